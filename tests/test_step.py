"""TrainStep: the guarded step, against hand-written torch loops and its own contract."""

import contextlib
import copy
import io
import math
import warnings
import weakref

import pytest
import torch
from torch import nn

import labkit
import labkit.step
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.clippers import NormClip
from labkit.faults import Faults

INF = float("inf")
NAN = float("nan")
PRECISIONS = ["fp32", "bf16", "fp16"]
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
}
SCHEDULERS = {
    "steplr": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "lambdalr": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
}


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def task():
    return labkit.ToyTask()


@pytest.fixture
def make_step(task):
    """Build a TrainStep on a fresh ToyTask model; the model/optimizer/scheduler hang off it."""

    def make(precision="fp32", optimizer="sgd-momentum", scheduler=None, **kwargs):
        model = task.model()
        opt = OPTIMIZERS[optimizer](model.parameters())
        sched = SCHEDULERS[scheduler](opt) if scheduler is not None else None
        return labkit.TrainStep(model, opt, task.loss_fn, precision=precision, scheduler=sched, **kwargs)

    return make


def run(step, task, n, start=0):
    return [step(*task.batch(i)) for i in range(start, start + n)]


def params_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def as_bits(t):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8)


def assert_bitwise(a, b, where=""):
    """Tensors (or nested dicts/lists of them) are identical bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(as_bits(a), as_bits(b)), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def same_value(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def assert_records_equal(a, b):
    da, db = a.to_dict(), b.to_dict()
    assert da.keys() == db.keys()
    diffs = {k: (da[k], db[k]) for k in da if not same_value(da[k], db[k])}
    assert not diffs, f"step {da['step']}: {diffs}"


class GradHook:
    """A gradient hook on one parameter that is only active while ``on`` is set."""

    def __init__(self, model, name, factor):
        self.param = dict(model.named_parameters())[name]
        self.factor, self.on = factor, False
        self.handle = self.param.register_hook(lambda g: g * self.factor if self.on else g)

    def __enter__(self):
        self.on = True
        return self

    def __exit__(self, *exc):
        self.on = False


# ---------------------------------------------------------------- fp32 is the plain torch loop


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=list(OPTIMIZERS))
@pytest.mark.parametrize(
    "max_norm, norm_type",
    [(1.0, 2.0), (0.3, 2.0), (None, 2.0), (0.05, INF), (0.5, 1.0)],
    ids=["clip-1-l2", "clip-0.3-l2", "no-clip", "clip-0.05-linf", "clip-0.5-l1"],
)
def test_fp32_matches_plain_torch_loop_bitwise(task, optimizer, max_norm, norm_type):
    steps = 8
    model = task.model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    sched = SCHEDULERS["steplr"](opt)
    clip = dict(max_norm=None) if max_norm is None else dict(clipper=NormClip(max_norm, norm_type=norm_type))
    train = labkit.TrainStep(model, opt, task.loss_fn, **clip, scheduler=sched)
    records = run(train, task, steps)

    ref = task.model()
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    ref_sched = SCHEDULERS["steplr"](ref_opt)
    losses, norms, lrs = [], [], []
    for i in range(steps):
        x, y = task.batch(i)
        lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.zero_grad()
        loss = task.loss_fn(ref(x), y)
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type).item())
        else:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type).item())
        ref_opt.step()
        ref_sched.step()
        losses.append(loss.item())

    assert_bitwise(params_of(model), params_of(ref), "params")
    assert [r.loss for r in records] == losses
    assert [r.grad_norm for r in records] == pytest.approx(norms, rel=1e-6)
    assert [r.lr for r in records] == pytest.approx(lrs)
    assert not any(r.skipped for r in records)
    if max_norm is None:
        assert not any(r.clipped for r in records)
    else:
        assert [r.clipped for r in records] == [n > max_norm for n in norms]
    assert sched.last_epoch == steps


def test_record_fields_on_a_clean_unclipped_step(task, make_step):
    train = make_step(max_norm=10.0)
    x, y = task.batch(0)
    record = train(x, y)

    ref = task.model()
    loss = task.loss_fn(ref(x), y)
    loss.backward()
    norm = labkit.grad_norm(ref.parameters()).item()

    assert isinstance(record, labkit.StepRecord)
    assert record.step == 0
    assert record.loss == loss.item()
    assert record.grad_norm == pytest.approx(norm, rel=1e-6)
    assert (record.clip_coef, record.clipped) == (1.0, False)
    assert (record.scale, record.next_scale) == (1.0, 1.0)
    assert (record.skipped, record.reason, record.skip_streak) == (False, None, 0)
    assert record.lr == 0.05
    assert record.fault is None
    assert record.top_grads == [] and record.first_nonfinite is None
    assert record.post_clip_norm == record.grad_norm
    assert train.log[0] is record and len(train.log) == 1
    assert train(*task.batch(1)).step == 1


def test_clipped_step_clips_grads_in_place_to_max_norm(task, make_step):
    train = make_step(max_norm=0.1)
    record = train(*task.batch(0))
    assert record.clipped
    assert record.grad_norm == pytest.approx(0.828, abs=1e-3)  # logged unclipped
    assert record.clip_coef == pytest.approx(0.1 / (record.grad_norm + 1e-6))
    assert record.post_clip_norm == pytest.approx(0.1, rel=1e-5)
    # the gradients the optimizer stepped with are the clipped ones
    assert labkit.grad_norm(train.model.parameters()).item() == pytest.approx(0.1, rel=1e-5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_scaler_created_per_precision(make_step, task, precision):
    train = make_step(precision)
    assert isinstance(train.scaler, labkit.GradScaler)
    assert isinstance(train.log, labkit.StepLog)
    assert train.scaler.is_enabled() == (precision == "fp16")
    record = train(*task.batch(0))
    expected = 65536.0 if precision == "fp16" else 1.0
    assert (record.scale, record.next_scale) == (expected, expected)
    assert not record.skipped


def test_given_scaler_is_used(make_step, task):
    scaler = labkit.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    train = make_step("fp16", scaler=scaler)
    assert train.scaler is scaler
    records = run(train, task, 4)
    assert ([(r.scale, r.next_scale) for r in records]
            == [(1024, 1024), (1024, 2048), (2048, 2048), (2048, 4096)])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_close_to_fp32(make_step, task, precision):
    n = 10 if precision == "fp16" else 4  # bf16 on CPU is slow
    ref, half = make_step("fp32"), make_step(precision)
    ref_records, half_records = run(ref, task, n), run(half, task, n)
    assert not any(r.skipped for r in half_records)
    assert [r.loss for r in half_records] == pytest.approx([r.loss for r in ref_records], rel=2e-2)
    for name, p in params_of(half.model).items():
        torch.testing.assert_close(p, params_of(ref.model)[name], atol=5e-3, rtol=0)


# ---------------------------------------------------------------- a skipped step changes nothing

SKIP_CAUSES = {
    "nan-batch": "nonfinite_loss",
    "inf-batch": "nonfinite_loss",
    "nan-grad": "nonfinite_grad",
}


@pytest.mark.parametrize("cause", list(SKIP_CAUSES), ids=list(SKIP_CAUSES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=list(OPTIMIZERS))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_skipped_step_leaves_params_and_optimizer_state_bitwise(make_step, task, precision, optimizer, cause):
    faults = {2: cause.split("-")[0]} if cause.endswith("batch") else None
    train = make_step(precision, optimizer, hooks=[Faults(faults)])
    hook = GradHook(train.model, "2.weight", NAN)
    run(train, task, 2)  # momentum / Adam moments exist now
    params, state = params_of(train.model), copy.deepcopy(train.optimizer.state_dict())
    assert state["state"], "optimizer state should be populated before the skip"

    with hook if cause == "nan-grad" else contextlib.nullcontext():
        record = train(*task.batch(2))

    assert record.skipped and record.reason == SKIP_CAUSES[cause]
    assert record.skip_streak == 1
    assert_bitwise(params_of(train.model), params, "params")
    assert_bitwise(train.optimizer.state_dict(), state, "optimizer state")
    assert not math.isfinite(record.grad_norm)
    assert math.isnan(record.post_clip_norm)
    if record.reason == "nonfinite_loss":
        assert not math.isfinite(record.loss)
        assert math.isnan(record.grad_norm)  # backward never ran
    expected_next = (
        record.scale * 0.5 if (precision == "fp16" and record.reason == "nonfinite_grad") else record.scale
    )
    assert record.next_scale == expected_next
    assert record.scale == (65536.0 if precision == "fp16" else 1.0)

    after = train(*task.batch(3))  # training goes on
    assert not after.skipped and after.skip_streak == 0


def test_skip_on_nonfinite_loss_does_not_run_backward(make_step, task):
    train = make_step("fp16", hooks=[Faults({0: "nan"})])
    record = train(*task.batch(0))
    assert record.reason == "nonfinite_loss"
    assert all(p.grad is None for p in train.model.parameters())  # zeroed, and backward never ran


# ---------------------------------------------------------------- the loss scale and bad data


def test_fp16_nan_batches_leave_the_scale_alone(make_step, task):
    scaler = labkit.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    train = make_step("fp16", scaler=scaler, hooks=[Faults(labkit.FaultSchedule.parse(["1-3:nan"]))])
    records = run(train, task, 6)
    assert ([r.reason for r in records]
            == [None, "nonfinite_loss", "nonfinite_loss", "nonfinite_loss", None, None])
    for r in records[1:4]:
        assert r.next_scale == r.scale == 1024.0
    # NaN batches do not count as clean iterations either: growth needs two real steps (0 and 4)
    assert [r.next_scale for r in records] == [1024.0, 1024.0, 1024.0, 1024.0, 2048.0, 2048.0]


def test_fp16_overflow_backs_off_by_the_scaler_backoff(make_step, task):
    scaler = labkit.GradScaler("cpu", init_scale=4096.0, backoff_factor=0.25)
    train = make_step("fp16", scaler=scaler, hooks=[Faults({1: "overflow", 2: "overflow"})])
    records = run(train, task, 4)
    assert [r.reason for r in records] == [None, "nonfinite_grad", "nonfinite_grad", None]
    assert [(r.scale, r.next_scale) for r in records] == [(4096, 4096), (4096, 1024), (1024, 256), (256, 256)]


def test_torch_gradscaler_halves_the_scale_on_nan_batches_labkit_does_not(make_step, task):
    """Documents the difference: torch's recipe punishes the scale for bad data, TrainStep does not."""
    bad = labkit.Fault("nan")
    nan_steps = {1, 2, 3}

    model = task.model()
    opt = OPTIMIZERS["sgd-momentum"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    torch_scales = []
    for i in range(5):
        x, y = task.batch(i)
        if i in nan_steps:
            x = bad.corrupt_inputs(x)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = task.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        torch_scales.append(scaler.get_scale())

    train = make_step("fp16", hooks=[Faults({i: "nan" for i in nan_steps})])
    labkit_scales = [r.next_scale for r in run(train, task, 5)]

    assert torch_scales == [65536.0, 32768.0, 16384.0, 8192.0, 8192.0]
    assert labkit_scales == [65536.0] * 5
    # and both left the parameters where the clean steps 0 and 4 put them
    for name, p in params_of(train.model).items():
        torch.testing.assert_close(p, params_of(model)[name], atol=1e-3, rtol=0)


# ---------------------------------------------------------------- scheduler


@pytest.mark.parametrize("scheduler", list(SCHEDULERS), ids=list(SCHEDULERS))
def test_scheduler_only_steps_with_the_optimizer(make_step, task, scheduler):
    train = make_step("fp16", scheduler=scheduler, hooks=[Faults({1: "nan", 2: "inf", 4: "overflow"})])
    records = run(train, task, 8)
    assert train.log.skipped_steps == [1, 2, 4]
    real = [0] + [sum(not r.skipped for r in records[:i]) for i in range(1, 8)]  # real steps before each
    factor = (lambda e: 0.5**e) if scheduler == "steplr" else (lambda e: 1.0 / (1 + e))
    assert [r.lr for r in records] == pytest.approx([0.05 * factor(e) for e in real])
    assert train.scheduler.last_epoch == 5
    assert train.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * factor(5))


# ---------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("k", [2, 4, 5], ids=["k2", "k4", "k5-unequal-splits"])
def test_accumulation_matches_the_full_batch(make_step, task, k):
    full, accum = make_step(max_norm=0.3), make_step(max_norm=0.3, accumulation_steps=k)
    full_records, accum_records = run(full, task, 5), run(accum, task, 5)
    assert any(r.clipped for r in accum_records)  # clipping is part of what is compared
    assert [r.loss for r in accum_records] == pytest.approx([r.loss for r in full_records], rel=1e-5)
    assert [r.grad_norm for r in accum_records] == pytest.approx(
        [r.grad_norm for r in full_records], rel=1e-5
    )
    assert [r.clipped for r in accum_records] == [r.clipped for r in full_records]
    for name, p in params_of(accum.model).items():
        torch.testing.assert_close(p, params_of(full.model)[name], atol=1e-6, rtol=0)


def test_accumulation_clips_once_on_the_accumulated_gradient(make_step, task):
    k, max_norm, steps = 4, 0.1, 3
    train = make_step(max_norm=max_norm, accumulation_steps=k)
    records = run(train, task, steps)
    assert all(r.clipped for r in records)

    def manual(clip_every_micro_batch):
        model = task.model()
        opt = OPTIMIZERS["sgd-momentum"](model.parameters())
        for i in range(steps):
            x, y = task.batch(i)
            opt.zero_grad()
            for xm, ym in zip(torch.tensor_split(x, k), torch.tensor_split(y, k)):
                (task.loss_fn(model(xm), ym) * len(xm) / len(x)).backward()
                if clip_every_micro_batch:  # the classic bug
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not clip_every_micro_batch:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
        return params_of(model)

    once, every = manual(False), manual(True)
    got = params_of(train.model)
    for name in got:
        torch.testing.assert_close(got[name], once[name], atol=1e-6, rtol=0)
    worst = max((got[n] - every[n]).abs().max().item() for n in got)
    assert worst > 1e-4, "clipping each micro-batch should give visibly different parameters"


def test_accumulation_does_one_norm_pass_one_unscale_clip_pass_one_step(make_step, task, monkeypatch):
    """The gradients are read once for the norms and written once (unscale and clip together)."""
    k = 4
    train = make_step("fp16", max_norm=0.1, accumulation_steps=k)
    calls = {"forward": 0, "norms": 0, "write": 0, "step": 0}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(
        labkit.step.decision, "grouped_norms", counting("norms", labkit.step.decision.grouped_norms)
    )
    monkeypatch.setattr(labkit.step.train, "scale_grads_", counting("write", labkit.step.train.scale_grads_))
    train.optimizer.register_step_post_hook(lambda *a: calls.__setitem__("step", calls["step"] + 1))
    train.model.register_forward_hook(lambda *a: calls.__setitem__("forward", calls["forward"] + 1))

    record = train(*task.batch(0))
    assert record.clipped and not record.skipped
    assert calls == {"forward": k, "norms": 1, "write": 1, "step": 1}


# ---------------------------------------------------------------- alarms


def count(caught, category):
    return sum(issubclass(w.category, category) for w in caught)


def _assert_clipped(record):
    assert record.clipped


def warned_at(train, task, steps, category, each=None):
    """Run ``steps`` steps; return the steps on which a ``category`` warning fired, and all warnings."""
    fired_at = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            before = count(caught, category)
            record = train(*task.batch(i))
            if each is not None:
                each(record)
            if count(caught, category) > before:
                fired_at.append(i)
    return fired_at, caught


def test_skip_streak_warning_once_per_streak(make_step, task):
    assert issubclass(labkit.SkipStreakWarning, labkit.LabkitWarning)
    # streak of 5 (steps 0-4), a good step, then a streak of 3 (steps 6-8)
    train = make_step(hooks=[SkipAlarm(3), Faults(labkit.FaultSchedule.parse(["0-4:nan", "6-8:nan"]))])
    fired_at, caught = warned_at(train, task, 10, labkit.SkipStreakWarning)
    assert fired_at == [2, 8]
    assert train.log.column("skip_streak") == [1, 2, 3, 4, 5, 0, 1, 2, 3, 0]
    message = str(next(w.message for w in caught if issubclass(w.category, labkit.SkipStreakWarning)))
    assert "3 steps skipped in a row" in message
    assert "nonfinite_loss" in message and "TrainStep(hooks=[Triage()]) does both" in message


def test_skip_streak_warning_with_pytest_warns(make_step, task):
    train = make_step("fp16", hooks=[SkipAlarm(2), Faults({0: "overflow", 1: "overflow"})])
    train(*task.batch(0))
    with pytest.warns(
        labkit.SkipStreakWarning, match=r"2 steps skipped in a row \(steps 0-1: nonfinite_grad x2\)"
    ):
        train(*task.batch(1))


def test_skip_alarm_none_never_warns(make_step, task):
    train = make_step(hooks=[SkipAlarm(None), Faults(labkit.FaultSchedule.parse(["0-11:nan"]))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = run(train, task, 12)
    assert count(caught, labkit.LabkitWarning) == 0
    assert [r.skip_streak for r in records] == list(range(1, 13))


def test_repeated_clipping_warning_fires_once(make_step, task):
    assert issubclass(labkit.RepeatedClippingWarning, labkit.LabkitWarning)
    train = make_step(max_norm=1e-3, hooks=[ClipAlarm(0.5, window=4)])
    fired_at, caught = warned_at(
        train, task, 12, labkit.RepeatedClippingWarning, each=lambda r: _assert_clipped(r)
    )
    assert fired_at == [3]
    message = str(next(w.message for w in caught if issubclass(w.category, labkit.RepeatedClippingWarning)))
    assert "repeated clipping" in message and "last 4 steps" in message


def test_repeated_clipping_with_pytest_warns(make_step, task):
    train = make_step(max_norm=1e-3, hooks=[ClipAlarm(0.5, window=2)])
    train(*task.batch(0))
    with pytest.warns(labkit.RepeatedClippingWarning, match="repeated clipping: 100% of the last 2 steps"):
        train(*task.batch(1))


def test_repeated_clipping_counts_stepped_steps_only(make_step, task):
    train = make_step(max_norm=1e-3, hooks=[ClipAlarm(0.5, window=2), Faults({1: "nan", 2: "nan"})])
    fired_at, caught = warned_at(train, task, 6, labkit.RepeatedClippingWarning)
    assert fired_at == [3]  # the stepped steps 0 and 3 fill the window of 2; skips 1-2 are not in it


def test_repeated_clipping_needs_more_than_the_fraction(make_step, task):
    # spikes clip steps 0, 2, 4 (half of every window of 4): not above 0.5; step 5 tips it
    train = make_step(max_norm=5.0,
                      hooks=[ClipAlarm(0.5, window=4),
                             Faults(labkit.FaultSchedule.parse(["0:spike", "2:spike", "4-5:spike"]))])
    fired_at, caught = warned_at(train, task, 6, labkit.RepeatedClippingWarning)
    assert train.log.clipped_steps == [0, 2, 4, 5]
    assert fired_at == [5]


def test_clip_alarm_none_never_warns(make_step, task):
    train = make_step(max_norm=1e-3, hooks=[ClipAlarm(None, window=2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = run(train, task, 6)
    assert all(r.clipped for r in records)
    assert count(caught, labkit.LabkitWarning) == 0


# ---------------------------------------------------------------- forensics


@pytest.mark.parametrize("name", ["0.weight", "2.bias", "4.weight"])
def test_top_grads_names_the_spiking_layer(make_step, task, name):
    train = make_step(max_norm=1.0)
    with GradHook(train.model, name, 1e4):
        record = train(*task.batch(0))
    assert record.clipped and not record.skipped
    assert record.first_nonfinite is None
    assert len(record.top_grads) == 3
    assert record.top_grads[0][0] == name
    assert all(isinstance(n, str) and n in NAMES for n, _ in record.top_grads)
    values = [v for _, v in record.top_grads]
    assert values == sorted(values, reverse=True)
    # the norms are the unclipped ones: the clipped grad divided by the clip coefficient
    grads = {n: p.grad for n, p in train.model.named_parameters()}
    for n, v in record.top_grads:
        assert v == pytest.approx(grads[n].norm().item() / record.clip_coef, rel=1e-4)
    assert record.grad_norm >= values[0]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["0.bias", "2.weight", "4.bias"])
def test_first_nonfinite_names_the_nan_layer(make_step, task, precision, name):
    train = make_step(precision)
    param = dict(train.model.named_parameters())[name]
    handle = param.register_hook(lambda g: g * float("nan"))
    record = train(*task.batch(0))
    handle.remove()
    assert record.skipped and record.reason == "nonfinite_grad"
    assert record.first_nonfinite == name
    assert record.top_grads[0][0] == name and math.isnan(record.top_grads[0][1])
    assert all(math.isfinite(v) for _, v in record.top_grads[1:])
    assert len(record.top_grads) == 3


def test_no_forensics_on_a_bad_batch(make_step, task):
    record = make_step(hooks=[Faults({0: "nan"})])(*task.batch(0))
    assert record.reason == "nonfinite_loss"
    assert record.top_grads == [] and record.first_nonfinite is None


def test_first_nonfinite_is_none_when_only_the_norm_overflows(make_step, task):
    """Every gradient is finite, but its float32 sum of squares overflows to inf.

    first_nonfinite must name a parameter *holding* a non-finite gradient, so here it must
    be None (TrainStep infers it from the per-tensor norms instead of the gradients).
    """
    train = make_step()
    with GradHook(train.model, "2.weight", 1e25):
        record = train(*task.batch(0))
    assert all(torch.isfinite(p.grad).all() for p in train.model.parameters())
    assert record.first_nonfinite is None


# ---------------------------------------------------------------- state_dict / resume


def _checkpoint(*objs):
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in objs], buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_equals_an_uninterrupted_run(task, precision):
    n = 6
    schedule = labkit.FaultSchedule.parse(["2:nan", "4-6:overflow", "8:spike:100", "9:nan"])

    def fresh():
        model = task.model()
        opt = OPTIMIZERS["adamw"](model.parameters())
        sched = SCHEDULERS["steplr"](opt)
        scaler = labkit.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
        train = labkit.TrainStep(model, opt, task.loss_fn, precision=precision,
                                 scaler=scaler if precision == "fp16" else None, scheduler=sched,
                                 max_norm=0.5, hooks=[SkipAlarm(3), Faults(schedule)])
        return train

    with warnings.catch_warnings(record=True) as caught_full:
        warnings.simplefilter("always")
        full = fresh()
        full_records = run(full, task, 2 * n)

    with warnings.catch_warnings(record=True) as caught_resumed:
        warnings.simplefilter("always")
        first = fresh()
        run(first, task, n)
        saved = _checkpoint(first, first.model, first.optimizer, first.scheduler)
        resumed = fresh()
        for obj, state in zip((resumed, resumed.model, resumed.optimizer, resumed.scheduler), saved):
            obj.load_state_dict(state)
        second_records = run(resumed, task, n, start=n)

    assert resumed.step_count == 2 * n
    assert [r.step for r in second_records] == list(range(n, 2 * n))
    for a, b in zip(full_records[n:], second_records):
        assert_records_equal(a, b)
    assert_bitwise(params_of(resumed.model), params_of(full.model), "params")
    assert_bitwise(resumed.optimizer.state_dict(), full.optimizer.state_dict(), "optimizer state")
    assert resumed.scheduler.last_epoch == full.scheduler.last_epoch
    # the schedule continued at the right step numbers, and a streak crossing the save survived
    assert [r.fault for r in second_records] == [
        schedule.get(i).label if schedule.get(i) else None for i in range(n, 2 * n)
    ]
    assert full.log.skipped_steps[-1] == 9
    streak_warnings = [
        str(w.message) for w in caught_full if issubclass(w.category, labkit.SkipStreakWarning)
    ]
    resumed_warnings = [
        str(w.message) for w in caught_resumed if issubclass(w.category, labkit.SkipStreakWarning)
    ]
    assert streak_warnings == resumed_warnings
    if precision == "fp16":
        assert full_records[6].reason == "nonfinite_grad"  # the streak 4-6 spans the save at step 6
        assert len(streak_warnings) == 1


def test_state_dict_contents(make_step, task):
    train = make_step("fp16", hooks=[Faults({1: "nan"})])
    run(train, task, 3)
    state = train.state_dict()
    assert state["step"] == 3
    assert state["scaler"]["scale"] == 65536.0
    assert state["skip_alarm"]["streak"] == 0
    assert len(state["clip_alarm"]["recent"]) == 2  # stepped steps only


def test_load_state_dict_missing_keys(make_step):
    train = make_step()
    with pytest.raises(KeyError, match="step"):
        train.load_state_dict({"skip_alarm": {}, "clip_alarm": {}, "scaler": {}})


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"precision": "fp8"}, ValueError),
        ({"precision": "float16"}, ValueError),
        ({"accumulation_steps": 0}, ValueError),
        ({"accumulation_steps": -2}, ValueError),
        ({"accumulation_steps": 2.0}, ValueError),
        ({"max_norm": 0}, ValueError),
        ({"max_norm": -1.0}, ValueError),
        ({"max_norm": NAN}, ValueError),
        ({"scaler": torch.amp.GradScaler("cpu")}, TypeError),
    ],
    ids=["fp8", "float16", "accum-0", "accum-neg", "accum-float", "max-norm-0", "max-norm-neg",
         "max-norm-nan", "torch-gradscaler"],
)
def test_bad_constructor_arguments(make_step, kwargs, error):
    with pytest.raises(error):
        make_step(**kwargs)


def test_torch_gradscaler_message_says_what_to_use(make_step):
    with pytest.raises(TypeError, match="labkit.GradScaler"):
        make_step("fp16", scaler=torch.amp.GradScaler("cpu"))


def test_non_scalar_loss(task):
    model = task.model()
    before = params_of(model)
    train = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match="one number"):
        train(*task.batch(0))
    assert_bitwise(params_of(model), before, "params")


@pytest.mark.parametrize("batch, k", [(3, 4), (1, 2)], ids=["3-samples-k4", "1-sample-k2"])
def test_batch_smaller_than_accumulation_steps(make_step, task, batch, k):
    train = make_step(accumulation_steps=k)
    x, y = task.batch(0)
    with pytest.raises(ValueError, match="accumulation_steps"):
        train(x[:batch], y[:batch])


def test_inputs_and_targets_of_different_lengths(make_step, task):
    x, y = task.batch(0)
    with pytest.raises(ValueError):
        make_step()(x, y[:-1])


def test_bf16_with_an_enabled_scaler_warns(make_step):
    with pytest.warns(labkit.LabkitWarning, match="bf16"):
        make_step("bf16", scaler=labkit.GradScaler("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_step("bf16", scaler=labkit.GradScaler("cpu", enabled=False))
    assert count(caught, labkit.LabkitWarning) == 0


@pytest.mark.parametrize("precision, sync_every", [("fp32", None), ("fp16", None), ("fp16", 2)])
def test_no_gradient_of_the_last_step_lives_into_the_next_forward(task, precision, sync_every):
    """zero_grad frees the last step's gradients, as in torch's loop: none is kept alive (a second
    set of gradients in memory through forward and backward, and their freeing paid later)."""
    model = task.model()
    train = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), task.loss_fn,
                             precision=precision, max_norm=0.05, sync_every=sync_every)
    train(*task.batch(0))
    old = [weakref.ref(p.grad) for p in model.parameters()]
    alive = []
    model.register_forward_pre_hook(lambda module, args: alive.append(sum(r() is not None for r in old)))
    record = train(*task.batch(1))
    assert alive == [0] and record.clipped and record.top_grads  # the forensics still had the gradients


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_two_param_groups_sum_the_norm_in_model_order_like_torch(precision):
    """nanoGPT's two groups (decayed weights, then undecayed biases): the norm is summed in the model's
    order, as ``clip_grad_norm_(model.parameters())`` sums it, so norms and parameters are torch's bits."""
    task = labkit.tasks.GPTTask(block_size=16, batch_size=4, measure=False)

    def groups(model):
        params = list(model.parameters())
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    steps, max_norm, dtype = 6, 1.0, labkit.step.PRECISIONS[precision]
    torch.manual_seed(0)
    model = task.model()
    train = labkit.TrainStep(model, torch.optim.AdamW(groups(model), lr=1e-3), task.loss_fn,
                             precision=precision, max_norm=max_norm)
    records = [train(*task.batch(i)) for i in range(steps)]

    torch.manual_seed(0)
    ref = task.model()
    opt = torch.optim.AdamW(groups(ref), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    norms = []
    for i in range(steps):
        x, y = task.batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = task.loss_fn(ref(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        scaler.step(opt)
        scaler.update()

    assert [r.grad_norm for r in records] == norms  # to the bit, not approx
    assert any(r.clipped for r in records)
    assert_bitwise(params_of(model), params_of(ref), "params")


@pytest.mark.parametrize("sync_every", [None, 2])
def test_the_alarms_warn_at_the_users_call_not_inside_labkit(make_step, task, sync_every):
    train = make_step(max_norm=1e-3, sync_every=sync_every, hooks=[ClipAlarm(0.5, window=2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            train(*task.batch(i))  # the warning's line
        train.flush()
    [w] = [w for w in caught if issubclass(w.category, labkit.RepeatedClippingWarning)]
    assert w.filename == __file__, w.filename


def test_clipping_that_subsides_is_the_design_clipping_that_holds_is_the_symptom():
    """The early steps of a max_norm=1 run clip most steps, fewer and fewer (nanoGPT: 63-70 % early):
    no warning, though more than half of a window clipped; the same rate held, or growing, warns."""
    from labkit.alarms import ClipAlarm

    def fired(pattern, window=100):
        alarm = ClipAlarm(rate=0.5, window=window)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, clipped in enumerate(pattern):
                alarm.observe(clipped, step=i)
        return [w for w in caught if issubclass(w.category, labkit.RepeatedClippingWarning)]

    # clipped with a probability falling from 0.95 to 0.2 over 300 steps (a fixed draw)
    g = torch.Generator().manual_seed(0)
    falling = [bool(torch.rand((), generator=g) < 0.95 - 0.75 * i / 300) for i in range(300)]
    assert sum(falling[:100]) > 70  # the rule before (more than half of the last 100) fired at step 99
    assert fired(falling) == []
    held = [bool(torch.rand((), generator=g) < 0.7) for _ in range(300)]
    assert len(fired(held)) == 1
    onset = [False] * 200 + [True] * 100  # a run that clipped rarely starts clipping every step
    assert len(fired(onset)) == 1


# ---------------------------------------------------------------- the step's fast paths keep torch's contract


def test_zero_grad_is_torchs_own_where_a_profiler_records_or_the_optimizer_has_its_own():
    """TrainStep frees the gradients itself (torch's zero_grad without its ~20 us profiler label) only where
    nothing can tell: a profiler still sees torch's label, and an optimizer's own zero_grad still runs."""
    task = labkit.ToyTask()

    class Counting(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            Counting.calls += 1
            super().zero_grad(set_to_none)

    model = task.model()
    step = labkit.TrainStep(model, Counting(model.parameters(), lr=0.01), task.loss_fn)
    for i in range(3):
        step(*task.batch(i))
    assert Counting.calls == 3

    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = labkit.TrainStep(model, opt, task.loss_fn)
    step(*task.batch(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(*task.batch(1))
    names = [e.name for e in prof.events()]
    assert "Optimizer.zero_grad#SGD.zero_grad" in names
    assert all(p.grad is not None for p in model.parameters())  # the last step's, kept for its forensics
    labkit.step.parts.GuardedParams(model, opt).zero_grad()  # outside a profiler: freed all the same
    assert all(p.grad is None for p in model.parameters())


def test_the_buffers_kept_are_the_modules_buffers_nested_shared_and_none():
    """Buffers' walk lists what model.buffers() does (as a set: a shared one twice is harmless)."""
    shared = nn.BatchNorm1d(2)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Sequential(nn.Linear(3, 2), shared, shared), nn.Identity())
    model.register_buffer("empty", None)
    model[1].register_buffer("count", torch.zeros(()))
    kept = labkit.step.batch.Buffers(model)
    assert {id(b) for b in kept.live} == {id(b) for b in model.buffers()}
    assert len({id(b) for b in model.buffers()}) == 7
    before = [b.clone() for b in model.buffers()]
    model.train()(torch.randn(4, 3))
    kept.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
