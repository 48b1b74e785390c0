"""``NormClip``: today's fixed ``max_norm``, as a member of the clipping family."""

from __future__ import annotations

from torch import Tensor

from ..clip import check_max_norm, check_norm_type, clip_coef
from .base import Clipper

__all__ = ["NormClip"]


class NormClip(Clipper):
    """Clip the global L2 norm of the gradients to a fixed ``max_norm`` (Pascanu et al., 2013).

    Rule: ``g <- g * min(1, max_norm / (||g||_p + 1e-6))``, torch's ``clip_grad_norm_`` (its
    ``norm_type`` is ``p``: 2.0, 1.0, ``inf``...; the step's norm and inf check ride on it, so
    it must be > 0). No statistics, so no feed policy and no lock-in guard
    (``RepeatedClippingWarning`` in ``TrainStep`` watches a fixed threshold instead).
    ``TrainStep(max_norm=1.0)`` means ``TrainStep(clipper=NormClip(1.0))``; another norm is
    ``TrainStep(clipper=NormClip(1.0, norm_type=math.inf))``.

    >>> import torch
    >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
    >>> NormClip(1.0).clip_([w]), w.grad
    (tensor(5.), tensor([0.6000, 0.8000]))
    """

    on_host = True  # no statistics: the coefficient is a function of the norm alone
    fused_ok = True  # a global coefficient and nothing else

    def __init__(self, max_norm: float = 1.0, norm_type: float | str = 2.0) -> None:
        self.max_norm = check_max_norm(max_norm)
        self.norm_type = check_norm_type(norm_type)
        if not self.norm_type > 0:  # the inf check rides on the norms: a p > 0 norm is inf/NaN on inf/NaN
            raise ValueError(f"NormClip needs norm_type p > 0 (2.0, 1.0 or float('inf')), got {norm_type!r}.")

    @property
    def fixed_threshold(self) -> float:  # type: ignore[override]
        return self.max_norm

    def coef_(self, norms: Tensor, norm: Tensor) -> tuple[Tensor, float]:
        # with the Python float and in the norm's own dtype, as torch's clip_grad_norm_: float64
        # gradients clip bit for bit as torch's do; nothing to observe
        return clip_coef(norm, self.max_norm), self.max_norm

    def __repr__(self) -> str:
        p = "" if self.norm_type == 2.0 else f", norm_type={self.norm_type:g}"
        return f"NormClip(max_norm={self.max_norm:g}{p})"
