"""What issue 13's guards cost per step (never asserted in tests).

    python benchmarks/bench_robustness.py

1. the parameter list read from optimizer.param_groups (a key compare per step);
2. the buffer snapshot taken before each forward (BatchNorm statistics), against the whole step;
3. a whole TrainStep on a BatchNorm model, fp32, for scale.
"""

from __future__ import annotations

import platform
import time

import torch
from torch import nn

import labkit
from labkit.alarms import ClipAlarm


def best_of(fn, repeat: int = 7, number: int = 200) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t) / number)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    task = labkit.ToyTask()
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64),
                          nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), task.loss_fn,
                            hooks=[ClipAlarm(None)])
    x, y = task.batch(0)
    params = best_of(step._named_params, number=2000)
    snapshot = best_of(lambda: [b.detach().clone() for b in model.buffers()], number=2000)
    whole = best_of(lambda: step(x, y), number=50)
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    print(f"params from optimizer.param_groups: {params * 1e6:8.2f} us/step")
    print(f"buffer snapshot (2 BatchNorm1d(64)): {snapshot * 1e6:8.2f} us/step")
    print(f"whole TrainStep (fp32, same model):  {whole * 1e6:8.2f} us/step "
          f"-> guards {100 * (params + snapshot) / whole:.1f}% of the step")


if __name__ == "__main__":
    main()
