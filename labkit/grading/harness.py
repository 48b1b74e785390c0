"""The student's side of grading: ``python -m labkit.grading.harness JOB OUT``, run in the sandbox.

It runs the submission's code cells top to bottom in an IPython shell (no kernel, no test
cells), then calls the student's functions on the cases each part's check builds from the
seed in JOB, and writes what they returned as plain data: ``cells.json`` (each cell's error),
one ``part-<k>.pt`` per part (``torch.save``; the grader reads it with
``torch.load(weights_only=True)``), so nothing
the student's code defines ever runs in the grader. ``OUT/status`` names what is running,
so a kill or an ``os._exit`` is blamed on the right cell. Whatever it prints is the
student's output; the grader keeps the first part of it.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any


class CellTimeout(BaseException):
    """Raised by the per-cell alarm; a BaseException, so ``except Exception`` in student code can't
    swallow it."""


def _alarm(signum: int, frame: Any) -> None:
    raise CellTimeout


def _orphaned() -> bool:
    """Return whether the grader is gone: the read end of our stdout pipe is closed.

    bwrap --die-with-parent kills the sandbox when the grader dies, except when the grader dies
    before bwrap has set that up: then this check, at the start and between cells, ends the run.
    """
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    return any(event & select.POLLERR for _, event in poll.poll(0))


def _status(out: Path, text: str) -> None:
    tmp = out / "status.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out / "status")


def _save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main(job_path: str, out_dir: str) -> int:
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    out = Path(out_dir)
    if _orphaned():
        return 3
    _status(out, "starting")
    watched: dict[str, tuple[Any, str]] = {"builtins.__import__": (builtins, "__import__")}
    if job["parts"]:  # only then is there something to protect, and torch to import (seconds)
        import torch
        from torch import Tensor

        from . import checks
        from .checks import core

        for names in checks.BANNED.values():  # before any student code: a saved reference is the wrapper too
            core.install_bans(names)
        # what the student's code must leave alone; checked after it ran (a changed one is tampering)
        watched.update({"torch.save": (torch, "save"), "checks.run": (checks, "run"),
                        "checks.CHECKS": (checks, "CHECKS")})
        guarded = ("run_cases", "call_student", "ship", "forbid", "install_bans")
        watched.update({f"checks.{n}": (core, n) for n in guarded})
        watched.update({f"Tensor.{n}": (Tensor, n) for n in checks.SYNCS})
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "nocolor"  # the output is kept as text
    shell = InteractiveShell.instance(config=config)
    before = {k: getattr(o, a) for k, (o, a) in watched.items()}
    signal.signal(signal.SIGALRM, _alarm)
    timeout = float(job["timeout"])

    cells = []
    for cell in job["cells"]:
        if _orphaned():
            return 3
        _status(out, f"cell {cell['label']}")
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            result = shell.run_cell(cell["source"], store_history=False, silent=False)
        except CellTimeout:  # raised between IPython's handlers: same as inside the cell
            result = None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        error = None
        if result is None or isinstance(result.error_in_exec, CellTimeout):
            error = (f"CellTimeout: the cell ran longer than {timeout:g} s (an infinite loop?)"
                     " and was interrupted")
        elif result.error_before_exec is not None or result.error_in_exec is not None:
            e = result.error_before_exec or result.error_in_exec
            error = f"{type(e).__name__}: {e}"
        cells.append({"label": cell["label"], "error": error, "seconds": time.monotonic() - start})

    def tampered() -> list[str]:
        changed = [k for k, (o, a) in watched.items() if getattr(o, a) is not before[k]]
        if sys.gettrace() is not None or sys.getprofile() is not None:
            changed.append("sys.settrace/setprofile")
        if signal.getsignal(signal.SIGALRM) is not _alarm:
            changed.append("the alarm signal handler")
        return changed

    (out / "cells.tmp").write_text(json.dumps({"cells": cells, "tampered": tampered()}), encoding="utf-8")
    os.replace(out / "cells.tmp", out / "cells.json")
    for k, part in enumerate(job["parts"]):
        if _orphaned():
            return 3
        results = []
        for call in part["calls"]:
            _status(out, f"part {part['grade_id']}: {call['check']}({call['fn']}, hidden={call['hidden']})")
            fn = shell.user_ns.get(call["fn"])
            if fn is None or not callable(fn):
                results.append({"missing": type(fn).__name__ if fn is not None else None, "outs": []})
                continue
            outs: list[dict[str, Any]] = []
            try:  # the alarm restarts at each case: a slow first case (torch warming up) is not a slow answer
                checks.run(call["check"], fn, call["hidden"], call["seed"], outs,
                           lambda: signal.setitimer(signal.ITIMER_REAL, timeout))
                results.append({"outs": outs})
            except CellTimeout:
                results.append({"outs": outs, "timeout": timeout})
            # SystemExit, KeyboardInterrupt...: the call ended the run, the part says so
            except BaseException as e:
                results.append({"outs": outs, "ended": f"{type(e).__name__}: {e}"})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        _save({"results": results, "tampered": tampered()}, out / f"part-{k}.pt")
    _status(out, "done")
    return 0


if __name__ == "__main__":
    code = main(*sys.argv[1:3])
    # Every result is on disk already (atomic replaces), so skip the interpreter's teardown: freeing
    # torch's modules (and torch._dynamo's, once an optimizer pulled it in) is about a fifth of a
    # sandboxed run. The student's buffered output is flushed first (their own stream too).
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
