"""Set 4, part 2: one update-clipped AdamW step (StableAdamW, Algorithm 2 of arXiv 2304.13013).

The grader walks ``labkit.optim.StableAdamW``'s own trajectory on float64 tensors and hands the
student its state before each step: a tensor whose gradient jumps (its ``RMS_t`` passes 1, so
its step is clipped) beside one whose gradients shrink (``RMS_t < 1``: AdamW's step, untouched),
with weight decay, over several steps. Each step's output must equal StableAdamW's to a
tolerance far below what any classic mistake changes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.optim import StableAdamW

from ..core import Check, call_student, check, forbid, on_case, raised_problem, ship
from .bans import RMS_FUNCS

__all__ = ["CHECK", "check_update_clipping"]


@dataclass
class _Step:
    """StableAdamW's state before step ``t`` (1 on the first) and its gradients, then the state after it."""

    t: int
    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    after: tuple[list[Tensor], list[Tensor], list[Tensor]]


@dataclass
class _StepCase:
    name: str
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    steps: list[_Step]


def _trajectory(name: str, params: list[Tensor], grads: list[list[Tensor]], lr: float,
                betas: tuple[float, float], eps: float, weight_decay: float) -> _StepCase:
    """Run StableAdamW (float64, one tensor at a time) and keep each step's inputs and outputs."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = StableAdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    out = []
    for t, gs in enumerate(grads, start=1):
        state = [opt.state.get(p) or {} for p in ps]
        m = [s["exp_avg"].clone() if s else torch.zeros_like(p) for s, p in zip(state, ps)]
        v = [s["exp_avg_sq"].clone() if s else torch.zeros_like(p) for s, p in zip(state, ps)]
        before = [p.detach().clone() for p in ps]
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        after = ([p.detach().clone() for p in ps], [opt.state[p]["exp_avg"].clone() for p in ps],
                 [opt.state[p]["exp_avg_sq"].clone() for p in ps])
        out.append(_Step(t, before, [g.clone() for g in gs], m, v, after))
    return _StepCase(name, lr, betas, eps, weight_decay, out)


def _step_cases(hidden: bool, seed: int) -> list[_StepCase]:
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=f64)

    if not hidden:
        # w's gradient: 1e-3 for four steps, then 1: new to v, RMS_t > 1, clipped; b's shrinks: never clipped
        w, b = randn(4, 3), randn(3)
        grads = [[randn(4, 3) * (1e-3 if t < 4 else 1.0), randn(3) * 0.5**t] for t in range(6)]
        return [_trajectory("w's gradient jumps 1000x at step 5, b's shrinks; lr=0.1, weight_decay=0.1",
                            [w, b], grads, 0.1, (0.9, 0.99), 1e-8, 0.1)]
    rnd = random.Random(seed)
    n, jump = rnd.randint(6, 9), rnd.randint(3, 5)
    shapes = [(rnd.randint(2, 6), rnd.randint(2, 5)), (rnd.randint(2, 8),), (rnd.randint(2, 5), 2)]
    small = 10.0 ** rnd.uniform(-4, -2)
    grads = []
    for t in range(n):
        big = t == jump or (t > jump and rnd.random() < 0.3)
        grads.append([randn(*shapes[0]) * (rnd.uniform(0.3, 3.0) if big else small),  # jumps: clipped
                      randn(*shapes[1]) * 0.6**t,  # shrinks: RMS_t < 1, AdamW's step
                      randn(*shapes[2]) * 10.0 ** rnd.uniform(-2, 0)])  # noise: now and then just above 1
    betas = (rnd.choice([0.8, 0.9]), rnd.choice([0.95, 0.98, 0.99]))
    lr, wd = 10.0 ** rnd.uniform(-2.5, -1), rnd.choice([0.05, 0.1, 0.3])
    first = _trajectory(f"{n} steps, the first tensor's gradient jumps at step {jump + 1}, lr={lr:.3g}, "
                        f"betas={betas}, weight_decay={wd}", [randn(*s) for s in shapes], grads, lr, betas,
                        1e-8, wd)
    # the clip every step: a gradient growing 10x a step is always new to v
    shape = (rnd.randint(3, 8), rnd.randint(3, 8))
    growing = [[randn(*shape) * 10.0 ** (t - 4), randn(shape[1]) * 0.1] for t in range(5)]
    second = _trajectory("5 steps of a gradient growing 10x each step (clipped every step but the first) "
                         f"beside a steady one, weight_decay={wd}", [randn(*shape), randn(shape[1])], growing,
                         lr, (0.9, 0.95), 1e-8, wd)
    return [first, second]


def _by_hand(case: _StepCase, s: _Step, mistake: str | None = None) -> tuple[list[Tensor], ...]:
    """Return one step written out (float64) with a classic mistake (``None``: Algorithm 2, as labkit's)."""
    beta1, beta2 = case.betas
    ps, ms, vs = [], [], []
    rms_all = []
    for p, g, m, v in zip(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs):
        m2, v2 = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        bc1, bc2 = 1 - beta1**s.t, 1 - beta2**s.t
        seen = v if mistake == "stale_v" else v2
        v_hat_rms = seen if mistake == "no_bias" else seen / bc2
        rms = (g * g / v_hat_rms.clamp_min(case.eps**2)).mean().sqrt()
        rms_all.append((g * g / v_hat_rms.clamp_min(case.eps**2)).sum())
        ms.append(m2)
        vs.append(v2)
        ps.append((p, m2 / bc1, (v2 / bc2).sqrt() + case.eps, rms))
    every = torch.stack(rms_all).sum() / sum(p.numel() for p in s.params)
    out = []
    for p, m_hat, denom, rms in ps:
        if mistake == "global":
            rms = every.sqrt()
        div = rms if mistake == "always" else torch.clamp(rms, min=1.0)
        if mistake == "none":
            div = torch.ones(())
        eta = case.lr / div
        decay = case.lr if mistake == "decay_unclipped" else eta
        out.append(p - decay * case.weight_decay * p - eta * m_hat / denom)
    return out, ms, vs


STEP_MISTAKES = {
    "none": "no tensor was clipped: that is AdamW's step. Divide each tensor's lr by max(1, RMS_t), RMS_t = "
            "sqrt(mean(g**2 / max(v_hat, eps**2)))",
    "decay_unclipped": "the weight decay is scaled by the clipped lr too: theta -= eta_t * weight_decay * "
                       "theta, eta_t = lr / max(1, RMS_t), as in Algorithm 2 (the authors' gist decays with "
                       "the unclipped lr; the paper's algorithm is what is graded)",
    "always": "a tensor whose RMS_t is below 1 keeps lr: divide by max(1, RMS_t), not by RMS_t (that would "
              "make its step larger than AdamW's)",
    "global": "RMS_t is per tensor: one RMS over all the tensors lets a steady tensor's coordinates dilute "
              "the one whose gradient jumped",
    "stale_v": "RMS_t divides by v_hat_t, the second moment *after* this step's update (it contains g_t): "
               "with the previous step's v a gradient new to v has no bound",
    "no_bias": "RMS_t's v_hat is bias-corrected, exp_avg_sq / (1 - beta2**step), as the step's own is",
}


def _run_step(fn: Callable, case: _StepCase) -> dict[str, Any]:
    traps: list[str] = []
    outs = []
    with forbid(RMS_FUNCS, "write the update-clipped step", traps):
        for s in case.steps:
            out = call_student(fn, [p.clone() for p in s.params], [g.clone() for g in s.grads],
                        [m.clone() for m in s.exp_avgs], [v.clone() for v in s.exp_avg_sqs], s.t, case.lr,
                        case.betas, case.eps, case.weight_decay)
            out["value"] = ship(out.get("value"))
            outs.append(out)
            if "raised" in out or traps:
                break
    last = outs[-1]
    return {**{k: last[k] for k in ("raised", "message", "_exc") if k in last}, "steps": outs, "traps": traps}


def _close_all(got: list[Tensor], want: list[Tensor], base: list[Tensor] | None = None) -> bool:
    """Whether each tensor is close; with ``base`` the *changes* from it are compared (an update is small)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            return False
        a, b = a.double(), b.double()
        if base is not None:
            a, b = a - base[i], b - base[i]
        if not torch.allclose(a, b, rtol=1e-6, atol=1e-12 + 1e-9 * b.abs().max().item()):
            return False
    return len(got) == len(want)


def _tensors(shipped: dict[str, Any], n: int) -> list[Tensor] | None:
    items = shipped.get("items")
    if items is None or len(items) != n or any("tensor" not in i for i in items):
        return None
    return [i["tensor"] for i in items]


def _judge_step(name: str, case: _StepCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    steps = out.get("steps", [])
    if out.get("traps") or not steps:
        return raised_problem(name, out, where)
    for s, step in zip(case.steps, steps):
        at = f"{where}, step {s.t}"
        raised = raised_problem(name, step, at)
        if raised:
            return raised
        items = step["value"].get("items", [])
        got = [_tensors(i, len(s.params)) for i in items] if len(items) == 3 else []
        if len(got) != 3 or any(g is None for g in got):
            return (f"{name} returned a {step['value']['type']} {at}; return (params, exp_avgs, "
                    f"exp_avg_sqs): three lists of {len(s.params)} tensors, the state after the step.")
        params, ms, vs = got
        if any(p.dtype != torch.float64 for p in params):
            return (f"{name} returned {params[0].dtype} parameters {at}: the inputs are float64; keep their "
                    "dtype (no .float()).")
        want_p, want_m, want_v = s.after
        if not (_close_all(ms, want_m) and _close_all(vs, want_v)):
            return (f"{name}'s moments after step {s.t} are wrong {where}: exp_avg = beta1 * exp_avg + (1 - "
                    "beta1) * g and exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2 (AdamW's, "
                    "unclipped).")
        if _close_all(params, want_p, s.params):
            continue
        bad = next(i for i in range(len(params)) if not _close_all([params[i]], [want_p[i]], [s.params[i]]))
        moved = (params[bad].double() - s.params[bad]).norm().item()
        should = (want_p[bad] - s.params[bad]).norm().item()
        hint = next((h for m, h in STEP_MISTAKES.items()
                     if _close_all(params, _by_hand(case, s, m)[0], s.params)), None)
        hint = hint or ("per tensor, eta_t = lr / max(1, RMS_t) with RMS_t = sqrt(mean(g**2 / max(v_hat, "
                        "eps**2))), v_hat = exp_avg_sq / (1 - beta2**t) after this step's update; then theta "
                        "-= eta_t * weight_decay * theta + eta_t * m_hat / (sqrt(v_hat) + eps)")
        return (f"{name} moved tensor {bad} (shape {tuple(params[bad].shape)}) by {moved:.6g} at step {s.t} "
                f"{where}; StableAdamW moves it by {should:.6g}: {hint}.")
    return None


CHECK = Check(_step_cases, _run_step, _judge_step)


def check_update_clipping(fn: Callable[..., tuple], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps, weight_decay)`` (StableAdamW).

    Returns ``(params, exp_avgs, exp_avg_sqs)`` after step ``step`` (1 on the first): AdamW's
    moments, and per tensor ``eta = lr / max(1, RMS_t)`` for the decay and the step
    (``labkit.optim.StableAdamW``, float64, to a tolerance).

    >>> import torch
    >>> def stable_adamw_step(params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps, weight_decay):
    ...     beta1, beta2 = betas
    ...     out = ([], [], [])
    ...     for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
    ...         m = beta1 * m + (1 - beta1) * g
    ...         v = beta2 * v + (1 - beta2) * g * g
    ...         m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
    ...         rms = (g * g / v_hat.clamp(min=eps**2)).mean().sqrt()
    ...         eta = lr / rms.clamp(min=1.0)
    ...         p = p - eta * weight_decay * p - eta * m_hat / (v_hat.sqrt() + eps)
    ...         for kept, t in zip(out, (p, m, v)):
    ...             kept.append(t)
    ...     return out
    >>> check_update_clipping(stable_adamw_step, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, RMS_FUNCS)
