"""Feedback for a graded class, in nbgrader's layout, so ``nbgrader release_feedback`` returns it.

From ``grade``'s gradebook (``OUT/gradebook.json`` and ``OUT/results/``) and nbgrader's
``submitted/<student>/<assignment>/``, write ``feedback/<student>/<assignment>/<notebook>.html``
and copy ``timestamp.txt`` and ``submission_secret.txt`` beside it: ``release_feedback`` names
the file it puts in the exchange by a hash of that secret, and each student's ``fetch_feedback``
finds it by the same hash. nbgrader's own ``generate_feedback`` needs its ``autograde``, which
runs the students' code outside any sandbox; this page is written from labkit's results.

The page shows the score, then every graded part (points, the grader's hint, hand-graded parts
marked as such), then the notebook as handed in: its code and text, never its saved outputs
(what the student's kernel printed is not what was graded). Everything the student wrote is
escaped. Points are the gradebook's: an unanswered written question is worth 0 and counts in
the total; an answered one not yet graded by hand (``--manual``) is shown as awaiting grading,
with its points out of the score until it is.
"""

from __future__ import annotations

import html
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .batch import Submission, file_sha256, find, write_atomically
from .notebook import grade_id_of, is_manual_cell, is_test_cell, nbgrader_meta, plan, read

__all__ = ["Feedback", "part_label", "render", "write_feedback"]

COPIED = ("timestamp.txt", "submission_secret.txt")  # what release_feedback reads beside the .html


@dataclass
class Feedback:
    """What ``write_feedback`` did: the pages it wrote, the students it could not write one for, and why."""

    written: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    awaiting: dict[str, list[str]] = field(default_factory=dict)  # student: written parts to grade by hand


def part_label(part: dict[str, Any]) -> str:
    """Return how a part's result reads on the page: its verdict, with the grader's hint if it failed.

    >>> part_label({"points": 0, "max_points": 2, "status": "manual", "message": "not answered"})
    'not answered (0 points)'
    >>> part_label({"points": 0, "max_points": 2, "status": "manual", "message": "graded by hand"})
    'awaiting grading by hand (not in the score yet)'
    """
    status, message = part["status"], part["message"]
    if status == "manual":
        return "not answered (0 points)" if message == "not answered" else \
            "awaiting grading by hand (not in the score yet)"
    if status == "hand-graded":
        return f"graded by hand: {message}" if message != "graded by hand" else "graded by hand"
    if status == "ok":
        return "correct"
    return message or status


def _awaiting(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in parts if p["status"] == "manual" and p["message"] != "not answered"]


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 1.5rem auto; padding: 0 1rem; }
table.parts { border-collapse: collapse; width: 100%; margin: 1rem 0 2rem; }
table.parts td, table.parts th { border: 1px solid #ccc; padding: .35rem .6rem; text-align: left; }
tr.ok td.points { color: #17692d; }
tr.failed td.points, tr.tampering td.points, tr.not-graded td.points { color: #a4161a; }
.cell { margin: .8rem 0; } .graded { border: 2px solid #3a6ea5; border-radius: 4px; }
.graded > .heading { background: #3a6ea5; color: white; padding: .3rem .6rem; display: flex;
                     justify-content: space-between; }
.graded > .verdict { padding: .3rem .6rem; background: #f3f6fa; border-top: 1px solid #c9d6e6; }
.markdown { padding: 0 .6rem; } .highlight pre { margin: 0; padding: .5rem .6rem; overflow-x: auto; }
.notice { border-left: 4px solid #a4161a; padding: .4rem .8rem; background: #fbeaea; }
"""


def _markdown(text: str) -> str:
    import mistune  # nbconvert's Markdown renderer; escape=True: a student's HTML shows as text

    return mistune.create_markdown(escape=True, plugins=["table", "strikethrough"])(text)


def _code(text: str) -> str:
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    return highlight(text, PythonLexer(), HtmlFormatter())


def _fmt(x: float) -> str:
    return f"{x:g}"


def render(source: dict[str, Any], submission: dict[str, Any] | None, entry: dict[str, Any], *, student: str,
           assignment: str, notebook: str, timestamp: str = "") -> str:
    """Return the feedback page of one student: the score, each part's verdict, and the notebook handed in.

    ``entry`` is the student's row of ``gradebook.json`` (``score``, ``max_score``, ``parts``,
    ``seed``, ``tampering``); ``submission`` the notebook handed in (None if unreadable).
    """
    from pygments.formatters import HtmlFormatter

    esc = html.escape
    parts = {p["grade_id"]: p for p in entry["parts"]}
    manual = {p.grade_id for p in plan(source) if p.manual}
    waiting = _awaiting(entry["parts"])
    title = f"{notebook} · {student}"
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
           f"<style>{STYLE}{HtmlFormatter().get_style_defs('.highlight')}</style></head><body>",
           f'<h1 id="score" data-score="{_fmt(entry["score"])}" data-max-score="{_fmt(entry["max_score"])}">'
           f"{esc(notebook)} (Score: {_fmt(entry['score'])} / {_fmt(entry['max_score'])})</h1>",
           f"<p>Student <b>{esc(student)}</b>, assignment <b>{esc(assignment)}</b>"
           + (f", submitted {esc(timestamp)}" if timestamp else "")
           + f". Graded by labkit in a sandbox; hidden cases seed {entry['seed']}.</p>"]
    if waiting:
        points = _fmt(sum(p["max_points"] for p in waiting))
        out.append(f'<p class="notice">{points} points of written answers are still to be graded by hand: '
                   "they are not in the score yet.</p>")
    if entry.get("tampering"):
        out.append('<p class="notice">Not run, and the parts that needed it not scored: code that could '
                   "reach into the grader. A person will review it:</p><ul>"
                   + "".join(f"<li>{esc(t)}</li>" for t in entry["tampering"]) + "</ul>")
    out.append('<table class="parts"><tr><th>part</th><th>kind</th><th>points</th><th>result</th></tr>')
    for gid, p in parts.items():
        kind = "written, graded by hand" if gid in manual else "autograded"
        out.append(f'<tr class="part {esc(p["status"]).replace(" ", "-")}" id="part-{esc(gid)}" '
                   f'data-grade-id="{esc(gid)}" data-points="{_fmt(p["points"])}" '
                   f'data-max-points="{_fmt(p["max_points"])}" data-status="{esc(p["status"])}">'
                   f'<td><a href="#cell-{esc(gid)}">{esc(gid)}</a></td><td>{kind}</td>'
                   f'<td class="points">{_fmt(p["points"])} / {_fmt(p["max_points"])}</td>'
                   f"<td>{esc(part_label(p))}</td></tr>")
    out.append("</table><h2>Your notebook</h2>")
    if submission is None:
        out.append('<p class="notice">The notebook handed in could not be read.</p>')
    for cell in (submission or {"cells": []})["cells"]:
        text = cell.get("source", "")
        body = _markdown(text) if cell.get("cell_type") == "markdown" else \
            _code(text) if cell.get("cell_type") == "code" else f"<pre>{esc(text)}</pre>"
        if cell.get("cell_type") == "markdown":
            body = f'<div class="markdown">{body}</div>'
        gid = grade_id_of(cell)
        if gid in parts:
            p = parts[gid]
            kind = ("Your written answer" if is_manual_cell(cell) else "Tests" if is_test_cell(cell)
                    else "Graded cell")
            out.append(f'<div class="cell graded" id="cell-{esc(gid)}"><div class="heading"><span>{kind}: '
                       f'<code>{esc(gid)}</code></span><span>Score: {_fmt(p["points"])} / '
                       f'{_fmt(p["max_points"])}</span></div>{body}<div class="verdict">'
                       f"{esc(part_label(p))}</div></div>")
        elif nbgrader_meta(cell).get("solution"):
            out.append(f'<div class="cell answer"><b>Your answer</b> <code>{esc(gid or "")}</code>'
                       f"{body}</div>")
        else:
            out.append(f'<div class="cell">{body}</div>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_feedback(source_path: Path, folder: Path, grades: Path, out: Path,
                   assignment: str | None = None) -> Feedback:
    """Write every graded student's feedback page into ``out`` in nbgrader's layout; return what was done.

    ``folder`` is nbgrader's ``submitted/`` (``<student>/<assignment>/<notebook>.ipynb`` with its
    ``timestamp.txt`` and ``submission_secret.txt``), ``grades`` the ``--out`` folder of ``grade``
    on it. Raises ``ValueError`` when the gradebook is missing, or a student's submission is not
    the one that was graded (regrade first: the same ``grade`` command grades only what changed).
    """
    source = read(source_path)
    try:
        book = json.loads((grades / "gradebook.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{grades} has no gradebook.json: grade the class first "
                         f"(python -m labkit.grading grade SOURCE {folder} --out {grades})") from None
    entries = {s["student"]: s for s in book["students"]}
    subs = [s for s in find(folder, source_path.name, assignment) if s.path is not None]
    if any(s.path.parent.parent.parent != folder for s in subs):
        raise ValueError(f"{folder} is a flat folder of notebooks: feedback needs nbgrader's submitted/"
                         "<student>/<assignment>/ layout, whose submission_secret.txt names the file "
                         "release_feedback returns.")
    stale = [s.student for s in subs
             if s.student not in entries or _graded_sha(grades, s) != file_sha256(s.path)]
    if stale:
        raise ValueError(f"the gradebook in {grades} was not made from these submissions of "
                         f"{', '.join(stale)} (graded another version, or not at all): run the same grade "
                         "command again first; it grades only what changed.")
    done = Feedback()
    for sub in subs:
        missing = [name for name in COPIED if not (sub.path.parent / name).is_file()]
        if missing:
            done.skipped[sub.student] = (f"no {' or '.join(missing)} in {sub.path.parent} (not collected by "
                                         "nbgrader collect?): release_feedback could not return it")
            continue
        entry = entries[sub.student]
        try:
            submission = read(sub.path)
        except (OSError, ValueError):
            submission = None
        target = out / sub.student / sub.path.parent.name
        target.mkdir(parents=True, exist_ok=True)
        page = target / f"{sub.path.stem}.html"
        timestamp = (sub.path.parent / "timestamp.txt").read_text(encoding="utf-8").strip()
        write_atomically(page, render(source, submission, entry, student=sub.student,
                                      assignment=sub.path.parent.name, notebook=sub.path.stem,
                                      timestamp=timestamp))
        for name in COPIED:
            shutil.copyfile(sub.path.parent / name, target / name)
        done.written.append(page)
        waiting = _awaiting(entry["parts"])
        if waiting:
            done.awaiting[sub.student] = [p["grade_id"] for p in waiting]
    return done


def _graded_sha(grades: Path, sub: Submission) -> str | None:
    try:
        result = json.loads((grades / "results" / f"{sub.student}.json").read_text(encoding="utf-8"))
        return result["key"]["submission"]
    except (OSError, ValueError, KeyError):
        return None
