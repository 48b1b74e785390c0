"""Set 2, part 1: backoffs and z-score flags read from the records of a real fp16 GPT run.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from labkit.reasons import Reason
from labkit.records import StepRecord
from labkit.scaler import GradScaler
from labkit.spikes import SpikeDetector, rolling_z
from labkit.step import TrainStep
from labkit.tasks.gpt import GPTTask

from ..core import (
    Check,
    as_plain,
    call_student,
    check,
    forbid,
    on_case,
    raised_problem,
    ship,
)
from .bans import SPIKE_FUNCS
from .tiny_gpt import TINY_GPT, one_thread


@functools.lru_cache(maxsize=8)
def _gpt_run(seed: int, steps: int, growth_interval: int, hysteresis: int, skip_z: float | None) -> tuple:
    """Return the records of a real fp16 run of a 1-layer GPT: its loss scale overflows by itself.

    AdamW at 3e-3, clipped at 1, the scale from 2**14 growing every ``growth_interval`` clean
    steps; with ``skip_z`` a ``SpikeDetector`` (window 16) skips the steps whose loss or norm
    is more than ``skip_z`` sigma above its window.
    """
    with one_thread():
        task = GPTTask(seed=seed, **TINY_GPT)
        model = task.model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scaler = GradScaler("cpu", init_scale=2.0**14, growth_interval=growth_interval, hysteresis=hysteresis)
        detector = SpikeDetector(window=16, skip_z=skip_z) if skip_z is not None else None
        step = TrainStep(model, optimizer, task.loss_fn, precision="fp16", scaler=scaler, max_norm=1.0,
                         skip_alarm=None, clip_alarm=None, hooks=[detector] if detector is not None else [])
        return tuple(step(*task.batch(i)) for i in range(steps))


# the mistakes a z-score over a run's records is built with, each replayed by _zscores
FLAG_MISTAKES = {
    "nonfinite": "a skipped step's norm is inf or NaN, and it entered your window (from then on the mean is "
                 "inf and every z NaN): a norm enters the window only if its step trained (not "
                 "record.skipped)",
    "skipped": "a step the run skipped (record.skipped, e.g. reason 'spike_grad') entered your window: it "
               "never trained, so its norm must not judge the next ones, finite or not",
    "current": "the current norm is in its own window: a z-score compares a norm with the window of the "
               "steps *before* it (with itself included, z can never exceed sqrt(window - 1))",
    "sample": "the standard deviation is the population one here (divide by the window size, as labkit's "
              "rolling_z and llm.c do), not the sample one (n - 1); OLMo-core's torch.std_mean does divide "
              "by n - 1 (src/olmo_core/optim/skip_step_optimizer.py, get_step_factor), and also admits "
              "skipped steps into its window, which labkit does not",
    "early": "a step is flagged only once the window is full (window norms of steps that trained)",
}
K_GRID = tuple(k / 4 for k in range(4, 17))  # 1.0 .. 4.0


def _zscores(records: tuple[StepRecord, ...], window: int, mistake: str | None = None) -> list[float]:
    """Return each record's norm z-score against the window before it (NaN: none), or with ``mistake``."""
    if mistake is None:  # labkit's rule: the previous `window` norms of steps that trained, population std
        history: deque[float] = deque(maxlen=window)
        out = []
        for r in records:
            out.append(rolling_z(history, r.grad_norm, min_count=window))
            if not r.skipped and math.isfinite(r.grad_norm):
                history.append(r.grad_norm)
        return out
    seen: list[float] = []
    out = []
    for r in records:
        x = r.grad_norm
        values = (seen + [x])[-window:] if mistake == "current" else seen[-window:]
        n = len(values)
        z = math.nan
        if n >= (2 if mistake == "early" else window) and math.isfinite(x):
            mean = sum(values) / n
            var = sum((v - mean) ** 2 for v in values) / (n - 1 if mistake == "sample" else n)
            std = math.sqrt(var) if var >= 0 else math.nan
            z = (x - mean) / std if std > 0 else math.nan
        out.append(z)
        if mistake == "nonfinite" or (mistake == "skipped" and math.isfinite(x)) or \
                (not r.skipped and math.isfinite(x)):
            seen.append(x)
    return out


def _flagged(records: tuple[StepRecord, ...], window: int, k: float, mistake: str | None = None) -> list[int]:
    return [r.step for r, z in zip(records, _zscores(records, window, mistake)) if z > k]


def _choose_k(records: tuple[StepRecord, ...], window: int) -> float:
    """Return the grid's threshold under which the most classic mistakes change the flags."""
    right = _zscores(records, window)
    wrong = [_zscores(records, window, m) for m in FLAG_MISTAKES]

    def shows(k: float) -> tuple[int, bool]:
        flags = [i for i, z in enumerate(right) if z > k]
        return sum(flags != [i for i, z in enumerate(zs) if z > k] for zs in wrong), bool(flags)

    return max(K_GRID, key=shows)


def _backoffs(records: tuple[StepRecord, ...]) -> list[tuple[int, str | None]]:
    return [(r.step, r.reason) for r in records if r.next_scale < r.scale]


@dataclass
class _RunCase:
    """A real run's records, with the window and threshold of the z-score detector to apply to them."""

    name: str
    records: tuple[StepRecord, ...]
    window: int
    k: float


def _run_case(name: str, seed: int, growth_interval: int, hysteresis: int, skip_z: float | None,
              window: int) -> _RunCase:
    records = _gpt_run(seed, 32, growth_interval, hysteresis, skip_z)
    what = (f"fp16 GPT, seed {seed}, growth_interval={growth_interval}, hysteresis={hysteresis}"
            + (f", SpikeDetector(skip_z={skip_z:g})" if skip_z is not None else ""))
    return _RunCase(f"{name}: {what}, window={window}", records, window, _choose_k(records, window))


def _read_cases(hidden: bool, seed: int) -> Iterator[_RunCase]:
    if not hidden:
        yield _run_case("a real run", 0, 2, 1, None, 8)
        return
    rnd = random.Random(seed)
    runs = rnd.sample(range(1, 10_000), 2)
    yield _run_case("with hysteresis", runs[0], rnd.randint(2, 3), 2, None, rnd.randint(5, 9))
    yield _run_case("with a spike detector", runs[1], rnd.randint(2, 4), 1, rnd.choice([1.5, 1.75]),
                    rnd.randint(5, 9))


def _run_read(fn: Callable, case: _RunCase) -> dict[str, Any]:
    traps: list[str] = []
    with forbid(SPIKE_FUNCS, "compute the z-scores", traps):
        out = call_student(fn, list(copy.deepcopy(case.records)), case.window, case.k)
    out.update(traps=traps, value=ship(out.get("value"), items=4096))
    return out


def _shown(items: list, limit: int = 8) -> str:
    return repr(items[:limit])[:-1] + (", ...]" if len(items) > limit else "]")


def _backoff_hint(case: _RunCase, got: list[tuple[int, Any]], want: list[tuple[int, Any]]) -> str:
    records = {r.step: r for r in case.records}
    late = [(records[i].step, records[i].reason) for i in range(1, len(case.records))
            if records[i].scale < records[i - 1].scale]
    if got == late or [s for s, _ in got] == [s + 1 for s, _ in want]:
        return ("each backoff is found one step late: the step that overflowed carries it in its own record "
                "(next_scale < scale); the next record only starts from the lower scale.")
    extra = sorted({s for s, _ in got} - {s for s, _ in want})
    if extra and extra[0] in records and records[extra[0]].skipped:
        r = records[extra[0]]
        why = "a z-score skip is not a scaling problem: the scale stays"
        if r.reason == Reason.NONFINITE_GRAD:
            # labkit.update_scale; Megatron-LM DynamicGradScaler.update; DeepSpeed's
            # DynamicLossScaler.update_scale (delayed_shift)
            why = ("with hysteresis=2 the first overflow after each growth of the scale (or the start) is "
                   "absorbed; every later one backs off until the scale grows again")
        return (f"step {r.step} was skipped ({r.reason}) but its scale stayed ({r.scale:g} -> "
                f"{r.next_scale:g}): {why}. A backoff is next_scale < scale, not skipped=True.")
    if [s for s, _ in got] == [s for s, _ in want]:
        step, reason = next((s, r) for (s, r), (_, mine) in zip(got, want) if r != mine)
        return (f"the steps are right, the reasons not (step {step}: you said {reason!r}, the record says "
                f"{records[step].reason!r}): a backoff's reason is the record.reason of the step that "
                "overflowed.")
    missing = sorted({s for s, _ in want} - {s for s, _ in got})
    if missing:
        r = records[missing[0]]
        return (f"step {r.step} backed off ({r.scale:g} -> {r.next_scale:g}, {r.reason}) and is missing: a "
                "backoff is any record whose next_scale is below its scale.")
    return "a backoff is a record whose next_scale is below its scale, as (record.step, record.reason)."


def _flag_hint(case: _RunCase, got: list[int], want: list[int]) -> str:
    for mistake, hint in FLAG_MISTAKES.items():
        if got == _flagged(case.records, case.window, case.k, mistake):
            return hint + "."
    z = dict(zip((r.step for r in case.records), _zscores(case.records, case.window)))
    step = min(set(got) ^ set(want))
    if step not in z:
        return f"step {step} is not a step of this run."
    shown = f"{z[step]:.3g}" if math.isfinite(z[step]) else \
        "undefined (the window is not full, or the norm not finite)"
    return (f"step {step}'s z-score is {shown} against the {case.window} norms of steps that trained before "
            f"it, so it is {'' if step in want else 'not '}flagged at k={case.k:g}.")


def _judge_read(name: str, case: _RunCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    try:
        backoffs, flagged = as_plain(out["value"])
        got_b = [(int(s), r) for s, r in backoffs]
        got_f = [int(s) for s in flagged]
    except (TypeError, ValueError):
        return (f"{name} returned a {out['value']['type']} {where}; return (backoffs, flagged): a list of "
                "(step, reason) pairs and a list of steps.")
    want_b, want_f = _backoffs(case.records), _flagged(case.records, case.window, case.k)
    if got_b != want_b:
        return (f"{name}'s backoffs {where} are {_shown(got_b, 4)}, expected {_shown(want_b, 4)}: "
                f"{_backoff_hint(case, got_b, want_b)}")
    if got_f != want_f:
        return (f"{name} flagged steps {_shown(got_f)} {where} with window={case.window}, k={case.k:g}; "
                f"expected {_shown(want_f)}: {_flag_hint(case, got_f, want_f)}")
    return None


CHECK = Check(_read_cases, _run_read, _judge_read)


def check_read_run(fn: Callable[..., tuple[list, list]], hidden: bool = False,
                   seed: int | None = None) -> None:
    """Check ``fn(records, window, k) -> (backoffs, flagged)`` on the records of a real fp16 GPT run.

    ``backoffs``: ``(step, reason)`` of each record whose ``next_scale`` is below its ``scale``;
    ``flagged``: the steps whose gradient norm is more than ``k`` population standard
    deviations above the mean of the previous ``window`` norms of steps that trained (once
    ``window`` of them are in). The records are produced at check time, from a recorded seed.

    >>> import math, statistics
    >>> def read_run(records, window, k):
    ...     backoffs = [(r.step, r.reason) for r in records if r.next_scale < r.scale]
    ...     seen, flagged = [], []
    ...     for r in records:
    ...         last = seen[-window:]
    ...         if len(last) == window and math.isfinite(r.grad_norm):
    ...             if (r.grad_norm - statistics.fmean(last)) / statistics.pstdev(last) > k:
    ...                 flagged.append(r.step)
    ...         if not r.skipped and math.isfinite(r.grad_norm):
    ...             seen.append(r.grad_norm)
    ...     return backoffs, flagged
    >>> check_read_run(read_run, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, SPIKE_FUNCS)
