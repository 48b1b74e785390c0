"""The sweep's figures: Wortsman et al.'s Fig. 1 (final loss against lr, per variant) and each run by step.

``plot_sweep`` draws the grid's points (and, given their logs, one lr's runs by step);
``plot_runs`` draws runs' measurements by step. A value that is not finite (an fp16 overflow)
is marked on the panel's top edge, never dropped silently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...names import FP16_MAX
from .analysis import by_variant, peak, summarize
from .recipe import VARIANTS, Point

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ...steplog import StepLog

__all__ = ["plot_runs", "plot_sweep"]


def _figure(fig: Figure | None, size: tuple[float, float]) -> Figure:
    if fig is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=size)
        FigureCanvasAgg(fig)
    fig.clear()
    return fig


def _color(variant: str, i: int) -> str:
    return f"C{list(VARIANTS).index(variant)}" if variant in VARIANTS else f"C{len(VARIANTS) + i}"


def _mark_nonfinite(ax: Any, xs: Sequence[float], ys: Sequence[float], color: str) -> None:
    """Mark each non-finite value (an overflow) with a triangle on the panel's top edge.

    A line through ``inf`` or NaN just stops, as if it left the axis: the marker says where and why.
    """
    from matplotlib.transforms import blended_transform_factory

    bad = [x for x, y in zip(xs, ys) if not math.isfinite(y)]
    if bad:
        top = blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot(bad, [0.97] * len(bad), "^", color=color, ms=7, transform=top, clip_on=False,
                label="not finite (overflow)")


def _overflow_line(ax: Any, overflow_at: float | None) -> None:
    if overflow_at is not None:
        label = "fp16 max 65504" if overflow_at == FP16_MAX else "q.k reaches fp16's 65504"
        ax.axhline(overflow_at, color="C3", ls="--", lw=1, label=label)


_RUN_PANELS = {  # name: (what a record gives, y-label, title, log y)
    "logit": (lambda r: peak(r.attn_logit_max.values()), "largest attention logit",
              "attention logit (any layer)", True),
    "entropy": (lambda r: min(r.attn_entropy.values(), default=math.nan), "entropy (nats)",
                "most peaked head's attention entropy", False),
    "loss": (lambda r: r.loss, "training loss", "loss", False),
    "ce_loss": (lambda r: r.ce_loss if r.ce_loss is not None else r.loss, "cross-entropy",
                "training cross-entropy (no z-loss term)", False),
    "log_z": (lambda r: r.log_z if r.log_z is not None else math.nan, "mean log Z", "output logits' log Z",
              False),
}


def plot_runs(logs: Mapping[str, StepLog], panels: Sequence[str] = ("logit", "entropy", "loss"), *,
              overflow_at: float | None = FP16_MAX, title: str = "", fig: Figure | None = None) -> Figure:
    """Draw each run's measurements by step, one panel for each of ``panels``.

    The panels: ``"logit"`` (largest attention logit), ``"entropy"`` (most peaked head's),
    ``"loss"``, ``"ce_loss"`` (the loss without its z-loss term) and ``"log_z"``.

    ``overflow_at`` marks on the logit panel where the logits overflow fp16 (``Recipe.fp16_logit_limit``).
    """
    unknown = [p for p in panels if p not in _RUN_PANELS]
    if unknown or not panels:
        raise ValueError(f"panels must be some of {list(_RUN_PANELS)}, got {list(panels)}.")
    fig = _figure(fig, (4.2 * len(panels), 3.4))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        value, ylabel, name, log_y = _RUN_PANELS[panel]
        for i, (run, log) in enumerate(logs.items()):
            ys, steps = [value(r) for r in log], [r.step for r in log]
            width = 0.8 if panel == "loss" else 1.2
            ax.plot(steps, [y if math.isfinite(y) else math.nan for y in ys], color=_color(run, i), lw=width,
                    label=run)
            _mark_nonfinite(ax, steps, ys, _color(run, i))
        if panel == "logit":
            _overflow_line(ax, overflow_at)
        ax.set(xlabel="step", ylabel=ylabel, title=name, yscale="log" if log_y else "linear")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_sweep(points: Sequence[Point], traces: Mapping[str, StepLog] | None = None, *,
               trace_lr: float | None = None, highlight: tuple[str, float] | None = None,
               overflow_at: float | None = FP16_MAX, fig: Figure | None = None) -> Figure:
    """Draw the paper's Fig. 1 (final loss against lr, per variant) and the largest attention logit by lr.

    With ``traces`` ({variant: log} of one lr, ``trace_lr``) a third panel draws each one's
    largest attention logit against the step. ``highlight=(variant, lr)`` rings one point;
    ``overflow_at`` marks where the logits overflow fp16 (``Recipe.fp16_logit_limit``).
    """
    panels = 3 if traces else 2
    fig = _figure(fig, (4.2 * panels, 3.6))
    axes = fig.subplots(1, panels)
    loss_ax, logit_ax = axes[0], axes[1]
    summary = summarize(points)
    init = [p.init_loss for p in points]
    for i, (variant, by_lr) in enumerate(by_variant(points).items()):
        color = _color(variant, i)
        lrs = sorted(by_lr)
        loss = [sum(p.final_loss for p in by_lr[lr]) / len(by_lr[lr]) for lr in lrs]
        logit = [max(p.attn_logit_max for p in by_lr[lr]) for lr in lrs]
        # LR sensitivity needs a curve: of one lr it is 0 by definition, not a finding
        label = (f"{variant} (LR sensitivity {summary[variant]['sensitivity']:.2f})" if len(lrs) > 1
                 else f"{variant} (one lr: no LR sensitivity)")
        loss_ax.plot(lrs, loss, "o-", color=color, label=label)
        finite = [v if math.isfinite(v) else math.nan for v in logit]
        logit_ax.plot(lrs, finite, "o-", color=color, label=variant)
        _mark_nonfinite(logit_ax, lrs, logit, color)
        if highlight is not None and highlight[0] == variant and highlight[1] in by_lr:
            lr = highlight[1]
            y = sum(p.final_loss for p in by_lr[lr]) / len(by_lr[lr])
            loss_ax.plot([lr], [y], "o", ms=14, mfc="none", mec="k", mew=1.5)
    if init:
        loss_ax.axhline(min(init), color="0.5", ls=":", lw=1, label="loss at initialisation")
    loss_ax.set(xscale="log", xlabel="learning rate", ylabel="final validation loss",
                title="final loss vs learning rate")
    loss_ax.legend(fontsize=7)
    _overflow_line(logit_ax, overflow_at)
    logit_ax.set(xscale="log", yscale="log", xlabel="learning rate", ylabel="largest attention logit",
                 title="attention logit growth")
    logit_ax.legend(fontsize=7)
    if traces:
        ax = axes[2]
        for i, (variant, log) in enumerate(traces.items()):
            color = _color(variant, i)
            values = [peak(r.attn_logit_max.values()) for r in log]
            steps = [r.step for r in log]
            ax.plot(steps, [v if math.isfinite(v) else math.nan for v in values], color=color, label=variant)
            _mark_nonfinite(ax, steps, values, color)
        _overflow_line(ax, overflow_at)
        ax.set(yscale="log", xlabel="step", ylabel="largest attention logit",
               title=f"lr {trace_lr:g}: attention logit by step" if trace_lr is not None else "by step")
        ax.legend(fontsize=7)
    # fixed margins, not a layout engine: tight_layout draws the figure once more on every redraw
    width = fig.get_figwidth()  # margins in inches: room for the y-labels, whatever the panel count
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.1 / width, bottom=0.14, top=0.9, wspace=0.3)
    return fig
