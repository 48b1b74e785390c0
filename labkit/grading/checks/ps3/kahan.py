"""Set 3, part 2: one Kahan-compensated bf16 update, against ``labkit.formats.bf16.kahan_add``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.formats.bf16 import kahan_add

from ..core import (
    Check,
    call_student,
    check,
    forbid,
    on_case,
    raised_problem,
    ship,
)
from .bans import KAHAN_FUNCS
from .bits import BF16, adjacent, ulp_of


@dataclass
class _KahanCase:
    """Steps of labkit's Kahan-compensated trajectory: each (weight, update, compensation) given in turn."""

    name: str
    steps: list[tuple[Tensor, Tensor, Tensor]]


def _trajectory(name: str, weight: Tensor, updates: list[Tensor]) -> _KahanCase:
    steps, c = [], torch.zeros_like(weight)
    for u in updates:
        steps.append((weight, u, c))
        weight, c = kahan_add(weight, u, c)
    return _KahanCase(name, steps)


def _kahan_cases(hidden: bool, seed: int) -> list[_KahanCase]:
    gen = torch.Generator().manual_seed(seed)
    if not hidden:
        one = _trajectory("300 updates of 1e-3 to w = 1", torch.ones(1, dtype=BF16),
                          [torch.tensor([1e-3])] * 300)
        w = (torch.randn(64, generator=gen) * 0.1).to(BF16)
        mixed = _trajectory("64 weights ~ N(0, 0.1), 50 updates ~ 1e-3", w,
                            [torch.randn(64, generator=gen) * 1e-3 for _ in range(50)])
        return [one, mixed]
    rnd = random.Random(seed)
    w = (torch.randn(64, generator=gen) * 10.0 ** rnd.uniform(-2, 1)).to(BF16)
    ulp = ulp_of(w).float()
    # about an ulp of each weight: there the compensation matters
    near = [ulp * torch.empty(64).uniform_(0.2, 3.0, generator=gen)
            * torch.where(torch.rand(64, generator=gen) < 0.5, -1.0, 1.0) for _ in range(40)]
    small = [torch.randn(64, generator=gen) * 10.0 ** rnd.uniform(-5, -3) for _ in range(40)]
    return [_trajectory("updates of 0.2 to 3 ulps of each weight", w, near),
            _trajectory("small updates, mixed signs", (torch.randn(64, generator=gen)).to(BF16), small)]


def _kahan_mistake(w: Tensor, u: Tensor, c: Tensor, mistake: str) -> tuple[Tensor, Tensor]:
    """Return one step computed with a classic mistake."""
    y = u.float() + (0.0 if mistake == "nocomp" else c.float())
    if mistake == "bf16":
        y = y.to(BF16).float()
    new = (w.float() + y).to(w.dtype)
    if mistake == "stale":
        return new, c
    carry = (new.float() - w.float()) - y if mistake == "sign" else y - (new.float() - w.float())
    return new, carry.to(c.dtype)


KAHAN_MISTAKES = {
    "nocomp": "the compensation was never added back: y = update + compensation is what goes into the weight",
    "sign": "the compensation has the wrong sign: it is what the rounding lost, y - (new - weight)",
    "bf16": "y = update + compensation was rounded to bf16 before the add: do the arithmetic in float32 and "
            "round only the results",
    "stale": "the compensation never changes: return the new one, y - (new - weight), rounded to bf16",
}


def _run_kahan(fn: Callable, case: _KahanCase) -> dict[str, Any]:
    traps: list[str] = []
    outs = []
    with forbid(KAHAN_FUNCS, "write the compensated update", traps):
        for w, u, c in case.steps:
            out = call_student(fn, w.clone(), u.clone(), c.clone())
            out["value"] = ship(out.get("value"))
            outs.append(out)
            if "raised" in out or traps:
                break
    last = outs[-1]
    return {**{k: last[k] for k in ("raised", "message", "_exc") if k in last}, "steps": outs, "traps": traps}


def _within_ulp(got: Tensor, want: Tensor) -> bool:
    """Whether ``got`` is ``want`` or one of its two neighbours, entry by entry (bf16)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    near = torch.stack([want, adjacent(want, True), adjacent(want, False)])
    return bool((got.unsqueeze(0) == near).any(dim=0).all())


def _judge_kahan(name: str, case: _KahanCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    steps = out["steps"]
    raised = raised_problem(name, out, f"{where}, step {len(steps) - 1}" if steps else where)
    if raised:
        return raised
    for t, (step, (w, u, c)) in enumerate(zip(steps, case.steps)):
        at = f"{where}, step {t}"
        items = step["value"].get("items", [])
        if len(items) != 2 or any("tensor" not in i for i in items):
            return f"{name} returned a {step['value']['type']} {at}; return (new_weight, new_compensation)."
        got_w, got_c = (i["tensor"] for i in items)
        if got_w.dtype != BF16 or got_c.dtype != BF16:
            return (f"{name} returned a {got_w.dtype} weight and a {got_c.dtype} compensation {at}: both "
                    "stay bf16 (16 + 16 bits per weight is the point), only the arithmetic is float32.")
        want_w, want_c = kahan_add(w, u, c)
        if _within_ulp(got_w, want_w) and _within_ulp(got_c, want_c):
            continue
        hint = next((h for m, h in KAHAN_MISTAKES.items()
                     if all(torch.equal(a, b) for a, b in zip((got_w, got_c), _kahan_mistake(w, u, c, m)))),
                    None)
        bad = int((~((got_w == want_w) & (got_c == want_c))).nonzero()[0, 0]) if got_w.numel() > 1 else 0
        shown = (f"weight={w.view(-1)[bad].item():.6g}, update={u.view(-1)[bad].item():.6g}, compensation="
                 f"{c.view(-1)[bad].item():.6g} gave ({got_w.view(-1)[bad].item():.6g}, "
                 f"{got_c.view(-1)[bad].item():.6g}), expected ({want_w.view(-1)[bad].item():.6g}, "
                 f"{want_c.view(-1)[bad].item():.6g})")
        hint = hint or ("y = update + compensation; new = round(weight + y) to bf16; compensation = "
                        "round(y - (new - weight)) to bf16, in float32")
        return f"{name} {at}: {shown}: {hint}."
    return None


CHECK = Check(_kahan_cases, _run_kahan, _judge_kahan)


def check_kahan_update(fn: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]], hidden: bool = False,
                       seed: int | None = None) -> None:
    """Check ``fn(weight, update, compensation) -> (weight, compensation)`` against ``precision.kahan_add``.

    bf16 weight and compensation, fp32 update, float32 arithmetic: ``y = u + c``,
    ``w' = bf16(w + y)``, ``c' = bf16(y - (w' - w))``. Each step of labkit's trajectory is
    given in turn; each output must be labkit's or a bf16 neighbour of it.

    >>> def kahan_update(weight, update, compensation):
    ...     y = update.float() + compensation.float()
    ...     new = (weight.float() + y).bfloat16()
    ...     return new, (y - (new.float() - weight.float())).bfloat16()
    >>> check_kahan_update(kahan_update, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, KAHAN_FUNCS)
