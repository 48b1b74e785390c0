"""TrainStep against nanoGPT's textbook loop on a nanoGPT-shaped model, side by side in one process.

    python benchmarks/bench_real_loop.py            # 2 layers x 64 wide, G=4 micro-batches of 4 x 16 tokens
    python benchmarks/bench_real_loop.py --quick    # fewer rounds, to check it runs

The model is ``tests/nanogpt.py``'s (nanoGPT's forward signature and two AdamW groups); the
textbook loop is nanoGPT's ``train.py`` step (``loss / G``, ``scaler.scale(loss).backward()``,
``unscale_``, ``clip_grad_norm_``, ``step``, ``update``, reading the loss each step as it logs
it); ``TrainStep`` gets the same G micro-batches as a list, with per-step records and its
defaults (triage off, alarms on). Each round runs both, in turn, for ``--steps`` steps on
models, optimizers and scalers made outside the timer; the figures are medians over the
rounds and the ratio is TrainStep / textbook (below 1: TrainStep is faster). Never asserted in
tests: timings depend on the machine and its load, printed with them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the nanoGPT-shaped model

from nanogpt import G, NanoGPT, get_batch, textbook_step  # noqa: E402

import labkit  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed_runs(precision: str, steps: int, data: list[list[dict]]) -> dict:
    """Return a function per loop, each running ``steps`` steps on fresh state and returning its seconds."""

    def textbook() -> float:
        model = NanoGPT()
        opt, scaler = model.configure_optimizers(), torch.amp.GradScaler("cpu", enabled=precision == "fp16")
        t = time.perf_counter()
        for batches in data[:steps]:
            textbook_step(model, opt, scaler, batches, precision)
        return time.perf_counter() - t

    def trainstep() -> float:
        model = NanoGPT()
        step = labkit.TrainStep(model, model.configure_optimizers(), lambda out: out[1], precision=precision,
                                max_norm=1.0, accumulation_steps=G)
        t = time.perf_counter()
        for batches in data[:steps]:
            step(batches)
        return time.perf_counter() - t

    return {"textbook": textbook, "TrainStep": trainstep}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(1)
    data = [[get_batch(i, m) for m in range(G)] for i in range(args.steps)]
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread; "
          f"load before {os.getloadavg()[0]:.2f}")
    print(f"model: nanoGPT-shaped, 2 layers x 64, G={G} micro-batches of 4 x 16 tokens, {args.steps} steps "
          f"a run, median of {rounds} interleaved rounds")
    for precision in ("fp32", "fp16"):
        fns = timed_runs(precision, args.steps, data)
        times: dict[str, list[float]] = {k: [] for k in fns}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the clip alarm: nanoGPT's early steps clip at 1.0 by design
            for fn in fns.values():  # warm-up
                fn()
            for _ in range(rounds):
                for name, fn in fns.items():
                    times[name].append(fn() / args.steps)
        med = {k: statistics.median(v) for k, v in times.items()}
        ours, theirs = med["TrainStep"], med["textbook"]
        print(f"{precision}: textbook {theirs * 1e3:.2f} ms/step, TrainStep {ours * 1e3:.2f} ms/step, "
              f"ratio {ours / theirs:.3f}")
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
