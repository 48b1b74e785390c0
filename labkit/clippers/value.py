"""``ValueClip`` and ``clip_grad_value_``: clamp every gradient element to ``[-clip_value, clip_value]``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..clip import Parameters
from ..validate import check_number
from .base import Clipper, effective_coef, parameters_list

__all__ = ["ValueClip", "clip_grad_value_"]


def _check_value(clip_value: float) -> float:
    return check_number("clip_value", clip_value, 0, low_open=True)


@torch.no_grad()
def clip_grad_value_(parameters: Parameters, clip_value: float, foreach: bool | None = None) -> None:
    """Clamp the gradients in place to ``[-clip_value, clip_value]``; torch's ``clip_grad_value_``.

    The same contract as ``torch.nn.utils.clip_grad_value_``: returns None, NaN stays NaN,
    ``inf`` becomes ``clip_value``. Parameters may also be ``(name, parameter)`` pairs.

    >>> w = torch.zeros(3, requires_grad=True); w.grad = torch.tensor([-5.0, 0.5, 5.0])
    >>> clip_grad_value_([w], 1.0); w.grad
    tensor([-1.0000,  0.5000,  1.0000])
    """
    v = _check_value(clip_value)
    grads = [p.grad for p in parameters_list(parameters) if p.grad is not None]
    if not grads:
        return
    use_foreach = all(g.device.type in ("cpu", "cuda") for g in grads) if foreach is None else foreach
    if use_foreach:
        torch._foreach_clamp_min_(grads, -v)
        torch._foreach_clamp_max_(grads, v)
    else:
        for g in grads:
            g.clamp_(min=-v, max=v)


class ValueClip(Clipper):
    """Clamp each gradient element to ``[-clip_value, clip_value]`` (Keras ``clipvalue``).

    Unlike ``clip_grad_value_``, a step whose global norm is not finite is left untouched
    (a NaN gradient is not repaired by clamping, and an inf would be clamped into a finite
    but meaningless value; the step is skipped instead). No statistics.

    >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, -4.0])
    >>> ValueClip(1.0).clip_([w]), w.grad
    (tensor(5.), tensor([ 1., -1.]))
    """

    def __init__(self, clip_value: float) -> None:
        self.clip_value = _check_value(clip_value)

    @torch.no_grad()
    def clip_unscaled_(self, params: list[Tensor], norms: Tensor, norm: Tensor) -> Tensor:
        finite, v, post = torch.isfinite(norm), self.clip_value, []
        for p in params:
            if p.grad is not None:
                p.grad.copy_(torch.where(finite, p.grad.clamp(-v, v), p.grad))
                post.append(torch.linalg.vector_norm(p.grad.float()))
        return effective_coef(post, norm, finite)

    def __repr__(self) -> str:
        return f"ValueClip(clip_value={self.clip_value:g})"
