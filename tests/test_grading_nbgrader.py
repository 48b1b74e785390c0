"""labkit's grade against real nbgrader's ``autograde``, part by part, on honest submissions of ps1.

A course directory in tmp: ps1's instructor notebook as ``source/ps1``, ``nbgrader
generate_assignment``, four students who start from nbgrader's release (the instructor's code;
correct code in other forms; two with classic bugs that each lose exactly their part), ``nbgrader
autograde ps1``, and nbgrader's gradebook read back with ``nbgrader.api.Gradebook``. nbgrader runs
the test cells in the student's kernel with hidden cases from a fresh random seed; labkit runs the
same checks' halves apart, seeded: on honest code the verdicts must be the same. Attacks are where
they differ on purpose (tests/test_grading_attacks.py): nbgrader gives them full marks.
"""

import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading.notebook import grade, read

sys.path.insert(0, str(Path(__file__).parent))
from test_grading import (  # noqa: E402
    AUTOGRADED,
    NORM_IN_FP16,
    SOURCE,
    STALE_SCALE,
    nbgrader,
    nbgrader_env,  # noqa: F401 (a fixture: pytest finds it by name in this module)
    sandboxed,
    solution,
)

pytestmark = [pytest.mark.nbgrader, pytest.mark.timeout(600)]
ANSWERS = ("grad_norm_answer", "clip_answer", "skip_answer", "scale_answer", "step_answer")

# correct, but not the instructor's way: a norm scaled by the largest gradient (NaN, not inf, for an
# inf gradient: the spec allows either), the student's own norm in the clip, a Python loop with
# math.isfinite, the rule written the other way round, labkit.clip_grad_norm_ after unscale_
OTHER_FORMS = {
    "grad_norm_answer": '''
def global_grad_norm(parameters):
    """Return the L2 norm of all parameters' .grad seen as one vector, as a 0-dim float32 tensor."""
    grads = [p.grad.float() for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    # scaled by the largest magnitude first, so no square overflows (and an inf gradient gives NaN: inf / inf)
    biggest = torch.stack([g.abs().max() if g.numel() else torch.tensor(0.0) for g in grads]).max()
    safe = torch.where(biggest > 0, biggest, torch.ones_like(biggest))
    return safe * torch.sqrt(sum(((g / safe) ** 2).sum() for g in grads))
''',
    "clip_answer": '''
def clip_to_norm_(parameters, max_norm):
    """Clip all .grad in place to a global L2 norm of max_norm; return the pre-clip norm."""
    parameters = list(parameters)
    total = global_grad_norm(parameters)
    factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
    factor = torch.where(total.isfinite(), factor, torch.tensor(1.0))
    for p in parameters:
        if p.grad is None:
            continue
        p.grad.mul_(factor.to(p.grad.dtype))
    return total
''',
    "skip_answer": '''
def skip_reason(loss, parameters):
    """Return None to step, or why to skip: "nonfinite_loss" or "nonfinite_grad"."""
    if not math.isfinite(loss.item()):
        return "nonfinite_loss"
    for p in parameters:
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return "nonfinite_grad"
    return None
''',
    "scale_answer": '''
def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):
    """Return the next (scale, growth_tracker, hysteresis_left) after one step."""
    if not found_inf:
        if growth_tracker + 1 < config.growth_interval:
            return scale, growth_tracker + 1, hysteresis_left
        return scale * config.growth_factor, 0, config.hysteresis
    left = hysteresis_left - 1 if hysteresis_left > 0 else 0
    new_scale = scale * config.backoff_factor if left == 0 else scale
    return new_scale, 0, left
''',
    "step_answer": '''
def guarded_step(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets, max_norm):
    """Run one guarded fp16 training step on (inputs, targets); return its labkit.StepRecord."""
    device = next(model.parameters()).device.type
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = loss_fn(model(inputs), targets)
    scale = scaler.get_scale()
    if not torch.isfinite(loss).item():
        return labkit.StepRecord(step, loss.item(), scale=scale, next_scale=scale, skipped=True,
                                 reason="nonfinite_loss")
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = labkit.clip_grad_norm_(model.parameters(), max_norm)
    stepped = scaler.step(optimizer)
    if stepped:
        scheduler.step()
    scaler.update()
    return labkit.StepRecord(step, loss.item(), grad_norm=norm.item(), scale=scale,
                             next_scale=scaler.get_scale(), skipped=not stepped,
                             reason=None if stepped else "nonfinite_grad")
''',
}
SKIP_NAN_ONLY = '''
def skip_reason(loss, parameters):
    return "nonfinite_loss" if torch.isnan(loss) else None
'''


def students():
    """Each student's answers by grade_id, and the points each autograded part is worth to them."""
    solved = {a: solution(a) for a in ANSWERS}
    no_unscale = "\n".join(
        line for line in solved["step_answer"].split("\n") if "scaler.unscale_(" not in line
    )
    every = dict(AUTOGRADED)
    return {
        "ada": (solved, every),  # the instructor's code
        "bo": (OTHER_FORMS, every),
        # the norm's squares in fp16 (overflow: only the hidden cases have large fp16
        # gradients, so nbgrader's 0 on this part shows it ran them); backs off on every
        # overflow, whatever the hysteresis
        "cy": ({**solved, "grad_norm_answer": NORM_IN_FP16, "scale_answer": STALE_SCALE},
               {**every, "grad_norm_tests": 0, "scale_tests": 0}),
        # only a NaN loss skips; clips the scaled gradients (no unscale_ before the norm; on a
        # skipped step it calls scaler.update() with no inf check recorded and labkit's GradScaler
        # raises ScalerUsageError: labkit used to ship that exception object, the grader could not
        # load it and reported tampering, 0/11, where nbgrader gave 6)
        "di": ({**solved, "skip_answer": SKIP_NAN_ONLY, "step_answer": no_unscale},
               {**every, "skip_tests": 0, "step_tests": 0}),
    }


@pytest.fixture
def autograded(nbgrader_env):  # noqa: F811 (the fixture imported above)
    """nbgrader's autograde of the class ({student: {grade_id: points}}), and labkit's
    ({student: {grade_id: Part}})."""
    sandboxed()
    course, env = nbgrader_env
    env["PYTHONPATH"] = str(Path(__file__).parents[1])  # the kernels nbgrader starts import this labkit
    nbgrader(["generate_assignment", "ps1", "--force"], course, env)
    released = course / "release" / "ps1" / SOURCE.name
    files = {}
    for name, (answers, _) in students().items():
        nb = nbformat.read(released, as_version=4)  # what the student downloaded
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in answers:
                cell.source = answers[gid].strip("\n")
            elif gid == "why_unscale_first":
                cell.source = "Before unscaling the norm is the loss scale times too large."
        files[name] = course / "submitted" / name / "ps1" / SOURCE.name
        files[name].parent.mkdir(parents=True)
        nbformat.write(nb, files[name])
    nbgrader(["autograde", "ps1", "--force", "--Execute.timeout=180"], course, env)
    ran = nbformat.read(course / "autograded" / "cy" / "ps1" / SOURCE.name, as_version=4)
    assert "check_grad_norm(global_grad_norm, hidden=True)" in next(  # nbgrader put the hidden tests back
        c.source for c in ran.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "grad_norm_tests")
    from nbgrader.api import Gradebook

    theirs = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for name in files:
            submitted = gb.find_submission_notebook(SOURCE.stem, "ps1", name)
            theirs[name] = {g.name: g.score for g in submitted.grades if g.name in AUTOGRADED}
    ours = {}
    for name, path in files.items():
        report = grade(read(SOURCE), read(path), student=name, timeout=60)
        assert report.tampering == [] and report.warnings == [], (name, report.format())
        ours[name] = {p.grade_id: p for p in report.parts if not p.manual}
    return theirs, ours


def test_labkit_and_nbgrader_autograde_agree_part_by_part_on_honest_submissions(autograded):
    theirs, ours = autograded
    for name, (_, points) in students().items():
        assert theirs[name] == points, ("nbgrader", name, theirs[name])
        assert {gid: p.points for gid, p in ours[name].items()} == points, ("labkit", name, ours[name])
    # and labkit says why each lost part was lost
    assert "your norm overflowed to inf on fp16 gradients" in ours["cy"]["grad_norm_tests"].message
    assert "back off only when hysteresis_left reaches 0" in ours["cy"]["scale_tests"].message
    assert "expected 'nonfinite_grad'" in ours["di"]["skip_tests"].message
    assert "did you clip before unscaling?" in ours["di"]["step_tests"].message
