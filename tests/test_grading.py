"""The graded exercises: release, grading a notebook in the sandbox, and nbgrader's own verdict.

A sandboxed run costs seconds (the harness imports torch), so each submission notebook is
graded once per module and several tests read the same report.
"""

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading.__main__ import main
from labkit.grading.notebook import CODE_STUB, TEXT_STUB, grade, release, validate

SOURCE = Path(__file__).parents[1] / "notebooks" / "exercises" / "ps1_clipping_and_scaling.ipynb"
AUTOGRADED = {"grad_norm_tests": 2, "clip_tests": 2, "skip_tests": 2, "scale_tests": 2, "step_tests": 3}
ANSWERS = {"grad_norm_tests": "grad_norm_answer", "clip_tests": "clip_answer", "skip_tests": "skip_answer",
           "scale_tests": "scale_answer", "step_tests": "step_answer"}


def sandboxed():
    """Skip without bubblewrap (grading refuses to run student code unsandboxed), except in CI."""
    if shutil.which("bwrap") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but bubblewrap is not installed: .ci/run must apt-get install bubblewrap")
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap); CI runs this test")


def gid(cell):
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def source():
    return nbformat.read(SOURCE, as_version=4)


def solution(gid_):
    """The instructor's answer, as a student would hand it in (markers gone)."""
    cell = next(c for c in source().cells if gid(c) == gid_)
    return "\n".join(line for line in cell.source.split("\n") if "### " not in line)


def submission(answers, *, delete=(), edit=None, prepend=()):
    """The student release with some answers filled in, cells deleted or edited, cells added on top."""
    nb = release(source())
    for cell in nb.cells:
        if gid(cell) in answers:
            cell.source = answers[gid(cell)]
        if gid(cell) in (edit or {}):
            cell.source = edit[gid(cell)]
    nb.cells = [c for c in nb.cells if gid(c) not in delete]
    nb.cells[1:1] = [nbformat.v4.new_code_cell(src) for src in prepend]
    return nb


def parts(report):
    return {p.grade_id: p for p in report.parts}


# ---------------------------------------------------------------- buggy answers a course sees

NORM_IN_FP16 = '''
def global_grad_norm(parameters):
    total = sum((p.grad ** 2).sum() for p in parameters if p.grad is not None)
    return torch.sqrt(torch.as_tensor(total)).float()
'''

INFINITE_LOOP = '''
def skip_reason(loss, parameters):
    while True:
        pass
'''

# backs off on every overflow, whatever the hysteresis: the stale copy of a copied cell
STALE_SCALE = '''
def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):
    if found_inf:
        return scale * config.backoff_factor, 0, max(hysteresis_left - 1, 0)
    if growth_tracker + 1 == config.growth_interval:
        return scale * config.growth_factor, 0, config.hysteresis
    return scale, growth_tracker + 1, hysteresis_left
'''

# clips the scaled gradients, and steps the scheduler whether or not the optimizer stepped
STEP_WITH_TWO_BUGS = '''
def guarded_step(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets, max_norm):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model(inputs), targets)
    scale = scaler.get_scale()
    if not math.isfinite(loss.item()):
        scheduler.step()
        return labkit.StepRecord(step, loss.item(), scale=scale, next_scale=scale, skipped=True,
                                 reason="nonfinite_loss")
    scaler.scale(loss).backward()
    norm = labkit.clip_grad_norm_(model.parameters(), max_norm)
    stepped = scaler.step(optimizer)
    scheduler.step()
    scaler.update()
    return labkit.StepRecord(step, loss.item(), grad_norm=norm.item(), scale=scale,
                             next_scale=scaler.get_scale(), skipped=not stepped,
                             reason=None if stepped else "nonfinite_grad")
'''


# ---------------------------------------------------------------- the source and its release


def test_source_is_valid_nbgrader_v3_with_five_graded_parts_and_a_written_one():
    nb = source()
    validate(nb)
    graded = {gid(c): c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
    assert {g: c.metadata.nbgrader.points for g, c in graded.items() if c.cell_type == "code"} == AUTOGRADED
    manual = [c for c in graded.values() if c.metadata.nbgrader.solution]
    assert len(manual) == 1 and manual[0].cell_type == "markdown"
    for cell in nb.cells:
        if "nbgrader" in cell.metadata:
            assert cell.metadata.nbgrader["schema_version"] == 3
    for answer in ANSWERS.values():
        assert "### BEGIN SOLUTION" in next(c for c in nb.cells if gid(c) == answer).source
    for test in AUTOGRADED:
        assert "### BEGIN HIDDEN TESTS" in next(c for c in nb.cells if gid(c) == test).source


def test_release_stubs_solutions_drops_hidden_tests_and_clears_outputs(released):
    src = {gid(c): c for c in source().cells if gid(c)}
    for cell in released.cells:
        assert "BEGIN SOLUTION" not in cell.source and "HIDDEN TESTS" not in cell.source
        assert "hidden=True" not in cell.source
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
        if gid(cell) in ANSWERS.values():
            assert CODE_STUB.split("\n")[1] in cell.source and cell.source.startswith(src[gid(cell)].source[:20])
            assert cell.metadata["deletable"] is False
        if gid(cell) in AUTOGRADED:
            assert cell.metadata["editable"] is False
    assert next(c for c in released.cells if gid(c) == "why_unscale_first").source == TEXT_STUB
    # the signature and docstring the student needs stay; only the marked region goes
    step = next(c for c in released.cells if gid(c) == "step_answer").source
    assert step.startswith("def guarded_step(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets")
    assert step.endswith("    # YOUR CODE HERE\n    raise NotImplementedError()")


def test_release_refuses_malformed_sources(tmp_path):
    nb = source()
    nb.cells[3].metadata.nbgrader.pop("grade_id")
    with pytest.raises(ValueError, match="no grade_id"):
        release(nb)
    nb = source()
    nb.cells[1].source += "\n### BEGIN SOLUTION\nx = 1"
    with pytest.raises(ValueError, match="no matching"):
        release(nb)
    nb = source()
    nb.cells[0].source += "\n### BEGIN HIDDEN TESTS\n### END HIDDEN TESTS"
    with pytest.raises(ValueError, match="not an autograder test cell"):
        release(nb)
    assert main(["release", str(SOURCE), "-o", str(SOURCE.parent)]) == 1  # would overwrite the source


# ---------------------------------------------------------------- graded once per module (a sandboxed run costs seconds)


@pytest.fixture(scope="module")
def metadata_lost_report(tmp_path_factory):
    """The instructor's solutions saved by a tool that dropped every cell's nbgrader metadata, graded by the CLI."""
    sandboxed()
    nb = source()
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    folder = tmp_path_factory.mktemp("lost")
    nbformat.write(nb, folder / "ada.ipynb")
    out = folder / "report.json"
    assert main(["grade", str(SOURCE), str(folder / "ada.ipynb"), "--json", str(out), "--include-manual"]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    folder = tmp_path_factory.mktemp("release")
    assert main(["release", str(SOURCE), "-o", str(folder)]) == 0
    return nbformat.read(folder / SOURCE.name, as_version=4)


@pytest.fixture(scope="module")
def release_report(released):
    """The blank release, except that part 1's answer cell fails its import and part 2's was deleted."""
    sandboxed()
    nb = copy.deepcopy(released)
    cell = next(c for c in nb.cells if gid(c) == "grad_norm_answer")
    cell.source = "from labkit.solutions import x\ndef global_grad_norm(parameters):\n    return x(parameters)"
    nb.cells = [c for c in nb.cells if gid(c) != "clip_answer"]
    return grade(source(), nb, timeout=20)


@pytest.fixture(scope="module")
def messy_report():
    """A partial submission that also loops forever, fails an import, games the tests and copies a cell.

    Part 1 takes the norm in fp16, its test cell edited to print "all good"; part 2 is solved and
    its test cell deleted; part 3 loops forever; part 4's answer cell was copied (the copy keeps
    its grade_id): the upper copy is stale and wrong, the lower one fixed; part 5 clips before
    unscaling and steps the scheduler on skips. The setup cell was edited to `pass`.
    """
    sandboxed()
    nb = submission(
        {"grad_norm_answer": NORM_IN_FP16, "clip_answer": solution("clip_answer"), "skip_answer": INFINITE_LOOP,
         "scale_answer": STALE_SCALE, "step_answer": STEP_WITH_TWO_BUGS},
        delete={"clip_tests"},
        edit={"grad_norm_tests": 'print("all good")', "setup": "pass"},
        prepend=["from labkit import answers_for_ps1  # there is no such thing"],
    )
    at = next(i for i, c in enumerate(nb.cells) if gid(c) == "scale_answer")
    fixed = copy.deepcopy(nb.cells[at])
    fixed.source = solution("scale_answer")
    nb.cells.insert(at + 1, fixed)
    return grade(source(), nb, timeout=12, student="messy")


def test_solutions_without_nbgrader_metadata_get_full_marks_with_a_warning(metadata_lost_report):
    report = metadata_lost_report
    assert report["score"] == sum(AUTOGRADED.values()) == 11
    assert report["max_score"] == 13  # --include-manual: the written question's 2 points count
    assert report["warnings"] == ["the submission has no nbgrader metadata (saved by another tool?): graded the "
                                  "functions its code defines, top to bottom"]
    assert report["tampering"] == [] and report["sandbox"] == "bwrap"
    by_id = {p["grade_id"]: p for p in report["parts"]}
    for test, points in AUTOGRADED.items():
        assert by_id[test]["points"] == points and by_id[test]["message"] == "" and by_id[test]["status"] == "ok"
        assert isinstance(by_id[test]["seed"], int)  # every part has hidden cases, and says which
    assert by_id["why_unscale_first"]["points"] == 0 and by_id["why_unscale_first"]["status"] == "manual"
    assert set(report) == {"score", "max_score", "parts", "seed", "tampering", "warnings", "sandbox"}


def test_release_scores_zero_and_every_part_says_what_to_do(release_report):
    assert release_report.score() == 0 and release_report.max_score() == 11
    assert release_report.to_dict()["max_score"] == 11 and len(release_report.to_dict()["parts"]) == 5
    by_id = parts(release_report)
    for test, answer in list(ANSWERS.items())[2:]:
        fn = {"grad_norm_answer": "global_grad_norm", "clip_answer": "clip_to_norm_", "skip_answer": "skip_reason",
              "scale_answer": "next_scale", "step_answer": "guarded_step"}[answer]
        assert by_id[test].points == 0 and by_id[test].max_points == AUTOGRADED[test]
        assert by_id[test].message == f"{fn} is not implemented yet: replace `raise NotImplementedError()` with your code."
    assert by_id["why_unscale_first"].manual and by_id["why_unscale_first"].message == "not answered"
    assert release_report.format().splitlines()[-1].split()[:4] == ["score", "0", "/", "11"]
    assert "TCP" not in release_report.output  # no kernel, no ipykernel warning about unencrypted TCP


def test_partial_submission_gets_exactly_the_points_it_earned(messy_report):
    by_id = parts(messy_report)
    assert {g: by_id[g].points for g in AUTOGRADED} == {
        "grad_norm_tests": 0, "clip_tests": 2, "skip_tests": 0, "scale_tests": 2, "step_tests": 0}
    assert messy_report.score() == 4 and messy_report.max_score() == 11


def test_each_classic_bug_gets_its_hint(messy_report):
    by_id = parts(messy_report)
    assert "your norm overflowed to inf on fp16 gradients: accumulate in float32" in by_id["grad_norm_tests"].message
    step = by_id["step_tests"].message
    assert "differs by a factor of ~" in step and "did you clip before unscaling?" in step
    assert "the scheduler advanced on a skipped step" in step


def test_an_infinite_loop_is_interrupted_and_later_parts_are_still_graded(messy_report):
    by_id = parts(messy_report)
    assert by_id["skip_tests"].message.startswith("skip_reason ran longer than 12 s on case #1 of check_skip_decision")
    assert by_id["scale_tests"].points == 2 and by_id["step_tests"].status == "failed"  # graded after the loop


def test_edited_deleted_or_locked_cells_change_nothing(messy_report):
    by_id = parts(messy_report)
    assert by_id["clip_tests"].points == 2  # its test cell deleted: the grader's calls don't live in the notebook
    assert by_id["grad_norm_tests"].points == 0  # test cell edited to print "all good": never run
    assert by_id["scale_tests"].points == 2  # setup edited to `pass` (and an import that fails): restored


def test_a_copied_answer_cell_is_graded_as_the_notebook_runs_and_said_so(messy_report):
    assert messy_report.warnings == [
        "'scale_answer' is in 2 cells (a copied cell keeps its grade_id): graded what the notebook defines run top "
        "to bottom, i.e. the last copy wins; delete the stale copy"]
    assert "warning: 'scale_answer' is in 2 cells" in messy_report.format()


def test_a_failing_or_missing_answer_cell_is_named_in_its_part(release_report):
    by_id = parts(release_report)
    assert by_id["grad_norm_tests"].message == (
        "global_grad_norm is not defined (cell 4 'grad_norm_answer' raised ModuleNotFoundError: No module named "
        "'labkit.solutions').")
    assert by_id["clip_tests"].message == "clip_to_norm_ is not defined: run its answer cell, and keep the function's name."


def test_an_unreadable_submission_is_graded_zero_with_exit_code_0(tmp_path, capsys):
    bad = tmp_path / "broken.ipynb"
    bad.write_text("{ not json")
    out = tmp_path / "report.json"
    assert main(["grade", str(SOURCE), str(bad), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["score"] == 0 and report["max_score"] == 11
    assert all(p["message"].startswith("the submission is not a readable notebook: not JSON") for p in report["parts"])
    assert "score" in capsys.readouterr().out


def test_cli_rejects_bad_arguments_and_sources(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["grade", str(SOURCE)])
    assert exit_.value.code == 2
    assert main(["grade", str(SOURCE), str(SOURCE), "--timeout", "0"]) == 2
    assert main(["grade", str(SOURCE), str(tmp_path), "--jobs", "0"]) == 2
    assert main(["grade", str(SOURCE), str(tmp_path)]) == 2  # a folder needs --out
    broken = source()
    broken.cells[3].metadata.nbgrader.pop("grade_id")
    path = tmp_path / "broken_source.ipynb"
    nbformat.write(broken, path)
    assert main(["grade", str(path), str(SOURCE)]) == 1
    assert "no grade_id" in capsys.readouterr().err
    custom = source()
    custom.cells[4].source += "\nassert global_grad_norm([]) == 0"
    nbformat.write(custom, path)
    assert main(["grade", str(path), str(SOURCE)]) == 1
    assert "the grader replays only labkit.grading's check_*(function_name" in capsys.readouterr().err


def test_the_cli_starts_without_torch_and_labkit_dispatches_to_it():
    code = ("import sys, labkit.grading.__main__ as m, labkit.grading.batch, labkit.grading.notebook\n"
            "assert 'torch' not in sys.modules and 'nbformat' not in sys.modules, sorted(sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
    done = subprocess.run([sys.executable, "-m", "labkit", "grading", "grade", "--help"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and "--jobs" in done.stdout and "--seed" in done.stdout


# ---------------------------------------------------------------- nbgrader itself (installed in CI)


@pytest.fixture
def nbgrader_env(tmp_path):
    """A course folder and a HOME in tmp, so nbgrader's config, database and runtime files stay there."""
    if importlib.util.find_spec("nbgrader") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but nbgrader is not installed: .ci/run must pip install -r requirements-nbgrader.txt")
        pytest.skip("nbgrader is not installed (pip install -r requirements-nbgrader.txt); CI runs this test")
    home = tmp_path / "home"
    course = tmp_path / "course"
    (course / "source" / "ps1").mkdir(parents=True)
    shutil.copy(SOURCE, course / "source" / "ps1" / SOURCE.name)
    (course / "nbgrader_config.py").write_text(
        f"c = get_config()\nc.CourseDirectory.root = {str(course)!r}\nc.CourseDirectory.course_id = 'labkit'\n")
    env = dict(os.environ, HOME=str(home), JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_DATA_DIR=str(home / "data"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               # nbgrader runs alembic (its database migrations) as a command
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return course, env


def nbgrader(args, course, env):
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.nbgrader
def test_nbgrader_validates_the_source_and_releases_the_same_student_notebook(nbgrader_env):
    course, env = nbgrader_env
    out = nbgrader(["validate", str(course / "source" / "ps1" / SOURCE.name)], course, env)
    assert "Success! Your notebook passes all the tests." in out
    nbgrader(["generate_assignment", "ps1", "--force"], course, env)
    theirs = nbformat.read(course / "release" / "ps1" / SOURCE.name, as_version=4)
    ours = release(source())
    assert [c.source for c in theirs.cells] == [c.source for c in ours.cells]
    assert [c.cell_type for c in theirs.cells] == [c.cell_type for c in ours.cells]
    for a, b in zip(theirs.cells, ours.cells):  # the same locks, so JupyterLab behaves the same
        assert (a.metadata.get("editable", True), a.metadata.get("deletable", True)) == \
            (b.metadata.get("editable", True), b.metadata.get("deletable", True))
