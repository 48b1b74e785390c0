"""The clipping family: one object per method, each ``clip_(parameters) -> Tensor`` (the pre-clip norm).

``NormClip`` (a fixed ``max_norm``), ``ValueClip``, ``AGC`` (unit-wise), ``AdaGC`` (per
tensor), ``ZClip`` (z-score against an EMA), ``AutoClip`` (a percentile of past norms) and
``UpdateNormClip`` (the optimizer's update, Levanter). Each keeps its state on the device,
never lets a NaN/inf into it, resumes bitwise from ``state_dict``, and plugs into the
guarded step as ``TrainStep(..., clipper=ZClip())``. Rules, defaults and sources are in
each class's docstring; research note: beyond-fixed-clipping.md §1.

>>> from labkit.clippers import ZClip
>>> ZClip()
ZClip(alpha=0.97, z_thresh=2.5, warmup=25, feed='clipped')
"""

from .adagc import AdaGC
from .agc import AGC
from .autoclip import AutoClip
from .base import FEEDS, Clipper, GlobalClipper, LockInWarning
from .norm import NormClip
from .update import UpdateNormClip
from .value import ValueClip, clip_grad_value_
from .zclip import ZClip

__all__ = [
    "AGC", "FEEDS", "AdaGC", "AutoClip", "Clipper", "GlobalClipper", "LockInWarning", "NormClip",
    "UpdateNormClip", "ValueClip", "ZClip", "clip_grad_value_",
]
