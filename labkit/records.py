"""What one guarded step did (``StepRecord``) and the log of a run (``StepLog``)."""

from __future__ import annotations

import csv
import dataclasses
import errno
import hashlib
import json
import math
import os
import stat
import sys
import warnings
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from .alarms import LabkitWarning
from .distributed import rank
from .reasons import COUNTED
from .spikes import spike_score
from .validate import check_int

__all__ = ["LogWriteError", "StepLog", "StepRecord", "parse_line"]

# Strict JSON has no NaN/Infinity (JavaScript's JSON.parse rejects Python's bare NaN): non-finite
# floats are written as these strings, and read back from them or from the bare tokens.
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _to_json(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, (list, tuple)):
        return [_to_json(v) for v in x]
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    return x


def _from_json(x: Any) -> Any:
    return NONFINITE.get(x, x) if isinstance(x, str) else x


def parse_line(line: str) -> dict[str, Any]:
    """Return one JSONL line as a dict, its non-finite numbers (``"NaN"`` or bare ``NaN``) as floats.

    Fields this labkit does not know are kept as they are.

    >>> parse_line('{"step": 3, "loss": "NaN", "lrs": ["Infinity"], "fault": "nan"}')
    {'step': 3, 'loss': nan, 'lrs': [inf], 'fault': 'nan'}
    """
    d = json.loads(line)
    for name in FLOATS & d.keys():
        d[name] = _from_json(d[name])
    if "top_grads" in d:
        d["top_grads"] = [[n, _from_json(v)] for n, v in d["top_grads"] or []]
    if "lrs" in d:
        d["lrs"] = [_from_json(v) for v in d["lrs"] or []]
    for name in PER_LAYER:
        if isinstance(d.get(name), dict):
            d[name] = {k: _from_json(v) for k, v in d[name].items()}
    return d


class LogWriteError(OSError):
    """A record could not be written to the JSONL stream; it is kept in memory and retried."""


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
    # the first gradient in backward order (nearest the loss) holding NaN/inf, and the module that produced it
    first_nonfinite: str | None = None
    culprit_module: str | None = None
    stale: dict[str, float] = field(default_factory=dict)  # per layer: updates below half an ulp (StaleMonitor)
    lrs: list[float] = field(default_factory=list)  # every param group's lr (``lr`` is group 0's)
    # Spike defenses: z-scores of loss and norm (NaN: no detector, or not enough history),
    # the clipper's threshold (NaN: none, or a per-tensor rule), why it clipped, whether its lock-in
    # guard fired, and rewinds: this step was undone (``rewound``), or it triggered one (``rewind_to``).
    z_loss: float = math.nan
    z_grad: float = math.nan
    threshold: float = math.nan
    clip_reason: str | None = None
    lockin: bool = False
    rewound: bool = False
    rewind_to: int | None = None
    # the GPT's logits (``labkit.tasks.gpt.LogitMonitor``; empty or None when not measured): per
    # layer the largest attention logit and the entropy of the most peaked head, the output
    # logits' mean log Z and mean log Z**2 (the z-loss term is its coefficient times that), and
    # the cross-entropy (the loss less its z-loss term)
    attn_logit_max: dict[str, float] = field(default_factory=dict)
    attn_entropy: dict[str, float] = field(default_factory=dict)
    log_z: float | None = None
    log_z_sq: float | None = None
    ce_loss: float | None = None

    @property
    def post_clip_norm(self) -> float:
        """The norm the optimizer stepped with (NaN on a skipped step)."""
        return math.nan if self.skipped else self.grad_norm * self.clip_coef

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Return one line of strict JSON (non-finite numbers as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``).

        >>> StepRecord(0, math.nan).to_json()[:29]
        '{"step": 0, "loss": "NaN", "g'
        """
        d = self.to_dict()
        for name in FLOATS:
            d[name] = _to_json(d[name])
        d["top_grads"] = [[n, _to_json(v)] for n, v in d["top_grads"]]
        d["lrs"] = _to_json(d["lrs"])
        for name in PER_LAYER:
            d[name] = _to_json(d[name])
        return json.dumps(d, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        """Build a record from ``to_dict()`` or from a parsed ``to_json()`` line (either form of NaN).

        Fields this labkit does not know (written by a newer one) are left out, so a log stays
        readable by the labkit that reads it; a record without ``step`` and ``loss`` is refused.

        >>> StepRecord.from_dict({"step": 1, "loss": "NaN", "from_the_future": 3}).loss
        nan
        """
        d = {k: v for k, v in d.items() if k in _KNOWN}
        for name in FLOATS & d.keys():
            d[name] = _from_json(d[name])
        d["top_grads"] = [(n, _from_json(v)) for n, v in d.get("top_grads") or []]
        d["lrs"] = [_from_json(v) for v in d.get("lrs") or []]
        for name in PER_LAYER:
            d[name] = {k: _from_json(v) for k, v in (d.get(name) or {}).items()}
        return cls(**d)


FIELDS = [f.name for f in dataclasses.fields(StepRecord)]
_KNOWN = frozenset(FIELDS)
PER_LAYER = ("stale", "attn_logit_max", "attn_entropy")  # {layer: number}
FLOATS = {f.name for f in dataclasses.fields(StepRecord) if f.type in ("float", "float | None")}


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
            raise KeyError(f"a StepLog state must be a dict with {sorted(vars(totals))}; pass StepLog.state_dict().")
        counts = [state[k] for k in ("steps", "stepped", "clipped")] + list(dict(state["reasons"]).values())
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) or (
            state["stepped"] + sum(state["reasons"].values()) != state["steps"] or state["clipped"] > state["stepped"]
        ):
            raise ValueError(f"a StepLog state's counts must be ints >= 0 that add up (stepped + skipped = steps), got {state}.")
        for k, v in state.items():
            setattr(totals, k, Counter(v) if k == "reasons" else (float(v) if k not in ("steps", "stepped", "clipped") else v))
        return totals


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

    With ``stream=path`` each record is also appended to a JSONL file (strict JSON, one line
    per record) as it arrives, so a crash loses nothing already recorded; a line torn by a
    crash or a full disk is cut off before a restart appends, and ``load_state_dict`` of a
    checkpoint cuts the records written after it (they are about to be redone; TensorBoard's
    ``purge_step`` does the same). ``path`` may also be a stream: a pipe or FIFO (with its
    reader already started), a terminal, ``/dev/null``, or ``/dev/stdout`` and ``/dev/stderr``
    (written through this process's own descriptor, in order with ``print``); nothing is cut
    from a stream. Under ``torch.distributed`` files are written by rank 0 only, unless the
    path holds ``{rank}`` (see ``rank_path``).

    Memory: every record is kept (0.4-0.8 KB per step, the more when it carries ``top_grads``: up
    to 0.8 GB per million steps; measured with tracemalloc, Python 3.11). For
    long runs pass ``window=N``: only the last N records are kept (indexing, ``column`` and
    ``skipped_steps`` see those), while ``summary()`` still counts every step. ``state_dict``
    carries the summary across a resume (``TrainStep.state_dict`` includes it).
    Each of ``sinks`` (anything with ``write(record)`` and ``close()``, e.g. a
    ``labkit.export.Telemetry``) is given every record as it is appended, and closed with the log.

    >>> log = StepLog([StepRecord(0, 1.0), StepRecord(1, math.nan, skipped=True, reason="nonfinite_loss")])
    >>> log.skipped_steps, log.column("loss")[0]
    ([1], 1.0)
    >>> tail = StepLog(log, window=1)
    >>> len(tail), tail.summary()["steps"]
    (1, 2)
    """

    def __init__(
        self, records: Sequence[StepRecord] = (), *, stream: str | os.PathLike | None = None,
        sinks: Sequence[Any] = (), window: int | None = None,
    ) -> None:
        check_int("window", window, 1, none="keep every record")
        if stream is not None and not isinstance(stream, (str, os.PathLike)):
            raise TypeError(f"log_path/stream must be a str or os.PathLike file path, got {type(stream).__name__}.")
        self.sinks: list[Any] = list(sinks)
        path = rank_path(stream) if stream is not None else None
        if path is not None:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise FileNotFoundError(
                    f"cannot write the log to {path!r}: the folder {folder!r} does not exist; "
                    "create it first (os.makedirs(folder, exist_ok=True))."
                )
        self._records: list[StepRecord] | deque[StepRecord] = deque(maxlen=window) if window else []
        self._totals = _Totals()
        self._pending: list[bytes] = []  # lines not yet written (after a failed write), oldest first
        self._sent = 0  # bytes of the first pending line already in a stream, which cannot be cut back
        self._last = b""  # the last line appended: a checkpoint names it (state_dict's "stream")
        self._path, self._fd, self._good_size, self._kind = path, None, 0, None
        self._where = os.path.abspath(path) if path is not None else None  # the same file after a chdir
        if path is not None:
            self._fd, self._kind = _open_stream(path)
            self._good_size = os.fstat(self._fd).st_size if self._kind == "file" else 0
        self.torn_tail: str | None = None  # set by read_jsonl: the incomplete last line, if any
        for r in records:  # kept, not streamed: they come from a file or another log
            self._records.append(r)
            self._totals.add(r)

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

    def append(self, record: StepRecord) -> None:
        """Keep ``record`` (and stream it); if the file cannot be written, raise ``LogWriteError``.

        The record is kept in memory either way, and every unwritten line is retried, in
        order, at the next ``append`` or ``flush``: free space and carry on, nothing is lost.
        """
        self._records.append(record)
        self._totals.add(record)
        if self._fd is not None:
            self._last = (record.to_json() + "\n").encode("utf-8")
            self._pending.append(self._last)
        for sink in self.sinks:
            sink.write(record)
        self.flush()

    def flush(self) -> None:
        """Write the lines a failed write left behind (see ``append``); raise ``LogWriteError`` if it fails again."""
        if self._fd is None or not self._pending:
            return
        data, written = b"".join(self._pending)[self._sent:], 0
        try:
            # a failed write may leave part of a line in a file: cut back to the last whole one first
            if self._kind == "file" and os.fstat(self._fd).st_size != self._good_size:
                os.ftruncate(self._fd, self._good_size)
            if self._kind in ("stdout", "stderr"):  # print()'s buffered lines first: they stay in order
                _flush_quietly(getattr(sys, self._kind))
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as e:
            if self._kind != "file":  # a stream keeps what reached it: drop what was written, resend the rest
                self._sent += written
                while self._sent >= len(self._pending[0]):
                    self._sent -= len(self._pending.pop(0))
            first = json.loads(self._pending[0])["step"]
            raise LogWriteError(
                e.errno,
                f"could not write to {self._path!r} ({e.strerror}): steps {first}-{self._records[-1].step} are "
                "not in the file yet. Training state is complete and the records are kept in memory (the log); "
                "they are written, in order, at the next step or log.flush() once the disk has room. To stop "
                "instead, save them with log.to_jsonl(other_path).",
            ) from e
        self._good_size += len(data)
        self._pending, self._sent = [], 0

    def close(self) -> None:
        """Write what is pending and close the JSONL stream, if any, and the sinks."""
        if self._fd is not None:
            try:
                self.flush()
            finally:
                if not self._pending:
                    os.close(self._fd)
                    self._fd = None
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
        """Return counts a run report needs: steps, skips by reason, clip rate, scale range, spikes.

        The counts are exact over every step appended (and, after ``load_state_dict``, the steps
        before a resume), however small the ``window``. The spike scores and ``rewinds`` are
        read from the records held (every one by default; the last ``window`` with one), since
        a rewind marks records after they were appended.
        """
        summary = self._totals.summary()
        kept = [r for r in self._records if not r.skipped and not r.rewound]
        # OLMo 2's spike score (% of values >= 7 sigma from a rolling 1000-value mean), over stepped steps
        summary["spike_score_loss"] = spike_score(r.loss for r in kept)
        summary["spike_score_grad"] = spike_score(r.grad_norm for r in kept)
        summary["rewinds"] = sum(r.rewind_to is not None for r in self._records)
        return summary

    def state_dict(self) -> dict[str, Any]:
        """Return the summary's running totals (not the records: those are in the JSONL file).

        With a stream to a file, also where the file ends at this point (``"stream"``: its size
        once every pending line is written, and the sha256 of its last line), so that a resume
        from this state can cut what was written after it.
        """
        state = self._totals.state_dict()
        if self._kind == "file" and self._last:
            size = self._good_size + sum(map(len, self._pending)) - self._sent
            state["stream"] = {"size": size, "last_line_sha256": hashlib.sha256(self._last).hexdigest()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the summary of a resumed run from ``state_dict()``.

        On a log that streams to the same file and holds no record yet (a resumed run), the
        lines the file gained after that state was taken are cut off, with a ``LabkitWarning``:
        their steps are redone from the checkpoint, and without the cut they would appear twice.
        The file is cut only where its line at the saved size is the saved last line; any other
        file is left as it is (with a warning if it is longer).
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
        if mark is not None and self._kind == "file" and not self._records and not self._pending:
            self._cut_after(mark["size"], mark["last_line_sha256"])
        self._totals = totals

    def _cut_after(self, size: int, last_line_sha256: str) -> None:
        """Truncate the stream's file to ``size`` if the line ending there is the checkpoint's last line."""
        assert self._fd is not None and self._where is not None
        ours = os.fstat(self._fd)
        if ours.st_size <= size:
            return
        now = ours.st_size
        with open(self._where, "rb") as f:
            there = os.fstat(f.fileno())
            if (there.st_dev, there.st_ino) != (ours.st_dev, ours.st_ino):  # the path names another file now
                return
            start = _line_start(f, size - 1)
            f.seek(start)
            line = f.read(size - start) if size - start <= MAX_LINE else b""
            f.seek(size)
            extra = f.read(now - size) if now - size <= MAX_LINE else None
        if not line.endswith(b"\n") or hashlib.sha256(line).hexdigest() != last_line_sha256:
            warnings.warn(f"{self._path}: it is longer than at the checkpoint, but its line there is not the "
                          "checkpoint's last record; it was left as it is (was it written by another run?).",
                          LabkitWarning, stacklevel=4)
            return
        os.ftruncate(self._fd, size)
        self._good_size = size
        steps = [] if extra is None else [_step_of(x) for x in extra.split(b"\n") if x.strip()]
        what = f"{len(steps)} records (steps {steps[0]}-{steps[-1]})" if steps and None not in steps else \
            f"{now - size} bytes"
        warnings.warn(f"{self._path}: cut {what} written after the checkpoint; the resumed run redoes those "
                      "steps.", LabkitWarning, stacklevel=4)

    def to_jsonl(self, path: str | os.PathLike) -> None:
        """Write one strict-JSON object per record (non-finite floats as the strings ``"NaN"``, ``"Infinity"``)."""
        path = rank_path(path)
        if path is None:
            return
        with open(path, "w", encoding="utf-8") as f:
            for r in self._records:
                f.write(r.to_json() + "\n")

    @classmethod
    def read_jsonl(cls, path: str | os.PathLike) -> StepLog:
        """Read a log written by ``to_jsonl`` or streamed with ``stream=`` (strict JSON or Python's bare NaN).

        A torn last line (what a crash or a full disk leaves) is not an error: every complete
        record is read, the torn text is kept in ``torn_tail`` and a ``LabkitWarning`` says so.
        A damaged line anywhere else raises ``ValueError`` naming it.
        """
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        records, torn = [], None
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(StepRecord.from_dict(json.loads(line)))
            except (ValueError, TypeError) as e:
                if i != last:
                    raise ValueError(f"{os.fspath(path)}, line {i + 1} is not a StepRecord ({e}): {line[:80]!r}") from None
                torn = line
        log = cls(records)
        if torn is not None:
            log.torn_tail = torn
            warnings.warn(
                f"{os.fspath(path)}: the last line is torn ({len(torn)} characters, after step "
                f"{records[-1].step if records else 'none'}), e.g. by a crash; read the {len(records)} complete records. "
                "StepLog(stream=path) and TrainStep(log_path=path) cut it off before appending.",
                LabkitWarning,
                stacklevel=2,
            )
        return log

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
                for column in PER_LAYER:
                    values = getattr(r, column).items()
                    row[column] = ";".join(f"{name}={value:.6g}" for name, value in values)
                row["lrs"] = ";".join(f"{lr:.6g}" for lr in r.lrs)
                writer.writerow(row)


# A record is a few KB; a "line" longer than this is no record and is not read into memory.
MAX_LINE = 1 << 24


def _open_stream(path: str) -> tuple[int, str]:
    """Open ``path`` for appending records; return the descriptor and its kind.

    ``"file"``: a regular file labkit alone appends to (a torn last line is cut off first, and a
    failed write is cut back). ``"stdout"``/``"stderr"``: this process's own, by whatever path
    (``/dev/stdout``, a file the shell redirected to): written through a copy of that descriptor,
    so the lines interleave with ``print`` instead of overwriting it. ``"stream"``: a pipe, FIFO,
    terminal or character device, never read, sought or cut (``/dev/full`` gives a
    ``LogWriteError`` at the first record). A FIFO nobody reads is refused rather than waited on.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        for fd in (1, 2):
            try:
                std = os.fstat(fd)
            except OSError:
                continue
            if (std.st_dev, std.st_ino) == (st.st_dev, st.st_ino):
                return os.dup(fd), ("stdout", "stderr")[fd - 1]
    if st is None or stat.S_ISREG(st.st_mode):
        _cut_torn_tail(path)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "file"
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"cannot write the log to {path!r}: it is a folder; give a "
                                f"file in it, e.g. {os.path.join(path, 'log.jsonl')!r}.")
    if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        raise OSError(errno.EINVAL, f"cannot write the log to {path!r}: it is neither a file, a pipe nor a "
                      "character device (a socket or a disk?); give a file path.")
    try:  # O_NONBLOCK: opening a FIFO for writing would wait forever for a reader
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, f"cannot write the log to the FIFO {path!r}: nothing is reading it. "
                          f"Start its reader first (e.g. `cat {path} &`), then the run.") from None
        raise
    os.set_blocking(fd, True)  # a slow reader slows the run, as with print(); it loses nothing
    return fd, "stream"


def _flush_quietly(stream: Any) -> None:
    try:
        stream.flush()
    except (AttributeError, OSError, ValueError):  # replaced, closed or gone: nothing to order against
        pass


def _step_of(line: bytes) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, TypeError, KeyError):
        return None


def _line_start(f: Any, end: int) -> int:
    """Return the offset just past the last newline in the first ``end`` bytes of ``f`` (0 if none).

    Read backwards in 64 KiB blocks: memory stays bounded however long the line.
    """
    pos = end
    while pos > 0:
        n = min(1 << 16, pos)
        pos -= n
        f.seek(pos)
        i = f.read(n).rfind(b"\n")
        if i >= 0:
            return pos + i + 1
    return 0


def _cut_torn_tail(path: str) -> None:
    """Cut an incomplete last line off ``path`` (a crash mid-write), so appending starts on a fresh line."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        start = _line_start(f, size)
        f.seek(start)
        rest = f.read() if size - start <= MAX_LINE else b"\0"  # longer than any record: torn
        if not rest.strip():
            return
        try:
            json.loads(rest)
            f.write(b"\n")  # complete but for its newline: keep it
        except ValueError:
            f.truncate(start)
            warnings.warn(
                f"{path}: cut off a torn last line ({size - start} bytes, e.g. from a crash) before "
                "appending.",
                LabkitWarning,
                stacklevel=5,
            )
