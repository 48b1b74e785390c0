"""A sweep's folder on disk: the recipe, a CSV row per finished point, each run's records.

``out/sweep.json`` holds the recipe (a folder of another recipe is refused), ``out/sweep.csv``
one row per finished ``Point`` (``COLUMNS``), appended as each point finishes, and
``out/runs/<variant>_lr<lr>_seed<seed>.jsonl`` each run's records. A grid stopped half-way
resumes from what is here: a row cut short is dropped by the log writer's torn-tail rule
(``labkit.logfile.cut_torn_tail``), and that point runs again.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os

from .recipe import Point, Recipe

__all__ = ["COLUMNS", "append_point", "log_file", "open_folder", "read_points", "run_name"]

COLUMNS = [f.name for f in dataclasses.fields(Point)]


def run_name(variant: str, lr: float, seed: int) -> str:
    """Return the name of one point's run: its log's file name without ``.jsonl``.

    >>> run_name("qk_norm", 0.003, 1)
    'qk_norm_lr0.003_seed1'
    """
    return f"{variant}_lr{lr:g}_seed{seed}"


def log_file(out: str, variant: str, lr: float, seed: int) -> str:
    """Return the path of one point's records in the sweep folder ``out``.

    >>> log_file("runs/sweep", "baseline", 0.1, 0).replace(os.sep, "/")
    'runs/sweep/runs/baseline_lr0.1_seed0.jsonl'
    """
    return os.path.join(out, "runs", run_name(variant, lr, seed) + ".jsonl")


def read_points(path: str) -> list[Point]:
    """Read the finished points of a ``sweep.csv``; a torn last row (a run stopped mid-write) is left out."""
    if not os.path.exists(path):
        return []
    points = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            try:
                points.append(Point.from_row(row))
            except (TypeError, ValueError, KeyError):
                continue  # a torn row: that point runs again
    return points


def open_folder(out: str, recipe: Recipe) -> tuple[str, dict[tuple[str, float, int], Point]]:
    """Make ``out`` a sweep folder of ``recipe`` (or check it is one); return its CSV's path and its points.

    The points are keyed by ``(variant, lr, seed)``. A folder of another recipe, or a CSV of
    other columns, raises ``ValueError`` and is left as it was; a torn last row is cut.
    """
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    meta = os.path.join(out, "sweep.json")
    mine = dataclasses.asdict(recipe)
    if os.path.exists(meta):
        with open(meta, encoding="utf-8") as f:  # a field added since reads as its default
            theirs = {fld.name: fld.default for fld in dataclasses.fields(Recipe)} | json.load(f)
        if theirs != mine:
            changed = sorted(k for k in mine if theirs.get(k) != mine[k])
            raise ValueError(f"{out} holds a sweep of another recipe (differs in {changed}): give "
                             "another --out, or delete the folder to start over.")
    else:
        with open(meta, "w", encoding="utf-8") as f:
            json.dump(mine, f, indent=1)
    csv_path = os.path.join(out, "sweep.csv")
    if os.path.exists(csv_path) and os.path.getsize(csv_path):
        with open(csv_path, encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), [])
        if header != COLUMNS:
            raise ValueError(f"{csv_path} has the columns {header}, not this labkit's {COLUMNS}: give "
                             "another --out, or delete the folder to start over.")
    from ...logfile import cut_torn_tail  # here: --help loads this module without torch

    # first, the log writer's rule: a row cut short may still parse, so a row without its newline is torn
    cut_torn_tail(csv_path, complete=lambda row: False, warn=False)
    done = {(p.variant, p.lr, p.seed): p for p in read_points(csv_path)}
    if not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0:
        with open(csv_path, "w", encoding="utf-8", newline="") as f:
            csv.writer(f).writerow(COLUMNS)
    return csv_path, done


def append_point(csv_path: str, point: Point) -> None:
    """Append ``point`` to the folder's ``sweep.csv`` as one row (a finished point is on disk at once)."""
    with open(csv_path, "a", encoding="utf-8", newline="") as f:
        csv.writer(f).writerow([getattr(point, c) for c in COLUMNS])
