"""Every defense in any loop: a plain torch loop (autocast, scaler.scale(loss).backward(), unscale_, a
labkit clipper, scaler.step, update) using labkit's parts by hand gives TrainStep's parameters and
records to the bit, with the same parts on the same seed; and each hook runs without TrainStep."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from labkit import GradScaler, StepLog, StepRecord, ToyTask, TrainStep
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.blame import BackwardOrder
from labkit.clip import clip_coef, per_tensor_norms, total_norm
from labkit.clippers import NormClip
from labkit.formats.bf16 import StaleMonitor
from labkit.hooks import DecisionView, Verdict
from labkit.records import put
from labkit.rewind import Rewind
from labkit.spikes import SpikeDetector
from labkit.step.record import forensics

STEPS, SPIKE_AT, NAN_AT, INF_AT = 40, 30, 12, 20


def batch(task, i):
    """The toy data, with a NaN batch, a x10 spike (the detector's) and, at INF_AT, an inf gradient."""
    x, y = task.batch(i)
    if i == NAN_AT:
        x = torch.full_like(x, math.nan)
    return (x * 10.0 if i == SPIKE_AT else x), y


def parts(task):
    torch.manual_seed(0)
    model = task.model()
    first = next(model.parameters())

    def overflow_at_the_head(module, args, out):  # an overflow in backward, at the output layer
        if first.grad_step == INF_AT:
            out.register_hook(lambda g: g * math.inf)

    model[4].register_forward_hook(overflow_at_the_head)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=16)
    return model, first, opt, scaler, NormClip(0.5), SpikeDetector(window=16, skip_z=6.0)


def plain_loop(task):
    """nanoGPT's order with labkit's pieces, by hand: what a practitioner's loop looks like."""
    model, first, opt, scaler, clipper, detector = parts(task)
    skips, clips, log = SkipAlarm(8), ClipAlarm(0.5, 100), StepLog()
    order = BackwardOrder()
    order.attach(model)
    for step in range(STEPS):
        order.pre_step(None, step)
        first.grad_step = step
        x, y = batch(task, step)
        lrs = [float(g["lr"]) for g in opt.param_groups]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = task.loss_fn(model(x), y)
        # the record's numbers, gathered as the step goes; the record is built once, at the end
        n = dict(loss=loss.item(), scale=scaler.get_scale(), lr=lrs[0], lrs=lrs)
        fields = {}
        if not math.isfinite(n["loss"]):  # a bad batch: no backward, no step, the scale untouched
            n.update(skipped=True, reason="nonfinite_loss", next_scale=n["scale"])
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
            norms = per_tensor_norms([g for _, g in named], 2.0)
            norm = total_norm(norms, 2.0)  # the unclipped norm, logged
            n["grad_norm"] = norm.item()
            put(fields, "threshold", clipper.max_norm)
            view = DecisionView(step, n["loss"], n["grad_norm"])
            verdict = detector.on_decision(None, view) or Verdict()
            for name, value in verdict.fields.items():  # z_loss, z_grad
                put(fields, name, value)
            if verdict.skip is not None:  # a spike: skip the step, keep the scale
                scaler.abandon_iteration()
                n.update(skipped=True, reason=verdict.skip, next_scale=n["scale"])
            else:
                n["clip_coef"] = clip_coef(norm, clipper.max_norm).item()
                clipper.clip_with_norms_([p for p in model.parameters() if p.grad is not None], norms, norm)
                n["skipped"] = not scaler.step(opt)
                scaler.update()
                n.update(next_scale=scaler.get_scale(), reason="nonfinite_grad" if n["skipped"] else None)
                n["clipped"] = n["clip_coef"] < 1.0 and not n["skipped"]
                if n["clipped"]:
                    put(fields, "clip_reason", "NormClip")
            if n.get("skipped") or n.get("clipped"):  # which layers: from the norms already computed
                top, culprit, module = forensics(named, norms, None, order.positions, order.uses)
                put(fields, "top_grads", top)
                if culprit is not None:
                    put(fields, "first_nonfinite", culprit)
                    put(fields, "culprit_module", module)
        record = StepRecord(step, fields=fields, **n)
        for hook in (skips, clips, detector):  # each hook's moment, called by hand
            hook.on_record(None, record)
        log.append(record)
    return model, log


def train_step_loop(task):
    model, first, opt, scaler, clipper, detector = parts(task)
    train = TrainStep(model, opt, task.loss_fn, precision="fp16", scaler=scaler, clipper=clipper,
                      hooks=[detector])
    for step in range(STEPS):
        first.grad_step = step
        train(*batch(task, step))
    return model, train.log


def test_a_plain_loop_with_labkits_parts_is_trainstep_to_the_bit():
    task = ToyTask()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_a, log_a = plain_loop(task)
        model_b, log_b = train_step_loop(task)
    records = {r.step: r for r in log_b}
    assert records[NAN_AT].reason == "nonfinite_loss" and records[INF_AT].reason == "nonfinite_grad"
    assert records[SPIKE_AT].reason in ("spike_loss", "spike_grad") and sum(r.clipped for r in log_b) >= 3
    overflow = records[INF_AT]
    # every layer's gradient is inf (it spread to the input layer); backward order names where it started
    assert overflow.next_scale == overflow.scale / 2
    assert not any(math.isfinite(v) for _, v in overflow.top_grads)
    assert overflow.first_nonfinite in ("4.weight", "4.bias") and overflow.culprit_module == "4"
    def flat(log):  # NaN equals NaN in a repr; sorted: the plain loop sets the fields in another order
        return [repr(sorted(r.to_dict().items())) for r in log]

    assert flat(log_a) == flat(log_b)
    assert repr(log_a.summary()) == repr(log_b.summary())
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_stale_monitor_in_a_plain_loop_is_the_observer_of_trainstep():
    def run(plain):
        task = ToyTask(seed=0)
        torch.manual_seed(0)
        model = task.model().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        monitor = StaleMonitor(patience=100, every=2)
        train = None if plain else TrainStep(model, opt, task.loss_fn, precision="bf16", max_norm=None,
                                             hooks=[monitor])
        stale = []
        for step in range(4):
            x, y = (t.to(torch.bfloat16) for t in task.batch(step))
            if train is not None:
                stale.append(train(x, y).stale)
                continue
            opt.zero_grad()
            task.loss_fn(model(x), y).backward()
            params = list(model.named_parameters())
            record = StepRecord(step, 0.0)
            monitor.pre_optim_step(None, step, params)
            opt.step()
            monitor.post_step(None, params, record)
            stale.append(record.stale)
        return stale

    plain, guarded = run(True), run(False)
    assert plain == guarded and plain[0] and plain[1] == {}


class Loop:
    """What Rewind reads of a trainer, in a plain loop: the model, optimizer, counter, log and state."""

    def __init__(self, model, opt, detector):
        self.model, self.optimizer, self.scheduler, self.detector = model, opt, None, detector
        self.step_count, self.log, self.device, self.process_group = 0, StepLog(), torch.device("cpu"), None

    def state_dict(self):
        return {"step": self.step_count, "detector": self.detector.state_dict()}

    def load_state_dict(self, state):
        self.step_count = state["step"]
        self.detector.load_state_dict(state["detector"])


def test_rewind_in_a_plain_loop_undoes_what_trainstep_undoes():
    task = ToyTask()

    def data(i):
        x, y = task.batch(i)
        return (x * 1000.0 if i == 20 else x), y

    def make():
        torch.manual_seed(0)
        model = task.model()
        return model, torch.optim.SGD(model.parameters(), lr=0.05), SpikeDetector(window=8, skip_z=6.0)

    model_a, opt, detector = make()
    rewind, loop = Rewind(back=4, skip=6, every=2), None
    loop = Loop(model_a, opt, detector)
    rewind.attach(loop)
    while loop.step_count < 28:
        step = loop.step_count
        x, y = data(rewind.data_index(step))
        opt.zero_grad()
        loss = task.loss_fn(model_a(x), y)
        loss.backward()
        norm = total_norm(per_tensor_norms([p.grad for p in model_a.parameters()], 2.0), 2.0)
        verdict = detector.on_decision(loop, DecisionView(step, loss.item(), norm.item())) or Verdict()
        if verdict.skip is None:
            opt.step()
        record = StepRecord(step, loss.item(), grad_norm=norm.item(), skipped=verdict.skip is not None,
                            reason=verdict.skip, fields=verdict.fields)
        detector.on_record(loop, record)
        loop.step_count += 1
        event = rewind.on_record(loop, record)
        loop.log.append(record)
        if event is not None:  # after the record: it undoes it too
            loop.log.append_event(event)

    model_b, opt_b, detector_b = make()
    rewind_b = Rewind(back=4, skip=6, every=2)
    train = TrainStep(model_b, opt_b, task.loss_fn, max_norm=None, hooks=[rewind_b, detector_b])
    while train.step_count < 28:
        train(*data(rewind_b.data_index(train.step_count)))
    assert rewind.rewinds == rewind_b.rewinds == [(20, 16)]
    assert loop.log.rewound == train.log.rewound and loop.log.rewinds == train.log.rewinds
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("hook", [SkipAlarm(2), ClipAlarm(0.5, 2)])
def test_the_alarms_are_hooks_a_plain_loop_calls(hook):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            hook.on_record(None, StepRecord(step, math.nan, skipped=isinstance(hook, SkipAlarm),
                                            clipped=isinstance(hook, ClipAlarm), reason="nonfinite_grad"))
    assert len(caught) == 1 and caught[0].filename == __file__  # the loop's own call
