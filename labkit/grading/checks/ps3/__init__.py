"""Problem set 3's checks: precision beyond fp16 (after lesson 06).

One module per part (and ``bits``, the neighbours and ulps of bf16 the first two use):

1. ``stale``, ``check_stale_fraction``: the fraction of bf16 updates lost to rounding, against
   ``labkit.formats.bf16.stale_fraction`` (round-to-nearest-even, the weight's own ulp in the
   update's direction), on subnormal, zero and negative weights and exact ties;
2. ``kahan``, ``check_kahan_update``: one Kahan-compensated bf16 update against
   ``labkit.formats.bf16.kahan_add``, step by step along its own trajectory;
3. ``fp8_tiles``, ``check_fp8_tiles``: per-tile (1x128) e4m3 quantization against
   ``labkit.formats.fp8.quantize``, the amax checked before the cast (non-finite: refuse; zero:
   keep the previous scale);
4. ``delayed``, ``check_delayed_scaling``: how many values saturate under delayed and under
   current scaling across a range jump, against ``labkit.formats.fp8.update_amax_history``'s rule.

Each judge that finds a wrong answer replays the classic mistakes of its part and names the one
that gives the student's numbers.
"""

from __future__ import annotations

from ..core import Check
from . import bans, delayed, fp8_tiles, kahan, stale
from .delayed import check_delayed_scaling
from .fp8_tiles import check_fp8_tiles
from .kahan import check_kahan_update
from .stale import check_stale_fraction

__all__ = ["BANNED", "CHECKS", "check_delayed_scaling", "check_fp8_tiles", "check_kahan_update",
           "check_stale_fraction"]

CHECKS: dict[str, Check] = {
    "check_stale_fraction": stale.CHECK,
    "check_kahan_update": kahan.CHECK,
    "check_fp8_tiles": fp8_tiles.CHECK,
    "check_delayed_scaling": delayed.CHECK,
}
# the library functions each part asks the student to write (trapped while it runs)
BANNED: dict[str, tuple[str, ...]] = {
    "check_stale_fraction": bans.STALE_FUNCS,
    "check_kahan_update": bans.KAHAN_FUNCS,
    "check_fp8_tiles": bans.FP8_FUNCS,
    "check_delayed_scaling": bans.FP8_FUNCS,
}
