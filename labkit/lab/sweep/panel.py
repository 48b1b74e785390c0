"""The lesson's sweep widget: an lr slider over the grid and a toggle per mitigation (``SweepPanel``)."""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from typing import Any

from ..latest import LatestRun
from .plots import plot_sweep
from .recipe import VARIANTS, Point, Recipe
from .runner import Runs

__all__ = ["SweepPanel"]


class SweepPanel:
    """The lesson's sweep: an lr slider over the grid and a toggle per mitigation, each re-run cached.

    The figure is ``plot_sweep`` of ``points`` (the reduced grid, run beforehand) with the
    chosen run ringed, plus that run's and the baseline's largest attention logit by step. A
    setting already run redraws at once; a new one trains one run (``recipe``'s size).

    >>> panel = SweepPanel(Recipe(n_layer=1, n_embd=16, n_head=2, block_size=8, batch_size=2, steps=4,
    ...                           val_batches=1), [1e-3, 1e-2])
    >>> panel.controls["qk_norm"].value = True; panel.variant, len(panel.runs)
    ('qk_norm', 2)
    """

    def __init__(self, recipe: Recipe, lrs: Sequence[float], points: Sequence[Point] = (), *,
                 lr: float | None = None, runs: Runs | None = None) -> None:
        import ipywidgets as W
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.recipe, self.lrs = recipe, [float(x) for x in lrs]
        self.runs = runs if runs is not None else Runs()
        self.points = list(points)
        self.controls = {
            "lr": W.SelectionSlider(options=[(f"{x:g}", x) for x in self.lrs],
                                    value=lr if lr is not None else self.lrs[-1], description="learning rate",
                                    continuous_update=False),
            "qk_norm": W.ToggleButton(value=False, description="qk_norm"),
            "z_loss": W.ToggleButton(value=False,
                                     description=f"z_loss {recipe.z_loss:.0e}".replace("e-0", "e-")),
        }
        self.status = W.HTML()
        self.seconds = math.nan
        self.error: Exception | None = None
        self.shown: tuple[str, float] | None = None  # (variant, lr) of the figure on screen
        self._latest = LatestRun(self._run_once)
        # a PNG in an Image widget: swapping its bytes is safe from a slider callback's thread
        # (see LiveDashboard), and the figure is redrawn whole (a new run changes every panel)
        self.fig = Figure(figsize=(12.6, 3.6))
        FigureCanvasAgg(self.fig)
        self.image = W.Image(format="png")
        self.controls["lr"].style.description_width = "120px"  # the default cuts "learning rate" short
        for name, widget in self.controls.items():
            widget.observe(lambda _: self.run(), names="value")
            widget.add_class(f"labkit-control-{name}")
        self.widget = W.VBox([W.HBox(list(self.controls.values())), self.status, self.image])
        self.widget.add_class("labkit-panel")
        self.run()

    @property
    def variant(self) -> str:
        qk, z = self.controls["qk_norm"].value, self.controls["z_loss"].value
        return "qk_norm+z_loss" if qk and z else "qk_norm" if qk else "z_loss" if z else "baseline"

    def run(self) -> None:
        """Run (or fetch) the chosen point and the baseline at its lr, and redraw.

        As ``ControlPanel.run``: a change during a run (a callback on another thread) makes it
        run once more with the latest settings when it ends, never two runs at once.
        """
        self._latest()

    def _run_once(self) -> None:
        start = time.perf_counter()
        lr, variant = self.controls["lr"].value, self.variant
        new = (self.recipe, variant, float(lr), 0) not in self.runs
        if self.shown is not None and self.shown != (variant, lr) and new:
            self.status.value = (f"settings changed: training <b>{variant}</b> at lr {lr:g} (a few seconds); "
                                 f"the figure below still shows {self.shown[0]} at lr {self.shown[1]:g}")
        try:
            point, log = self.runs.get(self.recipe, variant, lr)
            traces = {"baseline": self.runs.get(self.recipe, "baseline", lr)[1], variant: log}
        except Exception as e:  # shown in the panel: a callback's traceback would go unseen
            self.error = e
            self.status.value = f"<span style='color:#b00'>{type(e).__name__}: {e}</span>"
            return
        self.error = None
        self.shown = (variant, lr)
        points = [p for p in self.points if (p.variant, p.lr) != (variant, lr)] + [point]
        plot_sweep(points, traces, trace_lr=lr, highlight=(variant, lr),
                   overflow_at=self.recipe.fp16_logit_limit, fig=self.fig)
        buffer = io.BytesIO()
        self.fig.savefig(buffer, format="png", dpi=80)
        self.image.value = buffer.getvalue()
        self.seconds = time.perf_counter() - start
        self.status.value = (f"<b>{variant}</b>, lr {lr:g}: final loss {point.final_loss:.3f}, largest "
                             f"attention logit {point.attn_logit_max:.3g}, log Z at the end "
                             f"{point.log_z_final:.2f} &middot; {self.seconds:.2f} s")

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def figure_mismatches(self) -> list[str]:
        """Return each control whose value the figure does not show (``[]``: it shows them all, or none yet).

        >>> panel = SweepPanel(Recipe(n_layer=1, n_embd=16, n_head=2, block_size=8, batch_size=2, steps=3,
        ...                           val_batches=1), [1e-3])
        >>> panel.figure_mismatches(), panel.shown
        ([], ('baseline', 0.001))
        """
        if self.shown is None:
            return []
        variant, lr = self.shown
        qk_norm, z_loss = VARIANTS[variant]
        shown = {"lr": lr, "qk_norm": qk_norm, "z_loss": z_loss}
        return [f"{name}: the control says {widget.value!r}, the figure shows {shown[name]!r}"
                for name, widget in self.controls.items() if widget.value != shown[name]]
