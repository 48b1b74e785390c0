"""Spike defenses in the lab: which defense a run uses, and the figures that compare them.

``Defenses`` is what the notebook's sliders set (method, threshold or z, window, feed
policy, spike size, shift size, skip and rewind); ``ExperimentConfig(defenses=...)`` runs it
through ``run_experiment`` on the toy task. The spike is in the *data* (batch
``spike_step``'s inputs times ``spike_size``), so a rewind that skips that batch really
never sees it again; the level shift multiplies the loss by ``shift_size`` from step
``shift_step`` on (a batch-size ramp or data-mix switch has the same effect on the norm).

Figures: ``plot_defenses`` draws, per run, the gradient norm with the clipper's threshold,
the detector's band (mean +- z sigma over the rolling window), clipped steps marked and
rewound steps as a grey branch, above a skip ledger: one strip per run, one cell per
record, coloured by outcome (``ledger``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch import Tensor

from ..clippers import AGC, AdaGC, AutoClip, Clipper, NormClip, UpdateNormClip, ZClip
from ..reasons import Reason
from ..records import StepLog, StepRecord
from ..rewind import Rewind
from ..spikes import SpikeDetector

__all__ = ["METHODS", "OUTCOMES", "Defenses", "ledger", "loss_fn_with_shift", "plot_defenses", "rolling_band"]

METHODS = ("norm", "zclip", "autoclip", "adagc", "agc", "update", "none")
OUTCOMES = ("stepped", "clipped", "skip: loss not finite", "skip: overflow", "skip: z-score spike", "rewound")
_COLORS = ("#d9d9d9", "#4c72b0", "#c44e52", "#dd8452", "#8172b3", "#555555")


@dataclass(frozen=True)
class Defenses:
    """One defense setting: the clip method and its knob, the detector, rewind, and what to inject.

    ``threshold`` is the method's one knob: ``max_norm`` (norm), ``z_thresh`` (zclip),
    ``quantile`` (autoclip), ``lambda_rel`` (adagc), ``clipping`` (agc), ``k`` (update).
    ``window`` is ZClip's warm-up, AutoClip's history, UpdateNormClip's and the detector's
    window. ``feed=None`` keeps each method's published policy.

    >>> Defenses(method="zclip", threshold=2.5).clipper()
    ZClip(alpha=0.97, z_thresh=2.5, warmup=25, feed='clipped')
    """

    method: str = "norm"
    threshold: float = 1.0
    window: int = 25
    feed: str | None = None
    max_consecutive_clips: int | None = 50
    skip_z: float | None = None
    rewind_back: int | None = None
    rewind_skip: int = 20
    spike_step: int | None = None
    spike_size: float = 100.0
    shift_step: int | None = None
    shift_size: float = 2.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}.")
        if self.rewind_back is not None and self.skip_z is None:
            raise ValueError("rewind_back needs skip_z: a rewind is triggered by a step the detector skipped.")
        self.clipper()  # validates threshold, window, feed

    def clipper(self) -> Clipper | None:
        """Return the clipper this setting names (None for ``"none"``)."""
        feed = {} if self.feed is None else {"feed": self.feed}
        guard = {"max_consecutive_clips": self.max_consecutive_clips}
        t, w = self.threshold, self.window
        return {
            "norm": lambda: NormClip(t),
            "zclip": lambda: ZClip(z_thresh=t, warmup=w, **feed, **guard),
            "autoclip": lambda: AutoClip(quantile=t, history=w, **feed, **guard),
            "adagc": lambda: AdaGC(lambda_rel=t, warmup=w, **feed, **guard),
            "agc": lambda: AGC(clipping=t),
            "update": lambda: UpdateNormClip(window=max(w, 2), k=t, **feed, **guard),
            "none": lambda: None,
        }[self.method]()

    def detector(self) -> SpikeDetector:
        """Return the detector: always there, so every record has ``z_loss``/``z_grad``."""
        return SpikeDetector(window=max(self.window, 2), skip_z=self.skip_z)

    def rewind(self) -> Rewind | None:
        return None if self.rewind_back is None else Rewind(back=self.rewind_back, skip=self.rewind_skip)

    def corrupt(self, index: int, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Return batch ``index``, its inputs times ``spike_size`` if it is the spiky one."""
        x, y = batch
        return (x * self.spike_size, y) if index == self.spike_step else (x, y)

    def loss_weight(self, step: int) -> float:
        """Return the loss multiplier at ``step``: ``shift_size`` from ``shift_step`` on."""
        return self.shift_size if self.shift_step is not None and step >= self.shift_step else 1.0


def ledger(log: Sequence[StepRecord]) -> list[str]:
    """Return each record's outcome, one of ``OUTCOMES`` (the step that triggered a rewind shows why).

    >>> ledger([StepRecord(0, 1.0), StepRecord(1, 1.0, skipped=True, reason="spike_grad", rewound=True)])
    ['stepped', 'rewound']
    """
    out = []
    for r in log:
        if r.rewound and r.rewind_to is None:  # the step that triggered the rewind keeps its own outcome
            out.append("rewound")
        elif r.skipped:
            out.append({Reason.NONFINITE_LOSS: OUTCOMES[2], Reason.NONFINITE_GRAD: OUTCOMES[3]}.get(r.reason or "",
                                                                                            OUTCOMES[4]))
        else:
            out.append("clipped" if r.clipped else "stepped")
    return out


def rolling_band(log: Sequence[StepRecord], window: int, z: float) -> tuple[list[float], list[float]]:
    """Return the detector's band ``mean -+ z * std`` of the admitted norms before each record.

    The same rule as ``SpikeDetector`` (rewound and skipped steps leave the window as it was
    when they ran; NaN until ``window // 2`` values are in), recomputed from the records.
    """
    seen: deque[float] = deque(maxlen=window)
    lows, highs = [], []
    for r in log:
        if len(seen) >= max(window // 2, 1):
            mean = math.fsum(seen) / len(seen)
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in seen) / len(seen))
            lows.append(mean - z * std)
            highs.append(mean + z * std)
        else:
            lows.append(math.nan)
            highs.append(math.nan)
        if not r.skipped and not r.rewound and math.isfinite(r.grad_norm):
            seen.append(r.grad_norm)
    return lows, highs


def plot_defenses(logs: Mapping[str, StepLog], *, window: int = 25, z: float = 3.0,
                  title: str | None = None) -> Figure:
    """Draw each run's norm with its threshold, z band, clips and rewound branch, over a skip ledger.

    >>> fig = plot_defenses({"run": StepLog([StepRecord(0, 1.0, grad_norm=2.0, threshold=3.0)])})
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['grad norm', 'outcome']
    """
    if not logs:
        raise ValueError("logs must hold at least one run: {'name': StepLog}.")
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[4, 1])
    for i, (name, log) in enumerate(logs.items()):
        color = f"C{i}"
        live = [r for r in log if not r.rewound]
        gone = [r for r in log if r.rewound]
        top.plot([r.step for r in live], [r.grad_norm for r in live], color=color, lw=1.0, label=name)
        top.plot([r.step for r in live], [r.threshold for r in live], color=color, lw=0.8, ls="--")
        lows, highs = rolling_band(live, window, z)
        # a log axis cannot show mean - z sigma <= 0: the band then starts at half the smallest norm
        floor = 0.5 * min((r.grad_norm for r in live if r.grad_norm > 0), default=1e-12)
        top.fill_between([r.step for r in live], [max(v, floor) for v in lows], highs, color=color, alpha=0.12, lw=0)
        clipped = [r for r in live if r.clipped]
        top.plot([r.step for r in clipped], [r.grad_norm for r in clipped], "x", color=color, ms=5)
        if gone:
            top.plot([r.step for r in gone], [r.grad_norm for r in gone], color="0.6", lw=1.0, ls="-", marker=".", ms=3)
    top.set_yscale("log")
    top.set_ylabel("grad norm")
    handles, _ = top.get_legend_handles_labels()
    handles += [top.plot([], [], "k--", lw=0.8)[0], Patch(color="0.5", alpha=0.25), top.plot([], [], "kx")[0],
                top.plot([], [], color="0.6", marker=".")[0]]
    labels = [*logs, "threshold", f"mean +- {z:g} sigma", "clipped", "rewound (undone)"]
    top.legend(handles, labels, fontsize=7, ncols=2, loc="upper right")
    for k, log in enumerate(logs.values()):
        # rewound records share step numbers with their replacements: they fill the top half of the row
        for r, outcome in zip(log, ledger(log)):
            color = _COLORS[OUTCOMES.index(outcome)]
            bottom.add_patch(Rectangle((r.step - 0.5, k), 1.0, 0.5 if r.rewound else 1.0, color=color, lw=0,
                                       zorder=2 if r.rewound else 1))
    last = max((r.step for log in logs.values() for r in log), default=0)
    bottom.set_ylim(len(logs), 0)
    bottom.set_yticks([k + 0.5 for k in range(len(logs))], list(logs), fontsize=7)
    bottom.set_ylabel("outcome")
    bottom.set_xlabel("step")
    bottom.set_xlim(-0.5, last + 0.5)
    bottom.legend([Patch(color=c) for c in _COLORS], OUTCOMES, fontsize=6, ncols=6, loc="upper center",
                  bbox_to_anchor=(0.5, -0.6))
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def loss_fn_with_shift(loss_fn: Callable[[Tensor, Tensor], Tensor], defenses: Defenses,
                       step: Callable[[], int]) -> Callable[[Tensor, Tensor], Tensor]:
    """Return ``loss_fn`` times ``defenses.loss_weight(step())`` (the level shift)."""
    if defenses.shift_step is None:
        return loss_fn
    return lambda out, y: loss_fn(out, y) * defenses.loss_weight(step())
