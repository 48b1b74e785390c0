"""Lesson 08's runs: AdamW's second-moment spikes on a memorisation task, its arms, figure and beta2 panel.

Wortsman et al. 2023b (arXiv 2304.13013) tie loss spikes to AdamW's second moment ``v_hat``
under-estimating a suddenly larger ``g**2``: the per-tensor ``RMS(g / sqrt(v_hat))`` jumps a few
steps before the loss does, whatever the gradient's norm, and clipping the *update* per tensor
(StableAdamW, their Algorithm 2) removes most of the spike. ``Memorise`` is the regime where this
shows on a CPU in seconds (the research probe's: the lesson GPT trained on one fixed batch, AdamW
beta2 0.99, lr 1e-2 after 10 warm-up steps, no weight decay, 1000 steps; with the data fixed,
every loss spike is the optimizer's); ``fixed_batch=False`` is the same run on streaming text.
``ARMS`` are the three optimizers compared. ``run_monitored`` trains one (arm, seed) with
``labkit.update_monitor.UpdateMonitor`` on every step and keeps its log on disk (``cache_dir``),
keyed by the settings and by what decides the bits (torch's version, ``LABKIT_PERTURB``,
``ATEN_CPU_CAPABILITY``, the device, labkit's source): Run All again reads the logs back.
``update_series`` lines a log's numbers up by optimizer step, ``loss_spikes`` finds the loss
spikes and what the monitor saw before each, ``plot_update_spikes`` draws the arms side by side
and ``Beta2Panel`` is the lesson's beta2 slider.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..validate import check_int, check_number
from .latest import LatestRun

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..steplog import StepLog
    from .experiment import ExperimentConfig

__all__ = ["ARMS", "Beta2Panel", "LossSpike", "Memorise", "cache_dir", "loss_spikes", "plot_update_spikes",
           "run_monitored", "update_series"]

# name -> ExperimentConfig changes: the three optimizers of the lesson, same lr, betas, eps and data
ARMS: dict[str, dict[str, Any]] = {
    "AdamW": {"optimizer": "adamw", "max_norm": None},
    "AdamW+clip(1.0)": {"optimizer": "adamw", "max_norm": 1.0},
    "StableAdamW": {"optimizer": "stableadamw", "max_norm": None},
}
CACHE_ENV = "LABKIT_CACHE"
_CACHE_FORMAT = 1  # bump when what a cached log holds changes in a way labkit's source does not show


@dataclass(frozen=True)
class Memorise:
    """The memorisation regime: the lesson GPT on one fixed batch, AdamW, constant lr after a warm-up.

    The lesson GPT (``GPTTask()``: 2 layers, width 32, 2 heads, a 32-byte context, batches of 8,
    its logit measurements off), trained on ``task.batch(0)`` at every step (``FixedBatch``) in
    fp32; AdamW betas ``(0.9, beta2)``, eps 1e-8, weight decay 0, lr ``lr`` after ``warmup``
    linear warm-up steps (``lr * (t + 1) / (warmup + 1)``), then held. ``fixed_batch=False``
    trains the same model with the same optimizer on streaming text (a fresh batch every step).
    ``config(arm, seed)`` is one run's ``ExperimentConfig`` (``ARMS``: the optimizer and clip).

    >>> c = Memorise().config("StableAdamW", seed=2)
    >>> c.optimizer, c.betas, c.lr, c.max_norm, c.steps, type(c.task).__name__
    ('stableadamw', (0.9, 0.99), 0.01, None, 1000, 'FixedBatch')
    """

    steps: int = 1000
    lr: float = 1e-2
    warmup: int = 10
    beta2: float = 0.99
    fixed_batch: bool = True
    device: str | None = None

    def __post_init__(self) -> None:
        check_int("steps", self.steps, 2)
        check_int("warmup", self.warmup, 0, self.steps - 1, hint="(linear warm-up steps, fewer than steps)")
        check_number("lr", self.lr, 0, low_open=True, finite=True)
        check_number("beta2", self.beta2, 0, 1, high_open=True, hint="(Adam's second beta, e.g. 0.99)")
        if not isinstance(self.fixed_batch, bool):
            raise TypeError(f"fixed_batch must be True (one batch: memorisation) or False (streaming text), "
                            f"got {self.fixed_batch!r}.")

    @property
    def bound(self) -> float:
        """``1 / sqrt(1 - beta2)``: the most RMS(g / sqrt(v_hat)) can be, reached by a gradient new to ``v``.

        >>> round(Memorise(beta2=0.99).bound, 6)
        10.0
        """
        return 1.0 / math.sqrt(1.0 - self.beta2)

    def config(self, arm: str, seed: int = 0) -> ExperimentConfig:
        """Return the ``ExperimentConfig`` of ``arm`` (an ``ARMS`` name) on ``seed``."""
        from ..tasks import FixedBatch, GPTTask
        from .experiment import ExperimentConfig

        if arm not in ARMS:
            raise ValueError(f"arm must be one of {list(ARMS)}, got {arm!r}.")
        task = GPTTask(seed=seed, measure=False)
        return ExperimentConfig(
            task=FixedBatch(task) if self.fixed_batch else task, precision="fp32", lr=self.lr,
            betas=(0.9, self.beta2), weight_decay=0.0, warmup=self.warmup, scheduler=None, steps=self.steps,
            seed=seed, device=self.device, triage=False, **ARMS[arm])


def cache_dir() -> Path:
    """Return where ``run_monitored`` keeps its logs: ``$LABKIT_CACHE``, else ``~/.cache/labkit`` (XDG's)."""
    if os.environ.get(CACHE_ENV, "").strip():
        return Path(os.environ[CACHE_ENV]).expanduser()
    home = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "labkit"


_SOURCE: list[str] = []


def _source_digest() -> str:
    """sha256 of labkit's Python source: a cached log of another labkit is not this one's."""
    if not _SOURCE:
        root = Path(__file__).resolve().parents[1]
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
        _SOURCE.append(digest.hexdigest())
    return _SOURCE[0]


def _key(recipe: Memorise, arm: str, seed: int) -> str:
    import torch

    from ..tasks.perturb import perturb_seed

    device = torch.device(recipe.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    what = {"recipe": dataclasses.asdict(recipe) | {"device": device.type}, "arm": arm, "seed": seed,
            "torch": torch.__version__, "perturb": perturb_seed(),
            "aten": os.environ.get("ATEN_CPU_CAPABILITY", ""), "labkit": _source_digest(),
            "format": _CACHE_FORMAT}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


_MEMORY: dict[str, StepLog] = {}


def run_monitored(recipe: Memorise, arm: str, seed: int = 0, *, cache: bool = True) -> StepLog:
    """Train ``recipe``'s ``arm`` on ``seed`` with an ``UpdateMonitor``, or read the log of an earlier run.

    The monitor (no alarm: ``threshold=None``; replay ``update_series`` through
    ``UpdateMonitor.observe`` for its warnings) writes ``update_rms``, ``update_rms_max``,
    ``update_rms_peak``, ``applied_update_rms`` and ``update_step`` on every record. With
    ``cache`` the log is kept in memory and as JSONL under ``cache_dir()``, keyed by the
    settings and by what decides the bits (torch's version, ``LABKIT_PERTURB``,
    ``ATEN_CPU_CAPABILITY``, the device type, labkit's source): a log read back is the one this
    machine would train, number for number. A cache folder that cannot be written is skipped.

    >>> log = run_monitored(Memorise(steps=4, warmup=1), "AdamW", cache=False)
    >>> len(log), log[2].update_step, log[2].update_rms_max > 0
    (4, 1, True)
    """
    from ..steplog import StepLog
    from ..update_monitor import UpdateMonitor
    from .experiment import run_experiment

    config = recipe.config(arm, seed)  # a bad arm or seed fails here
    key = _key(recipe, arm, seed) if cache else ""
    if key in _MEMORY:
        return _MEMORY[key]
    name = arm.replace("+", "_").replace("(", "").replace(")", "")
    path = cache_dir() / "lesson08" / f"{name}-s{seed}-{key}.jsonl"
    if cache and path.exists():
        try:
            log = StepLog.read_jsonl(path)
        except (OSError, ValueError):
            log = None  # a damaged file: train again, and write it anew
        if log is not None and len(log) == recipe.steps:
            _MEMORY[key] = log
            return log
    log = run_experiment(config, observer=UpdateMonitor(threshold=None))
    if cache:
        _MEMORY[key] = log
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.part")
            log.to_jsonl(partial)
            os.replace(partial, path)  # a reader never sees half a file
        except OSError:
            pass  # read-only home: the run is kept in memory only
    return log


def update_series(log: StepLog) -> dict[str, list[Any]]:
    """Line a monitored log up by optimizer step ``t``: the loss of step ``t`` and what its update did.

    ``loss[t]`` is computed before step ``t``'s update and ``grad_norm[t]`` is its gradient's
    global norm (before any clip); ``rms[t]`` (the largest per-tensor RMS(g / sqrt(v_hat)) of
    step ``t``), ``peak[t]`` (its tensor) and ``update[t]`` (RMS of the applied update / lr)
    come from record ``t + 1`` (the monitor's record is one step late; NaN for the last step).
    So a large ``rms[t]`` moves the weights that ``loss[t + 1]`` is computed with.

    >>> s = update_series(run_monitored(Memorise(steps=3, warmup=1), "AdamW", cache=False))
    >>> s["step"], [math.isnan(v) for v in s["rms"]]
    ([0, 1, 2], [False, False, True])
    """
    steps = [r.step for r in log]
    at = {s: i for i, s in enumerate(steps)}
    rms = [math.nan] * len(steps)
    peak: list[str | None] = [None] * len(steps)
    update = [math.nan] * len(steps)
    for r in log:
        i = at.get(r.update_step) if r.update_step is not None else None
        if i is not None:
            rms[i], peak[i], update[i] = r.update_rms_max, r.update_rms_peak, r.applied_update_rms
    return {"step": steps, "loss": [r.loss for r in log], "grad_norm": [r.grad_norm for r in log], "rms": rms,
            "peak": peak, "update": update}


@dataclass(frozen=True)
class LossSpike:
    """One loss spike and what the update monitor saw in the steps before it (see ``loss_spikes``)."""

    onset: int  # the first step whose loss passed ratio x the median of the window before it
    peak_step: int
    peak: float  # the largest loss of the spike
    floor: float  # the median of the window before the onset
    rms_before: float  # the largest RMS(g / sqrt(v_hat)) in the `before` steps before the onset
    tensor: str | None  # the tensor it was measured on
    first_above: int | None  # the first of those steps with an RMS above `threshold` (None: none)
    grad_norm_there: float  # the gradient's norm at that step (NaN: none)
    update_at_onset: float  # RMS of the update applied at the step before the onset, / lr


def loss_spikes(log: StepLog, *, start: int = 100, ratio: float = 2.0, window: int = 20, before: int = 8,
                threshold: float = 3.0, min_peak: float = 0.0) -> list[LossSpike]:
    """Return the loss spikes after step ``start``, each with the update monitor's numbers before it.

    An onset is a step whose loss is above ``ratio`` x the median of the ``window`` losses before
    it; the spike lasts while the loss stays above that level (at most 50 steps), and only
    spikes peaking above ``min_peak`` are kept. For each: the largest RMS(g / sqrt(v_hat)) in
    the ``before`` optimizer steps before the onset and its tensor, the first of those steps
    above ``threshold`` and the gradient norm there. The research probe's rule (ratio 2 on a
    loss floor of about 0.02), as ``benchmarks/bench_update_clipping.py`` counts them.

    >>> log = run_monitored(Memorise(steps=30, warmup=1), "AdamW", cache=False)
    >>> loss_spikes(log, start=25)  # 30 steps from initialisation: the loss only falls
    []
    """
    s = update_series(log)
    loss, rms, peak, grad = s["loss"], s["rms"], s["peak"], s["grad_norm"]
    found, t = [], max(start, window)
    while t < len(loss):
        floor = statistics.median(loss[t - window:t])
        level = ratio * floor
        if not loss[t] > level:
            t += 1
            continue
        end = t
        while end + 1 < len(loss) and end + 1 < t + 50 and loss[end + 1] > level:
            end += 1
        top = max(range(t, end + 1), key=lambda i: loss[i])
        pre = range(max(0, t - before), t)
        worst = max(pre, key=lambda i: rms[i] if math.isfinite(rms[i]) else -1.0)
        first = next((i for i in pre if rms[i] > threshold), None)
        if loss[top] > min_peak:
            found.append(LossSpike(
                onset=s["step"][t], peak_step=s["step"][top], peak=loss[top], floor=floor,
                rms_before=rms[worst], tensor=peak[worst],
                first_above=None if first is None else s["step"][first],
                grad_norm_there=math.nan if first is None else grad[first],
                update_at_onset=s["update"][t - 1]))
        t = end + 1
    return found


def _style(i: int) -> dict[str, Any]:
    return {"color": f"C{i}", "lw": (1.1, 1.0, 1.2)[i % 3], "ls": ("-", "--", "-")[i % 3],
            "alpha": (0.9, 0.85, 0.8)[i % 3]}


_ROWS = ("loss", "grad_norm", "rms", "update")
_YLABELS = {"loss": "loss", "grad_norm": "grad norm (before clip)", "rms": "max RMS(g/sqrt(v_hat))",
            "update": "update RMS / lr"}


def plot_update_spikes(runs: Mapping[str, Mapping[int, StepLog]], *, max_norm: float | None = 1.0,
                       beta2: float | None = 0.99, threshold: float | None = 3.0, title: str | None = None,
                       fig: Figure | None = None) -> Figure:
    """Draw each arm's loss, gradient norm, max RMS(g / sqrt(v_hat)) and update RMS, one column a seed.

    ``runs`` maps an arm's name to ``{seed: monitored log}``. All four rows share the optimizer
    step on x (``update_series``), so a jump in RMS can be read against the loss one step later.
    The grad-norm row marks the clip threshold ``max_norm``; the RMS row the ``threshold`` and
    the bound ``1 / sqrt(1 - beta2)``; one key below the figure names them all. Every y-axis is
    logarithmic.

    >>> log = run_monitored(Memorise(steps=5, warmup=1), "AdamW", cache=False)
    >>> fig = plot_update_spikes({"AdamW": {0: log}})
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['loss', 'grad norm (before clip)', 'max RMS(g/sqrt(v_hat))', 'update RMS / lr']
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs or not all(runs.values()):
        raise ValueError("runs must map each arm's name to {seed: log}, with at least one seed: e.g. "
                         "{'AdamW': {0: run_monitored(Memorise(), 'AdamW', 0)}}.")
    seeds = sorted({seed for logs in runs.values() for seed in logs})
    if fig is None:
        fig = Figure(figsize=(4.3 * len(seeds) + 0.6, 8.4), layout="constrained")
        FigureCanvasAgg(fig)
    else:
        fig.clear()
    axes = fig.subplots(len(_ROWS), len(seeds), sharex=True, squeeze=False)
    for col, seed in enumerate(seeds):
        for i, (arm, logs) in enumerate(runs.items()):
            if seed not in logs:
                continue
            s = update_series(logs[seed])
            for row, name in enumerate(_ROWS):
                values = [v if math.isfinite(v) and v > 0 else math.nan for v in s[name]]
                axes[row, col].plot(s["step"], values, label=arm, **_style(i))
        axes[0, col].set_title(f"seed {seed}", fontsize=10)
        if max_norm is not None:
            axes[1, col].axhline(max_norm, color="k", lw=0.8, ls=":", label=f"clip threshold {max_norm:g}")
        if threshold is not None:
            axes[2, col].axhline(threshold, color="0.45", lw=0.8, ls="-.", label=f"alarm {threshold:g}")
        if beta2 is not None:
            axes[2, col].axhline(1 / math.sqrt(1 - beta2), color="k", lw=0.8, ls=":",
                                 label=f"bound 1/sqrt(1-beta2) = {1 / math.sqrt(1 - beta2):.3g}")
        axes[-1, col].set_xlabel("optimizer step")
        for row, name in enumerate(_ROWS):
            axes[row, col].set_yscale("log")
            if col == 0:
                axes[row, col].set_ylabel(_YLABELS[name])
    # one key for the whole figure: every arm and mark, drawn in every column
    handles = {}
    for ax in axes[:, 0]:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncols=min(len(handles), 2 * len(seeds)), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


class Beta2Panel:
    """The lesson's beta2 slider: AdamW on the memorisation task at 0.95, 0.99 or 0.999, one seed.

    Each setting trains once (``run_monitored``, cached on disk and in memory: a setting already
    run redraws at once); the figure shows the loss and the max RMS(g / sqrt(v_hat)) against the
    bound ``1 / sqrt(1 - beta2)`` of that setting, and the status line what the run did.

    >>> panel = Beta2Panel(Memorise(steps=30, warmup=1), cache=False)
    >>> panel.controls["beta2"].value = 0.95; panel.shown, panel.figure_mismatches()
    (0.95, [])
    """

    def __init__(self, recipe: Memorise, seed: int = 0, values: Sequence[float] = (0.95, 0.99, 0.999), *,
                 cache: bool = True) -> None:
        import ipywidgets as W
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.recipe, self.seed, self.cache = recipe, seed, cache
        self.values = [float(v) for v in values]
        for v in self.values:
            dataclasses.replace(recipe, beta2=v)  # a bad value fails here, not in a callback
        start = recipe.beta2 if recipe.beta2 in self.values else self.values[0]
        self.controls = {"beta2": W.SelectionSlider(options=[(f"{v:g}", v) for v in self.values], value=start,
                                                    description="beta2", continuous_update=False)}
        self.status = W.HTML()
        self.logs: dict[float, StepLog] = {}
        self.shown: float | None = None
        self.seconds = math.nan
        self.error: Exception | None = None
        self._latest = LatestRun(self._run_once)
        self.fig = Figure(figsize=(11, 3.2))
        FigureCanvasAgg(self.fig)
        self.image = W.Image(format="png")  # a PNG: safe to swap from a slider callback's thread
        for name, widget in self.controls.items():
            widget.observe(lambda _: self.run(), names="value")
            widget.add_class(f"labkit-control-{name}")
        self.widget = W.VBox([W.HBox(list(self.controls.values())), self.status, self.image])
        self.widget.add_class("labkit-panel")
        self.run()

    def run(self) -> None:
        """Run (or fetch) the chosen beta2 and redraw; a change during a run runs once more after it."""
        self._latest()

    def _run_once(self) -> None:
        beta2 = self.controls["beta2"].value
        start = time.perf_counter()
        if self.shown is not None and beta2 not in self.logs:
            self.status.value = (f"training AdamW at beta2 {beta2:g} ({self.recipe.steps} steps, seconds); "
                                 f"the figure below still shows beta2 {self.shown:g}")
        try:
            recipe = dataclasses.replace(self.recipe, beta2=beta2)
            log = run_monitored(recipe, "AdamW", self.seed, cache=self.cache)
        except Exception as e:  # shown in the panel: a callback's traceback would go unseen
            self.error = e
            self.status.value = f"<span style='color:#b00'>{type(e).__name__}: {e}</span>"
            return
        self.logs[beta2], self.error, self.shown = log, None, beta2
        self._draw(beta2, log)
        self.seconds = time.perf_counter() - start
        s = update_series(log)
        late = [(v, t) for t, v in zip(s["step"], s["loss"]) if t >= 100]
        top, at = max(late) if late else (math.nan, -1)
        spikes = loss_spikes(log, min_peak=0.5)
        rms = max((v for v in s["rms"] if math.isfinite(v)), default=math.nan)
        bound = 1 / math.sqrt(1 - beta2)
        self.status.value = (f"<b>AdamW, beta2 {beta2:g}</b>, seed {self.seed}: {len(spikes)} loss spike(s) "
                             f"peaking above 0.5 after step 100; largest loss after step 100 {top:.3g} "
                             f"(step {at}); largest RMS(g/sqrt(v_hat)) {rms:.3g} of a bound {bound:.3g} "
                             f"&middot; {self.seconds:.2f} s")

    def _draw(self, beta2: float, log: StepLog) -> None:
        s = update_series(log)
        self.fig.clear()
        loss_ax, rms_ax = self.fig.subplots(1, 2)
        loss_ax.plot(s["step"], s["loss"], color="C0", lw=1.0, label="AdamW")
        loss_ax.set(yscale="log", xlabel="optimizer step", ylabel="loss", title="loss")
        rms = [v if v > 0 else math.nan for v in s["rms"]]
        rms_ax.plot(s["step"], rms, color="C0", lw=1.0, label="AdamW")
        bound = 1 / math.sqrt(1 - beta2)
        rms_ax.axhline(bound, color="k", lw=0.8, ls=":", label=f"bound 1/sqrt(1-beta2) = {bound:.3g}")
        rms_ax.axhline(3.0, color="0.45", lw=0.8, ls="-.", label="alarm 3")
        rms_ax.set(yscale="log", xlabel="optimizer step", ylabel="max RMS(g/sqrt(v_hat))",
                   title="max RMS(g/sqrt(v_hat)) over tensors")
        rms_ax.legend(fontsize=7, loc="lower right")
        self.fig.suptitle(f"AdamW, beta2 {beta2:g}, seed {self.seed}: one fixed batch, lr {self.recipe.lr:g}",
                          fontsize=10)
        width = self.fig.get_figwidth()
        self.fig.subplots_adjust(left=0.7 / width, right=1 - 0.15 / width, bottom=0.16, top=0.82, wspace=0.25)
        buffer = io.BytesIO()
        self.fig.savefig(buffer, format="png", dpi=80)
        self.image.value = buffer.getvalue()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def figure_mismatches(self) -> list[str]:
        """Return each control whose value the figure does not show (``[]``: it shows them, or none yet)."""
        if self.shown is None:
            return []
        value = self.controls["beta2"].value
        if value == self.shown:
            return []
        return [f"beta2: the control says {value!r}, the figure shows {self.shown!r}"]
