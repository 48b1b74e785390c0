"""Release and grade nbgrader-format notebooks with nbformat and nbclient (nbgrader not needed).

The format is nbgrader's (``metadata.nbgrader`` with ``schema_version: 3``; solution regions
between ``### BEGIN SOLUTION`` / ``### END SOLUTION``, hidden tests between
``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS``), so instructors may use nbgrader itself.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import nbformat
from nbformat import NotebookNode

__all__ = ["Part", "Report", "grade", "release", "validate"]

CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
TEXT_STUB = "YOUR ANSWER HERE"
TIMEOUT = "CellTimeout"  # the ename our timeout reply carries


def _meta(cell: NotebookNode) -> dict[str, Any]:
    return cell.get("metadata", {}).get("nbgrader", {})


def _grade_id(cell: NotebookNode) -> str | None:
    meta = _meta(cell)
    return meta.get("grade_id") if meta.get("grade") or meta.get("solution") or meta.get("locked") else None


def _is_test(cell: NotebookNode) -> bool:
    """An autograder test cell: graded code that is not the student's to write."""
    meta = _meta(cell)
    return bool(meta.get("grade")) and not meta.get("solution") and cell.cell_type == "code"


def _is_manual(cell: NotebookNode) -> bool:
    meta = _meta(cell)
    return bool(meta.get("grade")) and bool(meta.get("solution"))


def _strip_region(source: str, begin: str, end: str, stub: str | None) -> tuple[str, bool]:
    """Replace each ``begin``..``end`` region with ``stub`` (indented like the marker), or drop it.

    Line by line, as nbgrader's ClearSolutions and ClearHiddenTests do, so the sources match.
    """
    out, inside, found = [], False, False
    for line in source.split("\n"):
        if begin in line:
            if inside:
                raise ValueError(f"nested {begin!r} markers; close each region with {end!r} first.")
            inside = found = True
            if stub is not None:
                indent = re.match(r"\s*", line).group(0)
                out.extend(indent + s for s in stub.split("\n"))
        elif end in line:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"a {begin!r} marker has no matching {end!r}.")
    return "\n".join(out), found


def validate(nb: NotebookNode) -> None:
    """Raise ``ValueError`` unless ``nb`` is a well-formed nbgrader source notebook.

    >>> cell = nbformat.v4.new_code_cell("1", metadata={"nbgrader": {"grade": True, "schema_version": 3}})
    >>> validate(nbformat.v4.new_notebook(cells=[cell]))
    Traceback (most recent call last):
    ...
    ValueError: cell 0 has nbgrader flags but no grade_id; give every graded, solution or locked cell a unique grade_id.
    """
    seen: set[str] = set()
    for i, cell in enumerate(nb.cells):
        meta = _meta(cell)
        flagged = meta.get("grade") or meta.get("solution") or meta.get("locked")
        if flagged:
            gid = meta.get("grade_id")
            if not gid:
                raise ValueError(f"cell {i} has nbgrader flags but no grade_id; give every graded, solution or "
                                 "locked cell a unique grade_id.")
            if gid in seen:
                raise ValueError(f"grade_id {gid!r} is used by two cells (the second is cell {i}); make it unique.")
            seen.add(gid)
            if meta.get("schema_version", 3) != 3:
                raise ValueError(f"cell {gid!r} has nbgrader schema_version {meta['schema_version']}; write 3.")
        if meta.get("grade") and not isinstance(meta.get("points"), (int, float)):
            raise ValueError(f"graded cell {meta.get('grade_id')!r} needs a number of points (metadata.nbgrader.points).")
        for begin, end, allowed, kind in (("BEGIN SOLUTION", "END SOLUTION", meta.get("solution"), "a solution"),
                                          ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS", _is_test(cell), "an autograder test")):
            _, found = _strip_region(cell.source, begin, end, None)
            if found and not allowed:
                raise ValueError(f"cell {i} holds a {begin!r} region but is not {kind} cell; mark it in "
                                 "metadata.nbgrader or move the region.")


def release(nb: NotebookNode) -> NotebookNode:
    """Return the student version: solutions stubbed, hidden tests removed, outputs cleared.

    >>> cell = nbformat.v4.new_code_cell("def f():\\n    ### BEGIN SOLUTION\\n    return 1\\n    ### END SOLUTION",
    ...     metadata={"nbgrader": {"solution": True, "grade": False, "locked": False, "grade_id": "f",
    ...                            "schema_version": 3}})
    >>> print(release(nbformat.v4.new_notebook(cells=[cell])).cells[0].source)
    def f():
        # YOUR CODE HERE
        raise NotImplementedError()
    """
    validate(nb)
    student = copy.deepcopy(nb)
    for cell in student.cells:
        meta = _meta(cell)
        stub = CODE_STUB if cell.cell_type == "code" else TEXT_STUB
        cell.source, replaced = _strip_region(cell.source, "BEGIN SOLUTION", "END SOLUTION", stub)
        if meta.get("solution") and not replaced:
            cell.source = stub
        cell.source, _ = _strip_region(cell.source, "BEGIN HIDDEN TESTS", "END HIDDEN TESTS", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        # JupyterLab honours these, as for nbgrader's LockCells; grading restores the cells anyway
        if meta.get("locked") or _is_test(cell):
            cell.metadata.update(editable=False, deletable=False)
        elif meta.get("solution"):
            cell.metadata["deletable"] = False
    return student


@dataclass
class Part:
    """One graded cell's result; ``manual`` parts are left for a person to grade."""

    grade_id: str
    points: float
    max_points: float
    message: str
    manual: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"grade_id": self.grade_id, "points": self.points, "max_points": self.max_points,
                "message": self.message}


@dataclass
class Report:
    """The grading of one submission: every graded part, in the source's order."""

    parts: list[Part]

    def score(self) -> float:
        return sum(p.points for p in self.parts if not p.manual)

    def max_score(self, include_manual: bool = False) -> float:
        return sum(p.max_points for p in self.parts if include_manual or not p.manual)

    def to_dict(self, include_manual: bool = False) -> dict[str, Any]:
        """Return ``{"score", "max_score", "parts": [{"grade_id", "points", "max_points", "message"}]}``."""
        parts = [p for p in self.parts if include_manual or not p.manual]
        return {"score": self.score(), "max_score": self.max_score(include_manual),
                "parts": [p.to_dict() for p in parts]}

    def format(self, include_manual: bool = False) -> str:
        """Return the per-part report a person reads: points, then the first failure message."""
        width = max([len(p.grade_id) for p in self.parts] + [4])
        lines = []
        for p in self.parts:
            if p.manual and not include_manual:
                lines.append(f"{p.grade_id:<{width}}  {'-':>3} / {p.max_points:<3g} {p.message} (not counted)")
            else:
                lines.append(f"{p.grade_id:<{width}}  {p.points:>3g} / {p.max_points:<3g} {p.message or 'ok'}")
        lines.append(f"{'score':<{width}}  {self.score():>3g} / {self.max_score(include_manual):g}")
        return "\n".join(lines)


def _assemble(source: NotebookNode, submission: NotebookNode) -> NotebookNode:
    """Return the notebook to run: the source's cells by grade_id, the student's own cells where they were.

    Locked and test cells come from the instructor (hidden tests included), so an edited or
    deleted test cannot be gamed; answers come from the submission, or the stub if deleted.
    Cells the student added run just before the source cell they preceded.
    """
    stubs = {_grade_id(c): c for c in release(source).cells if _grade_id(c)}
    anchors = {gid for gid in stubs}
    answers: dict[str, NotebookNode] = {}
    before: dict[str, list[NotebookNode]] = {}
    pending: list[NotebookNode] = []
    for cell in submission.cells:
        gid = _grade_id(cell)
        if gid in anchors and gid not in answers:
            answers[gid] = cell
            before[gid], pending = pending, []
        elif gid not in anchors:  # the student's own cell: it runs, but claims no grade_id
            own = copy.deepcopy(cell)
            own.metadata.pop("nbgrader", None)
            pending.append(own)
    cells = []
    for cell in source.cells:
        gid = _grade_id(cell)
        if gid is None:
            continue  # unflagged source cells are the student's to keep, edit or delete
        cells.extend(before.get(gid, []))
        meta = _meta(cell)
        if meta.get("solution") and not meta.get("locked"):
            answer = answers.get(gid, stubs[gid])
            cells.append(copy.deepcopy(answer if answer.cell_type == cell.cell_type else stubs[gid]))
        else:
            cells.append(copy.deepcopy(cell))
    cells.extend(pending)
    for cell in cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    run = copy.deepcopy(source)
    run.cells = cells
    return run


def _kernel_manager_class() -> type:
    """Return a KernelManager that starts ipykernel in this interpreter, whatever kernelspecs are installed.

    A ``python3`` kernelspec in ~/.local/share/jupyter would otherwise win and could run
    another Python, without torch or labkit.
    """
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    class ThisPython(AsyncKernelManager):
        @property
        def kernel_spec(self) -> KernelSpec:
            return KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())

    return ThisPython


def execute(nb: NotebookNode, timeout: float, cwd: str) -> dict[int, dict[str, Any]]:
    """Run ``nb`` in a fresh kernel; return each code cell's execute reply by index.

    A cell that runs past ``timeout`` seconds is interrupted and replies ``CellTimeout``;
    the later cells still run. After a kernel death the remaining cells have no reply.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    replies: dict[int, dict[str, Any]] = {}

    def record(cell: NotebookNode, cell_index: int, execute_reply: dict[str, Any]) -> None:
        replies[cell_index] = execute_reply["content"]

    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", kernel_manager_class=_kernel_manager_class(),
        allow_errors=True, interrupt_on_timeout=True,
        error_on_timeout={"ename": TIMEOUT, "evalue": f"the cell ran longer than {timeout:g} s (an infinite loop?) "
                          "and was interrupted", "traceback": []},
        skip_cells_with_tag="", on_cell_executed=record, resources={"metadata": {"path": cwd}},
    )
    try:
        client.execute()
    except DeadKernelError:
        pass  # the cells after the crash have no reply, and are reported as not run
    return replies


def _error(reply: dict[str, Any] | None) -> str | None:
    """Return ``"Name: value"`` for a failed reply, ``"did not run"`` for none, None on success."""
    if reply is None:
        return "did not run: the kernel died before this cell (did the submission exit or crash Python?)"
    if reply.get("status") == "ok":
        return None
    return f"{reply.get('ename', 'Error')}: {reply.get('evalue', '')}".strip()


def grade(source: NotebookNode, submission: NotebookNode | None, *, timeout: float = 60.0, cwd: str = ".",
          reason: str = "") -> Report:
    """Grade ``submission`` against the instructor's ``source``; ``None`` grades an unreadable one as 0.

    Each autograder test cell earns its points when it runs without error; written answers
    are reported for a person to grade.
    """
    validate(source)
    graded = [c for c in source.cells if _meta(c).get("grade")]
    if submission is None:
        return Report([Part(_grade_id(c), 0, _meta(c)["points"], reason, _is_manual(c)) for c in graded])
    run = _assemble(source, submission)
    replies = execute(run, timeout, cwd)
    position = {_grade_id(c): i for i, c in enumerate(run.cells) if _grade_id(c)}
    parts = []
    for cell in graded:
        gid, meta = _grade_id(cell), _meta(cell)
        i = position[gid]
        if _is_manual(cell):
            answer = run.cells[i].source.strip()
            message = "not answered" if answer in ("", TEXT_STUB) else "graded by hand"
            parts.append(Part(gid, 0, meta["points"], message, manual=True))
            continue
        error = _error(replies.get(i))
        if error is not None:
            answer = next((j for j in range(i - 1, -1, -1) if _meta(run.cells[j]).get("solution")), None)
            cause = _error(replies.get(answer)) if answer is not None and run.cells[answer].cell_type == "code" else None
            if cause is not None and not cause.startswith("NotImplementedError"):
                error += f" (your answer cell {_grade_id(run.cells[answer])!r} raised {cause})"
        parts.append(Part(gid, meta["points"] if error is None else 0, meta["points"], error or ""))
    return Report(parts)
