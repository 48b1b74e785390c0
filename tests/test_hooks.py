"""The hook protocol through TrainStep: the moments and their order, what a hook's verdict and measures
do to the step (on the host path and the device path alike), hook state, and the older keywords."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from host_reads import SyncCounter

import labkit
from labkit import GradScaler, ToyTask, TrainStep
from labkit.clippers import ZClip
from labkit.hooks import DecisionView, Hook, Verdict
from labkit.reasons import Reason

STEPS = 6
NAN = pytest.approx(math.nan, nan_ok=True)


@pytest.fixture
def task():
    return ToyTask()


class Recorder(Hook):
    """Writes down every moment it is called at, with what it saw."""

    state_key = "recorder"

    def __init__(self):
        self.calls = []

    def attach(self, trainer):
        self.calls.append(("attach", trainer.step_count))

    def pre_step(self, trainer, step):
        self.calls.append(("pre_step", step))

    def post_backward(self, trainer, step):
        self.calls.append(("post_backward", step))

    def on_decision(self, trainer, view):
        self.calls.append(("on_decision", view.step, view.loss_bad, view.norm))

    def pre_optim_step(self, trainer, step, params):
        assert all(p.grad is not None for _, p in params)  # the gradients the optimizer will use
        self.calls.append(("pre_optim_step", step, [n for n, _ in params][0]))

    def post_step(self, trainer, params, record):
        self.calls.append(("post_step", record.step, record.skipped))

    def on_record(self, trainer, record):
        self.calls.append(("on_record", record.step, record.reason, trainer.step_count))

    def state_dict(self):
        return {"seen": len(self.calls)}

    def load_state_dict(self, state):
        if not isinstance(state.get("seen"), int):
            raise ValueError("Recorder state needs an int 'seen'.")
        self.calls = self.calls[: state["seen"]]


def run(task, hooks=(), steps=STEPS, kind="sgd", **kwargs):
    torch.manual_seed(0)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    train = TrainStep(model, opt, task.loss_fn, precision="fp16", hooks=list(hooks), **kwargs)
    records = [train(*task.batch(i)) for i in range(steps)]
    return model, records, train


def test_moments_come_in_the_amp_order(task):
    rec = Recorder()
    _, records, train = run(task, [rec], steps=3, max_norm=0.05, faults={1: "nan", 2: "overflow"})
    clean, bad_loss, overflow = records
    assert clean.clipped and bad_loss.reason == "nonfinite_loss" and overflow.reason == "nonfinite_grad"
    assert rec.calls == [
        ("attach", 0),
        ("pre_step", 0), ("post_backward", 0), ("on_decision", 0, False, clean.grad_norm),
        ("pre_optim_step", 0, "0.weight"), ("post_step", 0, False), ("on_record", 0, None, 1),
        # a non-finite loss: no backward, no optimizer step; the hooks still see the decision and the record
        ("pre_step", 1), ("post_backward", 1), ("on_decision", 1, True, NAN),
        ("on_record", 1, "nonfinite_loss", 2),
        # gradients not finite: decided and skipped, so no pre_optim_step
        ("pre_step", 2), ("post_backward", 2), ("on_decision", 2, False, NAN),
        ("post_step", 2, True), ("on_record", 2, "nonfinite_grad", 3),
    ]
    assert list(train.log) == records


class SkipAt(Hook):
    """Skips one step, as a spike detector would."""

    def __init__(self, at):
        self.at = at

    def on_decision(self, trainer, view):
        return Verdict(skip=Reason.SPIKE_LOSS, fields={"z_loss": 9.5}) if view.step == self.at else None


class ClipTo(Hook):
    def __init__(self, limit):
        self.limit = limit

    def on_decision(self, trainer, view):
        return Verdict(clip_to=self.limit)


def _dicts(records):
    return [repr(r.to_dict()) for r in records]


@pytest.mark.parametrize("kind", ["sgd", "adamw-fused"])
def test_a_hook_skip_keeps_the_scale(task, kind):
    model_h, records_h, train_h = run(task, [SkipAt(3)], kind=kind, max_norm=0.05)
    skip = records_h[3]
    assert skip.skipped and skip.reason == "spike_loss" and type(skip.reason) is str and skip.z_loss == 9.5
    assert skip.next_scale == skip.scale and skip.clip_coef == 1.0 and skip.threshold == 0.05
    assert skip.top_grads and train_h.scaler.skip_count == 0  # named, and not counted as an overflow
    unskipped, _, _ = run(task, [], kind=kind, max_norm=0.05, steps=3)
    for p, q in zip(unskipped.parameters(), model_h.parameters()):  # step 3 never moved them
        assert not torch.equal(p, q)


def test_a_hook_clip_cuts_deeper_than_the_clipper_and_names_itself(task):
    _, plain, _ = run(task, [], max_norm=1e6)
    _, records_h, _ = run(task, [ClipTo(0.02)], max_norm=1e6)
    assert len(records_h) == len(plain)
    for r in records_h:
        assert r.clipped and r.clip_reason == "ClipTo" and r.threshold == 1e6
        assert r.grad_norm * r.clip_coef == pytest.approx(0.02, rel=1e-5)
    _, records, _ = run(task, [ClipTo(1e7)], max_norm=0.05)  # the clipper's cut is the deeper one
    assert all(r.clip_reason == "NormClip" for r in records if r.clipped)


class Measure(Hook):
    """Contributes a device tensor to the record (a model measurement, issue-26 style)."""

    def __init__(self):
        self.model = None

    def attach(self, trainer):
        self.model = trainer.model

    def post_backward(self, trainer, step):
        return {"z_loss": next(self.model.parameters()).detach().abs().max()}


@pytest.mark.parametrize("precision, kind, sync_every", [("fp16", "sgd", None), ("fp32", "sgd", None),
                                                         ("fp16", "sgd", 3), ("fp16", "fused", 3)])
def test_measures_ride_the_records_read(task, monkeypatch, precision, kind, sync_every):
    """A hook's device measure lands in its record field with no host read of its own."""
    def go(hooks):
        torch.manual_seed(0)
        model = task.model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05) if kind == "sgd" else \
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        # a NaN batch at step 2 (fp16: its measure rides the read of the scale; without a scaler nothing
        # else is read on such a step, and the measure costs that step its one read)
        faults = {2: "nan"} if sync_every is None and precision == "fp16" else None
        train = TrainStep(model, opt, task.loss_fn, precision=precision, sync_every=sync_every, hooks=hooks,
                          faults=faults)
        train(*task.batch(0))
        train.flush()
        counter = SyncCounter(monkeypatch)
        expected, records, syncs = [], [], []
        for i in range(1, 4):
            expected.append(next(model.parameters()).detach().abs().max().item())  # before the step moves it
            before = counter.count
            records.append(train(*task.batch(i)))
            syncs.append(counter.count - before)
        train.flush()
        monkeypatch.undo()
        return records, expected, syncs

    records, expected, syncs = go([Measure()])
    plain, _, plain_syncs = go([])
    assert syncs == plain_syncs
    assert [r.z_loss for r in records] == expected
    assert all(math.isnan(r.z_loss) for r in plain)


def test_hook_state_is_saved_validated_before_anything_is_written_and_restored(task):
    rec = Recorder()
    _, _, train = run(task, [rec], steps=3)
    state = train.state_dict()
    assert state["recorder"] == {"seen": 1 + 3 * 6}
    scale, step = train.scaler.get_scale(), train.step_count
    with pytest.raises(ValueError, match="Recorder state"):
        train.load_state_dict({**state, "step": 0, "recorder": {"seen": "many"}})
    assert train.step_count == step and train.scaler.get_scale() == scale and len(rec.calls) == 19
    train.load_state_dict({**state, "recorder": {"seen": 4}})
    assert len(rec.calls) == 4


def test_hooks_must_be_hooks_and_per_step_ones_refuse_deferred_records(task):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(TypeError, match="hooks must be labkit.hooks.Hook objects"):
        TrainStep(model, opt, task.loss_fn, hooks=[object()])
    with pytest.raises(TypeError, match="hooks must be a list"):
        TrainStep(model, opt, task.loss_fn, hooks=Recorder())
    per_step = Recorder()
    per_step.per_step = True
    with pytest.raises(ValueError, match="sync_every"):
        TrainStep(model, opt, task.loss_fn, hooks=[per_step], sync_every=2)


def test_max_norm_and_a_clipper_together_are_an_error(task):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ValueError, match="either max_norm"):
        TrainStep(model, opt, task.loss_fn, max_norm=1.0, clipper=ZClip())  # 1.0 is the default's value
    assert isinstance(TrainStep(model, opt, task.loss_fn, clipper=ZClip()).clipper, ZClip)
    assert TrainStep(model, opt, task.loss_fn, max_norm=None, clipper=ZClip()).max_norm is None
    assert TrainStep(model, opt, task.loss_fn).max_norm == 1.0
    assert inspect.signature(TrainStep).parameters["max_norm"].default == 1.0  # what help() shows


def test_records_hold_plain_strings_and_the_jsonl_is_unchanged(task, tmp_path):
    _, records, train = run(task, [SkipAt(2)], steps=4, faults={1: "nan"})
    assert [type(r.reason) for r in records] == [type(None), str, str, type(None)]
    summary = train.log.summary()["skips_by_reason"]
    assert summary == {"nonfinite_loss": 1, "nonfinite_grad": 0, "spike_loss": 1}
    assert all(type(k) is str for k in summary)
    train.log.to_jsonl(tmp_path / "log.jsonl")
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert '"reason": "nonfinite_loss"' in lines[1] and '"reason": "spike_loss"' in lines[2]
    assert f"{Reason.DEAD_SCALE}" == "dead_scale" and Reason("nonfinite_grad") is Reason.NONFINITE_GRAD


def test_a_scaler_iteration_can_be_abandoned_and_its_state_parsed_without_writing():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    scaler.abandon_iteration()  # a plain loop's skip that is no scaling problem: the scale stays
    scaler.unscale_(opt)  # a fresh iteration: no "already called"
    scaler.update()
    assert scaler.get_scale() == 8.0
    state = scaler.state_dict()
    config, values = GradScaler.parse_state(state)
    assert values[0] == 8.0 and config.growth_interval == 2000
    with pytest.raises(ValueError):
        GradScaler.parse_state({**state, "_growth_tracker": -1})
    assert scaler.state_dict() == state


def test_the_lab_front_names_what_the_lessons_import():
    import labkit.lab as lab
    from labkit.lab.experiment import ExperimentConfig
    from labkit.lab.widgets import ControlPanel

    assert lab.ExperimentConfig is ExperimentConfig and lab.ControlPanel is ControlPanel
    assert set(lab.__all__) == set(dir(lab)) & set(lab.__all__)
    for name in lab.__all__:
        assert getattr(lab, name) is not None, name
    with pytest.raises(AttributeError):
        lab.nothing_here  # noqa: B018


def test_a_decision_view_reads_device_values_once_when_asked():
    view = DecisionView(0, torch.tensor(0.5), torch.tensor(2.0))
    assert (view.loss, view.norm) == (0.5, 2.0)
    assert labkit.hooks.Verdict().skip is None


def test_hooks_carry_their_own_order(task):
    """``priority``, higher first, ties as given: the alarms, then triage, then the rest, a rewind last,
    wherever each was passed."""
    from labkit.alarms import ClipAlarm, SkipAlarm
    from labkit.rewind import Rewind
    from labkit.triage import Triage

    rewind, first, second = Rewind(back=2, skip=2), Recorder(), Recorder()
    model = task.model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                      hooks=[rewind, first, second], triage=True)
    kinds = [type(h) for h in train.hooks.members if type(h).__name__ != "BackwardOrder"]
    assert kinds == [SkipAlarm, ClipAlarm, Triage, Recorder, Recorder, Rewind]
    assert train.hooks.members.index(first) < train.hooks.members.index(second)
