"""The guarded training step: the one place where the AMP order lives."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .alarms import ClipAlarm, LabkitWarning, SkipAlarm
from .clip import (
    EPS, check_max_norm, check_norm_type, clip_grads_with_norm_, first_nonfinite, per_tensor_norms, total_norm,
)
from .distributed import ProcessGroup, all_reduce_, is_distributed, mean_across, rank
from .faults import FaultSchedule
from .records import StepLog, StepRecord
from .scaler import GradScaler

__all__ = ["PRECISIONS", "TrainStep"]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
TOP_K = 3


def _forensics(
    named: list[tuple[str, Tensor]], norms: Tensor, group: ProcessGroup | None
) -> tuple[list[tuple[str, float]], str | None]:
    """Return the top-3 ``(name, norm)`` (non-finite first) and the first non-finite gradient's name.

    Read from the per-tensor norms already computed, so there is no extra pass over the
    gradients unless a norm is non-finite (then the gradients themselves are asked, since
    an inf norm may be an fp32 overflow of finite values).
    """
    values = norms.tolist()
    finite = [math.isfinite(v) for v in values]
    ranked = sorted(range(len(values)), key=lambda i: (not finite[i], values[i] if finite[i] else 0.0), reverse=True)
    top = [(named[i][0], values[i]) for i in ranked[:TOP_K]]
    if all(finite):
        return top, None
    names = [n for n, _ in named]
    culprit = first_nonfinite([g for _, g in named], names)
    if is_distributed():
        # With FSDP2 the culprit may sit in another rank's shard: agree on the first by position
        # (one number, on skipped steps only; every rank is here, as the norms are global).
        first = torch.tensor([names.index(culprit) if culprit is not None else len(names)], device=norms.device)
        position = int(all_reduce_(first, "min", group).item())
        culprit = names[position] if position < len(names) else None
    return top, culprit


class TrainStep:
    """Run one guarded optimizer step per call and return its ``StepRecord``.

    The order, for every precision: zero grads -> inject the scheduled fault -> forward and
    loss under autocast -> **loss not finite: skip** (backward, step and the loss scale are
    left alone: a bad batch is not a scaling problem) -> scaled backward -> unscale -> global
    norm of the unscaled gradients (logged unclipped) -> **gradients not finite: skip** (the
    scale backs off) -> clip to ``max_norm`` -> step -> scheduler, only if the optimizer
    stepped -> scaler update. ``fp32`` and ``bf16`` use a disabled ``GradScaler``, so they go
    through the same lines. Host syncs per step: one per micro-batch for the loss check
    (backward is skipped on the host), one for the step decision on the norm, one in the
    scaler's ``step`` (fp16 only, as in torch) and two small scale reads for the record;
    none per parameter. Forensics read the per-tensor norms only on a skip or a clip.

    Under ``torch.distributed`` (DDP or FSDP2; nothing changes when it is not initialized)
    every rank takes the same decision: the loss check all-reduces the loss (one number per
    micro-batch, over ``process_group``, default the world) *before* backward, so a NaN on
    one rank makes every rank skip backward together instead of leaving the others waiting
    in DDP's gradient all-reduce; the record's loss is then the global-batch mean. The norm
    is global (sharded gradients are reduced across their mesh), the default scaler reduces
    ``found_inf``, and the records are equal on every rank. Rank 0 alone writes ``log_path``
    and raises the alarms.

    ``observer`` (e.g. ``labkit.precision.StaleMonitor``) is called with the named parameters
    right before the optimizer step (``before_step(params, step)``) and with the record right
    after it (``after_step(params, record)``); it may add to the record, never change the order.

    >>> from labkit.tasks import ToyTask
    >>> task = ToyTask(); model = task.model()
    >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp16")
    >>> record = step(*task.batch(0)); record.skipped, record.scale
    (False, 65536.0)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        *,
        precision: str = "fp32",
        max_norm: float | None = 1.0,
        norm_type: float = 2.0,
        scaler: GradScaler | None = None,
        scheduler: Any = None,
        device: str | torch.device | None = None,
        accumulation_steps: int = 1,
        skip_alarm: int | None = 8,
        clip_alarm: float | None = 0.5,
        clip_window: int = 100,
        faults: FaultSchedule | dict | None = None,
        log_path: str | os.PathLike | None = None,
        process_group: ProcessGroup | None = None,
        observer: Any = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}.")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}.")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(
                f"scaler must be a labkit.GradScaler, got {type(scaler).__name__}: torch's GradScaler.step() "
                "does not say whether it skipped, which TrainStep needs. labkit.GradScaler takes the same arguments."
            )
        if precision == "bf16" and scaler is not None and scaler.is_enabled():
            warnings.warn(
                "a loss scaler is not needed with bf16 (its range is fp32's); it only costs time and can skip "
                "steps. Pass scaler=None to keep the NaN/Inf checks without scaling.",
                LabkitWarning,
                stacklevel=2,
            )
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.precision = precision
        self.max_norm = None if max_norm is None else check_max_norm(max_norm)
        self.norm_type = check_norm_type(norm_type)
        self.scheduler = scheduler
        self.accumulation_steps = accumulation_steps
        self.process_group = process_group
        self.observer = observer  # sees the weights around the optimizer step (labkit.precision.StaleMonitor)
        first = next(model.parameters(), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
        if scaler is None:
            scaler = GradScaler(self.device.type, enabled=precision == "fp16", process_group=process_group)
        self.scaler = scaler
        self.faults = faults if isinstance(faults, FaultSchedule) else FaultSchedule(faults)
        self.skip_alarm = SkipAlarm(skip_alarm)
        self.clip_alarm = ClipAlarm(clip_alarm, clip_window)
        if rank() != 0:  # the records are the same on every rank: N ranks would warn N times
            self.skip_alarm.threshold = self.clip_alarm.rate = None
        self.log = StepLog(stream=log_path)
        self.step_count = 0
        names = {id(p): n for n, p in model.named_parameters()}
        self._params = [
            (names.get(id(p), f"group{g}.param{i}"), p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def __call__(self, inputs: Tensor, targets: Tensor) -> StepRecord:
        """Train on one batch (split into ``accumulation_steps`` micro-batches) and record it."""
        k = self.accumulation_steps
        if len(inputs) < k or len(inputs) != len(targets):
            raise ValueError(
                f"need as many targets as inputs and at least accumulation_steps={k} samples; "
                f"got {len(inputs)} inputs and {len(targets)} targets."
            )
        step, fault, scaler, opt = self.step_count, self.faults.get(self.step_count), self.scaler, self.optimizer
        lr = float(opt.param_groups[0]["lr"])
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

        opt.zero_grad(set_to_none=True)
        loss_total, bad_loss = 0.0, None
        for x, y in zip(torch.tensor_split(inputs, k), torch.tensor_split(targets, k)):
            if fault is not None:
                x = fault.corrupt_inputs(x)
            with self._autocast():
                out = self.model(x)
                if fault is not None:
                    out = fault.corrupt_output(out)
                loss = self.loss_fn(out, y)
            if loss.numel() != 1:
                raise ValueError(f"loss_fn must return one number (reduction='mean'), got shape {tuple(loss.shape)}.")
            weight = len(x) / len(inputs)  # exact for a mean-reduced loss, even with unequal splits
            # host sync, needed: on a bad batch backward must not run at all, on any rank
            value = mean_across(loss.detach(), self.process_group).item()
            if not math.isfinite(value):
                bad_loss = value
                break
            loss_total += value * weight
            scaler.scale(loss * weight).backward()

        if bad_loss is not None:
            scale = scaler.get_scale()
            record = StepRecord(step, bad_loss, scale=scale, next_scale=scale, skipped=True, reason="nonfinite_loss", lr=lr)
        else:
            record = self._unscale_check_clip_step(step, loss_total, lr)
        record.fault = fault.label if fault is not None else None
        record.skip_streak = self.skip_alarm.observe(record.skipped, record.reason, step)
        if not record.skipped:
            self.clip_alarm.observe(record.clipped, step)
        self.log.append(record)
        self.step_count += 1
        return record

    def _unscale_check_clip_step(self, step: int, loss: float, lr: float) -> StepRecord:
        scaler, opt = self.scaler, self.optimizer
        scale = scaler.get_scale()
        scaler.unscale_(opt)
        named = [(n, p.grad) for n, p in self._params if p.grad is not None]
        norms = per_tensor_norms([g for _, g in named], self.norm_type)
        norm = total_norm(norms, self.norm_type)
        norm_value = norm.item()  # host sync: the step decision
        coef, clipped = 1.0, False
        if math.isfinite(norm_value):
            if self.max_norm is not None:
                clip_grads_with_norm_(self._params, self.max_norm, norm)
                coef = min(1.0, self.max_norm / (norm_value + EPS))  # the same coefficient, for the record
                clipped = coef < 1.0
            if self.observer is not None:
                self.observer.before_step(self._params, step)
            stepped = scaler.step(opt)
        else:
            stepped = False  # clipping cannot repair a NaN: never step on it
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        scaler.update()
        record = StepRecord(
            step, loss, grad_norm=norm_value, clip_coef=coef, clipped=clipped, scale=scale,
            next_scale=scaler.get_scale(), skipped=not stepped, reason=None if stepped else "nonfinite_grad", lr=lr,
        )
        if record.skipped or clipped:
            record.top_grads, record.first_nonfinite = _forensics(named, norms, self.process_group)
        if self.observer is not None:
            self.observer.after_step(self._params, record)
        return record

    def state_dict(self) -> dict[str, Any]:
        """Return the step counter, alarm streaks and scaler state (save model/optimizer/scheduler as usual)."""
        return {
            "step": self.step_count,
            "skip_alarm": self.skip_alarm.state_dict(),
            "clip_alarm": self.clip_alarm.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next call continues the same step numbering and faults."""
        missing = {"step", "skip_alarm", "clip_alarm", "scaler"} - state.keys()
        if missing:
            raise KeyError(f"TrainStep state_dict lacks {sorted(missing)}; pass what TrainStep.state_dict() returned.")
        self.scaler.load_state_dict(state["scaler"])  # first: it validates before it writes
        self.skip_alarm.load_state_dict(state["skip_alarm"])
        self.clip_alarm.load_state_dict(state["clip_alarm"])
        self.step_count = int(state["step"])
