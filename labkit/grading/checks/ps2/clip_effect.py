"""Set 2, part 5: what a fixed clip does to the update under SGD and under Adam.
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from labkit.clip import clip_grad_norm_ as ref_clip_grad_norm_

from ..core import (
    Check,
    as_plain,
    call_student,
    check,
    close,
    on_case,
    raised_problem,
    ship,
)


@dataclass
class _EffectCase:
    """A small model warmed up by an optimizer on one seed, then a spike batch clipped to ``max_norm``."""

    name: str
    optimizer: str
    lr: float
    seed: int
    spike: float
    cut: float  # max_norm as a fraction of the spike batch's gradient norm
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warm: int = 20

    def _build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        if self.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=self.lr,
                                                         momentum=self.momentum)
        elif self.optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=self.lr, betas=self.betas,
                                    weight_decay=self.weight_decay)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=self.lr, betas=self.betas)
        return model, opt

    def batch(self, i: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + i)
        x = torch.randn(32, 8, generator=gen)
        return x, torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(32, 1, generator=gen)

    @functools.cached_property
    def _warm(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, opt = self._build()
        for i in range(self.warm):
            x, y = self.batch(i)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return model, opt

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Return a new (model, optimizer) in the warmed-up state: every call the same state."""
        return copy.deepcopy(self._warm)

    @property
    def inputs(self) -> tuple[Tensor, Tensor]:
        x, y = self.batch(self.warm)
        return x * self.spike, y

    @functools.cached_property
    def max_norm(self) -> float:
        model, _ = self.fresh()
        x, y = self.inputs
        nn.functional.mse_loss(model(x), y).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        return float(f"{norm * self.cut:.3g}")


def _update_ratio(case: _EffectCase, mistake: str | None = None) -> float:
    """Return |update clipped| / |update unclipped| from the same state (or under a classic mistake)."""
    deltas, model, opt = [], None, None
    for clip in (False, True):
        if model is None or mistake != "same_model":
            model, opt = case.fresh()
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        x, y = case.inputs
        nn.functional.mse_loss(model(x), y).backward()
        if clip:
            norm = ref_clip_grad_norm_(model.parameters(), case.max_norm)
            if mistake == "gradient":
                return min(1.0, case.max_norm / (norm.item() + 1e-6))
        opt.step()
        delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
        deltas.append(torch.linalg.vector_norm(delta).item())
    ratio = deltas[1] / deltas[0]
    return 1 / ratio if mistake == "inverse" else ratio


EFFECT_MISTAKES = {
    "gradient": "that is what clipping did to the gradient (the clip coefficient); the question is what it "
                "did to the update: compare the parameters after the step with those before it",
    "same_model": "the second step started where the first one ended: call fresh() again, so the clipped and "
                  "the unclipped step start from the same weights and the same optimizer state",
    "inverse": "that is the inverse: return |update with the clip| / |update without it|",
}


def _effect_cases(hidden: bool, seed: int) -> list[_EffectCase]:
    if not hidden:
        return [_EffectCase("SGD, lr 0.05, a 20x spike cut to a tenth", "sgd", 0.05, 0, 20.0, 0.1),
                _EffectCase("Adam, lr 1e-3, a 20x spike cut to a tenth", "adam", 1e-3, 0, 20.0, 0.1)]
    rnd = random.Random(seed)
    spike, cut = rnd.uniform(5.0, 50.0), rnd.uniform(0.02, 0.3)
    sgd_lr, momentum = rnd.choice([0.01, 0.05]), rnd.choice([0.5, 0.9])
    adam_lr, wd = rnd.choice([3e-4, 1e-3, 3e-3]), rnd.choice([0.01, 0.1])
    return [_EffectCase(f"SGD, lr {sgd_lr:g}", "sgd", sgd_lr, seed, spike, cut),
            _EffectCase(f"SGD with momentum {momentum:g}", "sgd", sgd_lr, seed + 1, spike, cut,
                        momentum=momentum),
            _EffectCase(f"Adam, betas (0.9, 0.95), lr {adam_lr:g}", "adam", adam_lr, seed + 2, spike, cut,
                        betas=(0.9, 0.95)),
            _EffectCase(f"AdamW, weight_decay {wd:g}", "adamw", adam_lr, seed + 3, spike, cut,
                        weight_decay=wd)]


def _run_effect(fn: Callable, case: _EffectCase) -> dict[str, Any]:
    x, y = case.inputs
    out = call_student(fn, case.fresh, nn.functional.mse_loss, x.clone(), y.clone(), case.max_norm)
    out["value"] = ship(out.get("value"))
    return out


def _judge_effect(name: str, case: _EffectCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = on_case(f"{case.name}, max_norm={case.max_norm:g}", hidden, seed)
    raised = raised_problem(name, out, where)
    if raised:
        return raised
    try:
        got = float(as_plain(out["value"]))
    except (TypeError, ValueError):
        return f"{name} returned a {out['value']['type']} {where}; return the ratio as a number."
    want = _update_ratio(case)
    if close(got, want, 1e-3):
        return None
    hint = next((h for m, h in EFFECT_MISTAKES.items() if close(got, _update_ratio(case, m), 1e-3)), None)
    if hint is None:
        hint = ("run one step without clipping and one with labkit.clip_grad_norm_(..., max_norm) after "
                "backward, each from fresh(), and divide the norms of the two updates (parameters after "
                "minus before)")
    return f"{name} returned {got:.6g} {where}, expected {want:.6g}: {hint}."


CHECK = Check(_effect_cases, _run_effect, _judge_effect)


def check_clip_effect(fn: Callable[..., float], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(fresh, loss_fn, inputs, targets, max_norm) -> |update clipped| / |update unclipped|``.

    ``fresh()`` returns a new ``(model, optimizer)`` in the same warmed-up state each call;
    one step without clipping and one with ``max_norm`` are compared (SGD, with momentum,
    Adam, AdamW), within 0.1% of labkit's run.

    >>> import labkit
    >>> def clip_effect(fresh, loss_fn, inputs, targets, max_norm):
    ...     sizes = []
    ...     for clip in (False, True):
    ...         model, optimizer = fresh()
    ...         before = [p.detach().clone() for p in model.parameters()]
    ...         optimizer.zero_grad()
    ...         loss_fn(model(inputs), targets).backward()
    ...         if clip:
    ...             labkit.clip_grad_norm_(model.parameters(), max_norm)
    ...         optimizer.step()
    ...         after = model.parameters()
    ...         sizes.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(after, before)]).norm())
    ...     return (sizes[1] / sizes[0]).item()
    >>> check_clip_effect(clip_effect, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed)
