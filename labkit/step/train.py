"""``TrainStep``: the guarded training step, the one place where the AMP order lives, read top to bottom.

Its parts pass data explicitly and never reach back into it: ``batch`` (the batch, its
micro-batches, the buffers kept), ``decision`` (unscale, check and clip as one pure decision
on the device, read to the host once), ``record`` (the record, forensics, deferred records) and
``parts`` (what it is built from, checked). Defenses and monitors join through
``labkit.hooks``; the step imports none of them.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..alarms import LabkitWarning
from ..autocast import PRECISIONS, autocast
from ..clip import check_scaled_norm_type, round_to, scale_grads_
from ..clippers import Clipper
from ..distributed import ProcessGroup, mean_across
from ..hooks import NO_VERDICT, DecisionView, GradientOrder, Hook, Verdict
from ..records import StepRecord
from ..scaler import GradScaler
from ..steplog import StepLog
from ..validate import check_int
from .batch import Batch, Buffers, LossCheck, gradient_sync
from .decision import Decision, decide, read, skip_bad_loss, unscaled_norms
from .parts import (
    DEFAULT_MAX_NORM,
    GuardedParams,
    check_deferred,
    check_parts,
    make_clipper,
    make_hooks,
    make_log,
    refuse_removed,
)
from .record import SKIPPED, Outcome, Pending, build

__all__ = ["TrainStep"]


class TrainStep:
    """Run one guarded optimizer step per call and return its ``StepRecord``.

    The order, for every precision (``fp32`` and ``bf16`` use a disabled ``GradScaler``: the
    same lines): zero grads -> the scheduled fault -> forward and loss under autocast -> **loss
    not finite: skip** (no backward, no step, the loss scale left alone: a bad batch is not a
    scaling problem) -> scaled backward -> unscale -> global norm of the unscaled gradients
    (logged unclipped) -> **gradients not finite: skip** (the scale backs off) -> clip -> step
    -> scaler update -> scheduler, only if the optimizer stepped -> hooks -> record.

    Unscale, check and clip take three passes over the gradients, not torch's five: one read
    for the per-tensor norms of the *scaled* gradients (a NaN/inf among them is the inf
    check), one read-write by ``coef / scale``; a skipped step writes nothing, nor does an
    fp32 step read to multiply by 1. A ``fused=True`` optimizer (torch's Adam, AdamW, SGD,
    Adagrad) does that multiply itself: ``scale / coef`` is its ``grad_scale``.

    One decision path: the check and the coefficient are 0-dim tensors on the device
    (``labkit.step.decision``). Host syncs per step (``sync_every=None``): one per micro-batch
    for the loss check; for a plain optimizer, one read of the decision (it must be skipped
    from the host) and, with an enabled scaler, one of the next scale; for a fused one, one
    read of the record's row after the update (its kernel skips by itself). A hook whose
    ``on_decision`` reads the view's loss or norm adds one. With ``sync_every=N`` the loss check
    and the skip stay on the device (a NaN/inf loss still skips and leaves the scale alone;
    backward runs on it), the records are ``DeferredRecord``s copied over in one batch every N
    steps or when one is read, and the scheduler steps every call, as in torch's AMP recipe.

    Under ``torch.distributed`` (DDP, FSDP2) every rank decides alike: the loss is all-reduced
    (one number per micro-batch, over ``process_group``) *before* backward, so a NaN on one
    rank makes every rank skip backward together; the norm is global, and so are the records.
    Rank 0 alone writes the log file and raises the alarms.

    The parameters guarded are the optimizer's at each step (groups added later included), on
    the model's device (move the model first). Bad arguments raise before anything changes; a
    skipped or failed step leaves the parameters, the optimizer, the scaler and the module's
    buffers (BatchNorm's running statistics) as they were. ``log``: a file path the records
    stream to (JSONL), or a ``StepLog`` (``StepLog(stream=path, window=N)`` keeps the last N).

    The clip stage is ``max_norm`` (torch's name: ``NormClip(max_norm)``) or ``clipper``
    (``NormClip(1.0, norm_type=math.inf)``, ``ZClip()``...). Defenses and monitors are
    ``labkit.hooks.Hook`` objects called at named moments, in the order of their ``priority``:
    ``hooks=[...]`` (``Faults``, ``Triage``, ``SpikeDetector``, ``Rewind``, ``StaleMonitor``,
    your own) and the default hooks (``parts.default_hooks``: ``SkipAlarm(8)``,
    ``ClipAlarm(0.5, window=100)``, ``BackwardOrder()``, each replaced by a hook of its class
    given in ``hooks``: ``hooks=[SkipAlarm(None)]`` silences that alarm). Skips name the first
    non-finite gradient in backward order (``labkit.blame``).

    >>> from labkit.tasks import ToyTask
    >>> task = ToyTask(); model = task.model()
    >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp16")
    >>> record = step(*task.batch(0)); record.skipped, record.scale
    (False, 65536.0)
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[Tensor, Tensor], Tensor],
        *, precision: str = "fp32", max_norm: float | None = DEFAULT_MAX_NORM, clipper: Clipper | None = None,
        scaler: GradScaler | None = None, scheduler: Any = None, accumulation_steps: int = 1,
        hooks: Sequence[Hook] = (), log: str | os.PathLike | StepLog | None = None,
        process_group: ProcessGroup | None = None, sync_every: int | None = None, **removed: Any,
    ) -> None:
        refuse_removed(removed)  # the keywords that became hooks, log= and NormClip's norm_type
        self.device = check_parts(model, optimizer, loss_fn, scheduler)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}.")
        self.accumulation_steps = check_int("accumulation_steps", accumulation_steps, 1)
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(
                f"scaler must be a labkit.GradScaler, got {type(scaler).__name__}: torch's GradScaler.step() "
                "does not say whether it skipped, which TrainStep needs. labkit.GradScaler takes the same "
                "arguments."
            )
        if precision == "bf16" and scaler is not None and scaler.is_enabled():
            warnings.warn("a loss scaler is not needed with bf16 (its range is fp32's); it only costs time "
                          "and can skip steps. Pass scaler=None to keep the NaN/Inf checks without scaling.",
                          LabkitWarning, stacklevel=2)
        self.model, self.optimizer, self.loss_fn, self.precision = model, optimizer, loss_fn, precision
        self.sync_every = check_int("sync_every", sync_every, 1, none="read every step")
        self.clipper = make_clipper(max_norm, clipper)
        self.hooks = make_hooks(hooks)  # yours, and the defaults (alarms, blame) of no class among them
        check_deferred(sync_every, self.hooks.members, self.clipper)
        self.norm_type = self.clipper.norm_type if self.clipper is not None else 2.0
        self.scheduler, self.process_group = scheduler, process_group
        if scaler is None:
            scaler = GradScaler(self.device.type, enabled=precision == "fp16", process_group=process_group)
        if scaler.is_enabled():
            check_scaled_norm_type(self.norm_type)
        self.scaler = scaler
        self._log = make_log(log)  # last: it opens the file, all else valid
        self.step_count = 0
        self._named_params = GuardedParams(model, optimizer)
        self._params: list[tuple[str, nn.Parameter]] = []  # this step's (read once, in _decide)
        self._named_grads: list[tuple[str, Tensor]] = []  # this step's, for its forensics
        self._order: GradientOrder | None = None  # this step's, from the hooks: where backward made each
        self._pending = Pending()
        self._one: Tensor | None = None  # a disabled scaler's scale, on the gradients' device
        self.hooks.attach(self)  # a Rewind takes its first snapshot: a spike in the first steps rewinds here

    def __call__(self, inputs: Any, targets: Tensor | None = None) -> StepRecord:
        """Train on one batch (split in ``accumulation_steps`` micro-batches) or on micro-batches; record it.

        ``inputs``: a tensor (``model(inputs)``), a dict of tensors (``model(**inputs)``; with
        ``targets=None`` the loss is ``loss_fn(output)``), or the micro-batches a loop fetched (a list,
        an iterator, a callable: ``batch.given_micro_batches``). Bad arguments raise before anything
        changes; an error from the model, loss or optimizer leaves all as it was (a scheduler's: raised
        after its step is recorded)."""
        step = self.step_count
        fault = self.hooks.pre_forward(self, step)  # Faults' (labkit.faults), once per step number
        batch = Batch(inputs, targets, self.accumulation_steps, self.device, fault)
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        buffers = Buffers(self.model)  # the forward changes them before the loss is checked
        self.hooks.pre_step(self, step)
        try:
            loss = self._forward_backward(batch)  # forward and loss check -> scaled backward
            measures = self.hooks.post_backward(self, step)
            self._order = self.hooks.gradient_order(self, step)  # kept with the record, for its forensics
            decision = self._decide(step, loss, batch, measures)  # unscaled norms -> check -> clip, verdict
            found = None
            if not loss.bad:  # a non-finite loss: nothing to step, the scale untouched
                found = self._step_or_skip(step, decision, measures)  # unscale+clip (one multiply), step/skip
                self._update_scale(decision, loss)  # back off, keep or grow the scale
            outcome = self._outcome(step, lrs, batch, loss, decision, found, measures)
        except BaseException:  # the model, loss or optimizer raised: nothing of this step is kept
            self.scaler.abandon_iteration()
            buffers.restore()
            raise
        return self._finish(outcome, buffers, stepped=not loss.bad)  # scheduler -> hooks -> record

    def _forward_backward(self, batch: Batch) -> LossCheck:
        """Run forward and loss under autocast, check the loss, backward the scaled loss, per micro-batch."""
        # the last step's gradients, kept for its forensics: let zero_grad free them, or they would live
        # through this forward and backward (a second set of gradients, freed late)
        self._named_grads = []
        self._named_params.zero_grad()
        deferred, total, flag = self.sync_every is not None, 0.0, None
        for i, (x, y, weight) in enumerate(batch.micro_batches()):
            with gradient_sync(self.model, on=i == batch.k - 1):  # DDP/FSDP2 reduce in the last backward only
                with autocast(self.precision, self.device):
                    loss = batch.loss(self.model, self.loss_fn, x, y)
                if deferred:  # the check stays on the device; backward runs on a bad batch, the step skips
                    mean = mean_across(loss.detach(), self.process_group)
                    flag = ~torch.isfinite(mean) if flag is None else flag | ~torch.isfinite(mean)
                else:
                    # host sync, needed: backward must not run on a bad batch, any rank (.item() needs no
                    # detach; mean_across detaches what it reduces)
                    value = mean_across(loss, self.process_group).item()
                    if not math.isfinite(value):
                        return LossCheck(value, bad=True)
                    mean = value
                total = total + mean * weight
                self.scaler.scale(batch.share(loss, weight)).backward()
        if deferred:
            return LossCheck(torch.as_tensor(total).reshape(()), flag=flag)
        return LossCheck(round_to(float(total), torch.float32))

    def _decide(self, step: int, loss: LossCheck, batch: Batch, measures: dict[str, Tensor]) -> Decision:
        """Read the gradients once for their norms; decide on the device, with the hooks' say."""
        scaler, enabled = self.scaler, self.scaler.is_enabled()
        if loss.bad:  # backward never ran: the hooks may still say why
            scale, *measured = read(scaler.get_scale_async(), *measures.values()) if measures else \
                [scaler.get_scale()]
            verdict = self._verdict(step, loss.value, math.nan, scale=scale, loss_bad=True, batch=batch)
            return skip_bad_loss(scale, verdict.measured(zip(measures, measured)))
        self._params = self._named_params()  # this step's: the hooks and the clipper see the same list
        named = [(name, p.grad) for name, p in self._params if p.grad is not None]
        grads = [g for _, g in named]
        if any(g.is_sparse for g in grads):
            raise ValueError("sparse gradients are not supported by the global norm: use sparse=False in the "
                             "model.")
        self._named_grads = named
        scale = scaler.get_scale_async() if enabled else None  # update() leaves this tensor as it is
        norms, norm, inv_scale = unscaled_norms(grads, scale, self.norm_type)
        if scale is None:  # a disabled scaler's: one 1 on the norm's device, made once
            if self._one is None or self._one.device != norm.device:
                self._one = torch.ones((), device=norm.device)
            scale = self._one
        verdict = self._verdict(step, loss.value, norm, norms=norms, scale=scale, batch=batch)
        return decide(norm, norms, scale, inv_scale, self.clipper, verdict, loss.flag)

    def _verdict(self, step: int, loss: float | Tensor, norm: float | Tensor, **view: Any) -> Verdict:
        """Return the hooks' say on this step (no view is built when none of them decides)."""
        if not self.hooks.decides:
            return NO_VERDICT
        return self.hooks.on_decision(self, DecisionView(step, loss, norm, **view))

    def _step_or_skip(self, step: int, d: Decision, measures: dict[str, Tensor]) -> Tensor:
        """Step the optimizer on the unscaled, clipped gradients, or skip it; return ``found_inf``."""
        opt, scaler, clipper, params = self.optimizer, self.scaler, self.clipper, self._params
        fused = getattr(opt, "_step_supports_amp_scaling", False)  # its kernel unscales, clips and skips
        # host sync, needed: a plain optimizer is skipped from the host; a fused one's read is free on a CPU,
        # and a coefficient of 1 read there spares its kernel a division of every gradient
        if self.sync_every is None and (not fused or self.device.type == "cpu"):
            d.read(*measures.values())
        found = d.skip if d.host is None else d.host[2] != 0
        if fused:
            if clipper is not None and not clipper.fused_ok:
                raise ValueError(f"{type(clipper).__name__} clips the gradients or the update itself: use a "
                                 "non-fused optimizer with it (fused=False).")
            scaler.inf_check_(opt, found, unscaled=False)
            opt.grad_scale = d.grad_scale()  # type: ignore[attr-defined]  # the scaler multiplies in the scale
            self.hooks.pre_optim_step(self, step, params)  # whether the kernel skips is on the device
            return scaler.step_async(opt)
        scaler.inf_check_(opt, found, unscaled=True)
        if not scaler.will_skip(opt):  # deferred records: the one read of found_inf a plain optimizer needs
            factor = d.factor()  # pass 2 (read-write): unscale and clip in one multiply; x1 is left out
            if factor is not None:
                scale_grads_([g for _, g in self._named_grads], factor)
            if clipper is not None and not clipper.fused_ok:  # a per-tensor clip, on the unscaled gradients
                d.take(clipper.clip_unscaled_([p for _, p in params], d.norms, d.norm))  # type: ignore[arg-type]
            self.hooks.pre_optim_step(self, step, params)
        found = scaler.step_async(opt)
        if clipper is not None and not clipper.fused_ok and not scaler.will_skip(opt):  # a clip of the update
            d.take(clipper.after_step_([p for _, p in params]))
        return found

    def _update_scale(self, d: Decision, loss: LossCheck) -> None:
        """Back off on an overflow, else count to growth; a hook's skip or a bad loss keep the scale."""
        if not d.keep_scale and loss.flag is None:
            self.scaler.update()
        elif d.keep_scale:
            self.scaler.update(keep_if=True)
        else:  # a non-finite loss found on the device is no scaling problem either
            self.scaler.update(keep_if=loss.flag.to(d.scale.device))  # type: ignore[union-attr]

    def _outcome(self, step: int, lrs: list[float], batch: Batch, loss: LossCheck, d: Decision,
                 found: Tensor | None, measures: dict[str, Tensor]) -> Outcome:
        """Return what the record is made of: its numbers (floats, or one device row) and the evidence."""
        order, uses = self._order or (None, None)
        o = Outcome(step, lrs, batch.label, [], d.norms, self._named_grads, d.threshold, self.clipper,
                    d.reason, d.hook_clip, d.clip_reason, d.fields, order=order, uses=uses)
        if loss.bad:
            o.values = [loss.value, 1.0, math.nan, 1.0, d.scale, d.scale, 1.0]
        elif d.host is not None:  # read to step a plain optimizer: only the next scale is left to read
            norm, coef, skip, scale = d.host[:4]
            o.values = [loss.value, 0.0, norm, coef, scale, self.scaler.get_scale(), skip, *d.measured]
            o.measures = tuple(measures)
        else:
            dev = d.norm.device
            # a disabled scaler's next scale is this step's 1: no tensor made for it
            next_scale = self.scaler.get_scale_async() if self.scaler.is_enabled() else d.scale
            row = [d.norm, d.coef.to(dev), d.scale.to(dev), next_scale.to(dev), found.to(dev),  # type: ignore[union-attr]
                   *(m.to(dev) for m in measures.values())]
            o.measures = tuple(measures)
            if self.sync_every is None:  # the loss was checked on the host: the device's numbers, one read
                norm, coef, scale, nxt, skip, *measured = torch.stack(row).double().tolist()
                o.values = [loss.value, 0.0, norm, coef, scale, nxt, skip, *measured]
            else:  # stack promotes the dtypes: one float64 row, read in one copy at the flush
                o.values = torch.stack([torch.as_tensor(loss.value).to(dev), loss.flag.to(dev),  # type: ignore[union-attr]
                                        *row]).double()
        return o

    def _finish(self, o: Outcome, buffers: Buffers, stepped: bool) -> StepRecord:
        """Put the buffers back on a skip, step the scheduler, call the hooks, log: the step is complete."""
        deferred, late_error = self.sync_every is not None, None
        if deferred:  # the skip is known on the device only: the buffers come back by a select, no sync
            buffers.restore_where(o.values, SKIPPED)  # type: ignore[arg-type]
            record: StepRecord = self._pending.defer(o, self.flush)
        else:
            record = build(o, o.values, self.scaler.is_enabled(), self.process_group)  # type: ignore[arg-type]
            if record.skipped:
                buffers.restore()
        if self.scheduler is not None and (deferred or not record.skipped):  # deferred: every call, as torch
            try:
                self.scheduler.step()
            except Exception as e:  # the optimizer has stepped: finish and record the step, then raise it
                late_error = e
        try:
            if deferred or stepped:
                self.hooks.post_step(self, self._params, record)
            self.step_count += 1  # the step is complete: numbering stays true even if the file write fails
            if not deferred:
                self._append(record)  # raises LogWriteError on a full disk; the record is kept in memory
            elif len(self._pending) >= self.sync_every:  # type: ignore[operator]
                self.flush()
        finally:
            if late_error is not None:
                raise late_error
        return record

    def _append(self, record: StepRecord) -> None:
        self._log.append(record, self.hooks.on_record(self, record))  # hooks first; a rewind's event follows

    @property
    def max_norm(self) -> float | None:
        """The fixed clip threshold (``NormClip``'s, the clipper of now), or None."""
        return self.clipper.fixed_threshold if self.clipper is not None else None

    @property
    def log(self) -> StepLog:
        """The records so far (with ``sync_every``, reading it copies the pending ones over first)."""
        self.flush()
        return self._log

    def flush(self) -> None:
        """Copy every pending ``DeferredRecord`` over in one batch; give each to the hooks and the log."""
        self._pending.flush(self.scaler.is_enabled(), self._append)

    def state_dict(self) -> dict[str, Any]:
        """Return the step counter, the hooks' state (alarms, detector...), the scaler's, the clipper's and
        the log's summary totals. Save the model, optimizer and scheduler as usual, next to it."""
        self.flush()
        state = {"step": self.step_count, **self.hooks.state_dict(), "scaler": self.scaler.state_dict(),
                 "log": self._log.state_dict()}
        if self.clipper is not None:
            state["clipper"] = self.clipper.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next call continues the same step numbering, faults and summary.

        Everything is validated before anything is written: a damaged state raises and leaves
        this ``TrainStep`` as it was. A state saved without ``"log"`` (older labkit) resumes
        with a summary that covers the resumed steps only.
        """
        if not isinstance(state, dict):
            raise TypeError(f"TrainStep state must be a dict from TrainStep.state_dict(), got "
                            f"{type(state).__name__}.")
        missing = {"step", "scaler"} - state.keys()  # each hook checks its own entry, where there is one
        if missing:
            raise KeyError(f"TrainStep state_dict lacks {sorted(missing)}; pass what TrainStep.state_dict() "
                           "returned.")
        step = check_int("TrainStep state['step']", state["step"], 0)
        self.hooks.check_state(state)  # each part raises on damage; nothing is written yet
        if self.scaler.is_enabled():
            GradScaler.parse_state(state["scaler"])
        if "log" in state:
            StepLog().load_state_dict(state["log"])
        if self.clipper is not None and "clipper" in state:  # tried on a copy: a few device numbers
            copy.deepcopy(self.clipper).load_state_dict(state["clipper"])
        self.scaler.load_state_dict(state["scaler"])
        self.hooks.load_state_dict(state)
        if self.clipper is not None and "clipper" in state:
            self.clipper.load_state_dict(state["clipper"])
        if "log" in state:
            self._log.load_state_dict(state["log"])
        self.step_count = step
