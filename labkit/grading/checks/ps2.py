"""Problem set 2's checks: real instabilities and spike defenses (after lessons 04 and 05).

1. ``check_read_run``: backoffs and z-score flags read from the records of a real fp16 GPT
   run, produced here from a recorded seed (a 1-layer GPT: a fifth of a second);
2. ``check_fp16_range``: what fp16 flushes to zero and turns into inf at a loss scale, against
   torch's own cast, on a GPT's real gradients and on the format's edges;
3. ``check_zscore_clipper``: a NaN-safe EMA z-score clipper against ``labkit.clippers.ZClip``,
   with no host sync, resumed from its ``state_dict`` bit for bit;
4. ``check_spike_detector``: OLMo-core's rolling-window rule against ``labkit.SpikeDetector``;
5. ``check_clip_effect``: what a fixed clip does to the update under SGD and under Adam.

Each judge that finds a wrong answer replays the classic mistakes of its part (a NaN in the
statistics, the current value in its own window, a step late...) and names the one that
gives the student's numbers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import math
import random
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from labkit.clip import clip_grad_norm_ as ref_clip_grad_norm_
from labkit.clippers import ZClip
from labkit.names import FP16_MAX
from labkit.reasons import Reason
from labkit.records import StepRecord
from labkit.scaler import GradScaler
from labkit.spikes import SpikeDetector, rolling_z
from labkit.step import TrainStep
from labkit.tasks.gpt import GPTTask

from .core import (
    Check,
    _call,
    _close,
    _forbid,
    _grads,
    _no_host_sync,
    _plain,
    _raised,
    _same,
    _ship,
    _where,
    check,
)

__all__ = ["BANNED", "CHECKS", "check_clip_effect", "check_fp16_range", "check_read_run",
           "check_spike_detector", "check_zscore_clipper"]

SPIKE_FUNCS = ("labkit.spikes.rolling_z", "labkit.spikes.SpikeDetector", "labkit.spikes.spike_score")
ZCLIP_FUNCS = ("labkit.clippers.ZClip", "labkit.clippers.zclip.zclip_update",
               "labkit.clippers.zclip.zclip_limit", "labkit.clippers.GlobalClipper",
               "labkit.clippers.NormClip", "labkit.clippers.AutoClip", "labkit.clippers.AdaGC",
               "labkit.clippers.AGC", "labkit.clippers.UpdateNormClip", "labkit.clippers.base.feed_value",
               "labkit.clippers.base.lockin_guard", "labkit.TrainStep")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run a reference on one thread, as the sandbox does: the same bits on both sides of the grader."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- 1. read a real run


TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "batch_size": 4}


@functools.lru_cache(maxsize=8)
def _gpt_run(seed: int, steps: int, growth_interval: int, hysteresis: int, skip_z: float | None) -> tuple:
    """Return the records of a real fp16 run of a 1-layer GPT: its loss scale overflows by itself.

    AdamW at 3e-3, clipped at 1, the scale from 2**14 growing every ``growth_interval`` clean
    steps; with ``skip_z`` a ``SpikeDetector`` (window 16) skips the steps whose loss or norm
    is more than ``skip_z`` sigma above its window.
    """
    with _one_thread():
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
    with _forbid(SPIKE_FUNCS, "compute the z-scores", traps):
        out = _call(fn, list(copy.deepcopy(case.records)), case.window, case.k)
    out.update(traps=traps, value=_ship(out.get("value"), items=4096))
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
    where = _where(case.name, hidden, seed)
    raised = _raised(name, out, where)
    if raised:
        return raised
    try:
        backoffs, flagged = _plain(out["value"])
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


# ---------------------------------------------------------------- 2. what fp16 loses at a loss scale


FP16_TINY, FP16_SUBNORMAL = 2.0**-14, 2.0**-24


@functools.lru_cache(maxsize=4)
def _gpt_grads(seed: int) -> tuple[Tensor, ...]:
    """Return the fp32 gradients of a 1-layer GPT's first step, its loss multiplied by a small weight.

    The weight plays lesson 04's ``loss_weight`` (2**-12 there): a small loss term's coefficient,
    which shrinks every gradient by the same factor and pushes many below fp16's range.
    """
    with _one_thread():
        task = GPTTask(seed=seed, **TINY_GPT)
        model = task.model()
        x, y = task.batch(0)
        # 64 tokens / 2**20 = 2**-14: a small loss term's coefficient (lesson 04, section 2). Not a batch
        # size: a mean loss over more tokens gives gradients of the same size. Kept as it was: the hidden
        # cases and every grade given so far depend on it.
        weight = x.numel() / 2**20
        (task.loss_fn(model(x), y) * weight).backward()
        return tuple(p.grad.detach().clone() for p in model.parameters())


# scaled values on fp16's edges: the largest finite value and the tie above it, the smallest
# normal and subnormal, the tie between 0 and the smallest subnormal (it rounds to 0: even)
EDGES = (65504.0, 65505.0, 65519.0, 65519.99, 65520.0, 65536.0, 1e5, 2.0**-14, 2.0**-15, 2.0**-24,
         1.5 * 2.0**-24, 2.0**-25, 2.0**-25 * 1.25, 2.0**-26, 3e-8, 1e-9, 0.0, 1.0)


@dataclass
class _RangeCase:
    """Gradients (fp32) and the loss scale they are multiplied by before the fp16 cast."""

    name: str
    grads: list[Tensor]
    scale: float


def _edges(scale: float, rnd: random.Random | None = None) -> Tensor:
    signs = [1.0 if rnd is None else rnd.choice([1.0, -1.0]) for _ in EDGES]
    # exact: the scale is a power of 2
    return torch.tensor([s * v for s, v in zip(signs, EDGES)], dtype=torch.float32) / scale


def _range_cases(hidden: bool, seed: int) -> list[_RangeCase]:
    grads = list(_gpt_grads(0 if not hidden else seed % 1000))
    if not hidden:
        return [_RangeCase("a GPT's gradients, no loss scale", grads, 1.0),
                _RangeCase("a GPT's gradients at scale 2**16", grads, 2.0**16),
                _RangeCase("fp16's edges, scale 1", [_edges(1.0)], 1.0)]
    rnd = random.Random(seed)
    low, high = 2.0 ** rnd.randint(0, 6), 2.0 ** rnd.randint(12, 24)
    edged = 2.0 ** rnd.randint(-8, 16)
    mixed = [g.clone() for g in grads[: rnd.randint(2, len(grads))]] + [_edges(edged, rnd)]
    return [_RangeCase(f"a GPT's gradients at scale {low:g}", grads, low),
            _RangeCase(f"a GPT's gradients at scale {high:g}", grads, high),
            _RangeCase(f"gradients and fp16's edges at scale {edged:g}", mixed, edged)]


def _fractions(case: _RangeCase, mistake: str | None = None) -> tuple[float, float]:
    """Return (flushed, overflowed) over all entries: torch's own cast, or a classic mistake's version."""
    g = torch.cat([t.detach().flatten().float() for t in case.grads])
    scaled = g * (1.0 if mistake == "noscale" else case.scale)
    half, n = scaled.half(), max(g.numel(), 1)
    flushed = (g != 0) & (half == 0)
    over = torch.isinf(half) & torch.isfinite(scaled)
    if mistake == "normal":
        flushed = (g != 0) & (scaled.abs() < FP16_TINY)
    elif mistake == "zeros":
        flushed = half == 0
    elif mistake == "floor":
        flushed = (g != 0) & (scaled.abs() < FP16_SUBNORMAL)
    elif mistake == "strict":
        over = scaled.abs() > FP16_MAX
    return flushed.sum().item() / n, over.sum().item() / n


RANGE_MISTAKES = {
    "normal": "you counted fp16's subnormals as flushed: below 2**-14 fp16 still holds values down to 2**-24 "
              "(with fewer bits); only what rounds to 0 is lost. Cast and compare: (g * scale).half() == 0",
    "zeros": "you counted gradients that were 0 already: flushed means a nonzero gradient that became 0",
    "floor": "a value between 2**-25 and 2**-24 rounds up to 2**-24, it is not lost (only up to 2**-25, the "
             "tie, rounds to 0): let the cast decide, (g * scale).half() == 0",
    "strict": "fp16 rounds to nearest: values up to 65520 (exclusive) round down to 65504, only from 65520 "
              "on do they become inf. Cast and test torch.isinf",
    "noscale": "the gradients are multiplied by the loss scale before the cast: that is the scaler's whole "
               "point",
}


def _run_range(fn: Callable, case: _RangeCase) -> dict[str, Any]:
    out = _call(fn, [g.clone() for g in case.grads], case.scale)
    out["value"] = _ship(out.get("value"))
    return out


def _judge_range(name: str, case: _RangeCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    raised = _raised(name, out, where)
    if raised:
        return raised
    try:
        flushed, over = (float(v) for v in _plain(out["value"]))
    except (TypeError, ValueError):
        return f"{name} returned a {out['value']['type']} {where}; return (flushed, overflowed): fractions."
    want = _fractions(case)
    if _close(flushed, want[0], 1e-6) and _close(over, want[1], 1e-6):
        return None
    hint = next((h for m, h in RANGE_MISTAKES.items()
                 if all(_close(a, b, 1e-6) for a, b in zip((flushed, over), _fractions(case, m)))), None)
    if hint is None and not _close(flushed, want[0], 1e-6):
        hint = "flushed is the fraction of all entries that are nonzero and become 0 in fp16 after the scale."
    elif hint is None:
        hint = "overflowed is the fraction of all entries that become inf in fp16 after the scale."
    return (f"{name} returned flushed={flushed:.6g}, overflowed={over:.6g} {where}; torch's fp16 cast gives "
            f"{want[0]:.6g} and {want[1]:.6g}: {hint}.")


# ---------------------------------------------------------------- 3. a NaN-safe z-score clipper


ZCLIP_ADVICE = ("keep the statistics as tensors and decide with torch.where (clip or not, warm-up or not, "
                "finite or not), never with an `if` on a tensor")


@dataclass
class _ZCase:
    """A series of global gradient norms (NaN/inf included) fed to a clipper, perhaps resumed mid-way."""

    name: str
    norms: list[float]
    alpha: float = 0.97
    z_thresh: float = 2.5
    warmup: int = 25
    eps: float = 1e-6
    resume_at: int | None = None
    seed: int = 0
    shapes: tuple[tuple[int, ...], ...] = ((5, 4), (7,))
    grads: list[list[Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        for norm in self.norms:
            parts = [torch.randn(s, generator=gen) for s in self.shapes]
            total = torch.linalg.vector_norm(torch.cat([p.flatten() for p in parts]))
            parts = [p / total * (norm if math.isfinite(norm) else 1.0) for p in parts]
            if not math.isfinite(norm):
                parts[0].view(-1)[0] = norm
            self.grads.append(parts)

    @property
    def config(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "z_thresh": self.z_thresh, "warmup": self.warmup, "eps": self.eps}

    def params(self, t: int) -> list[Tensor]:
        params = []
        for g in self.grads[t]:
            p = torch.zeros(g.shape, requires_grad=True)
            p.grad = g.clone()
            params.append(p)
        return params


def _series(rnd: random.Random, n: int, level: float = 1.0, noise: float = 0.05) -> list[float]:
    return [level * math.exp(rnd.gauss(0.0, noise)) for _ in range(n)]


def _zclip_cases(hidden: bool, seed: int) -> list[_ZCase]:
    if not hidden:
        rnd = random.Random(0)
        spiky = _series(rnd, 40)
        spiky[18] *= 10
        spiky[27] *= 4
        bad = _series(rnd, 30)
        bad[3], bad[15], bad[22] = math.nan, math.inf, math.nan
        bad[12], bad[19], bad[26] = bad[12] * 5, bad[19] * 3, bad[26] * 8
        return [_ZCase("steady norms with two spikes, warmup=8", spiky, warmup=8),
                _ZCase("NaN in warm-up, NaN and inf after it, spikes, warmup=6", bad, warmup=6, seed=1),
                _ZCase("resumed from state_dict() at step 20, warmup=8", spiky, warmup=8, resume_at=20,
                       seed=2)]
    rnd = random.Random(seed)
    cases = []
    warm = rnd.randint(5, 12)
    noisy = _series(rnd, 60, rnd.uniform(0.5, 5.0), rnd.uniform(0.02, 0.2))
    for i in rnd.sample(range(warm + 2, 60), 4):
        noisy[i] *= rnd.uniform(3.0, 50.0)
    for i in rnd.sample(range(1, 60), 5):
        noisy[i] = rnd.choice([math.nan, math.inf])
    noisy[rnd.randrange(warm)] = math.nan  # one inside the warm-up
    cases.append(_ZCase("random norms, spikes, NaN/inf at random steps", noisy, rnd.choice([0.9, 0.95, 0.97]),
                        rnd.uniform(1.5, 3.0), warm, seed=seed))
    shift = _series(rnd, 50, rnd.uniform(0.5, 2.0))
    at = rnd.randint(warm + 5, 30)
    shift[at:] = [v * rnd.uniform(2.0, 4.0) for v in shift[at:]]
    cases.append(_ZCase(f"a level shift at step {at}", shift, 0.97, 2.5, warm, seed=seed + 1))
    resume = _series(rnd, 40, rnd.uniform(0.5, 2.0))
    resume[rnd.randint(2, 5)] = math.nan
    resume[rnd.randint(warm + 3, 39)] *= 20
    cases.append(_ZCase(f"resumed mid-warm-up at step {warm - 2}", resume, 0.95, 2.5, warm,
                        resume_at=warm - 2, seed=seed + 2))
    cases.append(_ZCase(f"resumed after the warm-up at step {warm + 4}", noisy, 0.95, 2.0, warm,
                        resume_at=warm + 4, seed=seed + 3))
    return cases


def _roundtrip(state: Any) -> Any:
    """Return ``state`` as a checkpoint gives it back: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _drive(fn: Callable, case: _ZCase, traps: list[str], resume_at: int | None) -> dict[str, Any]:
    """Build the student's clipper and feed it the case's steps, through a state_dict at ``resume_at``."""
    made = _call(fn, **case.config)
    if "raised" in made:
        return {**made, "steps": []}
    clipper, steps = made["value"], []
    for t in range(len(case.norms)):
        if t == resume_at:
            saved = _call(lambda c=clipper: _roundtrip(c.state_dict()))
            if "raised" in saved:
                return {**saved, "steps": steps, "message": f"at the resume (step {t}): {saved['message']}"}
            again = _call(fn, **case.config)
            loaded = again if "raised" in again else _call(again["value"].load_state_dict, saved["value"])
            if "raised" in loaded:
                return {**loaded, "steps": steps}
            clipper = again["value"]
        params = case.params(t)
        with _no_host_sync(traps, ZCLIP_ADVICE):
            out = _call(clipper.clip_, params)
        out.update(value=_ship(out.get("value")), grads=_grads(params))
        steps.append(out)
        if "raised" in out or traps:
            return {"steps": steps, **{k: out[k] for k in ("raised", "message", "_exc") if k in out}}
    return {"steps": steps}


def _run_zclip(fn: Callable, case: _ZCase) -> dict[str, Any]:
    traps: list[str] = []
    with _forbid(ZCLIP_FUNCS, "write the clipper", traps):
        out = _drive(fn, case, traps, None)
        if case.resume_at is not None and "raised" not in out and not traps:
            out["resumed"] = _drive(fn, case, traps, case.resume_at)
            for key in ("raised", "message", "_exc"):
                if key in out["resumed"]:
                    out[key] = out["resumed"].pop(key)
    out["traps"] = traps
    return out


def _zclip_reference(case: _ZCase) -> list[tuple[float, list[Tensor]]]:
    """Return labkit's ZClip on the case: each step's pre-clip norm and the gradients after it."""
    clipper = ZClip(case.alpha, case.z_thresh, case.warmup, case.eps, max_consecutive_clips=None)
    out = []
    for t in range(len(case.norms)):
        params = case.params(t)
        norm = clipper.clip_(params)
        out.append((norm.item(), _grads(params)))
    return out


def _zclip_sim(case: _ZCase, mistake: str | None = None) -> list[float]:
    """Return each step's clip coefficient by ZClip's rule, or under a classic mistake (in float64)."""
    mean = var = math.nan
    buffer: list[float] = []
    count, coefs = 0, []
    for g in case.norms:
        finite = math.isfinite(g)
        if not finite and mistake not in ("nonfinite", "count"):
            coefs.append(1.0)
            continue
        if count < case.warmup:
            count += 1
            if finite or mistake == "nonfinite":
                buffer.append(g)
            else:  # "count": a NaN step took a slot of the warm-up buffer, which stays at its initial 0
                buffer.append(0.0)
            if count == case.warmup:
                mean = sum(buffer) / len(buffer) if buffer else math.nan
                var = sum((v - mean) ** 2 for v in buffer) / len(buffer) if buffer else math.nan
            coefs.append(1.0)
            continue
        if not finite and mistake == "count":
            coefs.append(1.0)
            continue
        std = math.sqrt(var) if var >= 0 else math.nan
        z = (g - mean) / (std + case.eps) if finite else math.nan
        limit = math.inf
        if z > case.z_thresh:
            limit = mean + (case.z_thresh if mistake == "threshold" else case.z_thresh**2 / z) * std
        coefs.append(min(1.0, limit / (g + 1e-6)) if finite else 1.0)
        value = g if mistake == "raw" else min(g, limit)
        old = mean
        mean = case.alpha * mean + (1 - case.alpha) * value
        var = case.alpha * var + (1 - case.alpha) * (value - (old if mistake == "old_mean" else mean)) ** 2
    return coefs


ZCLIP_MISTAKES = {
    "nonfinite": "your z-score statistics moved on a NaN/inf step: a non-finite norm must never enter the "
                 "mean, the variance or the warm-up buffer (one NaN turns the published ZClip off for good)",
    "count": "your warm-up counted a NaN/inf step: only finite norms fill the warm-up buffer",
    "raw": "the EMA was fed the raw norm of a clipped step: ZClip feeds it the clipped value, "
           "min(norm, limit)",
    "old_mean": "the variance is updated around the new mean: "
                "var = alpha * var + (1 - alpha) * (value - mean_new)**2",
    "threshold": "a clipped norm goes to mean + (z_thresh**2 / z) * std (ZClip's adaptive scaling), not to "
                 "the threshold mean + z_thresh * std",
}


def _coef(before: list[Tensor], after: list[Tensor]) -> float:
    b = torch.linalg.vector_norm(torch.cat([g.flatten().double() for g in before])).item()
    a = torch.linalg.vector_norm(torch.cat([g.flatten().double() for g in after])).item()
    return a / b if b > 0 else 1.0


def _zclip_hint(case: _ZCase, steps: list[dict[str, Any]], t: int, want: float) -> str:
    """Name the classic mistake whose clip coefficients are the student's, over every step they shipped."""
    coefs = [_coef(case.grads[i], s["grads"]) if math.isfinite(case.norms[i]) else 1.0
             for i, s in enumerate(steps)]
    right = _zclip_sim(case)[: len(coefs)]
    for mistake, hint in ZCLIP_MISTAKES.items():
        sim = _zclip_sim(case, mistake)[: len(coefs)]
        if sim != right and all(_close(a, b, 2e-5) for a, b in zip(coefs, sim)):
            return hint
    if t < case.warmup and want == 1.0:
        return f"the first warmup={case.warmup} finite norms only fill the warm-up buffer: nothing is clipped"
    return ("during the warm-up nothing is clipped; after it, a norm whose z = (norm - mean) / (std + eps) "
            "exceeds z_thresh is clipped to mean + (z_thresh**2 / z) * std, and the EMA moves by alpha")


def _judge_zclip(name: str, case: _ZCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    steps = out.get("steps", [])
    if out.get("raised") or out.get("traps"):
        at = f"{where}, step {len(steps) - 1}" if steps else where
        return _raised(name, out, at)
    for t, (step, (norm, grads)) in enumerate(zip(steps, _zclip_reference(case))):
        at = f"{where}, step {t} (norm {case.norms[t]:.4g})"
        value = step["value"]
        if "tensor" not in value or value["tensor"].numel() != 1:
            return f"{name}.clip_ returned a {value['type']} {at}; return the pre-clip norm, a 0-dim tensor."
        if not math.isfinite(norm):
            if not _same(step["grads"], case.grads[t]):
                return (f"{name}.clip_ changed the gradients {at}, whose norm is {norm:g}: a non-finite norm "
                        "must leave them untouched (the step will be skipped; multiplying by NaN destroys "
                        "the evidence).")
            continue
        got = value["tensor"].double().item()
        if not _close(got, norm, 1e-4):
            return f"{name}.clip_ returned {got:.6g} {at}; return the norm before clipping, {norm:.6g}."
        if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(step["grads"], grads)):
            want = _coef(case.grads[t], grads)
            return (f"{name}.clip_ scaled the gradients by {_coef(case.grads[t], step['grads']):.6g} {at}; "
                    f"labkit's ZClip scales them by {want:.6g}: {_zclip_hint(case, steps, t, want)}.")
    resumed = out.get("resumed")
    if resumed is not None:
        for t, (a, b) in enumerate(zip(resumed["steps"], steps)):
            if t >= case.resume_at and not (_same(a["grads"], b["grads"]) and _same(
                    [a["value"].get("tensor")], [b["value"].get("tensor")])):
                return (f"{name} did not resume bit for bit {where}: loaded from state_dict() at step "
                        f"{case.resume_at}, it clipped step {t} differently from the clipper that ran "
                        "straight on. state_dict() must hold every piece of state (mean, var, the warm-up "
                        "buffer and its count), and load_state_dict() must put all of it back.")
    return None


# ---------------------------------------------------------------- 4. a rolling-window spike detector


@dataclass
class _DetCase:
    """A series of (loss, gradient norm) fed to a detector, one step at a time."""

    name: str
    series: list[tuple[float, float]]
    window: int
    skip_z: float | None
    clip_z: float | None

    @property
    def config(self) -> dict[str, Any]:
        return {"window": self.window, "skip_z": self.skip_z, "clip_z": self.clip_z}


def _decisions(case: _DetCase, mistake: str | None = None) -> list[tuple[str, float | None]]:
    """Return each step's (action, limit): labkit's SpikeDetector as TrainStep drives it, or a mistake's."""
    if mistake is None:
        det = SpikeDetector(case.window, case.skip_z, case.clip_z)
        out: list[tuple[str, float | None]] = []
        for loss, norm in case.series:
            if not (math.isfinite(loss) and math.isfinite(norm)):
                out.append(("skip", None))
                continue
            action, _ = det.decide(*det.score(loss, norm))
            if action == "skip":
                out.append(("skip", None))
            elif action == "clip":
                limit = det.clip_limit()
                out.append(("clip", limit))
                det.observe(loss, limit, admitted=True)
            else:
                out.append(("log", None))
                det.observe(loss, norm, admitted=True)
        return out
    losses: list[float] = []
    norms: list[float] = []
    out = []
    need = 2 if mistake == "early" else case.window // 2

    def z(values: list[float], x: float) -> float:
        values = (values + [x])[-case.window:] if mistake == "current" else values[-case.window:]
        n = len(values)
        if n < need or not math.isfinite(x):
            return math.nan
        mean = sum(values) / n
        var = sum((v - mean) ** 2 for v in values) / (n - 1 if mistake == "sample" and n > 1 else n)
        std = math.sqrt(var) if var >= 0 else math.nan
        if std == 0:
            return 0.0 if x == mean else math.copysign(math.inf, x - mean)
        value = (x - mean) / std
        return abs(value) if mistake == "abs" else value

    for loss, norm in case.series:
        finite = math.isfinite(loss) and math.isfinite(norm)
        zl, zg = z(losses, loss), z(norms, norm)
        action, limit = "log", None
        if not finite or case.skip_z is not None and (zl > case.skip_z or zg > case.skip_z):
            action = "skip"
        elif case.clip_z is not None and zg > case.clip_z:
            recent = norms[-case.window:]
            mean = sum(recent) / len(recent)
            limit = mean + case.clip_z * math.sqrt(sum((v - mean) ** 2 for v in recent) / len(recent))
            action = "clip"
        out.append((action, limit))
        if mistake == "nonfinite":
            admit = action != "skip" or not finite
        else:
            admit = finite and (action != "skip" or mistake == "skipped")
        if admit:
            losses.append(loss)
            norms.append(norm if mistake == "raw" or action != "clip" else limit)
    return out


DETECTOR_MISTAKES = {
    "skipped": "a skipped spike entered your window: it never trained, and in the window it widens the band, "
               "so the next spike passes (inflation)",
    "nonfinite": "a NaN/inf entered your window: it must be skipped and never admitted",
    "current": "the z-score is against the previous values only (OLMo-core): leave the current one out of "
               "its window",
    "abs": "only increases count: a loss or norm far *below* its mean is good news, not a spike",
    "early": "the detector stays inactive until the window holds window // 2 values (OLMo-core's warm-up)",
    "raw": "a clipped step enters the norm window with its clipped norm (the limit), as TrainStep admits it",
    "sample": "the standard deviation is the population one here (divide by n, as labkit's SpikeDetector), "
              "not the sample one (n - 1) that OLMo-core's torch.std_mean takes",
}


def _det_series(rnd: random.Random, n: int) -> list[tuple[float, float]]:
    loss, level, out = rnd.uniform(2.0, 5.0), rnd.uniform(0.5, 2.0), []
    for _ in range(n):
        loss *= math.exp(rnd.gauss(-0.01, 0.01))
        out.append((loss, level * math.exp(rnd.gauss(0.0, 0.05))))
    return out


def _det_cases(hidden: bool, seed: int) -> list[_DetCase]:
    rnd = random.Random(seed if hidden else 0)
    if not hidden:
        base = _det_series(rnd, 48)
        spikes = list(base)
        spikes[20] = (spikes[20][0] * 3, spikes[20][1])  # a loss spike: skip
        spikes[30] = (spikes[30][0], spikes[30][1] * 20)  # a norm spike: skip
        spikes[31] = (spikes[31][0], spikes[31][1] * 20)  # right after it: judged by the window before both
        spikes[40] = (math.nan, spikes[40][1])
        spikes[44] = (spikes[44][0] * 3, spikes[44][1])  # a loss spike after the NaN loss: still judged
        spikes[3] = (spikes[3][0] * 50, spikes[3][1])  # in the warm-up: nothing acts yet
        clips = list(base)
        clips[25] = (clips[25][0], clips[25][1] * 1.2)
        clips[35] = (clips[35][0] * 0.5, clips[35][1] * 0.4)  # a drop: good news
        clips[36] = (clips[36][0], clips[36][1] * 30)
        clips[40] = (clips[40][0], clips[40][1] * 1.2)
        return [_DetCase("loss and norm spikes, a NaN, window=16, skip_z=6", spikes, 16, 6.0, None),
                _DetCase("clip at 3 sigma, skip at 6, a drop, window=16", clips, 16, 6.0, 3.0)]
    cases = []
    for k in range(2):
        window = rnd.choice([8, 12, 16])
        series = _det_series(rnd, rnd.randint(56, 64))
        warm = rnd.randrange(2, window // 2)
        series[warm] = (series[warm][0] * 100, series[warm][1] * 100)  # in the warm-up: nothing acts yet
        # each event at its own step, each judged by a window the earlier ones would spoil if admitted: a NaN,
        # two norm spikes in a row, a loss spike, a drop (good news), moderate rises (clipped with a clip_z)
        bad = rnd.randint(window + 2, window + 6)  # after the warm-up spike has left the window
        series[bad] = (rnd.choice([math.nan, math.inf]), series[bad][1]) if k else (series[bad][0], math.nan)
        burst = bad + rnd.randint(2, 4)
        first = rnd.uniform(20, 50)
        series[burst] = (series[burst][0], series[burst][1] * first)
        series[burst + 1] = (series[burst + 1][0], series[burst + 1][1] * first * 0.8)
        loss_spike = burst + 3
        series[loss_spike] = (series[loss_spike][0] * rnd.uniform(2, 4), series[loss_spike][1])
        drop = loss_spike + 2
        series[drop] = (series[drop][0] * rnd.uniform(0.2, 0.5), series[drop][1] * rnd.uniform(0.1, 0.3))
        for i in range(drop + window, len(series), 4):
            series[i] = (series[i][0], series[i][1] * rnd.uniform(1.16, 1.22))  # z 3 to 4.5: clip, not skip
        skip_z = rnd.uniform(5.0, 7.0)
        clip_z = rnd.uniform(2.0, 2.8) if k else None
        cases.append(_DetCase(f"random series #{k}, window={window}, skip_z={skip_z:.3g}"
                              + (f", clip_z={clip_z:.3g}" if clip_z else ""), series, window, skip_z, clip_z))
    flat = [(2.0, 1.0)] * 12 + [(2.0, 1.5), (2.0, 1.0)]  # a constant window: any rise is an infinite z
    cases.append(_DetCase("a constant window, then a small rise", flat, 8, 6.0, None))
    return cases


def _run_detector(fn: Callable, case: _DetCase) -> dict[str, Any]:
    traps: list[str] = []
    with _forbid(SPIKE_FUNCS, "write the detector", traps):
        made = _call(fn, **case.config)
        steps = []
        if "raised" not in made:
            for loss, norm in case.series:
                out = _call(made["value"].decide, loss, norm)
                out["value"] = _ship(out.get("value"))
                steps.append(out)
                if "raised" in out or traps:
                    made = {k: out[k] for k in ("raised", "message", "_exc") if k in out}
                    break
    ended = {k: made[k] for k in ("raised", "message", "_exc") if k in made}
    return {**ended, "steps": steps, "traps": traps}


def _judge_detector(name: str, case: _DetCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    steps = out["steps"]
    raised = _raised(name, out, f"{where}, step {len(steps) - 1}" if steps else where)
    if raised:
        return raised
    want = _decisions(case)
    got = []
    for t, step in enumerate(steps):
        try:
            action, limit = _plain(step["value"])
            got.append((action, None if limit is None else float(limit)))
        except (TypeError, ValueError):
            return (f"{name}.decide returned a {step['value']['type']} {where}, step {t}; return (action, "
                    "limit): ('log', None), ('clip', the norm to clip to) or ('skip', None).")
    for t, ((action, limit), (mine, mine_limit)) in enumerate(zip(got, want)):
        if action == mine and (limit is None) == (mine_limit is None) and \
                (limit is None or _close(limit, mine_limit, 1e-5)):
            continue
        loss, norm = case.series[t]
        hint = next((h for m, h in DETECTOR_MISTAKES.items() if _same_decisions(got, _decisions(case, m))),
                    None)
        if hint is None and mine == "clip" and action == "clip":
            hint = "clip to mean + clip_z * std of the norm window (the values before this step)"
        elif hint is None:
            hint = ("a NaN/inf loss or norm is skipped and never admitted; skip when the loss or the norm "
                    "z-score exceeds skip_z, else clip when the norm's exceeds clip_z; z against the "
                    "previous window (population std), inactive until window // 2 values; only steps that "
                    "trained enter the window")
        shown = f"({action!r}, {limit:.6g})" if limit is not None else f"({action!r}, None)"
        expected = f"({mine!r}, {mine_limit:.6g})" if mine_limit is not None else f"({mine!r}, None)"
        return (f"{name}.decide(loss={loss:.4g}, norm={norm:.4g}) returned {shown} {where}, step {t}; "
                f"expected {expected}: {hint}.")
    return None


def _same_decisions(a: list[tuple[str, float | None]], b: list[tuple[str, float | None]]) -> bool:
    return len(a) <= len(b) and all(x[0] == y[0] and (x[1] is None) == (y[1] is None) and
                                    (x[1] is None or _close(x[1], y[1], 1e-5)) for x, y in zip(a, b))


# ---------------------------------------------------------------- 5. Adam or SGD: what a clip does


@dataclass
class _EffectCase:
    """A small model warmed up by an optimizer on one seed, then a spike batch clipped to ``max_norm``."""

    name: str
    optimizer: str
    lr: float
    seed: int
    spike: float
    cut: float  # max_norm as a fraction of the spike batch's gradient norm
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warm: int = 20

    def _build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        if self.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=self.lr,
                                                         momentum=self.momentum)
        elif self.optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=self.lr, betas=self.betas,
                                    weight_decay=self.weight_decay)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=self.lr, betas=self.betas)
        return model, opt

    def batch(self, i: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + i)
        x = torch.randn(32, 8, generator=gen)
        return x, torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(32, 1, generator=gen)

    @functools.cached_property
    def _warm(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, opt = self._build()
        for i in range(self.warm):
            x, y = self.batch(i)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return model, opt

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Return a new (model, optimizer) in the warmed-up state: every call the same state."""
        return copy.deepcopy(self._warm)

    @property
    def inputs(self) -> tuple[Tensor, Tensor]:
        x, y = self.batch(self.warm)
        return x * self.spike, y

    @functools.cached_property
    def max_norm(self) -> float:
        model, _ = self.fresh()
        x, y = self.inputs
        nn.functional.mse_loss(model(x), y).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        return float(f"{norm * self.cut:.3g}")


def _update_ratio(case: _EffectCase, mistake: str | None = None) -> float:
    """Return |update clipped| / |update unclipped| from the same state (or under a classic mistake)."""
    deltas, model, opt = [], None, None
    for clip in (False, True):
        if model is None or mistake != "same_model":
            model, opt = case.fresh()
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        x, y = case.inputs
        nn.functional.mse_loss(model(x), y).backward()
        if clip:
            norm = ref_clip_grad_norm_(model.parameters(), case.max_norm)
            if mistake == "gradient":
                return min(1.0, case.max_norm / (norm.item() + 1e-6))
        opt.step()
        delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
        deltas.append(torch.linalg.vector_norm(delta).item())
    ratio = deltas[1] / deltas[0]
    return 1 / ratio if mistake == "inverse" else ratio


EFFECT_MISTAKES = {
    "gradient": "that is what clipping did to the gradient (the clip coefficient); the question is what it "
                "did to the update: compare the parameters after the step with those before it",
    "same_model": "the second step started where the first one ended: call fresh() again, so the clipped and "
                  "the unclipped step start from the same weights and the same optimizer state",
    "inverse": "that is the inverse: return |update with the clip| / |update without it|",
}


def _effect_cases(hidden: bool, seed: int) -> list[_EffectCase]:
    if not hidden:
        return [_EffectCase("SGD, lr 0.05, a 20x spike cut to a tenth", "sgd", 0.05, 0, 20.0, 0.1),
                _EffectCase("Adam, lr 1e-3, a 20x spike cut to a tenth", "adam", 1e-3, 0, 20.0, 0.1)]
    rnd = random.Random(seed)
    spike, cut = rnd.uniform(5.0, 50.0), rnd.uniform(0.02, 0.3)
    sgd_lr, momentum = rnd.choice([0.01, 0.05]), rnd.choice([0.5, 0.9])
    adam_lr, wd = rnd.choice([3e-4, 1e-3, 3e-3]), rnd.choice([0.01, 0.1])
    return [_EffectCase(f"SGD, lr {sgd_lr:g}", "sgd", sgd_lr, seed, spike, cut),
            _EffectCase(f"SGD with momentum {momentum:g}", "sgd", sgd_lr, seed + 1, spike, cut,
                        momentum=momentum),
            _EffectCase(f"Adam, betas (0.9, 0.95), lr {adam_lr:g}", "adam", adam_lr, seed + 2, spike, cut,
                        betas=(0.9, 0.95)),
            _EffectCase(f"AdamW, weight_decay {wd:g}", "adamw", adam_lr, seed + 3, spike, cut,
                        weight_decay=wd)]


def _run_effect(fn: Callable, case: _EffectCase) -> dict[str, Any]:
    x, y = case.inputs
    out = _call(fn, case.fresh, nn.functional.mse_loss, x.clone(), y.clone(), case.max_norm)
    out["value"] = _ship(out.get("value"))
    return out


def _judge_effect(name: str, case: _EffectCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(f"{case.name}, max_norm={case.max_norm:g}", hidden, seed)
    raised = _raised(name, out, where)
    if raised:
        return raised
    try:
        got = float(_plain(out["value"]))
    except (TypeError, ValueError):
        return f"{name} returned a {out['value']['type']} {where}; return the ratio as a number."
    want = _update_ratio(case)
    if _close(got, want, 1e-3):
        return None
    hint = next((h for m, h in EFFECT_MISTAKES.items() if _close(got, _update_ratio(case, m), 1e-3)), None)
    if hint is None:
        hint = ("run one step without clipping and one with labkit.clip_grad_norm_(..., max_norm) after "
                "backward, each from fresh(), and divide the norms of the two updates (parameters after "
                "minus before)")
    return f"{name} returned {got:.6g} {where}, expected {want:.6g}: {hint}."


# ---------------------------------------------------------------- the checks, in process and split


CHECKS = {
    "check_read_run": Check(_read_cases, _run_read, _judge_read),
    "check_fp16_range": Check(_range_cases, _run_range, _judge_range),
    "check_zscore_clipper": Check(_zclip_cases, _run_zclip, _judge_zclip),
    "check_spike_detector": Check(_det_cases, _run_detector, _judge_detector),
    "check_clip_effect": Check(_effect_cases, _run_effect, _judge_effect),
}
BANNED = {"check_read_run": SPIKE_FUNCS, "check_fp16_range": (), "check_zscore_clipper": ZCLIP_FUNCS,
          "check_spike_detector": SPIKE_FUNCS, "check_clip_effect": ()}


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
    check(CHECKS["check_read_run"], fn, hidden, seed, BANNED["check_read_run"])


def check_fp16_range(fn: Callable[[list[Tensor], float], tuple], hidden: bool = False,
                     seed: int | None = None) -> None:
    """Check ``fn(grads, scale) -> (flushed, overflowed)``: the fractions fp16 turns into 0 and into inf.

    The reference is torch's own cast, ``(g * scale).half()``: ``flushed`` counts the nonzero
    entries that become 0, ``overflowed`` the entries that become inf, over all entries.

    >>> def fp16_range(grads, scale):
    ...     g = torch.cat([t.flatten() for t in grads])
    ...     half = (g * scale).half()
    ...     return ((g != 0) & (half == 0)).float().mean(), half.isinf().float().mean()
    >>> check_fp16_range(fp16_range, hidden=True, seed=0)
    """
    check(CHECKS["check_fp16_range"], fn, hidden, seed, BANNED["check_fp16_range"])


def check_zscore_clipper(fn: Callable[..., Any], hidden: bool = False, seed: int | None = None) -> None:
    """Check the class ``fn(alpha, z_thresh, warmup, eps)`` against ``labkit.clippers.ZClip``, step by step.

    Its ``clip_(parameters)`` clips in place and returns the pre-clip norm with no host sync;
    a non-finite norm leaves the gradients and the statistics untouched; ``state_dict()`` /
    ``load_state_dict()`` resume bit for bit (through ``torch.save``, ``weights_only=True``).
    """
    check(CHECKS["check_zscore_clipper"], fn, hidden, seed, BANNED["check_zscore_clipper"])


def check_spike_detector(fn: Callable[..., Any], hidden: bool = False, seed: int | None = None) -> None:
    """Check the class ``fn(window, skip_z, clip_z)`` against ``SpikeDetector`` as ``TrainStep`` uses it.

    ``decide(loss, norm)`` returns ``("skip", None)``, ``("clip", limit)`` or ``("log", None)``
    for one step and then admits it (skipped and non-finite steps never enter the windows; a
    clipped one enters with its limit).
    """
    check(CHECKS["check_spike_detector"], fn, hidden, seed, BANNED["check_spike_detector"])


def check_clip_effect(fn: Callable[..., float], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(fresh, loss_fn, inputs, targets, max_norm) -> |update clipped| / |update unclipped|``.

    ``fresh()`` returns a new ``(model, optimizer)`` in the same warmed-up state each call;
    one step without clipping and one with ``max_norm`` are compared (SGD, with momentum,
    Adam, AdamW), within 0.1% of labkit's run.

    >>> import labkit
    >>> def clip_effect(fresh, loss_fn, inputs, targets, max_norm):
    ...     sizes = []
    ...     for clip in (False, True):
    ...         model, optimizer = fresh()
    ...         before = [p.detach().clone() for p in model.parameters()]
    ...         optimizer.zero_grad()
    ...         loss_fn(model(inputs), targets).backward()
    ...         if clip:
    ...             labkit.clip_grad_norm_(model.parameters(), max_norm)
    ...         optimizer.step()
    ...         after = model.parameters()
    ...         sizes.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(after, before)]).norm())
    ...     return (sizes[1] / sizes[0]).item()
    >>> check_clip_effect(clip_effect, hidden=True, seed=0)
    """
    check(CHECKS["check_clip_effect"], fn, hidden, seed, BANNED["check_clip_effect"])
