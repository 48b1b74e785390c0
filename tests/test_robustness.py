"""Nothing corrupted: the guarded step under real training loops, damaged state, bad arguments (issue 13)."""

import copy
import io
import math

import pytest
import torch
from torch import nn

import labkit
from labkit import GradScaler, TrainStep
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.clippers import NormClip
from labkit.faults import Faults
from labkit.steplog import StepLog

NAN = float("nan")


@pytest.fixture
def task():
    return labkit.ToyTask()


def snapshot(model, opt, sched=None):
    """Everything a step may change, deep-copied."""
    state = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
             "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
             "opt": copy.deepcopy(opt.state_dict())}
    if sched is not None:
        state["sched"] = copy.deepcopy(sched.state_dict())
    return state


def assert_same(a, b, where="state"):
    """Nested dicts/lists of tensors and numbers are identical, bit for bit (NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where} changed"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def records_equal(a, b):
    assert_same(a.to_dict(), b.to_dict(), f"step {a.step}")


def unwrapped(record):
    """The record as the bare model's would read: the wrapper's ``net.`` prefix off every layer name."""
    d = record.to_dict()
    if "top_grads" in d:
        d["top_grads"] = [(n.removeprefix("net."), v) for n, v in d["top_grads"]]
    for k in ("first_nonfinite", "culprit_module"):
        if d.get(k):
            d[k] = d[k].removeprefix("net.")
    return labkit.StepRecord.from_dict(d)


class TwoPart(nn.Module):
    """A body and a head: the head is added to the optimizer later (progressive unfreezing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(16, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


# ---------------------------------------------------------------- 1. parameters added after construction


def test_param_group_added_later_is_norm_clipped_and_nan_checked(task):
    model, ref = TwoPart(), TwoPart()
    opt = torch.optim.SGD(model.body.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.body.parameters(), lr=0.05)
    step = TrainStep(model, opt, task.loss_fn, max_norm=0.5)
    x, y = task.batch(0)
    step(x, y)
    # the reference: the torch loop, clipping the body first, then the whole model together
    ref_opt.zero_grad(); task.loss_fn(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(list(ref.body.parameters()), 0.5); ref_opt.step()
    opt.add_param_group({"params": model.head.parameters(), "lr": 0.01})
    ref_opt.add_param_group({"params": ref.head.parameters(), "lr": 0.01})
    for i in (1, 2):
        x, y = task.batch(i)
        record = step(x, y)
        ref_opt.zero_grad(); task.loss_fn(ref(x), y).backward()
        expected = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5); ref_opt.step()
        assert record.grad_norm == pytest.approx(expected.item(), rel=1e-6)  # the head's gradient counts
        assert record.lrs == [0.05, 0.01] and record.lr == 0.05
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # a NaN gradient in the late group: skipped, nothing written (it was written into the head before)
    handle = model.head.weight.register_hook(lambda g: g * NAN)
    before = snapshot(model, opt)
    record = step(*task.batch(3))
    handle.remove()
    assert record.skipped and record.reason == "nonfinite_grad" and record.first_nonfinite == "head.weight"
    assert_same(snapshot(model, opt), before)


# ---------------------------------------------------------------- 2. errors after optimizer.step


@pytest.mark.parametrize("make, message", [
    (lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "needs a metric"),
    (lambda opt: object(), "step\\(\\) method"),
    (lambda opt: torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), 1),
     "another optimizer"),
])
def test_schedulers_that_cannot_work_are_refused_at_construction(task, make, message):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises((TypeError, ValueError), match=message):
        TrainStep(model, opt, task.loss_fn, scheduler=make(opt))


def test_an_optimizer_that_needs_a_closure_is_refused(task):
    model = task.model()
    with pytest.raises(TypeError, match="LBFGS needs a closure"):
        TrainStep(model, torch.optim.LBFGS(model.parameters()), task.loss_fn)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_scheduler_error_comes_after_the_step_is_complete_and_numbered(task, precision):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1)  # raises from step 1 on
    step = TrainStep(model, opt, task.loss_fn, precision=precision, scheduler=sched)
    step(*task.batch(0))
    for i in (1, 2):
        before = snapshot(model, opt)
        with pytest.raises(ValueError, match="Tried to step"):  # OneCycleLR's own message, unchanged
            step(*task.batch(i))
        after = snapshot(model, opt)
        assert not torch.equal(before["params"]["0.weight"], after["params"]["0.weight"])  # it did step
    assert step.step_count == 3 and [r.step for r in step.log] == [0, 1, 2]
    assert all(not r.skipped for r in step.log)
    # the scaler is consistent: a step without the scheduler works (no "unscale_() after step()")
    step.scheduler = None
    assert not step(*task.batch(3)).skipped and step.step_count == 4


class FailOnce(torch.optim.SGD):
    """An optimizer whose step raises once, as a user's buggy optimizer would."""

    fail = False

    def step(self, closure=None):
        if self.fail:
            self.fail = False
            raise RuntimeError("my optimizer broke")
        return super().step(closure)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_users_optimizer_error_passes_through_and_the_next_step_is_the_reference(task, precision):
    model, ref = task.model(), task.model()
    opt, ref_opt = FailOnce(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    step = TrainStep(model, opt, task.loss_fn, precision=precision)
    ref_step = TrainStep(ref, ref_opt, task.loss_fn, precision=precision)
    records_equal(step(*task.batch(0)), ref_step(*task.batch(0)))
    opt.fail = True
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="^my optimizer broke$"):
        step(*task.batch(1))
    assert_same(snapshot(model, opt), before)
    assert step.step_count == 1 and len(step.log) == 1
    step.step_count = ref_step.step_count  # same numbering
    records_equal(step(*task.batch(1)), ref_step(*task.batch(1)))
    assert_same(snapshot(model, opt)["params"], snapshot(ref, ref_opt)["params"])


# ---------------------------------------------------------------- 3. the loss scale cannot die unseen


def drive(scaler, overflows):
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    for bad in overflows:
        opt.zero_grad()
        scaler.scale((w * (NAN if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale()


def test_the_default_floor_keeps_the_scale_alive_and_recovers():
    scaler = GradScaler("cpu", growth_interval=2)
    assert drive(scaler, [True] * 300) == torch.finfo(torch.float32).tiny  # torch reaches 0 here
    assert 1.0 / drive(scaler, [False] * 2) < math.inf  # it grows back on clean steps
    assert scaler.skip_count == 300 and scaler.skip_streak == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(init_scale=1e-45), "normal range"),
    (dict(init_scale=1e-39), "normal range"),
    (dict(backoff_factor=1e-300), "2\\*\\*-24"),
    (dict(growth_interval=2**31), "<= 2147483647"),
    (dict(hysteresis=2**40), "<= 2147483647"),
    (dict(growth_factor="2"), "growth_factor must be a number"),
    (dict(init_scale=None), "init_scale must be a number"),
    (dict(backoff_factor=torch.tensor(0.5)), "backoff_factor must be a number"),
    (dict(min_scale=True), "min_scale must be a number"),
    (dict(device="gpu"), "device must name a torch device"),
    (dict(device=3.5), "device must be a str"),
])
def test_scaler_settings_that_would_break_it_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        GradScaler(**{"device": "cpu", **kwargs})


def test_a_scale_set_dead_by_hand_is_named_alarmed_and_counted(task):
    model = task.model()
    scaler = GradScaler("cpu")
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp16",
                     scaler=scaler, hooks=[SkipAlarm(None)])
    step(*task.batch(0))
    scaler.update(new_scale=1e-41)  # torch's update(new_scale) takes any value; the default floor cannot
    with pytest.warns(labkit.DeadScaleWarning, match="scale is dead"):
        records = [step(*task.batch(i)) for i in range(1, 4)]
    # detected, named and counted as a skip; the back-off lands on the floor, which revives the scale
    assert [r.reason for r in records] == ["dead_scale", None, None]
    assert records[0].next_scale == torch.finfo(torch.float32).tiny and math.isfinite(records[1].grad_norm)
    assert step.log.summary()["skips_by_reason"]["dead_scale"] == 1 and scaler.skip_count == 1


# ---------------------------------------------------------------- 4. a skipped step leaves the buffers alone


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))


@pytest.mark.parametrize("precision, kind", [("fp32", "nan"), ("bf16", "inf"), ("fp16", "overflow")])
def test_batchnorm_statistics_survive_a_skipped_step(task, precision, kind):
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = TrainStep(model, opt, task.loss_fn, precision=precision, hooks=[Faults({1: kind})])
    step(*task.batch(0))
    before = snapshot(model, opt)
    record = step(*task.batch(1))
    assert record.skipped
    assert_same(snapshot(model, opt), before)
    assert not step(*task.batch(2)).skipped
    model.eval()
    assert torch.isfinite(model(task.batch(3)[0])).all()


# ---------------------------------------------------------------- 5. loading state: validated, then written


@pytest.fixture(scope="module")
def trained_step():
    task = labkit.ToyTask()
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp16",
                     hooks=[Faults({1: "nan"})])
    for i in range(3):
        step(*task.batch(i))
    return step


def damaged(state, path, value):
    state = copy.deepcopy(state)
    *keys, last = path
    d = state
    for k in keys:
        d = d[k]
    d[last] = value
    return state


@pytest.mark.parametrize("path, value", [
    (("scaler", "scale"), math.inf),
    (("scaler", "scale"), 0.0),
    (("scaler", "scale"), "big"),
    (("scaler", "_hysteresis_left"), 10**9),
    (("scaler", "_growth_tracker"), -1),
    (("scaler", "_growth_tracker"), 2**31),  # past int32 (at or past growth_interval is a state torch writes)
    (("scaler", "skip_count"), -3),
    (("scaler", "skip_streak"), 99),
    (("scaler", "growth_interval"), 2**31),
    (("skip_alarm", "streak"), -1),
    (("skip_alarm", "reasons"), None),
    (("clip_alarm", "recent"), "yes"),
    (("clip_alarm",), {}),
    (("log", "steps"), -5),
    (("step",), -1),
    (("step",), 2.5),
])
def test_a_damaged_state_raises_and_changes_nothing(trained_step, path, value):
    step = trained_step
    good = step.state_dict()
    with pytest.raises((ValueError, TypeError, KeyError)):
        step.load_state_dict(damaged(good, path, value))
    assert step.state_dict() == good


# ------------------------------------------------------------ 6. int32 overflow, tiny backoff, negative norms


def test_growth_interval_past_int32_is_refused_not_wrapped():
    with pytest.raises(ValueError, match="growth_interval"):
        labkit.ScalerConfig(growth_interval=2**31)
    assert labkit.ScalerConfig(growth_interval=2**31 - 1).growth_interval == 2**31 - 1


def test_clip_with_a_negative_norm_never_flips_the_gradients():
    w = nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    with pytest.raises(ValueError, match="total_norm must be >= 0"):
        labkit.clip_grads_with_norm_([w], 1.0, -5.0)
    labkit.clip_grads_with_norm_([w], 1.0, torch.tensor(-5.0))  # a tensor is not asked (a sync): left alone
    assert w.grad.tolist() == [3.0, 4.0]


# ---------------------------------------------------------------- clear errors for bad arguments


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(log=3), TypeError, "log must be a file path"),
    (dict(log="missing-folder/log.jsonl"), FileNotFoundError, "does not exist; create it first"),
    (dict(model=lambda x: x), TypeError, "model must be a torch.nn.Module"),
    (dict(optimizer="adam"), TypeError, "optimizer must be a torch.optim.Optimizer"),
    (dict(loss_fn=None), TypeError, "loss_fn must be callable"),
    (dict(hooks=SkipAlarm(3)), TypeError, "hooks must be a list"),
    (dict(nonsense=1), TypeError, "unexpected keyword argument 'nonsense'"),
])
def test_bad_constructor_arguments_get_a_message_with_the_fix(
    task, tmp_path, monkeypatch, kwargs, error, message
):
    monkeypatch.chdir(tmp_path)
    model = task.model()
    args = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=task.loss_fn)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        TrainStep(**args)
    assert list(tmp_path.iterdir()) == []  # not even the log file was created


# 0.1.0 has no users to protect: each keyword that became a hook, log= or NormClip's argument is gone,
# and says what to write instead
@pytest.mark.parametrize("kwargs, write", [
    (dict(faults=["10:nan"]), "hooks=[Faults(['10:nan'])] (labkit.faults)"),
    (dict(triage=True), "hooks=[Triage()] (labkit.triage)"),
    (dict(skip_alarm=None), "hooks=[SkipAlarm(None)] (labkit.alarms;"),
    (dict(clip_alarm=0.9), "hooks=[ClipAlarm(0.9, window=100)]"),
    (dict(clip_alarm=None, clip_window=20), "hooks=[ClipAlarm(None, window=20)]"),
    (dict(clip_window=20), "hooks=[ClipAlarm(0.5, window=20)]"),
    (dict(log_path="run.jsonl"), "log='run.jsonl' (a file path)"),
    (dict(log_path="run.jsonl", log_window=50), "log='run.jsonl' (a file path)"),
    (dict(log_window=50), "log=StepLog(stream='path', window=50)"),
    (dict(norm_type=math.inf), "clipper=NormClip(max_norm, norm_type=inf)"),
    (dict(device="cpu"), "nothing: the step trains where the model is (model.to(device) first)"),
])
def test_a_removed_keyword_says_what_to_write_instead(task, tmp_path, monkeypatch, kwargs, write):
    monkeypatch.chdir(tmp_path)
    model = task.model()
    with pytest.raises(TypeError, match=r"TrainStep\(\w+=...\) was removed: write ") as e:
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task.loss_fn, **kwargs)
    assert write in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_the_new_spellings_do_what_the_old_keywords_did(task, tmp_path):
    model = task.model()
    log = StepLog(stream=tmp_path / "run.jsonl", window=2)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task.loss_fn, precision="fp16",
                     log=log, clipper=NormClip(0.5, norm_type=math.inf),
                     hooks=[Faults(["1:nan"]), SkipAlarm(None)])
    records = [step(*task.batch(i)) for i in range(3)]
    assert step.log is log and len(log) == 2 and len(StepLog.read_jsonl(tmp_path / "run.jsonl")) == 3
    assert [r.fault for r in records] == [None, "nan", None] and records[1].skipped
    assert step.norm_type == math.inf and records[2].threshold == 0.5
    alarms = [h for h in step.hooks.members if isinstance(h, (SkipAlarm, ClipAlarm))]
    # the given SkipAlarm took the default's place
    assert sorted((type(h).__name__, h.threshold if isinstance(h, SkipAlarm) else h.rate)
                  for h in alarms) == [("ClipAlarm", 0.5), ("SkipAlarm", None)]


def test_a_fault_schedule_and_an_alarm_refuse_bad_settings_with_the_fix():
    with pytest.raises(TypeError, match="list of specs"):
        Faults("10:nan")
    with pytest.raises(TypeError, match="faults must be"):
        Faults(42)
    assert Faults(["10:nan"]).pre_forward(None, 10).label == "nan"
    with pytest.raises(ValueError, match="ClipAlarm rate must be a fraction"):
        ClipAlarm("half")
    with pytest.raises(ValueError, match="SkipAlarm threshold must be"):
        SkipAlarm(0)
    with pytest.raises(ValueError, match=r"NormClip needs norm_type p > 0"):
        NormClip(1.0, norm_type=0)


def test_a_norm_order_whose_powers_overflow_the_scaled_norm_is_refused_with_a_scaler(task):
    """TrainStep reads the norm of the *scaled* gradients: at norm_type 16 in fp16 it overflowed on 7 of 20
    clean steps of the toy run, all of which torch's loop (unscale, then the norm) stepped."""
    model = task.model()

    def make(norm_type, **kwargs):  # an infinite max_norm: the norm measured, nothing clipped
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        return TrainStep(model, opt, task.loss_fn, clipper=NormClip(math.inf, norm_type=norm_type), **kwargs)

    for p in (16.0, 1e10):
        with pytest.raises(ValueError, match=r"Use norm_type <= 4 or float\('inf'\)"):
            make(precision="fp16", norm_type=p)
    for kwargs in (dict(precision="fp16", norm_type=math.inf), dict(precision="fp16", norm_type=0.5),
                   dict(precision="bf16", norm_type=16.0),
                   dict(precision="fp16", norm_type=16.0, scaler=GradScaler("cpu", enabled=False))):
        make(**kwargs)  # no scaled norm there: taken
    # at the largest order taken, the scaled norm is torch's loop's unscaled one, step after step
    step = make(precision="fp16", norm_type=4.0)
    ref = copy.deepcopy(model)
    opt, scaler = torch.optim.SGD(ref.parameters(), lr=0.05), torch.amp.GradScaler("cpu")
    for i in range(10):
        record = step(*task.batch(i))
        x, y = task.batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = task.loss_fn(ref(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        theirs = labkit.grad_norm(ref.parameters(), 4.0).item()
        assert not record.skipped and record.grad_norm == pytest.approx(theirs, rel=1e-5)
        scaler.step(opt)
        scaler.update()

def test_schedule_parse_refuses_one_string_and_keeps_ranges_lazy():
    with pytest.raises(TypeError, match=r"list of specs, e.g. \['50:nan'\]"):
        labkit.FaultSchedule.parse("50:nan")
    huge = labkit.FaultSchedule.parse(["0-10000000:nan", "5:spike"])  # was 11.6 s and 1.4 GB
    assert (
        len(huge) == 10_000_001 and huge.get(5).label == "spike:1000" and huge.get(10_000_000).label == "nan"
    )
    assert huge.get(10_000_001) is None and list(zip(range(3), huge)) == [(0, 0), (1, 1), (2, 2)]


def one_arg(out):
    return out.float().mean()


@pytest.mark.parametrize("inputs, targets, error, message", [
    (torch.tensor(1.0), torch.tensor([1.0]), ValueError, "0-d tensor"),
    ([[1.0] * 16] * 4, torch.zeros(4, 1), TypeError, "torch.as_tensor"),
    ("batch", torch.zeros(4, 1), TypeError, "inputs must be a torch.Tensor or a dict"),
    (torch.zeros(4, 16), [0.0] * 4, TypeError, "targets must be a torch.Tensor"),
    (torch.zeros(4, 16), torch.tensor(0.0), TypeError, "0-d tensor"),
    (torch.zeros(4, 16), torch.zeros(3, 1), ValueError, "got 4 inputs and 3 targets"),
    ({"x": torch.zeros(4, 16)}, torch.zeros(64, 1), ValueError,
     "got 4 samples in the dict batch and 64 targets"),
    ({"x": torch.zeros(4, 16), "m": torch.zeros(3)}, None, ValueError, "share their first"),
    ({"ids": [1, 2]}, None, ValueError, "share their first"),
])
def test_bad_batches_are_refused_before_anything_changes(task, inputs, targets, error, message):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, task.loss_fn)
    step(*task.batch(0))
    before = snapshot(model, opt)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(error, match=message):
        step(inputs, targets)
    assert_same(snapshot(model, opt), before)
    assert_same([p.grad for p in model.parameters()], grads)  # not even zero_grad ran
    assert step.step_count == 1 and len(step.log) == 1


@pytest.mark.parametrize("loss_fn, error, message", [
    (lambda out, y: 0.5, TypeError, "got float"),
    (lambda out, y: 3, TypeError, "got int"),
    (lambda out, y: (nn.functional.mse_loss(out, y), {}), TypeError, "not a tuple"),
    (lambda out, y: nn.functional.mse_loss(out, y).detach(), ValueError, "does not require grad"),
    (lambda out, y: (out - y) ** 2, ValueError, "one number"),
    (lambda out, y: 1 / 0, ZeroDivisionError, "division by zero"),  # the user's own error, unchanged
])
# the path with the most state (the scaler's stages); fp32: tests/test_fuzz.py
@pytest.mark.parametrize("precision", ["fp16"])
def test_bad_losses_raise_and_the_next_step_is_the_reference(task, loss_fn, error, message, precision):
    model, ref = bn_model(), bn_model()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    step = TrainStep(model, opt, task.loss_fn, precision=precision)
    ref_step = TrainStep(ref, ref_opt, task.loss_fn, precision=precision)
    step.loss_fn = loss_fn
    before = snapshot(model, opt)
    with pytest.raises(error, match=message):
        step(*task.batch(0))
    assert_same(snapshot(model, opt), before)  # BatchNorm's statistics too
    step.loss_fn = task.loss_fn
    records_equal(step(*task.batch(0)), ref_step(*task.batch(0)))
    assert_same(snapshot(model, opt), snapshot(ref, ref_opt))


# ---------------------------------------------------------------- real training loops


class Outputs(nn.Module):
    """The toy model, returning a tuple or a dict as many real models do."""

    def __init__(self, net, kind):
        super().__init__()
        self.net, self.kind = net, kind

    def forward(self, x):
        out = self.net(x)
        return (out, out.detach() * 0) if self.kind == "tuple" else {"logits": out, "hidden": out * 2}


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tuple_and_dict_outputs_train_and_take_the_overflow_fault(task, kind, precision):
    pick = ((lambda out, y: task.loss_fn(out[0], y)) if kind == "tuple"
            else (lambda out, y: task.loss_fn(out["logits"], y)))
    model, ref = Outputs(task.model(), kind), task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), pick, precision=precision,
                     hooks=[Faults({2: "overflow"})])
    ref_step = TrainStep(ref, torch.optim.SGD(ref.parameters(), lr=0.05), task.loss_fn, precision=precision,
                         hooks=[Faults({2: "overflow"})])
    for i in range(4):
        a, b = step(*task.batch(i)), ref_step(*task.batch(i))
        records_equal(unwrapped(a), b)
    assert (step.log[2].reason == "nonfinite_grad") == (precision == "fp16")


class Seq2Loss(nn.Module):
    """A Hugging Face-style model: model(**batch) takes the labels and returns the loss."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, features, labels, scale=1.0):
        out = self.net(features) * scale
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_dict_batches_with_a_one_argument_loss_equal_the_tensor_form(task, precision):
    model, ref = Seq2Loss(task.model()), task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), lambda out: out["loss"],
                     precision=precision, accumulation_steps=2, hooks=[Faults({1: "nan"})])
    ref_step = TrainStep(ref, torch.optim.SGD(ref.parameters(), lr=0.05), task.loss_fn, precision=precision,
                         accumulation_steps=2, hooks=[Faults({1: "nan"})])
    for i in range(3):
        x, y = task.batch(i)
        a, b = step({"features": x, "labels": y, "scale": 1.0}), ref_step(x, y)
        records_equal(unwrapped(a), b)
    assert step.log[1].reason == "nonfinite_loss"


def test_sparse_embedding_gradients_get_a_clear_error(task):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"Embedding\(sparse=True\).*sparse=False"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task.loss_fn)


class Checkpointed(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False)


@pytest.mark.parametrize("wrap", ["checkpoint", "compile"])
def test_checkpointed_and_compiled_models_match_the_plain_model(task, wrap):
    net, ref = task.model(), task.model()
    # aot_eager: dynamo and AOTAutograd as in inductor, without compiling C++ (seconds on 2 CPU cores)
    model = Checkpointed(net) if wrap == "checkpoint" else torch.compile(net, backend="aot_eager")
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                     hooks=[Faults({1: "nan", 2: "spike"})])
    ref_step = TrainStep(ref, torch.optim.SGD(ref.parameters(), lr=0.05), task.loss_fn,
                         hooks=[Faults({1: "nan", 2: "spike"})])
    for i in range(4):
        a, b = step(*task.batch(i)), ref_step(*task.batch(i))
        assert (a.skipped, a.reason, a.clipped) == (b.skipped, b.reason, b.clipped)
        assert a.loss == pytest.approx(b.loss, rel=1e-5, nan_ok=True)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5, nan_ok=True)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_progressive_unfreezing_matches_the_torch_loop(task):
    model, ref = TwoPart(), TwoPart()
    model.body.requires_grad_(False); ref.body.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.head.parameters(), lr=0.05, momentum=0.9)
    step = TrainStep(model, opt, task.loss_fn, max_norm=1.0)
    for i in range(6):
        if i == 3:  # unfreeze the body
            for m, o in ((model, opt), (ref, ref_opt)):
                m.body.requires_grad_(True)
                o.add_param_group({"params": m.body.parameters(), "lr": 0.02})
        x, y = task.batch(i)
        record = step(x, y)
        ref_opt.zero_grad(); task.loss_fn(ref(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 1.0)
        ref_opt.step()
        assert record.grad_norm == pytest.approx(norm.item(), rel=1e-6)
        assert record.lrs == ([0.05] if i < 3 else [0.05, 0.02])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the promises: skip invariant, exact resume


def test_skipped_steps_change_nothing_bitwise(task):
    model = bn_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    faults = ["2:nan", "4-5:overflow", "7:inf", "8:overflow", "10:nan"]
    step = TrainStep(model, opt, task.loss_fn, precision="fp16", scheduler=sched,
                     scaler=GradScaler("cpu", init_scale=2.0**10), hooks=[SkipAlarm(None), Faults(faults)])
    skipped = 0
    for i in range(12):
        before = snapshot(model, opt, sched)
        record = step(*task.batch(i))
        if record.skipped:
            skipped += 1
            assert_same(snapshot(model, opt, sched), before, f"skipped step {i}")
    assert skipped == 6 and step.log.summary()["skipped"] == 6


def make_run(task):
    model = bn_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.7)
    step = TrainStep(model, opt, task.loss_fn, precision="fp16", scheduler=sched,
                     scaler=GradScaler("cpu", init_scale=2.0**8, growth_interval=3),
                     hooks=[Faults(["3:nan", "5:overflow", "8:overflow"])])
    return model, opt, sched, step


def test_resume_is_exact_and_the_summary_covers_the_whole_run(task):
    straight = make_run(task)
    expected = [straight[3](*task.batch(i)) for i in range(10)]
    first = make_run(task)
    for i in range(6):
        first[3](*task.batch(i))
    buffer = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[1].state_dict(), "sched": first[2].state_dict(),
                "step": first[3].state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    model, opt, sched, step = make_run(task)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    step.load_state_dict(saved["step"])
    for i in range(6, 10):
        records_equal(step(*task.batch(i)), expected[i])
    assert step.log.summary() == straight[3].log.summary()
    assert_same(snapshot(model, opt, sched), snapshot(*straight[:3]))


# ---------------------------------------------------------- the deferred path (sync_every) keeps the promises


@pytest.mark.parametrize("precision, kind", [("fp32", "nan"), ("fp16", "overflow")])
def test_deferred_steps_restore_buffers_on_a_skip_and_record_every_lr(task, precision, kind):
    model = bn_model()
    groups = [{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 0.01}]
    opt = torch.optim.SGD(groups, lr=0.05)
    step = TrainStep(model, opt, task.loss_fn, precision=precision, sync_every=4, hooks=[Faults({1: kind})])
    step(*task.batch(0))
    before = snapshot(model, opt)
    record = step(*task.batch(1))  # the skip is decided on the device: the buffers come back by a select
    assert record.skipped
    assert_same(snapshot(model, opt), before)
    assert not step(*task.batch(2)).skipped
    assert [r.lrs for r in step.log] == [[0.05, 0.01]] * 3 and [r.lr for r in step.log] == [0.05] * 3
    model.eval()
    assert torch.isfinite(model(task.batch(3)[0])).all()


def test_deferred_scheduler_error_comes_after_the_step_is_complete_and_numbered(task):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1)  # raises from step 1 on
    step = TrainStep(model, opt, task.loss_fn, scheduler=sched, sync_every=2)
    step(*task.batch(0))
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="Tried to step"):  # OneCycleLR's own message, unchanged
        step(*task.batch(1))
    # it stepped
    assert not torch.equal(before["params"]["0.weight"], snapshot(model, opt)["params"]["0.weight"])
    assert (
        step.step_count == 2 and [r.step for r in step.log] == [0, 1] and not any(r.skipped for r in step.log)
    )
    step.scheduler = None
    assert not step(*task.batch(2)).skipped and step.step_count == 3


@pytest.mark.parametrize("part, value", [("clipper", {"nonsense": 1}), ("detector", "x")])
def test_a_damaged_clipper_or_detector_state_raises_before_anything_is_written(task, part, value):
    from labkit.clippers import ZClip
    from labkit.spikes import SpikeDetector

    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp16",
                     max_norm=None, clipper=ZClip(), hooks=[SpikeDetector(window=16), Faults({1: "nan"})])
    for i in range(3):
        step(*task.batch(i))
    good = step.state_dict()
    bad = damaged(damaged(good, ("step",), 0), ("scaler", "scale"), 2.0)  # valid: a half-load would show
    bad[part] = value
    with pytest.raises((ValueError, TypeError, KeyError)):
        step.load_state_dict(bad)
    assert_same(step.state_dict(), good)
