"""Set 4, part 3: from a monitored run's records, which tensor's RMS spiked, when, and if before the loss.

The records are a real run's, produced here from the seed: a small MLP memorising one batch
with AdamW (beta2 0.99) under ``TrainStep`` with an ``UpdateMonitor`` (a fifth of a second). In
one kind of run an input feature that was 0 switches on: its weights, at 0, leave the loss where
it was, but their gradient is new to ``v``, so the RMS of the first layer's weight jumps at that
optimizer step and the loss rises on the next (the optimizer's spike). In the other a batch of
bad targets arrives: the loss spikes at that step, and the RMS with it (the data's spike). The
monitor's fields are one record late: record ``t + 1`` carries optimizer step ``t``
(``update_step``), so reading ``record.step`` for the RMS puts the optimizer's spike *with* the
loss instead of before it. The threshold and the loss factor are chosen per run so that the
first crossing is not the run's largest RMS and each classic mistake changes the answer.
"""

from __future__ import annotations

import copy
import functools
import random
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.records import StepRecord
from labkit.step import TrainStep
from labkit.update_monitor import UpdateMonitor

from ..core import Check, as_plain, call_student, check, forbid, on_case, raised_problem, ship
from ..ps2.tiny_gpt import one_thread
from .bans import SPIKE_FUNCS

__all__ = ["CHECK", "check_find_spike"]

FEATURE = 10.0  # the feature's size once on: its weights' first Adam steps overshoot
@functools.lru_cache(maxsize=8)
def _run(seed: int, kind: str, event: int, steps: int, lr: float = 0.05) -> tuple[StepRecord, ...]:
    """Return the records of a run: a feature switching on (``"feature"``) or bad targets, at ``event``."""
    with one_thread():
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        with torch.no_grad():
            model[0].weight[:, 5] = 0.0  # the feature that switches on: its weights start at 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        train = TrainStep(model, optimizer, nn.functional.mse_loss, max_norm=None,
                          hooks=[SkipAlarm(None), ClipAlarm(None), UpdateMonitor(threshold=None)])
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)
        feature = x[:, 5] * FEATURE
        records = []
        for t in range(steps):
            xb, yb = x.clone(), y
            xb[:, 5] = feature if kind == "feature" and t >= event else 0.0
            if kind == "bad" and t == event:
                yb = y * 4  # one batch of bad targets
            records.append(train(xb, yb))
        return tuple(records)


def _first_rms(records: tuple[StepRecord, ...], threshold: float,
               mistake: str | None = None) -> tuple[Any, Any]:
    """Return (tensor, optimizer step) of the first RMS above ``threshold`` (or with ``mistake``), or None."""
    found = [r for r in records if r.update_rms_max > threshold]
    if not found:
        return None, None
    r = max(found, key=lambda r: r.update_rms_max) if mistake == "largest" else found[0]
    return r.update_rms_peak, r.step if mistake == "late" else r.update_step


def _first_loss(records: tuple[StepRecord, ...], factor: float, window: int,
                mistake: str | None = None) -> Any:
    """Return the first step whose loss exceeds ``factor`` x the median of the ``window`` losses before it."""
    losses = [r.loss for r in records]
    for i in range(window, len(records)):
        before = losses[i - window + 1:i + 1] if mistake == "current" else losses[i - window:i]
        if losses[i] > factor * statistics.median(before):
            return records[i].step
    return None


def _answer(case: _SpikeCase, mistake: str | None = None) -> tuple[Any, Any, Any, bool]:
    tensor, rms_step = _first_rms(case.records, case.threshold, mistake)
    loss_step = _first_loss(case.records, case.factor, case.window, mistake)
    if rms_step is None or loss_step is None:
        return tensor, rms_step, loss_step, False
    first = rms_step <= loss_step if mistake == "same_step" else rms_step < loss_step
    return tensor, rms_step, loss_step, first


@dataclass
class _SpikeCase:
    name: str
    records: tuple[StepRecord, ...]
    threshold: float
    factor: float
    window: int


SPIKE_MISTAKES = {
    "late": "the monitor's fields are one record late: record t + 1 carries optimizer step t, and says so in "
            "record.update_step; the RMS spike's step is its update_step, not its record.step (read that "
            "way, the optimizer's spike seems to come with the loss, not before it)",
    "largest": "the spike started at the *first* optimizer step whose largest RMS (update_rms_max) passed "
               "the threshold, not at the run's largest RMS (the peak moves from tensor to tensor as the "
               "spike goes on)",
    "current": "a step's loss is compared with the median of the `window` losses *before* it, not "
               "including itself",
    "same_step": "the RMS spike came before the loss spike only if its optimizer step is earlier: at the "
                 "same step the loss was already up when the optimizer took it (the data's spike, not the "
                 "optimizer's)",
}


def _choose(records: tuple[StepRecord, ...], kind: str, event: int,
            window: int) -> tuple[float, float] | None:
    """Return a (threshold, factor) of the grid that finds the event and shows the most mistakes; or None.

    The event: the RMS first passes the threshold at optimizer step ``event``, and the loss first
    spikes at the next step (a feature switching on) or at ``event`` itself (bad targets). Off
    the grid's values that find it (None: not this run), the one where the most classic mistakes
    change the answer, reading the records one step late always among them.
    """
    best, best_shown = None, -1
    loss_at = event + 1 if kind == "feature" else event
    for threshold in (1.5, 1.75, 2.0, 2.25):
        for factor in (1.5, 2.0, 3.0):
            case = _SpikeCase("", records, threshold, factor, window)
            right = _answer(case)
            if right[1:3] != (event, loss_at):
                continue
            shown = sum(_answer(case, m) != right for m in SPIKE_MISTAKES)
            if _answer(case, "late") != right and shown > best_shown:
                best, best_shown = (threshold, factor), shown
    return best


def _case(name: str, seed: int, kind: str, event: int, window: int) -> _SpikeCase:
    for k in range(20):  # another run seed until one shows the event (about 7 in 10 feature runs do)
        records = _run(seed + k, kind, event, event + 10)
        chosen = _choose(records, kind, event, window)
        if chosen is not None:
            what = "feature 5 switches on" if kind == "feature" else "one batch of bad targets"
            what += f" at step {event}"
            return _SpikeCase(f"{name}: run seed {seed + k}, {what}", records, *chosen, window)
    raise RuntimeError(f"no run from seed {seed} shows the event: a grader bug, please report it")


def _spike_cases(hidden: bool, seed: int) -> Iterator[_SpikeCase]:
    if not hidden:
        yield _case("a feature switches on", 0, "feature", 40, 7)
        return
    rnd = random.Random(seed)
    runs = rnd.sample(range(2, 10_000), 2)
    yield _case("a feature switches on", runs[0], "feature", rnd.randint(35, 45), rnd.choice([5, 7, 9]))
    yield _case("bad targets", runs[1], "bad", rnd.randint(30, 45), rnd.choice([5, 7, 9]))


def _run_spike(fn: Callable, case: _SpikeCase) -> dict[str, Any]:
    traps: list[str] = []
    with forbid(SPIKE_FUNCS, "read the records", traps):
        out = call_student(fn, list(copy.deepcopy(case.records)), case.threshold, case.factor, case.window)
    out.update(traps=traps, value=ship(out.get("value")))
    return out


def _judge_spike(name: str, case: _SpikeCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    try:
        tensor, rms_step, loss_step, first = as_plain(out["value"])
        rms_step = None if rms_step is None else int(rms_step)
        loss_step = None if loss_step is None else int(loss_step)
    except (TypeError, ValueError):
        return (f"{name} returned a {out['value']['type']} {where}; return (tensor, rms_step, loss_step, "
                "rms_first): a name, two steps and a bool.")
    got = (tensor, rms_step, loss_step, bool(first))
    want = _answer(case)
    if got == want:
        return None
    told = f"with threshold={case.threshold:g}, factor={case.factor:g}, window={case.window}"
    hint = next((h for m, h in SPIKE_MISTAKES.items() if got == _answer(case, m)), None)
    if hint is None:
        if (tensor, rms_step) != want[:2]:
            hint = ("the RMS spike is the first record whose update_rms_max passes the threshold; its tensor "
                    "is update_rms_peak and its optimizer step update_step (the record is one step late)")
        elif loss_step != want[2]:
            hint = (f"the loss spike is the first step whose loss exceeds factor x the median of the "
                    f"{case.window} losses before it")
        else:
            hint = "rms_first is rms_step < loss_step (False when either spike is missing)"
    shown = lambda a: f"({a[0]!r}, {a[1]}, {a[2]}, {a[3]})"  # noqa: E731
    return f"{name} returned {shown(got)} {where} {told}; expected {shown(want)}: {hint}."


CHECK = Check(_spike_cases, _run_spike, _judge_spike)


def check_find_spike(fn: Callable[..., tuple], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(records, threshold, factor, window) -> (tensor, rms_step, loss_step, rms_first)``.

    ``rms_step``: the first optimizer step whose largest RMS passed ``threshold`` (its record's
    ``update_step``: the monitor is one record late), ``tensor`` its ``update_rms_peak``;
    ``loss_step``: the first step whose loss exceeds ``factor`` times the median of the
    ``window`` losses before it; ``rms_first``: ``rms_step < loss_step``. Graded on real monitored runs.

    >>> import statistics
    >>> def find_spike(records, threshold, factor, window):
    ...     first = next((r for r in records if r.update_rms_max > threshold), None)
    ...     tensor, rms_step = (first.update_rms_peak, first.update_step) if first else (None, None)
    ...     losses = [r.loss for r in records]
    ...     loss_step = next((records[i].step for i in range(window, len(records))
    ...                       if losses[i] > factor * statistics.median(losses[i - window:i])), None)
    ...     both = rms_step is not None and loss_step is not None
    ...     return tensor, rms_step, loss_step, both and rms_step < loss_step
    >>> check_find_spike(find_spike, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, SPIKE_FUNCS)
