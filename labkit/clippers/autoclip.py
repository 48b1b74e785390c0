"""``AutoClip``: clip the global norm at a percentile of the norms seen so far."""

from __future__ import annotations

import torch
from torch import Tensor

from ..validate import check_int, check_number
from .base import GlobalClipper

__all__ = ["AutoClip", "history_push"]


def history_push(history: Tensor, count: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(history, count)`` with ``value`` written over the oldest slot of the ring buffer.

    Empty slots hold NaN, so ``torch.nanquantile`` and ``nanmean`` see only what was pushed.

    >>> history_push(torch.full((2,), float("nan")), torch.tensor(0), torch.tensor(3.0))
    (tensor([3., nan]), tensor(1))
    """
    slot = torch.arange(history.numel(), device=history.device) == count % history.numel()
    return torch.where(slot, value, history), count + 1


class AutoClip(GlobalClipper):
    """Clip the global norm at the ``quantile`` of past norms (Seetharaman et al., 2020, arXiv 2007.14469).

    Rule: ``threshold = quantile({g_{t-history} .. g_{t-1}}, q)`` (linear interpolation, as
    ``numpy.percentile``); ``g_t`` is clipped to it. The paper's rule is the percentile of the
    *whole* history including the current norm, ``{g_1 .. g_t}``, with the percentile p its knob
    (a low p clips most steps, by design); the ``pseeth/autoclip`` package keeps the last
    ``history_length=1000`` pre-clip norms (``feed="raw"``) with ``quantile=0.9``, the defaults
    here. Where labkit deliberately differs: the current norm is not in its own quantile (the
    threshold is a function of the past only, the same on every rank before the step, and a
    spike cannot raise the bar it is judged against), the history is a window, and a NaN/inf norm
    never enters it (in ``autoclip`` 0.2.1 one NaN makes every later step's gradients NaN until
    it leaves the history).

    >>> clip = AutoClip(quantile=0.5)
    >>> for g in (1.0, 2.0, 3.0, 10.0):
    ...     w = torch.zeros(1, requires_grad=True); w.grad = torch.tensor([g]); _ = clip.clip_([w])
    >>> w.grad  # clipped to the median of 1, 2, 3
    tensor([2.0000])
    """

    def __init__(
        self,
        quantile: float = 0.9,
        history: int = 1000,
        min_history: int = 1,
        feed: str = "raw",
        max_consecutive_clips: int | None = 50,
    ) -> None:
        check_number("quantile", quantile, 0, 1, hint="(0.9 = the 90th percentile)")
        check_int("history", history, 1)
        check_int("min_history", min_history, 1)
        if min_history > history:
            raise ValueError(f"min_history={min_history} cannot exceed history={history}.")
        self.quantile, self.history, self.min_history = float(quantile), history, min_history
        super().__init__(feed, max_consecutive_clips)

    def initial(self) -> dict[str, Tensor]:
        return {
            "history": torch.full((self.history,), float("nan")),
            "count": torch.zeros((), dtype=torch.int64),
        }

    def threshold(self, state: dict[str, Tensor]) -> Tensor:
        level = torch.nanquantile(state["history"], self.quantile)
        return torch.where(state["count"] >= self.min_history, level, torch.full_like(level, float("inf")))

    def update(self, state: dict[str, Tensor], value: Tensor) -> dict[str, Tensor]:
        history, count = history_push(state["history"], state["count"], value)
        return {"history": history, "count": count}

    def __repr__(self) -> str:
        return f"AutoClip(quantile={self.quantile:g}, history={self.history}, feed={self.feed!r})"
