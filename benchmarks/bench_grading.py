"""Time grading a class of the real problem set: is 300 submissions in <= 30 min on 2 cores in reach?

    python benchmarks/bench_grading.py [--students 300] [--jobs 2] [--one-by-one 5] [--label "idle"]

Builds a class of ``--students`` submissions of notebooks/exercises/ps1 in nbgrader's layout
(the instructor's solutions, and each classic bug in turn), grades it with
``python -m labkit.grading grade ... --jobs N`` exactly as an instructor would (sandboxed),
and prints the grader's start, the wall time, seconds per submission and the time 300 would
take at that rate; ``--one-by-one K`` then grades K of them alone (``grade`` on one notebook,
``--seed`` from the gradebook) and checks each gets the batch's grade part by part. Quote the
result with the CPU (lscpu) and whether the machine was idle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
SOURCE = ROOT / "notebooks" / "exercises" / "ps1_clipping_and_scaling.ipynb"
sys.path.insert(0, str(ROOT))

from labkit.grading.notebook import read, release  # noqa: E402

BUGS = {  # answer grade_id -> a wrong body that a course sees
    "grad_norm_answer": "def global_grad_norm(parameters):\n    return torch.sqrt(sum((p.grad ** 2).sum() for p in "
                        "parameters if p.grad is not None)).float()",
    "skip_answer": "def skip_reason(loss, parameters):\n    return 'nonfinite_loss' if torch.isnan(loss) else None",
    "scale_answer": "def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):\n"
                    "    return (scale / 2, 0, 0) if found_inf else (scale, growth_tracker + 1, hysteresis_left)",
}


def solutions() -> dict[str, str]:
    src = read(SOURCE)
    return {c["metadata"]["nbgrader"]["grade_id"]: "\n".join(line for line in c["source"].split("\n") if "### " not in line)
            for c in src["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("solution")
            and c["cell_type"] == "code"}


def make_class(folder: Path, students: int) -> None:
    good = solutions()
    for i in range(students):
        nb = release(read(SOURCE))
        answers = dict(good)
        if i % 4:  # three in four students have one classic bug
            gid = list(BUGS)[i % len(BUGS)]
            answers[gid] = BUGS[gid]
        for cell in nb["cells"]:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            if gid in answers:
                cell["source"] = answers[gid]
        path = folder / "submitted" / f"student{i:03d}" / "ps1" / SOURCE.name
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(nb), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--students", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--one-by-one", type=int, default=0, help="regrade this many alone and compare")
    parser.add_argument("--label", default="", help="e.g. 'idle' or 'under load' (printed with the figures)")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "labkit.grading", "--help"], env=env, check=True, capture_output=True)
    cli = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_class(folder, args.students)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "labkit.grading", "grade", str(SOURCE), str(folder / "submitted"),
                        "--out", str(folder / "grades"), "--jobs", str(args.jobs)], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        book = json.loads((folder / "grades" / "gradebook.json").read_text())
        same = 0
        for entry in book["students"][: args.one_by_one]:
            alone = folder / f"{entry['student']}.json"
            subprocess.run([sys.executable, "-m", "labkit.grading", "grade", str(SOURCE),
                            str(folder / "submitted" / entry["student"] / "ps1" / SOURCE.name), "--json", str(alone),
                            "--seed", str(entry["seed"]), "--include-manual"], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            batch = json.loads((folder / "grades" / "results" / f"{entry['student']}.json").read_text())["parts"]
            same += json.loads(alone.read_text())["parts"] == batch
    scores = sorted({s["score"] for s in book["students"]})
    per = wall / args.students
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}, {os.cpu_count()} cores visible; {args.label or 'load not stated'}")
    print(f"python -m labkit.grading --help: {cli:.2f} s")
    print(f"{args.students} submissions, --jobs {args.jobs}: {wall:.1f} s wall, {per:.2f} s per submission; "
          f"300 would take {300 * per / 60:.1f} min (goal <= 30); scores seen: {scores}")
    if args.one_by_one:
        print(f"graded alone with the batch's seed: {same} of {args.one_by_one} got the batch's grade part by part")


if __name__ == "__main__":
    main()
