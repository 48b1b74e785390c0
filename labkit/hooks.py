"""The hook protocol: how defenses and monitors join the guarded step, at named moments.

One step, in order (as OLMo-core's ``Callback``); ``TrainStep(hooks=[...])`` calls each
moment of every hook in the order given, and a plain training loop may call them itself::

    attach(trainer)                             once, when the hook joins a trainer
    pre_step(trainer, step)                     before the forward (the last step's gradients are gone)
    pre_forward(trainer, step) -> fault         the fault this step's batch carries (a
                                                ``labkit.faults.Fault``: ``Faults`` schedules them), or None
    post_backward(trainer, step) -> measures    backward done, or stopped at a non-finite loss: device
                                                tensors read with the record's numbers (no sync of
                                                their own), written to the record fields they name
                                                (``field/key``: one entry of a per-layer field)
    gradient_order(trainer, step) -> order      where backward produced each gradient,
                                                ``(positions, uses)`` as ``labkit.blame.BackwardOrder``
                                                keeps them, or None: a skip's record names the first
                                                non-finite gradient in it (else registration order)
    on_decision(trainer, view) -> Verdict       the loss and the global norm are known: skip, clip
                                                or annotate the step (``Verdict``), or None
    pre_optim_step(trainer, step, params)       the optimizer is about to step: the gradients are
                                                final (unscaled, clipped)
    post_step(trainer, params, record)          after the optimizer step (or skip) and the scheduler
    on_record(trainer, record) -> event         the record's numbers are on the host and the step
                                                count has moved on (per step; with ``sync_every``,
                                                at the batched copy); an event returned (a
                                                ``RewindEvent``) is logged after the record
    state_key, state_dict(), load_state_dict(state), check_state(state)

``trainer`` is the ``TrainStep`` (or whatever a plain loop passes: only what a hook reads
must be there). ``params`` is the optimizer's ``[(name, parameter)]``. A hook changes the
step only through what it returns: a fault from ``pre_forward``, measures from
``post_backward``, an order from ``gradient_order``, a ``Verdict`` from ``on_decision`` (the
only moment that decides) and an event from ``on_record``. The record fields a
hook sets (measures, ``Verdict.fields``) are the ones it declares in ``record_fields``. Every
decision must be the same on every rank:
a verdict computed from the view's loss and norm is (both are global under
``torch.distributed``); anything decided from local values is all-reduced by the hook (as
``Rewind`` does with one flag).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .records import Field, RewindEvent, declare, put

if TYPE_CHECKING:  # torch is imported where a tensor is read: the alarms import this module, torch-free
    from torch import Tensor

# where backward produced each gradient: {name: (rank, module)} and a tied parameter's {module: [rank, amax]}
GradientOrder = tuple[Mapping[str, tuple[int, str]], Mapping[str, Mapping[str, list[Any]]]]

__all__ = ["NO_VERDICT", "DecisionView", "GradientOrder", "Hook", "Hooks", "Verdict"]


@dataclass
class Verdict:
    """What a hook's ``on_decision`` asks of the step.

    ``skip``: skip the step for this reason (a ``labkit.reasons.Reason``); the loss scale stays,
    as a spike is no scaling problem; on a step already skipped it names the reason instead.
    ``clip_to``: clip the global norm to at most this (the smaller of it and the clipper's
    limit wins), ``clip_reason`` naming it in the record when it cut deeper (default: the
    hook's class name). ``fields``: record fields to set (e.g. ``z_loss``).

    >>> Verdict.merge([Verdict(clip_to=3.0, clip_reason="a"),
    ...                Verdict(skip="spike_grad", fields={"z_grad": 9.0}),
    ...                Verdict(clip_to=2.0, clip_reason="b")])
    Verdict(skip='spike_grad', clip_to=2.0, clip_reason='b', fields={'z_grad': 9.0})
    """

    skip: str | None = None
    clip_to: float | None = None
    clip_reason: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def merge(verdicts: Iterable[Verdict | None]) -> Verdict:
        """Return one verdict: the first skip, the lowest ``clip_to`` (and its reason), every field."""
        out = Verdict()
        for v in verdicts:
            if v is None:
                continue
            out.skip = out.skip if out.skip is not None else v.skip
            if v.clip_to is not None and (out.clip_to is None or v.clip_to < out.clip_to):
                out.clip_to, out.clip_reason = v.clip_to, v.clip_reason
            out.fields.update(v.fields)  # a later hook's wins
        return out

    def measured(self, values: Iterable[tuple[str, float]]) -> Verdict:
        """Return this verdict with measured record fields added (itself when there are none)."""
        values = dict(values)
        if not values:
            return self
        return Verdict(self.skip, self.clip_to, self.clip_reason, {**self.fields, **values})



NO_VERDICT = Verdict()  # what no hook says: shared, never changed (``measured`` makes a new one)

class DecisionView:
    """What ``on_decision`` sees: this step's loss and global gradient norm, and what is known about them.

    ``loss`` and ``norm`` are host floats; where the step decides on the device they are read
    from it when first asked, together (one host read, only for a hook that asks). ``norms``
    holds the per-tensor norms of the unscaled gradients (a device tensor; None when backward
    was skipped), ``scale`` the loss scale, ``loss_bad`` whether the loss was found non-finite
    on the host (backward was skipped, the step is skipped), ``batch`` the step's batch.

    >>> import torch
    >>> view = DecisionView(3, 0.5, torch.tensor(2.0)); view.norm, view.loss
    (2.0, 0.5)
    """

    def __init__(
        self, step: int, loss: float | Tensor, norm: float | Tensor, *, norms: Tensor | None = None,
        scale: float | Tensor = 1.0, loss_bad: bool = False, batch: Any = None,
    ) -> None:
        self.step, self.norms, self.scale, self.loss_bad, self.batch = step, norms, scale, loss_bad, batch
        self._loss, self._norm = loss, norm

    def _read(self) -> None:
        if not (isinstance(self._loss, float) and isinstance(self._norm, float)):
            import torch

            # one host read of both (the spike detector's, on the device path)
            self._loss, self._norm = torch.stack([torch.as_tensor(self._loss).double().cpu(),
                                                  torch.as_tensor(self._norm).double().cpu()]).tolist()

    @property
    def loss(self) -> float:
        self._read()
        return self._loss  # type: ignore[return-value]

    @property
    def norm(self) -> float:
        self._read()
        return self._norm  # type: ignore[return-value]


class Hook:
    """One defense or monitor, called at the guarded step's named moments (see the module docstring).

    Every moment does nothing by default: a hook overrides the ones it needs. ``state_key``
    names its state in ``TrainStep.state_dict()`` (None: not saved there). ``record_fields``
    declares the record fields it sets (``{name: labkit.records.Field(default)}``). ``per_step=True``
    says the hook needs every record before the next step (a rewind, a detector deciding from
    the windows it keeps): ``TrainStep`` then refuses ``sync_every``. ``priority`` orders the
    hooks, as OLMo-core's callbacks: higher first, ties in the order given (the alarms 100: they
    number the skip streak the others read; ``Triage`` 50: its skip reason is the first
    verdict; ``Rewind`` -100: last, it may restore a snapshot of everything the others hold).

    >>> class CountSkips(Hook):
    ...     state_key = "count_skips"
    ...     def __init__(self): self.skips = 0
    ...     def on_record(self, trainer, record): self.skips += record.skipped
    ...     def state_dict(self): return {"skips": self.skips}
    ...     def load_state_dict(self, state): self.skips = state["skips"]
    >>> from labkit.records import StepRecord
    >>> hook = CountSkips(); hook.on_record(None, StepRecord(0, float('nan'), skipped=True)); hook.skips
    1
    """

    state_key: str | None = None
    record_fields: Mapping[str, Field] = {}
    per_step: bool = False
    priority: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "record_fields" in cls.__dict__:  # the fields it sets, known to every record from now on
            declare(cls.__name__, cls.record_fields)

    def attach(self, trainer: Any) -> None:
        """Join ``trainer`` (once, at the end of its constructor)."""

    def pre_step(self, trainer: Any, step: int) -> None:
        """Prepare for optimizer step ``step``, before its forward."""

    def pre_forward(self, trainer: Any, step: int) -> Any:
        """Return the fault to inject into this step's batch (a ``labkit.faults.Fault``: faults import this
        module, so it is not named in the annotation), or None."""
        return None

    def post_backward(self, trainer: Any, step: int) -> Mapping[str, Tensor] | None:
        """Return, after backward, ``{record field: 0-dim device tensor}`` to read with the record, or None.

        The tensors join the read the step makes anyway (the norm and the scale, or the record's
        batched copy); only a step whose loss was not finite, without a loss scale to read, reads
        them on their own. A name ``field/key`` sets one entry of a per-layer field (a dict, e.g.
        ``attn_logit_max/h.0``).
        """
        return None

    def gradient_order(self, trainer: Any, step: int) -> GradientOrder | None:
        """Return where backward produced each gradient this step, ``(positions, uses)``, or None.

        ``positions[name] = (rank from the loss, module)`` and ``uses`` (a tied parameter's
        uses), as ``labkit.blame.BackwardOrder`` records them; asked after backward, kept with
        the step's record (a new dict each step: a deferred record keeps its own).
        """
        return None

    def on_decision(self, trainer: Any, view: DecisionView) -> Verdict | None:
        """Return a ``Verdict`` (skip, clip, fields) from this step's loss and norm, or None."""
        return None

    def pre_optim_step(self, trainer: Any, step: int, params: Sequence[tuple[str, Tensor]]) -> None:
        """Act right before ``optimizer.step()``, on the gradients it will use."""

    def post_step(self, trainer: Any, params: Sequence[tuple[str, Tensor]], record: Any) -> None:
        """Act after the optimizer step or skip; ``record`` may still be deferred (a read copies it over)."""

    def on_record(self, trainer: Any, record: Any) -> RewindEvent | None:
        """Read the record (its numbers on the host) before it is logged; return an event to log after it."""

    def state_dict(self) -> dict[str, Any]:
        """Return what ``load_state_dict`` needs to resume this hook."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``."""

    def check_state(self, state: Any) -> None:
        """Raise if ``state`` cannot be loaded, changing nothing (by default: load it into a copy)."""
        copy.deepcopy(self).load_state_dict(state)




def _nothing(*args: Any) -> None:
    """A moment no member keeps."""


class Hooks(Hook):
    """Hooks called by ``priority`` (higher first, ties as given): one hook to the step, each moment to
    the members that define it.

    ``decides``: whether any member has an ``on_decision`` (without one the step builds no view).

    >>> Hooks([]).on_decision(None, DecisionView(0, 1.0, 1.0))
    Verdict(skip=None, clip_to=None, clip_reason=None, fields={})
    """

    MOMENTS = ("attach", "pre_step", "pre_forward", "post_backward", "gradient_order", "on_decision",
               "pre_optim_step", "post_step", "on_record")

    def __init__(self, hooks: Iterable[Hook]) -> None:
        members = list(hooks)
        for h in members:
            if not isinstance(h, Hook):
                raise TypeError(f"hooks must be labkit.hooks.Hook objects (SpikeDetector, Rewind, "
                                f"StaleMonitor, your own subclass), got {type(h).__name__}.")
        self.members = sorted(members, key=lambda h: -h.priority)  # stable: ties keep the order given
        self.per_step = any(h.per_step for h in self.members)
        self.decides = any(type(h).on_decision is not Hook.on_decision for h in self.members)
        # per moment, the members that define it: a step calls no empty method (the alarms define one)
        self._at = {m: [h for h in self.members if getattr(type(h), m) is not getattr(Hook, m)]
                    for m in self.MOMENTS}
        # a moment that returns nothing or the first answer, kept by no member or one: called straight, not
        # through a loop (the step calls each moment every step; the defaults keep one or none of them)
        for m in ("pre_step", "pre_forward", "gradient_order", "pre_optim_step", "post_step"):
            if len(self._at[m]) <= 1:
                setattr(self, m, getattr(self._at[m][0], m) if self._at[m] else _nothing)
        self._named: set[str] = set()  # measure names already checked

    def attach(self, trainer: Any) -> None:
        for h in self._at["attach"]:
            h.attach(trainer)

    def pre_step(self, trainer: Any, step: int) -> None:
        for h in self._at["pre_step"]:
            h.pre_step(trainer, step)

    def pre_forward(self, trainer: Any, step: int) -> Any:
        """Return the first fault a member gives (by priority), or None."""
        for h in self._at["pre_forward"]:
            fault = h.pre_forward(trainer, step)
            if fault is not None:
                return fault
        return None

    def post_backward(self, trainer: Any, step: int) -> dict[str, Tensor]:
        measures: dict[str, Tensor] = {}
        if not self._at["post_backward"]:
            return measures
        for h in self._at["post_backward"]:
            measures.update(h.post_backward(trainer, step) or {})
        if not self._named.issuperset(measures):  # each name checked once, before the step decides
            for name in measures:
                put({}, name, None)  # records.put's check, on a throwaway: a name nobody declared raises
            self._named.update(measures)
        return measures

    def gradient_order(self, trainer: Any, step: int) -> GradientOrder | None:
        """Return the first order a member gives (by priority), or None."""
        for h in self._at["gradient_order"]:
            order = h.gradient_order(trainer, step)
            if order is not None:
                return order
        return None

    def on_decision(self, trainer: Any, view: DecisionView) -> Verdict:
        verdicts = []
        for h in self._at["on_decision"]:
            v = h.on_decision(trainer, view)
            if v is not None and v.clip_to is not None and v.clip_reason is None:
                v.clip_reason = type(h).__name__
            verdicts.append(v)
        return Verdict.merge(verdicts)

    def pre_optim_step(self, trainer: Any, step: int, params: Sequence[tuple[str, Tensor]]) -> None:
        for h in self._at["pre_optim_step"]:
            h.pre_optim_step(trainer, step, params)

    def post_step(self, trainer: Any, params: Sequence[tuple[str, Tensor]], record: Any) -> None:
        for h in self._at["post_step"]:
            h.post_step(trainer, params, record)

    def on_record(self, trainer: Any, record: Any) -> list[RewindEvent]:
        events = []
        for h in self._at["on_record"]:
            event = h.on_record(trainer, record)
            if event is not None:
                events.append(event)
        return events

    def state_dict(self) -> dict[str, Any]:
        """Return ``{state_key: state}`` of every member that has a ``state_key``."""
        return {h.state_key: h.state_dict() for h in self.members if h.state_key is not None}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise if any member's entry in ``state`` is damaged (entries a member lacks are left alone)."""
        for h in self.members:
            if h.state_key is not None and h.state_key in state:
                h.check_state(state[h.state_key])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for h in self.members:
            if h.state_key is not None and h.state_key in state:
                h.load_state_dict(state[h.state_key])

