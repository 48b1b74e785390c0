"""Measure what issue 16's numbers rest on, in one command (never asserted in tests).

    python benchmarks/bench_precision.py

1. bf16 stagnation and its remedies (labkit.formats.bf16.compare_remedies, 300 AdamW steps).
2. Gradient accumulation over 64 micro-batches: bf16 against fp32 accumulator.
3. The cost of the stale detector: TrainStep on a bf16 ToyTask with and without StaleMonitor.
4. FP8 granularity against an outlier channel (256x1024, e4m3): % flushed, error of the other channels.
5. Delayed against current per-tensor scaling through a x10 range jump.
6. quantize() time per granularity on 256x1024.
"""

from __future__ import annotations

import platform
import subprocess
import time
import warnings

import torch

import labkit
from labkit.formats.bf16 import StaleMonitor, accumulate, compare_remedies
from labkit.formats.fp8 import GRANULARITIES, Fp8Fault, Fp8Guard, quantize
from labkit.lab.formats import granularity_rows


def best_of(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def cpu() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
        flags = next(line for line in lines if line.startswith("Flags"))
        simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        fp16 = "native fp16" if "avx512_fp16" in flags else "no native fp16"
        return f"{model}, {simd}, {fp16}, {torch.get_num_threads()} threads"
    except (OSError, StopIteration, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"


def main() -> None:
    print("machine:", cpu(), "| torch", torch.__version__)
    print("\n1. bf16 stagnation, AdamW lr 1e-3, 32 weights from 1")
    for name, run in compare_remedies().items():
        print(f"   {name:28s} moved {run.changed:2d}/32  loss {run.losses[0]:.1f} -> {run.losses[-1]:.1f}")

    print("\n2. gradient accumulation, 64 micro-batches of 100k bf16 gradients")
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randn(100_000, generator=g) * 1e-3 + 1e-3).bfloat16() for _ in range(64)]
    exact = torch.stack(micro).double().sum(0)
    for dtype in (torch.bfloat16, torch.float32):
        err = ((accumulate(micro, dtype).double() - exact).norm() / exact.norm()).item()
        print(f"   {str(dtype):15s} accumulator rel err {err:.2e}")

    print("\n3. stale detector cost: TrainStep, ToyTask with bf16 weights, AdamW, 50 steps")
    task = labkit.ToyTask()
    batches = [task.batch(i) for i in range(50)]

    def run(observer) -> None:
        model = task.model().to(torch.bfloat16)
        step = labkit.TrainStep(model, torch.optim.AdamW(model.parameters(), 1e-4), task.loss_fn,
                                precision="bf16", max_norm=None, hooks=[observer], skip_alarm=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for b in batches:
                step(*b)

    plain = best_of(lambda: run(None))
    for every in (1, 10):
        watched = best_of(lambda every=every: run(StaleMonitor(every=every)))
        print(f"   every={every:2d}: {1e3 * watched / 50:.2f} ms/step against {1e3 * plain / 50:.2f} ms/step "
              f"without ({watched / plain:.2f}x)")

    print("\n4. e4m3 granularity against one outlier channel (256x1024)")
    for outlier in (2e2, 1e4, 1e5):
        torch.manual_seed(0)
        x = torch.randn(256, 1024)
        x[:, 7] *= outlier
        rows = granularity_rows(x, 7)
        print(f"   x{outlier:<8g}" + "  ".join(f"{r['granularity']}: {100 * r['flushed']:5.2f}% flushed, "
                                              f"err {r['rel_err']:.3f}" for r in rows))

    print("\n5. delayed (history 16) vs current scaling, x10 range jump at step 20 (4096 values)")
    torch.manual_seed(0)
    stream = [torch.randn(4096) for _ in range(23)]
    for name, history in (("current", None), ("delayed", 16)):
        guard = Fp8Guard(history=history, faults={20: Fp8Fault("range_jump")})
        for x in stream:
            guard(x)
        print(f"   {name:8s}" + "  ".join(f"step {r.step}: {100 * r.saturated:.1f}% saturated ({r.reason})"
                                        for r in guard.records[19:22]))

    print("\n6. quantize() on 256x1024 fp32")
    x = torch.randn(256, 1024)
    quantize(x, granularity="mx32")  # torchao's import, once
    for granularity in GRANULARITIES:
        print(f"   {granularity:9s} {1e3 * best_of(lambda g=granularity: quantize(x, granularity=g)):.2f} ms")


if __name__ == "__main__":
    main()
