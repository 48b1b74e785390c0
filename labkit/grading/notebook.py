"""Release and grade nbgrader-format notebooks (nbgrader not needed); grading runs no student code here.

The format is nbgrader's (``metadata.nbgrader`` with ``schema_version: 3``; solution regions
between ``### BEGIN SOLUTION`` / ``### END SOLUTION``, hidden tests between
``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS``), so instructors may use nbgrader itself.
Notebooks are plain JSON dicts here (nbformat's validator costs seconds to import): an
``nbformat.NotebookNode`` works too.

Grading: the submission's code cells run top to bottom in a sandbox (``sandbox.py``,
``harness.py``), test cells never; each test cell's ``check_*(fn, hidden=...)`` calls say
which of the student's functions the harness calls on which cases; the verdict is reached
here, from the data it shipped, against labkit's reference.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import CHECK_NAMES

__all__ = ["Part", "Report", "grade", "grade_id_of", "is_manual_cell", "is_test_cell", "nbgrader_meta",
           "plan", "read", "release", "sweep", "validate"]

# judging builds reference models under torch's global RNG (seeded, then restored): one thread at a time,
# or two graded at once (--jobs) would draw each other's weights
_JUDGING = threading.Lock()
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
TEXT_STUB = "YOUR ANSWER HERE"
Cell = dict[str, Any]


def read(path: str | Path) -> dict[str, Any]:
    """Return the notebook at ``path`` as a dict with each cell's source as one string.

    Raises ``ValueError`` (with what is wrong) for a file that is not a v4 notebook.
    """
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list) or nb.get("nbformat") != 4:
        raise ValueError("not a version 4 notebook (no 'cells' list, or nbformat != 4)")
    for cell in nb["cells"]:
        if not isinstance(cell, dict) or not isinstance(cell.get("source", ""), (str, list)):
            raise ValueError("a cell is not a JSON object with a source")
        cell["source"] = _text(cell.get("source", ""))
        cell.setdefault("metadata", {})
        cell.setdefault("cell_type", "code")
    return nb


def _text(source: str | list[str]) -> str:
    return "".join(source) if isinstance(source, list) else source


def nbgrader_meta(cell: Cell) -> dict[str, Any]:
    """Return a cell's nbgrader metadata (empty when it has none, or none that is a dict)."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def grade_id_of(cell: Cell) -> str | None:
    """Return a graded, answer or locked cell's grade_id; None for any other cell."""
    meta = nbgrader_meta(cell)
    return meta.get("grade_id") if meta.get("grade") or meta.get("solution") or meta.get("locked") else None


def is_test_cell(cell: Cell) -> bool:
    """Return whether ``cell`` is an autograder test cell: graded code that is not the student's to write."""
    meta = nbgrader_meta(cell)
    return bool(meta.get("grade")) and not meta.get("solution") and cell["cell_type"] == "code"


def is_manual_cell(cell: Cell) -> bool:
    """Return whether ``cell`` is a hand-graded answer: graded, and the student's to write."""
    meta = nbgrader_meta(cell)
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


def validate(nb: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``nb`` is a well-formed nbgrader source notebook.

    >>> cell = {"cell_type": "code", "source": "1",
    ...         "metadata": {"nbgrader": {"grade": True, "schema_version": 3}}}
    >>> validate({"cells": [cell]})  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: cell 0 has nbgrader flags but no grade_id; give every graded, solution or locked cell a
    unique grade_id.
    """
    seen: set[str] = set()
    for i, cell in enumerate(nb["cells"]):
        meta = nbgrader_meta(cell)
        flagged = meta.get("grade") or meta.get("solution") or meta.get("locked")
        if flagged:
            gid = meta.get("grade_id")
            if not gid:
                raise ValueError(f"cell {i} has nbgrader flags but no grade_id; give every graded, solution "
                                 "or locked cell a unique grade_id.")
            if gid in seen:
                raise ValueError(
                    f"grade_id {gid!r} is used by two cells (the second is cell {i}); make it unique."
                )
            seen.add(gid)
            if meta.get("schema_version", 3) != 3:
                raise ValueError(
                    f"cell {gid!r} has nbgrader schema_version {meta['schema_version']}; write 3."
                )
        if meta.get("grade") and not isinstance(meta.get("points"), (int, float)):
            raise ValueError(
                f"graded cell {meta.get('grade_id')!r} needs a number of points (metadata.nbgrader.points)."
            )
        for begin, end, allowed, kind in (
                ("BEGIN SOLUTION", "END SOLUTION", meta.get("solution"), "a solution"),
                ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS", is_test_cell(cell), "an autograder test")):
            _, found = _strip_region(cell["source"], begin, end, None)
            if found and not allowed:
                raise ValueError(f"cell {i} holds a {begin!r} region but is not {kind} cell; mark it in "
                                 "metadata.nbgrader or move the region.")


def release(nb: dict[str, Any]) -> dict[str, Any]:
    """Return the student version: solutions stubbed, hidden tests removed, outputs cleared.

    >>> cell = {"cell_type": "code",
    ...         "source": "def f():\\n    ### BEGIN SOLUTION\\n    return 1\\n    ### END SOLUTION",
    ...         "metadata": {"nbgrader": {"solution": True, "grade": False, "locked": False, "grade_id": "f",
    ...                                   "schema_version": 3}}}
    >>> print(release({"cells": [cell]})["cells"][0]["source"])
    def f():
        # YOUR CODE HERE
        raise NotImplementedError()
    """
    validate(nb)
    student = copy.deepcopy(nb)
    for cell in student["cells"]:
        meta = nbgrader_meta(cell)
        stub = CODE_STUB if cell["cell_type"] == "code" else TEXT_STUB
        cell["source"], replaced = _strip_region(cell["source"], "BEGIN SOLUTION", "END SOLUTION", stub)
        if meta.get("solution") and not replaced:
            cell["source"] = stub
        cell["source"], _ = _strip_region(cell["source"], "BEGIN HIDDEN TESTS", "END HIDDEN TESTS", None)
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        # JupyterLab honours these, as for nbgrader's LockCells; grading restores the cells anyway
        if meta.get("locked") or is_test_cell(cell):
            cell["metadata"].update(editable=False, deletable=False)
        elif meta.get("solution"):
            cell["metadata"]["deletable"] = False
    return student




# ---------------------------------------------------------------- what each part checks


@dataclass(frozen=True)
class Call:
    """One ``check_*(fn, hidden=...)`` call of a test cell."""

    check: str
    fn: str
    hidden: bool


@dataclass(frozen=True)
class Planned:
    """A graded cell: its points, and the calls the grader makes for it (none for a written answer)."""

    grade_id: str
    points: float
    manual: bool
    calls: tuple[Call, ...]




def _calls(cell: Cell) -> tuple[Call, ...]:
    """Return the check calls of a test cell; raise ValueError if it holds code the harness cannot replay.

    Only imports, ``print(...)`` and ``check_*(name)`` / ``check_*(name, hidden=True)`` are
    allowed: the grader makes these calls itself, outside the student's process.
    """
    gid = grade_id_of(cell)
    calls = []
    for node in ast.parse(cell["source"]).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
            if name == "print":
                continue
            hidden = [k for k in call.keywords if k.arg == "hidden"]
            if (name in CHECK_NAMES and len(call.args) == 1 and isinstance(call.args[0], ast.Name)
                    and {k.arg for k in call.keywords} <= {"hidden"}
                    and all(isinstance(k.value, ast.Constant) and isinstance(k.value.value, bool)
                            for k in hidden)):
                calls.append(Call(name, call.args[0].id, bool(hidden and hidden[0].value.value)))
                continue
        raise ValueError(f"test cell {gid!r}, line {node.lineno}: the grader replays only labkit.grading's "
                         "check_*(function_name, hidden=True|False) calls (plus imports and print), outside "
                         "the student's process; write other tests as a check in labkit.grading.")
    if not calls:
        raise ValueError(
            f"test cell {gid!r} calls no labkit.grading check_*: it would give its points to anyone."
        )
    return tuple(calls)


def _only_checks(source: str) -> bool:
    try:
        return bool(_calls({"source": source, "metadata": {}}))
    except (ValueError, SyntaxError):
        return False


def plan(source: dict[str, Any]) -> list[Planned]:
    """Return the graded cells of a valid ``source`` in order, each with the calls the grader makes."""
    validate(source)
    out = []
    for cell in source["cells"]:
        meta = nbgrader_meta(cell)
        if meta.get("grade"):
            manual = is_manual_cell(cell)
            out.append(
                Planned(grade_id_of(cell), float(meta["points"]), manual, () if manual else _calls(cell))
            )
    return out


# ---------------------------------------------------------------- the report


@dataclass
class Part:
    """One graded cell's result; ``manual`` parts are left for a person to grade.

    ``seed`` is the seed of its hidden cases (None without any); ``status`` is "ok",
    "failed", "not graded" (the run stopped before it) or "tampering" (not scored).
    """

    grade_id: str
    points: float
    max_points: float
    message: str
    manual: bool = False
    seed: int | None = None
    status: str = "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"grade_id": self.grade_id, "points": self.points, "max_points": self.max_points,
                "message": self.message, "status": self.status, "seed": self.seed}


@dataclass
class Report:
    """The grading of one submission: every graded part, in the source's order, and how it was run."""

    parts: list[Part]
    seed: int = 0
    tampering: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sandbox: str = "bwrap"
    output: str = ""

    def score(self) -> float:
        return sum(p.points for p in self.parts if not p.manual)

    def max_score(self, include_manual: bool = False) -> float:
        return sum(p.max_points for p in self.parts if include_manual or not p.manual)

    def to_dict(self, include_manual: bool = False) -> dict[str, Any]:
        """Return ``{"score", "max_score", "parts": [...], "seed", "tampering", "warnings", "sandbox"}``."""
        parts = [p for p in self.parts if include_manual or not p.manual]
        return {"score": self.score(), "max_score": self.max_score(include_manual),
                "parts": [p.to_dict() for p in parts], "seed": self.seed, "tampering": self.tampering,
                "warnings": self.warnings, "sandbox": self.sandbox}

    def format(self, include_manual: bool = False) -> str:
        """Return the per-part report a person reads: points, then the first failure message."""
        width = max([len(p.grade_id) for p in self.parts] + [4])
        lines = [f"TAMPERING (not scored): {t}" for t in self.tampering]
        lines += [f"warning: {w}" for w in self.warnings]
        for p in self.parts:
            if p.manual and not include_manual:
                lines.append(
                    f"{p.grade_id:<{width}}  {'-':>3} / {p.max_points:<3g} {p.message} (not counted)"
                )
            else:
                lines.append(
                    f"{p.grade_id:<{width}}  {p.points:>3g} / {p.max_points:<3g} {p.message or 'ok'}"
                )
        lines.append(f"{'score':<{width}}  {self.score():>3g} / {self.max_score(include_manual):g}"
                     f"   (seed {self.seed}: --seed {self.seed} replays these hidden cases)")
        return "\n".join(lines)


# ---------------------------------------------------------------- grading


def default_seed(source: dict[str, Any], student: str) -> int:
    """Return the seed a student's hidden cases get (unless ``--seed`` is given): the same on every regrade.

    It hashes the instructor's source (which students never see) with the student's name.
    """
    text = json.dumps([c["source"] for c in source["cells"]]) + "\0" + student
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def part_seed(seed: int, grade_id: str) -> int:
    """Return the seed of one part's hidden cases, from the submission's seed."""
    return int(hashlib.sha256(f"{seed}:{grade_id}".encode()).hexdigest()[:8], 16)


def _defines(source: str) -> set[str]:
    """Return the names of the functions and classes ``source`` defines at its top level."""
    try:
        return {n.name for n in ast.parse(source).body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    except SyntaxError:
        return set()


def _cells(source: dict[str, Any], submission: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Return the code cells the harness runs, top to bottom as the student's notebook has them, and warnings.

    Test cells are left out (the grader makes their calls itself), also the student's cells that
    only import and call checks (a test cell whose metadata was lost); locked cells run as the
    instructor wrote them; answer cells and the student's own cells run as written, every copy,
    in order, so a function is graded as the notebook run top to bottom defines it.
    """
    locked = {grade_id_of(c): c for c in source["cells"]
              if nbgrader_meta(c).get("locked") and not nbgrader_meta(c).get("solution")
              and not is_test_cell(c) and c["cell_type"] == "code"}
    tests = {grade_id_of(c) for c in source["cells"] if is_test_cell(c)}
    answers = {grade_id_of(c) for c in source["cells"] if nbgrader_meta(c).get("solution")}
    cells, seen, copies, warnings = [], set(), {}, []
    for i, cell in enumerate(submission["cells"], 1):
        if cell.get("cell_type") != "code":
            continue
        gid, src = grade_id_of(cell), _text(cell.get("source", ""))
        if gid in tests or (gid is None and _only_checks(src)):
            continue  # a test cell, or a copy that lost its metadata: the grader makes these calls itself
        if gid in locked:
            if gid in seen:
                continue
            seen.add(gid)
            cells.append({"label": f"cell {i} '{gid}'", "source": locked[gid]["source"], "grade_id": gid})
        elif gid in answers:
            copies[gid] = copies.get(gid, 0) + 1
            cells.append({"label": f"cell {i} '{gid}'", "source": src, "grade_id": gid})
        else:
            cells.append({"label": f"cell {i}", "source": src, "grade_id": None})
    missing = [{"label": f"'{g}' (restored)", "source": c["source"], "grade_id": g} for g, c in locked.items()
               if g not in seen]
    for gid, n in copies.items():
        if n > 1:
            warnings.append(f"'{gid}' is in {n} cells (a copied cell keeps its grade_id): graded what the "
                            "notebook defines run top to bottom, i.e. the last copy wins; delete the stale "
                            "copy")
    if not any(grade_id_of(c) for c in submission["cells"]):
        warnings.append("the submission has no nbgrader metadata (saved by another tool?): graded the "
                        "functions its code defines, top to bottom")
    return missing + cells, warnings


WORK = "labkit-grade-"  # + "<pid>.<start time>-": each grader's work folders, one per submission being run


def _started(pid: int) -> str | None:
    """Return when process ``pid`` started (clock ticks after boot, /proc's field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def sweep(tmp: str | Path) -> list[Path]:
    """Remove the work folders that dead graders left in ``tmp``; return what was removed.

    A grader killed by SIGKILL or SIGTERM (a crash, a scheduler, ``kill``) never reaches its
    cleanup, and bwrap kills its sandboxes with it, so their folders (a few KB each) are garbage.
    A folder is named for its grader's PID and start time: it is stale once no process has that
    pair (a reused PID has another start time). Each grading sweeps before it starts.

    >>> import tempfile; tmp = Path(tempfile.mkdtemp())
    >>> (tmp / "labkit-grade-999999999.1-x").mkdir(); [p.name for p in sweep(tmp)]
    ['labkit-grade-999999999.1-x']
    """
    if _started(os.getpid()) is None:  # no /proc: whether a grader is alive cannot be told, keep everything
        return []
    removed = []
    for path in Path(tmp).glob(f"{WORK}*.*-*"):
        pid, _, started = path.name[len(WORK):].split("-", 1)[0].partition(".")
        if pid.isdigit() and _started(int(pid)) != started:
            shutil.rmtree(path, ignore_errors=True)  # another user's stays: /tmp is sticky
            removed.append(path)
    return removed


def _not_run(outcome: Any, status: str, wall: float) -> str:
    if outcome.timed_out:
        return (f"not graded: the submission was stopped at the hard limit of {wall:g} s while running "
                f"{status} (it ignored the interrupt, or ran too long)")
    return (
        f"not graded: the submission's process ended (exit code {outcome.returncode}) while running {status}"
    )


def grade(source: dict[str, Any], submission: dict[str, Any] | None, *, timeout: float = 60.0,
          wall: float | None = None, seed: int | None = None, student: str = "", sandbox: bool = True,
          reason: str = "") -> Report:
    """Grade ``submission`` against the instructor's ``source``; ``None`` grades an unreadable one as 0.

    ``timeout`` bounds each cell and each check's calls; ``wall`` (default: cells x timeout,
    at most 10 min) the whole submission, whatever it does with signals. ``seed`` replays a
    grading (default: ``default_seed``); ``sandbox=False`` runs without bubblewrap.
    """
    planned = plan(source)
    seed = default_seed(source, student) if seed is None else seed
    seeds = {
        p.grade_id: part_seed(seed, p.grade_id) if any(c.hidden for c in p.calls) else None for p in planned
    }

    def every(message: str, status: str) -> list[Part]:
        return [Part(p.grade_id, 0, p.points, "graded by hand" if p.manual else message, p.manual,
                     seeds[p.grade_id], "manual" if p.manual else status) for p in planned]

    if submission is None:
        return Report(every(reason, "failed"), seed, sandbox="bwrap" if sandbox else "none")
    cells, warnings = _cells(source, submission)
    tampering, skipped, withheld = _withhold(source, planned, cells)
    manual_text = {grade_id_of(c): c.get("source", "") for c in submission["cells"] if is_manual_cell(c)}
    if withheld is None:  # a flagged cell outside every answer: it could reach any part
        report = Report(every("not scored: the submission reaches into the grader from a cell outside every "
                              "answer (see tampering); a person must review it", "tampering"),
                        seed, tampering, warnings, "bwrap" if sandbox else "none")
    else:
        report = _run(source, planned, [c for c in cells if c["label"] not in skipped], seeds, timeout, wall,
                      sandbox, seed, warnings, withheld)
        report.tampering = tampering + report.tampering
    for part in report.parts:
        if part.manual:
            answer = _text(manual_text.get(part.grade_id, "")).strip()
            part.message = "not answered" if answer in ("", TEXT_STUB) else "graded by hand"
    return report


def _withhold(source: dict[str, Any], planned: list[Planned],
              cells: list[dict[str, Any]]) -> tuple[list[str], set[str], dict[str, str] | None]:
    """Return what in ``cells`` could reach the grader, the cells not to run, and the parts withheld for it.

    Each finding is ``"<cell label>, line N: ..."`` (``static.tampering``). A flagged cell never
    runs; the parts it answers (it defines their function, or it is their answer cell) are not
    scored, with a message naming the lines, and every other part is graded as usual (issue 32,
    point 23: one ``getattr`` in one answer cost a student every part). A flagged cell outside
    every answer could reach any part: then the parts are ``None``, and the whole submission is
    withheld. Locked cells run as the instructor wrote them and are not read.
    """
    from . import static

    locked = {grade_id_of(c) for c in source["cells"] if nbgrader_meta(c).get("locked")}
    # each answer cell's part: the first test cell after it in the source
    answered, pending = {}, []
    for c in source["cells"]:
        if nbgrader_meta(c).get("solution") and not is_manual_cell(c):
            pending.append(grade_id_of(c))
        elif is_test_cell(c):
            answered.update(dict.fromkeys(pending, grade_id_of(c)))
            pending = []
    tampering, skipped, withheld = [], set(), {}
    for cell in cells:
        if cell["grade_id"] in locked:
            continue
        found = static.tampering(static.python_source(cell["source"]))
        if not found:
            continue
        tampering += [f"{cell['label']}, {t}" for t in found]
        skipped.add(cell["label"])
        defined = _defines(cell["source"])
        parts = [p.grade_id for p in planned if not p.manual and defined & {k.fn for k in p.calls}]
        parts = parts or ([answered[cell["grade_id"]]] if cell["grade_id"] in answered else [])
        if not parts or withheld is None:
            withheld = None
            continue
        lines = "; ".join(static.explain(t) for t in found)
        for gid in parts:
            withheld[gid] = (f"not scored: {cell['label']} was not run, because it could reach into the "
                             f"grader ({lines}); a person will review it. Rewrite those lines: the part's "
                             "visible test names them too")
    return tampering, skipped, withheld


def _run(source: dict[str, Any], planned: list[Planned], cells: list[dict[str, Any]],
         seeds: dict[str, int | None], timeout: float, wall: float | None, sandbox: bool, seed: int,
         warnings: list[str], withheld: dict[str, str]) -> Report:
    """Run the cells and the parts' calls in the sandbox, then judge what came back, part by part.

    The parts in ``withheld`` (grade_id -> message) are not called: they are reported as tampering.
    """
    from . import checks, static
    from . import sandbox as box

    planned_all, planned = planned, [p for p in planned if p.grade_id not in withheld]
    calls = [c for p in planned for c in p.calls]
    wall = wall if wall is not None else min(600.0, timeout * (len(cells) + len(calls)) + 30)
    limits = box.Limits(wall=wall)
    sweep(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix=f"{WORK}{os.getpid()}.{_started(os.getpid())}-"))
    try:
        (work / "job").mkdir()
        (work / "out").mkdir()
        job = {"timeout": timeout, "cells": [{"label": c["label"], "source": c["source"]} for c in cells],
               "parts": [{"grade_id": p.grade_id, "calls": [
                   {"check": c.check, "fn": c.fn, "hidden": c.hidden,
                    "seed": seeds[p.grade_id] if c.hidden else 0}
                   for c in p.calls]} for p in planned if not p.manual]}
        (work / "job" / "job.json").write_text(json.dumps(job), encoding="utf-8")
        argv = (box.command(work / "job", work / "out", limits) if sandbox
                else box.unsandboxed(work / "job", work / "out", limits))
        outcome = box.run(argv, limits)
        status_file = work / "out" / "status"
        # the harness writes it before any student code: the sandbox itself failed
        if not status_file.exists():
            raise box.SandboxError(f"the sandbox did not start the harness (exit code {outcome.returncode}): "
                                   f"{outcome.output[-2000:]}")
        status = status_file.read_text(encoding="utf-8", errors="replace")[:300]
        import torch

        def load(name: str) -> Any:
            path = work / "out" / name
            if not path.exists():
                return None
            try:
                return torch.load(path, weights_only=True)
            except Exception as e:  # not what the harness writes: forged or cut short
                return {"unreadable": f"{type(e).__name__}: {e}"}

        try:
            ran = json.loads((work / "out" / "cells.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            ran = None
        except ValueError as e:
            ran = {"unreadable": f"cells.json: {e}"}
        results = {i: load(f"part-{i}.pt") for i in range(len(job["parts"]))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = Report([], seed, [], warnings, "bwrap" if sandbox else "none", outcome.output)
    stopped = _not_run(outcome, status, wall) if status != "done" else None
    cell_errors = {c["label"]: c["error"] for c in (ran or {}).get("cells", []) if isinstance(c, dict)} \
        if isinstance(ran, dict) else {}
    for value in [ran, *results.values()]:
        if isinstance(value, dict) and (value.get("tampered") or value.get("unreadable")):
            report.tampering.append(
                f"the harness's results: {value.get('tampered') or value.get('unreadable')}"
            )
    report.tampering = sorted(set(report.tampering))
    graded = iter(range(len(job["parts"])))
    for p in planned_all:
        if p.grade_id in withheld:
            report.parts.append(Part(p.grade_id, 0, p.points, withheld[p.grade_id], seed=seeds[p.grade_id],
                                     status="tampering"))
            continue
        if p.manual:
            report.parts.append(Part(p.grade_id, 0, p.points, "graded by hand", True, None, "manual"))
            continue
        result = results[next(graded)]
        if report.tampering:
            part = Part(p.grade_id, 0, p.points, "not scored: the submission tampered with the grader's "
                        "harness (see tampering); a person must review it", status="tampering")
        elif result is None:
            part = Part(p.grade_id, 0, p.points, stopped or "not graded: no result", status="not graded")
        else:
            try:
                with _JUDGING:
                    message = _judge_part(p, result, seeds[p.grade_id], cells, cell_errors, timeout)
            except Exception as e:  # malformed data: only a harness that was tampered with ships that
                report.tampering.append(f"the harness's results for {p.grade_id!r}: {type(e).__name__}: {e}")
                message = "not scored: the results shipped for this part are malformed (tampering?)"
            banned = [f"{c['label']}, {hit}" for c in cells if _defines(c["source"]) & {k.fn for k in p.calls}
                      for k in p.calls for hit in static.banned_calls(static.python_source(c["source"]),
                                                                      checks.BANNED[k.check])]
            if banned and message is None:
                message = f"uses what this part asks you to write yourself: {'; '.join(sorted(set(banned)))}"
            part = Part(p.grade_id, p.points if message is None else 0, p.points, message or "",
                        status="ok" if message is None else "failed")
        part.seed = seeds[p.grade_id]
        report.parts.append(part)
    return report


def _judge_part(p: Planned, result: dict[str, Any], seed: int | None, cells: list[dict[str, Any]],
                cell_errors: dict[str, str | None], timeout: float) -> str | None:
    """Return the first problem of one part's calls, from the data the harness shipped, or None."""
    from . import checks

    for call, shipped in zip(p.calls, result["results"], strict=True):
        hidden_seed = seed if call.hidden else 0
        if "missing" in shipped:
            defining = [c for c in cells if call.fn in _defines(c["source"])]
            errors = [f"{c['label']} raised {cell_errors[c['label']]}" for c in defining
                      if cell_errors.get(c["label"])]
            if shipped["missing"] is not None:
                return (
                    f"{call.fn} is a {shipped['missing']}, not a function: keep the name for your function."
                )
            return (f"{call.fn} is not defined" + (f" ({'; '.join(errors)})" if errors else
                    ": run its answer cell, and keep the function's name") + ".")
        problem = checks.judge(call.check, call.fn, call.hidden, hidden_seed, shipped["outs"])
        if problem is not None:
            return problem
        if "timeout" in shipped:
            return (f"{call.fn} ran longer than {timeout:g} s on case #{len(shipped['outs']) + 1} of "
                    f"{call.check}({'hidden, seed=' + str(hidden_seed) if call.hidden else 'visible'}) and "
                    "was interrupted: an infinite loop?")
        if "ended" in shipped:
            return f"{call.fn} ended the run ({shipped['ended']}) on case #{len(shipped['outs']) + 1}."
    return None
