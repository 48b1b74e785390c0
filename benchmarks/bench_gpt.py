"""Steps per second of the GPT task's default config on this machine (the issue's budget: 200 fp16 steps <= 10 s on 2 CPU cores).

    python benchmarks/bench_gpt.py [--steps 200]

Each row is one ``run_experiment`` of ``ExperimentConfig(task="gpt")`` at the default size for
the device (``GPTTask.for_device``), after a 5-step warm-up (on a CPU ``run_experiment`` uses one
intra-op thread: a second costs more than it saves on matrices this small); wall and process CPU time are both
printed, since on a shared machine the wall time says more about the neighbours than the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import subprocess
import time
import warnings

import torch

from labkit.lab.experiment import ExperimentConfig, default_device, run_experiment
from labkit.tasks import make_task


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    device = default_device()
    task = make_task("gpt", device=device)
    print(f"torch {torch.__version__}, {device}: {torch.cuda.get_device_name() if device == 'cuda' else cpu_name()}, "
          f"{torch.get_num_threads()} cores for torch")
    print(f"GPT {task.n_layer} layers, width {task.n_embd}, context {task.block_size}, batch {task.batch_size}; "
          f"data sha256 {task.fingerprint[:16]}")
    print(f"{'precision':10s} {'steps':>6s} {'wall s':>8s} {'cpu s':>8s} {'steps/s':>8s}")
    for precision in ("fp32", "fp16", "bf16"):
        config = ExperimentConfig(task="gpt", precision=precision, optimizer="adam", lr=3e-3, growth_interval=50,
                                  steps=args.steps, device=device)
        run_experiment(dataclasses.replace(config, steps=5))  # warm-up: lazy imports, allocator
        wall, cpu = time.perf_counter(), time.process_time()
        run_experiment(config)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"{precision:10s} {args.steps:6d} {wall:8.2f} {cpu:8.2f} {args.steps / wall:8.1f}")


if __name__ == "__main__":
    main()
