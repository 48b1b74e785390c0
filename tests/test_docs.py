"""The docs build's strict mode, fault by fault: each is put into a small site, which then fails to build.

The real site is built (strict) and opened page by page in ``tests/browser/test_docs_site.py``; here a
site of one guide, one lesson and one module builds in seconds, so that each fault the build exists to
catch is shown to fail it: a broken link, a missing page, a docstring that does not render, a
cross-reference to a name that does not exist, a public name that does not exist.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs tools: pip install -r requirements-docs.txt")
from mkdocs.exceptions import Abort  # noqa: E402

from labkit.lab import docs  # noqa: E402

_names = itertools.count()

GOOD_MODULE = '''"""A small module."""

__all__ = ["scale"]


def scale(x: float, factor: float = 2.0) -> float:
    """Return ``x`` times ``factor``.

    Args:
        x: the value.
        factor: what it is multiplied by.

    >>> scale(3.0)
    6.0
    """
    return x * factor
'''


def notebook(*cells: dict) -> dict:
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": list(cells)}


def small_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, module: str = GOOD_MODULE,
               guide: str = "# Guide\n\nSee [the module](reference/{pkg}.md).\n",
               nav: list | None = None) -> tuple[Path, dict[str, str]]:
    """A repository of one README, one guide, one lesson and one module (a fresh name each time)."""
    root = tmp_path / "repo"
    pkg = f"docs_site_{next(_names)}"
    (root / pkg).mkdir(parents=True)
    (root / pkg / "__init__.py").write_text(module, encoding="utf-8")
    (root / "docs").mkdir()
    (root / "docs" / "guide.md").write_text(guide.format(pkg=pkg), encoding="utf-8")
    nav = nav if nav is not None else [{"Home": "index.md"}, {"Guide": "guide.md"}]
    (root / "docs" / "nav.json").write_text(json.dumps(nav), encoding="utf-8")
    (root / "README.md").write_text("# small\n\nThe [guide](docs/guide.md) and [lesson 00]"
                                    "(notebooks/00_small.ipynb).\n", encoding="utf-8")
    (root / "notebooks" / "exercises").mkdir(parents=True)
    lesson = notebook(
        {"cell_type": "markdown", "id": "title", "metadata": {}, "source": "# 00 · Small\n\n## 1. A check"},
        {"cell_type": "code", "id": "check", "metadata": {"jupyter": {"source_hidden": True}},
         "execution_count": 1,
         "source": "assert SECRET_CHECK == 1", "outputs": [
             {"output_type": "stream", "name": "stdout", "text": "the check passed\n"}]},
    )
    (root / "notebooks" / "00_small.ipynb").write_text(json.dumps(lesson), encoding="utf-8")
    monkeypatch.syspath_prepend(str(root))
    return root, {pkg: "Small"}


def build(tmp_path: Path, root: Path, reference: dict[str, str]) -> Path:
    return docs.build(tmp_path / "site", root=root, reference=reference)


def test_a_small_site_builds_with_its_lesson_its_reference_and_the_hidden_check_hidden(tmp_path, monkeypatch):
    root, reference = small_site(tmp_path, monkeypatch)
    index = build(tmp_path, root, reference)
    site = index.parent
    lesson = (site / "lessons" / "00_small.html").read_text(encoding="utf-8")
    assert "the check passed" in lesson and "SECRET_CHECK" not in lesson  # output shown, source hidden
    (pkg,) = reference
    api = (site / "reference" / f"{pkg}.html").read_text(encoding="utf-8")
    assert "Return <code>x</code> times <code>factor</code>" in api
    assert '<span class="gp">&gt;&gt;&gt; </span>' in api  # the doctest as a highlighted session, not prose
    # the README's link to a notebook, made the site's
    assert 'href="lessons/00_small.html"' in index.read_text(encoding="utf-8")
    assert (site / "assets" / "mathjax" / "MathJax.js").is_file()


@pytest.mark.parametrize("fault, change, says", [
    ("a broken link", {"guide": "# Guide\n\nSee [the missing page](missing.md).\n"}, "missing.md"),
    ("a missing page",
     {"nav": [{"Home": "index.md"}, {"Guide": "guide.md"}, {"Gone": "gone.md"}]}, "gone.md"),
    ("a docstring that does not render",
     {"module": GOOD_MODULE.replace("factor: what it is", "fator: what it is")}, "fator"),
    ("a cross-reference to a name that does not exist",
     {"guide": "# Guide\n\nSee [nothing][{pkg}.nothing].\n"}, "nothing"),
])
def test_strict_mode_fails_the_build_on(fault, change, says, tmp_path, monkeypatch, caplog):
    root, reference = small_site(tmp_path, monkeypatch, **change)
    with pytest.raises(Abort, match="strict mode"):
        build(tmp_path, root, reference)
    assert says in caplog.text, f"the build failed on {fault} without naming it"


def test_a_public_name_that_does_not_exist_fails_the_build_naming_it(tmp_path, monkeypatch):
    root, reference = small_site(tmp_path, monkeypatch,
                                 module=GOOD_MODULE.replace('["scale"]', '["scale", "shift"]'))
    with pytest.raises(ValueError, match=r"docs_site_\d+\.shift is documented .* but does not exist"):
        build(tmp_path, root, reference)


def test_the_command_line_says_how_a_failed_build_failed(tmp_path, monkeypatch, capsys):
    out = tmp_path / "file"
    out.write_text("")
    with pytest.raises(SystemExit):
        docs.main(["--out", str(out)])
    assert "is a file, not a folder" in capsys.readouterr().err


def test_every_lesson_and_problem_set_on_disk_is_found_by_glob():
    root = Path(docs.__file__).resolve().parents[2]
    assert [p.name for p in docs.lessons()] == sorted(
        p.name for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [p.name for p in docs.problem_sets()] == sorted(
        p.name for p in (root / "notebooks" / "exercises").glob("ps*.ipynb"))
    assert len(docs.lessons()) >= 8 and len(docs.problem_sets()) >= 3
    assert sys.modules["labkit.lab.docs"] is docs
