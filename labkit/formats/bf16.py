"""bf16's quiet failure, stale weights, and its remedies.

bf16 has fp32's range but only 8 significant bits (7 stored): an update smaller than half an ulp of the
weight it is added to rounds away, and the weight never moves (``1 + 1e-3`` is ``1.0`` in
bf16). A run with bf16 parameters then trains on with a flat loss and no NaN, no skip, no
warning. This module measures it (``stale_fraction``, ``StaleMonitor`` -> ``StaleUpdateWarning``)
and implements the remedies as small pure rules: an fp32 master copy, stochastic rounding
(``stochastic_round_bf16``), Kahan-compensated updates (``kahan_add``), and an fp32 accumulator
for gradients summed over micro-batches (``accumulate``). ``compare_remedies`` runs them side
by side on the same seed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..alarms import LabkitWarning
from ..distributed import all_reduce_, is_distributed, rank
from ..hooks import Hook
from ..records import Field, put
from ..validate import check_int, check_number

__all__ = [
    "REMEDIES", "RemedyRun", "StaleMonitor", "StaleUpdateWarning", "accumulate", "compare_remedies",
    "kahan_add", "stale_fraction", "stochastic_round_bf16",
]


class StaleUpdateWarning(LabkitWarning):
    """Most updates of a layer were rounded away for many steps: its weights are not training."""


def _stale(update: Tensor, weight: Tensor, dtype: torch.dtype | None) -> Tensor:
    """Return where ``weight + update``, rounded to nearest even in the weight's dtype, is ``weight`` again.

    That is: ``update`` is below half the gap from ``weight`` to its neighbour in the update's
    direction, or exactly half of it with the weight's last bit even (a tie rounds to even).
    """
    w = weight.detach().to(dtype or weight.dtype)
    if not w.dtype.is_floating_point:
        raise TypeError(f"stale_fraction needs a floating-point weight dtype, got {w.dtype}.")
    u = update.detach().to(torch.float64)
    # The neighbour in the update's direction, in the weight's own dtype (real bits, no formula):
    # at a power of two the gap below is half the gap above, so the direction matters. Every
    # gap is a power of two, so half of it is exact in float64, and so is |u| (a float32 or less).
    neighbour = torch.nextafter(w, torch.where(u >= 0, math.inf, -math.inf).to(w.dtype))
    half = (neighbour.double() - w.double()).abs() / 2
    even = w.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]) % 2 == 0
    return (u.abs() < half) | ((u.abs() == half) & even)


def stale_fraction(
    update: Tensor, weight: Tensor, *, dtype: torch.dtype | None = None, mask: Tensor | None = None
) -> Tensor:
    """Return the fraction of entries whose ``update`` is below half an ulp of ``weight`` (fp32, 0-dim).

    Such an update rounds away: ``w + u`` is ``w`` again (the ulp is the gap to the next
    representable value in the update's direction; below a power of two it is half as wide;
    an update of exactly half an ulp rounds away when the weight's last bit is even).
    ``dtype`` is the precision the weight is stored in (default: ``weight.dtype``): pass
    ``torch.bfloat16`` with fp32 weights to ask whether a bf16 copy would still train.
    ``mask`` (bool, like ``update``) limits the count to the entries meant to move, e.g.
    ``grad != 0``; an empty selection gives 0. Stays on the device: no host sync.

    >>> w = torch.ones(4, dtype=torch.bfloat16)
    >>> stale_fraction(torch.tensor([1e-3, 2e-3, 1e-2, -5e-3]), w)
    tensor(0.5000)
    """
    if update.shape != weight.shape:
        raise ValueError(f"update and weight must have the same shape, got {tuple(update.shape)} and "
                         f"{tuple(weight.shape)}.")
    stale = _stale(update, weight, dtype)
    if mask is None:
        return stale.float().mean()
    if mask.shape != update.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor of shape {tuple(update.shape)}, got {mask.dtype} "
                         f"{tuple(mask.shape)}.")
    return (stale & mask).sum().float() / mask.sum().clamp(min=1).float()


class StaleMonitor(Hook):
    """Record each layer's stale fraction in ``StepRecord.stale`` and warn on a long stale streak.

    A hook (``TrainStep(hooks=[...])``): ``pre_optim_step`` copies the
    weights right before the optimizer step and ``post_step`` compares them right after (in a
    plain loop: ``before_step(params, step)`` and ``after_step(params, record)``), so the update
    measured is the one the optimizer really applied, ``w_after - w_before``, counted over the
    entries whose gradient is non-zero. With bf16 weights a stale update leaves the weight
    unchanged (0 < half an ulp); with fp32 weights pass ``dtype=torch.bfloat16`` to ask whether
    bf16 weights would stall. A layer whose fraction is at least ``threshold`` for ``patience``
    observed steps in a row raises one ``StaleUpdateWarning`` per streak (rank 0 only), like the
    skip streak.

    Cost: on an observed step, one copy of the parameters in their own dtype (2 bytes per
    bf16 weight) and two elementwise passes over them, plus one host sync to read the
    fractions (and, under torch.distributed, one all-reduce of two numbers per layer, so every
    rank records and alarms alike). ``every=k`` observes every k-th step only.

    >>> monitor = StaleMonitor(threshold=0.5, patience=2)
    >>> monitor.streaks
    {}
    """

    def __init__(
        self, threshold: float = 0.5, patience: int = 8, every: int = 1, dtype: torch.dtype | None = None,
        process_group: Any = None,
    ) -> None:
        check_number("threshold", threshold, 0, 1, low_open=True, noun="a fraction")
        check_int("patience", patience, 1)
        check_int("every", every, 1)
        self.threshold, self.patience, self.every, self.dtype = threshold, patience, every, dtype
        self.process_group = process_group
        self.streaks: dict[str, int] = {}
        self._before: list[Tensor | None] | None = None

    state_key = "stale_monitor"
    record_fields = {"stale": Field({}, per_layer=True)}  # per layer: the share of updates below half an ulp

    def pre_optim_step(self, trainer: Any, step: int, params: Sequence[tuple[str, Tensor]]) -> None:
        self.before_step(params, step)

    def post_step(self, trainer: Any, params: Sequence[tuple[str, Tensor]], record: Any) -> None:
        self.after_step(params, record, stacklevel=6)  # the line that called the TrainStep

    def before_step(self, params: Sequence[tuple[str, Tensor]], step: int) -> None:
        """Keep a copy of the weights that have a gradient (only on observed steps)."""
        self._before = None
        if step % self.every == 0:
            self._before = [p.detach().clone() if p.grad is not None else None for _, p in params]

    def after_step(self, params: Sequence[tuple[str, Tensor]], record: Any, stacklevel: int = 2) -> None:
        """Write ``record.stale`` ({layer: fraction}) from the update just applied, and alarm.

        ``stacklevel``: the warning's, the caller's line by default.
        """
        before, self._before = self._before, None
        if before is None or record.skipped:
            return
        names, counts = [], []
        for (name, p), old in zip(params, before):
            if old is None:
                continue
            moved = p.grad != 0
            update = p.detach().float() - old.float()
            stale = _stale(update, old, self.dtype) & moved
            names.append(name)
            counts.append(torch.stack([stale.sum(), moved.sum()]).double())
        if not names:
            return
        counts_t = torch.stack(counts)
        if is_distributed():  # sharded weights: a layer's fraction is over all its shards
            all_reduce_(counts_t, "sum", self.process_group)
        values = counts_t.tolist()  # host sync: the record holds plain numbers
        stale = {n: (s / m if m else 0.0) for n, (s, m) in zip(names, values)}
        put(record.fields, "stale", stale)
        for name, frac in stale.items():
            self.streaks[name] = self.streaks.get(name, 0) + 1 if frac >= self.threshold else 0
            if self.streaks[name] == self.patience and rank() == 0:
                warnings.warn(
                    f"stale weights: in {name}, {frac:.0%} of the updates were below half an ulp of their "
                    f"weight for {self.patience} observed steps (up to step {record.step}); they round away "
                    "and the layer does not train. Keep an fp32 master copy of the weights, or round the "
                    "update stochastically, or use Kahan-compensated updates (labkit.formats.bf16).",
                    StaleUpdateWarning,
                    stacklevel=stacklevel,
                )

    def state_dict(self) -> dict[str, Any]:
        return {"streaks": dict(self.streaks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streaks = {str(k): int(v) for k, v in state["streaks"].items()}


def stochastic_round_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round fp32 ``x`` to bf16, up or down with probability given by the distance: unbiased on average.

    The bit trick of torchao's ``_fp32_to_bf16_sr`` (``bf16_stochastic_round=True`` in its
    AdamW): bf16 is fp32's upper 16 bits, so truncate them, and round away from zero when a
    uniform 16-bit random number is below the 16 bits cut off. E[round(x)] = x. Same bits as
    torchao for the same random stream; ``generator`` makes runs repeatable.

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.full((100_000,), 1.001)
    >>> x.bfloat16().float().mean().item(), round(stochastic_round_bf16(x, g).float().mean().item(), 3)
    (1.0, 1.001)
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, got {x.dtype}; call .float() first.")
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator)
    toward_zero = bits & -0x10000  # 0xFFFF0000 as an int32
    rounded = torch.where(noise < (bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
    return rounded.view(torch.float32).bfloat16()


def kahan_add(weight: Tensor, update: Tensor, compensation: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(weight + update, new compensation)`` with the rounding error carried to the next step.

    Kahan-compensated summation with the sum in ``weight``'s dtype (bf16) and the lost low
    bits kept in a ``compensation`` buffer of the same dtype (16 + 16 bits per weight, against
    16 + 32 for an fp32 master copy); the arithmetic is fp32. y = u + c; w' = round(w + y);
    c' = y - (w' - w). Source: Kahan (1965); torch-optimi's ``kahan_sum``.

    >>> w, c = torch.ones(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
    >>> for _ in range(1000): w, c = kahan_add(w, torch.tensor([1e-3]), c)
    >>> round(w.item() + c.item(), 2)
    2.0
    """
    y = update.float() + compensation.float()
    new = (weight.float() + y).to(weight.dtype)
    return new, (y - (new.float() - weight.float())).to(compensation.dtype)


def accumulate(grads: Iterable[Tensor], dtype: torch.dtype) -> Tensor:
    """Return the sum of ``grads`` (micro-batch gradients) with the running sum kept in ``dtype``.

    bf16 sums lose the low bits of every addend once the sum has grown: over many
    micro-batches the error grows with their number. Llama 3 accumulates and reduces in fp32.

    >>> gs = [torch.full((3,), 1e-3, dtype=torch.bfloat16)] * 512
    >>> accumulate(gs, torch.bfloat16).tolist(), round(accumulate(gs, torch.float32)[0].item(), 3)
    ([0.5, 0.5, 0.5], 0.512)
    """
    total = None
    for g in grads:
        total = g.to(dtype) if total is None else total + g.to(dtype)
    if total is None:
        raise ValueError("accumulate needs at least one gradient.")
    return total


REMEDIES = ("fp32", "bf16", "bf16 + stochastic rounding", "bf16 + Kahan", "bf16 + fp32 master")


@dataclass
class RemedyRun:
    """One run of ``compare_remedies``: the loss before each step and the weights after each."""

    losses: list[float] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)
    stale: list[float] = field(default_factory=list)

    @property
    def changed(self) -> int:
        """How many weights differ from their start."""
        return sum(a != b for a, b in zip(self.weights[0], self.weights[-1]))


def compare_remedies(
    steps: int = 300, lr: float = 1e-3, features: int = 32, samples: int = 512, seed: int = 0
) -> dict[str, RemedyRun]:
    """Fit ``y = X @ w_true`` from ``w = 1`` with AdamW, once per entry of ``REMEDIES``, on the same seed.

    Every run takes the same torch AdamW step in fp32 from the weight it holds (weight decay
    0, so the moments do not depend on the weight); only how the result is written back to
    the weight differs: kept in fp32, rounded to nearest bf16, stochastically rounded, Kahan
    compensated, or kept in an fp32 master copy with the bf16 copy used for the forward.
    ``stale`` is the fraction of updates below half a bf16 ulp of the weight, per step.
    Measured (research notes, §2.1): bf16 0 of 32 weights moved, loss 70.0 -> 70.0; fp32 49.8.

    >>> runs = compare_remedies(steps=20)
    >>> runs["bf16"].changed, runs["fp32"].changed
    (0, 32)
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g)
    runs: dict[str, RemedyRun] = {}
    for name in REMEDIES:
        run, rng = RemedyRun(), torch.Generator().manual_seed(seed + 1)
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        weight = torch.ones(features, 1, dtype=dtype)
        master, comp = weight.float(), torch.zeros_like(weight)
        proxy = torch.zeros(features, 1, requires_grad=True)
        opt = torch.optim.AdamW([proxy], lr=lr, weight_decay=0.0)
        run.weights.append(weight.flatten().float().tolist())
        for _ in range(steps):
            w = weight.detach().requires_grad_(True)
            loss = ((x.to(dtype) @ w).float() - y).pow(2).mean()
            (grad,) = torch.autograd.grad(loss, w)
            with torch.no_grad():
                proxy.copy_(master if name == "bf16 + fp32 master" else weight.float())
                start = proxy.clone()
                proxy.grad = grad.float()
                opt.step()
                target = proxy.detach().clone()
                run.stale.append(stale_fraction(target - start, start, dtype=torch.bfloat16).item())
                if name == "fp32":
                    weight = target
                elif name == "bf16":
                    weight = target.bfloat16()
                elif name == "bf16 + stochastic rounding":
                    weight = stochastic_round_bf16(target, rng)
                elif name == "bf16 + Kahan":
                    weight, comp = kahan_add(weight, target - start, comp)
                else:
                    master, weight = target, target.bfloat16()
            run.losses.append(loss.item())
            run.weights.append(weight.flatten().float().tolist())
        runs[name] = run
    return runs

