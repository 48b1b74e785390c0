"""Set 3, part 1: the fraction of bf16 updates lost to rounding.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.formats.bf16 import stale_fraction

from ..core import (
    Check,
    as_plain,
    call_student,
    check,
    close,
    forbid,
    on_case,
    raised_problem,
    ship,
)
from .bans import STALE_FUNCS
from .bits import BF16, adjacent, ulp_of


@dataclass
class _StaleCase:
    """A bf16 weight and an fp32 update of the same shape."""

    name: str
    update: Tensor
    weight: Tensor


def _edge_case(rnd: random.Random, gen: torch.Generator) -> _StaleCase:
    """Return powers of two (updates toward 0), exact ties, just past a tie, zero and subnormal weights."""
    weights, updates = [], []

    def add(w: float, u: float) -> None:
        weights.append(w)
        updates.append(u)

    for sign in (1.0, 1.0, -1.0, -1.0):
        p = 2.0 ** rnd.randint(-20, 20) * sign
        half_below = abs(p) * 2.0**-9  # toward zero the gap is half the gap away from it (2**-8, 2**-7)
        add(p, -math.copysign(half_below * rnd.uniform(1.2, 1.9), p))  # between the two half-gaps: survives
    # ties: 4 weights with an even last bit, 8 with an odd one (so no two mistakes below count the same)
    bits = torch.tensor([rnd.uniform(1, 2) * 2.0 ** rnd.randint(-10, 10) * rnd.choice([1, -1])
                         for _ in range(12)])
    bits = bits.to(BF16).view(torch.int16)
    w = torch.cat([bits[:4] & ~1, bits[4:] | 1]).view(BF16)
    for i, wi in enumerate(w):
        up = i % 2 == 0
        half = (adjacent(wi.reshape(1), up).double() - wi.double()).abs().item() / 2
        sign = 1.0 if up else -1.0
        add(wi.item(), sign * half)  # an exact tie: lost if the weight's last bit is even
        if i < 3:
            add(wi.item(), sign * half * (1 + 2.0**-20))  # just past it: survives (float32 adds say lost)
    for u in (2.0**-134, 2.0**-133 * 0.75, 2.0**-135, 3e-41, 1e-30):
        add(0.0, u * rnd.choice([1.0, -1.0]))  # zero weights: the gap is the smallest subnormal, 2**-133
    for _ in range(4):
        sub = rnd.randint(1, 100) * 2.0**-133  # subnormal bf16 weights: a gap of 2**-133
        add(sub, rnd.choice([0.3, 0.5, 0.7, 1.5]) * 2.0**-133 * rnd.choice([1.0, -1.0]))
    add(rnd.uniform(-3, 3), 0.0)  # zero updates: nothing to lose
    add(1.0, 0.0)
    order = torch.randperm(len(weights), generator=gen)
    return _StaleCase("powers of two, exact ties, subnormal and zero weights",
                      torch.tensor(updates, dtype=torch.float32)[order],
                      torch.tensor(weights).to(BF16)[order])


def _stale_cases(hidden: bool, seed: int) -> list[_StaleCase]:
    gen = torch.Generator().manual_seed(seed)
    if not hidden:
        # around 1 the gap above is 2**-7 (half: 0.0039) and below 2**-8 (half: 0.00195); around 256 it is 2
        w = torch.tensor([1.0, 1.0, 1.0, 1.0, 256.0, 256.0, -1.5, 0.0, 0.0, 3.0], dtype=BF16)
        u = torch.tensor([1e-3, 3e-3, 5e-3, -3e-3, 0.9, 1.5, 4e-3, 1e-41, 1e-38, 0.0])
        weights = (torch.randn(64, 32, generator=gen) * 0.05).to(BF16)
        updates = torch.randn(64, 32, generator=gen) * 1e-4
        updates[::7] = 0.0
        return [_StaleCase("weights around 1 and 256, zeros", u, w),
                _StaleCase("weights ~ N(0, 0.05), AdamW-sized updates ~ 1e-4", updates, weights)]
    rnd = random.Random(seed)
    weights = (torch.randn(200, generator=gen) * 10.0 ** rnd.uniform(-3, 2)).to(BF16)
    updates = (ulp_of(weights) * torch.empty(200).uniform_(0.0, 1.5, generator=gen)
               * torch.where(torch.rand(200, generator=gen) < 0.5, -1.0, 1.0)).float()
    updates[torch.rand(200, generator=gen) < 0.1] = 0.0
    return [_StaleCase("random weights, updates from 0 to 1.5 ulps", updates, weights), _edge_case(rnd, gen)]


def _lost(case: _StaleCase, mistake: str | None = None) -> float:
    """Return the fraction of nonzero updates lost: labkit's rule, or a classic mistake's."""
    u, w = case.update, case.weight
    moving = u != 0
    if mistake is None:
        return stale_fraction(u, w, mask=moving).item()
    if mistake == "zeros":
        return stale_fraction(u, w).item()
    if mistake in ("up", "away"):  # the gap toward +inf, or away from zero, whatever the update's direction
        neighbour = adjacent(w, True) if mistake == "up" else adjacent(w, w >= 0)
        half = (neighbour.double() - w.double()).abs() / 2
        lost = (u.double().abs() < half) | ((u.double().abs() == half) & (w.view(torch.int16) % 2 == 0))
    elif mistake in ("strict", "le"):
        half = (adjacent(w, u >= 0).double() - w.double()).abs() / 2
        lost = u.double().abs() < half if mistake == "strict" else u.double().abs() <= half
    elif mistake == "fp32":
        lost = (w.float() + u).to(BF16) == w
    else:  # "relative": an ulp from a formula, not from the weight's own bits
        lost = u.abs() < w.float().abs() * 2.0**-9
    return ((lost & moving).sum() / moving.sum().clamp(min=1)).item()


STALE_MISTAKES = {
    "zeros": "a zero update has nothing to lose: count only the entries whose update is nonzero, and "
             "divide by them",
    "up": "the gap that matters is the one in the update's direction: below a power of two it is half the "
          "gap above (torch.nextafter(w, -inf) for a negative update)",
    "away": "the gap that matters is the one in the update's direction: below a power of two it is half the "
            "gap above (torch.nextafter(w, -inf) for a negative update)",
    "strict": "an update of exactly half an ulp is a tie, and a tie rounds to even: it is lost when the "
              "weight's last bit is even (w.view(torch.int16) % 2 == 0)",
    "le": "an update of exactly half an ulp is a tie, and a tie rounds to even: it survives when the "
          "weight's last bit is odd (w.view(torch.int16) % 2 == 1)",
    "fp32": "adding in float32 first rounds twice: an update just past a tie becomes the tie in float32, "
            "then rounds back to the weight in bf16. Compare |u| with half the gap, exactly",
    # bf16 keeps 8 significant bits: in [2**e, 2**(e+1)) the gap is 2**(e-7); the gap below 2**e is half that
    "relative": "|w| * 2**-9 is half the gap only *below* a power of two (w = 2**e, a downward update); "
                "everywhere else it undercounts (above 2**e half the gap is 2**(e-8), up to twice |w| * "
                "2**-9), and it is 0 at w = 0: take the weight's real neighbour in the update's direction, "
                "torch.nextafter(w, torch.where(u > 0, inf, -inf)), which also works at 0 and for subnormal "
                "weights",
}


def _run_stale(fn: Callable, case: _StaleCase) -> dict[str, Any]:
    traps: list[str] = []
    with forbid(STALE_FUNCS, "count the lost updates", traps):
        out = call_student(fn, case.update.clone(), case.weight.clone())
    out.update(traps=traps, value=ship(out.get("value")))
    return out


def _judge_stale(name: str, case: _StaleCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    try:
        got = float(as_plain(out["value"]))
    except (TypeError, ValueError):
        return f"{name} returned a {out['value']['type']} {where}; return the fraction as a number."
    want = _lost(case)
    if close(got, want, 1e-6):
        return None
    hint = next((h for m, h in STALE_MISTAKES.items() if close(got, _lost(case, m), 1e-6)), None)
    if hint is None:
        hint = ("an update is lost when w + u rounds back to w in bf16 (round to nearest, ties to even): |u| "
                "below half the gap to the weight's neighbour in the update's direction, or exactly half "
                "with an even w")
    return f"{name} returned {got:.6g} {where}, expected {want:.6g}: {hint}."


CHECK = Check(_stale_cases, _run_stale, _judge_stale)


def check_stale_fraction(fn: Callable[[Tensor, Tensor], Any], hidden: bool = False,
                         seed: int | None = None) -> None:
    """Check ``fn(update, weight) -> fraction``: of the nonzero fp32 updates, how many bf16 rounds away.

    Lost means ``weight + update`` rounded to the nearest bf16 (ties to even) is ``weight``:
    ``labkit.formats.bf16.stale_fraction(update, weight, mask=update != 0)``.

    >>> import math
    >>> def lost_fraction(update, weight):
    ...     toward = torch.where(update >= 0, math.inf, -math.inf).to(weight.dtype)
    ...     half = (torch.nextafter(weight, toward).double() - weight.double()).abs() / 2
    ...     even = weight.view(torch.int16) % 2 == 0
    ...     lost = (update.double().abs() < half) | ((update.double().abs() == half) & even)
    ...     moving = update != 0
    ...     return (lost & moving).sum() / moving.sum().clamp(min=1)
    >>> check_stale_fraction(lost_fraction, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, STALE_FUNCS)
