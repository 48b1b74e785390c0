"""``python -m labkit.grading release|grade``: the instructor's side of the exercises.

Exit codes: 0 when the command did its job (whatever the score), 1 when it could not
(an unreadable or malformed source), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat

from .notebook import grade, release

USAGE = """examples:
  python -m labkit.grading release notebooks/exercises/ps1_clipping_and_scaling.ipynb -o release/
  python -m labkit.grading grade notebooks/exercises/ps1_clipping_and_scaling.ipynb alice.ipynb --json alice.json
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit.grading", epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Release and grade nbgrader-format exercise notebooks.")
    commands = parser.add_subparsers(dest="command", required=True)
    rel = commands.add_parser("release", help="write the student version of a source notebook")
    rel.add_argument("source", type=Path, help="the instructor's notebook, with solutions and hidden tests")
    rel.add_argument("-o", "--output", type=Path, required=True, help="the folder to write the student version into")
    gra = commands.add_parser("grade", help="grade a student's notebook against the source")
    gra.add_argument("source", type=Path, help="the instructor's notebook the submission was released from")
    gra.add_argument("submission", type=Path, help="the student's notebook")
    gra.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    gra.add_argument("--include-manual", action="store_true",
                     help="count the manually graded parts in max_score and list them in the JSON")
    gra.add_argument("--timeout", type=float, default=60.0, help="seconds each cell may run (default 60)")
    return parser


def _read_source(path: Path) -> nbformat.NotebookNode:
    try:
        return nbformat.read(path, as_version=4)
    except (OSError, ValueError) as e:  # nbformat's NotJSONError is a ValueError
        raise SystemExit(f"labkit.grading: cannot read the source notebook {path}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source = _read_source(args.source)
    try:
        if args.command == "release":
            out = args.output / args.source.name
            if out.resolve() == args.source.resolve():
                print(f"labkit.grading: refusing to overwrite the source {args.source}; pick another -o folder.",
                      file=sys.stderr)
                return 1
            student = release(source)
            args.output.mkdir(parents=True, exist_ok=True)
            nbformat.write(student, out)
            print(f"wrote {out}")
            return 0
        if args.timeout <= 0:
            print(f"labkit.grading: --timeout must be > 0 seconds, got {args.timeout:g}.", file=sys.stderr)
            return 2
        try:
            submission, reason = nbformat.read(args.submission, as_version=4), ""
        except (OSError, ValueError) as e:
            submission, reason = None, f"the submission is not a readable notebook: {e}"
        report = grade(source, submission, timeout=args.timeout, cwd=str(args.submission.parent), reason=reason)
    except ValueError as e:  # a malformed source: grading itself did not work
        print(f"labkit.grading: {args.source}: {e}", file=sys.stderr)
        return 1
    print(report.format(args.include_manual))
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(args.include_manual), indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
