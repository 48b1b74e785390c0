"""The defenses' rules against their sources (issue 37: the mutants that survived the suite).

OLMo 2's spike score (|z| >= 7, non-finite values left out), the detector's clip limit (mean + z
std of its window, the population std: statistics.pstdev), PaLM's rewind (restore a snapshot at
least ``back`` steps old; the skipped window never feeds the batch that caused the spike again), the
tied-weight placement of ``blame.placed``, ``Triage``'s refusal without what it needs, and a
clipper's ``clip_with_norms_`` report against torch's clip.
"""

from __future__ import annotations

import copy
import math
import statistics
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.blame import placed
from labkit.clippers import AGC, LockInWarning, NormClip, ZClip
from labkit.clippers import base as clippers_base
from labkit.hooks import DecisionView, Verdict
from labkit.records import StepRecord
from labkit.rewind import Rewind
from labkit.spikes import SpikeDetector, rolling_z, spike_score
from labkit.triage import Triage

FAST = settings(max_examples=40, deadline=None, database=None)

# ------------------------------------------------------------------------------ spikes


def test_a_value_exactly_k_sigma_out_is_a_spike():
    """OLMo 2 counts values *at least* k sigma out: 8 against twenty of 0 and 2 (mean 1, std 1) is z = 7."""
    window = [0.0, 2.0] * 10
    assert rolling_z(window, 8.0, min_count=20) == 7.0
    assert spike_score(window + [8.0], window=100, k=7.0, min_count=20) == 100.0 / 21


@FAST
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=25, max_size=40),
       st.lists(st.integers(0, 40), min_size=1, max_size=4), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_nonfinite_values_are_left_out_of_the_spike_score(values, where, bad):
    spiked = values + [50.0]
    with_bad = list(spiked)
    for i in sorted(where, reverse=True):
        with_bad.insert(min(i, len(with_bad)), bad)
    assert spike_score(with_bad, window=30, min_count=20) == spike_score(spiked, window=30, min_count=20)


@FAST
@given(st.lists(st.integers(-4000, 4000).map(lambda i: i / 4), min_size=2, max_size=30),
       st.integers(-40000, 40000).map(lambda i: i / 4))
def test_rolling_z_is_the_population_z_score(window, x):
    std = statistics.pstdev(window)
    z = rolling_z(window, x, min_count=len(window))  # exactly min_count values: scored
    if std == 0:
        assert z == (0.0 if x == statistics.fmean(window) else math.copysign(math.inf, x - window[0]))
    else:
        assert z == pytest.approx((x - statistics.fmean(window)) / std, rel=1e-9, abs=1e-9)
    assert math.isnan(rolling_z(window, x, min_count=len(window) + 1))


def test_rolling_z_of_a_constant_window():
    assert rolling_z([3.0, 3.0], 3.0, min_count=1) == 0.0
    assert rolling_z([3.0, 3.0], 4.0, min_count=1) == math.inf
    assert rolling_z([3.0, 3.0], 2.0, min_count=1) == -math.inf
    assert math.isnan(rolling_z([], 2.0, min_count=0))


@FAST
@given(st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=2, max_size=16), st.floats(0.5, 5.0))
def test_the_detectors_clip_limit_is_mean_plus_z_std_of_its_window(norms, clip_z):
    det = SpikeDetector(window=16, skip_z=None, clip_z=clip_z, min_count=2)
    for n in norms:
        det.observe(1.0, n, admitted=True)
    want = statistics.fmean(norms) + clip_z * statistics.pstdev(norms)
    assert det.clip_limit() == pytest.approx(want, rel=1e-9, abs=1e-9)


def detector_at_mean_1_std_1(skip_z=6.0, clip_z=3.0):
    """A detector whose loss and norm windows are [0, 2] * 4: mean 1, population std 1, so z = x - 1."""
    det = SpikeDetector(window=8, skip_z=skip_z, clip_z=clip_z, min_count=2)
    for v in [0.0, 2.0] * 4:
        det.observe(v, v, admitted=True)
    return det


def test_a_step_exactly_skip_z_or_clip_z_sigma_out_is_kept():
    """OLMo-core's SkipStepOptimizer steps while ``x - mean <= k * std``: a value exactly ``skip_z`` sigma out
    is not skipped, and one exactly ``clip_z`` out is not clipped; a hair beyond, it is."""
    det = detector_at_mean_1_std_1()
    assert det.score(7.0, 4.0) == (6.0, 3.0)
    assert det.decide(6.0, 3.0) == (None, None)
    assert det.decide(0.0, 6.0) == ("clip", "z_grad")  # not skipped at skip_z: past clip_z, clipped
    assert det.on_decision(None, DecisionView(0, 7.0, 4.0)) == Verdict(fields={"z_loss": 6.0, "z_grad": 3.0})
    assert det.decide(6.0 + 1e-9, 0.0) == ("skip", "spike_loss")
    assert det.decide(0.0, 6.0 + 1e-9) == ("skip", "spike_grad")
    assert det.decide(0.0, 3.0 + 1e-9) == ("clip", "z_grad")


def test_a_gradient_spike_alone_skips_the_step_as_spike_grad():
    """A norm 9 sigma out with a quiet loss: the verdict skips the step, saying ``spike_grad``; 4 sigma
    (past clip_z, below skip_z) clips it to mean + clip_z * std = 4."""
    det = detector_at_mean_1_std_1()
    assert det.decide(0.0, 9.0) == ("skip", "spike_grad")
    assert det.on_decision(None, DecisionView(0, 1.0, 10.0)) == Verdict(
        skip="spike_grad", fields={"z_loss": 0.0, "z_grad": 9.0})
    assert det.on_decision(None, DecisionView(0, 1.0, 5.0)) == Verdict(
        clip_to=4.0, clip_reason="z_grad", fields={"z_loss": 0.0, "z_grad": 4.0})


def test_a_step_whose_loss_was_bad_is_not_scored():
    """A non-finite loss skips the step before backward: the detector says nothing of it, whatever norm the
    view holds, nor of a finite loss with a non-finite norm (that step skips anyway)."""
    det = detector_at_mean_1_std_1()
    assert det.on_decision(None, DecisionView(0, math.nan, 50.0, loss_bad=True)) is None
    assert det.on_decision(None, DecisionView(0, 50.0, math.inf)) is None


def test_a_resumed_detectors_window_still_holds_the_last_window_values():
    """The windows read back keep their length: after ``window`` more steps the saved values are gone, and
    the resumed detector scores as one that saw only those steps."""
    det = SpikeDetector(window=4, skip_z=6.0, min_count=2)
    for v in [50.0, 70.0, 90.0, 110.0]:
        det.observe(v, v, admitted=True)
    resumed, fresh = SpikeDetector(window=4, skip_z=6.0, min_count=2), SpikeDetector(window=4, min_count=2)
    resumed.load_state_dict(det.state_dict())
    for v in [0.0, 2.0] * 2:
        resumed.observe(v, v, admitted=True)
        fresh.observe(v, v, admitted=True)
    assert resumed.state_dict() == fresh.state_dict() == {"losses": [0.0, 2.0] * 2, "norms": [0.0, 2.0] * 2}
    assert resumed.score(7.0, 7.0) == (6.0, 6.0)


def test_the_detector_admits_a_record_as_the_step_was_taken():
    """``on_record`` admits the loss and the norm the optimizer stepped with: a z clip's own cut (its
    post-clip norm), another clipper's pre-clip norm (the spike it judges), and nothing of a skipped step."""
    det = SpikeDetector(window=8, skip_z=6.0, clip_z=3.0, min_count=2)
    det.on_record(None, StepRecord(0, 1.0, grad_norm=10.0, clip_coef=0.4, clip_reason="z_grad"))
    det.on_record(None, StepRecord(1, 2.0, grad_norm=10.0, clip_coef=0.4, clip_reason="NormClip"))
    det.on_record(None, StepRecord(2, 3.0, grad_norm=10.0))
    det.on_record(None, StepRecord(3, 50.0, grad_norm=90.0, skipped=True, reason="spike_grad"))
    assert det.state_dict() == {"losses": [1.0, 2.0, 3.0], "norms": [4.0, 10.0, 10.0]}


# ------------------------------------------------------------------------------ rewind


class Train:
    """What Rewind reads from a trainer: a model, an optimizer, a step count and a state."""

    def __init__(self):
        self.model = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler, self.device, self.process_group = None, torch.device("cpu"), None
        self.step_count = 0

    def state_dict(self):
        return {"step": self.step_count}

    def load_state_dict(self, state):
        self.step_count = state["step"]


def drive(rewind, steps, spikes):
    """Run ``steps`` records through ``rewind`` (spiking at the steps in ``spikes``, once each); return the
    batches fed, the steps they were fed at and the events."""
    train, fed, events, pending = Train(), [], [], set(spikes)
    rewind.attach(train)
    while train.step_count < steps:
        step = train.step_count
        fed.append((step, rewind.data_index(step)))
        spike = step in pending
        pending.discard(step)
        train.step_count += 1
        record = StepRecord(step, 1.0, skipped=spike, reason="spike_grad" if spike else None)
        event = rewind.after(train, record)
        if event is not None:
            events.append(event)
        # the newest snapshot at least `back` old and those after it: two copies at most when every = back
        assert len(rewind.snapshots) <= math.ceil(rewind.back / rewind.every) + 1
    return fed, events


def test_old_snapshots_are_dropped_as_the_run_goes_on():
    rewind = Rewind(back=5, skip=10)
    drive(rewind, 40, [])
    assert [s.step for s in rewind.snapshots] == [35, 40]


@FAST
@given(back=st.integers(1, 8), extra=st.integers(0, 12), spike=st.integers(0, 30), every=st.integers(1, 8))
def test_a_rewind_restores_a_snapshot_back_steps_old_and_never_feeds_the_spikes_batch_again(
        back, extra, spike, every):
    every = min(every, back)
    rewind = Rewind(back=back, skip=back + extra, every=every)
    fed, events = drive(rewind, spike + 20, [spike])
    (event,) = events
    assert event.step == spike and event.to <= max(0, spike + 1 - back)  # at least `back` steps undone
    bad = next(batch for step, batch in fed if step == spike)
    after = [batch for _, batch in fed[spike + 1:]]
    assert after and min(after) > bad  # the window skipped holds the spike's batch and all before it
    assert event.data_from <= bad < event.data_to == after[0]


def test_a_second_spike_right_after_a_rewind_rewinds_to_the_same_snapshot():
    rewind = Rewind(back=4, skip=8)
    _, events = drive(rewind, 14, [9, 9 + 1])
    first, second = events
    assert (first.step, first.to) == (9, 4)
    # the step after the rewind (step 4 again, at step_count 5) spikes: the snapshot of step 4 is kept
    assert second.to == 4


def same(a, b):
    """Equal state dicts: the same keys, and tensors equal element for element."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def spiked(train, rewind, steps, spikes, then=None):
    """Run ``train`` (trained on each batch fed) up to ``steps``, spiking at ``spikes``; return the
    batches fed at each step and the rewind events (``then(event)`` right after each)."""
    fed, events = [], []
    while train.step_count < steps:
        step = train.step_count
        fed.append(rewind.data_index(step))
        train.optimizer.zero_grad()
        train.model(torch.full((1, 2), 1.0 + fed[-1])).sum().backward()
        train.optimizer.step()
        train.step_count += 1
        spike = step in spikes
        spikes.discard(step)
        record = StepRecord(step, 1.0, skipped=spike, reason="spike_grad" if spike else None)
        event = rewind.after(train, record)
        if event is not None:
            events.append(event)
            if then is not None:
                then(event)
    return fed, events


def test_a_rewind_resumed_from_its_state_dict_goes_on_as_the_one_saved():
    """``Rewind.state_dict`` holds the data offset, the rewinds made and the snapshots: a fresh Rewind
    loaded with it (its rewinds as JSON reads them back, lists) feeds the same batches and rewinds alike."""
    torch.manual_seed(0)
    train = Train()
    rewind = Rewind(back=4, skip=6)
    rewind.attach(train)
    spiked(train, rewind, 12, {9})
    assert rewind.rewinds == [(9, 4)] and rewind.data_index(12) == 12 + 6
    saved = rewind.state_dict()
    model, step_count = copy.deepcopy(train.model.state_dict()), train.step_count
    fed, events = spiked(train, rewind, 24, {16})
    resumed = Rewind(back=4, skip=6)
    resumed.load_state_dict({**saved, "offset": str(saved["offset"]), "rewinds": [[9, 4]]})
    assert resumed.rewinds == [(9, 4)]
    train.model.load_state_dict(model)
    train.step_count = step_count
    assert spiked(train, resumed, 24, {16}) == (fed, events)
    assert resumed.rewinds == rewind.rewinds == [(9, 4), (16, 12)]


def test_a_rewinds_saved_state_is_a_copy():
    """What ``state_dict`` returns, and what ``load_state_dict`` was given, can be changed afterwards (a
    checkpoint edited, or loaded twice) without changing the snapshot the live Rewind restores."""
    torch.manual_seed(0)
    train = Train()
    rewind = Rewind(back=4, skip=6)
    rewind.attach(train)
    spiked(train, rewind, 6, set())
    at_4 = copy.deepcopy(rewind.snapshots[-1].state["model"])
    saved = rewind.state_dict()
    given = copy.deepcopy(saved)
    resumed = Rewind(back=4, skip=6)
    resumed.load_state_dict(given)
    for state in (saved, given):
        for snap in state["snapshots"]:
            for t in snap.state["model"].values():
                t.zero_()
    for r in (rewind, resumed):
        r.restore(train, StepRecord(8, 1.0, skipped=True, reason="spike_grad"))
        assert same(train.model.state_dict(), at_4) and train.step_count == 4


def test_two_rewinds_to_one_snapshot_restore_the_state_it_was_taken_with():
    """A snapshot is restored as taken: the steps trained after a rewind (SGD's momentum updated in
    place) leave it alone, so a second rewind to it restores the model and optimizer of its step."""
    torch.manual_seed(0)
    train = Train()
    train.optimizer = torch.optim.SGD(train.model.parameters(), lr=0.1, momentum=0.9)
    rewind = Rewind(back=4, skip=4)
    rewind.attach(train)
    spiked(train, rewind, 4, set())
    taken = copy.deepcopy((train.model.state_dict(), train.optimizer.state_dict()))
    assert taken[1]["state"][0]["momentum_buffer"].abs().sum() > 0
    restored = []
    spiked(train, rewind, 14, {9, 10},
           lambda event: restored.append((event.to, copy.deepcopy((train.model.state_dict(),
                                                                   train.optimizer.state_dict())))))
    assert [to for to, _ in restored] == [4, 4]
    for _, state in restored:
        assert same(state, taken)


# ------------------------------------------------------------------------------ blame


def uses(*amax):
    return {"wte.weight": {path: [rank, torch.tensor(a)] for path, rank, a in amax}}


POSITIONS = {"wte.weight": (0, "lm_head"), "h.1.w": (3, "h.1")}


@pytest.mark.parametrize("first, later, where", [
    (1.0, math.nan, (9, "wte")),  # finite at the head, non-finite further down: it came from below
    (math.inf, math.nan, (0, "lm_head")),  # the head's own share overflowed
    (math.inf, 1.0, (0, "lm_head")),
    (1.0, 2.0, (0, "lm_head")),  # nothing non-finite among the uses: left where it was
])
def test_a_tied_weight_is_placed_at_the_use_that_made_it_nonfinite(first, later, where):
    out = placed(POSITIONS, uses(("lm_head", 0, first), ("wte", 9, later)), ["wte.weight", "h.1.w"])
    assert out == {**POSITIONS, "wte.weight": where}


def test_the_uses_are_taken_in_backward_order_whatever_order_they_are_listed_in():
    listed = uses(("wte", 9, math.nan), ("mid", 5, math.inf), ("lm_head", 0, 1.0))
    out = placed(POSITIONS, listed, ["wte.weight"])
    assert out["wte.weight"] == (5, "mid")


def test_the_first_use_is_the_first_in_backward_not_in_the_alphabet():
    """A head named after its embedding in the alphabet ("head" > "emb") still comes first in backward: its
    finite share leaves the NaN to the embedding's use."""
    out = placed(POSITIONS, uses(("head", 0, 1.0), ("emb", 9, math.nan)), ["wte.weight"])
    assert out["wte.weight"] == (9, "emb")
    out = placed(POSITIONS, uses(("head", 0, math.nan), ("emb", 9, 1.0)), ["wte.weight"])
    assert out["wte.weight"] == POSITIONS["wte.weight"]


def test_a_weight_with_one_use_stays_where_backward_put_it():
    out = placed(POSITIONS, uses(("lm_head", 0, math.nan)), ["wte.weight"])
    assert out == POSITIONS and out is not POSITIONS


# ------------------------------------------------------------------------------ triage


@pytest.mark.parametrize("missing", ["model", "loss_fn", "precision"])
def test_triage_without_what_it_needs_says_so(missing):
    parts = {"model": torch.nn.Linear(2, 1), "loss_fn": torch.nn.functional.mse_loss, "precision": "fp16"}
    parts[missing] = None
    hook = Triage(**parts)
    view = DecisionView(0, math.nan, math.nan, loss_bad=True, batch=(torch.ones(1, 2), torch.zeros(1, 1)))
    with pytest.raises(RuntimeError, match="Triage needs the model, the loss function and the precision"):
        hook.on_decision(None, view)
    assert hook.on_decision(None, DecisionView(0, 1.0, 1.0)) is None  # a finite loss asks nothing


# ------------------------------------------------------------------------------ clippers


def params_with(grads):
    out = []
    for g in grads:
        p = torch.zeros(len(g), requires_grad=True)
        p.grad = torch.tensor(g)
        out.append(p)
    return out


@pytest.mark.parametrize("grads, max_norm", [([[3.0], [4.0]], 1.0), ([[0.3], [0.4]], 1.0),
                                             ([[3e-7, 4e-7]], 1e-7)])
def test_a_norm_clippers_report_is_torchs_coefficient_and_its_threshold(grads, max_norm):
    ours, theirs = params_with(grads), params_with(grads)
    norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in ours])
    done = NormClip(max_norm).clip_with_norms_(ours, norms, norm)
    want_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    assert done.dtype == torch.float32 and done.tolist() == [want_coef.item(), torch.tensor(max_norm).item()]
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad)
    again = params_with(grads)
    assert torch.equal(NormClip(max_norm).clip_(again), norm)


def test_a_per_tensor_clippers_report_is_the_post_over_pre_clip_norm():
    params = params_with([[30.0, 40.0]])
    for p in params:
        p.data.fill_(1.0)
    norm = torch.linalg.vector_norm(params[0].grad)
    done = AGC(clipping=0.01).clip_with_norms_(params, norm.reshape(1), norm)
    after = torch.linalg.vector_norm(params[0].grad)
    assert after < norm
    assert done[0].item() == pytest.approx((after / norm).item()) and math.isnan(done[1].item())


def test_the_lockin_warning_comes_from_rank_0_only(monkeypatch):
    """The records are the same on every rank, so one warning for the run: another rank says nothing."""
    def shifted(clipper):
        for i in range(80):
            clipper.clip_(params_with([[1.0 if i < 40 else 4.0]]))

    monkeypatch.setattr(clippers_base, "rank", lambda *a, **k: 1)
    other = ZClip(warmup=5, max_consecutive_clips=10)
    shifted(other)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LockInWarning)
        assert other.lockin() is True  # the guard fired, and the record says so, without a warning
    monkeypatch.setattr(clippers_base, "rank", lambda *a, **k: 0)
    first = ZClip(warmup=5, max_consecutive_clips=10)
    shifted(first)
    with pytest.warns(LockInWarning):
        assert first.lockin() is True


@pytest.mark.parametrize("kwargs", [{"back": 0}, {"skip": -1}, {"max_rewinds": 0}, {"every": 0},
                                    {"back": 4, "every": 5}])
def test_rewind_refuses_settings_out_of_range(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)) if "every" not in kwargs else "every"):
        Rewind(**kwargs)


def test_a_skip_of_one_batch_shorter_than_back_is_warned_about_and_zero_is_not():
    from labkit.alarms import LabkitWarning

    with pytest.warns(LabkitWarning, match="skip shorter than the steps undone"):
        Rewind(back=5, skip=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LabkitWarning)
        Rewind(back=5, skip=0)
        Rewind(back=5, skip=5)


def test_running_out_of_rewinds_warns_once_and_the_run_goes_on():
    from labkit.alarms import LabkitWarning

    rewind = Rewind(back=2, skip=2, max_rewinds=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, events = drive(rewind, 30, [5, 12, 20])
    assert len(events) == 1 and rewind.max_rewinds == 1
    assert len([w for w in caught if issubclass(w.category, LabkitWarning)]) == 1
    assert Rewind().max_rewinds == 10  # the documented default


def test_olmo2s_spike_score_defaults_are_a_window_of_1000_and_7_sigma():
    """OLMo 2 (arXiv 2501.00656): the last 1000 values, k = 7. A 50 that left the window 1001 values ago no
    longer widens it, so 8 against [0, 2] * 500 is exactly 7 sigma out: one spike in 1002 values."""
    values = [50.0] + [0.0, 2.0] * 500 + [8.0]
    assert spike_score(values) == 100.0 / len(values)
    assert spike_score([0.0, 2.0] * 10 + [8.0]) == 100.0 / 21  # scored from the 20th value on
    assert spike_score([]) == 0.0 and spike_score([math.nan, math.inf]) == 0.0


def test_a_resumed_detector_scores_as_the_one_it_was_saved_from():
    det = SpikeDetector(window=8, skip_z=6.0)
    for i in range(8):
        det.observe(1.0 + 0.01 * (i % 3), 2.0 + 0.01 * (i % 2), admitted=True)
    resumed = SpikeDetector(window=8, skip_z=6.0)
    resumed.load_state_dict(det.state_dict())
    assert resumed.score(1.5, 40.0) == det.score(1.5, 40.0) and not math.isnan(det.score(1.5, 40.0)[0])


@pytest.mark.parametrize("back", [1, 3, 5])
def test_a_rewind_returns_to_the_newest_snapshot_back_steps_old(back):
    """With a snapshot every step, the one restored undoes exactly ``back`` steps (the spike's included)."""
    rewind = Rewind(back=back, skip=back, every=1)
    _, (event,) = drive(rewind, 14, [9])
    assert event.to == 9 + 1 - back


def test_rewinds_defaults_are_palms_scale_as_its_repr_says():
    """PaLM §5.1: ~100 steps back, 200-500 batches skipped."""
    assert repr(Rewind()) == "Rewind(back=100, skip=300, every=100)"


# ------------------------------------------------------------------------------ spikes: settings, defaults


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"window": 1}, "window"), ({"window": 0}, "window"), ({"skip_z": 0}, "skip_z"),
    ({"skip_z": -1.0}, "skip_z"),
    ({"clip_z": 0, "skip_z": None}, "clip_z"), ({"clip_z": -1.0, "skip_z": None}, "clip_z"),
])
def test_a_detector_setting_out_of_range_is_refused_naming_it(kwargs, name):
    rule = "a number of standard deviations" if name != "window" else "an int"
    with pytest.raises(ValueError, match=f"^{name} must be {rule}"):
        SpikeDetector(**kwargs)


def test_a_detectors_clip_z_must_be_below_its_skip_z_and_the_edges_are_accepted():
    """Clip the moderate spikes, skip the big ones: ``clip_z == skip_z`` would leave no band to clip in."""
    with pytest.raises(ValueError, match="clip_z"):
        SpikeDetector(skip_z=6.0, clip_z=6.0)
    assert SpikeDetector(skip_z=6.0, clip_z=5.999).clip_z == 5.999
    assert SpikeDetector(window=2).window == 2
    assert SpikeDetector(skip_z=1e-9, clip_z=None).skip_z == 1e-9
    assert SpikeDetector(skip_z=None, clip_z=1e-9).clip_z == 1e-9


def test_a_detector_scores_from_its_min_count_or_half_its_window():
    """OLMo-core: inactive until ``window // 2`` values (4 of a window of 9); ``min_count`` overrides it."""
    det = SpikeDetector(window=9, skip_z=None)
    given_min = SpikeDetector(window=9, skip_z=None, min_count=2)
    for v in [0.0, 2.0]:
        det.observe(v, v, admitted=True)
        given_min.observe(v, v, admitted=True)
    assert math.isnan(det.score(3.0, 3.0)[0]) and given_min.score(3.0, 3.0) == (2.0, 2.0)
    for v in [0.0, 2.0]:
        det.observe(v, v, admitted=True)
    assert det.score(3.0, 3.0) == (2.0, 2.0)  # 4 values in: 9 // 2


def test_the_detectors_defaults_are_olmo_cores_window_of_128_and_6_sigma():
    """OLMo-core's SkipStepOptimizer: the last 128 values (active from 64), a skip beyond 6 sigma; no clip."""
    g = torch.Generator().manual_seed(5)
    values = (1.0 + torch.rand(200, generator=g, dtype=torch.float64)).tolist()
    default = SpikeDetector()
    published = SpikeDetector(window=128, skip_z=6.0, clip_z=None, min_count=64)
    for i, v in enumerate(values):
        past = values[max(0, i - 128):i]
        z = (v - statistics.fmean(past)) / statistics.pstdev(past) if len(past) >= 64 else math.nan
        got = default.score(v, v)
        assert got == published.score(v, v)
        assert (math.isnan(got[0]) and math.isnan(z)) or got[0] == pytest.approx(z, rel=1e-9)
        default.observe(v, v, admitted=True)
        published.observe(v, v, admitted=True)
    past = values[-128:]
    mean, std = statistics.fmean(past), statistics.pstdev(past)
    for z, want in [(5.9, (None, None)), (6.1, ("skip", "spike_loss"))]:
        x = mean + z * std
        assert default.decide(*default.score(x, 1.5)) == want == published.decide(*published.score(x, 1.5))


# ------------------------------------------------------------------------------ rewind: settings, all ranks


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"back": 0}, "back"), ({"skip": -1}, "skip"), ({"max_rewinds": 0}, "max_rewinds"),
    ({"every": 0}, "every"),
])
def test_a_rewind_setting_out_of_range_is_refused_naming_it(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must"):
        Rewind(**kwargs)


def test_every_rank_rewinds_when_one_ranks_record_says_so(monkeypatch):
    """Under torch.distributed the trigger is all-reduced by MAX over the trainer's process group: a quiet
    record on this rank still rewinds when another rank's record spiked (a fake two-rank group)."""
    import labkit.rewind as rewind_module

    group = object()
    peer = {"want": 0}
    calls = []

    def all_reduce_(tensor, op, group_=None):
        assert group_ is group, "reduced over another group than the trainer's"
        ops = {"max": torch.maximum, "min": torch.minimum, "sum": torch.add}
        calls.append(op)
        tensor.copy_(ops[op](tensor, torch.tensor([peer["want"]])))
        return tensor

    monkeypatch.setattr(rewind_module, "is_distributed", lambda: True)
    monkeypatch.setattr(rewind_module, "all_reduce_", all_reduce_)
    train = Train()
    train.process_group = group
    rewind = Rewind(back=2, skip=2)
    rewind.attach(train)
    for step in range(4):
        train.step_count += 1
        assert rewind.after(train, StepRecord(step, 1.0)) is None
    peer["want"] = 1  # the other rank's record at step 4 spiked; this rank's did not
    train.step_count += 1
    event = rewind.after(train, StepRecord(4, 1.0))
    assert event is not None and (event.step, event.to) == (4, 2) and train.step_count == 2
    assert calls == ["max"] * 5
