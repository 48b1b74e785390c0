"""Run a notebook end to end in a fresh kernel under another machine's path, and name its first error.

tests/test_portability.py and test_portability_gpt.py (marker ``portability``) run every lesson and
every problem set's source (the instructor's version, solutions in) through this, once per pass: a pass
is one setting added to the kernel's environment (the rest is inherited, LABKIT_STRICT=1 and
OMP_NUM_THREADS from conftest.py included, so a failed hidden check is an error output).
``LABKIT_PERTURB=<seed>`` takes another trajectory (labkit/tasks/perturb.py);
``ATEN_CPU_CAPABILITY=default`` or ``=avx2`` other kernels. Stored outputs are not compared here:
nbval does that, unperturbed.

``LABKIT_PORTABILITY`` picks the passes: unset, ``LABKIT_PERTURB=1`` alone (what CI runs); ``all``,
the three the lead runs before a merge (``LABKIT_PERTURB=1``, ``=2`` and ``ATEN_CPU_CAPABILITY=default``);
anything else, a comma-separated list of settings, e.g. ``ATEN_CPU_CAPABILITY=avx2,LABKIT_PERTURB=3``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from jupyter_client import AsyncKernelManager
from jupyter_client.utils import run_sync
from nbclient import NotebookClient
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
EVERY_NOTEBOOK = sorted(NOTEBOOKS.glob("0*.ipynb")) + sorted((NOTEBOOKS / "exercises").glob("*.ipynb"))
# The notebooks that train the GPT cost about half of a pass (07 alone about 40%; 08 trains twelve
# 1000-step runs, kept on disk per setting by labkit.lab.update_spikes, so each pass trains its own): they
# get a module of their own, so that pytest-xdist's --dist loadfile (one module per worker) splits a
# pass in two.
GPT = [NOTEBOOKS / "04_pretraining_gpt.ipynb", NOTEBOOKS / "07_small_scale_instabilities.ipynb",
       NOTEBOOKS / "08_optimizer_spikes.ipynb",
       NOTEBOOKS / "exercises" / "ps2_instabilities_and_spikes.ipynb"]
PASSES_ENV = "LABKIT_PORTABILITY"
CI_PASSES = ["LABKIT_PERTURB=1"]
ALL_PASSES = ["LABKIT_PERTURB=1", "LABKIT_PERTURB=2", "ATEN_CPU_CAPABILITY=default"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def passes() -> list[str]:
    """Return the settings ``LABKIT_PORTABILITY`` asks for, one pass each; raise on a malformed one."""
    value = os.environ.get(PASSES_ENV, "").strip()
    if not value:
        return CI_PASSES
    if value == "all":
        return ALL_PASSES
    settings = [s.strip() for s in value.split(",") if s.strip()]
    for setting in settings:
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", setting):
            raise ValueError(f"{PASSES_ENV}={value!r}: each pass is NAME=value (e.g. {PASSES_ENV}="
                             f"LABKIT_PERTURB=3,ATEN_CPU_CAPABILITY=avx2), or 'all'; got {setting!r}")
    return settings


def cases(paths: list[Path]) -> list:
    """One ``pytest.param`` per notebook and pass, with the id ``<notebook>-<setting>``."""
    return [pytest.param(path, setting, id=f"{path.stem}-{setting}")
            for path in paths for setting in passes()]


def errors(nb: nbformat.NotebookNode) -> list[str]:
    """Return each error output as ``cell <index>: <ename>: <first lines of evalue>``, in cell order.

    A cell tagged ``raises-exception`` (nbval's and nbclient's tag for a cell that must raise) is
    left out.
    """
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "raises-exception" in cell.metadata.get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                evalue = "\n    ".join(ANSI.sub("", out.evalue).splitlines()[:4])
                found.append(f"cell {index}: {out.ename}: {evalue or raising_line(out.traceback)}")
    return found


def raising_line(traceback: list[str]) -> str:
    """Return the line that raised (IPython's ``---->`` of the last frame): what a bare assert says."""
    lines = [line for line in ANSI.sub("", "\n".join(traceback)).splitlines() if line.startswith("---->")]
    return lines[-1] if lines else ""


def run(path: Path, setting: str) -> None:
    """Execute ``path`` in a fresh kernel with ``setting`` in its environment; fail naming each error.

    The kernel is this interpreter (as nbval's ``--nbval-current-env``) and starts in the
    notebook's folder. Every cell runs, even after an error, so the failure lists all of them;
    the first is the one to read (a later one may only follow from it).
    """
    name, _, value = setting.partition("=")
    nb = nbformat.read(path, as_version=4)
    km = AsyncKernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager())
    client = NotebookClient(nb, km=km, timeout=None, allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(env={**os.environ, name: value})
    finally:
        if km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)
    found = errors(nb)
    if found:
        where = path.relative_to(NOTEBOOKS.parent)
        later = "".join(f"\n  then {e}" for e in found[1:])
        pytest.fail(f"{where} under {setting}: {found[0]}{later}", pytrace=False)
