"""``python -m labkit docs --out DIR``: the lab as a static site, from the lessons and the docstrings.

MkDocs with the Material theme builds it in strict mode (any warning fails the build): the pages of
``docs/``, every lesson ``notebooks/NN_*.ipynb`` with its stored outputs, the student release of every
problem set ``notebooks/exercises/ps*.ipynb`` (made by ``labkit.grading``), and an API reference with
one mkdocstrings entry per name in the ``__all__`` of each module of ``REFERENCE``. Notebooks are found
by glob, so a new lesson or problem set is in the next build. Nothing is fetched: no CDN, no web fonts,
MathJax from the ``jupyter-server-mathjax`` wheel; ``python -m http.server -d DIR`` serves it (search
needs a server; the pages also open from disk).

What a page shows, against the notebook in JupyterLab:
- a hidden check (a cell whose source JupyterLab collapses, ``metadata.jupyter.source_hidden``) shows
  its outputs, not its source; a cell with ``outputs_hidden`` shows its source only;
- a widget has no kernel behind it: its last static image where the notebook stored one (ipympl
  stores a PNG beside the widget view), else the note ``WIDGET_NOTE``.
"""

from __future__ import annotations

import argparse
import copy
import glob
import importlib
import json
import logging
import os
import pkgutil
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = "An interactive widget: run it in JupyterLab to move this."
HIDDEN_TAG = "labkit-docs-hidden-input"  # the tags this module puts on cells, for mkdocs-jupyter's
NO_OUTPUT_TAG = "labkit-docs-hidden-output"  # TagRemovePreprocessor (remove_tag_config)
# The modules whose public names (their __all__) the reference documents, with each page's title.
REFERENCE = {
    "labkit": "The library",
    "labkit.lab": "The lab",
    "labkit.clippers": "Clippers",
    "labkit.formats": "Formats beyond fp16",
    "labkit.export": "Trackers",
    "labkit.grading": "Grading checks",
}


def lessons(root: Path = ROOT) -> list[Path]:
    """Return the lessons, ``notebooks/NN_*.ipynb``, in order.

    >>> [p.name for p in lessons()][:2]
    ['00_quickstart.ipynb', '01_gradient_clipping.ipynb']
    """
    return sorted(Path(p) for p in glob.glob(str(root / "notebooks" / "[0-9][0-9]_*.ipynb")))


def problem_sets(root: Path = ROOT) -> list[Path]:
    """Return the problem sets, ``notebooks/exercises/ps*.ipynb``, in order.

    >>> [p.name for p in problem_sets()][0]
    'ps1_clipping_and_scaling.ipynb'
    """
    return sorted(Path(p) for p in glob.glob(str(root / "notebooks" / "exercises" / "ps*.ipynb")))


def for_page(nb: dict[str, Any]) -> dict[str, Any]:
    """Return the notebook as the site shows it: hidden checks tagged, widgets as images or a note.

    >>> view = {"output_type": "display_data", "metadata": {},
    ...         "data": {WIDGET_VIEW: {"model_id": "m"}, "text/plain": "VBox(...)"}}
    >>> cell = {"cell_type": "code", "source": "panel", "outputs": [view],
    ...         "metadata": {"jupyter": {"source_hidden": True}}}
    >>> page = for_page({"cells": [cell], "metadata": {"widgets": {}}})
    >>> page["cells"][0]["metadata"]["tags"], "widgets" in page["metadata"]
    (['labkit-docs-hidden-input'], False)
    >>> page["cells"][0]["outputs"][0]["data"]["text/markdown"]
    '*An interactive widget: run it in JupyterLab to move this.*'
    """
    page = copy.deepcopy(nb)
    # The saved widget state would make the page load the widget manager from a CDN, to show
    # controls that no kernel answers.
    page["metadata"].pop("widgets", None)
    for cell in page["cells"]:
        shown = cell.get("metadata", {}).get("jupyter", {})
        # nbval's tags tell the suite what to compare; JupyterLab does not show them, nor does the page
        tags = [t for t in cell.setdefault("metadata", {}).get("tags", []) if not t.startswith("nbval-")]
        cell["metadata"]["tags"] = tags
        if shown.get("source_hidden"):
            tags.append(HIDDEN_TAG)
        if shown.get("outputs_hidden"):
            tags.append(NO_OUTPUT_TAG)
        if cell["cell_type"] == "code":
            cell["outputs"] = [_static(out) for out in cell.get("outputs", [])]
    return page


def _static(out: dict[str, Any]) -> dict[str, Any]:
    data = out.get("data", {})
    if WIDGET_VIEW not in data:
        return out
    if "image/png" in data:  # ipympl's last frame; its text/html twin embeds the same PNG again
        kept = {k: data[k] for k in ("image/png", "text/plain") if k in data}
    else:
        kept = {"text/markdown": f"*{WIDGET_NOTE}*"}
    return {**out, "data": kept}


def public_names(module: str) -> list[str]:
    """Return the dotted public names of ``module``: its ``__all__``, or its submodules' if it has none.

    >>> public_names("labkit.formats")[0]
    'labkit.formats.bf16.REMEDIES'
    """
    mod = importlib.import_module(module)
    if hasattr(mod, "__all__"):
        names = [f"{module}.{name}" for name in mod.__all__]
    else:  # a package of modules (labkit.formats: bf16, fp8), each with its own __all__
        subs = sorted(info.name for info in pkgutil.iter_modules(mod.__path__)
                      if not info.name.startswith("_"))
        names = [name for sub in subs for name in public_names(f"{module}.{sub}")]
    if not names:
        raise ValueError(f"{module} exports nothing (__all__ empty, no submodule with one): "
                         "the reference would document nothing.")
    return names


def home(dotted: str) -> str:
    """Return where a public name is defined (mkdocstrings reads the source there), importing it.

    A name missing from its module raises here, so the build fails on it. Lazily exported names
    (a module ``__getattr__``, as ``labkit.grading``'s checks) are beyond griffe's static reading.

    >>> home("labkit.grading.check_clip")
    'labkit.grading.checks.ps1.clip.check_clip'
    """
    module, _, name = dotted.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except AttributeError:
        raise ValueError(f"{dotted} is documented (in {module}.__all__) but does not exist: "
                         "define it or take it out of __all__.") from None
    where, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(where, str) and where.startswith("labkit") and qualname and "<" not in qualname:
        return f"{where}.{qualname}"
    return dotted  # a constant: documented where it is exported


def reference_page(module: str, title: str) -> str:
    """Return the Markdown of ``module``'s reference page: one mkdocstrings entry per public name.

    >>> print(reference_page("labkit.formats", "Formats").splitlines()[0])
    # Formats: `labkit.formats`
    """
    doc = importlib.import_module(module).__doc__ or ""
    lines = [f"# {title}: `{module}`", "", doc.strip().split("\n\n")[0], ""]
    for name in public_names(module):
        lines += [f"::: {home(name)}", ""]
    return "\n".join(lines)


# MathJax's fonts: the wheel ships STIX-Web only (MathJax looks for its TeX fonts first: a 404 on every
# page with a formula), and HTML-CSS output measures with a blank web font at url('about:blank'), a
# request Chromium refuses (a console error); local() asks for no file. No menu or zoom: MathJax would
# load them a second or two after the page, from a timer. No hidden MathML copy for screen readers
# (AssistiveMML): its \\mathbb asks the browser for MathJax's AMS web font, which is absent.
MATHJAX_CONFIG = """MathJax.Hub.Config({
  showMathMenu: false,
  menuSettings: {assistiveMML: false},
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null,
               styles: {"@font-face": {"font-family": "MathJax_Blank", src: "local('MathJax_Blank')"}}}
});
MathJax.Ajax.loadComplete("[MathJax]/config/local/labkit.js");
"""


# every notebook page is one folder down (lessons/, exercises/); local/labkit is MATHJAX_CONFIG
MATHJAX_URL = "../assets/mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe,local/labkit"


def _mathjax() -> Path:
    # MathJax 2.7 as the Jupyter server ships it: the lessons' $...$ typeset with no CDN.
    import jupyter_server_mathjax

    return Path(jupyter_server_mathjax.__file__).parent / "static"


def front_page(readme: str) -> str:
    """Return the README as the site's home page: its links into ``docs/`` and ``notebooks/`` made the site's.

    >>> front_page("[guide](docs/lab.md), [01](notebooks/01_x.ipynb), [ps1](notebooks/exercises/ps1.ipynb)")
    '[guide](lab.md), [01](lessons/01_x.ipynb), [ps1](exercises/ps1.ipynb)'
    """
    for source, page in (("](docs/", "]("), ("](notebooks/exercises/", "](exercises/"),
                         ("](notebooks/", "](lessons/")):
        readme = readme.replace(source, page)
    return readme


def config(docs_dir: Path, site_dir: Path, nav_lessons: list[Any], nav_sets: list[Any], root: Path = ROOT,
           reference: dict[str, str] = REFERENCE) -> dict[str, Any]:
    """Return the MkDocs configuration (as mkdocs.yml would hold it) of a staged ``docs_dir``."""
    pages = json.loads((docs_dir.parent / "nav.json").read_text(encoding="utf-8"))
    return {
        "site_name": "labkit",
        "site_description": "Gradient clipping and mixed-precision loss scaling, taught and tested.",
        "docs_dir": str(docs_dir),
        "site_dir": str(site_dir),
        # page.html, not page/: the pages open from disk too, where a folder shows no index.html
        "use_directory_urls": False,
        "strict": True,
        "validation": {"omitted_files": "warn", "absolute_links": "warn", "unrecognized_links": "warn",
                       "anchors": "warn"},
        "theme": {"name": "material", "font": False,  # no Google Fonts: the system's
                  "features": ["navigation.sections", "navigation.top", "toc.follow", "content.code.copy"]},
        "nav": [*pages, {"Lessons": nav_lessons}, {"Problem sets (student release)": nav_sets},
                {"API reference": [f"reference/{m}.md" for m in reference]}],
        "markdown_extensions": [
            "admonition", "tables", "attr_list", "md_in_html", {"toc": {"permalink": True}},
            {"pymdownx.highlight": {"use_pygments": True}}, "pymdownx.superfences", "pymdownx.details",
        ],
        "plugins": [
            "search",
            {"autorefs": {}},
            {"mkdocs-jupyter": {
                "include": ["*.ipynb"], "execute": False, "cache": False, "include_source": False,
                "ignore_h1_titles": False, "include_requirejs": False,
                "remove_tag_config": {"remove_input_tags": [HIDDEN_TAG],
                                      "remove_all_outputs_tags": [NO_OUTPUT_TAG]},
                "custom_mathjax_url": MATHJAX_URL,
            }},
            {"mkdocstrings": {"default_handler": "python", "handlers": {"python": {
                "paths": [str(root)],
                "options": {"docstring_style": "google", "show_source": False, "show_root_heading": True,
                            "show_root_full_path": False, "heading_level": 2, "members_order": "source",
                            "filters": ["!^_"], "show_signature_annotations": True,
                            "separate_signature": True, "merge_init_into_class": True,
                            "extensions": ["labkit.lab.docfences:DoctestFences"]},
            }}}},
        ],
    }


def stage(docs_dir: Path, root: Path = ROOT,
          reference: dict[str, str] = REFERENCE) -> tuple[list[Any], list[Any]]:
    """Copy the pages, the notebooks as the site shows them and the reference into ``docs_dir``."""
    import nbformat

    from labkit.grading.notebook import release

    shutil.copytree(root / "docs", docs_dir, ignore=shutil.ignore_patterns("nav.json"))
    (docs_dir / "index.md").write_text(front_page((root / "README.md").read_text(encoding="utf-8")),
                                       encoding="utf-8")
    nav_lessons, nav_sets = [], []
    for folder, paths, nav, make in (("lessons", lessons(root), nav_lessons, for_page),
                                     ("exercises", problem_sets(root), nav_sets,
                                      lambda nb: for_page(release(nb)))):
        (docs_dir / folder).mkdir(exist_ok=True)
        for path in paths:
            nb = nbformat.read(path, as_version=4)  # sources joined into strings, as the grader reads them
            nbformat.write(nbformat.from_dict(make(nb)), docs_dir / folder / path.name)
            nav.append(f"{folder}/{path.name}")
    (docs_dir / "reference").mkdir(exist_ok=True)
    for module, title in reference.items():
        (docs_dir / "reference" / f"{module}.md").write_text(reference_page(module, title), encoding="utf-8")
    shutil.copytree(_mathjax(), docs_dir / "assets" / "mathjax")
    local = docs_dir / "assets" / "mathjax" / "config" / "local"
    local.mkdir(parents=True, exist_ok=True)
    (local / "labkit.js").write_text(MATHJAX_CONFIG, encoding="utf-8")
    return nav_lessons, nav_sets


def build(out: Path, root: Path = ROOT, reference: dict[str, str] = REFERENCE) -> Path:
    """Build the site into ``out`` in strict mode and return ``out/index.html``; raise on any warning."""
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    out = Path(out).resolve()
    # MkDocs reports through the "mkdocs" logger; its command line prints it, a library call must.
    log = logging.getLogger("mkdocs")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="labkit-docs-") as tmp:
        docs_dir = Path(tmp) / "docs"
        nav_lessons, nav_sets = stage(docs_dir, root, reference)
        shutil.copy(root / "docs" / "nav.json", Path(tmp) / "nav.json")
        cfg_file = Path(tmp) / "mkdocs.yml"
        settings = config(docs_dir, out, nav_lessons, nav_sets, root, reference)
        cfg_file.write_text(json.dumps(settings), encoding="utf-8")
        cfg = load_config(str(cfg_file))  # JSON is YAML
        cfg.plugins.on_startup(command="build", dirty=False)
        try:
            mkdocs_build(cfg)
        finally:
            cfg.plugins.on_shutdown()
    return out / "index.html"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder to write the site to (DIR/index.html)")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out: {args.out} is a file, not a folder")
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        print("labkit docs: MkDocs is not installed; pip install -r requirements-docs.txt "
              "(or labkit[docs])", file=sys.stderr)
        return 1
    from mkdocs.exceptions import Abort, MkDocsException

    start = time.perf_counter()
    try:
        index = build(args.out)
    except (Abort, MkDocsException) as e:
        print(f"labkit docs: the build failed (strict mode: every warning above is an error): {e}",
              file=sys.stderr)
        return 1
    print(f"wrote {index} in {time.perf_counter() - start:.0f} s; to read it with search: "
          f"python -m http.server -d {os.fspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
