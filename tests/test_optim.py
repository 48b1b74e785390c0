"""labkit.optim: the update-RMS rule's invariants; StableAdamW vs Algorithm 2 (float64), AdamW (bitwise)."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest
import torch
from host_reads import READS, SyncCounter
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit
from labkit.optim import StableAdamW, read_update_rms, update_rms

PROPERTY = settings(max_examples=100, deadline=None, database=None)
SLOW_PROPERTY = settings(max_examples=25, deadline=None, database=None)
SHAPES = [(3, 4), (5,), ()]

betas2 = st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99, 0.999]) | st.floats(0.0, 0.9999)
entries = st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False)
big_entries = st.floats(1e-3, 1e3) | st.floats(-1e3, -1e-3)


def feed(history, beta2):
    """Run Adam's second moment over ``history`` as torch does (float64); return the last g and v."""
    v = torch.zeros_like(history[0])
    for g in history:
        v = v.mul(beta2).addcmul(g, g, value=1 - beta2)
    return history[-1], v


def histories(values=entries, n=None, steps=None):
    n, steps = n or st.integers(1, 8), steps or st.integers(1, 30)
    return st.tuples(n, steps).flatmap(lambda ns: st.lists(
        st.lists(values, min_size=ns[0], max_size=ns[0]), min_size=ns[1], max_size=ns[1])).map(
        lambda rows: torch.tensor(rows, dtype=torch.float64))


# ---------------------------------------------------------------- the rule: invariants from its formula


@PROPERTY
@given(histories(), betas2)
def test_rms_never_exceeds_the_cap_because_v_hat_contains_g(history, beta2):
    # v_t >= (1 - beta2) g_t**2, so g_t**2 / v_hat_t <= (1 - beta2**t) / (1 - beta2) <= 1 / (1 - beta2)
    t = len(history)
    g, v = feed(history, beta2)
    rms = update_rms(g, v, t, beta2, 1e-8).item()
    cap = math.sqrt((1 - beta2**t) / (1 - beta2))
    assert rms <= cap * (1 + 1e-12)
    assert cap <= 1 / math.sqrt(1 - beta2) * (1 + 1e-15)


@PROPERTY
@given(histories(values=big_entries, steps=st.just(1)), betas2, st.integers(1, 200))
def test_a_gradient_new_to_v_reaches_the_cap(g, beta2, t):
    # every earlier gradient was zero: v_t = (1 - beta2) g**2 and the ratio is the cap in every coordinate
    g = g[0]
    rms = update_rms(g, (1 - beta2) * g * g, t, beta2, 1e-8).item()
    assert rms == pytest.approx(math.sqrt((1 - beta2**t) / (1 - beta2)), rel=1e-12)


@PROPERTY
@given(histories(values=big_entries, steps=st.just(1)), betas2, st.integers(1, 60))
def test_a_gradient_constant_since_step_one_gives_one_at_every_step(g, beta2, steps):
    # bias correction makes v_hat exactly g**2 from the first step on, not only at steady state
    history = g.expand(steps, -1)
    for t in range(1, steps + 1):
        gt, v = feed(history[:t], beta2)
        assert update_rms(gt, v, t, beta2, 1e-8).item() == pytest.approx(1.0, rel=1e-12)


def test_zero_coordinates_count_in_the_mean():
    # a per-coordinate mean, not a norm ratio: a constant gradient on 1 coordinate of 4 gives sqrt(1/4)
    g = torch.tensor([0.0, 0.0, 0.0, 2.0], dtype=torch.float64)
    assert update_rms(g, 0.05 * g * g, 1, 0.95, 1e-8).item() == pytest.approx(0.5, rel=1e-15)


@PROPERTY
@given(histories(values=big_entries), betas2, st.integers(-8, 8), st.floats(0.1, 10.0))
def test_scaling_g_by_c_and_v_by_c_squared_changes_nothing(history, beta2, k, c):
    # while eps does not bind (every |g| >= 1e-3 here, so v_hat >= 1e-6 * 4**-8 >> eps**2)
    t = len(history)
    g, v = feed(history, beta2)
    rms = update_rms(g, v, t, beta2, 1e-8)
    assert torch.equal(update_rms(g * 2.0**k, v * 4.0**k, t, beta2, 1e-8), rms)  # powers of 2: exact
    assert update_rms(g * c, v * c * c, t, beta2, 1e-8).item() == pytest.approx(rms.item(), rel=1e-12)


@PROPERTY
@given(histories(), histories(), betas2)
def test_rms_squared_is_a_mean_over_coordinates(a, b, beta2):
    steps = min(len(a), len(b))
    (ga, va), (gb, vb) = feed(a[:steps], beta2), feed(b[:steps], beta2)
    ra, rb = update_rms(ga, va, steps, beta2, 1e-8).item(), update_rms(gb, vb, steps, beta2, 1e-8).item()
    rab = update_rms(torch.cat([ga, gb]), torch.cat([va, vb]), steps, beta2, 1e-8).item()
    na, nb = ga.numel(), gb.numel()
    assert rab**2 * (na + nb) == pytest.approx(na * ra**2 + nb * rb**2, rel=1e-12, abs=1e-300)


@PROPERTY
@given(histories(), betas2, st.floats(1e-12, 1e-2), st.floats(1.0, 1e4))
def test_eps_only_lowers_it(history, beta2, eps, factor):
    t = len(history)
    g, v = feed(history, beta2)
    small, large = update_rms(g, v, t, beta2, eps).item(), update_rms(g, v, t, beta2, eps * factor).item()
    assert large <= small * (1 + 1e-12)
    assert small <= g.square().mean().sqrt().item() / eps * (1 + 1e-12)


def test_it_is_the_rms_of_adams_own_step_when_beta1_is_zero():
    # torch as the oracle: with beta1 = 0, lr = 1 and no decay, AdamW moves each coordinate by
    # g / (sqrt(v_hat) + eps), so the RMS of its move is update_rms (eps 1e-12 against v_hat >= 1e-6)
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(64, dtype=torch.float64))
    opt = torch.optim.AdamW([w], lr=1.0, betas=(0.0, 0.95), eps=1e-12, weight_decay=0.0)
    read = []
    for t in range(1, 40):
        scale = 50.0 if t in (17, 31) else 1.0
        w.grad = (torch.rand(64, generator=gen, dtype=torch.float64) + 1e-3) * scale
        before = w.detach().clone()
        opt.step()
        moved = (w.detach() - before).square().mean().sqrt().item()
        (rms,) = read_update_rms(opt, [w])
        assert rms.item() == pytest.approx(moved, rel=1e-9)
        assert rms.dtype == torch.float64 and rms.shape == ()
        read.append(rms.item())
    spikes = [t for t, r in enumerate(read, start=1) if r > 2]
    assert spikes == [17, 31]  # 50x gradients; the cap for 0.95 is 4.47


def test_step_one_and_dtypes():
    g = torch.tensor([3.0, -4.0])
    assert update_rms(g, 0.01 * g * g, 1, 0.99, 1e-8).item() == pytest.approx(1.0, rel=1e-6)
    half = update_rms(g.bfloat16(), (0.01 * g * g).bfloat16(), 1, 0.99, 1e-8)
    assert half.dtype == torch.float32 and half.item() == pytest.approx(1.0, rel=1e-2)
    assert update_rms(g.double(), 0.01 * g.double() ** 2, 1, 0.99, 1e-8).dtype == torch.float64
    assert update_rms(torch.zeros(0), torch.zeros(0), 3, 0.99, 1e-8).item() == 0.0
    z = torch.tensor([1 + 2j, -3j])
    v = torch.view_as_complex(0.05 * torch.view_as_real(z) ** 2)
    assert update_rms(z, v, 1, 0.95, 1e-8).item() == pytest.approx(math.sqrt(3 / 4), rel=1e-6)  # a 0 part
    step = torch.tensor(7.0)  # torch's own state["step"]: a 0-dim float32 tensor
    v = 0.01 * g * g
    assert update_rms(g, v, step, 0.99, 1e-8).item() == update_rms(g, v, 7, 0.99, 1e-8).item()


def test_the_rule_refuses_bad_input_clearly():
    g = torch.ones(3)
    with pytest.raises(ValueError, match="same shape"):
        update_rms(g, torch.ones(4), 1, 0.99, 1e-8)
    with pytest.raises(ValueError, match=r"beta2 must be a number in \[0, 1\)"):
        update_rms(g, g, 1, 1.0, 1e-8)
    with pytest.raises(ValueError, match="step must be a number >= 1"):
        update_rms(g, g, 0, 0.99, 1e-8)
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        update_rms(g, g, 1, 0.99, -1e-8)


# ---------------------------------------------------------------- reading it from an optimizer


def test_read_matches_the_rule_on_the_optimizers_state_for_each_adam():
    for make in (torch.optim.Adam, torch.optim.AdamW, StableAdamW, torch.optim.NAdam, torch.optim.RAdam):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = make(params, lr=1e-2, betas=(0.9, 0.95))
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        read = read_update_rms(opt)
        for p, r in zip(params, read):
            st_ = opt.state[p]
            assert torch.equal(r, update_rms(p.grad, st_["exp_avg_sq"], int(st_["step"]), 0.95, 1e-8)), make
        assert read_update_rms(opt, params[::-1]) == read[::-1]


def test_read_gives_nan_for_a_parameter_with_no_gradient_or_no_step_yet():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([a, b])
    a.grad = torch.ones(2)
    opt.step()
    ra, rb = read_update_rms(opt)
    assert ra.item() == pytest.approx(1.0) and math.isnan(rb.item())
    a.grad = None
    b.grad = torch.ones(2)
    ra, rb = read_update_rms(opt)  # b has a gradient but was never stepped
    assert math.isnan(ra.item()) and math.isnan(rb.item())


def test_read_refuses_what_has_no_second_moment_and_says_why():
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    for opt in (torch.optim.SGD([w], lr=0.1), torch.optim.SGD([w], lr=0.1, momentum=0.9),
                torch.optim.Adagrad([w]), torch.optim.Adafactor([w])):
        opt.step()
        with pytest.raises(TypeError, match="keeps no second moment"):
            read_update_rms(opt)
    adamax = torch.optim.Adamax([w])
    adamax.step()
    with pytest.raises(TypeError, match=r"no exp_avg_sq \(it keeps \['exp_avg', 'exp_inf', 'step'\]\)"):
        read_update_rms(adamax)
    l2 = torch.optim.Adam([w], weight_decay=0.1)
    l2.step()
    with pytest.raises(ValueError, match=r"v holds \(g \+ wd \* p\)\*\*2: use AdamW"):
        read_update_rms(l2)
    adamw = torch.optim.AdamW([w])
    adamw.step()
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(3,\)\) is not a parameter of this AdamW"):
        read_update_rms(adamw, [torch.ones(3)])
    w.grad = None
    with pytest.raises(RuntimeError, match="before optimizer.zero_grad"):
        read_update_rms(adamw)


# ---------------------------------------------------------------- StableAdamW against Algorithm 2, float64


def algorithm2(theta0, grads, lrs, beta1, beta2, eps, wd):
    """Algorithm 2 of 2304.13013 as printed, in numpy float64: moments debiased by beta-hat, per tensor
    eta_t = lr_t / max(1, RMS_t), theta_t = theta_{t-1} - eta_t wd theta_{t-1} - eta_t v_t / (sqrt(u_t) + eps)
    (v, u: the paper's names for the debiased first and second moments). Returns the parameters after
    every step and every step's RMS per tensor."""
    theta = [np.array(p, dtype=np.float64) for p in theta0]
    v = [np.zeros_like(p) for p in theta]
    u = [np.zeros_like(p) for p in theta]
    out, rmss = [], []
    for t, (gs, lr) in enumerate(zip(grads, lrs), start=1):
        b1 = beta1 * (1 - beta1 ** (t - 1)) / (1 - beta1**t)
        b2 = beta2 * (1 - beta2 ** (t - 1)) / (1 - beta2**t)
        row = []
        for i, g in enumerate(gs):
            v[i] = b1 * v[i] + (1 - b1) * g
            u[i] = b2 * u[i] + (1 - b2) * g * g
            rms = math.sqrt(np.mean(g * g / np.maximum(u[i], eps * eps))) if g.size else 0.0
            eta = lr / max(1.0, rms)
            theta[i] = theta[i] - eta * wd * theta[i] - eta * v[i] / (np.sqrt(u[i]) + eps)
            row.append(rms)
        out.append([p.copy() for p in theta])
        rmss.append(row)
    return out, np.array(rmss)


SPIKES = ((5, 0, 80.0), (9, 1, 300.0), (14, 2, 30.0), (20, 0, 1e3))  # (step, tensor, factor)


def spiky_grads(steps, seed, shapes=SHAPES, spikes=SPIKES):
    rng = np.random.default_rng(seed)
    grads = [[rng.standard_normal(s) * 0.1 for s in shapes] for _ in range(steps)]
    for step, i, size in spikes:
        grads[step][i] = grads[step][i] * size
    return grads


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["single", "foreach", "fused"])
def test_stable_adamw_is_algorithm_2_in_float64(impl):
    steps, beta1, beta2, eps, wd = 24, 0.9, 0.95, 1e-8, 0.1
    grads = spiky_grads(steps, seed=1)
    lrs = [1e-2 * min(1.0, (t + 1) / 5) for t in range(steps)]  # a warm-up: the lr changes under it
    rng = np.random.default_rng(2)
    theta0 = [rng.standard_normal(s) for s in SHAPES]
    expected, rms = algorithm2(theta0, grads, lrs, beta1, beta2, eps, wd)
    params = [torch.nn.Parameter(torch.tensor(p)) for p in theta0]
    opt = StableAdamW(params, lr=lrs[0], betas=(beta1, beta2), eps=eps, weight_decay=wd, **impl)
    for t in range(steps):
        opt.param_groups[0]["lr"] = lrs[t]
        for p, g in zip(params, grads[t]):
            p.grad = torch.tensor(g)
        opt.step()
        for p, e in zip(params, expected[t]):
            np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-11, atol=1e-13)
        read = torch.stack(read_update_rms(opt, params)).numpy()
        np.testing.assert_allclose(read, rms[t], rtol=1e-11)
    clipped = rms > 1 + 1e-9
    assert clipped.sum() >= 4 and (~clipped).sum() >= 20  # the test exercises both branches


def shrinking_grads(steps, seed, shapes=SHAPES):
    """Step 1: powers of two (v_hat = g**2 exactly: RMS exactly 1); then every |g| shrinks by 0.2-0.9
    a step, so v_hat, an average of larger squares, exceeds g**2 and no tensor's RMS passes 1."""
    gen = torch.Generator().manual_seed(seed)
    first = [torch.ldexp(torch.ones(s), torch.randint(-6, 6, s, generator=gen)) *
             (torch.randint(0, 2, s, generator=gen) * 2 - 1) for s in shapes]
    out = [first]
    for _ in range(steps - 1):
        out.append([g * (0.2 + 0.7 * torch.rand(g.shape, generator=gen)) *
                    (torch.randint(0, 2, g.shape, generator=gen) * 2 - 1) for g in out[-1]])
    return out


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["single", "foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_without_a_clip_it_is_torch_adamw_bit_for_bit(impl, dtype):
    if dtype == torch.bfloat16 and "fused" in impl:
        pytest.skip("torch's fused CPU AdamW takes float32/float64 parameters")
    grads = shrinking_grads(12, seed=3)
    torch.manual_seed(4)
    init = [torch.randn(s).to(dtype) for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, **impl)
    opt, ref = StableAdamW(ours, **kw), torch.optim.AdamW(theirs, **kw)
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.5 ** (t % 3)) for o in (opt, ref)]
    for gs in grads:
        for p, q, g in zip(ours, theirs, gs):
            p.grad, q.grad = g.to(dtype), g.to(dtype)
        opt.step(); ref.step()
        assert all(r.item() <= 1.0 for r in read_update_rms(opt)), "precondition: no tensor clipped"
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
        for s in sched:
            s.step()
    for p, q in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], ref.state[q][key])


def test_a_clip_moves_only_the_clipped_tensor_back_along_adamws_step():
    torch.manual_seed(5)
    init = [torch.randn(s) for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    opt, ref = StableAdamW(ours, **kw), torch.optim.AdamW(theirs, **kw)
    branches = {"clipped": 0, "unclipped": 0}
    for t in range(12):
        gs = [torch.randn(s) * (1e3 if (t == 11 and i == 0) else 1e-2) for i, s in enumerate(SHAPES)]
        before = [q.detach().clone() for q in theirs]
        for p, q, g in zip(ours, theirs, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step(); ref.step()
        rms = [r.item() for r in read_update_rms(opt)]
        for p, q, b, r in zip(ours, theirs, before, rms):
            if r <= 1:
                assert torch.equal(p, q)
                branches["unclipped"] += 1
            else:
                torch.testing.assert_close(p.detach(), b + (q.detach() - b) / r, rtol=1e-6, atol=1e-7)
                assert not torch.equal(p, q)
                branches["clipped"] += 1
        for p, q in zip(ours, theirs):
            q.data.copy_(p.data)  # the same weights next step: compare one step at a time
    # the 1e5x spike on tensor 0 is new to v: its RMS is the cap for step 12, sqrt((1 - 0.99**12) / 0.01)
    assert rms[0] == pytest.approx(math.sqrt((1 - 0.99**12) / 0.01), rel=1e-4)
    assert branches["clipped"] >= 1 and branches["unclipped"] >= 5, branches


def test_state_dict_round_trips_and_is_adamws():
    def make():
        torch.manual_seed(6)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        return params, StableAdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)

    grads = spiky_grads(16, seed=7, spikes=((3, 0, 100.0), (12, 1, 100.0)))
    params, opt = make()
    saved = None
    for t, gs in enumerate(grads):
        if t == 8:
            saved = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
    resumed, opt2 = make()
    with torch.no_grad():
        for p, w in zip(resumed, saved[1]):
            p.copy_(w)
    opt2.load_state_dict(saved[0])
    for gs in grads[8:]:
        for p, g in zip(resumed, gs):
            p.grad = torch.tensor(g, dtype=torch.float32)
        opt2.step()
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
    plain = torch.optim.AdamW(resumed, lr=1.0)
    plain.load_state_dict(opt.state_dict())  # the same keys: an AdamW checkpoint loads either way
    assert plain.param_groups[0]["betas"] == (0.9, 0.95)
    assert set(plain.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bad_settings_raise_torchs_errors_or_say_what_algorithm_2_lacks():
    w = [torch.nn.Parameter(torch.ones(2))]
    for kwargs, message in [({"lr": -1.0}, "Invalid learning rate"), ({"eps": -1.0}, "Invalid epsilon"),
                            ({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1"),
                            ({"weight_decay": -0.1}, "Invalid weight_decay"),
                            ({"amsgrad": True}, "no amsgrad"),
                            ({"differentiable": True}, "not differentiable")]:
        with pytest.raises(ValueError, match=message):
            StableAdamW(w, **kwargs)


def test_a_loss_scaler_unscales_before_it_even_when_fused():
    # RMS_t must read the true gradient: the scaler unscales first (a power-of-two scale: exactly)
    assert not StableAdamW([torch.nn.Parameter(torch.ones(1))], fused=True)._step_supports_amp_scaling
    torch.manual_seed(8)
    model = torch.nn.Linear(4, 3)
    twin = copy.deepcopy(model)
    x = torch.randn(16, 4)
    opt, opt2 = StableAdamW(model.parameters(), lr=0.05, fused=True), StableAdamW(twin.parameters(), lr=0.05)
    scaler = labkit.GradScaler("cpu", init_scale=2.0**10)
    for t in range(6):
        k = 1e3 if t == 4 else 1.0
        opt.zero_grad(); opt2.zero_grad()
        scaler.scale(model(x * k).square().mean()).backward()
        scaler.step(opt); scaler.update()
        twin(x * k).square().mean().backward()
        opt2.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        rms = [r.item() for r in read_update_rms(opt)]
        torch.testing.assert_close(rms, [r.item() for r in read_update_rms(opt2)], rtol=1e-6, atol=0)
        assert (max(rms) > 1) == (t == 4), (t, rms)  # the 1e6x gradient is clipped, nothing else


def test_a_closure_is_evaluated_once_and_clipped_like_a_plain_step():
    torch.manual_seed(9)
    w = torch.nn.Parameter(torch.randn(5))
    w2 = torch.nn.Parameter(w.detach().clone())
    opt, opt2 = StableAdamW([w], lr=0.1), StableAdamW([w2], lr=0.1)
    calls = []
    for k in (1e-3, 1e-3, 1e-3, 10.0):
        def closure(k=k):
            calls.append(1)
            opt.zero_grad()
            loss = (w * k).sum()
            loss.backward()
            return loss
        opt.step(closure)
        w2.grad = torch.full((5,), k)
        opt2.step()
        assert torch.equal(w, w2)
    assert len(calls) == 4


def test_step_hooks_run_once_and_a_copy_still_clips():
    # the clip is itself a pair of step hooks around AdamW's step: a user's hooks run once per step,
    # load_state_dict does not add a second clip, and a deep copy or a pickle (torch keeps no hooks) clips
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])  # torch wraps AdamW.step with its hooks
    w = torch.nn.Parameter(torch.ones(4))
    opt = StableAdamW([w], lr=0.1, betas=(0.9, 0.99))
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    for _ in range(20):
        w.grad = torch.full((4,), 1e-3)
        opt.step()
    assert calls == ["pre", "post"] * 20
    opt.load_state_dict(opt.state_dict())
    copies = [opt, copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    moved = []
    for o in copies:
        (p,) = o.param_groups[0]["params"]
        before = p.detach().clone()
        p.grad = torch.full((4,), 1.0)  # new to v: RMS 4.362 at step 21
        o.step()
        moved.append((p.detach() - before).abs().max().item())
    assert moved == pytest.approx([0.0484 / 4.362] * 3, rel=2e-3)


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["single", "foreach", "fused"])
def test_no_host_read_in_the_step_or_the_read(monkeypatch, impl):
    torch.manual_seed(10)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = StableAdamW(params, lr=1e-2, **impl)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    reads = SyncCounter(monkeypatch, (*READS, "__index__"))
    for k in (1.0, 1e3, float("nan")):
        for p in params:
            p.grad = torch.randn_like(p) * k
        opt.step()
        read_update_rms(opt)
        state = opt.state[params[0]]
        update_rms(params[0].grad, state["exp_avg_sq"], state["step"], 0.999, 1e-8)
    assert reads.count == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU count is the test above")
@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True},
                                  {"capturable": True}], ids=["single", "foreach", "fused", "capturable"])
def test_on_a_gpu_no_sync_and_adamws_bits_without_a_clip(impl):
    grads = shrinking_grads(8, seed=11)
    torch.manual_seed(12)
    init = [torch.randn(s, device="cuda") for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    opt = StableAdamW(ours, lr=1e-2, betas=(0.9, 0.99), **impl)
    ref = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.99), **impl)
    for t, gs in enumerate(grads):
        for p, q, g in zip(ours, theirs, gs):
            p.grad, q.grad = g.cuda(), g.cuda()
        ref.step()
        if t:  # the first step allocates the state
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
            rms = torch.stack(read_update_rms(opt))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert (rms <= 1).all()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)


def test_labkit_names_the_module():
    assert labkit.optim.StableAdamW is StableAdamW
    assert labkit.optim.__all__ == ["StableAdamW", "read_update_rms", "update_rms"]
