"""Set 2, part 3: a NaN-safe EMA z-score clipper, against ``labkit.clippers.ZClip``.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from labkit.clippers import ZClip

from ..core import (
    Check,
    call_student,
    check,
    close,
    forbid,
    grads_of,
    no_host_sync,
    on_case,
    raised_problem,
    same_bits,
    ship,
)
from .bans import ZCLIP_FUNCS

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
    made = call_student(fn, **case.config)
    if "raised" in made:
        return {**made, "steps": []}
    clipper, steps = made["value"], []
    for t in range(len(case.norms)):
        if t == resume_at:
            saved = call_student(lambda c=clipper: _roundtrip(c.state_dict()))
            if "raised" in saved:
                return {**saved, "steps": steps, "message": f"at the resume (step {t}): {saved['message']}"}
            again = call_student(fn, **case.config)
            loaded = again if "raised" in again else \
                call_student(again["value"].load_state_dict, saved["value"])
            if "raised" in loaded:
                return {**loaded, "steps": steps}
            clipper = again["value"]
        params = case.params(t)
        with no_host_sync(traps, ZCLIP_ADVICE):
            out = call_student(clipper.clip_, params)
        out.update(value=ship(out.get("value")), grads=grads_of(params))
        steps.append(out)
        if "raised" in out or traps:
            return {"steps": steps, **{k: out[k] for k in ("raised", "message", "_exc") if k in out}}
    return {"steps": steps}


def _run_zclip(fn: Callable, case: _ZCase) -> dict[str, Any]:
    traps: list[str] = []
    with forbid(ZCLIP_FUNCS, "write the clipper", traps):
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
        out.append((norm.item(), grads_of(params)))
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
        if sim != right and all(close(a, b, 2e-5) for a, b in zip(coefs, sim)):
            return hint
    if t < case.warmup and want == 1.0:
        return f"the first warmup={case.warmup} finite norms only fill the warm-up buffer: nothing is clipped"
    return ("during the warm-up nothing is clipped; after it, a norm whose z = (norm - mean) / (std + eps) "
            "exceeds z_thresh is clipped to mean + (z_thresh**2 / z) * std, and the EMA moves by alpha")


def _judge_zclip(name: str, case: _ZCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    steps = out.get("steps", [])
    if out.get("raised") or out.get("traps"):
        at = f"{where}, step {len(steps) - 1}" if steps else where
        return raised_problem(name, out, at)
    for t, (step, (norm, grads)) in enumerate(zip(steps, _zclip_reference(case))):
        at = f"{where}, step {t} (norm {case.norms[t]:.4g})"
        value = step["value"]
        if "tensor" not in value or value["tensor"].numel() != 1:
            return f"{name}.clip_ returned a {value['type']} {at}; return the pre-clip norm, a 0-dim tensor."
        if not math.isfinite(norm):
            if not same_bits(step["grads"], case.grads[t]):
                return (f"{name}.clip_ changed the gradients {at}, whose norm is {norm:g}: a non-finite norm "
                        "must leave them untouched (the step will be skipped; multiplying by NaN destroys "
                        "the evidence).")
            continue
        got = value["tensor"].double().item()
        if not close(got, norm, 1e-4):
            return f"{name}.clip_ returned {got:.6g} {at}; return the norm before clipping, {norm:.6g}."
        if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(step["grads"], grads)):
            want = _coef(case.grads[t], grads)
            return (f"{name}.clip_ scaled the gradients by {_coef(case.grads[t], step['grads']):.6g} {at}; "
                    f"labkit's ZClip scales them by {want:.6g}: {_zclip_hint(case, steps, t, want)}.")
    resumed = out.get("resumed")
    if resumed is not None:
        for t, (a, b) in enumerate(zip(resumed["steps"], steps)):
            if t >= case.resume_at and not (same_bits(a["grads"], b["grads"]) and same_bits(
                    [a["value"].get("tensor")], [b["value"].get("tensor")])):
                return (f"{name} did not resume bit for bit {where}: loaded from state_dict() at step "
                        f"{case.resume_at}, it clipped step {t} differently from the clipper that ran "
                        "straight on. state_dict() must hold every piece of state (mean, var, the warm-up "
                        "buffer and its count), and load_state_dict() must put all of it back.")
    return None


CHECK = Check(_zclip_cases, _run_zclip, _judge_zclip)


def check_zscore_clipper(fn: Callable[..., Any], hidden: bool = False, seed: int | None = None) -> None:
    """Check the class ``fn(alpha, z_thresh, warmup, eps)`` against ``labkit.clippers.ZClip``, step by step.

    Its ``clip_(parameters)`` clips in place and returns the pre-clip norm with no host sync;
    a non-finite norm leaves the gradients and the statistics untouched; ``state_dict()`` /
    ``load_state_dict()`` resume bit for bit (through ``torch.save``, ``weights_only=True``).
    """
    check(CHECK, fn, hidden, seed, ZCLIP_FUNCS)
