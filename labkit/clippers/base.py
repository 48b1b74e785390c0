"""What every clipper shares: one interface in the AMP order, the feed policy and the lock-in guard.

A clipper is an object with ``clip_(parameters) -> Tensor`` (the pre-clip global norm, like
``torch.nn.utils.clip_grad_norm_``) and ``state_dict``/``load_state_dict``. ``TrainStep``
asks every clipper the same three things (``Clipper``: a coefficient from the norms it has
already computed, a per-tensor clip once the gradients are unscaled, an after-step), so the
gradients are read once and the step never asks a clipper's type. Global-norm clippers
(``NormClip``, ``ZClip``, ``AutoClip``) reduce to a threshold that is a function of their
state and of the global norm only, so under ``torch.distributed`` every rank computes the
same threshold with no collective of its own. All state lives in tensors on the gradients'
device and every decision is a ``torch.where``: no host sync per step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ..alarms import LabkitWarning
from ..clip import EPS, Parameters, grouped_norms, named_grads, named_tensors, scale_grads_, total_norm
from ..distributed import rank
from ..records import Field, declare
from ..validate import check_int

__all__ = ["FEEDS", "Clipper", "GlobalClipper", "LockInWarning", "check_max_consecutive_clips", "feed_value",
           "lockin_guard"]

FEEDS = ("clipped", "raw", "exclude")


class LockInWarning(LabkitWarning):
    """An adaptive clipper clipped so many steps in a row that it restarted its statistics."""


def feed_value(feed: str, norm: Tensor, limit: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(value, admit)``: what enters the statistics after a step, and whether anything does.

    ``clipped`` feeds ``min(norm, limit)`` (ZClip, AdaGC), ``raw`` feeds ``norm`` (AutoClip,
    Levanter), ``exclude`` feeds ``norm`` only when it was not clipped (llm.c PR #711). A
    non-finite norm is never admitted, whatever the policy.

    >>> feed_value("clipped", torch.tensor(5.0), torch.tensor(2.0))
    (tensor(2.), tensor(True))
    >>> feed_value("exclude", torch.tensor(5.0), torch.tensor(2.0))[1]
    tensor(False)
    """
    finite = torch.isfinite(norm)
    if feed == "clipped":
        return torch.minimum(norm, limit), finite
    if feed == "raw":
        return norm, finite
    if feed == "exclude":
        return norm, finite & ~(norm > limit)
    raise ValueError(f"feed must be one of {FEEDS}, got {feed!r}.")


def lockin_guard(streak: Tensor, clipped: Tensor, bound: int | None) -> tuple[Tensor, Tensor]:
    """Return ``(streak, release)``: consecutive clips so far, and whether they reached ``bound``.

    ``streak' = (streak + 1) if clipped else 0``; ``release = streak' >= bound`` (then the
    streak restarts at 0). A clipper that clips ``bound`` steps in a row is no longer catching
    spikes: its statistics have locked onto an old level (ZClip after a 2x level shift clips
    every one of the next 1000 steps, research note §1.3b). Under SGD that is a silent
    learning-rate cut (every update is divided by the new level over the old); under Adam, which is
    invariant to a constant gradient scale up to eps, it amounts to normalized gradients and
    costs little, but the threshold no longer follows the run.
    Isolated spikes never reach the bound. ``bound=None`` turns the guard off.

    >>> lockin_guard(torch.tensor(2), torch.tensor(True), 3)
    (tensor(0), tensor(True))
    >>> lockin_guard(torch.tensor(2), torch.tensor(False), 3)
    (tensor(0), tensor(False))
    """
    streak = torch.where(clipped, streak + 1, torch.zeros_like(streak))
    if bound is None:
        return streak, torch.zeros_like(clipped)
    release = streak >= bound
    return torch.where(release, torch.zeros_like(streak), streak), release


def effective_coef(post: list[Tensor], norm: Tensor, finite: Tensor) -> Tensor:
    """Return ``[coef, nan]``: the global-norm factor a per-tensor clip amounted to (post-clip / pre-clip
    norm).

    ``post`` holds each gradient's norm after clipping; with none, or a zero or non-finite ``norm``,
    the factor is 1. The NaN slot is the threshold, which per-tensor rules do not have.
    """
    after = torch.linalg.vector_norm(torch.stack(post)) if post else norm
    coef = torch.where(finite & (norm > 0), after / norm, torch.ones_like(norm))
    return torch.stack([coef.float(), torch.full_like(coef.float(), float("nan"))])


# on a clipped step: the clipper's threshold (NaN: none, or a per-tensor rule), who cut deepest (a
# clipper's class name, or a hook's reason such as "z_grad") and whether its lock-in guard fired
declare("Clipper", {"threshold": Field(math.nan), "clip_reason": Field(None), "lockin": Field(False)})


def check_max_consecutive_clips(bound: int | None) -> int | None:
    """Return a clipper's lock-in bound if it is an int >= 1 or None (the guard off); raise otherwise.

    >>> check_max_consecutive_clips(50), check_max_consecutive_clips(None)
    (50, None)
    """
    return check_int("max_consecutive_clips", bound, 1, none="guard off")


class Clipper:
    """Base of the clipping family: ``clip_(parameters)`` returns the pre-clip global norm.

    The guarded step (and a plain loop, through ``clip_``) asks every clipper the same things,
    in the AMP order; each does nothing by default, so a clipper implements only its own:

    - ``coef_(norms, norm) -> (coef, threshold)``: before the optimizer step, the factor every
      gradient is multiplied by, from the per-tensor and global norms of the unscaled
      gradients (``coef`` None: no global factor; ``threshold``: a float, a 0-d tensor or
      None); the statistics admit the norm.
    - ``clip_unscaled_(params, norms, norm) -> Tensor | None``: once the gradients are
      unscaled (and multiplied by ``coef``), clip them per tensor in place; return
      ``[coef, threshold]`` of what that amounted to for the global norm, or None.
    - ``after_step_(params) -> Tensor | None``: after the optimizer stepped, clip the update;
      return ``[coef, threshold]``, or None.

    What the step reads instead of a type: ``norm_type`` (the order of the norms it computes
    for the clipper: 2.0 but for ``NormClip(norm_type=p)``), ``on_host`` (the coefficient is a function of the
    norm alone: the clipper has no state, so deferred records may take it), ``fused_ok`` (a global
    coefficient is all it does: no ``clip_unscaled_``, no ``after_step_``, so a fused optimizer
    can apply it and the step asks nothing more), ``fixed_threshold`` (the
    threshold known without a step, ``NormClip``'s ``max_norm``), ``max_consecutive_clips``
    (the lock-in guard's bound; None: none) and ``lockin()``.
    """

    name = "clipper"
    norm_type = 2.0
    on_host = False
    fused_ok = False
    fixed_threshold: float | None = None
    max_consecutive_clips: int | None = None
    _warned = 0  # guard releases already warned about
    _seen = 0  # guard releases already reported by lockin()

    def clip_(self, parameters: Parameters) -> Tensor:
        """Clip the gradients of ``parameters`` in place; return their pre-clip global norm
        (``norm_type``)."""
        params = parameters_list(parameters)
        grads, _ = named_grads(params)
        norms, order = grouped_norms(grads, self.norm_type)
        norm = total_norm(norms, self.norm_type, order)
        self.clip_with_norms_([p for p in params if p.grad is not None], norms, norm)
        return norm

    @torch.no_grad()
    def clip_with_norms_(self, params: list[Tensor], norms: Tensor, norm: Tensor) -> Tensor:
        """Clip ``params``' gradients given their per-tensor and global norms; return ``[coef, threshold]``.

        ``coef_``, its multiply, then ``clip_unscaled_``: what ``clip_`` does once it has the
        norms. ``coef`` is the post-clip over the pre-clip global norm (1: untouched),
        ``threshold`` the level above which the global norm is clipped (NaN for per-tensor
        rules), a 2-element float32 tensor on the norm's device.
        """
        coef, threshold = self.coef_(norms, norm)
        if coef is not None:
            scale_grads_([p.grad for p in params if p.grad is not None], coef)
        done = self.clip_unscaled_(params, norms, norm)
        if done is not None:
            return done
        coef = torch.ones_like(norm, dtype=torch.float32) if coef is None else coef.to(torch.float32)
        level = threshold if isinstance(threshold, Tensor) else torch.full_like(
            coef, float("nan") if threshold is None else threshold)
        return torch.stack([coef, level.to(coef.dtype)])

    def coef_(self, norms: Tensor, norm: Tensor) -> tuple[Tensor | None, float | Tensor | None]:
        """Return ``(coef, threshold)`` for the global norm, the norm admitted; ``(None, None)``: none."""
        return None, None

    def clip_unscaled_(self, params: list[Tensor], norms: Tensor, norm: Tensor) -> Tensor | None:
        """Clip the unscaled gradients per tensor in place; return ``[coef, threshold]``, or None."""
        return None

    def after_step_(self, params: list[Tensor]) -> Tensor | None:
        """Act after the optimizer stepped (``UpdateNormClip``); return ``[coef, threshold]`` or None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Return the clipper's state (tensors cloned): ``load_state_dict`` of it resumes bitwise."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``."""

    def releases(self) -> int:
        """Return how many times the lock-in guard restarted the statistics (one host read)."""
        return 0

    def lockin(self) -> bool:
        """Return whether the lock-in guard fired since the last call (one host read; none without a guard).

        Rank 0 also warns (``check_lockin``): the records are the same on every rank.
        """
        if self.max_consecutive_clips is None:
            return False
        releases = self.releases()
        fired, self._seen = releases > self._seen, releases
        if fired and rank() == 0:
            self.check_lockin()
        return fired

    def check_lockin(self) -> bool:
        """Warn (``LockInWarning``) if the guard fired since the last check; return whether it did
        (a read)."""
        n = self.releases()
        if n <= self._warned:
            return False
        self._warned = n
        warnings.warn(
            f"{type(self).__name__} clipped {self.max_consecutive_clips} steps in a row and restarted its "
            f"statistics from the raw norm (guard fired {n} time(s)): "
            f"with feed={getattr(self, 'feed', None)!r} "
            "it had locked onto an old gradient-norm level (under SGD a silent learning-rate cut; under Adam "
            "little cost, but the threshold no longer followed the run). If the level shift is real "
            "(batch-size ramp, data mix), this is what you want; if not, look at the data around these "
            "steps.",
            LockInWarning,
            stacklevel=3,
        )
        return True


class GlobalClipper(Clipper):
    """A clipper whose threshold is a function of its state and of the global gradient norm.

    Subclasses give ``initial()`` (the state before any step, a dict of tensors),
    ``threshold(state)`` (the level above which a norm is clipped; ``inf`` while warming up),
    ``limit(state, norm)`` (what the norm is clipped to; the threshold unless the rule says
    otherwise) and ``update(state, value)`` (the state after admitting one value). The base
    applies the feed policy, keeps non-finite norms out, and runs the lock-in guard: after
    ``max_consecutive_clips`` clips in a row the statistics restart from the raw norm (warm-up
    again) and a ``LockInWarning`` is raised when the host next looks (``TrainStep`` looks on
    clipped steps; standalone users call ``check_lockin()`` when they log).
    """

    def __init__(self, feed: str, max_consecutive_clips: int | None) -> None:
        if feed not in FEEDS:
            raise ValueError(f"feed must be one of {FEEDS}, got {feed!r}: 'clipped' can lock in, "
                             "'raw' can inflate, 'exclude' can go blind (research note §1.3b).")
        self.feed = feed
        self.max_consecutive_clips = check_max_consecutive_clips(max_consecutive_clips)
        self.state = self.initial()
        self.state["streak"] = torch.zeros((), dtype=torch.int64)
        self.state["releases"] = torch.zeros((), dtype=torch.int64)

    # -- the rule, given by subclasses --------------------------------------------------------
    def initial(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def threshold(self, state: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def limit(self, state: dict[str, Tensor], norm: Tensor) -> Tensor:
        return self.threshold(state)

    def update(self, state: dict[str, Tensor], value: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def coef(self, limit: Tensor, norm: Tensor) -> Tensor:
        """Return torch's ``clamp(limit / (norm + 1e-6), max=1)``, and exactly 1 for a non-finite norm."""
        coef = torch.clamp(limit / (norm + EPS), max=1.0)
        return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))

    # -- shared machinery -----------------------------------------------------------------------
    fused_ok = True  # a global coefficient and nothing else

    def _to(self, device: torch.device) -> None:
        if self.state["streak"].device != device:
            self.state = {k: v.to(device) for k, v in self.state.items()}

    def observe(self, norm: Tensor, limit: Tensor) -> Tensor:
        """Admit one step's pre-clip global ``norm``, clipped to ``limit``; return whether it was clipped."""
        state = self.state
        norm = norm.to(torch.float32)
        clipped = torch.isfinite(norm) & (norm > limit)
        value, admit = feed_value(self.feed, norm, limit)
        rule = {k: v for k, v in state.items() if k not in ("streak", "releases")}
        new = self.update(rule, torch.where(admit, value, torch.zeros_like(value)))
        streak, release = lockin_guard(state["streak"], clipped, self.max_consecutive_clips)
        streak = torch.where(torch.isfinite(norm), streak, state["streak"])  # a skipped step is no evidence
        fresh = self.update({k: v.to(norm.device) for k, v in self.initial().items()}, norm)
        out = {}
        for k, v in rule.items():
            kept = torch.where(admit, new[k], v)
            out[k] = torch.where(release, fresh[k], kept)
        out["streak"] = streak
        out["releases"] = state["releases"] + release.long()
        self.state = out
        return clipped

    def coef_(self, norms: Tensor, norm: Tensor) -> tuple[Tensor, Tensor]:
        self._to(norm.device)
        norm = norm.to(torch.float32)
        threshold = self.threshold(self.state)
        limit = self.limit(self.state, norm)
        coef = self.coef(limit, norm)
        self.observe(norm, limit)
        return coef, threshold

    def clip_with_norms_(self, params: list[Tensor], norms: Tensor, norm: Tensor) -> Tensor:
        return super().clip_with_norms_(params, norms, norm.to(torch.float32))

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = self.state.keys() - state.keys()
        if missing:
            raise KeyError(f"{type(self).__name__} state_dict lacks {sorted(missing)}; "
                           "pass what state_dict() returned.")
        for k, v in self.state.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(f"{type(self).__name__} state {k!r} has shape {tuple(state[k].shape)}, "
                                 f"expected {tuple(v.shape)}: was it saved by a clipper with other settings?")
        self.state = {k: state[k].detach().clone().to(v.device, v.dtype) for k, v in self.state.items()}
        self._seen = self.releases()

    def releases(self) -> int:
        return int(self.state["releases"].item())



def parameters_list(parameters: Parameters | Iterable[Tensor]) -> list[Tensor]:
    """Return the parameters (named pairs unwrapped) as a list; anything else raises ``TypeError``."""
    return [p for _, p in named_tensors(parameters)]
