"""What one guarded step did (``StepRecord``) and the log of a run (``StepLog``)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, overload

from .distributed import rank

__all__ = ["StepLog", "StepRecord"]

REASONS = ("nonfinite_loss", "nonfinite_grad")


@dataclass
class StepRecord:
    """One training step, as ``TrainStep`` saw it; every number is a plain Python value.

    ``grad_norm`` is the unclipped norm of the unscaled gradients (NaN when backward was
    skipped); ``scale`` is the loss scale used for this step, ``next_scale`` the one after.

    >>> StepRecord(step=0, loss=0.5).post_clip_norm
    nan
    """

    step: int
    loss: float
    grad_norm: float = math.nan
    clip_coef: float = 1.0
    clipped: bool = False
    scale: float = 1.0
    next_scale: float = 1.0
    skipped: bool = False
    reason: str | None = None
    skip_streak: int = 0
    lr: float = math.nan
    fault: str | None = None
    top_grads: list[tuple[str, float]] = field(default_factory=list)
    first_nonfinite: str | None = None
    stale: dict[str, float] = field(default_factory=dict)  # per layer: updates below half an ulp (StaleMonitor)

    @property
    def post_clip_norm(self) -> float:
        """The norm the optimizer stepped with (NaN on a skipped step)."""
        return math.nan if self.skipped else self.grad_norm * self.clip_coef

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        d = dict(d)
        d["top_grads"] = [tuple(x) for x in d.get("top_grads") or []]
        return cls(**d)


FIELDS = [f.name for f in dataclasses.fields(StepRecord)]


def rank_path(path: str | os.PathLike) -> str | None:
    """Return where this rank writes ``path``: rank 0 writes it, other ranks write nothing (None).

    Every rank holds the same records, so N writers would only race on one file. A path
    with ``{rank}`` in it is written by every rank, to its own file.

    >>> rank_path("log.jsonl"), rank_path("log.{rank}.jsonl")
    ('log.jsonl', 'log.0.jsonl')
    """
    text, r = os.fspath(path), rank()
    if "{rank}" in text:
        return text.replace("{rank}", str(r))
    return text if r == 0 else None


class StepLog(Sequence[StepRecord]):
    """The records of a run, in order, with columns, summaries and JSONL/CSV export.

    With ``stream=path`` each record is also appended to a JSONL file and flushed as it
    arrives, so a crash loses nothing already recorded. Under ``torch.distributed`` files
    are written by rank 0 only, unless the path holds ``{rank}`` (see ``rank_path``).
    Each of ``sinks`` (anything with ``write(record)`` and ``close()``, e.g. a
    ``labkit.export.Telemetry``) is given every record as it is appended, and closed with the log.

    >>> log = StepLog([StepRecord(0, 1.0), StepRecord(1, math.nan, skipped=True, reason="nonfinite_loss")])
    >>> log.skipped_steps, log.column("loss")[0]
    ([1], 1.0)
    """

    def __init__(self, records: Sequence[StepRecord] = (), *, stream: str | os.PathLike | None = None,
                 sinks: Sequence[Any] = ()) -> None:
        self._records: list[StepRecord] = list(records)
        self.sinks: list[Any] = list(sinks)
        path = rank_path(stream) if stream is not None else None
        self._stream: IO[str] | None = open(path, "a", encoding="utf-8") if path is not None else None

    @overload
    def __getitem__(self, i: int) -> StepRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[StepRecord]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._records[i]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def __repr__(self) -> str:
        return f"StepLog({len(self)} records, skipped steps {self.skipped_steps})"

    def append(self, record: StepRecord) -> None:
        self._records.append(record)
        if self._stream is not None:
            self._stream.write(json.dumps(record.to_dict()) + "\n")
            self._stream.flush()
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Close the JSONL stream, if any, and the sinks."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        for sink in self.sinks:
            sink.close()

    def column(self, name: str) -> list[Any]:
        """Return one field of every record, e.g. ``log.column("scale")``."""
        if name not in FIELDS and name != "post_clip_norm":
            raise KeyError(f"no column {name!r}; StepRecord has {FIELDS + ['post_clip_norm']}")
        return [getattr(r, name) for r in self._records]

    @property
    def skipped_steps(self) -> list[int]:
        return [r.step for r in self._records if r.skipped]

    @property
    def clipped_steps(self) -> list[int]:
        return [r.step for r in self._records if r.clipped]

    def summary(self) -> dict[str, Any]:
        """Return counts a run report needs: steps, skips by reason, clip rate, scale range."""
        reasons = Counter(r.reason for r in self._records if r.skipped)
        stepped = [r for r in self._records if not r.skipped]
        scales = [r.scale for r in self._records] + [r.next_scale for r in self._records[-1:]]
        return {
            "steps": len(self),
            "skipped": sum(reasons.values()),
            "skips_by_reason": {reason: reasons.get(reason, 0) for reason in REASONS},
            "clipped": sum(r.clipped for r in stepped),
            "clip_rate": sum(r.clipped for r in stepped) / len(stepped) if stepped else 0.0,
            "min_scale": min(scales) if scales else math.nan,
            "max_scale": max(scales) if scales else math.nan,
            "final_scale": scales[-1] if scales else math.nan,
            "final_loss": stepped[-1].loss if stepped else math.nan,
        }

    def to_jsonl(self, path: str | os.PathLike) -> None:
        """Write one JSON object per record (non-finite floats as NaN/Infinity, as Python's json does)."""
        path = rank_path(path)
        if path is None:
            return
        with open(path, "w", encoding="utf-8") as f:
            for r in self._records:
                f.write(json.dumps(r.to_dict()) + "\n")

    @classmethod
    def read_jsonl(cls, path: str | os.PathLike) -> StepLog:
        """Read a log written by ``to_jsonl`` or streamed with ``stream=``."""
        with open(path, encoding="utf-8") as f:
            return cls([StepRecord.from_dict(json.loads(line)) for line in f if line.strip()])

    def to_csv(self, path: str | os.PathLike) -> None:
        """Write one row per record with every field; ``top_grads`` as ``name=norm;...``."""
        path = rank_path(path)
        if path is None:
            return
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            for r in self._records:
                row = r.to_dict()
                row["top_grads"] = ";".join(f"{name}={norm:.6g}" for name, norm in r.top_grads)
                row["stale"] = ";".join(f"{name}={frac:.6g}" for name, frac in r.stale.items())
                writer.writerow(row)
