"""plot_log and LiveDashboard: what is on screen is what the log says, redrawn when it should be."""

import math
import warnings

import ipywidgets
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest

from labkit.lab.plots import LiveDashboard, plot_log, plot_scale_and_skips
from labkit.records import StepRecord
from labkit.steplog import StepLog

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records(n=12, skip=(4, 5), clip=(7,)):
    out = []
    for i in range(n):
        if i in skip:
            out.append(StepRecord(i, math.nan if i == 4 else 0.5, grad_norm=math.nan if i == 4 else math.inf,
                                  scale=1024.0 / 2 ** (i == 5),
                                  next_scale=512.0 if i == 5 else 1024.0 / 2 ** (i == 5),
                                  skipped=True, reason="nonfinite_loss" if i == 4 else "nonfinite_grad"))
        else:
            norm = 50.0 if i in clip else 0.1 * (i + 1)
            coef = 1.0 / (norm + 1e-6) if i in clip else 1.0
            scale = 1024.0 if i < 5 else 512.0
            out.append(StepRecord(i, 1.0 / (i + 1), grad_norm=norm, clip_coef=coef, clipped=i in clip,
                                  scale=scale, next_scale=scale))
    return StepLog(out)


def ydata(line):
    return np.asarray(line.get_ydata(), dtype=float)


def skip_xs(line):
    xs = np.asarray(line.get_xdata(), dtype=float)
    return sorted(set(xs[np.isfinite(xs)].astype(int).tolist()))


def test_plot_log_draws_the_log_columns_with_skips_marked():
    log = records()
    fig = plot_log(log, max_norm=1.0)
    ax_norm, ax_loss, ax_scale = fig.axes
    pre, post = ax_norm.get_lines()[:2]
    assert list(pre.get_xdata()) == list(range(12))
    expected = [math.nan if i in (4, 5) else r.grad_norm for i, r in enumerate(log)]  # inf/NaN are gaps
    np.testing.assert_array_equal(ydata(pre), expected)
    assert ydata(post)[7] == pytest.approx(1.0) and math.isnan(ydata(post)[5])
    assert ax_scale.get_yscale() == "log" and ydata(ax_scale.get_lines()[0]).tolist() == log.column("scale")
    # norm: then max_norm
    skip_lines = [ax_norm.get_lines()[2], ax_loss.get_lines()[-1], ax_scale.get_lines()[-1]]
    assert [skip_xs(line) for line in skip_lines] == [[4, 5]] * 3
    assert any(line.get_ydata()[0] == 1.0 for line in ax_norm.get_lines())  # the threshold
    assert fig._suptitle.get_text() == "12 steps, 2 skipped, 1 clipped"


def test_dashboard_redraws_every_k_records_and_its_lines_follow():
    dash = LiveDashboard(max_norm=1.0, every=5)
    assert not dash.interactive and isinstance(dash.widget, ipywidgets.Image)
    log = records()
    frames = []
    for r in log:
        dash.update(r)
        frames.append(bytes(dash.widget.value))
    assert dash.draws == 2  # after 5 and 10 records
    assert frames[3] == b"" and frames[4].startswith(PNG_MAGIC) and frames[9] != frames[4]
    assert len(ydata(dash.line("norm"))) == 10  # what was drawn last
    dash.draw()
    assert dash.draws == 3 and len(ydata(dash.line("norm"))) == 12
    assert skip_xs(dash.line("skip")) == [4, 5]
    assert ydata(dash.line("scale")).tolist() == log.column("scale")
    assert dash.figure._suptitle.get_text() == "run: 12 steps, 2 skipped, 1 clipped"


def test_show_and_reset_keep_the_same_figure_and_lines():
    dash = LiveDashboard(max_norm=2.0, every=100)
    fig, line = dash.figure, dash.line("loss")
    dash.show(records())
    assert dash.draws == 1 and len(ydata(line)) == 12
    assert ydata(line)[4] != ydata(line)[4]  # the NaN loss is a gap
    dash.reset(max_norm=None)
    assert dash.figure is fig and dash.line("loss") is line and len(ydata(line)) == 0
    dash.show(records(5, skip=(), clip=()))
    assert len(ydata(line)) == 5 and skip_xs(dash.line("skip")) == []


def test_the_threshold_line_follows_max_norm_and_stays_in_view():
    dash = LiveDashboard(max_norm=0.001)
    dash.show(records(4, skip=(), clip=()))
    threshold = dash._panels.threshold
    assert ydata(threshold).tolist() == [0.001, 0.001]
    lo, hi = dash.figure.axes[0].get_ylim()
    assert lo <= 0.0005 and hi >= 0.4
    dash.reset(max_norm=None)
    assert np.isnan(ydata(threshold)).all()


def test_several_runs_share_one_figure():
    dash = LiveDashboard(max_norm=1.0, runs=("clipped", "unclipped"), panels=("norm", "loss"))
    assert [ax.get_ylabel() for ax in dash.figure.axes] == ["grad norm", "loss"]
    dash.show({"clipped": records(6), "unclipped": records(3, skip=(), clip=())})
    assert len(ydata(dash.line("loss", "clipped"))) == 6 and len(ydata(dash.line("loss", "unclipped"))) == 3
    assert skip_xs(dash.line("skip", "clipped")) == [4, 5] and skip_xs(dash.line("skip", "unclipped")) == []
    with pytest.raises(ValueError, match="say which with run="):
        dash.update(records(1)[0])
    with pytest.raises(KeyError, match="unknown run 'other'"):
        dash.show({"other": records(1)})
    with pytest.raises(KeyError, match="no line 'scale'"):
        dash.line("scale", "clipped")


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "every must be an int >= 1"),
    ({"every": 2.5}, "every must be an int >= 1"),
    ({"panels": ("norm", "lr")}, "panels must be a non-empty selection"),
    ({"panels": ()}, "panels must be a non-empty selection"),
    ({"runs": ("a", "a")}, "runs must be distinct names"),
])
def test_bad_dashboard_arguments_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LiveDashboard(**kwargs)


def test_the_dashboard_displays_as_its_widget():
    dash = LiveDashboard()
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == dash.widget.model_id
    assert dash.draws == 1 and bytes(dash.widget.value).startswith(PNG_MAGIC)  # never shown empty


@pytest.fixture
def ipympl_backend():
    before = matplotlib.get_backend()
    plt.switch_backend("module://ipympl.backend_nbagg")
    yield
    plt.close("all")
    plt.switch_backend(before)


def test_under_ipympl_the_canvas_is_the_widget_and_loops_draw_now_callbacks_draw_idle(
    ipympl_backend, monkeypatch
):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ipympl's toolbar warned twice per figure
        dash = LiveDashboard(max_norm=1.0, every=4)
    canvas = dash.figure.canvas
    assert dash.interactive and dash.widget is canvas and isinstance(canvas, ipywidgets.DOMWidget)
    assert canvas.header_visible is False and canvas.toolbar_position == "right"  # left, it hid the y-label
    calls = []
    monkeypatch.setattr(canvas, "draw", lambda: calls.append("draw"))
    monkeypatch.setattr(canvas, "draw_idle", lambda: calls.append("draw_idle"))
    for r in records():
        dash.update(r)
    # inside a running loop draw_idle() would not repaint until the cell ends: draw() it is
    assert calls == ["draw"] * 3
    dash.show(records())
    assert calls[-1] == "draw_idle" and len(calls) == 4
    assert plt.get_fignums() == [dash.figure.number]  # made with pyplot, not shown twice


def test_a_live_dashboard_drawn_before_it_is_shown_sends_the_page_no_broken_image(ipympl_backend):
    # ipympl 0.10 syncs each frame drawn before display as bare base64, which the page cannot
    # draw: the widget never appeared in JupyterLab (tests/browser found it). No frame is synced;
    # the page asks for one when it shows the canvas.
    dash = LiveDashboard(every=2)
    sent = []
    dash.widget.observe(lambda change: sent.append(change["new"]), names="_data_url")
    for r in records()[:4]:
        dash.update(r)
    assert dash.draws == 2 and sent == [] and dash.widget._data_url is None


def legend_labels(ax):
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def finite_ys(ax):
    ys = [y for line in ax.get_lines() if line.get_visible() and line.get_transform() == ax.transData
          for y in np.asarray(line.get_ydata(), dtype=float)]
    return [y for y in ys if math.isfinite(y)]


def spiky(n, spike_at=None, size=1e6):
    return StepLog(
        [StepRecord(i, 0.5, grad_norm=size if i == spike_at else 0.5 + 0.01 * i) for i in range(n)]
    )


def test_the_norm_axis_rescales_on_every_redraw_and_always_shows_the_threshold():
    # set_ylim for the threshold used to turn autoscaling off: every later redraw kept the first limits
    dash = LiveDashboard(max_norm=1.0, panels=("norm", "loss"))
    ax = dash.figure.axes[0]
    for log in (spiky(40), spiky(40, spike_at=30), spiky(40, spike_at=10, size=1e-4), spiky(40)):
        dash.show(log)
        lo, hi = ax.get_ylim()
        assert lo <= min(finite_ys(ax)) and max(finite_ys(ax)) <= hi and lo < 1.0 < hi
    assert hi < 10  # the spike is gone, so is its range
    # live: the curve keeps growing past the first frame's limits
    dash = LiveDashboard(max_norm=None, every=10)
    for r in spiky(60, spike_at=45, size=1e6):
        dash.update(r)
    assert dash.draws == 6 and dash.figure.axes[0].get_ylim()[1] >= 1e6


def test_legends_list_only_what_is_drawn():
    dash = LiveDashboard(max_norm=None, panels=("norm", "loss", "scale"))
    dash.show(records(6, skip=(), clip=()))
    norm, loss, scale = dash.figure.axes
    assert legend_labels(norm) == ["pre-clip (logged)"]  # no threshold, no skip, no clip (post = pre)
    assert legend_labels(loss) == [] and legend_labels(scale) == []
    dash.reset(max_norm=1.0)
    dash.show(records())
    assert legend_labels(norm) == ["pre-clip (logged)", "post-clip (stepped)", "skipped step", "max_norm"]
    assert legend_labels(loss) == ["skipped step"] and legend_labels(scale) == ["skipped step"]


def test_two_runs_each_skip_entry_has_the_colour_of_its_own_marks():
    dash = LiveDashboard(max_norm=1.0, runs=("clipped", "unclipped"), panels=("norm", "loss"))
    dash.show({"clipped": records(12, skip=()), "unclipped": records(12)})
    norm = dash.figure.axes[0]
    labels = legend_labels(norm)
    assert "unclipped: skipped step" in labels and "clipped: skipped step" not in labels
    handle = norm.get_legend().legend_handles[labels.index("unclipped: skipped step")]
    assert (handle.get_color() == dash.line("skip", "unclipped").get_color()
            != dash.line("skip", "clipped").get_color())


def test_plot_log_draws_no_threshold_and_no_scale_panel_where_there_is_none():
    fp32 = StepLog([StepRecord(i, 1.0, grad_norm=0.5) for i in range(5)])
    fig = plot_log(fp32, max_norm=None)
    assert [ax.get_ylabel() for ax in fig.axes] == ["grad norm", "loss"]  # no scaler ran: no flat line at 1
    assert "max_norm" not in legend_labels(fig.axes[0]) and "skipped step" not in legend_labels(fig.axes[0])
    fig = plot_log(records(), max_norm=50.0)
    assert fig.axes[2].get_ylabel() == "loss scale" and "max_norm" in legend_labels(fig.axes[0])
    lo, hi = fig.axes[0].get_ylim()
    assert lo <= 0.1 and hi >= 50.0


def test_a_run_without_a_scaler_gets_a_note_not_a_flat_scale_line():
    dash = LiveDashboard(max_norm=1.0)
    dash.reset(1.0, scale_note="bf16: no loss scaler")
    dash.show(records(5, skip=(), clip=()))
    scale_ax = dash.figure.axes[2]
    assert not dash.line("scale").get_visible() and not scale_ax.yaxis.get_visible()
    assert "bf16: no loss scaler" in [t.get_text() for t in scale_ax.texts] and legend_labels(scale_ax) == []
    dash.reset(1.0)
    dash.show(records())
    assert dash.line("scale").get_visible() and [t.get_text() for t in scale_ax.texts] == [""]


def test_the_loss_is_plotted_divided_by_its_weight_and_the_axis_says_so():
    dash = LiveDashboard(panels=("loss",), loss_weight=1e-5)
    dash.show([StepRecord(0, 2e-5), StepRecord(1, 1e-5)])
    assert ydata(dash.line("loss")).tolist() == pytest.approx([2.0, 1.0])
    assert dash.figure.axes[0].get_ylabel() == "loss / loss_weight"
    with pytest.raises(ValueError, match="loss_weight must be a finite number > 0"):
        LiveDashboard(loss_weight=0)


@pytest.mark.parametrize("runs", [("run",), ("fp32", "fp16, no scaler", "fp16 + scaler")])
def test_nothing_is_cut_off_at_the_edges_of_the_canvas(runs):
    dash = LiveDashboard(max_norm=1.0, runs=runs, panels=("norm", "loss"))
    dash.show({run: records() for run in runs})
    fig = dash.figure
    box, canvas = fig.get_tightbbox(fig.canvas.get_renderer()), fig.bbox_inches
    assert (box.x0 >= canvas.x0 and box.y0 >= canvas.y0
            and box.x1 <= canvas.x1 and box.y1 <= canvas.y1), (box, canvas)
    assert fig._suptitle.get_text().count("\n") == (len(runs) - 1 if len(runs) > 2 else 0)


def test_the_scale_plot_draws_each_skip_under_its_own_reason_never_a_spike_as_a_loss_skip():
    reasons = ["nonfinite_loss", "forward_overflow", "nonfinite_grad", "spike_grad", "spike_loss",
               "dead_scale", "my_hook"]
    log = StepLog([StepRecord(0, 1.0, scale=8.0, next_scale=8.0)]
                  + [StepRecord(i, math.nan if i < 3 else 1.0, scale=8.0, next_scale=8.0, skipped=True,
                                reason=r)
                     for i, r in enumerate(reasons, 1)])
    ax = plot_scale_and_skips({"run": log}).axes[0]
    drawn = {line.get_label(): line.get_xdata().tolist() for line in ax.get_lines()[1:]}
    assert drawn == {
        "skipped: loss not finite (forward): 2": [1, 2],  # nonfinite_loss and triage's forward_overflow
        "skipped: gradient not finite (backward): 1": [3],
        "skipped: spike (z-score): 2": [4, 5],
        "skipped: loss scale dead (1/scale overflows): 1": [6],
        "skipped: my_hook: 1": [7],  # a hook's own reason keeps its name
    }
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss scale", *drawn]
