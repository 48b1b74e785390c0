"""Problem set 1's checks: the global norm, clipping in place, skip or step, the scale rule, the guarded step.

Each compares the student's function with labkit's own (``labkit.grad_norm``,
``clip_grad_norm_``, ``update_scale``, ``TrainStep``) on visible cases and on a hidden,
randomized battery (shapes, fp32/fp16/bf16, ``None`` grads, NaN/Inf, thresholds) built from
``seed``, quoted in every failure so it can be replayed.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from labkit.clip import clip_grad_norm_ as ref_clip_grad_norm_
from labkit.clip import grad_norm as ref_grad_norm
from labkit.clip import per_tensor_norms
from labkit.faults import Fault
from labkit.reasons import COUNTED
from labkit.records import StepRecord
from labkit.scaler import GradScaler, ScalerConfig, update_scale
from labkit.step import TrainStep

from .core import (
    Check,
    _by_name,
    _call,
    _close,
    _forbid,
    _grads,
    _no_host_sync,
    _number,
    _raised,
    _same,
    _ship,
    _where,
    check,
)

__all__ = ["BANNED", "CHECKS", "check_clip", "check_grad_norm", "check_guarded_step", "check_skip_decision",
           "check_update_scale"]

HALF = (torch.float16, torch.bfloat16)
REASONS = (None, *(r.value for r in COUNTED))  # what a student's skip decision may return


@dataclass
class _Case:
    """One input a check feeds the student's function, named for the failure message."""

    name: str
    grads: list[Tensor | None]
    max_norm: float = 1.0
    loss: float = 0.5
    loss_dtype: torch.dtype = torch.float32

    def params(self) -> list[Tensor]:
        """Return fresh leaf parameters carrying copies of the case's gradients."""
        params = []
        for g in self.grads:
            p = torch.zeros(g.shape if g is not None else (3,), dtype=g.dtype if g is not None else torch.float32,
                            requires_grad=True)
            p.grad = None if g is None else g.clone()
            params.append(p)
        return params


def _none_hint(case: _Case) -> str:
    """Say how to handle missing gradients, if the case has any."""
    if case.grads and all(g is None for g in case.grads):
        return " With no gradients at all the norm is 0: return torch.tensor(0.0) (torch.stack([]) fails)."
    if None in case.grads:
        return " Some parameters have no .grad (None: frozen or unused): skip them."
    return ""


# ---------------------------------------------------------------- cases


NORM_FUNCS = ("labkit.grad_norm", "labkit.clip_grad_norm_", "labkit.clip.per_tensor_norms",
              "torch.nn.utils.clip_grad_norm_", "torch.nn.utils.get_total_norm")
CLIP_FUNCS = ("labkit.clip_grad_norm_", "labkit.clip_grads_with_norm_", "torch.nn.utils.clip_grad_norm_",
              "torch.nn.utils.clip_grads_with_norm_")
SCALE_FUNCS = ("labkit.update_scale", "labkit.GradScaler", "torch.amp.GradScaler")
STEP_FUNCS = ("labkit.TrainStep",)


def _randn(gen: torch.Generator, shape: tuple[int, ...], scale: float, dtype: torch.dtype = torch.float32) -> Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


SHAPES = [(), (7,), (3, 4), (2, 3, 5), (64, 33), (1,)]


def _mixed(gen: torch.Generator, rnd: random.Random, n: int, dtype: torch.dtype = torch.float32) -> list[Tensor | None]:
    return [_randn(gen, rnd.choice(SHAPES), rnd.uniform(0.1, 10.0), dtype) for _ in range(n)]


def _poison(grads: list[Tensor | None], rnd: random.Random, value: float) -> list[Tensor | None]:
    grads = [None if g is None else g.clone() for g in grads]
    i = rnd.choice([k for k, g in enumerate(grads) if g is not None and g.numel() > 0])
    grads[i].view(-1)[rnd.randrange(grads[i].numel())] = value
    return grads


def _gradient_cases(hidden: bool, seed: int, kinds: tuple[str, ...]) -> list[_Case]:
    """Return the visible cases, or the hidden battery built from ``seed``."""
    if not hidden:
        return [
            _Case("grads [3, 4] and [12]", [torch.tensor([3.0, 4.0]), torch.tensor([12.0])], max_norm=1.0),
            _Case("one parameter has no .grad", [torch.tensor([3.0, 4.0]), None, torch.tensor([[12.0]])], max_norm=20.0),
        ]
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    mixed = _mixed(gen, rnd, rnd.randint(3, 6))
    with_none = _mixed(gen, rnd, 4)
    with_none[rnd.randrange(4)] = None
    with_none.insert(rnd.randrange(5), None)
    cases = {
        "mixed shapes, fp32": _Case("mixed shapes, fp32", mixed),
        "some .grad are None": _Case("some .grad are None", with_none),
        "no gradients at all": _Case("no gradients at all", [None, None]),
        # per-tensor norms ~40000 each: fine in fp16, but their squares (and the total) are not
        "large fp16 gradients": _Case("large fp16 gradients", [_randn(gen, (256,), 2500.0, torch.float16) for _ in range(8)]),
        "fp16 gradients": _Case("fp16 gradients", _mixed(gen, rnd, 4, torch.float16)),
        "bf16 gradients": _Case("bf16 gradients", [_randn(gen, (rnd.randint(200, 600),), 1.0, torch.bfloat16) for _ in range(3)]),
        "a NaN gradient": _Case("a NaN gradient", _poison(_mixed(gen, rnd, 4), rnd, math.nan)),
        "an inf gradient": _Case("an inf gradient", _poison(_mixed(gen, rnd, 4), rnd, rnd.choice([math.inf, -math.inf]))),
    }
    return [cases[k] for k in kinds]


# ---------------------------------------------------------------- 1. the global norm


def _diagnose_norm(got: float, want: float, case: _Case) -> str:
    """Name the likely mistake behind a wrong norm."""
    grads = [g for g in case.grads if g is not None]
    per = per_tensor_norms(grads, 2.0).tolist() if grads else []
    half = next((g.dtype for g in grads if g.dtype in HALF), None)
    if math.isinf(got) and half is torch.float16:
        return ("your norm overflowed to inf on fp16 gradients: accumulate in float32 (g.float(), or "
                "dtype=torch.float32); fp16 stops at 65504, and squares of gradients get there fast.")
    if math.isnan(got):
        return "you got NaN from finite gradients."
    if _close(got, want**2):
        return "that is the square of the norm: did you forget the square root?"
    if per and _close(got, sum(per)):
        return "you added the per-tensor norms; the global norm is the square root of the sum of their squares."
    if per and _close(got, max(per)):
        return "that is the largest per-tensor norm; the global norm treats all gradients as one vector."
    if per and _close(got, per[0]):
        return "that is the norm of the first gradient only; include every parameter's .grad."
    if half is not None and want > 0 and abs(got / want - 1) < 0.02:
        short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[half]
        bits = {torch.float16: 10, torch.bfloat16: 7}[half]
        return (f"it is off by {abs(got / want - 1):.2%} on {short} gradients: accumulate in float32 "
                f"({short} keeps only {bits} bits of mantissa).")
    if want > 0 and got > 0:
        return f"the norm differs by a factor of ~{got / want:.3g}."
    return ""


def _norm_cases(hidden: bool, seed: int) -> list[_Case]:
    return _gradient_cases(hidden, seed, ("mixed shapes, fp32", "some .grad are None", "large fp16 gradients",
                                          "fp16 gradients", "bf16 gradients", "a NaN gradient", "an inf gradient",
                                          "no gradients at all"))


def _run_norm(fn: Callable, case: _Case) -> dict[str, Any]:
    params = case.params()
    before = _grads(params)
    traps: list[str] = []
    with _forbid(NORM_FUNCS, "compute the norm", traps):
        out = _call(fn, params)
    out.update(traps=traps, changed=not _same(_grads(params), before), value=_ship(out.get("value")))
    return out


def _judge_norm(name: str, case: _Case, out: dict[str, Any], where: str) -> str | None:
    raised = _raised(name, out, where, _none_hint(case))
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
            return (f"{name} returned {value:g} {where}; {bad} gradient must give a NaN or inf norm: the step "
                    "decides to skip from it, so don't filter or nan_to_num non-finite values.")
        return None
    if not _close(value, want):
        diagnosis = _diagnose_norm(value, want, case)
        return f"{name} returned {value:g} {where}, labkit.grad_norm gives {want:g}" + (
            f": {diagnosis}" if diagnosis else ".")
    return None


# ---------------------------------------------------------------- 2. clipping in place


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-5)


def _clip_cases(hidden: bool, seed: int) -> list[_Case]:
    rnd = random.Random(seed + 1)
    cases = _gradient_cases(hidden, seed, ("mixed shapes, fp32", "some .grad are None", "fp16 gradients",
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


def _run_clip(fn: Callable, case: _Case) -> dict[str, Any]:
    params = case.params()
    objects = [p.grad for p in params]
    traps: list[str] = []
    with _forbid(CLIP_FUNCS, "write the clipping", traps), _no_host_sync(traps):
        out = _call(fn, params, case.max_norm)
    out.update(traps=traps, value=_ship(out.get("value")), grads=_grads(params),
               replaced=any(p.grad is not obj for p, obj in zip(params, objects)))
    return out


def _judge_clip(name: str, case: _Case, out: dict[str, Any], where: str) -> str | None:
    raised = _raised(name, out, where, _none_hint(case))
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
        if not _same(got, case.grads):
            return (f"{name} changed the gradients {where}, whose norm is {norm:g}: a non-finite norm must leave "
                    "them untouched (the step will be skipped and they are the evidence; multiplying by NaN or 0 "
                    "destroys it). Keep the factor at 1 with torch.where(torch.isfinite(norm), coef, 1.0).")
        if not _close(value, norm) and not (math.isinf(norm) and math.isnan(value)):
            return f"{name} returned {value:g} {where}; return the pre-clip norm, {norm:g}."
        return None
    if not _close(value, norm):
        hint = ("that is the norm after clipping; return the one before (the number worth logging: it shows "
                "the spike)." if norm > case.max_norm and _close(value, case.max_norm, 1e-3)
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
                hint = (f"the gradients were scaled although the norm {norm:.4g} is below max_norm: the factor "
                        "is min(1, max_norm / (norm + 1e-6)); clip only ever shrinks (torch.clamp(..., max=1.0)).")
            else:
                hint = (f"after clipping the norm is {after:.4g}, expected max_norm={case.max_norm:.4g}: scale every "
                        "gradient by max_norm / (norm + 1e-6), with the norm of all of them together.")
            return f"{name} clipped wrongly {where}: {hint}"
    return None


# ---------------------------------------------------------------- 3. skip or step


def _skip_cases(hidden: bool, seed: int) -> list[tuple[_Case, str | None]]:
    finite = [torch.tensor([0.5, -1.0]), torch.tensor([[2.0]])]
    if not hidden:
        return [
            (_Case("finite loss and gradients", finite, loss=0.7), None),
            (_Case("NaN loss", finite, loss=math.nan), "nonfinite_loss"),
            (_Case("an inf gradient", [torch.tensor([0.5, math.inf]), torch.tensor([[2.0]])], loss=0.7), "nonfinite_grad"),
        ]
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    mixed = _mixed(gen, rnd, 4)
    with_none = mixed[:2] + [None] + mixed[2:]
    nan_grad = _poison(mixed, rnd, math.nan)
    # finite fp16 values whose squares and fp16 norm overflow: a norm taken in fp16 cries wolf
    big16 = [_randn(gen, (256,), 2500.0, torch.float16) for _ in range(8)]
    return [
        (_Case("finite, some .grad are None", with_none, loss=rnd.uniform(0.1, 3)), None),
        (_Case("+inf loss", mixed, loss=math.inf), "nonfinite_loss"),
        (_Case("-inf loss", mixed, loss=-math.inf), "nonfinite_loss"),
        (_Case("NaN loss in fp16", mixed, loss=math.nan, loss_dtype=torch.float16), "nonfinite_loss"),
        (_Case("NaN loss and NaN gradients", nan_grad, loss=math.nan), "nonfinite_loss"),
        (_Case("a NaN gradient", nan_grad, loss=rnd.uniform(0.1, 3)), "nonfinite_grad"),
        (_Case("a -inf gradient", _poison(mixed, rnd, -math.inf), loss=rnd.uniform(0.1, 3)), "nonfinite_grad"),
        (_Case("large but finite fp16 gradients", big16, loss=rnd.uniform(0.1, 3), loss_dtype=torch.float16), None),
        (_Case("a huge but finite loss", mixed, loss=1e30), None),
    ]


def _run_skip(fn: Callable, case: tuple[_Case, str | None]) -> dict[str, Any]:
    traps: list[str] = []
    with _forbid(STEP_FUNCS, "decide", traps):
        out = _call(fn, torch.tensor(case[0].loss, dtype=case[0].loss_dtype), case[0].params())
    out.update(traps=traps, value=_ship(out.get("value")))
    return out


def _judge_skip(name: str, case: tuple[_Case, str | None], out: dict[str, Any], where: str) -> str | None:
    case, want = case
    raised = _raised(name, out, where, _none_hint(case))
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
        hint = ("every gradient is finite, but an fp16 norm of them overflows: test torch.isfinite(g).all() per "
                "gradient, or take the norm in float32.")
    elif want is None:
        hint = "a finite loss and finite gradients is a normal step: return None."
    elif want == "nonfinite_loss" and got == "nonfinite_grad":
        hint = "check the loss first: on a bad loss backward never runs, so its gradients don't count."
    elif want == "nonfinite_loss":
        hint = f"the loss is {case.loss}: NaN, +inf and -inf are all not finite (math.isfinite, torch.isfinite)."
    else:
        hint = ("one gradient holds a NaN or inf: check every .grad that exists (torch.isfinite(g).all(), or "
                "whether the global norm is finite).")
    return f"{name} returned {got!r} {where}, expected {want!r}: {hint}"


# ---------------------------------------------------------------- 4. the loss-scale rule



def _ref_update(state: tuple[float, int, int], found_inf: bool, config: ScalerConfig) -> tuple[float, int, int]:
    tracker, hyst = (torch.tensor(v, dtype=torch.int32) for v in state[1:])
    s, g, h = update_scale(torch.tensor(state[0]), tracker, hyst, torch.tensor(float(found_inf)), config)
    return s.item(), int(g.item()), int(h.item())


def _scale_hint(state: tuple[float, int, int], found: bool, got: tuple, want: tuple, config: ScalerConfig) -> str:
    scale = state[0]
    if found and want[0] == scale and got[0] < scale:
        return (f"with hysteresis={config.hysteresis}, back off only when hysteresis_left reaches 0 (it counts the "
                "overflows since the last growth), not on every overflow.")
    if found and want[0] < scale and got[0] != want[0]:
        return (f"on this overflow the scale must back off to scale * backoff_factor = {want[0]:g} "
                f"(hysteresis_left {state[2]} -> {want[2]}).")
    if not found and want[0] > scale and got[0] == scale:
        return (f"this is clean step number growth_interval={config.growth_interval} in a row: grow when "
                "growth_tracker + 1 reaches growth_interval (count this step too), then reset the tracker to 0.")
    if not found and got[0] > scale and want[0] == scale:
        return (f"the scale grew too early: it grows only after growth_interval={config.growth_interval} clean steps "
                "in a row, and an overflow resets the count to 0.")
    if got[1] != want[1]:
        return ("growth_tracker is wrong: +1 on a clean step, back to 0 on an overflow and after a growth.")
    if got[2] != want[2]:
        return ("hysteresis_left is wrong: -1 on an overflow (never below 0), refilled to config.hysteresis after a "
                "growth, unchanged on other clean steps.")
    return "the scale is wrong."


def _scale_runs(hidden: bool, seed: int) -> list[tuple[str, ScalerConfig, float, list[bool]]]:
    if not hidden:
        return [
            ("two overflows, hysteresis=1", ScalerConfig(growth_interval=3), 1024.0, [True, True]),
            ("three clean steps, growth_interval=3", ScalerConfig(growth_interval=3), 1024.0, [False, False, False]),
            ("hysteresis=2: overflow, overflow", ScalerConfig(growth_interval=3, hysteresis=2), 1024.0, [True, True]),
        ]
    rnd = random.Random(seed)
    runs = []
    for k in range(6):
        config = ScalerConfig(growth_factor=rnd.choice([2.0, 4.0]), backoff_factor=rnd.choice([0.5, 0.25]),
                              growth_interval=rnd.randint(1, 5), hysteresis=1 if k < 2 else rnd.randint(2, 3))
        flags = [rnd.random() < rnd.uniform(0.15, 0.5) for _ in range(40)]
        runs.append((f"a random run of 40 steps #{k}", config, 2.0 ** rnd.randint(4, 16), flags))
    return runs


@dataclass
class _ScaleCase:
    """One step of a scale run: the state labkit's rule reached, and whether this step overflowed."""

    name: str
    config: ScalerConfig
    state: tuple[float, int, int]
    found: bool


def _scale_cases(hidden: bool, seed: int) -> list[_ScaleCase]:
    cases = []
    for run, config, init, flags in _scale_runs(hidden, seed):
        state = (init, 0, config.hysteresis)
        for i, found in enumerate(flags):
            cases.append(_ScaleCase(f"{run}, step {i}", config, state, found))
            state = _ref_update(state, found, config)
    return cases


def _run_scale(fn: Callable, case: _ScaleCase) -> dict[str, Any]:
    traps: list[str] = []
    with _forbid(SCALE_FUNCS, "write the rule", traps):
        out = _call(fn, *case.state, case.found, copy.copy(case.config))
    out.update(traps=traps, value=_ship(out.get("value")))
    return out


def _judge_scale(name: str, case: _ScaleCase, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    where = _where(case.name, hidden, seed)
    raised = _raised(name, out, where)
    if raised:
        return raised
    shipped, state = out["value"], case.state
    items = shipped.get("items", [])
    try:
        got = (float(_number(items[0])), int(_number(items[1])), int(_number(items[2])))
    except (TypeError, ValueError, IndexError):
        shown = repr(shipped["py"]) if "py" in shipped else f"a {shipped['type']}"
        return f"{name} returned {shown} {where}; return a tuple (scale, growth_tracker, hysteresis_left)."
    want = _ref_update(state, case.found, case.config)
    if got != want:
        return (f"{name}(scale={state[0]:g}, growth_tracker={state[1]}, hysteresis_left={state[2]}, "
                f"found_inf={case.found}) returned {got}, expected {want} {where} with {case.config}: "
                f"{_scale_hint(state, case.found, got, want, case.config)}")
    return None



# ---------------------------------------------------------------- 5. the guarded step


@dataclass
class _Scenario:
    """A short fp16 run with scheduled faults, played by TrainStep and by the student's step."""

    name: str
    seed: int
    steps: int
    faults: dict[int, str]
    max_norm: float
    init_scale: float
    growth_interval: int
    compare_norm: bool  # off where max_norm never bites, so each bug is reported by one scenario only


def _scenarios(hidden: bool, seed: int) -> list[_Scenario]:
    if not hidden:
        return [
            _Scenario("clipping", 0, 6, {}, 0.05, 2.0**10, 100, True),
            _Scenario("skipped steps", 1, 8, {2: "nan", 4: "overflow", 5: "overflow"}, 1e9, 2.0**10, 2, False),
        ]
    rnd = random.Random(seed)
    bad = rnd.sample(range(1, 11), 4)
    return [
        _Scenario("clipping", seed, 8, {}, rnd.uniform(0.02, 0.1), 2.0 ** rnd.randint(8, 14), 100, True),
        _Scenario("skipped steps", seed + 1, 12, {bad[0]: "nan", bad[1]: "inf", bad[2]: "overflow", bad[3]: "overflow"},
                  1e9, 2.0 ** rnd.randint(8, 14), rnd.randint(2, 3), False),
    ]


class _Run:
    """A model, an SGD optimizer, an LR scheduler and a scaler for one side of a scenario."""

    def __init__(self, sc: _Scenario) -> None:
        with torch.random.fork_rng(devices=[]):  # the student's own RNG stream is left alone
            torch.manual_seed(sc.seed)
            self.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        # plain SGD: the update is lr * grad, so a wrong gradient scale shows as the same factor
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)
        self.scaler = GradScaler("cpu", init_scale=sc.init_scale, growth_interval=sc.growth_interval)
        self.fault: Fault | None = None

    def loss_fn(self, out: Tensor, targets: Tensor) -> Tensor:
        if self.fault is not None:
            out = self.fault.corrupt_output(out)
        return nn.functional.mse_loss(out.float(), targets)

    def params(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _batches(sc: _Scenario) -> list[tuple[Tensor, Tensor, Fault | None]]:
    gen = torch.Generator().manual_seed(sc.seed + 1000)
    out = []
    for i in range(sc.steps):
        x = torch.randn(16, 4, generator=gen)
        y = torch.randn(16, 1, generator=gen)
        fault = Fault(sc.faults[i]) if i in sc.faults else None
        if fault is not None:
            x = fault.corrupt_inputs(x)
        out.append((x, y, fault))
    return out


def _ship_record(rec: Any) -> dict[str, Any]:
    """Return a step's record as data; a field that is not a number, bool, string or None is only named."""
    if not isinstance(rec, StepRecord):
        return {"type": type(rec).__name__}
    fields = {}
    for field in ("step", "loss", "grad_norm", "scale", "next_scale", "skipped", "reason"):
        value = _ship(getattr(rec, field, None))
        if "tensor" in value:  # a logged tensor is compared by value, and named (it costs a sync to log)
            value = {"type": value["type"], "py": value["tensor"].float().item()} if value["tensor"].numel() == 1 \
                else {"type": value["type"]}
        fields[field] = value
    return {"type": "StepRecord", "fields": fields}


def _state(run: _Run, params: list[Tensor]) -> dict[str, Any]:
    """Return what the grader compares after a step: parameters, scheduler epoch, scale."""
    return {"params": [p.detach().clone() for p in params], "epoch": int(run.scheduler.last_epoch),
            "scale": float(GradScaler.get_scale(run.scaler))}


def _run_step(fn: Callable, sc: _Scenario) -> dict[str, Any]:
    theirs = _Run(sc)
    params = list(theirs.model.parameters())  # read directly: the student's code holds the model
    steps, raised = [], {}
    for i, (x, y, fault) in enumerate(_batches(sc)):
        theirs.fault = fault
        traps: list[str] = []
        with _forbid(STEP_FUNCS, "write the step", traps):
            out = _call(fn, i, theirs.model, theirs.optimizer, theirs.scaler, theirs.scheduler, theirs.loss_fn,
                        x.clone(), y.clone(), sc.max_norm)
        # what the step raised goes up to where run() drops it: an exception object (labkit's ScalerUsageError
        # from a step that never called scaler.step) is not data, and torch.load(weights_only=True) refuses it
        raised = {"_exc": out.pop("_exc")} if "_exc" in out else {}
        out.update(_state(theirs, params), traps=traps, record=_ship_record(out.pop("value", None)))
        steps.append(out)
        if out.get("raised") or traps:
            break
    return {"steps": steps, **raised}


def _step_problem(i: int, sc: _Scenario, ref: StepRecord, rec: dict[str, Any], mine: dict[str, Any],
                  theirs: dict[str, Any], before: list[Tensor]) -> str | None:
    """Return what is wrong with the student's step ``i``, or None if it matches TrainStep's."""
    kind = f"skipped: {ref.reason}" if ref.skipped else ("clipped" if ref.clipped else "normal")
    at = f"at step {i} ({kind})"
    if rec["type"] != "StepRecord":
        return f"returned {rec['type']} {at}; return a labkit.StepRecord (the log of this step)."
    fields = {k: v.get("py", f"a {v['type']}") for k, v in rec["fields"].items()}
    if theirs["epoch"] > mine["epoch"]:
        return (f"the scheduler advanced on a skipped step {at}: call scheduler.step() only when "
                "scaler.step(optimizer) returned True (the optimizer really stepped).")
    if theirs["epoch"] < mine["epoch"]:
        return f"the scheduler did not advance {at}: call scheduler.step() after every step the optimizer took."
    scale, their_scale = ref.scale, theirs["scale"]
    if ref.reason == "nonfinite_loss" and their_scale != mine["scale"]:
        return (f"the loss scale changed on a NaN/inf loss {at} ({scale:g} -> {their_scale:g}): check the loss before "
                "backward and skip without backward or scaler.update(); a bad batch is not a scaling problem.")
    norm = fields["grad_norm"]
    if sc.compare_norm and not ref.skipped:
        if not isinstance(norm, (int, float)) or isinstance(norm, bool):
            return f"logged grad_norm={norm} {at}; log the global norm of the unscaled gradients as a number."
        if not _close(norm, ref.grad_norm):
            ratio = norm / ref.grad_norm if ref.grad_norm else math.inf
            if _close(ratio, scale, 0.02):
                return (f"the logged norm differs by a factor of ~{ratio:.0f} (the loss scale) {at}: did you clip "
                        "before unscaling? Call scaler.unscale_(optimizer) first, then measure and clip.")
            return (f"logged grad_norm={norm:.6g} {at}, expected {ref.grad_norm:.6g}: log the global norm of the "
                    "unscaled gradients, before clipping.")
    params, want = theirs["params"], mine["params"]
    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(params, want)):
        if ref.skipped:
            return (f"the parameters changed on a skipped step {at}: on a non-finite loss or gradient, neither "
                    "optimizer.step() nor backward's garbage may reach them.")
        theirs_delta = torch.cat([(a - b).flatten() for a, b in zip(params, before)]).norm().item()
        ref_delta = torch.cat([(a - b).flatten() for a, b in zip(want, before)]).norm().item()
        ratio = theirs_delta / ref_delta if ref_delta else math.inf
        if ref.clipped and _close(ratio, 1 / scale, 0.05):
            return (f"the update is ~{scale:.0f}x too small {at}: the norm differs by a factor of ~{scale:.0f}, the "
                    "loss scale: did you clip before unscaling? Call scaler.unscale_(optimizer) first, then clip.")
        if _close(ratio, scale, 0.05):
            return f"the update is ~{scale:.0f}x too large {at}: the gradients were never unscaled (scaler.unscale_)."
        if ref.clipped and ratio > 1.5:
            return (f"the update is {ratio:.3g}x too large {at}: clip the unscaled gradients to max_norm before "
                    "scaler.step(optimizer).")
        return (f"the parameters after step {i} differ from labkit.TrainStep's {at}: follow the order zero_grad -> "
                "forward under autocast -> loss check -> scale(loss).backward() -> unscale_ -> norm -> check -> "
                "clip -> step -> scheduler -> update.")
    if bool(fields["skipped"]) != ref.skipped or fields["reason"] != ref.reason:
        return (f"logged skipped={fields['skipped']!r}, reason={fields['reason']!r} {at}; expected "
                f"skipped={ref.skipped}, reason={ref.reason!r}.")
    if their_scale != mine["scale"]:
        return (f"the loss scale after step {i} is {their_scale:g}, expected {mine['scale']:g}: call "
                "scaler.update() once per step that ran backward, skipped or not.")
    if fields["scale"] != ref.scale or fields["next_scale"] != ref.next_scale:
        return (f"logged scale={fields['scale']!r}, next_scale={fields['next_scale']!r} {at}; expected "
                f"{ref.scale:g} and {ref.next_scale:g}: log scaler.get_scale() before the step and after update().")
    return None


_REFERENCES: dict[str, tuple[list[Tensor], list[tuple[StepRecord, dict[str, Any]]]]] = {}


def _reference(sc: _Scenario) -> tuple[list[Tensor], list[tuple[StepRecord, dict[str, Any]]]]:
    """Return TrainStep's run of ``sc``: the initial parameters, then each step's record and state.

    The visible scenarios are the same for every student: a class computes them once.
    """
    key = repr(sc)
    if key in _REFERENCES:
        return _REFERENCES[key]
    mine = _Run(sc)
    reference = TrainStep(mine.model, mine.optimizer, mine.loss_fn, precision="fp16", max_norm=sc.max_norm,
                          scaler=mine.scaler, scheduler=mine.scheduler, skip_alarm=None, clip_alarm=None)
    params = list(mine.model.parameters())
    initial, steps = [p.detach().clone() for p in params], []
    for x, y, fault in _batches(sc):
        mine.fault = fault
        steps.append((reference(x, y), _state(mine, params)))
    if len(_REFERENCES) > 16:  # hidden scenarios differ per student: keep the cache small
        _REFERENCES.clear()
    _REFERENCES[key] = (initial, steps)
    return initial, steps


def _judge_step(name: str, sc: _Scenario, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
    before, reference = _reference(sc)
    steps = out.get("steps", [])
    for i, (ref, mine) in enumerate(reference[: len(steps)]):  # the harness stops only after a problem
        theirs = steps[i]
        raised = _raised(name, theirs, _where(f"{sc.name}, step {i}", hidden, seed))
        problem = raised or _step_problem(i, sc, ref, theirs["record"], mine, theirs, before)
        if problem is not None:
            return problem if raised else f"[{sc.name}{'' if not hidden else f', seed={seed}'}] {problem}"
        before = theirs["params"]
    return None


# ---------------------------------------------------------------- the checks, in process and split


CHECKS = {
    "check_grad_norm": Check(_norm_cases, _run_norm, _by_name(_judge_norm)),
    "check_clip": Check(_clip_cases, _run_clip, _by_name(_judge_clip)),
    "check_skip_decision": Check(_skip_cases, _run_skip, _by_name(_judge_skip)),
    "check_update_scale": Check(_scale_cases, _run_scale, _judge_scale),
    "check_guarded_step": Check(_scenarios, _run_step, _judge_step, every_case=True),
}
BANNED = {"check_grad_norm": NORM_FUNCS, "check_clip": CLIP_FUNCS, "check_skip_decision": STEP_FUNCS,
          "check_update_scale": SCALE_FUNCS, "check_guarded_step": STEP_FUNCS}


def check_grad_norm(fn: Callable[[list[Tensor]], Tensor], hidden: bool = False, seed: int | None = None) -> None:
    """Check that ``fn(parameters)`` returns the global L2 norm of their ``.grad`` as ``labkit.grad_norm`` does.

    >>> def global_grad_norm(parameters):
    ...     norms = [p.grad.float().norm() for p in parameters if p.grad is not None]
    ...     return torch.stack(norms).norm() if norms else torch.tensor(0.0)
    >>> check_grad_norm(global_grad_norm, hidden=True, seed=0)
    >>> check_grad_norm(lambda parameters: torch.tensor(7.0))
    Traceback (most recent call last):
    ...
    AssertionError: <lambda> returned 7 on the case 'grads [3, 4] and [12]', labkit.grad_norm gives 13: the norm differs by a factor of ~0.538.
    """
    check(CHECKS["check_grad_norm"], fn, hidden, seed, BANNED["check_grad_norm"])


def check_clip(fn: Callable[[list[Tensor], float], Tensor], hidden: bool = False, seed: int | None = None) -> None:
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
    check(CHECKS["check_clip"], fn, hidden, seed, BANNED["check_clip"])


def check_skip_decision(fn: Callable[[Tensor, list[Tensor]], str | None], hidden: bool = False,
                        seed: int | None = None) -> None:
    """Check that ``fn(loss, parameters)`` returns ``None`` (step), ``"nonfinite_loss"`` or ``"nonfinite_grad"``.

    A bad loss wins over bad gradients (on a bad loss, backward must not even run).

    >>> import math, labkit
    >>> def skip_reason(loss, parameters):
    ...     if not math.isfinite(loss.item()):
    ...         return "nonfinite_loss"
    ...     return None if torch.isfinite(labkit.grad_norm(parameters)) else "nonfinite_grad"
    >>> check_skip_decision(skip_reason, hidden=True, seed=0)
    """
    check(CHECKS["check_skip_decision"], fn, hidden, seed, BANNED["check_skip_decision"])


def check_update_scale(fn: Callable[..., tuple[float, int, int]], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(scale, growth_tracker, hysteresis_left, found_inf, config)`` against ``labkit.update_scale``.

    ``fn`` takes and returns plain numbers: ``(scale, growth_tracker, hysteresis_left)``.

    >>> import labkit
    >>> def next_scale(scale, growth_tracker, hysteresis_left, found_inf, config):
    ...     if found_inf:
    ...         hysteresis_left = max(hysteresis_left - 1, 0)
    ...         return (scale * config.backoff_factor if hysteresis_left == 0 else scale), 0, hysteresis_left
    ...     if growth_tracker + 1 == config.growth_interval:
    ...         return scale * config.growth_factor, 0, config.hysteresis
    ...     return scale, growth_tracker + 1, hysteresis_left
    >>> check_update_scale(next_scale, hidden=True, seed=0)
    """
    check(CHECKS["check_update_scale"], fn, hidden, seed, BANNED["check_update_scale"])


def check_guarded_step(fn: Callable[..., StepRecord], hidden: bool = False, seed: int | None = None) -> None:
    """Check ``fn(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets, max_norm)`` against ``TrainStep``.

    Two fp16 scenarios run side by side with ``labkit.TrainStep``: one where clipping bites, one
    with a NaN batch and overflows. ``fn`` returns a ``labkit.StepRecord``; the parameters,
    the scheduler, the scale and the record must match after every step. Every scenario's
    first problem is reported.

    >>> import math, labkit, torch
    >>> def guarded_step(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets, max_norm):
    ...     optimizer.zero_grad(set_to_none=True)
    ...     with torch.autocast("cpu", dtype=torch.float16):
    ...         loss = loss_fn(model(inputs), targets)
    ...     scale = scaler.get_scale()
    ...     if not math.isfinite(loss.item()):
    ...         return labkit.StepRecord(step, loss.item(), scale=scale, next_scale=scale, skipped=True,
    ...                                  reason="nonfinite_loss")
    ...     scaler.scale(loss).backward()
    ...     scaler.unscale_(optimizer)
    ...     norm = labkit.grad_norm(model.parameters())
    ...     stepped = False
    ...     if torch.isfinite(norm):
    ...         labkit.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    ...         stepped = scaler.step(optimizer)
    ...     if stepped:
    ...         scheduler.step()
    ...     scaler.update()
    ...     return labkit.StepRecord(step, loss.item(), grad_norm=norm.item(), scale=scale,
    ...                              next_scale=scaler.get_scale(), skipped=not stepped,
    ...                              reason=None if stepped else "nonfinite_grad")
    >>> check_guarded_step(guarded_step, hidden=True, seed=0)
    """
    check(CHECKS["check_guarded_step"], fn, hidden, seed, BANNED["check_guarded_step"])
