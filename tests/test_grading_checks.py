"""The autograder checks: labkit's reference passes every seed, each classic bug gets its own hint."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit
from labkit.grading import (
    check_clip,
    check_grad_norm,
    check_guarded_step,
    check_skip_decision,
    check_update_scale,
)


@pytest.fixture(autouse=True, scope="module")
def undo_bans():
    """Put back every home the ban wrappers took (they stay by design in a submission's process)."""
    import importlib

    from labkit.grading import checks
    from labkit.grading.checks.core import ban_homes

    for names in checks.BANNED.values():  # every module a ban reaches, loaded before the snapshot
        for full in names:
            importlib.import_module(full.rsplit(".", 1)[0])
    homes = {name: importlib.import_module(name) for name in ban_homes()}
    saved = {name: dict(vars(module)) for name, module in homes.items()}
    inits = {v: v.__dict__["__init__"] for d in saved.values() for v in d.values()
             if isinstance(v, type) and "__init__" in v.__dict__}
    yield
    for name, module in homes.items():
        for attr, value in saved[name].items():
            if getattr(module, attr, value) is not value:
                setattr(module, attr, value)
    for cls, init in inits.items():
        if cls.__dict__["__init__"] is not init:
            cls.__init__ = init


# ---------------------------------------------------------------- correct answers (not labkit's own code)


def good_norm(parameters):
    norms = [p.grad.float().norm() for p in parameters if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.tensor(0.0)


def good_clip(parameters, max_norm):
    norm = labkit.grad_norm(parameters)
    coef = torch.where(torch.isfinite(norm), torch.clamp(max_norm / (norm + 1e-6), max=1.0), 1.0)
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def good_skip(loss, parameters):
    if not math.isfinite(loss.item()):
        return "nonfinite_loss"
    grads = [p.grad for p in parameters if p.grad is not None]
    return None if all(torch.isfinite(g).all() for g in grads) else "nonfinite_grad"


def good_scale(scale, tracker, hysteresis, found_inf, config):
    if found_inf:
        hysteresis = max(hysteresis - 1, 0)
        return (scale * config.backoff_factor if hysteresis == 0 else scale), 0, hysteresis
    if tracker + 1 == config.growth_interval:
        return scale * config.growth_factor, 0, config.hysteresis
    return scale, tracker + 1, hysteresis


def make_step(clip_before_unscale=False, scheduler_on_skip=False, backward_on_bad_loss=False, clip=True,
              step_on_skip=False, update_on_skip=True, scale_after=False, log_norm=lambda norm: norm.item()):
    """A guarded step with the given mistakes (none by default)."""

    def guarded_step(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets, max_norm):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(inputs), targets)
        scale = scaler.get_scale()
        if not backward_on_bad_loss and not math.isfinite(loss.item()):
            if scheduler_on_skip:
                scheduler.step()
            return labkit.StepRecord(step, loss.item(), scale=scale, next_scale=scale, skipped=True,
                                     reason="nonfinite_loss")
        scaler.scale(loss).backward()
        if clip_before_unscale:
            norm = labkit.clip_grad_norm_(model.parameters(), max_norm)
            scaler.unscale_(optimizer)
        else:
            scaler.unscale_(optimizer)
            norm = labkit.grad_norm(model.parameters())
            if clip:
                labkit.clip_grads_with_norm_(model.parameters(), max_norm, norm)
        if step_on_skip:
            optimizer.step()
            stepped = bool(torch.isfinite(norm))
        else:
            stepped = scaler.step(optimizer)
        if stepped or scheduler_on_skip:
            scheduler.step()
        if stepped or update_on_skip:
            scaler.update()
        return labkit.StepRecord(
            step, loss.item(), grad_norm=log_norm(norm), scale=scaler.get_scale() if scale_after else scale,
            next_scale=scaler.get_scale(), skipped=not stepped,
            reason=None if stepped
            else ("nonfinite_grad" if math.isfinite(loss.item()) else "nonfinite_loss"))

    return guarded_step


GOOD = [(check_grad_norm, good_norm), (check_clip, good_clip), (check_skip_decision, good_skip),
        (check_update_scale, good_scale)]


@pytest.mark.parametrize("check, fn", GOOD, ids=[c.__name__ for c, _ in GOOD])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_correct_answer_passes_every_hidden_seed(check, fn, seed):
    check(fn)
    check(fn, hidden=True, seed=seed)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_correct_guarded_step_passes_every_hidden_seed(seed):
    check_guarded_step(make_step(), hidden=True, seed=seed)


def test_visible_and_hidden_cases_run_without_a_seed():
    check_guarded_step(make_step())
    check_grad_norm(good_norm, hidden=True)  # a fresh seed, quoted in any failure


def fails(check, fn, *hints, hidden=True, seed=3):
    with pytest.raises(AssertionError) as err:
        check(fn, hidden=hidden, seed=seed)
    message = str(err.value)
    for hint in hints:
        assert hint in message, message
    if hidden:
        assert f"seed={seed}" in message
    return message


# ---------------------------------------------------------------- 1. the norm


def norm_fp16_squares(ps):
    return torch.sqrt(sum((p.grad**2).sum() for p in ps if p.grad is not None)).float()


def norm_fp16_stack(ps):
    norms = [p.grad.norm() for p in ps if p.grad is not None]
    return torch.stack(norms).norm().float() if norms else torch.tensor(0.0)


def norm_bf16(ps):
    norms = [p.grad.norm() for p in ps if p.grad is not None]
    return torch.stack(norms).float().norm() if norms else torch.tensor(0.0)


NORM_BUGS = {
    "fp16 squares": (norm_fp16_squares,
                     "your norm overflowed to inf on fp16 gradients: accumulate in float32"),
    "fp16 stack": (norm_fp16_stack, "your norm overflowed to inf on fp16 gradients"),
    "no sqrt": (lambda ps: sum((p.grad.float() ** 2).sum() for p in ps if p.grad is not None),
                "did you forget the square root?"),
    "sum of norms": (lambda ps: sum(p.grad.float().norm() for p in ps if p.grad is not None),
                     "you added the per-tensor norms"),
    "max norm": (lambda ps: max(p.grad.float().norm() for p in ps if p.grad is not None),
                 "that is the largest per-tensor norm"),
    "None grads": (lambda ps: torch.stack([p.grad.float().norm() for p in ps]).norm(),
                   "raised AttributeError",
                   "Some parameters have no .grad (None: frozen or unused): skip them."),
    "python float": (lambda ps: math.sqrt(sum((p.grad.float() ** 2).sum().item() for p in ps
                                              if p.grad is not None)),
                     "returned a float", "host sync"),
    "float16 result": (lambda ps: good_norm(ps).half(), "returned a torch.float16 norm", "return float32"),
    "nan filtered": (lambda ps: torch.stack([torch.nan_to_num(p.grad.float(), 0.0, 0.0, 0.0).norm()
                                             for p in ps if p.grad is not None]).norm(),
                     "a NaN gradient must give a NaN or inf norm"),
    "empty": (lambda ps: torch.stack([p.grad.float().norm() for p in ps if p.grad is not None]).norm(),
              "With no gradients at all the norm is 0: return torch.tensor(0.0)"),
    "calls labkit": (lambda ps: labkit.grad_norm(ps),
                     "called labkit.grad_norm: this part asks you to compute the norm yourself"),
    "calls torch": (lambda ps: torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None]),
                    "called torch.nn.utils.get_total_norm"),
    "in place": (lambda ps: torch.stack([p.grad.pow_(2).sum() for p in ps
                                         if p.grad is not None]).sum().sqrt().float(),
                 "changed p.grad", "a norm only reads"),
}


@pytest.mark.parametrize("bug", NORM_BUGS)
def test_each_norm_bug_gets_its_hint(bug):
    fn, *hints = NORM_BUGS[bug]
    fails(check_grad_norm, fn, *hints)


def test_half_precision_accumulation_is_caught_on_every_seed():
    for seed in range(5):
        fails(check_grad_norm, norm_bf16, "gradients: accumulate in float32", "bits of mantissa", seed=seed)


def test_visible_failures_name_the_case_and_need_no_seed():
    message = fails(check_grad_norm, lambda ps: torch.tensor(7.0), hidden=False)
    assert message == ("<lambda> returned 7 on the case 'grads [3, 4] and [12]', labkit.grad_norm gives 13: "
                       "the norm differs by a factor of ~0.538.")


def test_a_stub_says_it_is_not_implemented():
    def global_grad_norm(parameters):
        raise NotImplementedError()

    fails(check_grad_norm, global_grad_norm, "global_grad_norm is not implemented yet", hidden=False)


# ---------------------------------------------------------------- 2. clipping


def clip_with(coef_fn, inplace=True, returns="pre"):
    def clip(ps, max_norm):
        norm = labkit.grad_norm(ps)
        coef = coef_fn(norm, max_norm)
        for p in ps:
            if p.grad is not None:
                if inplace:
                    p.grad.mul_(coef)
                else:
                    p.grad = p.grad * coef
        return norm if returns == "pre" else labkit.grad_norm(ps)
    return clip


CLAMPED = lambda n, m: torch.where(torch.isfinite(n), torch.clamp(m / (n + 1e-6), max=1.0), 1.0)  # noqa: E731
CLIP_BUGS = {
    "if on a tensor": (clip_with(lambda n, m: m / (n + 1e-6) if n > m else 1.0), "synced with the host",
                       "used a tensor as a Python bool", "torch.clamp(max_norm / (norm + 1e-6), max=1.0)"),
    "min()": (clip_with(lambda n, m: min(1.0, m / (n + 1e-6))), "synced with the host"),
    ".item()": (clip_with(lambda n, m: min(1.0, m / (n.item() + 1e-6))), "called .item() on a tensor"),
    "no clamp": (clip_with(lambda n, m: torch.where(torch.isfinite(n), m / (n + 1e-6), 1.0)),
                 "clip only ever shrinks"),
    "NaN not kept out": (clip_with(lambda n, m: torch.clamp(m / (n + 1e-6), max=1.0)),
                         "a non-finite norm must leave them untouched",
                         "torch.where(torch.isfinite(norm), coef, 1.0)"),
    "post-clip norm returned": (clip_with(CLAMPED, returns="post"), "that is the norm after clipping"),
    "not in place": (clip_with(CLAMPED, inplace=False), "replaced p.grad with a new tensor", "clip in place"),
    "torch's clip": (lambda ps, m: torch.nn.utils.clip_grad_norm_(ps, m),
                     "called torch.nn.utils.clip_grad_norm_"),
    "labkit's clip": (lambda ps, m: labkit.clip_grad_norm_(ps, m), "called labkit.clip_grad_norm_"),
}


@pytest.mark.parametrize("bug", CLIP_BUGS)
def test_each_clip_bug_gets_its_hint(bug):
    fn, *hints = CLIP_BUGS[bug]
    fails(check_clip, fn, *hints)


def test_the_host_sync_trap_is_lifted_afterwards():
    fails(check_clip, CLIP_BUGS["if on a tensor"][0])
    t = torch.tensor([2.5])
    assert t.item() == 2.5 and bool(t) and float(t) == 2.5 and t.tolist() == [2.5]
    assert labkit.clip_grad_norm_ is labkit.clip.clip_grad_norm_


# ---------------------------------------------------------------- 3. skip or step


def skip_if(loss_bad, grads_bad, loss_first=True):
    def skip(loss, ps):
        grads = [p.grad for p in ps if p.grad is not None]
        order = [(loss_bad(loss), "nonfinite_loss"), (grads_bad(grads), "nonfinite_grad")]
        for bad, reason in order if loss_first else order[::-1]:
            if bad:
                return reason
        return None
    return skip


ANY_BAD = lambda gs: not all(torch.isfinite(g).all() for g in gs)  # noqa: E731
SKIP_BUGS = {
    "only NaN counts": (skip_if(lambda loss: bool(torch.isnan(loss)), ANY_BAD), "expected 'nonfinite_loss'",
                        "NaN, +inf and -inf are all not finite"),
    "gradients first": (skip_if(lambda loss: not torch.isfinite(loss), ANY_BAD, loss_first=False),
                        "check the loss first"),
    "fp16 norm": (skip_if(lambda loss: not torch.isfinite(loss),
                          lambda gs: not torch.isfinite(torch.stack([g.norm() for g in gs]).norm())),
                  "every gradient is finite, but an fp16 norm of them overflows"),
    "first gradient only": (skip_if(lambda loss: not torch.isfinite(loss),
                                    lambda gs: not torch.isfinite(gs[0]).all()),
                            "expected 'nonfinite_grad'", "check every .grad that exists"),
    "returns a bool": (lambda loss, ps: False, "returned False", "return None to step"),
}


@pytest.mark.parametrize("bug", SKIP_BUGS)
def test_each_skip_bug_gets_its_hint(bug):
    fn, *hints = SKIP_BUGS[bug]
    fails(check_skip_decision, fn, *hints)


# ---------------------------------------------------------------- 4. the scale rule


def scale_bug(kind):
    def next_scale(scale, tracker, hysteresis, found_inf, config):
        if kind == "no hysteresis" and found_inf:
            return scale * config.backoff_factor, 0, max(hysteresis - 1, 0)
        if kind == "off by one" and not found_inf:
            if tracker == config.growth_interval:
                return scale * config.growth_factor, 0, config.hysteresis
            return scale, tracker + 1, hysteresis
        if kind == "tracker kept" and found_inf:
            hysteresis = max(hysteresis - 1, 0)
            return (scale * config.backoff_factor if hysteresis == 0 else scale), tracker, hysteresis
        if kind == "no refill" and not found_inf and tracker + 1 == config.growth_interval:
            return scale * config.growth_factor, 0, hysteresis
        if kind == "grows early" and not found_inf and tracker + 2 >= config.growth_interval:
            return scale * config.growth_factor, 0, config.hysteresis
        return good_scale(scale, tracker, hysteresis, found_inf, config)
    return next_scale


SCALE_BUGS = {
    "no hysteresis": "back off only when hysteresis_left reaches 0",
    "off by one": "grow when growth_tracker + 1 reaches growth_interval (count this step too)",
    "tracker kept": "growth_tracker is wrong: +1 on a clean step, back to 0 on an overflow",
    "no refill": "refilled to config.hysteresis after a growth",
    "grows early": "the scale grew too early",
}


@pytest.mark.parametrize("bug", SCALE_BUGS)
def test_each_scale_rule_bug_gets_its_hint(bug):
    fails(check_update_scale, scale_bug(bug), SCALE_BUGS[bug])


def test_the_scale_rule_is_shown_on_visible_cases_too():
    fails(check_update_scale, scale_bug("no hysteresis"), "hysteresis=2", hidden=False)
    fails(check_update_scale, lambda *state: None, "return a tuple (scale, growth_tracker, hysteresis_left)",
          hidden=False)


# ---------------------------------------------------------------- 5. the guarded step

STEP_BUGS = {
    "clip before unscale": ({"clip_before_unscale": True},
                            ["[clipping", "differs by a factor of ~", "did you clip before unscaling?"]),
    "scheduler on a skip": ({"scheduler_on_skip": True},
                            ["[skipped steps", "the scheduler advanced on a skipped step"]),
    "backward on a NaN loss": ({"backward_on_bad_loss": True}, ["the loss scale changed on a NaN/inf loss"]),
    "no clipping": ({"clip": False}, ["too large", "clip the unscaled gradients to max_norm"]),
    "stepping on a skip": ({"step_on_skip": True}, ["the parameters changed on a skipped step"]),
    "no update on a skip": ({"update_on_skip": False},
                            ["call scaler.update() once per step that ran backward"]),
    "scale logged after update": ({"scale_after": True},
                                  ["log scaler.get_scale() before the step and after update()"]),
    # a tensor in the log used to skip the comparison: now its value is compared
    "post-clip norm logged as a tensor": ({"log_norm": lambda norm: torch.clamp(norm, max=0.05)},
                                          ["logged grad_norm=0.05",
                                           "log the global norm of the unscaled gradients"]),
    "norm logged as a string": ({"log_norm": lambda norm: "big"},
                                ["logged grad_norm=big", "as a number"]),
}


@pytest.mark.parametrize("bug", STEP_BUGS)
def test_each_guarded_step_bug_gets_its_hint(bug):
    kwargs, hints = STEP_BUGS[bug]
    fails(check_guarded_step, make_step(**kwargs), *hints, hidden=False)


def test_two_bugs_in_one_step_get_both_hints_one_per_scenario():
    message = fails(check_guarded_step, make_step(clip_before_unscale=True, scheduler_on_skip=True),
                    "did you clip before unscaling?", "the scheduler advanced on a skipped step")
    assert message.count("[") == 2


def test_a_step_that_raises_ships_as_data_the_grader_can_load(tmp_path):
    """What an honest step raised used to be shipped as the exception object itself (labkit's
    ScalerUsageError): ``torch.load(weights_only=True)`` refused it and the grader reported the student as
    tampering, 0 points."""
    from labkit.grading import checks

    def guarded_step(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets, max_norm):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_fn(model(inputs), targets)).backward()
        scaler.update()  # neither unscale_ nor step: no inf check was recorded

    outs = checks.run("check_guarded_step", guarded_step, False, 0)
    torch.save({"results": [{"outs": outs}]}, tmp_path / "part-4.pt")  # as the harness ships it
    shipped = torch.load(tmp_path / "part-4.pt", weights_only=True)["results"][0]["outs"]
    assert checks.judge("check_guarded_step", "guarded_step", False, 0, shipped).startswith(
        "guarded_step raised ScalerUsageError: No inf checks were recorded prior to update()")
    with pytest.raises(AssertionError) as info:  # in the notebook the student still sees their traceback
        check_guarded_step(guarded_step)
    assert type(info.value.__cause__).__name__ == "ScalerUsageError"
