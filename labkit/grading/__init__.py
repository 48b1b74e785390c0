"""Graded exercises: checks for autograder test cells, and nbgrader-format release and grading.

Test cells call the checks (``check_grad_norm(student_fn)``); instructors run
``python -m labkit.grading release|grade|feedback`` (see ``python -m labkit.grading --help``). The
checks are imported on first use: they need torch, the command line does not. One package of
checks per problem set, one module per part: ``checks.ps1`` (clipping and loss scaling),
``checks.ps2`` (real instabilities and spike defenses), ``checks.ps3`` (precision beyond fp16), ``checks.ps4``
(spikes that gradient clipping cannot see: Adam's update RMS and update clipping).

>>> from labkit.grading import check_update_scale
>>> check_update_scale(  # doctest: +NORMALIZE_WHITESPACE
...     lambda scale, tracker, hysteresis, found_inf, config: (scale, tracker, hysteresis))
Traceback (most recent call last):
...
AssertionError: <lambda>(scale=1024, growth_tracker=0, hysteresis_left=1, found_inf=True) returned
(1024.0, 0, 1), expected (512.0, 0, 0) on the case 'two overflows, hysteresis=1, step 0' with
ScalerConfig(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=1, min_scale=None,
max_scale=None): on this overflow the scale must back off to scale * backoff_factor = 512
(hysteresis_left 1 -> 0).
"""

from typing import Any

# every check a test cell may call, by problem set (the grader replays only these)
CHECK_NAMES = (
    "check_grad_norm", "check_clip", "check_skip_decision", "check_update_scale", "check_guarded_step",
    "check_read_run", "check_fp16_range", "check_zscore_clipper", "check_spike_detector", "check_clip_effect",
    "check_stale_fraction", "check_kahan_update", "check_fp8_tiles", "check_delayed_scaling",
    "check_update_rms", "check_update_clipping", "check_find_spike",
)
__all__ = list(CHECK_NAMES)


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import checks

        return getattr(checks, name)
    raise AttributeError(f"module 'labkit.grading' has no attribute {name!r}")
