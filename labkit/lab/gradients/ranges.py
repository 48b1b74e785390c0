"""What fp16 and bf16 keep of a gradient: their ranges, and what a cast to fp16 flushes to 0 or to inf.

``FP16_RANGE`` and ``BF16_RANGE`` are each format's (smallest subnormal, smallest normal,
largest finite) in log2|x|; ``u_curve`` and ``flush_fractions`` give the share of gradient
entries that a cast to fp16 after ``* 2**log2_scale`` rounds to 0 and to inf (Micikevicius et
al. 2018, "Mixed Precision Training", §3.2 and Fig. 3: the loss scale slides the gradients into
fp16's range).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["BF16_RANGE", "FP16_RANGE", "flush_fractions", "u_curve"]

_F16, _BF16 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16)
# log2 of |x|: (smallest subnormal, smallest normal, largest finite)
FP16_RANGE = (math.log2(_F16.smallest_normal) - 10, math.log2(_F16.smallest_normal),
              math.log2(_F16.max))  # -24, -14, 15.9998
BF16_RANGE = (math.log2(_BF16.smallest_normal) - 7, math.log2(_BF16.smallest_normal),
              math.log2(_BF16.max))  # -133, -126, 127.99
# Round to nearest even: |x| <= 2**-25 (half the smallest subnormal) becomes 0, |x| >= 65520 becomes inf.
_FLUSH, _OVERFLOW = 2.0**-25, 65520.0


def flush_fractions(values: Tensor, log2_scale: float) -> tuple[float, float]:
    """Return the fractions of nonzero ``values`` that fp16 flushes to 0 and to inf after ``* 2**log2_scale``.

    Exactly what a cast does (the thresholds are round-to-nearest-even's); zeros are left out,
    since they are zero at any scale.

    >>> g = torch.tensor([1e-9, 1e-3, 1.0, 0.0])
    >>> flush_fractions(g, 0), flush_fractions(g, 20)
    ((0.3333333333333333, 0.0), (0.0, 0.3333333333333333))
    """
    under, over = u_curve(values, [log2_scale])
    return under[0], over[0]


def u_curve(values: Tensor, log2_scales: Sequence[float]) -> tuple[list[float], list[float]]:
    """Return the flushed and the overflowing fraction of ``values`` at each log2 scale: the U's two arms.

    One sort, then two binary searches per scale: a slider or a 50-point curve over 10**5
    gradients costs milliseconds.

    >>> under, over = u_curve(torch.tensor([2.0**-30, 1.0]), [0, 10, 20])
    >>> under, over
    ([0.5, 0.0, 0.0], [0.0, 0.0, 0.5])
    """
    a = values.detach().abs().double().flatten()
    a = a[a > 0].sort().values
    n = a.numel()
    if n == 0:
        return [0.0] * len(log2_scales), [0.0] * len(log2_scales)
    s = torch.tensor([2.0**k for k in log2_scales], dtype=torch.float64)
    # |g| * s <= FLUSH  <=>  |g| <= FLUSH / s (exact: s is a power of two), likewise for overflow
    flushed = torch.searchsorted(a, _FLUSH / s, right=True)
    kept = torch.searchsorted(a, _OVERFLOW / s, right=False)
    return (flushed.double() / n).tolist(), ((n - kept).double() / n).tolist()

