"""Figures of a run: gradient norm (pre- and post-clip), loss and loss scale, static or live."""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure

from ..reasons import LOSS, SPIKES, Reason
from ..records import StepRecord
from ..steplog import StepLog
from ..validate import check_int

__all__ = ["PANELS", "LiveDashboard", "finite_positive", "ipympl_active", "plot_log", "plot_scale_and_skips"]

PANELS = ("norm", "loss", "scale")
_YLABELS = {"norm": "grad norm", "loss": "loss", "scale": "loss scale"}
_SKIP_COLOR = "C3"


def finite_positive(values: Iterable[float]) -> list[float]:
    """Replace what a log axis cannot show (non-finite, zero, negative) by NaN, keeping the length.

    >>> finite_positive([1.0, 0.0, float("inf"), -2.0, 3.0])
    [1.0, nan, nan, nan, 3.0]
    """
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


def _mark_isolated(line) -> None:  # type: ignore[no-untyped-def]
    """Put a marker on each finite point with no finite neighbour (between skips): a line alone draws none."""
    y = [math.isfinite(v) for v in line.get_ydata()]
    lone = [i for i, ok in enumerate(y)
            if ok and not (i > 0 and y[i - 1]) and not (i + 1 < len(y) and y[i + 1])]
    line.set_marker("o" if lone else "None")
    line.set_markersize(3)
    line.set_markevery(lone or None)


def _drawn(line) -> bool:  # type: ignore[no-untyped-def]
    """Whether a line shows anything: a finite point (a NaN-only line draws nothing)."""
    return line.get_visible() and any(math.isfinite(y) for y in line.get_ydata())


def _summary(run: str, records: Sequence[StepRecord]) -> str:
    skipped = sum(r.skipped for r in records)
    clipped = sum(r.clipped for r in records if not r.skipped)
    return f"{run}: {len(records)} steps, {skipped} skipped, {clipped} clipped"


def had_scaler(log: Iterable[StepRecord]) -> bool:
    """Whether a loss scaler ran: a disabled one (fp32, bf16) reports scale 1 and never moves it."""
    return any(r.scale != 1.0 or r.next_scale != 1.0 for r in log)


class _Panels:
    """The axes and line artists of one figure, made once; ``set_run`` only changes their data.

    Every repaint puts back what the figure shows: y-limits from all the data drawn plus the
    threshold (autoscale stays on: a fixed limit would freeze the first run's range), and
    legends that list exactly the artists that draw something.
    """

    def __init__(self, fig: Figure, runs: Sequence[str], panels: Sequence[str], max_norm: float | None,
                 loss_weight: float = 1.0) -> None:
        unknown = [p for p in panels if p not in PANELS]
        if unknown or not panels:
            raise ValueError(f"panels must be a non-empty selection of {PANELS}, got {tuple(panels)!r}.")
        if not runs or len(set(runs)) != len(runs):
            raise ValueError(f"runs must be distinct names, at least one; got {tuple(runs)!r}.")
        if not (loss_weight > 0 and math.isfinite(loss_weight)):
            raise ValueError(f"loss_weight must be a finite number > 0 (the loss is plotted divided by it), "
                             f"got {loss_weight!r}.")
        self.fig, self.runs, self.loss_weight = fig, tuple(runs), loss_weight
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        self.axes = dict(zip(panels, axes))
        for name, ax in self.axes.items():
            ax.set_ylabel(_YLABELS[name] if name != "loss" or loss_weight == 1.0 else "loss / loss_weight")
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
                elif name == "loss":  # one run: the axis label names the line
                    self.lines[run, "loss"] = ax.plot([], [], lw=1, color="C2" if single else color,
                                                      label="_loss" if single else run)[0]
                else:
                    self.lines[run, "scale"] = ax.plot([], [], lw=1, color=color, drawstyle="steps-post",
                                                       label="_scale" if single else f"{prefix}scale")[0]
                # Each run's marks in its own colour, with its own entry: a swatch is the marks' colour.
                self.lines[run, "skip:" + name] = ax.plot(
                    [], [], color=_SKIP_COLOR if single else color, alpha=0.35, lw=1,
                    transform=ax.get_xaxis_transform(), label=f"{prefix}skipped step")[0]
        self.threshold = None
        if "norm" in self.axes:
            self.threshold = self.axes["norm"].axhline(math.nan, color="k", ls=":", lw=0.8, label="max_norm")
        self.note = None
        if "scale" in self.axes:
            self.note = self.axes["scale"].text(0.5, 0.5, "", transform=self.axes["scale"].transAxes,
                                                ha="center", va="center", fontsize=9, color="0.35")
        self._legends: dict[str, tuple] = {}
        self.set_max_norm(max_norm)

    def set_max_norm(self, max_norm: float | None) -> None:
        if self.threshold is not None:
            self.threshold.set_ydata([math.nan if max_norm is None else max_norm] * 2)  # NaN: not drawn

    def set_scale_note(self, note: str | None) -> None:
        """Show ``note`` in place of the scale curves (a run without a scaler), or the curves (``None``)."""
        if "scale" not in self.axes:
            return
        self.note.set_text(note or "")
        for (_, key), line in self.lines.items():
            if key in ("scale", "skip:scale"):
                line.set_visible(note is None)
        self.axes["scale"].yaxis.set_visible(note is None)

    def set_run(self, run: str, records: Sequence[StepRecord]) -> None:
        steps = [r.step for r in records]
        skips = _skip_marks([r.step for r in records if r.skipped])
        # A run that never clipped has a post-clip line equal to its pre-clip one: drawn, one would
        # hide the other (in the same colour when runs share one), and the legend would list both.
        clipped = any(r.clipped for r in records)
        data = {
            "pre": finite_positive(r.grad_norm for r in records),
            "post": finite_positive(r.post_clip_norm if clipped else math.nan for r in records),
            "loss": finite_positive(r.loss / self.loss_weight for r in records),
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
        for name, ax in self.axes.items():
            # On every repaint: a call to set_ylim (or a zoom) turns autoscaling off for good.
            ax.set_autoscaley_on(True)
            ax.relim(visible_only=True)  # the threshold (an axhline) counts for y; the skip marks only for x
            ax.autoscale_view()
            if ax is self.axes.get("norm") and self.threshold is not None and _drawn(self.threshold):
                # A margin of 2x around the threshold too, so it is never drawn on the frame.
                t = self.threshold.get_ydata()[0]
                lo, hi = ax.get_ylim()
                ax.set_ylim(min(lo, t / 2), max(hi, t * 2), auto=None)  # auto=None: autoscale stays on
            self._legend(name, ax)

    def _legend(self, name: str, ax) -> None:  # type: ignore[no-untyped-def]
        handles = tuple(line for line in ax.get_lines()
                        if not line.get_label().startswith("_") and _drawn(line))
        if self._legends.get(name) == handles:
            return  # rebuilding a legend costs more than drawing it
        self._legends[name] = handles
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        if handles:
            # "best": where it covers the fewest data points (a fixed corner hid the scale's last steps)
            ax.legend(handles=list(handles), loc="best", fontsize=7)


def plot_log(log: StepLog, max_norm: float | None = None, title: str | None = None,
             panels: Sequence[str] | None = None) -> Figure:
    """Return the figure of a finished run (no pyplot, so it works without a display).

    ``panels`` defaults to norm, loss and, if a loss scaler ran (the scale moved off 1), scale.

    >>> from labkit.records import StepRecord
    >>> fig = plot_log(StepLog([StepRecord(0, 1.0, grad_norm=2.0, clip_coef=0.5, clipped=True,
    ...                                    scale=1024.0)]), max_norm=1.0)
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['grad norm', 'loss', 'loss scale']
    """
    if panels is None:
        panels = PANELS if had_scaler(log) else ("norm", "loss")
    fig = Figure(figsize=(9, 2.3 * len(panels) + 0.4), layout="constrained")
    drawn = _Panels(fig, ("run",), panels, max_norm)
    drawn.set_run("run", list(log))
    for (_, key), line in drawn.lines.items():
        if key in ("pre", "post", "loss"):
            _mark_isolated(line)
    drawn.rescale()
    summary = log.summary()
    fig.suptitle(title or f"{summary['steps']} steps, {summary['skipped']} skipped, "
                          f"{summary['clipped']} clipped")
    return fig


def ipympl_active() -> bool:
    """Return whether figures draw on ipympl's canvas (``%matplotlib widget``), else they are sent as PNGs.

    >>> ipympl_active() == (matplotlib.get_backend() in ("widget", "module://ipympl.backend_nbagg"))
    True
    """
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
    unlike ``with output:``, it is safe from a widget callback's thread. A redraw is a full
    Agg render to PNG (``benchmarks/bench_widgets.py`` times it), so keep ``every`` at 10 or more.
    Every repaint rescales each panel to all of its data and the threshold, and lists in each
    legend only what is drawn. ``loss_weight`` plots the loss divided by it (see
    ``ExperimentConfig.loss_weight``).

    >>> from labkit.records import StepRecord
    >>> dash = LiveDashboard(max_norm=1.0, every=2)
    >>> for i in range(4):
    ...     dash.update(StepRecord(i, 1.0 / (i + 1), grad_norm=2.0, clip_coef=0.5, clipped=True))
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
        loss_weight: float = 1.0,
    ) -> None:
        check_int("every", every, 1, hint="(records between redraws)")
        self.every = every
        self.interactive = ipympl_active()
        if self.interactive:
            import matplotlib.pyplot as plt

            # made, not shown: the caller displays the dashboard once
            with plt.ioff(), warnings.catch_warnings():
                # ipympl 0.10's Toolbar passes its arguments on to traitlets, which warns (a
                # DeprecationWarning the student can do nothing about); only that one is silenced.
                warnings.filterwarnings("ignore", r"Passing unrecognized arguments to super\(Toolbar\)",
                                        DeprecationWarning)
                fig = plt.figure(figsize=figsize)
            fig.canvas.header_visible = False  # "Figure 7" changes every run; it says nothing
            # ipympl's toolbar floats over the canvas; on the left (its default) it hid the norm
            # panel's y-label and ticks. On the right it sits in the margin kept free for it below.
            fig.canvas.toolbar_position = "right"
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
        # The title has one line per run (one long line was cut off at both edges).
        title_lines = len(runs) if len(runs) > 2 else 1
        fig.subplots_adjust(left=0.12, right=0.94, top=0.97 - 0.035 * title_lines, bottom=0.09, hspace=0.12)
        self.figure = fig
        self._panels = _Panels(fig, tuple(runs), tuple(panels), max_norm, loss_weight)
        self._title_sep = "\n" if title_lines > 1 else " | "
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
        """Return a plotted line, to read back what is on screen: ``norm``, ``post``, ``loss``, ``scale``,
        ``skip``."""
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

    def reset(self, max_norm: float | None = None, *, scale_note: str | None = None) -> None:
        """Forget every run's records (the figure stays), set the threshold line and the scale panel.

        ``scale_note``: the run has no loss scaler; the scale panel says this instead of showing
        a flat line at 1 that means nothing.
        """
        for records in self._records.values():
            records.clear()
        self._panels.set_max_norm(max_norm)
        self._panels.set_scale_note(scale_note)
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
        self.figure.suptitle(self._title_sep.join(_summary(run, recs) for run, recs in self._records.items()),
                             fontsize=9)
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


# Which skips a scale plot tells apart, by labkit.reasons' sets (one home for "which skips are loss skips")
_SKIP_KINDS: tuple[tuple[tuple[str, ...], str, str, str], ...] = (
    (LOSS, "^", "C3", "skipped: loss not finite (forward)"),
    ((Reason.NONFINITE_GRAD,), "v", "C1", "skipped: gradient not finite (backward)"),
    ((Reason.DEAD_SCALE,), "s", "C5", "skipped: loss scale dead (1/scale overflows)"),
    (SPIKES, "D", "C2", "skipped: spike (z-score)"),
)
_KNOWN = frozenset(reason for reasons, *_ in _SKIP_KINDS for reason in reasons)


def plot_scale_and_skips(logs: Mapping[str, StepLog], title: str = "") -> Figure:
    """Return each run's loss scale against step (log2 axis), its skipped steps marked by why they skipped.

    A backward overflow (``nonfinite_grad``) halves the scale and the run goes on: the sawtooth. A
    forward overflow makes the loss itself not finite (``nonfinite_loss``): backward never runs,
    the scale is left alone, and every later batch that overflows skips again at the same scale. The
    kinds are ``labkit.reasons``' sets (``LOSS`` takes triage's refinements too); a spike detector's skip,
    a dead scale and a hook's own reason each get their own mark.

    >>> from labkit.records import StepRecord
    >>> log = StepLog([StepRecord(0, math.nan, scale=4.0, next_scale=4.0, skipped=True,
    ...                           reason="nonfinite_loss")])
    >>> fig = plot_scale_and_skips({"storm": log}); [line.get_label() for line in fig.axes[0].get_lines()][:2]
    ['loss scale', 'skipped: loss not finite (forward): 1']
    """
    fig = Figure(figsize=(4.4 * len(logs), 3.0), layout="constrained")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    for ax, (name, log) in zip(fig.subplots(1, len(logs), squeeze=False)[0], logs.items()):
        steps, scales = log.column("step"), log.column("scale")
        ax.plot(steps, scales, drawstyle="steps-post", color="C4", lw=1.2, label="loss scale")
        skips = [r for r in log if r.skipped]
        # a reason no set names (a user's hook's own) is drawn under its own name, never as another's
        others = dict.fromkeys(str(r.reason) for r in skips if r.reason not in _KNOWN)
        kinds = [*_SKIP_KINDS, *(((reason,), "x", "C7", f"skipped: {reason}") for reason in others)]
        for reasons, marker, color, label in kinds:
            hit = [r for r in skips if r.reason in reasons]
            if hit:
                ax.plot([r.step for r in hit], [r.scale for r in hit], marker, color=color, ms=5, ls="none",
                        label=f"{label}: {len(hit)}")
        ax.set_yscale("log", base=2)
        finite = [x for x in scales if math.isfinite(x) and x > 0]
        if finite:  # a binade of room above and below, so marks on the edge and the legend stay clear
            ax.set_ylim(min(finite) / 2, max(finite) * 4)
        ax.set(xlabel="step", ylabel="loss scale", title=name)
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=9)
    return fig
