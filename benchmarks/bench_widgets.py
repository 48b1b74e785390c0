"""Time what a student waits for: slider release -> re-run -> redraw, for each lesson's panel.

    python benchmarks/bench_widgets.py

The panels are the notebooks' defaults. Each row moves one slider (the callback runs the
experiment and redraws), takes the median of several moves after a warm-up, and prints it
with the bare ``run_experiment`` time of the same settings measured in the same run, so the
ratio is the panel's own cost (redraw, status, table). The redraw is a real Agg render to
PNG (the non-ipympl path); under ipympl the browser asks for the same render.
The budgets, on a plain 2-core laptop-class CPU: slider -> redrawn <= 0.5 s for the auto-run
panels (01, 02), a live Run <= 3 s for 03 (a redraw every 40 steps: each is a full render, ~0.15 s).
Each row also times a slider moved back to a value already seen (the panel's run cache: no training).

It prints the machine first: CPU model, whether it has AVX-512 and native fp16 arithmetic (CPU
flags, and an fp16 vs fp32 matmul timed here: without native fp16, torch emulates it and it is
many times slower), the torch threads and the load average, so a figure is never quoted without
the machine it was taken on, or taken on a busy machine without saying so. The process's CPU
time per slider move is printed too: the runs use one thread, so on a busy machine it is a
rough stand-in for the wall time an idle one would take.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
import warnings

import torch

from labkit.lab.experiment import ExperimentConfig, run_experiment
from labkit.lab.widgets import ControlPanel

LESSONS = {
    "01 clipping (2 runs)": (
        ExperimentConfig(precision="fp32", steps=120, faults=["60:spike:30"], device="cpu"),
        dict(controls={"max_norm": 1.0, "fault_step": 60, "fault_magnitude": 30.0}, fixed={"fault": "spike"},
             variants={"clipped": {}, "unclipped": {"max_norm": None}}, panels=("norm", "loss")),
        ("fault_step", [61, 62, 63, 64, 65]),
    ),
    "02 loss scaling": (
        ExperimentConfig(precision="fp16", steps=160, init_scale=2.0**10, growth_interval=50,
                         faults=["100-104:overflow"], device="cpu"),
        dict(controls={"init_scale": 2.0**10, "growth_interval": 50, "fault_step": 100, "fault_count": 5},
             fixed={"fault": "overflow"}, panels=("scale", "norm")),
        ("init_scale", [11, 12, 13, 14, 15]),
    ),
    "03 guarded step (Run, live)": (
        ExperimentConfig(precision="fp16", steps=200, scheduler="cosine", device="cpu"),
        dict(controls={"fault": "nan", "fault_step": 60, "fault_count": 1, "max_norm": 1.0,
                       "init_scale": 2.0**10, "precision": "fp16"}, auto_run=False, live=True, every=40),
        ("fault_step", [61, 62, 63]),
    ),
}


BUDGET_S = {"01 clipping (2 runs)": 0.5, "02 loss scaling": 0.5, "03 guarded step (Run, live)": 3.0}


def cpu() -> tuple[str, set[str]]:
    """Return the CPU's model name and its flags (Linux: /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, flags


def fp16_vs_fp32(n: int = 256, repeat: int = 20) -> float:
    """Return how many times slower a CPU fp16 matmul is than an fp32 one (about 1 where fp16 is native)."""
    # One thread and CPU time: on a busy machine, threads waiting for a core would blur the ratio.
    times, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.float16):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            a @ b
            start = time.process_time()
            for _ in range(repeat):
                a @ b
            times[dtype] = time.process_time() - start
    finally:
        torch.set_num_threads(threads)
    return times[torch.float16] / times[torch.float32]


def machine() -> str:
    model, flags = cpu()
    avx512 = "AVX-512" if "avx512f" in flags else "AVX2 (no AVX-512)" if "avx2" in flags else "no AVX2"
    native = sorted(flags & {"avx512_fp16", "amx_fp16"})  # arithmetic; f16c only converts
    slower = fp16_vs_fp32()
    fp16 = (f"native fp16 ({', '.join(native)})" if native else "no native fp16") + \
        f", an fp16 matmul {slower:.0f}x the time of fp32"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    busy = "UNDER LOAD: " if load > 0.5 * (os.cpu_count() or 1) else ""
    return (f"{model}, {os.cpu_count()} logical CPUs, {avx512}, {fp16}\n"
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {busy}load average {load:.2f}")


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    warnings.simplefilter("ignore")
    print(machine())
    print(f"{'panel':30s} {'slider -> redrawn':>18s} {'budget':>7s} {'bare run':>10s} {'ratio':>6s} "
          f"{'back to a seen value':>21s}")
    for name, (base, kwargs, (control, values)) in LESSONS.items():
        panel = ControlPanel(base, **kwargs)
        panel.run()  # warm-up: first-run costs (torch's lazy imports, font cache) are not a slider's
        first = panel.controls[control].value
        times, cpu_times = [], []
        for value in values:
            start, cpu_start = time.perf_counter(), time.process_time()
            panel.controls[control].value = value
            if not panel.auto_run:
                panel.run_button.click()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        assert panel.error is None, panel.error
        start = time.perf_counter()
        panel.controls[control].value = first  # seen before: from the run cache
        if not panel.auto_run:
            panel.run_button.click()
        cached = time.perf_counter() - start
        bare = []
        for _ in values:
            start = time.perf_counter()
            for changes in panel.variants.values():
                run_experiment(dataclasses.replace(panel.config, **changes))
            bare.append(time.perf_counter() - start)
        med, bare_med = statistics.median(times), statistics.median(bare)
        verdict = "ok" if med <= BUDGET_S[name] else "OVER"
        print(f"{name:30s} {med:16.3f} s {BUDGET_S[name]:5.1f} s {bare_med:8.3f} s {med / bare_med:6.2f} "
              f"{cached:19.3f} s  {verdict}  (CPU time {statistics.median(cpu_times):.3f} s)")


if __name__ == "__main__":
    main()
