"""``ZClip``: clip the global norm when its z-score against an EMA of past norms is too high."""

from __future__ import annotations

import torch
from torch import Tensor

from ..validate import check_int, check_number
from .base import GlobalClipper

__all__ = ["ZClip", "zclip_limit", "zclip_update"]


def zclip_limit(mean: Tensor, var: Tensor, norm: Tensor, z_thresh: float, eps: float, mode: str) -> Tensor:
    """Return the norm to clip to: ``inf`` (no clip) unless ``z = (norm - mean) / (std + eps) > z_thresh``.

    ``adaptive_scaling`` (ZClip's default) clips to ``mean + (z_thresh**2 / z) * std``, so a
    larger outlier is pulled further down; ``mean`` clips to ``mean``.

    >>> zclip_limit(torch.tensor(1.0), torch.tensor(0.01), torch.tensor(2.0), 2.5, 1e-6, "adaptive_scaling")
    tensor(1.0625)
    """
    std = var.sqrt()
    z = (norm - mean) / (std + eps)
    target = mean + (z_thresh**2 / z) * std if mode == "adaptive_scaling" else mean
    return torch.where(z > z_thresh, target, torch.full_like(target, float("inf")))


def zclip_update(
    state: dict[str, Tensor], value: Tensor, alpha: float, warmup: int
) -> dict[str, Tensor]:
    """Return the state after admitting one norm ``value``.

    Warm-up: the first ``warmup`` values fill ``buffer``; when it is full ``mean`` and ``var``
    are its mean and (population) variance. After: ``mean' = alpha*mean + (1-alpha)*value``,
    ``var' = alpha*var + (1-alpha)*(value - mean')**2`` (ZClip's ``_update_ema``).

    >>> s = {"mean": torch.tensor(1.0), "var": torch.tensor(0.0), "buffer": torch.zeros(1),
    ...      "count": torch.tensor(1)}
    >>> zclip_update(s, torch.tensor(2.0), 0.5, 1)["mean"]
    tensor(1.5000)
    """
    mean, var, buf, count = state["mean"], state["var"], state["buffer"], state["count"]
    warming = count < warmup
    slot = torch.arange(buf.numel(), device=buf.device) == count
    buf = torch.where(slot & warming, value, buf)
    done = count + 1 == warmup
    ema_mean = alpha * mean + (1 - alpha) * value
    ema_var = alpha * var + (1 - alpha) * (value - ema_mean) ** 2
    buf_mean = buf.mean()
    buf_var = ((buf - buf_mean) ** 2).mean()
    new_mean = torch.where(warming, torch.where(done, buf_mean, mean), ema_mean)
    new_var = torch.where(warming, torch.where(done, buf_var, var), ema_var)
    return {"mean": new_mean, "var": new_var, "buffer": buf, "count": count + 1}


class ZClip(GlobalClipper):
    """Clip the global norm at a z-score against an EMA of past norms (Kumar et al., 2025, arXiv 2504.02507).

    Rule (``zclip_limit``, ``zclip_update``): ``z = (g - mu) / (sigma + eps)``; if ``z > z_thresh``
    clip ``g`` to ``mu + (z_thresh**2 / z) * sigma``; then ``mu, sigma**2`` move by an EMA with
    ``alpha``. The first ``warmup`` norms only fill a buffer. Defaults as ``bluorion-com/ZClip``
    (``zclip/zclip.py``, PyPI ``zclip`` 1.0.0): ``alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6``,
    ``feed="clipped"``. Where labkit deliberately differs from ZClip 1.0.0: a NaN/inf norm never
    enters the EMA (one NaN turns the published one off for good), the state is on the device
    with no ``.item()`` per step, ``state_dict`` includes the warm-up buffer, and there is no
    always-on fixed clip: the reference's ``max_grad_norm`` defaults to 1.0 in its code (its
    README says None) and clips to the smaller of it and the adaptive limit, so with its defaults
    every norm above 1 is cut whatever the z-score. Here ZClip is the adaptive rule alone; put a
    fixed cap in your loop if you want both. ``feed`` and ``max_consecutive_clips``: see
    ``GlobalClipper``.

    >>> clip = ZClip(warmup=2)
    >>> for g in (1.0, 1.2, 1.1, 50.0):
    ...     w = torch.zeros(1, requires_grad=True); w.grad = torch.tensor([g]); _ = clip.clip_([w])
    >>> round(w.grad.item(), 3)  # the 50x spike, pulled down near the mean
    1.101
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        warmup: int = 25,
        eps: float = 1e-6,
        mode: str = "adaptive_scaling",
        feed: str = "clipped",
        max_consecutive_clips: int | None = 50,
    ) -> None:
        check_number("alpha", alpha, 0, 1, low_open=True, high_open=True, hint="e.g. 0.97")
        check_number("z_thresh", z_thresh, 0, low_open=True, hint="e.g. 2.5")
        check_int("warmup", warmup, 1)
        if mode not in ("adaptive_scaling", "mean"):
            raise ValueError(f"mode must be 'adaptive_scaling' or 'mean', got {mode!r}.")
        self.alpha, self.z_thresh, self.warmup = float(alpha), float(z_thresh), warmup
        self.eps, self.mode = eps, mode
        super().__init__(feed, max_consecutive_clips)

    def initial(self) -> dict[str, Tensor]:
        zero = torch.zeros((), dtype=torch.float32)
        return {"mean": zero, "var": zero.clone(), "buffer": torch.zeros(self.warmup),
                "count": torch.zeros((), dtype=torch.int64)}

    def threshold(self, state: dict[str, Tensor]) -> Tensor:
        level = state["mean"] + self.z_thresh * (state["var"].sqrt() + self.eps)
        return torch.where(state["count"] >= self.warmup, level, torch.full_like(level, float("inf")))

    def limit(self, state: dict[str, Tensor], norm: Tensor) -> Tensor:
        target = zclip_limit(state["mean"], state["var"], norm, self.z_thresh, self.eps, self.mode)
        return torch.where(state["count"] >= self.warmup, target, torch.full_like(target, float("inf")))

    def update(self, state: dict[str, Tensor], value: Tensor) -> dict[str, Tensor]:
        return zclip_update(state, value, self.alpha, self.warmup)

    def __repr__(self) -> str:
        return (f"ZClip(alpha={self.alpha:g}, z_thresh={self.z_thresh:g}, warmup={self.warmup}, "
                f"feed={self.feed!r})")
