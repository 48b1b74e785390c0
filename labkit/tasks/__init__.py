"""The built-in tasks: deterministic data and a fresh model per run, no download.

A task is anything with ``name``, ``model(device)``, ``batch(step, device)`` and ``loss_fn``
(``Task``); ``ToyTask`` and ``GPTTask`` are interchangeable wherever one is taken.
``make_task(name, seed, device)`` builds a registered one at its default size for ``device``.

>>> make_task("gpt", seed=1).name, make_task("toy").name
('gpt', 'toy')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from .fixed import FixedBatch
from .gpt import GPTTask
from .text import TextCorpus
from .toy import ToyTask

__all__ = ["TASKS", "FixedBatch", "GPTTask", "Task", "TextCorpus", "ToyTask", "make_task"]


@runtime_checkable
class Task(Protocol):
    """What a training loop needs from a task."""

    name: str

    def model(self, device: str | torch.device = "cpu") -> nn.Module: ...

    def batch(self, step: int, device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]: ...

    @property
    def loss_fn(self) -> Callable[[Tensor, Tensor], Tensor]: ...


# name -> (seed, device) -> task at its default size for that device
TASKS: dict[str, Callable[[int, str | torch.device], Task]] = {
    "toy": lambda seed, device: ToyTask(seed=seed),
    "gpt": lambda seed, device: GPTTask.for_device(device, seed=seed),
}


def make_task(name: str, seed: int = 0, device: str | torch.device = "cpu") -> Task:
    """Return the registered task ``name`` with ``seed``, sized for ``device``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; the built-in tasks are {sorted(TASKS)}.")
    return TASKS[name](seed, device)
