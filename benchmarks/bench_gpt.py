"""Steps per second of the GPT task's default config on this machine, against the issue's budget.

    python benchmarks/bench_gpt.py [--steps 200] [--options] [--panel]

The issue's budget: 200 fp16 steps <= 10 s on 2 CPU cores. Each row is one ``run_experiment`` of
``ExperimentConfig(task="gpt")`` at the default size for the device (``GPTTask.for_device``),
after a 5-step warm-up (on a CPU ``run_experiment`` uses one intra-op thread: a second costs more
than it saves on matrices this small); wall and process CPU time are both printed, since on a
shared machine the wall time says more about the neighbours than the code.

``--options`` times each stability option of ``GPTTask`` (qk-layernorm, z-loss, soft-caps,
the explicit attention path) and the logit measurements themselves (``measure=False`` is the
step without them) against the baseline, in fp32 and fp16, each the best of ``--repeats``
interleaved runs, as a ratio to the baseline's CPU time. ``--panel`` times lesson 07's
``SweepPanel``: a toggle that trains one new run and redraws, and one that redraws a run it has.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import subprocess
import time
import warnings

import torch

from labkit.lab.experiment import ExperimentConfig, default_device, run_experiment
from labkit.tasks import GPTTask, make_task


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    fp16 = "native fp16" if "avx512_fp16" in flags else "no native fp16"
    return f"{fields.get('Model name', '?').strip()} ({isa}, {fp16})"


OPTIONS = {
    "no measurements": {"measure": False},
    "baseline (measured)": {},
    "qk_norm": {"qk_norm": True},
    "z_loss 1e-4": {"z_loss": 1e-4},
    "logit_softcap 30": {"logit_softcap": 30.0},
    "explicit attention": {"attention": "explicit"},
    "explicit + attn_softcap 50": {"attention": "explicit", "attn_softcap": 50.0},
}


def bench_options(task: GPTTask, steps: int, repeats: int, device: str) -> None:
    """Print each option's steps/s and CPU time relative to the measured baseline."""
    print(f"\nstability options, {steps} steps, AdamW lr 3e-3, best of {repeats} interleaved runs")
    print(f"{'option':28s} {'precision':9s} {'cpu s':>7s} {'steps/s':>8s} {'vs baseline':>11s}")
    for precision in ("fp32", "fp16"):
        best = {name: (math.inf, math.inf) for name in OPTIONS}
        for _ in range(repeats):
            for name, options in OPTIONS.items():
                config = ExperimentConfig(task=dataclasses.replace(task, **options), precision=precision,
                                          optimizer="adamw", lr=3e-3, steps=steps, device=device)
                wall, cpu = time.perf_counter(), time.process_time()
                run_experiment(config)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                best[name] = min(best[name], (cpu, wall))
        base = best["baseline (measured)"][0]
        for name, (cpu, _wall) in best.items():
            print(f"{name:28s} {precision:9s} {cpu:7.2f} {steps / cpu:8.1f} {cpu / base:10.3f}x")


def bench_panel(device: str) -> None:
    """Print lesson 07's toggle times: a new setting (one run, then a redraw) and one already run."""
    from labkit.lab.sweep import Recipe, Runs, SweepPanel

    recipe, runs = Recipe.lesson(device), Runs()
    panel = SweepPanel(recipe, [0.1], lr=0.1, runs=runs)  # trains the baseline at 0.1 first
    for toggle, what in (("qk_norm", "new setting: one run + redraw"), ("qk_norm", "back: redraw only")):
        cpu = time.process_time()
        panel.controls[toggle].value = not panel.controls[toggle].value
        print(f"07 panel, {what:30s} {panel.seconds:6.2f} s wall, {time.process_time() - cpu:6.2f} s cpu "
              f"({recipe.steps} steps; budget 3 s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--options", action="store_true",
                        help="time the stability options and the measurements")
    parser.add_argument("--repeats", type=int, default=3, help="runs per option (the best counts; default 3)")
    parser.add_argument("--panel", action="store_true", help="time lesson 07's toggle")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    device = default_device()
    task = make_task("gpt", device=device)
    machine = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    print(f"torch {torch.__version__}, {device}: {machine}, {torch.get_num_threads()} cores for torch, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"GPT {task.n_layer} layers, width {task.n_embd}, context {task.block_size}, "
          f"batch {task.batch_size}; data sha256 {task.fingerprint[:16]}")
    print(f"{'precision':10s} {'steps':>6s} {'wall s':>8s} {'cpu s':>8s} {'steps/s':>8s}")
    for precision in ("fp32", "fp16", "bf16"):
        config = ExperimentConfig(task="gpt", precision=precision, optimizer="adam", lr=3e-3,
                                  growth_interval=50, steps=args.steps, device=device)
        run_experiment(dataclasses.replace(config, steps=5))  # warm-up: lazy imports, allocator
        wall, cpu = time.perf_counter(), time.process_time()
        run_experiment(config)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"{precision:10s} {args.steps:6d} {wall:8.2f} {cpu:8.2f} {args.steps / wall:8.1f}")
    if args.options:
        bench_options(task, args.steps, args.repeats, device)
    if args.panel:
        bench_panel(device)


if __name__ == "__main__":
    main()
