"""The guarded training step: the one place where the AMP order lives."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .alarms import ClipAlarm, LabkitWarning, SkipAlarm
from .clip import (
    check_max_norm, check_norm_type, check_scaled_norm_type, clip_coef, first_nonfinite, host_clip_coef,
    per_tensor_norms, round_to, scale_grads_, total_norm,
)
from .distributed import ProcessGroup, all_reduce_, is_distributed, mean_across, rank
from .faults import FaultSchedule
from .clippers import Clipper, GlobalClipper, NormClip, UpdateNormClip
from .records import FIELDS, LogWriteError, StepLog, StepRecord
from .rewind import Rewind
from .scaler import F32, GradScaler, check_device
from .spikes import SpikeDetector

__all__ = ["PRECISIONS", "DeferredRecord", "TrainStep"]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
TOP_K = 3


def _forensics(
    named: list[tuple[str, Tensor | None]], norms: Tensor | list[float], group: ProcessGroup | None
) -> tuple[list[tuple[str, float]], str | None]:
    """Return the top-3 ``(name, norm)`` (non-finite first) and the first non-finite gradient's name.

    Read from the per-tensor norms already computed, so there is no extra pass over the
    gradients unless a norm is non-finite (then the gradients themselves are asked, since
    an inf norm may be an fp32 overflow of finite values).
    """
    values = norms.tolist() if isinstance(norms, Tensor) else list(norms)
    finite = [math.isfinite(v) for v in values]
    ranked = sorted(range(len(values)), key=lambda i: (not finite[i], values[i] if finite[i] else 0.0), reverse=True)
    top = [(named[i][0], values[i]) for i in ranked[:TOP_K]]
    if all(finite):
        return top, None
    names = [n for n, _ in named]
    if any(g is None for _, g in named):  # gradients no longer at hand (deferred records)
        return top, names[finite.index(False)]
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
        return [batch] if k == 1 else list(torch.tensor_split(batch, k))
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


# What the stage leaves on the device for the record, in this order (one batched copy reads them).
_DEVICE_FIELDS = ("loss", "loss_bad", "grad_norm", "clip_coef", "scale", "next_scale", "skipped")
_LAZY = frozenset(FIELDS) - {"step"}


class DeferredRecord(StepRecord):
    """A ``StepRecord`` whose numbers are still on the device (``TrainStep(sync_every=N)``).

    Reading any field but ``step`` first copies every pending record of its ``TrainStep``
    over, in one batched copy; after that it is a plain ``StepRecord``.
    """

    def __getattribute__(self, name: str) -> Any:
        if name in _LAZY:
            flush = object.__getattribute__(self, "_flush")
            if flush is not None:
                flush()
        return object.__getattribute__(self, name)


class TrainStep:
    """Run one guarded optimizer step per call and return its ``StepRecord``.

    The order, for every precision: zero grads -> inject the scheduled fault -> forward and
    loss under autocast -> **loss not finite: skip** (backward, step and the loss scale are
    left alone: a bad batch is not a scaling problem) -> scaled backward -> unscale -> global
    norm of the unscaled gradients (logged unclipped) -> **gradients not finite: skip** (the
    scale backs off) -> clip to ``max_norm`` -> step -> scheduler, only if the optimizer
    stepped -> scaler update. ``fp32`` and ``bf16`` use a disabled ``GradScaler``, so they go
    through the same lines.

    Unscale, check and clip take three passes over the gradients, not torch's five: one read
    yields the per-tensor norms of the *scaled* gradients (a NaN/inf among them is the inf
    check), then one read-write multiplies by ``coef / scale``; a skipped step writes
    nothing, nor does one known on the host to multiply by 1 (no clip, no scale: fp32 and
    bf16's usual step; torch multiplies by 1 anyway). An optimizer built with ``fused=True`` (torch's Adam, AdamW, SGD, Adagrad) does
    that multiply itself: ``scale / coef`` is handed over as its ``grad_scale`` with
    ``found_inf``, so the gradients are read once and the step needs no host sync.

    Host syncs per step (``sync_every=None``): one per micro-batch for the loss check
    (backward is skipped on the host), one read of the norm and the scale that decides the
    step, and one of the next scale (none when the scaler is disabled: fp32, bf16). Having
    read the norm, the check, the clip coefficient and the record are float arithmetic on
    the host, with the kernels' own bits, not ~25 0-dim kernels. A fused optimizer on a GPU
    instead keeps everything on the device (no sync inside the step) and copies the
    record's numbers once, after it. With ``sync_every=N`` the
    loss check and the skip decision stay on the device (a NaN/inf loss still skips the
    step and leaves the scale untouched; backward then runs on it), the records are
    ``DeferredRecord`` and are copied over in one batch every N steps, or when one is read;
    with a fused optimizer that is 0 syncs per step, otherwise 1 (a plain optimizer can
    only be skipped from the host). In that mode the scheduler steps every call, as in
    torch's AMP recipe, and the alarms and ``log`` see the records at each copy.
    Forensics read the per-tensor norms only on a skip or a clip.

    Under ``torch.distributed`` (DDP or FSDP2; nothing changes when it is not initialized)
    every rank takes the same decision: the loss check all-reduces the loss (one number per
    micro-batch, over ``process_group``, default the world) *before* backward, so a NaN on
    one rank makes every rank skip backward together instead of leaving the others waiting
    in DDP's gradient all-reduce; the record's loss is then the global-batch mean. The norm
    is global (sharded gradients are reduced across their mesh), so a decision taken from it
    on the host is the same on every rank (on the device path the scaler reduces
    ``found_inf``), and the records are equal on every rank. Rank 0 alone writes ``log_path``
    and raises the alarms.

    The parameters guarded are the optimizer's at each step (groups added later included).
    Bad arguments raise before anything changes; a skipped or failed step leaves the
    parameters, the optimizer, the scaler and the module's buffers as they were: the buffers
    (BatchNorm's running statistics) are copied before the forward and put back on a skip
    or an error. With ``sync_every`` the skip is known on the device only, so the copy is put
    back by a device-side select (one read-write of the buffers per step, no host sync).
    ``log_window=N`` keeps only the last N records in ``log`` (its summary stays exact).

    ``observer`` (e.g. ``labkit.precision.StaleMonitor``) is called with the named parameters
    right before the optimizer step (``before_step(params, step)``) and with the record right
    after it (``after_step(params, record)``, on every step, a skipped one too); it may add to
    the record, never change the order.

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
        sync_every: int | None = None,
        observer: Any = None,
        clipper: Clipper | None = None,
        detector: SpikeDetector | None = None,
        rewind: Rewind | None = None,
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
        if sync_every is not None and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"sync_every must be None (read every step) or an int >= 1, got {sync_every!r}.")
        # issue 15: the clip stage is a clipper (labkit.clippers); a float max_norm means NormClip(max_norm)
        if clipper is not None and max_norm not in (None, 1.0):
            raise ValueError(f"pass either max_norm ({max_norm!r}) or clipper ({clipper!r}), not both; for a fixed "
                             f"threshold with a clipper object use clipper=NormClip({max_norm!r}).")
        if clipper is not None and not isinstance(clipper, Clipper):
            raise TypeError(f"clipper must be one of labkit.clippers (NormClip, ZClip, ...), got {type(clipper).__name__}.")
        self.clipper = clipper if clipper is not None else (NormClip(check_max_norm(max_norm)) if max_norm is not None else None)
        if sync_every is not None and (detector is not None or rewind is not None or self.max_norm is None and clipper is not None):
            raise ValueError("sync_every defers the records, but an adaptive clipper, a detector or a rewind decides from "
                             "them every step: use sync_every=None with clipper=/detector=/rewind=.")
        self.detector, self.rewind = detector, rewind
        self._releases = 0
        self.norm_type = check_norm_type(norm_type)
        if not self.norm_type > 0:  # the inf check rides on the norms: only a p > 0 norm is inf/NaN on inf/NaN
            raise ValueError(f"TrainStep needs norm_type p > 0 (2.0, 1.0 or float('inf')), got {norm_type!r}.")
        self.sync_every = sync_every
        self._pending: list[tuple[DeferredRecord, Tensor, Tensor, list[str]]] = []
        self.scheduler = scheduler
        self.accumulation_steps = accumulation_steps
        self.process_group = process_group
        self.observer = observer  # sees the weights around the optimizer step (labkit.precision.StaleMonitor)
        self.device = device
        # the parts of _decides_on_host that never change (a read decides a plain optimizer's step; on a CPU it is free)
        self._host_can_decide = device.type == "cpu" or not getattr(optimizer, "_step_supports_amp_scaling", False)
        if scaler is None:
            scaler = GradScaler(self.device.type, enabled=precision == "fp16", process_group=process_group)
        self.scaler = scaler
        if scaler.is_enabled():
            check_scaled_norm_type(self.norm_type)
        self.faults = FaultSchedule.coerce(faults)
        self.skip_alarm = SkipAlarm(skip_alarm)
        self.clip_alarm = ClipAlarm(clip_alarm, clip_window)
        if rank() != 0:  # the records are the same on every rank: N ranks would warn N times
            self.skip_alarm.threshold = self.clip_alarm.rate = None
        self._log = StepLog(stream=log_path, window=log_window)  # last: it opens the file, once all else is valid
        self.step_count = 0
        self._params_key: tuple = ()
        self._params: list[tuple[str, nn.Parameter]] = []
        self._named_grads: list[tuple[str, Tensor]] = []  # this step's, for its forensics
        if rewind is not None:
            rewind.snapshot(self)  # step 0: a spike in the first `back` steps rewinds to the start

    @property
    def max_norm(self) -> float | None:
        """The fixed clip threshold, ``NormClip``'s (``self.clipper``'s now, if it was changed), or None."""
        return self.clipper.max_norm if isinstance(self.clipper, NormClip) else None

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

        deferred = self.sync_every is not None
        late_error: BaseException | None = None
        try:
            # the last step's gradients, kept for its forensics: let zero_grad free them, or they would
            # live through this forward and backward (a second set of gradients: 134 MB and ~9 ms a
            # step of freeing them late on a 33.6M-parameter model)
            self._named_grads = []
            opt.zero_grad(set_to_none=True)
            loss_total: Tensor | float = 0.0
            bad_loss, loss_bad = None, None
            for x, y in zip(_split(inputs, k), _split(targets, k)):
                with self._autocast():
                    out = self.model(**x) if isinstance(x, Mapping) else self.model(x)
                    if fault is not None:
                        out = fault.corrupt_output(out)
                    loss = _check_loss(self.loss_fn(out) if y is None else self.loss_fn(out, y))
                weight = 1.0 if k == 1 else _batch_size(x, None, 1) / n  # exact for a mean-reduced loss, even with unequal splits
                mean = mean_across(loss.detach(), self.process_group)
                if deferred:  # the check stays on the device; backward runs on a bad batch and its step is skipped
                    bad = ~torch.isfinite(mean)
                    loss_bad = bad if loss_bad is None else loss_bad | bad
                else:
                    # host sync, needed: on a bad batch backward must not run at all, on any rank
                    value = mean.item()
                    if not math.isfinite(value):
                        bad_loss = value
                        break
                    mean = value
                loss_total = loss_total + mean * weight
                scaler.scale(loss if weight == 1 else loss * weight).backward()  # x1 is exact: one op less

            if bad_loss is not None:
                scale = scaler.get_scale()
                record = StepRecord(
                    step, bad_loss, scale=scale, next_scale=scale, skipped=True, reason="nonfinite_loss",
                    lr=lrs[0], lrs=lrs,
                )
            elif deferred:
                values, norms = self._unscale_check_clip_step(step, torch.as_tensor(loss_total).reshape(()), loss_bad)
                if buffers:
                    skipped = values[-1] != 0
                    with torch.no_grad():  # the skip is on the device: put the buffers back by a select, no sync
                        for b, s in zip(buffers, saved):
                            b.copy_(torch.where(skipped.to(b.device), s, b))
            else:
                values, norms = self._unscale_check_clip_step(step, round_to(float(loss_total), torch.float32), None)
                record = self._record(step, lrs, values if isinstance(values, list) else values.tolist(), norms)
                self._annotate(record)
        except BaseException:
            # the user's model, loss or optimizer raised (or a bad loss): nothing of this step is kept
            scaler._abandon_iteration()
            _restore(buffers, saved)
            raise

        if deferred:
            if self.scheduler is not None:
                try:
                    self.scheduler.step()  # every call, as torch's recipe: whether it stepped is still on the device
                except Exception as e:  # the optimizer has stepped: finish and record the step, then raise it
                    late_error = e
            record = DeferredRecord(step, math.nan, lr=lrs[0], lrs=lrs, fault=fault.label if fault is not None else None)
            object.__setattr__(record, "_flush", self.flush)
            self._pending.append((record, values, norms, [name for name, _ in self._named_grads]))
            self.step_count += 1  # the step is complete: numbering stays true even if the file write fails
            try:
                if self.observer is not None:  # on the steps it observes, reading record.skipped copies the records
                    self.observer.after_step(self._named_params(), record)
                if len(self._pending) >= self.sync_every:
                    self.flush()  # raises LogWriteError on a full disk; the records are kept in memory
            finally:
                if late_error is not None:
                    raise late_error
            return record

        if record.skipped:
            _restore(buffers, saved)
        elif self.scheduler is not None:
            try:
                self.scheduler.step()
            except Exception as e:  # the optimizer has stepped: finish and record the step, then raise it
                late_error = e
        if self.observer is not None:  # every step: a skipped one's forward is worth seeing too
            self.observer.after_step(self._named_params(), record)
        record.fault = fault.label if fault is not None else None
        self._observe(record, append=False)
        if self.detector is not None:  # after the decision: a skipped or non-finite step never enters the window
            seen = record.post_clip_norm if record.clip_reason == "z_grad" else record.grad_norm  # its own cut
            self.detector.observe(record.loss, seen, admitted=not record.skipped)
        self.step_count += 1  # the step is complete: numbering stays true even if the file write fails
        try:
            if self.rewind is not None:  # may restore a snapshot: step_count goes back, this record is marked
                self.rewind.after(self, record)
            self._log.append(record)  # raises LogWriteError on a full disk; the record is kept in memory
        finally:
            if late_error is not None:
                raise late_error
        return record

    def _observe(self, record: StepRecord, append: bool = True) -> None:
        record.skip_streak = self.skip_alarm.observe(record.skipped, record.reason, record.step)
        if not record.skipped:
            self.clip_alarm.observe(record.clipped, record.step)
        if append:
            self._log.append(record)

    def _decides_on_host(self) -> bool:
        """Whether this step's check and coefficient are done on the host, from one read of the norm.

        With per-step records (``sync_every=None``), where a host sync decides the step anyway
        (an optimizer that is not ``fused=True``), and on a CPU, where a read costs nothing
        (a fused optimizer on a GPU keeps its sync-free step). Adaptive clippers and detectors
        keep their state on the device: they take the device path.
        """
        return self._host_can_decide and self.sync_every is None and self.detector is None and \
            (self.clipper is None or type(self.clipper) is NormClip)

    def _defenses(self, loss: Tensor, norm: Tensor, norms: Tensor, found_inf: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Issue 15: the detector's decision and the clipper's coefficient; return ``(coef, found_inf, keep_scale)``.

        The detector reads loss and norm on the host (one read, only with a detector). A z-score
        skip sets ``found_inf`` (the optimizer skips) and keeps the scale. Global-norm clippers give
        the coefficient from their state and observe the norm; per-tensor ones act after unscaling.
        """
        spike = self._spike = _no_spike()
        action = None
        if self.detector is not None:
            loss_value, norm_value = torch.stack([loss.double().cpu(), norm.double().cpu()]).tolist()
            if math.isfinite(norm_value):
                spike["z_loss"], spike["z_grad"] = self.detector.score(loss_value, norm_value)
                action, why = self.detector.decide(spike["z_loss"], spike["z_grad"])
                if action == "skip":
                    spike["reason"] = why
                    return torch.ones_like(norm), torch.ones_like(found_inf), True
        clipper = self.clipper
        if isinstance(clipper, NormClip):
            coef = clip_coef(norm, clipper.max_norm)  # threshold and reason: set in _record, with no read
        elif isinstance(clipper, GlobalClipper) and not isinstance(clipper, UpdateNormClip):
            clipper._to(norm.device)
            spike["threshold"] = clipper.threshold(clipper.state)
            limit = clipper.limit(clipper.state, norm.float())
            coef = clipper.coef(limit, norm.float())
            clipper.observe(norm.float(), limit)
        else:
            coef = torch.ones_like(norm)
        if action == "clip":
            z_coef = clip_coef(norm, self.detector.clip_limit())  # type: ignore[union-attr]
            spike["z_clip"] = bool((z_coef < coef).item())
            coef = torch.minimum(coef, z_coef)
        return coef, found_inf, False

    def _annotate(self, record: StepRecord) -> None:
        """Issue 15: add the detector's z-scores and the clipper's threshold, reason and guard to ``record``."""
        spike = self._spike
        record.z_loss, record.z_grad = spike["z_loss"], spike["z_grad"]
        if spike["reason"] is not None and record.skipped:
            record.reason = spike["reason"]
        if spike["threshold"] is not None:  # adaptive clippers only: one small read, after the step's sync
            record.threshold = float(spike["threshold"])
        if record.clipped:
            record.clip_reason = "z_grad" if spike.get("z_clip") else type(self.clipper).__name__
            if getattr(self.clipper, "max_consecutive_clips", None) is not None:  # a guard to read
                record.lockin = self._lockin()

    def _lockin(self) -> bool:
        """Whether the clipper's lock-in guard fired on this (clipped) step; rank 0 warns."""
        releases = self.clipper.releases() if self.clipper is not None else 0
        fired, self._releases = releases > self._releases, releases
        if fired and rank() == 0:
            self.clipper.check_lockin()  # type: ignore[union-attr]
        return fired

    def _record(
        self, step: int, lrs: list[float], values: list[float], norms: Tensor | list[float], names: list[str] | None = None
    ) -> StepRecord:
        loss, loss_bad, norm, coef, scale, next_scale, skipped = values
        skipped, clipped = bool(skipped), coef < 1.0
        # a scale below float32's normal range (set by hand: the default floor forbids it) skips every step
        dead = self.scaler.is_enabled() and not scale >= F32.tiny
        reason = ("nonfinite_loss" if loss_bad else "dead_scale" if dead else "nonfinite_grad") if skipped else None
        record = StepRecord(
            step, loss, grad_norm=norm, clip_coef=coef, clipped=clipped and not skipped, scale=scale,
            next_scale=next_scale, skipped=skipped, reason=reason, lr=lrs[0], lrs=list(lrs),
        )
        if self.max_norm is not None and reason != "nonfinite_loss":  # issue 15: NormClip's threshold, no read
            record.threshold = self.max_norm
            record.clip_reason = "NormClip" if record.clipped else None
        if reason in ("nonfinite_grad", "dead_scale") or record.clipped:
            if names is None:  # the gradients are still there: ask them
                record.top_grads, record.first_nonfinite = _forensics(self._named_grads, norms, self.process_group)
            else:  # deferred: the gradients are gone; the first non-finite norm names the parameter
                record.top_grads, record.first_nonfinite = _forensics([(n, None) for n in names], norms, None)
        return record

    def flush(self) -> None:
        """Copy every pending ``DeferredRecord`` over in one batch, then feed the alarms and the log."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        width = len(_DEVICE_FIELDS)
        sizes = [width + n.numel() for _, _, n, _ in pending]
        flat = torch.cat([torch.cat([v, n.to(v)]) for _, v, n, _ in pending]).tolist()  # the one host sync
        offset, write_error = 0, None
        for (record, _, _, names), size in zip(pending, sizes):
            row, offset = flat[offset:offset + size], offset + size
            object.__setattr__(record, "_flush", None)
            done = self._record(record.step, record.lrs, row[:width], row[width:], names)
            for name in _LAZY - {"lr", "lrs", "fault"}:
                setattr(record, name, getattr(done, name))
            try:
                self._observe(record)
            except LogWriteError as e:  # every record is still observed and kept; the first error is raised
                write_error = write_error or e
        if write_error is not None:
            raise write_error

    @property
    def log(self) -> StepLog:
        """The records so far (with ``sync_every``, reading it copies the pending ones over first)."""
        self.flush()
        return self._log

    def _unscale_check_clip_step(
        self, step: int, loss: Tensor | float, loss_bad: Tensor | None
    ) -> tuple[Tensor | list[float], Tensor]:
        """Unscale, check, clip, step or skip, update; return the record's numbers and the per-tensor norms.

        The numbers stay on the device (a tensor), except where the host decides the step
        (``_decides_on_host``): then they are already floats.
        """
        scaler, opt = self.scaler, self.optimizer
        host = self._decides_on_host()
        if not host:
            scale = scaler.get_scale_async().clone()  # update() writes the state in place; the record reads it after
        elif scaler.is_enabled():
            scale = scaler.get_scale_async()  # read with the norm, before update()
        params = self._named_params()
        named, grads = [], []
        for n, p in params:
            g = p.grad
            if g is not None:
                if g.is_sparse:
                    raise ValueError("sparse gradients are not supported by the global norm: use sparse=False in the model.")
                named.append((n, g))
                grads.append(g)
        self._named_grads = named
        # pass 1 (read): the per-tensor norms of the *scaled* gradients; a NaN/inf among them is the inf check
        scaled_norms = per_tensor_norms(grads, self.norm_type)
        if scaler.is_enabled():
            inv_scale: Tensor | None = scale.double().reciprocal().float()  # as torch's unscale_: exact for powers of two
            norms = scaled_norms * inv_scale.to(scaled_norms.device)
        else:  # a disabled scaler's scale is 1: nothing to undo (3 kernels less)
            inv_scale, norms = None, scaled_norms
        norm = total_norm(norms, self.norm_type)
        # A scaled norm can overflow float32 where the unscaled one would not (|g| * scale > 3.4e38):
        # then this skips (and backs off) where torch's unscale-then-norm would not. See tests/test_fused.py.
        # A dead scale (below float32's normal range, set by hand) has 1/scale = inf: the norm is
        # inf or NaN, so the step skips, is counted and backs off onto the floor, which revives it.
        # TrainStep takes orders p > 0 only: a NaN/inf norm, or 1/scale = inf, reaches the total.
        if host:
            # host sync, needed: a plain optimizer is skipped from the host (and on a CPU a read is
            # free). Reading the norm and the scale here instead of found_inf, the check, the
            # coefficient and the record are a few float operations with the kernels' own bits, not
            # ~25 0-dim kernels (~130 us a step on a CPU, 13% of the toy model's step; on a GPU,
            # launches). The norm is global, the same bits on every rank (DDP's gradients are equal,
            # FSDP2's norm is all-reduced), so the decision is too: found_inf needs no all-reduce.
            if inv_scale is None:
                norm_value, scale_value = norm.item(), 1.0
            else:
                norm_value, scale_value = torch.stack([norm, scale.to(norm)]).tolist()
            skip = not math.isfinite(norm_value)
            self._spike = _no_spike()
            max_norm = self.max_norm
            coef_value = 1.0 if max_norm is None else host_clip_coef(norm_value, max_norm, norm.dtype)
            if inv_scale is not None:  # coef * float32(1/scale), as the device path multiplies
                coef_times_inv = round_to(coef_value * round_to(1.0 / scale_value, torch.float32), norm.dtype)
            else:
                coef_times_inv = coef_value
            found_inf: Tensor | bool = skip
            keep = False
        else:
            loss = torch.as_tensor(loss)  # a float with per-step records: the detector and the record read it
            found_inf = torch.isnan(norm - norm).float()  # inf - inf and NaN - NaN are NaN: isfinite's answer in 2 kernels, not 4
            if loss_bad is not None:
                found_inf = torch.maximum(found_inf, loss_bad.float().to(found_inf.device))
            # issue 15: the detector decides here (on the host), then the clipper gives the coefficient
            coef, found_inf, keep = self._defenses(loss, norm, norms, found_inf)
        if getattr(opt, "_step_supports_amp_scaling", False):
            # fused optimizer: its kernel divides by grad_scale = scale / coef and skips on found_inf
            scaler.inf_check_(opt, found_inf, unscaled=False)
            if self.clipper is not None and not isinstance(self.clipper, GlobalClipper) or \
                    isinstance(self.clipper, UpdateNormClip):
                raise ValueError(f"{type(self.clipper).__name__} clips the gradients or the update itself: use a "
                                 "non-fused optimizer with it (fused=False).")
            if host:  # float32(1 / coef), as the device path's coef.reciprocal().float(); None for 1: no division
                inv_coef = round_to(round_to(1.0 / coef_value if coef_value else math.inf, norm.dtype), torch.float32)
                opt.grad_scale = None if inv_coef == 1.0 else \
                    torch.full((), inv_coef, dtype=torch.float32, device=norm.device)  # type: ignore[attr-defined]
            else:
                opt.grad_scale = coef.reciprocal().float()  # type: ignore[attr-defined]  # the scaler multiplies in the scale
            if self.observer is not None:  # whether the kernel skips is on the device: the observer reads record.skipped
                self.observer.before_step(params, step)
            found = scaler.step_async(opt)
        else:
            scaler.inf_check_(opt, found_inf, unscaled=True)
            if not scaler.will_skip(opt):  # host sync on the device path: a plain optimizer is skipped from the host
                # pass 2 (read-write): unscale and clip in one multiply (coef * 2^-k is exact); known on
                # the host to be x1 (no clip, no scale: most steps in fp32/bf16), it is left out
                if not host:
                    scale_grads_(grads, coef if inv_scale is None else (coef * inv_scale.to(coef.device)).to(coef.dtype))
                elif coef_times_inv != 1.0:
                    scale_grads_(grads, torch.full((), coef_times_inv, dtype=norm.dtype, device=norm.device))
                if self.clipper is not None and not isinstance(self.clipper, GlobalClipper):  # per tensor: on unscaled grads
                    coef, self._spike["threshold"] = self.clipper.clip_with_norms_([p for _, p in params], norms, norm)
                if self.observer is not None:
                    self.observer.before_step(params, step)
                if isinstance(self.clipper, UpdateNormClip):
                    self.clipper.begin_([p for _, p in params])
            found = scaler.step_async(opt)
            if isinstance(self.clipper, UpdateNormClip) and not scaler.will_skip(opt):
                coef, self._spike["threshold"] = self.clipper.after_step_([p for _, p in params])
        if keep:  # a z-score skip is not a scaling problem: the scale stays
            scaler.update(keep_if=torch.ones((), dtype=torch.bool, device=scale.device))
        elif loss_bad is None:
            scaler.update()
        else:
            scaler.update(keep_if=loss_bad.to(scale.device))
        if host:  # the next scale is the one read left (none when the scaler is disabled)
            return [loss, 0.0, norm_value, coef_value, scale_value, scaler.get_scale(), float(skip)], norms
        device = norm.device
        values = torch.stack([  # stack promotes the dtypes: one float64 row, read in one copy
            loss.to(device), (loss_bad if loss_bad is not None else torch.zeros((), device=device)).to(device), norm,
            coef.to(device), scale.to(device), scaler.get_scale_async().to(device), found.to(device),
        ]).double()
        return values, norms

    def state_dict(self) -> dict[str, Any]:
        """Return the step counter, alarm streaks, scaler state and the log's summary totals.

        Save the model, optimizer and scheduler as usual, next to it.
        """
        self.flush()
        state = {
            "step": self.step_count,
            "skip_alarm": self.skip_alarm.state_dict(),
            "clip_alarm": self.clip_alarm.state_dict(),
            "scaler": self.scaler.state_dict(),
            "log": self._log.state_dict(),
        }
        if self.clipper is not None:  # issue 15
            state["clipper"] = self.clipper.state_dict()
        if self.detector is not None:
            state["detector"] = self.detector.state_dict()
        return state

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
        # issue 15's parts are tried on copies (their state is a few device numbers): a damaged one raises here
        if self.clipper is not None and "clipper" in state:
            copy.deepcopy(self.clipper).load_state_dict(state["clipper"])
        if self.detector is not None and "detector" in state:
            copy.deepcopy(self.detector).load_state_dict(state["detector"])
        self.scaler.load_state_dict(state["scaler"])
        self.skip_alarm.load_state_dict(state["skip_alarm"])
        self.clip_alarm.load_state_dict(state["clip_alarm"])
        if self.clipper is not None and "clipper" in state:  # issue 15
            self.clipper.load_state_dict(state["clipper"])
            self._releases = self.clipper.releases()
        if self.detector is not None and "detector" in state:
            self.detector.load_state_dict(state["detector"])
        if "log" in state:
            self._log.load_state_dict(state["log"])
        self.step_count = step


def _no_spike() -> dict[str, Any]:
    """Return what ``_annotate`` reads when no detector or adaptive clipper has spoken."""
    return {"z_loss": math.nan, "z_grad": math.nan, "threshold": None, "why": None, "reason": None}


def _restore(buffers: list[Tensor], saved: list[Tensor]) -> None:
    with torch.no_grad():
        for b, s in zip(buffers, saved):
            b.copy_(s)
