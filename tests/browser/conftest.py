"""Fixtures of the browser tests: Debian's Chromium through pytest-playwright, and one JupyterLab server.

Chromium is the system's (``apt-get install chromium``), never Playwright's download, which
these machines cannot fetch. Without it the tests skip, saying so, except under ``CI=true``,
where they fail: CI installs it, so a missing browser there is a broken CI, not a reason to skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lab_driver import CHROMIUM, CHROMIUM_ARGS, NOTEBOOKS, RELEASE, LabServer, Notebook

# Run All's wait, in seconds, where a notebook's first Run All trains more than the default allows. The
# lab runs with a fresh HOME, so 08's disk cache (labkit.lab.update_spikes) starts empty: twelve 1000-step
# runs, about 140 s of CPU on the Xeon, several minutes on a loaded 2-core machine.
RUN_ALL_TIMEOUT = {"08_optimizer_spikes.ipynb": 900.0}

HERE = Path(__file__).parent
# student_view.py, loaded into a notebook's kernel before Run All (as a module of its own, without
# touching the notebook's sys.path): it checks each figure as it is displayed and remembers each
# control with the value its cell gave it.
INSTALL_VIEW = ("import types as _types\n_labkit_view = _types.ModuleType('_labkit_view')\n"
                f"exec(compile({(HERE / 'student_view.py').read_text()!r}, 'student_view.py', 'exec'), "
                "_labkit_view.__dict__)\n_labkit_view.install()\ndel _types")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Run the browser tests last.

    Chromium, Playwright's driver and its event loop (which the sync API marks as running in
    this thread between calls) live until the session ends: the rest of the suite should
    not run beside them.
    """
    ours = [item for item in items if HERE in Path(item.path).parents]
    mine = set(ours)
    items[:] = [item for item in items if item not in mine] + ours


@pytest.fixture(scope="session")
def chromium() -> Path:
    """The Chromium binary, or a skip (a failure under ``CI=true``) that says how to get it."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        message = (f"Chromium not found at {CHROMIUM}: install it with `apt-get install chromium` (or set "
                   "LABKIT_CHROMIUM to its path); run the rest with `pytest -m 'not browser'`")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {message}; .ci/run installs it", pytrace=False)
        pytest.skip(message)
    return CHROMIUM


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args, chromium):  # type: ignore[no-untyped-def]
    """pytest-playwright's launch options, pointed at the system Chromium."""
    return {**browser_type_launch_args, "executable_path": str(chromium), "headless": True,
            "args": CHROMIUM_ARGS}


@pytest.fixture(scope="session")
def lab(tmp_path_factory, chromium):  # type: ignore[no-untyped-def]
    """A JupyterLab server over a copy of ``notebooks/`` plus the exercises' student releases."""
    scratch = tmp_path_factory.mktemp("jupyterlab")
    root = scratch / "notebooks"
    shutil.copytree(NOTEBOOKS, root)
    for source in sorted((NOTEBOOKS / "exercises").glob("*.ipynb")):
        subprocess.run([sys.executable, "-m", "labkit.grading", "release", str(source), "-o",
                        str(root / RELEASE)], check=True, capture_output=True, timeout=60)
    server = LabServer(root, scratch).start()
    try:
        yield server
    finally:
        killed = server.stop()
        if killed:  # they are dead now; say that the clean shutdown did not do it
            print(f"jupyter lab left processes {killed} after /api/shutdown; killed them")


@pytest.fixture(scope="session")
def notebooks(lab, browser):  # type: ignore[no-untyped-def]
    """Open a notebook once per session, with all its cells run: ``notebooks("01_gradient_clipping.ipynb")``.

    The tests of one notebook share its page and kernel, as a student's session does; each
    test reads the state it starts from instead of assuming one. What a student would find
    wrong right after Run All (``student_view.report()``) is read once, before any test moves a
    slider: ``notebooks.report(path)``.
    """
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(60_000)
    page = context.new_page()  # one lab, the notebooks in its tabs
    opened: dict[str, tuple[Notebook, float, dict | None]] = {}
    # a notebook whose Run All stopped on an error: each of its tests fails at once
    stopped: dict[str, str] = {}

    def get(path: str, run: bool = True) -> Notebook:
        if path in stopped:
            pytest.fail(f"{stopped[path]}\n(as the first test of this notebook reported)", pytrace=False)
        if path not in opened:
            nb = Notebook.open(page, lab, path)
            seconds, report = 0.0, None
            if run:
                nb.kernel(INSTALL_VIEW)
                try:
                    seconds = nb.run_all(RUN_ALL_TIMEOUT.get(path, 150.0))
                except AssertionError as e:
                    stopped[path] = str(e)
                    raise
                report = nb.value("_labkit_view.report()")
            opened[path] = nb, seconds, report
        nb = opened[path][0]
        nb.activate()
        return nb

    get.seconds = lambda path: opened[path][1]  # type: ignore[attr-defined]
    get.report = lambda path: opened[path][2]  # type: ignore[attr-defined]
    try:
        yield get
    finally:
        context.close()  # the kernels stop with the server (lab's teardown), all at once
