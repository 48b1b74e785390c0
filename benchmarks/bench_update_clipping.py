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

Per run it prints the loss floor (median of steps 100-199), the max loss after step 100 and its
step, the number of spike onsets (``loss > 2 x`` the median of the 20 steps before) and of those
peaking above 0.5, and CPU and wall seconds; then, for each spike peaking above 0.5: its onset
and peak, the max over tensors of the RMS in the 8 steps before the onset (which tensor), the
first of those steps with an RMS above 3 and the gradient norm there, and the update/lr.
``LABKIT_PERTURB=1`` in the environment nudges every model's initial weights (another machine's
path). Figures go to the issue's report, never into a test.

Measured 2026-12-03 (Intel Xeon Emerald Rapids, torch 2.13.0+cpu, 1 thread, three runs at once,
load average 6-12 on 2 cores): 5.4-7.6 CPU-s per AdamW run, 7.7-8.4 per StableAdamW run (20-40 s
wall). Max loss after step 100, seeds 0/1/2:

    LABKIT_PERTURB  AdamW                           StableAdamW
    unset           1.68 @293, 2.81 @558, 2.74 @682   0.28, 0.60, 0.009 (no spike)
    1               1.96 @249, 1.73 @462, 0.037 (none in 1000 steps; 2.90 @1081 in 2000)   0.15, 0.39, 0.009
    2               2.24 @790, 2.52 @755, 1.93 @450   0.21, 0.32, 0.009

In 7 of the 8 AdamW spikes within 1000 steps the max RMS passed 3 (3.0-8.6) on the step before the
loss doubled, at a gradient norm of 0.07-3.0 (0.07-0.39, under a clip at 1, in 5 of them); in the 8th
it passed 3 (6.0) on the step the loss first rose (0.006 -> 0.014), one step before the jump. The
2000-step spike had a max RMS of 1.14 in the 8 steps before its onset (not examined further). The
spike time is chaotic: 2^-20 on the initial weights moves it by hundreds of steps or past step 1000.
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


def events(run: dict, start: int = 100, ratio: float = 2.0, window: int = 20, before: int = 8) -> list[dict]:
    """Return the loss spikes after ``start``: an onset is a loss above ``ratio`` x the median of the
    ``window`` losses before it; the event lasts while the loss stays above that level (at most 50
    steps). Each event: onset, peak and its step, the max over tensors of the RMS in the ``before``
    steps before the onset, the first of them above 3 (None if none), the grad norm and loss there,
    the tensor that peaked, and the update/lr at the onset."""
    loss, top = run["loss"], run["rms"].amax(1)
    out, t = [], start
    while t < len(loss):
        level = ratio * loss[t - window:t].median()
        if loss[t] <= level:
            t += 1
            continue
        end = t
        while end + 1 < len(loss) and end + 1 < t + 50 and loss[end + 1] > level:
            end += 1
        peak = t + int(loss[t:end + 1].argmax())
        pre = top[t - before:t]
        first = next((t - before + i for i, r in enumerate(pre.tolist()) if r > 3), None)
        tensor = run["names"][int(run["rms"][t - before:t].amax(0).argmax())]
        out.append({"onset": t, "peak": loss[peak].item(), "peak_step": peak, "rms_before": pre.max().item(),
                    "first_rms3": first, "tensor": tensor, "update_at_onset": run["update"][t].item(),
                    "gnorm_at_first": None if first is None else run["gnorm"][first].item(),
                    "loss_at_first": None if first is None else loss[first].item()})
        t = end + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", help="write every run's per-step tensors here (torch.save)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} thread(s), "
          f"LABKIT_PERTURB={os.environ.get('LABKIT_PERTURB', '')!r}, load average {os.getloadavg()[0]:.1f}")
    saved = {}
    for seed in args.seeds:
        for name in args.optimizers:
            wall, cpu = time.perf_counter(), time.process_time()
            run = memorise(seed, name, args.steps)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            saved[(seed, name)] = run
            loss = run["loss"]
            peak_step = 100 + int(loss[100:].argmax())
            found = events(run)
            print(f"seed {seed} {name}: floor {loss[100:200].median().item():.4f}, max loss after step 100 "
                  f"{loss[peak_step].item():.3f} at {peak_step}, {len(found)} onsets (2x), "
                  f"{sum(e['peak'] > 0.5 for e in found)} peaking > 0.5, max update/lr after 100 "
                  f"{run['update'][100:].max().item():.3f}  [{cpu:.1f} CPU-s, {wall:.1f} s wall]", flush=True)
            for e in found:
                if e["peak"] > 0.5:
                    gn = "-" if e["gnorm_at_first"] is None else f"{e['gnorm_at_first']:.3f}"
                    print(f"    onset {e['onset']}, peak {e['peak']:.3f} at {e['peak_step']}; max RMS in the "
                          f"8 steps before {e['rms_before']:.2f} ({e['tensor']}), first > 3 at "
                          f"{e['first_rms3']} (grad norm {gn}); update/lr at onset "
                          f"{e['update_at_onset']:.3f}", flush=True)
    if args.save:
        torch.save(saved, args.save)


if __name__ == "__main__":
    main()
