"""The parts a guarded step is built from, checked before anything is created: a clear error for each.

``check_parts``: the model, optimizer, loss, scheduler and device; ``make_clipper``: the
clip stage from ``max_norm`` or ``clipper``; ``make_hooks``: the alarms, ``triage`` and
``hooks=[...]`` as one list (``labkit.hooks.Hooks`` orders it by each hook's ``priority``);
``GuardedParams``: the parameters the step guards, the optimizer's at each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..alarms import ClipAlarm, SkipAlarm
from ..clip import check_max_norm
from ..clippers import Clipper, NormClip
from ..distributed import rank
from ..hooks import Hook
from ..scaler import check_device
from ..triage import Triage

__all__ = ["DEFAULT_MAX_NORM", "GuardedParams", "check_deferred", "check_parts", "make_clipper", "make_hooks"]


class _DefaultMaxNorm(float):
    """``max_norm``'s default, 1.0: told apart from an explicit ``max_norm=1.0`` given with a ``clipper``."""


DEFAULT_MAX_NORM = _DefaultMaxNorm(1.0)


def check_parts(model: Any, optimizer: Any, loss_fn: Any, scheduler: Any, device: Any) -> torch.device:
    """Raise a clear error for parts ``TrainStep`` cannot drive; return the device to train on."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS needs a closure that re-evaluates the loss, which a guarded step (check, clip, then one "
            "step) cannot give it: use a first-order optimizer (SGD, Adam...) with TrainStep."
        )
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(output, targets), got {type(loss_fn).__name__}."
        )
    if scheduler is not None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau needs a metric at each step: pass scheduler=None and call "
                "scheduler.step(metric) yourself after the steps whose record says skipped=False."
            )
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"scheduler must have a step() method (a torch LR scheduler), got {type(scheduler).__name__}."
            )
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError(
                "scheduler was built on another optimizer: build it on the optimizer given to TrainStep."
            )
    sparse = [type(m).__name__ for m in model.modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(
            f"{sparse[0]}(sparse=True) gives sparse gradients, which the global norm and clipping do not "
            "take: build it with sparse=False (the default)."
        )
    first = next(model.parameters(), None)
    home = first.device if first is not None else torch.device("cpu")
    if device is None:
        return home
    dev = check_device(device)
    missing = dev.type == "cuda" and not torch.cuda.is_available() or \
        dev.type == "mps" and not torch.backends.mps.is_available()
    if missing:
        raise ValueError(
            f"device={device!r}, but there is no {dev.type} device here: use 'cpu' (or device=None, "
            "the model's)."
        )
    if first is not None and dev.type != home.type:
        raise ValueError(
            f"device={device!r}, but the model is on {home}: move it first (model.to({str(dev)!r}))."
        )
    return dev


def make_clipper(max_norm: float | None, clipper: Clipper | None) -> Clipper | None:
    """Return the clip stage: ``clipper``, or ``NormClip(max_norm)``, or None (no clipping).

    >>> make_clipper(0.5, None), make_clipper(DEFAULT_MAX_NORM, None), make_clipper(None, None)
    (NormClip(max_norm=0.5), NormClip(max_norm=1), None)
    """
    if clipper is None:
        return NormClip(check_max_norm(max_norm)) if max_norm is not None else None
    if max_norm is not None and max_norm is not DEFAULT_MAX_NORM:
        raise ValueError(f"pass either max_norm ({max_norm!r}) or clipper ({clipper!r}), not both; for a "
                         f"fixed threshold with a clipper object use clipper=NormClip({max_norm!r}).")
    if not isinstance(clipper, Clipper):
        raise TypeError(
            f"clipper must be one of labkit.clippers (NormClip, ZClip, ...), got {type(clipper).__name__}."
        )
    return clipper


def make_hooks(
    skip_alarm: int | None, clip_alarm: float | None, clip_window: int, hooks: Sequence[Hook],
    triage: bool = False,
) -> tuple[SkipAlarm, ClipAlarm, list[Hook]]:
    """Return the alarms and every hook of the step: the alarms, ``Triage`` if ``triage``, then ``hooks``.

    The order they are called in is their ``priority``'s (``labkit.hooks.Hook``): the alarms
    first, ``Triage`` next, a ``Rewind`` last, wherever each is in ``hooks``.
    """
    if not isinstance(triage, bool):
        raise TypeError(f"triage must be True or False (for your own labkit.triage.Triage, pass "
                        f"hooks=[...]), got {triage!r}.")
    skips, clips = SkipAlarm(skip_alarm), ClipAlarm(clip_alarm, clip_window)
    if rank() != 0:  # the records are the same on every rank: N ranks would warn N times
        skips.threshold = clips.rate = None
    if isinstance(hooks, Hook) or not isinstance(hooks, Sequence):
        raise TypeError(f"hooks must be a list of labkit.hooks.Hook objects, got {type(hooks).__name__}.")
    return skips, clips, [skips, clips, *([Triage()] if triage else []), *hooks]


def check_deferred(sync_every: int | None, hooks: Sequence[Hook], clipper: Clipper | None) -> None:
    """Refuse ``sync_every`` with the parts that need the host's numbers every step, naming them."""
    needs = [type(h).__name__ for h in hooks if h.per_step]
    needs += [type(clipper).__name__] if clipper is not None and not clipper.on_host else []
    if sync_every is not None and needs:
        raise ValueError(f"sync_every defers the records and keeps the loss check on the device, but "
                         f"{', '.join(needs)} decide(s) from them on the host every step (an adaptive "
                         "clipper, a detector, a rewind, triage): use sync_every=None with them.")


class GuardedParams:
    """``(name, parameter)`` of every parameter the optimizer holds now (progressive unfreezing too).

    In the model's order (``model.parameters()``), not the groups': the global norm is summed in
    this order, and ``clip_grad_norm_(model.parameters())`` sums it so, so with several groups
    (nanoGPT's decayed and undecayed) the norm is torch's to the bit, not one ulp off. Parameters
    the model does not hold come last, in the groups' order. Read from
    ``optimizer.param_groups`` at each call; the list is rebuilt only when a group is added or
    its parameter list changes (a tuple compare per step, no pass over the model).

    >>> layer = nn.Linear(2, 1)
    >>> opt = torch.optim.SGD([{"params": [layer.bias]}, {"params": [layer.weight]}], lr=0.1)
    >>> [name for name, _ in GuardedParams(layer, opt)()]
    ['weight', 'bias']
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.key: tuple = ()
        self.params: list[tuple[str, nn.Parameter]] = []

    def __call__(self) -> list[tuple[str, nn.Parameter]]:
        groups = self.optimizer.param_groups
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key != self.key:
            held = {id(p): f"group{g}.param{i}" for g, group in enumerate(groups)
                    for i, p in enumerate(group["params"])}
            ours = [(n, p) for n, p in self.model.named_parameters() if held.pop(id(p), None) is not None]
            others = [(held[id(p)], p) for group in groups for p in group["params"] if id(p) in held]
            self.params = ours + others
            self.key = key
        return self.params
