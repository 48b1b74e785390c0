"""Unscale, check, clip: what the step does with its gradients, as one pure decision in two implementations.

The gradients are read once, for the per-tensor norms of the *scaled* gradients
(``unscaled_norms``: a NaN/inf among them is the inf check, and the scale is undone on the
norms, not on the gradients). From the global norm, the scale, the clipper and the hooks'
``Verdict``, ``decide_on_host`` (Python floats, once the norm and the scale are read) and
``decide_on_device`` (0-dim tensors, no host sync) return the same ``Decision``: the record's
numbers and the one multiply by ``coef / scale`` that unscales and clips. The host's float
arithmetic has the kernels' own bits (``labkit.clip.round_to``, ``host_clip_coef``), so both
give the same records and parameters to the bit (``tests/test_fused.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..clip import clip_coef, host_clip_coef, per_tensor_norms, round_to, total_norm
from ..clippers import Clipper
from ..hooks import Verdict

__all__ = ["Decision", "decide_on_device", "decide_on_host", "read", "skip_bad_loss", "unscaled_norms"]


@dataclass(slots=True)
class Decision:
    """What the step does with this step's gradients, and what its record says about them.

    On the host path the numbers are floats; on the device path 0-dim tensors.
    """

    norm: float | Tensor  # the global norm of the unscaled gradients, before clipping (logged)
    coef: float | Tensor  # min(1, limit / (norm + 1e-6)): 1 is no clip
    skip: bool | Tensor  # found_inf: the optimizer does not step (nonzero on the device)
    scale: float | Tensor  # the loss scale this step ran with
    inv_scale: float | Tensor | None  # float32(1 / scale), as torch's unscale_; None: a disabled scaler
    dtype: torch.dtype  # the norm's: the multiply is done in it
    device: torch.device
    threshold: float | Tensor | None = None  # the clipper's level (None: none to report)
    keep_scale: bool = False  # a hook's skip: no scaling problem, the scale stays
    reason: str | None = None  # a hook's skip reason
    hook_clip: bool | Tensor = False  # a hook's clip_to cut deeper than the clipper's
    clip_reason: str | None = None  # that hook's name for it
    fields: dict[str, Any] = field(default_factory=dict)  # record fields from the hooks
    norms: Tensor | None = None  # the per-tensor norms of the unscaled gradients (None: backward was skipped)

    def factor(self) -> Tensor | None:
        """Return what the gradients are multiplied by to unscale and clip, ``coef / scale``; None for 1."""
        coef, inv = self.coef, self.inv_scale
        if isinstance(coef, Tensor):
            return coef if inv is None else (coef * inv.to(coef.device)).to(coef.dtype)  # type: ignore[union-attr]
        # one rounding of the product, as the device's multiply of two float32 numbers
        value = coef if inv is None else round_to(coef * inv, self.dtype)  # type: ignore[operator]
        return None if value == 1.0 else torch.full((), value, dtype=self.dtype, device=self.device)

    def grad_scale(self) -> Tensor | None:
        """Return ``1 / coef``, a fused optimizer's ``grad_scale`` (the scaler adds the scale); None for 1."""
        if isinstance(self.coef, Tensor):
            return self.coef.reciprocal().float()
        inv = round_to(round_to(1.0 / self.coef if self.coef else math.inf, self.dtype), torch.float32)
        return None if inv == 1.0 else torch.full((), inv, dtype=torch.float32, device=self.device)

    def take(self, done: Tensor | None) -> None:
        """Report what a per-tensor or update clip amounted to, ``[coef, threshold]`` (None: nothing done)."""
        if done is not None:
            self.coef, self.threshold = done[0], done[1]


def read(*tensors: Tensor) -> list[float]:
    """Copy 0-dim tensors to the host in one read (one host sync), in the first one's dtype.

    >>> read(torch.tensor(2.0), torch.tensor(3, dtype=torch.int32))
    [2.0, 3.0]
    """
    first = tensors[0]
    if len(tensors) == 1:
        return [first.item()]
    return torch.stack([first, *(t.to(first) for t in tensors[1:])]).tolist()


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
    scaled = per_tensor_norms(grads, norm_type)
    if scale is None:  # a disabled scaler's scale is 1: nothing to undo (3 kernels less)
        return scaled, total_norm(scaled, norm_type), None
    inv_scale = scale.double().reciprocal().float()  # as torch's unscale_: exact for powers of two
    norms = scaled * inv_scale.to(scaled.device)
    return norms, total_norm(norms, norm_type), inv_scale


def decide_on_host(
    norm: float, norms: Tensor, scale: float | None, clipper: Clipper | None, verdict: Verdict
) -> Decision:
    """Decide from the norm and the scale already read to the host (``scale=None``: a disabled scaler).

    ``norms`` (the per-tensor norms, on the device) give the dtype and the device of the multiply.
    Skip when the norm is not finite, or when a hook says so (then the scale stays); else clip
    by the clipper's coefficient (``host_coef``: an ``on_host`` clipper) and a hook's
    ``clip_to``, whichever cuts deeper. Floats with the kernels' bits: ``decide_on_device``'s.

    >>> from labkit.clippers import NormClip
    >>> d = decide_on_host(5.0, torch.tensor([5.0]), 2.0**16, NormClip(1.0), Verdict())
    >>> d.skip, d.coef, d.factor()
    (False, 0.19999995827674866, tensor(3.0518e-06))
    """
    inv = None if scale is None else round_to(1.0 / scale, torch.float32)
    threshold = clipper.fixed_threshold if clipper is not None else None
    dtype, device, scale = norms.dtype, norms.device, 1.0 if scale is None else scale
    if verdict.skip is not None:  # a spike is no scaling problem: skip, keep the scale
        return Decision(norm, 1.0, True, scale, inv, dtype, device, threshold, keep_scale=True,
                        reason=verdict.skip, fields=verdict.fields, norms=norms)
    coef, hook_clip = 1.0 if clipper is None else clipper.host_coef(norm, dtype), False
    if verdict.clip_to is not None:
        hook_coef = host_clip_coef(norm, verdict.clip_to, dtype)
        hook_clip, coef = hook_coef < coef, min(coef, hook_coef)
    return Decision(norm, coef, not math.isfinite(norm), scale, inv, dtype, device, threshold,
                    hook_clip=hook_clip, clip_reason=verdict.clip_reason, fields=verdict.fields, norms=norms)


def decide_on_device(
    norm: Tensor, norms: Tensor, scale: Tensor, inv_scale: Tensor | None, clipper: Clipper | None,
    verdict: Verdict, loss_bad: Tensor | None = None,
) -> Decision:
    """Decide on the device, with no host sync: ``decide_on_host``'s rule as 0-dim tensors.

    ``inv_scale`` None: a disabled scaler (``scale`` is then 1). ``loss_bad`` (deferred
    records: the loss check stayed on the device) skips the step too. A clipper with state
    (``ZClip``...) gives its coefficient and admits the norm here (``coef_``); a hook's skip
    leaves it unasked.

    >>> from labkit.clippers import NormClip
    >>> one = torch.ones(())
    >>> d = decide_on_device(torch.tensor(5.0), torch.tensor([5.0]), one, None, NormClip(1.0), Verdict())
    >>> d.skip, d.coef, d.factor()
    (tensor(0.), tensor(0.2000), tensor(0.2000))
    """
    # inf - inf and NaN - NaN are NaN: isfinite's answer in 2 kernels, not 4
    found_inf = torch.isnan(norm - norm).float()
    if loss_bad is not None:
        found_inf = torch.maximum(found_inf, loss_bad.float().to(found_inf.device))
    if verdict.skip is not None:  # a spike is no scaling problem: skip, keep the scale
        threshold = clipper.fixed_threshold if clipper is not None else None
        return Decision(norm, torch.ones_like(norm), torch.ones_like(found_inf), scale, inv_scale, norm.dtype,
                        norm.device, threshold, keep_scale=True, reason=verdict.skip, fields=verdict.fields,
                        norms=norms)
    coef, threshold = clipper.coef_(norms, norm) if clipper is not None else (None, None)
    coef = torch.ones_like(norm) if coef is None else coef
    hook_clip: bool | Tensor = False
    if verdict.clip_to is not None:
        hook_coef = clip_coef(norm, verdict.clip_to)
        hook_clip, coef = hook_coef < coef, torch.minimum(coef, hook_coef)
    return Decision(norm, coef, found_inf, scale, inv_scale, norm.dtype, norm.device, threshold,
                    hook_clip=hook_clip, clip_reason=verdict.clip_reason, fields=verdict.fields, norms=norms)


def skip_bad_loss(scale: float, verdict: Verdict, device: torch.device) -> Decision:
    """Decide a step whose loss was not finite on the host: skip; backward never ran, the scale is untouched.

    A hook's ``skip`` names the reason (e.g. a forward overflow told from bad data).

    >>> skip_bad_loss(1024.0, Verdict(), torch.device("cpu")).skip
    True
    """
    return Decision(math.nan, 1.0, True, scale, None, torch.float32, device, keep_scale=True,
                    reason=verdict.skip, fields=verdict.fields)
