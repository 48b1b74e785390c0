"""Set 1, part 1: the global gradient norm, against ``labkit.grad_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from labkit.clip import grad_norm as ref_grad_norm
from labkit.clip import per_tensor_norms

from ..core import (
    Check,
    call_student,
    check,
    close,
    forbid,
    grads_of,
    located,
    raised_problem,
    same_bits,
    ship,
)
from .bans import NORM_FUNCS
from .gradients import HALF, GradCase, gradient_cases, none_hint


def _diagnose_norm(got: float, want: float, case: GradCase) -> str:
    """Name the likely mistake behind a wrong norm."""
    grads = [g for g in case.grads if g is not None]
    per = per_tensor_norms(grads, 2.0).tolist() if grads else []
    half = next((g.dtype for g in grads if g.dtype in HALF), None)
    if math.isinf(got) and half is torch.float16:
        return ("your norm overflowed to inf on fp16 gradients: accumulate in float32 (g.float(), or "
                "dtype=torch.float32); fp16 stops at 65504, and squares of gradients get there fast.")
    if math.isnan(got):
        return "you got NaN from finite gradients."
    if close(got, want**2):
        return "that is the square of the norm: did you forget the square root?"
    if per and close(got, sum(per)):
        return ("you added the per-tensor norms; the global norm is the square root of the sum of their "
                "squares.")
    if per and close(got, max(per)):
        return "that is the largest per-tensor norm; the global norm treats all gradients as one vector."
    if per and close(got, per[0]):
        return "that is the norm of the first gradient only; include every parameter's .grad."
    if half is not None and want > 0 and abs(got / want - 1) < 0.02:
        short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[half]
        bits = {torch.float16: 10, torch.bfloat16: 7}[half]
        return (f"it is off by {abs(got / want - 1):.2%} on {short} gradients: accumulate in float32 "
                f"({short} keeps only {bits} bits of mantissa).")
    if want > 0 and got > 0:
        return f"the norm differs by a factor of ~{got / want:.3g}."
    return ""


def _norm_cases(hidden: bool, seed: int) -> list[GradCase]:
    return gradient_cases(hidden, seed, ("mixed shapes, fp32", "some .grad are None", "large fp16 gradients",
                                         "fp16 gradients", "bf16 gradients", "a NaN gradient",
                                         "an inf gradient", "no gradients at all"))


def _run_norm(fn: Callable, case: GradCase) -> dict[str, Any]:
    params = case.params()
    before = grads_of(params)
    traps: list[str] = []
    with forbid(NORM_FUNCS, "compute the norm", traps):
        out = call_student(fn, params)
    out.update(traps=traps, changed=not same_bits(grads_of(params), before), value=ship(out.get("value")))
    return out


def _judge_norm(name: str, case: GradCase, out: dict[str, Any], where: str) -> str | None:
    raised = raised_problem(name, out, where, none_hint(case))
    if raised:
        return raised
    if out.get("changed"):
        return f"{name} changed p.grad {where}: a norm only reads (use out-of-place ops, not g.pow_())."
    got = out["value"]
    if "tensor" not in got:
        return (f"{name} returned a {got['type']} {where}; return a 0-dim tensor "
                "(a Python number means .item(), a host sync that waits for the GPU).")
    tensor = got["tensor"]
    if tensor.shape != ():
        return (f"{name} returned a tensor of shape {tuple(tensor.shape)} {where}; return one number, "
                "a 0-dim tensor: the norm of all gradients seen as one vector.")
    if tensor.dtype != torch.float32:
        return (f"{name} returned a {tensor.dtype} norm {where}; return float32, whatever the "
                "gradients' dtype (an fp16 norm is inf above 65504).")
    value, want = tensor.item(), ref_grad_norm(case.params()).item()
    # the spec asks for a NaN or inf norm from non-finite gradients: either one is right
    if not math.isfinite(want):
        if math.isfinite(value):
            bad = "a NaN" if math.isnan(want) else "an inf"
            return (f"{name} returned {value:g} {where}; {bad} gradient must give a NaN or inf norm: the "
                    "step decides to skip from it, so don't filter or nan_to_num non-finite values.")
        return None
    if not close(value, want):
        diagnosis = _diagnose_norm(value, want, case)
        return f"{name} returned {value:g} {where}, labkit.grad_norm gives {want:g}" + (
            f": {diagnosis}" if diagnosis else ".")
    return None


CHECK = Check(_norm_cases, _run_norm, located(_judge_norm))


def check_grad_norm(fn: Callable[[list[Tensor]], Tensor], hidden: bool = False,
                    seed: int | None = None) -> None:
    """Check that ``fn(parameters)`` returns the global L2 norm of their ``.grad``, as ``labkit.grad_norm``.

    >>> def global_grad_norm(parameters):
    ...     norms = [p.grad.float().norm() for p in parameters if p.grad is not None]
    ...     return torch.stack(norms).norm() if norms else torch.tensor(0.0)
    >>> check_grad_norm(global_grad_norm, hidden=True, seed=0)
    >>> check_grad_norm(lambda parameters: torch.tensor(7.0))  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    AssertionError: <lambda> returned 7 on the case 'grads [3, 4] and [12]', labkit.grad_norm gives 13:
    the norm differs by a factor of ~0.538.
    """
    check(CHECK, fn, hidden, seed, NORM_FUNCS)
