"""What a student sees, checked from inside a notebook's kernel (the browser tests load it before Run All).

``install()`` hooks the kernel's IPython before the notebook runs:

- every figure IPython displays (the inline backend's PNGs, a figure a cell returns, one that
  ``interact`` shows) is checked as it is drawn, and its problems are kept with the cell's number;
- after each cell, every control widget (slider, dropdown, toggle, checkbox, text box) that cell
  made is remembered with the value it had when the cell ended: what the cell's code shows.

Then ``report()`` (``widget_problems()`` and ``figure_problems()``) says, in words, what a student
would find wrong after Run All:

- a control left at another value than the cell that shows it set (a later cell moved it);
- a control whose value its figure does not show: every lab object that holds controls says
  what its figure shows through ``figure_mismatches()`` (``[]`` when the figure shows the
  controls' values), an ``interact`` through the arguments of its last call; a lab object with
  controls and no ``figure_mismatches`` is a problem too, and so is a panel showing an error;
- in every figure, displayed or live (ipympl canvases, figures that lab objects draw into an
  image): a y-range that misses a drawn value (lines, scatter points, bars), a legend entry for
  nothing drawn, a drawn series a legend leaves out, two labelled series and no key, a heatmap
  without a colour scale, a series hidden exactly under another (or on it, in the same colour)
  with no note that names both
  (a legend label of one naming the other, or a title or text naming both), and, where the
  canvas is not cropped to its contents, anything drawn outside it.

``option_problems()`` then picks every option of every list a student can choose from (dropdowns,
toggle buttons), one at a time, puts the first choice back, and says which choice raised: a
traceback in an ``interact`` output, an error in a panel, or an exception out of a callback.

It imports only what a notebook already has (matplotlib, ipywidgets, IPython), and is unit-tested
without a browser (``test_student_view.py``).
"""

from __future__ import annotations

import math
import sys

import ipywidgets as W
import matplotlib.colors as mcolors
import numpy as np
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle, StepPatch

_NOT_CONTROLS = (
    W.HTML,
    W.HTMLMath,
    W.Label,
    W.Image,
    W.Video,
    W.Audio,
    W.IntProgress,
    W.FloatProgress,
    W.Valid,
)
_first_seen: dict[str, tuple[object, object, object]] = {}  # model id -> (cell, value, widget)
_displayed: dict[int, tuple[Figure, list[str]]] = {}  # id(figure) -> (figure, its problems when displayed)
_trying = False  # option_problems() is picking options: its figures are not the lesson's


def is_control(widget: object) -> bool:
    """Whether ``widget`` is something a student sets: a value widget that is not output or decoration."""
    return isinstance(widget, W.ValueWidget) and not isinstance(widget, _NOT_CONTROLS)


def _widgets() -> list:
    from ipywidgets.widgets import widget as module

    return list(getattr(module, "_instances", {}).values())


def _name(widget) -> str:  # type: ignore[no-untyped-def]
    return repr(getattr(widget, "description", "") or type(widget).__name__)


def _snapshot(cell: object) -> None:
    for widget in _widgets():
        if is_control(widget) and widget.model_id not in _first_seen:
            _first_seen[widget.model_id] = (cell, widget.value, widget)


def _title(fig: Figure) -> str:
    suptitle = getattr(fig, "_suptitle", None)
    texts = [suptitle.get_text() if suptitle is not None else ""]
    texts += [t for ax in fig.axes for t in (ax.get_title(), ax.get_ylabel())]
    return repr(next((t for t in texts if t), "untitled"))[:80]


def install() -> None:
    """Hook IPython: check each figure as it is displayed; after each cell, remember the controls it made."""
    from IPython import get_ipython

    ip = get_ipython()
    formatter = ip.display_formatter
    if getattr(formatter.format, "_labkit", False):
        return
    original = formatter.format

    def format(obj, include=None, exclude=None):  # type: ignore[no-untyped-def]
        if isinstance(obj, Figure) and id(obj) not in _displayed and not _trying:
            where = f"cell [{ip.execution_count}] figure {_title(obj)}"
            try:
                # IPython saves a displayed figure with bbox_inches="tight": nothing is cut off the PNG
                problems = check_figure(obj, where, bounds=False)
            except Exception as e:  # a check that cannot run is a problem, never a broken display
                problems = [f"{where}: could not be checked ({type(e).__name__}: {e})"]
            _displayed[id(obj)] = obj, problems
        return original(obj, include=include, exclude=exclude)

    format._labkit = True  # type: ignore[attr-defined]
    formatter.format = format
    ip.events.register("post_run_cell", lambda result: _snapshot(result.execution_count))


# ---------------------------------------------------------------- widgets


def _lab_objects(namespace: dict) -> list:
    """The lab's objects a notebook holds: labkit instances among its variables, one container deep."""
    found: dict[int, object] = {}

    def visit(obj: object, depth: int) -> None:
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            items = list(obj)
        else:
            if type(obj).__module__.startswith("labkit."):
                found.setdefault(id(obj), obj)
            return
        if depth < 2:
            for item in items[:200]:
                visit(item, depth + 1)

    for name, value in list(namespace.items()):
        if name in ("In", "_ih", "_dh", "_i", "_ii", "_iii") or name.startswith("_i"):
            continue
        visit(value, 0)
    return list(found.values())


def _controls_of(obj: object) -> list:
    held = []
    for value in getattr(obj, "__dict__", {}).values():  # a slotted object (a StepRecord) holds no widget
        values = list(value.values()) if isinstance(value, dict) else [value]
        held += [v for v in values if is_control(v)]
    return held


def widget_problems(namespace: dict | None = None) -> list[str]:
    """What a student would find wrong with the controls after Run All (see the module's docstring)."""
    if namespace is None:
        from IPython import get_ipython

        namespace = get_ipython().user_ns
    problems = []
    for cell, value, widget in _first_seen.values():
        if widget.comm is not None and widget.value != value:
            problems.append(
                f"cell [{cell}]: control {_name(widget)} is at {widget.value!r} after Run All; "
                f"the cell that shows it set {value!r}"
            )
    for obj in _lab_objects(namespace):
        kind = type(obj).__name__
        if getattr(obj, "error", None) is not None:
            problems.append(f"{kind}: shows an error: {obj.error!r}")
        if callable(getattr(obj, "figure_mismatches", None)):
            problems += [f"{kind}: {m}" for m in obj.figure_mismatches()]
        elif _controls_of(obj):
            problems.append(
                f"{kind} holds controls {', '.join(_name(w) for w in _controls_of(obj))} but cannot say "
                "what its "
                "figure shows: give it figure_mismatches()"
            )
    for widget in _widgets():
        if isinstance(widget, W.interactive) and widget.comm is not None:
            now = {w._kwarg: w.get_interact_value() for w in widget.kwargs_widgets}
            shown = getattr(widget, "kwargs", {})
            for key in now:
                if key in shown and shown[key] != now[key]:
                    problems.append(
                        f"interact: control {key!r} says {now[key]!r}, its output shows {shown[key]!r}"
                    )
    return problems


# ---------------------------------------------------------------- figures


def _in_data(artist, ax, axis: int = 1) -> bool:  # type: ignore[no-untyped-def]
    return artist.get_transform().contains_branch_seperately(ax.transData)[axis]


def _line_drawn(line: Line2D) -> bool:
    y = np.asarray(line.get_ydata(), dtype=float)
    return line.get_visible() and bool(np.isfinite(y).any())


def _labelled(label: str) -> bool:
    return bool(label) and not label.startswith("_")


def _drawn_series(ax) -> list[tuple[str, list]]:  # type: ignore[no-untyped-def]
    """``(label, colours)`` of each labelled artist of ``ax`` that draws something."""
    out = []
    for line in ax.get_lines():
        if _line_drawn(line):
            out.append((line.get_label(), [mcolors.to_rgb(line.get_color())]))
    for c in ax.collections:
        if c.get_visible() and (len(c.get_paths()) or len(c.get_offsets())):
            colours = [tuple(rgba[:3]) for rgba in [*c.get_facecolor(), *c.get_edgecolor()]]
            out.append((c.get_label(), colours))
    for p in ax.patches:
        if p.get_visible():
            out.append((p.get_label(), [tuple(p.get_facecolor()[:3]), tuple(p.get_edgecolor()[:3])]))
    for container in ax.containers:
        if isinstance(container, BarContainer) and any(p.get_visible() for p in container.patches):
            out.append((container.get_label(), [tuple(p.get_facecolor()[:3]) for p in container.patches]))
    return out


def _key_colours(handle) -> list:  # type: ignore[no-untyped-def]
    colours = []
    for getter in ("get_color", "get_facecolor", "get_edgecolor"):
        try:
            value = np.atleast_2d(mcolors.to_rgba_array(getattr(handle, getter)()))
        except (AttributeError, ValueError, TypeError):
            continue
        colours += [tuple(v[:3]) for v in value if v[3] > 0]
    return colours


def _near(a, b) -> bool:  # type: ignore[no-untyped-def]
    return all(abs(x - y) < 2e-3 for x, y in zip(a, b))


def _grey(colour) -> bool:  # type: ignore[no-untyped-def]
    return max(colour) - min(colour) < 2e-3


def _proxy_drawn(handle, axes) -> bool:  # type: ignore[no-untyped-def]
    """Whether a legend key made for the legend (a proxy) stands for something drawn in ``axes``.

    A coloured key names what is drawn in its colour; a black or grey key names a style (dashed,
    a marker, a band) drawn in any colour, as a key for every run's threshold does.
    """
    keys = _key_colours(handle)
    drawn = [s for ax in axes for s in _drawn_series(ax)]
    if keys and any(_near(k, c) for k in keys for _, colours in drawn for c in colours):
        return True
    if not keys or not all(_grey(k) for k in keys):
        return False
    if isinstance(handle, Line2D):
        style = handle.get_linestyle(), handle.get_marker()
        return any(
            line.get_linestyle() == style[0] and line.get_marker() == style[1]
            for ax in axes
            for line in ax.get_lines()
            if _line_drawn(line)
        )
    return any(
        c.get_visible() and len(c.get_paths()) and not isinstance(c, (PathCollection, LineCollection))
        for ax in axes
        for c in ax.collections
    )


def _legend_problems(fig: Figure, where: str) -> list[str]:
    problems = []
    legends = [(ax.get_legend(), [ax]) for ax in fig.axes if ax.get_legend() is not None]
    legends += [(legend, list(fig.axes)) for legend in fig.legends]
    covered: dict[int, set] = {}
    for legend, axes in legends:
        drawn = [s for ax in axes for s in _drawn_series(ax) if _labelled(s[0])]
        entries = [t.get_text() for t in legend.get_texts()]
        for text, handle in zip(entries, legend.legend_handles):
            if any(label == text for label, _ in drawn) or _proxy_drawn(handle, axes):
                continue
            problems.append(f"{where}: legend lists {text!r}, but nothing drawn is {text!r}")
        for ax in axes:
            covered.setdefault(id(ax), set()).update(entries)
    named = {text for entries in covered.values() for text in entries}
    for ax in fig.axes:
        drawn = [label for label, _ in _drawn_series(ax) if _labelled(label)]
        if id(ax) in covered:
            missing = sorted(set(drawn) - covered[id(ax)])
            if missing:
                problems.append(f"{where}: {missing} drawn but not in the legend")
        elif len(set(drawn)) >= 2:
            # named in place (a text on the axes) or by a legend the figure has elsewhere
            texts = " ".join(t.get_text() for t in ax.texts)
            unnamed = sorted(label for label in set(drawn) if label not in texts and label not in named)
            if unnamed:
                problems.append(
                    f"{where}: {len(set(drawn))} labelled series {sorted(set(drawn))} and no legend or "
                    "text naming them"
                )
    return problems


def _ylim_problems(ax, where: str) -> list[str]:  # type: ignore[no-untyped-def]
    lo, hi = sorted(ax.get_ylim())
    log = ax.get_yscale() == "log"
    ys: list[float] = []
    for line in ax.get_lines():
        if _line_drawn(line) and _in_data(line, ax):
            ys += list(np.asarray(line.get_ydata(), dtype=float))
    for c in ax.collections:
        if (
            isinstance(c, PathCollection)
            and c.get_visible()
            and c.get_offset_transform().contains_branch_seperately(ax.transData)[1]
        ):
            ys += list(np.asarray(c.get_offsets(), dtype=float).reshape(-1, 2)[:, 1])
    for p in ax.patches:
        if not p.get_visible() or not _in_data(p, ax):
            continue
        if isinstance(p, Rectangle):
            ys += [p.get_y(), p.get_y() + p.get_height()]
        elif isinstance(p, StepPatch):
            ys += list(np.asarray(p.get_data().values, dtype=float))
    ys = [y for y in ys if math.isfinite(y) and (y > 0 or not log)]
    outside = [y for y in ys if not lo - 1e-9 * abs(lo) <= y <= hi + 1e-9 * abs(hi)]
    if outside:
        return [f"{where} {ax.get_ylabel()!r}: y-limits {(lo, hi)} miss {sorted(set(outside))[:3]}"]
    return []


def _hidden_problems(ax, where: str) -> list[str]:  # type: ignore[no-untyped-def]
    lines = [
        line for line in ax.get_lines() if _line_drawn(line) and _in_data(line, ax) and _in_data(line, ax, 0)
    ]
    order = sorted(range(len(lines)), key=lambda i: (lines[i].get_zorder(), i))
    notes = [ax.get_title(), *(t.get_text() for t in ax.texts), *(t.get_text() for t in ax.figure.texts)]
    suptitle = getattr(ax.figure, "_suptitle", None)
    if suptitle is not None:
        notes.append(suptitle.get_text())
    problems = []
    for a, i in enumerate(order):
        lower = lines[i]
        xy_lower = np.column_stack([lower.get_xdata(), lower.get_ydata()]).astype(float)
        for j in order[a + 1 :]:
            upper = lines[j]
            xy_upper = np.column_stack([upper.get_xdata(), upper.get_ydata()]).astype(float)
            same_colour = mcolors.to_rgba(upper.get_color()) == mcolors.to_rgba(lower.get_color())
            if xy_upper.shape != xy_lower.shape or not (same_colour or _covers(upper, lower)):
                continue
            finite = np.isfinite(xy_lower).all(axis=1)
            if not np.array_equal(finite, np.isfinite(xy_upper).all(axis=1)) or not finite.any():
                continue
            px = ax.transData.transform(xy_lower[finite]) - ax.transData.transform(xy_upper[finite])
            if np.abs(px).max() > 0.5:
                continue
            names = lower.get_label(), upper.get_label()
            if (
                names[0] in names[1]
                or names[1] in names[0]
                or any(names[0] in n and names[1] in n for n in notes)
            ):
                continue
            problems.append(
                f"{where} {ax.get_ylabel()!r}: {names[0]!r} is drawn exactly under {names[1]!r}, "
                "and nothing says so"
            )
    return problems


def _covers(upper: Line2D, lower: Line2D) -> bool:
    """Whether ``upper`` hides ``lower`` where they meet: opaque, solid, as wide, same steps and markers."""
    alpha = upper.get_alpha()
    return (
        upper.get_visible()
        and (alpha is None or alpha >= 1)
        and upper.get_linestyle() == "-"
        and upper.get_linewidth() >= lower.get_linewidth()
        and upper.get_drawstyle() == lower.get_drawstyle()
        and (
            lower.get_marker() in ("None", None, "", " ")
            or (lower.get_marker() == upper.get_marker() and upper.get_markersize() >= lower.get_markersize())
        )
    )


def _colour_scale_problems(fig: Figure, where: str) -> list[str]:
    problems = []
    for ax in fig.axes:
        if hasattr(ax, "_colorbar"):
            continue  # a colour bar's own axes draws its scale with a colour map
        for image in [
            *ax.images,
            *(
                c
                for c in ax.collections
                if not isinstance(c, (PathCollection, LineCollection)) and c.get_array() is not None
            ),
        ]:
            array = image.get_array()
            if array is None or (isinstance(image, AxesImage) and np.ndim(array) == 3):
                continue  # an RGB picture carries its own colours
            if getattr(image, "colorbar", None) is None and ax.get_legend() is None and not fig.legends:
                problems.append(
                    f"{where} {ax.get_title() or ax.get_ylabel()!r}: a colour map with no colour scale"
                )
    return problems


def check_figure(fig: Figure, where: str, bounds: bool = True) -> list[str]:
    """Return what a student would find wrong with ``fig`` (``bounds``: its canvas is not cropped to it)."""
    fig.draw_without_rendering()  # the layout the picture has (constrained layout moves the axes at draw)
    problems = _legend_problems(fig, where) + _colour_scale_problems(fig, where)
    for ax in fig.axes:
        problems += _ylim_problems(ax, where) + _hidden_problems(ax, where)
    if bounds:
        box, canvas = fig.get_tightbbox(fig._get_renderer()), fig.bbox_inches
        if (
            box.x0 < canvas.x0 - 0.01
            or box.y0 < canvas.y0 - 0.01
            or box.x1 > canvas.x1 + 0.01
            or box.y1 > canvas.y1 + 0.01
        ):
            problems.append(
                f"{where}: drawn {tuple(round(v, 2) for v in box.bounds)} outside the canvas "
                f"{tuple(round(v, 2) for v in canvas.bounds)}"
            )
    return problems


def live_figures(namespace: dict | None = None) -> list[Figure]:
    """The figures that repaint: ipympl canvases, pyplot's open figures, lab objects' figures."""
    from matplotlib._pylab_helpers import Gcf

    if namespace is None:
        from IPython import get_ipython

        namespace = get_ipython().user_ns
    figures: dict[int, Figure] = {}
    for widget in _widgets():
        figure = getattr(widget, "figure", None)
        if isinstance(figure, Figure) and widget.comm is not None:
            figures[id(figure)] = figure
    for manager in Gcf.get_all_fig_managers():  # pyplot's open figures, without making one current
        figures[id(manager.canvas.figure)] = manager.canvas.figure
    for obj in _lab_objects(namespace):
        for value in getattr(obj, "__dict__", {}).values():  # a slotted StepRecord holds no figure
            inner = [value, *vars(value).values()] if hasattr(value, "__dict__") else [value]
            for figure in inner:
                if isinstance(figure, Figure):
                    figures[id(figure)] = figure
    return list(figures.values())


def figure_problems(namespace: dict | None = None) -> list[str]:
    """Problems of every figure displayed so far (as displayed) and of every live figure (as it is now)."""
    problems = [p for _, found in _displayed.values() for p in found]
    for fig in live_figures(namespace):
        if id(fig) in _displayed and "ipympl" not in type(fig.canvas).__module__:
            continue  # a PNG: checked when it was displayed
        problems += check_figure(fig, f"live figure {_title(fig)}")
    return problems


def live_figure_problems(namespace: dict | None = None) -> list[str]:
    """Problems of the live figures only, as they are now (after a slider moved, say)."""
    return [
        p
        for fig in live_figures(namespace)
        if "ipympl" in type(fig.canvas).__module__ or id(fig) not in _displayed
        for p in check_figure(fig, f"live figure {_title(fig)}")
    ]


def report() -> dict[str, list[str]]:
    """What a student would find wrong now: ``{"widgets": [...], "figures": [...]}``."""
    return {"widgets": widget_problems(), "figures": figure_problems()}


_CHOICES = (W.Dropdown, W.ToggleButtons, W.RadioButtons, W.Select)


def option_problems(namespace: dict | None = None) -> list[str]:
    """Pick every option of every list on screen, one at a time, then the first again; return what raised."""
    from IPython import get_ipython

    ip = get_ipython()
    namespace = ip.user_ns if namespace is None else namespace
    problems: list[str] = []
    caught: list[str] = []

    def showtraceback(*args, **kwargs):  # type: ignore[no-untyped-def]
        etype, value, _ = sys.exc_info()  # what interact shows in its output (it calls this)
        caught.append(f"{getattr(etype, '__name__', etype)}: {value}")

    global _trying
    original = ip.showtraceback
    ip.showtraceback, _trying = showtraceback, True
    try:
        for cell, _, widget in list(_first_seen.values()):
            if not isinstance(widget, _CHOICES) or widget.comm is None:
                continue
            first = widget.value
            options = [o[1] if isinstance(o, tuple) else o for o in widget.options]
            for option in [o for o in options if o != first] + [first]:
                caught.clear()
                try:
                    widget.value = option
                except Exception as e:  # out of a callback: the student gets it in the log console
                    caught.append(f"{type(e).__name__}: {e}")
                caught += [
                    f"{type(obj).__name__} shows {obj.error!r}"
                    for obj in _lab_objects(namespace)
                    if getattr(obj, "error", None) is not None
                ]
                problems += [f"cell [{cell}]: {_name(widget)} = {option!r}: {c}" for c in caught]
    finally:
        ip.showtraceback, _trying = original, False
    return problems
