"""bf16 at the bit level: a value's neighbours and its ulp, the gaps rounding works in."""

from __future__ import annotations

import math

import torch
from torch import Tensor

BF16 = torch.bfloat16


def adjacent(w: Tensor, up: bool | Tensor) -> Tensor:
    """Return each entry's neighbour in its own dtype, toward +inf where ``up``, else toward -inf.

    >>> adjacent(torch.tensor([1.0, 1.0], dtype=BF16), torch.tensor([True, False])).tolist()
    [1.0078125, 0.99609375]
    """
    direction = torch.where(torch.as_tensor(up), math.inf, -math.inf).to(w.dtype)
    return torch.nextafter(w, direction.expand_as(w))


def ulp_of(t: Tensor) -> Tensor:
    """Return each entry's gap to its neighbour away from zero, in ``t``'s dtype, as float64."""
    return (adjacent(t, t >= 0).double() - t.double()).abs()
