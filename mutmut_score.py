"""Print mutmut's score per core module, the equivalent mutants of mutmut-equivalent.md left out.

    .venv-mut/bin/mutmut run --max-children 2     # first (see docs/testing.md)
    python mutmut_score.py                        # then: one row per module, and the core's total

Score = (killed + timeout) / (mutants - equivalent), as mutmut's own badge counts it
(``mutmut badge``) less the listed equivalents; "no tests" (no selected test calls the
function) and "not checked" (the run did not reach it) count against it. Names in
mutmut-equivalent.md's tables are mutmut's, in backticks; a trailing ``*`` matches a family.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 24, -24, 36, 152, 255}  # mutmut's "killed" and "timeout" exit codes (mutmut/stats.py)
SURVIVED, NO_TESTS = {0}, {5, 33}


def equivalents(path: Path) -> list[str]:
    """Return the mutant names and patterns listed in the first column of the file's tables."""
    names = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `labkit."):
            names += re.findall(r"`(labkit\.[^`]+)`", line.split("|")[1])
    return names


def module(name: str) -> str:
    """Return a mutant's module: ``labkit.step.batch.x_split__mutmut_2`` -> ``labkit.step.batch``."""
    return name.split(".x_")[0].split(".xǁ")[0]


def main(root: Path = Path(".")) -> int:
    metas = sorted((root / "mutants").rglob("*.py.meta"))
    if not metas:
        print("no mutants/: run `mutmut run` first (docs/testing.md)", file=sys.stderr)
        return 1
    listed = equivalents(root / "mutmut-equivalent.md")
    counts: dict[str, Counter] = {}
    for meta in metas:
        for name, code in json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"].items():
            c = counts.setdefault(module(name), Counter())
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in listed):
                c["equivalent"] += 1
            elif code in KILLED:
                c["killed"] += 1
            elif code in SURVIVED:
                c["survived"] += 1
            elif code in NO_TESTS:
                c["no tests"] += 1
            elif code is None:
                c["not checked"] += 1
            else:
                c["other"] += 1
    total = Counter()
    print(f"{'module':34} {'score':>7} {'killed':>7} {'survived':>8} {'no tests':>8} {'unrun':>6} "
          f"{'equiv':>6}")
    for mod in sorted(counts):
        c = counts[mod]
        total += c
        print(row(mod, c))
    print(row("core", total))
    return 0


def row(name: str, c: Counter) -> str:
    scored = sum(c.values()) - c["equivalent"]
    score = 100 * c["killed"] / scored if scored else 100.0
    return (f"{name:34} {score:6.1f}% {c['killed']:7} {c['survived']:8} {c['no tests']:8} "
            f"{c['not checked'] + c['other']:6} {c['equivalent']:6}")


if __name__ == "__main__":
    sys.exit(main())
