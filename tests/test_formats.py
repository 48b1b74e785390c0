"""The precision figures show what the casts did: where a format puts a value, live explorer numbers."""

import math

import pytest
import torch

from labkit.formats.bf16 import compare_remedies
from labkit.formats.fp8 import Fp8Fault, Fp8Guard
from labkit.lab.formats import (
    NUMBER_LINE,
    GranularityExplorer,
    format_values,
    number_line,
    round_trip,
    scaling_figure,
    stagnation_figure,
)


def test_format_values_are_every_bit_pattern_and_agree_with_finfo():
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        v = format_values(name)
        assert v.max().item() == torch.finfo(dtype).max
        assert v.min().item() == torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    # 2**7 minus 0, and NaN / inf
    assert len(format_values("e4m3")) == 126 and len(format_values("e5m2")) == 123
    assert format_values("fp16").max().item() == 65504.0
    with pytest.raises(ValueError, match="name must be one of"):
        format_values("fp8")


def test_number_line_cursor_shows_where_each_format_puts_the_value():
    fig = number_line(cursor=math.inf)
    ax = fig.axes[0]
    cursor_points = [line for line in ax.get_lines() if line.get_marker() == "o"]
    labels = [t.get_text() for t in ax.texts]
    assert (labels == [f"{round_trip(math.inf, name):g}" for name in NUMBER_LINE]
            == ["6", "448", "inf", "inf", "inf"])
    assert [p.get_ydata()[0] for p in cursor_points] == list(range(len(NUMBER_LINE)))
    assert [t.get_text() for t in ax.get_yticklabels()] == list(NUMBER_LINE)


def test_granularity_explorer_slider_recomputes_and_redraws():
    explorer = GranularityExplorer(rows=16, cols=1024, outlier=1.0)
    before = explorer.image.value
    assert all(r["flushed"] == 0.0 for r in explorer.rows)
    explorer.slider.value = 1e5
    assert explorer.image.value != before and explorer.image.value[:4] == b"\x89PNG"
    tensor, row, tile, mx = (r["flushed"] for r in explorer.rows)
    # 8 tiles, 32 MX blocks per row: one holds the outlier
    assert tensor > 0.3 and tile < tensor / 4 and mx < tensor / 16
    assert f"outlier x100000: per tensor {100 * tensor:.2f}%" in explorer.figure.texts[0].get_text()
    assert [p.get_height() for p in explorer.ax_flush.patches] == pytest.approx(
        [100 * r["flushed"] for r in explorer.rows]
    )


def test_stagnation_and_scaling_figures_plot_the_runs():
    runs = compare_remedies(steps=5)
    fig = stagnation_figure(runs, {"bf16": {"0.weight": 0.9, "0.bias": 0.5}})
    ax_w, ax_loss, ax_bar = fig.axes
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(runs)  # one legend, below the panels
    assert ax_loss.get_title() == "loss"  # five steps: nothing coincides yet, nothing is announced
    assert [p.get_height() for p in ax_bar.patches] == [0.5, 0.9]  # layers sorted by name
    guard = Fp8Guard(history=4, faults={3: Fp8Fault("range_jump")})
    for _ in range(5):
        guard(torch.linspace(-1, 1, 512))
    fig = scaling_figure({"delayed": guard.records}, fault_step=3)
    heights = [p.get_height() for p in fig.axes[1].patches]
    assert heights[3] > 50 and heights[:3] == [0.0] * 3


def test_coinciding_remedies_are_announced_in_the_loss_panel():
    runs = compare_remedies(steps=300)
    ax_w, ax_loss, _ = stagnation_figure(runs, {"bf16": {"0.weight": 0.9}}).axes
    assert ax_loss.get_title() == "loss\n(fp32, bf16 + Kahan and bf16 + fp32 master coincide)"
    assert [line.get_label() for line in ax_w.get_lines()] == list(runs)


def test_the_explorers_bars_are_never_cut_and_its_map_has_a_colour_bar():
    explorer = GranularityExplorer(rows=16, cols=1024, outlier=1e6)
    assert [r["flushed"] > 0.6 for r in explorer.rows][0]  # beyond the 60 % the axis used to stop at
    for ax, key, scale in ((explorer.ax_flush, "flushed", 100), (explorer.ax_err, "rel_err", 1)):
        assert max(p.get_height() for p in ax.patches) == pytest.approx(
            max(scale * r[key] for r in explorer.rows)
        )
        assert ax.get_ylim()[1] >= max(p.get_height() for p in ax.patches)
    assert [a.get_ylabel() for a in explorer.figure.axes if a not in (explorer.ax_map, explorer.ax_flush,
                                                                    explorer.ax_err)] == ["log10 |x|"]
    explorer.slider.value = 10.0
    assert len(explorer.figure.axes) == 4  # one colour bar, updated, not one more per move
    assert explorer.ax_map.images[0].colorbar is not None  # and the new map knows its colour bar
