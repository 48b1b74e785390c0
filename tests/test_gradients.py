"""The gradient pictures: fp16/bf16 bands at the formats' limits, fractions equal to torch's own cast."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.lab.gradients import (
    BF16_RANGE,
    FP16_RANGE,
    GradHistogram,
    GradientProbe,
    GradStat,
    flush_fractions,
    plot_flushed_by_tensor,
    plot_headroom,
    plot_layer_heatmap,
    plot_sawtooth,
    plot_u_curve,
    u_curve,
)
from labkit.records import StepRecord
from labkit.steplog import StepLog


def test_histogram_bands_sit_at_fp16_and_bf16_limits():
    f16 = torch.finfo(torch.float16)
    assert (math.log2(f16.smallest_normal * f16.eps), math.log2(f16.smallest_normal),
            math.log2(f16.max)) == FP16_RANGE
    assert FP16_RANGE[:2] == (-24.0, -14.0) and BF16_RANGE[1] == -126.0
    # the smallest subnormal
    assert 2.0 ** FP16_RANGE[0] == torch.tensor(2.0**-24, dtype=torch.float16).item()
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
    expected = (
        (float(((h == 0) & nonzero).sum()) / n, float(h.isinf().sum()) / n) if nonzero.any() else (0.0, 0.0)
    )
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
                   StepRecord(1, 1.0, scale=2.0**11, next_scale=2.0**10, skipped=True,
                              reason="nonfinite_grad")])
    saw = plot_sawtooth(log).axes[0]
    assert (
        saw.get_lines()[1].get_xdata().tolist() == [1] and "1" in saw.get_legend().get_texts()[1].get_text()
    )
    u = plot_u_curve(torch.tensor([1.0, 2.0**-40]), trajectory=log.column("scale"),
                     backoffs=[2.0**11]).axes[0]
    assert [line.get_label() for line in u.get_lines()] == ["flushed to 0", "overflow (inf)", "lost"]
    assert u.collections[0].get_offsets()[:, 0].tolist() == [10.0, 11.0]
    p = GradientProbe.holding([0, 1], layer_norms={"wte": [1.0, 1000.0], "h.0.attn.c_attn": [0.1, 0.1]})
    image = plot_layer_heatmap(p).axes[0].images[0].get_array()
    assert image.tolist() == [[0.0, 3.0], [-1.0, -1.0]]


def test_a_root_parameter_is_one_layer_the_root_module_with_torchs_norm():
    model = torch.nn.Linear(4, 3)  # weight and bias belong to the root module, which torch names ""
    probe = GradientProbe()
    probe.attach(model)
    probe.begin(0)
    probe.loss_hook(
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(0))).square().sum()
    ).backward()
    probe.close()
    assert probe.layers == [""]  # one layer, not "weight" and "bias" as two
    expected = torch.linalg.vector_norm(torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()]))
    assert probe.layer_norms[""] == [pytest.approx(expected.item(), rel=1e-6)]
    ticks = plot_layer_heatmap(probe).axes[0].get_yticklabels()
    assert [t.get_text() for t in ticks] == ["(root)"]


class _Boom(torch.autograd.Function):
    """Identity forward; backward turns the gradient into inf: an overflow in the middle of the model."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * math.inf


class _Middle(torch.nn.Module):
    def forward(self, x):
        return _Boom.apply(x)


def test_the_trace_is_in_backward_order_and_blames_where_the_inf_started_not_the_input_layer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), _Middle(), torch.nn.Linear(8, 2)
    )
    probe = GradientProbe()
    probe.attach(model)
    probe.begin(0)
    probe.loss_hook(model(torch.randn(5, 4)).square().sum()).backward()
    (stats,) = probe.trace
    names = [g.name for g in stats]
    assert names[0] == "3 (output)"  # nearest the loss first
    assert names.index("3 (input)") < names.index("1 (output)") < names.index("0 (output)")
    assert "0 (input)" not in names  # the data needs no gradient
    assert probe.first_nonfinite == ["1 (output)"]  # the gradient right below the overflow
    assert not math.isfinite(next(g.amax for g in stats if g.name == "0.weight"))  # upstream is inf too


def test_an_fp16_sawtooth_overflows_in_a_weight_gradient_and_the_probe_names_it():
    from labkit.lab.experiment import ExperimentConfig, run_experiment
    from labkit.lab.gradients import Probed
    from labkit.tasks import GPTTask

    probe = GradientProbe()
    task = GPTTask(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4)
    log = run_experiment(ExperimentConfig(task=Probed(task, probe), device="cpu", precision="fp16",
                                          optimizer="adam", lr=3e-3, init_scale=2.0**16, growth_interval=1,
                                          steps=8))
    backoffs = [r.step for r in log if r.next_scale < r.scale]
    assert backoffs and [s for s, name in zip(probe.steps, probe.first_nonfinite) if name] == backoffs
    # a weight gradient (a sum over the batch's tokens) overflowed; no activation gradient
    for step in backoffs:
        bad = [g for g in probe.trace[step] if not math.isfinite(g.amax)]
        assert bad and all(g.kind == "weight" for g in bad)
        assert probe.first_nonfinite[step] in {g.name for g in bad}
    tied = next(g for g in probe.trace[0] if g.name.startswith("wte.weight"))
    # its .grad adds the fp32 embedding's
    assert tied.name == "wte.weight = lm_head.weight" and not tied.linear
    assert next(g for g in probe.trace[0] if g.name == "lm_head.weight (this use)").linear
    ax = plot_headroom(probe).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    held = [max(g.amax * s for g in stats if g.kind == "weight" and g.linear) for stats, s in
            zip(probe.trace, probe.loss_scale)]
    # no overflow, below the line
    assert all(h < 65520 for h, step in zip(held, probe.steps) if step not in backoffs)
    drawn = lines["weight gradients"].get_ydata().tolist()
    assert [d for d, step in zip(drawn, probe.steps) if step not in backoffs] == \
        [h for h, step in zip(held, probe.steps) if step not in backoffs]
    assert all(math.isnan(drawn[s]) for s in backoffs)
    marks = [line for label, line in lines.items() if label.startswith("overflow: inf first in")]
    assert sorted(x for line in marks for x in line.get_xdata()) == backoffs


def test_the_histogram_by_kind_gives_each_kind_its_own_fractions():
    act, w = torch.tensor([2.0**-30, 2.0**-30, 1.0, 1.0]), torch.tensor([2.0**-10, 1.0])
    h = GradHistogram({"activation": act, "weight": w})
    assert h.fractions("activation") == flush_fractions(act, 0) == (0.5, 0.0)
    assert h.fractions("weight") == (0.0, 0.0) and h.fractions() == flush_fractions(torch.cat([act, w]), 0)
    assert sum(h.bars["activation"].get_data().values) == pytest.approx(1.0)  # a fraction of its own entries
    assert h.title() == "scale 2^0: flush to 0: activation 50.0%, weight 0.0%; overflow 0.0% (fp16)"
    h.slider.value = 24
    assert h.fractions("activation") == (0.0, 0.5)
    with pytest.raises(KeyError, match="no gradients of kind 'bias'"):
        h.fractions("bias")


def test_flushed_bars_follow_backward_order_and_heatmaps_share_one_colour_range():
    def trace(zeros):
        return [[GradStat("head (output)", "activation", 1.0, zeros[0]), GradStat("w", "weight", 1.0, 0.0),
                 GradStat("body (input)", "activation", 1.0, zeros[1])]] * 2

    a = GradientProbe.holding([0, 1], trace=trace((0.1, 0.9)), layer_norms={"x": [10.0, 1000.0]})
    b = GradientProbe.holding([0, 1], trace=trace((0.0, 0.0)))
    ax = plot_flushed_by_tensor({"a": a, "b": b}).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["head (output)", "body (input)"]
    assert [bar.get_width() for bar in ax.patches] == [0.1, 0.9, 0.0, 0.0]
    lo, hi = sorted(ax.get_ylim())  # every bar inside the axes
    assert all(lo <= bar.get_y() and bar.get_y() + bar.get_height() <= hi for bar in ax.patches)
    b = GradientProbe.holding([0], layer_norms={"x": [0.1]})  # b stopped after step 0
    fig = plot_layer_heatmap({"a": a, "b": b}, steps=4)
    top, bottom = fig.axes[:2]
    assert top.images[0].get_clim() == bottom.images[0].get_clim() == (-1.0, 3.0)
    assert top.images[0].colorbar is bottom.images[0].colorbar is not None  # one colour bar serves both
    assert bottom.images[0].get_array().shape == (1, 4)
    note = "grey: norm not finite (inf/NaN) or no backward, first at step {}"
    assert [t.get_text() for t in bottom.texts] == [note.format(1)]
    assert [t.get_text() for t in top.texts] == [note.format(2)]
    overflowed = GradientProbe.holding([0, 1], layer_norms={"x": [10.0, math.inf]})  # grey too
    assert [t.get_text() for t in plot_layer_heatmap(overflowed, steps=2).axes[0].texts] == [note.format(1)]


def test_a_held_probe_reads_back_what_it_was_given_and_refuses_a_step_count_that_disagrees():
    stats = [[GradStat("w", "weight", 0.5, 0.0)], [GradStat("w", "weight", math.inf, 0.0)]]
    p = GradientProbe.holding([3, 4], layer_norms={"w": [1.0, 2.0]}, loss_scale=[8.0, 4.0], trace=stats,
                              zero_fraction=[0.25, 0.5])
    assert (p.steps, p.layers, p.layer_norms, p.loss_scale, p.zero_fraction) == (
        [3, 4], ["w"], {"w": [1.0, 2.0]}, [8.0, 4.0], [0.25, 0.5])
    assert p.trace == stats and p.first_nonfinite == [None, "w"]
    with pytest.raises(
        ValueError, match=r"one value per step \(2 steps\), got \{\"layer_norms\['w'\]\": 1\}"
    ):
        GradientProbe.holding([0, 1], layer_norms={"w": [1.0]})


def test_a_tied_weights_linear_use_is_measured_apart_and_equals_the_untied_heads_gradient():
    import copy

    from labkit.tasks import GPTTask

    task = GPTTask(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4)
    tied = task.model()
    untied = copy.deepcopy(tied)
    # the oracle: its own tensor
    untied.lm_head.weight = torch.nn.Parameter(untied.wte.weight.detach().clone())
    x, y = task.batch(0)
    task.loss_fn(untied(x), y).backward()
    probe = GradientProbe()
    probe.attach(tied)
    probe.begin(0)
    probe.loss_hook(task.loss_fn(tied(x), y)).backward()
    stats = {g.name: g for g in probe.trace[0]}
    assert stats["lm_head.weight (this use)"].amax == pytest.approx(
        untied.lm_head.weight.grad.abs().max().item(), rel=1e-5)
    assert stats["wte.weight = lm_head.weight"].amax == pytest.approx(
        (untied.lm_head.weight.grad + untied.wte.weight.grad).abs().max().item(), rel=1e-5)
