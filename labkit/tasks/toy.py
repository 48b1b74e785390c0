"""A small deterministic task: no download, fast on two CPU cores, and spike-sensitive.

A teacher MLP maps standard-normal inputs to targets; the student is a 3-layer MLP trained
with MSE. Batches are a pure function of ``(seed, step)``, so two runs with the same seed
(clipped and unclipped, fp16 and fp32) see exactly the same data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from .perturb import perturb_

__all__ = ["ToyTask"]


@dataclass(frozen=True)
class ToyTask:
    """Regression onto a fixed random teacher: ``model()``, ``batch(step)``, ``loss_fn``.

    >>> task = ToyTask(seed=0)
    >>> x, y = task.batch(0); tuple(x.shape), tuple(y.shape)
    ((64, 16), (64, 1))
    >>> torch.equal(task.batch(3)[0], ToyTask(seed=0).batch(3)[0])
    True
    """

    name: ClassVar[str] = "toy"
    in_features: int = 16
    hidden: int = 64
    batch_size: int = 64
    seed: int = 0

    def _net(self) -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(self.in_features, self.hidden), nn.ReLU(),
            nn.Linear(self.hidden, self.hidden), nn.ReLU(),
            nn.Linear(self.hidden, 1),
        )

    def model(self, device: str | torch.device = "cpu") -> nn.Sequential:
        """Return a freshly initialised student; the same seed gives the same weights (``LABKIT_PERTURB``)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = self._net()
        return perturb_(net).to(device)

    @property
    def loss_fn(self) -> nn.MSELoss:
        return nn.MSELoss()

    @functools.cached_property
    def _teacher(self) -> nn.Sequential:
        # Built once per task: re-seeding and building it for every batch cost about as much as
        # the training step itself. (cached_property writes the instance dict, so the
        # dataclass stays frozen, and equal tasks still compare and hash by their fields.)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10_000 + self.seed)
            teacher = self._net()
        return teacher.requires_grad_(False)

    def batch(self, step: int, device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
        """Return ``(inputs, targets)`` for ``step``: the same step always gives the same batch."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(self.batch_size, self.in_features, generator=g)
        with torch.no_grad():
            y = self._teacher(x) * 3.0
        return x.to(device), y.to(device)
