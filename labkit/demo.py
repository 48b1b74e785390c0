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

from .distributed import is_distributed, rank
from .faults import FaultSchedule
from .plots import plot_log
from .records import StepLog, StepRecord
from .scaler import GradScaler
from .step import PRECISIONS, TrainStep
from .task import ToyTask

__all__ = ["build_parser", "describe", "init_distributed", "main", "parallelize", "run_demo"]

DEFAULT_FAULTS = ["50:spike:10", "120:nan", "200-204:overflow"]


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
    p.add_argument("--lr", type=_positive(float), default=0.05)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
            f"gradient not finite (first: {record.first_nonfinite})")
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


def parallelize(model: torch.nn.Module, how: str, device: torch.device) -> torch.nn.Module:
    """Return ``model`` wrapped for data parallelism: ``"ddp"`` or ``"fsdp2"`` (each Linear, then the root)."""
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def run_demo(args: argparse.Namespace, echo=print) -> StepLog:
    """Train as ``args`` says, echo one line per event, write the log files and the figure.

    Under an initialized process group each rank trains on its slice of the global batch
    and only rank 0 echoes and writes.
    """
    device = torch.device(args.device)
    world, lead = (dist.get_world_size(), rank() == 0) if is_distributed() else (1, True)
    parallel = args.parallel or "ddp"
    if not lead:
        echo = lambda *a, **k: None  # noqa: E731
    task = ToyTask(seed=args.seed)
    model = task.model(device)
    if world > 1:
        model = parallelize(model, parallel, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = GradScaler(device.type, init_scale=args.init_scale, growth_interval=args.growth_interval,
                        enabled=args.precision == "fp16")
    os.makedirs(args.out, exist_ok=True)
    faults = args.faults if args.fault_rank in (None, rank()) else FaultSchedule()
    step = TrainStep(model, optimizer, task.loss_fn, precision=args.precision, max_norm=args.max_norm,
                     scaler=scaler, faults=faults, log_path=os.path.join(args.out, "log.jsonl.partial"))
    bar = tqdm(range(args.steps), disable=args.no_progress or not lead, unit="step", file=sys.stderr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in bar:
            inputs, targets = (t.tensor_split(world)[rank()] for t in task.batch(i, device))
            record = step(inputs, targets)
            for line in describe(record, args.max_norm):
                if args.no_progress or not lead:
                    echo(line)
                else:
                    tqdm.write(line, file=sys.stdout)
            bar.set_postfix(loss=f"{record.loss:.3g}", scale=f"{record.scale:g}", refresh=False)
    bar.close()
    step.log.close()
    for w in caught:
        echo(f"WARNING {w.category.__name__}: {w.message}")
    log = step.log
    if not lead:  # the records are the same on every rank; rank 0 writes them
        return log
    os.replace(os.path.join(args.out, "log.jsonl.partial"), os.path.join(args.out, "log.jsonl"))
    log.to_csv(os.path.join(args.out, "log.csv"))
    plot_log(log, args.max_norm, title=f"labkit demo: {args.precision}, max_norm={args.max_norm}").savefig(
        os.path.join(args.out, "demo.png"), dpi=100)
    s = log.summary()
    rows = [
        ("steps", s["steps"]),
        *([("ranks", f"{world} ({parallel}, {dist.get_backend()})")] if world > 1 else []),
        ("skipped", f"{s['skipped']} (nonfinite_loss {s['skips_by_reason']['nonfinite_loss']}, "
                    f"nonfinite_grad {s['skips_by_reason']['nonfinite_grad']})"),
        ("clipped", f"{s['clipped']} ({s['clip_rate']:.1%} of stepped steps)"),
        ("loss scale", f"min {s['min_scale']:g}, max {s['max_scale']:g}, final {s['final_scale']:g}"),
        ("final loss", f"{s['final_loss']:.4g}"),
        ("files", f"{os.path.join(args.out, 'log.jsonl')}, log.csv, demo.png"),
    ]
    echo("\nsummary")
    for key, value in rows:
        echo(f"  {key:<11} {value}")
    return log


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    specs = args.inject if args.inject is not None else DEFAULT_FAULTS
    try:
        args.faults = FaultSchedule.parse([] if specs == ["none"] else specs)
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
    if world == 1:
        run_demo(args)
        return 0
    args.device = str(init_distributed(device))
    try:
        run_demo(args)
    finally:
        dist.destroy_process_group()
    return 0
