"""Set 1, part 2: clipping in place to a global norm, against ``labkit.clip_grad_norm_``.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from labkit.clip import clip_grad_norm_ as ref_clip_grad_norm_
from labkit.clip import grad_norm as ref_grad_norm

from ..core import (
    Check,
    call_student,
    check,
    close,
    forbid,
    grads_of,
    located,
    no_host_sync,
    raised_problem,
    same_bits,
    ship,
)
from .bans import CLIP_FUNCS
from .gradients import GradCase, gradient_cases, none_hint


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-5)


def _clip_cases(hidden: bool, seed: int) -> list[GradCase]:
    rnd = random.Random(seed + 1)
    cases = gradient_cases(hidden, seed, ("mixed shapes, fp32", "some .grad are None", "fp16 gradients",
                                           "bf16 gradients", "a NaN gradient", "an inf gradient",
                                           "no gradients at all"))
    if hidden:
        above = copy.copy(cases[0])
        above.name = "max_norm above the norm"
        cases.append(above)
        for case in cases:
            norm = ref_grad_norm(case.params()).item()
            finite = math.isfinite(norm) and norm > 0
            case.max_norm = (norm * (rnd.uniform(1.5, 4.0) if case.name == "max_norm above the norm"
                                     else rnd.uniform(0.05, 0.9)) if finite else rnd.uniform(0.5, 2.0))
    for case in cases:
        case.name = f"{case.name}, max_norm={case.max_norm:.4g}"
    return cases


def _run_clip(fn: Callable, case: GradCase) -> dict[str, Any]:
    params = case.params()
    objects = [p.grad for p in params]
    traps: list[str] = []
    with forbid(CLIP_FUNCS, "write the clipping", traps), no_host_sync(traps):
        out = call_student(fn, params, case.max_norm)
    out.update(traps=traps, value=ship(out.get("value")), grads=grads_of(params),
               replaced=any(p.grad is not obj for p, obj in zip(params, objects)))
    return out


def _judge_clip(name: str, case: GradCase, out: dict[str, Any], where: str) -> str | None:
    raised = raised_problem(name, out, where, none_hint(case))
    if raised:
        return raised
    if out.get("replaced"):
        return (f"{name} replaced p.grad with a new tensor {where}: clip in place "
                "(p.grad.mul_(coef)): optimizers and hooks keep references to the old one.")
    tensor = out["value"].get("tensor")
    if tensor is None or tensor.shape != ():
        return (f"{name} returned {out['value']['type']} {where}; return the pre-clip norm as a 0-dim "
                "tensor (the number to log).")
    value, params = tensor.float().item(), case.params()
    norm = ref_grad_norm(params).item()
    got = out["grads"]
    if not math.isfinite(norm):
        if not same_bits(got, case.grads):
            return (f"{name} changed the gradients {where}, whose norm is {norm:g}: a non-finite norm must "
                    "leave them untouched (the step will be skipped and they are the evidence; multiplying "
                    "by NaN or 0 destroys it). Keep the factor at 1 with torch.where(torch.isfinite(norm), "
                    "coef, 1.0).")
        if not close(value, norm) and not (math.isinf(norm) and math.isnan(value)):
            return f"{name} returned {value:g} {where}; return the pre-clip norm, {norm:g}."
        return None
    if not close(value, norm):
        hint = ("that is the norm after clipping; return the one before (the number worth logging: it shows "
                "the spike)." if norm > case.max_norm and close(value, case.max_norm, 1e-3)
                else "return the norm of the gradients before clipping, as labkit.grad_norm gives it.")
        return f"{name} returned {value:g} {where}, the pre-clip norm is {norm:g}: {hint}"
    ref_clip_grad_norm_(params, case.max_norm)
    for g, q in zip(got, params):
        if g is None or q.grad is None:
            continue
        if g.dtype != q.grad.dtype:
            return f"{name} changed the gradient dtype to {g.dtype} {where}; keep each gradient's own dtype."
        if not torch.allclose(g.float(), q.grad.float(), rtol=_tolerance(q.grad.dtype), atol=1e-6):
            after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.float()) for x in got
                                                          if x is not None])).item()
            if norm <= case.max_norm:
                hint = (f"the gradients were scaled although the norm {norm:.4g} is below max_norm: the "
                        "factor is min(1, max_norm / (norm + 1e-6)); clip only ever shrinks "
                        "(torch.clamp(..., max=1.0)).")
            else:
                hint = (f"after clipping the norm is {after:.4g}, expected max_norm={case.max_norm:.4g}: "
                        "scale every gradient by max_norm / (norm + 1e-6), with the norm of all of them "
                        "together.")
            return f"{name} clipped wrongly {where}: {hint}"
    return None


CHECK = Check(_clip_cases, _run_clip, located(_judge_clip))


def check_clip(fn: Callable[[list[Tensor], float], Tensor], hidden: bool = False,
               seed: int | None = None) -> None:
    """Check that ``fn(parameters, max_norm)`` clips in place, returns the pre-clip norm and never syncs.

    The reference is ``labkit.clip_grad_norm_``: a non-finite norm leaves the gradients untouched.

    >>> import labkit
    >>> def clip_to_norm_(parameters, max_norm):
    ...     norm = labkit.grad_norm(parameters)
    ...     coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    ...     coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    ...     for p in parameters:
    ...         if p.grad is not None:
    ...             p.grad.mul_(coef.to(p.grad.dtype))
    ...     return norm
    >>> check_clip(clip_to_norm_, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, CLIP_FUNCS)
