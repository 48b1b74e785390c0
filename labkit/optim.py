"""Adam's update-RMS signal and update clipping (StableAdamW): what a gradient norm cannot see.

Adam divides each coordinate's step by ``sqrt(v_hat)``, a running average of past squared
gradients. When a gradient arrives that is large *for that average* (``v_hat`` under-estimates
``g**2``), the step is large however small the gradient's norm is. Wortsman et al. 2023b
(*Stable and low-precision training for large-scale vision-language models*, arXiv 2304.13013)
measure that per tensor as ``RMS_t = sqrt(mean(g_t**2 / max(v_hat_t, eps**2)))``, find
loss spikes 1-8 steps after it jumps, and clip the update with it (Algorithm 2, StableAdamW:
Adafactor's update clipping, Shazeer & Stern 2018, ported to AdamW). Because ``v_hat_t``
already contains ``g_t``, ``(1 - beta2) * g_t**2 <= v_t`` caps every coordinate's ratio at
``(1 - beta2**t) / (1 - beta2)``: the RMS is at most ``1 / sqrt(1 - beta2)`` (10 for 0.99),
and it reaches that cap when the gradient is entirely new to ``v``.

``update_rms`` is the rule, a pure function of one tensor's gradient and second moment;
``read_update_rms`` reads it from an Adam-family optimizer's own state after its step;
``StableAdamW`` clips with it. Neither function nor the optimizer reads a tensor on the host.

>>> w = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.AdamW([w], betas=(0.9, 0.99))
>>> for g in [1e-3] * 20 + [1.0]:  # a gradient 1000x larger than anything v has seen
...     w.grad = torch.full((4,), g); opt.step()
>>> read_update_rms(opt, [w])  # at the cap for step 21: sqrt((1 - 0.99**21) / (1 - 0.99)) = 4.362
[tensor(4.3620)]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .distributed import local_tensor, reduce_sharded_sums_
from .validate import check_number

__all__ = ["StableAdamW", "read_update_rms", "update_rms"]


def _bias_correction(beta2: float | Tensor, step: int | float | Tensor) -> float | Tensor:
    """``1 - beta2**step`` as torch's Adam computes it, without reading ``step`` on the host."""
    if isinstance(step, Tensor):
        # torch keeps `step` as a 0-dim float32 CPU tensor (on the device when capturable or fused)
        # and its plain path computes 1 - beta2**step in Python floats: float64 on the CPU matches it
        # without an .item(); on a device, float32, as torch's capturable path does.
        exponent = step.double() if step.device.type == "cpu" else step
        return 1 - torch.pow(beta2, exponent)
    return 1 - beta2**step


def update_rms(grad: Tensor, exp_avg_sq: Tensor, step: int | float | Tensor, beta2: float | Tensor,
               eps: float) -> Tensor:
    """Return ``sqrt(mean(grad**2 / max(v_hat, eps**2)))``, ``v_hat = exp_avg_sq / (1 - beta2**step)``.

    The per-tensor ``RMS_t`` of Wortsman et al. 2023b (arXiv 2304.13013), Algorithm 2: the size
    of this step's gradient against Adam's running estimate of it. ``exp_avg_sq`` is Adam's
    biased second moment *after* this step's update (so it contains ``grad``: torch's
    ``optimizer.state[p]["exp_avg_sq"]`` once ``optimizer.step()`` has run) and ``step`` its
    count ``t`` (an int, or torch's 0-dim ``state[p]["step"]``). Bias correction as torch's Adam.
    Properties: ``1`` for a gradient constant since step 1; at most
    ``sqrt((1 - beta2**t) / (1 - beta2)) <= 1 / sqrt(1 - beta2)``, reached by a gradient new to
    ``v``; unchanged when ``grad`` is scaled by ``c`` and ``exp_avg_sq`` by ``c**2`` (while
    ``eps`` does not bind). Returns a 0-dim tensor on ``grad``'s device, in float32 (float64 for
    float64 inputs), 0 for an empty tensor; no host sync.

    >>> g = torch.tensor([3.0, 4.0])
    >>> update_rms(g, (1 - 0.99) * g**2, 1, 0.99, 1e-8)  # step 1: v_hat = g**2, RMS 1
    tensor(1.)
    >>> update_rms(g, (1 - 0.99) * g**2, 30, 0.99, 1e-8)  # step 30, v had seen only zeros: the cap
    tensor(5.1020)
    """
    if grad.shape != exp_avg_sq.shape:
        raise ValueError(f"grad and exp_avg_sq must have the same shape (one parameter's), got "
                         f"{tuple(grad.shape)} and {tuple(exp_avg_sq.shape)}.")
    if not isinstance(beta2, Tensor):
        beta2 = check_number("beta2", beta2, 0, 1, high_open=True, hint="(Adam's second betas entry)")
    if not isinstance(step, Tensor):
        check_number("step", step, 1, hint="(the optimizer's step count after this step: 1 on the first)")
    eps = check_number("eps", eps, 0, finite=True)
    if grad.is_complex():  # torch's Adam runs complex parameters as their real view
        grad, exp_avg_sq = torch.view_as_real(grad), torch.view_as_real(exp_avg_sq)
    dtype = torch.promote_types(grad.dtype, torch.float32)
    if grad.numel() == 0:  # no coordinate, no update to clip
        return torch.zeros((), dtype=dtype, device=grad.device)
    g = grad.detach().to(dtype)
    correction = _bias_correction(beta2, step)
    if isinstance(correction, Tensor):  # as a Python float would be: the tensor's dtype, not float64
        correction = correction.to(dtype)
    v_hat = exp_avg_sq.detach().to(dtype) / correction
    return (g.square() / v_hat.clamp_min(eps * eps)).mean().sqrt()


def read_update_rms(optimizer: torch.optim.Optimizer, params: Iterable[Tensor] | None = None) -> list[Tensor]:
    """Return ``update_rms`` of each parameter, read from an Adam-family optimizer's state after its step.

    Call it after ``optimizer.step()`` and before the gradients are cleared: it reads each
    parameter's ``grad`` and ``state[p]["exp_avg_sq"]``, ``state[p]["step"]`` and its group's
    ``betas`` and ``eps`` (torch's Adam, AdamW, NAdam, RAdam and ``StableAdamW``; nothing is
    recomputed but the ratio). ``params``: which parameters, in which order (default: every
    parameter of every group). A parameter without a gradient or not yet stepped gives NaN.
    An optimizer with no second moment (SGD, Adagrad, Adafactor, Adamax) is refused, and so is
    Adam with L2 ``weight_decay`` (its ``v`` holds ``(g + wd * p)**2``, not ``g**2``). Returns
    0-dim tensors, each on its parameter's device; no host sync. The tensors of one device, dtype
    and group go through torch's ``_foreach`` operations together, each value bitwise ``update_rms``'s.

    >>> w = torch.nn.Parameter(torch.zeros(2)); opt = torch.optim.Adam([w], betas=(0.9, 0.95))
    >>> w.grad = torch.tensor([1.0, -2.0]); opt.step(); read_update_rms(opt)
    [tensor(1.)]
    """
    home: dict[int, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            home[id(p)] = group
    every = [p for group in optimizer.param_groups for p in group["params"]]
    wanted = every if params is None else list(params)
    name = type(optimizer).__name__
    out: list[Tensor | None] = []
    batches: dict[tuple, list[tuple[int, Tensor, Tensor, Tensor]]] = {}  # tensors that go together
    for i, p in enumerate(wanted):
        group = home.get(id(p))
        if group is None:
            raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) is not a parameter of this {name}: pass "
                             f"the parameters the optimizer steps.")
        if "betas" not in group:
            raise TypeError(f"{name} keeps no second moment (exp_avg_sq, with betas): RMS(g / sqrt(v_hat)) "
                            f"is defined for Adam-family optimizers (Adam, AdamW, StableAdamW).")
        if group.get("weight_decay", 0) and not group.get("decoupled_weight_decay", True):
            raise ValueError(f"{name} with L2 weight_decay={group['weight_decay']:g} adds wd * p to the "
                             f"gradient before v sees it, so v holds (g + wd * p)**2: use AdamW "
                             f"(decoupled decay).")
        state = optimizer.state.get(p, {})
        if state and "exp_avg_sq" not in state:
            raise TypeError(f"{name}'s state has no exp_avg_sq (it keeps {sorted(state)}): "
                            f"RMS(g / sqrt(v_hat)) is defined for Adam-family optimizers (Adam, AdamW, "
                            f"StableAdamW).")
        if p.grad is None or not state:
            out.append(torch.full((), float("nan"), device=p.device))
            continue
        grad, v, step = p.grad, state["exp_avg_sq"], state["step"]
        beta2, eps = group["betas"][1], group["eps"]
        sharded = type(grad) is not Tensor  # FSDP2's DTensor: the mean over the whole tensor, across ranks
        if not isinstance(step, Tensor) or grad.is_complex() or isinstance(beta2, Tensor) or \
                not sharded and grad.numel() == 0:  # the rule itself, one tensor at a time
            out.append(update_rms(grad, v, step, beta2, eps))
            continue
        out.append(None)
        key = (local_tensor(grad).device, torch.promote_types(grad.dtype, torch.float32), step.device, beta2,
               eps, sharded)
        batches.setdefault(key, []).append((i, grad, v, step))
    for (_, dtype, step_device, beta2, eps, sharded), batch in batches.items():
        check_number("beta2", beta2, 0, 1, high_open=True, hint="(Adam's second betas entry)")
        check_number("eps", eps, 0, finite=True)
        values = _update_rms_together(batch, dtype, step_device, beta2, eps, sharded)
        for i, value in zip([i for i, *_ in batch], values):
            out[i] = value
    if wanted and all(p.grad is None for p in wanted):
        raise RuntimeError("no parameter has a gradient: read the update RMS after optimizer.step() and "
                           "before optimizer.zero_grad().")
    return out  # type: ignore[return-value]


def _update_rms_together(batch: list[tuple[int, Tensor, Tensor, Tensor]], dtype: torch.dtype,
                         step_device: torch.device, beta2: float, eps: float, sharded: bool) -> list[Tensor]:
    """``update_rms`` of tensors on one device, in one dtype and group, with ``_foreach`` operations.

    ``sharded``: FSDP2's ``DTensor``s; each rank sums over its shards, one all-reduce adds the sums
    up, and the mean is over the whole tensor (the same on every rank; not the bits of one process).
    """
    grads = [local_tensor(g.detach()) for _, g, _, _ in batch]
    squares = [local_tensor(v.detach()) for _, _, v, _ in batch]
    grads = [g if g.dtype is dtype else g.to(dtype) for g in grads]
    squares = [v if v.dtype is dtype else v.to(dtype) for v in squares]
    steps = torch.stack([s for *_, s in batch])
    steps = steps.double() if step_device.type == "cpu" else steps  # as _bias_correction
    # 1 - beta2**step of every tensor at once, in each one's own bits: a strided view goes through the
    # kernel's element-by-element loop, as a 0-dim tensor does (a contiguous one may take a vectorized
    # pow, which rounds some last bits otherwise)
    corrections = 1 - torch.pow(beta2, torch.stack([steps, steps], 1)[:, 0])
    corrections = corrections.to(dtype).unbind()
    if corrections[0].device == grads[0].device:
        v_hat = torch._foreach_div(squares, list(corrections))
    else:  # torch's CPU step counts with parameters on a GPU: each 0-dim CPU number joins its own kernel
        v_hat = [v / c for v, c in zip(squares, corrections)]
    ratios = torch._foreach_div(torch._foreach_mul(grads, grads), torch._foreach_clamp_min(v_hat, eps * eps))
    if sharded:  # the mean of the whole tensor: the shards' sums added up, over its number of elements
        sums = reduce_sharded_sums_(torch.stack([r.sum() for r in ratios]), [g for _, g, _, _ in batch])
        means = sums / torch.tensor([g.numel() for _, g, _, _ in batch], dtype=sums.dtype, device=sums.device)
        return list(means.sqrt().unbind())
    # one mean per tensor (torch has no foreach mean); sqrt is correctly rounded, vector or not
    return list(torch.stack([r.mean() for r in ratios]).sqrt().unbind())


class StableAdamW(torch.optim.AdamW):
    """Step as AdamW does, with each tensor's lr divided by ``max(1, RMS_t)`` (update clipping).

    Wortsman et al. 2023b (arXiv 2304.13013), Algorithm 2, per parameter tensor at step ``t``::

        m_t, v_t     = AdamW's moments; m_hat, v_hat bias-corrected (v_hat contains g_t)
        RMS_t        = sqrt(mean(g_t**2 / max(v_hat, eps**2)))        # update_rms
        eta_t        = lr_t / max(1, RMS_t)
        theta_t      = theta_{t-1} - eta_t * weight_decay * theta_{t-1} - eta_t * m_hat / (sqrt(v_hat) + eps)

    The weight decay is scaled by ``eta_t`` too, as in Algorithm 2 (the authors' public gist
    decays with the unclipped ``lr``; the paper's algorithm is what this follows). Where no
    tensor's ``RMS_t`` exceeds 1 the step *is* ``torch.optim.AdamW``'s, bit for bit, with every
    implementation (``foreach``, ``fused``, ``capturable``): AdamW steps, then only a clipped
    tensor is moved back to ``theta_{t-1} + (theta_AdamW - theta_{t-1}) / RMS_t``. Cost: a copy
    of the parameters per step and one pass over each gradient; no host sync. Arguments and
    defaults are ``torch.optim.AdamW``'s (``lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2``: a drop-in; the state and ``state_dict`` are AdamW's), checked by it;
    ``amsgrad`` and ``differentiable`` are refused (Algorithm 2 has neither).
    A ``GradScaler`` always unscales the gradients before ``step`` (also with ``fused=True``):
    ``RMS_t`` reads the true gradient. Under DDP every rank holds the same gradients and so
    clips the same tensors.

    >>> w = torch.nn.Parameter(torch.ones(4)); opt = StableAdamW([w], lr=0.1, betas=(0.9, 0.99))
    >>> for g in [1e-3] * 20 + [1.0]:  # the last gradient is new to v
    ...     before = w.detach().clone(); w.grad = torch.full((4,), g); opt.step()
    >>> read_update_rms(opt, [w]), w.detach() - before  # AdamW would move 0.0484; 0.0484 / 4.362
    ([tensor(4.3620)], tensor([-0.0111, -0.0111, -0.0111, -0.0111]))
    """

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None) -> None:
        if amsgrad:
            raise ValueError("StableAdamW has no amsgrad (Algorithm 2 of 2304.13013 divides by v_hat, not "
                             "its running max): use amsgrad=False, or torch.optim.AdamW(amsgrad=True).")
        if differentiable:
            raise ValueError("StableAdamW's clip is not differentiable through the step: use "
                             "differentiable=False.")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused)
        # A fused AdamW unscales inside its kernel and leaves p.grad scaled; RMS_t must read the true
        # gradient, so a scaler unscales first (one extra pass over the gradients with fused=True).
        self._step_supports_amp_scaling = False
        self._hook_clip()

    # The clip runs as torch's own step hooks around AdamW's unchanged step: overriding step() and
    # calling super().step() would run every registered step hook twice (torch wraps each class's
    # step with them), and AdamW's step is what keeps the unclipped bits.
    def _hook_clip(self) -> None:
        handles = getattr(self, "_clip_hooks", None)
        if handles is not None and handles[0].id in self._optimizer_step_pre_hooks:
            return  # load_state_dict calls __setstate__ on a live optimizer: hooked already
        self._before: dict[int, Tensor] = {}
        self._clip_hooks = (self.register_step_pre_hook(StableAdamW._remember),
                            self.register_step_post_hook(StableAdamW._clip))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._hook_clip()  # unpickled or deep-copied: torch's __getstate__ keeps no hooks

    @torch.no_grad()
    def _remember(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Keep ``theta_{t-1}`` of every parameter the step will move (all of them under a closure)."""
        closure = kwargs.get("closure", args[0] if args else None)
        self._before = {id(p): p.detach().clone() for group in self.param_groups for p in group["params"]
                        if closure is not None or p.grad is not None}

    @torch.no_grad()
    def _clip(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """After AdamW's step, move each tensor whose ``RMS_t`` exceeds 1 back by ``1 / RMS_t``."""
        before, self._before = self._before, {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) not in before:
                    continue
                state = self.state[p]
                rms = update_rms(p.grad, state["exp_avg_sq"], state["step"], group["betas"][1], group["eps"])
                work = torch.promote_types(p.dtype, rms.dtype)  # bf16/fp16 weights: move them in fp32
                old = before[id(p)].to(work)
                clipped = old + (p.detach().to(work) - old) / rms
                # where, not a multiply by 1: an unclipped tensor keeps AdamW's bits exactly
                p.copy_(torch.where(rms > 1, clipped.to(p.dtype), p))
