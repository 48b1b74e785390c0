"""Figures of a run: gradient norm (pre- and post-clip), loss and loss scale, static or live."""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure

from ..records import StepLog, StepRecord

__all__ = ["PANELS", "LiveDashboard", "plot_log"]

PANELS = ("norm", "loss", "scale")
_YLABELS = {"norm": "grad norm", "loss": "loss", "scale": "loss scale"}
_SKIP_COLOR = "C3"


def _positive(values: Iterable[float]) -> list[float]:
    # NaN, not a gap in the list: set_data keeps x and y aligned, and a log axis cannot show <= 0.
    return [v if math.isfinite(v) and v > 0 else math.nan for v in values]


def _skip_marks(steps: Sequence[int]) -> tuple[list[float], list[float]]:
    # One polyline of vertical strokes (x, 0)-(x, 1) in axes-y coordinates, NaN-separated:
    # one artist however many steps are skipped, so a redraw costs the same after 500 skips.
    xs: list[float] = []
    ys: list[float] = []
    for s in steps:
        xs += [s, s, math.nan]
        ys += [0.0, 1.0, math.nan]
    return xs, ys


def _summary(run: str, records: Sequence[StepRecord]) -> str:
    skipped = sum(r.skipped for r in records)
    clipped = sum(r.clipped for r in records if not r.skipped)
    return f"{run}: {len(records)} steps, {skipped} skipped, {clipped} clipped"


class _Panels:
    """The axes and line artists of one figure, made once; ``set_run`` only changes their data."""

    def __init__(self, fig: Figure, runs: Sequence[str], panels: Sequence[str], max_norm: float | None) -> None:
        unknown = [p for p in panels if p not in PANELS]
        if unknown or not panels:
            raise ValueError(f"panels must be a non-empty selection of {PANELS}, got {tuple(panels)!r}.")
        if not runs or len(set(runs)) != len(runs):
            raise ValueError(f"runs must be distinct names, at least one; got {tuple(runs)!r}.")
        self.fig, self.runs = fig, tuple(runs)
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        self.axes = dict(zip(panels, axes))
        for name, ax in self.axes.items():
            ax.set_ylabel(_YLABELS[name])
            ax.set_yscale("log", base=2 if name == "scale" else 10)
        axes[-1].set_xlabel("step")
        self.lines: dict[tuple[str, str], matplotlib.lines.Line2D] = {}
        single = len(self.runs) == 1
        for i, run in enumerate(self.runs):
            color, prefix = f"C{4 if single else i}", "" if single else f"{run}: "
            for name, ax in self.axes.items():
                if name == "norm":
                    self.lines[run, "pre"] = ax.plot([], [], lw=1, color="C0" if single else color,
                                                     label=f"{prefix}pre-clip (logged)")[0]
                    self.lines[run, "post"] = ax.plot([], [], lw=1, ls="--", color="C1" if single else color,
                                                      alpha=0.8, label=f"{prefix}post-clip (stepped)")[0]
                elif name == "loss":
                    self.lines[run, "loss"] = ax.plot([], [], lw=1, color="C2" if single else color, label=run)[0]
                else:
                    self.lines[run, "scale"] = ax.plot([], [], lw=1, color=color, drawstyle="steps-post",
                                                       label=f"{prefix}scale")[0]
                self.lines[run, "skip:" + name] = ax.plot(
                    [], [], color=_SKIP_COLOR if single else color, alpha=0.35, lw=1, transform=ax.get_xaxis_transform(),
                    label="skipped step" if i == 0 and name != "loss" else None)[0]
        self.threshold = None
        if "norm" in self.axes:
            self.threshold = self.axes["norm"].axhline(math.nan, color="k", ls=":", lw=0.8, label="max_norm")
        self.set_max_norm(max_norm)
        for name, ax in self.axes.items():
            if name != "loss" or not single:
                ax.legend(loc="upper right" if name != "scale" else "lower right", fontsize=7)

    def set_max_norm(self, max_norm: float | None) -> None:
        if self.threshold is not None:
            self.threshold.set_ydata([math.nan if max_norm is None else max_norm] * 2)  # NaN: not drawn

    def set_run(self, run: str, records: Sequence[StepRecord]) -> None:
        steps = [r.step for r in records]
        skips = _skip_marks([r.step for r in records if r.skipped])
        data = {
            "pre": _positive(r.grad_norm for r in records),
            "post": _positive(r.post_clip_norm for r in records),
            "loss": _positive(r.loss for r in records),
            "scale": [r.scale for r in records],
        }
        for (name_run, key), line in self.lines.items():
            if name_run != run:
                continue
            if key.startswith("skip:"):
                line.set_data(*skips)
            else:
                line.set_data(steps, data[key])

    def rescale(self) -> None:
        for ax in self.axes.values():
            ax.relim()
            ax.autoscale_view()
        if self.threshold is not None:  # keep the threshold in view even before the norm reaches it
            ydata = self.threshold.get_ydata()
            if math.isfinite(ydata[0]):
                lo, hi = self.axes["norm"].get_ylim()
                self.axes["norm"].set_ylim(min(lo, ydata[0] / 2), max(hi, ydata[0] * 2))


def plot_log(log: StepLog, max_norm: float | None = None, title: str | None = None) -> Figure:
    """Return the 3-panel figure of a finished run (no pyplot, so it works without a display).

    >>> from labkit.records import StepRecord
    >>> fig = plot_log(StepLog([StepRecord(0, 1.0, grad_norm=2.0, clip_coef=0.5, clipped=True)]), max_norm=1.0)
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['grad norm', 'loss', 'loss scale']
    """
    fig = Figure(figsize=(9, 7), layout="constrained")
    panels = _Panels(fig, ("run",), PANELS, max_norm)
    panels.set_run("run", list(log))
    panels.rescale()
    summary = log.summary()
    fig.suptitle(title or f"{summary['steps']} steps, {summary['skipped']} skipped, {summary['clipped']} clipped")
    return fig


def _ipympl_active() -> bool:
    backend = matplotlib.get_backend().lower()
    return "ipympl" in backend or backend == "widget"


class LiveDashboard:
    """Redraw a run's norm, loss and scale in place while it trains, and again when it is done.

    The figure and its lines are made once; new data goes in with ``set_data``. Under
    ``%matplotlib widget`` (ipympl) the figure's canvas is the widget: ``update`` calls
    ``canvas.draw()`` every ``every`` records, because inside a running cell ``draw_idle()``
    does not repaint until the cell ends; ``show`` (after a run, e.g. from a slider callback,
    when the kernel is idle) calls ``draw_idle()``. With any other backend the figure is
    rendered to PNG into an ``ipywidgets.Image``: swapping its bytes replaces the picture in
    one piece (no blank frame, unlike ``Output.clear_output()`` without ``wait=True``), and,
    unlike ``with output:``, it is safe from a widget callback's thread. A redraw costs
    about 65 ms (ipympl) to 95 ms (PNG) on two CPU cores, so keep ``every`` at 10 or more.

    >>> from labkit.records import StepRecord
    >>> dash = LiveDashboard(max_norm=1.0, every=2)
    >>> for i in range(4): dash.update(StepRecord(i, 1.0 / (i + 1), grad_norm=2.0, clip_coef=0.5, clipped=True))
    >>> dash.draws, list(dash.line("norm").get_ydata())
    (2, [2.0, 2.0, 2.0, 2.0])
    """

    def __init__(
        self,
        max_norm: float | None = None,
        *,
        runs: Sequence[str] = ("run",),
        panels: Sequence[str] = PANELS,
        every: int = 10,
        figsize: tuple[float, float] = (8, 5.5),
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (records between redraws), got {every!r}.")
        self.every = every
        self.interactive = _ipympl_active()
        if self.interactive:
            import matplotlib.pyplot as plt

            with plt.ioff():  # made, not shown: the caller displays the dashboard once
                fig = plt.figure(figsize=figsize)
            fig.canvas.header_visible = False  # "Figure 7" changes every run; it says nothing
            # Until a page shows it, ipympl 0.10 syncs each drawn frame to the page as bare base64
            # where the page expects a data URL; the page then fails to render the widget at all
            # (a live dashboard drawn before it is displayed; found by tests/browser). Off, the
            # page starts blank and asks the kernel for a frame, as it does for any new figure.
            fig.canvas.syncing_data_url = False
        else:
            import ipywidgets
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            fig = Figure(figsize=figsize)
            FigureCanvasAgg(fig)
            self._image = ipywidgets.Image(format="png")
        # Fixed margins, not a layout engine: constrained layout on every redraw costs ~70 % more.
        fig.subplots_adjust(left=0.12, right=0.97, top=0.93, bottom=0.09, hspace=0.12)
        self.figure = fig
        self._panels = _Panels(fig, tuple(runs), tuple(panels), max_norm)
        self._records: dict[str, list[StepRecord]] = {run: [] for run in self._panels.runs}
        self.draws = 0

    @property
    def runs(self) -> tuple[str, ...]:
        return self._panels.runs

    @property
    def widget(self):  # type: ignore[no-untyped-def]
        """The ipywidget that shows the figure: ipympl's canvas, or an ``Image``."""
        return self.figure.canvas if self.interactive else self._image

    def _repr_mimebundle_(self, **kwargs):  # type: ignore[no-untyped-def]
        if self.draws == 0:
            self.draw_idle()
        return self.widget._repr_mimebundle_(**kwargs)

    def line(self, key: str, run: str | None = None):  # type: ignore[no-untyped-def]
        """Return a plotted line, to read back what is on screen: ``norm``, ``post``, ``loss``, ``scale``, ``skip``."""
        run = self._run(run)
        lines = self._panels.lines
        name = {"norm": "pre", "skip": "skip:" + next(iter(self._panels.axes))}.get(key, key)
        if (run, name) not in lines:
            raise KeyError(f"no line {key!r}; this dashboard has norm, post, loss, scale, skip for panels "
                           f"{tuple(self._panels.axes)}.")
        return lines[run, name]

    def _run(self, run: str | None) -> str:
        if run is None:
            if len(self.runs) != 1:
                raise ValueError(f"this dashboard shows several runs {self.runs}; say which with run=.")
            return self.runs[0]
        if run not in self._records:
            raise KeyError(f"unknown run {run!r}; this dashboard shows {self.runs}.")
        return run

    def reset(self, max_norm: float | None = None) -> None:
        """Forget every run's records (the figure stays) and set the threshold line."""
        for records in self._records.values():
            records.clear()
        self._panels.set_max_norm(max_norm)
        for run in self.runs:
            self._panels.set_run(run, [])

    def update(self, record: StepRecord, run: str | None = None) -> None:
        """Add one record; every ``every`` records, repaint now (this runs inside the training loop)."""
        records = self._records[self._run(run)]
        records.append(record)
        if len(records) % self.every == 0:
            self.draw()

    def show(self, log: Iterable[StepRecord] | Mapping[str, Iterable[StepRecord]]) -> None:
        """Show a finished log (or ``{run: log}``) and repaint when the kernel is next idle."""
        logs = log if isinstance(log, Mapping) else {self._run(None): log}
        for run, records in logs.items():
            self._records[self._run(run)][:] = list(records)
        self.draw_idle()

    def draw(self) -> None:
        """Repaint now: right inside a running loop."""
        self._paint(idle=False)

    def draw_idle(self) -> None:
        """Repaint when the kernel is idle: right at the end of a callback."""
        self._paint(idle=True)

    def _paint(self, idle: bool) -> None:
        for run, records in self._records.items():
            self._panels.set_run(run, records)
        self._panels.rescale()
        self.figure.suptitle(" | ".join(_summary(run, recs) for run, recs in self._records.items()), fontsize=9)
        self.draws += 1
        if not self.interactive:
            self._render_png()
        elif idle:
            self.figure.canvas.draw_idle()
        else:
            self.figure.canvas.draw()

    def _render_png(self) -> None:
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=80)
        self._image.value = buf.getvalue()
