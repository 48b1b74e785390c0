"""The guarded training step: the one place where the AMP order lives."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Mapping
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
from .scaler import F32, GradScaler, check_device

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


def _check_parts(model: Any, optimizer: Any, loss_fn: Any, scheduler: Any, device: Any) -> torch.device:
    """Raise a clear error for parts ``TrainStep`` cannot drive; return the device to train on."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS needs a closure that re-evaluates the loss, which a guarded step (check, clip, then one step) "
            "cannot give it: use a first-order optimizer (SGD, Adam...) with TrainStep."
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, targets), got {type(loss_fn).__name__}.")
    if scheduler is not None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau needs a metric at each step: pass scheduler=None and call "
                "scheduler.step(metric) yourself after the steps whose record says skipped=False."
            )
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method (a torch LR scheduler), got {type(scheduler).__name__}.")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("scheduler was built on another optimizer: build it on the optimizer given to TrainStep.")
    sparse = [type(m).__name__ for m in model.modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(
            f"{sparse[0]}(sparse=True) gives sparse gradients, which the global norm and clipping do not take: "
            "build it with sparse=False (the default)."
        )
    first = next(model.parameters(), None)
    home = first.device if first is not None else torch.device("cpu")
    if device is None:
        return home
    dev = check_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available() or dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}, but there is no {dev.type} device here: use 'cpu' (or device=None, the model's).")
    if first is not None and dev.type != home.type:
        raise ValueError(f"device={device!r}, but the model is on {home}: move it first (model.to({str(dev)!r})).")
    return dev


def _batch_size(inputs: Any, targets: Any, k: int) -> int:
    """Return the batch size, or raise saying how to pass the batch (before anything is touched)."""
    if isinstance(inputs, Mapping):
        sizes = {key: v.shape[0] if v.dim() else None for key, v in inputs.items() if isinstance(v, Tensor)}
        if not sizes or None in sizes.values() or len(set(sizes.values())) != 1:
            raise ValueError(
                "a dict batch (model(**batch)) needs tensors that share their first (batch) dimension, "
                f"got sizes {sizes}."
            )
        n, what = next(iter(sizes.values())), "samples in the dict batch"
    elif isinstance(inputs, Tensor):
        if inputs.dim() == 0:
            raise ValueError("inputs is a 0-d tensor: a batch needs a first (batch) dimension, e.g. x.unsqueeze(0).")
        n, what = len(inputs), "inputs"
    else:
        raise TypeError(
            f"inputs must be a torch.Tensor or a dict of tensors (passed as model(**batch)), got "
            f"{type(inputs).__name__}; convert it with torch.as_tensor(...)."
        )
    if targets is not None:
        if not isinstance(targets, Tensor) or targets.dim() == 0:
            raise TypeError(
                f"targets must be a torch.Tensor with a batch dimension, or None for a one-argument loss_fn(output), "
                f"got {type(targets).__name__ if not isinstance(targets, Tensor) else '0-d tensor'}."
            )
        if len(targets) != n:
            raise ValueError(f"need as many targets as {what}; got {n} {what} and {len(targets)} targets.")
    if n < k:
        raise ValueError(f"need at least accumulation_steps={k} samples to split, got {n}.")
    return n


def _split(batch: Any, k: int) -> list[Any]:
    """Return ``k`` micro-batches of a tensor, a dict of tensors (other values repeated) or None."""
    if batch is None:
        return [None] * k
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, k))
    parts = {key: torch.tensor_split(v, k) if isinstance(v, Tensor) else [v] * k for key, v in batch.items()}
    return [{key: p[i] for key, p in parts.items()} for i in range(k)]


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: _to(v, device) for key, v in batch.items()}
    return batch


def _check_loss(loss: Any) -> Tensor:
    if not isinstance(loss, Tensor):
        hint = " (return the loss alone, not a tuple)" if isinstance(loss, (tuple, list)) else ""
        raise TypeError(
            f"loss_fn must return a tensor that requires grad, got {type(loss).__name__}{hint}; a Python number "
            "carries no gradient: return e.g. nn.functional.mse_loss(output, targets)."
        )
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return one number (reduction='mean'), got shape {tuple(loss.shape)}.")
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: it was detached (.item(), .detach(), torch.no_grad()) or no "
            "trainable parameter was used; return the loss tensor straight from the model's output."
        )
    return loss


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

    The parameters guarded are the optimizer's at each step (groups added later included).
    Bad arguments raise before anything changes; a skipped or failed step leaves the
    parameters, the optimizer, the scaler and the module's buffers as they were.
    ``log_window=N`` keeps only the last N records in ``log`` (its summary stays exact).

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
        faults: FaultSchedule | dict | list[str] | None = None,
        log_path: str | os.PathLike | None = None,
        log_window: int | None = None,
        process_group: ProcessGroup | None = None,
        observer: Any = None,
    ) -> None:
        device = _check_parts(model, optimizer, loss_fn, scheduler, device)
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
        self.device = device
        if scaler is None:
            scaler = GradScaler(self.device.type, enabled=precision == "fp16", process_group=process_group)
        self.scaler = scaler
        self.faults = FaultSchedule.coerce(faults)
        self.skip_alarm = SkipAlarm(skip_alarm)
        self.clip_alarm = ClipAlarm(clip_alarm, clip_window)
        if rank() != 0:  # the records are the same on every rank: N ranks would warn N times
            self.skip_alarm.threshold = self.clip_alarm.rate = None
        self.log = StepLog(stream=log_path, window=log_window)  # last: it opens the file, once all else is valid
        self.step_count = 0
        self._params_key: tuple = ()
        self._params: list[tuple[str, nn.Parameter]] = []

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        """Return ``(name, param)`` of every parameter the optimizer holds now (progressive unfreezing too).

        Read from ``optimizer.param_groups`` each step; the list is rebuilt only when a group is
        added or its parameter list changes (a tuple compare per step, no pass over the model).
        """
        groups = self.optimizer.param_groups
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key != self._params_key:
            names = {id(p): n for n, p in self.model.named_parameters()}
            self._params = [
                (names.get(id(p), f"group{g}.param{i}"), p)
                for g, group in enumerate(groups)
                for i, p in enumerate(group["params"])
            ]
            self._params_key = key
        return self._params

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def __call__(self, inputs: Tensor | Mapping[str, Any], targets: Tensor | None = None) -> StepRecord:
        """Train on one batch (split into ``accumulation_steps`` micro-batches) and record it.

        ``inputs`` is a tensor (``model(inputs)``) or a dict of tensors (``model(**inputs)``,
        e.g. a Hugging Face batch); with ``targets=None`` the loss is ``loss_fn(output)`` (e.g.
        ``lambda out: out.loss``). Bad arguments raise before anything changes. An error from
        the model, the loss or the optimizer passes through unchanged, with the parameters,
        buffers, scaler and counters as they were; the scheduler's error is raised after the
        step it follows is complete and recorded.
        """
        k = self.accumulation_steps
        n = _batch_size(inputs, targets, k)
        step, fault, scaler, opt = self.step_count, self.faults.get(self.step_count), self.scaler, self.optimizer
        lrs = [float(g["lr"]) for g in opt.param_groups]
        inputs, targets = _to(inputs, self.device), _to(targets, self.device)
        if fault is not None:
            inputs = fault.corrupt_batch(inputs)  # before anything changes: it may refuse the batch
        # A skipped step must leave BatchNorm's running statistics (any buffer) as they were, but
        # the forward changes them before the loss can be checked: one copy of the buffers per
        # step (2 numbers per BatchNorm channel; nothing for a model without buffers), put back on a skip.
        buffers = list(self.model.buffers())
        saved = [b.detach().clone() for b in buffers]

        try:
            opt.zero_grad(set_to_none=True)
            loss_total, bad_loss = 0.0, None
            for x, y in zip(_split(inputs, k), _split(targets, k)):
                with self._autocast():
                    out = self.model(**x) if isinstance(x, Mapping) else self.model(x)
                    if fault is not None:
                        out = fault.corrupt_output(out)
                    loss = _check_loss(self.loss_fn(out) if y is None else self.loss_fn(out, y))
                weight = _batch_size(x, None, 1) / n  # exact for a mean-reduced loss, even with unequal splits
                # host sync, needed: on a bad batch backward must not run at all, on any rank
                value = mean_across(loss.detach(), self.process_group).item()
                if not math.isfinite(value):
                    bad_loss = value
                    break
                loss_total += value * weight
                scaler.scale(loss * weight).backward()

            if bad_loss is not None:
                scale = scaler.get_scale()
                record = StepRecord(step, bad_loss, scale=scale, next_scale=scale, skipped=True, reason="nonfinite_loss")
                late_error = None
            else:
                record, late_error = self._unscale_check_clip_step(step, loss_total)
        except BaseException:
            # the user's model, loss or optimizer raised (or a bad loss): nothing of this step is kept
            scaler._abandon_iteration()
            _restore(buffers, saved)
            raise
        if record.skipped:
            _restore(buffers, saved)
        record.lr, record.lrs = lrs[0], lrs
        record.fault = fault.label if fault is not None else None
        record.skip_streak = self.skip_alarm.observe(record.skipped, record.reason, step)
        if not record.skipped:
            self.clip_alarm.observe(record.clipped, step)
        self.step_count += 1  # the step is complete: numbering stays true even if the file write fails
        try:
            self.log.append(record)  # raises LogWriteError on a full disk; the record is kept in memory
        finally:
            if late_error is not None:
                raise late_error
        return record

    def _unscale_check_clip_step(self, step: int, loss: float) -> tuple[StepRecord, BaseException | None]:
        scaler, opt = self.scaler, self.optimizer
        scale = scaler.get_scale()
        params = self._named_params()
        named = [(n, p.grad) for n, p in params if p.grad is not None]
        if any(g.is_sparse for _, g in named):
            raise ValueError("sparse gradients are not supported by the global norm: use sparse=False in the model.")
        scaler.unscale_(opt)
        norms = per_tensor_norms([g for _, g in named], self.norm_type)
        norm = total_norm(norms, self.norm_type)
        norm_value = norm.item()  # host sync: the step decision
        coef, clipped = 1.0, False
        if math.isfinite(norm_value):
            if self.max_norm is not None:
                clip_grads_with_norm_(params, self.max_norm, norm)
                coef = min(1.0, self.max_norm / (norm_value + EPS))  # the same coefficient, for the record
                clipped = coef < 1.0
            if self.observer is not None:
                self.observer.before_step(params, step)
            stepped = scaler.step(opt)
        else:
            stepped = False  # clipping cannot repair a NaN: never step on it
        late_error = None
        if stepped and self.scheduler is not None:
            try:
                self.scheduler.step()
            except Exception as e:  # the optimizer has stepped: finish and record the step, then raise it
                late_error = e
        scaler.update()
        # a scale below float32's normal range (set by hand: the default floor forbids it) skips every step
        dead = scaler.is_enabled() and not scale >= F32.tiny
        reason = None if stepped else ("dead_scale" if dead else "nonfinite_grad")
        record = StepRecord(
            step, loss, grad_norm=norm_value, clip_coef=coef, clipped=clipped, scale=scale,
            next_scale=scaler.get_scale(), skipped=not stepped, reason=reason,
        )
        if record.skipped or clipped:
            record.top_grads, record.first_nonfinite = _forensics(named, norms, self.process_group)
        if self.observer is not None:
            self.observer.after_step(params, record)
        return record, late_error

    def state_dict(self) -> dict[str, Any]:
        """Return the step counter, alarm streaks, scaler state and the log's summary totals.

        Save the model, optimizer and scheduler as usual, next to it.
        """
        return {
            "step": self.step_count,
            "skip_alarm": self.skip_alarm.state_dict(),
            "clip_alarm": self.clip_alarm.state_dict(),
            "scaler": self.scaler.state_dict(),
            "log": self.log.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next call continues the same step numbering, faults and summary.

        Everything is validated before anything is written: a damaged state raises and leaves
        this ``TrainStep`` as it was. A state saved without ``"log"`` (older labkit) resumes
        with a summary that covers the resumed steps only.
        """
        if not isinstance(state, dict):
            raise TypeError(f"TrainStep state must be a dict from TrainStep.state_dict(), got {type(state).__name__}.")
        missing = {"step", "skip_alarm", "clip_alarm", "scaler"} - state.keys()
        if missing:
            raise KeyError(f"TrainStep state_dict lacks {sorted(missing)}; pass what TrainStep.state_dict() returned.")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"TrainStep state['step'] must be an int >= 0, got {step!r}.")
        SkipAlarm.parse_state(state["skip_alarm"])  # each part raises on damage; nothing is written yet
        ClipAlarm.parse_state(state["clip_alarm"])
        if self.scaler.is_enabled():
            self.scaler._parse_state(state["scaler"])
        if "log" in state:
            StepLog().load_state_dict(state["log"])
        self.scaler.load_state_dict(state["scaler"])
        self.skip_alarm.load_state_dict(state["skip_alarm"])
        self.clip_alarm.load_state_dict(state["clip_alarm"])
        if "log" in state:
            self.log.load_state_dict(state["log"])
        self.step_count = step


def _restore(buffers: list[Tensor], saved: list[Tensor]) -> None:
    with torch.no_grad():
        for b, s in zip(buffers, saved):
            b.copy_(s)
