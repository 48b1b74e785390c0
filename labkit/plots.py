"""Figures of a run: gradient norm (pre- and post-clip), loss, and loss scale."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from .records import StepLog

__all__ = ["plot_log"]


def _finite(xs: list[int], ys: list[float]) -> tuple[list[int], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y) and y > 0]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_log(log: StepLog, max_norm: float | None = None, title: str | None = None) -> Figure:
    """Return a 3-panel figure of a finished run (no pyplot, so it works without a display).

    >>> from labkit.records import StepRecord
    >>> fig = plot_log(StepLog([StepRecord(0, 1.0, grad_norm=2.0, clip_coef=0.5, clipped=True)]), max_norm=1.0)
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['grad norm', 'loss', 'loss scale']
    """
    fig = Figure(figsize=(9, 7), layout="constrained")
    ax_norm, ax_loss, ax_scale = fig.subplots(3, 1, sharex=True)
    steps = log.column("step")
    skipped = [r for r in log if r.skipped]

    ax_norm.plot(*_finite(steps, log.column("grad_norm")), label="pre-clip (logged)", lw=1)
    ax_norm.plot(*_finite(steps, log.column("post_clip_norm")), label="post-clip (stepped)", lw=1)
    if max_norm is not None:
        ax_norm.axhline(max_norm, color="k", ls="--", lw=0.8, label=f"max_norm = {max_norm:g}")
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("grad norm")

    ax_loss.plot(*_finite(steps, log.column("loss")), lw=1, color="C2")
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")

    ax_scale.step(steps, log.column("scale"), where="post", lw=1, color="C4", label="scale")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")

    for ax in (ax_norm, ax_loss, ax_scale):
        for i, r in enumerate(skipped):
            ax.axvline(r.step, color="C3", alpha=0.35, lw=1, label="skipped step" if i == 0 and ax is not ax_loss else None)
    ax_norm.legend(loc="upper right", fontsize=8)
    ax_scale.legend(loc="lower right", fontsize=8)
    summary = log.summary()
    fig.suptitle(title or f"{summary['steps']} steps, {summary['skipped']} skipped, {summary['clipped']} clipped")
    return fig
