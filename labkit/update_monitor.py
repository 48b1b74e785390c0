"""Watch Adam's per-tensor RMS(g/sqrt(v_hat)) and the applied update, and warn on an RMS spike.

Wortsman et al. 2023b (arXiv 2304.13013, §3.4) find loss spikes 1-8 steps after the per-tensor
``RMS_t = sqrt(mean(g_t**2 / v_hat_t))`` of AdamW jumps: a gradient large *for Adam's running
average* gives a large step however small its norm (``labkit.optim``). ``UpdateMonitor`` records
that signal per parameter tensor, which tensor peaked, and the RMS of the update the optimizer
applied (divided by the learning rate), and warns once per episode when the peak passes a
threshold (3 by default: the probe, /work/shared/research/optimizer-spikes-probe.md, saw
RMS > 3 precede 67-85 % of loss-spike onsets against a 2-5 % base rate, AdamW beta2 0.99).

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
from .distributed import rank
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
    under FSDP2 each rank holds a shard, and the means would need an all-reduce of the sums
    (as the logit measures reduce theirs), not done here.

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
        lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        measures: dict[str, Tensor] = {}
        squares, count = [], 0
        for (name, p), rms in zip(params, values):
            count_now = opt.state[p].get("step") if opt.state.get(p) else None
            if count_now is None:  # never stepped
                continue
            last = self._steps.get(id(p))
            # the optimizer's own count moved, or the step was skipped (a scaler's overflow, a hook's
            # skip): compared as tensors where they live, nothing read on the host; the mask (0 or NaN)
            # is added, as a 0-dim tensor may join a kernel on another device (torch's CPU count with
            # CUDA parameters) where torch.where would refuse it; + 0 keeps rms's bits
            count_now = torch.as_tensor(count_now)
            moved = count_now != last if last is not None else torch.ones((), dtype=torch.bool,
                                                                         device=count_now.device)
            self._steps[id(p)] = count_now.detach().clone()
            mask = torch.where(moved, 0.0, math.nan)
            measures[f"update_rms/{name}"] = rms + mask.to(rms.dtype)
            if id(p) in before:
                delta = (p.detach().double() - before[id(p)].double()) / lrs[id(p)]
                squares.append(delta.square().sum() + mask.double())
                count += p.numel()
        if squares and count:
            measures["applied_update_rms"] = (torch.stack(squares).sum() / count).sqrt().float()
        self._pending = measures

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
