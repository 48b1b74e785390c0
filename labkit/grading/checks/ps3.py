"""Problem set 3's checks: precision beyond fp16 (after lesson 06).

1. ``check_stale_fraction``: the fraction of bf16 updates lost to rounding, against
   ``labkit.formats.bf16.stale_fraction`` (round-to-nearest-even, the weight's own ulp in the
   update's direction), on subnormal, zero and negative weights and exact ties;
2. ``check_kahan_update``: one Kahan-compensated bf16 update against
   ``labkit.formats.bf16.kahan_add``, step by step along its own trajectory;
3. ``check_fp8_tiles``: per-tile (1x128) e4m3 quantization against ``labkit.formats.fp8.quantize``,
   the amax checked before the cast (non-finite: refuse; zero: keep the previous scale);
4. ``check_delayed_scaling``: how many values saturate under delayed and under current
   scaling across a range jump, against ``labkit.formats.fp8.update_amax_history``'s rule.

Each judge that finds a wrong answer replays the classic mistakes of its part and names the one
that gives the student's numbers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.formats.bf16 import kahan_add, stale_fraction
from labkit.formats.fp8 import check_amax, quantize, update_amax_history

from .core import Check, _call, _close, _forbid, _plain, _raised, _ship, _where, check

__all__ = ["BANNED", "CHECKS", "check_delayed_scaling", "check_fp8_tiles", "check_kahan_update",
           "check_stale_fraction"]

STALE_FUNCS = ("labkit.formats.bf16.stale_fraction", "labkit.formats.bf16._stale",
               "labkit.formats.bf16.StaleMonitor")
KAHAN_FUNCS = ("labkit.formats.bf16.kahan_add", "labkit.formats.bf16.stochastic_round_bf16")
FP8_FUNCS = ("labkit.formats.fp8.quantize", "labkit.formats.fp8.check_amax", "labkit.formats.fp8.Fp8Guard",
             "labkit.formats.fp8.update_amax_history", "labkit.formats.fp8._block_amax",
             "labkit.formats.fp8._block_view", "labkit.formats.fp8._expand")
BF16 = torch.bfloat16
E4M3_MAX = 448.0


def _neighbour(w: Tensor, up: bool | Tensor) -> Tensor:
    direction = torch.where(torch.as_tensor(up), math.inf, -math.inf).to(w.dtype)
    return torch.nextafter(w, direction.expand_as(w))


def _ulp(t: Tensor) -> Tensor:
    """The gap from each entry of ``t`` to its neighbour away from zero, in ``t``'s dtype, as float64."""
    return (_neighbour(t, t >= 0).double() - t.double()).abs()


# ---------------------------------------------------------------- 1. stale updates in bf16


@dataclass
class _StaleCase:
    """A bf16 weight and an fp32 update of the same shape."""

    name: str
    update: Tensor
    weight: Tensor


def _edge_case(rnd: random.Random, gen: torch.Generator) -> _StaleCase:
    """Return powers of two (updates toward 0), exact ties, just past a tie, zero and subnormal weights."""
    weights, updates = [], []

    def add(w: float, u: float) -> None:
        weights.append(w)
        updates.append(u)

    for sign in (1.0, 1.0, -1.0, -1.0):
        p = 2.0 ** rnd.randint(-20, 20) * sign
        half_below = abs(p) * 2.0**-9  # toward zero the gap is half the gap away from it (2**-8, 2**-7)
        add(p, -math.copysign(half_below * rnd.uniform(1.2, 1.9), p))  # between the two half-gaps: survives
    # ties: 4 weights with an even last bit, 8 with an odd one (so no two mistakes below count the same)
    bits = torch.tensor([rnd.uniform(1, 2) * 2.0 ** rnd.randint(-10, 10) * rnd.choice([1, -1])
                         for _ in range(12)])
    bits = bits.to(BF16).view(torch.int16)
    w = torch.cat([bits[:4] & ~1, bits[4:] | 1]).view(BF16)
    for i, wi in enumerate(w):
        up = i % 2 == 0
        half = (_neighbour(wi.reshape(1), up).double() - wi.double()).abs().item() / 2
        sign = 1.0 if up else -1.0
        add(wi.item(), sign * half)  # an exact tie: lost if the weight's last bit is even
        if i < 3:
            add(wi.item(), sign * half * (1 + 2.0**-20))  # just past it: survives (float32 adds say lost)
    for u in (2.0**-134, 2.0**-133 * 0.75, 2.0**-135, 3e-41, 1e-30):
        add(0.0, u * rnd.choice([1.0, -1.0]))  # zero weights: the gap is the smallest subnormal, 2**-133
    for _ in range(4):
        sub = rnd.randint(1, 100) * 2.0**-133  # subnormal bf16 weights: a gap of 2**-133
        add(sub, rnd.choice([0.3, 0.5, 0.7, 1.5]) * 2.0**-133 * rnd.choice([1.0, -1.0]))
    add(rnd.uniform(-3, 3), 0.0)  # zero updates: nothing to lose
    add(1.0, 0.0)
    order = torch.randperm(len(weights), generator=gen)
    return _StaleCase("powers of two, exact ties, subnormal and zero weights",
                      torch.tensor(updates, dtype=torch.float32)[order],
                      torch.tensor(weights).to(BF16)[order])


def _stale_cases(hidden: bool, seed: int) -> list[_StaleCase]:
    gen = torch.Generator().manual_seed(seed)
    if not hidden:
        # around 1 the gap above is 2**-7 (half: 0.0039) and below 2**-8 (half: 0.00195); around 256 it is 2
        w = torch.tensor([1.0, 1.0, 1.0, 1.0, 256.0, 256.0, -1.5, 0.0, 0.0, 3.0], dtype=BF16)
        u = torch.tensor([1e-3, 3e-3, 5e-3, -3e-3, 0.9, 1.5, 4e-3, 1e-41, 1e-38, 0.0])
        weights = (torch.randn(64, 32, generator=gen) * 0.05).to(BF16)
        updates = torch.randn(64, 32, generator=gen) * 1e-4
        updates[::7] = 0.0
        return [_StaleCase("weights around 1 and 256, zeros", u, w),
                _StaleCase("weights ~ N(0, 0.05), AdamW-sized updates ~ 1e-4", updates, weights)]
    rnd = random.Random(seed)
    weights = (torch.randn(200, generator=gen) * 10.0 ** rnd.uniform(-3, 2)).to(BF16)
    updates = (_ulp(weights) * torch.empty(200).uniform_(0.0, 1.5, generator=gen)
               * torch.where(torch.rand(200, generator=gen) < 0.5, -1.0, 1.0)).float()
    updates[torch.rand(200, generator=gen) < 0.1] = 0.0
    return [_StaleCase("random weights, updates from 0 to 1.5 ulps", updates, weights), _edge_case(rnd, gen)]


def _lost(case: _StaleCase, mistake: str | None = None) -> float:
    """Return the fraction of nonzero updates lost: labkit's rule, or a classic mistake's."""
    u, w = case.update, case.weight
    moving = u != 0
    if mistake is None:
        return stale_fraction(u, w, mask=moving).item()
    if mistake == "zeros":
        return stale_fraction(u, w).item()
    if mistake in ("up", "away"):  # the gap toward +inf, or away from zero, whatever the update's direction
        neighbour = _neighbour(w, True) if mistake == "up" else _neighbour(w, w >= 0)
        half = (neighbour.double() - w.double()).abs() / 2
        lost = (u.double().abs() < half) | ((u.double().abs() == half) & (w.view(torch.int16) % 2 == 0))
    elif mistake in ("strict", "le"):
        half = (_neighbour(w, u >= 0).double() - w.double()).abs() / 2
        lost = u.double().abs() < half if mistake == "strict" else u.double().abs() <= half
    elif mistake == "fp32":
        lost = (w.float() + u).to(BF16) == w
    else:  # "relative": an ulp from a formula, not from the weight's own bits
        lost = u.abs() < w.float().abs() * 2.0**-9
    return ((lost & moving).sum() / moving.sum().clamp(min=1)).item()


STALE_MISTAKES = {
    "zeros": "a zero update has nothing to lose: count only the entries whose update is nonzero, and "
             "divide by them",
    "up": "the gap that matters is the one in the update's direction: below a power of two it is half the "
          "gap above (torch.nextafter(w, -inf) for a negative update)",
    "away": "the gap that matters is the one in the update's direction: below a power of two it is half the "
            "gap above (torch.nextafter(w, -inf) for a negative update)",
    "strict": "an update of exactly half an ulp is a tie, and a tie rounds to even: it is lost when the "
              "weight's last bit is even (w.view(torch.int16) % 2 == 0)",
    "le": "an update of exactly half an ulp is a tie, and a tie rounds to even: it survives when the "
          "weight's last bit is odd (w.view(torch.int16) % 2 == 1)",
    "fp32": "adding in float32 first rounds twice: an update just past a tie becomes the tie in float32, "
            "then rounds back to the weight in bf16. Compare |u| with half the gap, exactly",
    # bf16 keeps 8 significant bits: in [2**e, 2**(e+1)) the gap is 2**(e-7); the gap below 2**e is half that
    "relative": "|w| * 2**-9 is half the gap only *below* a power of two (w = 2**e, a downward update); "
                "everywhere else it undercounts (above 2**e half the gap is 2**(e-8), up to twice |w| * "
                "2**-9), and it is 0 at w = 0: take the weight's real neighbour in the update's direction, "
                "torch.nextafter(w, torch.where(u > 0, inf, -inf)), which also works at 0 and for subnormal "
                "weights",
}


def _run_stale(fn: Callable, case: _StaleCase) -> dict[str, Any]:
    traps: list[str] = []
    with _forbid(STALE_FUNCS, "count the lost updates", traps):
        out = _call(fn, case.update.clone(), case.weight.clone())
    out.update(traps=traps, value=_ship(out.get("value")))
    return out


def _judge_stale(name: str, case: _StaleCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    raised = _raised(name, out, where)
    if raised:
        return raised
    try:
        got = float(_plain(out["value"]))
    except (TypeError, ValueError):
        return f"{name} returned a {out['value']['type']} {where}; return the fraction as a number."
    want = _lost(case)
    if _close(got, want, 1e-6):
        return None
    hint = next((h for m, h in STALE_MISTAKES.items() if _close(got, _lost(case, m), 1e-6)), None)
    if hint is None:
        hint = ("an update is lost when w + u rounds back to w in bf16 (round to nearest, ties to even): |u| "
                "below half the gap to the weight's neighbour in the update's direction, or exactly half "
                "with an even w")
    return f"{name} returned {got:.6g} {where}, expected {want:.6g}: {hint}."


# ---------------------------------------------------------------- 2. a Kahan-compensated bf16 update


@dataclass
class _KahanCase:
    """Steps of labkit's Kahan-compensated trajectory: each (weight, update, compensation) given in turn."""

    name: str
    steps: list[tuple[Tensor, Tensor, Tensor]]


def _trajectory(name: str, weight: Tensor, updates: list[Tensor]) -> _KahanCase:
    steps, c = [], torch.zeros_like(weight)
    for u in updates:
        steps.append((weight, u, c))
        weight, c = kahan_add(weight, u, c)
    return _KahanCase(name, steps)


def _kahan_cases(hidden: bool, seed: int) -> list[_KahanCase]:
    gen = torch.Generator().manual_seed(seed)
    if not hidden:
        one = _trajectory("300 updates of 1e-3 to w = 1", torch.ones(1, dtype=BF16),
                          [torch.tensor([1e-3])] * 300)
        w = (torch.randn(64, generator=gen) * 0.1).to(BF16)
        mixed = _trajectory("64 weights ~ N(0, 0.1), 50 updates ~ 1e-3", w,
                            [torch.randn(64, generator=gen) * 1e-3 for _ in range(50)])
        return [one, mixed]
    rnd = random.Random(seed)
    w = (torch.randn(64, generator=gen) * 10.0 ** rnd.uniform(-2, 1)).to(BF16)
    ulp = _ulp(w).float()
    # about an ulp of each weight: there the compensation matters
    near = [ulp * torch.empty(64).uniform_(0.2, 3.0, generator=gen)
            * torch.where(torch.rand(64, generator=gen) < 0.5, -1.0, 1.0) for _ in range(40)]
    small = [torch.randn(64, generator=gen) * 10.0 ** rnd.uniform(-5, -3) for _ in range(40)]
    return [_trajectory("updates of 0.2 to 3 ulps of each weight", w, near),
            _trajectory("small updates, mixed signs", (torch.randn(64, generator=gen)).to(BF16), small)]


def _kahan_mistake(w: Tensor, u: Tensor, c: Tensor, mistake: str) -> tuple[Tensor, Tensor]:
    """Return one step computed with a classic mistake."""
    y = u.float() + (0.0 if mistake == "nocomp" else c.float())
    if mistake == "bf16":
        y = y.to(BF16).float()
    new = (w.float() + y).to(w.dtype)
    if mistake == "stale":
        return new, c
    carry = (new.float() - w.float()) - y if mistake == "sign" else y - (new.float() - w.float())
    return new, carry.to(c.dtype)


KAHAN_MISTAKES = {
    "nocomp": "the compensation was never added back: y = update + compensation is what goes into the weight",
    "sign": "the compensation has the wrong sign: it is what the rounding lost, y - (new - weight)",
    "bf16": "y = update + compensation was rounded to bf16 before the add: do the arithmetic in float32 and "
            "round only the results",
    "stale": "the compensation never changes: return the new one, y - (new - weight), rounded to bf16",
}


def _run_kahan(fn: Callable, case: _KahanCase) -> dict[str, Any]:
    traps: list[str] = []
    outs = []
    with _forbid(KAHAN_FUNCS, "write the compensated update", traps):
        for w, u, c in case.steps:
            out = _call(fn, w.clone(), u.clone(), c.clone())
            out["value"] = _ship(out.get("value"))
            outs.append(out)
            if "raised" in out or traps:
                break
    last = outs[-1]
    return {**{k: last[k] for k in ("raised", "message", "_exc") if k in last}, "steps": outs, "traps": traps}


def _within_ulp(got: Tensor, want: Tensor) -> bool:
    """Whether ``got`` is ``want`` or one of its two neighbours, entry by entry (bf16)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    near = torch.stack([want, _neighbour(want, True), _neighbour(want, False)])
    return bool((got.unsqueeze(0) == near).any(dim=0).all())


def _judge_kahan(name: str, case: _KahanCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    steps = out["steps"]
    raised = _raised(name, out, f"{where}, step {len(steps) - 1}" if steps else where)
    if raised:
        return raised
    for t, (step, (w, u, c)) in enumerate(zip(steps, case.steps)):
        at = f"{where}, step {t}"
        items = step["value"].get("items", [])
        if len(items) != 2 or any("tensor" not in i for i in items):
            return f"{name} returned a {step['value']['type']} {at}; return (new_weight, new_compensation)."
        got_w, got_c = (i["tensor"] for i in items)
        if got_w.dtype != BF16 or got_c.dtype != BF16:
            return (f"{name} returned a {got_w.dtype} weight and a {got_c.dtype} compensation {at}: both "
                    "stay bf16 (16 + 16 bits per weight is the point), only the arithmetic is float32.")
        want_w, want_c = kahan_add(w, u, c)
        if _within_ulp(got_w, want_w) and _within_ulp(got_c, want_c):
            continue
        hint = next((h for m, h in KAHAN_MISTAKES.items()
                     if all(torch.equal(a, b) for a, b in zip((got_w, got_c), _kahan_mistake(w, u, c, m)))),
                    None)
        bad = int((~((got_w == want_w) & (got_c == want_c))).nonzero()[0, 0]) if got_w.numel() > 1 else 0
        shown = (f"weight={w.view(-1)[bad].item():.6g}, update={u.view(-1)[bad].item():.6g}, compensation="
                 f"{c.view(-1)[bad].item():.6g} gave ({got_w.view(-1)[bad].item():.6g}, "
                 f"{got_c.view(-1)[bad].item():.6g}), expected ({want_w.view(-1)[bad].item():.6g}, "
                 f"{want_c.view(-1)[bad].item():.6g})")
        hint = hint or ("y = update + compensation; new = round(weight + y) to bf16; compensation = "
                        "round(y - (new - weight)) to bf16, in float32")
        return f"{name} {at}: {shown}: {hint}."
    return None


# ---------------------------------------------------------------- 3. per-tile FP8 quantization


@dataclass
class _TileCase:
    """An fp32 activation (rows, 128 * k) and the scales of the previous step, one per 1x128 tile."""

    name: str
    x: Tensor
    previous: Tensor


def _activation(gen: torch.Generator, rows: int, tiles: int, outliers: dict[int, float],
                tiny: bool = False) -> Tensor:
    x = torch.randn(rows, 128 * tiles, generator=gen)
    for column, factor in outliers.items():
        x[:, column] *= factor
    if tiny:
        x[-1] *= 1e-6  # one row of tiny values: the e4m3 cast flushes them unless their own tile scales them
    return x


def _tile_cases(hidden: bool, seed: int) -> list[_TileCase]:
    gen = torch.Generator().manual_seed(seed)
    if not hidden:
        x = _activation(gen, 4, 2, {7: 1e4})
        x[2, 128:] = 0.0  # a tile of zeros: padding, or a dead unit
        bad = _activation(gen, 2, 1, {})
        bad[1, 5] = math.inf
        return [_TileCase("4x256, an outlier channel (x1e4), a tile of zeros", x, torch.full((4, 2), 0.01)),
                _TileCase("2x128 with an inf", bad, torch.full((2, 1), 0.01))]
    rnd = random.Random(seed)
    cases = []
    rows, tiles = rnd.randint(2, 12), rnd.randint(2, 4)
    outliers = {c: rnd.uniform(1e3, 1e5) for c in rnd.sample(range(128 * tiles), 2)}
    x = _activation(gen, rows, tiles, outliers, tiny=True)
    zero = (rnd.randrange(rows), rnd.randrange(tiles))
    x[zero[0], zero[1] * 128:(zero[1] + 1) * 128] = 0.0
    previous = torch.rand(rows, tiles, generator=gen) * 0.1 + 1e-3
    name = f"{rows}x{128 * tiles}, outlier channels {sorted(outliers)}, a row of 1e-6, a zero tile"
    cases.append(_TileCase(name, x, previous))
    x2 = _activation(gen, 1, 1, {rnd.randrange(128): rnd.uniform(10, 100)}) * 10.0 ** rnd.uniform(-3, 3)
    cases.append(_TileCase("one tile, one outlier, a random range", x2, torch.full((1, 1), 0.5)))
    for value in (math.nan, -math.inf):
        bad = _activation(gen, rnd.randint(1, 4), rnd.randint(1, 3), {})
        bad.view(-1)[rnd.randrange(bad.numel())] = value
        cases.append(_TileCase(f"a {value} in "
                               f"{tuple(bad.shape)}", bad, torch.full((bad.shape[0], bad.shape[1] // 128),
                                                                                     0.01)))
    return cases


def _tiles_reference(case: _TileCase) -> tuple[Tensor, Tensor, float, float] | None:
    """Return labkit's tile128 e4m3 cast, a zero tile keeping its previous scale; None: refuse (NaN/inf)."""
    if check_amax(case.x, "tile128") == "nonfinite_amax":
        return None
    q = quantize(case.x, "e4m3", "tile128")
    amax = case.x.abs().reshape(case.x.shape[0], -1, 128).amax(dim=-1)
    scale = torch.where(amax > 0, q.scale, case.previous)
    return q.data, scale, q.saturated, q.flushed


def _run_tiles(fn: Callable, case: _TileCase) -> dict[str, Any]:
    traps: list[str] = []
    with _forbid(FP8_FUNCS, "write the cast", traps):
        out = _call(fn, case.x.clone(), case.previous.clone())
    out.update(traps=traps, value=_ship(out.get("value")))
    return out


def _e4m3_steps(a: Tensor, b: Tensor) -> Tensor:
    """Return how many e4m3 values apart ``a`` and ``b`` are, entry by entry (their bits are ordered)."""
    ia, ib = a.view(torch.uint8).long(), b.view(torch.uint8).long()
    signed = lambda i: torch.where(i >= 128, -(i - 128), i)  # noqa: E731 (sign-magnitude to a line)
    return (signed(ia) - signed(ib)).abs()


def _judge_tiles(name: str, case: _TileCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    want = _tiles_reference(case)
    if want is None:
        if out.get("raised") == "ValueError":
            return None
        if out.get("raised") and out["raised"] not in ("NotImplementedError", "trap"):
            return (f"{name} raised {out['raised']} {where}; refuse a non-finite amax with a ValueError that "
                    "says which tile.")
        raised = _raised(name, out, where)
        if raised:
            return raised
        return (f"{name} returned {where} instead of refusing: this tensor holds a NaN or inf, and the e4m3 "
                "cast hides it (inf becomes 448, saturated): check every tile's amax *before* the cast and "
                "raise ValueError.")
    raised = _raised(name, out, where)
    if raised:
        return raised
    items = out["value"].get("items", [])
    if len(items) != 4 or "tensor" not in items[0] or "tensor" not in items[1]:
        return f"{name} returned a {out['value']['type']} {where}; return (data, scale, saturated, flushed)."
    data, scale = items[0]["tensor"], items[1]["tensor"]
    try:
        saturated, flushed = float(_plain(items[2])), float(_plain(items[3]))
    except (TypeError, ValueError):
        return f"{name} returned saturated/flushed that are not numbers {where}."
    want_data, want_scale, want_sat, want_flushed = want
    rows, tiles = case.previous.shape
    if data.dtype != torch.float8_e4m3fn or data.shape != case.x.shape:
        return f"{name} returned data of {data.dtype} {tuple(data.shape)} {where}; cast x to float8_e4m3fn."
    if scale.shape != (rows, tiles):
        hint = "tiles are 1x128: 128 consecutive entries of one row, so the scales are (rows, columns // 128)"
        if scale.numel() == 1:
            hint = "one scale for the whole tensor: one outlier then sets it for every row"
        return f"{name} returned scales of shape {tuple(scale.shape)} {where}, not {(rows, tiles)}: {hint}."
    scale = scale.float()
    if torch.isnan(scale).any() or (scale == 0).any() or torch.isinf(scale).any():
        return (f"{name} returned a scale of {scale[~torch.isfinite(scale) | (scale == 0)][0].item():g} "
                f"{where}: a tile of zeros has amax 0, and amax / 448 = 0 makes its data 0 / 0 = NaN: keep "
                "the previous step's scale for it.")
    if not torch.allclose(scale, want_scale, rtol=1e-6, atol=0):
        if torch.allclose(scale * want_scale, torch.full_like(scale, 1.0), rtol=1e-5) or \
                torch.allclose(1 / scale, want_scale, rtol=1e-5, atol=0):
            hint = "that is the inverse: scale = amax / 448, so that x is about data * scale"
        elif torch.allclose(scale, torch.full_like(scale, want_scale.max().item()), rtol=1e-6):
            hint = ("one scale for the whole tensor: its outlier channel then flushes the other tiles to 0; "
                    "one scale per 1x128 tile of each row")
        elif torch.allclose(*(torch.where(want_scale == case.previous, torch.ones_like(scale), s)
                              for s in (scale, want_scale)), rtol=1e-6):
            hint = "a tile of zeros (amax 0) keeps the previous step's scale (previous_scale), not 1 or 0"
        else:
            hint = "each tile's scale is its amax (the largest |x| of its 128 entries) / 448"
        return f"{name} returned wrong scales {where}: {hint}."
    apart = _e4m3_steps(data, want_data)
    if (apart > 1).any() or (apart > 0).float().mean().item() > 0.01:
        return (f"{name}'s e4m3 data differ from x / scale {where}: divide each entry by its tile's scale, "
                "clamp to +-448, then cast to torch.float8_e4m3fn (round to nearest).")
    if not _close(flushed, want_flushed, 2e-3):
        return (f"{name} returned flushed={flushed:.4g} {where}, expected {want_flushed:.4g}: the fraction "
                "of all entries that were nonzero in x and are 0 in the e4m3 data.")
    if not _close(saturated, want_sat, 1e-6):
        if saturated > 0:
            hint = ("each tile's amax maps to 448 exactly: that is the scale working, not saturating. With "
                    "current scaling nothing lies above the amax its scale was made for, so nothing "
                    "saturates; do not compare x / scale with 448 (the division can round just above it)")
        else:
            hint = "the fraction of entries whose |x| is above the amax their tile's scale was made for"
        return f"{name} returned saturated={saturated:.4g} {where}, expected {want_sat:.4g}: {hint}."
    return None


# ---------------------------------------------------------------- 4. delayed vs current scaling


@dataclass
class _DelayedCase:
    """A tensor per step and the length of the amax history delayed scaling keeps."""

    name: str
    steps: list[Tensor]
    history: int


def _saturation(case: _DelayedCase, mistake: str | None = None) -> tuple[list[int], list[int]]:
    """Return per-step saturated counts under delayed and current scaling: labkit's rule, or a mistake's."""
    keep = max(1, case.history + {"longer": 1, "shorter": -1}.get(mistake or "", 0))
    history = torch.zeros(0)
    delayed, current = [], []
    for x in case.steps:
        magnitude = x.abs()
        amax = magnitude.amax()
        if mistake == "current":
            limit = update_amax_history(history, amax, keep).amax()
        elif not history.numel():
            limit = torch.tensor(0.0) if mistake == "first" else amax
        else:
            limit = history.mean() if mistake == "mean" else history.amax()
        delayed.append(int((magnitude > limit).sum()))
        current.append(int((magnitude > amax).sum()))
        history = update_amax_history(history, amax, keep)
    return delayed, current


DELAYED_MISTAKES = {
    "current": "this step's amax was already in the history when its scale was chosen: delayed scaling takes "
               "the scale from the previous steps' amaxes only, and appends this one after the cast",
    "mean": "delayed scaling takes the largest amax of the history (Transformer Engine's "
            "amax_compute_algo='max'), not their mean",
    "longer": "the history holds the last `history` amaxes, not one more",
    "shorter": "the history holds the last `history` amaxes, not one fewer",
    "first": "with an empty history (the first step) there is nothing to be late about: use this step's "
             "own amax",
}


def _delayed_cases(hidden: bool, seed: int) -> list[_DelayedCase]:
    gen = torch.Generator().manual_seed(seed)
    if not hidden:
        steps = [torch.randn(256, generator=gen) * (10.0 if i == 5 else 1.0) for i in range(8)]
        return [_DelayedCase("8 steps, a 10x jump at step 5, history=4", steps, 4)]
    rnd = random.Random(seed)
    cases = []
    for k in range(2):
        length = rnd.randint(2, 6)
        n = rnd.randint(16, 20)
        scales = [math.exp(rnd.gauss(0, 0.1)) for _ in range(n)]
        big = rnd.randint(1, 3)
        scales[big] *= 8.0  # a large step, then a medium jump just as it leaves (or not) the history
        scales[big + length] *= 4.0
        scales[big + length + 1] *= 0.2  # a drop: delayed scaling wastes range, nothing saturates
        jump = rnd.randint(big + length + 3, n - 2)
        scales[jump] *= rnd.uniform(3.0, 20.0)
        steps = [torch.randn(rnd.choice([64, 256]), generator=gen) * s * 10.0 ** (k - 1) for s in scales]
        name = f"{n} steps, history={length}, jumps at steps {big}, {big + length} and {jump}"
        cases.append(_DelayedCase(name, steps, length))
    return cases


def _run_delayed(fn: Callable, case: _DelayedCase) -> dict[str, Any]:
    traps: list[str] = []
    with _forbid(FP8_FUNCS, "keep the history", traps):
        out = _call(fn, [x.clone() for x in case.steps], case.history)
    out.update(traps=traps, value=_ship(out.get("value"), items=64))
    return out


def _judge_delayed(name: str, case: _DelayedCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    raised = _raised(name, out, where)
    if raised:
        return raised
    try:
        delayed, current = ([int(v) for v in counts] for counts in _plain(out["value"]))
    except (TypeError, ValueError):
        return (f"{name} returned a {out['value']['type']} {where}; return (delayed, current): two lists of "
                "counts, one per step.")
    want_delayed, want_current = _saturation(case)
    if current != want_current:
        return (f"{name}'s current-scaling counts are {current} {where}, expected {want_current}: current "
                "scaling takes the scale from this step's own amax, so no value lies above it.")
    if delayed != want_delayed:
        hint = next((h for m, h in DELAYED_MISTAKES.items() if delayed == _saturation(case, m)[0]), None)
        step = next(i for i, (a, b) in enumerate(zip(delayed, want_delayed)) if a != b)
        hint = hint or ("the scale of a step comes from the largest amax of the previous `history` steps "
                        "(this step's own amax when there is none yet); count the values whose |x| is above "
                        "that amax")
        return (f"{name}'s delayed-scaling counts are {delayed} {where}, expected {want_delayed} (first "
                f"difference at step {step}): {hint}.")
    return None


# ---------------------------------------------------------------- the checks, in process and split


CHECKS = {
    "check_stale_fraction": Check(_stale_cases, _run_stale, _judge_stale),
    "check_kahan_update": Check(_kahan_cases, _run_kahan, _judge_kahan),
    "check_fp8_tiles": Check(_tile_cases, _run_tiles, _judge_tiles),
    "check_delayed_scaling": Check(_delayed_cases, _run_delayed, _judge_delayed),
}
BANNED = {"check_stale_fraction": STALE_FUNCS, "check_kahan_update": KAHAN_FUNCS,
          "check_fp8_tiles": FP8_FUNCS, "check_delayed_scaling": FP8_FUNCS}


def check_stale_fraction(fn: Callable[[Tensor, Tensor], Any], hidden: bool = False,
                         seed: int | None = None) -> None:
    """Check ``fn(update, weight) -> fraction``: of the nonzero fp32 updates, how many bf16 rounds away.

    Lost means ``weight + update`` rounded to the nearest bf16 (ties to even) is ``weight``:
    ``labkit.formats.bf16.stale_fraction(update, weight, mask=update != 0)``.

    >>> import math
    >>> def lost_fraction(update, weight):
    ...     toward = torch.where(update >= 0, math.inf, -math.inf).to(weight.dtype)
    ...     half = (torch.nextafter(weight, toward).double() - weight.double()).abs() / 2
    ...     even = weight.view(torch.int16) % 2 == 0
    ...     lost = (update.double().abs() < half) | ((update.double().abs() == half) & even)
    ...     moving = update != 0
    ...     return (lost & moving).sum() / moving.sum().clamp(min=1)
    >>> check_stale_fraction(lost_fraction, hidden=True, seed=0)
    """
    check(CHECKS["check_stale_fraction"], fn, hidden, seed, BANNED["check_stale_fraction"])


def check_kahan_update(fn: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]], hidden: bool = False,
                       seed: int | None = None) -> None:
    """Check ``fn(weight, update, compensation) -> (weight, compensation)`` against ``precision.kahan_add``.

    bf16 weight and compensation, fp32 update, float32 arithmetic: ``y = u + c``,
    ``w' = bf16(w + y)``, ``c' = bf16(y - (w' - w))``. Each step of labkit's trajectory is
    given in turn; each output must be labkit's or a bf16 neighbour of it.

    >>> def kahan_update(weight, update, compensation):
    ...     y = update.float() + compensation.float()
    ...     new = (weight.float() + y).bfloat16()
    ...     return new, (y - (new.float() - weight.float())).bfloat16()
    >>> check_kahan_update(kahan_update, hidden=True, seed=0)
    """
    check(CHECKS["check_kahan_update"], fn, hidden, seed, BANNED["check_kahan_update"])


def check_fp8_tiles(fn: Callable[[Tensor, Tensor], tuple], hidden: bool = False,
                    seed: int | None = None) -> None:
    """Check ``fn(x, previous_scale) -> (data, scale, saturated, flushed)``: e4m3, one scale per 1x128 tile.

    ``scale = amax / 448`` per tile, the amax checked before the cast: a NaN/inf raises
    ``ValueError``, a zero amax keeps ``previous_scale``'s entry. Graded against
    ``labkit.formats.fp8.quantize(x, "e4m3", "tile128")`` on shapes with outlier channels.

    >>> def quantize_tiles(x, previous_scale):
    ...     tiles = x.reshape(x.shape[0], -1, 128)
    ...     amax = tiles.abs().amax(dim=-1)
    ...     if not torch.isfinite(amax).all():
    ...         raise ValueError("a tile holds a NaN or inf")
    ...     scale = torch.where(amax > 0, amax / 448, previous_scale)
    ...     data = (tiles / scale[..., None]).clamp(-448, 448).reshape(x.shape).to(torch.float8_e4m3fn)
    ...     flushed = ((x != 0) & (data.float() == 0)).float().mean()
    ...     return data, scale, 0.0, flushed
    >>> check_fp8_tiles(quantize_tiles, hidden=True, seed=0)
    """
    check(CHECKS["check_fp8_tiles"], fn, hidden, seed, BANNED["check_fp8_tiles"])


def check_delayed_scaling(fn: Callable[[list[Tensor], int], tuple], hidden: bool = False,
                          seed: int | None = None) -> None:
    """Check ``fn(steps, history) -> (delayed, current)``: per step, how many values saturate under each.

    Delayed: the scale comes from the largest amax of the previous ``history`` steps (this
    step's own when there is none yet), the history updated after the cast
    (``labkit.formats.fp8.update_amax_history``); current: from this step's amax.

    >>> def saturation(steps, history):
    ...     amaxes, delayed, current = [], [], []
    ...     for x in steps:
    ...         amax = x.abs().max()
    ...         limit = max(amaxes[-history:]) if amaxes else amax
    ...         delayed.append(int((x.abs() > limit).sum()))
    ...         current.append(int((x.abs() > amax).sum()))
    ...         amaxes.append(amax)
    ...     return delayed, current
    >>> check_delayed_scaling(saturation, hidden=True, seed=0)
    """
    check(CHECKS["check_delayed_scaling"], fn, hidden, seed, BANNED["check_delayed_scaling"])
