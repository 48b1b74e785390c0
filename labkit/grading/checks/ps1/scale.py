"""Set 1, part 4: the dynamic loss-scale rule, against ``labkit.update_scale``.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from labkit.scaler import ScalerConfig, update_scale

from ..core import (
    Check,
    as_number,
    call_student,
    check,
    forbid,
    on_case,
    raised_problem,
    ship,
)
from .bans import SCALE_FUNCS

State = tuple[float, int, int]  # (scale, growth_tracker, hysteresis_left), as plain numbers


def _ref_update(state: State, found_inf: bool, config: ScalerConfig) -> State:
    tracker, hyst = (torch.tensor(v, dtype=torch.int32) for v in state[1:])
    s, g, h = update_scale(torch.tensor(state[0]), tracker, hyst, torch.tensor(float(found_inf)), config)
    return s.item(), int(g.item()), int(h.item())


def _scale_hint(state: State, found: bool, got: tuple, want: tuple, config: ScalerConfig) -> str:
    scale = state[0]
    if found and want[0] == scale and got[0] < scale:
        return (f"with hysteresis={config.hysteresis}, back off only when hysteresis_left reaches 0 (it "
                "counts the overflows since the last growth), not on every overflow.")
    if found and want[0] < scale and got[0] != want[0]:
        return (f"on this overflow the scale must back off to scale * backoff_factor = {want[0]:g} "
                f"(hysteresis_left {state[2]} -> {want[2]}).")
    if not found and want[0] > scale and got[0] == scale:
        return (f"this is clean step number growth_interval={config.growth_interval} in a row: grow when "
                "growth_tracker + 1 reaches growth_interval (count this step too), then reset the tracker to "
                "0.")
    if not found and got[0] > scale and want[0] == scale:
        return (f"the scale grew too early: it grows only after growth_interval={config.growth_interval} "
                "clean steps in a row, and an overflow resets the count to 0.")
    if got[1] != want[1]:
        return ("growth_tracker is wrong: +1 on a clean step, back to 0 on an overflow and after a growth.")
    if got[2] != want[2]:
        return ("hysteresis_left is wrong: -1 on an overflow (never below 0), refilled to config.hysteresis "
                "after a growth, unchanged on other clean steps.")
    return "the scale is wrong."


def _scale_runs(hidden: bool, seed: int) -> list[tuple[str, ScalerConfig, float, list[bool]]]:
    if not hidden:
        return [
            ("two overflows, hysteresis=1", ScalerConfig(growth_interval=3), 1024.0, [True, True]),
            ("three clean steps, growth_interval=3", ScalerConfig(growth_interval=3), 1024.0,
             [False, False, False]),
            ("hysteresis=2: overflow, overflow", ScalerConfig(growth_interval=3, hysteresis=2), 1024.0,
             [True, True]),
        ]
    rnd = random.Random(seed)
    runs = []
    for k in range(6):
        config = ScalerConfig(growth_factor=rnd.choice([2.0, 4.0]), backoff_factor=rnd.choice([0.5, 0.25]),
                              growth_interval=rnd.randint(1, 5), hysteresis=1 if k < 2 else rnd.randint(2, 3))
        flags = [rnd.random() < rnd.uniform(0.15, 0.5) for _ in range(40)]
        runs.append((f"a random run of 40 steps #{k}", config, 2.0 ** rnd.randint(4, 16), flags))
    return runs


@dataclass
class _ScaleCase:
    """One step of a scale run: the state labkit's rule reached, and whether this step overflowed."""

    name: str
    config: ScalerConfig
    state: State
    found: bool


def _scale_cases(hidden: bool, seed: int) -> list[_ScaleCase]:
    cases = []
    for run, config, init, flags in _scale_runs(hidden, seed):
        state = (init, 0, config.hysteresis)
        for i, found in enumerate(flags):
            cases.append(_ScaleCase(f"{run}, step {i}", config, state, found))
            state = _ref_update(state, found, config)
    return cases


def _run_scale(fn: Callable, case: _ScaleCase) -> dict[str, Any]:
    traps: list[str] = []
    with forbid(SCALE_FUNCS, "write the rule", traps):
        out = call_student(fn, *case.state, case.found, copy.copy(case.config))
    out.update(traps=traps, value=ship(out.get("value")))
    return out


def _judge_scale(name: str, case: _ScaleCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    shipped, state = out["value"], case.state
    items = shipped.get("items", [])
    try:
        got = (float(as_number(items[0])), int(as_number(items[1])), int(as_number(items[2])))
    except (TypeError, ValueError, IndexError):
        shown = repr(shipped["py"]) if "py" in shipped else f"a {shipped['type']}"
        return f"{name} returned {shown} {where}; return a tuple (scale, growth_tracker, hysteresis_left)."
    want = _ref_update(state, case.found, case.config)
    if got != want:
        return (f"{name}(scale={state[0]:g}, growth_tracker={state[1]}, hysteresis_left={state[2]}, "
                f"found_inf={case.found}) returned {got}, expected {want} {where} with {case.config}: "
                f"{_scale_hint(state, case.found, got, want, case.config)}")
    return None


CHECK = Check(_scale_cases, _run_scale, _judge_scale)


def check_update_scale(fn: Callable[..., State], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(scale, growth_tracker, hysteresis_left, found_inf, config)`` against ``update_scale``.

    ``fn`` takes and returns plain numbers: ``(scale, growth_tracker, hysteresis_left)``.

    >>> import labkit
    >>> def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):
    ...     if found_inf:
    ...         hysteresis_left = max(hysteresis_left - 1, 0)
    ...         return (scale * config.backoff_factor if hysteresis_left == 0 else scale), 0, hysteresis_left
    ...     if growth_tracker + 1 == config.growth_interval:
    ...         return scale * config.growth_factor, 0, config.hysteresis
    ...     return scale, growth_tracker + 1, hysteresis_left
    >>> check_update_scale(next_scale, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, SCALE_FUNCS)
