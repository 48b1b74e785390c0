"""student_view.py's checks, without a browser: each problem it reports, on a figure or widget that has it.

The browser tests run these checks inside every notebook's kernel; here each one is held to
a small case that has the problem and one that does not, so a check that cannot fail shows.
"""

from __future__ import annotations

import ipywidgets as W
import matplotlib
import pytest
import student_view as view
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

matplotlib.use("Agg")


def figure(*lines: dict, legend: bool = True, **fig_kwargs) -> tuple[Figure, object]:  # type: ignore[no-untyped-def]
    fig = Figure(figsize=(4, 3), **fig_kwargs)
    ax = fig.add_subplot()
    for kw in lines:
        kw = dict(kw)
        x, y = kw.pop("x", [0, 1, 2, 3]), kw.pop("y")
        ax.plot(x, y, **kw)
    if legend:
        ax.legend()
    return fig, ax


def test_a_clean_figure_has_no_problem():
    fig, _ = figure({"y": [1, 2, 3, 4], "label": "a"}, {"y": [2, 1, 2, 1], "label": "b"})
    assert view.check_figure(fig, "f") == []


def test_y_limits_that_miss_a_drawn_value_or_a_bar_are_reported():
    fig, ax = figure({"y": [1, 2, 3, 40], "label": "a"})
    ax.set_ylim(0, 10)
    assert any("y-limits" in p and "40" in p for p in view.check_figure(fig, "f"))
    fig = Figure()
    ax = fig.add_subplot()
    ax.bar(["x", "y"], [10, 90])
    ax.set_ylim(0, 60)  # a bar cut at the top, as a fixed limit does when the slider goes far
    assert any("y-limits" in p for p in view.check_figure(fig, "f"))
    ax.set_ylim(0, 100)
    assert view.check_figure(fig, "f") == []


def test_log_axes_ignore_what_they_cannot_draw():
    fig, ax = figure({"y": [0.0, 1.0, 10.0, 100.0], "label": "a"})
    ax.set_yscale("log")
    ax.set_ylim(0.5, 200)
    assert view.check_figure(fig, "f") == []


def test_a_legend_entry_for_nothing_drawn_and_a_drawn_series_left_out_are_reported():
    fig, ax = figure({"y": [1, 2, 3, 4], "label": "a"}, {"y": [2, 2, 2, 2], "label": "b"}, legend=False)
    ax.plot([], [], label="never")  # an empty line: its entry names nothing
    ax.legend()
    problems = view.check_figure(fig, "f")
    assert any("'never'" in p and "nothing drawn" in p for p in problems)
    ax.legend(handles=ax.get_lines()[:1])  # "b" is drawn but the legend leaves it out
    assert any("['b'] drawn but not in the legend" in p for p in view.check_figure(fig, "f"))


def test_two_labelled_series_need_a_key_a_legend_elsewhere_or_a_text_on_the_axes_will_do():
    fig, ax = figure({"y": [1, 2, 3, 4], "label": "a"}, {"y": [2, 2, 2, 2], "label": "b"}, legend=False)
    assert any("no legend" in p for p in view.check_figure(fig, "f"))
    ax.text(0, 1, "a", transform=ax.transAxes)
    ax.text(0, 0.9, "b", transform=ax.transAxes)
    assert view.check_figure(fig, "f") == []
    fig = Figure()
    left, right = fig.subplots(1, 2)
    for ax in (left, right):
        ax.plot([0, 1], [0, 1], label="a")
        ax.plot([0, 1], [1, 0], label="b")
    right.legend()  # one key for both panels
    assert view.check_figure(fig, "f") == []


def test_proxy_keys_name_a_drawn_colour_or_a_drawn_style():
    fig, ax = figure({"y": [1, 2, 3, 4], "color": "C0", "ls": "--"}, legend=False)
    ax.legend(
        [Line2D([], [], color="k", ls="--"), Patch(color="C0"), Patch(color="C3")],
        ["threshold", "run", "an outcome that never happened"],
    )
    problems = view.check_figure(fig, "f")
    assert problems == [
        "f: legend lists 'an outcome that never happened', but nothing drawn is "
        "'an outcome that never happened'"
    ]


def test_a_colour_map_needs_a_colour_scale():
    fig = Figure()
    ax = fig.add_subplot()
    image = ax.imshow([[0, 1], [2, 3]])
    assert any("no colour scale" in p for p in view.check_figure(fig, "f"))
    fig.colorbar(image, ax=ax)
    assert view.check_figure(fig, "f") == []


def test_a_series_exactly_under_another_is_reported_unless_something_says_so():
    same = [1.0, 2.0, 4.0, 3.0]
    fig, ax = figure(
        {"y": same, "label": "bf16 + Kahan", "color": "C1"},
        {"y": same, "label": "fp32 master", "color": "C2"},
    )
    problems = view.check_figure(fig, "f")
    assert problems == ["f '': 'bf16 + Kahan' is drawn exactly under 'fp32 master', and nothing says so"]
    ax.set_title("bf16 + Kahan lies under fp32 master")
    assert view.check_figure(fig, "f") == []


def test_a_wider_line_underneath_or_a_dashed_one_on_top_stays_visible():
    same = [1.0, 2.0, 4.0, 3.0]
    wide, _ = figure(
        {"y": same, "label": "fp32", "lw": 4, "alpha": 0.4}, {"y": same, "label": "fp16 + scaler", "lw": 1}
    )
    dashed, _ = figure(
        {"y": same, "label": "pre", "color": "C0"}, {"y": same, "label": "post", "color": "C1", "ls": "--"}
    )
    assert view.check_figure(wide, "f") == [] and view.check_figure(dashed, "f") == []
    # the same colour, dashed on solid: the dashes vanish into the line below
    one_colour, _ = figure(
        {"y": same, "label": "pre", "color": "C0"}, {"y": same, "label": "post", "color": "C0", "ls": "--"}
    )
    assert any("exactly under" in p for p in view.check_figure(one_colour, "f"))


def test_anything_drawn_outside_the_canvas_is_reported_where_the_canvas_is_not_cropped():
    fig, ax = figure({"y": [1, 2, 3, 4], "label": "a"})
    fig.subplots_adjust(left=0.0)  # the tick labels hang off the left edge
    assert any("outside the canvas" in p for p in view.check_figure(fig, "f"))
    assert view.check_figure(fig, "f", bounds=False) == []  # displayed inline: saved with bbox_inches="tight"


class Slider:
    """A lab object with a control and no way to say what its figure shows (labkit.* by its module)."""

    __module__ = "labkit.lab.fake"

    def __init__(self) -> None:
        self.slider = W.FloatSlider(value=1.0)


def test_a_panel_whose_figure_shows_other_settings_than_its_controls_is_reported(monkeypatch):
    monkeypatch.setattr(view, "_first_seen", {})
    from labkit.lab.experiment import ExperimentConfig
    from labkit.lab.widgets import ControlPanel

    panel = ControlPanel(
        ExperimentConfig(precision="fp32", steps=8), {"precision": "fp16", "fault_step": 3}, auto_run=False
    )
    assert view.widget_problems({"panel": panel}) == []  # nothing drawn yet
    panel.controls["precision"].value = "fp32"  # what a hidden check did in 04: run in fp32 ...
    panel.run()
    panel.controls["precision"].value = "fp16"  # ... and put the control back without running again
    assert view.widget_problems({"panel": panel}) == [
        "ControlPanel: precision: the control says 'fp16', the figure shows 'fp32'"
    ]
    panel.run()
    assert view.widget_problems({"panel": panel}) == []
    assert view.widget_problems({"things": [Slider()]}) == [
        "Slider holds controls 'FloatSlider' but cannot say what its figure shows: "
        "give it figure_mismatches()"
    ]


def test_a_control_moved_after_its_cell_ended_is_reported(monkeypatch):
    monkeypatch.setattr(view, "_first_seen", {})
    slider = W.FloatLogSlider(value=1e4, max=6, description="outlier x")
    view._snapshot(15)  # the end of the cell that shows it
    slider.value = 1e5  # a later cell moved it (06's hidden check did) and left it there
    view._snapshot(16)
    assert view.widget_problems({}) == [
        "cell [15]: control 'outlier x' is at 100000.0 after Run All; the cell that shows it set 10000.0"
    ]
    slider.value = 1e4
    assert view.widget_problems({}) == []
    slider.close()


@pytest.fixture
def shell(monkeypatch):  # type: ignore[no-untyped-def]
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setattr(view, "_first_seen", {})
    return InteractiveShell.instance()


def test_every_option_is_tried_and_the_one_that_raises_is_named(shell):
    def explore(method="zclip", threshold=2.5):
        if method == "autoclip" and threshold > 1:
            raise ValueError(f"quantile must be in [0, 1], got {threshold}")
        return method

    shown = W.interactive(explore, method=["zclip", "autoclip", "norm"], threshold=(0.1, 5.0))
    view._snapshot(8)
    assert view.option_problems({}) == [
        "cell [8]: 'method' = 'autoclip': ValueError: quantile must be in [0, 1], got 2.5"
    ]
    assert shown.kwargs["method"] == "zclip"  # the first choice is back, and shown
    assert view.widget_problems({}) == []
    shown.close()
