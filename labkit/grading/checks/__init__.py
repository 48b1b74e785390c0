"""Autograder checks: run a student's function on visible and hidden cases against labkit's own.

One package per problem set (``ps1``, ``ps2``, ``ps3``) with one module per part of the set,
each holding its check's cases, student side, judge and ``check_*`` function, and a ``bans``
module (what each part asks the student to write); ``core`` holds what they all share (calling
student code, shipping its results as data, the host-sync and ban traps, running a check) and
``cells`` reads the student's cells as the grader will. Each check has two halves that meet
only through data: ``run`` calls the student's function on a case and
returns what it saw (tensors, numbers, strings: what ``torch.save``/
``torch.load(weights_only=True)`` carries), and ``judge`` compares that with labkit's
reference and returns the failure message, or None. The grader runs ``run`` in the
student's sandboxed process and ``judge`` in its own (``labkit.grading.harness``), so a
submission cannot reach the verdict; ``check_*`` runs both in one process, for the
notebook's test cells. ``hidden=True`` runs a randomized battery built from ``seed``, quoted
in every failure so it can be replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import core, ps1, ps2, ps3
from .core import SYNCS
from .ps1 import check_clip, check_grad_norm, check_guarded_step, check_skip_decision, check_update_scale
from .ps2 import (
    check_clip_effect,
    check_fp16_range,
    check_read_run,
    check_spike_detector,
    check_zscore_clipper,
)
from .ps3 import check_delayed_scaling, check_fp8_tiles, check_kahan_update, check_stale_fraction

__all__ = ["BANNED", "CHECKS", "SYNCS", "check_clip", "check_clip_effect", "check_delayed_scaling",
           "check_fp16_range", "check_fp8_tiles", "check_grad_norm", "check_guarded_step",
           "check_kahan_update", "check_read_run", "check_skip_decision", "check_spike_detector",
           "check_stale_fraction", "check_update_scale", "check_zscore_clipper", "judge", "run"]

CHECKS: dict[str, core.Check] = {**ps1.CHECKS, **ps2.CHECKS, **ps3.CHECKS}
# the library functions each check's part asks the student to write (trapped while it runs)
BANNED: dict[str, tuple[str, ...]] = {**ps1.BANNED, **ps2.BANNED, **ps3.BANNED}


def run(check: str, fn: Callable, hidden: bool, seed: int, outs: list[dict[str, Any]] | None = None,
        before_case: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Call ``fn`` on every case of ``check``: the student's side, whose result is plain data.

    >>> outs = run("check_skip_decision", lambda loss, parameters: None, hidden=False, seed=0)
    >>> [out["value"] for out in outs][:2]
    [{'type': 'NoneType', 'py': None}, {'type': 'NoneType', 'py': None}]
    >>> judge("check_skip_decision", "skip_reason", False, 0, outs)[:62]
    "skip_reason returned None on the case 'NaN loss', expected 'no"
    """
    return core.run_cases(CHECKS[check], fn, hidden, seed, outs, before_case)


def judge(check: str, name: str, hidden: bool, seed: int, outs: list[dict[str, Any]]) -> str | None:
    """Compare what ``run`` shipped with labkit's reference: the failure message, or None."""
    return core.judge_cases(CHECKS[check], name, hidden, seed, outs)

