"""labkit.GradScaler and labkit.update_scale, with torch.amp.GradScaler("cpu") as the oracle.

torch is trusted: wherever labkit promises to be a drop-in (hysteresis=1, no bounds) the
tests run torch's scaler side by side on deep copies of the same model and data and demand
bit-for-bit agreement. The features torch lacks (step() -> bool, hysteresis, min/max
bounds, skip counters, full state_dict) are checked against small Python references of
the rule written in ``update_scale``'s docstring.
"""

from __future__ import annotations

import copy
import inspect
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import labkit
from labkit import GradScaler, ScalerConfig, update_scale
from labkit.scaler import grow_or_keep

INF = float("inf")
NAN = float("nan")
F32_MAX = float(torch.finfo(torch.float32).max)

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
}

# (init_scale, growth_factor, backoff_factor, growth_interval)
SCALER_ARGS = {
    "gi1": (2.0**16, 2.0, 0.5, 1),
    "gi3-g1.7-b0.3": (2.0**10, 1.7, 0.3, 3),
    "gi5": (2.0**12, 2.0, 0.5, 5),
    "gi1-g1.7-b0.3": (1000.0, 1.7, 0.3, 1),
}

HYPOTHESIS = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------- helpers


def f32(x: float) -> float:
    """Round a Python float (float64) to float32 and back, as torch's CPU kernel does."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def make_batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(n)]


def overflow_pattern(seed: int, n: int, p: float = 0.3) -> list[str | None]:
    """Per iteration: None (clean) or how to overflow ("inf", "nan" in a grad, "loss" too large)."""
    rng = random.Random(seed)
    return [rng.choice(["inf", "nan", "loss"]) if rng.random() < p else None for _ in range(n)]


def grads_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def train_iteration(model, opt, scaler, batch, fault, *, explicit_unscale, clip=None):
    """One standard AMP iteration; returns (step() return value, whether the grads overflowed)."""
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    if fault == "loss":
        loss = loss * F32_MAX  # times the scale (>= 1 here) this overflows float32
    scaler.scale(loss).backward()
    if fault in ("inf", "nan"):
        with torch.no_grad():
            model[2].weight.grad[1, 2] = INF if fault == "inf" else NAN
    overflowed = not grads_finite(model)
    if explicit_unscale:
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    stepped = scaler.step(opt)
    scaler.update()
    return stepped, overflowed


def assert_same_params(a: nn.Module, b: nn.Module, where: str = "") -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs {where}"


def opt_state_snapshot(opt: torch.optim.Optimizer) -> list[dict]:
    return [
        {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in opt.state[p].items()}
        for group in opt.param_groups
        for p in group["params"]
    ]


def assert_same_opt_state(a: list[dict], b: list[dict], where: str = "") -> None:
    assert len(a) == len(b)
    for i, (sa, sb) in enumerate(zip(a, b)):
        assert sa.keys() == sb.keys(), f"param {i}: state keys differ {where}"
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), f"param {i}: state[{k!r}] differs {where}"
            else:
                assert sa[k] == sb[k], f"param {i}: state[{k!r}] differs {where}"


class Toy:
    """One parameter and an SGD optimizer: the cheapest way to drive a scaler through iterations."""

    def __init__(self, n: int = 3):
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, n))
        self.opt = torch.optim.SGD([self.w], lr=0.1)

    def iterate(self, scaler, overflow: bool) -> object:
        self.opt.zero_grad(set_to_none=True)
        scaler.scale((self.w**2).sum()).backward()
        if overflow:
            self.w.grad[0] = INF
        result = scaler.step(self.opt)
        scaler.update()
        return result


def drive(scaler, pattern) -> list[float]:
    """Run ``scaler`` through the overflow ``pattern``; return get_scale() after each update."""
    toy = Toy()
    scales = []
    for overflow in pattern:
        toy.iterate(scaler, overflow)
        scales.append(scaler.get_scale())
    return scales


def t_scale(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def t_int(v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32)


def t_found(overflow: bool) -> torch.Tensor:
    return torch.tensor(1.0 if overflow else 0.0, dtype=torch.float32)


def reference_rule(scale, tracker, hyst, overflow, cfg: ScalerConfig):
    """The pseudocode of update_scale's docstring, in plain Python (float64 products -> float32)."""
    if overflow:
        tracker = 0
        hyst = max(hyst - 1, 0)
        if hyst == 0:
            scale = f32(scale * cfg.backoff_factor)
            # without min_scale the floor is float32's smallest normal number: the scale never dies
            scale = max(
                scale, cfg.min_scale if cfg.min_scale is not None else torch.finfo(torch.float32).tiny
            )
    else:
        tracker += 1
        if tracker == cfg.growth_interval:
            tracker = 0
            hyst = cfg.hysteresis
            grown = f32(scale * cfg.growth_factor)
            if math.isfinite(grown):
                scale = grown if cfg.max_scale is None else min(grown, cfg.max_scale)
    return scale, tracker, hyst


def torch_rule(scale, tracker, overflow, growth_factor, backoff_factor, growth_interval):
    """torch's _amp_update_scale_ in plain Python."""
    if overflow:
        return f32(scale * backoff_factor), 0
    tracker += 1
    if tracker == growth_interval:
        grown = f32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, tracker


def run_rule(init_scale, cfg, pattern, init_tracker=0, init_hyst=None):
    """Apply labkit.update_scale along ``pattern``; yield (scale, tracker, hyst) as Python numbers."""
    s, g, h = (t_scale(init_scale), t_int(init_tracker),
               t_int(cfg.hysteresis if init_hyst is None else init_hyst))
    for overflow in pattern:
        s, g, h = update_scale(s, g, h, t_found(overflow), cfg)
        assert s.dtype == torch.float32 and g.dtype == torch.int32 and h.dtype == torch.int32
        assert s.shape == g.shape == h.shape == ()
        yield s.item(), g.item(), h.item()


# ---------------------------------------------------------------- 1. parity with torch


@pytest.mark.parametrize("explicit_unscale", [True, False], ids=["unscale_", "step-only"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("args_id", list(SCALER_ARGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parity_with_torch_scale_sequence_and_params(seed, args_id, opt_name, explicit_unscale):
    init_scale, growth, backoff, interval = SCALER_ARGS[args_id]
    n = 50
    ref_model = make_model(seed)
    our_model = copy.deepcopy(ref_model)
    ref_opt, our_opt = (
        OPTIMIZERS[opt_name](ref_model.parameters()),
        OPTIMIZERS[opt_name](our_model.parameters()),
    )
    kwargs = dict(
        init_scale=init_scale, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
    )
    ref = torch.amp.GradScaler("cpu", **kwargs)
    ours = GradScaler("cpu", **kwargs)
    assert ours.get_scale() == ref.get_scale() == init_scale
    clip = 1.0 if explicit_unscale else None

    ref_scales, our_scales, overflows = [], [], []
    for i, (batch, fault) in enumerate(zip(make_batches(seed, n), overflow_pattern(seed, n))):
        _, ref_overflow = train_iteration(
            ref_model, ref_opt, ref, batch, fault, explicit_unscale=explicit_unscale, clip=clip
        )
        stepped, our_overflow = train_iteration(
            our_model, our_opt, ours, batch, fault, explicit_unscale=explicit_unscale, clip=clip
        )
        assert ref_overflow == our_overflow
        if fault in ("inf", "nan"):
            assert our_overflow, "an injected inf/nan must count as an overflow"
        assert stepped is (not our_overflow), f"iteration {i}: step() returned {stepped!r}"
        ref_scales.append(ref.get_scale())
        our_scales.append(ours.get_scale())
        overflows.append(our_overflow)
        assert our_scales[-1] == ref_scales[-1], (
            f"iteration {i}: scale {our_scales[-1]} != torch's {ref_scales[-1]}"
        )
        assert_same_params(ref_model, our_model, f"after iteration {i}")
        ref_sd, our_sd = ref.state_dict(), ours.state_dict()
        assert our_sd["_growth_tracker"] == ref_sd["_growth_tracker"], f"iteration {i}"
        assert {k: our_sd[k] for k in ref_sd} == ref_sd

    assert our_scales == ref_scales
    assert_same_opt_state(opt_state_snapshot(ref_opt), opt_state_snapshot(our_opt), "at the end")
    # the run exercised both directions, so the comparison above had something to compare
    assert any(overflows) and not all(overflows)
    assert any(b < a for a, b in zip([init_scale] + our_scales, our_scales)), "no backoff happened"
    assert any(b > a for a, b in zip([init_scale] + our_scales, our_scales)), "no growth happened"
    assert ours.skip_count == sum(overflows)


def test_parity_with_torch_sparse_embedding_gradients():
    """Sparse (uncoalesced) embedding grads are unscaled in place, as torch does, before SGD steps."""
    torch.manual_seed(0)
    ref_emb = nn.Embedding(10, 3, sparse=True)
    our_emb = copy.deepcopy(ref_emb)
    ref_opt = torch.optim.SGD(ref_emb.parameters(), lr=0.1)
    our_opt = torch.optim.SGD(our_emb.parameters(), lr=0.1)
    ref, ours = torch.amp.GradScaler("cpu", init_scale=1024.0), GradScaler("cpu", init_scale=1024.0)
    idx = torch.tensor([1, 1, 2, 3, 3])
    for emb, opt, scaler in ((ref_emb, ref_opt, ref), (our_emb, our_opt, ours)):
        scaler.scale(emb(idx).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert torch.equal(our_emb.weight, ref_emb.weight), (our_emb.weight - ref_emb.weight).abs().max()


# ---------------------------------------------------------------- 2. skipped steps


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_skipped_step_leaves_params_and_optimizer_state_bitwise_unchanged(opt_name):
    model = make_model(3)
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    batches = make_batches(3, 6)
    for batch in batches[:2]:  # populate momentum / exp_avg / exp_avg_sq / step
        assert train_iteration(model, opt, scaler, batch, None, explicit_unscale=False) == (True, False)
    assert all(opt.state[p] for p in model.parameters())
    for fault, batch in zip(["inf", "nan", "loss"], batches[2:5]):
        params = [p.detach().clone() for p in model.parameters()]
        state = opt_state_snapshot(opt)
        assert train_iteration(model, opt, scaler, batch, fault, explicit_unscale=True) == (False, True)
        for p, before in zip(model.parameters(), params):
            assert torch.equal(p, before)
        assert_same_opt_state(state, opt_state_snapshot(opt), f"after a skipped {fault} step")
    # and a clean step afterwards does move them
    params = [p.detach().clone() for p in model.parameters()]
    assert train_iteration(model, opt, scaler, batches[5], None, explicit_unscale=False) == (True, False)
    assert any(not torch.equal(p, before) for p, before in zip(model.parameters(), params))


def test_skip_count_and_streak_over_a_pattern():
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    toy = Toy()
    assert (scaler.skip_count, scaler.skip_streak) == (0, 0)
    pattern = [False, True, True, False, True, True, True, False]
    expected_count = [0, 1, 2, 2, 3, 4, 5, 5]
    expected_streak = [0, 1, 2, 0, 1, 2, 3, 0]
    got = []
    for overflow in pattern:
        got.append((toy.iterate(scaler, overflow), scaler.skip_count, scaler.skip_streak))
    assert got == [(not o, c, s) for o, c, s in zip(pattern, expected_count, expected_streak)]
    assert isinstance(scaler.skip_count, int) and isinstance(scaler.skip_streak, int)
    sd = scaler.state_dict()
    assert (sd["skip_count"], sd["skip_streak"]) == (5, 0)


def test_an_iteration_with_an_overflow_counts_once_however_many_grads_overflow():
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    toy = Toy()
    toy.opt.zero_grad()
    scaler.scale((toy.w**2).sum()).backward()
    toy.w.grad.fill_(INF)
    assert scaler.step(toy.opt) is False
    scaler.update()
    assert (scaler.skip_count, scaler.skip_streak, scaler.get_scale()) == (1, 1, 2.0**9)


def test_hysteresis_in_the_scaler_skips_every_overflow_but_backs_off_at_the_hth():
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, hysteresis=2)
    toy = Toy()
    pattern = [True, True, True, False, False, True, False, True, True]
    got = [
        (toy.iterate(scaler, o), scaler.get_scale(), scaler.state_dict()["_hysteresis_left"]) for o in pattern
    ]
    assert got == [
        (False, 1024.0, 1),  # 1st overflow since the start: counted, not backed off
        (False, 512.0, 0),  # 2nd: backs off
        (False, 256.0, 0),  # counter exhausted: every further overflow backs off
        (True, 256.0, 0),
        (True, 512.0, 2),  # growth refills the counter
        (False, 512.0, 1),
        (True, 512.0, 1),  # a clean step without growth does not refill
        (False, 256.0, 0),
        (False, 128.0, 0),
    ]
    assert (scaler.skip_count, scaler.skip_streak) == (6, 2)


# ---------------------------------------------------------------- 3. the pure rule, by hypothesis

found_seqs = st.lists(st.booleans(), min_size=1, max_size=60)
sparse_found_seqs = st.lists(st.sampled_from([False, False, False, True]), min_size=1, max_size=60)


@HYPOTHESIS
@given(
    init_exp=st.integers(-20, 40),
    growth=st.one_of(st.sampled_from([2.0, 1.7, 1.5, 3.0]), st.floats(1.01, 4.0)),
    backoff=st.one_of(st.sampled_from([0.5, 0.3, 0.25]), st.floats(0.05, 0.95)),
    interval=st.integers(1, 5),
    pattern=st.one_of(found_seqs, sparse_found_seqs),
)
def test_rule_with_hysteresis_1_and_no_bounds_is_torchs_rule(init_exp, growth, backoff, interval, pattern):
    cfg = ScalerConfig(growth, backoff, interval, 1, None, None)
    init = 2.0**init_exp
    ref_s, ref_g = init, 0
    oracle_s, oracle_g = t_scale(init), t_int(0)
    for overflow, (s, g, h) in zip(pattern, run_rule(init, cfg, pattern)):
        ref_s, ref_g = torch_rule(ref_s, ref_g, overflow, growth, backoff, interval)
        torch._amp_update_scale_(oracle_s, oracle_g, t_found(overflow), growth, backoff, interval)
        assert (s, g) == (ref_s, ref_g) == (oracle_s.item(), oracle_g.item())
        assert h in (0, 1)


@HYPOTHESIS
@given(
    scale=st.one_of(st.floats(2.0**-130, 3e38), st.sampled_from([2.0**-126, 2.0**-149, 3.4e38])),
    tracker=st.integers(0, 12),
    left=st.integers(0, 1),
    found=st.sampled_from([0.0, 1.0, 2.0, math.inf, math.nan]),
    growth=st.one_of(st.sampled_from([2.0, 1.7]), st.floats(1.01, 8.0)),
    backoff=st.one_of(st.sampled_from([0.5, 0.3]), st.floats(0.01, 0.99)),
    interval=st.integers(1, 6),
    min_scale=st.one_of(st.none(), st.floats(1e-30, 1e4)),
    counts=st.tuples(st.integers(0, 50), st.integers(0, 50)),
    read=st.booleans(),
)
def test_scaler_update_is_torchs_kernel_with_the_floor(scale, tracker, left, found, growth, backoff, interval,
                                                       min_scale, counts, read):
    """hysteresis 1 and no cap: update() gives what torch's fused ``_amp_update_scale_`` gives, from any
    state, with the rule's two additions: a tracker at or past a lowered growth_interval grows now (clamped
    first), and a backed-off scale is floored (``min_scale``, else 2**-126). ``read``: the check was a
    host bool."""
    scaler = GradScaler("cpu", growth_factor=growth, backoff_factor=backoff, growth_interval=interval,
                        min_scale=min_scale)
    state = scaler._lazy_init(torch.device("cpu"))
    skips = (max(counts), min(counts))
    values = (t_scale(scale), t_int(tracker), t_int(left), torch.tensor(skips[0]), torch.tensor(skips[1]))
    for key, value in zip(
        ("scale", "growth_tracker", "hysteresis_left", "skip_count", "skip_streak"), values
    ):
        state[key].copy_(value)
    # the oracle: torch's kernel on copies
    want_scale, want_tracker = values[0].clone(), values[1].clone().clamp_(max=interval - 1)
    torch._amp_update_scale_(want_scale, want_tracker, torch.tensor(float(found)), growth, backoff, interval)
    if found != 0:
        floor = 2.0**-126 if min_scale is None else torch.tensor(min_scale, dtype=torch.float64)
        if min_scale is not None:  # rounded inwards to float32, so a floor never lets the scale below it
            f = floor.float()
            floor = torch.nextafter(f, torch.tensor(math.inf)).item() if f.double() < floor else f.item()
        want_scale = torch.maximum(want_scale, torch.tensor(floor, dtype=torch.float32))
    w = torch.ones(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.0)
    w.grad = torch.zeros(1)
    scaler.inf_check_(opt, bool(found != 0) if read else torch.tensor(found), unscaled=True)
    scaler.update()
    assert torch.equal(state["scale"], want_scale), (state["scale"], want_scale)
    assert torch.equal(state["growth_tracker"], want_tracker)
    assert state["hysteresis_left"].item() == (0 if found != 0 else 1 if want_tracker == 0 else left)
    skipped = int(found != 0)
    assert ((state["skip_count"].item(), state["skip_streak"].item())
            == (skips[0] + skipped, (skips[1] + 1) * skipped))


@HYPOTHESIS
@given(
    scale=st.one_of(st.floats(2.0**-130, 3e38), st.sampled_from([2.0**-126, 2.0**-149, 3.4e38])),
    tracker=st.integers(0, 12),
    left=st.integers(0, 4),
    growth=st.one_of(st.sampled_from([2.0, 1.7]), st.floats(1.01, 8.0)),
    interval=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    bounds=st.tuples(st.one_of(st.none(), st.floats(1e-30, 1e4)), st.one_of(st.none(), st.floats(1.0, 3e38))),
)
def test_the_clean_steps_rule_is_the_rule_given_no_overflow(scale, tracker, left, growth, interval,
                                                             hysteresis, bounds):
    """``grow_or_keep`` (a check already read on the host, clean) is ``update_scale`` given ``found_inf=0``:
    the same three tensors, bit for bit and dtype for dtype, and the inputs left as they were."""
    lo, hi = bounds
    assume(lo is None or hi is None or lo <= hi)
    cfg = ScalerConfig(growth, 0.5, interval, hysteresis, lo, hi)
    state = (t_scale(scale), t_int(tracker), t_int(min(left, hysteresis)))
    before = [t.clone() for t in state]
    want = update_scale(*state, t_found(False), cfg)
    got = grow_or_keep(*state, cfg)
    for name, g, w in zip(("scale", "tracker", "hysteresis_left"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape == () and torch.equal(g, w), (name, g, w)
    assert all(torch.equal(a, b) for a, b in zip(state, before))


@HYPOTHESIS
@given(
    init_exp=st.integers(-10, 30),
    below=st.integers(0, 8),
    above=st.integers(0, 8),
    has_min=st.booleans(),
    has_max=st.booleans(),
    growth=st.one_of(st.sampled_from([2.0, 1.7, 4.0]), st.floats(1.01, 8.0)),
    backoff=st.one_of(st.sampled_from([0.5, 0.3, 0.125]), st.floats(0.01, 0.99)),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    pattern=st.one_of(found_seqs, sparse_found_seqs, st.lists(st.just(True), min_size=30, max_size=60)),
)
def test_rule_matches_its_pseudocode_and_stays_within_bounds(
    init_exp, below, above, has_min, has_max, growth, backoff, interval, hysteresis, pattern
):
    init = 2.0**init_exp
    lo = init * 2.0**-below if has_min else None
    hi = init * 2.0**above if has_max else None
    cfg = ScalerConfig(growth, backoff, interval, hysteresis, lo, hi)
    ref = (init, 0, hysteresis)
    for i, (overflow, got) in enumerate(zip(pattern, run_rule(init, cfg, pattern))):
        ref = reference_rule(*ref, overflow, cfg)
        assert got == ref, f"step {i}"
        s = got[0]
        assert math.isfinite(s)
        if lo is not None:
            assert s >= lo > 0
        if hi is not None:
            assert s <= hi
        assert 0 <= got[1] < interval
        assert 0 <= got[2] <= hysteresis


@HYPOTHESIS
@given(
    init_exp=st.integers(-10, 30),
    growth=st.one_of(st.sampled_from([2.0, 1.7]), st.floats(1.01, 4.0)),
    backoff=st.one_of(st.sampled_from([0.5, 0.3]), st.floats(0.05, 0.95)),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    pattern=st.one_of(found_seqs, sparse_found_seqs),
)
def test_rule_growth_timing_tracker_reset_and_hysteresis(
    init_exp, growth, backoff, interval, hysteresis, pattern
):
    """Stated as observations, independent of the pseudocode: when it grows, resets and backs off."""
    cfg = ScalerConfig(growth, backoff, interval, hysteresis, None, None)
    prev_scale, prev_tracker = 2.0**init_exp, 0
    clean_run = 0  # consecutive clean iterations since the last overflow or growth
    overflows_since_growth = 0  # the start counts as a growth: the hysteresis counter is full
    for i, (overflow, (s, g, h)) in enumerate(zip(pattern, run_rule(prev_scale, cfg, pattern))):
        if overflow:
            clean_run = 0
            overflows_since_growth += 1
            assert g == 0, f"step {i}: an overflow must reset the growth tracker"
            if overflows_since_growth >= hysteresis:
                assert s == f32(prev_scale * backoff), (
                    f"step {i}: overflow #{overflows_since_growth} must back off"
                )
            else:
                assert s == prev_scale, (
                    f"step {i}: overflow #{overflows_since_growth} < hysteresis must not back off"
                )
            assert h == max(hysteresis - overflows_since_growth, 0)
        else:
            clean_run += 1
            if clean_run == interval:
                grown = f32(prev_scale * growth)
                expected = grown if math.isfinite(grown) else prev_scale
                assert s == expected, f"step {i}: {interval} clean steps must grow the scale"
                assert g == 0 and h == hysteresis
                clean_run = 0
                overflows_since_growth = 0
            else:
                assert s == prev_scale, f"step {i}: grew after only {clean_run} clean steps"
                assert g == prev_tracker + 1 == clean_run
        prev_scale, prev_tracker = s, g


@HYPOTHESIS
@given(
    init_exp=st.integers(118, 127),
    growth=st.one_of(st.just(2.0), st.floats(1.01, 16.0)),
    interval=st.integers(1, 3),
    hysteresis=st.integers(1, 3),
    with_cap=st.booleans(),
    pattern=st.lists(st.sampled_from([False] * 5 + [True]), min_size=1, max_size=60),
)
def test_rule_growth_never_makes_the_scale_infinite(
    init_exp, growth, interval, hysteresis, with_cap, pattern
):
    init = 2.0**init_exp
    cfg = ScalerConfig(growth, 0.5, interval, hysteresis, None, F32_MAX if with_cap else None)
    for s, _, _ in run_rule(init, cfg, pattern):
        assert math.isfinite(s) and 0 < s <= F32_MAX


def test_rule_at_float32_max_keeps_the_scale_and_resets_the_tracker():
    cfg = ScalerConfig(2.0, 0.5, 1, 2, None, None)
    got = list(run_rule(2.0**127, cfg, [False, False, False], init_hyst=1))
    assert got == [(2.0**127, 0, 2)] * 3
    s, g = t_scale(2.0**127), t_int(0)
    torch._amp_update_scale_(s, g, t_found(False), 2.0, 0.5, 1)
    assert (s.item(), g.item()) == (2.0**127, 0)


def test_rule_docstring_example_and_first_backoff_at_hth_overflow():
    cfg = ScalerConfig(2.0, 0.5, 3, 3, None, None)
    got = [
        s
        for s, _, _ in run_rule(1024.0, cfg, [True, True, True, True, False, False, False, True, True, True])
    ]
    assert got == [1024.0, 1024.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0, 512.0, 256.0]


# ---------------------------------------------------------------- 4. misuse


SCALERS = {
    "torch": lambda: torch.amp.GradScaler("cpu", init_scale=4.0),
    "labkit": lambda: GradScaler("cpu", init_scale=4.0),
}


def _prepared(make):
    scaler, toy = make(), Toy()
    scaler.scale((toy.w**2).sum()).backward()
    return scaler, toy


def _unscale_twice(scaler, opt):
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def _unscale_after_step(scaler, opt):
    scaler.step(opt)
    scaler.unscale_(opt)


def _step_twice(scaler, opt):
    scaler.step(opt)
    scaler.step(opt)


def _closure(scaler, opt):
    scaler.step(opt, closure=lambda: torch.tensor(0.0))


MISUSES = {
    "unscale-twice": (_unscale_twice, "already been called"),
    "unscale-after-step": (_unscale_after_step, "after step"),
    "step-twice": (_step_twice, "already been called"),
    "closure": (_closure, "[Cc]losure"),
}


@pytest.mark.parametrize("impl", list(SCALERS))
@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_runtime_error_like_torch(impl, misuse):
    scaler, toy = _prepared(SCALERS[impl])
    action, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        action(scaler, toy.opt)


def test_after_update_the_next_iteration_is_allowed_again():
    scaler, toy = _prepared(SCALERS["labkit"])
    scaler.unscale_(toy.opt)
    assert scaler.step(toy.opt) is True
    scaler.update()
    toy.opt.zero_grad()
    scaler.scale((toy.w**2).sum()).backward()
    scaler.unscale_(toy.opt)
    assert scaler.step(toy.opt) is True
    scaler.update()


@pytest.mark.parametrize("method", ["unscale_", "step"])
def test_unscale_or_step_before_scale_raises_runtime_error(method):
    scaler, toy = GradScaler("cpu"), Toy()
    (toy.w**2).sum().backward()
    with pytest.raises(RuntimeError, match="scale"):
        getattr(scaler, method)(toy.opt)
    assert torch.equal(toy.w, torch.linspace(-1.0, 1.0, 3)), "nothing may have stepped"


def test_update_before_any_scale_raises_runtime_error():
    with pytest.raises(RuntimeError):
        GradScaler("cpu").update()


def test_update_without_unscale_or_step_raises_runtime_error():
    scaler, toy = _prepared(SCALERS["labkit"])
    with pytest.raises(RuntimeError, match="unscale_|step"):
        scaler.update()
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("impl", list(SCALERS))
def test_fp16_gradients_are_refused_like_torch(impl):
    scaler = SCALERS[impl]()
    w = nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.float().sum()).backward()
    assert w.grad.dtype == torch.float16
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(opt)


# ---------------------------------------------------------------- 5. state_dict


RESUME_PATTERN = [False, True, False, False, False, True, True, True, False, False, False, False, True,
                  False] * 3


@pytest.mark.parametrize("lazy_initialised", [False, True], ids=["fresh", "already-used"])
@pytest.mark.parametrize("split", [5, 7, 20])
def test_state_dict_resumes_the_exact_trajectory(split, lazy_initialised):
    kwargs = dict(init_scale=2.0**10, growth_factor=1.7, backoff_factor=0.3, growth_interval=3,
                  hysteresis=2, min_scale=2.0**4, max_scale=2.0**12)
    reference = GradScaler("cpu", **kwargs)
    ref_scales = drive(reference, RESUME_PATTERN)
    ref_sds = []
    replay = GradScaler("cpu", **kwargs)
    toy = Toy()
    for overflow in RESUME_PATTERN:
        toy.iterate(replay, overflow)
        ref_sds.append(replay.state_dict())

    first = GradScaler("cpu", **kwargs)
    drive(first, RESUME_PATTERN[:split])
    saved = first.state_dict()
    assert saved == ref_sds[split - 1]
    assert {"scale", "_growth_tracker", "_hysteresis_left", "skip_count", "skip_streak",
            "hysteresis"} <= saved.keys()

    resumed = GradScaler(
        "cpu", init_scale=1.0, growth_factor=3.0, backoff_factor=0.9, growth_interval=999, hysteresis=1
    )
    if lazy_initialised:
        Toy().iterate(resumed, True)  # state tensors exist now and must be overwritten
    resumed.load_state_dict(saved)
    assert resumed.get_scale() == saved["scale"]
    assert resumed.state_dict() == saved
    assert (resumed.get_growth_factor(), resumed.get_backoff_factor(),
            resumed.get_growth_interval()) == (1.7, 0.3, 3)
    toy = Toy()
    for i, overflow in enumerate(RESUME_PATTERN[split:], start=split):
        toy.iterate(resumed, overflow)
        assert resumed.get_scale() == ref_scales[i], f"iteration {i}"
        assert resumed.state_dict() == ref_sds[i], f"iteration {i}"
    assert (resumed.skip_count, resumed.skip_streak) == (reference.skip_count, reference.skip_streak)
    assert resumed.skip_count == sum(RESUME_PATTERN)


PARITY_PATTERN = [False, False, True, False, False, False, True, True, False, False, False, False] * 2


def test_torch_state_dict_loads_into_labkit_and_continues_identically():
    kwargs = dict(init_scale=2.0**12, growth_factor=1.7, backoff_factor=0.3, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    drive(theirs, PARITY_PATTERN[:10])
    ours = GradScaler("cpu", init_scale=1.0, growth_interval=999, growth_factor=5.0)
    ours.load_state_dict(theirs.state_dict())
    sd = ours.state_dict()
    assert {k: sd[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert drive(ours, PARITY_PATTERN[10:]) == drive(theirs, PARITY_PATTERN[10:])
    assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]


def test_labkit_state_dict_loads_into_torch_and_continues_identically():
    kwargs = dict(init_scale=2.0**12, growth_factor=1.7, backoff_factor=0.3, growth_interval=3)
    ours = GradScaler("cpu", **kwargs)
    drive(ours, PARITY_PATTERN[:10])
    theirs = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=999, growth_factor=5.0)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == ours.get_scale()
    assert drive(theirs, PARITY_PATTERN[10:]) == drive(ours, PARITY_PATTERN[10:])
    assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]


def test_loading_an_empty_state_dict_raises_runtime_error():
    with pytest.raises(RuntimeError, match="empty"):
        GradScaler("cpu").load_state_dict({})


@pytest.mark.parametrize("used", [True, False], ids=["used", "fresh"])
@pytest.mark.parametrize("missing", ["scale", "growth_factor", "backoff_factor", "growth_interval",
                                     "_growth_tracker"])
def test_loading_a_state_dict_missing_keys_raises_key_error_and_changes_nothing(missing, used):
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=2)
    expected = [2.0**10, 2.0**10, 2.0**11]
    if used:
        drive(scaler, [False, True, False])
        expected = [2.0**10, 2.0**11, 2.0**11]
    before = scaler.state_dict()
    donor = GradScaler("cpu", init_scale=8.0, growth_factor=3.0, growth_interval=7, hysteresis=3)
    drive(donor, [True, True, True, False])
    sd = donor.state_dict()
    del sd[missing]
    with pytest.raises(KeyError, match=missing):
        scaler.load_state_dict(sd)
    assert scaler.state_dict() == before
    assert scaler.get_growth_interval() == 3 and scaler.get_growth_factor() == 2.0
    assert drive(scaler, [False, False, False]) == expected


# ---------------------------------------------------------------- 6. bounds


def test_min_scale_is_a_floor_where_torch_collapses():
    ours = GradScaler("cpu", init_scale=2.0**16, growth_interval=1000, min_scale=2.0**-4)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000)
    ours_scales, their_scales = drive(ours, [True] * 100), drive(theirs, [True] * 100)
    assert min(ours_scales) >= 2.0**-4
    assert ours_scales[:20] == their_scales[:20]  # identical until the floor is hit
    assert ours_scales[-1] == 2.0**-4
    assert their_scales[-1] == 2.0**-84 < 2.0**-4  # torch has no floor: the scale goes to tiny
    assert ours.skip_count == 100 and ours.skip_streak == 100


def test_max_scale_caps_growth():
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=1, max_scale=3000.0)
    scales = drive(ours, [False] * 10)
    assert scales == [2048.0, 3000.0] + [3000.0] * 8
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, max_scale=2.0**13)
    assert drive(ours, [False] * 10) == [1024.0, 2048.0, 2048.0, 4096.0, 4096.0, 8192.0] + [8192.0] * 4


@pytest.mark.parametrize("kwargs", [dict(), dict(max_scale=F32_MAX), dict(hysteresis=2)],
                         ids=["plain", "cap", "hyst"])
def test_growth_near_float32_max_stays_finite(kwargs):
    ours = GradScaler("cpu", init_scale=2.0**126, growth_interval=1, **kwargs)
    scales = drive(ours, [False] * 5)
    assert scales == [2.0**127] * 5
    if not kwargs:
        assert (
            drive(torch.amp.GradScaler("cpu", init_scale=2.0**126, growth_interval=1), [False] * 5) == scales
        )


@pytest.mark.parametrize(
    "kwargs, pattern, check",
    [
        (dict(init_scale=1.0, min_scale=0.7), [True] * 5, lambda s: s >= 0.7),
        (dict(init_scale=0.05, max_scale=0.1, growth_interval=1), [False] * 5, lambda s: s <= 0.1),
    ],
    ids=["min-0.7", "max-0.1"],
)
def test_bounds_that_float32_cannot_represent_still_hold(kwargs, pattern, check):
    """A bound is a promise about get_scale(); it must hold even when float32 rounds the bound."""
    scaler = GradScaler("cpu", **{"growth_interval": 1000, **kwargs})
    for s in drive(scaler, pattern):
        assert check(s), f"scale {s!r} violates {kwargs}"


# ---------------------------------------------------------------- 7. disabled


def test_disabled_scaler_is_a_pass_through():
    scaler = GradScaler("cpu", enabled=False)
    ref = torch.amp.GradScaler("cpu", enabled=False)
    assert not scaler.is_enabled()
    model = make_model(4)
    plain = copy.deepcopy(model)
    opt, plain_opt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](plain.parameters())
    for batch in make_batches(4, 3):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        assert scaler.scale(loss) is loss
        pair = [loss, loss * 2]
        assert scaler.scale(pair) is pair
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        scaler.unscale_(opt)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        assert scaler.step(opt) is True
        scaler.update()
        opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert_same_params(model, plain)
        assert scaler.get_scale() == ref.get_scale() == 1.0
    assert scaler.state_dict() == ref.state_dict() == {}
    scaler.load_state_dict({})  # a no-op, as in torch
    scaler.load_state_dict({"scale": 4.0})
    assert scaler.get_scale() == 1.0
    assert (scaler.skip_count, scaler.skip_streak) == (0, 0)


def test_disabled_scaler_steps_even_on_inf_gradients():
    scaler, toy = GradScaler("cpu", enabled=False), Toy()
    assert toy.iterate(scaler, True) is True
    assert math.isinf(toy.w[0].item())
    assert scaler.skip_count == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("impl", [torch.amp.GradScaler, GradScaler], ids=["torch", "labkit"])
def test_cuda_without_cuda_warns_and_disables(impl):
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = impl(device="cuda")
    assert not scaler.is_enabled()
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss


# ---------------------------------------------------------------- constructor validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(growth_factor=1.0), r"growth_factor.*> 1"),
        (dict(growth_factor=0.5), r"growth_factor.*> 1"),
        (dict(growth_factor=NAN), r"growth_factor.*> 1"),
        (dict(backoff_factor=0.0), r"backoff_factor.*\(0, 1\)"),
        (dict(backoff_factor=1.0), r"backoff_factor.*\(0, 1\)"),
        (dict(backoff_factor=1.5), r"backoff_factor.*\(0, 1\)"),
        (dict(backoff_factor=-0.5), r"backoff_factor.*\(0, 1\)"),
        (dict(growth_interval=0), r"growth_interval.*int >= 1"),
        (dict(growth_interval=-3), r"growth_interval.*int >= 1"),
        (dict(growth_interval=2.0), r"growth_interval.*int >= 1"),
        (dict(growth_interval=2.5), r"growth_interval.*int >= 1"),
        (dict(hysteresis=0), r"hysteresis.*int >= 1"),
        (dict(hysteresis=1.5), r"hysteresis.*int >= 1"),
        (dict(init_scale=0.0), r"init_scale.*> 0"),
        (dict(init_scale=-1.0), r"init_scale.*> 0"),
        (dict(init_scale=INF), r"init_scale.*finite"),
        (dict(init_scale=NAN), r"init_scale.*> 0"),
        (dict(init_scale=1.0, min_scale=2.0), r"init_scale.*\[min_scale, max_scale\]"),
        (dict(init_scale=4.0, max_scale=2.0), r"init_scale.*\[min_scale, max_scale\]"),
        (dict(init_scale=3.0, min_scale=4.0, max_scale=2.0), r"min_scale.*must not exceed max_scale"),
        (dict(min_scale=0.0), r"min_scale.*> 0"),
        (dict(init_scale=1.0, min_scale=1e-50), r"min_scale.*float32's normal range"),
        (dict(max_scale=1e39), r"max_scale.*float32's normal range"),
        (dict(max_scale=-1.0), r"max_scale.*> 0"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_bad_constructor_arguments_raise_value_error_saying_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradScaler("cpu", **kwargs)


def test_good_constructor_arguments_are_accepted():
    scaler = GradScaler("cpu", init_scale=8.0, growth_factor=1.0001, backoff_factor=0.999, growth_interval=1,
                        hysteresis=4, min_scale=8.0, max_scale=8.0)
    assert scaler.get_scale() == 8.0
    assert scaler.state_dict()["hysteresis"] == 4


# ---------------------------------------------------------------- 8. several optimizers


@pytest.mark.parametrize("inf_in", [(), ("a",), ("b",), ("a", "b")], ids=["none", "a", "b", "both"])
def test_two_optimizers_skip_independently_and_back_off_once(inf_in):
    torch.manual_seed(5)
    a0, b0 = torch.randn(4), torch.randn(3)
    results = {}
    for impl in ("torch", "labkit"):
        scaler = (torch.amp.GradScaler if impl == "torch" else GradScaler)(
            "cpu", init_scale=2.0**10, growth_interval=1
        )
        a, b = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())
        opt_a, opt_b = torch.optim.SGD([a], lr=0.1, momentum=0.9), torch.optim.AdamW([b], lr=0.1)
        scaler.scale((a**2).sum() + (b**3).sum()).backward()
        if "a" in inf_in:
            a.grad[1] = INF
        if "b" in inf_in:
            b.grad[0] = NAN
        scaler.unscale_(opt_a)
        stepped = (scaler.step(opt_a), scaler.step(opt_b))
        scaler.update()
        results[impl] = (stepped, a.detach().clone(), b.detach().clone(), scaler.get_scale())
    (_, ta, tb, tscale), ((sa, sb), la, lb, lscale) = results["torch"], results["labkit"]
    assert (sa, sb) == ("a" not in inf_in, "b" not in inf_in)
    assert torch.equal(la, ta) and torch.equal(lb, tb)
    assert torch.equal(la, a0) == ("a" in inf_in) and torch.equal(lb, b0) == ("b" in inf_in)
    assert lscale == tscale == (2.0**9 if inf_in else 2.0**11)


# ---------------------------------------------------------------- 9. scale() outputs


@pytest.mark.parametrize("container", [list, tuple], ids=["list", "tuple"])
def test_scale_keeps_the_container_type(container):
    ours, theirs = GradScaler("cpu", init_scale=3.0), torch.amp.GradScaler("cpu", init_scale=3.0)
    values = container(
        [torch.tensor(1.5), torch.tensor([2.0, -1.0]), torch.tensor(0.25, dtype=torch.float16)]
    )
    got, want = ours.scale(values), theirs.scale(values)
    assert type(got) is container
    assert len(got) == len(values)
    for g, w, v in zip(got, want, values):
        assert g.dtype == w.dtype
        assert torch.equal(g, w) and torch.equal(g, v * torch.tensor(3.0))


def test_scale_of_a_nested_container_and_of_an_iterator():
    ours, theirs = GradScaler("cpu", init_scale=2.0), torch.amp.GradScaler("cpu", init_scale=2.0)
    nested = [torch.tensor(1.0), (torch.tensor(2.0), torch.tensor(3.0))]
    got = ours.scale(nested)
    assert type(got) is list and type(got[1]) is tuple
    assert [got[0].item(), got[1][0].item(), got[1][1].item()] == [2.0, 4.0, 6.0]
    it = [t.item() for t in ours.scale(iter([torch.tensor(1.0), torch.tensor(5.0)]))]
    assert it == [t.item() for t in theirs.scale(iter([torch.tensor(1.0), torch.tensor(5.0)]))] == [2.0, 10.0]


@pytest.mark.parametrize("shape", [(), (3,)], ids=["0-dim", "1-dim"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_scaled_loss_dtype_and_value_match_torch(dtype, shape):
    """torch multiplies by a 0-dim fp32 scale: a 0-dim fp16 loss becomes float32, a 1-dim one stays fp16."""
    ours, theirs = GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loss = torch.full(shape, 0.3, dtype=dtype)
    got, want = ours.scale(loss), theirs.scale(loss)
    assert got.dtype == want.dtype
    assert got.dtype == (dtype if shape or dtype == torch.float64 else torch.float32)
    assert torch.equal(got, want)


def test_fp16_outputs_scaled_past_65504_overflow_and_the_step_is_skipped():
    """fp16 outputs times 2**16 are inf; the gradients overflow and step skips, exactly as in torch."""
    for impl in (torch.amp.GradScaler, GradScaler):
        scaler = impl("cpu", init_scale=2.0**16)
        w = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        scaled = scaler.scale(w.half() * 4)
        assert scaled.dtype == torch.float16 and torch.isinf(scaled).all()
        scaled.sum().backward()
        assert not torch.isfinite(w.grad).any()
        result = scaler.step(opt)
        scaler.update()
        assert torch.equal(w, torch.ones(2))
        assert scaler.get_scale() == 2.0**15
        if impl is GradScaler:
            assert result is False and scaler.skip_count == 1


def test_public_names_are_exported():
    # a grading check run earlier in this process (labkit/grading's doctests, in the same pytest worker)
    # leaves its ban wrapper on labkit.update_scale: the function under it is the one exported
    assert labkit.GradScaler is GradScaler and inspect.unwrap(labkit.update_scale) is update_scale
    assert labkit.ScalerConfig is ScalerConfig


# ---------------------------------------------------------------- states torch writes, resets, rule edges


def test_a_growth_tracker_past_a_lowered_interval_loads_from_torch_and_from_labkit():
    """torch keeps its tracker when set_growth_interval lowers the interval, and saves it (6 >= 3 here); its
    kernel then never grows again until an overflow, the rule grows at the next clean step (>=)."""
    theirs, mine = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10), \
        GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    for scaler in (theirs, mine):
        drive(scaler, [False] * 6)
        scaler.set_growth_interval(3)
    assert theirs.state_dict()["_growth_tracker"] == mine.state_dict()["_growth_tracker"] == 6
    pattern, scales = [False, True, False, False, False], [2.0**11, 2.0**10, 2.0**10, 2.0**10, 2.0**11]
    for state in (theirs.state_dict(), mine.state_dict()):
        resumed = GradScaler("cpu")
        resumed.load_state_dict(state)
        assert resumed.state_dict()["_growth_tracker"] == 2 and resumed.get_scale() == 2.0**10
        assert drive(resumed, pattern) == scales
    assert drive(mine, pattern) == scales  # the run that was never saved: the same scales
    assert drive(theirs, [False]) == [2.0**10]  # torch's own: no growth at 7 >= 3 (its kernel asks ==)


@pytest.mark.parametrize(
    "bad", [-1.0, 0.0, -0.0, INF, -INF, NAN, 1e39, torch.tensor(-2.0), torch.tensor(INF)],
    ids=["-1", "0", "-0", "inf", "-inf", "nan", "1e39 (inf in float32)", "tensor -2", "tensor inf"])
def test_update_refuses_a_new_scale_that_is_not_positive_and_finite_where_torch_takes_it(bad):
    theirs, ours = torch.amp.GradScaler("cpu", init_scale=8.0), GradScaler("cpu", init_scale=8.0)
    for scaler in (theirs, ours):
        Toy().iterate(scaler, False)
    if not (isinstance(bad, float) and bad == 1e39):  # torch refuses that one itself (a RuntimeError)
        theirs.update(new_scale=bad)  # torch: the scale is now the bad value
        assert not theirs.get_scale() > 0 or math.isinf(theirs.get_scale())
    with pytest.raises(labkit.ScalerValueError, match="new_scale must be a number > 0 that is finite"):
        ours.update(new_scale=bad)
    assert ours.get_scale() == 8.0 and ours.state_dict() == GradScaler("cpu", init_scale=8.0).state_dict() | {
        "_growth_tracker": 1}  # unchanged by the refused call
    ours.update(new_scale=2.0**-140)  # positive, but below float32's normal range: taken (TrainStep names it)
    assert ours.get_scale() == 2.0**-140


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_a_scale_starting_at_float32s_smallest_normal_follows_the_rule_through_overflows(hysteresis):
    """1.18e-38, the floor itself: backed off it stays there; tracker and hysteresis follow the rule."""
    tiny = torch.finfo(torch.float32).tiny
    scaler = GradScaler("cpu", init_scale=tiny, growth_interval=2, hysteresis=hysteresis)
    cfg, state = scaler.config, (tiny, 0, hysteresis)
    toy = Toy()
    for overflow in [True, True, False, True, False, False, False, True, True, True, False, False]:
        toy.iterate(scaler, overflow)
        state = reference_rule(*state, overflow, cfg)
        got = scaler.state_dict()
        assert (got["scale"], got["_growth_tracker"], got["_hysteresis_left"]) == state


@pytest.mark.parametrize(
    "found", [torch.tensor([1.0]), torch.tensor(1.0, dtype=torch.float64), torch.tensor(True),
              torch.tensor([1], dtype=torch.int32), torch.tensor([[0.0]]),
              torch.tensor(0.0, dtype=torch.float16)],
    ids=["1-d", "float64", "bool", "int32 1-d", "2-d zero", "fp16 zero"])
@pytest.mark.parametrize("hysteresis", [1, 2], ids=["torch's kernel", "the rule"])
def test_inf_check_takes_any_one_element_found_inf_then_update_moves_the_scale_as_usual(found, hysteresis):
    reference = GradScaler("cpu", init_scale=2.0**10, growth_interval=1, hysteresis=hysteresis)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=1, hysteresis=hysteresis)
    for s, f in ((scaler, found), (reference, t_found(bool(found.reshape(()))))):
        toy = Toy()
        s.scale((toy.w ** 2).sum()).backward()
        s.inf_check_(toy.opt, f, unscaled=False)
        s.update()
    assert scaler.state_dict() == reference.state_dict()
    assert scaler.get_scale_async().shape == () and scaler.get_scale_async().dtype == torch.float32


def test_will_skip_answers_a_bool():
    scaler = GradScaler("cpu")
    for overflow in (False, True):
        toy = Toy()
        scaler.scale((toy.w ** 2).sum()).backward()
        if overflow:
            toy.w.grad[0] = INF
        scaler.unscale_(toy.opt)
        assert scaler.will_skip(toy.opt) is overflow
        scaler.step(toy.opt)
        scaler.update()
    disabled = GradScaler("cpu", enabled=False)
    assert disabled.will_skip(Toy().opt) is False
