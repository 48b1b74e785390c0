"""What the gradients look like inside a run: the probe that reads them and the pictures of them.

``GradientProbe`` watches a model while ``run_experiment`` (or any loop around ``TrainStep``)
trains it, through hooks only, so the step itself is untouched: for every step it records each
layer's gradient norm (unscaled, before clipping), the fraction of activation gradients that are
exactly zero (flushed: in fp16 without a scaler, gradients below 2**-24 underflow), and a sample
of activation-gradient values. ``Probed(task, probe)`` is the task with the probe attached to
every model it builds, so it goes wherever a task goes (``ExperimentConfig(task=...)``).

The pictures: ``GradHistogram`` (log2|g| over fp16's and bf16's ranges, with a loss-scale
slider; Micikevicius et al. 2018, "Mixed Precision Training", Fig. 3, live), ``plot_u_curve``
(flushed and overflowing fractions against log2 of the scale), ``plot_layer_heatmap`` and
``plot_sawtooth``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from ..records import StepLog
from ..tasks import Task
from .plots import _ipympl_active

__all__ = ["FP16_RANGE", "BF16_RANGE", "GradHistogram", "GradientProbe", "Probed", "flush_fractions",
           "plot_layer_heatmap", "plot_sawtooth", "plot_u_curve", "u_curve"]

_F16, _BF16 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16)
# log2 of |x|: (smallest subnormal, smallest normal, largest finite)
FP16_RANGE = (math.log2(_F16.smallest_normal) - 10, math.log2(_F16.smallest_normal), math.log2(_F16.max))  # -24, -14, 15.9998
BF16_RANGE = (math.log2(_BF16.smallest_normal) - 7, math.log2(_BF16.smallest_normal), math.log2(_BF16.max))  # -133, -126, 127.99
# Round to nearest even: |x| <= 2**-25 (half the smallest subnormal) becomes 0, |x| >= 65520 becomes inf.
_FLUSH, _OVERFLOW = 2.0**-25, 65520.0


def flush_fractions(values: Tensor, log2_scale: float) -> tuple[float, float]:
    """Return the fractions of nonzero ``values`` that fp16 flushes to 0 and to inf after ``* 2**log2_scale``.

    Exactly what a cast does (the thresholds are round-to-nearest-even's); zeros are left out,
    since they are zero at any scale.

    >>> g = torch.tensor([1e-9, 1e-3, 1.0, 0.0])
    >>> flush_fractions(g, 0), flush_fractions(g, 20)
    ((0.3333333333333333, 0.0), (0.0, 0.3333333333333333))
    """
    a = values.detach().abs().double().flatten()
    a = a[a > 0]
    if a.numel() == 0:
        return 0.0, 0.0
    a = a * 2.0**log2_scale
    return float((a <= _FLUSH).double().mean()), float((a >= _OVERFLOW).double().mean())


def u_curve(values: Tensor, log2_scales: Sequence[float]) -> tuple[list[float], list[float]]:
    """Return the flushed and the overflowing fraction of ``values`` at each log2 scale: the U's two arms.

    >>> under, over = u_curve(torch.tensor([2.0**-30, 1.0]), [0, 10, 20])
    >>> under, over
    ([0.5, 0.0, 0.0], [0.0, 0.0, 0.5])
    """
    pairs = [flush_fractions(values, s) for s in log2_scales]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


class GradientProbe:
    """Record per-layer gradient norms, flushed fractions and gradient samples of a model, by hooks.

    ``attach(model)`` hooks every ``nn.Linear`` output (its gradient is the activation gradient
    that fp16 carries in backward) and every parameter (its gradient's norm, grouped by module),
    and the task's loss (its gradient is the loss scale, so no scaler is needed to unscale).
    ``begin(step)`` closes the previous step: one host sync per step, the probe's own cost
    (a few small tensors), not the training step's. Attaching again forgets the old run.

    >>> from labkit.tasks import GPTTask
    >>> from labkit.lab.experiment import ExperimentConfig, run_experiment
    >>> probe = GradientProbe()
    >>> task = Probed(GPTTask(n_layer=1, n_embd=16, block_size=8, batch_size=2), probe)
    >>> log = run_experiment(ExperimentConfig(task=task, precision="fp32", steps=3, device="cpu"))
    >>> probe.steps, probe.layers[:2], len(probe.layer_norms["wte"])
    ([0, 1, 2], ['wte', 'wpe'], 3)
    """

    def __init__(self, sample: int = 2048) -> None:
        self.sample = sample
        self._handles: list = []
        self.listeners: list[Callable[[GradientProbe], None]] = []
        self._reset()

    def _reset(self) -> None:
        self.layers: list[str] = []
        self._steps: list[int] = []
        self._norms: dict[str, list[float]] = {}
        self._zero_fraction: list[float] = []
        self._scale: list[float] = []
        self._values = torch.zeros(0)
        self._step: int | None = None
        self._pending: dict | None = None

    # Read through close(): the last step's numbers are still tensors until someone asks.
    @property
    def steps(self) -> list[int]:
        """The steps that ran backward, in order."""
        self.close()
        return self._steps

    @property
    def layer_norms(self) -> dict[str, list[float]]:
        """Per module (parameters grouped by owner): the unscaled, unclipped gradient norm of each step."""
        self.close()
        return self._norms

    @property
    def zero_fraction(self) -> list[float]:
        """Per step: the fraction of activation-gradient entries (``nn.Linear`` outputs) that were exactly 0."""
        self.close()
        return self._zero_fraction

    @property
    def loss_scale(self) -> list[float]:
        """Per step: the gradient that reached the loss, i.e. the loss scale (1 without a scaler)."""
        self.close()
        return self._scale

    @property
    def values(self) -> Tensor:
        """The last step's sampled activation gradients, unscaled, float32 (entries that flushed are 0)."""
        self.close()
        return self._values

    def attach(self, model: nn.Module) -> nn.Module:
        """Hook ``model`` (and unhook the previous one); return it."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._reset()
        groups: dict[str, list[nn.Parameter]] = {}
        for name, p in model.named_parameters():
            groups.setdefault(_module_of(name), []).append(p)
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda p, module=_module_of(name): self._param_grad(module, p)))
        self.layers = list(groups)
        self._norms = {m: [] for m in self.layers}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                self._handles.append(module.register_forward_hook(self._linear_output))
        return model

    def _buffers(self) -> dict:
        if self._pending is None:
            self._pending = {"sq": {}, "zeros": [], "numel": 0, "samples": [], "scale": None}
        return self._pending

    def _linear_output(self, module: nn.Module, args: object, out: Tensor) -> None:
        if out.requires_grad:
            out.register_hook(self._activation_grad)

    def _activation_grad(self, g: Tensor) -> None:
        buf = self._buffers()
        buf["zeros"].append((g == 0).sum())
        buf["numel"] += g.numel()
        stride = max(1, g.numel() // self.sample)
        buf["samples"].append(g.detach().flatten()[::stride].float())

    def _param_grad(self, module: str, p: Tensor) -> None:
        sq = self._buffers()["sq"]
        s = p.grad.detach().float().pow(2).sum()
        sq[module] = sq[module] + s if module in sq else s

    def loss_hook(self, loss: Tensor) -> Tensor:
        """Record the gradient that reaches ``loss`` in backward: the loss scale (times the micro-batch's weight)."""
        if loss.requires_grad:
            loss.register_hook(self._loss_grad)
        return loss

    def _loss_grad(self, g: Tensor) -> None:
        self._buffers()["scale"] = g.detach().float().reshape(())

    def begin(self, step: int) -> None:
        """Close the step before (if it ran backward) and start ``step``."""
        self.close()
        self._step = step

    def close(self) -> None:
        """Turn the last step's hooks' tensors into numbers (one host sync) and tell the listeners."""
        buf, self._pending = self._pending, None
        if buf is None or self._step is None or buf["scale"] is None:
            return
        scale = buf["scale"]
        names = list(buf["sq"])
        stacked = torch.stack([buf["sq"][m] for m in names] + [sum(buf["zeros"], torch.zeros(()))] + [scale])
        numbers = stacked.tolist()  # the probe's one host sync per step
        s = numbers[-1]
        norms = dict(zip(names, numbers[: len(names)]))
        for m in self.layers:
            self._norms[m].append(math.sqrt(norms[m]) / s if m in norms else math.nan)
        self._zero_fraction.append(numbers[-2] / max(1, buf["numel"]))
        self._scale.append(s)
        self._values = torch.cat(buf["samples"]).cpu() / s if buf["samples"] else torch.zeros(0)
        self._steps.append(self._step)
        for listener in self.listeners:
            listener(self)

    def heatmap(self) -> tuple[list[str], list[int], Tensor]:
        """Return ``(layers, steps, log10 norms)``: the layers x steps picture's data."""
        norms = torch.tensor([self.layer_norms[m] for m in self.layers], dtype=torch.float64)
        return self.layers, list(self.steps), norms.log10()


@dataclass(frozen=True, eq=False)
class Probed:
    """``task`` with ``probe`` attached to every model it builds: pass it wherever a task goes.

    >>> from labkit.tasks import ToyTask
    >>> Probed(ToyTask(), GradientProbe()).name
    'toy'
    """

    task: Task
    probe: GradientProbe

    @property
    def name(self) -> str:
        return self.task.name

    def model(self, device: str | torch.device = "cpu") -> nn.Module:
        return self.probe.attach(self.task.model(device))

    def batch(self, step: int, device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
        self.probe.begin(step)
        return self.task.batch(step, device)

    @property
    def loss_fn(self) -> Callable[[Tensor, Tensor], Tensor]:
        inner, probe = self.task.loss_fn, self.probe
        return lambda out, y: probe.loss_hook(inner(out, y))

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        # what the task has beyond the interface (val_loss, fingerprint, corpus) is still there
        return getattr(self.task, name)
