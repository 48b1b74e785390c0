"""Every lesson and problem-set source runs to the end, no error output, on another machine's path.

The GPT notebooks are in test_portability_gpt.py (see tests/portability.py for why, and for the passes).
"""

import pytest
from portability import EVERY_NOTEBOOK, GPT, cases, run


@pytest.mark.portability
@pytest.mark.timeout(1800)  # ATEN_CPU_CAPABILITY=default (no vector kernels) is the slowest pass
@pytest.mark.parametrize(("path", "setting"), cases([p for p in EVERY_NOTEBOOK if p not in GPT]))
def test_runs_to_the_end(path, setting):
    run(path, setting)
