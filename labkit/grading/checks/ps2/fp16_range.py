"""Set 2, part 2: what fp16 flushes to zero and turns into inf at a loss scale.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.names import FP16_MAX
from labkit.tasks.gpt import GPTTask

from ..core import (
    Check,
    as_plain,
    call_student,
    check,
    close,
    on_case,
    raised_problem,
    ship,
)
from .tiny_gpt import TINY_GPT, one_thread

FP16_TINY, FP16_SUBNORMAL = 2.0**-14, 2.0**-24


@functools.lru_cache(maxsize=4)
def _gpt_grads(seed: int) -> tuple[Tensor, ...]:
    """Return the fp32 gradients of a 1-layer GPT's first step, its loss multiplied by a small weight.

    The weight plays lesson 04's ``loss_weight`` (2**-12 there): a small loss term's coefficient,
    which shrinks every gradient by the same factor and pushes many below fp16's range.
    """
    with one_thread():
        task = GPTTask(seed=seed, **TINY_GPT)
        model = task.model()
        x, y = task.batch(0)
        # 64 tokens / 2**20 = 2**-14: a small loss term's coefficient (lesson 04, section 2). Not a batch
        # size: a mean loss over more tokens gives gradients of the same size. Kept as it was: the hidden
        # cases and every grade given so far depend on it.
        weight = x.numel() / 2**20
        (task.loss_fn(model(x), y) * weight).backward()
        return tuple(p.grad.detach().clone() for p in model.parameters())


# scaled values on fp16's edges: the largest finite value and the tie above it, the smallest
# normal and subnormal, the tie between 0 and the smallest subnormal (it rounds to 0: even)
EDGES = (65504.0, 65505.0, 65519.0, 65519.99, 65520.0, 65536.0, 1e5, 2.0**-14, 2.0**-15, 2.0**-24,
         1.5 * 2.0**-24, 2.0**-25, 2.0**-25 * 1.25, 2.0**-26, 3e-8, 1e-9, 0.0, 1.0)


@dataclass
class _RangeCase:
    """Gradients (fp32) and the loss scale they are multiplied by before the fp16 cast."""

    name: str
    grads: list[Tensor]
    scale: float


def _edges(scale: float, rnd: random.Random | None = None) -> Tensor:
    signs = [1.0 if rnd is None else rnd.choice([1.0, -1.0]) for _ in EDGES]
    # exact: the scale is a power of 2
    return torch.tensor([s * v for s, v in zip(signs, EDGES)], dtype=torch.float32) / scale


def _range_cases(hidden: bool, seed: int) -> list[_RangeCase]:
    grads = list(_gpt_grads(0 if not hidden else seed % 1000))
    if not hidden:
        return [_RangeCase("a GPT's gradients, no loss scale", grads, 1.0),
                _RangeCase("a GPT's gradients at scale 2**16", grads, 2.0**16),
                _RangeCase("fp16's edges, scale 1", [_edges(1.0)], 1.0)]
    rnd = random.Random(seed)
    low, high = 2.0 ** rnd.randint(0, 6), 2.0 ** rnd.randint(12, 24)
    edged = 2.0 ** rnd.randint(-8, 16)
    mixed = [g.clone() for g in grads[: rnd.randint(2, len(grads))]] + [_edges(edged, rnd)]
    return [_RangeCase(f"a GPT's gradients at scale {low:g}", grads, low),
            _RangeCase(f"a GPT's gradients at scale {high:g}", grads, high),
            _RangeCase(f"gradients and fp16's edges at scale {edged:g}", mixed, edged)]


def _fractions(case: _RangeCase, mistake: str | None = None) -> tuple[float, float]:
    """Return (flushed, overflowed) over all entries: torch's own cast, or a classic mistake's version."""
    g = torch.cat([t.detach().flatten().float() for t in case.grads])
    scaled = g * (1.0 if mistake == "noscale" else case.scale)
    half, n = scaled.half(), max(g.numel(), 1)
    flushed = (g != 0) & (half == 0)
    over = torch.isinf(half) & torch.isfinite(scaled)
    if mistake == "normal":
        flushed = (g != 0) & (scaled.abs() < FP16_TINY)
    elif mistake == "zeros":
        flushed = half == 0
    elif mistake == "floor":
        flushed = (g != 0) & (scaled.abs() < FP16_SUBNORMAL)
    elif mistake == "strict":
        over = scaled.abs() > FP16_MAX
    return flushed.sum().item() / n, over.sum().item() / n


RANGE_MISTAKES = {
    "normal": "you counted fp16's subnormals as flushed: below 2**-14 fp16 still holds values down to 2**-24 "
              "(with fewer bits); only what rounds to 0 is lost. Cast and compare: (g * scale).half() == 0",
    "zeros": "you counted gradients that were 0 already: flushed means a nonzero gradient that became 0",
    "floor": "a value between 2**-25 and 2**-24 rounds up to 2**-24, it is not lost (only up to 2**-25, the "
             "tie, rounds to 0): let the cast decide, (g * scale).half() == 0",
    "strict": "fp16 rounds to nearest: values up to 65520 (exclusive) round down to 65504, only from 65520 "
              "on do they become inf. Cast and test torch.isinf",
    "noscale": "the gradients are multiplied by the loss scale before the cast: that is the scaler's whole "
               "point",
}


def _run_range(fn: Callable, case: _RangeCase) -> dict[str, Any]:
    out = call_student(fn, [g.clone() for g in case.grads], case.scale)
    out["value"] = ship(out.get("value"))
    return out


def _judge_range(name: str, case: _RangeCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    try:
        flushed, over = (float(v) for v in as_plain(out["value"]))
    except (TypeError, ValueError):
        return f"{name} returned a {out['value']['type']} {where}; return (flushed, overflowed): fractions."
    want = _fractions(case)
    if close(flushed, want[0], 1e-6) and close(over, want[1], 1e-6):
        return None
    hint = next((h for m, h in RANGE_MISTAKES.items()
                 if all(close(a, b, 1e-6) for a, b in zip((flushed, over), _fractions(case, m)))), None)
    if hint is None and not close(flushed, want[0], 1e-6):
        hint = "flushed is the fraction of all entries that are nonzero and become 0 in fp16 after the scale."
    elif hint is None:
        hint = "overflowed is the fraction of all entries that become inf in fp16 after the scale."
    return (f"{name} returned flushed={flushed:.6g}, overflowed={over:.6g} {where}; torch's fp16 cast gives "
            f"{want[0]:.6g} and {want[1]:.6g}: {hint}.")


CHECK = Check(_range_cases, _run_range, _judge_range)


def check_fp16_range(fn: Callable[[list[Tensor], float], tuple], hidden: bool = False,
                     seed: int | None = None) -> None:
    """Check ``fn(grads, scale) -> (flushed, overflowed)``: the fractions fp16 turns into 0 and into inf.

    The reference is torch's own cast, ``(g * scale).half()``: ``flushed`` counts the nonzero
    entries that become 0, ``overflowed`` the entries that become inf, over all entries.

    >>> def fp16_range(grads, scale):
    ...     g = torch.cat([t.flatten() for t in grads])
    ...     half = (g * scale).half()
    ...     return ((g != 0) & (half == 0)).float().mean(), half.isinf().float().mean()
    >>> check_fp16_range(fp16_range, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed)
