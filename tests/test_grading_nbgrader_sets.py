"""labkit's grade against real nbgrader's ``autograde``, part by part, on honest submissions of ps2-ps4.

One course holds the three sets (one ``nbgrader`` start for their autograde): each set's source as
``source/<set>``, ``nbgrader generate_assignment``, students who start from nbgrader's release (two
carrying correct code in other forms wherever they carry no bug, and classic bugs that each lose
exactly their part), ``nbgrader autograde``, and nbgrader's gradebook read back. nbgrader runs the
test cells in the student's kernel with hidden cases from a fresh random seed, labkit runs the same
checks' halves apart, seeded, in its sandbox: on honest code the verdicts must be the same. The
instructor's code is graded by labkit here and not by nbgrader: a kernel running it with the hidden
tests is what nbval does to the source on every run (and the browser test too), two kernels fewer.
(ps1's: tests/test_grading_nbgrader.py; a module each, so the two run side by side.)
"""

import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading.notebook import grade, read

sys.path.insert(0, str(Path(__file__).parent))
import grading_answers as ga  # noqa: E402
from test_grading import nbgrader, nbgrader_env, sandboxed  # noqa: E402,F401 (nbgrader_env is a fixture)

pytestmark = [pytest.mark.nbgrader, pytest.mark.timeout(600)]

# each student starts from nbgrader's release; cy and di carry correct code in other forms wherever they
# carry no bug, so every part's other form is graded by nbgrader too (a third student for them would cost
# a kernel per set). A bug only the hidden cases show (cy's in read_run and in lost_fraction): nbgrader's
# 0 there proves it ran them
SET_BUGS = {
    ga.PS2: {"cy": ("counts every skip as a backoff", "a NaN enters the z-score statistics"),
             "di": ("subnormals counted as flushed", "skipped spikes enter the window",
                    "measures the gradient, not the update")},
    ga.PS3: {"cy": ("a tie never rounds away", "one scale for the whole tensor"),
             "di": ("the compensation's sign is flipped", "this step's amax is already in the history")},
    ga.PS4: {"cy": ("v_hat without its bias correction", "the RMS spike read at record.step"),
             "di": ("the weight decay with the unclipped lr",)},
}


def set_students(path):
    """Each student's answers by grade_id, and the points each autograded part is worth to them."""
    solved = ga.solutions(path)
    out = {"ada": (solved, dict(ga.PARTS[path]))}
    for student, bugs in SET_BUGS[path].items():
        cells, points = {gid: ga.OTHER_FORMS[gid] for gid in solved}, dict(ga.PARTS[path])
        for bug in bugs:
            gid, source, test, _ = ga.BUGS[bug]
            cells[gid], points[test] = source, 0
        out[student] = (cells, points)
    return out


@pytest.fixture
def sets_autograded(request):
    """nbgrader's and labkit's grades of ps2, ps3 and ps4: {set: {student: {grade_id: points or Part}}}."""
    sandboxed()
    course, env = request.getfixturevalue("nbgrader_env")
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    files = {}
    for path in (ga.PS2, ga.PS3, ga.PS4):
        name = path.stem.split("_")[0]
        (course / "source" / name).mkdir()
        shutil.copy(path, course / "source" / name / path.name)
        nbgrader(["generate_assignment", name, "--force"], course, env)
        for student, (cells, _) in set_students(path).items():
            nb = nbformat.read(course / "release" / name / path.name, as_version=4)  # what they downloaded
            for cell in nb.cells:
                gid = cell.metadata.get("nbgrader", {}).get("grade_id")
                if gid in cells:
                    cell.source = cells[gid].strip("\n")
                elif gid in ("why_rewind", "why_e5m2", "why_update_clip"):
                    cell.source = "An answer."
            handed = "labkit-only" if student == "ada" else "submitted"  # nbgrader autogrades submitted/
            files[path, student] = course / handed / student / name / path.name
            files[path, student].parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, files[path, student])
    nbgrader(["autograde", "ps[234]", "--force", "--Execute.timeout=180"], course, env)  # the sets, one start
    ran = nbformat.read(course / "autograded" / "cy" / "ps3" / ga.PS3.name, as_version=4)
    assert "check_stale_fraction(lost_fraction, hidden=True)" in next(  # nbgrader put the hidden tests back
        c.source for c in ran.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "stale_tests")
    from nbgrader.api import Gradebook

    theirs, ours = {}, {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for path, student in files:
            if student == "ada":
                continue
            submitted = gb.find_submission_notebook(path.stem, path.stem.split("_")[0], student)
            theirs.setdefault(path, {})[student] = {g.name: g.score for g in submitted.grades
                                                    if g.name in ga.PARTS[path]}
    for (path, student), file in files.items():
        report = grade(read(path), read(file), student=student, timeout=60)
        assert report.tampering == [] and report.warnings == [], (student, report.format())
        ours.setdefault(path, {})[student] = {p.grade_id: p for p in report.parts if not p.manual}
    return theirs, ours


def test_labkit_and_nbgrader_agree_part_by_part_on_problem_sets_2_3_and_4(sets_autograded):
    theirs, ours = sets_autograded
    for path in (ga.PS2, ga.PS3, ga.PS4):
        for student, (_, points) in set_students(path).items():
            if student != "ada":
                assert theirs[path][student] == points, ("nbgrader", path.stem, student,
                                                         theirs[path][student])
            assert {gid: p.points for gid, p in ours[path][student].items()} == points, \
                ("labkit", path.stem, student, {g: (p.points, p.message)
                                                for g, p in ours[path][student].items()})
        for student, bugs in SET_BUGS[path].items():  # and labkit says why each lost part was lost
            for bug in bugs:
                _, _, test, hint = ga.BUGS[bug]
                assert hint in ours[path][student][test].message, (bug, ours[path][student][test].message)
