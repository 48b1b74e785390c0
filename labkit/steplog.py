"""The log of a run (``StepLog``): its records and events in order, a running summary, sinks, export."""

from __future__ import annotations

import csv
import math
import os
import warnings
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import Any, overload

from .alarms import LabkitWarning
from .logfile import JsonlFile, rank_path
from .reasons import COUNTED
from .records import CORE, RewindEvent, StepRecord, declared, read_line
from .spikes import spike_score
from .validate import check_int

__all__ = ["StepLog"]


class _Totals:
    """What ``StepLog.summary`` reports, kept as running totals: exact with a window, resumable."""

    def __init__(self) -> None:
        self.steps = self.stepped = self.clipped = 0
        self.reasons: Counter[str] = Counter()
        self.min_scale = self.max_scale = self.next_scale = self.final_loss = math.nan

    def add(self, r: StepRecord) -> None:
        self.steps += 1
        if r.skipped:
            self.reasons[r.reason or "?"] += 1
        else:
            self.stepped += 1
            self.clipped += bool(r.clipped)
            self.final_loss = r.loss
        self.min_scale = r.scale if not self.min_scale <= r.scale else self.min_scale  # NaN start: take it
        self.max_scale = r.scale if not self.max_scale >= r.scale else self.max_scale
        self.next_scale = r.next_scale

    def summary(self) -> dict[str, Any]:
        scales = [s for s in (self.min_scale, self.max_scale, self.next_scale) if not math.isnan(s)]
        return {
            "steps": self.steps,
            "skipped": sum(self.reasons.values()),
            "skips_by_reason": {**{reason.value: 0 for reason in COUNTED}, **self.reasons},
            "clipped": self.clipped,
            "clip_rate": self.clipped / self.stepped if self.stepped else 0.0,
            "min_scale": min(scales) if scales else math.nan,
            "max_scale": max(scales) if scales else math.nan,
            "final_scale": self.next_scale,
            "final_loss": self.final_loss,
        }

    def state_dict(self) -> dict[str, Any]:
        return {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}

    @classmethod
    def from_state(cls, state: Any) -> _Totals:
        """Return the totals in ``state`` (from ``state_dict``), or raise saying what is wrong."""
        totals = cls()
        if not isinstance(state, dict) or state.keys() != vars(totals).keys():
            raise KeyError(f"a StepLog state must be a dict with {sorted(vars(totals))}; pass "
                           "StepLog.state_dict().")
        counts = [state[k] for k in ("steps", "stepped", "clipped")] + list(dict(state["reasons"]).values())
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) or (
            state["stepped"] + sum(state["reasons"].values()) != state["steps"]
            or state["clipped"] > state["stepped"]
        ):
            raise ValueError(f"a StepLog state's counts must be ints >= 0 that add up (stepped + skipped = "
                             f"steps), got {state}.")
        for k, v in state.items():
            counted = k in ("steps", "stepped", "clipped")
            setattr(totals, k, Counter(v) if k == "reasons" else v if counted else float(v))
        return totals


class StepLog(Sequence[StepRecord]):
    """The records of a run, in order, with the events between them, columns, summaries and JSONL/CSV export.

    A record, once appended, is never changed: what happens to it later is an event appended
    after it. A ``RewindEvent`` undoes the records before it from its step ``to`` on; ``rewound``
    (one flag per record held) and the summary are derived from the events, so a log read back
    from its file says what the live one said.

    With ``stream=path`` each record and event is also appended to a JSONL file as it arrives
    (``labkit.logfile.JsonlFile``: crash-safe, one log per run: a file another run wrote is
    moved aside, and only ``load_state_dict`` of this run's checkpoint continues it, cutting the
    records written after it). ``path`` may also be a stream: a pipe or FIFO (with its reader
    already started), a terminal, ``/dev/null``, or ``/dev/stdout`` and ``/dev/stderr``. Under
    ``torch.distributed`` files are written by rank 0 only, unless the path holds ``{rank}``
    (see ``labkit.logfile.rank_path``). Each of ``sinks`` (anything with ``write(record)`` and
    ``close()``, e.g. a ``labkit.export.Telemetry``) is given every record as it is appended, and
    closed with the log.

    Memory: every record is kept (0.4-0.8 KB per step, the more when it carries ``top_grads``: up
    to 0.8 GB per million steps; measured with tracemalloc, Python 3.11). For long runs pass
    ``window=N``: only the last N records are kept (indexing, ``column`` and ``skipped_steps``
    see those), while ``summary()`` still counts every step. ``state_dict`` carries the summary
    across a resume (``TrainStep.state_dict`` includes it).

    >>> log = StepLog([StepRecord(0, 1.0), StepRecord(1, math.nan, skipped=True, reason="nonfinite_loss")])
    >>> log.skipped_steps, log.column("loss")[0]
    ([1], 1.0)
    >>> log.append_event(RewindEvent(step=1, to=1)); log.rewound, log.summary()["rewinds"]
    ([False, True], 1)
    >>> tail = StepLog(log, window=1)
    >>> len(tail), tail.summary()["steps"]
    (1, 2)
    """

    def __init__(
        self, records: Sequence[StepRecord] = (), *, stream: str | os.PathLike | None = None,
        sinks: Sequence[Any] = (), window: int | None = None, events: Sequence[tuple[int, RewindEvent]] = (),
    ) -> None:
        check_int("window", window, 1, none="keep every record")
        if stream is not None and not isinstance(stream, (str, os.PathLike)):
            raise TypeError(f"log_path/stream must be a str or os.PathLike file path, got "
                            f"{type(stream).__name__}.")
        self.sinks: list[Any] = list(sinks)
        path = rank_path(stream) if stream is not None else None
        self.file = JsonlFile(path) if path is not None else None
        self._records: list[StepRecord] | deque[StepRecord] = deque(maxlen=window) if window else []
        self._count = 0  # records ever appended: an event's place
        self._totals = _Totals()
        # every event, with the number of records appended before it
        self.events: list[tuple[int, RewindEvent]] = list(getattr(records, "events", events))
        self.torn_tail: str | None = None  # set by read_jsonl: the incomplete last line, if any
        for r in records:  # kept, not streamed: they come from a file or another log
            self._records.append(r)
            self._totals.add(r)
            self._count += 1

    @overload
    def __getitem__(self, i: int) -> StepRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[StepRecord]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return list(self._records)[i] if isinstance(i, slice) else self._records[i]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def __repr__(self) -> str:
        return f"StepLog({len(self)} records, skipped steps {self.skipped_steps})"

    def append(self, record: StepRecord, events: Sequence[RewindEvent] = ()) -> None:
        """Keep ``record``, then the ``events`` it triggered (a rewind), and stream them.

        If the file cannot be written, ``LogWriteError`` is raised.

        The record is kept in memory either way, and every unwritten line is retried, in
        order, at the next ``append`` or ``flush``: free space and carry on, nothing is lost.
        """
        self._records.append(record)
        self._totals.add(record)
        self._count += 1
        for sink in self.sinks:
            sink.write(record)
        if self.file is not None:
            self.file.write(record)
        for event in events:
            self.append_event(event)

    def append_event(self, event: RewindEvent) -> None:
        """Keep ``event`` after the records appended so far (and stream it)."""
        if not isinstance(event, RewindEvent):
            raise TypeError(f"a StepLog event is a labkit.records.RewindEvent, got {type(event).__name__}.")
        self.events.append((self._count, event))
        if self.file is not None:
            self.file.write(event)

    def flush(self) -> None:
        """Write the lines a failed write left behind; raise ``LogWriteError`` if it fails again."""
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        """Write what is pending and close the JSONL stream, if any, and the sinks."""
        if self.file is not None:
            self.file.close()
        for sink in self.sinks:
            sink.close()

    @property
    def rewinds(self) -> list[RewindEvent]:
        """The rewinds, in order."""
        return [e for _, e in self.events]

    def events_after(self) -> dict[int, list[RewindEvent]]:
        """Return ``{i: events}``, the events logged right after ``self[i]`` (which triggered them)."""
        first, out = self._count - len(self._records), {}
        for at, e in self.events:
            if at - 1 - first >= 0:
                out.setdefault(at - 1 - first, []).append(e)
        return out

    @property
    def rewound(self) -> list[bool]:
        """Per record held: whether a rewind after it undid it (its step is the rewind's ``to`` or later)."""
        first = self._count - len(self._records)  # the index of the first record held
        return [any(at > first + i and r.step >= e.to for at, e in self.events)
                for i, r in enumerate(self._records)]

    @property
    def rewound_steps(self) -> list[int]:
        """The steps of the records undone by a rewind, in log order (a step undone twice appears twice)."""
        return [r.step for r, gone in zip(self._records, self.rewound) if gone]

    def kept(self) -> list[StepRecord]:
        """The records no rewind undid: the run's own history, one record per step."""
        return [r for r, gone in zip(self._records, self.rewound) if not gone]

    def column(self, name: str) -> list[Any]:
        """Return one field of every record, e.g. ``log.column("scale")`` (None where a record lacks it)."""
        known = {*CORE, "post_clip_norm", *declared(), *(k for r in self._records for k in r.fields)}
        if name not in known:
            raise KeyError(f"no column {name!r}; the records have {sorted(known)}")
        return [getattr(r, name) if name in CORE or name == "post_clip_norm" or name in declared()
                else r.get(name) for r in self._records]

    @property
    def skipped_steps(self) -> list[int]:
        return [r.step for r in self._records if r.skipped]

    @property
    def clipped_steps(self) -> list[int]:
        return [r.step for r in self._records if r.clipped]

    def summary(self) -> dict[str, Any]:
        """Return counts a run report needs: steps, skips by reason, clip rate, scale range, spikes, rewinds.

        The counts are exact over every step appended (and, after ``load_state_dict``, the steps
        before a resume), however small the ``window``: a rewind does not take back the steps it
        undid. The spike scores are over the records held that were stepped and not rewound.
        """
        summary = self._totals.summary()
        kept = [r for r in self.kept() if not r.skipped]
        # OLMo 2's spike score (% of values >= 7 sigma from a rolling 1000-value mean), over stepped steps
        summary["spike_score_loss"] = spike_score(r.loss for r in kept)
        summary["spike_score_grad"] = spike_score(r.grad_norm for r in kept)
        summary["rewinds"] = len(self.events)
        return summary

    def state_dict(self) -> dict[str, Any]:
        """Return the summary's running totals (not the records: those are in the JSONL file).

        With a stream to a file, also where the file ends at this point (``"stream"``: its size
        once every pending line is written, and the sha256 of its last line), so that a resume
        from this state continues that file and cuts what was written after it.
        """
        state = self._totals.state_dict()
        mark = self.file.mark() if self.file is not None else None
        if mark is not None:
            state["stream"] = mark
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the summary of a resumed run from ``state_dict()``, and its log file.

        On a log that streams to the file the state was saved from and has written nothing yet
        (a resumed run), the lines the file gained after that state was taken are cut off, with
        a ``LabkitWarning``: their steps are redone from the checkpoint, and without the cut they
        would appear twice. Any other file is another run's (see ``labkit.logfile``).
        """
        if not isinstance(state, dict):
            raise TypeError("a StepLog state must be a dict from StepLog.state_dict(), "
                            f"got {type(state).__name__}.")
        state = dict(state)
        mark = state.pop("stream", None)
        if mark is not None and not (
            isinstance(mark, dict) and mark.keys() == {"size", "last_line_sha256"}
            and type(mark["size"]) is int and mark["size"] > 0 and isinstance(mark["last_line_sha256"], str)
        ):
            raise ValueError("a StepLog state's 'stream' must be {'size': int > 0, 'last_line_sha256': str}, "
                             f"got {mark!r}.")
        totals = _Totals.from_state(state)
        if mark is not None and self.file is not None and not self._records:
            self.file.resume(mark)
        self._totals = totals

    def to_jsonl(self, path: str | os.PathLike) -> None:
        """Write one strict-JSON line a record and event (non-finite floats as ``"NaN"``, ``"Infinity"``)."""
        path = rank_path(path)
        if path is None:
            return
        first, events = self._count - len(self._records), iter(self.events)
        pending = next(events, None)
        with open(path, "w", encoding="utf-8") as f:
            for i, r in enumerate(self._records, first):
                while pending is not None and pending[0] <= i:
                    f.write(pending[1].to_json() + "\n")
                    pending = next(events, None)
                f.write(r.to_json() + "\n")
            while pending is not None:
                f.write(pending[1].to_json() + "\n")
                pending = next(events, None)

    @classmethod
    def read_jsonl(cls, path: str | os.PathLike) -> StepLog:
        """Read a log written by ``to_jsonl`` or streamed with ``stream=`` (strict JSON or Python's bare NaN).

        Lines of an older labkit (every field on every record, rewinds marked on the records)
        read as the same records and events. A torn last line (what a crash or a full disk
        leaves) is not an error: every complete line is read, the torn text is kept in
        ``torn_tail`` and a ``LabkitWarning`` says so. A damaged line anywhere else raises
        ``ValueError`` naming it.
        """
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        records: list[StepRecord] = []
        events: list[tuple[int, RewindEvent]] = []
        torn = None
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                items = read_line(line)
            except (ValueError, TypeError) as e:
                if i != last:
                    raise ValueError(f"{os.fspath(path)}, line {i + 1} is not a StepRecord ({e}): "
                                     f"{line[:80]!r}") from None
                torn = line
                continue
            for item in items:
                if isinstance(item, RewindEvent):
                    events.append((len(records), item))
                else:
                    records.append(item)
        log = cls(records, events=events)
        if torn is not None:
            log.torn_tail = torn
            warnings.warn(
                f"{os.fspath(path)}: the last line is torn ({len(torn)} characters, after step "
                f"{records[-1].step if records else 'none'}), e.g. by a crash; read the {len(records)} "
                "complete records. A run that resumes this file (load_state_dict of its checkpoint) cuts it "
                "off before appending.",
                LabkitWarning,
                stacklevel=2,
            )
        return log

    def to_csv(self, path: str | os.PathLike) -> None:
        """Write one row per record: the core, ``rewound``, then every field any record has.

        A per-layer field and ``top_grads`` as ``name=value;...``, ``lrs`` as ``lr;...``.
        """
        path = rank_path(path)
        if path is None:
            return
        extra = list(dict.fromkeys(k for r in self._records for k in r.fields))
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*CORE, "rewound", *extra])
            writer.writeheader()
            for r, gone in zip(self._records, self.rewound):
                row = {**r.to_dict(), "rewound": gone}
                for name, value in row.items():
                    if isinstance(value, dict):
                        row[name] = ";".join(f"{k}={v:.6g}" for k, v in value.items())
                    elif isinstance(value, list) and value and isinstance(value[0], tuple):
                        row[name] = ";".join(f"{k}={v:.6g}" for k, v in value)
                    elif isinstance(value, list):
                        row[name] = ";".join(f"{v:.6g}" for v in value)
                writer.writerow(row)
