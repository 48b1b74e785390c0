"""What a sweep found: Wortsman et al.'s LR sensitivity, the stable learning rates, a summary per variant.

Pure reductions of ``Point``s (and of a run's measurements: ``peak``), with no training and no
files: the runner, the figures, the panel and the command line read their numbers from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .recipe import Point

__all__ = ["by_variant", "lr_sensitivity", "peak", "stable_lrs", "summarize"]


def lr_sensitivity(final: Mapping[float, float], init_loss: float) -> float:
    """Return Wortsman et al.'s LR sensitivity: the mean over the grid of ``min(loss, init) - best``.

    ``final`` maps each learning rate to its run's final loss; a run that diverged (a loss above
    the loss at initialisation ``init``, or not finite) counts as ``init``, and ``best`` is the
    lowest of them. 0 means every learning rate in the grid does as well as the best one. It
    depends on the grid (a learning rate too low to train in the run's steps adds the same gap
    to every variant): compare variants on the same grid.

    >>> lr_sensitivity({1e-3: 2.5, 1e-2: 2.4, 1e-1: float("nan")}, init_loss=5.0)
    0.9
    """
    if not final:
        raise ValueError("lr_sensitivity needs at least one (lr, final loss) pair.")
    capped = [min(loss, init_loss) if math.isfinite(loss) else init_loss for loss in final.values()]
    best = min(capped)
    return round(sum(c - best for c in capped) / len(capped), 12)


def stable_lrs(final: Mapping[float, float], tolerance: float = 0.1) -> list[float]:
    """Return the learning rates whose final loss is within ``tolerance`` (nats) of the best one's.

    >>> stable_lrs({1e-3: 2.5, 1e-2: 2.42, 1e-1: 2.9, 1.0: float("nan")})
    [0.001, 0.01]
    """
    finite = {lr: loss for lr, loss in final.items() if math.isfinite(loss)}
    if not finite:
        return []
    best = min(finite.values())
    return sorted(lr for lr, loss in finite.items() if loss <= best + tolerance)


def peak(values: Iterable[float]) -> float:
    """Return the largest value, ``inf`` or NaN counted as larger than any number (an overflow is the peak).

    >>> peak([1.0, 3.0, 2.0]), peak([1.0, float("nan")]), peak([])
    (3.0, inf, -inf)
    """
    largest = -math.inf
    for v in values:
        if math.isnan(v) or v > largest:
            largest = math.inf if math.isnan(v) else v
    return largest


def by_variant(points: Sequence[Point]) -> dict[str, dict[float, list[Point]]]:
    """Return the points grouped by variant, then by lr (the seeds of one setting in a list), in order.

    >>> p = lambda v, lr, s: Point(v, lr, s, 2.5, 5.0, 2.5, 1.0, 1.0, 4.0, 0, -1, 0.0, 1.0)
    >>> table = by_variant([p("a", 0.1, 0), p("a", 0.1, 1), p("b", 0.1, 0)])
    >>> {v: {lr: len(ps) for lr, ps in by_lr.items()} for v, by_lr in table.items()}
    {'a': {0.1: 2}, 'b': {0.1: 1}}
    """
    table: dict[str, dict[float, list[Point]]] = {}
    for p in points:
        table.setdefault(p.variant, {}).setdefault(p.lr, []).append(p)
    return table


def summarize(points: Sequence[Point], tolerance: float = 0.1) -> dict[str, dict[str, Any]]:
    """Return per variant: best loss and its lr, LR sensitivity (mean over seeds), stable lrs, top lr's logit.

    >>> p = lambda v, lr, loss, a: Point(v, lr, 0, loss, 5.0, loss, a, a, 4.0, 0, -1, 0.0, 1.0)
    >>> s = summarize([p("baseline", 0.01, 2.4, 50.0), p("baseline", 0.1, 2.9, 2e4)])["baseline"]
    >>> s["best_lr"], s["sensitivity"], s["stable_lrs"], s["attn_logit_max_top_lr"]
    (0.01, 0.25, [0.01], 20000.0)
    """
    out: dict[str, dict[str, Any]] = {}
    for variant, by_lr in by_variant(points).items():
        seeds = sorted({p.seed for ps in by_lr.values() for p in ps})
        per_seed = []
        for s in seeds:
            final = {lr: p.final_loss for lr, ps in by_lr.items() for p in ps if p.seed == s}
            init = next(p.init_loss for ps in by_lr.values() for p in ps if p.seed == s)
            per_seed.append(lr_sensitivity(final, init))
        mean = {lr: sum(p.final_loss for p in ps) / len(ps) for lr, ps in sorted(by_lr.items())}
        best_lr = min(mean, key=lambda lr: mean[lr] if math.isfinite(mean[lr]) else math.inf)
        top = max(by_lr)
        out[variant] = {
            "best_lr": best_lr, "best_loss": mean[best_lr], "sensitivity": sum(per_seed) / len(per_seed),
            "sensitivity_per_seed": per_seed, "stable_lrs": stable_lrs(mean, tolerance),
            "attn_logit_max_top_lr": max(p.attn_logit_max for p in by_lr[top]), "seeds": len(seeds),
        }
    return out
