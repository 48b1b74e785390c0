"""Set 3, part 4: saturation under delayed and under current FP8 scaling across a range jump.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.formats.fp8 import update_amax_history

from ..core import (
    Check,
    as_plain,
    call_student,
    check,
    forbid,
    on_case,
    raised_problem,
    ship,
)
from .bans import FP8_FUNCS


@dataclass
class _DelayedCase:
    """A tensor per step and the length of the amax history delayed scaling keeps."""

    name: str
    steps: list[Tensor]
    history: int


def _saturation(case: _DelayedCase, mistake: str | None = None) -> tuple[list[int], list[int]]:
    """Return per-step saturated counts under delayed and current scaling: labkit's rule, or a mistake's."""
    keep = max(1, case.history + {"longer": 1, "shorter": -1}.get(mistake or "", 0))
    history = torch.zeros(0)
    delayed, current = [], []
    for x in case.steps:
        magnitude = x.abs()
        amax = magnitude.amax()
        if mistake == "current":
            limit = update_amax_history(history, amax, keep).amax()
        elif not history.numel():
            limit = torch.tensor(0.0) if mistake == "first" else amax
        else:
            limit = history.mean() if mistake == "mean" else history.amax()
        delayed.append(int((magnitude > limit).sum()))
        current.append(int((magnitude > amax).sum()))
        history = update_amax_history(history, amax, keep)
    return delayed, current


DELAYED_MISTAKES = {
    "current": "this step's amax was already in the history when its scale was chosen: delayed scaling takes "
               "the scale from the previous steps' amaxes only, and appends this one after the cast",
    "mean": "delayed scaling takes the largest amax of the history (Transformer Engine's "
            "amax_compute_algo='max'), not their mean",
    "longer": "the history holds the last `history` amaxes, not one more",
    "shorter": "the history holds the last `history` amaxes, not one fewer",
    "first": "with an empty history (the first step) there is nothing to be late about: use this step's "
             "own amax",
}


def _delayed_cases(hidden: bool, seed: int) -> list[_DelayedCase]:
    gen = torch.Generator().manual_seed(seed)
    if not hidden:
        steps = [torch.randn(256, generator=gen) * (10.0 if i == 5 else 1.0) for i in range(8)]
        return [_DelayedCase("8 steps, a 10x jump at step 5, history=4", steps, 4)]
    rnd = random.Random(seed)
    cases = []
    for k in range(2):
        length = rnd.randint(2, 6)
        n = rnd.randint(16, 20)
        scales = [math.exp(rnd.gauss(0, 0.1)) for _ in range(n)]
        big = rnd.randint(1, 3)
        scales[big] *= 8.0  # a large step, then a medium jump just as it leaves (or not) the history
        scales[big + length] *= 4.0
        scales[big + length + 1] *= 0.2  # a drop: delayed scaling wastes range, nothing saturates
        jump = rnd.randint(big + length + 3, n - 2)
        scales[jump] *= rnd.uniform(3.0, 20.0)
        steps = [torch.randn(rnd.choice([64, 256]), generator=gen) * s * 10.0 ** (k - 1) for s in scales]
        name = f"{n} steps, history={length}, jumps at steps {big}, {big + length} and {jump}"
        cases.append(_DelayedCase(name, steps, length))
    return cases


def _run_delayed(fn: Callable, case: _DelayedCase) -> dict[str, Any]:
    traps: list[str] = []
    with forbid(FP8_FUNCS, "keep the history", traps):
        out = call_student(fn, [x.clone() for x in case.steps], case.history)
    out.update(traps=traps, value=ship(out.get("value"), items=64))
    return out


def _judge_delayed(name: str, case: _DelayedCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    try:
        delayed, current = ([int(v) for v in counts] for counts in as_plain(out["value"]))
    except (TypeError, ValueError):
        return (f"{name} returned a {out['value']['type']} {where}; return (delayed, current): two lists of "
                "counts, one per step.")
    want_delayed, want_current = _saturation(case)
    if current != want_current:
        return (f"{name}'s current-scaling counts are {current} {where}, expected {want_current}: current "
                "scaling takes the scale from this step's own amax, so no value lies above it.")
    if delayed != want_delayed:
        hint = next((h for m, h in DELAYED_MISTAKES.items() if delayed == _saturation(case, m)[0]), None)
        step = next(i for i, (a, b) in enumerate(zip(delayed, want_delayed)) if a != b)
        hint = hint or ("the scale of a step comes from the largest amax of the previous `history` steps "
                        "(this step's own amax when there is none yet); count the values whose |x| is above "
                        "that amax")
        return (f"{name}'s delayed-scaling counts are {delayed} {where}, expected {want_delayed} (first "
                f"difference at step {step}): {hint}.")
    return None


CHECK = Check(_delayed_cases, _run_delayed, _judge_delayed)


def check_delayed_scaling(fn: Callable[[list[Tensor], int], tuple], hidden: bool = False,
                          seed: int | None = None) -> None:
    """Check ``fn(steps, history) -> (delayed, current)``: per step, how many values saturate under each.

    Delayed: the scale comes from the largest amax of the previous ``history`` steps (this
    step's own when there is none yet), the history updated after the cast
    (``labkit.formats.fp8.update_amax_history``); current: from this step's amax.

    >>> def saturation(steps, history):
    ...     amaxes, delayed, current = [], [], []
    ...     for x in steps:
    ...         amax = x.abs().max()
    ...         limit = max(amaxes[-history:]) if amaxes else amax
    ...         delayed.append(int((x.abs() > limit).sum()))
    ...         current.append(int((x.abs() > amax).sum()))
    ...         amaxes.append(amax)
    ...     return delayed, current
    >>> check_delayed_scaling(saturation, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, FP8_FUNCS)
