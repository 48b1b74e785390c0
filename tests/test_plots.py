"""plot_log and LiveDashboard: what is on screen is what the log says, redrawn when it should be."""

import math

import ipywidgets
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest

from labkit.lab.plots import LiveDashboard, plot_log
from labkit.records import StepLog, StepRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records(n=12, skip=(4, 5), clip=(7,)):
    out = []
    for i in range(n):
        if i in skip:
            out.append(StepRecord(i, math.nan if i == 4 else 0.5, grad_norm=math.nan if i == 4 else math.inf,
                                  scale=1024.0 / 2 ** (i == 5), next_scale=512.0 if i == 5 else 1024.0 / 2 ** (i == 5),
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
    skip_lines = [ax_norm.get_lines()[2], ax_loss.get_lines()[-1], ax_scale.get_lines()[-1]]  # norm: then max_norm
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


def test_under_ipympl_the_canvas_is_the_widget_and_loops_draw_now_callbacks_draw_idle(ipympl_backend, monkeypatch):
    dash = LiveDashboard(max_norm=1.0, every=4)
    canvas = dash.figure.canvas
    assert dash.interactive and dash.widget is canvas and isinstance(canvas, ipywidgets.DOMWidget)
    assert canvas.header_visible is False
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
