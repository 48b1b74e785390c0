"""``python -m labkit show LOG.jsonl``: a log from any loop, shown as the demo shows its own run.

The event lines (``describe``: skips with their reason, clips, faults, rewinds, changes of
scale), the summary, and the figure (``plot_log``) written next to the log as a PNG. The log
is any JSONL that ``StepLog`` streams (``TrainStep(log=...)``, or ``StepLog(stream=...)`` in
a plain loop); a torn last line is read as ``StepLog.read_jsonl`` reads it, with a warning.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable

from ..records import StepRecord
from ..steplog import StepLog
from .plots import had_scaler, plot_log
from .text import describe, describe_rewind, format_scale

__all__ = ["main", "show"]


def fixed_threshold(log: StepLog) -> float | None:
    """Return the run's fixed clip threshold (``NormClip``'s ``max_norm``) if its records agree on one.

    >>> fixed_threshold(StepLog([StepRecord(0, 1.0, threshold=0.5, clip_reason="NormClip")]))
    0.5
    """
    # get: a log read back where the clippers that declare these fields were never imported
    seen = {r.get("threshold") for r in log
            if r.get("clip_reason") == "NormClip" and math.isfinite(r.get("threshold", math.nan))}
    return seen.pop() if len(seen) == 1 else None


def summary_rows(log: StepLog) -> list[tuple[str, str]]:
    """Return the summary as ``(name, value)`` rows: steps, skips by reason, clips, scale, final loss."""
    s = log.summary()
    skips = ", ".join(f"{reason} {count}" for reason, count in s["skips_by_reason"].items() if count)
    finite = [r.loss for r in log if not r.skipped and math.isfinite(r.loss)]
    rows = [
        ("steps", str(s["steps"])),
        ("skipped", f"{s['skipped']}" + (f" ({skips})" if skips else "")),
        ("clipped", f"{s['clipped']} ({s['clip_rate']:.1%} of stepped steps)"),
        ("loss scale", f"min {format_scale(s['min_scale'])}, max {format_scale(s['max_scale'])}, "
                       f"final {format_scale(s['final_scale'])}" if had_scaler(log) else "none (no scaler)"),
        ("final loss", f"{finite[-1]:.4g}" if finite else "none: no step was taken"),
    ]
    if s["rewinds"]:
        rows.append(("rewinds", str(s["rewinds"])))
    return rows


def show(path: str | os.PathLike, png: str | os.PathLike | None = None, max_norm: float | None = None,
         echo: Callable[[str], object] = print) -> StepLog:
    """Echo a log's event lines and summary, write its figure to ``png`` (default: the log's name, .png).

    ``max_norm`` is read from the records when they agree on one (``NormClip``'s threshold).
    """
    log = StepLog.read_jsonl(path)
    if not len(log):
        raise ValueError(f"{os.fspath(path)} holds no records: nothing to show.")
    max_norm = fixed_threshold(log) if max_norm is None else max_norm
    after = log.events_after()
    for i, record in enumerate(log):
        limit = max_norm if max_norm is not None else _own_threshold(record)
        for line in [*describe(record, limit), *(describe_rewind(e) for e in after.get(i, ()))]:
            echo(line)
    echo("\nsummary")
    for key, value in summary_rows(log):
        echo(f"  {key:<11} {value}")
    png = os.fspath(png) if png is not None else os.path.splitext(os.fspath(path))[0] + ".png"
    plot_log(log, max_norm).savefig(png, dpi=100)
    echo(f"  {'figure':<11} {png}")
    return log


def _own_threshold(record: StepRecord) -> float | None:
    threshold = record.get("threshold", math.nan)
    return threshold if math.isfinite(threshold) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit show",
        description="Show a log.jsonl from any loop: its event lines, its summary, and its figure as a PNG.")
    parser.add_argument("log", help="the JSONL log (TrainStep(log=...), or StepLog(stream=...))")
    parser.add_argument("--png", help="where to write the figure (default: the log's path with .png)")
    parser.add_argument("--max-norm", type=float, help="the clip threshold to draw (default: the records')")
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            show(args.log, args.png, args.max_norm)
    except (OSError, ValueError) as e:
        print(f"labkit show: {e}", file=sys.stderr)
        return 1
    for w in caught:  # a torn last line, say: after the report, as the demo prints its warnings
        print(f"WARNING {w.category.__name__}: {w.message}")
    return 0
