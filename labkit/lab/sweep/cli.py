"""``python -m labkit sweep``: run a grid into a folder, print the summary, draw ``sweep.png``.

The parser is built from ``Recipe``'s defaults without importing torch, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...names import PRECISIONS
from .analysis import by_variant, summarize
from .plots import plot_sweep
from .recipe import SCHEDULES, VARIANTS, Point, Recipe, lr_grid
from .runner import sweep
from .store import log_file

if TYPE_CHECKING:
    from ...steplog import StepLog

__all__ = ["build_parser", "main"]


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
    """Return the parser of ``python -m labkit sweep``, each flag with ``Recipe``'s default."""
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
    """Run ``python -m labkit sweep`` with ``argv``; return the exit status (2: a bad folder or recipe)."""
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
    from ...steplog import StepLog

    summary = summarize(points)
    lrs = sorted({p.lr for p in points})
    if "baseline" in summary:
        stable = summary["baseline"]["stable_lrs"]
        beyond = [lr for lr in lrs if stable and lr > stable[-1]]
        lr = beyond[0] if beyond else lrs[-1]
    else:
        lr = lrs[-1]
    traces = {}
    for variant in by_variant(points):
        path = log_file(out, variant, lr, seed)
        if os.path.exists(path):
            traces[variant] = StepLog.read_jsonl(path)
    return traces, lr
