"""labkit in nanoGPT's loop: its model's ``(idx, targets) -> (logits, loss)``, its two AdamW groups, its
accumulation (G micro-batches fetched one by one, ``loss / G``, one gradient all-reduce per step under DDP),
fp16 with a loss scaler; and every fault kind acting on a model whose inputs are token ids.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from datetime import timedelta

import pytest
import torch
from nanogpt import G, NanoGPT, get_batch, textbook_step

import labkit
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.faults import Faults
from labkit.reasons import Reason
from labkit.triage import Triage

STEPS = 6


def loss_of(out):
    return out[1]


def trainstep(model, precision, hooks=(), **kwargs):
    kwargs = {"max_norm": 1.0, **kwargs}
    return labkit.TrainStep(model, model.configure_optimizers(), loss_of, precision=precision,
                            hooks=[ClipAlarm(None), SkipAlarm(None), *hooks], **kwargs)


def micro_batches(i, form, rank=0):
    """Step ``i``'s G micro-batches, handed to TrainStep the way ``form`` says."""
    batches = [get_batch(i, m, rank) for m in range(G)]
    if form == "list":
        return (batches,)
    if form == "iterator":
        return (iter(batches),)
    if form == "callable":  # nanoGPT's get_batch, called G times
        it = iter(batches)
        return (lambda: next(it),)
    return ({k: torch.cat([b[k] for b in batches]) for k in batches[0]},)  # one batch of B*G: the step splits


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------- the textbook loop, to the bit


@pytest.mark.parametrize("form", ["list", "callable", "iterator", "one batch"])
def test_fp16_with_nanogpts_accumulation_is_bitwise_its_textbook_loop(form):
    ref, ours = NanoGPT(), NanoGPT()
    opt, scaler = ref.configure_optimizers(), torch.amp.GradScaler("cpu")
    step = trainstep(ours, "fp16", accumulation_steps=G)
    for i in range(STEPS):
        textbook_step(ref, opt, scaler, [get_batch(i, m) for m in range(G)], "fp16")
        record = step(*micro_batches(i, form))
        assert record.scale == scaler.get_scale() and not record.skipped
    assert_same_params(ref, ours)
    assert len(step.log) == STEPS and {r.fault for r in step.log} == {None}


def test_fp32_with_nanogpts_two_groups_is_bitwise_its_textbook_loop():
    ref, ours = NanoGPT(), NanoGPT()
    opt, scaler = ref.configure_optimizers(), torch.amp.GradScaler("cpu", enabled=False)
    step = trainstep(ours, "fp32", accumulation_steps=G)
    for i in range(12):
        textbook_step(ref, opt, scaler, [get_batch(i, m) for m in range(G)], "fp32")
        step(*micro_batches(i, "list"))
    assert_same_params(ref, ours)


def test_the_records_loss_is_the_mean_of_the_micro_batches_losses_whose_gradient_was_taken():
    model = NanoGPT()
    batches = [get_batch(0, m) for m in range(G)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        losses = [model(**b)[1].item() for b in batches]
    record = trainstep(model, "fp16")(batches)
    assert record.loss == pytest.approx(sum(losses) / G, rel=1e-6)  # nanoGPT prints losses[-1] only


def test_micro_batches_are_checked_before_anything_changes():
    model = NanoGPT()
    before = [p.detach().clone() for p in model.parameters()]
    step = trainstep(model, "fp16", accumulation_steps=G)
    batches = [get_batch(0, m) for m in range(G)]
    with pytest.raises(ValueError, match="got 3 micro-batches with accumulation_steps=4"):
        step(batches[:3])
    with pytest.raises(TypeError, match="a tuple is ambiguous"):
        step(tuple(batches))
    with pytest.raises(ValueError, match="the iterator gave 2 micro-batches"):
        step(iter(batches[:2]))
    with pytest.raises(TypeError, match="micro-batch 1 is a str"):
        step([batches[0], "oops", *batches[2:]])
    assert step.step_count == 0 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_an_iterator_gives_exactly_g_micro_batches_per_step():
    stream = iter([get_batch(0, m) for m in range(3 * G)])
    step = trainstep(NanoGPT(), "fp32", accumulation_steps=G)
    step(stream)
    assert len(list(stream)) == 2 * G  # the loader goes on where the step left it


# ---------------------------------------------------------------- faults on a language model


def run(kind, precision, step_at=1, steps=3, model=None, loss_fn=loss_of, hooks=(), **kwargs):
    model = model or NanoGPT()
    faults = {step_at: kind} if kind else None
    step = labkit.TrainStep(model, model.configure_optimizers(), loss_fn, precision=precision, max_norm=1.0,
                            accumulation_steps=G, **kwargs,
                            hooks=[SkipAlarm(None), ClipAlarm(None), Faults(faults), *hooks])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(steps):
            step([get_batch(i, m) for m in range(G)])
    return step.log


def test_a_spike_on_token_ids_scales_the_loss_used_and_the_norm_by_its_magnitude():
    clean, spiked = run(None, "fp32"), run("spike", "fp32")
    assert spiked[1].fault == "spike:1000" and spiked[1].clipped and not spiked[1].skipped
    assert spiked[1].grad_norm / clean[1].grad_norm == pytest.approx(1000.0, rel=1e-4)
    assert spiked[1].loss / clean[1].loss == pytest.approx(1000.0, rel=1e-6)
    assert spiked[0].fault is None and spiked[0].grad_norm == clean[0].grad_norm


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nan_and_inf_on_token_ids_go_into_the_first_activation_and_the_step_skips(kind, precision):
    log = run(kind, precision, hooks=[Triage()])
    bad = log[1]
    assert bad.fault == kind and bad.skipped and not math.isfinite(bad.loss)
    # the data's first activation went bad: fp32 gives no finite loss either, so it is no forward overflow
    assert bad.reason == Reason.NONFINITE_LOSS
    assert bad.next_scale == bad.scale  # a bad batch is not a scaling problem
    assert not log[2].skipped and log[2].fault is None


def test_overflow_on_a_model_that_computes_its_loss_inside_overflows_fp16():
    log, clean = run("overflow", "fp16"), run(None, "fp16")
    bad = log[1]
    assert bad.fault == "overflow" and math.isfinite(bad.loss) and bad.loss == clean[1].loss
    assert bad.skipped and bad.reason == Reason.NONFINITE_GRAD and bad.next_scale == bad.scale / 2
    assert bad.culprit_module == "transformer.lm_head"  # the logits the loss was computed from


def test_overflow_in_fp32_is_a_gradient_spike_the_clip_catches():
    log, clean = run("overflow", "fp32"), run(None, "fp32")
    assert log[1].fault == "overflow" and not log[1].skipped and log[1].clipped
    assert log[1].grad_norm > 1e3 * clean[1].grad_norm


class LossOnly(NanoGPT):
    """A model that returns its loss alone (loss_fn=lambda loss: loss)."""

    def forward(self, idx, targets):
        return super().forward(idx, targets)[1]


@pytest.mark.parametrize("kind, precision, reason", [
    ("spike", "fp32", None), ("overflow", "fp16", "nonfinite_grad"), ("nan", "fp16", "nonfinite_loss"),
    ("inf", "fp32", "nonfinite_loss")])
def test_every_fault_acts_on_a_model_that_returns_a_loss_alone(kind, precision, reason):
    log = run(kind, precision, model=LossOnly(), loss_fn=lambda loss: loss)
    clean = run(None, precision, model=LossOnly(), loss_fn=lambda loss: loss)
    assert log[1].fault == (f"{kind}:1000" if kind == "spike" else kind)
    assert log[1].reason == reason and log[1].skipped == (reason is not None)
    if kind == "spike":
        assert log[1].grad_norm / clean[1].grad_norm == pytest.approx(1000.0, rel=1e-4)


def test_a_fault_fires_once_a_step_replayed_after_going_back_runs_clean():
    model = NanoGPT()
    step = labkit.TrainStep(model, model.configure_optimizers(), loss_of, precision="fp16",
                            hooks=[SkipAlarm(None), ClipAlarm(None), Faults({1: "nan"})])
    step(get_batch(0, 0))
    saved = step.state_dict()
    assert step(get_batch(1, 0)).fault == "nan"
    step.load_state_dict(saved)  # back to step 1, as a rewind does
    again = step(get_batch(1, 0))
    assert again.step == 1 and again.fault is None and not again.skipped


def test_a_nan_fault_with_nowhere_to_go_raises_saying_where_to_inject():
    class Counts(torch.nn.Module):  # integers in, integers out: no module output a NaN could go into
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, idx):
            return idx.sum(-1)

    model = Counts()
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda out: (out.float() * model.w).mean(), hooks=[Faults({0: "nan"})])
    with pytest.raises(TypeError, match="found no floating tensor"):
        step(torch.ones(2, 3, dtype=torch.long))


# ---------------------------------------------------------------- DDP: one gradient all-reduce per step

WORLD, DDP_STEPS = 2, 3


def ddp_worker(rank, port, out):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    calls, all_reduce = [], dist.all_reduce
    # every all-reduce, the loss checks' too
    dist.all_reduce = lambda *a, **k: (calls.append(1), all_reduce(*a, **k))[1]

    def counted():
        buckets = []
        model = DDP(NanoGPT())

        def hook(state, bucket):  # DDP's own all-reduce of a bucket, counted
            buckets.append(1)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
        return model, buckets

    result = {}
    try:
        for name in ("nanogpt", "nanogpt, sync every micro-step", "list", "callable", "one batch"):
            model, buckets = counted()
            per_step, reduces = [], []
            if name.startswith("nanogpt"):
                opt, scaler = model.module.configure_optimizers(), torch.amp.GradScaler("cpu")
                for i in range(DDP_STEPS):
                    before, n = len(buckets), len(calls)
                    batches = [get_batch(i, m, rank) for m in range(G)]
                    textbook_step(model, opt, scaler, batches, "fp16", no_sync=name == "nanogpt")
                    per_step.append(len(buckets) - before)
                    reduces.append(len(calls) - n)
            else:
                step = labkit.TrainStep(model, model.module.configure_optimizers(), loss_of, precision="fp16",
                                        max_norm=1.0, accumulation_steps=G,
                                        hooks=[SkipAlarm(None), ClipAlarm(None)])
                for i in range(DDP_STEPS):
                    before, n = len(buckets), len(calls)
                    step(*micro_batches(i, name, rank))
                    per_step.append(len(buckets) - before)
                    reduces.append(len(calls) - n)
            result[name] = {"buckets": per_step, "all_reduces": reduces,
                            "params": [p.detach().clone() for p in model.module.parameters()]}
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    out = tmp_path_factory.mktemp("ddp_accumulation")
    ctx = mp.start_processes(ddp_worker, args=(port, out), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail("the DDP run hung")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_ddp_counts_the_buckets_it_reduces(ddp):
    """The control: nanoGPT's loop with the sync left on at every micro-step reduces G times a step."""
    assert ddp[0]["nanogpt, sync every micro-step"]["buckets"] == [G] * DDP_STEPS


@pytest.mark.parametrize("form", ["list", "callable", "one batch"])
def test_ddp_accumulation_reduces_the_gradients_once_per_step_as_nanogpt_does(ddp, form):
    for rank in ddp:
        assert rank["nanogpt"]["buckets"] == [1] * DDP_STEPS  # nanoGPT's require_backward_grad_sync
        assert rank[form]["buckets"] == [1] * DDP_STEPS
        # and the loss check: one all-reduce of one float64 per micro-batch, so every rank skips alike
        assert rank[form]["all_reduces"] == [G + 1] * DDP_STEPS
        assert rank["nanogpt"]["all_reduces"] == [1] * DDP_STEPS


@pytest.mark.parametrize("form", ["list", "callable", "one batch"])
def test_ddp_accumulation_gives_nanogpts_parameters_to_the_bit(ddp, form):
    for rank in ddp:
        for p, q in zip(rank["nanogpt"]["params"], rank[form]["params"]):
            assert torch.equal(p, q)
    for p, q in zip(ddp[0][form]["params"], ddp[1][form]["params"]):
        assert torch.equal(p, q)
