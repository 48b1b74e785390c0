"""Clipping and loss scaling bit for bit against torch (issue 37: the mutants that survived the suite).

``clip_grad_norm_`` and ``clip_coef`` against ``torch.nn.utils.clip_grad_norm_``'s rule (it adds 1e-6
to the norm: a drop-in that subtracts it gives other gradients), and the scaler's dead-scale guard and
``inf_check_`` against the rule they promise.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
import re
import weakref

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from test_clip import params_from_values

import labkit
from labkit import GradScaler
from labkit.clip import check_scaled_norm_type, clip_coef, round_to, total_norm

FAST = settings(max_examples=60, deadline=None, database=None)



@contextlib.contextmanager
def float64_default():
    """Run the block with float64 as torch's default dtype (a user's ``torch.set_default_dtype``)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)

def grads_of(values, scale):
    out = []
    for v in values:
        p = torch.zeros(len(v), requires_grad=True)
        p.grad = torch.tensor(v, dtype=torch.float32) * scale
        out.append(p)
    return out


@FAST
@given(values=st.lists(st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=4), min_size=1,
                       max_size=3),
       scale=st.sampled_from([1e-7, 1e-6, 1e-4, 1.0, 300.0]),
       max_norm=st.sampled_from([1e-6, 1e-3, 0.5, 1.0, 7.0]), foreach=st.sampled_from([None, False]))
def test_clip_grad_norm_is_torchs_bit_for_bit(values, scale, max_norm, foreach):
    ours, theirs = grads_of(values, scale), grads_of(values, scale)
    norm = labkit.clip_grad_norm_(ours, max_norm, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
    assert torch.equal(norm, want)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad), (p.grad, q.grad)


@pytest.mark.parametrize("norm", [0.0, 1e-7, 1e-6, 3e-6, 0.5, 1.0, 2.0, 1e3])
@pytest.mark.parametrize("max_norm", [1e-6, 0.25, 1.0])
def test_clip_coef_is_torchs_factor_for_a_float_and_a_tensor_limit(norm, max_norm):
    n = torch.tensor(norm)
    want = torch.clamp(max_norm / (n + 1e-6), max=1.0)  # torch.nn.utils.clip_grads_with_norm_
    assert torch.equal(clip_coef(n, max_norm), want)
    limit = torch.tensor(max_norm)
    assert torch.equal(clip_coef(n, limit), torch.clamp(limit / (n + 1e-6), max=1.0))


@settings(max_examples=300, deadline=None)
@given(norm=st.one_of(st.floats(0.0, allow_infinity=False, width=32),
                     st.sampled_from([0.0, -0.0, 1e-45, 1e-6])),
       max_norm=st.floats(2.0**-100, 2.0**100, width=32),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_clip_coef_of_any_finite_norm_is_torchs_factor(norm, max_norm, dtype):
    """Every finite norm, in each dtype a norm comes in: the guard against bad norms changes no bit."""
    n = torch.tensor(norm).to(dtype)
    assume(bool(torch.isfinite(n)))  # fp16 holds no norm past 65504
    limit = torch.tensor(max_norm)
    for got, want in ((clip_coef(n, max_norm), torch.clamp(max_norm / (n + 1e-6), max=1.0)),
                      (clip_coef(n, limit), torch.clamp(limit / (n + 1e-6), max=1.0))):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("norm", [math.inf, -math.inf, math.nan, -1.0])
def test_clip_coef_is_one_where_there_is_no_norm_to_clip_by(norm):
    assert float(clip_coef(torch.tensor(norm), 1.0)) == 1.0
    assert float(clip_coef(torch.tensor(norm), torch.tensor(1.0))) == 1.0


def test_clip_grads_with_norm_is_torchs_with_the_same_norm():
    ours, theirs = grads_of([[3e-7, 4e-7], [1.0]], 1.0), grads_of([[3e-7, 4e-7], [1.0]], 1.0)
    labkit.clip_grads_with_norm_(ours, 0.5, torch.tensor(1.0))
    torch.nn.utils.clip_grads_with_norm_(theirs, 0.5, torch.tensor(1.0))
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad)


def one_param_step(scaler, grad):
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale(w.sum())  # the scaler's state is created on the loss's device
    w.grad = torch.tensor(grad)
    return w, opt


def test_a_dead_scale_skips_and_backs_off_onto_the_floor_instead_of_stepping_on_inf():
    """A scale set below float32's normal range has 1/scale = inf: finite gradients would become inf."""
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=1e-40)  # subnormal in float32: > 0, so update() takes it
    w, opt = one_param_step(scaler, [1.0, -2.0])
    assert scaler.step(opt) is False  # skipped: the parameters were not moved by inf
    assert torch.equal(w, torch.zeros(2))
    scaler.update()
    assert scaler.get_scale() == 2.0**-126 and scaler.skip_count == 1  # revived at the floor


@pytest.mark.parametrize("found", [True, False])
def test_inf_check_takes_a_host_bool(found):
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    w, opt = one_param_step(scaler, [1.0, 1.0])
    scaler.inf_check_(opt, found, unscaled=True)
    assert scaler.will_skip(opt) is found
    assert scaler.step(opt) is (not found)
    scaler.update()
    assert scaler.get_scale() == (512.0 if found else 2048.0)
    assert torch.equal(w, torch.zeros(2) if found else -torch.ones(2))


@pytest.mark.parametrize("found", [1.0, 0.0])
def test_inf_check_takes_a_device_tensor(found):
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    _, opt = one_param_step(scaler, [1.0, 1.0])
    scaler.inf_check_(opt, torch.tensor([found]), unscaled=True)
    assert scaler.will_skip(opt) is bool(found)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == (512.0 if found else 2048.0)


# ---------------------------------------------------------------- the scaler's setters, repr and fused path


def two_scalers(**kwargs):
    return torch.amp.GradScaler("cpu", **kwargs), GradScaler("cpu", **kwargs)


def begun(scaler, optimizer_class):
    """Return ``(w, opt)``: one parameter with gradient ones, its iteration begun by ``scaler.scale``."""
    w = torch.zeros(2, requires_grad=True)
    opt = optimizer_class([w], lr=1.0)
    scaler.scale(w.sum())
    w.grad = torch.ones(2)
    return w, opt


def scaled_step(scaler, opt, w, grad):
    """One iteration on one parameter whose scaled gradient is ``grad`` (inf: an overflow)."""
    scaler.scale(w.sum())
    w.grad = torch.tensor(grad, dtype=torch.float32)
    stepped = scaler.step(opt)
    scaler.update()
    return stepped


def test_set_growth_and_backoff_factor_move_the_scale_as_torchs_setters_do():
    """set_growth_factor/set_backoff_factor take effect at the next update(), as torch's, bit for bit."""
    pattern = [1.0, math.inf, 1.0, 1.0, math.inf, 1.0]
    scales = []
    for scaler in two_scalers(init_scale=1024.0, growth_interval=1):
        scaler.set_growth_factor(3.0)
        scaler.set_backoff_factor(0.125)
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=1.0)
        got = []
        for g in pattern:
            scaled_step(scaler, opt, w, [g, g])
            got.append(scaler.get_scale())
        scales.append(got)
        assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.125)
        assert scaler.state_dict()["growth_factor"] == 3.0 and scaler.state_dict()["backoff_factor"] == 0.125
    assert scales[0] == scales[1] == [3072.0, 384.0, 1152.0, 3456.0, 432.0, 1296.0]


def test_repr_says_whether_the_scaler_is_enabled():
    """A disabled scaler says so; an enabled one shows its scale and rule."""
    assert repr(GradScaler("cpu", enabled=False)) == "GradScaler(enabled=False)"
    enabled = repr(GradScaler("cpu", init_scale=8.0))
    assert enabled.startswith("GradScaler(scale=8, ScalerConfig(growth_factor=2.0")


def fused_pair(seed=0):
    """Two identical one-parameter fused AdamW setups (torch's scaler, labkit's)."""
    torch.manual_seed(seed)
    w0 = torch.randn(3, dtype=torch.float32)  # float32 parameters whatever the default dtype
    out = []
    for scaler in two_scalers(init_scale=4.0, growth_interval=1):
        w = w0.clone().requires_grad_(True)
        opt = torch.optim.AdamW([w], lr=0.1, fused=True)
        out.append((scaler, opt, w))
    return out


def fused_iteration(scaler, opt, w, grad, **step_kwargs):
    scaler.scale(w.sum())
    w.grad = torch.tensor(grad, dtype=torch.float32)
    scaler.step(opt, **step_kwargs)
    scaler.update()


def assert_same_adam(a, b):
    (_, opt_a, w_a), (_, opt_b, w_b) = a, b
    assert torch.equal(w_a, w_b), (w_a, w_b)
    sa, sb = opt_a.state[w_a], opt_b.state[w_b]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), (k, sa[k], sb[k])


@pytest.mark.parametrize("grads", [[[1.0, -2.0, 0.5]], [[math.inf, 1.0, 1.0]],
                                   [[1.0, 2.0, 3.0], [math.nan, 0.0, 1.0], [4.0, -1.0, 2.0]]],
                         ids=["clean", "inf-first", "nan-between"])
def test_a_fused_adamw_step_is_torchs_bit_for_bit_and_skips_on_inf(grads):
    """scaler.step(fused AdamW): the kernel unscales and skips on inf/NaN as under torch's scaler."""
    ref, ours = fused_pair()
    for g in grads:
        for scaler, opt, w in (ref, ours):
            fused_iteration(scaler, opt, w, g)
        assert_same_adam(ref, ours)
        assert ref[0].get_scale() == ours[0].get_scale()


def test_a_fused_step_under_a_float64_default_dtype_is_torchs():
    """found_inf and the unit scale are float32 whatever the default dtype: torch's kernels take no other."""
    with float64_default():
        ref, ours = fused_pair()
        for g in ([1.0, -2.0, 0.5], [math.inf, 0.0, 0.0], [0.25, 1.0, -1.0]):
            for scaler, opt, w in (ref, ours):
                fused_iteration(scaler, opt, w, g)
            assert_same_adam(ref, ours)
    assert ours[0].skip_count == 1


def test_a_fused_step_with_an_lr_scheduler_is_torchs():
    """An LR scheduler wraps optimizer.step in a plain function (no __func__): the fused path still works."""
    ref, ours = fused_pair()
    for scaler, opt, w in (ref, ours):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for g in ([1.0, -2.0, 0.5], [math.inf, 0.0, 0.0], [0.25, 1.0, -1.0]):
            fused_iteration(scaler, opt, w, g)
            sched.step()
    assert_same_adam(ref, ours)


def test_a_user_grad_scale_after_unscale_reaches_the_fused_kernel_as_torchs():
    """After unscale_ the kernel gets the optimizer's own grad_scale (a clip factor), not the loss scale."""
    ref, ours = fused_pair()
    for scaler, opt, w in (ref, ours):
        scaler.scale(w.sum())
        w.grad = torch.tensor([1.0, -2.0, 0.5])
        scaler.unscale_(opt)
        opt.grad_scale = torch.tensor(0.25)  # the kernel divides the gradients by it
        scaler.step(opt)
        scaler.update()
        assert not hasattr(opt, "grad_scale")  # removed after the step, as torch does
    assert_same_adam(ref, ours)


@pytest.mark.parametrize("found", [True, False])
def test_a_host_decision_drives_the_fused_kernel(found):
    """inf_check_(opt, bool): a known skip leaves parameters and moments as torch's skip does; a go steps."""
    ref, ours = fused_pair()
    grad = [math.inf, 0.0, 0.0] if found else [1.0, -2.0, 0.5]
    fused_iteration(*ref, grad)
    scaler, opt, w = ours
    scaler.scale(w.sum())
    w.grad = torch.tensor([1.0, -2.0, 0.5])  # the decision, not the gradient, says skip
    scaler.inf_check_(opt, found, unscaled=False)
    assert scaler.step(opt) is not found
    scaler.update()
    if found:
        assert_same_adam(ref, ours)
    else:
        assert_same_adam(ref, (scaler, opt, w))
    assert scaler.get_scale() == ref[0].get_scale()


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.overloadpacket.__name__, kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_a_step_known_on_the_host_to_go_ahead_spares_the_kernels_check_and_undo_pass():
    """inf_check_(opt, False): the kernel gets found_inf=None; no step-counter undo (_foreach_sub_) runs."""
    (_, _, w_ref), (scaler, opt, w) = fused_pair()
    for found in (False, True):
        scaler.scale(w.sum())
        w.grad = torch.tensor([1.0, -2.0, 0.5])
        scaler.inf_check_(opt, found, unscaled=False)
        with OpLog() as log:
            scaler.step(opt)
        scaler.update()
        kernel = [kw for name, kw in log.calls if name == "_fused_adamw_"]
        assert len(kernel) == 1
        assert (kernel[0].get("found_inf") is None) is (not found)
        assert any(name == "_foreach_sub_" for name, _ in log.calls) is found


def clean_iteration(found_inf):
    """A scaler that has seen one clean check, ``found_inf`` (a host bool or a device tensor)."""
    scaler = GradScaler("cpu", growth_interval=1)
    w = torch.ones(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.inf_check_(opt, found_inf, unscaled=False)
    return scaler


def test_a_clean_check_read_on_the_host_updates_without_an_overflows_selects():
    """TrainStep reads its decision before the step: a clean check known on the host takes ``grow_or_keep``
    (no floor, no hysteresis count-down, no skip counted), and leaves the state the device's check leaves."""
    states, ops = [], []
    for found in (False, torch.tensor(0.0)):
        scaler = clean_iteration(found)
        with OpLog() as log:
            scaler.update()
        states.append(scaler.state_dict())
        ops.append({name for name, _ in log.calls})
    assert states[0] == states[1] and states[0]["scale"] == 2.0**17  # grown: growth_interval=1
    assert not ops[0] & {"maximum", "ne", "addcmul"}  # the floor, the skip, the streak
    assert {"maximum", "ne", "addcmul"} <= ops[1]


def test_keep_if_on_the_device_keeps_the_state_after_a_clean_check_read_on_the_host():
    scaler = clean_iteration(False)
    before = scaler.state_dict()
    scaler.update(keep_if=torch.tensor(True))
    assert scaler.state_dict() == before


def test_a_fused_step_keeps_no_reference_to_the_optimizer():
    """After update() nothing in the scaler holds the optimizer (torch's doesn't): a dropped one is freed."""
    scaler, opt, w = fused_pair()[1]
    fused_iteration(scaler, opt, w, [1.0, -2.0, 0.5])
    ref = weakref.ref(opt)
    del opt  # freed by its reference count: no cycle, no gc pass
    assert ref() is None


class OldContract(torch.optim.SGD):
    """torch's older contract for _step_supports_amp_scaling: step() takes the scaler as grad_scaler=."""

    _step_supports_amp_scaling = True

    def step(self, factor=1.0, grad_scaler=None):
        self.seen = (factor, grad_scaler)


def test_an_optimizer_taking_grad_scaler_gets_the_scaler_and_the_arguments_as_from_torch():
    """The older contract: step(*args, grad_scaler=scaler), a FutureWarning, and a second step() refused."""
    for scaler in two_scalers():
        _, opt = begun(scaler, OldContract)
        with pytest.warns(FutureWarning, match="passing itself"):
            scaler.step(opt, 0.5)
        assert opt.seen == (0.5, scaler)
        with pytest.raises(RuntimeError):
            scaler.step(opt)
        with pytest.raises(RuntimeError):
            scaler.unscale_(opt)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")
@pytest.mark.parametrize("grad", [1.0, math.inf])
def test_an_optimizer_taking_grad_scaler_reports_the_inf_check_made_before_it(grad):
    """step_async hands back found_inf from an unscale_ made before (0 when none was): step() says skipped."""
    scaler = GradScaler("cpu")
    w = torch.zeros(2, requires_grad=True)
    opt = OldContract([w], lr=1.0)
    scaler.scale(w.sum())
    w.grad = torch.full((2,), grad)
    assert torch.equal(scaler.step_async(opt), torch.tensor(0.0))  # nothing checked: the optimizer decides
    scaler.update(new_scale=2.0)
    scaler.scale(w.sum())
    scaler.unscale_(opt)
    assert scaler.step(opt) is (grad != math.inf)


class ScaledSGD(torch.optim.Optimizer):
    """A minimal optimizer of torch's grad_scale/found_inf contract that takes sparse gradients."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        if self.found_inf is not None and bool(self.found_inf):
            return
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad if self.grad_scale is None else p.grad / self.grad_scale
                p.add_(g, alpha=-group["lr"])


@pytest.mark.parametrize("overflow", [False, True])
def test_sparse_gradients_of_a_self_unscaling_optimizer_are_checked_as_torch_checks_them(overflow):
    """A sparse (embedding) gradient's values are inf-checked before such an optimizer steps, as by torch."""
    torch.manual_seed(0)
    emb0 = torch.nn.Embedding(6, 2, sparse=True)
    weights = []
    for scaler in two_scalers(init_scale=8.0):
        emb = copy.deepcopy(emb0)
        opt = ScaledSGD(emb.parameters(), lr=0.1)
        loss = emb(torch.tensor([1, 1, 4])).sum() * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        weights.append(emb.weight.detach())
        assert scaler.get_scale() == (4.0 if overflow else 8.0)
    assert torch.equal(weights[0], weights[1])
    assert torch.equal(weights[1], emb0.weight) is overflow


class Failing(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self):
        raise ValueError("the optimizer failed")


def test_a_fused_step_that_raised_leaves_the_iteration_begun_as_torch_does():
    """After a self-unscaling optimizer raised in step(): no pickling (as torch), no second inf check."""
    for scaler in two_scalers():
        _, opt = begun(scaler, Failing)
        with pytest.raises(ValueError, match="the optimizer failed"):
            scaler.step(opt)
        with pytest.raises(AssertionError):
            pickle.dumps(scaler)
    with pytest.raises(RuntimeError):  # the iteration's check was made by the step that raised
        scaler.inf_check_(opt, False, unscaled=False)
    scaler.abandon_iteration()
    scaler.inf_check_(opt, False, unscaled=False)


# ---------------------------------------------------------------- the scaler's state_dict: what it refuses


def saved(**entries):
    """A state_dict from a scaler that ran, with ``entries`` replaced."""
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=4, hysteresis=2)
    scaler.scale(torch.ones(()))
    return {**scaler.state_dict(), **entries}


@pytest.mark.parametrize("key, value, error", [
    ("growth_factor", "2", TypeError), ("backoff_factor", "0.5", TypeError), ("scale", "8", TypeError),
    ("scale", 0.0, ValueError), ("scale", math.inf, ValueError), ("_growth_tracker", -1, ValueError),
    ("_growth_tracker", 2**31, ValueError), ("_hysteresis_left", -1, ValueError),
    ("_hysteresis_left", 3, ValueError), ("skip_count", -1, ValueError), ("skip_count", 2**63, ValueError),
    ("skip_streak", -1, ValueError), ("skip_streak", 1, ValueError),  # a streak longer than the count
])
def test_a_bad_state_dict_entry_is_refused_naming_it_and_nothing_is_written(key, value, error):
    """Every entry out of its range (int32 counters, an int64 skip count, hysteresis_left <= hysteresis,
    a float32-normal scale) is refused by an error that names it, before the scaler changes."""
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=4, hysteresis=2)
    scaler.scale(torch.ones(()))
    before = scaler.state_dict()
    with pytest.raises(error, match=re.escape(f"state_dict['{key}']")):
        scaler.load_state_dict(saved(**{key: value}))
    assert scaler.state_dict() == before


@pytest.mark.parametrize("count", [0, 126, 10**6, 2**63 - 1])
def test_any_int64_skip_count_is_taken(count):
    _, (scale, tracker, left, got, streak) = GradScaler.parse_state(saved(skip_count=count, skip_streak=0))
    assert (got, streak, scale, tracker, left) == (count, 0, 8.0, 0, 2)


def test_a_state_dict_lacking_entries_names_every_missing_one():
    state = saved()
    del state["scale"], state["_growth_tracker"]
    with pytest.raises(KeyError, match=r"\['_growth_tracker', 'scale'\]"):
        GradScaler.parse_state(state)


def test_torchs_state_dict_resumes_with_no_skips_counted():
    """torch's state_dict has no skip counters, no hysteresis: they start at 0 and 1, as a fresh scaler's."""
    ref = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=3)
    ref.scale(torch.ones(()))
    scaler = GradScaler("cpu")
    scaler.load_state_dict(ref.state_dict())
    assert (scaler.skip_count, scaler.skip_streak, scaler.get_scale()) == (0, 0, 64.0)
    assert scaler.state_dict()["_hysteresis_left"] == 1


class Recording(torch.optim.SGD):
    """A self-unscaling optimizer (torch's grad_scale/found_inf contract) that keeps its step's arguments."""

    _step_supports_amp_scaling = True

    def step(self, factor=1.0, *, tag=None):
        self.seen = (factor, tag)


def test_a_self_unscaling_optimizer_gets_the_steps_arguments_once_as_from_torch():
    """step(opt, *args, **kwargs) reaches the optimizer's step; a second step() or an unscale_ is refused."""
    seen = []
    for scaler in two_scalers():
        _, opt = begun(scaler, Recording)
        scaler.step(opt, 0.5, tag="x")
        seen.append(opt.seen)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.step(opt)
        with pytest.raises(RuntimeError, match="after step"):
            scaler.unscale_(opt)
    assert seen == [(0.5, "x"), (0.5, "x")]


def test_unscale_then_a_fused_step_under_a_float64_default_dtype_is_torchs():
    """unscale_'s found_inf is float32 whatever the default dtype: a fused kernel takes it after unscale_."""
    with float64_default():
        ref, ours = fused_pair()
        for g in ([1.0, -2.0, 0.5], [math.inf, 0.0, 0.0], [0.25, 1.0, -1.0]):
            for scaler, opt, w in (ref, ours):
                scaler.scale(w.sum())
                w.grad = torch.tensor(g, dtype=torch.float32)
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            assert_same_adam(ref, ours)
            assert ref[0].get_scale() == ours[0].get_scale()


def test_get_scale_async_is_a_float32_tensor_before_the_first_scale_and_one_when_disabled():
    """The documented 0-dim float32 scale, whatever the default dtype; 1.0 disabled (torch's get_scale)."""
    with float64_default():
        got = GradScaler("cpu", init_scale=2.0**-3).get_scale_async()
    assert got.dtype == torch.float32 and got.shape == () and got.item() == 2.0**-3
    off = GradScaler("cpu", enabled=False)
    assert torch.equal(off.get_scale_async(), torch.ones(())) and off.get_scale() == 1.0
    assert torch.amp.GradScaler("cpu", enabled=False).get_scale() == 1.0


@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_a_method_called_before_scale_names_itself_as_torchs_does(method):
    """unscale_()/step()/update() before scale(): the error names the method called, as torch's does."""
    for scaler in two_scalers():
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=1.0)
        with pytest.raises(AssertionError, match=method):
            if method == "unscale_":
                scaler.unscale_(opt)
            elif method == "step":
                scaler.step(opt)
            else:
                scaler.update()


@settings(max_examples=25, deadline=None, database=None)
@given(params=st.lists(st.tuples(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
                                 st.sampled_from([None, 1.0, -3.0, 1e30, math.inf, math.nan])),
                       min_size=1, max_size=4),
       scale=st.sampled_from([2.0**-120, 2.0**-10, 1.0, 2.0**16]))
def test_unscale_and_step_over_mixed_dtypes_and_missing_grads_are_torchs(params, scale):
    """Gradients of several dtypes, some None, some inf/NaN: the same skip, parameters and scale as torch."""
    out = []
    for scaler in two_scalers(init_scale=scale, growth_interval=1):
        ws = [torch.ones(2, dtype=dtype, requires_grad=True) for dtype, _ in params]
        opt = torch.optim.SGD(ws, lr=1.0)
        scaler.scale(torch.ones(()))
        for w, (dtype, g) in zip(ws, params):
            w.grad = None if g is None else torch.full((2,), g, dtype=dtype)
        if all(g is None for _, g in params):
            continue
        scaler.unscale_(opt)
        grads = [None if w.grad is None else w.grad.clone() for w in ws]
        scaler.step(opt)
        scaler.update()
        out.append((grads, [w.detach() for w in ws], scaler.get_scale()))
    if out:
        (g_ref, w_ref, s_ref), (g, w, s) = out
        assert s == s_ref
        for a, b in zip(g + w, g_ref + w_ref):
            assert (a is None and b is None) or torch.equal(a.nan_to_num(), b.nan_to_num()), (a, b)


def test_a_dead_scale_skips_a_self_unscaling_optimizer_too():
    """A dead scale (1/scale = inf) flags found_inf for a fused kernel as for a plain step: nothing moves."""
    scaler, opt, w = fused_pair()[1]
    w0 = w.detach().clone()
    scaler.scale(w.sum())
    scaler.update(new_scale=1e-40)
    scaler.scale(w.sum())
    w.grad = torch.tensor([1.0, -2.0, 0.5])
    scaler.unscale_(opt)
    assert scaler.step(opt) is False
    assert torch.equal(w, w0)
    scaler.update()
    assert scaler.get_scale() == 2.0**-126 and scaler.skip_count == 1


def test_inf_check_before_scale_names_itself():
    scaler = GradScaler("cpu")
    _, opt = begun(torch.amp.GradScaler("cpu"), torch.optim.SGD)
    with pytest.raises(AssertionError, match="inf_check_"):
        scaler.inf_check_(opt, False, unscaled=True)


@pytest.mark.parametrize("found", [True, False])
def test_a_host_decision_drives_a_fused_kernel_under_a_float64_default_dtype(found):
    """inf_check_(opt, bool)'s flag is float32 whatever the default dtype: the kernel takes it, as torch's."""
    with float64_default():
        ref, ours = fused_pair()
        grad = [math.inf, 0.0, 0.0] if found else [1.0, -2.0, 0.5]
        fused_iteration(*ref, grad)
        scaler, opt, w = ours
        scaler.scale(w.sum())
        w.grad = torch.tensor([math.inf, 0.0, 0.0] if found else [1.0, -2.0, 0.5], dtype=torch.float32)
        scaler.inf_check_(opt, found, unscaled=False)
        assert scaler.step(opt) is not found
        scaler.update()
    assert_same_adam(ref, ours)
    assert scaler.get_scale() == ref[0].get_scale()


@pytest.mark.parametrize("flag", [torch.tensor(True), torch.tensor(1, dtype=torch.int32),
                                  torch.tensor(1.0, dtype=torch.float64), torch.tensor(False),
                                  torch.tensor(0.0, dtype=torch.float64)], ids=str)
def test_inf_check_takes_a_flag_of_any_dtype_for_a_fused_kernel(flag):
    """A 0-dim bool/int/float64 found_inf reaches the kernel as float32: it skips or steps as torch's."""
    ref, ours = fused_pair()
    grad = [math.inf, 0.0, 0.0] if bool(flag) else [1.0, -2.0, 0.5]
    fused_iteration(*ref, grad)
    scaler, opt, w = ours
    scaler.scale(w.sum())
    w.grad = torch.tensor(grad)
    scaler.inf_check_(opt, flag, unscaled=False)
    assert scaler.step(opt) is not bool(flag)
    scaler.update()
    assert_same_adam(ref, ours)
    assert scaler.get_scale() == ref[0].get_scale()


def test_inf_check_unscaled_tells_a_fused_kernel_the_gradients_are_unscaled_already():
    """inf_check_(unscaled=True) is unscale_ done elsewhere: the kernel is not given the scale again."""
    ref, ours = fused_pair()
    for scaler, opt, w in (ref, ours):
        scaler.scale(w.sum())
        w.grad = torch.tensor([1.0, -2.0, 0.5]) * scaler.get_scale()
        if scaler is ref[0]:
            scaler.unscale_(opt)
        else:
            w.grad /= scaler.get_scale()
            scaler.inf_check_(opt, torch.tensor(0.0), unscaled=True)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert_same_adam(ref, ours)


def test_inf_check_of_scaled_gradients_is_refused_for_a_plain_optimizer():
    """unscaled=False: only a self-unscaling optimizer can step on the still-scaled gradients."""
    scaler = GradScaler("cpu")
    _, opt = begun(scaler, torch.optim.SGD)
    scaler.inf_check_(opt, torch.tensor(0.0), unscaled=False)
    with pytest.raises(RuntimeError, match="unscale themselves"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="fresh iteration"):
        scaler.inf_check_(opt, False, unscaled=False)


# ---------------------------------------------------------------- update_scale, the pure rule


def t32(v, dtype=torch.int32):
    return torch.tensor(v, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("found", [0, 1])
def test_update_scale_reads_found_inf_of_any_dtype_as_nonzero_on_overflow(dtype, found):
    """found_inf is "nonzero on overflow" in any dtype: the same step as with torch's float32 flag."""
    args = (t32(1024.0, torch.float32), t32(0), t32(1))
    config = labkit.ScalerConfig(growth_interval=1)
    want = labkit.update_scale(*args, t32(float(found), torch.float32), config)
    got = labkit.update_scale(*args, t32(found, dtype), config)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want)), (got, want)
    assert want[0].item() == (512.0 if found else 2048.0)


def test_update_scale_keeps_the_states_dtypes_under_a_float64_default_dtype():
    """A back-off onto the floor under a float64 default still gives a float32 scale and int32 counters."""
    with float64_default():
        # a floor of its own (2**-93): no constant made under float32 by another test is reused
        got = labkit.update_scale(t32(2.0**-92, torch.float32), t32(0), t32(1), t32(1.0, torch.float32),
                                  labkit.ScalerConfig(min_scale=2.0**-93, backoff_factor=0.25))
    assert [t.dtype for t in got] == [torch.float32, torch.int32, torch.int32]
    assert [t.item() for t in got] == [2.0**-93, 0, 0]


class PlainRecording(torch.optim.SGD):
    def step(self, factor=1.0, *, tag=None):
        self.seen = (factor, tag)
        return super().step()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_plain_optimizer_steps_with_the_arguments_as_from_torch(enabled):
    seen = []
    for scaler in two_scalers(enabled=enabled):
        _, opt = begun(scaler, PlainRecording)
        scaler.step(opt, 0.5, tag="x")
        seen.append(opt.seen)
    assert seen == [(0.5, "x"), (0.5, "x")]


@pytest.mark.parametrize("grad", [[1.0, -2.0], [math.inf, 1.0]])
def test_will_skip_before_unscale_checks_the_gradients_itself_and_step_agrees(grad):
    """will_skip on a fresh iteration unscales and checks once; step() then does what torch's step does."""
    out = []
    for scaler in two_scalers(init_scale=4.0):
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=1.0)
        scaler.scale(w.sum())
        w.grad = torch.tensor(grad) * 4.0
        if isinstance(scaler, GradScaler):
            assert scaler.will_skip(opt) is (grad[0] == math.inf)
        scaler.step(opt)
        scaler.update()
        out.append((w.detach().clone(), scaler.get_scale()))
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]


@pytest.mark.parametrize("keep_if", [False, torch.tensor(False)], ids=["host", "device"])
def test_update_with_a_false_keep_if_is_a_plain_update(keep_if):
    """keep_if False moves the scale, the tracker and the skip counters as update() without it does."""
    states = []
    for kwargs in ({}, {"keep_if": keep_if}):
        scaler = GradScaler("cpu", init_scale=64.0, growth_interval=2)
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=1.0)
        for g in (1.0, math.inf, 1.0, 1.0):
            scaler.scale(w.sum())
            w.grad = torch.full((2,), g)
            scaler.step(opt)
            scaler.update(**kwargs)
        states.append(scaler.state_dict())
    assert states[0] == states[1] and states[0]["scale"] == 64.0 and states[0]["skip_count"] == 1


def test_update_with_a_new_scale_sets_it_whatever_keep_if_says():
    scaler = GradScaler("cpu", init_scale=64.0)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=8.0, keep_if=True)
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("new_scale", [4.0, torch.tensor(4.0, dtype=torch.float64)], ids=["float", "float64"])
def test_update_with_a_new_scale_keeps_a_float32_scale_as_torchs(new_scale):
    """torch copies new_scale into its float32 scale: the scale stays a 0-dim float32 whatever is passed."""
    with float64_default():
        for scaler in two_scalers(init_scale=64.0):
            scaler.scale(torch.ones((), dtype=torch.float32))
            scaler.update(new_scale=new_scale)
            got = scaler._scale if isinstance(scaler, torch.amp.GradScaler) else scaler.get_scale_async()
            assert got.dtype == torch.float32 and got.item() == 4.0


def test_update_after_unscaling_an_optimizer_without_gradients_is_refused_as_by_torch():
    """No gradient, no inf check: update() has nothing to go on and says so, as torch's does."""
    for scaler in two_scalers():
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=1.0)
        scaler.scale(w.sum())
        scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="No inf checks were recorded"):
            scaler.update()


def test_a_scaler_without_a_device_takes_the_losss():
    """device=None (labkit's default): the state is made on the first loss's device, and it scales."""
    scaler = GradScaler(init_scale=4.0)
    assert torch.equal(scaler.scale(torch.ones(3)), torch.full((3,), 4.0))
    assert scaler.get_scale_async().device == torch.device("cpu")


def test_float32s_largest_number_is_a_valid_scale():
    """The scale is a float32: any finite float32 > 0 in the normal range is taken, the largest too."""
    big = torch.finfo(torch.float32).max
    scaler = GradScaler("cpu", init_scale=big)
    assert scaler.get_scale() == big
    scaler.load_state_dict(saved(scale=big))
    assert scaler.get_scale() == big


def test_a_non_number_init_scale_is_refused_naming_it():
    with pytest.raises(TypeError, match="init_scale must be a number"):
        GradScaler("cpu", init_scale="8")


@pytest.mark.parametrize("name", ["growth_factor", "backoff_factor", "min_scale", "max_scale"])
def test_a_non_number_setting_is_refused_naming_it(name):
    with pytest.raises(TypeError, match=f"{name} must be a number"):
        labkit.ScalerConfig(**{name: "0.5"})


def test_the_config_takes_its_documented_extremes_and_refuses_past_them():
    """backoff >= 2**-24 (below: a reset); bounds in float32's normal range; int32 counters (<= 2**31-1)."""
    assert labkit.ScalerConfig(backoff_factor=2.0**-24).backoff_factor == 2.0**-24
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    config = labkit.ScalerConfig(min_scale=tiny, max_scale=big)  # float32's normal range, ends included
    assert (config.min_scale, config.max_scale) == (tiny, big)
    with pytest.raises(ValueError, match="below 2"):
        labkit.ScalerConfig(backoff_factor=2.0**-25)
    for name in ("growth_interval", "hysteresis"):
        assert getattr(labkit.ScalerConfig(**{name: 2**31 - 1}), name) == 2**31 - 1
        with pytest.raises(ValueError, match=name):
            labkit.ScalerConfig(**{name: 2**31})


# ------------------------------------------------------------- the norms against torch's, any dtype and order


F32, F64 = torch.float32, torch.float64
# summed in the parameters' order, these totals (order 0.5, order 2) differed from torch's in the last bit
MIXED = [[340.13630263058826, -596.0173824010928, 219.54122083356083], [-980.5906811323717],
         [925.1329265093634, 798.0160760620151, 636.2367618355881], [50.21476966689329],
         [205.17342961082704, -688.1892704615993]]
MIXED_L2 = [[-921.2966269416163, -639.2212174873324], [-559.8990004049917, 680.9180210693573],
            [868.9217768922977, -360.80600329236484], [-785.4292458734801, 799.2512626276282],
            [82.15139491912282, -597.6299090524324, -406.7174974461742],
            [28.070935676543286, -75.84511434785998]]


@settings(max_examples=60, deadline=None, database=None)
@given(dtypes=st.lists(st.sampled_from([F32, F64]), min_size=6, max_size=6),
       tensors=st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=3), min_size=1,
                        max_size=6),
       norm_type=st.sampled_from([1.0, 2.0, 3.0, 0.0, math.inf, -math.inf, 0.5]),
       max_norm=st.sampled_from([1e-3, 1.0, 1e6]), foreach=st.sampled_from([None, False, True]))
@example(dtypes=[F64, F64, F64, F32, F32, F32], norm_type=0.5, max_norm=1.0, foreach=None,
         tensors=MIXED)
@example(dtypes=[F64, F64, F32, F32, F32, F32], norm_type=2.0, max_norm=1e6, foreach=False,
         tensors=MIXED_L2)
def test_norms_and_clipping_are_torchs_over_any_mix_of_float32_and_float64(
    dtypes, tensors, norm_type, max_norm, foreach
):
    """get_total_norm, grad_norm, clip_grad_norm_ over float32 and float64 gradients, any mix: torch's bits.

    torch sums the norms group by group (by device and dtype), not in the parameters' order: a sum's
    rounding depends on its order, and at some orders (0.5) the last bit differed before labkit did so too.
    """
    dtypes = dtypes[:len(tensors)]
    ours, theirs = params_from_values(tensors, dtypes), params_from_values(tensors, dtypes)
    want_total = torch.nn.utils.get_total_norm([p.grad for p in theirs], norm_type, foreach=foreach)
    got_total = labkit.get_total_norm([p.grad for p in ours], norm_type, foreach=foreach)
    assert got_total.dtype == want_total.dtype and torch.equal(got_total, want_total)
    assert torch.equal(labkit.grad_norm(ours, norm_type, foreach=foreach), want_total)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=foreach)
    got = labkit.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
    assert torch.equal(got, want)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad), (p.grad, q.grad)


@pytest.mark.parametrize("scale", [None, 2.0**-3, 2.0**10])
@pytest.mark.parametrize("dtypes", [[F64, F64, F32, F32, F32, F32], [F32, F64, F32, F64, F32, F64]],
                         ids=["64-then-32", "mixed"])
def test_the_steps_unscaled_global_norm_over_mixed_dtypes_is_torchs(dtypes, scale):
    """The step's 2-norm (scaled norms times 1/scale, summed as torch groups them) is torch's after unscale_.

    Order 2 and a power-of-two scale: scaling by s scales each square by s**2, exactly, so the norm of the
    scaled gradients times 1/s is the unscaled gradients' norm, bit for bit, in any one summation order.
    """
    from labkit.step.decision import unscaled_norms

    s = 1.0 if scale is None else scale
    scaled = [p.grad for p in params_from_values([[v * s for v in row] for row in MIXED_L2], dtypes)]
    unscaled = [g.clone() for g in scaled]
    torch._amp_foreach_non_finite_check_and_unscale_(  # torch's unscale_, one dtype group at a time
        [g for g in unscaled if g.dtype == F32], torch.zeros(1), torch.full((1,), 1 / s))
    torch._amp_foreach_non_finite_check_and_unscale_(
        [g for g in unscaled if g.dtype == F64], torch.zeros(1), torch.full((1,), 1 / s))
    want = torch.nn.utils.get_total_norm(unscaled, 2.0)
    _, got, _ = unscaled_norms(scaled, None if scale is None else torch.tensor(scale), 2.0)
    assert torch.equal(got, want), (got.item(), want.item())


@pytest.mark.parametrize("p", [1.0, 2.0, 4.0, math.inf])
def test_norm_orders_up_to_4_and_inf_are_taken_with_a_scaler(p):
    """The documented orders for scaled gradients: p <= 4 (65504**4 stays finite in float32) and inf."""
    assert check_scaled_norm_type(p) == p


@pytest.mark.parametrize("p", [4.5, 16.0])
def test_norm_orders_above_4_are_refused_with_a_scaler(p):
    with pytest.raises(ValueError, match="norm_type"):
        check_scaled_norm_type(p)


@FAST
@given(x=st.one_of(st.floats(allow_nan=False), st.sampled_from([3.5e38, -3.5e38, 1e39, -1e300, 3.402824e38])))
def test_round_to_float32_is_a_float32_tensors_value(x):
    """round_to(x, float32) is what a float32 tensor of x holds: the nearest float32, +-inf past the range."""
    assert round_to(x, torch.float32) == torch.tensor(x, dtype=torch.float32).item()
    assert round_to(x, torch.float64) == x


def test_per_tensor_norms_passes_foreach_on_where_a_device_has_no_foreach_norm():
    """foreach=True on a device without a foreach norm (here: meta) is refused, as torch's get_total_norm
    refuses it; left to choose (None), the per-tensor norm is taken."""
    from labkit.clip import per_tensor_norms

    grads = [torch.ones(3, device="meta")]
    with pytest.raises(RuntimeError, match="no foreach norm on meta"):
        per_tensor_norms(grads, 2.0, foreach=True)
    assert per_tensor_norms(grads, 2.0).shape == (1,)


@pytest.mark.parametrize("clipper", ["NormClip", "ZClip"])
def test_a_clippers_own_clip_over_mixed_dtypes_reports_torchs_norm(clipper):
    """Clipper.clip_ (a plain loop's call) sums the per-tensor norms as torch does: float64's group first."""
    from labkit.clippers import NormClip, ZClip

    dtypes = [F64, F64, F32, F32, F32, F32]
    ours = params_from_values(MIXED_L2, dtypes)
    want = torch.nn.utils.get_total_norm([p.grad for p in params_from_values(MIXED_L2, dtypes)])
    clip = NormClip(1e6) if clipper == "NormClip" else ZClip()
    assert torch.equal(clip.clip_(ours), want)


class Tagged(torch.Tensor):
    """A tensor subclass (as a library's gradient may be): the grouped path, not the one-call fast path."""


def test_gradients_of_a_tensor_subclass_are_scaled_by_the_grouped_path_all_the_same():
    from labkit.clip import scale_grads_

    sub = torch.tensor([2.0, 4.0]).as_subclass(Tagged)
    plain = torch.tensor([1.0])
    scale_grads_([sub, plain], torch.tensor(0.5))
    assert sub.tolist() == [1.0, 2.0] and plain.tolist() == [0.5]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_norms_clip_coefficient_is_torchs_near_its_epsilon(dtype):
    """fp16/bf16 norms take torch's 1e-6 as a Python number: at a norm of 2e-5 it moves the coefficient."""
    norm = torch.tensor(2e-5, dtype=dtype)
    grad = torch.ones(1, dtype=dtype)
    p = torch.zeros(1, dtype=dtype, requires_grad=True)
    p.grad = grad
    torch.nn.utils.clip_grads_with_norm_([p], 1e-5, norm)
    assert clip_coef(norm, 1e-5).to(dtype).item() == p.grad.item()


def test_no_gradients_have_no_per_tensor_norms_and_a_zero_total():
    from labkit.clip import grouped_norms

    norms, order = grouped_norms([], 2.0)
    assert norms.shape == (0,) and order is None and total_norm(norms, 2.0).item() == 0.0


def test_a_float64_threshold_on_a_float32_norm_still_never_scales_up():
    """A float64 adaptive threshold against a float32 norm: the coefficient is min(1, ...), in float64."""
    coef = clip_coef(torch.tensor(0.5), torch.tensor(1.0, dtype=torch.float64))
    assert coef.dtype == torch.float64 and coef.item() == 1.0
    assert clip_coef(torch.tensor(4.0), torch.tensor(1.0, dtype=torch.float64)).item() == pytest.approx(0.25)
