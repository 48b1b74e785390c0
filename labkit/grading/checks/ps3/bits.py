"""bf16 at the bit level: a value's neighbours and its ulp, the gaps rounding works in.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BF16 = torch.bfloat16


def adjacent(w: Tensor, up: bool | Tensor) -> Tensor:
    direction = torch.where(torch.as_tensor(up), math.inf, -math.inf).to(w.dtype)
    return torch.nextafter(w, direction.expand_as(w))


def ulp_of(t: Tensor) -> Tensor:
    """The gap from each entry of ``t`` to its neighbour away from zero, in ``t``'s dtype, as float64."""
    return (adjacent(t, t >= 0).double() - t.double()).abs()
