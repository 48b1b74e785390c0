"""Time labkit against torch in the same process, interleaved, and print medians and ratios.

    python benchmarks/bench_step.py            # the issue's sizes: 50M gradients, a ~50M-parameter model
    python benchmarks/bench_step.py --quick    # reduced sizes, to check it runs (e.g. on a loaded machine)
    python benchmarks/bench_step.py --device cuda

(a) unscale + check + clip of N fp32 gradients in 50 tensors: labkit's three passes (scaled
    per-tensor norms, then one multiply by coef/scale) against torch's ``unscale_`` +
    ``clip_grad_norm_`` (five passes) and against the floor ``_foreach_norm`` + ``_foreach_mul_``.
(b) ``TrainStep`` against torch's textbook AMP loop (autocast, ``scale().backward()``,
    ``unscale_``, ``clip_grad_norm_``, ``step``, ``update``, reading loss, norm and scale each
    step) on the toy model and on a wide MLP, with AdamW foreach and fused, per-step records
    (``sync_every=None``) and deferred ones (``sync_every=N``). The loops take turns every N steps
    on the same batches and each gets the median of its blocks: on a shared machine, whole loops
    timed in turn scattered the ratio by +-0.15 between runs, blocks by about +-0.02. Each
    comparison runs twice, torch's loop built first and then last, and prints the geometric mean
    of the two ratios: where a loop's tensors land depends on when it is built.
(c) host syncs per step of each, counted by trapping ``.item()``, ``bool()``, ``float()``,
    ``int()``, ``.tolist()``, ``.cpu()`` called from labkit, torch.amp or the loop itself
    (torch's optimizers' reads of their CPU step counters are no device syncs).

Ratios are labkit/torch (below 1: labkit is faster). Never asserted in tests: timings are
machine- and load-dependent. Quote them with ``lscpu``'s model name and flags.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import labkit
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.clip import clip_coef, per_tensor_norms, scale_grads_, total_norm


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, repeat: int, device: torch.device) -> dict[str, float]:
    """Run each fn once per round, in turn, ``repeat`` rounds; return each one's median seconds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


# ---------------------------------------------------------------- (a) unscale + check + clip


def bench_clip(numel: int, device: torch.device, repeat: int) -> dict[str, float]:
    torch.manual_seed(0)
    sizes = [numel // 50] * 50
    params = [torch.zeros(n, device=device, requires_grad=True) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel(), device=device) * 1e-3
    grads = [p.grad for p in params]
    opt = torch.optim.SGD(params, lr=0.0)
    # scale 1 and a max_norm above the norm: every pass reads and writes as in training, and the
    # values stay the same round after round (no drift into subnormals)
    max_norm = 1e9
    torch_scaler = torch.amp.GradScaler(device.type, init_scale=1.0)
    torch_scaler.scale(torch.ones((), device=device))
    scale = torch.ones((), device=device)

    def theirs():
        torch_scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        torch_scaler._per_optimizer_states.clear()  # a fresh iteration, without update()'s scale math

    def ours():  # what TrainStep's stage does: read once, multiply once
        scaled = per_tensor_norms(grads, 2.0)
        inv = scale.double().reciprocal().float()
        norm = total_norm(scaled * inv, 2.0)
        found_inf = (~torch.isfinite(scaled).all()).float()
        scale_grads_(grads, clip_coef(norm, max_norm) * inv)
        return found_inf

    def floor():
        norms = torch._foreach_norm(grads, 2.0)
        norm = torch.linalg.vector_norm(torch.stack(norms))
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))

    return interleaved({"labkit": ours, "torch": theirs, "floor": floor}, repeat, device)


# ---------------------------------------------------------------- (b) TrainStep vs the textbook loop


class Wide(nn.Sequential):
    def __init__(self, width: int, depth: int = 4) -> None:
        layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 1))
        super().__init__(*layers)


def textbook_step(model, opt, x, y, dtype, device, scaler, max_norm=1.0):
    """One step of torch's AMP recipe, reading loss, norm and scale (TrainStep's record has them)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return loss.item(), norm.item(), scale  # the same observability as TrainStep's record


def textbook_loop(model, opt, batches, dtype, device, max_norm=1.0, scaler=None):
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    return [textbook_step(model, opt, x, y, dtype, device, scaler, max_norm) for x, y in batches]


def trainstep_loop(model, opt, batches, precision, sync_every, max_norm=1.0, step=None):
    step = step or labkit.TrainStep(model, opt, nn.functional.mse_loss, precision=precision,
                                    max_norm=max_norm, sync_every=sync_every,
                                    hooks=[SkipAlarm(None), ClipAlarm(None)])
    records = [step(x, y) for x, y in batches]
    step.flush()
    return records


def make_setup(width, fused, device, steps, batch=64):
    torch.manual_seed(0)
    model = Wide(width).to(device) if width else labkit.ToyTask().model(device)
    inputs = 16 if width else labkit.ToyTask().in_features
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
    batches = [
        (torch.randn(batch, inputs, device=device), torch.randn(batch, 1, device=device))
        for _ in range(steps)
    ]
    return model, opt, batches


def build_loops(width, fused, precision, device, sync_every, first_batch, torch_first):
    """Return ``{name: loop}``, built (and stepped once) in the order given: torch's loop first or last.

    Each has its own model (the same seed), optimizer and scaler. Where a loop's tensors and objects
    land depends on when it is built, and two copies of one loop built one after the other differ by
    a few per cent on a small model; built both ways, that falls on each side alike."""
    dtype = labkit.step.PRECISIONS[precision]

    def textbook():
        model, opt, _ = make_setup(width, fused, device, 1)
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        textbook_step(model, opt, *first_batch, dtype, device, scaler)
        return lambda x, y: textbook_step(model, opt, x, y, dtype, device, scaler)

    def trainstep(every):
        model, opt, _ = make_setup(width, fused, device, 1)
        step = labkit.TrainStep(model, opt, nn.functional.mse_loss, precision=precision, max_norm=1.0,
                                sync_every=every, hooks=[SkipAlarm(None), ClipAlarm(None)])
        step(*first_batch)
        step.flush()
        return step

    builders = {"torch": textbook, "labkit": lambda: trainstep(None),
                f"labkit sync_every={sync_every}": lambda: trainstep(sync_every)}
    names = list(builders) if torch_first else list(builders)[::-1]
    return {name: builders[name]() for name in names}


def bench_step(width, fused, precision, device, steps, block, sync_every):
    """Per loop, the median seconds per step of blocks of ``block`` steps, the loops taking turns block
    by block on the same batches (a machine's slow minute falls on all of them alike), timed twice:
    with torch's loop built first and built last. Returns ``{order: {name: seconds}}``. A block of
    ``sync_every`` steps holds one flush of the deferred records."""
    _, _, batches = make_setup(width, fused, device, steps + 1)
    out = {}
    for torch_first in (True, False):
        loops = build_loops(width, fused, precision, device, sync_every, batches[0], torch_first)
        times: dict[str, list[float]] = {k: [] for k in loops}
        for start in range(1, steps + 1 - block + 1, block):
            chunk = batches[start:start + block]
            for name, run in loops.items():
                sync(device)
                t = time.perf_counter()
                for x, y in chunk:
                    run(x, y)
                if isinstance(run, labkit.TrainStep):
                    run.flush()
                sync(device)
                times[name].append((time.perf_counter() - t) / block)
        out["torch built first" if torch_first else "torch built last"] = {
            k: statistics.median(v) for k, v in times.items()}
    return out


# ---------------------------------------------------------------- (c) host syncs per step


class SyncCounter:
    NAMES = ("item", "__bool__", "tolist", "__float__", "__int__", "cpu", "numpy")
    # __name__: the textbook loop here
    COUNTED = ("labkit", "torch.amp", __name__, "torch.nn.utils.clip_grad")

    def __init__(self) -> None:
        self.count, self._real = 0, {n: getattr(torch.Tensor, n) for n in self.NAMES}

    def __enter__(self):
        for name, real in self._real.items():
            setattr(torch.Tensor, name, self._wrap(real))
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)

    def _wrap(self, real):
        def trapped(t, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith(self.COUNTED):
                self.count += 1
            return real(t, *args, **kwargs)
        return trapped


def syncs_per_step(fused, precision, device, sync_every, steps=8):
    dtype = labkit.step.PRECISIONS[precision]
    out = {}
    model, opt, batches = make_setup(0, fused, device, steps)
    with SyncCounter() as c:
        textbook_loop(model, opt, batches, dtype, device)
    out["torch"] = c.count / steps
    for every in (None, sync_every):
        model, opt, batches = make_setup(0, fused, device, steps)
        with SyncCounter() as c:
            trainstep_loop(model, opt, batches, precision, every)
        out["labkit" if every is None else f"labkit sync_every={every}"] = c.count / steps
    return out


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        for line in lines:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = next(line for line in lines if line.startswith("flags")).split()
                isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
                fp16 = "native fp16" if "avx512_fp16" in flags else "no native fp16"
                return f"{name} ({isa}, {fp16})"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="reduced sizes (2M gradients, a ~1M-parameter MLP)")
    ap.add_argument("--precision", choices=list(labkit.step.PRECISIONS),
                    help="default fp16 on a GPU, fp32 on a CPU (most emulate fp16: the MLP would take "
                         "an hour)")
    ap.add_argument("--models", default="toy,mlp", help="(b)'s models: toy, mlp or both")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--parts", default="abc", help="which of (a), (b), (c) to run, e.g. --parts a")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    device = torch.device(args.device)
    args.precision = args.precision or ("fp16" if device.type == "cuda" else "fp32")
    if set(args.models.split(",")) - {"toy", "mlp"}:
        ap.error(f"--models takes toy, mlp or toy,mlp; got {args.models!r}")
    numel, width, repeat = (2_000_000, 512, 5) if args.quick else (50_000_000, 4096, 9)
    if device.type == "cpu":
        # --quick: 1 thread, steadier on a shared machine
        torch.set_num_threads(1 if args.quick else torch.get_num_threads())
    where = torch.cuda.get_device_name() if device.type == "cuda" else cpu_name()
    print(f"# {where}; torch {torch.__version__}; {torch.get_num_threads()} threads; medians, interleaved")

    if "a" in args.parts:
        clip_part(numel, device, repeat)
    if "b" in args.parts:
        step_part(args, width, device)
    if "c" in args.parts:
        sync_part(args, device)


def clip_part(numel, device, repeat):
    t = bench_clip(numel, device, repeat)
    print(f"\n(a) unscale+check+clip, {numel / 1e6:g}M fp32 gradients in 50 tensors")
    print(f"    labkit {t['labkit'] * 1e3:8.2f} ms   torch {t['torch'] * 1e3:8.2f} ms   "
          f"floor {t['floor'] * 1e3:8.2f} ms")
    print(f"    torch/labkit = {t['torch'] / t['labkit']:.2f}x faster (goal >= 1.5)   "
          f"labkit/floor = {t['labkit'] / t['floor']:.2f} (goal <= 1.15)")


def step_part(args, width, device):
    print(f"\n(b) TrainStep vs the textbook loop, {args.precision}, AdamW, per step: median of blocks of "
          f"{args.sync_every} steps, the loops taking turns; ratio labkit/torch (goal <= 1.0): the geometric "
          "mean of two runs, torch's loop built first and built last (each in brackets)")
    # the toy's step is ~1 ms of Python and small kernels: many blocks; the MLP's is ~0.2 s
    sizes = {"toy": (0, 1600), "mlp": (width, 32 if args.quick else 64)}
    for name in args.models.split(","):
        w, steps = sizes[name]
        n = sum(p.numel() for p in make_setup(w, False, device, 1)[0].parameters())
        for fused in (False, True):
            t = bench_step(w, fused, args.precision, device, steps, args.sync_every, args.sync_every)
            runs = list(t.values())
            label = f"{'toy' if not w else 'MLP'} {n / 1e6:.2f}M params, {'fused' if fused else 'foreach'}"
            ratios = []
            for k in runs[0]:
                if k != "torch":
                    each = [r[k] / r["torch"] for r in runs]
                    mean = math.prod(each) ** (1 / len(each))
                    ratios.append(f"{k} {mean:.2f}x ({'/'.join(f'{x:.2f}' for x in each)})")
            torch_ms = statistics.median(r["torch"] for r in runs) * 1e3
            print(f"    {label:<34} torch {torch_ms:7.2f} ms/step   {'  '.join(ratios)}")


def sync_part(args, device):
    print("\n(c) host syncs per step (toy model)")
    for fused in (False, True):
        s = syncs_per_step(fused, args.precision, device, args.sync_every)
        print(
            f"    AdamW {'fused  ' if fused else 'foreach'}  "
            + "   ".join(f"{k}: {v:g}" for k, v in s.items())
        )


if __name__ == "__main__":
    main()
