"""Time labkit against torch in the same run and print ratios (never asserted in tests).

    python benchmarks/bench_step.py

1. clip: labkit.clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_ on many fp32 gradients.
2. scaler: labkit.GradScaler vs torch.amp.GradScaler("cpu") in the standard loop.
3. step: labkit.TrainStep (fp16) vs a hand-written torch AMP loop with clipping, same task.
"""

from __future__ import annotations

import time
import warnings

import torch

import labkit


def best_of(fn, repeat: int = 7, number: int = 1) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t) / number)
    return min(times)


def bench_clip() -> tuple[float, float]:
    torch.manual_seed(0)
    params = [torch.zeros(n, requires_grad=True) for n in [4096] * 200 + [1 << 20] * 8]
    for p in params:
        p.grad = torch.randn_like(p)
    ours = best_of(lambda: labkit.clip_grad_norm_(params, 1.0), number=5)
    theirs = best_of(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), number=5)
    return ours, theirs


def amp_loop(scaler, steps: int, task: labkit.ToyTask) -> None:
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(steps):
        x, y = task.batch(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = task.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def trainstep_loop(steps: int, task: labkit.ToyTask) -> None:
    model = task.model()
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), task.loss_fn,
                            precision="fp16", max_norm=1.0)
    for i in range(steps):
        step(*task.batch(i))


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    task, steps = labkit.ToyTask(), 300
    rows = []
    ours, theirs = bench_clip()
    rows.append(("clip_grad_norm_ (208 fp32 grads, 9.2M values)", ours, theirs))
    ours = best_of(lambda: amp_loop(labkit.GradScaler("cpu"), steps, task), repeat=3)
    theirs = best_of(lambda: amp_loop(torch.amp.GradScaler("cpu"), steps, task), repeat=3)
    rows.append((f"AMP loop, {steps} fp16 steps, GradScaler", ours, theirs))
    ours = best_of(lambda: trainstep_loop(steps, task), repeat=3)
    rows.append((f"TrainStep vs hand loop, {steps} fp16 steps", ours, theirs))
    print(f"{'what':<48} {'labkit':>10} {'torch':>10} {'ratio':>7}")
    for what, a, b in rows:
        print(f"{what:<48} {a * 1e3:>8.2f}ms {b * 1e3:>8.2f}ms {a / b:>6.2f}x")
    print(f"(torch {torch.__version__}, {torch.get_num_threads()} threads; best of several runs; ratio = labkit/torch)")


if __name__ == "__main__":
    main()
