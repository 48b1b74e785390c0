"""TrainStep's three-pass unscale+check+clip, the fused-optimizer path and the deferred records.

The oracle is torch's textbook AMP loop (autocast, ``scale().backward()``, ``unscale_``,
``clip_grad_norm_``, ``step``, ``update``) on the same seed. Host syncs are counted by
trapping ``.item()``, ``bool()``, ``float()``, ``int()``, ``.tolist()``, ``.cpu()`` and
``.numpy()`` when labkit's own code calls them (torch's optimizers read their CPU step
counters with ``.item()``; on a GPU those are no syncs, so they are not counted).
"""

from __future__ import annotations

import math

import pytest
import torch
from host_reads import SyncCounter

import labkit
from labkit.faults import Faults
from labkit.hooks import Hook, Verdict

STEPS = 6


@pytest.fixture
def task():
    return labkit.ToyTask()


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(
        params, lr=1e-2, **({"fused": True} if kind == "adamw-fused" else {"foreach": True})
    )


def textbook(task, kind, max_norm, steps=STEPS, init_scale=2.0**16):
    """torch's recipe, reading loss, norm and scale each step; returns the model, norms, scales, skips."""
    torch.manual_seed(0)
    model = task.model()
    opt = make_optimizer(kind, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    norms, scales, skipped = [], [], []
    for i in range(steps):
        x, y = task.batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = task.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        scales.append(scale)
    return model, norms, scales, skipped


def labkit_run(task, kind, max_norm, steps=STEPS, init_scale=2.0**16, **kwargs):
    torch.manual_seed(0)
    model = task.model()
    scaler = labkit.GradScaler("cpu", init_scale=init_scale)
    train = labkit.TrainStep(model, make_optimizer(kind, model.parameters()), task.loss_fn, precision="fp16",
                             max_norm=max_norm, scaler=scaler, **kwargs)
    records = [train(*task.batch(i)) for i in range(steps)]
    return model, records, train


def params_bits(model):
    return [p.detach().clone().view(torch.int32) for p in model.parameters()]


# ---------------------------------------------------------------- three passes = the textbook order


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "no-clip"])
def test_three_pass_equals_textbook_bitwise(task, max_norm):
    """Power-of-two scale, nothing overflows: same parameters to the bit, norms within 1e-6, same skips."""
    ref, norms, scales, skipped = textbook(task, "sgd", max_norm)
    model, records, _ = labkit_run(task, "sgd", max_norm)
    assert [r.skipped for r in records] == skipped
    assert [r.scale for r in records] == scales
    for r, n in zip(records, norms):
        assert r.grad_norm == pytest.approx(n, rel=1e-6) or (math.isnan(n) and math.isnan(r.grad_norm))
    if max_norm < 1:
        assert any(r.clipped for r in records)
    for a, b in zip(params_bits(model), params_bits(ref)):
        assert torch.equal(a, b)


def test_three_pass_skips_like_textbook_on_overflow(task):
    """An fp16 overflow in backward (init_scale 2**40 first): the same steps skip, the scales agree."""
    ref, _, scales, skipped = textbook(task, "sgd", 1.0, init_scale=2.0**40)
    model, records, _ = labkit_run(task, "sgd", 1.0, init_scale=2.0**40)
    assert any(skipped)
    assert [r.skipped for r in records] == skipped
    assert [r.scale for r in records] == scales
    for a, b in zip(params_bits(model), params_bits(ref)):
        assert torch.equal(a, b)


def test_scaled_norm_overflow_is_where_they_differ():
    """Finite scaled gradients whose float32 norm overflows: labkit skips (and backs off), torch steps.

    float32 norms square their inputs, so they overflow above ~1.8e19. 2048 gradients of
    1e17, scaled by 2**16, are finite (6.6e21) but their scaled norm is inf; unscaled first,
    as torch does, the norm is 4.5e18 and torch clips and steps. (Unscaled norms above
    ~2.8e14 at scale 2**16: no trained model's.)
    """
    def setup():
        w = torch.nn.Parameter(torch.zeros(2048))
        return w, torch.optim.SGD([w], lr=1.0)

    w, opt = setup()
    model = torch.nn.Module()
    model.w = w
    model.forward = lambda x: (model.w * x).sum()  # backward leaves x * scale in w.grad: 1e17 * 2**16, finite
    train = labkit.TrainStep(model, opt, lambda out: out, precision="fp16", max_norm=1.0)
    record = train(torch.full((2048,), 1e17))  # SGD, per-step records: the host decides
    assert torch.isfinite(w.grad).all() and w.grad[0].item() == pytest.approx(1e17 * 2.0**16, rel=1e-6)
    assert record.skipped and record.reason == "nonfinite_grad" and record.next_scale == record.scale / 2
    assert torch.equal(w, torch.zeros(2048))

    w2, opt2 = setup()
    w2.grad = torch.full((2048,), 1e17 * 2.0**16)
    ref = torch.amp.GradScaler("cpu")
    ref.scale(torch.ones(()))
    ref.unscale_(opt2)
    ref_norm = torch.nn.utils.clip_grad_norm_([w2], 1.0)
    assert math.isfinite(ref_norm.item()) and ref.step(opt2) is None
    ref.update()
    assert ref.get_scale() == 2.0**16 and not torch.equal(w2, torch.zeros(2048))


# ---------------------------------------------------------------- fused optimizers


@pytest.mark.parametrize("max_norm", [0.05], ids=["clips"])
def test_fused_adamw_matches_textbook(task, max_norm):
    """scale/coef as the fused kernel's grad_scale: the textbook's parameters within fp32 rounding."""
    ref, norms, scales, skipped = textbook(task, "adamw-fused", max_norm)
    model, records, _ = labkit_run(task, "adamw-fused", max_norm)
    assert [r.skipped for r in records] == skipped
    assert [r.scale for r in records] == scales
    # The two updates round differently in fp32 (~3e-8 apart), and once a weight sits at an fp16
    # rounding boundary the autocast forward rounds it one fp16 ulp (2^-11 relative) apart: the later
    # norms then differ by up to ~1e-4 relative, and Adam, whose step is about lr whatever the gradient's
    # size, carries that into the weights (up to 9.3e-4 here). Whether and where that happens depends on
    # the machine's bits: none unperturbed on this Xeon, at step 3 under LABKIT_PERTURB=1 (measured over
    # seeds 1-10 with ATEN_CPU_CAPABILITY avx512, avx2 and default). A wrong coef or grad_scale moves the
    # norm by far more than 1e-3, and a step skipped or taken twice moves the weights by ~lr = 1e-2
    # (9.9e-3 measured for one step fewer): both still fail.
    for r, n in zip(records, norms):
        assert r.grad_norm == pytest.approx(n, rel=1e-3)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-3)


def test_fused_adamw_skips_without_touching_state(task):
    """found_inf handed to the fused kernel: an overflowed step changes neither parameters nor moments."""
    model, records, train = labkit_run(task, "adamw-fused", 1.0, steps=3, init_scale=2.0**40)
    assert records[0].skipped
    ref, _, _, skipped = textbook(task, "adamw-fused", 1.0, steps=3, init_scale=2.0**40)
    assert [r.skipped for r in records] == skipped
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        assert train.optimizer.state[p]["step"].item() == sum(not r.skipped for r in records)


def test_a_step_read_to_go_ahead_hands_the_kernel_no_flag(task):
    """A decision read on the host: a step that goes ahead passes found_inf=None (the kernel's check and the
    step counters' undo pass are spared); a skipped one still hands the kernel its flag, as torch's scaler."""
    seen = []

    class Seen(torch.optim.AdamW):
        def step(self, closure=None):
            seen.append(getattr(self, "found_inf", "unset"))
            return super().step(closure)

    torch.manual_seed(0)
    model = task.model()
    train = labkit.TrainStep(model, Seen(model.parameters(), lr=1e-3, fused=True), task.loss_fn,
                             precision="fp16", scaler=labkit.GradScaler("cpu", init_scale=2.0**18))
    records = [train(*task.batch(i)) for i in range(8)]  # overflows, backs off to a scale fp16 holds
    assert records[0].skipped and not records[-1].skipped
    for r, flag in zip(records, seen):
        if r.skipped:
            assert flag is not None and flag.item() == 1.0
        else:
            assert flag is None
    for p in model.parameters():  # the skipped first step left torch's state: the counters say so
        assert train.optimizer.state[p]["step"].item() == sum(not r.skipped for r in records)


# ---------------------------------------------------------------- host syncs per step


@pytest.mark.parametrize(
    "kind, precision, sync_every, expected",
    [
        ("sgd", "fp16", None, [3] * 4),            # loss check, the norm and scale (the step decision),
                                                   # the next scale
        ("adamw-fused", "fp16", None, [3] * 4),    # the same on a CPU, where a read costs nothing (on a
                                                   # GPU: 2, the loss check and the record's row: the fused
                                                   # kernel skips itself)
        ("sgd", "fp32", None, [2] * 4),            # loss check, the norm: a disabled scaler's scale needs
                                                   # no read
        ("sgd", "fp16", 4, [1, 1, 1, 2]),          # the step decision; the 4th also copies the 4 records
        ("adamw-fused", "fp16", 4, [0, 0, 0, 1]),  # nothing per step; one batched copy every 4 steps
    ],
)
def test_host_syncs_per_step(task, monkeypatch, kind, precision, sync_every, expected):
    torch.manual_seed(0)
    model = task.model()
    train = labkit.TrainStep(model, make_optimizer(kind, model.parameters()), task.loss_fn,
                             precision=precision, max_norm=1e6, sync_every=sync_every)
    train(*task.batch(0))  # warm-up: the scaler's state is created on the first call
    train.flush()
    counter = SyncCounter(monkeypatch)
    counts = []
    for i in range(1, 5):
        before = counter.count
        train(*task.batch(i))
        counts.append(counter.count - before)
    assert counts == expected


class ClipTo(Hook):
    """A hook that cuts every step's clip to ``limit`` (Verdict.clip_to), as a spike hook does."""

    def __init__(self, limit):
        self.limit = limit

    def on_decision(self, trainer, view):
        return Verdict(clip_to=self.limit)


@pytest.mark.parametrize("limit, reads", [(1e-3, 3), (1e6, 2)], ids=["cuts", "loose"])
def test_a_hooks_clip_is_read_with_the_steps_row_not_on_its_own(task, monkeypatch, limit, reads):
    """Whether a hook's clip cut deeper than the clipper's travels in the decision's one read: fp32 reads
    the loss check and the row, as without the hook, and a clipped step its per-tensor norms for the
    record's top_grads (the forensics of every clipped step); the record says which cut."""
    torch.manual_seed(0)
    model = task.model()
    train = labkit.TrainStep(model, make_optimizer("sgd", model.parameters()), task.loss_fn, max_norm=1.0,
                             hooks=[ClipTo(limit)])
    train(*task.batch(0))
    counter = SyncCounter(monkeypatch)
    counts, records = [], []
    for i in range(1, 4):
        before = counter.count
        records.append(train(*task.batch(i)))
        counts.append(counter.count - before)
    assert counts == [reads] * 3
    assert [r.clip_reason == "ClipTo" for r in records] == [limit < 1.0] * 3


@pytest.mark.parametrize("change", ["threshold", "clipper", "none"])
def test_the_step_clips_with_the_clipper_of_this_step(task, change):
    """A threshold changed during training (clipper.max_norm, a new NormClip, or no clipper) is the
    one the next step clips with: torch's clip_grad_norm_ with that threshold gives the same parameters."""
    torch.manual_seed(0)
    model = task.model()
    ref = task.model()
    ref.load_state_dict(model.state_dict())
    train = labkit.TrainStep(model, make_optimizer("sgd", model.parameters()), task.loss_fn,
                             max_norm=1e6 if change != "none" else 0.01)
    ref_opt = make_optimizer("sgd", ref.parameters())
    records = []
    for i in range(4):
        if i == 1 and change == "threshold":
            train.clipper.max_norm = 0.01
        elif i == 1 and change == "clipper":
            train.clipper = labkit.clippers.NormClip(0.01)
        elif i == 1:
            train.clipper = None
        records.append(train(*task.batch(i)))
        ref_opt.zero_grad()
        task.loss_fn(ref(task.batch(i)[0]), task.batch(i)[1]).backward()
        limit = (1e6 if i == 0 else 0.01) if change != "none" else (0.01 if i == 0 else None)
        if limit is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), limit)
        ref_opt.step()
    assert [r.clipped for r in records] == (
        [False, True, True, True] if change != "none" else [True, False, False, False]
    )
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_fused_step_under_a_float64_default_dtype(task, precision):
    """grad_scale and found_inf are float32 whatever the default dtype: the fused kernels take no other."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = task.model().float()
        train = labkit.TrainStep(model, make_optimizer("adamw-fused", model.parameters()), task.loss_fn,
                                 precision=precision, max_norm=0.05)
        records = [train(*(t.float() for t in task.batch(i))) for i in range(3)]
    finally:
        torch.set_default_dtype(before)
    assert all(r.clipped and not r.skipped for r in records)


def test_sync_counter_counts(monkeypatch):
    counter = SyncCounter(monkeypatch)
    labkit.scaler.GradScaler("cpu").get_scale()  # a labkit call that reads a tensor
    assert counter.count == 0  # no state yet: nothing read
    s = labkit.GradScaler("cpu")
    s.scale(torch.ones(()))
    s.get_scale()
    assert counter.count == 1


# ---------------------------------------------------------------- deferred records


def _dicts(records):
    return [repr(r.to_dict()) for r in records]  # repr: NaN equals NaN


@pytest.mark.parametrize("kind", ["sgd", "adamw-fused"])
def test_deferred_records_equal_per_step_records(task, kind):
    """sync_every=3 gives the records, scales and parameters of the per-step mode, NaN batch included."""
    faults = {2: "nan", 5: "overflow"}
    model_a, records_a, _ = labkit_run(task, kind, 0.05, hooks=[Faults(faults)])
    model_b, records_b, train = labkit_run(task, kind, 0.05, sync_every=3, hooks=[Faults(faults)])
    assert all(isinstance(r, labkit.step.DeferredRecord) for r in records_b)
    assert records_b[2].reason == "nonfinite_loss" and records_b[5].reason == "nonfinite_grad"
    assert records_b[2].next_scale == records_b[2].scale, "a NaN batch leaves the scale alone"
    assert _dicts(records_a) == _dicts(records_b)
    assert _dicts(train.log) == _dicts(records_a)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_reading_a_deferred_record_copies_the_pending_ones(task, monkeypatch):
    torch.manual_seed(0)
    model = task.model()
    train = labkit.TrainStep(model, make_optimizer("adamw-fused", model.parameters()), task.loss_fn,
                             precision="fp16", sync_every=100)
    first = [train(*task.batch(i)) for i in range(3)]
    assert len(train._log) == 0, "nothing copied yet"
    counter = SyncCounter(monkeypatch)
    assert first[0].grad_norm > 0  # reading one record copies all three, once
    assert counter.count == 1 and len(train._log) == 3
    assert [r.step for r in train.log] == [0, 1, 2] and counter.count == 1


def test_sync_every_must_be_a_positive_int(task):
    model = task.model()
    with pytest.raises(ValueError, match="sync_every"):
        labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task.loss_fn, sync_every=0)


def test_clip_coef_takes_a_device_threshold():
    """An adaptive clipper's threshold is a 0-dim tensor: the coefficient stays on the device."""
    norm = torch.tensor(4.0)
    assert torch.equal(labkit.clip.clip_coef(norm, torch.tensor(2.0)), labkit.clip.clip_coef(norm, 2.0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU; the CPU count is test_host_syncs_per_step")
def test_fused_deferred_step_never_syncs_on_cuda(task):
    """torch's own sync detector: with a fused optimizer and sync_every, no step syncs until the copy."""
    torch.manual_seed(0)
    model = task.model("cuda")
    train = labkit.TrainStep(model, make_optimizer("adamw-fused", model.parameters()), task.loss_fn,
                             precision="fp16", sync_every=4)
    batches = [task.batch(i, "cuda") for i in range(4)]
    train(*batches[0])
    train.flush()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[1:]:
            train(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [r.step for r in train.log] == [0, 1, 2, 3]


def test_deferred_records_keep_the_observer(task):
    """StaleMonitor composes with sync_every: the same record.stale as the per-step mode."""
    from labkit.formats.bf16 import StaleMonitor

    def run(sync_every):
        torch.manual_seed(0)
        model = task.model().to(torch.bfloat16)
        train = labkit.TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3), task.loss_fn,
                                 precision="bf16", sync_every=sync_every,
                                 hooks=[StaleMonitor(patience=100, every=2)])
        return [train(*(t.to(torch.bfloat16) for t in task.batch(i))) for i in range(4)]

    per_step, deferred = run(None), run(4)
    assert [r.stale for r in deferred] == [r.stale for r in per_step]
    assert per_step[0].stale and per_step[1].stale == {}, "every=2: steps 0 and 2 are observed"


@pytest.mark.parametrize("precision, max_norm, written", [("fp32", 1e6, False), ("bf16", 1e6, False),
                                                          ("fp32", 0.05, True), ("fp16", 1e6, True)])
def test_a_step_that_neither_clips_nor_unscales_writes_no_gradient(task, precision, max_norm, written):
    """Known on the host to be x1 (no clip, a disabled scaler), the read-write pass is left out: the
    gradients backward left are the ones the optimizer reads (torch multiplies by 1 anyway)."""
    torch.manual_seed(0)
    model = task.model()
    train = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), task.loss_fn,
                             precision=precision, max_norm=max_norm)
    after_backward = {}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: after_backward.__setitem__(p, p.grad._version))
    record = train(*task.batch(0))
    assert not record.skipped and record.clipped == (max_norm < 1)
    changed = [p.grad._version != after_backward[p] for p in model.parameters()]
    assert all(changed) if written else not any(changed)
