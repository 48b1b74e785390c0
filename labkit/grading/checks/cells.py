"""Read a student's function as the grader will: the notebook cells it and its helpers came from.

A visible test cell says what the grader would refuse before the grade does (``scan``): a cell
that could reach into the grader, or a banned library function in the function's own cell.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from typing import Any

from ..static import banned_calls, explain, tampering

__all__ = ["scan"]


def _codes(obj: Any) -> list[Any]:
    """Return the code objects of a function, or of a class's methods, nested ones included."""
    if isinstance(obj, type):
        return [c for f in vars(obj).values() for c in _codes(getattr(f, "__func__", f))]
    code = getattr(obj, "__code__", None)
    out, todo = [], [code] if code is not None else []
    while todo:
        c = todo.pop()
        out.append(c)
        todo += [k for k in c.co_consts if hasattr(k, "co_names")]
    return out


def _cell_of(code: Any) -> str | None:
    """Return the source of the notebook cell ``code`` was compiled from; None if it is not a cell.

    IPython caches each cell it runs in ``linecache`` under the cell's own name, with no mtime
    (``IPython.core.compilerop.CachingCompiler.cache``); a file on disk has one.
    """
    entry = linecache.cache.get(code.co_filename)
    if not entry or len(entry) != 4 or entry[1] is not None:
        return None
    return "".join(entry[2])


def _globals(obj: Any) -> dict[str, Any]:
    """Return the module globals a function, or a class's methods, see names in."""
    if isinstance(obj, type):
        obj = next((f for f in vars(obj).values() if hasattr(f, "__globals__")), None)
    return getattr(obj, "__globals__", {})


def _cells(fn: Callable) -> list[tuple[str, str]]:
    """Return ``(what, source)`` for the cell that defined ``fn`` and each cell defining a helper it uses.

    A helper is a function or class of the notebook that ``fn``'s code names (followed
    through helpers' helpers); outside IPython there is none, and nothing is returned.
    """
    name = getattr(fn, "__name__", "your function")
    out, seen, todo = {}, set(), [(fn, f"{name}'s cell")]
    while todo:
        obj, what = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for code in _codes(obj):
            source = _cell_of(code)
            if source is None:
                continue
            out.setdefault(source, what)
            names = _globals(obj)
            for used in code.co_names:
                helper = names.get(used)
                if callable(helper) and (hasattr(helper, "__code__") or isinstance(helper, type)):
                    todo.append((helper, f"the cell that defines {used} (which {name} uses)"))
    return [(what, source) for source, what in out.items()]


def scan(name: str, fn: Callable, banned: tuple[str, ...]) -> str | None:
    """Return what the grader's reading of ``fn``'s cells would refuse, as the student's message, or None.

    The same reading as the grader's (``labkit.grading.static``): a cell that could reach into
    the grader is not run, and the part it answers is not scored (a cell outside every answer
    withholds the whole notebook); a banned library function in ``fn``'s own cell loses the part.
    """
    own = f"{name}'s cell"
    for what, source in _cells(fn):
        found = tampering(source)
        if found:
            then = ("so this part would score 0 (the other parts are graded as usual)" if what == own else
                    "so the part it answers would score 0, or, outside every answer, the whole notebook")
            return (f"{what} cannot be graded as written: the grader never runs a cell that could reach "
                    f"into it, {then}. " + "; ".join(explain(f) for f in found) + ".")
        hits = banned_calls(source, banned) if what == own else []
        if hits:
            return f"{what} uses what this part asks you to write yourself: {'; '.join(hits)}."
    return None
