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
record, coloured by outcome (``ledger``). The panel that runs them is ``explorer.DefenseExplorer``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch import Tensor

from ..clippers import AGC, AdaGC, AutoClip, Clipper, NormClip, UpdateNormClip, ZClip
from ..faults import Fault
from ..reasons import LOSS, Reason
from ..records import StepRecord
from ..rewind import Rewind
from ..spikes import SpikeDetector
from ..steplog import StepLog
from .plots import finite_positive

__all__ = ["KNOBS", "METHODS", "OUTCOMES", "Defenses", "ledger", "loss_fn_with_shift",
           "plot_defenses", "rolling_band"]

METHODS = ("norm", "zclip", "autoclip", "adagc", "agc", "update", "none")
OUTCOMES = ("stepped", "clipped", "skip: loss not finite", "skip: overflow", "skip: z-score spike", "rewound")
_COLORS = ("#d9d9d9", "#4c72b0", "#c44e52", "#dd8452", "#8172b3", "#555555")
# Each method's one knob: its name, the values that make sense for it, and its default: the paper's, or its
# reference code's (AutoClip's 0.9 is the `autoclip` package's QuantileClip default; the paper's knob is a
# percentile p).
KNOBS: dict[str, tuple[str, tuple[float, ...], float]] = {
    "norm": ("max_norm", (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 100.0), 1.0),
    "zclip": ("z_thresh", (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0), 2.5),
    "autoclip": ("quantile", (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0), 0.9),
    "adagc": ("lambda_rel", (1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0), 1.05),
    "agc": ("clipping", (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0), 0.01),
    "update": ("k", (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0), 3.0),
}


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
            raise ValueError("rewind_back needs skip_z: a rewind is triggered by a step the detector "
                             "skipped.")
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

    def warm_up_note(self) -> str | None:
        """Return one line when the method is still warming up at the spike or the shift (it cannot act
        there).

        >>> Defenses(method="zclip", threshold=2.5, window=60,  # doctest: +NORMALIZE_WHITESPACE
        ...          spike_step=50).warm_up_note()
        'ZClip warms up for window=60 steps: at the spike (step 50) it is still warming up and cannot clip it;
        choose a window below 50.'
        """
        warm = {"zclip": ("ZClip", self.window),
                "update": ("UpdateNormClip", max(self.window, 2) // 2)}.get(self.method)
        if warm is None:
            return None
        name, steps = warm
        for what, at in (("spike", self.spike_step), ("shift", self.shift_step)):
            if at is not None and steps >= at:
                return (f"{name} warms up for window={self.window} steps: at the {what} (step {at}) "
                        "it is still warming "
                        f"up and cannot clip it; choose a window below {at if name == 'ZClip' else 2 * at}.")
        return None

    def detector(self) -> SpikeDetector:
        """Return the detector: always there, so every record has ``z_loss``/``z_grad``."""
        return SpikeDetector(window=max(self.window, 2), skip_z=self.skip_z)

    def rewind(self) -> Rewind | None:
        return None if self.rewind_back is None else Rewind(back=self.rewind_back, skip=self.rewind_skip)

    def corrupt(self, index: int, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Return batch ``index``, its inputs times ``spike_size`` if it is the spiky one (``Fault``'s spike).

        Keyed by the data index, not the step: a rewind that skips past it never meets it again.
        """
        x, y = batch
        return (Fault("spike", self.spike_size).corrupt_inputs(x), y) if index == self.spike_step else (x, y)

    def loss_weight(self, step: int) -> float:
        """Return the loss multiplier at ``step``: ``shift_size`` from ``shift_step`` on."""
        return self.shift_size if self.shift_step is not None and step >= self.shift_step else 1.0


def _rewound(log: Sequence[StepRecord]) -> list[bool]:
    """Per record, whether a rewind undid it (a plain list of records has no rewinds)."""
    return log.rewound if isinstance(log, StepLog) else [False] * len(log)


def ledger(log: Sequence[StepRecord]) -> list[str]:
    """Return each record's outcome, one of ``OUTCOMES`` (the step that triggered a rewind shows why).

    >>> from labkit.records import RewindEvent
    >>> log = StepLog([StepRecord(0, 1.0), StepRecord(1, 1.0),
    ...                StepRecord(2, 1.0, skipped=True, reason="spike_grad")])
    >>> log.append_event(RewindEvent(step=2, to=1)); ledger(log)
    ['stepped', 'rewound', 'skip: z-score spike']
    """
    out = []
    triggers = log.events_after() if isinstance(log, StepLog) else {}
    for i, (r, gone) in enumerate(zip(log, _rewound(log))):
        if gone and i not in triggers:  # the step that triggered the rewind keeps its own outcome
            out.append("rewound")
        elif r.skipped:
            out.append(OUTCOMES[2] if r.reason in LOSS else OUTCOMES[3] if r.reason == Reason.NONFINITE_GRAD
                       else OUTCOMES[4])
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
    for r, gone in zip(log, _rewound(log)):
        if len(seen) >= max(window // 2, 1):
            mean = math.fsum(seen) / len(seen)
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in seen) / len(seen))
            lows.append(mean - z * std)
            highs.append(mean + z * std)
        else:
            lows.append(math.nan)
            highs.append(math.nan)
        if not r.skipped and not gone and math.isfinite(r.grad_norm):
            seen.append(r.grad_norm)
    return lows, highs


def plot_defenses(logs: Mapping[str, StepLog], *, window: int = 25,
                  z: float | Mapping[str, float] | None = None, title: str | None = None) -> Figure:
    """Draw one panel per run (small multiples, one step axis) over a skip ledger with a row per run.

    Each panel shows that run's own numbers: the raw gradient norm (logged), the norm it stepped
    with (after its clip), its clipper's threshold (warm-up and per-tensor rules have none),
    the clipped steps, the steps where the lock-in guard restarted the statistics, and the
    rewound branch in grey. ``z`` (a detector's ``skip_z``, or ``{run: skip_z}`` where the runs
    differ) adds the level the detector skips above, ``mean + z * std`` of its rolling
    ``window``. Every legend lists only what is drawn, the ledger's only the outcomes that
    happened.

    >>> fig = plot_defenses({"run": StepLog([StepRecord(0, 1.0, grad_norm=2.0, threshold=3.0)])})
    >>> ([ax.get_ylabel() for ax in fig.axes],
    ...  [t.get_text() for t in fig.axes[0].get_legend().get_texts()])
    (['grad norm', 'outcome'], ['grad norm (raw)', 'threshold'])
    """
    if not logs:
        raise ValueError("logs must hold at least one run: {'name': StepLog}.")
    n = len(logs)
    fig = Figure(figsize=(9, 1.7 * n + 1.5), layout="constrained")
    axes = fig.subplots(n + 1, 1, sharex=True, height_ratios=[3] * n + [0.5 + 0.4 * n])
    panels, bottom = axes[:n], axes[n]
    for ax, (name, log) in zip(panels, logs.items()):
        flags = _rewound(log)
        live = [r for r, undone in zip(log, flags) if not undone]
        gone = [r for r, undone in zip(log, flags) if undone]
        steps = [r.step for r in live]
        ax.plot(steps, finite_positive(r.grad_norm for r in live), color="C0", lw=1.0,
                label="grad norm (raw)")
        clipped = [r for r in live if r.clipped and not r.skipped]
        if clipped:  # dashed over the raw line: where nothing was clipped the two coincide and both show
            ax.plot(steps, finite_positive(r.post_clip_norm if not r.skipped else math.nan for r in live),
                    color="C1", lw=1.0, ls=(0, (3, 2)), label="stepped with (after clip)")
            ax.plot([r.step for r in clipped], [r.grad_norm for r in clipped], "x", color="C3", ms=5,
                    label=f"clipped ({len(clipped)})")
        threshold = finite_positive(r.get("threshold", math.nan) for r in live)
        if any(math.isfinite(t) for t in threshold):
            ax.plot(steps, threshold, color="k", lw=0.8, ls="--", label="threshold")
        skip_z = z.get(name) if isinstance(z, Mapping) else z
        if skip_z is not None:
            _, highs = rolling_band(live, window, skip_z)
            if any(math.isfinite(h) for h in highs):
                ax.plot(steps, finite_positive(highs), color="C4", lw=1.0, ls="-.",
                        label=f"skip above mean + {skip_z:g} sigma")
        fired = [r for r in live if r.get("lockin")]
        for k, r in enumerate(fired):
            ax.axvline(r.step, color="C2", lw=1.2, label="lock-in guard fired" if k == 0 else "_guard")
        if gone:
            ax.plot([r.step for r in gone], finite_positive(r.grad_norm for r in gone), color="0.6", lw=1.0,
                    marker=".", ms=3, label="rewound (undone)")
        ax.set_yscale("log")
        ax.set_ylabel("grad norm")
        ax.set_title(name, fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper left", ncols=3)
        lo, hi = _data_range(ax)
        ax.set_ylim(lo / 2, hi * 12)  # room above the data for the legend
    for k, log in enumerate(logs.values()):
        # rewound records share step numbers with their replacements: they fill the top half of the row
        for r, outcome, undone in zip(log, ledger(log), _rewound(log)):
            color = _COLORS[OUTCOMES.index(outcome)]
            bottom.add_patch(Rectangle((r.step - 0.5, k), 1.0, 0.5 if undone else 1.0, color=color, lw=0,
                                       zorder=2 if undone else 1))
    happened = {outcome for log in logs.values() for outcome in ledger(log)}
    shown = [o for o in OUTCOMES if o in happened]
    last = max((r.step for log in logs.values() for r in log), default=0)
    bottom.set_ylim(n, 0)
    bottom.set_yticks([k + 0.5 for k in range(n)], list(logs), fontsize=7)
    bottom.set_ylabel("outcome")
    bottom.set_xlabel("step")
    bottom.set_xlim(-0.5, last + 0.5)
    bottom.legend([Patch(color=_COLORS[OUTCOMES.index(o)]) for o in shown], shown, fontsize=7,
                  ncols=len(shown), loc="upper center", bbox_to_anchor=(0.5, -0.9 / (0.5 + 0.4 * n)))
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _data_range(ax: Axes) -> tuple[float, float]:
    ys = [y for line in ax.get_lines() if line.get_transform().contains_branch_seperately(ax.transData)[1]
          for y in line.get_ydata() if math.isfinite(y) and y > 0]
    return (min(ys), max(ys)) if ys else (0.1, 10.0)


def loss_fn_with_shift(loss_fn: Callable[[Tensor, Tensor], Tensor], defenses: Defenses,
                       step: Callable[[], int]) -> Callable[[Tensor, Tensor], Tensor]:
    """Return ``loss_fn`` times ``defenses.loss_weight(step())`` (the level shift)."""
    if defenses.shift_step is None:
        return loss_fn
    return lambda out, y: loss_fn(out, y) * defenses.loss_weight(step())
