"""The hub a ``StepLog`` streams into: schema rows, histograms and alarms, fanned out to sinks."""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..alarms import ClipAlarm, SkipAlarm
from .schema import Histogram, Row, log2_histogram, row

if TYPE_CHECKING:
    import torch

__all__ = ["TRACKERS", "Sink", "Telemetry", "check_trackers", "open_sink", "parse_trackers"]

# Each name is at once the sink's module in labkit.export, the package it imports and labkit's extra.
TRACKERS = ("tensorboard", "trackio", "mlflow", "wandb")


class Sink:
    """One tracker. Subclasses write what their tracker has; the defaults say what it lacks.

    A tracker without an alert API gets alerts as text, one without histograms gets none.
    """

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        """Write one step's scalars and texts."""
        raise NotImplementedError

    def histogram(self, step: int, tag: str, hist: Histogram) -> None:
        """Write a log2|g| histogram; trackers without histograms drop it."""

    def alert(self, step: int, title: str, text: str) -> None:
        """Raise an alarm; trackers without an alert API log it as text under ``alerts/<title>``."""
        self.log(step, {}, {f"alerts/{title}": text})

    def rewind(self, step: int) -> None:
        """The run went back to ``step``: records from there on are a new branch."""

    def close(self) -> None:
        raise NotImplementedError


def parse_trackers(log_to: str | Iterable[str] | None) -> list[str]:
    """Return the tracker names in ``"tensorboard,trackio"`` (or a list), checked against ``TRACKERS``.

    >>> parse_trackers("tensorboard, mlflow")
    ['tensorboard', 'mlflow']
    >>> parse_trackers("tensorbord")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown tracker 'tensorbord'; choose from tensorboard, trackio, mlflow, wandb ...
    """
    if log_to is None:
        return []
    names = [n.strip() for n in (log_to.split(",") if isinstance(log_to, str) else log_to)]
    names = [n for n in names if n]
    for n in names:
        if n not in TRACKERS:
            raise ValueError(f"unknown tracker {n!r}; choose from {', '.join(TRACKERS)} (comma-separated).")
    return list(dict.fromkeys(names))


def _install_hint(name: str) -> str:
    return (f"logging to {name} needs the {name} package, which is not installed: "
            f"pip install 'labkit[{name}]' (or pip install -r requirements-trackers.txt)")


def check_trackers(names: Iterable[str]) -> None:
    """Raise ``ModuleNotFoundError`` with the install line for the first tracker whose package is missing.

    Looks the packages up without importing them, so a run fails before it starts.
    """
    for n in names:
        try:
            found = importlib.util.find_spec(n) is not None
        except ValueError:  # a module set to None in sys.modules: as good as missing
            found = False
        if not found:
            raise ModuleNotFoundError(_install_hint(n), name=n)


def open_sink(name: str, out: str | os.PathLike, run_name: str) -> Sink:
    """Open the ``name`` tracker's sink, writing under ``out``; the tracker is imported here, not before."""
    check_trackers([name])
    module = importlib.import_module(f".{name}", __package__)
    return module.open(out, run_name)


class Telemetry:
    """Stream records into trackers: the schema's scalars and texts, alarms, rewinds, histograms.

    A ``StepLog`` given it as a sink calls ``write`` with every record. The alarms are the
    library's own (``SkipAlarm``, ``ClipAlarm``) with ``TrainStep``'s defaults, run over the
    records, so a replay of a ``log.jsonl`` raises the same alerts the live run did.

    >>> class Printer(Sink):
    ...     def log(self, step, scalars, texts): print(step, scalars.get("amp/skip_streak"), texts)
    ...     def close(self): pass
    >>> from labkit import StepRecord
    >>> t = Telemetry([Printer()], skip_alarm=2)
    >>> skip = lambda i: StepRecord(i, float("nan"), skipped=True, reason="nonfinite_loss", skip_streak=i + 1)
    >>> for i in range(2): t.write(skip(i))  # doctest: +ELLIPSIS
    0 1.0 {'amp/skip_reason': 'nonfinite_loss'}
    1 2.0 {'amp/skip_reason': 'nonfinite_loss'}
    1 None {'alerts/SkipStreakWarning': '2 steps skipped in a row (steps 0-1: nonfinite_loss x2). ...'}
    """

    def __init__(self, sinks: Sequence[Sink], *, skip_alarm: int | None = 8, clip_alarm: float | None = 0.5,
                 clip_window: int = 100) -> None:
        self.sinks = list(sinks)
        self.skip_alarm, self.clip_alarm = SkipAlarm(skip_alarm), ClipAlarm(clip_alarm, clip_window)
        self.last_step: int | None = None
        self.alerts: list[tuple[int, str, str]] = []

    @classmethod
    def open(cls, log_to: str | Iterable[str], out: str | os.PathLike, run_name: str | None = None,
             **alarms: Any) -> Telemetry:
        """Open the trackers named in ``log_to`` under ``out`` (each package checked before any opens)."""
        names = parse_trackers(log_to)
        check_trackers(names)
        os.makedirs(out, exist_ok=True)
        run_name = run_name or os.path.basename(os.path.abspath(out))
        sinks: list[Sink] = []
        try:
            for n in names:
                sinks.append(open_sink(n, out, run_name))
        except BaseException:
            for s in sinks:
                s.close()
            raise
        return cls(sinks, **alarms)

    def write(self, record: Any) -> None:
        """Send one record (a ``StepRecord`` or its JSONL dict) to every sink."""
        r: Row = row(record)
        if self.last_step is not None and r.step <= self.last_step:
            for s in self.sinks:
                s.rewind(r.step)
            r.texts["events/rewind"] = f"rewound to step {r.step} (the run had reached step {self.last_step})"
        self.last_step = r.step
        for s in self.sinks:
            s.log(r.step, r.scalars, r.texts)
        skipped = bool(r.scalars.get("amp/skipped"))
        with warnings.catch_warnings(record=True) as caught:
            # the alarms' own messages, caught here: the run's TrainStep already warned the user
            warnings.simplefilter("always")
            self.skip_alarm.observe(skipped, r.texts.get("amp/skip_reason"), r.step)
            if not skipped:
                self.clip_alarm.observe(bool(r.scalars.get("grad/clipped")), r.step)
        for w in caught:
            self.alert(r.step, w.category.__name__, str(w.message))

    def alert(self, step: int, title: str, text: str) -> None:
        """Send an alarm to every sink (its alert API where it has one); other alarms may call this too."""
        self.alerts.append((step, title, text))
        for s in self.sinks:
            s.alert(step, title, text)

    def histograms(self, step: int, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Write a log2|g| histogram per parameter with a gradient (costs a pass over them: not every step).

        A parameter with no finite non-zero gradient entry (a skipped step) gets none.
        """
        for name, p in named_parameters:
            if p.grad is not None:
                hist = log2_histogram([p.grad])
                if not any(hist.counts):
                    continue
                for s in self.sinks:
                    s.histogram(step, f"layers/{name}/log2_abs_grad", hist)

    def close(self) -> None:
        """Close every sink (the trackers flush and finish their runs); a second call does nothing."""
        sinks, self.sinks = self.sinks, []
        for s in sinks:
            s.close()
