"""``AGC``: adaptive gradient clipping, unit-wise, relative to the weight norm (NFNets)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..validate import check_number
from .base import Clipper, effective_coef

__all__ = ["AGC", "agc_", "unitwise_norm"]


def unitwise_norm(x: Tensor) -> Tensor:
    """Return the L2 norm of each unit: the whole tensor if it has <= 1 dim, else each row/filter (dim 0).

    >>> unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
    tensor([[5.],
            [1.]])
    """
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def agc_(weight: Tensor, grad: Tensor, clipping: float, eps: float) -> Tensor:
    """Return ``grad`` with each unit clipped to ``clipping * max(||W_i||, eps)``.

    ``G_i <- G_i * (clipping * max(||W_i||, eps) / max(||G_i||, 1e-6))`` when ``||G_i||`` is at
    least that bound, else unchanged (``timm/utils/agc.py``; optax ``adaptive_grad_clip``).

    >>> agc_(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), 0.01, 1e-3)
    tensor([0.0000, 0.0100])
    """
    bound = unitwise_norm(weight).clamp(min=eps) * clipping
    g_norm = unitwise_norm(grad)
    clipped = grad * (bound / g_norm.clamp(min=1e-6))
    return torch.where(g_norm < bound, grad, clipped)


class AGC(Clipper):
    """Clip each unit's gradient to ``clipping`` times its weight's norm (Brock et al., NFNets, ICML 2021).

    Rule: ``agc_``. Defaults as timm and optax: ``clipping=0.01, eps=1e-3``. The paper leaves
    the final classifier layer unclipped: pass only the parameters to clip. No statistics, so
    no feed policy; a non-finite global norm leaves every gradient untouched (no host sync:
    the choice is a ``torch.where``).

    >>> w = torch.nn.Parameter(torch.tensor([[1.0, 0.0]])); w.grad = torch.tensor([[0.0, 2.0]])
    >>> AGC(clipping=0.1).clip_([w]), w.grad
    (tensor(2.), tensor([[0.0000, 0.1000]]))
    """

    def __init__(self, clipping: float = 0.01, eps: float = 1e-3) -> None:
        self.clipping = check_number("clipping", clipping, 0, low_open=True,
                                     hint="(the largest gradient/weight norm ratio, e.g. 0.01)")
        self.eps = float(eps)

    @torch.no_grad()
    def clip_unscaled_(self, params: list[Tensor], norms: Tensor, norm: Tensor) -> Tensor:
        finite = torch.isfinite(norm)
        post = []
        for p in params:
            if p.grad is None:
                continue
            new = agc_(p.detach(), p.grad, self.clipping, self.eps)
            p.grad.copy_(torch.where(finite, new, p.grad))
            post.append(torch.linalg.vector_norm(p.grad.float()))
        return effective_coef(post, norm, finite)

    def __repr__(self) -> str:
        return f"AGC(clipping={self.clipping:g}, eps={self.eps:g})"
