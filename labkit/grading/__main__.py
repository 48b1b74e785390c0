"""``python -m labkit.grading release|grade|feedback`` (or ``python -m labkit grading ...``): for instructors.

Exit codes: 0 when the command did its job (whatever the score), 1 when it could not
(an unreadable or malformed source, no sandbox tool), 2 for bad arguments. Starts in well
under a second: torch is imported only once grading judges a result.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

USAGE = """examples:
  python -m labkit.grading release notebooks/exercises/ps1_clipping_and_scaling.ipynb -o release/
  python -m labkit.grading grade SOURCE.ipynb alice.ipynb --json alice.json
  python -m labkit.grading grade SOURCE.ipynb course/submitted/ --out grades/ --jobs 2 --manual written.csv
  python -m labkit.grading feedback SOURCE.ipynb course/submitted/ --grades grades/ -o course/feedback/

A folder is graded as a class: nbgrader's submitted/<student>/<assignment>/<notebook>.ipynb or a flat folder
of <student>.ipynb, into OUT/gradebook.csv, gradebook.json, summary.txt and results/<student>.json (kept:
run the same command again after a crash and only what is missing is graded). --manual is a CSV
student,grade_id,points[,comment] of hand-graded points. Every submission runs in a bubblewrap sandbox
(apt-get install bubblewrap); its hidden cases are seeded from the source and the student's name, and the
seed is in the JSON: --seed replays it. feedback writes each student's page from the gradebook into nbgrader's
feedback/<student>/<assignment>/<notebook>.html, for `nbgrader release_feedback`.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit.grading", epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Release and grade nbgrader-format exercise notebooks.")
    commands = parser.add_subparsers(dest="command", required=True)
    rel = commands.add_parser("release", help="write the student version of a source notebook")
    rel.add_argument("source", type=Path, help="the instructor's notebook, with solutions and hidden tests")
    rel.add_argument("-o", "--output", type=Path, required=True,
                     help="the folder to write the student version into")
    gra = commands.add_parser("grade", epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
                              help="grade a student's notebook, or a folder of them, against the source")
    gra.add_argument("source", type=Path, help="the instructor's notebook the submission was released from")
    gra.add_argument("submission", type=Path,
                     help="the student's notebook, or a folder of submissions (a class)")
    gra.add_argument("--json", type=Path, help="one notebook: also write the report as JSON to this file")
    gra.add_argument("--out", type=Path, help="a folder: where the gradebook and each student's results go")
    gra.add_argument("--jobs", type=int, default=1, help="a folder: submissions graded at once (default 1)")
    gra.add_argument("--manual", type=Path,
                     help="a folder: CSV of hand-graded points (student,grade_id,points)")
    gra.add_argument("--assignment", help="a folder in nbgrader's layout: the assignment folder name")
    gra.add_argument("--include-manual", action="store_true",
                     help="count the manually graded parts in max_score and list them in the JSON")
    gra.add_argument("--timeout", type=float, default=60.0,
                     help="seconds each cell and each check may run (default 60)")
    gra.add_argument("--wall", type=float,
                     help="seconds a whole submission may run, hard (default: from --timeout, at most 600)")
    gra.add_argument("--seed", type=int, help="replay the hidden cases of this seed (from a report's JSON)")
    gra.add_argument("--no-sandbox", action="store_true",
                     help="run without bubblewrap: only for notebooks you trust (your own solutions)")
    fee = commands.add_parser("feedback", help="write each student's feedback page from a graded class, for "
                              "nbgrader release_feedback")
    fee.add_argument("source", type=Path, help="the instructor's notebook the class was graded against")
    fee.add_argument("submitted", type=Path, help="nbgrader's submitted/ folder that was graded")
    fee.add_argument("--grades", type=Path, required=True, help="grade's --out folder (gradebook.json)")
    fee.add_argument("-o", "--output", type=Path, required=True, help="nbgrader's feedback/ folder, to write")
    fee.add_argument("--assignment", help="the assignment folder name, if students have several")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .notebook import read

    try:
        source = read(args.source)
    except (OSError, ValueError) as e:
        print(f"labkit.grading: cannot read the source notebook {args.source}: {e}", file=sys.stderr)
        return 1
    if args.command == "release":
        return _release(args, source)
    if args.command == "feedback":
        return _feedback(args)
    for name, value in (("--timeout", args.timeout), ("--wall", args.wall)):
        if value is not None and value <= 0:
            print(f"labkit.grading: {name} must be > 0 seconds, got {value:g}.", file=sys.stderr)
            return 2
    if args.jobs < 1:
        print(f"labkit.grading: --jobs must be at least 1, got {args.jobs}.", file=sys.stderr)
        return 2
    from .sandbox import SandboxError

    options = {"timeout": args.timeout, "wall": args.wall, "seed": args.seed, "sandbox": not args.no_sandbox}
    try:
        if args.submission.is_dir():
            return _grade_class(args, options)
        return _grade_one(args, source, options)
    except (ValueError, SandboxError) as e:  # a malformed source, a bad --manual file, no or broken bwrap
        print(f"labkit.grading: {e}", file=sys.stderr)
        return 1


def _release(args: argparse.Namespace, source: dict) -> int:
    from .notebook import release

    out = args.output / args.source.name
    if out.resolve() == args.source.resolve():
        print(f"labkit.grading: refusing to overwrite the source {args.source}; pick another -o folder.",
              file=sys.stderr)
        return 1
    try:
        student = release(source)
    except ValueError as e:
        print(f"labkit.grading: {args.source}: {e}", file=sys.stderr)
        return 1
    args.output.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(student, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _feedback(args: argparse.Namespace) -> int:
    from .feedback import write_feedback

    try:
        done = write_feedback(args.source, args.submitted, args.grades, args.output, args.assignment)
    except ValueError as e:
        print(f"labkit.grading: {e}", file=sys.stderr)
        return 1
    for student, why in done.skipped.items():
        print(f"labkit.grading: no feedback for {student}: {why}", file=sys.stderr)
    for student, parts in done.awaiting.items():
        print(f"labkit.grading: {student}'s {', '.join(parts)} not graded by hand yet: the page says so "
              "(add it to --manual and grade again)", file=sys.stderr)
    print(f"wrote {len(done.written)} feedback pages under {args.output}")
    return 0


def _grade_one(args: argparse.Namespace, source: dict, options: dict) -> int:
    from .notebook import grade, read

    if args.out is not None or args.manual is not None:
        print("labkit.grading: --out and --manual are for a folder of submissions; for one notebook use "
              "--json.", file=sys.stderr)
        return 2
    try:
        submission, reason = read(args.submission), ""
    except (OSError, ValueError) as e:
        submission, reason = None, f"the submission is not a readable notebook: {e}"
    report = grade(source, submission, student=args.submission.stem, reason=reason, **options)
    print(report.format(args.include_manual))
    if args.json is not None:
        text = json.dumps(report.to_dict(args.include_manual), indent=2) + "\n"
        args.json.write_text(text, encoding="utf-8")
    return 0


def _grade_class(args: argparse.Namespace, options: dict) -> int:
    from .batch import grade_class, summary

    if args.out is None:
        print("labkit.grading: grading a folder needs --out FOLDER for the gradebook.", file=sys.stderr)
        return 2
    book = grade_class(args.source, args.submission, args.out, jobs=args.jobs, manual=args.manual,
                       assignment=args.assignment, **options)
    print(summary(book))
    print(f"wrote {args.out / 'gradebook.csv'}, gradebook.json, summary.txt, results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
