"""Set 3, part 3: per-tile (1x128) e4m3 quantization, against ``labkit.formats.fp8.quantize``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.formats.fp8 import check_amax, quantize

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
from .bans import FP8_FUNCS


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
    with forbid(FP8_FUNCS, "write the cast", traps):
        out = call_student(fn, case.x.clone(), case.previous.clone())
    out.update(traps=traps, value=ship(out.get("value")))
    return out


def _e4m3_steps(a: Tensor, b: Tensor) -> Tensor:
    """Return how many e4m3 values apart ``a`` and ``b`` are, entry by entry (their bits are ordered)."""
    ia, ib = a.view(torch.uint8).long(), b.view(torch.uint8).long()
    signed = lambda i: torch.where(i >= 128, -(i - 128), i)  # noqa: E731 (sign-magnitude to a line)
    return (signed(ia) - signed(ib)).abs()


def _judge_tiles(name: str, case: _TileCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(case.name, hidden, seed)
    want = _tiles_reference(case)
    if want is None:
        if out.get("raised") == "ValueError":
            return None
        if out.get("raised") and out["raised"] not in ("NotImplementedError", "trap"):
            return (f"{name} raised {out['raised']} {where}; refuse a non-finite amax with a ValueError that "
                    "says which tile.")
        raised = raised_problem(name, out, where)
        if raised:
            return raised
        return (f"{name} returned {where} instead of refusing: this tensor holds a NaN or inf, and the e4m3 "
                "cast hides it (inf becomes 448, saturated): check every tile's amax *before* the cast and "
                "raise ValueError.")
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    items = out["value"].get("items", [])
    if len(items) != 4 or "tensor" not in items[0] or "tensor" not in items[1]:
        return f"{name} returned a {out['value']['type']} {where}; return (data, scale, saturated, flushed)."
    data, scale = items[0]["tensor"], items[1]["tensor"]
    try:
        saturated, flushed = float(as_plain(items[2])), float(as_plain(items[3]))
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
    if not close(flushed, want_flushed, 2e-3):
        return (f"{name} returned flushed={flushed:.4g} {where}, expected {want_flushed:.4g}: the fraction "
                "of all entries that were nonzero in x and are 0 in the e4m3 data.")
    if not close(saturated, want_sat, 1e-6):
        if saturated > 0:
            hint = ("each tile's amax maps to 448 exactly: that is the scale working, not saturating. With "
                    "current scaling nothing lies above the amax its scale was made for, so nothing "
                    "saturates; do not compare x / scale with 448 (the division can round just above it)")
        else:
            hint = "the fraction of entries whose |x| is above the amax their tile's scale was made for"
        return f"{name} returned saturated={saturated:.4g} {where}, expected {want_sat:.4g}: {hint}."
    return None


CHECK = Check(_tile_cases, _run_tiles, _judge_tiles)


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
    check(CHECK, fn, hidden, seed, FP8_FUNCS)
