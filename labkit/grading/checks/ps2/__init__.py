"""Problem set 2's checks: real instabilities and spike defenses (after lessons 04 and 05).

One module per part (and ``tiny_gpt``, the model whose real runs the first two read):

1. ``read_run``, ``check_read_run``: backoffs and z-score flags read from the records of a
   real fp16 GPT run, produced here from a recorded seed (a 1-layer GPT: a fifth of a second);
2. ``fp16_range``, ``check_fp16_range``: what fp16 flushes to zero and turns into inf at a
   loss scale, against torch's own cast, on a GPT's real gradients and on the format's edges;
3. ``zclip``, ``check_zscore_clipper``: a NaN-safe EMA z-score clipper against
   ``labkit.clippers.ZClip``, with no host sync, resumed from its ``state_dict`` bit for bit;
4. ``detector``, ``check_spike_detector``: OLMo-core's rolling-window rule against
   ``labkit.SpikeDetector``;
5. ``clip_effect``, ``check_clip_effect``: what a fixed clip does to the update under SGD and
   under Adam.

Each judge that finds a wrong answer replays the classic mistakes of its part (a NaN in the
statistics, the current value in its own window, a step late...) and names the one that
gives the student's numbers.
"""

from __future__ import annotations

from ..core import Check
from . import bans, clip_effect, detector, fp16_range, read_run, zclip
from .clip_effect import check_clip_effect
from .detector import check_spike_detector
from .fp16_range import check_fp16_range
from .read_run import check_read_run
from .zclip import check_zscore_clipper

__all__ = ["BANNED", "CHECKS", "check_clip_effect", "check_fp16_range", "check_read_run",
           "check_spike_detector", "check_zscore_clipper"]

CHECKS: dict[str, Check] = {
    "check_read_run": read_run.CHECK,
    "check_fp16_range": fp16_range.CHECK,
    "check_zscore_clipper": zclip.CHECK,
    "check_spike_detector": detector.CHECK,
    "check_clip_effect": clip_effect.CHECK,
}
# the library functions each part asks the student to write (trapped while it runs)
BANNED: dict[str, tuple[str, ...]] = {
    "check_read_run": bans.SPIKE_FUNCS,
    "check_fp16_range": (),
    "check_zscore_clipper": bans.ZCLIP_FUNCS,
    "check_spike_detector": bans.SPIKE_FUNCS,
    "check_clip_effect": (),
}
