"""The step's decision rules, each against an oracle (issue 37: the mutants that survived the suite).

A hook's ``clip_to`` only ever tightens the step's clip; ``Verdict.merge`` keeps the tightest; a fused
optimizer's ``grad_scale`` is ``1 / coef``; a hook's measure must be a declared field. The clip
coefficient's oracle is torch's own rule, ``min(1, max_norm / (norm + 1e-6))`` computed in float32.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mutants_log import Seen

from labkit import GradScaler, ToyTask, TrainStep
from labkit.clippers import NormClip
from labkit.hooks import Hook, Hooks, Verdict
from labkit.step.decision import Decision, decide, read

FAST = settings(max_examples=60, deadline=None, database=None)
NORMS = st.floats(0.0, 1e4, allow_nan=False, width=32)
LIMITS = st.floats(2.0**-10, 1e4, allow_nan=False, width=32)


def torch_coef(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grads_with_norm_'s factor: clamp(max_norm / (norm + 1e-6), max=1), float32."""
    n = torch.tensor(norm, dtype=torch.float32)
    return float(torch.clamp(max_norm / (n + 1e-6), max=1.0))


@FAST
@given(norm=NORMS, max_norm=LIMITS, clip_to=LIMITS)
def test_a_hook_clip_never_loosens_the_clippers(norm, max_norm, clip_to):
    n = torch.tensor(norm)
    d = decide(n, n.reshape(1), torch.ones(()), None, NormClip(max_norm), Verdict(clip_to=clip_to))
    clipper, hook = torch_coef(norm, max_norm), torch_coef(norm, clip_to)
    assert float(d.coef) == min(clipper, hook)  # the deeper cut, whichever it is
    assert bool(d.hook_clip) == (hook < clipper)
    assert not float(d.skip)


@FAST
@given(clip_to=st.lists(st.one_of(st.none(), LIMITS), min_size=1, max_size=5))
def test_merge_keeps_the_tightest_clip_and_the_first_hook_to_ask_for_it(clip_to):
    verdicts = [Verdict(clip_to=c, clip_reason=f"hook{i}") for i, c in enumerate(clip_to)]
    merged = Verdict.merge(verdicts)
    asked = [c for c in clip_to if c is not None]
    if not asked:
        assert merged.clip_to is None and merged.clip_reason is None
        return
    assert merged.clip_to == min(asked)
    # on a tie the hook called first (the higher priority) names it
    assert merged.clip_reason == f"hook{clip_to.index(min(asked))}"


def test_merge_on_a_tie_keeps_the_first_reason():
    merged = Verdict.merge([Verdict(clip_to=2.0, clip_reason="first"), None,
                            Verdict(clip_to=2.0, clip_reason="second")])
    assert (merged.clip_to, merged.clip_reason) == (2.0, "first")


class ClipTo(Hook):
    def __init__(self, limit):
        self.limit = limit

    def on_decision(self, trainer, view):
        return Verdict(clip_to=self.limit)


@pytest.mark.parametrize("fused", [False, True])
def test_a_loose_hook_clip_leaves_the_clippers_cut_in_the_step(fused):
    """A hook asking for 1e7 on a step clipped at 0.05: the optimizer still gets gradients of norm 0.05."""
    task = ToyTask()
    torch.manual_seed(0)
    model = task.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=0.05)
    train = TrainStep(model, opt, task.loss_fn, precision="fp16", max_norm=0.05, hooks=[ClipTo(1e7)])
    records = [train(*task.batch(i)) for i in range(3)]
    for r in records:
        assert r.grad_norm > 0.05 and r.clipped and r.clip_reason == "NormClip"
        assert r.clip_coef == pytest.approx(torch_coef(r.grad_norm, 0.05), rel=1e-6)
        assert r.post_clip_norm == pytest.approx(0.05, rel=1e-5)


def test_grad_scale_is_one_over_the_clip_coefficient():
    d = Decision(torch.tensor(8.0), torch.tensor(0.25), torch.tensor(0.0), torch.tensor(1024.0), None)
    assert float(d.grad_scale()) == 4.0  # before the read: from the device tensor
    d.read()
    assert d.host == [8.0, 0.25, 0.0, 1024.0] and float(d.grad_scale()) == 4.0


def test_an_unclipped_step_hands_a_fused_optimizer_no_grad_scale():
    d = Decision(torch.tensor(0.5), torch.tensor(1.0), torch.tensor(0.0), torch.tensor(1024.0), None)
    d.read()
    assert d.grad_scale() is None and d.factor() is None  # nothing to multiply: no kernel for a factor 1
    clipped = Decision(torch.tensor(2.0), torch.tensor(0.5), torch.tensor(0.0), torch.ones(()), None)
    clipped.read()
    assert float(clipped.factor()) == 0.5


class Undeclared(Hook):
    def post_backward(self, trainer, step):
        return {"no_such_field_anywhere": torch.tensor(1.0)}


class Declared(Hook):
    def post_backward(self, trainer, step):
        return {"z_loss": torch.tensor(1.0)}  # SpikeDetector's field, declared when labkit is imported


def test_a_measure_nobody_declared_is_refused_before_the_step_decides():
    hooks = Hooks([Declared(), Undeclared()])
    with pytest.raises(ValueError, match="no_such_field_anywhere"):
        hooks.post_backward(None, 0)
    assert set(Hooks([Declared()]).post_backward(None, 0)) == {"z_loss"}


def test_decide_skips_on_a_nonfinite_norm_and_clips_nothing():
    for bad in (math.inf, math.nan):
        n = torch.tensor(bad)
        d = decide(n, n.reshape(1), torch.ones(()), None, NormClip(1.0), Verdict(clip_to=0.5))
        assert float(d.skip) == 1.0 and float(d.coef) == 1.0


def test_a_hook_class_defined_now_declares_its_record_fields():
    """Declared at class definition (``Hook.__init_subclass__``): a record reads the default at once.

    The field's name is new in every run: the declarations are process-wide (a process that ran the test
    before, e.g. mutmut's forking parent, would otherwise hold it already)."""
    import uuid

    from labkit.records import Field, StepRecord, put

    name = f"late_measure_{uuid.uuid4().hex}"
    type("LateMeasure", (Hook,), {"record_fields": {name: Field(-1.0)}})
    assert getattr(StepRecord(0, 1.0), name) == -1.0
    fields = {}
    put(fields, name, 2.0)
    assert fields == {name: 2.0}


def test_merge_keeps_the_first_skip_whatever_comes_after_it():
    merged = Verdict.merge([Verdict(skip="spike_loss"), Verdict(clip_to=1.0), Verdict(skip="spike_grad"),
                            None])
    assert merged.skip == "spike_loss" and merged.clip_to == 1.0


def test_hooks_hand_every_member_the_trainer_they_were_given():
    seen = []

    class Reads(Hook):
        def post_backward(self, trainer, step):
            seen.append((trainer, step))

    trainer = object()
    Hooks([Reads()]).post_backward(trainer, 7)
    assert seen == [(trainer, 7)]


# ------------------------------------------------ micro-batches: split, given, one-argument loss


def _sgd_loop(model, micro, loss_of, max_norm, lr=0.1):
    """The textbook accumulation loop: each micro-batch's loss times its weight, backward, clip, step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.zero_grad()
    for x, weight in micro:
        (loss_of(model, x) * weight).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()


def test_accumulation_with_a_one_argument_loss_is_the_textbook_loop():
    """targets=None (loss_fn(output)) splits too: each micro-batch weighs its share, unequal splits too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    ref, before = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(8, 3)
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731  # no targets: e.g. an energy or an autoencoder's
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, max_norm=0.5,
                      accumulation_steps=3, hooks=[])
    r = train(x)
    chunks = torch.tensor_split(x, 3)  # 3, 3, 2 samples
    _sgd_loop(ref, [(c, len(c) / 8) for c in chunks], lambda m, c: loss_fn(m(c)), 0.5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    with torch.no_grad():  # the step's loss: the micro-batches' losses, each weighed by its share
        expected = sum(float(loss_fn(before(c))) * len(c) / 8 for c in chunks)
    assert r.loss == pytest.approx(expected, rel=1e-6) and not r.skipped


class KeywordModel(torch.nn.Module):
    """A Hugging Face-style model: ``model(**batch)`` returns the loss; ``mode`` is a non-tensor entry."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x, y, mode):
        assert mode == "sum-of-squares"  # a non-tensor entry reaches every micro-batch as it is
        return (self.lin(x).squeeze(-1) - y).pow(2).mean()


@pytest.mark.parametrize("k", [2, 3])
def test_a_dict_batch_splits_its_tensors_and_repeats_its_other_values(k):
    """model(**batch) with accumulation: tensors are split along the batch, other values go to every part."""
    torch.manual_seed(1)
    model = KeywordModel()
    ref = copy.deepcopy(model)
    batch = {"x": torch.randn(7, 3), "y": torch.randn(7), "mode": "sum-of-squares"}
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out: out, max_norm=0.5,
                      accumulation_steps=k, hooks=[])
    r = train(batch)
    parts = list(zip(torch.tensor_split(batch["x"], k), torch.tensor_split(batch["y"], k)))
    _sgd_loop(ref, [(p, len(p[0]) / 7) for p in parts], lambda m, p: m(p[0], p[1], "sum-of-squares"), 0.5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert not r.skipped


def test_given_micro_batches_are_each_a_kth_of_the_step():
    """step([(x0, y0), (x1, y1), (x2, y2)]): the gradient is the mean of the micro-batches' mean losses."""
    torch.manual_seed(2)
    model = torch.nn.Linear(3, 1)
    ref = copy.deepcopy(model)
    pairs = [(torch.randn(n, 3), torch.randn(n, 1)) for n in (4, 2, 5)]
    mse = torch.nn.functional.mse_loss
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, max_norm=0.5, hooks=[])
    r = train(pairs)
    _sgd_loop(ref, [(p, 1 / 3) for p in pairs], lambda m, p: mse(m(p[0]), p[1]), 0.5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert not r.skipped and r.step == 0


def test_a_micro_batch_of_three_is_refused_and_nothing_changes():
    """A micro-batch is a tensor, a dict or an (inputs, targets) pair: a triple raises before any change."""
    model = torch.nn.Linear(3, 1)
    before = copy.deepcopy(model.state_dict())
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      hooks=[])
    triples = [(torch.randn(2, 3), torch.randn(2, 1), torch.randn(2)) for _ in range(2)]
    with pytest.raises(TypeError):
        train(triples)
    assert train.step_count == 0
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name])


# ------------------------------------------------ deferred records: a skip's buffers, numbers known at once


def _bn_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def _buffers(model):
    return {name: b.clone() for name, b in model.named_buffers()}


def test_deferred_records_put_a_skipped_steps_buffers_back_and_keep_a_stepped_ones():
    """sync_every=N: a skipped step leaves BatchNorm's running statistics as they were, a stepped one
    leaves them as its forward set them (torch's train-mode forward is the oracle)."""
    model = _bn_model()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      sync_every=4)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    oracle = copy.deepcopy(model)
    oracle(x)  # one train-mode forward: what the step's forward does to the buffers
    first = train(x, y)
    after = _buffers(model)
    for name, b in _buffers(oracle).items():
        assert torch.equal(after[name], b), name
    params = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0] = math.nan  # the forward writes NaN into the running mean; the step skips
    second = train(bad, y)
    for name, b in _buffers(model).items():
        assert torch.equal(b, after[name]), name
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert not first.skipped and second.skipped and second.reason == "nonfinite_loss"


def test_a_deferred_record_knows_its_step_and_learning_rates_before_the_copy():
    """step, lr and lrs are on the host at once (never on the device): right before the copy and after."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.3}], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train = TrainStep(model, opt, torch.nn.functional.mse_loss, scheduler=sched, sync_every=8)
    records = [train(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    assert [(r.step, r.lr, r.lrs) for r in records] == [
        (i, 0.1 * 0.5**i, [0.1 * 0.5**i, 0.3 * 0.5**i]) for i in range(3)]
    assert [len(train.log)] == [3] and all(math.isfinite(r.loss) for r in records)
    assert [(r.step, r.lr, r.lrs) for r in records] == [
        (i, 0.1 * 0.5**i, [0.1 * 0.5**i, 0.3 * 0.5**i]) for i in range(3)]


# ------------------------------------------------ a hook's state: checked on a copy


class InPlaceState(Hook):
    """A hook whose load_state_dict writes into a dict it holds, then checks (a realistic custom hook)."""

    state_key = "in_place_state"

    def __init__(self):
        self.counts = {"skips": 0}

    def state_dict(self):
        return dict(self.counts)

    def load_state_dict(self, state):
        self.counts.update(state)
        if not isinstance(self.counts["skips"], int):
            raise TypeError("skips must be an int")


def test_a_damaged_hook_state_changes_nothing_when_it_is_refused():
    """TrainStep.load_state_dict checks each hook's entry first (Hook.check_state: a deep copy loads it)."""
    hook = InPlaceState()
    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      hooks=[hook])
    state = train.state_dict()
    state["in_place_state"] = {"skips": "many"}
    with pytest.raises(TypeError):
        train.load_state_dict(state)
    assert hook.counts == {"skips": 0}
    hook.check_state({"skips": 5})  # a good state, checked: still nothing changes
    assert hook.counts == {"skips": 0}


class InPlaceClip(NormClip):
    """A custom clipper whose load_state_dict writes its tensors in place, then checks the rest."""

    def __init__(self):
        super().__init__(1.0)
        self.state = {"seen": torch.zeros(()), "limit": torch.ones(())}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state["seen"].copy_(state["seen"])
        if not bool(state["limit"] > 0):
            raise ValueError("limit must be > 0")
        self.state["limit"].copy_(state["limit"])


def test_a_damaged_clipper_state_changes_nothing_when_it_is_refused():
    """The clipper's entry is tried on a deep copy: one that writes its own tensors in place before it
    checks leaves the real clipper's as they were when the state is refused."""
    clipper = InPlaceClip()
    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      clipper=clipper)
    state = train.state_dict()
    state["clipper"] = {"seen": torch.tensor(7.0), "limit": torch.tensor(-1.0)}
    with pytest.raises(ValueError, match="limit"):
        train.load_state_dict(state)
    assert (clipper.state["seen"].item(), clipper.state["limit"].item()) == (0.0, 1.0)
    assert train.step_count == 0


def test_take_reports_what_a_per_tensor_or_update_clip_amounted_to():
    """Decision.take([coef, threshold]): the record's coefficient and threshold become the clip's own."""
    d = Decision(torch.tensor(4.0), torch.tensor(1.0), torch.tensor(0.0), torch.ones(()), None)
    d.take(torch.tensor([0.25, 3.0]))  # on the device: nothing read yet
    assert (float(d.coef), float(d.threshold), d.host) == (0.25, 3.0, None)
    read_first = Decision(torch.tensor(4.0), torch.tensor(1.0), torch.tensor(0.0), torch.ones(()), None)
    read_first.read()
    read_first.take(torch.tensor([0.5, 2.0]))  # after the read: the host's copy follows
    assert read_first.host == [4.0, 0.5, 0.0, 1.0] and float(read_first.threshold) == 2.0
    read_first.take(None)  # nothing done: nothing changes
    assert read_first.host == [4.0, 0.5, 0.0, 1.0] and float(read_first.coef) == 0.5


VERDICTS = st.one_of(st.none(), st.builds(
    Verdict, skip=st.one_of(st.none(), st.sampled_from(["spike_loss", "spike_grad"])),
    clip_to=st.one_of(st.none(), LIMITS), clip_reason=st.sampled_from(["a", "b"]),
    fields=st.dictionaries(st.sampled_from(["z_loss", "z_grad"]), st.floats(0, 9), max_size=2)))


@FAST
@given(verdicts=st.lists(VERDICTS, max_size=6))
def test_a_hook_that_says_nothing_changes_nothing_in_the_merge(verdicts):
    """Verdict.merge: a None (a hook with no say) anywhere leaves the merge of the others as it is."""
    said = [v for v in verdicts if v is not None]
    assert Verdict.merge(verdicts) == Verdict.merge(said)
    skips = [v.skip for v in said if v.skip is not None]
    assert Verdict.merge(verdicts).skip == (skips[0] if skips else None)


def test_a_state_saved_before_a_hook_joined_resumes_with_that_hook_as_it_is():
    """TrainStep.load_state_dict: a hook whose entry the state lacks is left alone (no KeyError)."""
    model = torch.nn.Linear(3, 1)
    old = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    old(torch.randn(4, 3), torch.randn(4, 1))
    state = old.state_dict()
    hook = InPlaceState()
    hook.counts["skips"] = 3
    new = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                    hooks=[hook])
    new.load_state_dict(state)
    assert new.step_count == 1 and hook.counts == {"skips": 3}
    assert new.state_dict()["in_place_state"] == {"skips": 3}


# ------------------------------------------------ TrainStep.load_state_dict: all checked before any write


def _toy_step(clipper=None, **kw):
    task = ToyTask()
    torch.manual_seed(4)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clip = dict(clipper=clipper) if clipper is not None else dict(max_norm=None)
    return TrainStep(model, opt, task.loss_fn, precision="fp16", **clip, **kw), task


def _same_state(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("damage", ["negative step", "log", "clipper"])
def test_a_damaged_state_raises_and_leaves_the_train_step_as_it_was(damage):
    """Each part of the state is checked before the first is written: scale, step and clipper stay."""
    from labkit.clippers import ZClip

    saved, task = _toy_step(ZClip(warmup=2))
    for i in range(4):
        saved(*task.batch(i))
    state = saved.state_dict()
    state["scaler"]["scale"] = 4.0  # a good entry that differs from the target's: written first, if at all
    state.update({"negative step": {"step": -1}, "log": {"log": "not a log state"},
                  "clipper": {"clipper": {}}}[damage])
    target, _ = _toy_step(ZClip(warmup=2))
    target(*task.batch(0))
    before = target.state_dict()
    with pytest.raises((ValueError, TypeError, KeyError)):
        target.load_state_dict(state)
    assert _same_state(target.state_dict(), before)


def test_a_resumed_zclip_continues_its_statistics():
    """The clipper's state is saved and loaded with the step's: a resumed run clips as the whole one does."""
    from labkit.clippers import ZClip

    whole, task = _toy_step(ZClip(warmup=2))

    def batch(i):  # a gradient spike at step 4: ZClip's statistics (past its warm-up) clip it
        x, y = task.batch(i)
        return (x * 3, y) if i == 4 else (x, y)

    records = [whole(*batch(i)) for i in range(6)]
    first, _ = _toy_step(ZClip(warmup=2))
    for i in range(3):
        first(*batch(i))
    resumed, _ = _toy_step(ZClip(warmup=2))
    resumed.model.load_state_dict(first.model.state_dict())
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())
    resumed.load_state_dict(first.state_dict())
    later = [resumed(*batch(i)) for i in range(3, 6)]
    assert [(r.step, r.grad_norm, r.clip_coef) for r in later] == \
        [(r.step, r.grad_norm, r.clip_coef) for r in records[3:]]
    assert any(r.clipped for r in records[3:])  # the statistics decide something here


def test_a_state_with_a_clipper_entry_loads_into_a_step_without_a_clipper():
    """max_norm=None: the state's clipper entry (saved by a step that clipped) is left alone."""
    from labkit.clippers import ZClip

    saved, task = _toy_step(ZClip(warmup=2))
    saved(*task.batch(0))
    target, _ = _toy_step()
    target.load_state_dict(saved.state_dict())
    assert target.step_count == 1 and target.clipper is None


# ------------------------------------------------ the hooks' view, a bad loss's decision, deferred flushes


def test_on_decision_is_handed_the_train_step():
    """TrainStep calls each hook's on_decision with itself as the trainer (what a hook reads is there)."""
    seen = []

    class Sees(Hook):
        def on_decision(self, trainer, view):
            seen.append((trainer, view.step))

    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      hooks=[Sees()])
    train(torch.randn(4, 3), torch.randn(4, 1))
    assert seen == [(train, 0)]


def test_a_plain_loops_decision_view_has_a_scale_of_one():
    """DecisionView without a scale: an unscaled (fp32 or bf16) run's, 1."""
    from labkit.hooks import DecisionView

    view = DecisionView(0, 1.0, 2.0)
    assert view.scale == 1.0 and not view.loss_bad and view.norms is None and view.batch is None


def test_a_bad_loss_is_decided_on_the_host_skip_and_keep_the_scale():
    """skip_bad_loss: skip, no norm (nan), no clip (1), the scale kept, the hook's reason and fields."""
    from labkit.step.decision import skip_bad_loss

    d = skip_bad_loss(1024.0, Verdict(skip="spike_loss", fields={"z_loss": 7.0}))
    assert math.isnan(d.norm) and (d.coef, d.skip, d.scale, d.keep_scale) == (1.0, True, 1024.0, True)
    assert (d.reason, d.fields, d.inv_scale) == ("spike_loss", {"z_loss": 7.0}, None)


def test_a_deferred_record_names_a_dead_scale_as_a_per_step_one_does():
    """sync_every changes when a record is read, never what it says: a scale set below float32's normal
    range skips with reason dead_scale either way."""
    from labkit.scaler import GradScaler

    reasons = []
    for sync_every in (None, 2):
        scaler = GradScaler("cpu")
        scaler.scale(torch.ones(()))
        scaler.update(new_scale=1e-40)  # subnormal in float32: 1/scale is inf
        step, task = _toy_step(scaler=scaler, sync_every=sync_every)
        with pytest.warns(Warning, match="loss scale is dead"):  # the alarm says so too
            reasons.append(step(*task.batch(0)).reason)
    assert reasons == ["dead_scale", "dead_scale"]


def test_a_deferred_flush_that_cannot_write_finishes_every_record_then_raises():
    """A log write failing at the batched copy: every record is still kept, then LogWriteError is raised."""
    from labkit import LogWriteError

    step, task = _toy_step(log="/dev/full", sync_every=3)
    records = [step(*task.batch(i)) for i in range(2)]
    with pytest.raises(LogWriteError):
        step(*task.batch(2))  # the third call copies the three records over and writes them
    assert step.step_count == 3 and [r.step for r in step.log] == [0, 1, 2]
    assert all(math.isfinite(r.loss) for r in records)


def test_measured_fields_join_a_verdict_without_changing_what_it_asks():
    """Verdict.measured adds the hooks' measures as fields; its skip, clip and reason stay as they were."""
    v = Verdict(skip="spike_grad", clip_to=0.5, clip_reason="Mine", fields={"z_loss": 1.0})
    m = v.measured([("z_grad", 3.0), ("z_loss", 2.0)])
    assert m == Verdict("spike_grad", 0.5, "Mine", {"z_loss": 2.0, "z_grad": 3.0})
    assert v.fields == {"z_loss": 1.0} and v.measured([]) is v


def test_a_hook_raising_at_a_deferred_flush_leaves_every_record_whole_and_the_others_logged():
    """sync_every: a hook that raises on one record of the batched copy leaves none with placeholder numbers;
    the others reach the hooks and the log, as they would step by step, then the error is raised."""
    seen = []

    class Fussy(Hook):
        def on_record(self, trainer, record):
            seen.append(record.step)
            if record.step == 1:
                raise RuntimeError("this hook refuses step 1")

    step, task = _toy_step(sync_every=3, hooks=[Fussy()])
    ref, _ = _toy_step()
    records = [step(*task.batch(i)) for i in range(2)]
    with pytest.raises(RuntimeError, match="refuses step 1"):
        step(*task.batch(2))  # the third call copies the three over
    assert seen == [0, 1, 2]
    logged = list(step.log)
    assert [r.step for r in logged] == [0, 2]  # step 1's hook raised before it was logged, as step by step
    expected = [ref(*task.batch(i)) for i in range(3)]  # the same steps, read step by step
    for r, e in zip([*records, logged[1]], expected[:2] + expected[2:]):
        assert (r.loss, r.grad_norm, r.scale, r.skipped) == (e.loss, e.grad_norm, e.scale, e.skipped)


def test_read_copies_a_mixed_row_over_in_the_first_ones_dtype():
    """read(): one copy, in the first tensor's dtype: a float64 norm first keeps its bits (a float64
    model's record), and a float32 first rounds a float64 extra to float32, as documented."""
    fine = 1.0 + 2.0**-40  # not a float32
    f64 = torch.tensor(fine, dtype=torch.float64)
    assert read(f64, torch.tensor(0.5), torch.tensor(3, dtype=torch.int32)) == [fine, 0.5, 3.0]
    assert read(torch.tensor(0.5), f64) == [0.5, 1.0]
    assert read(torch.tensor(2.0), torch.tensor(3, dtype=torch.int32)) == [2.0, 3.0]


# ------------------------------------------------ forensics: which layers a record names


def test_forensics_of_finite_gradients_names_the_top_norms_and_no_culprit():
    """A clipped step: the top norms, largest first, and no first non-finite gradient."""
    from labkit.step.record import Forensics, forensics

    got = forensics([("a", None), ("b", None), ("c", None), ("d", None)], [1.0, 4.0, 2.0, 3.0], None)
    assert got == Forensics([("b", 4.0), ("d", 3.0), ("c", 2.0)], None, None)


def test_forensics_of_an_overflowed_norm_of_finite_gradients_names_the_norm_but_no_culprit():
    """An inf norm from finite values (the float32 sum of squares overflowed): the top norms still say so,
    and no gradient holds a NaN/inf to name."""
    from labkit.step.record import Forensics, forensics

    big = torch.full((2,), 3e38)
    assert torch.isinf(torch.linalg.vector_norm(big)) and torch.isfinite(big).all()
    got = forensics([("small", torch.ones(1)), ("big", big)], [1.0, math.inf], None)
    assert got == Forensics([("big", math.inf), ("small", 1.0)], None, None)


def test_forensics_ranks_a_gradient_missing_from_the_order_last_and_names_its_own_module():
    """A non-finite gradient the backward order did not see (a parameter hooked after attach) comes after
    every ordered one, and its module is read from its name."""
    from labkit.step.record import forensics

    named = [("h.0.w", None), ("h.1.w", None)]
    first = forensics(named, [math.inf, math.inf], None, {"h.1.w": (0, "h.1")})
    assert (first.first_nonfinite, first.culprit_module) == ("h.1.w", "h.1")
    unordered = forensics(named, [math.inf, math.nan], None, {})
    assert (unordered.first_nonfinite, unordered.culprit_module) == ("h.0.w", "h.0")


# ------------------------------------------------ the parameters the step guards follow the optimizer


@pytest.mark.parametrize("change", ["added", "swapped"])
def test_parameters_the_optimizer_takes_on_mid_run_are_guarded_from_the_next_step(change):
    """optimizer.add_param_group (progressive unfreezing), or a group's list replaced by another of the same
    length (training a different layer): the next step's norm covers what the optimizer holds now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    train = TrainStep(model, opt, torch.nn.functional.mse_loss, max_norm=1e6)
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    train(x, y)
    if change == "added":
        opt.add_param_group({"params": list(model[1].parameters())})
        held = list(model.parameters())
    else:
        opt.param_groups[0]["params"] = list(model[1].parameters())
        held = list(model[1].parameters())
    model.zero_grad(set_to_none=True)
    record = train(x, y)
    assert record.grad_norm == torch.nn.utils.get_total_norm([p.grad for p in held]).item()


def test_given_micro_batches_divide_the_loss_by_their_count_as_the_textbook_loop_does():
    """A list of k micro-batches: each loss / k (nanoGPT's ``loss / gradient_accumulation_steps``), not
    times 1/k: backward then divides the scale by k, which rounds differently from multiplying by 1/k
    when neither is a power of two (a scale of 100, k = 3). The same parameters as torch's loop, bitwise."""
    torch.manual_seed(0)
    k = 3
    ours, ref = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    ref.load_state_dict(ours.state_dict())
    ref_opt, scaler = torch.optim.SGD(ref.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=100.0)
    train = TrainStep(ours, torch.optim.SGD(ours.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      max_norm=None, accumulation_steps=k, scaler=GradScaler("cpu", init_scale=100.0))
    for _ in range(4):
        parts = [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(k)]
        for x, y in parts:
            scaler.scale(torch.nn.functional.mse_loss(ref(x), y) / k).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        train(parts)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)


# ------------------------------------------------ the optimizer's step: fused or not, and the hooks around it


class SeesTheStep(Hook):
    """Keep what pre_optim_step was given."""

    def __init__(self):
        self.seen = []

    def pre_optim_step(self, trainer, step, params):
        self.seen.append((trainer, step, [n for n, _ in params]))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_pre_optim_step_gets_the_trainer_the_step_and_the_guarded_parameters(fused):
    hook = SeesTheStep()
    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused),
                      torch.nn.functional.mse_loss, max_norm=None, hooks=[hook])
    for _ in range(2):
        train(torch.randn(4, 3), torch.randn(4, 1))
    assert hook.seen == [(train, 0, ["weight", "bias"]), (train, 1, ["weight", "bias"])]


def test_a_fused_optimizer_steps_without_a_clipper_and_refuses_one_that_clips_per_tensor():
    from labkit.clippers import AGC

    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    ref.load_state_dict(ours.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)
    train = TrainStep(ours, torch.optim.AdamW(ours.parameters(), lr=0.1, fused=True),
                      torch.nn.functional.mse_loss, max_norm=None)
    for _ in range(3):
        x, y = torch.randn(4, 3), torch.randn(4, 1)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert not train(x, y).skipped
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    per_tensor = TrainStep(ours, torch.optim.AdamW(ours.parameters(), lr=0.1, fused=True),
                           torch.nn.functional.mse_loss, clipper=AGC())
    with pytest.raises(ValueError, match="non-fused optimizer"):
        per_tensor(torch.randn(4, 3), torch.randn(4, 1))


def test_an_update_clip_with_a_loss_scaler_runs_after_the_step():
    """UpdateNormClip under fp16: after the step the scaler is asked again whether it skipped (its answer
    kept from the step's read), and the update is clipped to mean + k std of the past ones (k tiny: about
    the mean, so a growing update is cut)."""
    from labkit.clippers import UpdateNormClip

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      precision="fp16", clipper=UpdateNormClip(window=2, k=1e-6),
                      scaler=GradScaler("cpu", init_scale=16.0))
    x = torch.randn(4, 3)
    records = [train(x, torch.full((4, 1), 2.0 * (i + 1))) for i in range(3)]  # ever larger errors
    assert [r.skipped for r in records] == [False] * 3
    assert records[0].clip_coef == 1.0 and records[2].clip_coef < 1.0


@pytest.mark.parametrize("scale, reason", [(2.0**-126, "nonfinite_grad"), (2.0**-127, "dead_scale")],
                         ids=["the-floor", "below-it"])
def test_a_skip_at_the_scales_floor_is_an_overflow_and_below_it_a_dead_scale(scale, reason):
    """float32's smallest normal number (2**-126) is the default floor, a live scale: a skip there is the
    gradients' own. Below it (set by hand) 1 / scale is inf and every step skips: dead_scale."""
    from labkit.step.record import Outcome, build

    o = Outcome(0, [0.1], None, [], norms=[math.inf], named=[("w", None)])
    record = build(o, [1.0, 0.0, math.inf, 1.0, scale, scale, 1.0], True, None)
    assert (record.skipped, record.reason, record.first_nonfinite) == (True, reason, "w")


def test_normclips_defaults_are_a_2_norm_of_at_most_1_and_its_norm_order_must_be_positive():
    """NormClip() is nanoGPT's grad_clip = 1.0 on the 2-norm; an order <= 0 has no inf check in its norm."""
    clip = NormClip()
    assert (clip.max_norm, clip.norm_type) == (1.0, 2.0)
    for bad in (0, 0.0, -1.0):
        with pytest.raises(ValueError, match="norm_type"):
            NormClip(1.0, norm_type=bad)


# ------------------------------------------------ what a deciding hook is shown


class SeesTheDecision(Hook):
    """Keep every DecisionView; decide nothing."""

    def __init__(self):
        self.views = []

    def on_decision(self, trainer, view):
        self.views.append(view)


def test_a_deciding_hook_sees_the_scale_the_unscaled_norms_and_the_batch():
    hook = SeesTheDecision()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      precision="fp16", max_norm=1e6, scaler=GradScaler("cpu", init_scale=1024.0),
                      hooks=[hook])
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    record = train(x, y)
    view = hook.views[0]
    assert (view.step, float(view.scale), view.loss_bad) == (0, 1024.0, False)
    assert view.batch.inputs is x and view.batch.targets is y
    want = torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])  # unscaled, unclipped
    assert torch.equal(view.norms, want) and view.norm == record.grad_norm
    bad = train(torch.full((4, 3), math.nan), y)  # a NaN loss: backward never runs, the hooks still see it
    view = hook.views[1]
    assert bad.skipped and (view.step, float(view.scale), view.loss_bad) == (1, 1024.0, True)
    assert math.isnan(view.norm) and view.norms is None


def test_a_nonfinite_loss_found_on_the_device_is_named_so_in_a_deferred_record():
    """sync_every: the loss is checked on the device, and its flag reaches the decision: the record says
    nonfinite_loss (the loss), not nonfinite_grad (what backward then made of it)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      sync_every=2)
    y = torch.randn(4, 2)
    records = [train(torch.randn(4, 3), y), train(torch.full((4, 3), math.nan), y)]
    assert [(r.skipped, r.reason) for r in records] == [(False, None), (True, "nonfinite_loss")]


def test_a_deferred_step_with_an_infinite_loss_and_finite_gradients_is_skipped():
    """A loss of inf whose backward still gives finite gradients (an inf term that holds no parameter):
    with the loss check on the device, its flag alone skips the step; the parameters stay as they were."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)

    def loss_fn(out, y):
        return torch.nn.functional.mse_loss(out, y) + torch.tensor(math.inf)

    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, sync_every=1)
    before = [p.detach().clone() for p in model.parameters()]
    record = train(torch.randn(4, 3), torch.randn(4, 2))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert (record.skipped, record.reason) == (True, "nonfinite_loss")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))



# ------------------------------------------------ accumulation: the gradient sync, the loss check, the record


class NoSyncNet(torch.nn.Linear):
    """A module with DDP's ``no_sync()`` protocol, recording for which micro-batches it was entered."""

    def __init__(self):
        super().__init__(3, 2)
        self.synced, self._off = [], False

    @contextlib.contextmanager
    def no_sync(self):
        self._off = True
        try:
            yield
        finally:
            self._off = False

    def forward(self, x):
        self.synced.append(not self._off)
        return super().forward(x)


@pytest.mark.parametrize("k", [1, 3])
def test_only_the_last_micro_batchs_backward_syncs_the_gradients(k):
    """DDP's no_sync() around every micro-batch but the last (nanoGPT's require_backward_grad_sync): the
    gradients are reduced once per optimizer step. One micro-batch: it syncs."""
    model = NoSyncNet()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      accumulation_steps=k)
    train([(torch.randn(2, 3), torch.randn(2, 2)) for _ in range(k)])
    assert model.synced == [False] * (k - 1) + [True]


def test_deferred_accumulation_flags_a_non_finite_loss_in_any_micro_batch_and_none_in_clean_ones():
    """sync_every: the loss check stays on the device, over every micro-batch: a NaN in the first of two
    skips the step as a bad loss; clean micro-batches skip nothing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      accumulation_steps=2, sync_every=1)
    y = torch.randn(2, 2)
    clean = train([(torch.randn(2, 3), y), (torch.randn(2, 3), y)])
    first_bad = train([(torch.full((2, 3), math.nan), y), (torch.randn(2, 3), y)])
    assert (clean.skipped, clean.reason) == (False, None)
    assert (first_bad.skipped, first_bad.reason) == (True, "nonfinite_loss")


def test_an_accumulated_steps_logged_loss_is_the_float32_mean_of_its_micro_batches():
    """The record's loss is the mean of the micro-batches' losses, rounded to float32 as the losses are."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      accumulation_steps=3)
    parts = [(torch.randn(2, 3), torch.randn(2, 2)) for _ in range(3)]
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model(x), y).item() for x, y in parts]
    record = train(parts)
    assert record.loss == torch.tensor(record.loss, dtype=torch.float32).item()  # a float32 value
    assert record.loss == pytest.approx(sum(losses) / 3, rel=1e-6)


class SeesPostStep(Hook):
    def __init__(self):
        self.seen = []

    def post_step(self, trainer, params, record):
        self.seen.append((trainer, [n for n, _ in params], record.step))


def test_post_step_gets_the_trainer_its_parameters_and_the_record():
    hook = SeesPostStep()
    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      hooks=[hook])
    train(torch.randn(4, 3), torch.randn(4, 1))
    assert hook.seen == [(train, ["weight", "bias"], 0)]


class BrokenScheduler:
    def step(self):
        raise RuntimeError("the scheduler broke")


def test_a_schedulers_error_is_raised_after_the_step_is_complete_and_recorded():
    """The optimizer has stepped when the scheduler raises: the step is counted and logged, then it raises."""
    model = torch.nn.Linear(3, 1)
    before = model.weight.detach().clone()
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      scheduler=BrokenScheduler())
    with pytest.raises(RuntimeError, match="the scheduler broke"):
        train(torch.randn(4, 3), torch.randn(4, 1))
    assert train.step_count == 1 and [r.step for r in train.log] == [0]
    assert not torch.equal(model.weight, before)


class SeesTheCalls(Seen):
    """test_mutants_log's recording hook, first in line (it gives no order: BackwardOrder's is read next)."""

    priority = 100


def test_the_per_step_hooks_get_the_trainer_and_the_step_number():
    hook = SeesTheCalls()
    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      hooks=[hook])
    for _ in range(2):
        train(torch.randn(4, 3), torch.randn(4, 1))
    per_step = ("pre_forward", "post_backward", "gradient_order")
    want = [(name, train, step) for step in (0, 1) for name in per_step]
    assert [c for c in hook.calls if c[0] in per_step] == want


class OwnZeroGrad(torch.optim.SGD):
    """An optimizer with a zero_grad of its own (as some wrappers have): the step calls it."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.asked = []

    def zero_grad(self, set_to_none=True):
        self.asked.append(set_to_none)
        super().zero_grad(set_to_none=set_to_none)


def test_an_optimizers_own_zero_grad_is_called_to_set_the_gradients_to_none():
    model = torch.nn.Linear(3, 1)
    opt = OwnZeroGrad(model.parameters())
    train = TrainStep(model, opt, torch.nn.functional.mse_loss)
    train(torch.randn(4, 3), torch.randn(4, 1))
    train(torch.randn(4, 3), torch.randn(4, 1))
    assert opt.asked == [True, True]


def test_a_tensor_the_optimizer_holds_outside_the_model_is_guarded_by_its_place():
    """A parameter in the optimizer but not in the model (a learned temperature kept apart) is clipped
    and checked with the rest, named by its place in the optimizer's groups."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    temperature = torch.nn.Parameter(torch.tensor(2.0))

    def loss_fn(out, y):
        return torch.nn.functional.mse_loss(out * temperature, y)

    train = TrainStep(model, torch.optim.SGD([*model.parameters(), temperature], lr=0.1), loss_fn,
                      max_norm=1e6)
    record = train(torch.randn(4, 3), torch.randn(4, 1))
    want = torch.nn.utils.get_total_norm([model.weight.grad, model.bias.grad, temperature.grad])
    assert record.grad_norm == want.item()
    assert [name for name, _ in train._named_params()] == ["weight", "bias", "group0.param2"]


def test_every_trainstep_has_the_documented_default_alarms_and_blame():
    """parts.default_hooks' docstring: a streak of 8 skips, clipping on over half of the last 100 steps."""
    model = torch.nn.Linear(3, 1)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    assert {repr(h) for h in train.hooks.members} == {
        "SkipAlarm(threshold=8)", "ClipAlarm(rate=0.5, window=100)", "BackwardOrder()"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value, skip", [(3.0, 0.0), (math.inf, 1.0), (math.nan, 1.0)])
def test_the_decisions_found_inf_is_a_float32_flag_for_any_norm_dtype(dtype, value, skip):
    """found_inf as torch's unscale_ and fused optimizers take it: a float32 0 or 1, for float64 too."""
    norm = torch.tensor(value, dtype=dtype)
    d = decide(norm, norm.reshape(1), torch.ones(()), None, NormClip(1.0), Verdict())
    assert d.skip.dtype == torch.float32 and d.skip.item() == skip


# ------------------------------------------------ the batches a step takes, and the parts it refuses


def linear_step(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, **kw)


def test_a_batch_of_exactly_k_samples_splits_into_k_micro_batches_of_one():
    record = linear_step(accumulation_steps=4)(torch.randn(4, 3), torch.randn(4, 2))
    assert not record.skipped


@pytest.mark.parametrize("form", ["iterator", "callable"])
def test_micro_batches_from_an_iterator_or_a_callable_take_exactly_k(form):
    """An iterator gives k (next k times, no more: a loader goes on where the step left it); a callable is
    called k times (nanoGPT's get_batch). Micro-batches of one sample each are fine."""
    parts = [(torch.randn(1, 3), torch.randn(1, 2)) for _ in range(5)]
    it = iter(parts)
    step = linear_step(accumulation_steps=2)
    record = step(it if form == "iterator" else (lambda: next(it)))
    assert not record.skipped and next(it) is parts[2]  # two taken, the third is the loader's next


def test_an_iterator_with_fewer_than_k_micro_batches_is_refused():
    with pytest.raises(ValueError, match="the iterator gave 1 micro-batches; accumulation_steps=2 needs 2"):
        linear_step(accumulation_steps=2)(iter([(torch.randn(2, 3), torch.randn(2, 2))]))


def test_micro_batches_given_as_tensors_alone_go_to_a_one_argument_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out: out.pow(2).mean(),
                      accumulation_steps=2)
    xs = [torch.randn(2, 3), torch.randn(2, 3)]
    with torch.no_grad():
        want = sum(model(x).pow(2).mean().item() for x in xs) / 2
    assert train(xs).loss == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("batch", [{"x": torch.tensor(1.0)}, {"x": torch.tensor(1.0), "y": torch.tensor(2.)}],
                         ids=["one-scalar", "two-scalars"])
def test_a_dict_batch_of_0_dim_tensors_is_refused_saying_it_needs_a_batch_dimension(batch):
    with pytest.raises(ValueError, match="share their first .batch. dimension"):
        linear_step()(batch)


@pytest.mark.parametrize("fault", [None, "spike"])
def test_a_loss_that_does_not_require_grad_is_refused_before_backward(fault):
    """With or without a fault injected into the step (labkit.faults), the loss is checked first."""
    from labkit.faults import Faults

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      lambda out, y: torch.nn.functional.mse_loss(out, y).detach(),
                      hooks=[Faults({0: fault})] if fault else [])
    with pytest.raises(ValueError, match="the loss does not require grad: it was detached"):
        train(torch.randn(2, 3), torch.randn(2, 2))


def test_a_model_without_parameters_of_its_own_trains_what_the_optimizer_holds():
    """nn.Identity() and a parameter kept apart: the step runs on the CPU and guards that parameter."""
    w = torch.nn.Parameter(torch.ones(3))
    train = TrainStep(torch.nn.Identity(), torch.optim.SGD([w], lr=0.1),
                      lambda out, y: torch.nn.functional.mse_loss(out * w, y))
    record = train(torch.randn(4, 3), torch.zeros(4, 3))
    assert train.device == torch.device("cpu") and not record.skipped and not torch.equal(w, torch.ones(3))


@pytest.mark.parametrize("hooks", [iter([]), {SeesTheCalls()}], ids=["iterator", "set"])
def test_hooks_not_given_as_a_list_are_refused(hooks):
    with pytest.raises(TypeError, match="hooks"):
        linear_step(hooks=hooks)


def test_sync_every_refuses_an_adaptive_clipper_by_name():
    from labkit.clippers import ZClip

    with pytest.raises(ValueError, match="ZClip decide"):
        linear_step(clipper=ZClip(), max_norm=None, sync_every=2)


@pytest.mark.parametrize("name", ["accumulation_steps", "sync_every"])
def test_a_count_below_1_is_refused_by_its_name(name):
    with pytest.raises(ValueError, match=f"^{name}"):
        linear_step(**{name: 0})
