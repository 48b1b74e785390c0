"""The clippers: each rule against a hand-written reference, NaN safety, exact resume, no sync, lock-in."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit
from labkit import ToyTask, TrainStep
from labkit.alarms import ClipAlarm
from labkit.clippers import AGC, AdaGC, AutoClip, LockInWarning, NormClip, UpdateNormClip, ValueClip, ZClip
from labkit.faults import Faults

FAST = settings(max_examples=10, deadline=None)
norms_st = st.lists(st.floats(0.05, 20.0), min_size=1, max_size=40)


def one(g: float) -> torch.Tensor:
    w = torch.zeros(1, requires_grad=True)
    w.grad = torch.tensor([g], dtype=torch.float32)
    return w


def applied(clipper, series):
    """Feed a 1-element gradient per step; return the norms the optimizer would have stepped with."""
    out = []
    for g in series:
        w = one(g)
        clipper.clip_([w])
        out.append(w.grad.item())
    return out


# ---------------------------------------------------------------- references (float64, from the sources)


def zclip_reference(series, feed, alpha=0.97, zt=2.5, warm=25, eps=1e-6):
    """research/exp/ema_feed_policy.py's transcription of zclip.py, with warm-up and the three feeds."""
    mean = var = None
    buf, out = [], []
    for g in series:
        if mean is None:
            buf.append(g)
            out.append(g)
            if len(buf) >= warm:
                mean, var = float(np.mean(buf)), float(np.var(buf))
            continue
        std = math.sqrt(var)
        z = (g - mean) / (std + eps)
        limit = mean + zt * zt / z * std if z > zt else math.inf
        eff = min(g, limit)
        out.append(g * min(1.0, limit / (g + 1e-6)))
        if feed == "exclude" and g > limit:
            continue
        x = eff if feed == "clipped" else g
        mean = alpha * mean + (1 - alpha) * x
        var = alpha * var + (1 - alpha) * (x - mean) ** 2
    return out


def autoclip_reference(series, q, history):
    past, out = [], []
    for g in series:
        limit = float(np.percentile(past[-history:], 100 * q)) if past else math.inf
        out.append(g * min(1.0, limit / (g + 1e-6)))
        past.append(g)
    return out


def update_reference(series, window, k):
    past, out = [], []
    for u in series:
        last = past[-window:]
        limit = float(np.mean(last) + k * np.std(last)) if len(last) >= window // 2 else math.inf
        out.append(u * min(1.0, limit / (u + 1e-6)))
        past.append(u)
    return out


@FAST
@given(norms_st, st.sampled_from(["clipped", "raw", "exclude"]), st.integers(1, 6), st.floats(0.5, 3.0))
def test_zclip_rule_matches_the_reference(series, feed, warmup, zt):
    got = applied(ZClip(warmup=warmup, z_thresh=zt, feed=feed, max_consecutive_clips=None), series)
    np.testing.assert_allclose(got, zclip_reference(series, feed, zt=zt, warm=warmup), rtol=2e-4)


@FAST
@given(norms_st, st.floats(0.0, 1.0), st.integers(1, 12))
def test_autoclip_rule_matches_numpy_percentile(series, q, history):
    got = applied(AutoClip(quantile=q, history=history, max_consecutive_clips=None), series)
    np.testing.assert_allclose(got, autoclip_reference(series, q, history), rtol=1e-5)


@FAST
@given(norms_st, st.integers(2, 8), st.floats(0.5, 4.0))
def test_update_norm_rule_matches_the_reference(series, window, k):
    clip, w, got = (UpdateNormClip(window=window, k=k, max_consecutive_clips=None),
                    torch.nn.Parameter(torch.zeros(1)), [])
    for u in series:
        clip.begin_([w])
        before = w.item()
        with torch.no_grad():
            w += u
        clip.clip_([w])
        got.append(w.item() - before)
    np.testing.assert_allclose(got, update_reference(series, window, k), rtol=1e-4, atol=1e-5)


def agc_reference(w: np.ndarray, g: np.ndarray, clipping: float, eps: float) -> np.ndarray:
    """timm/utils/agc.py, unit by unit, in float64 loops."""
    units = [(slice(None),)] if w.ndim <= 1 else [(i,) for i in range(w.shape[0])]
    out = g.astype(np.float64).copy()
    for u in units:
        bound = max(np.linalg.norm(w[u]), eps) * clipping
        gn = np.linalg.norm(g[u])
        if not gn < bound:
            out[u] = g[u] * (bound / max(gn, 1e-6))
    return out


@FAST
@given(st.integers(0, 10_000), st.floats(0.001, 0.5))
def test_agc_matches_timm_reference(seed, clipping):
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(4, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(5, generator=gen)),
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 0.1
    expected = [agc_reference(p.detach().numpy(), p.grad.numpy(), clipping, 1e-3) for p in params]
    AGC(clipping=clipping).clip_(params)
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.grad.numpy(), e, rtol=1e-5, atol=1e-7)


def adagc_reference(steps, beta, lambda_rel, lambda_abs, warmup, eps):
    """pytorch_optimizer's AdaGC clipping (optimizer/adagc.py), per tensor, in float64.

    ``steps``: a list of norm lists."""
    gamma, out = None, []
    for t, norms in enumerate(steps):
        total = math.sqrt(sum(n * n for n in norms))
        if t < warmup:
            h = [min(lambda_abs / (total + eps), 1.0)] * len(norms)
            cut = [hi * n for hi, n in zip(h, norms)]
            gamma = cut if t == 0 else [min(a, b) for a, b in zip(gamma, cut)]
        else:
            h = [min(lambda_rel * gm / n, 1.0) if n > 0 else 1.0 for gm, n in zip(gamma, norms)]
            gamma = [beta * gm + (1 - beta) * hi * n for gm, hi, n in zip(gamma, h, norms)]
        out.append(h)
    return out


@FAST
@given(st.lists(st.tuples(st.floats(0.05, 5.0), st.floats(0.05, 5.0)), min_size=1, max_size=25),
       st.integers(1, 5))
def test_adagc_rule_matches_the_reference(steps, warmup):
    clip = AdaGC(warmup=warmup, max_consecutive_clips=None)
    got = []
    for a, b in steps:
        params = [one(a), one(b)]
        clip.clip_(params)
        got.append([p.grad.item() / n for p, n in zip(params, (a, b))])
    expected = adagc_reference([list(s) for s in steps], 0.98, 1.05, 1.0, warmup, 1e-8)
    np.testing.assert_allclose(got, expected, rtol=2e-4)


# ---------------------------------------------------------------- clip_grad_value_: torch is the oracle


@FAST
@given(st.integers(0, 10_000), st.floats(0.01, 3.0), st.booleans())
def test_clip_grad_value_matches_torch(seed, value, poison):
    gen = torch.Generator().manual_seed(seed)
    ours = [
        torch.nn.Parameter(torch.randn(3, 4, generator=gen)),
        torch.nn.Parameter(torch.randn(7, generator=gen)),
    ]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=gen) * 3
        if poison:
            a.grad[0] = math.nan
            a.grad[-1] = -math.inf
        b.grad = a.grad.clone()
    assert labkit.clip_grad_value_(ours, value) is torch.nn.utils.clip_grad_value_(theirs, value) is None
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad.nan_to_num(7.0), b.grad.nan_to_num(7.0))


def test_clip_grad_value_refuses_a_bad_value():
    with pytest.raises(ValueError, match="clip_value must be a number > 0"):
        labkit.clip_grad_value_([one(1.0)], 0.0)


def test_value_clip_leaves_a_nan_step_untouched_and_returns_the_norm():
    w = torch.zeros(2, requires_grad=True)
    w.grad = torch.tensor([math.nan, 5.0])
    assert math.isnan(ValueClip(1.0).clip_([w]).item())
    assert w.grad[1].item() == 5.0  # clamping would have made it 1


# ---------------------------------------------------------------- NaN safety, resume, sync


STATEFUL = {
    "zclip": lambda: ZClip(warmup=3),
    "zclip_raw": lambda: ZClip(warmup=3, feed="raw"),
    "autoclip": lambda: AutoClip(history=5),
    "adagc": lambda: AdaGC(warmup=2),
    "update": lambda: UpdateNormClip(window=4),
}


def run_steps(clip, series, grads_out=None):
    w = torch.nn.Parameter(torch.zeros(2))
    for g in series:
        if isinstance(clip, UpdateNormClip):
            clip.begin_([w])
            with torch.no_grad():
                w += torch.tensor([g, g / 2])
            clip.clip_([w])
            if grads_out is not None:
                grads_out.append(w.detach().clone())
        else:
            w.grad = torch.tensor([g, g / 2])
            clip.clip_([w])
            if grads_out is not None:
                grads_out.append(w.grad.clone())
    return w


def state_bits(clip):
    return {k: v.clone() for k, v in clip.state_dict().items()}


def same_bits(a, b):
    """Bit for bit: a NaN equals a NaN with its bits, 0.0 and -0.0 differ, every finite value is exact."""
    if a.dtype.is_floating_point:
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(width), b.view(width) if b.dtype == a.dtype else b
    return a.dtype == b.dtype and torch.equal(a, b)


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert same_bits(a[k], b[k]), k


@pytest.mark.parametrize("before", [[], [1.0, 2.0, 1.5, 0.7, 2.5, 1.1, 3.0, 0.9]], ids=["warm-up", "warm"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_a_nonfinite_step_leaves_gradients_updates_and_statistics_exactly_as_they_were(name, bad, before):
    """One entry non-finite, one finite: a clipper that multiplied them (x0 or xNaN) would change the finite
    one; the bits are compared, NaN with NaN. UpdateNormClip must leave what the optimizer wrote."""
    clip = STATEFUL[name]()
    w = run_steps(clip, before)
    if name == "adagc" and not before:
        w = run_steps(clip, [1.0])  # AdaGC sizes its state on the first step
    saved = state_bits(clip)
    if isinstance(clip, UpdateNormClip):
        clip.begin_([w])
        with torch.no_grad():
            w += torch.tensor([bad, 0.25])  # the optimizer's update
        written = w.detach().clone()
        clip.clip_([w])
        after = w.detach()
    else:
        w.grad = torch.tensor([bad, 0.25])
        written = w.grad.clone()
        clip.clip_([w])
        after = w.grad
    assert same_bits(after, written), (written, after)
    assert_state_equal(saved, state_bits(clip))


def test_a_nan_does_not_turn_zclip_off():
    # ZClip 1.0.0: after one NaN its mean is NaN and a later 100x spike passes (research note §1.3a)
    clip = ZClip(warmup=5)
    out = applied(clip, [1.0 + 0.05 * math.sin(i) for i in range(30)] + [math.nan, 100.0])
    assert out[-1] < 1.2


@pytest.mark.parametrize("name", sorted(STATEFUL))
@pytest.mark.parametrize("split", [2, 9])  # mid-warm-up, mid-run
def test_resume_from_state_dict_is_bitwise(name, split):
    series = [1.0 + 0.1 * math.sin(i) for i in range(14)]
    series[11] = 9.0  # a spike after the split: clipping differs if any state was lost
    whole, grads_whole = STATEFUL[name](), []
    run_steps(whole, series, grads_whole)
    first, grads = STATEFUL[name](), []
    run_steps(first, series[:split], grads)
    second = STATEFUL[name]()
    second.load_state_dict(first.state_dict())
    if isinstance(second, UpdateNormClip):
        rest = []
        w = torch.nn.Parameter(grads[-1].clone())
        for g in series[split:]:
            second.begin_([w])
            with torch.no_grad():
                w += torch.tensor([g, g / 2])
            second.clip_([w])
            rest.append(w.detach().clone())
        grads += rest
    else:
        run_steps(second, series[split:], grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_whole))
    assert_state_equal(state_bits(second), state_bits(whole))


def test_load_state_dict_refuses_another_clippers_state():
    with pytest.raises(KeyError, match="lacks"):
        ZClip().load_state_dict({"mean": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="shape"):
        ZClip(warmup=3).load_state_dict(ZClip(warmup=4).state_dict())


@pytest.mark.parametrize("make", [lambda: NormClip(1.0), lambda: ZClip(warmup=2), lambda: AutoClip(history=4),
                                  lambda: AdaGC(warmup=1), lambda: AGC(), lambda: ValueClip(1.0)])
def test_no_host_sync_per_step(make, monkeypatch):
    clip = make()
    params = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))]

    def step(g):
        for p in params:
            p.grad = torch.full_like(p, g)
        return clip.clip_(params)

    for g in (1.0, 1.1, 0.9):
        step(g)  # warm-up, lazy allocation

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync in clip_")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for g in (1.0, 50.0, math.nan, 1.0):
        step(g)


# ---------------------------------------------------------------- feed policy and the lock-in guard


def series(kind, T=400):
    rng = np.random.default_rng(0)
    base = 1.0 + 0.05 * rng.standard_normal(T)
    if kind == "spikes":
        base[80::80] *= 20
    else:
        base[200:] *= 2.0
    return base.tolist()


def test_feed_policy_decides_how_a_level_shift_fails():
    shift = series("shift")
    late = {feed: np.mean(applied(ZClip(feed=feed, max_consecutive_clips=None), shift)[340:])
            for feed in ("clipped", "raw", "exclude")}
    assert late["clipped"] < 1.1 and late["exclude"] < 1.1  # locked in: a permanent cut to the old level
    assert late["raw"] > 1.9  # adapts to the new level


@pytest.mark.parametrize("make", [lambda **k: ZClip(**k), lambda **k: AutoClip(feed="clipped", **k)])
def test_lockin_guard_fires_on_a_level_shift_and_not_on_isolated_spikes(make):
    spiky = make(max_consecutive_clips=50)
    out = applied(spiky, series("spikes"))
    assert spiky.releases() == 0 and max(out[120:]) < 1.5  # the spikes were clipped, no release
    shifted = make(max_consecutive_clips=50)
    assert spiky.check_lockin() is False  # a bool, not merely something falsy
    with pytest.warns(LockInWarning, match="restarted its statistics"):
        out = applied(shifted, series("shift"))
        assert shifted.check_lockin() is True
    assert shifted.releases() >= 1 and shifted.check_lockin() is False  # said once
    assert np.mean(out[340:]) > 1.9  # released: the new level passes


@pytest.mark.parametrize("q", [0.0, 1.0], ids=["min", "max"])
def test_autoclip_takes_both_ends_of_the_quantile_range(q):
    """quantile=1.0 clips at the largest past norm, 0.0 at the smallest: both valid settings."""
    series = [1.0, 3.0, 2.0, 10.0, 0.5]
    got = applied(AutoClip(quantile=q, max_consecutive_clips=None), series)
    np.testing.assert_allclose(got, autoclip_reference(series, q, 1000), rtol=1e-6)
    assert got[3] == pytest.approx(3.0 if q == 1.0 else 1.0, rel=1e-5)  # 10: cut to max or min of 1, 3, 2


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([torch.float32, torch.float64]), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_normclip_clips_as_torchs_clip_grad_norm_bit_for_bit_in_the_gradients_dtype(dtype, max_norm, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen, dtype=dtype) * 10 for n in (7, 33, 2)]
    ours, theirs = ([torch.zeros(g.shape, dtype=dtype, requires_grad=True) for g in grads] for _ in range(2))
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    norm = NormClip(max_norm).clip_(ours)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm.dtype == dtype and torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))


def test_trainstep_takes_a_clipper_and_a_float_still_means_normclip():
    task = ToyTask()
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert isinstance(TrainStep(model, opt, task.loss_fn, max_norm=0.5).clipper, NormClip)
    with pytest.raises(ValueError, match="either max_norm"):
        TrainStep(model, opt, task.loss_fn, max_norm=0.5, clipper=ZClip())
    step = TrainStep(model, opt, task.loss_fn, clipper=ZClip(warmup=3), hooks=[Faults({6: "spike"})])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = [step(*task.batch(i)) for i in range(8)]
    assert all(math.isinf(r.threshold) for r in records[:3]) and math.isfinite(records[3].threshold)
    assert records[6].clipped and records[6].clip_reason == "ZClip"
    # adaptive scaling cuts below it
    assert records[6].grad_norm * records[6].clip_coef < records[6].threshold
    assert not any(r.clipped for r in records[:3])
    state = step.state_dict()
    assert set(state["clipper"]) >= {"mean", "var", "buffer", "count"}


def test_trainstep_update_norm_and_per_tensor_clippers_run_the_same_order():
    task = ToyTask()
    for clipper in (UpdateNormClip(window=4), AGC(clipping=0.001), AdaGC(warmup=2)):
        model = task.model()
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, clipper=clipper,
                         hooks=[ClipAlarm(None), Faults({7: "spike"})])
        records = [step(*task.batch(i)) for i in range(9)]
        assert not any(r.skipped for r in records), clipper
        assert records[7].clipped and records[7].clip_reason == type(clipper).__name__, clipper
