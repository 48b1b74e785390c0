"""Set 1, part 3: skip or step, the reason a step is skipped, against ``labkit.TrainStep``'s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from labkit.reasons import COUNTED

from ..core import (
    Check,
    call_student,
    check,
    forbid,
    located,
    raised_problem,
    ship,
)
from .bans import STEP_FUNCS
from .gradients import GradCase, none_hint, poisoned, random_grads, scaled_randn

REASONS = (None, *(r.value for r in COUNTED))  # what a student's skip decision may return


def _skip_cases(hidden: bool, seed: int) -> list[tuple[GradCase, str | None]]:
    finite = [torch.tensor([0.5, -1.0]), torch.tensor([[2.0]])]
    if not hidden:
        return [
            (GradCase("finite loss and gradients", finite, loss=0.7), None),
            (GradCase("NaN loss", finite, loss=math.nan), "nonfinite_loss"),
            (GradCase("an inf gradient", [torch.tensor([0.5, math.inf]), torch.tensor([[2.0]])], loss=0.7),
             "nonfinite_grad"),
        ]
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    mixed = random_grads(gen, rnd, 4)
    with_none = mixed[:2] + [None] + mixed[2:]
    nan_grad = poisoned(mixed, rnd, math.nan)
    # finite fp16 values whose squares and fp16 norm overflow: a norm taken in fp16 cries wolf
    big16 = [scaled_randn(gen, (256,), 2500.0, torch.float16) for _ in range(8)]
    return [
        (GradCase("finite, some .grad are None", with_none, loss=rnd.uniform(0.1, 3)), None),
        (GradCase("+inf loss", mixed, loss=math.inf), "nonfinite_loss"),
        (GradCase("-inf loss", mixed, loss=-math.inf), "nonfinite_loss"),
        (GradCase("NaN loss in fp16", mixed, loss=math.nan, loss_dtype=torch.float16), "nonfinite_loss"),
        (GradCase("NaN loss and NaN gradients", nan_grad, loss=math.nan), "nonfinite_loss"),
        (GradCase("a NaN gradient", nan_grad, loss=rnd.uniform(0.1, 3)), "nonfinite_grad"),
        (GradCase("a -inf gradient", poisoned(mixed, rnd, -math.inf), loss=rnd.uniform(0.1, 3)),
         "nonfinite_grad"),
        (GradCase("large but finite fp16 gradients", big16, loss=rnd.uniform(0.1, 3),
                  loss_dtype=torch.float16), None),
        (GradCase("a huge but finite loss", mixed, loss=1e30), None),
    ]


def _run_skip(fn: Callable, case: tuple[GradCase, str | None]) -> dict[str, Any]:
    traps: list[str] = []
    with forbid(STEP_FUNCS, "decide", traps):
        out = call_student(fn, torch.tensor(case[0].loss, dtype=case[0].loss_dtype), case[0].params())
    out.update(traps=traps, value=ship(out.get("value")))
    return out


def _judge_skip(name: str, case: tuple[GradCase, str | None], out: dict[str, Any], where: str) -> str | None:
    case, want = case
    raised = raised_problem(name, out, where, none_hint(case))
    if raised:
        return raised
    shipped = out["value"]
    got = shipped.get("py", shipped.get("type")) if shipped["type"] in ("str", "NoneType") else None
    if shipped["type"] not in ("str", "NoneType") or got not in REASONS:
        shown = repr(shipped["py"]) if "py" in shipped else f"a {shipped['type']}"
        return (f"{name} returned {shown} {where}; return None to step, or the reason to skip: "
                "'nonfinite_loss' or 'nonfinite_grad'.")
    if got == want:
        return None
    if want is None and "fp16" in case.name:
        hint = ("every gradient is finite, but an fp16 norm of them overflows: test torch.isfinite(g).all() "
                "per gradient, or take the norm in float32.")
    elif want is None:
        hint = "a finite loss and finite gradients is a normal step: return None."
    elif want == "nonfinite_loss" and got == "nonfinite_grad":
        hint = "check the loss first: on a bad loss backward never runs, so its gradients don't count."
    elif want == "nonfinite_loss":
        hint = (f"the loss is {case.loss}: NaN, +inf and -inf are all not finite (math.isfinite, "
                "torch.isfinite).")
    else:
        hint = ("one gradient holds a NaN or inf: check every .grad that exists (torch.isfinite(g).all(), or "
                "whether the global norm is finite).")
    return f"{name} returned {got!r} {where}, expected {want!r}: {hint}"


CHECK = Check(_skip_cases, _run_skip, located(_judge_skip))


def check_skip_decision(fn: Callable[[Tensor, list[Tensor]], str | None], hidden: bool = False,
                        seed: int | None = None) -> None:
    """Check that ``fn(loss, parameters)`` returns None (step), ``"nonfinite_loss"`` or ``"nonfinite_grad"``.

    A bad loss wins over bad gradients (on a bad loss, backward must not even run).

    >>> import math, labkit
    >>> def skip_reason(loss, parameters):
    ...     if not math.isfinite(loss.item()):
    ...         return "nonfinite_loss"
    ...     return None if torch.isfinite(labkit.grad_norm(parameters)) else "nonfinite_grad"
    >>> check_skip_decision(skip_reason, hidden=True, seed=0)
    """
    check(CHECK, fn, hidden, seed, STEP_FUNCS)
