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

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

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

    def corrupt_output(self, output: Tensor) -> Tensor:
        """Return ``output`` unchanged in value; for ``overflow`` its backward overflows fp16."""
        return _OverflowBackward.apply(output) if self.kind == "overflow" else output


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
_SPEC = re.compile(r"^(\d+)(?:-(\d+))?:([a-z]+)(?::([^:]+))?$")


class FaultSchedule(Mapping[int, Fault]):
    """Which fault happens at which step (0-based); steps without one get ``None``.

    >>> s = FaultSchedule.parse(["50:spike:1000", "120:nan", "200-202:overflow"])
    >>> s.get(50).label, s.get(201).label, s.get(7)
    ('spike:1000', 'overflow', None)
    """

    def __init__(self, faults: Mapping[int, Fault | str] | None = None) -> None:
        self._faults: dict[int, Fault] = {}
        for step, fault in (faults or {}).items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"fault steps must be ints >= 0, got {step!r}.")
            self._faults[step] = Fault(fault) if isinstance(fault, str) else fault

    @classmethod
    def parse(cls, specs: Iterable[str]) -> FaultSchedule:
        """Build a schedule from ``STEP:KIND[:MAGNITUDE]`` or ``START-END:KIND`` (END included)."""
        faults: dict[int, Fault] = {}
        for spec in specs:
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
            for step in range(first, last + 1):
                faults[step] = fault
        return cls(faults)

    def __getitem__(self, step: int) -> Fault:
        return self._faults[step]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(sorted(self._faults))

    def __len__(self) -> int:
        return len(self._faults)

    def __repr__(self) -> str:
        return "FaultSchedule({" + ", ".join(f"{s}: {self._faults[s].label!r}" for s in self) + "})"
