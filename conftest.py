"""One intra-op thread per test process: the suite runs in two pytest-xdist workers (pyproject's
addopts), and two workers each running torch on both cores oversubscribe a 2-core machine so badly
that a 120-step toy run took 11 s instead of 0.7 s (AMD EPYC, 2 cores). Set before torch is imported,
so notebook kernels started by nbval and the browser tests inherit it. LABKIT_TEST_THREADS overrides.
"""

import importlib.util
import os

os.environ["OMP_NUM_THREADS"] = os.environ.get("LABKIT_TEST_THREADS", "1")
# A lesson's hidden check (labkit.lab.expect) prints one line in a student's kernel and goes on; in the
# test suite (nbval, the browser tests, the portability pass: kernels inherit this) it raises.
os.environ.setdefault("LABKIT_STRICT", "1")

# The old names of labkit.formats.bf16 and .fp8, kept one release: each file replaces itself in
# sys.modules with the new module (so monkeypatching and pickles see one module), which pytest's
# doctest collection reads as an import mismatch. Their doctests run under the new names.
collect_ignore = ["labkit/precision.py", "labkit/fp8.py"]
# The docs build's griffe extension imports griffe (requirements-docs.txt, which the test command
# installs); without it tests/test_docs.py and the site's browser test skip, saying so.
if importlib.util.find_spec("griffe") is None:
    collect_ignore.append("labkit/lab/docfences.py")
