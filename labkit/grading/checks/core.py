"""What every check shares: calling student code, shipping what it returned, traps, bans, running cases.

A check (``Check``) is three functions that meet only through data: ``cases(hidden, seed)``
builds its inputs, ``run(fn, case)`` calls the student's function on one and returns what it
saw as plain data (what ``torch.save``/``torch.load(weights_only=True)`` carries), and
``judge(name, case, out, hidden, seed)`` compares that with labkit's reference and returns
the failure message, or None. The grader runs ``run_cases`` in the student's sandboxed
process and ``judge_cases`` in its own (``labkit.grading.harness``), so a submission cannot
reach the verdict; ``check`` runs both in one process, for the notebook's test cells.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .cells import scan

__all__ = ["CLIP_ADVICE", "SYNCS", "Check", "as_number", "as_plain", "ban_homes", "call_student", "check",
           "close", "forbid", "grads_of", "install_bans", "judge_cases", "located", "no_host_sync", "on_case",
           "raised_problem", "run_cases", "same_bits", "ship"]

# ---------------------------------------------------------------- calling student code


class _Trapped(BaseException):
    """Raised inside student code by a trap; a BaseException, so ``except Exception`` can't hide it."""


def on_case(case: str, hidden: bool, seed: int) -> str:
    """Say which case a message is about; a hidden one with its seed, so it can be replayed.

    >>> on_case("NaN loss", hidden=True, seed=7)
    "on the hidden case 'NaN loss' (seed=7)"
    """
    return f"on the hidden case '{case}' (seed={seed})" if hidden else f"on the case '{case}'"


def ship(value: Any, items: int = 8) -> Any:
    """Return ``value`` as plain data: tensors as plain tensors, numbers and strings as they are.

    A tensor subclass is read with torch functions off, so its own ``__torch_function__``
    cannot choose what the grader sees; a tuple or list keeps its first ``items`` items;
    anything else is only named.
    """
    if isinstance(value, Tensor):
        with torch._C.DisableTorchFunction():
            plain = value.detach().clone().as_subclass(Tensor)
        return {"type": type(value).__name__, "tensor": plain}
    if value is None or type(value) in (bool, int, float, str):
        return {"type": type(value).__name__, "py": value}
    if type(value) in (tuple, list):
        return {"type": type(value).__name__, "items": [ship(v, items) for v in value[:items]],
                "len": len(value)}
    return {"type": type(value).__name__}


def call_student(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call the student's ``fn``; return ``{"value": ...}`` or what it raised, as data.

    ``_exc`` keeps the exception itself for the in-process checks (its traceback helps the
    student); it never leaves the process.
    """
    try:
        return {"value": fn(*args, **kwargs)}
    except NotImplementedError:
        return {"raised": "NotImplementedError", "message": ""}
    except _Trapped as e:
        return {"raised": "trap", "message": str(e)}
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "_exc": e}


def raised_problem(name: str, out: dict[str, Any], where: str, hint: str = "") -> str | None:
    """Return the message for what the student's function raised or tripped over, or None."""
    if out.get("traps"):
        return f"{name}, {where}, {out['traps'][0]}."
    kind = out.get("raised")
    if kind is None:
        return None
    if kind == "NotImplementedError":
        return f"{name} is not implemented yet: replace `raise NotImplementedError()` with your code."
    if kind == "trap":
        return f"{name}, {where}, {out['message']}."
    if kind == "AssertionError":
        return out["message"]
    return f"{name} raised {kind}: {out['message']} {where}.{hint}"


SYNCS = {
    "item": "called .item() on a tensor",
    "tolist": "called .tolist() on a tensor",
    "numpy": "called .numpy() on a tensor",
    "__bool__": "used a tensor as a Python bool (an `if`, `and`/`or`, min()/max() or a comparison)",
    "__float__": "called float() on a tensor",
    "__int__": "called int() on a tensor",
}


CLIP_ADVICE = ("compute the factor as a tensor (torch.clamp(max_norm / (norm + 1e-6), max=1.0)) and choose "
               "with torch.where, not `if`")


@contextlib.contextmanager
def no_host_sync(traps: list[str], advice: str = CLIP_ADVICE) -> Iterator[None]:
    """Make every tensor-to-Python conversion raise, and note it in ``traps`` (kept if swallowed).

    ``advice`` says how to do without it, in the part's own terms.
    """
    saved = {name: getattr(Tensor, name) for name in SYNCS}

    def trap(what: str) -> Callable:
        def raise_(*args: Any, **kwargs: Any) -> Any:
            message = (f"synced with the host: it {what}. In the hot path that waits for the GPU every step; "
                       f"{advice}")
            traps.append(message)
            raise _Trapped(message)
        return raise_

    try:
        for name, what in SYNCS.items():
            setattr(Tensor, name, trap(what))
        yield
    finally:
        for name, method in saved.items():
            setattr(Tensor, name, method)


# ---- bans: library functions a part asks the student to write. The wrappers go in once and stay
# (a reference saved before the test is the wrapper too); while a part's ban is on they refuse every
# call, however it is reached: directly, through an alias, a saved reference, a subclass, or another
# library function (labkit's own, a torch loop or a thread pool calling it for the student).

_TORCH_HOMES = ("torch.nn.utils", "torch.nn.utils.clip_grad", "torch.amp", "torch.amp.grad_scaler")
_ACTIVE: list[tuple[frozenset[Callable], str, list[str]]] = []  # (the wrappers banned now, task, traps seen)


def ban_homes() -> list[str]:
    """Return the modules a banned function may be re-exported from: labkit's, loaded now, and torch's."""
    return sorted(n for n in sys.modules if n == "labkit" or n.startswith("labkit.")) + list(_TORCH_HOMES)


def _wrap(original: Callable, full: str) -> Callable:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if any(guarded in wrappers for wrappers, _, _ in _ACTIVE):
            _, task, traps = next(a for a in _ACTIVE if guarded in a[0])
            message = f"called {full}: this part asks you to {task} yourself"
            traps.append(message)
            raise _Trapped(message)
        return original(*args, **kwargs)

    guarded.__labkit_ban__ = full
    return guarded


def install_bans(names: tuple[str, ...]) -> frozenset[Callable]:
    """Put a ban wrapper in every home of each of ``names`` (once); return the wrappers."""
    wrappers = set()
    for full in names:
        home, attr = full.rsplit(".", 1)
        found = getattr(importlib.import_module(home), attr, None)
        if found is None:
            continue
        if isinstance(found, type):  # a class: guard its constructor (subclasses call it too)
            if not hasattr(found.__dict__.get("__init__"), "__labkit_ban__"):
                found.__init__ = _wrap(found.__init__, full)
            wrappers.add(found.__init__)
            continue
        wrapper = found if hasattr(found, "__labkit_ban__") else _wrap(found, full)
        for other in ban_homes():  # the same function re-exported elsewhere gets the same wrapper
            module = sys.modules.get(other)
            if module is not None and module.__dict__.get(attr) is found:
                setattr(module, attr, wrapper)
        wrappers.add(wrapper)
    return frozenset(wrappers)


@contextlib.contextmanager
def forbid(names: tuple[str, ...], task: str, traps: list[str]) -> Iterator[None]:
    """Make the library functions the part asks the student to write refuse, noting each call in ``traps``."""
    _ACTIVE.append((install_bans(names), task, traps))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _seed(hidden: bool, seed: int | None) -> int:
    if seed is not None:
        return seed
    return int.from_bytes(os.urandom(4), "little") if hidden else 0


def close(a: float, b: float, rel: float = 1e-4) -> bool:
    """Return whether two numbers agree to ``rel`` (absolutely to 1e-6 near 0); NaN agrees only with NaN.

    >>> close(1.0, 1.00001), close(float("nan"), float("nan")), close(1.0, float("nan"))
    (True, True, False)
    """
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-6)


def grads_of(params: list[Tensor]) -> list[Tensor | None]:
    """Return a copy of each parameter's ``.grad`` as a plain tensor (None where there is none)."""
    return [None if p.grad is None else p.grad.detach().clone().as_subclass(Tensor) for p in params]


def same_bits(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    """Return whether two lists of gradients are bit for bit equal (NaN included)."""
    def bits(t: Tensor) -> Tensor:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])

    def same(x: Tensor | None, y: Tensor | None) -> bool:
        if x is None or y is None:
            return x is y
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))

    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))




def as_number(shipped: dict[str, Any]) -> float:
    """Return a shipped Python number or one-element tensor as a float; raise TypeError otherwise."""
    if shipped.get("type") in ("int", "float", "bool"):
        return shipped["py"]
    tensor = shipped.get("tensor")
    if isinstance(tensor, Tensor) and tensor.numel() == 1:
        return tensor.item()
    raise TypeError(shipped.get("type"))


def as_plain(shipped: dict[str, Any]) -> Any:
    """Return shipped data as Python values: numbers (one-element tensors too), strings, None, lists.

    Raises ``TypeError`` naming the first thing that is none of those (or a list cut short).
    """
    if "items" in shipped:
        if shipped.get("len", len(shipped["items"])) > len(shipped["items"]):
            raise TypeError(f"a {shipped['type']} of {shipped['len']} items")
        return [as_plain(v) for v in shipped["items"]]
    if shipped.get("type") in ("str", "NoneType"):
        return shipped["py"]
    return as_number(shipped)



# ---------------------------------------------------------------- a check's halves, together and apart


@dataclass(frozen=True)
class Check:
    """One check's halves: its cases from (hidden, seed), the student side, the grader side.

    ``cases`` may return any iterable: a generator builds an expensive case (a training run)
    only when it is reached, so a part that stops at its first case pays for one.
    """

    cases: Callable[[bool, int], Iterable[Any]]
    run: Callable[[Callable, Any], dict[str, Any]]
    judge: Callable[[str, Any, dict[str, Any], bool, int], str | None]
    every_case: bool = False  # report each case's first problem (scenarios), not only the first case's


def located(judge_: Callable) -> Callable:
    """Adapt a judge that takes ``where`` to the (name, case, out, hidden, seed) signature."""
    def adapted(name: str, case: Any, out: dict[str, Any], hidden: bool, seed: int) -> str | None:
        label = case[0].name if isinstance(case, tuple) else case.name
        return judge_(name, case, out, on_case(label, hidden, seed))
    return adapted


def run_cases(spec: Check, fn: Callable, hidden: bool, seed: int, outs: list[dict[str, Any]] | None = None,
              before_case: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Call ``fn`` on every case of ``spec``: the student's side, whose result is plain data.

    Appends to ``outs`` as it goes (what came before a timeout is kept), calls ``before_case()``
    before each case (the harness restarts its alarm there); stops after the first case that
    raised or touched a banned function (later cases would only repeat it).
    """
    outs = [] if outs is None else outs
    for case in spec.cases(hidden, seed):
        if before_case is not None:
            before_case()
        out = spec.run(fn, case)
        out.pop("_exc", None)
        outs.append(out)
        if out.get("raised") or out.get("traps"):
            break
    return outs


def judge_cases(spec: Check, name: str, hidden: bool, seed: int, outs: list[dict[str, Any]]) -> str | None:
    """Compare what ``run_cases`` shipped with labkit's reference: the failure message, or None.

    ``outs`` shorter than the cases means the run stopped there (a timeout, a crash): the
    caller says why. No case past the last one shipped is built.
    """
    problems = []
    for out, case in zip(outs, spec.cases(hidden, seed)):
        problem = spec.judge(name, case, out, hidden, seed)
        if problem is not None:
            problems.append(problem)
            if not spec.every_case:
                break
    return _joined(name, problems) if problems else None


def _joined(name: str, problems: list[str]) -> str:
    """Return the problems of several cases as one message (each said once)."""
    text = " ".join(dict.fromkeys(problems))
    return text if text.startswith(name) else f"{name}: {text}"


_GRADER = os.path.dirname(os.path.abspath(__file__))


def _student_view(error: AssertionError) -> list[str]:
    """Return what IPython shows for a check's failure: its message, and the student's frames if they raised.

    The grader's frames (this package) say nothing a student can act on: a stub's
    ``NotImplementedError`` used to print 20 lines through them (issue 32, point 25).
    """
    lines = []
    cause = error.__cause__
    if cause is not None:
        frames = [f for f in traceback.extract_tb(cause.__traceback__) if not f.filename.startswith(_GRADER)]
        lines.append("Traceback of your code (the grader's own frames left out):")
        lines += [line.rstrip("\n") for line in traceback.format_list(frames)]
        lines += [line.rstrip("\n") for line in traceback.format_exception_only(type(cause), cause)]
        lines.append("")
    return [*lines, f"AssertionError: {error}"]


def _failure(message: str) -> AssertionError:
    """Return the AssertionError a test cell raises; IPython renders it with ``_student_view``."""
    error = AssertionError(message)
    error._render_traceback_ = functools.partial(_student_view, error)  # type: ignore[attr-defined]
    return error



def check(spec: Check, fn: Callable, hidden: bool, seed: int | None, banned: tuple[str, ...] = ()) -> None:
    """Run and judge case by case in this process (the notebook's test cells); raise AssertionError.

    First it reads ``fn``'s cell as the grader will (``cells.scan``): what the grader would refuse
    fails the visible test too, with the line and why. ``banned`` names the library functions
    the part asks the student to write.
    """
    name = getattr(fn, "__name__", "your function")
    refused = scan(name, fn, banned)
    if refused is not None:
        raise _failure(refused) from None
    seed = _seed(hidden, seed)
    problems, cause = [], None
    for case in spec.cases(hidden, seed):
        out = spec.run(fn, case)
        problem = spec.judge(name, case, out, hidden, seed)
        if problem is not None:
            if not spec.every_case:
                raise _failure(problem) from out.get("_exc")
            problems.append(problem)
            cause = cause or out.get("_exc")
    if problems:
        raise _failure(_joined(name, problems)) from cause
