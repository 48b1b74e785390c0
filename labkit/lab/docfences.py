"""A griffe extension for the docs build: a docstring's doctest examples shown as Python sessions.

labkit's docstrings follow a summary line with bare ``>>>`` examples (the suite runs them). In
Markdown a bare ``>>> xs[:2]`` is prose, and ``[...][:2]`` a link to nowhere, which the strict build
rejects; fenced as ``pycon`` it renders as the session it is. Needs griffe (requirements-docs.txt).
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    r"""Return ``text`` with each run of doctest lines (``>>>``, ``...`` and their output) fenced as pycon.

    >>> fence_doctests("Add.\n\n>>> 1 + 1\n2\n\nDone.").split("\n")
    ['Add.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'Done.']
    """
    out: list[str] = []
    indent: str | None = None  # the indentation of the open pycon fence; None: none open
    for line in text.split("\n"):
        stripped = line.lstrip()
        if indent is not None and (not stripped or not line.startswith(indent)):
            out.append(f"{indent}```")  # a doctest's output ends at a blank line (or a dedent)
            indent = None
        if indent is None and stripped.startswith(">>>") and not _in_fence(out):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
        out.append(line)
    if indent is not None:
        out.append(f"{indent}```")
    return "\n".join(out)


def _in_fence(lines: list[str]) -> bool:
    return sum(line.lstrip().startswith("```") for line in lines) % 2 == 1


class DoctestFences(griffe.Extension):
    """Fence every object's doctest examples (``fence_doctests``) before mkdocstrings renders them."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
