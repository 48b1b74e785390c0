"""The adaptive clippers against their published rules and defaults (issue 37: the mutants that survived).

Each rule is checked against a transcription of its source, in plain Python floats: AdaGC's
per-tensor EMA (arXiv 2502.11034, ``pytorch_optimizer.AdaGC``), ZClip's z-score limit (arXiv
2504.02507, ``bluorion-com/ZClip``), AGC's unit-wise clip (NFNets; ``timm/utils/agc.py``),
AutoClip's percentile (Seetharaman et al. 2020) and Levanter's update-norm clip. A clipper built
with its defaults must behave step for step as one given the published defaults explicitly, and
every setting out of its range must be refused with a message naming the setting, while the
boundary values inside it are accepted.
"""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.clippers import AGC, AdaGC, AutoClip, LockInWarning, UpdateNormClip, ZClip
from labkit.clippers.adagc import adagc_update
from labkit.clippers.agc import agc_
from labkit.clippers.zclip import zclip_limit

FAST = settings(max_examples=60, deadline=None, database=None)


def _norms(seed: int, n: int, low: float = 1.0, high: float = 2.0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64)).tolist()


def _global_coefs(clip, norms: list[float]) -> list[tuple[float, float]]:
    """Feed a global-norm clipper one norm per step through ``coef_``; return each (coef, threshold)."""
    out = []
    for x in norms:
        norm = torch.tensor(x, dtype=torch.float32)
        coef, threshold = clip.coef_(norm.reshape(1), norm)
        out.append((coef.item(), threshold.item()))
    return out


# ------------------------------------------------------------------------------ settings refused / accepted

BAD = [
    (AdaGC, {"beta": 0}, "beta"), (AdaGC, {"beta": 1}, "beta"), (AdaGC, {"beta": 1.5}, "beta"),
    (AdaGC, {"lambda_rel": 0}, "lambda_rel"), (AdaGC, {"lambda_rel": -1}, "lambda_rel"),
    (AdaGC, {"lambda_abs": 0}, "lambda_abs"), (AdaGC, {"lambda_abs": -1}, "lambda_abs"),
    (AdaGC, {"warmup": 0}, "warmup"), (AdaGC, {"feed": "clip"}, "feed"),
    (AutoClip, {"quantile": -0.01}, "quantile"), (AutoClip, {"quantile": 1.01}, "quantile"),
    (AutoClip, {"history": 0}, "history"), (AutoClip, {"min_history": 0}, "min_history"),
    (AutoClip, {"history": 2, "min_history": 3}, "min_history"),
    (UpdateNormClip, {"window": 1}, "window"), (UpdateNormClip, {"k": 0}, "k"),
    (UpdateNormClip, {"k": -1}, "k"),
    (AGC, {"clipping": 0}, "clipping"), (AGC, {"clipping": -0.01}, "clipping"),
    (ZClip, {"alpha": 0}, "alpha"), (ZClip, {"alpha": 1}, "alpha"), (ZClip, {"alpha": 1.5}, "alpha"),
    (ZClip, {"z_thresh": 0}, "z_thresh"), (ZClip, {"z_thresh": -1}, "z_thresh"),
    (ZClip, {"warmup": 0}, "warmup"),
    (ZClip, {"mode": "median"}, "mode"),
]
GOOD = [
    (AdaGC, {"beta": 1e-6}), (AdaGC, {"beta": 1 - 1e-6}), (AdaGC, {"lambda_rel": 1e-6}),
    (AdaGC, {"lambda_rel": 0.5}),
    (AdaGC, {"lambda_abs": 1e-6}), (AdaGC, {"lambda_abs": 0.5}), (AdaGC, {"warmup": 1}),
    (AutoClip, {"quantile": 0}), (AutoClip, {"quantile": 1}), (AutoClip, {"history": 1, "min_history": 1}),
    (AutoClip, {"history": 2, "min_history": 2}),
    (UpdateNormClip, {"window": 2}), (UpdateNormClip, {"k": 1e-6}), (UpdateNormClip, {"k": 0.5}),
    (AGC, {"clipping": 1e-9}), (AGC, {"clipping": 0.5}),
    (ZClip, {"alpha": 1e-6}), (ZClip, {"alpha": 1 - 1e-6}), (ZClip, {"z_thresh": 1e-6}),
    (ZClip, {"z_thresh": 0.5}),
    (ZClip, {"warmup": 1}), (ZClip, {"mode": "mean"}),
]


@pytest.mark.parametrize(("cls", "kwargs", "name"), BAD, ids=[f"{c.__name__}-{k}" for c, k, _ in BAD])
def test_a_setting_out_of_its_range_is_refused_naming_it(cls, kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        cls(**kwargs)


@pytest.mark.parametrize(("cls", "kwargs"), GOOD, ids=[f"{c.__name__}-{k}" for c, k in GOOD])
def test_a_setting_at_the_edge_of_its_range_is_accepted(cls, kwargs):
    clip = cls(**kwargs)
    for key, value in kwargs.items():
        if key != "feed":
            assert getattr(clip, key) == value


# ------------------------------------------------------------------------------ AdaGC


def adagc_rule(gamma, count, norms, norm, *, beta, lambda_rel, lambda_abs, warmup, eps, feed):
    """AdaGC's step for each tensor, as its docstring and arXiv 2502.11034 give it, in Python floats."""
    hs, gammas, cuts = [], [], []
    for g, n in zip(gamma, norms):
        if count < warmup:  # the global clip at lambda_abs; gamma: the first, then the least, h*||g_i||
            h = min(1.0, lambda_abs / (norm + eps))
            gammas.append(h * n if count == 0 else min(g, h * n))
            cuts.append(False)
        else:  # h_i = min(1, lambda_rel * gamma_i / ||g_i||): a zero gradient has nothing to clip
            h = 1.0 if n == 0 else min(1.0, lambda_rel * g / n)
            cut = h < 1
            value = h * n if feed == "clipped" else n
            gammas.append(g if feed == "exclude" and cut else beta * g + (1 - beta) * value)
            cuts.append(cut)
        hs.append(h)
    return hs, gammas, cuts


GRID = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0])


@FAST
@given(st.lists(st.tuples(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), GRID), min_size=1, max_size=4),
       st.sampled_from([0, 1, 2, 5]), st.sampled_from([1, 3]), st.sampled_from([0.5, 1.5, 4.0]),
       st.sampled_from([0.5, 0.9, 0.98]), st.sampled_from([0.5, 1.0, 1.05, 2.0]),
       st.sampled_from([0.5, 1.0, 3.0]),
       st.sampled_from([0.0, 1e-8, 0.25]), st.sampled_from(["clipped", "raw", "exclude"]))
def test_adagc_update_is_the_papers_rule(pairs, count, warmup, norm, beta, lambda_rel, lambda_abs, eps, feed):
    gamma, norms = [p[0] for p in pairs], [p[1] for p in pairs]
    kw = dict(beta=beta, lambda_rel=lambda_rel, lambda_abs=lambda_abs, warmup=warmup, eps=eps, feed=feed)
    h, new, cut = adagc_update(torch.tensor(gamma), torch.tensor(count), torch.tensor(norms),
                               torch.tensor(norm), **kw)
    want_h, want_gamma, want_cut = adagc_rule(gamma, count, norms, norm, **kw)
    assert h.tolist() == pytest.approx(want_h, rel=1e-5)
    assert new.tolist() == pytest.approx(want_gamma, rel=1e-5)
    assert cut.tolist() == want_cut


def test_adagc_update_hand_cases():
    """Warm-up: h = min(1, lambda_abs / (||g|| + eps)); after, a zero gradient and one under its EMA are
    not cut."""
    kw = dict(beta=0.5, lambda_rel=1.0, lambda_abs=1.0, warmup=2, eps=0.5)
    h, _, cut = adagc_update(torch.tensor([1.0]), torch.tensor(0), torch.tensor([1.5]), torch.tensor(1.5),
                             feed="clipped", **kw)
    assert h.tolist() == [0.5] and cut.tolist() == [False]  # 1 / (1.5 + 0.5)
    h, gamma, cut = adagc_update(torch.tensor([0.5, 1.0, 1.0]), torch.tensor(2),
                                 torch.tensor([0.0, 1.0, 4.0]), torch.tensor(4.0), feed="exclude", **kw)
    assert h.tolist() == [1.0, 1.0, 0.25]
    assert cut.tolist() == [False, False, True]
    assert gamma.tolist() == [0.25, 1.0, 1.0]  # EMA with 0, EMA with 1, kept (cut: excluded)
    _, gamma, _ = adagc_update(torch.tensor([1.0]), torch.tensor(2), torch.tensor([4.0]), torch.tensor(4.0),
                               feed="raw", **kw)
    assert gamma.tolist() == [2.5]  # 0.5 * 1 + 0.5 * 4: the raw norm, not the clipped 1


def _adagc_run(clip, steps: list[tuple[float, float]]) -> list[list[float]]:
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(2, requires_grad=True)
    out = []
    for x, y in steps:
        a.grad, b.grad = torch.tensor([x]), torch.tensor([y, 0.0])
        clip.clip_([a, b])
        out.append([a.grad.item(), b.grad[0].item(), clip.releases()])
    return out


def test_adagc_defaults_are_the_published_ones():
    """beta=0.98, lambda_rel=1.05, lambda_abs=1.0, warmup=100, eps=1e-8, feed="clipped", 50 clips in a row."""
    steps = list(zip(_norms(1, 100), _norms(2, 100))) + [(10.0, 0.5)] * 60  # 100 of warm-up, then clipped
    default = _adagc_run(AdaGC(), steps)
    published = _adagc_run(AdaGC(beta=0.98, lambda_rel=1.05, lambda_abs=1.0, warmup=100, eps=1e-8,
                                 feed="clipped", max_consecutive_clips=50), steps)
    assert default == published
    assert default[99][0] == pytest.approx(steps[99][0] / math.hypot(*steps[99]), rel=1e-5)  # warm-up: global
    assert default[100][0] < 2.0  # step 100 is past the warm-up: cut against gamma, not the global bound
    assert [r[2] for r in default].index(1) == 149  # the guard: the 50th clip in a row


def test_a_fresh_adagc_saves_and_loads_and_warns_at_its_first_release():
    clip = AdaGC()
    fresh = AdaGC()
    fresh.load_state_dict(clip.state_dict())  # a checkpoint before the first step
    assert fresh.state_dict() == {} and fresh.releases() == 0
    clip = AdaGC(warmup=1, lambda_rel=1.0, max_consecutive_clips=2)
    _adagc_run(clip, [(1.0, 1.0), (4.0, 4.0), (8.0, 8.0)])
    assert clip.releases() == 1
    with pytest.warns(LockInWarning):
        assert clip.check_lockin()


# ------------------------------------------------------------------------------ AutoClip


def test_autoclip_defaults_are_the_published_ones():
    """quantile=0.9 over the last history=1000 norms, feed="raw", min_history=1, 50 clips in a row."""
    norms = _norms(3, 1010)
    default = _global_coefs(AutoClip(), norms)
    published = _global_coefs(AutoClip(quantile=0.9, history=1000, min_history=1, feed="raw",
                                       max_consecutive_clips=50), norms)
    assert default == published
    past = torch.tensor(norms[1005 - 1000:1005], dtype=torch.float32)
    assert default[1005][1] == pytest.approx(torch.quantile(past, 0.9).item())  # the window: the last 1000
    rising = [float(i) for i in range(1, 60)]  # every norm above all before it: clipped from the second on
    default = _global_coefs(AutoClip(), rising)
    assert default == _global_coefs(AutoClip(max_consecutive_clips=50), rising)
    # the 50th clip in a row (step 50) restarted the history from its raw norm, 51
    assert default[50][1] < 50.0 and default[51][1] == 51.0


@pytest.mark.parametrize("make", [lambda: AutoClip(history=3, quantile=0.5),
                                  lambda: UpdateNormClip(window=3)], ids=["AutoClip", "UpdateNormClip"])
def test_a_history_resumed_past_2_24_steps_still_overwrites_its_oldest_norm(make):
    """The ring's position is the step count mod its length, exact at any step (a float32 count is not)."""
    clip = make()
    state = clip.state_dict()
    state["history"] = torch.tensor([1.0, 2.0, 3.0])
    state["count"] = torch.tensor(2**24 + 1)  # the slot to overwrite next: (2**24 + 1) % 3 == 2
    clip.load_state_dict(state)
    clip.observe(torch.tensor(10.0), torch.tensor(math.inf))
    assert clip.state_dict()["history"].tolist() == [1.0, 2.0, 10.0]
    assert clip.state_dict()["count"].item() == 2**24 + 2


# ------------------------------------------------------------------------------ UpdateNormClip


def _update_run(clip, updates: list[float]) -> list[list[float]]:
    """Apply each update to one weight between ``begin_`` and ``clip_``; return what the clip took off it
    (0: untouched) and the guard's releases so far, per step."""
    w = torch.nn.Parameter(torch.zeros(1))
    out = []
    for u in updates:
        clip.begin_([w])
        with torch.no_grad():
            w += u
        before = w.item()
        clip.clip_([w])
        out.append([w.item() - before, clip.releases()])
    return out


def test_update_norm_clip_defaults_are_levanters():
    """window=128, k=3.0, feed="raw", 50 clips in a row (Levanter's ClipUpdateNorm)."""
    updates = _norms(4, 140) + [100.0] + [2.0**i for i in range(1, 60)]
    default = _update_run(UpdateNormClip(), updates)
    published = UpdateNormClip(window=128, k=3.0, feed="raw", max_consecutive_clips=50)
    assert default == _update_run(published, updates)
    past = torch.tensor(updates[140 - 128:140], dtype=torch.float64)
    mean, std = past.mean().item(), past.std(unbiased=False).item()
    assert 100.0 + default[140][0] == pytest.approx(mean + 3.0 * std, rel=1e-4)  # cut to mean + 3 std
    assert [r[1] for r in default].count(0) < len(default)  # the lock-in guard is on


def test_update_norm_clip_is_active_once_half_its_window_is_in():
    """Levanter: inactive until ``window // 2`` update norms are in (2 of a window of 5), then
    ``mean + k * std`` (population std): 2 + 3 * 1 after updates of 1 and 3."""
    clip = UpdateNormClip(window=5)
    steps = _update_run(clip, [1.0, 3.0, 10.0])
    assert [cut for cut, _ in steps[:2]] == [0.0, 0.0]
    assert 10.0 + steps[2][0] == pytest.approx(5.0, rel=1e-5)  # the update of 10, cut to 5


def test_clip_before_begin_says_to_call_begin_first():
    with pytest.raises(RuntimeError, match="begin_"):
        UpdateNormClip().clip_([])


# ------------------------------------------------------------------------------ ZClip


def test_zclip_limit_hand_cases():
    """z = (g - mu) / (sigma + eps); a clip only when z > z_thresh, to mu + z_thresh**2 / z * sigma
    (mode "mean": to mu)."""
    mean, var = torch.tensor(1.0), torch.tensor(0.25)  # sigma 0.5
    at = zclip_limit(mean, var, torch.tensor(2.0), 2.0, 0.0, "adaptive_scaling")
    assert at.item() == math.inf  # z == z_thresh exactly: not clipped
    # eps = 0.5: z = (3 - 1) / (0.5 + 0.5) = 2 > 1.5, the limit 1 + (2.25 / 2) * 0.5
    limit = zclip_limit(mean, var, torch.tensor(3.0), 1.5, 0.5, "adaptive_scaling")
    assert limit.item() == pytest.approx(1.5625)
    assert zclip_limit(mean, var, torch.tensor(3.0), 1.5, 0.5, "mean").item() == 1.0


def test_zclips_defaults_are_the_published_ones():
    """alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6, mode="adaptive_scaling", feed="clipped"
    (bluorion-com/ZClip), and the guard after 50 clips in a row (a 5x level shift locks the clipped feed)."""
    norms = _norms(6, 30) + [10.0] * 60
    default = _global_coefs(ZClip(), norms)
    published = ZClip(alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6, mode="adaptive_scaling", feed="clipped",
                      max_consecutive_clips=50)
    assert default == _global_coefs(published, norms)
    assert default[24][1] == math.inf and default[25][1] < 3.0  # 25 norms of warm-up
    assert all(coef < 1.0 for coef, _ in default[30:80]) and default[80][1] == math.inf  # restarted


@pytest.mark.parametrize("make", [AdaGC, ZClip, AutoClip, UpdateNormClip])
def test_a_clippers_step_counters_are_exact_integers(make):
    """A float32 counter stops at 2**24 steps (the warm-up's end, the ring's slot, the guard's streak)."""
    clip = make()
    if isinstance(clip, AdaGC):
        _adagc_run(clip, [(1.0, 1.0)])
    state = clip.state_dict()
    for key in ("count", "streak", "releases"):
        assert not state[key].is_floating_point()


def zclip_stats(values: list[float], alpha: float, warmup: int) -> list[tuple[float, float]]:
    """ZClip's (mean, var) after each value, as ``bluorion-com/ZClip`` computes them: the warm-up buffer's
    mean and population variance once it is full, then ``_update_ema``."""
    out, mean, var = [], 0.0, 0.0
    for i, x in enumerate(values):
        if i + 1 == warmup:
            buf = values[:warmup]
            mean = statistics.fmean(buf)
            var = statistics.pvariance(buf, mean)
        elif i >= warmup:
            mean = alpha * mean + (1 - alpha) * x
            var = alpha * var + (1 - alpha) * (x - mean) ** 2
        out.append((mean, var))
    return out


@FAST
@given(st.lists(st.floats(0.5, 4.0), min_size=1, max_size=12), st.integers(1, 4),
       st.sampled_from([0.5, 0.9, 0.97]))
def test_zclips_statistics_are_the_references(values, warmup, alpha):
    clip = ZClip(alpha=alpha, warmup=warmup)
    state, got = clip.initial(), []
    for x in values:
        state = clip.update(state, torch.tensor(x, dtype=torch.float32))
        got.append((state["mean"].item(), state["var"].item()))
    want = zclip_stats([float(torch.tensor(x, dtype=torch.float32)) for x in values], alpha, warmup)
    for (m, v), (wm, wv) in zip(got, want):
        assert m == pytest.approx(wm, rel=1e-5) and v == pytest.approx(wv, rel=1e-4, abs=1e-6)


def test_zclips_threshold_is_the_norm_where_clipping_starts():
    """mu + z_thresh * (sigma + eps): z > z_thresh exactly above it."""
    clip = ZClip(warmup=2, eps=0.25)
    _global_coefs(clip, [0.5, 1.5])  # mu 1, sigma 0.5: the threshold 1 + 2.5 * 0.75
    below, above = copy.deepcopy(clip), copy.deepcopy(clip)
    (coef, threshold), = _global_coefs(clip, [2.0])
    assert threshold == pytest.approx(2.875)
    assert _global_coefs(below, [2.87])[0][0] == 1.0
    assert _global_coefs(above, [2.88])[0][0] < 1.0


# ------------------------------------------------------------------------------ AGC


def timm_agc(weight: torch.Tensor, grad: torch.Tensor, clipping: float, eps: float) -> torch.Tensor:
    """``timm.utils.agc.adaptive_clip_grad`` for one tensor, written out in float64."""
    w, g = weight.double(), grad.double()
    dims = tuple(range(1, w.ndim)) if w.ndim > 1 else None
    w_norm = w.norm(dim=dims, keepdim=True) if dims else w.norm()
    g_norm = g.norm(dim=dims, keepdim=True) if dims else g.norm()
    max_norm = w_norm.clamp(min=eps) * clipping
    clipped = g * (max_norm / g_norm.clamp(min=1e-6))
    return torch.where(g_norm < max_norm, g, clipped)


def test_agc_at_its_bound_takes_timms_clipped_branch():
    """``G * bound / max(||G||, 1e-6)`` unless ``||G|| < bound``: at the bound, under 1e-6, that is a cut."""
    eps = clipping = 2.0**-10  # the bound 2**-20, below timm's 1e-6 floor on ||G||
    weight, grad = torch.zeros(1), torch.tensor([2.0**-20])
    got = agc_(weight, grad, clipping, eps)
    assert torch.allclose(got.double(), timm_agc(weight, grad, clipping, eps), rtol=1e-6, atol=0)
    assert got.item() < grad.item()


def test_agcs_defaults_are_timms():
    """clipping=0.01, eps=1e-3 (timm, optax)."""
    def run(clip):
        w = torch.nn.Parameter(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        w.grad = torch.tensor([[0.05, 0.0], [0.0, 0.01]])
        clip.clip_([w])
        return w.grad
    assert torch.equal(run(AGC()), run(AGC(clipping=0.01, eps=1e-3)))
    assert torch.allclose(run(AGC()), torch.tensor([[0.01, 0.0], [0.0, 0.01]]))  # row 0 cut to 0.01 * 1


# ------------------------------------------------------------- a per-tensor clip's global-norm factor


@pytest.mark.parametrize(("post", "norm", "finite", "want"), [
    ([3.0, 4.0], 10.0, True, 0.5),        # the post-clip global norm over the pre-clip one: 5 / 10
    ([0.3, 0.4], 0.5, True, 1.0),         # a norm below 1 nothing cut: 0.5 / 0.5
    ([0.1], 0.5, True, 0.2),              # a norm below 1, cut: the ratio, not 1
    ([], 2.0, True, 1.0),                 # no per-tensor norms reported: nothing cut
    ([0.0, 0.0], 0.0, True, 1.0),         # all-zero gradients: 1, not 0 / 0
    ([], math.inf, False, 1.0),           # a non-finite step (it skips): 1, not inf / inf
    ([1.0], math.nan, False, 1.0),
], ids=["cut", "uncut-below-1", "cut-below-1", "no-post", "zero", "inf", "nan"])
def test_a_per_tensor_clips_effective_coef_is_the_ratio_of_global_norms(post, norm, finite, want):
    """effective_coef: ||post-clip norms|| / pre-clip norm, 1 where that is undefined, and a NaN threshold."""
    from labkit.clippers.base import effective_coef

    out = effective_coef([torch.tensor(v) for v in post], torch.tensor(norm), torch.tensor(finite))
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert out[0].item() == pytest.approx(want, rel=1e-6) and math.isnan(out[1].item())


# ------------------------------------------------------------- the global clippers' shared machinery


@pytest.mark.parametrize("bound", [0, -1, 1.5, True])
def test_max_consecutive_clips_below_1_or_not_an_int_is_refused_by_name(bound):
    with pytest.raises((ValueError, TypeError), match="max_consecutive_clips"):
        ZClip(max_consecutive_clips=bound)


@pytest.mark.parametrize(("limit", "norm"), [(1.0, 2.0), (0.5, 0.5), (3.0, 1e-7), (1.0, 1e-6)])
def test_a_global_clippers_coef_is_what_torchs_clip_multiplies_by(limit, norm):
    """coef(limit, norm) is the factor torch's clip_grads_with_norm_ applies: min(1, limit / (norm + eps))."""
    grad = torch.ones(1)
    p = torch.zeros(1, requires_grad=True)
    p.grad = grad
    torch.nn.utils.clip_grads_with_norm_([p], limit, torch.tensor(norm))
    got = ZClip().coef(torch.tensor(limit), torch.tensor(norm))
    assert got.item() == p.grad.item()


@pytest.mark.parametrize("feed", ["clipped", "raw", "exclude"])
def test_a_norm_exactly_at_the_limit_is_not_clipped_and_is_admitted(feed):
    """Clipping is norm > limit (ZClip clips z > z_thres; llm.c's exclude policy drops norms above the
    threshold): a norm at the limit is no clip, so it feeds the statistics and starts no lock-in streak."""
    from labkit.clippers.base import feed_value

    norm = limit = torch.tensor(2.0)
    value, admit = feed_value(feed, norm, limit)
    assert bool(admit) and value.item() == 2.0
    clip = ZClip(warmup=1, max_consecutive_clips=1)
    clip.observe(torch.tensor(3.0), torch.tensor(math.inf))  # warm
    before = {k: v.clone() for k, v in clip.state.items()}
    assert not bool(clip.observe(norm, limit))
    assert clip.state["streak"].item() == before["streak"].item() == 0


def test_a_float64_norm_leaves_a_global_clippers_state_and_coef_float32():
    """A float64 model's norm is float64: the clipper's statistics stay float32, and so does its factor."""
    clip = ZClip(warmup=2)
    for v in (1.0, 2.0, 4.0):
        clip.observe(torch.tensor(v, dtype=torch.float64), torch.tensor(math.inf))
    assert {v.dtype for v in clip.state.values() if v.is_floating_point()} == {torch.float32}
    big = torch.tensor(30.0, dtype=torch.float64)
    coef, threshold = clip.coef_(big.reshape(1), big)
    assert coef.dtype == torch.float32 and threshold.dtype == torch.float32
    assert {v.dtype for v in clip.state.values() if v.is_floating_point()} == {torch.float32}
