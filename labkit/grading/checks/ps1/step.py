"""Set 1, part 5: the guarded fp16 step, side by side with ``labkit.TrainStep``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from labkit.faults import Fault
from labkit.records import StepRecord
from labkit.scaler import GradScaler
from labkit.step import TrainStep

from ..core import (
    Check,
    call_student,
    check,
    close,
    forbid,
    on_case,
    raised_problem,
    ship,
)
from .bans import STEP_FUNCS


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
            _Scenario("skipped steps", 1, 8, {2: "nan", 4: "overflow", 5: "overflow"}, 1e9, 2.0**10, 2,
                      False),
        ]
    rnd = random.Random(seed)
    bad = rnd.sample(range(1, 11), 4)
    return [
        _Scenario("clipping", seed, 8, {}, rnd.uniform(0.02, 0.1), 2.0 ** rnd.randint(8, 14), 100, True),
        _Scenario("skipped steps", seed + 1, 12,
                  {bad[0]: "nan", bad[1]: "inf", bad[2]: "overflow", bad[3]: "overflow"}, 1e9,
                  2.0 ** rnd.randint(8, 14), rnd.randint(2, 3), False),
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
        value = ship(getattr(rec, field, None))
        if "tensor" in value:  # a logged tensor is compared by value, and named (it costs a sync to log)
            tensor = value["tensor"]
            value = {"type": value["type"], **({"py": tensor.float().item()} if tensor.numel() == 1 else {})}
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
        with forbid(STEP_FUNCS, "write the step", traps):
            out = call_student(fn, i, theirs.model, theirs.optimizer, theirs.scaler, theirs.scheduler,
                               theirs.loss_fn, x.clone(), y.clone(), sc.max_norm)
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
        return (f"the scheduler did not advance {at}: call scheduler.step() after every step the optimizer "
                "took.")
    scale, their_scale = ref.scale, theirs["scale"]
    if ref.reason == "nonfinite_loss" and their_scale != mine["scale"]:
        return (f"the loss scale changed on a NaN/inf loss {at} ({scale:g} -> {their_scale:g}): check the "
                "loss before backward and skip without backward or scaler.update(); a bad batch is not a "
                "scaling problem.")
    norm = fields["grad_norm"]
    if sc.compare_norm and not ref.skipped:
        if not isinstance(norm, (int, float)) or isinstance(norm, bool):
            return f"logged grad_norm={norm} {at}; log the global norm of the unscaled gradients as a number."
        if not close(norm, ref.grad_norm):
            ratio = norm / ref.grad_norm if ref.grad_norm else math.inf
            if close(ratio, scale, 0.02):
                return (f"the logged norm differs by a factor of ~{ratio:.0f} (the loss scale) {at}: did you "
                        "clip before unscaling? Call scaler.unscale_(optimizer) first, then measure and "
                        "clip.")
            return (f"logged grad_norm={norm:.6g} {at}, expected {ref.grad_norm:.6g}: log the global norm of "
                    "the unscaled gradients, before clipping.")
    params, want = theirs["params"], mine["params"]
    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(params, want)):
        if ref.skipped:
            return (f"the parameters changed on a skipped step {at}: on a non-finite loss or gradient, "
                    "neither optimizer.step() nor backward's garbage may reach them.")
        theirs_delta = torch.cat([(a - b).flatten() for a, b in zip(params, before)]).norm().item()
        ref_delta = torch.cat([(a - b).flatten() for a, b in zip(want, before)]).norm().item()
        ratio = theirs_delta / ref_delta if ref_delta else math.inf
        if ref.clipped and close(ratio, 1 / scale, 0.05):
            return (f"the update is ~{scale:.0f}x too small {at}: the norm differs by a factor of "
                    f"~{scale:.0f}, the loss scale: did you clip before unscaling? Call "
                    "scaler.unscale_(optimizer) first, then clip.")
        if close(ratio, scale, 0.05):
            return (f"the update is ~{scale:.0f}x too large {at}: the gradients were never unscaled "
                    "(scaler.unscale_).")
        if ref.clipped and ratio > 1.5:
            return (f"the update is {ratio:.3g}x too large {at}: clip the unscaled gradients to max_norm "
                    "before scaler.step(optimizer).")
        return (f"the parameters after step {i} differ from labkit.TrainStep's {at}: follow the order "
                "zero_grad -> forward under autocast -> loss check -> scale(loss).backward() -> unscale_ -> "
                "norm -> check -> clip -> step -> scheduler -> update.")
    if bool(fields["skipped"]) != ref.skipped or fields["reason"] != ref.reason:
        return (f"logged skipped={fields['skipped']!r}, reason={fields['reason']!r} {at}; expected "
                f"skipped={ref.skipped}, reason={ref.reason!r}.")
    if their_scale != mine["scale"]:
        return (f"the loss scale after step {i} is {their_scale:g}, expected {mine['scale']:g}: call "
                "scaler.update() once per step that ran backward, skipped or not.")
    if fields["scale"] != ref.scale or fields["next_scale"] != ref.next_scale:
        return (f"logged scale={fields['scale']!r}, next_scale={fields['next_scale']!r} {at}; expected "
                f"{ref.scale:g} and {ref.next_scale:g}: log scaler.get_scale() before the step and after "
                "update().")
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
        raised = raised_problem(name, theirs, on_case(f"{sc.name}, step {i}", hidden, seed))
        problem = raised or _step_problem(i, sc, ref, theirs["record"], mine, theirs, before)
        if problem is not None:
            return problem if raised else f"[{sc.name}{'' if not hidden else f', seed={seed}'}] {problem}"
        before = theirs["params"]
    return None


CHECK = Check(_scenarios, _run_step, _judge_step, every_case=True)


def check_guarded_step(fn: Callable[..., StepRecord], hidden: bool = False, seed: int | None = None) -> None:
    """Check the guarded step ``fn(step, model, optimizer, scaler, scheduler, loss_fn, inputs, ...)``.

    Its arguments end with ``targets, max_norm``. Two fp16 scenarios run side by side with
    ``labkit.TrainStep``: one where clipping bites, one with a NaN batch and overflows. ``fn``
    returns a ``labkit.StepRecord``; the parameters, the scheduler, the scale and the record must
    match after every step. Every scenario's first problem is reported.

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
    check(CHECK, fn, hidden, seed, STEP_FUNCS)
