"""Set 4, part 1: RMS(g/sqrt(v_hat)) per parameter tensor, read from an AdamW's state after its step.

Graded against ``labkit.optim.read_update_rms`` on optimizers built here from the seed: param
groups with their own betas and eps, a tensor frozen for the first steps (its own, smaller step
count), a coordinate whose gradient was always 0 (``v_hat = 0``: only ``max(v_hat, eps**2)``
keeps it finite), ``eps`` that binds, a gradient new to ``v`` (the ratio at its cap), float64,
and a parameter with no gradient this step (NaN).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from labkit.optim import read_update_rms

from ..core import Check, as_plain, call_student, check, close, forbid, on_case, raised_problem, ship
from .bans import RMS_FUNCS

__all__ = ["CHECK", "check_update_rms"]


@dataclass
class _Group:
    """One param group: its tensors' shapes and dtype, betas, eps, and per tensor the steps it has no grad."""

    shapes: list[tuple[int, ...]]
    betas: tuple[float, float]
    eps: float
    dtype: torch.dtype = torch.float32


@dataclass
class _RmsCase:
    """An AdamW run: ``scales[t][i]``, the size of tensor i's gradient at step t (None: no gradient)."""

    name: str
    seed: int
    groups: list[_Group]
    scales: list[list[float | None]]
    zero_column: bool = False  # the first tensor's first coordinate never gets a gradient


def _optimizer(case: _RmsCase) -> torch.optim.AdamW:
    """Return the case's AdamW after its last step, its gradients still there."""
    gen = torch.Generator().manual_seed(case.seed)
    groups, params = [], []
    for g in case.groups:
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=g.dtype)) for s in g.shapes]
        params += ps
        groups.append({"params": ps, "betas": g.betas, "eps": g.eps})
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01, foreach=False)
    for row in case.scales:
        for p, scale in zip(params, row):
            p.grad = None if scale is None else torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale
        if case.zero_column and params[0].grad is not None:
            params[0].grad.view(-1)[0] = 0.0
        opt.step()
    return opt


def _labels(case: _RmsCase) -> list[str]:
    return [f"group {k}, tensor {i} (shape {tuple(s)}{', float64' if g.dtype == torch.float64 else ''})"
            for k, g in enumerate(case.groups) for i, s in enumerate(g.shapes)]


def _rms_cases(hidden: bool, seed: int) -> list[_RmsCase]:
    if not hidden:
        steps = [[1e-2, 1e-2, 1e-2] for _ in range(5)]
        steps[-1][0] = 1.0  # 100x larger than anything v has seen
        return [_RmsCase("one group, three tensors, five steps, the last gradient of the first 100x larger",
                         seed, [_Group([(8, 4), (4,), (4, 2)], (0.9, 0.99), 1e-8)], steps)]
    rnd = random.Random(seed)
    b2 = rnd.sample([0.95, 0.98, 0.99, 0.995, 0.999], 2)
    n, frozen = rnd.randint(6, 10), rnd.randint(2, 4)
    scales = [[10.0 ** rnd.uniform(-3, -1) for _ in range(4)] for _ in range(n)]
    for t in range(frozen):
        scales[t][2] = None  # the third tensor joins late: its own step count is n - frozen
    scales[-1][3] = None  # the last has no gradient this step: NaN
    scales[-1][1] *= rnd.uniform(20, 100)
    groups = [_Group([(rnd.randint(3, 9), rnd.randint(2, 6)), (rnd.randint(2, 8),)], (0.9, b2[0]), 1e-8),
              _Group([(rnd.randint(2, 6), 3), (5,)], (rnd.choice([0.8, 0.9]), b2[1]), 1e-6)]
    first = _RmsCase(f"two param groups (beta2 {b2[0]} and {b2[1]}), a tensor frozen for {frozen} of {n} "
                     "steps, one with no gradient this step, a coordinate that never had a gradient",
                     seed, groups, scales, zero_column=True)
    m, eps = rnd.randint(25, 40), 10.0 ** rnd.uniform(-4, -3)
    tiny = [[1e-6, rnd.uniform(0.5, 2.0) * eps] for _ in range(m)]
    tiny[-1][0] = rnd.uniform(0.5, 2.0)  # new to v: the ratio at its cap
    second = _RmsCase(f"float64, eps={eps:.2g} as large as the second tensor's gradients, after {m} steps of "
                      "tiny gradients the first tensor's jumps", seed + 1,
                      [_Group([(rnd.randint(4, 12),), (rnd.randint(4, 12), 2)],
                              (0.9, rnd.choice([0.95, 0.99])), eps, torch.float64)], tiny)
    return [first, second]


def _by_hand(case: _RmsCase, mistake: str) -> list[float]:
    """Return each tensor's RMS computed with a classic mistake."""
    opt = _optimizer(case)
    every = [(p, g) for g in opt.param_groups for p in g["params"]]
    top = max(float(opt.state[p]["step"]) for p, _ in every if opt.state.get(p))
    out = []
    for p, group in every:
        if p.grad is None:
            out.append(0.0 if mistake == "zero" else math.nan)
            continue
        state = opt.state[p]
        beta1, beta2 = (opt.param_groups[0] if mistake == "group0" else group)["betas"]
        eps = (opt.param_groups[0] if mistake == "group0" else group)["eps"]
        t = top if mistake == "shared_step" else float(state["step"])
        g, v = p.grad.double(), state["exp_avg_sq"].double()
        v_hat = v if mistake == "no_bias" else v / (1 - (beta1 if mistake == "beta1" else beta2) ** t)
        if mistake == "plus_eps":
            ratio = (g / (v_hat.sqrt() + eps)).square()
        elif mistake == "no_eps":
            ratio = g.square() / v_hat
        else:
            ratio = g.square() / v_hat.clamp_min(eps * eps)
        out.append((ratio.sqrt().mean() if mistake == "mean_abs" else ratio.mean().sqrt()).item())
    return out


RMS_MISTAKES = {
    "no_bias": "v_hat is the bias-corrected second moment: exp_avg_sq / (1 - beta2**step) (torch's Adam "
               "corrects it the same way); without it the RMS is too small by sqrt(1 - beta2**step)",
    "beta1": "the second moment's bias correction uses beta2 (betas[1]), not beta1",
    "group0": "each tensor takes the betas and eps of its own param group (optimizer.param_groups[k]), not "
              "of the first",
    "shared_step": "each tensor has its own step count, optimizer.state[p]['step']: a tensor that had no "
                   "gradient for a few steps was not stepped then, and its bias correction uses its own "
                   "count",
    "mean_abs": "that is the mean of |g| / sqrt(v_hat); the RMS is the square root of the mean of "
                "g**2 / v_hat",
    "plus_eps": "divide by max(v_hat, eps**2), as Algorithm 2 of arXiv 2304.13013 does, not by "
                "(sqrt(v_hat) + eps)**2",
    "no_eps": "a coordinate whose gradient was always 0 has v_hat = 0, and g**2 / v_hat is 0 / 0: divide by "
              "max(v_hat, eps**2)",
    "zero": "a tensor with no gradient this step (p.grad is None) was not stepped, and has no RMS: return "
            "NaN for it",
}


def _run_rms(fn: Callable, case: _RmsCase) -> dict[str, Any]:
    opt = _optimizer(case)
    traps: list[str] = []
    with forbid(RMS_FUNCS, "compute the RMS", traps):
        out = call_student(fn, opt)
    out.update(traps=traps, value=ship(out.get("value"), items=64))
    return out


def _judge_rms(name: str, case: _RmsCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    labels = _labels(case)
    try:
        got = [float(v) for v in as_plain(out["value"])]
    except (TypeError, ValueError):
        return (f"{name} returned a {out['value']['type']} {where}; return a list with one number (or 0-dim "
                "tensor) per parameter, in the order of optimizer.param_groups.")
    want = [v.item() for v in read_update_rms(_optimizer(case))]
    if len(got) != len(want):
        return (f"{name} returned {len(got)} values {where}, expected {len(want)}: one per parameter of "
                "every param group, in order (a parameter with no gradient this step gives NaN).")
    wrong = [i for i, (a, b) in enumerate(zip(got, want)) if not close(a, b)]
    if not wrong:
        return None
    i = wrong[0]
    hint = next((h for m, h in RMS_MISTAKES.items()
                 if all(close(a, b) for a, b in zip(got, _by_hand(case, m)))), None)
    hint = hint or ("RMS = sqrt(mean(g**2 / max(v_hat, eps**2))), v_hat = exp_avg_sq / (1 - beta2**step), "
                    "with the tensor's own step count and its group's betas and eps")
    return f"{name} gave {got[i]:.6g} for {labels[i]} {where}, expected {want[i]:.6g}: {hint}."


CHECK = Check(_rms_cases, _run_rms, _judge_rms)


def check_update_rms(fn: Callable[[Any], list], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(optimizer) -> [RMS per parameter]`` against ``labkit.optim.read_update_rms``.

    Called after ``optimizer.step()``, gradients still there: per parameter, in the order of
    ``optimizer.param_groups``, ``sqrt(mean(g**2 / max(v_hat, eps**2)))`` with ``v_hat =
    exp_avg_sq / (1 - beta2**step)``, its own step count and its group's betas and eps; NaN
    for a parameter with no gradient.

    >>> import math, torch
    >>> def update_rms_per_tensor(optimizer):
    ...     out = []
    ...     for group in optimizer.param_groups:
    ...         beta2, eps = group["betas"][1], group["eps"]
    ...         for p in group["params"]:
    ...             if p.grad is None:
    ...                 out.append(math.nan)
    ...                 continue
    ...             state = optimizer.state[p]
    ...             v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"].item())
    ...             out.append((p.grad**2 / v_hat.clamp(min=eps**2)).mean().sqrt().item())
    ...     return out
    >>> check_update_rms(update_rms_per_tensor, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, RMS_FUNCS)
