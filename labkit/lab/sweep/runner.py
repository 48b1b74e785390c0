"""Running the sweep: one point (``run_point``), a memory of points run (``Runs``), a whole grid (``sweep``).

Each point is one ``run_experiment`` of ``Recipe.config`` followed by its validation loss;
``sweep`` runs a grid in order, keeping each finished point in a folder (``store``) so that a
grid stopped half-way resumes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .analysis import peak
from .recipe import VARIANTS, Point, Recipe
from .store import append_point, log_file, open_folder

if TYPE_CHECKING:
    from ...records import StepRecord
    from ...steplog import StepLog

__all__ = ["Runs", "run_point", "sweep"]


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



def run_point(recipe: Recipe, variant: str, lr: float, seed: int = 0, *,
              watch: Callable[[StepRecord, Any], None] | None = None,
              log_path: str | os.PathLike | None = None) -> tuple[Point, StepLog, Any]:
    """Train one point of the grid; return its ``Point``, its log and the trained model.

    ``watch(record, model)`` sees each record with the model as that step left it (a skipped
    step leaves the weights its forward used: that forward can be run again, e.g. in fp32).
    """
    from ...alarms import RepeatedClippingWarning
    from ..experiment import one_thread_on_cpu, run_experiment

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
    with one_thread_on_cpu(model.wte.weight.device):  # as small as the training's forwards (see there)
        final = task.val_loss(model, batches=recipe.val_batches)
        init = task.val_loss(task.model(model.wte.weight.device), batches=recipe.val_batches)
    stepped = [r.loss for r in log if not r.skipped]
    tail = stepped[-max(1, len(log) // 10):]
    point = Point(
        variant=variant, lr=float(lr), seed=seed, final_loss=final, init_loss=init,
        train_loss=sum(tail) / len(tail) if tail else math.nan,
        attn_logit_max=peak(v for r in log for v in r.attn_logit_max.values()),
        attn_logit_final=peak(log[-1].attn_logit_max.values()),
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
        csv_path, done = open_folder(out, recipe)
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
            log_path = log_file(out, variant, lr, seed)
            if os.path.exists(log_path):
                os.remove(log_path)  # a run stopped half-way: it starts again from step 0
        point, log, _ = run_point(recipe, variant, lr, seed, log_path=log_path)
        if runs is not None:
            runs.put(recipe, point, log)
        done[(variant, lr, seed)] = point
        if csv_path is not None:
            append_point(csv_path, point)
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
