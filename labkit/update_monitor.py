"""Watch Adam's per-tensor RMS(g/sqrt(v_hat)) and the applied update, and warn on an RMS spike.

Wortsman et al. 2023b (arXiv 2304.13013: its abstract, Algorithm 2) find loss spikes 1-8 steps
after the per-tensor ``RMS_t = sqrt(mean(g_t**2 / v_hat_t))`` of AdamW jumps: a gradient large *for
Adam's running average* gives a large step however small its norm (``labkit.optim``).
``UpdateMonitor`` records that signal per parameter tensor, which tensor peaked, and the RMS of the
update the optimizer applied (divided by the learning rate), and warns once per episode when the
peak passes a threshold (3 by default: a probe of the memorisation regime lesson 08 runs saw RMS >
3 precede 67-85 % of loss-spike onsets against a 2-5 % base rate, AdamW beta2 0.99).

**The record is one step late.** ``RMS_t`` needs ``v_t``, which the optimizer writes in its
step; the protocol reads a hook's device tensors only with the numbers the step reads anyway,
which for optimizer step ``t`` happens before ``optimizer.step()`` (the skip decision). So the
monitor measures at ``post_step`` (on the device, no read) and hands the tensors to the *next*
step's read (``post_backward``): record ``t + 1`` holds the RMS of optimizer step ``t`` and
says so in ``update_step``. That costs no host sync; the price is the lag, and the last step's
values are never recorded. Computing ``v_t`` at ``post_backward`` instead would read
gradients that are still scaled and not yet clipped, and a skip not yet decided.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .alarms import LabkitWarning, warn
from .distributed import local_tensor, rank, reduce_sharded_sums_
from .hooks import Hook
from .optim import read_update_rms
from .records import Field, put
from .validate import check_number

__all__ = ["UpdateMonitor", "UpdateSpikeWarning"]


class UpdateSpikeWarning(LabkitWarning):
    """Adam's RMS(g/sqrt(v_hat)) jumped: a loss spike may follow that gradient clipping cannot see."""


class UpdateMonitor(Hook):
    """Record each tensor's RMS(g/sqrt(v_hat)) and the update's RMS; warn when the peak passes ``threshold``.

    Fields (of the *previous* optimizer step, ``update_step``; see the module docstring):
    ``update_rms`` ``{tensor name: RMS_t}`` (``labkit.optim.read_update_rms``, bitwise),
    ``update_rms_max`` and ``update_rms_peak`` (the largest and its tensor), ``applied_update_rms``
    the RMS over every coordinate of ``(theta_t - theta_{t-1}) / lr`` (weight decay and
    StableAdamW's clip included). A skipped optimizer step gives NaN. ``optimizer``: the one to
    read (default: the trainer's). Refused as ``read_update_rms`` refuses: an optimizer without a
    second moment (SGD, Adagrad), Adam with L2 ``weight_decay``. In a plain loop call
    ``pre_optim_step`` before ``optimizer.step()`` (else no ``applied_update_rms``), ``post_step``
    after it, take the tensors from the next step's ``post_backward`` and hand the record (its
    numbers on the host) to ``on_record``, which names the peak and warns. Cost per step:
    a copy of the parameters (for the applied update) and one pass over the gradients and ``v``;
    no host sync. Under DDP every rank holds the same gradients and states, so the same values;
    under FSDP2 each rank holds a shard: its sums over the shards are all-reduced (one SUM per
    group of ranks, as ``labkit.distributed.reduce_sharded_norms_`` does for the norms), so every
    rank records the whole tensors' values.

    >>> w = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.AdamW([w], betas=(0.9, 0.99))
    >>> monitor = UpdateMonitor(opt)
    >>> w.grad = torch.ones(4); opt.step(); monitor.post_step(None, [("w", w)], None)
    >>> monitor.post_backward(None, 1)["update_rms/w"]
    tensor(1.)
    """

    priority = 100  # its fields are set before any hook reads them in on_record
    state_key = None
    record_fields = {"update_rms": Field({}, per_layer=True), "update_rms_max": Field(math.nan),
                     "update_rms_peak": Field(None), "applied_update_rms": Field(math.nan),
                     "update_step": Field(None)}

    def __init__(self, optimizer: torch.optim.Optimizer | None = None, threshold: float | None = 3.0) -> None:
        self.threshold = check_number("threshold", threshold, 0, low_open=True, none="off",
                                      hint="(RMS(g/sqrt(v_hat)) is 1 for a steady gradient; 3 is a spike)")
        self.optimizer = optimizer
        if optimizer is not None:
            self._check(optimizer)
        self._before: dict[int, Tensor] = {}  # theta_{t-1}, copied at pre_optim_step
        self._steps: dict[int, Tensor] = {}  # each parameter's optimizer step count, as last seen
        self._last: tuple[tuple[int, ...], Tensor | None] = ((), None)  # whose counts, stacked
        self._pending: dict[str, Tensor] = {}
        self._alarmed = False  # in an episode (the peak above threshold) already warned about

    @staticmethod
    def _check(optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer without a second moment now, as ``read_update_rms`` would at the first step."""
        with contextlib.suppress(RuntimeError):  # no gradient yet: the optimizer itself is fine
            read_update_rms(optimizer)

    def attach(self, trainer: Any) -> None:
        if self.optimizer is None:
            self.optimizer = trainer.optimizer
            self._check(self.optimizer)

    @torch.no_grad()
    def pre_optim_step(self, trainer: Any, step: int, params: Sequence[tuple[str, Tensor]]) -> None:
        self._before = {id(p): p.detach().clone() for _, p in params if p.grad is not None}

    @torch.no_grad()
    def post_step(self, trainer: Any, params: Iterable[tuple[str, Tensor]], record: Any) -> None:
        """Measure the optimizer step just taken, on the device; the next step's read carries it."""
        opt = self.optimizer if self.optimizer is not None else trainer.optimizer
        params = [(n, p) for n, p in params if p.grad is not None]
        before, self._before = self._before, {}
        if not params:
            return
        values = read_update_rms(opt, [p for _, p in params])
        states = [opt.state.get(p) for _, p in params]
        stepped = [(n, p, rms, torch.as_tensor(state["step"]))
                   for (n, p), rms, state in zip(params, values, states)
                   if state and state.get("step") is not None]  # else never stepped
        if not stepped:
            self._pending = {}
            return
        # the optimizer's own count moved, or the step was skipped (a scaler's overflow, a hook's skip):
        # compared as tensors where they live, nothing read on the host; a mask of 0 or NaN is added
        # (+ 0 keeps rms's bits) to every tensor of one device at once
        counts = torch.stack([c for *_, c in stepped])
        ids = tuple(id(p) for _, p, _, _ in stepped)
        last_ids, last = self._last
        moved = counts != last if last_ids == ids else torch.stack(
            [c != self._steps[i] if i in self._steps else torch.ones((), dtype=torch.bool, device=c.device)
             for i, (*_, c) in zip(ids, stepped)])
        self._last = (ids, counts)
        self._steps = dict(zip(ids, counts.unbind()))
        nan = torch.full_like(counts, math.nan, dtype=torch.float32)
        mask = torch.where(moved, torch.zeros_like(nan), nan)
        rms = [r for _, _, r, _ in stepped]
        if all(r.device == mask.device and r.dtype == mask.dtype for r in rms):
            rms = (torch.stack(rms) + mask).unbind()
        else:  # a 0-dim mask joins a kernel on another device (torch's CPU count with CUDA parameters)
            rms = [r + m.to(r.dtype) for r, m in zip(rms, mask.unbind())]
        measures = {f"update_rms/{n}": r for (n, *_), r in zip(stepped, rms)}
        moved_ = [(p, before[id(p)], m) for (_, p, _, _), m in zip(stepped, mask.unbind()) if id(p) in before]
        count = sum(p.numel() for p, _, _ in moved_)
        if count:
            measures["applied_update_rms"] = self._applied_rms(opt, moved_, count)
        self._pending = measures

    @staticmethod
    def _applied_rms(opt: torch.optim.Optimizer, moved: list[tuple[Tensor, Tensor, Tensor]],
                     count: int) -> Tensor:
        """RMS over every coordinate of ``(theta_t - theta_{t-1}) / lr``, in float64 (masked as the RMS)."""
        lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        # a DTensor's (FSDP2) local shard; its sum is added up across the ranks below
        deltas = [local_tensor(p.detach()).to(torch.float64, copy=True) for p, _, _ in moved]  # written next
        torch._foreach_sub_(deltas, [local_tensor(b) for _, b, _ in moved])  # theta_{t-1}: exact in float64
        rates = [lrs[id(p)] for p, _, _ in moved]
        if all(isinstance(r, (int, float)) for r in rates):
            torch._foreach_div_(deltas, rates)
        else:  # a tensor learning rate
            deltas = [d / r for d, r in zip(deltas, rates)]
        torch._foreach_mul_(deltas, deltas)
        squares = reduce_sharded_sums_(torch.stack([d.sum() for d in deltas]), [p for p, _, _ in moved])
        masks = [m for *_, m in moved]
        if masks[0].device == squares.device:
            squares = squares + torch.stack(masks).to(squares.dtype)
        else:  # a CPU count's mask with GPU parameters: 0-dim numbers join the kernels, no copy to wait for
            squares = torch.stack([s + m.double() for s, m in zip(squares.unbind(), masks)])
        return (squares.sum() / count).sqrt().float()

    def post_backward(self, trainer: Any, step: int) -> dict[str, Tensor] | None:
        """Hand the previous optimizer step's measures to this step's one read."""
        pending, self._pending = self._pending, {}
        return pending or None

    def on_record(self, trainer: Any, record: Any) -> None:
        """Name the peak tensor and warn (rank 0, once per episode) when it passes the threshold."""
        if not record.update_rms:  # nothing measured: the first step, or after a non-finite loss
            return
        put(record.fields, "update_step", record.step - 1)
        rms = {k: v for k, v in record.update_rms.items() if not math.isnan(v)}
        if not rms:  # that optimizer step was skipped
            return
        peak = max(rms, key=rms.__getitem__)
        put(record.fields, "update_rms_max", rms[peak])
        put(record.fields, "update_rms_peak", peak)
        self.observe(rms[peak], peak, record.step - 1)

    def observe(self, peak_rms: float, tensor: str, step: int) -> bool:
        """Warn when ``peak_rms`` first passes the threshold (again once it fell below); return if above."""
        above = self.threshold is not None and peak_rms > self.threshold
        if above and not self._alarmed and rank() == 0:
            warn(f"optimizer step {step}: RMS(g/sqrt(v_hat)) of {tensor} is {peak_rms:.3g} (above "
                 f"{self.threshold:g}; 1 for a steady gradient): Adam's second moment under-estimates a "
                 f"gradient suddenly larger than its recent ones, and the step is that many times too large "
                 f"whatever the gradient norm (clipping the gradient does not see it). A loss spike often "
                 f"follows in 1-8 steps (Wortsman et al. 2023b, arXiv 2304.13013). Clip the update per "
                 f"tensor (labkit.optim.StableAdamW, a drop-in for torch.optim.AdamW), or lower beta2 so v "
                 f"follows the gradients faster (0.95 rather than 0.99 or 0.999).", UpdateSpikeWarning)
        self._alarmed = above
        return above
