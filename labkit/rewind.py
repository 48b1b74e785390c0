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
from typing import Any

import torch

from .distributed import all_reduce_, is_distributed
from .hooks import Hook
from .reasons import SPIKES
from .records import StepRecord
from .validate import check_int

__all__ = ["Rewind", "Snapshot", "is_spike"]


def is_spike(record: StepRecord) -> bool:
    """The default trigger: the step was skipped by the spike detector.

    >>> is_spike(StepRecord(0, 1.0, skipped=True, reason="spike_grad"))
    True
    """
    return record.reason in SPIKES


@dataclass
class Snapshot:
    """Everything a rewind restores, taken when ``step`` steps had run."""

    step: int
    offset: int
    state: dict[str, Any]


class Rewind(Hook):
    """Rewind ``back`` steps and skip ``skip`` batches when ``trigger(record)`` says so.

    Snapshots are taken every ``every`` steps (default ``back``), in memory: two copies of
    the model and optimizer state at most. The training loop asks ``data_index(step)`` which
    batch to feed; after a rewind to step ``r`` it is ``r + skip`` (then onward), so the run
    continues exactly as a run that never saw batches ``r .. r + skip - 1``. Under
    ``torch.distributed`` the decision is all-reduced (MAX, one int per step): every rank
    rewinds together even if only one rank's record said so.

    As a hook it snapshots when it joins a trainer (``attach``) and acts on each record
    (``on_record``), last of all hooks. ``train`` is the ``TrainStep``, or anything with its
    ``model``, ``optimizer``, ``scheduler``, ``step_count``, ``log``, ``device``,
    ``process_group``, ``state_dict()`` and ``load_state_dict()``. Its snapshots hold the
    trainer's state: save ``rewind.state_dict()`` yourself (it is not in ``TrainStep.state_dict()``).

    >>> rewind = Rewind(back=10, skip=30); rewind.data_index(5)
    5
    """

    priority = -100
    per_step = True  # it restores a snapshot before the next step

    def __init__(self, back: int = 100, skip: int = 300, every: int | None = None,
                 trigger: Callable[[StepRecord], bool] = is_spike, max_rewinds: int = 10) -> None:
        check_int("back", back, 1)
        check_int("skip", skip, 0)
        check_int("max_rewinds", max_rewinds, 1)
        every = check_int("every", back if every is None else every, 1, back, hint="(back)")
        self.back, self.skip, self.every, self.trigger, self.max_rewinds = back, skip, every, trigger, max_rewinds
        self.offset = 0
        self.snapshots: list[Snapshot] = []
        self.rewinds: list[tuple[int, int]] = []  # (from step, to step)

    def data_index(self, step: int) -> int:
        """Return the index of the batch to feed at optimizer step ``step``."""
        return step + self.offset

    def attach(self, trainer: Any) -> None:
        self.snapshot(trainer)  # step 0: a spike in the first `back` steps rewinds to the start

    def on_record(self, trainer: Any, record: Any) -> None:
        self.after(trainer, record)

    def snapshot(self, train: Any) -> None:
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

    def after(self, train: Any, record: StepRecord) -> None:
        """Rewind or snapshot after each record (``step_count`` already advanced)."""
        want = bool(self.trigger(record)) and len(self.rewinds) < self.max_rewinds
        if is_distributed():
            flag = torch.tensor([int(want)], device=train.device)
            want = bool(all_reduce_(flag, "max", train.process_group).item())
        if want and self.snapshots:
            self.restore(train, record)
        elif train.step_count % self.every == 0:
            self.snapshot(train)

    def restore(self, train: Any, record: StepRecord) -> None:
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
