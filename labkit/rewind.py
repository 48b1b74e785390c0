"""Rewind and skip (PaLM §5.1): on a spike, return to a snapshot from N steps back and skip a data window.

PaLM restarted "from a checkpoint roughly 100 steps before the spike started" and skipped
"roughly 200-500 data batches"; everywhere else (llm.c#637, axolotl#1310, OLMo-core#424)
this is still done by hand. ``Rewind`` does it inside the run: it keeps in-memory snapshots
(model, optimizer, scheduler, scaler, clipper, detector, RNG, step counter), and when a
record says "spike" it restores the newest snapshot at least ``back`` steps old and moves the
data forward by ``skip`` batches. The records of the undone steps stay in the log, marked
``rewound``; the step that triggered it carries ``rewind_to``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .distributed import all_reduce_, is_distributed
from .records import StepRecord

if TYPE_CHECKING:
    from .step import TrainStep

__all__ = ["Rewind", "Snapshot", "is_spike"]

SPIKE_REASONS = ("spike_loss", "spike_grad")


def is_spike(record: StepRecord) -> bool:
    """The default trigger: the step was skipped by the spike detector.

    >>> is_spike(StepRecord(0, 1.0, skipped=True, reason="spike_grad"))
    True
    """
    return record.reason in SPIKE_REASONS


@dataclass
class Snapshot:
    """Everything a rewind restores, taken when ``step`` steps had run."""

    step: int
    offset: int
    state: dict[str, Any]


class Rewind:
    """Rewind ``back`` steps and skip ``skip`` batches when ``trigger(record)`` says so.

    Snapshots are taken every ``every`` steps (default ``back``), in memory: two copies of
    the model and optimizer state at most. The training loop asks ``data_index(step)`` which
    batch to feed; after a rewind to step ``r`` it is ``r + skip`` (then onward), so the run
    continues exactly as a run that never saw batches ``r .. r + skip - 1``. Under
    ``torch.distributed`` the decision is all-reduced (MAX, one int per step): every rank
    rewinds together even if only one rank's record said so.

    >>> rewind = Rewind(back=10, skip=30); rewind.data_index(5)
    5
    """

    def __init__(self, back: int = 100, skip: int = 300, every: int | None = None,
                 trigger: Callable[[StepRecord], bool] = is_spike, max_rewinds: int = 10) -> None:
        for name, v in (("back", back), ("skip", skip), ("max_rewinds", max_rewinds)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "skip" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'skip' else 1}, got {v!r}.")
        every = back if every is None else every
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= back:
            raise ValueError(f"every must be an int in [1, back={back}], got {every!r}.")
        self.back, self.skip, self.every, self.trigger, self.max_rewinds = back, skip, every, trigger, max_rewinds
        self.offset = 0
        self.snapshots: list[Snapshot] = []
        self.rewinds: list[tuple[int, int]] = []  # (from step, to step)

    def data_index(self, step: int) -> int:
        """Return the index of the batch to feed at optimizer step ``step``."""
        return step + self.offset

    def snapshot(self, train: TrainStep) -> None:
        """Keep a copy of everything ``train`` would need to continue from its current step."""
        state = {
            "train": train.state_dict(),
            "model": train.model.state_dict(),
            "optimizer": train.optimizer.state_dict(),
            "scheduler": train.scheduler.state_dict() if train.scheduler is not None else None,
            "rng": torch.get_rng_state(),
        }
        self.snapshots.append(Snapshot(train.step_count, self.offset, copy.deepcopy(state)))
        # keep the newest snapshot that is at least ``back`` old, and everything after it
        old = [i for i, s in enumerate(self.snapshots) if train.step_count - s.step >= self.back]
        if old:
            del self.snapshots[: old[-1]]

    def after(self, train: TrainStep, record: StepRecord) -> None:
        """Called by ``TrainStep`` after each record (``step_count`` already advanced): rewind or snapshot."""
        want = bool(self.trigger(record)) and len(self.rewinds) < self.max_rewinds
        if is_distributed():
            flag = torch.tensor([int(want)], device=train.device)
            want = bool(all_reduce_(flag, "max", train.process_group).item())
        if want and self.snapshots:
            self.restore(train, record)
        elif train.step_count % self.every == 0:
            self.snapshot(train)

    def restore(self, train: TrainStep, record: StepRecord) -> None:
        """Return ``train`` to the newest snapshot at least ``back`` steps before ``record.step``."""
        fit = [s for s in self.snapshots if record.step - s.step >= self.back - 1]
        target = fit[-1] if fit else self.snapshots[0]
        state = copy.deepcopy(target.state)
        train.model.load_state_dict(state["model"])
        train.optimizer.load_state_dict(state["optimizer"])
        if train.scheduler is not None:
            train.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        # the log keeps the undone records (marked rewound): its summary totals are not rewound
        train.load_state_dict({k: v for k, v in state["train"].items() if k != "log"})
        self.offset = target.offset + self.skip
        self.snapshots = [s for s in self.snapshots if s.step <= target.step]
        self.rewinds.append((record.step, target.step))
        record.rewind_to = target.step
        for r in [*train.log, record]:
            if r.step >= target.step and not r.rewound:
                r.rewound = True

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "rewinds": list(self.rewinds), "snapshots": copy.deepcopy(self.snapshots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset, self.rewinds = int(state["offset"]), [tuple(x) for x in state["rewinds"]]
        self.snapshots = copy.deepcopy(state["snapshots"])

    def __repr__(self) -> str:
        return f"Rewind(back={self.back}, skip={self.skip}, every={self.every})"
