"""``python -m labkit export LOG.jsonl --to tensorboard,...``: replay a finished run into trackers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..records import parse_line
from .telemetry import TRACKERS, Telemetry, parse_trackers

__all__ = ["build_parser", "main", "read_records", "replay"]


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Return the JSONL's records as dicts (not its event lines), keeping fields this labkit does not know."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            d = parse_line(line)  # strict JSON: "NaN"/"Infinity" back to floats
            if "event" not in d:  # a rewind event: the trackers see it as the step going back
                records.append(d)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a torn last line, what a crash mid-write leaves: the rest is whole
                print(f"labkit export: {path}: the last line is incomplete and was left out", file=sys.stderr)
                break
            raise ValueError(
                f"{path}, line {i + 1}: not a JSON record; is this a labkit log.jsonl?"
            ) from None
    return records


def replay(path: str | os.PathLike, log_to: str | list[str], out: str | os.PathLike,
           run_name: str | None = None, **alarms: Any) -> Telemetry:
    """Write each record of the JSONL at ``path`` into the ``log_to`` trackers under ``out``, alarms too.

    ``alarms`` are ``Telemetry``'s (``skip_alarm``, ``clip_alarm``, ``clip_window``); histograms
    are not in a JSONL, so a replay has none. Returns the closed ``Telemetry`` (its ``alerts``).
    """
    records = read_records(path)
    telemetry = Telemetry.open(log_to, out, run_name or os.path.splitext(os.path.basename(path))[0], **alarms)
    try:
        for r in records:
            telemetry.write(r)
    finally:
        telemetry.close()
    return telemetry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labkit export",
        description="Replay a labkit log.jsonl into trackers (the JSONL stays the source of truth).",
    )
    p.add_argument("log", help="a log.jsonl written by labkit (run_experiment's log_path, the demo's --out)")
    p.add_argument("--to", required=True, metavar="TRACKERS", help=f"comma-separated: {','.join(TRACKERS)}")
    p.add_argument("--out", help="folder for the trackers' files (default: the log's folder)")
    p.add_argument("--name", help="run name (default: the log's file name)")
    p.add_argument(
        "--skip-alarm", type=int, default=8, help="alert after this many skips in a row (default 8)"
    )
    p.add_argument("--clip-alarm", type=float, default=0.5,
                   help="alert when more than this fraction of --clip-window steps clipped (default 0.5)")
    p.add_argument("--clip-window", type=int, default=100, help="steps in the clipping window (default 100)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = parse_trackers(args.to)
    except ValueError as e:
        parser.error(f"--to: {e}")
    if not names:
        parser.error(f"--to: name at least one of {', '.join(TRACKERS)}")
    if not os.path.isfile(args.log):
        parser.error(f"{args.log}: no such file")
    out = args.out or os.path.dirname(os.path.abspath(args.log))
    try:
        t = replay(args.log, names, out, args.name, skip_alarm=args.skip_alarm, clip_alarm=args.clip_alarm,
                   clip_window=args.clip_window)
    except (ModuleNotFoundError, ValueError) as e:
        print(f"labkit export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.log} to {', '.join(names)} under {out} ({len(t.alerts)} alerts)")
    return 0
