"""The pictures of a probed run: the U-curve, the layers x steps heatmap, headroom, zeros and sawtooth.

``plot_u_curve`` (flushed and overflowing fractions against log2 of the scale),
``plot_headroom`` (each step's largest |gradient| x scale against fp16's 65504, the overflows and
the tensor each started in), ``plot_flushed_by_tensor`` (how zeros compound from the loss down),
``plot_layer_heatmap`` (log10 gradient norm per layer and step) and ``plot_sawtooth`` (the loss
scale by step). Each returns a new ``Figure``, drawn with Agg.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib
import torch
from matplotlib.figure import Figure
from torch import Tensor

from ...names import FP16_MAX
from ...steplog import StepLog
from .probe import GradientProbe
from .ranges import flush_fractions, u_curve

__all__ = ["plot_flushed_by_tensor", "plot_headroom", "plot_layer_heatmap", "plot_sawtooth", "plot_u_curve"]


def plot_u_curve(values: Tensor, log2_scales: Sequence[int] = range(-8, 41), trajectory: Sequence[float] = (),
                 backoffs: Sequence[float] = ()) -> Figure:
    """Return the U-curve: the fraction fp16 flushes to 0 and to inf against log2 of the loss scale.

    ``trajectory`` (the scales a run used, e.g. ``log.column("scale")``) is drawn on the curve,
    darker for later steps; ``backoffs`` (the scales that overflowed) as red crosses.

    >>> fig = plot_u_curve(torch.tensor([2.0**-30, 1.0]), trajectory=[2.0**10, 2.0**11])
    >>> [line.get_label() for line in fig.axes[0].get_lines()][:2]
    ['flushed to 0', 'overflow (inf)']
    """
    fig = Figure(figsize=(7, 3.4), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    xs = list(log2_scales)
    under, over = u_curve(values, xs)
    ax.plot(xs, under, color="C0", label="flushed to 0")
    ax.plot(xs, over, color="C3", label="overflow (inf)")
    ax.plot(xs, [u + o for u, o in zip(under, over)], color="k", lw=0.8, ls=":", label="lost")
    if len(trajectory):
        t = [math.log2(s) for s in trajectory]
        lost = [sum(flush_fractions(values, s)) for s in t]
        ax.scatter(t, lost, c=range(len(t)), cmap="viridis", s=14, zorder=3, label="dynamic scaler's steps")
    if len(backoffs):
        b = [math.log2(s) for s in backoffs]
        ax.scatter(b, [sum(flush_fractions(values, s)) for s in b], marker="x", color="C3", s=40, zorder=4,
                   label="backoff (overflowed)")
    ax.set_xlabel("log2(loss scale)")
    ax.set_ylabel("fraction of gradient entries")
    ax.legend(fontsize=7, loc="upper center")
    return fig


def plot_layer_heatmap(probes: GradientProbe | Mapping[str, GradientProbe], title: str = "",
                       steps: int | None = None) -> Figure:
    """Return the layers x steps heatmap of log10 gradient norm (unscaled, before clipping).

    ``probes`` is one probe or ``{run: probe}``: several runs are stacked on one colour range
    with one colour bar, so the same colour means the same norm in each. ``steps`` (the runs'
    length) draws every step; a cell without a finite norm (inf or NaN: an entry was, or the sum
    of squares overflowed; or backward did not run) is grey, and a note on the panel says so and
    from which step.

    >>> p = GradientProbe.holding([0, 1], layer_norms={"a": [1.0, 10.0], "b": [0.1, 0.1]})
    >>> plot_layer_heatmap(p).axes[0].get_yticklabels()[1].get_text()
    'b'
    """
    runs = {"": probes} if isinstance(probes, GradientProbe) else dict(probes)
    if not runs:
        raise ValueError("probes must hold at least one run: a GradientProbe or {'name': probe}.")
    grids = {}
    for name, probe in runs.items():
        layers, done, z = probe.heatmap()
        n = max([steps or 0, *(s + 1 for s in done)])
        grid = torch.full((len(layers), n), math.nan, dtype=torch.float64)
        for j, s in enumerate(done):
            grid[:, s] = z[:, j]
        grid[~torch.isfinite(grid)] = math.nan
        grids[name] = (layers, grid)
    finite = torch.cat([g[torch.isfinite(g)] for _, g in grids.values()])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    rows = sum(len(layers) for layers, _ in grids.values())
    fig = Figure(figsize=(8, 0.25 * rows + 1.1 * len(grids) + 0.4), layout="constrained")
    _agg(fig)
    axes = fig.subplots(len(grids), 1, sharex=True, squeeze=False,
                        height_ratios=[len(layers) for layers, _ in grids.values()])[:, 0]
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="0.85")
    for ax, (name, (layers, grid)) in zip(axes, grids.items()):
        n = grid.shape[1]
        im = ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", cmap=cmap, vmin=lo, vmax=hi,
                       extent=(-0.5, n - 0.5, len(layers) - 0.5, -0.5))
        # torch names the root module "" (named_modules): a root parameter's row gets a visible label
        ax.set_yticks(range(len(layers)), [m or "(root)" for m in layers], fontsize=7)
        if name:
            ax.set_title(name, fontsize=9, loc="left")
        grey = (~torch.isfinite(grid)).any(dim=0).nonzero().flatten().tolist()
        if grey:  # said on the panel: a grey cell is not a small norm
            ax.text(0.995, 0.98, f"grey: norm not finite (inf/NaN) or no backward, first at step {grey[0]}",
                    transform=ax.transAxes, ha="right", va="top", fontsize=7, color="0.15",
                    bbox={"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 1.5})
    axes[-1].set_xlabel("step")
    bar = fig.colorbar(im, ax=list(axes), label="log10 grad norm")
    for ax in axes:  # one bar for every panel: they share the colour range
        ax.images[0].colorbar = bar
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def plot_headroom(probe: GradientProbe, title: str = "") -> Figure:
    """Return each step's largest |gradient| x scale (as fp16 held it) against 65504, overflows named.

    From ``probe.trace`` of an fp16 run with a scaler: per step, the largest weight gradient and
    activation gradient of the ``nn.Linear`` layers (the ones autocast computes in fp16) times
    that step's loss scale, on a log2 axis, against fp16's largest value. A step whose backward
    overflowed gets a mark at the top, coloured by the gradient the inf first appeared in
    (backward order). Below 65504 by less than 2x, the next doubling of the scale overflows.
    A weight tied to an fp32 op (GPT's head and embedding) counts by its Linear use's share.

    >>> from labkit.lab.gradients import GradStat
    >>> w, inf = GradStat("w", "weight", 0.5, 0.0), GradStat("w", "weight", math.inf, 0.0)
    >>> p = GradientProbe.holding([0, 1], loss_scale=[2.0**16, 2.0**17], trace=[[w], [inf]])
    >>> ax = plot_headroom(p).axes[0]; [t.get_text() for t in ax.get_legend().get_texts()]
    ['weight gradients', 'fp16 max 65504', 'overflow: inf first in w (1)']
    """
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    steps, scales, trace = probe.steps, probe.loss_scale, probe.trace
    overflowed = [name is not None for name in probe.first_nonfinite]
    for kind, color in (("weight", "C3"), ("activation", "k")):
        ys = []  # an overflowed step has no largest value to draw: its mark goes on top instead
        for stats, s, bad in zip(trace, scales, overflowed):
            held = [g.amax * s for g in stats if g.kind == kind and g.linear]
            ys.append(max(held) if held and not bad and max(held) > 0 else math.nan)
        if any(math.isfinite(y) for y in ys):
            ax.plot(steps, ys, color=color, lw=1.0, marker=".", ms=3, label=f"{kind} gradients")
    ax.axhline(FP16_MAX, color="C0", lw=1.0, ls="--", label="fp16 max 65504")
    culprits: dict[str, list[int]] = {}
    for step, name in zip(steps, probe.first_nonfinite):
        if name is not None:
            culprits.setdefault(name, []).append(step)
    top = 2.0 * FP16_MAX
    for i, (name, at) in enumerate(culprits.items()):
        ax.plot(at, [top] * len(at), "v", color=f"C{(i + 4) % 10}", ms=7, ls="none",
                label=f"overflow: inf first in {name} ({len(at)})")
    ax.set_yscale("log", base=2)
    lo = min([y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y) and y > 0],
             default=1.0)
    ax.set_ylim(lo / 2, top * 2)
    ax.set_xlabel("step")
    ax.set_ylabel("max |gradient| x scale")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2)  # below: off the data
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def plot_flushed_by_tensor(probes: Mapping[str, GradientProbe], title: str = "") -> Figure:
    """Return each activation gradient's share of exact zeros (mean over steps), in backward order, per run.

    The rows run from the loss (top) to the input (bottom), in the order backward produced
    them: a gradient that flushed to 0 makes every gradient computed from it 0 as well, so in
    fp16 without a scaler the zeros pile up towards the input.

    >>> from labkit.lab.gradients import GradStat
    >>> p = GradientProbe.holding([0], trace=[[GradStat("head (output)", "activation", 1.0, 0.1),
    ...                                        GradStat("w", "weight", 1.0, 0.0)]])
    >>> [t.get_text() for t in plot_flushed_by_tensor({"run": p}).axes[0].get_yticklabels()]
    ['head (output)']
    """
    if not probes:
        raise ValueError("probes must hold at least one run: {'name': GradientProbe}.")
    first = next(iter(probes.values())).trace
    names = [g.name for g in first[-1] if g.kind == "activation"] if first else []
    fig = Figure(figsize=(8, 0.22 * len(names) + 1.2), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    height = 0.8 / len(probes)
    for i, (run, probe) in enumerate(probes.items()):
        sums: dict[str, list[float]] = {}
        for stats in probe.trace:
            for g in stats:
                sums.setdefault(g.name, []).append(g.zero_fraction)
        means = [sum(sums.get(n, [math.nan])) / len(sums.get(n, [math.nan])) for n in names]
        # bars of ~0 length: named anyway
        overall = sum(probe.zero_fraction) / max(1, len(probe.zero_fraction))
        ax.barh([j + i * height for j in range(len(names))], means, height=height, color=f"C{i}",
                label=f"{run} ({overall:.1%} of all entries)")
    ax.set_yticks([j + (len(probes) - 1) * height / 2 for j in range(len(names))], names, fontsize=7)
    ax.set_ylim(len(names) - 1 + (len(probes) - 0.5) * height + 0.1, -height / 2 - 0.1)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of entries exactly 0 (mean over steps)")
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def plot_sawtooth(log: StepLog, title: str = "") -> Figure:
    """Return the loss scale against step (log2 axis) with each backoff marked.

    >>> from labkit.records import StepRecord
    >>> log = StepLog([StepRecord(0, 1.0, scale=4.0, next_scale=8.0),
    ...                StepRecord(1, 1.0, scale=8.0, next_scale=4.0, skipped=True, reason="nonfinite_grad")])
    >>> fig = plot_sawtooth(log); fig.axes[0].get_lines()[1].get_xdata().tolist()
    [1]
    """
    fig = Figure(figsize=(8, 2.8), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    steps, scales = log.column("step"), log.column("scale")
    ax.plot(steps, scales, drawstyle="steps-post", color="C4", lw=1.2, label="loss scale")
    back = [r for r in log if r.next_scale < r.scale]
    ax.plot([r.step for r in back], [r.scale for r in back], "v", color="C3", ms=6, ls="none",
            label=f"backoff: gradient overflowed ({len(back)})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def _agg(fig: Figure) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
