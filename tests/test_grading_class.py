"""Grading a class of 40: a folder with --jobs 2, killed midway and resumed, against one-by-one grading.

The problem set has two cheap autograded parts (the skip decision, the loss-scale rule) and a
written one, so a sandboxed run costs little more than its floor, starting Python and importing
torch (~1.9 s on an AMD EPYC core). The module grades 40 submissions twice: as a class
(--jobs 2, killed by SIGKILL after some results, then the same command again) and one by one
(the ``grade`` command on each file): ~82 sandboxed runs, ~2 min on 2 cores.
"""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from labkit.grading.__main__ import main
from labkit.grading.batch import find, read_manual, summary
from labkit.grading.notebook import WORK, release, sweep

sys.path.insert(0, str(Path(__file__).parent))
from test_grading import sandboxed  # noqa: E402

N = 40
KILL_AFTER = 10  # results on disk when the grader is killed
pytestmark = pytest.mark.timeout(900)  # one module fixture grades the class twice: minutes under load
SETUP = "import math\nimport torch\nimport labkit"
SKIP = '''def skip_reason(loss, parameters):
    """Return why this step must be skipped ('nonfinite_loss' or 'nonfinite_grad'), or None to step."""
{body}'''
SKIP_RIGHT = """    if not torch.isfinite(loss).all():
        return "nonfinite_loss"
    for p in parameters:
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return "nonfinite_grad"
    return None"""
SCALE = '''def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):
    """Return the next (scale, growth_tracker, hysteresis_left) after one step."""
{body}'''
SCALE_RIGHT = """    if found_inf:
        hysteresis_left = max(hysteresis_left - 1, 0)
        return (scale * config.backoff_factor if hysteresis_left == 0 else scale), 0, hysteresis_left
    if growth_tracker + 1 == config.growth_interval:
        return scale * config.growth_factor, 0, config.hysteresis
    return scale, growth_tracker + 1, hysteresis_left"""
STUB = "    # YOUR CODE HERE\n    raise NotImplementedError()"
# what a class hands in: (skip body, scale body, points of skip_tests, points of scale_tests, a hint it must get)
KINDS = {
    "right": (SKIP_RIGHT, SCALE_RIGHT, 2, 2, None),
    "no hysteresis": (SKIP_RIGHT, SCALE_RIGHT.replace("if hysteresis_left == 0 else scale", "if True else scale"),
                      2, 0, "back off only when hysteresis_left reaches 0"),
    "stub": (STUB, STUB, 0, 0, "is not implemented yet"),
    "grows early": (SKIP_RIGHT, SCALE_RIGHT.replace("growth_tracker + 1 == config.growth_interval",
                                                    "growth_tracker + 2 >= config.growth_interval"),
                    2, 0, "the scale grew too early"),
    "NaN loss only": ("    return 'nonfinite_loss' if torch.isnan(loss) else None", SCALE_RIGHT, 0, 2,
                      "expected 'nonfinite_grad'"),
    # finite grads on the visible NaN-loss case: only the hidden "NaN loss and NaN gradients" catches it
    "gradients first": ("\n".join(SKIP_RIGHT.split("\n")[2:5] + SKIP_RIGHT.split("\n")[:2] + ["    return None"]),
                        SCALE_RIGHT, 0, 2, "check the loss first"),
}


def meta(gid, **flags):
    return {"nbgrader": {"grade": False, "solution": False, "locked": False, "grade_id": gid, "schema_version": 3,
                         **flags}}


def problem_set():
    cells = [
        nbformat.v4.new_markdown_cell("# Problem set 0: skip or step, and the loss-scale rule"),
        nbformat.v4.new_code_cell(SETUP, metadata=meta("setup", locked=True)),
        nbformat.v4.new_code_cell(SKIP.format(body="    ### BEGIN SOLUTION\n" + SKIP_RIGHT + "\n    ### END SOLUTION"),
                                  metadata=meta("skip_answer", solution=True)),
        nbformat.v4.new_code_cell("from labkit.grading import check_skip_decision\ncheck_skip_decision(skip_reason)\n"
                                  "### BEGIN HIDDEN TESTS\ncheck_skip_decision(skip_reason, hidden=True)\n"
                                  "### END HIDDEN TESTS", metadata=meta("skip_tests", grade=True, locked=True, points=2)),
        nbformat.v4.new_code_cell(SCALE.format(body="    ### BEGIN SOLUTION\n" + SCALE_RIGHT + "\n    ### END SOLUTION"),
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


def student(i):
    return f"s{i:02d}"


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """nbgrader's layout: source/ps0/ps0.ipynb and submitted/<student>/ps0/ps0.ipynb; s40 handed nothing in."""
    root = tmp_path_factory.mktemp("course")
    src = root / "source" / "ps0" / "ps0.ipynb"
    src.parent.mkdir(parents=True)
    nbformat.write(problem_set(), src)
    for i in range(N):
        skip, scale = KINDS[kind_of(i)][:2]
        nb = problem_set()
        nb.cells[2].source = SKIP.format(body=skip)
        nb.cells[4].source = SCALE.format(body=scale)
        nb.cells[6].source = "Because the scale multiplies the norm."
        path = root / "submitted" / student(i) / "ps0" / "ps0.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(nb, path)
    (root / "submitted" / student(N)).mkdir()
    (root / "manual.csv").write_text("student,grade_id,points,comment\ns00,why,1,clear\ns01,why,0.5,half of it\n")
    return root


def _in_sandbox_of(prefix):
    """PIDs of harness processes whose sandbox binds a folder named ``prefix``* (their /out), wherever they hang."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (b"labkit.grading.harness" in Path(f"/proc/{pid}/cmdline").read_bytes()
                    and prefix in Path(f"/proc/{pid}/mountinfo").read_text()):
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def graded(course):
    """Start the class with --jobs 2, SIGKILL the grader after some results, then run the same command again.

    A private TMPDIR holds the graders' work folders, so what the killed one left is seen here.
    """
    sandboxed()
    out, tmp = course / "grades", course / "tmp"
    tmp.mkdir()
    args = ["grade", str(course / "source" / "ps0" / "ps0.ipynb"), str(course / "submitted"), "--out", str(out),
            "--jobs", "2", "--manual", str(course / "manual.csv"), "--timeout", "30"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), TMPDIR=str(tmp))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "labkit.grading", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(list((out / "results").glob("*.json"))) < KILL_AFTER and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_after = time.monotonic() - start
    before = {p.name: p.stat().st_mtime_ns for p in (out / "results").glob("*.json")}
    mine = f"{WORK}{proc.pid}."
    deadline = time.monotonic() + 15  # bwrap's --die-with-parent is at once; a sandbox starting in the kill's
    while _in_sandbox_of(mine) and time.monotonic() < deadline:  # instant ends at the harness's first check
        time.sleep(0.2)
    survivors = _in_sandbox_of(mine)
    left = sorted(p.name for p in tmp.glob(mine + "*"))
    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp)  # the resumed run (in this process) works in the same TMPDIR
    try:
        assert main(args) == 0
    finally:
        tempfile.tempdir = saved
    return {"out": out, "before": before, "survivors": survivors, "left": left, "tmp": tmp, "mine": mine,
            "killed_after": killed_after}


@pytest.fixture(scope="module")
def one_by_one(course, tmp_path_factory):
    """Each submission graded alone by the ``grade`` command, as <student>.ipynb (so its own seed is derived)."""
    folder = tmp_path_factory.mktemp("alone")
    reports = {}
    for i in range(N):
        path = folder / f"{student(i)}.ipynb"
        shutil.copy(course / "submitted" / student(i) / "ps0" / "ps0.ipynb", path)
        assert main(["grade", str(course / "source" / "ps0" / "ps0.ipynb"), str(path), "--json",
                     str(folder / f"{student(i)}.json"), "--include-manual", "--timeout", "30"]) == 0
        reports[student(i)] = json.loads((folder / f"{student(i)}.json").read_text())
    return reports


def test_a_killed_run_loses_nothing_and_leaves_no_process(graded):
    out, before = graded["out"], graded["before"]
    assert graded["survivors"] == []  # the sandboxes died with the grader (bwrap --die-with-parent)
    assert KILL_AFTER <= len(before) < N, graded["killed_after"]
    after = {p.name: p.stat().st_mtime_ns for p in (out / "results").glob("*.json")}
    assert len(after) == N + 1
    assert all(after[name] == mtime for name, mtime in before.items())  # graded once, not again


def test_the_killed_graders_work_folders_are_swept_by_the_next_run(graded):
    # two submissions were in flight when the grader died; their folders outlived it, until the resumed run
    assert 1 <= len(graded["left"]) <= 2, graded["left"]
    assert list(graded["tmp"].glob(graded["mine"] + "*")) == []
    assert list(graded["tmp"].iterdir()) == []  # and the resumed run cleaned up after itself


def test_sweep_removes_only_the_folders_of_dead_graders(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    started = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    alive = tmp_path / f"{WORK}{os.getpid()}.{started}-abc"  # this process: a grader still running
    reused = tmp_path / f"{WORK}{os.getpid()}.1-abc"  # this PID, but another process's start time
    gone = tmp_path / f"{WORK}{dead}.{started}-xyz"
    other = tmp_path / "labkit-grade-old"  # not named for a grader: left alone
    for folder in (alive, reused, gone, other):
        (folder / "out").mkdir(parents=True)
        (folder / "out" / "status").write_text("cell 3")
    assert sorted(sweep(tmp_path)) == sorted([reused, gone])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


def test_the_class_gets_the_grades_of_one_by_one_part_by_part_seed_by_seed(graded, one_by_one):
    out = graded["out"]
    for i in range(N):
        batch = json.loads((out / "results" / f"{student(i)}.json").read_text())
        alone = one_by_one[student(i)]
        assert alone["seed"] == batch["seed"], student(i)
        assert alone["parts"] == batch["parts"], (student(i), kind_of(i))
        assert (alone["score"], alone["tampering"], alone["warnings"]) == (batch["score"], [], [])


def test_the_gradebook_has_one_row_per_student_and_part_with_the_earned_points(graded, one_by_one):
    out = graded["out"]
    rows = list(csv.DictReader((out / "gradebook.csv").open()))
    assert [(r["student"], r["grade_id"]) for r in rows] == [
        (student(i), gid) for i in range(N + 1) for gid in ("skip_tests", "scale_tests", "why")]
    by = {(r["student"], r["grade_id"]): r for r in rows}
    for i in range(N):
        _, _, skip, scale, hint = KINDS[kind_of(i)]
        for gid, points in (("skip_tests", skip), ("scale_tests", scale)):
            row = by[student(i), gid]
            assert (float(row["points"]), row["max_points"]) == (points, "2"), (i, kind_of(i), row)
            assert row["status"] == ("ok" if points else "failed")
            assert (row["message"] == "") == bool(points), row
            assert hint is None or points or hint in row["message"], (i, row["message"])
            assert int(row["seed"]) == next(p["seed"] for p in one_by_one[student(i)]["parts"] if p["grade_id"] == gid)
    nothing = [by[student(N), gid] for gid in ("skip_tests", "scale_tests")]
    assert [(r["points"], r["status"], r["message"]) for r in nothing] == [("0", "failed", "nothing handed in")] * 2
    assert (by["s00", "why"]["points"], by["s00", "why"]["status"], by["s00", "why"]["message"]) == \
        ("1", "hand-graded", "clear")
    assert (by["s01", "why"]["points"], by["s01", "why"]["message"]) == ("0.5", "half of it")
    assert (by["s02", "why"]["points"], by["s02", "why"]["status"]) == ("0", "manual")
    book = json.loads((out / "gradebook.json").read_text())
    scores = {s["student"]: s["score"] for s in book["students"]}
    assert scores == {**{student(i): sum(KINDS[kind_of(i)][2:4]) for i in range(N)}, student(N): 0,
                      "s00": 5, "s01": 0.5 + 2}  # s00 right (4) + 1 written; s01 no hysteresis (2) + 0.5
    assert all(s["max_score"] == 5 for s in book["students"])
    assert len({s["seed"] for s in book["students"]}) == N + 1  # each student's own hidden cases


def test_the_summary_shows_the_histogram_the_failed_parts_and_the_hints(graded):
    text = (graded["out"] / "summary.txt").read_text()
    lines = text.splitlines()
    counts = {kind: sum(kind_of(i) == kind for i in range(N)) for kind in KINDS}
    fails = {gid: 1 + sum(n for kind, n in counts.items() if not KINDS[kind][k])
             for gid, k in (("skip_tests", 2), ("scale_tests", 3))}  # + the one who handed nothing in
    mean = (sum(sum(KINDS[kind_of(i)][2:4]) for i in range(N)) + 1 + 0.5) / (N + 1)
    assert lines[0] == f"{N + 1} submissions; mean {mean:.2f} / 5"
    histogram = {line.split()[0]: int(line.split()[-1]) for line in lines[2:12]}
    assert histogram["0.0-0.5"] == counts["stub"] + 1  # and the one who handed nothing in
    assert histogram["2.0-2.5"] == N - counts["stub"] - counts["right"] - 1  # s01 has 2.5: the next bin
    assert histogram["2.5-3.0"] == 1 and histogram["4.0-4.5"] == counts["right"] - 1 and histogram["4.5-5.0"] == 1
    for gid, n in fails.items():
        assert f"  {gid:<20} {n:>4} of {N + 1}" in lines
    assert f"  {counts['no hysteresis']:>4} x with hysteresis=N, back off only when hysteresis_left reaches N (it " \
           "counts the overflows since the last growth), not on every overflow." in lines
    assert f"  {counts['grows early']:>4} x the scale grew too early: it grows only after" in text
    assert lines[-1] == "tampering (not scored, review by hand): none"


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


# ---------------------------------------------------------------- a class that hands in ps1, ps2 and ps3

import grading_answers as ga  # noqa: E402
from test_grading import SOURCE as PS1  # noqa: E402
from test_grading import solution as ps1_solution  # noqa: E402

# who handed in what: a set's source grades its own notebooks in the shared submitted/ folder, and everyone else in
# the class as "nothing handed in" (no sandbox run for them)
HANDED_IN = {
    "s1": {PS1: "solved", ga.PS2: ("counts every skip as a backoff", "a NaN enters the z-score statistics")},
    "s2": {ga.PS3: ("the compensation's sign is flipped", "this step's amax is already in the history")},
    "s3": {},  # nothing at all
}


def expected_points(path, work):
    parts = {"grad_norm_tests": 2, "clip_tests": 2, "skip_tests": 2, "scale_tests": 2, "step_tests": 3} \
        if path == PS1 else ga.PARTS[path]
    lost = {ga.BUGS[bug][2] for bug in work} if isinstance(work, tuple) else set()
    return {gid: 0 if gid in lost else points for gid, points in parts.items()}


@pytest.fixture(scope="module")
def mixed_class(tmp_path_factory):
    """nbgrader's submitted/<student>/<assignment>/<notebook> with three sets, each graded by its own source."""
    sandboxed()
    root = tmp_path_factory.mktemp("mixed")
    for student, sets in HANDED_IN.items():
        for path, work in sets.items():
            nb = release(nbformat.read(path, as_version=4))
            answers = {gid: ps1_solution(gid) for gid in ("grad_norm_answer", "clip_answer", "skip_answer",
                                                          "scale_answer", "step_answer")} if path == PS1 \
                else {**ga.solutions(path), **{ga.BUGS[b][0]: ga.BUGS[b][1] for b in work if isinstance(work, tuple)}}
            for cell in nb.cells:
                gid = cell.metadata.get("nbgrader", {}).get("grade_id")
                if gid in answers:
                    cell.source = answers[gid]
            target = root / "submitted" / student / path.stem.split("_")[0] / path.name
            target.parent.mkdir(parents=True)
            nbformat.write(nb, target)
        (root / "submitted" / student).mkdir(parents=True, exist_ok=True)
    books = {}
    for path in (PS1, ga.PS2, ga.PS3):
        out = root / f"grades-{path.stem}"
        assert main(["grade", str(path), str(root / "submitted"), "--out", str(out), "--jobs", "2"]) == 0
        books[path] = (json.loads((out / "gradebook.json").read_text()), (out / "summary.txt").read_text())
    return books


def test_a_class_handing_in_three_sets_gets_each_set_graded_by_its_own_source(mixed_class):
    for path, (book, summary_text) in mixed_class.items():
        by_student = {s["student"]: s for s in book["students"]}
        assert sorted(by_student) == ["s1", "s2", "s3"]  # the whole class, in every set's gradebook
        for student, entry in by_student.items():
            work = HANDED_IN[student].get(path)
            points = {p["grade_id"]: p["points"] for p in entry["parts"] if p["status"] != "manual"}
            if work is None:
                assert {p["message"] for p in entry["parts"] if p["status"] != "manual"} == {"nothing handed in"}
                assert entry["score"] == 0
            else:
                assert points == expected_points(path, work), (path.stem, student, entry["parts"])
                assert entry["tampering"] == [] and entry["warnings"] == []
        assert summary_text.startswith("3 submissions;")
    ps2 = {s["student"]: s for s in mixed_class[ga.PS2][0]["students"]}
    assert "A backoff is next_scale < scale" in next(p["message"] for p in ps2["s1"]["parts"]
                                                     if p["grade_id"] == "read_run_tests")
