"""PyTorch's own GradScaler and clip_grad_norm_ tests, ported to the CPU and run on torch and on labkit.

Every case is parametrized over ``impl`` (``torch`` or ``labkit``): torch is the oracle, and a
case that passes for torch must pass for labkit. Where a torch test calls a private helper
(``scaler._unscale_grads_``, ``_amp_update_scale_``), the port asks the same question through
the public API. Sizes are torch's (8x8 models, 4 batches). Sources (pytorch/pytorch, main):

* ``test/test_torch.py`` (``TestTorchDeviceType``): ``test_grad_scaling_unscale``,
  ``test_grad_scaling_update_scale``, ``test_grad_scaling_unscale_sparse``,
  ``test_grad_scaling_state_dict``, ``test_grad_scaling_autocast`` (with its ``try_pickle``
  second run), ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``,
  ``test_grad_scale_will_not_overflow``, ``test_grad_scaling_clipping``,
  ``test_grad_scaling_clipping_separate_unscale``, ``test_grad_scaling_penalty``,
  ``test_grad_scaling_accumulation``, ``test_grad_scaling_multiple``,
  ``test_grad_scaler_pass_itself``; their helpers ``_run_scaling_case`` and
  ``torch/testing/_internal/common_cuda.py``'s ``_create_scaling_case``.
* ``test/test_optim.py`` (``TestOptimRenewed``): ``test_grad_scaling_autocast_fused_optimizers``
  (Adagrad, Adam, AdamW, SGD; fused against foreach, with and without a separate ``unscale_``).
* ``test/test_nn.py`` (``TestNNDeviceType``): ``test_clip_grad_norm``,
  ``test_clip_grad_norm_error_if_nonfinite``.
* ``torch/amp/grad_scaler.py``: the misuse errors (``AssertionError`` in torch).

Deliberate deviations (docs/defenses.md, "Where labkit differs from torch on purpose"), each asserted
here for labkit and, for contrast, for torch: a non-finite norm leaves the gradients
unchanged (torch scales them into NaN/zeros); fp16/bf16 norms are float32.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import inf, nan

import labkit

DEVICE = "cpu"
IMPLS = {
    "torch": SimpleNamespace(
        GradScaler=partial(torch.amp.GradScaler, DEVICE), clip_grad_norm_=torch.nn.utils.clip_grad_norm_,
        scaler_type=torch.amp.GradScaler,
    ),
    "labkit": SimpleNamespace(
        GradScaler=partial(labkit.GradScaler, DEVICE), clip_grad_norm_=labkit.clip_grad_norm_,
        scaler_type=labkit.GradScaler,
    ),
}
impls = pytest.mark.parametrize("impl", list(IMPLS))


def create_scaling_models_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """common_cuda._create_scaling_models_optimizers, on the CPU."""
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return mod_control, mod_scaling, optimizer_ctor(mod_control.parameters(), **kwargs), optimizer_ctor(
        mod_scaling.parameters(), **kwargs
    )


def create_scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """common_cuda._create_scaling_case: 4 batches of 8x8, MSE, inf injected at iteration 2."""
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (*create_scaling_models_optimizers(optimizer_ctor, optimizer_kwargs), data, torch.nn.MSELoss(), 2)


def run_scaling_case(
    impl, run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
    """test_torch.py's _run_scaling_case: the scaled run must match an unscaled control run."""
    for enabled in (True, False):
        torch.manual_seed(0)
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = create_scaling_case(
            optimizer_ctor, optimizer_kwargs
        )
        scaler = impl.GradScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * net_growth * net_backoff
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                torch.testing.assert_close(c_state[k], s_state[k], atol=atol, rtol=1e-5, msg=k)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- test_torch.py: unscale, update, sparse


@impls
@pytest.mark.parametrize("inject_inf", range(-1, 4))
def test_grad_scaling_unscale(impl, inject_inf):
    """test_grad_scaling_unscale: contiguous, transposed and sliced grads; an inf anywhere is found.

    torch asks ``scaler._unscale_grads_``; here the public ``unscale_`` then ``update``:
    the scale halves exactly when an inf was injected.
    """
    impl = IMPLS[impl]
    g = torch.full((20, 20), 4.0)
    grads = [g.clone(), g.clone().t().contiguous().t(), g.clone()[:, :5], g.clone()[:, :5]]
    if inject_inf >= 0:
        grads[inject_inf][2, 2] = inf
    params = [torch.empty_like(x) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = impl.GradScaler(init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    if inject_inf < 0:
        for x in grads:
            torch.testing.assert_close(x, torch.ones_like(x), rtol=1e-5, atol=1e-7)
    scaler.update()
    assert scaler.get_scale() == (2.0 if inject_inf >= 0 else 4.0)


@impls
def test_grad_scaling_unscale_refuses_fp16_grads(impl):
    """test_grad_scaling_unscale's fp16 grads take the private allow_fp16 path; unscale_ refuses them."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    p.grad = torch.full((3,), 4.0, dtype=torch.float16)
    scaler = IMPLS[impl].GradScaler(init_scale=4.0)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([p], lr=1.0))


def _torch_update(scale, tracker, found_inf, growth, backoff, interval):
    torch._amp_update_scale_(scale, tracker, found_inf, growth, backoff, interval)


def _labkit_update(scale, tracker, found_inf, growth, backoff, interval):
    config = labkit.ScalerConfig(growth, backoff, interval)
    hyst = torch.ones((), dtype=torch.int32)
    new_scale, new_tracker, _ = labkit.update_scale(
        scale.reshape(()), tracker.reshape(()), hyst, found_inf.reshape(()), config
    )
    scale.copy_(new_scale.reshape(scale.shape))
    tracker.copy_(new_tracker.reshape(tracker.shape))


@pytest.mark.parametrize("update", [_torch_update, _labkit_update], ids=["torch", "labkit"])
def test_grad_scaling_update_scale(update):
    """test_grad_scaling_update_scale: torch's _amp_update_scale_ kernel against labkit.update_scale."""
    growth, backoff, interval = 2.0, 0.25, 2
    scale = torch.full((1,), 4.0)
    tracker = torch.full((1,), 0, dtype=torch.int32)
    found_inf = torch.full((1,), 0.0)
    update(scale, tracker, found_inf, growth, backoff, interval)  # no inf: tracker 1, scale unchanged
    assert tracker.item() == 1 and scale.item() == 4.0
    update(scale, tracker, found_inf, growth, backoff, interval)  # interval reached: grow, reset
    assert tracker.item() == 0 and scale.item() == 8.0
    found_inf.fill_(1.0)
    update(scale, tracker, found_inf, growth, backoff, interval)  # inf: back off, reset
    assert tracker.item() == 0 and scale.item() == 2.0


@impls
def test_grad_scaling_unscale_sparse(impl):
    """test_grad_scaling_unscale_sparse (its float32 part; the fp16 part needs the private allow_fp16)."""
    impl = IMPLS[impl]
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], dtype=torch.int64)
    s = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), (2, 3), check_invariants=True)
    for last, has_inf in ((64.0, False), (inf, True), (nan, True)):
        p = s.clone()
        opt = torch.optim.SGD([p], lr=1.0)
        p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, last]), (2, 3))
        scaler = impl.GradScaler(init_scale=4.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        if not has_inf:
            assert torch.equal(p.grad.to_dense(), (s / 4).to_dense())
        scaler.update()
        assert scaler.get_scale() == (2.0 if has_inf else 4.0)


# ---------------------------------------------------------------- state_dict, pickle, overflow


@impls
@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(impl, lazy_init_scale):
    """test_grad_scaling_state_dict (public getters; torch also peeks at _init_growth_tracker)."""
    impl = IMPLS[impl]
    s0 = impl.GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = impl.GradScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1.state_dict()["_growth_tracker"] == 0


@impls
def test_grad_scaling_pickle_only_between_iterations(impl):
    """torch/amp/grad_scaler.py __getstate__: pickling mid-iteration raises AssertionError."""
    impl = IMPLS[impl]
    scaler = impl.GradScaler(init_scale=8.0, growth_interval=1)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="pickled"):
        pickle.dumps(scaler)
    scaler.step(opt)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == scaler.get_scale() == 16.0


@impls
def test_grad_scale_will_not_overflow(impl):
    """test_grad_scale_will_not_overflow: growing 1e38 by 16 keeps the scale finite."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = IMPLS[impl].GradScaler(growth_interval=1, growth_factor=2**4, init_scale=1e38)
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert math.isfinite(scaler.get_scale())


# ---------------------------------------------------------------- the _run_scaling_case family


@impls
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("foreach, fused", [(None, None), (True, None), (None, True)],
                         ids=["default", "foreach", "fused"])
def test_grad_scaling_autocast(impl, optimizer_ctor, foreach, fused):
    """test_grad_scaling_autocast: fp16 autocast + scaler vs an fp32 control, then again pickling each
    iteration."""
    impl = IMPLS[impl]
    try_pickle = False

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=DEVICE, dtype=torch.half, enabled=try_scaling_api):
                loss = loss_fn(model(input), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(inf)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    kwargs = {"lr": 1.0 if optimizer_ctor is torch.optim.SGD else 0.01, "foreach": foreach, "fused": fused}
    run_scaling_case(impl, run, 3, 1, atol=1e-3, optimizer_ctor=optimizer_ctor, optimizer_kwargs=kwargs)
    if foreach is None and fused is None:  # the pickling rerun once per optimizer, to keep the suite fast
        try_pickle = True
        run_scaling_case(impl, run, 3, 1, atol=1e-3, optimizer_ctor=optimizer_ctor, optimizer_kwargs=kwargs)


@impls
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "kwargs",
    [{"foreach": False, "fused": False}, {"foreach": True, "fused": False},
     {"foreach": False, "fused": True}],
    ids=["forloop", "foreach", "fused"],
)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(impl, optimizer_ctor, kwargs):
    """_test_grads_invalidated_between_unscale_and_step: the check is the one made at unscale_."""
    torch.manual_seed(0)
    model, _, optimizer, _, data, loss_fn, _ = create_scaling_case(optimizer_ctor, kwargs)
    scaler = IMPLS[impl].GradScaler(init_scale=128.0)
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type=DEVICE, dtype=torch.half):
            loss = loss_fn(model(input), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(inf if j % 2 else nan)
        scaler.step(optimizer)
        scaler.update()
    assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())


@impls
def test_grad_scaling_clipping(impl):
    """test_grad_scaling_clipping: clip the scaled grads to max_norm * scale."""
    impl = IMPLS[impl]

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                impl.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(inf)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                impl.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    run_scaling_case(impl, run, 3, 1, atol=1e-5)


@impls
def test_grad_scaling_clipping_separate_unscale(impl):
    """test_grad_scaling_clipping_separate_unscale: unscale_, then clip the true gradients."""
    impl = IMPLS[impl]

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(inf)
                scaler.unscale_(optimizer)
                impl.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                impl.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    run_scaling_case(impl, run, 3, 1)


@impls
def test_grad_scaling_penalty(impl):
    """test_grad_scaling_penalty: a gradient penalty through autograd.grad of the scaled loss."""
    impl = IMPLS[impl]

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = sum(g.pow(2).sum() for g in grad_params).sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(inf)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    run_scaling_case(impl, run, 3, 1)


@impls
def test_grad_scaling_accumulation(impl):
    """test_grad_scaling_accumulation: two micro-batches per step."""
    impl = IMPLS[impl]

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            loss = loss_fn(model(input), target) / iters_to_accumulate
            (scaler.scale(loss) if try_scaling_api else loss).backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(impl, run, 2, 0)


@impls
@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaling_multiple(impl, enabled):
    """test_grad_scaling_multiple: 2 models, 2 optimizers, 2 losses; the inf in one skips only its
    optimizer."""
    impl = IMPLS[impl]
    torch.manual_seed(0)
    mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = create_scaling_case()
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = create_scaling_models_optimizers()
    scaler = impl.GradScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            output0, output1 = model0(input), model1(input)
            loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
            loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    model1[1].weight.grad.data.fill_(inf)
                scaler.unscale_(optimizer0)
                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
    assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
    controls = itertools.chain(mod_control0.parameters(), mod_control1.parameters())
    scalings = itertools.chain(mod_scaling0.parameters(), mod_scaling1.parameters())
    for c, s in zip(controls, scalings):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


@impls
def test_grad_scaler_pass_itself(impl):
    """test_grad_scaler_pass_itself: _step_supports_amp_scaling optimizers get grad_scaler= or
    grad_scale/found_inf."""
    impl = IMPLS[impl]
    seen = {}

    class PlaceHolder(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class Optimizer1(PlaceHolder):
        def step(self, closure=None, *, grad_scaler=None):
            seen["1"] = (grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf"))

    class Optimizer2(PlaceHolder):
        def step(self, closure=None):
            seen["2"] = (self.grad_scale, self.found_inf)

    m = torch.nn.Linear(4, 1)
    o1, o2 = Optimizer1(m.parameters()), Optimizer2(m.parameters())
    scaler = impl.GradScaler(init_scale=2.0)
    with torch.autocast(device_type=DEVICE, dtype=torch.half):
        loss = m(torch.randn(4, 4)).mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert isinstance(seen["1"][0], impl.scaler_type) and seen["1"][1:] == (False, False)
    grad_scale, found_inf = seen["2"]
    assert isinstance(grad_scale, torch.Tensor) and grad_scale.item() == 2.0
    assert isinstance(found_inf, torch.Tensor) and found_inf.item() == 0.0
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")


# ---------------------------------------------------------------- test_optim.py: fused optimizers

FUSED_CASES = {
    # a few of test_optim.py's optim_inputs per optimizer, at torch's sizes
    "SGD": (torch.optim.SGD, [{"lr": 0.1},
                              {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1, "dampening": 0.5}]),
    "Adam": (torch.optim.Adam, [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "amsgrad": True}]),
    "AdamW": (torch.optim.AdamW, [
        {"lr": 0.01, "amsgrad": True},
        {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.99))},
    ]),
    "Adagrad": (torch.optim.Adagrad, [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.1, "lr_decay": 0.01}]),
}


@impls
@pytest.mark.parametrize("name", list(FUSED_CASES))
@pytest.mark.parametrize("separate_unscale", [True, False])
def test_grad_scaling_autocast_fused_optimizers(impl, name, separate_unscale):
    """test_optim.py test_grad_scaling_autocast_fused_optimizers: fused (unscales in its kernel) = foreach."""
    impl = IMPLS[impl]
    optim_cls, inputs = FUSED_CASES[name]
    for kwargs in inputs:
        torch.manual_seed(20)
        mod_control, mod_scaling, _, opt_scaling, data, loss_fn, _ = create_scaling_case(
            optim_cls, {**kwargs, "fused": True}
        )
        # torch refuses a Tensor lr with foreach (and capturable=False)
        foreach = not torch.is_tensor(kwargs["lr"])
        opt_control = optim_cls(mod_control.parameters(), **{**copy.deepcopy(kwargs), "foreach": foreach})
        scaler_scaling, scaler_control = impl.GradScaler(init_scale=128.0), impl.GradScaler(init_scale=128.0)
        betas = opt_control.param_groups[0].get("betas")
        tol = {"atol": 2e-5, "rtol": 2e-5} if betas is not None and not torch.is_tensor(betas[0]) else {}
        for input, target in data:
            for model, opt, scaler, separate in (
                (mod_control, opt_control, scaler_control, False),
                (mod_scaling, opt_scaling, scaler_scaling, separate_unscale),
            ):
                opt.zero_grad()
                with torch.autocast(device_type=DEVICE, dtype=torch.half):
                    loss = loss_fn(model(input), target)
                scaler.scale(loss).backward()
                if separate:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            # torch's TensorTracker.pop_check_set: check, then set the fused side to the control's values
            # so that rounding differences do not compound over the iterations
            with torch.no_grad():
                for pc, ps in zip(mod_control.parameters(), mod_scaling.parameters()):
                    torch.testing.assert_close(ps.grad, pc.grad)
                    ps.grad.copy_(pc.grad)
                    torch.testing.assert_close(ps, pc, **tol)
                    ps.copy_(pc)
                    for k, v in opt_control.state[pc].items():
                        actual = opt_scaling.state[ps][k]
                        torch.testing.assert_close(actual.squeeze() if k == "step" else actual, v,
                                                   **(tol if k in ("exp_avg_sq", "max_exp_avg_sq") else {}))
                        actual.copy_(v.reshape(actual.shape))


# ---------------------------------------------------------------- test_nn.py: clip_grad_norm_


@impls
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("norm_type", [0.5, 1.5, 2, 4, "inf"])
def test_clip_grad_norm(impl, foreach, norm_type):
    """test_nn.py test_clip_grad_norm: clips to max_norm, uniform scaling, small grads untouched, warnings."""
    clip_grad_norm_ = IMPLS[impl].clip_grad_norm_
    torch.manual_seed(0)
    layer = torch.nn.Linear(10, 10)
    max_norm = 2

    def compute_norm(norm_type):
        norm_type = float(norm_type)
        if norm_type != inf:
            return pow(sum(p.grad.abs().pow(norm_type).sum() for p in layer.parameters()), 1.0 / norm_type)
        return max(p.grad.abs().max() for p in layer.parameters())

    def compare_scaling(grads):
        scale = torch.cat([p.grad.div(g).view(-1) for p, g in zip(layer.parameters(), grads)])
        assert scale.std().item() == pytest.approx(0.0, abs=1e-6)
        return scale[0]

    grads = torch.arange(1.0, 101).view(10, 10), torch.ones(10).div(1000)
    for p, g in zip(layer.parameters(), grads):
        p._grad = g.clone().view_as(p.data)
    norm_before = compute_norm(norm_type)
    norm = clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    torch.testing.assert_close(norm, norm_before)
    torch.testing.assert_close(norm_after, torch.tensor(float(max_norm)))
    assert norm_after <= norm_before
    compare_scaling(grads)

    grads = torch.rand(10, 10).div(10000), torch.ones(10).div(500)
    for p, g in zip(layer.parameters(), grads):
        p.grad.data.copy_(g)
    norm_before = compute_norm(norm_type)
    norm = clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    torch.testing.assert_close(norm, norm_before)
    torch.testing.assert_close(norm_before, norm_after)
    assert norm_after <= max_norm
    assert compare_scaling(grads) == 1

    p1, p2 = torch.randn(10, 10), torch.randn(10, 10)
    g = torch.arange(1.0, 101).view(10, 10)
    p1._grad, p2._grad = g.clone(), g.clone()
    clip_grad_norm_(p1, max_norm, norm_type=norm_type, foreach=foreach)
    clip_grad_norm_([p2], max_norm, norm_type=norm_type, foreach=foreach)
    assert torch.equal(p1.grad, p2.grad)

    params = layer.parameters()
    for _ in params:
        pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)
    assert [str(x.message) for x in w] == [
        "`parameters` is an empty generator, no gradient clipping will occur."
    ]


NORMS_POS = [0.1, 1, 2, 3.5, inf]
NORMS_NEG = [-0.1, -1, -2, -3.5]
NORMS_EXCEPT_0 = NORMS_POS + NORMS_NEG
NORMS_ALL = NORMS_EXCEPT_0 + [0]
# (grad_only_one_elem, prefix_finite_grad_param, scalars, norms_nonfinite, norms_finite): torch's table
NONFINITE_CASES = [
    (False, False, [inf, -inf], NORMS_EXCEPT_0, [0]),
    (False, True, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    (True, False, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    (True, True, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    (False, False, [nan], NORMS_EXCEPT_0, [0]),
    (False, True, [nan], NORMS_EXCEPT_0, [0]),
    (True, False, [nan], NORMS_EXCEPT_0, [0]),
    (True, True, [nan], NORMS_EXCEPT_0, [0]),
    (False, False, [2e22, -2e22], [], NORMS_ALL),
    (False, True, [2e22, -2e22], [], NORMS_ALL),
    (True, False, [2e22, -2e22], [], NORMS_ALL),
    (True, True, [2e22, -2e22], [], NORMS_ALL),
    (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [inf, 1, 0.1, 0, -1, -0.1]),
    (False, True, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
    (True, False, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
    (True, True, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
]


def _gen_parameters(scalar, grad_only_one_elem, prefix_finite_grad_param):
    param = torch.ones(10, dtype=torch.float64, requires_grad=True)
    (param[1] if grad_only_one_elem else param).mul(scalar).sum().backward()
    if prefix_finite_grad_param:
        prefix = torch.ones(1, dtype=torch.float64, requires_grad=True)
        prefix.mul(1).sum().backward()
        return [prefix, param]
    return [param]


@impls
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", range(len(NONFINITE_CASES)))
def test_clip_grad_norm_error_if_nonfinite(impl, foreach, case):
    """test_nn.py test_clip_grad_norm_error_if_nonfinite: raise exactly when the float64 norm is non-finite.

    torch's table, on float64 gradients. With error_if_nonfinite=True a non-finite norm raises
    (message starts "The total norm of order {p} for gradients") and leaves the gradients as
    they were; otherwise no error, and the returned norm's finiteness is the table's.
    """
    clip_grad_norm_ = IMPLS[impl].clip_grad_norm_
    grad_only_one_elem, prefix, scalars, norms_nonfinite, norms_finite = NONFINITE_CASES[case]
    runs = [(n, s, True) for n, s in itertools.product(norms_nonfinite, scalars)]
    runs += [(n, s, False) for n, s in itertools.product(norms_finite, scalars)]
    for norm_type, scalar, is_norm_nonfinite in runs:
        for error_if_nonfinite in (False, True):
            parameters = _gen_parameters(scalar, grad_only_one_elem, prefix)
            msg = f"norm_type={norm_type} scalar={scalar} error_if_nonfinite={error_if_nonfinite}"
            if is_norm_nonfinite and error_if_nonfinite:
                before = [p.grad.clone() for p in parameters]
                with pytest.raises(
                    RuntimeError, match=f"The total norm of order {float(norm_type)} for gradients"
                ):
                    clip_grad_norm_(
                        parameters, 1, norm_type=norm_type, error_if_nonfinite=True, foreach=foreach
                    )
                for b, p in zip(before, parameters):
                    torch.testing.assert_close(p.grad, b, equal_nan=True, msg=msg)
            else:
                norm = clip_grad_norm_(
                    parameters, 1, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
                )
                assert bool(norm.isfinite()) is not is_norm_nonfinite, msg


# ---------------------------------------------------------------- misuse errors (torch/amp/grad_scaler.py)


def _prepared(impl):
    scaler = impl.GradScaler(init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    return scaler, opt


MISUSES = {
    "unscale-before-scale": lambda impl: impl.GradScaler().unscale_(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])),
    "update-before-scale": lambda impl: impl.GradScaler().update(),
    "update-without-inf-checks": lambda impl: _prepared(impl)[0].update(),
    "growth-factor-1": lambda impl: impl.GradScaler(growth_factor=1.0),
    "backoff-factor-1": lambda impl: impl.GradScaler(backoff_factor=1.0),
    "new-scale-2-elements": lambda impl: _prepared(impl)[0].update(torch.ones(2)),
    "new-scale-requires-grad": lambda impl: _prepared(impl)[0].update(torch.ones(1, requires_grad=True)),
}


@impls
@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_assertion_error_like_torch(impl, misuse):
    """torch raises AssertionError here; code catching it keeps working with labkit (whose errors are
    both)."""
    impl = IMPLS[impl]
    with pytest.raises(AssertionError):
        MISUSES[misuse](impl)


@pytest.mark.parametrize("misuse, kind", [
    ("unscale-before-scale", RuntimeError), ("update-without-inf-checks", RuntimeError),
    ("growth-factor-1", ValueError), ("new-scale-2-elements", ValueError),
])
def test_labkit_misuse_errors_keep_their_own_class(misuse, kind):
    with pytest.raises(kind):
        MISUSES[misuse](IMPLS["labkit"])


@impls
def test_step_without_gradients_raises_no_inf_checks(impl):
    """torch/amp/grad_scaler.py step(): an optimizer none of whose parameters has a grad."""
    impl = IMPLS[impl]
    scaler = impl.GradScaler()
    scaler.scale(torch.ones((), requires_grad=True)).backward()
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.step(torch.optim.SGD([w], lr=0.1))
    assert torch.equal(w, torch.ones(2))


# ---------------------------------------------------------------- deliberate deviations


@pytest.mark.parametrize("bad", [inf, nan])
def test_deviation_nonfinite_norm_leaves_grads_unchanged(bad):
    """torch scales the gradients by max_norm / (inf or NaN): zeros or NaN. labkit leaves them as they
    were."""
    def grads():
        w = torch.nn.Parameter(torch.ones(3))
        w.grad = torch.tensor([1.0, bad, 2.0])
        return w
    ours, theirs = grads(), grads()
    labkit.clip_grad_norm_([ours], 1.0)
    torch.nn.utils.clip_grad_norm_([theirs], 1.0)
    torch.testing.assert_close(ours.grad, torch.tensor([1.0, bad, 2.0]), equal_nan=True)
    assert not torch.equal(torch.nan_to_num(theirs.grad), torch.nan_to_num(ours.grad))


def test_deviation_fp16_norm_is_float32():
    """torch's fp16 norm of 300 values of 60000 is inf (fp16) and zeroes the grads; labkit's is 1.039e6 in
    fp32."""
    w = torch.nn.Parameter(torch.ones(300, dtype=torch.float16))
    w.grad = torch.full((300,), 60000.0, dtype=torch.float16)
    assert torch.nn.utils.get_total_norm([w.grad]).isinf()
    norm = labkit.clip_grad_norm_([w], 1.0)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(60000.0 * math.sqrt(300), rel=1e-4)
