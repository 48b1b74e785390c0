"""Set 2, part 4: OLMo-core's rolling-window spike rule, against ``labkit.SpikeDetector``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.spikes import SpikeDetector

from ..core import (
    Check,
    as_plain,
    call_student,
    check,
    close,
    forbid,
    on_case,
    raised_problem,
    ship,
)
from .bans import SPIKE_FUNCS


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
    with forbid(SPIKE_FUNCS, "write the detector", traps):
        made = call_student(fn, **case.config)
        steps = []
        if "raised" not in made:
            for loss, norm in case.series:
                out = call_student(made["value"].decide, loss, norm)
                out["value"] = ship(out.get("value"))
                steps.append(out)
                if "raised" in out or traps:
                    made = {k: out[k] for k in ("raised", "message", "_exc") if k in out}
                    break
    ended = {k: made[k] for k in ("raised", "message", "_exc") if k in made}
    return {**ended, "steps": steps, "traps": traps}


def _judge_detector(name: str, case: _DetCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    steps = out["steps"]
    raised = raised_problem(name, out, f"{where}, step {len(steps) - 1}" if steps else where)
    if raised:
        return raised
    want = _decisions(case)
    got = []
    for t, step in enumerate(steps):
        try:
            action, limit = as_plain(step["value"])
            got.append((action, None if limit is None else float(limit)))
        except (TypeError, ValueError):
            return (f"{name}.decide returned a {step['value']['type']} {where}, step {t}; return (action, "
                    "limit): ('log', None), ('clip', the norm to clip to) or ('skip', None).")
    for t, ((action, limit), (mine, mine_limit)) in enumerate(zip(got, want)):
        if action == mine and (limit is None) == (mine_limit is None) and \
                (limit is None or close(limit, mine_limit, 1e-5)):
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
                                    (x[1] is None or close(x[1], y[1], 1e-5)) for x, y in zip(a, b))


CHECK = Check(_det_cases, _run_detector, _judge_detector)


def check_spike_detector(fn: Callable[..., Any], hidden: bool = False, seed: int | None = None) -> None:
    """Check the class ``fn(window, skip_z, clip_z)`` against ``SpikeDetector`` as ``TrainStep`` uses it.

    ``decide(loss, norm)`` returns ``("skip", None)``, ``("clip", limit)`` or ``("log", None)``
    for one step and then admits it (skipped and non-finite steps never enter the windows; a
    clipped one enters with its limit).
    """
    check(CHECK, fn, hidden, seed, SPIKE_FUNCS)
