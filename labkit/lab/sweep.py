"""The learning-rate sweep of Wortsman et al. 2023 on the GPT task: final loss against LR, per mitigation.

Wortsman et al. (2023), *Small-scale proxies for large-scale Transformer training instabilities*
(arXiv 2309.14322), train small transformers over a log-spaced grid of learning rates with and
without each mitigation (qk-layernorm, z-loss) and plot the final loss against the learning rate
(their Fig. 1): a mitigation that works flattens the curve's right side. They sum a curve up by
its *LR sensitivity* (``lr_sensitivity``). ``Recipe`` is their training recipe (AdamW with
beta2 0.95 and eps 1e-8, independent weight decay 1e-4, linear warm-up then cosine decay, global
clipping at 1) on a small ``GPTTask``; ``VARIANTS`` are the mitigations.

``sweep`` runs a grid, one ``Point`` per (variant, lr, seed), and with ``out=`` writes each
point to ``sweep.csv`` (and each run's records to ``runs/*.jsonl``) as it finishes, so a grid
stopped half-way resumes where it stopped. ``python -m labkit sweep`` runs it from the command
line and draws ``sweep.png`` (``plot_sweep``); ``SweepPanel`` is the lesson's slider and toggles.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..names import FP16_MAX, PRECISIONS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..records import StepRecord
    from ..steplog import StepLog
    from ..tasks.gpt import GPTTask
    from .experiment import ExperimentConfig

__all__ = ["VARIANTS", "Point", "Recipe", "Runs", "SweepPanel", "lr_grid", "lr_sensitivity", "main",
           "plot_runs", "plot_sweep", "run_point", "stable_lrs", "summarize", "sweep"]

# name -> (qk_norm, z_loss): the mitigations each variant turns on (z-loss at the recipe's coefficient)
VARIANTS: dict[str, tuple[bool, bool]] = {
    "baseline": (False, False),
    "qk_norm": (True, False),
    "z_loss": (False, True),
    "qk_norm+z_loss": (True, True),
}
SCHEDULES = ("cosine", "constant")


def lr_grid(low: float, high: float, count: int) -> list[float]:
    """Return ``count`` log-spaced learning rates from ``low`` to ``high``, rounded to 3 digits.

    >>> lr_grid(1e-4, 1, 9)
    [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0]
    """
    good_count = isinstance(count, int) and not isinstance(count, bool) and count >= 2
    if not (0 < low < high and math.isfinite(high)) or not good_count:
        raise ValueError(f"need 0 < low < high and count >= 2, got low={low!r}, high={high!r}, "
                         f"count={count!r}.")
    step = math.log10(high / low) / (count - 1)
    # 10**(k/2) is 3.16: a grid of two points a decade reads as 1, 3, 10 (the paper's plots do too)
    return [float(f"{_round3(low * 10 ** (i * step)):.3g}") for i in range(count)]


def _round3(x: float) -> float:
    mantissa = x / 10 ** math.floor(math.log10(x))
    return 3 * 10 ** math.floor(math.log10(x)) if abs(mantissa - math.sqrt(10)) < 1e-6 else x


def lr_sensitivity(final: Mapping[float, float], init_loss: float) -> float:
    """Return Wortsman et al.'s LR sensitivity: the mean over the grid of ``min(loss, init) - best``.

    ``final`` maps each learning rate to its run's final loss; a run that diverged (a loss above
    the loss at initialisation ``init``, or not finite) counts as ``init``, and ``best`` is the
    lowest of them. 0 means every learning rate in the grid does as well as the best one. It
    depends on the grid (a learning rate too low to train in the run's steps adds the same gap
    to every variant): compare variants on the same grid.

    >>> lr_sensitivity({1e-3: 2.5, 1e-2: 2.4, 1e-1: float("nan")}, init_loss=5.0)
    0.9
    """
    if not final:
        raise ValueError("lr_sensitivity needs at least one (lr, final loss) pair.")
    capped = [min(loss, init_loss) if math.isfinite(loss) else init_loss for loss in final.values()]
    best = min(capped)
    return round(sum(c - best for c in capped) / len(capped), 12)


def stable_lrs(final: Mapping[float, float], tolerance: float = 0.1) -> list[float]:
    """Return the learning rates whose final loss is within ``tolerance`` (nats) of the best one's.

    >>> stable_lrs({1e-3: 2.5, 1e-2: 2.42, 1e-1: 2.9, 1.0: float("nan")})
    [0.001, 0.01]
    """
    finite = {lr: loss for lr, loss in final.items() if math.isfinite(loss)}
    if not finite:
        return []
    best = min(finite.values())
    return sorted(lr for lr, loss in finite.items() if loss <= best + tolerance)


@dataclass(frozen=True)
class Recipe:
    """What every point of a sweep shares: the model's size, steps, precision and optimizer.

    The optimizer is Wortsman et al.'s (§2.1): AdamW with beta1 0.9, beta2 0.95, eps 1e-8,
    *independent* weight decay 1e-4 (not multiplied by the peak lr: torch's ``weight_decay`` is
    ``1e-4 / lr``), linear warm-up then cosine decay, the global gradient norm clipped at 1; the
    z-loss variants use their (and PaLM's) coefficient 1e-4. Where the defaults differ from §2.1,
    on purpose or by size (each but the model's size is a field or a ``GPTTask`` option):

    - warm-up 10 % of the steps (theirs: 5e3 of 1e5 steps, 5 %; ``warmup=0.05``), and the cosine
      decays to 0 (theirs: to a minimum lr of 1e-5; over the last steps of a 300-step run the
      two differ by at most 1e-5 in the lr);
    - neither qk-layernorm nor z-loss unless the variant turns it on (their default model has
      both, and each figure ablates one: Fig. 1 is with and without qk-layernorm, z-loss on in
      both; Fig. 3 with and without z-loss, qk-layernorm on and no weight decay);
    - nanoGPT's model (``GPTTask``): biases in every linear layer and LayerNorm (theirs: none),
      a head tied to the token embedding (theirs untied: ``tie_head=False``), learned position
      embeddings (theirs: rotary), N(0, 0.02) init (theirs: the embedding N(0, 1/d), the rest a
      truncated normal of std 1/sqrt(fan-in)), LayerNorm eps 1e-5 (theirs 1e-6);
    - bytes of the stdlib's source, a 162-symbol vocabulary (theirs: C4, 32101 SentencePiece
      tokens), fp32 on a CPU (theirs: bf16 on TPUs), and a model and run far smaller: 2 layers,
      width 64, 4 heads, a 64-byte context, batches of 16, 300 steps (theirs: millions to billions
      of non-embedding parameters, Fig. 4's 2.4M to §3.3's 4.8B, batches of 256 x 512 tokens,
      1e5 steps).

    ``schedule="constant"`` holds the lr after the warm-up (their output-logit divergence comes
    "towards the end of training" of models with no weight decay, §3.1.2: ``weight_decay=0``,
    ``tie_head=False`` and many steps). ``attention="explicit"`` forms the attention logits as a
    tensor (in fp16, where they can overflow). ``triage=True`` tells a non-finite loss apart
    (``forward_overflow`` or ``nonfinite_input``, ``labkit.triage``); off by default, as the
    README's grid was run.

    >>> Recipe().config("qk_norm", lr=0.1, seed=1).task.qk_norm, Recipe().config("baseline", 0.1).weight_decay
    (True, 0.001)
    >>> paper = Recipe(tie_head=False, weight_decay=0.0, schedule="constant", warmup=0.05)
    >>> paper.config("qk_norm", 0.3).scheduler is None, paper.task("qk_norm").tie_head
    (True, False)
    """

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    batch_size: int = 16
    steps: int = 300
    precision: str = "fp32"
    attention: str = "sdpa"
    warmup: float = 0.1
    beta2: float = 0.95
    weight_decay: float = 1e-4
    max_norm: float | None = 1.0
    z_loss: float = 1e-4
    init_scale: float = 2.0**16
    val_batches: int = 16
    device: str | None = None
    triage: bool = False  # True: a non-finite loss reads forward_overflow or nonfinite_input (labkit.triage)
    tie_head: bool = True  # False: the head has its own weight, as in Wortsman et al.'s models
    schedule: str = "cosine"  # or "constant": the lr held after the warm-up

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}.")
        self.config("baseline", 1e-3)  # a bad setting raises here, in ExperimentConfig's and GPTTask's words
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warmup is a fraction of the steps in [0, 1), got {self.warmup!r}.")
        n = self.val_batches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"val_batches must be an int >= 1, got {self.val_batches!r}.")

    @classmethod
    def lesson(cls, device: str | None = None) -> Recipe:
        """Return the recipe lesson 07 trains live: on a CPU the GPT of lesson 04 (2 layers, width 32, 2
        heads of dimension 16, a 32-byte context, batches of 8), 250 steps; on a GPU this default size."""
        import torch

        if torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda":
            return cls(device=device)
        return cls(n_head=2, n_embd=32, block_size=32, batch_size=8, steps=250, device=device)

    @property
    def fp16_logit_limit(self) -> float:
        """The attention logit at which ``q.k`` passes fp16's 65504: ``65504 / sqrt(head dim)``.

        nanoGPT's explicit attention scales after the matmul (``(q @ k.T) / sqrt(d)``), so the
        product overflows first. SDPA's kernels scale before, and accumulate in fp32.

        >>> Recipe.lesson("cpu").fp16_logit_limit
        16376.0
        """
        return FP16_MAX / math.sqrt(self.n_embd // self.n_head)

    def task(self, variant: str, seed: int = 0) -> GPTTask:
        """Return the ``GPTTask`` of ``variant`` (a ``VARIANTS`` name) at this size and ``seed``."""
        from ..tasks import GPTTask

        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}.")
        qk_norm, z_loss = VARIANTS[variant]
        return GPTTask(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                       block_size=self.block_size, batch_size=self.batch_size, seed=seed,
                       attention=self.attention, qk_norm=qk_norm, z_loss=self.z_loss if z_loss else 0.0,
                       tie_head=self.tie_head)

    def config(self, variant: str, lr: float, seed: int = 0) -> ExperimentConfig:
        """Return the ``ExperimentConfig`` of one point of the grid."""
        from .experiment import ExperimentConfig

        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < math.inf):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}.")
        return ExperimentConfig(
            task=self.task(variant, seed), precision=self.precision, optimizer="adamw", lr=lr,
            betas=(0.9, self.beta2), weight_decay=self.weight_decay / lr,
            warmup=int(self.warmup * self.steps),
            scheduler="cosine" if self.schedule == "cosine" else None, max_norm=self.max_norm,
            steps=self.steps, seed=seed, device=self.device,
            init_scale=self.init_scale, growth_interval=2000,
            triage=self.triage,
        )


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its settings and what it ended with.

    ``final_loss`` is the validation cross-entropy of the trained model, ``init_loss`` that of
    the untrained one; ``attn_logit_max`` the largest attention logit of the whole run (any
    layer, any step; ``inf`` if an fp16 forward overflowed), ``attn_logit_final`` that of the
    last step; ``log_z_final`` the last step's mean log Z.
    """

    variant: str
    lr: float
    seed: int
    final_loss: float
    init_loss: float
    train_loss: float
    attn_logit_max: float
    attn_logit_final: float
    log_z_final: float
    skipped: int
    first_skip: int
    clip_rate: float
    seconds: float

    @classmethod
    def from_row(cls, row: Mapping[str, str]) -> Point:
        """Read a point back from its ``sweep.csv`` row (strings)."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        def read(name: str, kind: str) -> Any:
            return row[name] if kind == "str" else int(row[name]) if kind == "int" else float(row[name])

        return cls(**{name: read(name, kind) for name, kind in kinds.items()})


_COLUMNS = [f.name for f in dataclasses.fields(Point)]


class _Kept:
    """``task``, keeping the last model it built (the sweep asks it for the validation loss)."""

    def __init__(self, task: Any) -> None:
        self.task, self.built = task, None
        self.name = task.name

    def model(self, device: Any = "cpu") -> Any:
        self.built = self.task.model(device)
        return self.built

    def batch(self, step: int, device: Any = "cpu") -> Any:
        return self.task.batch(step, device)

    @property
    def loss_fn(self) -> Any:
        return self.task.loss_fn

    def monitor(self, model: Any) -> Any:
        return self.task.monitor(model)


def _peak(values: Iterable[float]) -> float:
    """The largest value, ``inf`` or NaN counted as larger than any number (an overflow is the peak)."""
    peak = -math.inf
    for v in values:
        if math.isnan(v) or v > peak:
            peak = math.inf if math.isnan(v) else v
    return peak


def run_point(recipe: Recipe, variant: str, lr: float, seed: int = 0, *,
              watch: Callable[[StepRecord, Any], None] | None = None,
              log_path: str | os.PathLike | None = None) -> tuple[Point, StepLog, Any]:
    """Train one point of the grid; return its ``Point``, its log and the trained model.

    ``watch(record, model)`` sees each record with the model as that step left it (a skipped
    step leaves the weights its forward used: that forward can be run again, e.g. in fp32).
    """
    from ..alarms import RepeatedClippingWarning
    from .experiment import _one_thread_on_cpu, run_experiment

    config = recipe.config(variant, lr, seed)
    kept = _Kept(config.task)
    start = time.perf_counter()
    with warnings.catch_warnings():
        # at a high lr every step is clipped, by design of the sweep: the point's clip_rate says
        # how often, instead of one RepeatedClippingWarning per run
        warnings.simplefilter("ignore", RepeatedClippingWarning)
        on_record = (lambda record: watch(record, kept.built)) if watch is not None else None
        log = run_experiment(dataclasses.replace(config, task=kept), on_record, log_path=log_path)
    seconds = time.perf_counter() - start
    task, model = config.task, kept.built
    with _one_thread_on_cpu(model.wte.weight.device):  # as small as the training's forwards (see there)
        final = task.val_loss(model, batches=recipe.val_batches)
        init = task.val_loss(task.model(model.wte.weight.device), batches=recipe.val_batches)
    stepped = [r.loss for r in log if not r.skipped]
    tail = stepped[-max(1, len(log) // 10):]
    point = Point(
        variant=variant, lr=float(lr), seed=seed, final_loss=final, init_loss=init,
        train_loss=sum(tail) / len(tail) if tail else math.nan,
        attn_logit_max=_peak(v for r in log for v in r.attn_logit_max.values()),
        attn_logit_final=_peak(log[-1].attn_logit_max.values()),
        log_z_final=log[-1].log_z if log[-1].log_z is not None else math.nan,
        skipped=len(log.skipped_steps), first_skip=log.skipped_steps[0] if log.skipped_steps else -1,
        clip_rate=log.summary()["clip_rate"], seconds=seconds,
    )
    return point, log, model


class Runs:
    """Points and logs kept in memory by ``(recipe, variant, lr, seed)``: each setting trains once.

    The lesson shares one between its cells and its panel: a setting already run is at hand.

    >>> runs = Runs(); recipe = Recipe(n_layer=1, n_embd=16, n_head=2, block_size=8, batch_size=2, steps=3,
    ...                                val_batches=1)
    >>> point, log = runs.get(recipe, "baseline", 1e-2)
    >>> len(log), runs.get(recipe, "baseline", 1e-2)[1] is log
    (3, True)
    """

    def __init__(self) -> None:
        self._runs: dict[tuple[Recipe, str, float, int], tuple[Point, StepLog]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, recipe: Recipe, variant: str, lr: float, seed: int = 0) -> tuple[Point, StepLog]:
        """Return the point and log of this setting, training it first if it has not run."""
        key = (recipe, variant, float(lr), seed)
        if key not in self._runs:
            point, log, _ = run_point(recipe, variant, lr, seed)
            self._runs[key] = point, log
        return self._runs[key]

    def put(self, recipe: Recipe, point: Point, log: StepLog) -> None:
        """Keep a point run elsewhere (``sweep`` does)."""
        self._runs[(recipe, point.variant, point.lr, point.seed)] = point, log


def _run_name(variant: str, lr: float, seed: int) -> str:
    return f"{variant}_lr{lr:g}_seed{seed}"


def _read_points(path: str) -> list[Point]:
    """Read the finished points of a ``sweep.csv``; a torn last row (a run stopped mid-write) is left out."""
    if not os.path.exists(path):
        return []
    points = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            try:
                points.append(Point.from_row(row))
            except (TypeError, ValueError, KeyError):
                continue  # a torn row: that point runs again
    return points


def sweep(
    recipe: Recipe,
    lrs: Sequence[float],
    variants: Sequence[str] = tuple(VARIANTS),
    seeds: Sequence[int] = (0,),
    *,
    out: str | os.PathLike | None = None,
    echo: Callable[[str], None] | None = None,
    progress: bool = False,
    runs: Runs | None = None,
) -> list[Point]:
    """Run every (variant, lr, seed) of the grid and return the points, in grid order.

    With ``out`` each finished point is appended to ``out/sweep.csv`` at once and its records go
    to ``out/runs/<variant>_lr<lr>_seed<seed>.jsonl``; points already in the CSV are not run
    again (a grid stopped half-way resumes), and ``out/sweep.json`` holds the recipe: a folder
    of another recipe is refused. ``echo`` gets one line per point; ``progress`` shows a bar
    (tqdm) instead, with the lines above it. ``runs`` keeps points and logs in memory (and
    takes those it already has from there): the lesson's cells and panel share one.
    """
    for v in variants:
        recipe.task(v)  # unknown variants fail before anything runs
    grid = [(v, float(lr), s) for v in variants for lr in lrs for s in seeds]
    done: dict[tuple[str, float, int], Point] = {}
    csv_path = None
    if out is not None:
        out = os.fspath(out)
        os.makedirs(os.path.join(out, "runs"), exist_ok=True)
        meta = os.path.join(out, "sweep.json")
        mine = dataclasses.asdict(recipe)
        if os.path.exists(meta):
            with open(meta, encoding="utf-8") as f:  # a field added since reads as its default
                theirs = {fld.name: fld.default for fld in dataclasses.fields(Recipe)} | json.load(f)
            if theirs != mine:
                changed = sorted(k for k in mine if theirs.get(k) != mine[k])
                raise ValueError(f"{out} holds a sweep of another recipe (differs in {changed}): give "
                                 "another --out, or delete the folder to start over.")
        else:
            with open(meta, "w", encoding="utf-8") as f:
                json.dump(mine, f, indent=1)
        csv_path = os.path.join(out, "sweep.csv")
        if os.path.exists(csv_path) and os.path.getsize(csv_path):
            with open(csv_path, encoding="utf-8", newline="") as f:
                header = next(csv.reader(f), [])
            if header != _COLUMNS:
                raise ValueError(f"{csv_path} has the columns {header}, not this labkit's {_COLUMNS}: give "
                                 "another --out, or delete the folder to start over.")
        from ..logfile import cut_torn_tail  # here: --help loads this module without torch

        # first, the log writer's rule: a row cut short may still parse, so a row without its newline is torn
        cut_torn_tail(csv_path, complete=lambda row: False, warn=False)
        done = {(p.variant, p.lr, p.seed): p for p in _read_points(csv_path)}
        if not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0:
            with open(csv_path, "w", encoding="utf-8", newline="") as f:
                csv.writer(f).writerow(_COLUMNS)
    todo = [key for key in grid if key not in done and (runs is None or (recipe, *key) not in runs)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(grid), initial=len(grid) - len(todo), unit="run", file=sys.stderr)
    def say(line: str) -> None:
        if bar is not None:
            bar.write(line, file=sys.stdout)
        elif echo is not None:
            echo(line)

    if out is not None and len(todo) < len(grid):
        say(f"resuming: {len(grid) - len(todo)} of {len(grid)} points already in {csv_path}")
    for n, (variant, lr, seed) in enumerate(todo, start=len(grid) - len(todo) + 1):
        log_path = None
        if out is not None:
            log_path = os.path.join(out, "runs", _run_name(variant, lr, seed) + ".jsonl")
            if os.path.exists(log_path):
                os.remove(log_path)  # a run stopped half-way: it starts again from step 0
        point, log, _ = run_point(recipe, variant, lr, seed, log_path=log_path)
        if runs is not None:
            runs.put(recipe, point, log)
        done[(variant, lr, seed)] = point
        if csv_path is not None:
            with open(csv_path, "a", encoding="utf-8", newline="") as f:
                csv.writer(f).writerow([getattr(point, c) for c in _COLUMNS])
        say(f"[{n:>{len(str(len(grid)))}}/{len(grid)}] {variant} lr {lr:g} seed {seed}: final loss "
            f"{point.final_loss:.3f}, largest attention logit {point.attn_logit_max:.3g}, log Z at the end "
            f"{point.log_z_final:.2f}"
            + (f", {point.skipped} skipped" if point.skipped else "") + f" ({point.seconds:.1f} s)")
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if runs is not None:
        done.update({key: runs.get(recipe, *key)[0] for key in grid if key not in done})
    return [done[key] for key in grid]


def _by_variant(points: Sequence[Point]) -> dict[str, dict[float, list[Point]]]:
    table: dict[str, dict[float, list[Point]]] = {}
    for p in points:
        table.setdefault(p.variant, {}).setdefault(p.lr, []).append(p)
    return table


def summarize(points: Sequence[Point], tolerance: float = 0.1) -> dict[str, dict[str, Any]]:
    """Return per variant: best loss and its lr, LR sensitivity (mean over seeds), stable lrs, top lr's logit.

    >>> p = lambda v, lr, loss, a: Point(v, lr, 0, loss, 5.0, loss, a, a, 4.0, 0, -1, 0.0, 1.0)
    >>> s = summarize([p("baseline", 0.01, 2.4, 50.0), p("baseline", 0.1, 2.9, 2e4)])["baseline"]
    >>> s["best_lr"], s["sensitivity"], s["stable_lrs"], s["attn_logit_max_top_lr"]
    (0.01, 0.25, [0.01], 20000.0)
    """
    out: dict[str, dict[str, Any]] = {}
    for variant, by_lr in _by_variant(points).items():
        seeds = sorted({p.seed for ps in by_lr.values() for p in ps})
        per_seed = []
        for s in seeds:
            final = {lr: p.final_loss for lr, ps in by_lr.items() for p in ps if p.seed == s}
            init = next(p.init_loss for ps in by_lr.values() for p in ps if p.seed == s)
            per_seed.append(lr_sensitivity(final, init))
        mean = {lr: sum(p.final_loss for p in ps) / len(ps) for lr, ps in sorted(by_lr.items())}
        best_lr = min(mean, key=lambda lr: mean[lr] if math.isfinite(mean[lr]) else math.inf)
        top = max(by_lr)
        out[variant] = {
            "best_lr": best_lr, "best_loss": mean[best_lr], "sensitivity": sum(per_seed) / len(per_seed),
            "sensitivity_per_seed": per_seed, "stable_lrs": stable_lrs(mean, tolerance),
            "attn_logit_max_top_lr": max(p.attn_logit_max for p in by_lr[top]), "seeds": len(seeds),
        }
    return out


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
    "logit": (lambda r: _peak(r.attn_logit_max.values()), "largest attention logit",
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
    for i, (variant, by_lr) in enumerate(_by_variant(points).items()):
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
            values = [_peak(r.attn_logit_max.values()) for r in log]
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
        self._lock, self._running, self._pending = threading.Lock(), False, False
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
        with self._lock:
            if self._running:
                self._pending = True
                return
            self._running = True
        try:
            while True:
                self._run_once()
                with self._lock:
                    if not self._pending:
                        break
                    self._pending = False
        finally:
            with self._lock:
                self._running = self._pending = False

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


def _floats(text: str) -> list[float]:
    try:
        if ":" in text:
            low, high, count = text.split(":")
            return lr_grid(float(low), float(high), int(count))
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"give a comma list (1e-3,1e-2) or low:high:count (1e-4:1:9): "
                                         f"{e}") from None
    if not values or not all(0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"learning rates must be finite numbers > 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labkit sweep",
        description="Final loss against learning rate on the GPT task, with and without qk-layernorm and "
                    "z-loss (Wortsman et al. 2023, Fig. 1): writes sweep.csv, sweep.png and each run's "
                    "log.jsonl; run it again to resume a grid stopped half-way.",
    )
    d = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(Recipe)})  # no torch for --help
    p.add_argument("--lrs", type=_floats, default=lr_grid(1e-4, 1.0, 9),
                   help="learning rates: 1e-3,1e-2 or low:high:count, log-spaced (default 1e-4:1:9)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)} (default all)")
    p.add_argument("--seeds", default="0", help="comma list of seeds (default 0)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"steps per run (default {d.steps})")
    sizes = (("n_layer", "layers"), ("n_head", "heads"), ("n_embd", "width"), ("block_size", "context"),
             ("batch_size", "batch"))
    for name, flag in sizes:
        default = getattr(d, name)
        p.add_argument(f"--{flag}", type=int, default=default, help=f"{name} (default {default})")
    p.add_argument("--precision", choices=list(PRECISIONS), default=d.precision,
                   help="fp16 runs with the dynamic loss scaler (slow on a CPU without native fp16)")
    p.add_argument("--attention", choices=["sdpa", "explicit"], default=d.attention,
                   help="explicit forms q @ k.T as a tensor, which overflows in fp16 (default sdpa)")
    p.add_argument("--warmup", type=float, default=d.warmup,
                   help=f"warm-up, a fraction of the steps (default {d.warmup}; Wortsman et al. 0.05)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default=d.schedule,
                   help="after the warm-up: cosine decay to 0, or the lr held constant (default cosine)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"independent weight decay (default {d.weight_decay:g}; 0: the setting of their "
                        "output-logit divergence, §3.1.2)")
    p.add_argument("--z-loss", type=float, default=d.z_loss,
                   help=f"z-loss coefficient of the z_loss variants (default {d.z_loss:g})")
    p.add_argument("--untied-head", action="store_true",
                   help="give the output head its own weight, as in Wortsman et al.'s models (default: "
                        "tied to the token embedding, nanoGPT's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default=os.path.join("runs", "sweep"), help="folder (default runs/sweep)")
    p.add_argument("--no-progress", action="store_true",
                   help="plain lines, no progress bar (the default without a tty)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: give a comma list of ints, got {args.seeds!r}")
    try:
        recipe = Recipe(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.context,
                        batch_size=args.batch, steps=args.steps, precision=args.precision,
                        attention=args.attention, device=args.device, warmup=args.warmup,
                        schedule=args.schedule, weight_decay=args.weight_decay, z_loss=args.z_loss,
                        tie_head=not args.untied_head)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out: {out!r} is a file, not a folder")
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        points = sweep(recipe, args.lrs, variants, seeds, out=out, echo=print, progress=progress)
    except ValueError as e:
        print(f"labkit sweep: {e}", file=sys.stderr)
        return 2
    summary = summarize(points)
    print(f"\n{len(points)} runs, {len(args.lrs)} learning rates {args.lrs[0]:g} .. {args.lrs[-1]:g}, "
          f"seeds {seeds}, {recipe.steps} steps, {recipe.precision}, {recipe.schedule} lr after "
          f"{recipe.warmup:.0%} warm-up, weight decay {recipe.weight_decay:g}, "
          f"{'tied' if recipe.tie_head else 'untied'} head")
    for variant, s in summary.items():
        stable = s["stable_lrs"]
        sensitivity = f"{s['sensitivity']:.3f}" if len(args.lrs) > 1 else "- (one lr)"
        print(f"  {variant:<15} best {s['best_loss']:.3f} at lr {s['best_lr']:g}, LR sensitivity "
              f"{sensitivity}, within 0.1 of best for lr "
              f"{f'{stable[0]:g} .. {stable[-1]:g}' if stable else 'none'}, "
              f"largest attention logit at lr {max(args.lrs):g}: {s['attn_logit_max_top_lr']:.3g}")
    traces, trace_lr = _traces(out, points, seeds[0])
    fig = plot_sweep(points, traces, trace_lr=trace_lr, overflow_at=recipe.fp16_logit_limit)
    fig.savefig(os.path.join(out, "sweep.png"), dpi=100)
    print(f"files: {os.path.join(out, 'sweep.csv')}, sweep.png, runs/*.jsonl")
    return 0


def _traces(out: str, points: Sequence[Point], seed: int) -> tuple[dict[str, StepLog], float | None]:
    """The per-step logs at the lowest lr where the baseline is out of its stable range (or the largest)."""
    from ..steplog import StepLog

    summary = summarize(points)
    lrs = sorted({p.lr for p in points})
    if "baseline" in summary:
        stable = summary["baseline"]["stable_lrs"]
        beyond = [lr for lr in lrs if stable and lr > stable[-1]]
        lr = beyond[0] if beyond else lrs[-1]
    else:
        lr = lrs[-1]
    traces = {}
    for variant in _by_variant(points):
        path = os.path.join(out, "runs", _run_name(variant, lr, seed) + ".jsonl")
        if os.path.exists(path):
            traces[variant] = StepLog.read_jsonl(path)
    return traces, lr
