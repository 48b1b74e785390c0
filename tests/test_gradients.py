"""The gradient pictures: fp16/bf16 bands at the formats' limits, fractions equal to torch's own cast."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from labkit.lab.gradients import (BF16_RANGE, FP16_RANGE, GradHistogram, GradientProbe, flush_fractions,
                                  plot_layer_heatmap, plot_sawtooth, plot_u_curve, u_curve)
from labkit.records import StepLog, StepRecord


def test_histogram_bands_sit_at_fp16_and_bf16_limits():
    f16, bf16 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16)
    assert FP16_RANGE == (math.log2(f16.smallest_normal * f16.eps), math.log2(f16.smallest_normal), math.log2(f16.max))
    assert FP16_RANGE[:2] == (-24.0, -14.0) and BF16_RANGE[1] == -126.0
    assert 2.0 ** FP16_RANGE[0] == torch.tensor(2.0**-24, dtype=torch.float16).item()  # the smallest subnormal
    h = GradHistogram(torch.tensor([1.0]))
    spans = {label: patch.get_x() for label, patch in h.bands.items()}
    widths = {label: patch.get_width() for label, patch in h.bands.items()}
    assert spans["fp16 subnormal"] == -24.0 and spans["fp16 normal"] == -14.0
    assert spans["fp16 normal"] + widths["fp16 normal"] == pytest.approx(math.log2(65504.0), abs=1e-12)
    assert spans["bf16 (normal)"] == -126.0
    assert {t.get_text() for t in h.ax.texts} == {"fp16 subnormal", "fp16 normal", "bf16 (normal)"}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32), min_size=1, max_size=50),
       st.integers(min_value=-30, max_value=40))
def test_fractions_are_what_torchs_fp16_cast_does(values, k):
    g = torch.tensor(values, dtype=torch.float32)
    nonzero = g != 0
    h = (g.double() * 2.0**k).half()
    n = max(1, int(nonzero.sum()))
    expected = (float(((h == 0) & nonzero).sum()) / n, float(h.isinf().sum()) / n) if nonzero.any() else (0.0, 0.0)
    assert flush_fractions(g, k) == expected


def test_the_u_curves_minimum_moves_with_the_scale_of_the_gradients():
    g = torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * 2.0**-20
    scales = list(range(-10, 60))
    def best(values):
        under, over = u_curve(values, scales)
        lost = [u + o for u, o in zip(under, over)]
        low = min(lost)
        return [s for s, x in zip(scales, lost) if x == low]
    base = best(g)
    assert best(g * 2.0**8) == [s - 8 for s in base] and best(g * 2.0**-5) == [s + 5 for s in base]
    under, over = u_curve(g, scales)
    assert under[0] > 0.9 and over[-1] > 0.9  # both arms of the U


def test_the_slider_shifts_the_histogram_and_says_what_is_lost():
    g = torch.tensor([2.0**-30] * 3 + [1.0])
    h = GradHistogram(g, log2_scale=0)
    assert h.title() == "scale 2^0: 75.0% flush to 0, 0.0% overflow (fp16)"
    before = list(h.bars["all"].get_data().values)
    h.slider.value = 20  # what a student's slider does
    assert h.title() == "scale 2^20: 0.0% flush to 0, 25.0% overflow (fp16)"
    assert list(h.bars["all"].get_data().values) != before


def test_u_curve_sawtooth_and_heatmap_show_what_the_run_did():
    log = StepLog([StepRecord(0, 1.0, scale=2.0**10, next_scale=2.0**11),
                   StepRecord(1, 1.0, scale=2.0**11, next_scale=2.0**10, skipped=True, reason="nonfinite_grad")])
    saw = plot_sawtooth(log).axes[0]
    assert saw.get_lines()[1].get_xdata().tolist() == [1] and "1" in saw.get_legend().get_texts()[1].get_text()
    u = plot_u_curve(torch.tensor([1.0, 2.0**-40]), trajectory=log.column("scale"), backoffs=[2.0**11]).axes[0]
    assert [line.get_label() for line in u.get_lines()] == ["flushed to 0", "overflow (inf)", "lost"]
    assert u.collections[0].get_offsets()[:, 0].tolist() == [10.0, 11.0]
    p = GradientProbe()
    p.layers, p._norms, p._steps = ["wte", "h.0.attn.c_attn"], {"wte": [1.0, 1000.0], "h.0.attn.c_attn": [0.1, 0.1]}, [0, 1]
    image = plot_layer_heatmap(p).axes[0].images[0].get_array()
    assert image.tolist() == [[0.0, 3.0], [-1.0, -1.0]]
