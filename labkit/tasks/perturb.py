"""``LABKIT_PERTURB``: nudge a fresh model's weights by 2^-20 relative, to take another machine's path.

Other hardware gives other last bits (MKL or OpenBLAS, AVX2 or AVX-512, emulated or native
fp16, a GPU's TF32 and its summation orders), and a divergent or overflowing run amplifies
them. A lesson or a test that holds only on the bits of one machine is a defect; this switch
shows it on any machine: with ``LABKIT_PERTURB=<int>`` in the environment every built-in
task's ``model()`` multiplies its freshly initialised parameters by ``1 + 2**-20 * noise``
(standard-normal noise from a generator seeded by the value; the global RNG is not touched),
so a run takes a slightly different trajectory, as it would elsewhere. Every model of a run
gets the same nudge, so two arms on the same seed still start from the same weights. Unset
(the default), nothing changes.

>>> import os, torch
>>> saved = os.environ.get("LABKIT_PERTURB"); os.environ["LABKIT_PERTURB"] = "1"
>>> w = torch.nn.Linear(4, 4); before = w.weight.detach().clone(); _ = perturb_(w)
>>> bool((w.weight != before).any()), bool(((w.weight - before).abs() <= before.abs() * 2.0**-16).all())
(True, True)
>>> _ = os.environ.pop("LABKIT_PERTURB") if saved is None else os.environ.update(LABKIT_PERTURB=saved)
"""

from __future__ import annotations

import os
from typing import TypeVar

import torch
from torch import nn

__all__ = ["PERTURB_ENV", "perturb_", "perturb_seed"]

PERTURB_ENV = "LABKIT_PERTURB"
RELATIVE = 2.0**-20  # ~8 float32 ulps: far below anything a lesson measures, far above the kernels' noise

M = TypeVar("M", bound=nn.Module)


def perturb_seed() -> int | None:
    """Return the seed in ``LABKIT_PERTURB``, None when it is unset or empty; raise on anything else."""
    value = os.environ.get(PERTURB_ENV, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{PERTURB_ENV} must be an integer seed (e.g. {PERTURB_ENV}=1), or unset; got "
                         f"{value!r}.") from None


@torch.no_grad()
def perturb_(model: M, seed: int | None = None) -> M:
    """Multiply ``model``'s parameters by ``1 + 2**-20 * noise`` in place when perturbing; return it.

    ``seed``: the generator's seed; by default ``LABKIT_PERTURB``'s (unset: nothing changes).
    The noise is drawn on the CPU in float32, parameter by parameter in ``named_parameters``
    order, so it is the same on every device.
    """
    seed = perturb_seed() if seed is None else seed
    if seed is None:
        return model
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        p.mul_((1.0 + RELATIVE * noise).to(device=p.device, dtype=p.dtype))
    return model
