"""``AdaGC``: clip each tensor against an EMA of its own clipped norms."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..clip import scale_grads_
from ..validate import check_int, check_number
from .base import FEEDS, Clipper, check_max_consecutive_clips, lockin_guard

__all__ = ["AdaGC", "adagc_update"]


def adagc_update(
    gamma: Tensor, count: Tensor, norms: Tensor, norm: Tensor, *, beta: float, lambda_rel: float,
    lambda_abs: float, warmup: int, eps: float, feed: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(h, gamma', clipped)``: each tensor's clip factor, the new EMAs, which tensors were cut.

    Warm-up (``count < warmup``): ``h_i = min(1, lambda_abs / (||g|| + eps))`` (global) and
    ``gamma_i`` is the first, then the running minimum, of ``h_i * ||g_i||``. After:
    ``h_i = min(1, lambda_rel * gamma_i / ||g_i||)`` and ``gamma_i' = beta*gamma_i +
    (1-beta) * v_i`` with ``v_i = h_i*||g_i||`` (``feed="clipped"``, the paper's), ``||g_i||``
    (``"raw"``), or ``gamma_i`` kept where ``h_i < 1`` (``"exclude"``).

    >>> h, g, c = adagc_update(torch.tensor([1.0]), torch.tensor(5), torch.tensor([3.0]), torch.tensor(3.0),
    ...                        beta=0.5, lambda_rel=1.0, lambda_abs=1.0, warmup=1, eps=1e-6, feed="clipped")
    >>> h, g, c
    (tensor([0.3333]), tensor([1.]), tensor([True]))
    """
    warming = count < warmup
    h_abs = torch.clamp(lambda_abs / (norm + eps), max=1.0).expand_as(norms)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    h_rel = torch.where(norms > 0, torch.clamp(lambda_rel * gamma / safe, max=1.0), torch.ones_like(norms))
    h = torch.where(warming, h_abs, h_rel)
    cut = h * norms
    warm_gamma = torch.where(count == 0, cut, torch.minimum(gamma, cut))
    clipped = ~warming & (h < 1)
    value = cut if feed == "clipped" else norms
    ema = beta * gamma + (1 - beta) * value
    if feed == "exclude":
        ema = torch.where(clipped, gamma, ema)
    return h, torch.where(warming, warm_gamma, ema), clipped


class AdaGC(Clipper):
    """Clip each tensor's gradient against an EMA of its own norms (Wang et al., 2025, arXiv 2502.11034).

    Rule: ``adagc_update``. Defaults as ``pytorch_optimizer.AdaGC`` (kozistr): ``beta=0.98,
    lambda_rel=1.05, lambda_abs=1.0, warmup=100``, ``eps=1e-8``, ``feed="clipped"``. One
    ``gamma`` per tensor, on the device; a step whose global norm is not finite leaves the
    gradients and every ``gamma`` untouched. The lock-in guard counts steps where any tensor
    was cut; after ``max_consecutive_clips`` in a row AdaGC restarts its warm-up.

    >>> clip = AdaGC(warmup=1, lambda_rel=1.0)
    >>> for g in (1.0, 1.0, 4.0):
    ...     w = torch.zeros(1, requires_grad=True); w.grad = torch.tensor([g]); _ = clip.clip_([w])
    >>> w.grad  # cut back to its EMA of 1
    tensor([1.])
    """

    def __init__(
        self,
        beta: float = 0.98,
        lambda_rel: float = 1.05,
        lambda_abs: float = 1.0,
        warmup: int = 100,
        eps: float = 1e-8,
        feed: str = "clipped",
        max_consecutive_clips: int | None = 50,
    ) -> None:
        check_number("beta", beta, 0, 1, low_open=True, high_open=True, hint="e.g. 0.98")
        check_number("lambda_rel", lambda_rel, 0, low_open=True)
        check_number("lambda_abs", lambda_abs, 0, low_open=True)
        check_int("warmup", warmup, 1, hint="(gamma starts from the warm-up norms)")
        if feed not in FEEDS:
            raise ValueError(f"feed must be one of {FEEDS}, got {feed!r}.")
        self.beta, self.lambda_rel, self.lambda_abs, self.warmup, self.eps = (
            beta, lambda_rel, lambda_abs, warmup, eps)
        self.feed, self.max_consecutive_clips = feed, check_max_consecutive_clips(max_consecutive_clips)
        self.state: dict[str, Tensor] = {}
        self._warned = 0

    def _init(self, n: int, device: torch.device) -> None:
        if not self.state:
            zero = torch.zeros((), dtype=torch.int64, device=device)
            self.state = {"gamma": torch.zeros(n, device=device), "count": zero, "streak": zero.clone(),
                          "releases": zero.clone()}
        elif self.state["gamma"].numel() != n:
            raise ValueError(f"AdaGC was started on {self.state['gamma'].numel()} tensors with gradients, "
                             f"now given {n}: use one AdaGC per fixed set of parameters.")

    @torch.no_grad()
    def clip_unscaled_(self, params: list[Tensor], norms: Tensor, norm: Tensor) -> Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        self._init(len(grads), norm.device)
        s, finite = self.state, torch.isfinite(norm)
        norms = norms.to(torch.float32)
        h, gamma, cut = adagc_update(s["gamma"], s["count"], norms, norm, beta=self.beta,
                                     lambda_rel=self.lambda_rel, lambda_abs=self.lambda_abs,
                                     warmup=self.warmup, eps=self.eps, feed=self.feed)
        h = torch.where(finite, h, torch.ones_like(h))
        for i, g in enumerate(grads):
            scale_grads_([g], h[i])
        streak, release = lockin_guard(s["streak"], finite & cut.any(), self.max_consecutive_clips)
        streak = torch.where(finite, streak, s["streak"])
        count = torch.where(release, torch.zeros_like(s["count"]), s["count"] + finite.long())
        self.state = {"gamma": torch.where(finite, gamma, s["gamma"]), "count": count, "streak": streak,
                      "releases": s["releases"] + release.long()}
        after = torch.linalg.vector_norm(h * norms)
        coef = torch.where(finite & (norm > 0), after / norm, torch.ones_like(norm))
        return torch.stack([coef, torch.full_like(coef, float("nan"))])

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and not {"gamma", "count", "streak", "releases"} <= state.keys():
            raise KeyError("AdaGC state_dict lacks gamma/count/streak/releases; "
                           "pass what AdaGC.state_dict() returned.")
        self.state = {k: v.detach().clone() for k, v in state.items()}
        self._seen = self.releases()

    def releases(self) -> int:
        return int(self.state["releases"].item()) if self.state else 0

    def __repr__(self) -> str:
        return (f"AdaGC(beta={self.beta:g}, lambda_rel={self.lambda_rel:g}, "
                f"warmup={self.warmup}, feed={self.feed!r})")
