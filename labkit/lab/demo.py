"""The headless demo: ``python -m labkit demo`` trains the toy task through injected faults.

Under ``torchrun --nproc_per_node=N -m labkit demo`` it joins the job (nccl on CUDA, one GPU
per local rank; gloo on CPU), wraps the model in DDP (or FSDP2 with ``--parallel fsdp2``),
gives each rank its slice of every global batch, and lets rank 0 alone print and write.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..distributed import is_distributed, rank
from .experiment import ExperimentConfig, default_device, run_experiment
from ..faults import FaultSchedule
from .plots import plot_log
from ..records import StepLog, StepRecord
from ..step import PRECISIONS

__all__ = ["build_parser", "describe", "init_distributed", "main", "run_demo"]

DEFAULT_FAULTS = ["50:spike:10", "120:nan", "200-204:overflow"]
# The GPT needs no injected fault (its overflows come by themselves) and SGD's lr for it is higher.
TASK_DEFAULTS = {"toy": {"faults": DEFAULT_FAULTS, "lr": 0.05}, "gpt": {"faults": [], "lr": 0.3}}


def _max_norm(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 or 'none', got {text!r}")
    return value


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__} > 0, got {text!r}") from None
        if not value > 0 or (kind is float and math.isinf(value)):
            raise argparse.ArgumentTypeError(f"must be a finite {kind.__name__} > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labkit demo",
        description="Train the built-in toy task through injected bad batches and show what the safety belts did.",
    )
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp16")
    p.add_argument("--max-norm", type=_max_norm, default=1.0, help="clipping threshold, or 'none' (default 1.0)")
    p.add_argument("--init-scale", type=_positive(float), default=2.0**10, help="initial loss scale (default 1024)")
    p.add_argument("--growth-interval", type=_positive(int), default=50, help="clean steps before the scale grows (default 50)")
    p.add_argument("--steps", type=_positive(int), default=300)
    p.add_argument("--lr", type=_positive(float), help="learning rate (default 0.05 for toy, 0.3 for gpt)")
    p.add_argument("--task", choices=list(TASK_DEFAULTS), default="toy",
                   help="toy (regression, default) or gpt (a small GPT on the Python stdlib's source, no faults by default)")
    p.add_argument("--device", default=default_device())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--inject", action="append", metavar="STEP:KIND[:MAG]",
        help=f"a fault: spike, nan, inf or overflow, e.g. 50:spike:1000 or 200-204:overflow (repeatable; "
        f"default {' '.join(DEFAULT_FAULTS)}; --inject none for a clean run)",
    )
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="folder for log.jsonl, log.csv, demo.png")
    p.add_argument("--parallel", choices=["ddp", "fsdp2"],
                   help="under torchrun: wrap the model in DDP (default) or FSDP2")
    p.add_argument("--fault-rank", type=int, metavar="R",
                   help="under torchrun: inject the faults on rank R only (default: every rank)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def describe(record: StepRecord, max_norm: float | None) -> list[str]:
    """Return the event lines for one record: a skip, a clip, a change of loss scale."""
    lines, fault = [], f" [fault {record.fault}]" if record.fault else ""
    if record.skipped:
        what = "loss is not finite: backward skipped, scale untouched" if record.reason == "nonfinite_loss" else (
            f"gradient not finite (first: {record.first_nonfinite})" if record.first_nonfinite is not None else
            "gradient norm not finite, every gradient finite: their sum of squares overflowed float32")
        lines.append(f"step {record.step:4d}  SKIP  {record.reason}: {what}{fault}")
    elif record.clipped:
        top = ", ".join(f"{n}={v:.3g}" for n, v in record.top_grads)
        lines.append(
            f"step {record.step:4d}  CLIP  norm {record.grad_norm:.4g} > max_norm {max_norm:g} "
            f"(x{record.clip_coef:.3g}); largest: {top}{fault}"
        )
    if record.next_scale != record.scale:
        verb = "backoff" if record.next_scale < record.scale else "growth"
        lines.append(f"step {record.step:4d}  SCALE {record.scale:g} -> {record.next_scale:g} ({verb})")
    return lines


def init_distributed(device: torch.device) -> torch.device:
    """Join the torchrun job (nccl on CUDA, gloo on CPU) and return this rank's device."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def run_demo(config: ExperimentConfig, out: str, *, progress: bool = True, echo=print) -> StepLog:
    """Run ``config``, echo one line per event, write the log files and the figure into ``out``.

    Under an initialized process group every rank trains (on its slice of each global batch)
    and only rank 0 echoes and writes: the records are the same on every rank.
    """
    lead = rank() == 0
    progress = progress and lead
    if not lead:
        echo = lambda *a, **k: None  # noqa: E731
    os.makedirs(out, exist_ok=True)
    partial = os.path.join(out, "log.jsonl.partial")
    bar = tqdm(total=config.steps, disable=not progress, unit="step", file=sys.stderr)

    def report(record: StepRecord) -> None:
        for line in describe(record, config.max_norm):
            if progress:
                tqdm.write(line, file=sys.stdout)
            else:
                echo(line)
        bar.set_postfix(loss=f"{record.loss:.3g}", scale=f"{record.scale:g}", refresh=False)
        bar.update()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = run_experiment(config, report, log_path=partial)
    bar.close()
    for w in caught:
        echo(f"WARNING {w.category.__name__}: {w.message}")
    if not lead:
        return log
    os.replace(partial, os.path.join(out, "log.jsonl"))
    log.to_csv(os.path.join(out, "log.csv"))
    plot_log(log, config.max_norm, title=f"labkit demo: {config.precision}, max_norm={config.max_norm}").savefig(
        os.path.join(out, "demo.png"), dpi=100)
    s = log.summary()
    world = dist.get_world_size() if is_distributed() else 1
    rows = [
        ("steps", s["steps"]),
        *([("ranks", f"{world} ({config.parallel or 'ddp'}, {dist.get_backend()})")] if world > 1 else []),
        ("skipped", f"{s['skipped']} (nonfinite_loss {s['skips_by_reason']['nonfinite_loss']}, "
                    f"nonfinite_grad {s['skips_by_reason']['nonfinite_grad']})"),
        ("clipped", f"{s['clipped']} ({s['clip_rate']:.1%} of stepped steps)"),
        ("loss scale", f"min {s['min_scale']:g}, max {s['max_scale']:g}, final {s['final_scale']:g}"),
        ("final loss", f"{s['final_loss']:.4g}"),
        ("files", f"{os.path.join(out, 'log.jsonl')}, log.csv, demo.png"),
    ]
    echo("\nsummary")
    for key, value in rows:
        echo(f"  {key:<11} {value}")
    return log


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    task_defaults = TASK_DEFAULTS[args.task]
    specs = args.inject if args.inject is not None else task_defaults["faults"]
    try:
        FaultSchedule.parse([] if specs == ["none"] else specs)
    except ValueError as e:
        parser.error(f"--inject: {e}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: unknown device {args.device!r}; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine; use --device cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets it (with RANK, LOCAL_RANK, MASTER_*)
    if world == 1 and args.parallel is not None:
        parser.error("--parallel: launch under torchrun, e.g. torchrun --nproc_per_node=2 -m labkit demo --parallel "
                     f"{args.parallel}")
    if args.fault_rank is not None and not 0 <= args.fault_rank < world:
        parser.error(f"--fault-rank: must be a rank in 0..{world - 1}, got {args.fault_rank}")
    if world > 1:
        device = init_distributed(device)
    config = ExperimentConfig(
        precision=args.precision, max_norm=args.max_norm, init_scale=args.init_scale,
        growth_interval=args.growth_interval, faults=[] if specs == ["none"] else specs, steps=args.steps,
        lr=args.lr if args.lr is not None else task_defaults["lr"], seed=args.seed, device=str(device),
        parallel=args.parallel, fault_rank=args.fault_rank, task=args.task,
    )
    fingerprint = getattr(config.make_task(), "fingerprint", None)
    if fingerprint is not None and rank() == 0:  # the data a run saw: equal fingerprints, equal text
        print(f"task {args.task}: data sha256 {fingerprint}")
    try:
        run_demo(config, args.out, progress=not args.no_progress)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0
