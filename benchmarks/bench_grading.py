"""Time grading a class of each problem set: seconds per submission; is 300 in <= 30 min on 2 cores in reach?

    python benchmarks/bench_grading.py [--sets ps1,ps2,ps3,ps4] [--students 300] [--jobs 2]
        [--one-by-one 5] [--label "idle"]

For each set of notebooks/exercises/ builds a class of ``--students`` submissions in
nbgrader's layout (the instructor's solutions, and in three of four of them one classic bug,
each bug in turn: ps1's below, ps2's to ps4's from tests/grading_answers.py), grades it with
``python -m labkit.grading grade ... --jobs N`` exactly as an instructor would (sandboxed), and
prints the wall time, seconds per submission (the goal: <= 4 s on 2 cores) the time 300
would take at that rate; ``--one-by-one K`` then grades K of them alone (``grade`` on one
notebook, ``--seed`` from the gradebook) and checks each gets the batch's grade part by part.
Quote the result with the CPU (lscpu) and whether the machine was idle.
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
EXERCISES = ROOT / "notebooks" / "exercises"
SETS = {"ps1": EXERCISES / "ps1_clipping_and_scaling.ipynb",
        "ps2": EXERCISES / "ps2_instabilities_and_spikes.ipynb",
        "ps3": EXERCISES / "ps3_precision_beyond_fp16.ipynb", "ps4": EXERCISES / "ps4_optimizer_spikes.ipynb"}
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from grading_answers import BUGS as SET_BUGS  # noqa: E402

from labkit.grading.notebook import read, release  # noqa: E402

PS1_BUGS = {  # answer grade_id -> a wrong body that a course sees
    "grad_norm_answer": "def global_grad_norm(parameters):\n"
                        "    return torch.sqrt(sum((p.grad ** 2).sum() for p in parameters "
                        "if p.grad is not None)).float()",
    "skip_answer": "def skip_reason(loss, parameters):\n"
                   "    return 'nonfinite_loss' if torch.isnan(loss) else None",
    "scale_answer": "def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):\n"
                    "    return (scale / 2, 0, 0) if found_inf "
                    "else (scale, growth_tracker + 1, hysteresis_left)",
}


def bugs(source: Path) -> list[tuple[str, str]]:
    """The classic bugs of a set, as (answer grade_id, source)."""
    if source == SETS["ps1"]:
        return list(PS1_BUGS.items())
    ids = {c["metadata"].get("nbgrader", {}).get("grade_id") for c in read(source)["cells"]}
    return [(gid, body) for gid, body, _, _ in SET_BUGS.values() if gid in ids]


def solutions(source: Path) -> dict[str, str]:
    src = read(source)
    return {c["metadata"]["nbgrader"]["grade_id"]: "\n".join(line for line in c["source"].split("\n")
                                                                if "### " not in line)
            for c in src["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("solution")
            and c["cell_type"] == "code"}


def make_class(source: Path, folder: Path, students: int) -> None:
    good, wrong = solutions(source), bugs(source)
    for i in range(students):
        nb = release(read(source))
        answers = dict(good)
        if i % 4:  # three in four students have one classic bug
            gid, body = wrong[i % len(wrong)]
            answers[gid] = body
        for cell in nb["cells"]:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            if gid in answers:
                cell["source"] = answers[gid]
        path = folder / "submitted" / f"student{i:03d}" / source.stem.split("_")[0] / source.name
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(nb), encoding="utf-8")


def bench(name: str, source: Path, args: argparse.Namespace, env: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_class(source, folder, args.students)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "labkit.grading", "grade", str(source),
                        str(folder / "submitted"), "--out", str(folder / "grades"), "--jobs", str(args.jobs)],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        book = json.loads((folder / "grades" / "gradebook.json").read_text())
        same = 0
        for entry in book["students"][: args.one_by_one]:
            alone = folder / f"{entry['student']}.json"
            notebook = folder / "submitted" / entry["student"] / source.stem.split("_")[0] / source.name
            subprocess.run([sys.executable, "-m", "labkit.grading", "grade", str(source), str(notebook),
                            "--json", str(alone), "--seed", str(entry["seed"]), "--include-manual"],
                           env=env, check=True, stdout=subprocess.DEVNULL)
            batch = json.loads(
                (folder / "grades" / "results" / f"{entry['student']}.json").read_text()
            )["parts"]
            same += json.loads(alone.read_text())["parts"] == batch
    scores = sorted({s["score"] for s in book["students"]})
    per = wall / args.students
    print(f"{name}: {args.students} submissions, --jobs {args.jobs}: {wall:.1f} s wall, {per:.2f} s per "
          f"submission (goal <= 4); 300 would take {300 * per / 60:.1f} min (goal <= 30); scores seen: "
          f"{scores}")
    if args.one_by_one:
        print(f"{name}: graded alone with the batch's seed: {same} of {args.one_by_one} got the batch's "
              "grade part by part")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", default="ps1,ps2,ps3,ps4", help="comma-separated: ps1, ps2, ps3, ps4")
    parser.add_argument("--students", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--one-by-one", type=int, default=0, help="regrade this many alone and compare")
    parser.add_argument("--label", default="", help="e.g. 'idle' or 'under load' (printed with the figures)")
    args = parser.parse_args()
    names = [n.strip() for n in args.sets.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETS]
    if unknown:
        parser.error(f"unknown set(s) {unknown}; choose from {', '.join(SETS)}")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "labkit.grading", "--help"], env=env, check=True, capture_output=True
    )
    cli = time.perf_counter() - start
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}, {os.cpu_count()} cores visible; {args.label or 'load not stated'}")
    print(f"python -m labkit.grading --help: {cli:.2f} s")
    for name in names:
        bench(name, SETS[name], args, env)


if __name__ == "__main__":
    main()
