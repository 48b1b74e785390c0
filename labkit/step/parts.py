"""The parts a guarded step is built from, checked before anything is created: a clear error for each.

``check_parts``: the model, optimizer, loss and scheduler; ``make_clipper``: the clip stage
from ``max_norm`` or ``clipper``; ``make_hooks``: ``hooks=[...]`` and the default hooks
(``default_hooks``) as one ``labkit.hooks.Hooks``, ordered by each hook's ``priority``;
``make_log``: the ``StepLog`` from ``log=``; ``refuse_removed``: the keywords that went, each
with what to write instead; ``GuardedParams``: the parameters the step guards, the
optimizer's at each step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..alarms import ClipAlarm, SkipAlarm
from ..blame import BackwardOrder
from ..clip import check_max_norm
from ..clippers import Clipper, NormClip
from ..hooks import Hook, Hooks
from ..steplog import StepLog

__all__ = ["DEFAULT_MAX_NORM", "GuardedParams", "check_deferred", "check_parts", "default_hooks",
           "make_clipper", "make_hooks", "make_log", "refuse_removed"]


class _DefaultMaxNorm(float):
    """``max_norm``'s default, 1.0: told apart from an explicit ``max_norm=1.0`` given with a ``clipper``."""


DEFAULT_MAX_NORM = _DefaultMaxNorm(1.0)


def check_parts(model: Any, optimizer: Any, loss_fn: Any, scheduler: Any) -> torch.device:
    """Raise a clear error for parts ``TrainStep`` cannot drive; return the model's device, the step's."""
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
    return first.device if first is not None else torch.device("cpu")


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


def default_hooks() -> list[Hook]:
    """Return the hooks every ``TrainStep`` has, each unless a hook of its class is given in ``hooks=[...]``.

    ``SkipAlarm(8)`` and ``ClipAlarm(0.5, window=100)`` (``labkit.alarms``: a streak of skips, habitual
    clipping), ``BackwardOrder()`` (``labkit.blame``: a skip's record names the first non-finite
    gradient in backward order). As Lightning's default callbacks: ``hooks=[SkipAlarm(20)]``
    retunes one, ``hooks=[SkipAlarm(None), ClipAlarm(None)]`` silences both.

    >>> default_hooks()
    [SkipAlarm(threshold=8), ClipAlarm(rate=0.5, window=100), BackwardOrder()]
    """
    return [SkipAlarm(8), ClipAlarm(0.5, window=100), BackwardOrder()]


def make_hooks(hooks: Sequence[Hook]) -> Hooks:
    """Return ``hooks`` and the ``default_hooks`` whose class none of them has, ordered by ``priority``.

    >>> [type(h).__name__ for h in make_hooks([SkipAlarm(None)]).members]  # by priority, ties as given
    ['ClipAlarm', 'SkipAlarm', 'BackwardOrder']
    """
    if isinstance(hooks, Hook) or not isinstance(hooks, Sequence):
        raise TypeError(f"hooks must be a list of labkit.hooks.Hook objects, got {type(hooks).__name__}.")
    given = list(hooks)
    kept = [d for d in default_hooks() if not any(isinstance(h, type(d)) for h in given)]
    return Hooks([*kept, *given])


def make_log(log: str | os.PathLike | StepLog | None) -> StepLog:
    """Return the step's ``StepLog``: ``log`` itself, one streaming to the file path ``log``, or a new one."""
    if log is None:
        return StepLog()
    if isinstance(log, StepLog):
        return log
    if isinstance(log, (str, os.PathLike)):
        return StepLog(stream=log)
    raise TypeError(f"log must be a file path (str or os.PathLike) or a labkit.StepLog (e.g. "
                    f"StepLog(stream=path, window=1000)), got {type(log).__name__}.")


# TrainStep's keywords before the hooks carried the alarms, faults and triage (0.1.0 keeps no old
# spelling): each raises a TypeError saying what to write instead
_REMOVED = {
    "norm_type": "clipper=NormClip(max_norm, norm_type={norm_type!r})",
    "skip_alarm": "hooks=[SkipAlarm({skip_alarm!r})] (labkit.alarms; it is on by default at 8, "
                  "SkipAlarm(None) silences it)",
    "clip_alarm": "hooks=[ClipAlarm({clip_alarm!r}, window={clip_window!r})] (labkit.alarms; it is on by "
                  "default at 0.5, ClipAlarm(None) silences it)",
    "clip_window": "hooks=[ClipAlarm({clip_alarm!r}, window={clip_window!r})] (labkit.alarms)",
    "faults": "hooks=[Faults({faults!r})] (labkit.faults)",
    "triage": "hooks=[Triage()] (labkit.triage) to triage a non-finite loss; leave it out for no triage",
    "log_path": "log={log_path!r} (a file path), or log=StepLog(stream=path, window=N)",
    "log_window": "log=StepLog(stream={log_path!r}, window={log_window!r}) (labkit.StepLog)",
    "device": "nothing: the step trains where the model is (model.to(device) first)",
}


def refuse_removed(given: dict[str, Any]) -> None:
    """Raise ``TypeError`` for keywords ``TrainStep`` does not take, saying what to write for a removed one.

    >>> refuse_removed({"triage": True})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: TrainStep(triage=...) was removed: write hooks=[Triage()] (labkit.triage) to triage a ...
    """
    if not given:
        return
    name = next((n for n in _REMOVED if n in given), None)
    if name is None:
        raise TypeError(f"TrainStep() got an unexpected keyword argument {next(iter(given))!r}")
    values = {"clip_alarm": 0.5, "clip_window": 100, "log_path": "path", **given}
    raise TypeError(f"TrainStep({name}=...) was removed: write {_REMOVED[name].format(**values)}.")


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

    def zero_grad(self) -> None:
        """Set every gradient to None, as ``optimizer.zero_grad(set_to_none=True)``.

        torch's own ``zero_grad`` does only that, inside a profiler label: two dispatched operations
        a step (entering and leaving it) that show nowhere unless a profiler records. Then, or when
        the optimizer has a ``zero_grad`` of its own, that one is called.

        >>> layer = nn.Linear(2, 1); layer(torch.ones(2)).sum().backward()
        >>> GuardedParams(layer, torch.optim.SGD(layer.parameters(), lr=0.1)).zero_grad(); layer.weight.grad
        """
        if type(self.optimizer).zero_grad is not _TORCH_ZERO_GRAD or torch.autograd._profiler_enabled():
            self.optimizer.zero_grad(set_to_none=True)
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad
