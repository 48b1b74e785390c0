"""The log file: a crash-safe JSONL sink for a ``StepLog`` (one line per record or event, one log per run).

``JsonlFile`` appends each line as it comes, so a crash loses nothing already logged. A
regular file: a torn last line (a crash mid-write) is cut before anything is appended, a
failed write (a full disk) is cut back to the last whole line and retried, and a resumed run
cuts what was written after its checkpoint. A stream (a pipe or FIFO with its reader started,
a terminal, ``/dev/null``, ``/dev/full``, this process's stdout or stderr by any path) is
written in order and never read, sought or cut.

**One log per run.** A file that already holds lines belongs to another run, unless this
run resumes it: ``StepLog.load_state_dict`` (``TrainStep.load_state_dict``) with the state
saved while writing it, whose last line the file still holds at the saved size. Otherwise
nothing is appended to it: at this run's first line the old file is moved to the first free
``<path>.1``, ``<path>.2``... (a ``LabkitWarning`` names both files and the steps it holds)
and this run starts ``<path>`` afresh.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import sys
import warnings
from collections.abc import Callable
from typing import Any

from .alarms import LabkitWarning, warn
from .distributed import rank

__all__ = ["JsonlFile", "LogWriteError", "cut_torn_tail", "rank_path"]

# A record is a few KB; a "line" longer than this is no record and is not read into memory.
MAX_LINE = 1 << 24


class LogWriteError(OSError):
    """A record could not be written to the JSONL stream; it is kept in memory and retried."""


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


class JsonlFile:
    """Append lines of strict JSON to ``path`` (a file or a stream), crash-safe: see the module docstring.

    ``write(item)`` takes anything with ``to_json()`` (a ``StepRecord``, a ``RewindEvent``).

    >>> import tempfile; path = os.path.join(tempfile.mkdtemp(), "log.jsonl")
    >>> from labkit.records import StepRecord
    >>> f = JsonlFile(path); f.write(StepRecord(0, 1.0)); f.close(); open(path).read()[:22]
    '{"step": 0, "loss": 1.'
    """

    def __init__(self, path: str) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"cannot write the log to {path!r}: the folder {folder!r} does not exist; "
                "create it first (os.makedirs(folder, exist_ok=True))."
            )
        self.path = path
        self._where = os.path.abspath(path)  # the same file after a chdir
        self._fd: int | None
        self._fd, self.kind = _open_stream(path)
        self._good_size = os.fstat(self._fd).st_size if self.kind == "file" else 0
        self._others = self._good_size > 0  # another run's lines, until a resume claims them
        self._pending: list[bytes] = []  # lines not yet written (after a failed write), oldest first
        self._sent = 0  # bytes of the first pending line already in a stream, which cannot be cut back
        self._last = b""  # the last line appended: a checkpoint names it (``mark``)

    @property
    def written(self) -> bool:
        """Whether this run has given it a line."""
        return bool(self._last)

    def write(self, item: Any) -> None:
        """Append ``item.to_json()`` as a line; raise ``LogWriteError`` if it cannot (kept, retried)."""
        self._last = (item.to_json() + "\n").encode("utf-8")
        self._pending.append(self._last)
        if self._others:  # another run's file: moved aside before our first line (again if that failed)
            self._move_aside()
        self.flush()

    def flush(self) -> None:
        """Write the lines a failed write left behind; raise ``LogWriteError`` if it fails again."""
        if self._fd is None or not self._pending:
            return
        if self._others:
            self._move_aside()
        data, written = b"".join(self._pending)[self._sent:], 0
        try:
            # a failed write may leave part of a line in a file: cut back to the last whole one first
            if self.kind == "file" and os.fstat(self._fd).st_size != self._good_size:
                os.ftruncate(self._fd, self._good_size)
            if self.kind in ("stdout", "stderr"):  # print()'s buffered lines first: they stay in order
                _flush_quietly(getattr(sys, self.kind))
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as e:
            if self.kind != "file":  # a stream keeps what reached it: drop what was written, resend the rest
                self._sent += written
                while self._sent >= len(self._pending[0]):
                    self._sent -= len(self._pending.pop(0))
            first, last = _step_of(self._pending[0]), _step_of(self._pending[-1])
            raise LogWriteError(
                e.errno,
                f"could not write to {self.path!r} ({e.strerror}): steps {first}-{last} are not in the file "
                "yet. Training state is complete and the records are kept in memory (the log); they are "
                "written, in order, at the next step or log.flush() once the disk has room. To stop instead, "
                "save them with log.to_jsonl(other_path).",
            ) from e
        self._good_size += len(data)
        self._pending, self._sent = [], 0

    def close(self) -> None:
        """Write what is pending and close (kept open if it cannot be written: ``flush`` raises)."""
        if self._fd is not None:
            self.flush()
            os.close(self._fd)
            self._fd = None

    def mark(self) -> dict[str, Any] | None:
        """Return where the file ends once every pending line is written (None: no file, or no line)."""
        if self.kind != "file" or not self._last:
            return None
        size = self._good_size + sum(map(len, self._pending)) - self._sent
        return {"size": size, "last_line_sha256": hashlib.sha256(self._last).hexdigest()}

    def resume(self, mark: dict[str, Any]) -> None:
        """Continue the run that wrote ``mark``: keep its lines, cut those after it (with a warning).

        Only a file this run has not written to is resumed, and only where its line at the
        saved size is the saved last line; any other file is another run's: left as it is
        (with a warning) until the first line moves it aside.
        """
        if self.kind != "file" or self._last or self._pending or self._fd is None:
            return
        size, now = mark["size"], os.fstat(self._fd).st_size
        with open(self._where, "rb") as f:
            ours, there = os.fstat(self._fd), os.fstat(f.fileno())
            # the path may name another file now
            same = (there.st_dev, there.st_ino) == (ours.st_dev, ours.st_ino)
            line = b""
            if same and size <= now:
                start = _line_start(f, size - 1)
                f.seek(start)
                line = f.read(size - start) if size - start <= MAX_LINE else b""
            f.seek(size)
            extra = f.read(now - size) if 0 <= now - size <= MAX_LINE else None
        if not line.endswith(b"\n") or hashlib.sha256(line).hexdigest() != mark["last_line_sha256"]:
            warnings.warn(f"{self.path}: its line at the checkpoint's size is not the checkpoint's last "
                          "record; it was left as it is (was it written by another run?), and this run's "
                          f"first record moves it to {_free_name(self.path)!r} and starts {self.path!r} "
                          "afresh (one log per run).", LabkitWarning, stacklevel=4)
            return
        self._others = False
        if now == size:
            return
        os.ftruncate(self._fd, size)
        self._good_size = size
        steps = [] if extra is None else [_step_of(x) for x in extra.split(b"\n") if x.strip()]
        what = f"{len(steps)} records (steps {steps[0]}-{steps[-1]})" if steps and None not in steps else \
            f"{now - size} bytes"
        warnings.warn(f"{self.path}: cut {what} written after the checkpoint; the resumed run redoes those "
                      "steps.", LabkitWarning, stacklevel=4)

    def _move_aside(self) -> None:
        """Move another run's file to the first free ``<path>.N``; start ``path`` empty for this run.

        If it cannot be moved, nothing changes: ``LogWriteError``, and the next line tries again.
        The warning names the user's line, whichever path reached here (a ``TrainStep``, a
        ``StepLog.append``, a ``flush``).
        """
        assert self._fd is not None
        aside = _free_name(self.path)
        with open(self._where, "rb") as f:
            first = _step_of(f.readline(MAX_LINE))
            last = _step_of(_last_line(f))
        try:
            os.rename(self._where, aside)  # before closing: if it fails, the file is open and ours as it was
            try:
                fd, kind = _open_stream(self.path)
            except OSError:  # no fresh file (out of descriptors, say): put the old one back, as it was
                os.rename(aside, self._where)
                raise
        except OSError as e:
            first_ours, last_ours = _step_of(self._pending[0]), _step_of(self._pending[-1])
            raise LogWriteError(
                e.errno,
                f"could not move {self.path!r}, another run's log (steps {first}-{last}), aside to {aside!r} "
                f"and start it afresh ({e.strerror}): steps {first_ours}-{last_ours} are not in the file "
                "yet. They are kept in memory (the log) and written, in order, at the next step or "
                "log.flush() once it can be moved; or save them with log.to_jsonl(other_path).",
            ) from e
        os.close(self._fd)
        self._fd, self.kind = fd, kind
        self._good_size, self._others = 0, False
        warn(f"{self.path} holds the records of another run (steps {first}-{last}): moved it to {aside!r}, "
             f"and this run's records start {self.path!r} afresh (one log per run; to continue a run's log, "
             "resume it: load_state_dict with the state saved while writing it).", LabkitWarning)


def _free_name(path: str) -> str:
    n = 1
    while os.path.lexists(f"{path}.{n}"):
        n += 1
    return f"{path}.{n}"


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
        cut_torn_tail(path)
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
    # replaced, closed or gone: nothing to order against
    with contextlib.suppress(AttributeError, OSError, ValueError):
        stream.flush()


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


def _last_line(f: Any) -> bytes:
    """Return the last line of ``f`` that is not blank (at most ``MAX_LINE`` bytes), without its newline."""
    end = f.seek(0, os.SEEK_END)
    while end > 0:  # blank lines at the end (a hand edit, another tool's file) are no record: skip them
        n = min(1 << 16, end)
        f.seek(end - n)
        kept = len(f.read(n).rstrip())
        end -= n - kept
        if kept:
            break
    start = _line_start(f, end)
    f.seek(start)
    return f.read(min(end - start, MAX_LINE))


def _is_json(tail: bytes) -> bool:
    try:
        json.loads(tail)
        return True
    except ValueError:
        return False


def cut_torn_tail(path: str | os.PathLike, complete: Callable[[bytes], bool] = _is_json,
                  warn: bool = True) -> None:
    """Cut an incomplete last line off ``path`` (a crash mid-write), so appending starts on a fresh line.

    The rule: what follows the last newline is torn unless ``complete(it)`` says it is a whole
    line (a JSONL record by default), which only lacks its newline: then the newline is added.
    A table whose rows may parse when cut short (a CSV) passes ``complete=lambda tail: False``.
    """
    try:
        f = open(path, "rb+")  # noqa: SIM115 (the with below; the try catches only the open's error)
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        start = _line_start(f, size)
        f.seek(start)
        rest = f.read() if size - start <= MAX_LINE else None  # longer than any record: torn
        if rest is not None and not rest.strip():
            return
        if rest is not None and complete(rest):
            f.write(b"\n")  # complete but for its newline: keep it
            return
        f.truncate(start)
        if warn:
            warnings.warn(f"{os.fspath(path)}: cut off a torn last line ({size - start} bytes, e.g. from a "
                          "crash) before appending.", LabkitWarning, stacklevel=5)
