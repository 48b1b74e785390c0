"""What the gradients look like inside a run: the probe that reads them and the pictures of them.

``GradientProbe`` watches a model while ``run_experiment`` (or any loop around ``TrainStep``)
trains it, through hooks only, so the step itself is untouched: for every step it records each
layer's gradient norm (unscaled, before clipping), the fraction of activation gradients that are
exactly zero (flushed: in fp16 without a scaler, values up to 2**-25, half the smallest
subnormal, round to 0), samples of the activation and the weight gradients, and every hooked
gradient's largest magnitude in the order backward produced them (``trace``), so the first
that was not finite, the one closest to the loss, is named (``first_nonfinite``).
``Probed(task, probe)`` is the task with the probe attached to every model it builds, so it goes
wherever a task goes (``ExperimentConfig(task=...)``).

The pictures: ``GradHistogram`` (log2|g| over fp16's and bf16's ranges, with a loss-scale
slider; Micikevicius et al. 2018, "Mixed Precision Training", Fig. 3, live), ``plot_u_curve``
(flushed and overflowing fractions against log2 of the scale), ``plot_headroom`` (each step's
largest |gradient| x scale against fp16's 65504, the overflows and the tensor each started
in), ``plot_flushed_by_tensor`` (how zeros compound from the loss down), ``plot_layer_heatmap``
and ``plot_sawtooth``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from ..names import module_of
from ..steplog import StepLog
from ..tasks import Task
from .plots import _ipympl_active

__all__ = ["FP16_RANGE", "BF16_RANGE", "GradHistogram", "GradStat", "GradientProbe", "Probed", "flush_fractions",
           "plot_flushed_by_tensor", "plot_headroom", "plot_layer_heatmap", "plot_sawtooth", "plot_u_curve",
           "u_curve"]

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
    under, over = u_curve(values, [log2_scale])
    return under[0], over[0]


def u_curve(values: Tensor, log2_scales: Sequence[float]) -> tuple[list[float], list[float]]:
    """Return the flushed and the overflowing fraction of ``values`` at each log2 scale: the U's two arms.

    One sort, then two binary searches per scale: a slider or a 50-point curve over 10**5
    gradients costs milliseconds.

    >>> under, over = u_curve(torch.tensor([2.0**-30, 1.0]), [0, 10, 20])
    >>> under, over
    ([0.5, 0.0, 0.0], [0.0, 0.0, 0.5])
    """
    a = values.detach().abs().double().flatten()
    a = a[a > 0].sort().values
    n = a.numel()
    if n == 0:
        return [0.0] * len(log2_scales), [0.0] * len(log2_scales)
    s = torch.tensor([2.0**k for k in log2_scales], dtype=torch.float64)
    # |g| * s <= FLUSH  <=>  |g| <= FLUSH / s (exact: s is a power of two), likewise for overflow
    flushed = torch.searchsorted(a, _FLUSH / s, right=True)
    kept = torch.searchsorted(a, _OVERFLOW / s, right=False)
    return (flushed.double() / n).tolist(), ((n - kept).double() / n).tolist()


@dataclass(frozen=True)
class GradStat:
    """One gradient of one step, as backward produced it.

    ``name`` is a parameter's (``h.0.attn.c_proj.weight``; a tied one has all its names,
    ``wte.weight = lm_head.weight``) or a module's activation (``h.0.attn.c_proj (output)``,
    ``(input)``); ``kind`` is ``"weight"`` or ``"activation"``; ``amax`` its largest magnitude,
    unscaled (``inf``/``nan`` when the gradient held one; times the step's ``loss_scale`` it is
    what the tensor held); ``zero_fraction`` its share of exact zeros. ``linear``: only an
    ``nn.Linear`` computed it (its input, output, weight or bias gradient), which autocast runs
    in fp16; embeddings and LayerNorms run in fp32 under autocast, and a weight tied to one of
    them has a ``.grad`` that adds an fp32 part.
    """

    name: str
    kind: str
    amax: float
    zero_fraction: float
    linear: bool = True


class GradientProbe:
    """Record per-layer gradient norms, flushed fractions and gradient samples of a model, by hooks.

    ``attach(model)`` hooks every ``nn.Linear``'s input and output and every ``nn.Embedding``'s
    output (their gradients are the activation gradients that fp16 carries in backward), every
    parameter (its gradient's norm, grouped by module), and the task's loss (its gradient is the
    loss scale, so no scaler is needed to unscale). Each hook fires when backward produces its
    gradient, so ``trace`` is in backward order: from the loss to the input. A tied parameter
    (GPT's head and token embedding) is reported once, when its gradient is complete, and each
    Linear use of it also on its own (``lm_head.weight (this use)``: that use's share, recomputed
    in fp32 from the matmul's two operands), since the sum hides which use was large.
    ``begin(step)`` closes the previous step: one host sync per step, the probe's own cost
    (a few small tensors per hooked gradient), not the training step's. Attaching again forgets
    the old run.

    >>> from labkit.tasks import GPTTask
    >>> from labkit.lab.experiment import ExperimentConfig, run_experiment
    >>> probe = GradientProbe()
    >>> task = Probed(GPTTask(n_layer=1, n_embd=16, block_size=8, batch_size=2), probe)
    >>> log = run_experiment(ExperimentConfig(task=task, precision="fp32", steps=3, device="cpu"))
    >>> probe.steps, probe.layers[:2], len(probe.layer_norms["wte"])
    ([0, 1, 2], ['wte', 'wpe'], 3)
    >>> [g.name for g in probe.trace[-1][:2]], probe.trace[-1][-1].name, probe.first_nonfinite
    (['lm_head (output)', 'lm_head.weight (this use)'], 'wte.weight = lm_head.weight', [None, None, None])
    """

    def __init__(self, sample: int = 65536) -> None:
        self.sample = sample
        self._handles: list = []
        self._tied: set[int] = set()
        self.model: nn.Module | None = None
        self.listeners: list[Callable[[GradientProbe], None]] = []
        self._reset()

    def _reset(self) -> None:
        self.layers: list[str] = []
        self._steps: list[int] = []
        self._norms: dict[str, list[float]] = {}
        self._zero_fraction: list[float] = []
        self._scale: list[float] = []
        self._trace: list[list[GradStat]] = []
        self._values = {"activation": torch.zeros(0), "weight": torch.zeros(0)}
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
        """Per step: the fraction of activation-gradient entries (``nn.Linear`` inputs and outputs) that were exactly 0."""
        self.close()
        return self._zero_fraction

    @property
    def loss_scale(self) -> list[float]:
        """Per step: the gradient that reached the loss, i.e. the loss scale (1 without a scaler)."""
        self.close()
        return self._scale

    @property
    def values(self) -> Tensor:
        """The last step's gradients, unscaled, float32: the activation gradients and the weight gradients.

        At most ``sample`` entries (evenly strided) of each tensor; entries that flushed are 0.
        """
        self.close()
        return torch.cat([self._values["activation"], self._values["weight"]])

    @property
    def activation_values(self) -> Tensor:
        """The last step's activation gradients only (per token: they shrink as the batch grows)."""
        self.close()
        return self._values["activation"]

    @property
    def weight_values(self) -> Tensor:
        """The last step's weight gradients only (sums over the batch's tokens)."""
        self.close()
        return self._values["weight"]

    @property
    def trace(self) -> list[list[GradStat]]:
        """Per step: every hooked gradient, in the order backward produced it (nearest the loss first)."""
        self.close()
        return self._trace

    @property
    def first_nonfinite(self) -> list[str | None]:
        """Per step: the first gradient in backward order holding inf or NaN (where it started), or None.

        An overflow spreads back into every gradient upstream of it, so the first in
        *registration* order (the input layer) is the wrong one to blame; backward order is right.
        """
        return [next((g.name for g in stats if not math.isfinite(g.amax)), None) for stats in self.trace]

    def attach(self, model: nn.Module) -> nn.Module:
        """Hook ``model`` (and unhook the previous one); return it."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._reset()
        self.model = model  # the model this probe watches: e.g. for its validation loss after the run
        groups: dict[str, list[nn.Parameter]] = {}
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
        self._tied = {pid for pid, names in aliases.items() if len(names) > 1}
        for name, p in model.named_parameters():
            groups.setdefault(module_of(name), []).append(p)
            label = " = ".join(aliases[id(p)])
            # a tied weight's .grad adds its uses; if one is not a Linear (an fp32 embedding), it is not fp16's
            only_linear = id(p) in linear and id(p) not in self._tied
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda p, module=module_of(name), label=label, lin=only_linear:  # noqa: B008
                self._param_grad(module, label, p, lin)))
        self.layers = list(groups)
        self._norms = {m: [] for m in self.layers}
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                self._handles.append(module.register_forward_hook(
                    lambda m, args, out, name=name: self._activation_output(name, m, args, out)))
        return model

    def _buffers(self) -> dict:
        if self._pending is None:
            self._pending = {"sq": {}, "zeros": [], "numel": 0, "samples": {"activation": [], "weight": []},
                             "scale": None, "stats": []}
        return self._pending

    def _activation_output(self, name: str, module: nn.Module, args: tuple, out: Tensor) -> None:
        # Both sides of every Linear: under autocast its input is the fp16 cast, whose gradient
        # (out_grad @ W, in fp16) can overflow before any weight gradient does. An Embedding's
        # input is token ids: only its output has a gradient.
        sides = ((args[0], "input"), (out, "output")) if isinstance(module, nn.Linear) else ((out, "output"),)
        lin = isinstance(module, nn.Linear)
        for t, side in sides:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(lambda g, label=f"{name} ({side})": self._activation_grad(label, g, lin))
        if lin and id(module.weight) in self._tied and out.requires_grad:
            # This use's share of a tied weight's gradient, which its .grad hides in a sum: recomputed
            # in fp32 from the two tensors the Linear's weight-gradient matmul multiplies (one small matmul).
            x = args[0].detach()
            out.register_hook(lambda g, label=f"{name}.weight (this use)": self._use_grad(label, g, x))

    def _activation_grad(self, name: str, g: Tensor, linear: bool) -> None:
        buf = self._buffers()
        zeros = (g == 0).sum()
        buf["zeros"].append(zeros)
        buf["numel"] += g.numel()
        buf["samples"]["activation"].append(self._sample(g))
        buf["stats"].append((name, "activation", g.detach().abs().amax().float(), zeros, g.numel(), linear))

    def _use_grad(self, name: str, g: Tensor, x: Tensor) -> None:
        gw = g.detach().flatten(0, -2).float().t() @ x.flatten(0, -2).float()
        self._buffers()["stats"].append((name, "weight", gw.abs().amax(), (gw == 0).sum(), gw.numel(), True))

    def _sample(self, g: Tensor) -> Tensor:
        stride = max(1, g.numel() // self.sample)
        return g.detach().flatten()[::stride].float()

    def _param_grad(self, module: str, name: str, p: Tensor, linear: bool) -> None:
        buf = self._buffers()
        g = p.grad.detach()
        s = g.float().pow(2).sum()
        buf["sq"][module] = buf["sq"][module] + s if module in buf["sq"] else s
        buf["samples"]["weight"].append(self._sample(g))
        buf["stats"].append((name, "weight", g.abs().amax().float(), (g == 0).sum(), g.numel(), linear))

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
        stats = buf["stats"]
        device = scale.device
        stacked = torch.stack([buf["sq"][m].to(device) for m in names]
                              + [sum(buf["zeros"], torch.zeros((), device=device)).to(device), scale]
                              + [stat[2].to(device) for stat in stats]
                              + [stat[3].to(device).float() for stat in stats])
        numbers = stacked.tolist()  # the probe's one host sync per step
        n = len(names)
        s = numbers[n + 1]
        norms = dict(zip(names, numbers[:n]))
        for m in self.layers:
            self._norms[m].append(math.sqrt(norms[m]) / s if m in norms else math.nan)
        self._zero_fraction.append(numbers[n] / max(1, buf["numel"]))
        self._scale.append(s)
        amaxes, zeros = numbers[n + 2: n + 2 + len(stats)], numbers[n + 2 + len(stats):]
        self._trace.append([GradStat(name, kind, amax / s, z / max(1, numel), linear)
                            for (name, kind, _, _, numel, linear), amax, z in zip(stats, amaxes, zeros)])
        self._values = {kind: torch.cat(samples).cpu() / s if samples else torch.zeros(0)
                        for kind, samples in buf["samples"].items()}
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
        if name.startswith("__") or name in ("task", "probe"):  # not while copying or unpickling
            raise AttributeError(name)
        return getattr(self.task, name)


_BANDS = (  # (label, lo, hi, color) in log2|x|
    ("bf16 (normal)", BF16_RANGE[1], BF16_RANGE[2], "C2"),
    ("fp16 subnormal", FP16_RANGE[0], FP16_RANGE[1], "C1"),
    ("fp16 normal", FP16_RANGE[1], FP16_RANGE[2], "C0"),
)


def _log2_abs(values: Tensor) -> Tensor:
    a = values.detach().abs().double().flatten()
    return a[a > 0].log2()


_KIND_COLORS = {"all": "k", "activation": "k", "weight": "C3"}


class GradHistogram:
    """A histogram of log2|gradient| over fp16's and bf16's ranges, with a loss-scale slider.

    The bands are fp16's subnormal range [2**-24, 2**-14), its normal range up to 65504, and
    bf16's normal range (2**-126 .. 3.4e38, wider than the axis: bf16 flushes nothing here).
    Moving the slider multiplies the gradients by ``2**log2_scale``, shifting the histogram,
    and the title says what fp16 would flush to zero and to inf. ``values`` is one tensor, or
    ``{"activation": ..., "weight": ...}`` (``probe.activation_values``, ``probe.weight_values``):
    each kind is then drawn as its own outline, as a fraction of its own entries, and the title
    gives each kind's share. ``update(values)`` takes new gradients (pass ``every=`` and attach
    it with ``probe.listeners.append`` to follow a run live: it shows both kinds). Rendered like
    ``LiveDashboard``: ipympl's canvas, else a PNG image.

    >>> h = GradHistogram(torch.tensor([2.0**-30, 2.0**-20, 1.0]), log2_scale=0)
    >>> h.title()
    'scale 2^0: 33.3% flush to 0, 0.0% overflow (fp16)'
    >>> h.set_scale(10); h.title()
    'scale 2^10: 0.0% flush to 0, 0.0% overflow (fp16)'
    >>> GradHistogram({"activation": torch.tensor([2.0**-30, 1.0]), "weight": torch.tensor([1.0])}).title()
    'scale 2^0: flush to 0: activation 50.0%, weight 0.0%; overflow 0.0% (fp16)'
    """

    def __init__(self, values: Tensor | Mapping[str, Tensor] | None = None, log2_scale: int = 0, *, every: int = 10,
                 xlim: tuple[float, float] = (-48.0, 24.0), figsize: tuple[float, float] = (8, 3.2)) -> None:
        import ipywidgets as W

        self.every, self.xlim = every, xlim
        self.interactive = _ipympl_active()
        if self.interactive:
            import matplotlib.pyplot as plt

            with plt.ioff():
                fig = plt.figure(figsize=figsize)
            fig.canvas.header_visible = False
            fig.canvas.syncing_data_url = False  # see LiveDashboard: the page asks for the first frame
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            fig = Figure(figsize=figsize)
            FigureCanvasAgg(fig)
            self._image = W.Image(format="png")
        fig.subplots_adjust(left=0.08, right=0.98, top=0.88, bottom=0.17)
        self.figure, self.ax = fig, fig.add_subplot()
        ax = self.ax
        self.bands = {label: ax.axvspan(lo, hi, color=color, alpha=0.12 if "bf16" in label else 0.25, lw=0, label=label)
                      for label, lo, hi, color in _BANDS}
        # Named in place, not in a legend: a band's name belongs where the band is.
        for label, lo, hi, color in _BANDS:
            x = (max(lo, xlim[0]) + min(hi, xlim[1])) / 2 if "bf16" not in label else xlim[0] + 1
            ax.text(x, 0.97, label, transform=ax.get_xaxis_transform(), ha="center" if "bf16" not in label else "left",
                    va="top", fontsize=7, color=color)
        self.edges = torch.arange(xlim[0], xlim[1] + 0.5, 0.5, dtype=torch.float64)
        self.bars: dict[str, Any] = {}
        self._kind_labels: dict[str, Any] = {}
        ax.set_xlim(*xlim)
        ax.set_xlabel("log2 |gradient x scale|")
        ax.set_ylabel("fraction")
        self.slider = W.IntSlider(value=log2_scale, min=-8, max=40, description="scale 2^", continuous_update=True)
        self.slider.observe(lambda change: self.set_scale(change["new"]), names="value")
        self.slider.add_class("labkit-control-hist_scale")
        self._values: dict[str, Tensor] = {}
        self._seen = 0
        self._drawn_scale: int | None = None  # the scale the bars and title were last set for
        self.widget = W.VBox([self.slider, fig.canvas if self.interactive else self._image])
        self.widget.add_class("labkit-histogram")
        self.update(values if values is not None else torch.zeros(0), draw=False)

    @property
    def log2_scale(self) -> int:
        return self.slider.value

    def _repr_mimebundle_(self, **kwargs):  # type: ignore[no-untyped-def]
        self._paint(idle=True)
        return self.widget._repr_mimebundle_(**kwargs)

    def figure_mismatches(self) -> list[str]:
        """Return ``[]`` when the histogram shows the slider's scale, else what each says."""
        if self._drawn_scale in (None, self.log2_scale):
            return []
        return [f"scale: the slider says 2^{self.log2_scale}, the histogram shows 2^{self._drawn_scale}"]

    def fractions(self, kind: str | None = None) -> tuple[float, float]:
        """The fractions fp16 flushes to 0 and to inf at the slider's scale: of every entry, or of one ``kind``."""
        if kind is not None:
            if kind not in self._values:
                raise KeyError(f"no gradients of kind {kind!r}; this histogram has {sorted(self._values)}.")
            return flush_fractions(self._values[kind], self.log2_scale)
        return flush_fractions(torch.cat(list(self._values.values())), self.log2_scale)

    def title(self) -> str:
        under, over = self.fractions()
        if list(self._values) == ["all"]:
            return f"scale 2^{self.log2_scale}: {under:.1%} flush to 0, {over:.1%} overflow (fp16)"
        kinds = ", ".join(f"{kind} {self.fractions(kind)[0]:.1%}" for kind in self._values)
        return f"scale 2^{self.log2_scale}: flush to 0: {kinds}; overflow {over:.1%} (fp16)"

    def set_scale(self, log2_scale: int) -> None:
        """Shift the histogram to ``gradients * 2**log2_scale`` and redraw."""
        if self.slider.value != log2_scale:
            self.slider.value = log2_scale  # its observer comes back here
            return
        self._redraw(idle=True)

    def update(self, values: Tensor | Mapping[str, Tensor], draw: bool = True) -> None:
        """Show new gradient values (``probe.values``, or ``{"activation": ..., "weight": ...}``)."""
        kinds = {"all": values} if isinstance(values, Tensor) else dict(values)
        self._values = {kind: v.detach().float().cpu().flatten() for kind, v in kinds.items()}
        for kind in self._values:
            if kind not in self.bars:
                color = _KIND_COLORS.get(kind, f"C{len(self.bars) + 4}")
                filled = kind == "all"
                self.bars[kind] = self.ax.stairs([0.0] * (len(self.edges) - 1), self.edges.tolist(), fill=filled,
                                                 color=color, alpha=0.6 if filled else 0.9, lw=1.2)
                if not filled:  # named where it is drawn, as the bands are: no legend
                    self._kind_labels[kind] = self.ax.text(
                        0.99, 0.86 - 0.08 * len(self._kind_labels), f"{kind} gradients", transform=self.ax.transAxes,
                        ha="right", va="top", fontsize=8, color=color)
        for kind, bars in self.bars.items():
            bars.set_visible(kind in self._values)
            if kind in self._kind_labels:
                self._kind_labels[kind].set_visible(kind in self._values)
        if draw:
            self._redraw(idle=False)
        else:
            self._set_data()

    def __call__(self, probe: GradientProbe) -> None:
        """A probe listener: every ``every`` steps, show the probe's latest gradients (inside the run)."""
        self._seen += 1
        if self._seen % self.every == 0:
            self.update({"activation": probe.activation_values, "weight": probe.weight_values})

    def _set_data(self) -> None:
        top = 0.05
        for kind, values in self._values.items():
            x = _log2_abs(values) + self.log2_scale
            counts = torch.histogram(x.clamp(self.xlim[0], self.xlim[1] - 1e-9), self.edges).hist
            total = max(1, len(values))
            self.bars[kind].set_data((counts / total).tolist())
            top = max(top, float(counts.max()) / total * 1.15 if counts.numel() else 0.0)
        self.ax.set_ylim(0, top)
        self.ax.set_ylabel("fraction" if list(self._values) == ["all"] else "fraction of each kind")
        self.ax.set_title(self.title(), fontsize=9)
        self._drawn_scale = self.log2_scale

    def _redraw(self, idle: bool) -> None:
        self._set_data()
        self._paint(idle)

    def _paint(self, idle: bool) -> None:
        if not self.interactive:
            buf = io.BytesIO()
            self.figure.savefig(buf, format="png", dpi=80)
            self._image.value = buf.getvalue()
        elif idle:
            self.figure.canvas.draw_idle()
        else:
            self.figure.canvas.draw()


def plot_u_curve(values: Tensor, log2_scales: Sequence[int] = range(-8, 41), trajectory: Sequence[float] = (),
                 backoffs: Sequence[float] = ()) -> Figure:
    """Return the U-curve: the fraction fp16 flushes to 0 and to inf against log2 of the loss scale.

    ``trajectory`` (the scales a run used, e.g. ``log.column("scale")``) is drawn on the curve,
    darker for later steps; ``backoffs`` (the scales that overflowed) as red crosses.

    >>> fig = plot_u_curve(torch.tensor([2.0**-30, 1.0]), trajectory=[2.0**10, 2.0**11])
    >>> [line.get_label() for line in fig.axes[0].get_lines()][:2]
    ['flushed to 0', 'overflow (inf)']
    """
    fig = Figure(figsize=(7, 3.4), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    xs = list(log2_scales)
    under, over = u_curve(values, xs)
    ax.plot(xs, under, color="C0", label="flushed to 0")
    ax.plot(xs, over, color="C3", label="overflow (inf)")
    ax.plot(xs, [u + o for u, o in zip(under, over)], color="k", lw=0.8, ls=":", label="lost")
    if len(trajectory):
        t = [math.log2(s) for s in trajectory]
        lost = [sum(flush_fractions(values, s)) for s in t]
        ax.scatter(t, lost, c=range(len(t)), cmap="viridis", s=14, zorder=3, label="dynamic scaler's steps")
    if len(backoffs):
        b = [math.log2(s) for s in backoffs]
        ax.scatter(b, [sum(flush_fractions(values, s)) for s in b], marker="x", color="C3", s=40, zorder=4,
                   label="backoff (overflowed)")
    ax.set_xlabel("log2(loss scale)")
    ax.set_ylabel("fraction of gradient entries")
    ax.legend(fontsize=7, loc="upper center")
    return fig


def plot_layer_heatmap(probes: GradientProbe | Mapping[str, GradientProbe], title: str = "",
                       steps: int | None = None) -> Figure:
    """Return the layers x steps heatmap of log10 gradient norm (unscaled, before clipping).

    ``probes`` is one probe or ``{run: probe}``: several runs are stacked on one colour range
    with one colour bar, so the same colour means the same norm in each. ``steps`` (the runs'
    length) draws every step; a cell without a finite norm (inf or NaN: an entry was, or the sum
    of squares overflowed; or backward did not run) is grey, and a note on the panel says so and
    from which step.

    >>> p = GradientProbe(); p.layers = ["a", "b"]; p._norms = {"a": [1.0, 10.0], "b": [0.1, 0.1]}; p._steps = [0, 1]
    >>> plot_layer_heatmap(p).axes[0].get_yticklabels()[1].get_text()
    'b'
    """
    runs = {"": probes} if isinstance(probes, GradientProbe) else dict(probes)
    if not runs:
        raise ValueError("probes must hold at least one run: a GradientProbe or {'name': probe}.")
    grids = {}
    for name, probe in runs.items():
        layers, done, z = probe.heatmap()
        n = max([steps or 0, *(s + 1 for s in done)])
        grid = torch.full((len(layers), n), math.nan, dtype=torch.float64)
        for j, s in enumerate(done):
            grid[:, s] = z[:, j]
        grid[~torch.isfinite(grid)] = math.nan
        grids[name] = (layers, grid)
    finite = torch.cat([g[torch.isfinite(g)] for _, g in grids.values()])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    rows = sum(len(layers) for layers, _ in grids.values())
    fig = Figure(figsize=(8, 0.25 * rows + 1.1 * len(grids) + 0.4), layout="constrained")
    _agg(fig)
    axes = fig.subplots(len(grids), 1, sharex=True, squeeze=False,
                        height_ratios=[len(layers) for layers, _ in grids.values()])[:, 0]
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="0.85")
    for ax, (name, (layers, grid)) in zip(axes, grids.items()):
        n = grid.shape[1]
        im = ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", cmap=cmap, vmin=lo, vmax=hi,
                       extent=(-0.5, n - 0.5, len(layers) - 0.5, -0.5))
        # torch names the root module "" (named_modules): a root parameter's row gets a visible label
        ax.set_yticks(range(len(layers)), [m or "(root)" for m in layers], fontsize=7)
        if name:
            ax.set_title(name, fontsize=9, loc="left")
        grey = (~torch.isfinite(grid)).any(dim=0).nonzero().flatten().tolist()
        if grey:  # said on the panel: a grey cell is not a small norm
            ax.text(0.995, 0.98, f"grey: norm not finite (inf/NaN) or no backward, first at step {grey[0]}",
                    transform=ax.transAxes, ha="right", va="top", fontsize=7, color="0.15",
                    bbox={"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 1.5})
    axes[-1].set_xlabel("step")
    bar = fig.colorbar(im, ax=list(axes), label="log10 grad norm")
    for ax in axes:  # one bar for every panel: they share the colour range
        ax.images[0].colorbar = bar
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def plot_headroom(probe: GradientProbe, title: str = "") -> Figure:
    """Return each step's largest |gradient| x scale (as fp16 held it) against 65504, with the overflows named.

    From ``probe.trace`` of an fp16 run with a scaler: per step, the largest weight gradient and
    activation gradient of the ``nn.Linear`` layers (the ones autocast computes in fp16) times
    that step's loss scale, on a log2 axis, against fp16's largest value. A step whose backward
    overflowed gets a mark at the top, coloured by the gradient the inf first appeared in
    (backward order). Below 65504 by less than 2x, the next doubling of the scale overflows.
    A weight tied to an fp32 op (GPT's head and embedding) counts by its Linear use's share.

    >>> p = GradientProbe(); p._steps, p._scale = [0, 1], [2.0**16, 2.0**17]
    >>> p._trace = [[GradStat("w", "weight", 0.5, 0.0)], [GradStat("w", "weight", math.inf, 0.0)]]
    >>> ax = plot_headroom(p).axes[0]; [t.get_text() for t in ax.get_legend().get_texts()]
    ['weight gradients', 'fp16 max 65504', 'overflow: inf first in w (1)']
    """
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    steps, scales, trace = probe.steps, probe.loss_scale, probe.trace
    overflowed = [name is not None for name in probe.first_nonfinite]
    for kind, color in (("weight", "C3"), ("activation", "k")):
        ys = []  # an overflowed step has no largest value to draw: its mark goes on top instead
        for stats, s, bad in zip(trace, scales, overflowed):
            held = [g.amax * s for g in stats if g.kind == kind and g.linear]
            ys.append(max(held) if held and not bad and max(held) > 0 else math.nan)
        if any(math.isfinite(y) for y in ys):
            ax.plot(steps, ys, color=color, lw=1.0, marker=".", ms=3, label=f"{kind} gradients")
    ax.axhline(_F16.max, color="C0", lw=1.0, ls="--", label="fp16 max 65504")
    culprits: dict[str, list[int]] = {}
    for step, name in zip(steps, probe.first_nonfinite):
        if name is not None:
            culprits.setdefault(name, []).append(step)
    top = 2.0 * _F16.max
    for i, (name, at) in enumerate(culprits.items()):
        ax.plot(at, [top] * len(at), "v", color=f"C{(i + 4) % 10}", ms=7, ls="none",
                label=f"overflow: inf first in {name} ({len(at)})")
    ax.set_yscale("log", base=2)
    lo = min([y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y) and y > 0], default=1.0)
    ax.set_ylim(lo / 2, top * 2)
    ax.set_xlabel("step")
    ax.set_ylabel("max |gradient| x scale")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2)  # below: off the data
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def plot_flushed_by_tensor(probes: Mapping[str, GradientProbe], title: str = "") -> Figure:
    """Return each activation gradient's share of exact zeros (mean over steps), in backward order, per run.

    The rows run from the loss (top) to the input (bottom), in the order backward produced
    them: a gradient that flushed to 0 makes every gradient computed from it 0 as well, so in
    fp16 without a scaler the zeros pile up towards the input.

    >>> p = GradientProbe(); p._steps, p._scale = [0], [1.0]
    >>> p._trace = [[GradStat("head (output)", "activation", 1.0, 0.1), GradStat("w", "weight", 1.0, 0.0)]]
    >>> [t.get_text() for t in plot_flushed_by_tensor({"run": p}).axes[0].get_yticklabels()]
    ['head (output)']
    """
    if not probes:
        raise ValueError("probes must hold at least one run: {'name': GradientProbe}.")
    first = next(iter(probes.values())).trace
    names = [g.name for g in first[-1] if g.kind == "activation"] if first else []
    fig = Figure(figsize=(8, 0.22 * len(names) + 1.2), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    height = 0.8 / len(probes)
    for i, (run, probe) in enumerate(probes.items()):
        sums: dict[str, list[float]] = {}
        for stats in probe.trace:
            for g in stats:
                sums.setdefault(g.name, []).append(g.zero_fraction)
        means = [sum(sums.get(n, [math.nan])) / len(sums.get(n, [math.nan])) for n in names]
        overall = sum(probe.zero_fraction) / max(1, len(probe.zero_fraction))  # bars of ~0 length: named anyway
        ax.barh([j + i * height for j in range(len(names))], means, height=height, color=f"C{i}",
                label=f"{run} ({overall:.1%} of all entries)")
    ax.set_yticks([j + (len(probes) - 1) * height / 2 for j in range(len(names))], names, fontsize=7)
    ax.set_ylim(len(names) - 1 + (len(probes) - 0.5) * height + 0.1, -height / 2 - 0.1)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of entries exactly 0 (mean over steps)")
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def plot_sawtooth(log: StepLog, title: str = "") -> Figure:
    """Return the loss scale against step (log2 axis) with each backoff marked.

    >>> from labkit.records import StepRecord
    >>> log = StepLog([StepRecord(0, 1.0, scale=4.0, next_scale=8.0), StepRecord(1, 1.0, scale=8.0, next_scale=4.0,
    ...                skipped=True, reason="nonfinite_grad")])
    >>> fig = plot_sawtooth(log); fig.axes[0].get_lines()[1].get_xdata().tolist()
    [1]
    """
    fig = Figure(figsize=(8, 2.8), layout="constrained")
    _agg(fig)
    ax = fig.add_subplot()
    steps, scales = log.column("step"), log.column("scale")
    ax.plot(steps, scales, drawstyle="steps-post", color="C4", lw=1.2, label="loss scale")
    back = [r for r in log if r.next_scale < r.scale]
    ax.plot([r.step for r in back], [r.scale for r in back], "v", color="C3", ms=6, ls="none",
            label=f"backoff: gradient overflowed ({len(back)})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def _agg(fig: Figure) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
