"""Bad batches on a schedule, to watch the safety belts work.

Four kinds, each deterministic:

- ``spike``: the inputs times ``magnitude`` (default 1000): a single bad batch that spikes
  the gradient norm by orders of magnitude. Clipping is the belt.
- ``nan`` / ``inf``: one input entry set to NaN / +inf: invalid data. The loss is not
  finite, so the step must be skipped before backward (clipping cannot repair it).
- ``overflow``: the forward is untouched, but the gradient flowing back out of the model's
  output is driven to twice fp16's largest value (65504 * 2 = 131008 in the largest entry).
  Under fp16 the scaled backward overflows at any loss scale, so the scaler must skip and
  back off; fp32 and bf16 can hold it, and see a gradient spike instead.
"""

from __future__ import annotations

import copy
import heapq
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .records import Field, declare
from .validate import check_int

__all__ = ["Fault", "FaultSchedule"]

KINDS = ("spike", "nan", "inf", "overflow")
FP16_MAX = 65504.0


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
            if isinstance(value, Tensor) and value.is_floating_point() and not (done and self.kind != "spike"):
                out[key], done = self.corrupt_inputs(value), True
        if not done and self.kind in ("nan", "inf"):
            return self.corrupt_inputs(next(v for v in batch.values() if isinstance(v, Tensor)))  # raises, saying why
        return out

    def corrupt_inputs(self, inputs: Tensor) -> Tensor:
        """Return the bad version of ``inputs`` (a new tensor; the caller's batch is untouched)."""
        if self.kind == "spike":
            return inputs * self.magnitude
        if self.kind in ("nan", "inf"):
            if not inputs.is_floating_point():
                raise TypeError(
                    f"a {self.kind} fault needs floating-point inputs, got {inputs.dtype}; for token ids, "
                    "inject it into the embeddings (or use the overflow fault, which acts on the output)."
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
        if isinstance(output, Tensor):
            return _OverflowBackward.apply(output) if output.is_floating_point() else output
        if isinstance(output, Mapping):
            new = copy.copy(output)  # keeps the output's own class (ModelOutput, OrderedDict, ...)
            for key, value in output.items():
                new[key] = self.corrupt_output(value)
            return new
        if isinstance(output, (tuple, list)):
            items = [self.corrupt_output(o) for o in output]
            return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
        return output


class _OverflowBackward(torch.autograd.Function):
    """Identity forward; backward rescales the gradient so its largest entry is 2 * 65504."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        peak = grad.detach().float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
        # Rounded back into grad's own dtype: fp16 turns 131008 into inf, fp32/bf16 hold it.
        return (grad.float() * (2 * FP16_MAX / peak)).to(grad.dtype)


_EXAMPLE = "e.g. 50:spike:1000, 120:nan or 200-204:overflow"
declare("FaultSchedule", {"fault": Field(None)})  # the fault injected at the step, e.g. "spike:1000"
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
                f"FaultSchedule takes a mapping {{step: kind}}, got {type(faults).__name__}; for specs such as "
                f"['50:nan'] use FaultSchedule.parse([...]) ({_EXAMPLE})."
            )
        # (first, last, position, fault): where entries overlap the later position wins
        self._ranges: list[tuple[int, int, int, Fault]] = []
        self._single: dict[int, tuple[int, Fault]] = {}  # step -> (position, fault): a dict lookup per step
        self._added = 0
        for step, fault in (faults or {}).items():
            check_int("a fault's step", step, 0)
            if not isinstance(fault, (str, Fault)):
                raise TypeError(f"a fault must be a kind such as 'nan' or a labkit.Fault, got {fault!r} at step {step}.")
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
            raise TypeError(f"FaultSchedule.parse takes a list of specs, e.g. [{specs!r}], got {type(specs).__name__}.")
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
                raise ValueError(f"bad fault spec {spec!r}: the range {first}-{last} runs backwards; {_EXAMPLE}.")
            if magnitude is not None and kind != "spike":
                raise ValueError(f"bad fault spec {spec!r}: only spike takes a magnitude; {_EXAMPLE}.")
            try:
                fault = Fault(kind, float(magnitude)) if magnitude is not None else Fault(kind)
            except ValueError as e:
                raise ValueError(f"bad fault spec {spec!r}: {e} Write it as {_EXAMPLE}.") from None
            schedule._add(first, last, fault)
        return schedule

    @classmethod
    def coerce(cls, faults: FaultSchedule | Mapping[int, Fault | str] | Iterable[str] | None) -> FaultSchedule:
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
