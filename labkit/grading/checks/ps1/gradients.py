"""The gradients set 1's first three parts are checked on: visible cases and a hidden battery from a seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)


@dataclass
class GradCase:
    """One input a check feeds the student's function, named for the failure message."""

    name: str
    grads: list[Tensor | None]
    max_norm: float = 1.0
    loss: float = 0.5
    loss_dtype: torch.dtype = torch.float32

    def params(self) -> list[Tensor]:
        """Return fresh leaf parameters carrying copies of the case's gradients."""
        params = []
        for g in self.grads:
            shape, dtype = (3,), torch.float32
            if g is not None:
                shape, dtype = g.shape, g.dtype
            p = torch.zeros(shape, dtype=dtype, requires_grad=True)
            p.grad = None if g is None else g.clone()
            params.append(p)
        return params


def none_hint(case: GradCase) -> str:
    """Say how to handle missing gradients, if the case has any."""
    if case.grads and all(g is None for g in case.grads):
        return " With no gradients at all the norm is 0: return torch.tensor(0.0) (torch.stack([]) fails)."
    if None in case.grads:
        return " Some parameters have no .grad (None: frozen or unused): skip them."
    return ""


def scaled_randn(gen: torch.Generator, shape: tuple[int, ...], scale: float,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


SHAPES = [(), (7,), (3, 4), (2, 3, 5), (64, 33), (1,)]


def random_grads(gen: torch.Generator, rnd: random.Random, n: int,
                 dtype: torch.dtype = torch.float32) -> list[Tensor | None]:
    return [scaled_randn(gen, rnd.choice(SHAPES), rnd.uniform(0.1, 10.0), dtype) for _ in range(n)]


def poisoned(grads: list[Tensor | None], rnd: random.Random, value: float) -> list[Tensor | None]:
    grads = [None if g is None else g.clone() for g in grads]
    i = rnd.choice([k for k, g in enumerate(grads) if g is not None and g.numel() > 0])
    grads[i].view(-1)[rnd.randrange(grads[i].numel())] = value
    return grads


def gradient_cases(hidden: bool, seed: int, kinds: tuple[str, ...]) -> list[GradCase]:
    """Return the visible cases, or the hidden battery built from ``seed``."""
    if not hidden:
        return [
            GradCase("grads [3, 4] and [12]", [torch.tensor([3.0, 4.0]), torch.tensor([12.0])], max_norm=1.0),
            GradCase("one parameter has no .grad", [torch.tensor([3.0, 4.0]), None, torch.tensor([[12.0]])],
                     max_norm=20.0),
        ]
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    mixed = random_grads(gen, rnd, rnd.randint(3, 6))
    with_none = random_grads(gen, rnd, 4)
    with_none[rnd.randrange(4)] = None
    with_none.insert(rnd.randrange(5), None)
    # built in this order whichever kinds are asked for: the hidden battery of a seed never changes
    grads = {
        "mixed shapes, fp32": mixed,
        "some .grad are None": with_none,
        "no gradients at all": [None, None],
        # per-tensor norms ~40000 each: fine in fp16, but their squares (and the total) are not
        "large fp16 gradients": [scaled_randn(gen, (256,), 2500.0, torch.float16) for _ in range(8)],
        "fp16 gradients": random_grads(gen, rnd, 4, torch.float16),
        "bf16 gradients": [scaled_randn(gen, (rnd.randint(200, 600),), 1.0, torch.bfloat16)
                           for _ in range(3)],
        "a NaN gradient": poisoned(random_grads(gen, rnd, 4), rnd, math.nan),
        "an inf gradient": poisoned(random_grads(gen, rnd, 4), rnd, rnd.choice([math.inf, -math.inf])),
    }
    return [GradCase(k, grads[k]) for k in kinds]
