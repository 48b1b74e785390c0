"""Problem set 4's checks: spikes that gradient clipping cannot see (after lesson 08).

1. ``check_update_rms`` (``rms``): RMS(g/sqrt(v_hat)) per parameter tensor from an AdamW's state,
   against ``labkit.optim.read_update_rms``;
2. ``check_update_clipping`` (``step``): one update-clipped AdamW step, Algorithm 2 of arXiv
   2304.13013, against ``labkit.optim.StableAdamW`` on float64, step by step along its trajectory;
3. ``check_find_spike`` (``spike``): the tensor and optimizer step of an RMS spike and whether it
   came before the loss spike, read from a real monitored run's records (``UpdateMonitor``'s
   fields, one record late).

Each judge that finds a wrong answer replays the classic mistakes of its part and names the one
that gives the student's numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core import check
from .rms import RMS_FUNCS, rms_check
from .spike import SPIKE_FUNCS, spike_check
from .step import STEP_FUNCS, step_check

__all__ = ["BANNED", "CHECKS", "check_find_spike", "check_update_clipping", "check_update_rms"]

CHECKS = {"check_update_rms": rms_check, "check_update_clipping": step_check, "check_find_spike": spike_check}
BANNED = {"check_update_rms": RMS_FUNCS, "check_update_clipping": STEP_FUNCS, "check_find_spike": SPIKE_FUNCS}


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
    check(CHECKS["check_update_rms"], fn, hidden, seed, BANNED["check_update_rms"])


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
    check(CHECKS["check_update_clipping"], fn, hidden, seed, BANNED["check_update_clipping"])


def check_find_spike(fn: Callable[..., tuple], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(records, threshold, factor, window) -> (tensor, rms_step, loss_step, rms_first)``.

    ``rms_step``: the first optimizer step whose largest RMS passed ``threshold`` (its record's
    ``update_step``: the monitor is one record late), ``tensor`` its ``update_rms_peak``;
    ``loss_step``: the first step whose loss exceeds ``factor`` times the median of the
    ``window`` losses before it; ``rms_first``: ``rms_step < loss_step``. Graded on real monitored runs.

    >>> import statistics
    >>> def find_spike(records, threshold, factor, window):
    ...     first = next((r for r in records if r.update_rms_max > threshold), None)
    ...     tensor, rms_step = (first.update_rms_peak, first.update_step) if first else (None, None)
    ...     losses = [r.loss for r in records]
    ...     loss_step = next((records[i].step for i in range(window, len(records))
    ...                       if losses[i] > factor * statistics.median(losses[i - window:i])), None)
    ...     both = rms_step is not None and loss_step is not None
    ...     return tensor, rms_step, loss_step, both and rms_step < loss_step
    >>> check_find_spike(find_spike, hidden=True, seed=0)
    """
    check(CHECKS["check_find_spike"], fn, hidden, seed, BANNED["check_find_spike"])

