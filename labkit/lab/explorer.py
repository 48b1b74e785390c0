"""The "Try it" panel of lesson 05: pick a spike defense and its knob, and see the run it gives.

It runs ``run_experiment`` with the ``Defenses`` its controls set, so it lives above both
``experiment`` (which builds the defenses) and ``defenses`` (their settings and figures): the lab
imports in one direction only.
"""

from __future__ import annotations

import dataclasses
import html
import io
import warnings
from typing import Any

from matplotlib.figure import Figure

from ..clippers.base import FEEDS
from ..steplog import StepLog
from .defenses import KNOBS, Defenses, plot_defenses
from .experiment import run_experiment

__all__ = ["DefenseExplorer"]


class DefenseExplorer:
    """The "Try it" panel: a method with its own knob, window, feed, spike, shift: the figure follows it.

    Choosing a method puts *its* knob on the slider (``KNOBS``: its name, the values that make
    sense for it, its default), so a quantile never receives a z-score. The feed
    dropdown is off for the methods without statistics (``norm``, ``agc``). A setting the
    method cannot act on (a warm-up that lasts past the spike) is said in one line under the
    controls, and an error is shown in that line, never as a traceback. Each change re-runs
    ``base`` with the new ``Defenses`` (``base.defenses`` gives the spike and shift steps) and
    redraws ``plot_defenses``; the figure's title repeats the settings it was drawn for. The last
    16 runs are kept by their settings, so going back to one redraws without training.

    >>> from labkit.lab.experiment import ExperimentConfig
    >>> from labkit.lab.defenses import Defenses
    >>> base = ExperimentConfig(precision="fp32", steps=12, defenses=Defenses(spike_step=8))
    >>> ex = DefenseExplorer(base, window=4)
    >>> ex.controls["method"].value = "autoclip"  # what a student's click does
    >>> ex.controls["knob"].description, ex.controls["knob"].value, ex.error
    ('quantile', 0.9, None)
    """

    def __init__(self, base: Any, *, method: str = "zclip", window: int = 20, feed: str = "clipped",
                 spike_size: float = 100.0, shift_size: float = 1.0) -> None:
        import ipywidgets as W

        if base.defenses is None or base.defenses.spike_step is None:
            raise ValueError("base.defenses must name the spike's step, e.g. "
                             "ExperimentConfig(defenses=Defenses(spike_step=50, shift_step=40)).")
        if method not in KNOBS:
            raise ValueError(f"method must be one of {tuple(KNOBS)}, got {method!r}.")
        self.base = base
        name, options, default = KNOBS[method]
        self.controls = {
            "method": W.Dropdown(options=list(KNOBS), value=method, description="method"),
            "knob": W.SelectionSlider(options=[(f"{v:g}", v) for v in options], value=default,
                                      description=name, continuous_update=False),
            "window": W.IntSlider(value=window, min=4, max=60, description="window", continuous_update=False),
            "feed": W.Dropdown(options=list(FEEDS), value=feed, description="feed"),
            "spike_size": W.FloatLogSlider(value=spike_size, base=10, min=0, max=4, step=0.25,
                                           description="spike x", continuous_update=False),
            "shift_size": W.FloatLogSlider(value=shift_size, base=10, min=0, max=2, step=0.25,
                                           description="shift x", continuous_update=False),
        }
        self.status = W.HTML()
        self.image = W.Image(format="png")
        self.log: StepLog | None = None
        self.figure: Figure | None = None
        self.note: str | None = None
        self._cache: dict[Defenses, StepLog] = {}  # a run is a pure function of its settings: back is instant
        self.error: Exception | None = None
        self._quiet = False
        self._shown: dict[str, Any] = {}  # the controls' values the figure was drawn for
        self.controls["method"].observe(self._method_changed, names="value")
        for key in ("knob", "window", "feed", "spike_size", "shift_size"):
            self.controls[key].observe(lambda _: self.update(), names="value")
        self.widget = W.VBox([*self.controls.values(), self.status, self.image])
        self.update()

    def _repr_mimebundle_(self, **kwargs):  # type: ignore[no-untyped-def]
        return self.widget._repr_mimebundle_(**kwargs)

    def figure_mismatches(self) -> list[str]:
        """Return ``[]`` when the figure shows the controls' values, else what each says."""
        return [f"{key}: the control says {w.value!r}, the figure shows {self._shown.get(key)!r}"
                for key, w in self.controls.items() if w.value != self._shown.get(key)]

    def _method_changed(self, change: Any) -> None:
        name, options, default = KNOBS[change["new"]]
        knob = self.controls["knob"]
        self._quiet = True  # the options and the value change together: one run, not two
        try:
            knob.options = [(f"{v:g}", v) for v in options]
            knob.value = default
            knob.description = name
        finally:
            self._quiet = False
        self.update()

    def defenses(self) -> Defenses:
        """Return the ``Defenses`` the controls set (may raise ``ValueError``)."""
        v = {key: w.value for key, w in self.controls.items()}
        base = self.base.defenses
        stats = v["method"] not in ("norm", "agc")
        return dataclasses.replace(base, method=v["method"], threshold=v["knob"], window=v["window"],
                                   feed=v["feed"] if stats else None, spike_size=v["spike_size"],
                                   shift_step=base.shift_step if v["shift_size"] != 1.0 else None,
                                   shift_size=v["shift_size"])

    def title(self) -> str:
        """The settings, as the figure's title states them."""
        v = {key: w.value for key, w in self.controls.items()}
        feed = f", feed={v['feed']}" if v["method"] not in ("norm", "agc") else ""
        shift_step = self.base.defenses.shift_step
        shift = f", loss x{v['shift_size']:g} from step {shift_step}" if v["shift_size"] != 1.0 else ""
        knob = f"{self.controls['knob'].description}={v['knob']:g}"
        return (f"{v['method']} {knob}, window={v['window']}{feed}; "
                f"inputs x{v['spike_size']:g} at step {self.base.defenses.spike_step}{shift}")

    def update(self) -> None:
        """Re-run with the controls' values and redraw; a problem goes to the status line."""
        if self._quiet:
            return
        self.controls["feed"].disabled = self.controls["method"].value in ("norm", "agc")
        try:
            d = self.defenses()
            if d not in self._cache:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the ledger and the guard marks show what the alarms say
                    self._cache[d] = run_experiment(dataclasses.replace(self.base, defenses=d))
                while len(self._cache) > 16:
                    del self._cache[next(iter(self._cache))]
            self.log = self._cache[d]
        except (ValueError, TypeError) as e:
            self.error, self.note, self.log = e, None, None
            self.status.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
            self.figure = _message_figure(f"no run: {e}")
        else:
            self.error, self.note = None, d.warm_up_note()
            self.status.value = html.escape(self.note) if self.note else ""
            self.figure = plot_defenses({d.method: self.log}, window=d.window, title=self.title())
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=72)
        self.image.value = buf.getvalue()
        self._shown = {key: w.value for key, w in self.controls.items()}


def _message_figure(text: str) -> Figure:
    fig = Figure(figsize=(9, 1.2))
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, wrap=True)
    return fig
