"""Grading a class: a folder of submissions with --jobs 2, killed midway and resumed, into a gradebook.

A one-part problem set keeps each sandboxed run near its floor: starting Python and importing
torch, ~4 CPU-seconds. So the class is 16 students (the issue's 40 cost ~80 s on 2 idle cores;
benchmarks/bench_grading.py grades 40 or 300 and compares them with one-by-one grading).
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from labkit.grading.__main__ import main
from labkit.grading.batch import find, read_manual, summary

sys.path.insert(0, str(Path(__file__).parent))
from test_grading import sandboxed  # noqa: E402

N = 16
pytestmark = pytest.mark.timeout(900)  # one module fixture grades the class: minutes under load
SETUP = "import torch\nimport labkit"
ANSWER = """def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):
    \"\"\"Return the next (scale, growth_tracker, hysteresis_left) after one step.\"\"\"
{body}"""
RIGHT = """    if found_inf:
        hysteresis_left = max(hysteresis_left - 1, 0)
        return (scale * config.backoff_factor if hysteresis_left == 0 else scale), 0, hysteresis_left
    if growth_tracker + 1 == config.growth_interval:
        return scale * config.growth_factor, 0, config.hysteresis
    return scale, growth_tracker + 1, hysteresis_left"""
# what a class hands in, and the points each earns (recorded: the rule is graded the same every time)
KINDS = {
    "right": (RIGHT, 2),
    "no hysteresis": (RIGHT.replace("if hysteresis_left == 0 else scale", "if True else scale"), 0),
    "stub": ("    # YOUR CODE HERE\n    raise NotImplementedError()", 0),
    "grows early": (RIGHT.replace("growth_tracker + 1 == config.growth_interval",
                                  "growth_tracker + 2 >= config.growth_interval"), 0),
}
HINTS = {"no hysteresis": "back off only when hysteresis_left reaches 0", "stub": "is not implemented yet",
         "grows early": "the scale grew too early"}


def meta(gid, **flags):
    return {"nbgrader": {"grade": False, "solution": False, "locked": False, "grade_id": gid, "schema_version": 3,
                         **flags}}


def problem_set():
    cells = [
        nbformat.v4.new_markdown_cell("# Problem set 0: the loss-scale rule"),
        nbformat.v4.new_code_cell(SETUP, metadata=meta("setup", locked=True)),
        nbformat.v4.new_code_cell(ANSWER.format(body="    ### BEGIN SOLUTION\n" + RIGHT + "\n    ### END SOLUTION"),
                                  metadata=meta("scale_answer", solution=True)),
        nbformat.v4.new_code_cell("from labkit.grading import check_update_scale\ncheck_update_scale(next_scale)\n"
                                  "### BEGIN HIDDEN TESTS\ncheck_update_scale(next_scale, hidden=True)\n"
                                  "### END HIDDEN TESTS", metadata=meta("scale_tests", grade=True, locked=True, points=2)),
        nbformat.v4.new_markdown_cell("### BEGIN SOLUTION\nBecause.\n### END SOLUTION",
                                      metadata=meta("why", grade=True, solution=True, points=1)),
    ]
    return nbformat.v4.new_notebook(cells=cells)


def kind_of(i):
    return list(KINDS)[i % len(KINDS)]


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """nbgrader's layout: source/ps0/ps0.ipynb and submitted/<student>/ps0/ps0.ipynb; s40 handed nothing in."""
    root = tmp_path_factory.mktemp("course")
    src = root / "source" / "ps0" / "ps0.ipynb"
    src.parent.mkdir(parents=True)
    nbformat.write(problem_set(), src)
    for i in range(N):
        nb = problem_set()
        nb.cells[2].source = ANSWER.format(body=KINDS[kind_of(i)][0])
        nb.cells[4].source = "Because the scale multiplies the norm."
        path = root / "submitted" / f"s{i:02d}" / "ps0" / "ps0.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(nb, path)
    (root / "submitted" / f"s{N}").mkdir()
    (root / "manual.csv").write_text("student,grade_id,points,comment\ns00,why,1,clear\ns01,why,0.5,half of it\n")
    return root


def _harnesses():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"labkit.grading.harness" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def graded(course):
    """Start the class with --jobs 2, kill the grader after a few results, then run the same command again."""
    sandboxed()
    out = course / "grades"
    args = ["grade", str(course / "source" / "ps0" / "ps0.ipynb"), str(course / "submitted"), "--out", str(out),
            "--jobs", "2", "--manual", str(course / "manual.csv"), "--timeout", "30"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "labkit.grading", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while len(list((out / "results").glob("*.json"))) < 4 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {p.name: p.stat().st_mtime_ns for p in (out / "results").glob("*.json")}
    deadline = time.monotonic() + 15  # SIGKILL is at once; one started in the kill's instant exits at its first check
    while _harnesses() and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = _harnesses()
    assert main(args) == 0
    return out, before, survivors


def test_a_killed_run_loses_nothing_and_leaves_no_process(graded):
    out, before, survivors = graded
    assert survivors == []  # the sandboxes died with the grader (bwrap --die-with-parent)
    assert 4 <= len(before) < N
    after = {p.name: p.stat().st_mtime_ns for p in (out / "results").glob("*.json")}
    assert len(after) == N + 1
    assert all(after[name] == mtime for name, mtime in before.items())  # graded once, not again


def test_the_gradebook_has_one_row_per_student_and_part_with_the_recorded_grades(graded):
    out, _, _ = graded
    rows = list(csv.DictReader((out / "gradebook.csv").open()))
    assert len(rows) == 2 * (N + 1)
    by = {(r["student"], r["grade_id"]): r for r in rows}
    for i in range(N):
        row = by[f"s{i:02d}", "scale_tests"]
        kind = kind_of(i)
        assert float(row["points"]) == KINDS[kind][1], (i, kind, row)
        assert row["status"] == ("ok" if kind == "right" else "failed")
        if kind in HINTS:
            assert HINTS[kind] in row["message"]
    assert by[f"s{N}", "scale_tests"]["message"] == "nothing handed in" and by[f"s{N}", "scale_tests"]["points"] == "0"
    assert (by["s00", "why"]["points"], by["s00", "why"]["status"], by["s00", "why"]["message"]) == \
        ("1", "hand-graded", "clear")
    assert by["s01", "why"]["points"] == "0.5" and by["s02", "why"]["status"] == "manual"
    book = json.loads((out / "gradebook.json").read_text())
    assert [s["score"] for s in book["students"][:2]] == [3, 0.5]
    assert len({s["seed"] for s in book["students"]}) == N + 1  # each student's own hidden cases


def test_the_summary_shows_the_histogram_the_failed_parts_and_the_hints(graded):
    out, _, _ = graded
    text = (out / "summary.txt").read_text()
    assert text.startswith(f"{N + 1} submissions; mean ")
    assert "score histogram:" in text and f"scale_tests            {N // 4 * 3 + 1} of {N + 1}" in text
    assert f"{N // 4} x with hysteresis=N, back off only when hysteresis_left reaches N" in text
    assert "tampering (not scored, review by hand): none" in text


def test_one_by_one_with_the_recorded_seed_gives_the_batch_grade(graded, course, tmp_path):
    out, _, _ = graded
    for student in ("s00", "s01"):  # right, and a bug only the hidden cases... and the visible ones show
        batch = json.loads((out / "results" / f"{student}.json").read_text())
        one = tmp_path / f"{student}.json"
        path = course / "submitted" / student / "ps0" / "ps0.ipynb"
        assert main(["grade", str(course / "source" / "ps0" / "ps0.ipynb"), str(path), "--json", str(one),
                     "--seed", str(batch["seed"]), "--include-manual"]) == 0
        assert json.loads(one.read_text())["parts"] == batch["parts"]


def test_a_flat_folder_and_bad_hand_graded_files_are_understood(tmp_path):
    for name in ("bob", "ada"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    assert [(s.student, s.path.name) for s in find(tmp_path, "ps0.ipynb")] == [("ada", "ada.ipynb"),
                                                                                ("bob", "bob.ipynb")]
    manual = tmp_path / "m.csv"
    for text, error in (("student,points\n", "missing ['grade_id']"), ("student,grade_id,points\neve,why,1\n",
                                                                      "line 2: no submission from 'eve'"),
                        ("student,grade_id,points\nada,why,3\n", "3 points for 'why', which is worth 1"),
                        ("student,grade_id,points\nada,how,1\n", "no graded part 'how'")):
        manual.write_text(text)
        with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
            read_manual(manual, {"scale_tests": 2, "why": 1}, {"ada", "bob"})
    assert summary({"students": []}) == "no submissions"
