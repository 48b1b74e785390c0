"""``UpdateNormClip``: clip the optimizer's update, not the gradient, against its own history (Levanter)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..clip import EPS, Parameters
from ..validate import check_int, check_number
from .autoclip import history_push
from .base import GlobalClipper, parameters_list

__all__ = ["UpdateNormClip"]


class UpdateNormClip(GlobalClipper):
    """Clip the norm of the update the optimizer applied to ``mean + k * std`` of past update norms.

    Rule (Levanter ``clip_update_by_historical_norm``, ``ClipUpdateNorm``): over the last
    ``window`` update norms, ``threshold = mean + k * std`` (population std), inactive until
    ``window // 2`` are in; defaults ``window=128, k=3.0``, ``feed="raw"`` (Levanter stores the
    unclipped norm "to prevent collapse"). Marin found update-norm spikes come *before*
    gradient and loss spikes (marin#1368). Use: ``begin_(params)`` before ``optimizer.step()``
    (it keeps a copy of the parameters: one model's worth of memory), ``clip_(params)`` after;
    ``clip_`` returns the pre-clip update norm. ``TrainStep(clipper=UpdateNormClip())`` does both.

    >>> w = torch.nn.Parameter(torch.zeros(1)); clip = UpdateNormClip(window=2)
    >>> for u in (1.0, 1.0, 9.0):
    ...     clip.begin_([w]); w.data += u; _ = clip.clip_([w])
    >>> round(w.item(), 4)  # 1 + 1 + the 9, cut to mean + 3 std of (1, 1) = 1
    3.0
    """

    def __init__(self, window: int = 128, k: float = 3.0, feed: str = "raw",
                 max_consecutive_clips: int | None = 50) -> None:
        self.window = check_int("window", window, 2)
        self.k = check_number("k", k, 0, low_open=True, hint="(standard deviations)")
        self._before: list[Tensor] | None = None
        super().__init__(feed, max_consecutive_clips)

    def initial(self) -> dict[str, Tensor]:
        return {"history": torch.full((self.window,), float("nan")),
                "count": torch.zeros((), dtype=torch.int64)}

    def threshold(self, state: dict[str, Tensor]) -> Tensor:
        h = state["history"]
        mean = torch.nanmean(h)
        std = torch.nanmean((h - mean) ** 2).sqrt()
        level = mean + self.k * std
        return torch.where(state["count"] >= self.window // 2, level, torch.full_like(level, float("inf")))

    def update(self, state: dict[str, Tensor], value: Tensor) -> dict[str, Tensor]:
        history, count = history_push(state["history"], state["count"], value)
        return {"history": history, "count": count}

    @torch.no_grad()
    def begin_(self, parameters: Parameters) -> None:
        """Remember the parameters before the optimizer step."""
        self._before = [p.detach().clone() for p in parameters_list(parameters)]

    @torch.no_grad()
    def clip_(self, parameters: Parameters) -> Tensor:
        """Clip the update applied since ``begin_`` in place; return its pre-clip global norm."""
        params = parameters_list(parameters)
        if self._before is None or len(self._before) != len(params):
            raise RuntimeError("call clip.begin_(params) before optimizer.step(), with the same parameters.")
        before, self._before = self._before, None
        deltas = [p.detach() - b for p, b in zip(params, before)]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d.float()) for d in deltas]))
        self._to(norm.device)
        threshold = self.threshold(self.state)
        finite = torch.isfinite(norm)
        coef = torch.where(finite, torch.clamp(threshold / (norm + EPS), max=1.0), torch.ones_like(norm))
        for p, d in zip(params, deltas):
            # p - (1 - coef) * delta: exactly p when coef is 1, so an unclipped step is bit-identical
            p.copy_(torch.where(finite, p - (1 - coef) * d, p))
        self.observe(norm, threshold)
        self._last = torch.stack([coef, threshold])
        return norm

    fused_ok = False  # it clips the update: the optimizer must step where it can see it

    def coef_(self, norms: Tensor, norm: Tensor) -> tuple[None, None]:
        return None, None  # the gradient is not clipped: its update is, after the step

    def clip_unscaled_(self, params: list[Tensor], norms: Tensor, norm: Tensor) -> Tensor | None:
        self.begin_(params)
        return None

    def after_step_(self, params: list[Tensor]) -> Tensor | None:
        self.clip_(params)
        return self._last

    def __repr__(self) -> str:
        return f"UpdateNormClip(window={self.window}, k={self.k:g}, feed={self.feed!r})"
