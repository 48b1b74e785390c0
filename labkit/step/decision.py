"""Unscale, check, clip: what the step does with its gradients, as one pure decision on the device.

The gradients are read once, for the per-tensor norms of the *scaled* gradients
(``unscaled_norms``: a NaN/inf among them is the inf check, and the scale is undone on the
norms, not on the gradients). From the global norm, the scale, the clipper and the hooks'
``Verdict``, ``decide`` returns a ``Decision`` of 0-dim device tensors, with no host sync: the
record's numbers and the one multiply by ``coef / scale`` that unscales and clips. The step
reads them to the host once (``Decision.read``), where a plain optimizer must be skipped from
the host anyway; a fused optimizer's kernel takes them as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..clip import clip_coef, grouped_norms, total_norm
from ..clippers import Clipper
from ..hooks import Verdict

__all__ = ["Decision", "decide", "read", "skip_bad_loss", "unscaled_norms"]


@dataclass(slots=True)
class Decision:
    """What the step does with this step's gradients, and what its record says about them.

    0-dim device tensors; ``host`` holds ``[norm, coef, skip, scale, *extra]`` once ``read`` copied
    them over (one host sync). A loss found non-finite on the host (``skip_bad_loss``) has
    host floats: backward never ran, there is nothing on the device to decide.
    """

    norm: Any  # the global norm of the unscaled gradients, before clipping (logged)
    coef: Any  # min(1, limit / (norm + 1e-6)): 1 is no clip
    skip: Any  # found_inf: the optimizer does not step (nonzero)
    scale: Any  # the loss scale this step ran with
    inv_scale: Tensor | None  # float32(1 / scale), as torch's unscale_; None: a disabled scaler
    threshold: float | Tensor | None = None  # the clipper's level (None: none to report)
    keep_scale: bool = False  # a hook's skip: no scaling problem, the scale stays
    reason: str | None = None  # a hook's skip reason
    hook_clip: bool | Tensor = False  # a hook's clip_to cut deeper than the clipper's
    clip_reason: str | None = None  # that hook's name for it
    fields: dict[str, Any] = field(default_factory=dict)  # record fields from the hooks
    norms: Tensor | None = None  # the per-tensor norms of the unscaled gradients (None: backward was skipped)
    host: list[float] | None = None  # [norm, coef, skip, scale] once read
    measured: list[float] = field(default_factory=list)  # the extra tensors read with them

    def read(self, *extra: Tensor) -> None:
        """Copy the norm, coefficient, skip, scale and ``extra`` over in one read (``host``, ``measured``).

        >>> d = Decision(torch.tensor(5.0), torch.tensor(0.5), torch.tensor(0.0), torch.tensor(2.0), None)
        >>> d.read(torch.tensor(7.0)); d.host, d.measured
        ([5.0, 0.5, 0.0, 2.0], [7.0])
        """
        hook_clip = isinstance(self.hook_clip, Tensor)
        self.host = read(self.norm, self.coef, self.skip, self.scale,
                         *([self.hook_clip] if hook_clip else []), *extra)
        if hook_clip:
            self.hook_clip = bool(self.host.pop(4))
        self.host, self.measured = self.host[:4], self.host[4:]

    def factor(self) -> Tensor | None:
        """Return what the gradients are multiplied by to unscale and clip, ``coef / scale``; None: 1."""
        coef, inv = self.coef, self.inv_scale
        if inv is None:
            return None if self.host is not None and self.host[1] == 1.0 else coef
        factor = coef * inv.to(coef.device)
        return factor if factor.dtype is coef.dtype else factor.to(coef.dtype)  # no cast that does nothing

    def grad_scale(self) -> Tensor | None:
        """Return ``1 / coef``, a fused optimizer's ``grad_scale`` (the scaler adds the scale); None: 1."""
        return None if self.host is not None and self.host[1] == 1.0 else self.coef.reciprocal().float()

    def take(self, done: Tensor | None) -> None:
        """Report what a per-tensor or update clip amounted to, ``[coef, threshold]`` (None: nothing done)."""
        if done is not None:
            self.coef, self.threshold = done[0], done[1]
            if self.host is not None:
                self.host[1] = float(done[0])  # host sync: a per-tensor or update clip, its own read


def read(*tensors: Tensor) -> list[float]:
    """Copy 0-dim tensors to the host in one read (one host sync), in the first one's dtype.

    >>> read(torch.tensor(2.0), torch.tensor(3, dtype=torch.int32))
    [2.0, 3.0]
    """
    first = tensors[0]
    if len(tensors) == 1:
        return [first.item()]
    dtype = first.dtype
    if all(t.dtype is dtype for t in tensors):  # the step's row: one dtype, and one device but rarely
        try:
            return torch.stack(tensors).tolist()
        except RuntimeError:  # on several devices
            pass
    return torch.stack([t.to(first) for t in tensors]).tolist()


def unscaled_norms(
    grads: list[Tensor], scale: Tensor | None, norm_type: float
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Return the per-tensor norms of the unscaled gradients, their global norm and ``1 / scale`` (float32).

    One read of the gradients, as they are (scaled): their norms times ``1 / scale`` are the
    unscaled gradients' norms, so the gradients need no unscale pass of their own. A scaled
    norm overflows float32 above ~1.8e19 where the unscaled one might not: that step skips and
    backs off (``tests/test_fused.py``); a dead scale (set by hand below float32's normal
    range) has ``1/scale = inf``, so its norm is inf or NaN and the step skips too.
    ``scale=None`` (a disabled scaler) undoes nothing.

    >>> norms, norm, inv = unscaled_norms([torch.tensor([6.0]), torch.tensor([8.0])], torch.tensor(2.0), 2.0)
    >>> norms, norm, inv
    (tensor([3., 4.]), tensor(5.), tensor(0.5000))
    """
    scaled, order = grouped_norms(grads, norm_type)
    if scale is None:  # a disabled scaler's scale is 1: nothing to undo
        return scaled, total_norm(scaled, norm_type, order), None
    inv_scale = scale.double().reciprocal().float()  # as torch's unscale_: exact for powers of two
    norms = scaled * inv_scale.to(scaled.device)
    return norms, total_norm(norms, norm_type, order), inv_scale


def decide(
    norm: Tensor, norms: Tensor, scale: Tensor, inv_scale: Tensor | None, clipper: Clipper | None,
    verdict: Verdict, loss_bad: Tensor | None = None,
) -> Decision:
    """Decide on the device, with no host sync: skip on a non-finite norm or a hook's skip, else clip.

    Skip when the norm is not finite, or when a hook says so (then the scale stays); else clip
    by the clipper's coefficient and a hook's ``clip_to``, whichever cuts deeper. ``inv_scale``
    None: a disabled scaler (``scale`` is then 1). ``loss_bad`` (deferred
    records: the loss check stayed on the device) skips the step too. A clipper with state
    (``ZClip``...) gives its coefficient and admits the norm here (``coef_``); a hook's skip
    leaves it unasked.

    >>> from labkit.clippers import NormClip
    >>> one = torch.ones(())
    >>> d = decide(torch.tensor(5.0), torch.tensor([5.0]), one, None, NormClip(1.0), Verdict())
    >>> d.skip, d.coef, d.factor()
    (tensor(0.), tensor(0.2000), tensor(0.2000))
    """
    # inf - inf and NaN - NaN are NaN, the one number unequal to itself: isfinite's answer, as a float
    # (found_inf's dtype), in fewer 0-dim operations
    found_inf = norm - norm
    found_inf = found_inf.ne_(found_inf) if found_inf.dtype == torch.float32 else found_inf.isnan().float()
    if loss_bad is not None:
        found_inf = torch.maximum(found_inf, loss_bad.float().to(found_inf.device))
    if verdict.skip is not None:  # a spike is no scaling problem: skip, keep the scale
        threshold = clipper.fixed_threshold if clipper is not None else None
        return Decision(norm, torch.ones_like(norm), torch.ones_like(found_inf), scale, inv_scale, threshold,
                        keep_scale=True, reason=verdict.skip, fields=verdict.fields, norms=norms)
    coef, threshold = clipper.coef_(norms, norm) if clipper is not None else (None, None)
    coef = torch.ones_like(norm) if coef is None else coef
    hook_clip: bool | Tensor = False
    if verdict.clip_to is not None:
        hook_coef = clip_coef(norm, verdict.clip_to)
        hook_clip, coef = hook_coef < coef, torch.minimum(coef, hook_coef)
    return Decision(norm, coef, found_inf, scale, inv_scale, threshold, hook_clip=hook_clip,
                    clip_reason=verdict.clip_reason, fields=verdict.fields, norms=norms)


def skip_bad_loss(scale: float, verdict: Verdict) -> Decision:
    """Decide a step whose loss was not finite on the host: skip; backward never ran, the scale is untouched.

    A hook's ``skip`` names the reason (e.g. a forward overflow told from bad data).

    >>> skip_bad_loss(1024.0, Verdict()).skip
    True
    """
    return Decision(math.nan, 1.0, True, scale, None, keep_scale=True, reason=verdict.skip,
                    fields=verdict.fields)
