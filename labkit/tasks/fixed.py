"""``FixedBatch``: a task trained on one of its batches at every step (a memorisation task).

With the data fixed, nothing but the optimizer changes from one step to the next: a loss that
jumps after it reached its floor was made by the optimizer (lesson 08's regime for AdamW's
second-moment spikes, Wortsman et al. 2023b's mechanism on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..validate import check_int

__all__ = ["FixedBatch"]


@dataclass(frozen=True)
class FixedBatch:
    """Return ``task``'s batch ``index`` at every step; the model, loss and measurements are ``task``'s.

    >>> from labkit.tasks import GPTTask
    >>> task = FixedBatch(GPTTask(seed=1))
    >>> torch.equal(task.batch(7)[0], GPTTask(seed=1).batch(0)[0]), task.name
    (True, 'gpt')
    """

    task: Any
    index: int = 0

    def __post_init__(self) -> None:
        for need in ("model", "batch", "loss_fn", "name"):
            if not hasattr(self.task, need):
                raise TypeError(f"task must have name, model(device), batch(step, device) and loss_fn "
                                f"(a labkit task such as GPTTask(seed=0)); {type(self.task).__name__} has "
                                f"no {need}.")
        check_int("index", self.index, 0, hint="(the step whose batch is trained on every step)")

    @property
    def name(self) -> str:
        return self.task.name

    def model(self, device: str | torch.device = "cpu") -> nn.Module:
        return self.task.model(device)

    def batch(self, step: int, device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
        return self.task.batch(self.index, device)

    @property
    def loss_fn(self) -> Callable[[Tensor, Tensor], Tensor]:
        return self.task.loss_fn

    def monitor(self, model: nn.Module) -> Any:
        """The task's own measurement hook, if it has one (``GPTTask``'s logit measures)."""
        monitor = getattr(self.task, "monitor", None)
        return monitor(model) if callable(monitor) else None
