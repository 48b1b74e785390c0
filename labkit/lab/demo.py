"""The headless demo: ``python -m labkit demo`` trains the toy task through injected faults.

Under ``torchrun --nproc_per_node=N -m labkit demo`` it joins the job (nccl on CUDA, one GPU
per local rank; gloo on CPU), wraps the model in DDP (or FSDP2 with ``--parallel fsdp2``),
gives each rank its slice of every global batch, and lets rank 0 alone print and write.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import warnings
from typing import TYPE_CHECKING

from ..names import PRECISIONS
from .text import describe as _describe
from .text import format_scale as _format_scale
from .text import title as _title

# torch, tqdm and matplotlib are imported where they are used, after the flags are parsed:
# `--help` and a bad flag answer at once instead of after torch's import (seconds).
if TYPE_CHECKING:
    import torch

    from ..records import StepRecord
    from ..steplog import StepLog
    from .experiment import ExperimentConfig

__all__ = ["build_parser", "init_distributed", "main", "run_demo"]

DEFAULT_FAULTS = ["50:spike:10", "120:nan", "200-204:overflow"]
# The GPT needs no injected fault (its overflows come by themselves) and SGD's lr for it is higher.
TASK_DEFAULTS = {"toy": {"faults": DEFAULT_FAULTS, "lr": 0.05}, "gpt": {"faults": [], "lr": 0.3}}
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: a loss scale lives in float32


def _max_norm(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 or 'none', got {text!r}")
    return value


def _positive(kind: type, most: float = math.inf) -> object:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__} > 0, got {text!r}") from None
        if not value > 0 or (kind is float and math.isinf(value)):
            raise argparse.ArgumentTypeError(f"must be a finite {kind.__name__} > 0, got {text!r}")
        if value > most:
            raise argparse.ArgumentTypeError(
                f"must be at most {most:g} (float32's largest number), got {text!r}"
            )
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labkit demo",
        description="Train the built-in toy task through injected bad batches and show what the safety "
                    "belts did.",
    )
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp16",
                   help="fp16 runs with a dynamic loss scaler, fp32 and bf16 without (default fp16)")
    p.add_argument(
        "--max-norm", type=_max_norm, default=1.0, help="clipping threshold, or 'none' (default 1.0)"
    )
    p.add_argument("--init-scale", type=_positive(float, FLOAT32_MAX), default=2.0**10,
                   help="initial loss scale, at most 3.4e38 (default 1024)")
    p.add_argument("--growth-interval", type=_positive(int), default=50,
                   help="clean steps before the scale grows (default 50)")
    p.add_argument("--steps", type=_positive(int), default=300, help="training steps (default 300)")
    p.add_argument("--lr", type=_positive(float),
                   help="SGD learning rate, momentum 0.9 (default 0.05 for toy, 0.3 for gpt)")
    p.add_argument("--task", choices=list(TASK_DEFAULTS), default="toy",
                   help="toy (regression, default) or gpt (a small GPT on the Python stdlib's source, "
                        "no faults by default)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="data and weights (default 0)")
    p.add_argument(
        "--inject", action="append", metavar="STEP:KIND[:MAG]",
        help=f"a fault: spike, nan, inf or overflow, e.g. 50:spike:1000 or 200-204:overflow (repeatable; "
        f"default {' '.join(DEFAULT_FAULTS)}; --inject none for a clean run)",
    )
    p.add_argument("--out", default=os.path.join("runs", "demo"),
                   help="folder for log.jsonl, log.csv, demo.png (default runs/demo)")
    p.add_argument("--parallel", choices=["ddp", "fsdp2"],
                   help="under torchrun: wrap the model in DDP (default) or FSDP2")
    p.add_argument("--fault-rank", type=int, metavar="R",
                   help="under torchrun: inject the faults on rank R only (default: every rank)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-to", metavar="TRACKERS",
                   help="also stream the records to trackers under --out: tensorboard,trackio,mlflow,wandb "
                   "(each an extra: pip install 'labkit[tensorboard]')")
    return p


def init_distributed(device: torch.device) -> torch.device:
    """Join the torchrun job (nccl on CUDA, gloo on CPU) and return this rank's device."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _final_loss(log: StepLog, summary: dict) -> str:
    if summary["steps"] > summary["skipped"]:
        return f"{summary['final_loss']:.4g}"
    # StepLog's final loss is the last *stepped* one; with none stepped, nan would read as a NaN loss
    finite = [r.loss for r in log if math.isfinite(r.loss)]
    last = f"; the last finite loss was {finite[-1]:.4g}" if finite else ""
    return f"none: every step was skipped, the model never stepped{last}"


def run_demo(config: ExperimentConfig, out: str, *, progress: bool = True, echo=print,
             log_to: str | None = None) -> StepLog:
    """Run ``config``, echo one line per event, write the log files and the figure into ``out``.

    Under an initialized process group every rank trains (on its slice of each global batch)
    and only rank 0 echoes and writes: the records are the same on every rank, except that a
    fault injected on ``config.fault_rank`` alone is named from the schedule. ``progress``
    is tqdm's bar (on stderr) when stdout and stderr are terminals; otherwise (``> run.log``,
    a pipe, a notebook) a plain ``progress`` line every tenth of the run, in order with the
    events, since a bar's carriage-return redraws would fill a file with frames.
    """
    import torch.distributed as dist
    from tqdm import tqdm

    from ..distributed import is_distributed, rank
    from .experiment import run_experiment
    from .plots import plot_log

    lead = rank() == 0
    progress = progress and lead
    if not lead:
        echo = lambda *a, **k: None  # noqa: E731
    world = dist.get_world_size() if is_distributed() else 1
    schedule = config.fault_schedule()
    elsewhere = config.fault_rank is not None and config.fault_rank != rank()
    os.makedirs(out, exist_ok=True)
    partial = os.path.join(out, "log.jsonl.partial")
    live = progress and _is_terminal(sys.stdout) and _is_terminal(sys.stderr)
    every = max(1, math.ceil(config.steps / 10)) if progress and not live else 0
    bar = tqdm(total=config.steps, disable=not live, unit="step", file=sys.stderr)
    scaler = config.precision == "fp16" and config.loss_scaling

    def report(record: StepRecord) -> None:
        fault = f"{schedule[record.step].label} on rank {config.fault_rank}" if (
            elsewhere and record.step in set(schedule)) else None
        for line in _describe(record, config.max_norm, fault):
            if live:
                tqdm.write(line, file=sys.stdout)
            else:
                echo(line)
        done = record.step + 1
        if every and (done % every == 0 or done == config.steps):
            scale = f", scale {_format_scale(record.next_scale)}" if scaler else ""
            count = f"{done:>{len(str(config.steps))}}/{config.steps}"
            echo(f"progress {count} steps ({done / config.steps:.0%}), loss {record.loss:.4g}{scale}")
        bar.set_postfix(loss=f"{record.loss:.3g}", scale=_format_scale(record.scale), refresh=False)
        bar.update()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = run_experiment(config, report, log_path=partial, log_to=log_to, log_dir=out)
    bar.close()
    for w in caught:
        echo(f"WARNING {w.category.__name__}: {w.message}")
    if not lead:
        return log
    os.replace(partial, os.path.join(out, "log.jsonl"))
    log.to_csv(os.path.join(out, "log.csv"))
    plot_log(log, config.max_norm, title=_title(config, world)).savefig(
        os.path.join(out, "demo.png"), dpi=100
    )
    s = log.summary()
    rows = [
        ("steps", s["steps"]),
        *([("ranks", f"{world} ({config.parallel or 'ddp'}, {dist.get_backend()})")] if world > 1 else []),
        ("skipped", f"{s['skipped']} (" + ", ".join(f"{reason} {count}" for reason, count in
                                                   s["skips_by_reason"].items()) + ")"),
        ("clipped", f"{s['clipped']} ({s['clip_rate']:.1%} of stepped steps)"),
        ("loss scale", f"min {_format_scale(s['min_scale'])}, max {_format_scale(s['max_scale'])}, "
                       f"final {_format_scale(s['final_scale'])}" if scaler
                       else f"none ({config.precision} runs without a loss scaler)"),
        ("final loss", _final_loss(log, s)),
        ("files", f"{os.path.join(out, 'log.jsonl')}, log.csv, demo.png"),
    ]
    echo("\nsummary")
    for key, value in rows:
        echo(f"  {key:<11} {value}")
    return log


def _is_terminal(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def _check_out(parser: argparse.ArgumentParser, out: str) -> str | None:
    """Fail on an ``--out`` that cannot be a folder we write; return the top folder this run will create."""
    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out: {out!r} is a file, not a folder; give a folder (it is created if missing)")
    top = None
    missing = os.path.abspath(out)
    while not os.path.exists(missing):
        top, missing = missing, os.path.dirname(missing)
    if not os.path.isdir(missing) or not os.access(missing, os.W_OK | os.X_OK):
        parser.error(f"--out: cannot create or write {out!r} ({missing!r} is not a writable folder); "
                     "give a folder you can write to")
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".labkit-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        parser.error(f"--out: cannot write into {out!r} ({e.strerror}); give a folder you can write to")
    return top


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # before torch is imported: --help and bad flags answer at once
    task_defaults = TASK_DEFAULTS[args.task]
    specs = args.inject if args.inject is not None else task_defaults["faults"]
    faults = [] if specs == ["none"] else specs
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets it (with RANK, LOCAL_RANK, MASTER_*)
    if world == 1 and args.parallel is not None:
        parser.error("--parallel: launch under torchrun, e.g. torchrun --nproc_per_node=2 -m labkit demo "
                     f"--parallel {args.parallel}")
    from ..export.telemetry import check_trackers, parse_trackers  # no torch: a bad --log-to answers at once

    try:
        check_trackers(parse_trackers(args.log_to))
    except (ValueError, ModuleNotFoundError) as e:
        parser.error(f"--log-to: {e}")
    if args.fault_rank is not None and not 0 <= args.fault_rank < world:
        parser.error(f"--fault-rank: must be a rank in 0..{world - 1}, got {args.fault_rank}")

    import torch

    from ..faults import FaultSchedule
    from .experiment import ExperimentConfig, default_device

    try:
        schedule = FaultSchedule.parse(faults)
    except ValueError as e:
        parser.error(f"--inject: {e}")
    try:
        device = torch.device(args.device or default_device())
    except RuntimeError:
        parser.error(f"--device: unknown device {args.device!r}; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine; use --device cpu")
    try:  # every setting checked before anything is written or a process group joined
        config = ExperimentConfig(
            precision=args.precision, max_norm=args.max_norm, init_scale=args.init_scale,
            growth_interval=args.growth_interval, faults=faults, steps=args.steps, seed=args.seed,
            lr=args.lr if args.lr is not None else task_defaults["lr"],
            device=str(device), parallel=args.parallel, fault_rank=args.fault_rank, task=args.task,
        )
    except ValueError as e:
        parser.error(str(e))
    late = [step for step in schedule if step >= args.steps]
    if late and int(os.environ.get("RANK", "0")) == 0:
        which = "the default --inject" if args.inject is None else "--inject"
        print(f"note: {which} puts faults at steps {_ranges(late)}, past the last step ({args.steps - 1}); "
              f"they never fire (raise --steps to see them)", file=sys.stderr)
    fingerprint = getattr(config.make_task(), "fingerprint", None)
    # the data a run saw: equal hashes, equal text
    if fingerprint is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"task {args.task}: data sha256 {fingerprint}")
    created = _check_out(parser, args.out) if int(os.environ.get("RANK", "0")) == 0 else None
    if world > 1:
        device = init_distributed(device)
        config = dataclasses.replace(config, device=str(device))
    try:
        run_demo(config, args.out, progress=not args.no_progress, log_to=args.log_to)
        if world > 1:
            import torch.distributed as dist

            # every rank done before any tears gloo down: without it a rank aborted at exit
            # ("terminate called without an active exception", SIGABRT) in 2 of ~20 runs of
            # tests/test_distributed.py's torchrun demo, seemingly as its peer closed the sockets
            dist.barrier()
    except BaseException:
        if created is not None:  # a run that failed leaves no folder of its own behind
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _ranges(steps: list[int]) -> str:
    """``[5, 6, 7, 9]`` -> ``"5-7, 9"``."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
