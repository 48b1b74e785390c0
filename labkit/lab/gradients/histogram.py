"""A histogram of log2|gradient| over fp16's and bf16's ranges, with a loss-scale slider (``GradHistogram``).

Micikevicius et al. 2018, "Mixed Precision Training", Fig. 3, live: moving the slider multiplies
the gradients by the scale, and the title says what fp16 would flush to zero and to inf.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from matplotlib.figure import Figure
from torch import Tensor

from ..plots import ipympl_active
from .ranges import BF16_RANGE, FP16_RANGE, flush_fractions

if TYPE_CHECKING:
    from .probe import GradientProbe

__all__ = ["GradHistogram"]

_BANDS = (  # (label, lo, hi, color) in log2|x|
    ("bf16 (normal)", BF16_RANGE[1], BF16_RANGE[2], "C2"),
    ("fp16 subnormal", FP16_RANGE[0], FP16_RANGE[1], "C1"),
    ("fp16 normal", FP16_RANGE[1], FP16_RANGE[2], "C0"),
)


def _log2_abs(values: Tensor) -> Tensor:
    a = values.detach().abs().double().flatten()
    return a[a > 0].log2()


_KIND_COLORS = {"all": "k", "activation": "k", "weight": "C3"}


class GradHistogram:
    """A histogram of log2|gradient| over fp16's and bf16's ranges, with a loss-scale slider.

    The bands are fp16's subnormal range [2**-24, 2**-14), its normal range up to 65504, and
    bf16's normal range (2**-126 .. 3.4e38, wider than the axis: bf16 flushes nothing here).
    Moving the slider multiplies the gradients by ``2**log2_scale``, shifting the histogram,
    and the title says what fp16 would flush to zero and to inf. ``values`` is one tensor, or
    ``{"activation": ..., "weight": ...}`` (``probe.activation_values``, ``probe.weight_values``):
    each kind is then drawn as its own outline, as a fraction of its own entries, and the title
    gives each kind's share. ``update(values)`` takes new gradients (pass ``every=`` and attach
    it with ``probe.listeners.append`` to follow a run live: it shows both kinds). Rendered like
    ``LiveDashboard``: ipympl's canvas, else a PNG image.

    >>> h = GradHistogram(torch.tensor([2.0**-30, 2.0**-20, 1.0]), log2_scale=0)
    >>> h.title()
    'scale 2^0: 33.3% flush to 0, 0.0% overflow (fp16)'
    >>> h.set_scale(10); h.title()
    'scale 2^10: 0.0% flush to 0, 0.0% overflow (fp16)'
    >>> GradHistogram({"activation": torch.tensor([2.0**-30, 1.0]), "weight": torch.tensor([1.0])}).title()
    'scale 2^0: flush to 0: activation 50.0%, weight 0.0%; overflow 0.0% (fp16)'
    """

    def __init__(self, values: Tensor | Mapping[str, Tensor] | None = None, log2_scale: int = 0, *,
                 every: int = 10, xlim: tuple[float, float] = (-48.0, 24.0),
                 figsize: tuple[float, float] = (8, 3.2)) -> None:
        import ipywidgets as W

        self.every, self.xlim = every, xlim
        self.interactive = ipympl_active()
        if self.interactive:
            import matplotlib.pyplot as plt

            with plt.ioff():
                fig = plt.figure(figsize=figsize)
            fig.canvas.header_visible = False
            fig.canvas.syncing_data_url = False  # see LiveDashboard: the page asks for the first frame
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            fig = Figure(figsize=figsize)
            FigureCanvasAgg(fig)
            self._image = W.Image(format="png")
        fig.subplots_adjust(left=0.08, right=0.98, top=0.88, bottom=0.17)
        self.figure, self.ax = fig, fig.add_subplot()
        ax = self.ax
        self.bands = {label: ax.axvspan(lo, hi, color=color, alpha=0.12 if "bf16" in label else 0.25, lw=0,
                                        label=label)
                      for label, lo, hi, color in _BANDS}
        # Named in place, not in a legend: a band's name belongs where the band is.
        for label, lo, hi, color in _BANDS:
            x = (max(lo, xlim[0]) + min(hi, xlim[1])) / 2 if "bf16" not in label else xlim[0] + 1
            ax.text(x, 0.97, label, transform=ax.get_xaxis_transform(),
                    ha="center" if "bf16" not in label else "left", va="top", fontsize=7, color=color)
        self.edges = torch.arange(xlim[0], xlim[1] + 0.5, 0.5, dtype=torch.float64)
        self.bars: dict[str, Any] = {}
        self._kind_labels: dict[str, Any] = {}
        ax.set_xlim(*xlim)
        ax.set_xlabel("log2 |gradient x scale|")
        ax.set_ylabel("fraction")
        self.slider = W.IntSlider(value=log2_scale, min=-8, max=40, description="scale 2^",
                                  continuous_update=True)
        self.slider.observe(lambda change: self.set_scale(change["new"]), names="value")
        self.slider.add_class("labkit-control-hist_scale")
        self._values: dict[str, Tensor] = {}
        self._seen = 0
        self._drawn_scale: int | None = None  # the scale the bars and title were last set for
        self.widget = W.VBox([self.slider, fig.canvas if self.interactive else self._image])
        self.widget.add_class("labkit-histogram")
        self.update(values if values is not None else torch.zeros(0), draw=False)

    @property
    def log2_scale(self) -> int:
        return self.slider.value

    def _repr_mimebundle_(self, **kwargs):  # type: ignore[no-untyped-def]
        self._paint(idle=True)
        return self.widget._repr_mimebundle_(**kwargs)

    def figure_mismatches(self) -> list[str]:
        """Return ``[]`` when the histogram shows the slider's scale, else what each says."""
        if self._drawn_scale in (None, self.log2_scale):
            return []
        return [f"scale: the slider says 2^{self.log2_scale}, the histogram shows 2^{self._drawn_scale}"]

    def fractions(self, kind: str | None = None) -> tuple[float, float]:
        """The fractions fp16 flushes to 0 and to inf at the slider's scale: of all entries or of ``kind``."""
        if kind is not None:
            if kind not in self._values:
                raise KeyError(f"no gradients of kind {kind!r}; this histogram has {sorted(self._values)}.")
            return flush_fractions(self._values[kind], self.log2_scale)
        return flush_fractions(torch.cat(list(self._values.values())), self.log2_scale)

    def title(self) -> str:
        under, over = self.fractions()
        if list(self._values) == ["all"]:
            return f"scale 2^{self.log2_scale}: {under:.1%} flush to 0, {over:.1%} overflow (fp16)"
        kinds = ", ".join(f"{kind} {self.fractions(kind)[0]:.1%}" for kind in self._values)
        return f"scale 2^{self.log2_scale}: flush to 0: {kinds}; overflow {over:.1%} (fp16)"

    def set_scale(self, log2_scale: int) -> None:
        """Shift the histogram to ``gradients * 2**log2_scale`` and redraw."""
        if self.slider.value != log2_scale:
            self.slider.value = log2_scale  # its observer comes back here
            return
        self._redraw(idle=True)

    def update(self, values: Tensor | Mapping[str, Tensor], draw: bool = True) -> None:
        """Show new gradient values (``probe.values``, or ``{"activation": ..., "weight": ...}``)."""
        kinds = {"all": values} if isinstance(values, Tensor) else dict(values)
        self._values = {kind: v.detach().float().cpu().flatten() for kind, v in kinds.items()}
        for kind in self._values:
            if kind not in self.bars:
                color = _KIND_COLORS.get(kind, f"C{len(self.bars) + 4}")
                filled = kind == "all"
                self.bars[kind] = self.ax.stairs([0.0] * (len(self.edges) - 1), self.edges.tolist(),
                                                 fill=filled, color=color, alpha=0.6 if filled else 0.9,
                                                 lw=1.2)
                if not filled:  # named where it is drawn, as the bands are: no legend
                    self._kind_labels[kind] = self.ax.text(
                        0.99, 0.86 - 0.08 * len(self._kind_labels), f"{kind} gradients",
                        transform=self.ax.transAxes, ha="right", va="top", fontsize=8, color=color)
        for kind, bars in self.bars.items():
            bars.set_visible(kind in self._values)
            if kind in self._kind_labels:
                self._kind_labels[kind].set_visible(kind in self._values)
        if draw:
            self._redraw(idle=False)
        else:
            self._set_data()

    def __call__(self, probe: GradientProbe) -> None:
        """A probe listener: every ``every`` steps, show the probe's latest gradients (inside the run)."""
        self._seen += 1
        if self._seen % self.every == 0:
            self.update({"activation": probe.activation_values, "weight": probe.weight_values})

    def _set_data(self) -> None:
        top = 0.05
        for kind, values in self._values.items():
            x = _log2_abs(values) + self.log2_scale
            counts = torch.histogram(x.clamp(self.xlim[0], self.xlim[1] - 1e-9), self.edges).hist
            total = max(1, len(values))
            self.bars[kind].set_data((counts / total).tolist())
            top = max(top, float(counts.max()) / total * 1.15 if counts.numel() else 0.0)
        self.ax.set_ylim(0, top)
        self.ax.set_ylabel("fraction" if list(self._values) == ["all"] else "fraction of each kind")
        self.ax.set_title(self.title(), fontsize=9)
        self._drawn_scale = self.log2_scale

    def _redraw(self, idle: bool) -> None:
        self._set_data()
        self._paint(idle)

    def _paint(self, idle: bool) -> None:
        if not self.interactive:
            buf = io.BytesIO()
            self.figure.savefig(buf, format="png", dpi=80)
            self._image.value = buf.getvalue()
        elif idle:
            self.figure.canvas.draw_idle()
        else:
            self.figure.canvas.draw()

