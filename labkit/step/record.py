"""A step's record: its numbers read in one batch, why it skipped or clipped, and which layers to blame.

``Outcome`` is what a step leaves for its record (its numbers as floats or as one device
row, the per-tensor norms, the decision's threshold and reasons). ``build`` turns it into a
``StepRecord``; ``Pending`` keeps the outcomes of ``sync_every`` steps on the device behind
``DeferredRecord``s and copies them over in one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..blame import placed
from ..clip import first_nonfinite
from ..clippers import Clipper
from ..distributed import ProcessGroup, all_reduce_, is_distributed
from ..names import module_of
from ..reasons import Reason
from ..records import CORE, StepRecord, put
from ..scaler import F32

__all__ = ["DEVICE_FIELDS", "SKIPPED", "DeferredRecord", "Forensics", "Outcome", "Pending", "build",
           "forensics"]

TOP_K = 3
# What a step leaves on the device for its record, in this order (one batched copy reads them),
# then the hooks' measures.
DEVICE_FIELDS = ("loss", "loss_bad", "grad_norm", "clip_coef", "scale", "next_scale", "skipped")
SKIPPED = DEVICE_FIELDS.index("skipped")  # where a device row holds the skip
# what reading a deferred record copies over first: its numbers (not step, lr, lrs: known at once)
_LAZY = frozenset(CORE) - {"step", "lr", "lrs"} | {"fields", "get", "to_dict", "to_json", "post_clip_norm"}


class Forensics(NamedTuple):
    """Which layers a skipped or clipped step's record names (``StepRecord`` fields of the same names)."""

    top_grads: list[tuple[str, float]]
    first_nonfinite: str | None
    culprit_module: str | None


def forensics(
    named: list[tuple[str, Tensor | None]], norms: Tensor | list[float], group: ProcessGroup | None,
    order: Mapping[str, tuple[int, str]] | None = None, uses: Mapping[str, Mapping[str, list]] | None = None,
) -> Forensics:
    """Return the top-3 ``(name, norm)`` (non-finite first), the first non-finite gradient and its module.

    "First" is in backward order when ``order`` is given (``labkit.blame.BackwardOrder``'s
    ``positions``: the gradient produced nearest the loss, where the ``inf`` started, since it
    spreads into every gradient upstream), else, and for parameters it did not place, in
    registration order. The module is the one that produced that gradient (a tied weight's
    use whose share was non-finite: ``uses``, ``labkit.blame.placed``), else the parameter's
    own. Read from the per-tensor norms already
    computed, so there is no extra pass over the gradients unless a norm is non-finite (then
    those gradients themselves are asked, in that order, since an inf norm may be an fp32
    overflow of finite values). Gradients given as None (gone, with deferred records): the
    first non-finite norm names the parameter.

    >>> forensics([("a", None), ("b", None), ("c", None)], [1.0, math.inf, math.nan], None)
    Forensics(top_grads=[('b', inf), ('c', nan), ('a', 1.0)], first_nonfinite='b', culprit_module='')
    >>> order = {"4.w": (0, "4"), "0.w": (1, "0")}  # backward produced 4.w first
    >>> forensics([("0.w", None), ("4.w", None)], [math.inf, math.inf], None, order)
    Forensics(top_grads=[('0.w', inf), ('4.w', inf)], first_nonfinite='4.w', culprit_module='4')
    """
    values = norms.tolist() if isinstance(norms, Tensor) else list(norms)
    finite = [math.isfinite(v) for v in values]
    ranked = sorted(range(len(values)), key=lambda i: (not finite[i], values[i] if finite[i] else 0.0),
                    reverse=True)
    top = [(named[i][0], values[i]) for i in ranked[:TOP_K]]
    if all(finite):
        return Forensics(top, None, None)
    names = [n for n, _ in named]
    order = order or {}
    gone = any(g is None for _, g in named)
    # a tied weight: placed at the use that made it non-finite (a read on this skipped step). Not from a
    # deferred record's flush, which one rank may start alone (a collective there could hang): such a
    # record keeps the tied weight at its first use
    if uses and not gone:
        order = placed(order, uses, [names[i] for i, f in enumerate(finite) if not f], group)
    # the candidates, in backward order (a gradient with a finite norm holds no inf/NaN)
    bad = sorted((i for i, f in enumerate(finite) if not f),
                 key=lambda i: (order[names[i]][0] if names[i] in order else math.inf, i))
    if gone:
        where = 0
    else:
        grads = [named[i][1] for i in bad]
        culprit = first_nonfinite(grads, [names[i] for i in bad])  # type: ignore[arg-type]
        where = [names[i] for i in bad].index(culprit) if culprit is not None else len(bad)
        if is_distributed():
            # With FSDP2 the culprit may sit in another rank's shard: agree on the first by its place in
            # backward order, which every rank recorded alike (one number, on skipped steps only; every
            # rank is here, as the norms are global)
            first = torch.tensor([where], device=norms.device)  # type: ignore[union-attr]
            where = int(all_reduce_(first, "min", group).item())
    if where == len(bad):
        return Forensics(top, None, None)
    name = names[bad[where]]
    return Forensics(top, name, order[name][1] if name in order else module_of(name))


@dataclass(slots=True)
class Outcome:
    """What one step leaves for its record: its numbers and the evidence to explain them."""

    step: int
    lrs: list[float]
    fault: str | None
    values: list[float] | Tensor  # DEVICE_FIELDS then the measures: host floats, or one device row
    norms: Tensor | list[float] | None = None  # the per-tensor norms (None: backward was skipped)
    named: list[tuple[str, Tensor | None]] = field(default_factory=list)  # the gradients (None: gone)
    threshold: float | Tensor | None = None
    clipper: Clipper | None = None
    reason: str | None = None  # a hook's skip reason
    hook_clip: bool | Tensor = False  # a hook's clip cut deeper than the clipper's (a device bool: one read)
    clip_reason: str | None = None  # that hook's name for it
    fields: dict[str, Any] = field(default_factory=dict)
    measures: tuple[str, ...] = ()
    order: Mapping[str, tuple[int, str]] | None = None  # where backward produced each gradient
    uses: Mapping[str, Mapping[str, list]] | None = None  # a tied weight's uses (labkit.blame)


def build(o: Outcome, values: list[float], scaler_enabled: bool, group: ProcessGroup | None) -> StepRecord:
    """Return the ``StepRecord`` of ``o`` given its numbers on the host (``DEVICE_FIELDS``, then measures)."""
    loss, loss_bad, norm, coef, scale, next_scale, skipped = values[: len(DEVICE_FIELDS)]
    skipped, clipped = bool(skipped), coef < 1.0
    # a scale below float32's normal range (set by hand: the default floor forbids it) skips every step
    dead = scaler_enabled and not scale >= F32.tiny
    reason = (Reason.NONFINITE_LOSS if loss_bad else Reason.DEAD_SCALE if dead else Reason.NONFINITE_GRAD) \
        if skipped else None
    clipped = clipped and not skipped
    fields: dict[str, Any] = {}
    if o.fault is not None:
        put(fields, "fault", o.fault)
    if o.threshold is not None and reason is not Reason.NONFINITE_LOSS:  # adaptive: one small read
        put(fields, "threshold", float(o.threshold))
    if reason in (Reason.NONFINITE_GRAD, Reason.DEAD_SCALE) or clipped:  # a hook's skip too
        top, first, module = forensics(o.named, o.norms, group, o.order, o.uses)  # type: ignore[arg-type]
        put(fields, "top_grads", top)
        if first is not None:
            put(fields, "first_nonfinite", first)
            put(fields, "culprit_module", module)
    if clipped:
        put(fields, "clip_reason", o.clip_reason if o.hook_clip else type(o.clipper).__name__)
        if o.clipper is not None and o.clipper.lockin():
            put(fields, "lockin", True)
    for name, value in [*o.fields.items(), *zip(o.measures, values[len(DEVICE_FIELDS):])]:
        put(fields, name, value)
    why = str(o.reason) if o.reason is not None and skipped else reason.value if reason else None
    return StepRecord(o.step, loss, grad_norm=norm, clip_coef=coef, clipped=clipped, scale=scale,
                      next_scale=next_scale, skipped=skipped, reason=why, lr=o.lrs[0], lrs=o.lrs,
                      fields=fields)


class DeferredRecord(StepRecord):
    """A ``StepRecord`` whose numbers are still on the device (``TrainStep(sync_every=N)``).

    Reading any field but ``step`` first copies every pending record of its ``TrainStep``
    over, in one batched copy; after that it is a plain ``StepRecord``.
    """

    __slots__ = ("_flush",)

    def __getattribute__(self, name: str) -> Any:
        if name in _LAZY:
            flush = object.__getattribute__(self, "_flush")
            if flush is not None:
                flush()
        return object.__getattribute__(self, name)


class Pending:
    """The outcomes of deferred steps, on the device until ``flush`` copies them over in one batch."""

    def __init__(self) -> None:
        self.items: list[tuple[DeferredRecord, Outcome]] = []

    def __len__(self) -> int:
        return len(self.items)

    def defer(self, o: Outcome, flush: Callable[[], None]) -> DeferredRecord:
        """Return the ``DeferredRecord`` of ``o``; reading it calls ``flush``."""
        record = DeferredRecord(o.step, math.nan, lr=o.lrs[0], lrs=o.lrs)
        object.__setattr__(record, "_flush", flush)
        o.named = [(n, None) for n, _ in o.named]  # names only: the gradients are freed by the next step
        self.items.append((record, o))
        return record

    def flush(self, scaler_enabled: bool, finish: Callable[[StepRecord], None]) -> None:
        """Copy every pending outcome over (one host sync), fill every record, then ``finish`` each, in order.

        An error from ``finish`` (a log write failing, a hook raising) does not stop the others:
        every record already holds its numbers before the first is finished, every record is
        finished, then the first error is raised.
        """
        items, self.items = self.items, []
        if not items:
            return
        rows = [torch.cat([o.values, o.norms.to(o.values)]) for _, o in items]  # type: ignore[union-attr, arg-type]
        flat = torch.cat(rows).tolist()  # the one host sync
        offset = 0
        for (record, o), row in zip(items, rows):
            width = len(o.values)
            numbers, offset = flat[offset:offset + len(row)], offset + len(row)
            object.__setattr__(record, "_flush", None)
            o.norms = numbers[width:]
            done = build(o, numbers[:width], scaler_enabled, None)
            for name in (*CORE, "fields"):
                object.__setattr__(record, name, object.__getattribute__(done, name))
        error = None
        for record, _ in items:
            try:
                finish(record)
            except Exception as e:  # the steps ran: each is still given to the hooks and the log
                error = error or e
        if error is not None:
            raise error
