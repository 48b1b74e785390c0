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

One module per job, each importing only those listed before it: ``recipe`` (what a point is),
``analysis`` (what the points say), ``store`` (the folder on disk), ``runner`` (running points),
``plots`` (the figures), ``panel`` (the widget), ``cli`` (the command line).
"""

from .analysis import lr_sensitivity, stable_lrs, summarize
from .cli import build_parser, main
from .panel import SweepPanel
from .plots import plot_runs, plot_sweep
from .recipe import SCHEDULES, VARIANTS, Point, Recipe, lr_grid
from .runner import Runs, run_point, sweep

__all__ = ["SCHEDULES", "VARIANTS", "Point", "Recipe", "Runs", "SweepPanel", "build_parser", "lr_grid",
           "lr_sensitivity", "main", "plot_runs", "plot_sweep", "run_point", "stable_lrs", "summarize",
           "sweep"]
