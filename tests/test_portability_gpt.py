"""The notebooks that train the GPT run to the end, no error output, on another machine's path.

A module of its own for pytest-xdist's balance (tests/portability.py says why, and what the passes are).
"""

import pytest
from portability import GPT, cases, run


@pytest.mark.portability
@pytest.mark.timeout(1800)  # ATEN_CPU_CAPABILITY=default (no vector kernels) is the slowest pass
@pytest.mark.parametrize(("path", "setting"), cases(GPT))
def test_runs_to_the_end(path, setting):
    run(path, setting)
