"""Grade a class: every submission in a folder, N at a time, resumable, into a gradebook.

Layouts: nbgrader's ``submitted/<student>/<assignment>/<notebook>.ipynb`` (pass the
``submitted`` folder) and a flat folder of ``<student>.ipynb``. Each student's report is
written to ``OUT/results/<student>.json`` the moment it is done (atomically), so a run that
is killed loses nothing already graded and the next run skips it (same submission bytes,
same source, same options). At the end: ``gradebook.csv`` and ``gradebook.json`` (one row
per student and part, hand-graded points merged from ``--manual``), ``summary.txt``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .notebook import grade, plan, read

__all__ = ["Submission", "file_sha256", "find", "grade_class", "read_manual", "summary", "write_atomically"]


@dataclass(frozen=True)
class Submission:
    """One student's notebook (``path`` None: nothing handed in)."""

    student: str
    path: Path | None


def find(folder: Path, notebook: str, assignment: str | None = None) -> list[Submission]:
    """Return the submissions in ``folder``, by student name: flat ``*.ipynb`` or nbgrader's layout.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "ada.ipynb").write_text("{}")
    >>> [(s.student, s.path.name) for s in find(d, "ps1.ipynb")]
    [('ada', 'ada.ipynb')]
    """
    flat = sorted(p for p in folder.glob("*.ipynb") if p.is_file())
    if flat:
        return [Submission(p.stem, p) for p in flat]
    out = []
    for student in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found = sorted(student.glob(f"{assignment or '*'}/{notebook}"))
        if len(found) > 1:
            raise ValueError(f"{student.name} has {notebook} in several assignments "
                             f"({', '.join(p.parent.name for p in found)}): pass --assignment NAME.")
        out.append(Submission(student.name, found[0] if found else None))
    if not out:
        raise ValueError(f"{folder} holds no *.ipynb and no <student>/<assignment>/{notebook}: pass a flat "
                         "folder of <student>.ipynb or nbgrader's submitted/ folder.")
    return out


def read_manual(
    path: Path, parts: dict[str, float], students: set[str]
) -> dict[tuple[str, str], tuple[float, str]]:
    """Return hand-graded points ``{(student, grade_id): (points, comment)}`` from a CSV file.

    Columns: ``student,grade_id,points`` and optionally ``comment``. Raises ``ValueError``
    naming the row for an unknown student or part, or points outside 0..max.
    """
    out = {}
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f)
        missing = {"student", "grade_id", "points"} - set(rows.fieldnames or [])
        if missing:
            raise ValueError(
                f"{path}: the header needs student,grade_id,points[,comment]; missing {sorted(missing)}"
            )
        for n, row in enumerate(rows, 2):
            student, gid = row["student"].strip(), row["grade_id"].strip()
            if student not in students:
                raise ValueError(f"{path}, line {n}: no submission from {student!r}")
            if gid not in parts:
                raise ValueError(
                    f"{path}, line {n}: no graded part {gid!r}; the parts are {', '.join(parts)}"
                )
            try:
                points = float(row["points"])
            except ValueError:
                raise ValueError(f"{path}, line {n}: points {row['points']!r} is not a number") from None
            if not 0 <= points <= parts[gid]:
                raise ValueError(
                    f"{path}, line {n}: {points:g} points for {gid!r}, which is worth {parts[gid]:g}"
                )
            out[student, gid] = (points, (row.get("comment") or "").strip())
    return out


def file_sha256(path: Path | None) -> str:
    """Return the SHA-256 of a file's bytes, hex; "" for no file (what a cached grade is keyed by)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else ""


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _grade_one(source: dict[str, Any], sub: Submission, key: dict[str, Any], options: dict[str, Any],
               results: Path, logs: Path) -> dict[str, Any]:
    if sub.path is None:
        submission, reason = None, "nothing handed in"
    else:
        try:
            submission, reason = read(sub.path), ""
        except (OSError, ValueError) as e:
            submission, reason = None, f"the submission is not a readable notebook: {e}"
    report = grade(source, submission, student=sub.student, reason=reason, **options)
    entry = {"student": sub.student, "key": key, **report.to_dict(include_manual=True)}
    write_atomically(logs / f"{sub.student}.txt", report.output)
    write_atomically(results / f"{sub.student}.json", json.dumps(entry, indent=1) + "\n")
    return entry


def grade_class(source_path: Path, folder: Path, out: Path, *, jobs: int = 1, manual: Path | None = None,
                assignment: str | None = None, progress: bool = True, **options: Any) -> dict[str, Any]:
    """Grade every submission in ``folder`` into ``out``; return the gradebook (also written as CSV and JSON).

    ``options`` go to ``grade`` (timeout, wall, seed, sandbox). Already graded students
    (same submission, source and options) are read back, not regraded.
    """
    source = read(source_path)
    planned = plan(source)
    subs = find(folder, source_path.name, assignment)
    hand = (read_manual(manual, {p.grade_id: p.points for p in planned}, {s.student for s in subs})
            if manual else {})
    results, logs = out / "results", out / "logs"
    results.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    source_sha = file_sha256(source_path)
    done, todo = {}, []
    for sub in subs:
        key = {"submission": file_sha256(sub.path), "source": source_sha,
               "options": {k: options[k] for k in sorted(options)}}
        path = results / f"{sub.student}.json"
        if path.exists():
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
                if entry.get("key") == key:
                    done[sub.student] = entry
                    continue
            except (OSError, ValueError):
                pass  # half-written by a killed run? (writes are atomic, but be safe): regrade
        todo.append((sub, key))
    from tqdm import tqdm

    bar = tqdm(
        total=len(subs), initial=len(done), desc="grading", unit="nb", disable=not progress, file=sys.stderr
    )
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            pool.submit(_grade_one, source, sub, key, options, results, logs): sub for sub, key in todo
        }
        for future in as_completed(futures):
            entry = future.result()
            done[entry["student"]] = entry
            bar.set_postfix_str(
                f"{entry['student']}: {entry['score']:g}/{entry['max_score']:g}", refresh=False
            )
            bar.update()
    bar.close()
    book = _gradebook([done[s.student] for s in subs], hand)
    write_atomically(out / "gradebook.json", json.dumps(book, indent=1) + "\n")
    with open(out / "gradebook.csv.tmp", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "grade_id", "points", "max_points", "status", "seed", "message"])
        for student in book["students"]:
            for part in student["parts"]:
                writer.writerow([student["student"], part["grade_id"], f"{part['points']:g}",
                                 f"{part['max_points']:g}", part["status"], part["seed"], part["message"]])
    os.replace(out / "gradebook.csv.tmp", out / "gradebook.csv")
    write_atomically(out / "summary.txt", summary(book) + "\n")
    return book


def _gradebook(
    entries: list[dict[str, Any]], hand: dict[tuple[str, str], tuple[float, str]]
) -> dict[str, Any]:
    students = []
    for entry in entries:
        parts = []
        for part in entry["parts"]:
            part = dict(part)
            if (entry["student"], part["grade_id"]) in hand:
                part["points"], comment = hand[entry["student"], part["grade_id"]]
                part["status"], part["message"] = "hand-graded", comment or "graded by hand"
            parts.append(part)
        score = sum(p["points"] for p in parts)
        students.append({"student": entry["student"], "score": score,
                         "max_score": sum(p["max_points"] for p in parts), "seed": entry["seed"],
                         "tampering": entry["tampering"], "warnings": entry["warnings"], "parts": parts})
    return {"students": students}


def _hint(message: str) -> str:
    """Return a message with its case, seed and numbers taken out, so the same hint counts once."""
    message = re.sub(r" on the (hidden )?case '[^']*'( \(seed=\d+\))?", "", message)
    message = re.sub(r"\[[^\]]*\] ", "", message)
    message = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", message)
    return message.split(": ", 1)[-1][:140]


def summary(book: dict[str, Any], bins: int = 10) -> str:
    """Return the class summary: a score histogram, the parts most failed, the hints most given."""
    students = book["students"]
    if not students:
        return "no submissions"
    top = max(s["max_score"] for s in students) or 1
    counts = Counter(min(bins - 1, int(s["score"] / top * bins)) for s in students)
    lines = [f"{len(students)} submissions; "
             f"mean {sum(s['score'] for s in students) / len(students):.2f} / {top:g}",
             "score histogram:"]
    width = max(counts.values())
    for b in range(bins):
        lo, hi = top * b / bins, top * (b + 1) / bins
        lines.append(
            f"  {lo:5.1f}-{hi:<5.1f} {'#' * round(30 * counts.get(b, 0) / width):<30} {counts.get(b, 0)}"
        )
    failed = Counter(p["grade_id"] for s in students for p in s["parts"]
                     if p["status"] not in ("ok", "manual", "hand-graded"))
    lines.append("parts most failed:")
    lines += [f"  {gid:<20} {n:>4} of {len(students)}" for gid, n in failed.most_common(5)] or ["  none"]
    hints = Counter(_hint(p["message"]) for s in students for p in s["parts"] if p["status"] == "failed")
    lines.append("hints most given:")
    lines += [f"  {n:>4} x {hint}" for hint, n in hints.most_common(5)] or ["  none"]
    flagged = [s["student"] for s in students if s["tampering"]]
    lines.append(f"tampering (not scored, review by hand): {', '.join(flagged) if flagged else 'none'}")
    return "\n".join(lines)
