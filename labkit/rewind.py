"""Rewind and skip (PaLM §5.1): on a spike, return to a snapshot from N steps back and skip a data window.

PaLM restarted "from a checkpoint roughly 100 steps before the spike started" and skipped
"roughly 200-500 data batches"; everywhere else (llm.c#637, axolotl#1310, OLMo-core#424)
this is still done by hand. ``Rewind`` does it inside the run: it keeps in-memory snapshots
(model, optimizer, scheduler, scaler, clipper, detector, RNG, step counter), and when a
record says "spike" it restores the newest snapshot at least ``back`` steps old and moves the
data past the batches that caused it. The records of the undone steps stay in the log as they
were written; the rewind is a ``RewindEvent`` logged after the record that triggered it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .alarms import LabkitWarning
from .distributed import all_reduce_, is_distributed, rank
from .hooks import Hook
from .reasons import SPIKES
from .records import RewindEvent, StepRecord
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
    """Everything a rewind restores, taken when ``step`` steps had run (``offset``: the data's, then)."""

    step: int
    offset: int
    state: dict[str, Any]


class Rewind(Hook):
    """Rewind ``back`` steps and skip ``skip`` batches when ``trigger(record)`` says so.

    Snapshots are taken every ``every`` steps (default ``back``), in memory: two copies of
    the model and optimizer state at most. The training loop asks ``data_index(step)`` which
    batch to feed. A rewind from step ``s`` to the snapshot of step ``r`` moves the data
    forward: step ``r`` is fed the batch ``skip`` past the one it was fed at the snapshot (PaLM's
    rule: the skip is counted from the restart), and never one before the batch after ``s``'s,
    since the batches from the snapshot to the spike caused it: a ``skip`` shorter than that
    window is lengthened to it. Repeated rewinds add up (each moves past the data the last one
    fed). ``skip=0`` is the one exception: the same batches again (a transient fault, not bad
    data). Every rewind is logged as a ``RewindEvent`` (the steps undone, the data window
    skipped); ``data_index`` and ``rewinds`` say the same.

    ``max_rewinds`` bounds them: a trigger after that many raises a ``LabkitWarning`` naming the
    steps (once) and the run goes on without rewinding. Under ``torch.distributed`` the decision
    is all-reduced (MAX, one int per step): every rank rewinds together even if only one rank's
    record said so.

    As a hook it snapshots when it joins a trainer (``attach``) and acts on each record
    (``on_record``), last of all hooks. ``train`` is the ``TrainStep``, or anything with its
    ``model``, ``optimizer``, ``scheduler``, ``step_count``, ``device``, ``process_group``,
    ``state_dict()`` and ``load_state_dict()``. Its snapshots hold the trainer's state: save
    ``rewind.state_dict()`` yourself (it is not in ``TrainStep.state_dict()``).

    >>> rewind = Rewind(back=10, skip=30); rewind.data_index(5)
    5
    """

    priority = -100
    per_step = True  # it restores a snapshot before the next step

    def __init__(self, back: int = 100, skip: int = 300, every: int | None = None,
                 trigger: Callable[[StepRecord], bool] = is_spike, max_rewinds: int = 10) -> None:
        check_int("back", back, 1)
        check_int("skip", skip, 0, hint="(batches skipped from the snapshot; 0: replay the same batches)")
        check_int("max_rewinds", max_rewinds, 1)
        every = check_int("every", back if every is None else every, 1, back, hint="(back)")
        if 0 < skip < back:
            warnings.warn(f"Rewind(back={back}, skip={skip}): a skip shorter than the steps undone would "
                          "feed the batches that caused the spike again, so each rewind skips at least past "
                          "the spike's batch (PaLM rewound ~100 steps and skipped 200-500 batches). Pass "
                          "skip >= back to skip a window of your own, or skip=0 to replay the same batches.",
                          LabkitWarning, stacklevel=2)
        self.back, self.skip, self.every = back, skip, every
        self.trigger, self.max_rewinds = trigger, max_rewinds
        self.offset = 0
        self.snapshots: list[Snapshot] = []
        self.rewinds: list[tuple[int, int]] = []  # (from step, to step)
        self._gave_up = False

    def data_index(self, step: int) -> int:
        """Return the index of the batch to feed at optimizer step ``step``."""
        return step + self.offset

    def attach(self, trainer: Any) -> None:
        self.snapshot(trainer)  # step 0: a spike in the first `back` steps rewinds to the start

    def on_record(self, trainer: Any, record: Any) -> RewindEvent | None:
        return self.after(trainer, record)

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

    def after(self, train: Any, record: StepRecord) -> RewindEvent | None:
        """Rewind or snapshot after each record (``step_count`` has advanced); return the rewind, if any."""
        want = bool(self.trigger(record))
        if is_distributed():
            flag = torch.tensor([int(want)], device=train.device)
            want = bool(all_reduce_(flag, "max", train.process_group).item())
        if want and len(self.rewinds) >= self.max_rewinds:
            if not self._gave_up and rank() == 0:
                done = ", ".join(f"{a}->{b}" for a, b in self.rewinds)
                warnings.warn(f"Rewind: step {record.step} asked for a rewind ({record.reason}), but "
                              f"max_rewinds={self.max_rewinds} were made (steps {done}); the run goes on "
                              "without rewinding. Look at the data around those steps, or raise "
                              "max_rewinds.", LabkitWarning,
                              stacklevel=5)
            self._gave_up, want = True, False
        if want and self.snapshots:
            return self.restore(train, record)
        if train.step_count % self.every == 0:
            self.snapshot(train)
        return None

    def restore(self, train: Any, record: StepRecord) -> RewindEvent:
        """Return ``train`` to the newest snapshot >= ``back`` steps before ``record.step``; move data on."""
        fit = [s for s in self.snapshots if record.step - s.step >= self.back - 1]
        target = fit[-1] if fit else self.snapshots[0]
        state = copy.deepcopy(target.state)
        train.model.load_state_dict(state["model"])
        train.optimizer.load_state_dict(state["optimizer"])
        if train.scheduler is not None:
            train.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        # the log keeps the undone records and the summary's totals: its state is not rewound
        train.load_state_dict({k: v for k, v in state["train"].items() if k != "log"})
        start = target.step + target.offset  # the batch the snapshot's step was first fed
        resume = start if self.skip == 0 else max(start + self.skip, self.data_index(record.step) + 1)
        self.offset = resume - target.step
        self.snapshots = [s for s in self.snapshots if s.step <= target.step]
        self.rewinds.append((record.step, target.step))
        return RewindEvent(record.step, target.step, record.reason, data_from=start, data_to=resume)

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "rewinds": list(self.rewinds),
                "snapshots": copy.deepcopy(self.snapshots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset, self.rewinds = int(state["offset"]), [tuple(x) for x in state["rewinds"]]
        self.snapshots = copy.deepcopy(state["snapshots"])

    def __repr__(self) -> str:
        return f"Rewind(back={self.back}, skip={self.skip}, every={self.every})"
