"""Bad batches on a schedule, to watch the safety belts work.

Four kinds, each deterministic:

- ``spike``: the inputs times ``magnitude`` (default 1000): a single bad batch that spikes
  the gradient norm by orders of magnitude. Clipping is the belt. A batch with no floating
  tensor (token ids) cannot be scaled: the loss the step uses is, so the gradient norm moves by
  exactly ``magnitude``.
- ``nan`` / ``inf``: one input entry set to NaN / +inf: invalid data. The loss is not
  finite, so the step must be skipped before backward (clipping cannot repair it). With token
  ids the first activation the data makes (an embedding's output: the first floating output of
  a module in the forward) gets the entry instead.
- ``overflow``: the forward is untouched, but the gradient flowing back into the activation
  nearest the loss (the first module output backward reaches in the autocast dtype: an LM head's
  logits, a regression's output) is driven to twice fp16's largest value (65504 * 2 = 131008 in
  its largest entry). Under fp16 the scaled backward overflows at any loss scale, so the scaler
  must skip and back off; fp32 and bf16 can hold it, and see a gradient spike instead. A loss
  computed inside the model (nanoGPT's ``(logits, loss)``) overflows too: the activation is the
  logits, not the fp32 loss.

In ``TrainStep`` the ``Faults`` hook gives each step its fault (``hooks=[Faults(["50:nan"])]``)
and a fault fires once per step number: a step that a rewind replays (the same number again)
runs without it, as the data that carried it was skipped. An ``Injection`` is one
step's fault at work and says whether it acted; the record names a fault only if it did, and a
fault that cannot act on the model raises, saying where to inject instead.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .hooks import Hook
from .names import FP16_MAX
from .records import Field, RewindEvent
from .validate import check_int

__all__ = ["Fault", "FaultSchedule", "Faults", "Injection", "floating_tensors"]

KINDS = ("spike", "nan", "inf", "overflow")


@dataclass(frozen=True)
class Fault:
    """One kind of bad batch; ``magnitude`` is the spike factor (ignored by the other kinds).

    >>> Fault("spike").label, Fault("nan").label
    ('spike:1000', 'nan')
    """

    kind: str
    magnitude: float = 1000.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of {', '.join(KINDS)}.")
        if self.kind == "spike" and not (self.magnitude > 0 and self.magnitude < float("inf")):
            raise ValueError(f"a spike's magnitude must be a finite number > 0, got {self.magnitude!r}.")

    @property
    def label(self) -> str:
        return f"spike:{self.magnitude:g}" if self.kind == "spike" else self.kind

    def corrupt_batch(self, batch: Tensor | Mapping[str, Any]) -> Tensor | dict[str, Any]:
        """Return the bad version of a tensor batch or a ``model(**batch)`` dict (its floating tensors).

        A spike scales every floating tensor of a dict; nan/inf go into the first one.

        >>> Fault("nan").corrupt_batch({"ids": torch.tensor([1]), "x": torch.ones(2)})["x"]
        tensor([nan, 1.])
        """
        if isinstance(batch, Tensor):
            return self.corrupt_inputs(batch)
        out, done = dict(batch), False
        for key, value in batch.items():
            wanted = not (done and self.kind != "spike")  # a spike scales them all; nan/inf the first
            if isinstance(value, Tensor) and value.is_floating_point() and wanted:
                out[key], done = self.corrupt_inputs(value), True
        if not done and self.kind in ("nan", "inf"):
            # raises, saying why
            return self.corrupt_inputs(next(v for v in batch.values() if isinstance(v, Tensor)))
        return out

    def corrupt_inputs(self, inputs: Tensor) -> Tensor:
        """Return the bad version of ``inputs`` (a new tensor; the caller's batch is untouched)."""
        if self.kind == "spike":
            return inputs * self.magnitude
        if self.kind in ("nan", "inf"):
            if not inputs.is_floating_point():
                raise TypeError(
                    f"a {self.kind} fault needs floating-point inputs, got {inputs.dtype}; for token ids, "
                    "put it into the first activation (TrainStep(hooks=[Faults(...)]) does: an Injection's "
                    "forward)."
                )
            bad = inputs.clone(memory_format=torch.contiguous_format)  # so view(-1) writes into it
            bad.view(-1)[0] = float(self.kind)
            return bad
        return inputs

    def corrupt_output(self, output: Any) -> Any:
        """Return ``output`` unchanged in value; for ``overflow`` its backward overflows fp16.

        A tuple, list or dict output (a Hugging Face ``ModelOutput`` too) gets it on each of its
        floating tensors: whichever the loss reads, its gradient overflows.
        """
        if self.kind != "overflow":
            return output
        return _map_floating(output, _OverflowBackward.apply)


def _overflow(grad: Tensor) -> Tensor:
    """Return ``grad`` rescaled so its largest entry is 2 * 65504, in ``grad``'s own dtype."""
    peak = grad.detach().float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    # Rounded back into grad's own dtype: fp16 turns 131008 into inf, fp32/bf16 hold it.
    return (grad.float() * (2 * FP16_MAX / peak)).to(grad.dtype)


class _OverflowBackward(torch.autograd.Function):
    """Identity forward; backward rescales the gradient so its largest entry is 2 * 65504."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return _overflow(grad)


class _FirstInBackward(torch.autograd.Function):
    """Identity forward; in backward the first of a step's marked outputs reached in ``dtype`` overflows.

    Backward reaches the outputs nearest the loss first, so the one rescaled is the activation the
    loss was computed from, whichever tensor the loss function picked out of the model's output.
    """

    @staticmethod
    def forward(ctx, x: Tensor, injection: Injection) -> Tensor:  # type: ignore[override]
        ctx.injection = injection
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        inj = ctx.injection
        if inj.backward_done or (inj.dtype is not None and grad.dtype != inj.dtype):
            return grad, None
        inj.backward_done = inj.acted = True
        return _overflow(grad), None


def _map_floating(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Return ``out`` (a tensor, tuple, list or dict of them) with ``fn`` applied to its floating tensors."""
    if isinstance(out, Tensor):
        return fn(out) if out.is_floating_point() else out
    if isinstance(out, Mapping):
        new = copy.copy(out)  # keeps the output's own class (ModelOutput, OrderedDict, ...)
        for key, value in out.items():
            new[key] = _map_floating(value, fn)
        return new
    if isinstance(out, (tuple, list)):
        items = [_map_floating(o, fn) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out


class Injection:
    """One step's fault at work: where it acts (the inputs, the forward, the loss), and whether it did.

    ``batch`` corrupts a (micro-)batch with a floating tensor; ``forward`` is the context the
    model runs in (NaN/inf into the first activation of token ids; ``overflow``'s backward);
    ``loss`` scales the loss of a ``spike`` the inputs could not carry. ``acted`` is read after
    backward: the record names the fault only then.

    >>> from torch import nn
    >>> emb = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)); inj = Injection(Fault("nan"))
    >>> ids = inj.batch(torch.tensor([[1, 2]]))  # token ids carry no NaN: the embedding's output will
    >>> with inj.forward(emb): out = emb(ids)
    >>> bool(out.isnan().any()), inj.acted
    (True, True)
    """

    def __init__(self, fault: Fault) -> None:
        self.fault, self.acted, self.backward_done = fault, False, False
        self.on_inputs: bool | None = None  # known at the first batch: did it hold a floating tensor?
        self.dtype: torch.dtype | None = None  # overflow: the activations' dtype its backward rescales

    @property
    def label(self) -> str | None:
        """The fault's label for the record if it acted, else None."""
        return self.fault.label if self.acted else None

    def batch(self, batch: Any) -> Any:
        """Return the (micro-)batch, corrupted where it holds a floating tensor (spike, nan, inf)."""
        if self.fault.kind == "overflow":
            return batch
        if self.on_inputs is None:
            self.on_inputs = next(floating_tensors(batch), None) is not None
        if not self.on_inputs:
            return batch
        self.acted = True
        return self.fault.corrupt_batch(batch)

    def loss(self, loss: Tensor) -> Tensor:
        """Return the loss the step uses: a spike's ``magnitude`` times it if the inputs could not hold it."""
        if self.fault.kind == "spike" and self.on_inputs is False:
            self.acted = True
            return loss * self.fault.magnitude
        return loss

    @contextlib.contextmanager
    def forward(self, model: torch.nn.Module) -> Iterator[None]:
        """Run ``model``'s forward with the fault where it acts inside it (token ids' NaN/inf, overflow).

        One global module forward hook for the duration, answering for ``model``'s modules only; a
        step without such a fault registers nothing.
        """
        kind = self.fault.kind
        in_forward = kind == "overflow" or kind in ("nan", "inf") and self.on_inputs is False
        if not in_forward:
            yield
            return
        ours = {id(m) for m in model.modules()}
        if kind == "overflow":
            device = next((p.device.type for p in model.parameters()), "cpu")
            self.backward_done = False  # each micro-batch's backward overflows
            self.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

        done = False  # this forward's: triage's fp32 re-run gets the NaN again

        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            nonlocal done
            if id(module) not in ours:
                return None
            if kind == "overflow":
                return _map_floating(out, lambda t: _FirstInBackward.apply(t, self) if t.requires_grad else t)
            first = None if done else next(floating_tensors(out), None)
            if first is None:  # the NaN/inf went into the first activation already, or this has none
                return None
            done = self.acted = True
            return _map_floating(out, lambda t: self.fault.corrupt_inputs(t) if t is first else t)

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()
        if kind != "overflow" and not done:
            raise TypeError(
                f"the {kind} fault found no floating tensor to put a {kind} in: the batch holds none (token "
                "ids) and no module of the model output one. Put it into the data yourself, or use the "
                "spike or overflow fault, which act on the loss and its backward."
            )


def floating_tensors(out: Any) -> Iterator[Tensor]:
    """Yield the floating tensors in ``out`` (a tensor, or dicts, tuples and lists of them), in order.

    >>> [t.dtype for t in floating_tensors({"ids": torch.zeros(2, dtype=torch.long), "x": (torch.ones(1),)})]
    [torch.float32]
    """
    if isinstance(out, Tensor):
        if out.is_floating_point():
            yield out
    elif isinstance(out, Mapping):
        for v in out.values():
            yield from floating_tensors(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            yield from floating_tensors(v)


_EXAMPLE = "e.g. 50:spike:1000, 120:nan or 200-204:overflow"
_SPEC = re.compile(r"^(\d+)(?:-(\d+))?:([a-z]+)(?::([^:]+))?$")


class FaultSchedule(Mapping[int, Fault]):
    """Which fault happens at which step (0-based); steps without one get ``None``.

    A range is kept as a range (``"0-10000000:nan"`` costs one entry, not ten million);
    where entries overlap the later one wins.

    >>> s = FaultSchedule.parse(["50:spike:1000", "120:nan", "200-202:overflow"])
    >>> s.get(50).label, s.get(201).label, s.get(7)
    ('spike:1000', 'overflow', None)
    """

    def __init__(self, faults: Mapping[int, Fault | str] | None = None) -> None:
        if faults is not None and not isinstance(faults, Mapping):
            raise TypeError(
                f"FaultSchedule takes a mapping {{step: kind}}, got {type(faults).__name__}; for specs such "
                "as "
                f"['50:nan'] use FaultSchedule.parse([...]) ({_EXAMPLE})."
            )
        # (first, last, position, fault): where entries overlap the later position wins
        self._ranges: list[tuple[int, int, int, Fault]] = []
        self._single: dict[int, tuple[int, Fault]] = {}  # step -> (position, fault): a dict lookup per step
        self._added = 0
        for step, fault in (faults or {}).items():
            check_int("a fault's step", step, 0)
            if not isinstance(fault, (str, Fault)):
                raise TypeError(f"a fault must be a kind such as 'nan' or a labkit.Fault, got {fault!r} at "
                                f"step {step}.")
            self._add(step, step, Fault(fault) if isinstance(fault, str) else fault)

    def _add(self, first: int, last: int, fault: Fault) -> None:
        if first == last:
            self._single[first] = (self._added, fault)
        else:
            self._ranges.append((first, last, self._added, fault))
        self._added += 1

    @classmethod
    def parse(cls, specs: Iterable[str]) -> FaultSchedule:
        """Build a schedule from ``STEP:KIND[:MAGNITUDE]`` or ``START-END:KIND`` (END included)."""
        if isinstance(specs, str) or not isinstance(specs, Iterable):
            raise TypeError(f"FaultSchedule.parse takes a list of specs, e.g. [{specs!r}], got "
                            f"{type(specs).__name__}.")
        schedule = cls()
        for spec in specs:
            if not isinstance(spec, str):
                raise TypeError(f"each fault spec must be a str such as '120:nan', got {spec!r}; {_EXAMPLE}.")
            m = _SPEC.match(spec.strip())
            if not m:
                raise ValueError(
                    f"bad fault spec {spec!r}: write STEP:KIND[:MAGNITUDE] or START-END:KIND, "
                    f"{_EXAMPLE} (kinds: {', '.join(KINDS)})."
                )
            start, end, kind, magnitude = m.groups()
            first, last = int(start), int(end) if end is not None else int(start)
            if last < first:
                raise ValueError(f"bad fault spec {spec!r}: the range {first}-{last} runs backwards; "
                                 f"{_EXAMPLE}.")
            if magnitude is not None and kind != "spike":
                raise ValueError(f"bad fault spec {spec!r}: only spike takes a magnitude; {_EXAMPLE}.")
            try:
                fault = Fault(kind, float(magnitude)) if magnitude is not None else Fault(kind)
            except ValueError as e:
                raise ValueError(f"bad fault spec {spec!r}: {e} Write it as {_EXAMPLE}.") from None
            schedule._add(first, last, fault)
        return schedule

    @classmethod
    def coerce(cls, faults: FaultSchedule | Mapping[int, Fault | str] | Iterable[str] | None
               ) -> FaultSchedule:
        """Return ``faults`` as a schedule: a schedule, a ``{step: kind}`` mapping, or a list of specs.

        >>> FaultSchedule.coerce(["10:nan"]).get(10).label
        'nan'
        """
        if isinstance(faults, FaultSchedule):
            return faults
        if faults is None or isinstance(faults, Mapping):
            return cls(faults)
        if isinstance(faults, (list, tuple)):
            return cls.parse(faults)
        raise TypeError(
            f"faults must be a FaultSchedule, a mapping {{step: kind}} or a list of specs ({_EXAMPLE}), "
            f"got {type(faults).__name__}."
        )

    def __getitem__(self, step: int) -> Fault:
        position, fault = self._single.get(step, (-1, None))
        for first, last, pos, f in self._ranges:
            if first <= step <= last and pos > position:
                position, fault = pos, f
        if fault is None:
            raise KeyError(step)
        return fault

    def __iter__(self) -> Iterator[int]:
        merged = heapq.merge(sorted(self._single), *(range(a, b + 1) for a, b, _, _ in self._ranges))
        last = None
        for step in merged:  # lazy: a huge range is never held in memory
            if step != last:
                yield step
                last = step

    def __len__(self) -> int:
        spans = sorted([(a, b) for a, b, _, _ in self._ranges] + [(s, s) for s in self._single])
        count, end = 0, -1
        for a, b in spans:  # the union of the spans, counted without listing its steps
            if b > end:
                count += b - max(a, end + 1) + 1
                end = b
        return count

    def __repr__(self) -> str:
        shown = []
        for step in self:
            if len(shown) == 20:
                return "FaultSchedule({" + ", ".join(shown) + f", ...}} ({len(self)} steps))"
            shown.append(f"{step}: {self[step].label!r}")
        return "FaultSchedule({" + ", ".join(shown) + "})"


class Faults(Hook):
    """Inject the scheduled faults into a ``TrainStep``'s batches, each once per step number.

    ``schedule``: a ``FaultSchedule``, a ``{step: kind}`` mapping or a list of specs
    (``FaultSchedule.coerce``). A step a ``Rewind`` replays (its number again) runs without its
    fault: the data that carried it was skipped. The record names the fault (``fault``) when it
    acted. Not saved in ``TrainStep.state_dict()``: a rewind's restore must not re-arm a fault,
    and a resumed run starts past the steps it saved.

    >>> faults = Faults(["1:nan"]); faults.pre_forward(None, 0), faults.pre_forward(None, 1).label
    (None, 'nan')
    """

    record_fields = {"fault": Field(None)}  # the fault injected at the step, e.g. "spike:1000"

    def __init__(self, schedule: FaultSchedule | Mapping[int, Fault | str] | Iterable[str]) -> None:
        self.schedule = FaultSchedule.coerce(schedule)
        self.unseen = 0  # the first step number not recorded yet: a fault fires there and later only

    def pre_forward(self, trainer: Any, step: int) -> Fault | None:
        return self.schedule.get(step) if step >= self.unseen else None

    def on_record(self, trainer: Any, record: Any) -> RewindEvent | None:
        self.unseen = max(self.unseen, record.step + 1)
        return None

    def __repr__(self) -> str:
        return f"Faults({self.schedule!r})"
