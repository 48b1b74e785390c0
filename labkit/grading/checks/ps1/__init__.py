"""Problem set 1's checks: the global norm, clipping in place, skip or step, the scale rule, the guarded step.

One module per part: ``norm``, ``clip``, ``skip``, ``scale``, ``step`` (and ``gradients``, the
cases the first three share). Each compares the student's function with labkit's own
(``labkit.grad_norm``, ``clip_grad_norm_``, ``update_scale``, ``TrainStep``) on visible cases
and on a hidden, randomized battery (shapes, fp32/fp16/bf16, ``None`` grads, NaN/Inf,
thresholds) built from ``seed``, quoted in every failure so it can be replayed.
"""

from __future__ import annotations

from ..core import Check
from . import bans, clip, norm, scale, skip, step
from .clip import check_clip
from .norm import check_grad_norm
from .scale import check_update_scale
from .skip import REASONS, check_skip_decision
from .step import check_guarded_step

__all__ = ["BANNED", "CHECKS", "REASONS", "check_clip", "check_grad_norm", "check_guarded_step",
           "check_skip_decision", "check_update_scale"]

CHECKS: dict[str, Check] = {
    "check_grad_norm": norm.CHECK,
    "check_clip": clip.CHECK,
    "check_skip_decision": skip.CHECK,
    "check_update_scale": scale.CHECK,
    "check_guarded_step": step.CHECK,
}
# the library functions each part asks the student to write (trapped while it runs)
BANNED: dict[str, tuple[str, ...]] = {
    "check_grad_norm": bans.NORM_FUNCS,
    "check_clip": bans.CLIP_FUNCS,
    "check_skip_decision": bans.STEP_FUNCS,
    "check_update_scale": bans.SCALE_FUNCS,
    "check_guarded_step": bans.STEP_FUNCS,
}
