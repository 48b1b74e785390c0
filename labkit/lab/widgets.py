"""The lab's control panel: sliders that re-run an experiment and redraw its dashboard.

Every widget path is a plain function of plain values, so it runs headless: set
``panel.controls["max_norm"].value`` (as a student's slider would) and read ``panel.logs``.

In JupyterLab 4.6 with ipykernel 7 a widget callback may run on another thread while a cell
is still running. So a callback only computes the new settings and starts a run when none is
going; during a run it leaves a note, and the running loop starts once more with the latest
settings when it is done. Each run trains a model of its own, so a callback never touches
a model that is being trained.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as W

from ..faults import KINDS
from ..names import PRECISIONS
from ..steplog import StepLog
from ..validate import check_int
from .experiment import ExperimentConfig, run_experiment
from .latest import LatestRun
from .plots import PANELS, LiveDashboard
from .text import describe, describe_rewind, format_scale

__all__ = ["CONTROLS", "ControlPanel", "config_from", "episode", "event_rows", "scaler_runs"]

CONTROLS = ("max_norm", "fault", "fault_step", "fault_count", "fault_magnitude",
            "init_scale", "growth_interval", "precision", "loss_scaling", "lr")
LRS = tuple(float(f"{m}e{e}") for e in range(-4, 1) for m in (1, 2, 3, 5, 8)) + (10.0,)  # 1e-4 ... 10
MAX_NORMS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0)
EPISODE = {"fault": "spike", "fault_step": 50, "fault_count": 1, "fault_magnitude": 1000.0}
_FAULT_KEYS = tuple(EPISODE)


def episode(
    fault: str, fault_step: int, fault_count: int = 1, fault_magnitude: float = 1000.0
) -> tuple[str, ...]:
    """Return the fault specs of one episode: ``fault_count`` bad batches from ``fault_step`` on.

    >>> episode("overflow", 100, 5), episode("spike", 60, fault_magnitude=10), episode("none", 3)
    (('100-104:overflow',), ('60:spike:10',), ())
    """
    if fault == "none":
        return ()
    if fault not in KINDS:
        raise ValueError(f"fault must be 'none' or one of {', '.join(KINDS)}, got {fault!r}.")
    check_int("fault_count", fault_count, 1)
    steps = f"{fault_step}" if fault_count == 1 else f"{fault_step}-{fault_step + fault_count - 1}"
    return (f"{steps}:{fault}" + (f":{fault_magnitude:g}" if fault == "spike" else ""),)


def config_from(base: ExperimentConfig, values: Mapping[str, Any]) -> ExperimentConfig:
    """Return ``base`` with the panel's control values applied (pure: widgets only read it).

    ``max_norm`` ``inf`` means no clipping; ``init_scale`` is given as its log2 exponent;
    the four fault controls make one episode (missing ones take ``EPISODE``'s defaults).

    >>> c = config_from(ExperimentConfig(),
    ...                 {"max_norm": math.inf, "init_scale": 16, "fault": "nan", "fault_step": 7})
    >>> c.max_norm, c.init_scale, c.faults
    (None, 65536.0, ('7:nan',))
    """
    unknown = set(values) - set(CONTROLS)
    if unknown:
        raise KeyError(f"unknown controls {sorted(unknown)}; known: {', '.join(CONTROLS)}.")
    changes: dict[str, Any] = {
        k: v for k, v in values.items() if k in ("growth_interval", "precision", "loss_scaling", "lr")
    }
    if "max_norm" in values:
        changes["max_norm"] = None if values["max_norm"] == math.inf else values["max_norm"]
    if "init_scale" in values:
        exponent = values["init_scale"]
        if isinstance(exponent, bool) or not isinstance(exponent, int) or not -126 <= exponent <= 127:
            raise ValueError(f"the init_scale control is log2 of the scale, an int in [-126, 127] (float32's "
                             f"range), got {exponent!r}.")
        changes["init_scale"] = 2.0**exponent
    if any(k in values for k in _FAULT_KEYS):
        changes["faults"] = episode(**{k: values.get(k, EPISODE[k]) for k in _FAULT_KEYS})
    return dataclasses.replace(base, **changes)


def event_rows(logs: Mapping[str, StepLog], max_norm: float | None | Mapping[str, float | None],
               last: int = 8, *, scaler: bool | Mapping[str, bool] = True) -> list[tuple[str, str]]:
    """Return the last ``last`` events (skips, clips, faults, scale changes) as ``(run, line)`` rows.

    ``max_norm`` is the threshold the runs clipped at, or ``{run: threshold}`` where they differ;
    ``scaler`` whether a loss scaler ran (``scaler_runs``), or ``{run: bool}``: a run without one
    is not told what a skip did to a scale.

    With several runs each keeps a fair share: one run's many skips do not push out the other
    run's one clip (the rows are cut from whichever run has the most, oldest first).

    >>> from labkit.records import StepRecord
    >>> log = StepLog([StepRecord(3, math.nan, skipped=True, reason="nonfinite_loss", fault="nan")])
    >>> for run, line in event_rows({"run": log}, 1.0):
    ...     print(run, line)
    run step    3  SKIP  nonfinite_loss: loss is not finite: backward skipped, scale untouched [fault nan]
    """
    if last <= 0:
        return []
    thresholds = max_norm if isinstance(max_norm, Mapping) else {run: max_norm for run in logs}
    scaled = scaler if isinstance(scaler, Mapping) else {run: scaler for run in logs}
    per_run = {run: _lines(log, i, run, thresholds[run], scaled[run])[-last:]
               for i, (run, log) in enumerate(logs.items())}
    while sum(map(len, per_run.values())) > last:
        # ties: the oldest
        del max(per_run.values(), key=lambda rows: (len(rows), -rows[0][0] if rows else 0))[0]
    # by step, then by run; sorted is stable, so the lines of one record keep their order
    rows = sorted((row for rows in per_run.values() for row in rows), key=lambda row: row[:2])
    return [(run, line) for _, _, run, line in rows]


def _lines(log: StepLog, i: int, run: str, max_norm: float | None,
           scaler: bool) -> list[tuple[int, int, str, str]]:
    """Each record's event lines, each rewind's after the record that triggered it."""
    after = log.events_after() if isinstance(log, StepLog) else {}
    return [(r.step, i, run, line) for k, r in enumerate(log)
            for line in [*describe(r, max_norm, scaler=scaler),
                         *(describe_rewind(e) for e in after.get(k, ()))]]


def scaler_runs(config: ExperimentConfig) -> bool:
    """Whether ``config`` trains with a loss scaler: fp16 with ``loss_scaling`` (fp32 and bf16 need none)."""
    return config.precision == "fp16" and config.loss_scaling


def _control(name: str, value: Any, steps: int) -> W.ValueWidget:
    if name == "max_norm":
        value = math.inf if value is None else float(value)
        options = sorted(set(MAX_NORMS) | ({value} if math.isfinite(value) else set()))
        return W.SelectionSlider(options=[(f"{m:g}", m) for m in options] + [("off", math.inf)], value=value,
                                 description="max_norm", continuous_update=False)
    if name == "fault":
        return W.Dropdown(options=["none", *KINDS], value=value, description="fault")
    if name == "fault_step":
        return W.IntSlider(
            value=value, min=0, max=steps - 1, description="fault step", continuous_update=False
        )
    if name == "fault_count":
        return W.IntSlider(value=value, min=1, max=20, description="fault count", continuous_update=False)
    if name == "fault_magnitude":
        return W.FloatLogSlider(value=value, base=10, min=0, max=5, step=0.25, description="spike x",
                                continuous_update=False)
    if name == "init_scale":
        exponent = math.log2(value)
        if not exponent.is_integer():
            raise ValueError(
                f"init_scale's slider moves in powers of two; give one, e.g. 1024, not {value!r}."
            )
        return W.IntSlider(
            value=int(exponent), min=0, max=24, description="init_scale 2^", continuous_update=False
        )
    if name == "growth_interval":
        return W.IntSlider(
            value=value, min=1, max=200, description="growth_interval", continuous_update=False
        )
    if name == "precision":
        return W.ToggleButtons(options=list(PRECISIONS), value=value, description="precision")
    if name == "loss_scaling":
        return W.Checkbox(value=value, description="loss scaling")
    if name == "lr":  # a grid of exact values, with the given one on it: a student can always return to it
        options = sorted(set(LRS) | {float(value)})
        return W.SelectionSlider(options=[(f"{v:g}", v) for v in options], value=float(value),
                                 description="learning rate", continuous_update=False)
    raise KeyError(f"unknown control {name!r}; known: {', '.join(CONTROLS)}.")


class ControlPanel:
    """Widgets that set an ``ExperimentConfig``, run it (once per variant) and show the result.

    ``controls`` maps control names (``CONTROLS``) to their first value; ``fixed`` gives control
    values without a widget (e.g. ``{"fault": "overflow"}`` with only step sliders); ``variants`` maps a
    run's name to config changes applied on top (e.g. ``{"unclipped": {"max_norm": None}}``);
    ``auto_run`` re-runs on every change (sliders fire on release), else only the Run button
    does; ``live`` repaints the dashboard every ``every`` steps while training. A run is a pure
    function of its config, so the last ``cache_size`` logs are kept by config: a slider moved
    back to a value already seen redraws at once, without training. In the page,
    each widget carries a CSS class: ``labkit-panel``, ``labkit-control-<name>``, ``labkit-run``,
    ``labkit-status``, ``labkit-dashboard`` and ``labkit-events`` (the table of last events).

    >>> panel = ControlPanel(ExperimentConfig(precision="fp32", steps=30), {"fault": "nan", "fault_step": 5})
    >>> panel.run()["run"].skipped_steps
    [5]
    >>> panel.controls["fault_step"].value = 9  # what a student's slider does
    >>> panel.logs["run"].skipped_steps, panel.config.faults
    ([9], ('9:nan',))
    """

    def __init__(
        self,
        base: ExperimentConfig,
        controls: Mapping[str, Any],
        *,
        fixed: Mapping[str, Any] | None = None,
        variants: Mapping[str, Mapping[str, Any]] | None = None,
        auto_run: bool = True,
        live: bool = False,
        every: int = 25,
        panels: Sequence[str] = PANELS,
        table_rows: int = 8,
        cache_size: int = 32,
    ) -> None:
        self.base = base
        self.variants = {name: dict(changes) for name, changes in (variants or {"run": {}}).items()}
        self.auto_run, self.live, self.table_rows = auto_run, live, table_rows
        self.fixed = dict(fixed or {})
        both = self.fixed.keys() & controls.keys()
        if both:
            raise ValueError(f"{sorted(both)} given both as controls and as fixed; keep one.")
        self.controls = {name: _control(name, value, base.steps) for name, value in controls.items()}
        self.config = config_from(base, self.values())
        # The settings with the control values they came from, set in one assignment (a callback
        # thread may change them while a run reads them), and the values of the run on screen.
        self._settings = self.config, self.values()
        self.shown_values: dict[str, Any] | None = None
        self._shown_status = ""  # the status line of the run on screen
        for variant in self.variants.values():
            dataclasses.replace(self.config, **variant)  # a bad variant fails here, not in a callback
        self.dashboard = LiveDashboard(
            self.config.max_norm, runs=tuple(self.variants), panels=panels, every=every
        )
        self.run_button = W.Button(description="Run", icon="play", tooltip="train with these settings")
        self.status = W.HTML(value="not run yet")
        self.table = W.HTML()
        self.logs: dict[str, StepLog] = {}
        self.alarms: dict[str, list[str]] = {}
        self.error: Exception | None = None
        self.seconds = math.nan
        # Logs by the exact config that made them (runs are a pure function of it): ~100 KB each.
        check_int("cache_size", cache_size, 0, hint="(logs kept; 0: none)")
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[ExperimentConfig, tuple[StepLog, list[str]]] = (
            collections.OrderedDict()
        )
        self._latest = LatestRun(self._run_latest)
        for widget in self.controls.values():
            widget.observe(self._changed, names="value")
        self.run_button.on_click(lambda _: self.run())
        self.widget = W.VBox([*self.controls.values(), W.HBox([self.run_button, self.status]),
                              self.dashboard.widget, self.table])
        # Stable CSS hooks (labels change with wording; these don't): for styling, and for the
        # browser tests, which find a control by its name, not by its label's text.
        for name, widget in self.controls.items():
            widget.add_class(f"labkit-control-{name}")
            # the default cuts "init_scale 2^" and "growth_interval" short
            widget.style.description_width = "120px"
        for widget, role in ((self.run_button, "run"), (self.status, "status"), (self.table, "events"),
                             (self.dashboard.widget, "dashboard"), (self.widget, "panel")):
            widget.add_class(f"labkit-{role}")

    def _repr_mimebundle_(self, **kwargs):  # type: ignore[no-untyped-def]
        return self.widget._repr_mimebundle_(**kwargs)

    def figure_mismatches(self) -> list[str]:
        """Return each control whose value the figure does not show (``[]``: it shows them all, or none yet).

        The figure, status and table show the last finished run; a control changed since (code
        that moved a slider and put it back without re-running, or a setting waiting for Run)
        is listed with both values.

        >>> config = ExperimentConfig(precision="fp32", steps=10)
        >>> panel = ControlPanel(config, {"fault_step": 5}, auto_run=False)
        >>> panel.figure_mismatches()  # nothing drawn yet
        []
        >>> _ = panel.run(); panel.controls["fault_step"].value = 7
        >>> panel.figure_mismatches()
        ['fault_step: the control says 7, the figure shows 5']
        """
        if self.shown_values is None:
            return []
        now = self.values()
        return [f"{name}: the control says {now[name]!r}, the figure shows {self.shown_values.get(name)!r}"
                for name in self.controls if now[name] != self.shown_values.get(name)]

    def values(self) -> dict[str, Any]:
        """Return the controls' current values, with the fixed ones."""
        return {**self.fixed, **{name: widget.value for name, widget in self.controls.items()}}

    def _changed(self, change: Any = None) -> None:
        # Only settings here: this may run on a callback thread in the middle of a run.
        try:
            values = self.values()
            self.config = config_from(self.base, values)
            self._settings = self.config, values
        except (ValueError, TypeError) as e:
            self._fail(e)
            return
        if self.auto_run:
            self.run()
        elif self.shown_values is not None and not self.running:  # the figure no longer shows the controls
            changed = self.figure_mismatches()
            self.status.value = (f"settings changed ({', '.join(m.split(':')[0] for m in changed)}): "
                                 "press Run; the figure shows the last run"
                                 if changed else self._shown_status)

    def run(self) -> dict[str, StepLog]:
        """Run every variant with the current settings (or, if a run is going, ask it to run again)."""
        try:
            self._latest()
        except Exception as e:  # shown in the panel: a callback's traceback would go unseen
            self._fail(e)
        return self.logs

    @property
    def running(self) -> bool:
        """Whether a run is going (a change now runs once more when it ends)."""
        return self._latest.running

    def _run_latest(self) -> None:
        self.run_button.disabled = True
        try:
            self._run_once(*self._settings)
        finally:
            self.run_button.disabled = False

    def _run_once(self, config: ExperimentConfig, values: Mapping[str, Any]) -> None:
        self.status.value = "running..."
        dash = self.dashboard
        configs = {name: dataclasses.replace(config, **changes) for name, changes in self.variants.items()}
        scaled = [c for c in configs.values() if scaler_runs(c)]
        dash.reset(
            config.max_norm, scale_note=None if scaled else f"{config.precision}: no loss scaler in this run"
        )
        start, logs, alarms, trained = time.perf_counter(), {}, {}, False
        for name, run_config in configs.items():
            if run_config in self._cache:  # a slider back on a value already seen: nothing to train
                self._cache.move_to_end(run_config)
                logs[name], alarms[name] = self._cache[run_config]
                continue
            trained = True
            on_record = (lambda record, name=name: dash.update(record, name)) if self.live else None
            # Alarms go into the status line: from a callback, a warning would land in a log
            # console nobody reads. (catch_warnings is process-wide, not per thread; at worst
            # a warning raised elsewhere during the run is shown here instead.)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logs[name] = run_experiment(run_config, on_record)
            alarms[name] = sorted({w.category.__name__ for w in caught})
            self._cache[run_config] = logs[name], alarms[name]
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        dash.show(logs)
        # A run shown again from the cache took no training: its time would read as the run's.
        self.seconds = time.perf_counter() - start if trained else math.nan
        self.logs, self.alarms, self.error = logs, alarms, None
        self.shown_values = dict(values)
        self.status.value = self._shown_status = self._status_html(config)
        rows = event_rows(logs, {name: c.max_norm for name, c in configs.items()}, self.table_rows,
                          scaler={name: scaler_runs(c) for name, c in configs.items()})
        self.table.value = _table_html(rows, multi=len(logs) > 1)

    def _status_html(self, config: ExperimentConfig) -> str:
        parts = []
        for name, log in self.logs.items():
            s = log.summary()
            alarm = f", <b>alarm</b>: {', '.join(self.alarms[name])}" if self.alarms[name] else ""
            scale = ""
            if scaler_runs(dataclasses.replace(config, **self.variants[name])) and len(log):
                scale = f"scale {format_scale(log[0].scale)} &rarr; {format_scale(s['final_scale'])}, "
            loss = f"final loss {s['final_loss']:.3g}" if s["steps"] > s["skipped"] else "no step taken"
            parts.append(f"<b>{html.escape(name)}</b>: {s['skipped']} skipped, {s['clipped']} clipped, "
                         f"{scale}{loss}{alarm}")
        device = config.resolved_device().type
        took = f"{self.seconds:.2f} s on {device}"
        if math.isnan(self.seconds):  # every run came from the cache
            took = "shown again (already run)"
        return " &middot; ".join(parts) + f" &middot; {took}"

    def clear(self) -> None:
        """Take the shown run off the panel: an empty dashboard, "not run yet", no events (the cache stays).

        A check that runs the panel from code and then puts its controls back calls this, so the
        panel never shows a run of other settings than the ones on its controls.
        """
        self.logs, self.alarms, self.error, self.shown_values = {}, {}, None, None
        self.dashboard.reset(self.config.max_norm, scale_note=None)
        self.dashboard.draw_idle()
        self.status.value = "not run yet"
        self.table.value = ""

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.status.value = (
            f"<span style='color:#b00'>{html.escape(type(error).__name__)}: {html.escape(str(error))}</span>"
        )


def _table_html(rows: list[tuple[str, str]], multi: bool) -> str:
    if not rows:
        return "<i>no skipped or clipped steps</i>"
    body = "".join(
        (f"<tr><td>{html.escape(run)}</td>" if multi else "<tr>")
        + f"<td><code>{html.escape(line)}</code></td></tr>"
        for run, line in rows
    )
    return f"<table><tr>{'<th>run</th>' if multi else ''}<th>last events</th></tr>{body}</table>"
