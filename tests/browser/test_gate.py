"""Without Chromium the browser tests skip and say how to get it; under CI=true they fail instead."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def run_browser_test(**env):  # type: ignore[no-untyped-def]
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/browser/test_lab.py",
         "-k", "runs_in_jupyterlab and 00_quickstart"],
        cwd=ROOT, env={**environ, "LABKIT_CHROMIUM": "/nonexistent/chromium", **env},
        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", [False, True])
def test_without_chromium_the_browser_tests_skip_with_the_fix_or_fail_under_ci(ci):
    proc = run_browser_test(**({"CI": "true"} if ci else {}))
    out = proc.stdout + proc.stderr
    assert "Chromium not found at /nonexistent/chromium: install it with `apt-get install chromium`" in out, out
    if ci:
        assert proc.returncode == 1 and "1 error" in out and "CI=true but Chromium not found" in out, out
    else:
        assert proc.returncode == 0 and "1 skipped" in out and "pytest -m 'not browser'" in out, out
