"""Figures for precision beyond fp16: the float-format number line, bf16 stagnation, FP8 scaling.

Every value drawn comes from a real cast: torch's float8 and 16-bit dtypes, torchao's e2m1
(torch has the ``float4_e2m1fn_x2`` dtype but cannot cast to it on the CPU).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..formats.bf16 import RemedyRun
from ..formats.fp8 import FORMATS, CastRecord, quantize

__all__ = [
    "GRANULARITY_LABELS", "NUMBER_LINE", "GranularityExplorer", "format_values", "granularity_rows",
    "number_line", "round_trip", "scaling_figure", "stagnation_figure",
]

NUMBER_LINE = ("e2m1", "e4m3", "e5m2", "fp16", "bf16")
_DTYPES = {**FORMATS, "fp16": torch.float16, "bf16": torch.bfloat16}
_XLIM = (2.0**-26, 2.0**20)  # fp16's smallest subnormal to past e5m2's max
GRANULARITY_LABELS = {"tensor": "per tensor", "row": "per row", "tile128": "1x128 tiles",
                      "mx32": "MX (32, e8m0)"}


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=72)  # small PNGs in the committed notebook
    FigureCanvasAgg(fig)
    return fig


def _e2m1():  # type: ignore[no-untyped-def]
    from ..formats.fp8 import import_torchao_mx

    import_torchao_mx()  # torchao imported quietly
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    return f32_to_f4_unpacked, f4_unpacked_to_f32


def format_values(name: str, samples: int = 512) -> torch.Tensor:
    """Return a format's positive finite values, sorted: all for e2m1/e4m3/e5m2, ``samples`` for fp16/bf16.

    bf16 is sampled between 2^-26 and 2^20, the number line's window.

    Read from the bit patterns themselves (every byte viewed as the dtype), not from a formula.

    >>> format_values("e2m1").tolist()
    [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    >>> v = format_values("e4m3"); len(v), v.min().item(), v.max().item()
    (126, 0.001953125, 448.0)
    """
    if name == "e2m1":
        values = _e2m1()[1](torch.arange(16, dtype=torch.uint8))
    elif name in FORMATS:
        values = torch.arange(256, dtype=torch.uint8).view(FORMATS[name]).float()
    elif name in ("fp16", "bf16"):
        # bf16: sampled over the number line's window (its full range spans 2^-133 to 2^128)
        first, last = (0x3280, 0x4980) if name == "bf16" else (1, 0x7BFF)
        patterns = torch.linspace(first, last, samples).round().to(torch.int16)
        values = patterns.view(_DTYPES[name]).float()
    else:
        raise ValueError(f"name must be one of {NUMBER_LINE}, got {name!r}.")
    values = values[torch.isfinite(values) & (values > 0)]
    return values.unique()


def round_trip(value: float, name: str) -> float:
    """Return ``value`` after a real cast to format ``name`` and back.

    >>> [round_trip(500.0, f) for f in ("e4m3", "e5m2", "e2m1")], round_trip(math.inf, "e4m3")
    ([448.0, 512.0, 6.0], 448.0)
    """
    x = torch.tensor([value], dtype=torch.float32)
    if name == "e2m1":
        to_f4, from_f4 = _e2m1()
        return float(from_f4(to_f4(x))[0])
    if name not in _DTYPES:
        raise ValueError(f"name must be one of {NUMBER_LINE}, got {name!r}.")
    return float(x.to(_DTYPES[name]).float()[0])


def number_line(cursor: float | None = None, formats: Sequence[str] = NUMBER_LINE) -> Figure:
    """Draw each format's values on a log axis; ``cursor`` marks a value and where each format rounds it.

    >>> fig = number_line(cursor=500.0); [t.get_text() for t in fig.axes[0].get_yticklabels()][:2]
    ['e2m1', 'e4m3']
    """
    fig = _figure(9, 0.55 * len(formats) + 1.2)
    ax = fig.subplots()
    for row, name in enumerate(formats):
        values = format_values(name).tolist()
        ax.plot(values, [row] * len(values), "|", color=f"C{row}", markersize=12)
        if cursor is not None:
            landed = round_trip(cursor, name)
            shown = min(max(landed, _XLIM[0]), _XLIM[1] / 1.5) if not math.isnan(landed) else _XLIM[1] / 1.5
            ax.plot([shown], [row], "o", color="k", markersize=6)
            ax.annotate(f"{landed:g}", (shown, row), textcoords="offset points", xytext=(6, 6), fontsize=8)
    if cursor is not None and math.isfinite(cursor) and cursor > 0:
        ax.axvline(cursor, color="k", linestyle="--", linewidth=1)
    ax.set_title("every value of each format (fp16, bf16: sampled; bf16 goes on to 2^-133 and 2^128)"
                 + (f"; cursor {cursor:g}" if cursor is not None else ""), fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xlim(*_XLIM)
    ax.set_yticks(range(len(formats)), list(formats))
    ax.set_ylim(-0.7, len(formats) - 0.3)
    ax.set_xlabel("positive value (log2 axis)")
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.2, top=0.88)
    return fig


def stagnation_figure(
    runs: Mapping[str, RemedyRun], stale_by_layer: Mapping[str, Mapping[str, float]], entry: int = 0
) -> Figure:
    """Draw one weight's trajectory per remedy, the losses, and each layer's share of stale updates per run.

    ``stale_by_layer`` is ``{run: {layer: fraction}}`` (e.g. the mean of ``StepRecord.stale``).
    Runs whose losses coincide on screen (within 1 % of the panel's range, about 2 pixels, at
    every step) are drawn with distinct dashes and named together in the loss panel's title,
    so no curve hides under another unannounced.

    >>> from labkit.formats.bf16 import compare_remedies
    >>> fig = stagnation_figure(compare_remedies(steps=300), {"bf16": {"0.weight": 0.9}})
    >>> fig.axes[1].get_title()
    'loss\\n(fp32, bf16 + Kahan and bf16 + fp32 master coincide)'
    """
    fig = _figure(11, 3.8)
    ax_w, ax_loss, ax_bar = fig.subplots(1, 3)
    styles = ["-", (0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (2, 3))]
    for i, (name, run) in enumerate(runs.items()):
        style = {"linestyle": styles[i % len(styles)], "lw": 1.6}
        ax_w.plot([w[entry] for w in run.weights], label=name, color=f"C{i}", **style)
        ax_loss.plot(run.losses, label=name, color=f"C{i}", **style)
    names = list(runs)
    every = [v for run in runs.values() for v in run.losses]
    tol = 0.01 * (max(every) - min(every)) if every else 0.0
    same = [n for n in names if n != names[0] and _coincide(runs[n].losses, runs[names[0]].losses, tol)]
    together = [names[0], *same]
    note = f"\n({', '.join(together[:-1])} and {together[-1]} coincide)" if same else ""
    ax_w.set_xlabel("step"); ax_w.set_ylabel(f"weight[{entry}]")
    ax_w.set_title("one weight: bf16 never moves", fontsize=10)
    ax_loss.set_xlabel("step"); ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss" + note, fontsize=9)
    fig.legend(
        *ax_loss.get_legend_handles_labels(), loc="lower center", ncols=len(runs), fontsize=9, frameon=False
    )
    layers = sorted({layer for fractions in stale_by_layer.values() for layer in fractions})
    width = 0.8 / max(1, len(stale_by_layer))
    for i, (name, fractions) in enumerate(stale_by_layer.items()):
        ax_bar.bar([j + i * width for j in range(len(layers))],
                   [fractions.get(layer, 0.0) for layer in layers], width=width, label=name)
    ax_bar.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))], layers, rotation=45, fontsize=8)
    ax_bar.set_ylim(0, 1.45)
    ax_bar.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax_bar.set_ylabel("updates below half an ulp")
    ax_bar.set_title("per layer, mean over steps", fontsize=10); ax_bar.legend(fontsize=8, loc="upper left")
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.3, top=0.86, wspace=0.3)
    return fig


def _coincide(a: Sequence[float], b: Sequence[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def granularity_rows(x: torch.Tensor, outlier_channel: int | None = None, fmt: str = "e4m3") -> list[dict]:
    """Quantize ``x`` per tensor, row, 1x128 tile and MX block: % flushed, % saturated, other channels' error.

    >>> rows = granularity_rows(torch.ones(2, 128)); [r["granularity"] for r in rows], rows[0]["flushed"]
    (['tensor', 'row', 'tile128', 'mx32'], 0.0)
    """
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    if outlier_channel is not None:
        keep[outlier_channel] = False
    rows = []
    for granularity in GRANULARITY_LABELS:
        q = quantize(x, fmt, granularity)
        err = (q.dequantize() - x)[:, keep].norm() / x[:, keep].norm().clamp(min=1e-30)
        rows.append({"granularity": granularity, "flushed": q.flushed, "saturated": q.saturated,
                     "rel_err": err.item()})
    return rows


class GranularityExplorer:
    """An activation matrix with one outlier channel, a size slider, and what each scale choice does to it.

    ``set_outlier(v)`` (or the slider) recomputes with real casts: a heatmap of log10 |x| (with
    its colour bar) and bars of the % flushed to zero and the error on the other channels, per
    tensor/row/1x128 tile/MX. The bars' axes grow with the values, so no bar is cut off.
    """

    def __init__(
        self, rows: int = 128, cols: int = 512, channel: int = 7, outlier: float = 1e4, seed: int = 0
    ) -> None:
        import ipywidgets as W

        g = torch.Generator().manual_seed(seed)
        self.base, self.channel = torch.randn(rows, cols, generator=g), channel
        self.figure = _figure(10.5, 3.3)
        self.ax_map, self.ax_flush, self.ax_err = self.figure.subplots(1, 3)
        self.figure.subplots_adjust(left=0.05, right=0.98, bottom=0.25, top=0.86, wspace=0.45)
        self._colorbar = None
        self.slider = W.FloatLogSlider(value=outlier, base=10, min=0, max=6, step=0.25,
                                       description="outlier x", continuous_update=False)
        self.image = W.Image(format="png")
        self.slider.observe(lambda change: self.set_outlier(change["new"]), names="value")
        self.widget = W.VBox([self.slider, self.image])
        self.rows: list[dict] = []
        self.outlier = outlier  # the size the figure was last drawn for
        self.set_outlier(outlier)

    def matrix(self, outlier: float) -> torch.Tensor:
        x = self.base.clone()
        x[:, self.channel] *= outlier
        return x

    def set_outlier(self, outlier: float) -> None:
        """Recompute and redraw for an outlier channel ``outlier`` times larger than the rest."""
        x = self.matrix(outlier)
        self.rows = granularity_rows(x, self.channel)
        labels = [GRANULARITY_LABELS[r["granularity"]] for r in self.rows]
        for ax in (self.ax_map, self.ax_flush, self.ax_err):
            ax.clear()
        image = self.ax_map.imshow(torch.log10(x.abs().clamp(min=1e-3))[:, :64].numpy(), aspect="auto",
                                   cmap="viridis")
        if self._colorbar is None:
            self._colorbar = self.figure.colorbar(image, ax=self.ax_map, label="log10 |x|")
        else:
            self._colorbar.update_normal(image)
            image.colorbar = self._colorbar  # update_normal rebinds the bar but not the image's link to it
        self.ax_map.set_title(f"first 64 columns (outlier: column {self.channel})", fontsize=8)
        flushed = [100 * r["flushed"] for r in self.rows]
        errors = [r["rel_err"] for r in self.rows]
        self.ax_flush.bar(labels, flushed, color="C3")
        self.ax_flush.set_ylabel("% of values flushed to 0")
        self.ax_flush.set_ylim(0, max(60.0, 1.1 * max(flushed)))
        self.ax_err.bar(labels, errors, color="C0")
        self.ax_err.set_ylabel("rel. error, other channels")
        self.ax_err.set_ylim(0, max(0.5, 1.1 * max(errors)))
        for ax in (self.ax_flush, self.ax_err):
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        self.figure.suptitle(f"e4m3, outlier x{outlier:g}: " + ", ".join(
            f"{label} {100 * r['flushed']:.2f}%" for label, r in zip(labels, self.rows))
            + " flushed", fontsize=9)
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=72)
        self.image.value = buf.getvalue()
        self.outlier = outlier

    def figure_mismatches(self) -> list[str]:
        """Return ``[]`` when the figure shows the slider's outlier size, else what each says."""
        if self.slider.value == self.outlier:
            return []
        return [f"outlier: the slider says x{self.slider.value:g}, the figure shows x{self.outlier:g}"]

    def _repr_mimebundle_(self, **kwargs):  # type: ignore[no-untyped-def]
        return self.widget._repr_mimebundle_(**kwargs)


def scaling_figure(runs: Mapping[str, Sequence[CastRecord]], fault_step: int | None = None) -> Figure:
    """Draw each step's amax and the amax its scale was made for, and the % saturated, per scaling recipe."""
    fig = _figure(10, 3.2)
    ax_amax, ax_sat = fig.subplots(1, 2)
    for i, (name, records) in enumerate(runs.items()):
        steps = [r.step for r in records]
        if i == 0:
            ax_amax.plot(steps, [r.amax for r in records], "k.-", label="amax of the tensor")
        ax_amax.step(
            steps, [r.scale_amax for r in records], where="mid", color=f"C{i}", label=f"{name}: scale's amax"
        )
        ax_sat.bar([s + 0.4 * i - 0.2 for s in steps], [100 * r.saturated for r in records], width=0.4,
                   color=f"C{i}", label=name)
    for ax in (ax_amax, ax_sat):
        ax.set_xlabel("step")
        if fault_step is not None:
            ax.axvline(fault_step, color="C3", linestyle=":", linewidth=1)
    ax_amax.set_yscale("log"); ax_amax.set_ylabel("amax"); ax_amax.legend(fontsize=7)
    ax_amax.set_title("amax and the amax history's max (delayed)", fontsize=9)
    ax_sat.set_ylabel("% of values saturated (clamped to 448)")
    ax_sat.set_ylim(0, 100)
    ax_sat.legend(fontsize=7)
    ax_sat.set_title("what the cast did: no NaN, no inf, no skip", fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.16, top=0.9, wspace=0.25)
    return fig
