"""Does AdamW spike where StableAdamW does not? The memorisation demo of Wortsman et al. 2023b's mechanism.

    python benchmarks/bench_update_clipping.py [--seeds 0 1 2] [--steps 1000] [--optimizers adamw stable]

The regime of the probe (research note optimizer-spikes-probe.md, Q1b): the lesson GPT
(``GPTTask()``: 2 layers, width 32, 2 heads, context 32) trained on **one fixed 8x32 batch**
(``task.batch(0)``), AdamW betas (0.9, 0.99), eps 1e-8, lr 1e-2 after 10 linear warm-up steps
(``(t + 1) / 11``) then constant, weight decay 0, no gradient clipping. The data never change,
so every loss spike comes from the optimizer. A plain torch loop, one intra-op thread; per step it
keeps, as 0-dim tensors read once at the end: the loss (before the step), the gradient's global
norm, the max over tensors of ``labkit.optim.update_rms`` (read from the optimizer's state after
its step) and the RMS of the update applied, divided by the lr.

Per run it prints: the loss floor (median of steps 100-199), the peak loss after step 100 and
its step, the first spike onset (``loss > 2 x`` the median of the 20 steps before, after step
100), the max RMS in the 8 steps before it, the gradient norm there, and CPU and wall seconds.
``LABKIT_PERTURB=1`` in the environment nudges every model's initial weights (another machine's
path). Figures go to the issue's report, never into a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from labkit.optim import StableAdamW, read_update_rms
from labkit.tasks import GPTTask

OPTIMIZERS = {"adamw": torch.optim.AdamW, "stable": StableAdamW}


def memorise(seed: int, optimizer: str = "adamw", steps: int = 1000, lr: float = 1e-2, beta2: float = 0.99,
             warmup: int = 10) -> dict[str, torch.Tensor]:
    """Train the lesson GPT on one fixed batch; return per-step loss, grad norm, max RMS, update RMS."""
    task = GPTTask(seed=seed, measure=False)
    model = task.model()
    x, y = task.batch(0)
    params = list(model.parameters())
    opt = OPTIMIZERS[optimizer](params, lr=lr, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (t + 1) / (warmup + 1) if t < warmup else 1.0)
    count = sum(p.numel() for p in params)
    loss_, gnorm_, rms_, update_ = [], [], [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = task.loss_fn(model(x), y)
        loss.backward()
        lr_now = opt.param_groups[0]["lr"]
        before = [p.detach().clone() for p in params]
        gnorm_.append(torch.nn.utils.get_total_norm([p.grad for p in params]))
        opt.step()
        sched.step()
        rms_.append(torch.stack(read_update_rms(opt, params)))
        moved = sum((p.detach() - b).square().sum() for p, b in zip(params, before))
        update_.append((moved / count).sqrt() / lr_now)
        loss_.append(loss.detach())
    return {"loss": torch.stack(loss_), "gnorm": torch.stack(gnorm_), "rms": torch.stack(rms_),
            "update": torch.stack(update_), "names": [n for n, _ in model.named_parameters()]}


def summary(run: dict, start: int = 100, ratio: float = 2.0, window: int = 20, before: int = 8) -> dict:
    """Return the floor, the peak after ``start``, and the first onset with what preceded it."""
    loss, rms = run["loss"], run["rms"].amax(1)
    floor = loss[start:start + 100].median().item()
    peak_step = start + int(loss[start:].argmax())
    onset = None
    for t in range(start, len(loss)):
        if loss[t] > ratio * loss[t - window:t].median():
            onset = t
            break
    out = {"floor": floor, "peak": loss[peak_step].item(), "peak_step": peak_step, "onset": onset}
    if onset is not None:
        pre = rms[onset - before:onset]
        first = next((onset - before + i for i, r in enumerate(pre.tolist()) if r > 3), None)
        top = run["rms"][onset - before:onset].amax(0).argmax().item()
        out.update(rms_before=pre.max().item(), first_rms3=first, tensor=run["names"][top],
                   gnorm_at_first=None if first is None else run["gnorm"][first].item(),
                   update_at_onset=run["update"][onset].item(), loss_at_first=None if first is None
                   else loss[first].item())
    out["max_update_after_start"] = run["update"][start:].max().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} thread(s), "
          f"LABKIT_PERTURB={os.environ.get('LABKIT_PERTURB', '')!r}, load average {os.getloadavg()[0]:.1f}")
    for seed in args.seeds:
        for name in args.optimizers:
            wall, cpu = time.perf_counter(), time.process_time()
            run = memorise(seed, name, args.steps)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            s = summary(run)
            line = (f"seed {seed} {name:6s} floor {s['floor']:.4f} peak {s['peak']:.3f} @ "
                    f"{s['peak_step']:4d}  max update/lr after 100: {s['max_update_after_start']:.3f}  ")
            if s["onset"] is None:
                line += "no onset"
            else:
                line += (f"onset {s['onset']:4d}: max RMS in the 8 steps before {s['rms_before']:.2f} "
                         f"(first > 3 at {s['first_rms3']}, loss there {s['loss_at_first']}, grad norm "
                         f"{s['gnorm_at_first']}, {s['tensor']}); update/lr at onset "
                         f"{s['update_at_onset']:.3f}")
            print(line + f"  [{cpu:.1f} CPU-s, {wall:.1f} s wall]", flush=True)


if __name__ == "__main__":
    main()
