"""The probe that reads a run's gradients by hooks (``GradientProbe``); a task that carries it (``Probed``).

``GradientProbe`` watches a model while ``run_experiment`` (or any loop around ``TrainStep``)
trains it, through hooks only, so the step itself is untouched: for every step it records each
layer's gradient norm (unscaled, before clipping), the fraction of activation gradients that are
exactly zero (flushed: in fp16 without a scaler, values up to 2**-25, half the smallest
subnormal, round to 0), samples of the activation and the weight gradients, and every hooked
gradient's largest magnitude in the order backward produced them (``trace``, of ``GradStat``), so
the first that was not finite, the one closest to the loss, is named (``first_nonfinite``).
``Probed(task, probe)`` is the task with the probe attached to every model it builds, so it goes
wherever a task goes (``ExperimentConfig(task=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...names import module_of
from ...tasks import Task

__all__ = ["GradStat", "GradientProbe", "Probed"]


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

    @classmethod
    def holding(cls, steps: Sequence[int], *, layer_norms: Mapping[str, Sequence[float]] | None = None,
                loss_scale: Sequence[float] | None = None, trace: Sequence[Sequence[GradStat]] | None = None,
                zero_fraction: Sequence[float] | None = None) -> GradientProbe:
        """Return a probe that holds these measurements, as if it had watched them (to draw numbers kept).

        Each is per step, as the property of its name reads it (``layer_norms``: per layer, per
        step; ``layers`` are its keys); the loss scale is 1, no gradient a zero, the trace empty
        unless given. A probe held this way is not attached: ``attach`` starts it afresh.

        >>> p = GradientProbe.holding([0, 1], layer_norms={"a": [1.0, 10.0]})
        >>> p.layers, p.steps, p.loss_scale, p.first_nonfinite
        (['a'], [0, 1], [1.0, 1.0], [None, None])
        """
        steps = list(steps)
        norms = {m: list(v) for m, v in (layer_norms or {}).items()}
        per_step = {"loss_scale": [1.0] * len(steps) if loss_scale is None else list(loss_scale),
                    "trace": [[] for _ in steps] if trace is None else [list(s) for s in trace],
                    "zero_fraction": [0.0] * len(steps) if zero_fraction is None else list(zero_fraction),
                    **{f"layer_norms[{m!r}]": v for m, v in norms.items()}}
        wrong = {name: len(v) for name, v in per_step.items() if len(v) != len(steps)}
        if wrong:
            raise ValueError(f"each measurement needs one value per step ({len(steps)} steps), got {wrong}.")
        probe = cls()
        probe.layers, probe._steps, probe._norms = list(norms), steps, norms
        probe._scale, probe._trace = per_step["loss_scale"], per_step["trace"]
        probe._zero_fraction = per_step["zero_fraction"]
        return probe

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
        """Per step: the share of activation-gradient entries (``nn.Linear`` inputs, outputs) exactly 0."""
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
        linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear)
                  for p in m.parameters(recurse=False)}
        self._tied = {pid for pid, names in aliases.items() if len(names) > 1}
        for name, p in model.named_parameters():
            groups.setdefault(module_of(name), []).append(p)
            label = " = ".join(aliases[id(p)])
            # a tied weight's .grad adds its uses; if one is not a Linear (an fp32 embedding), not fp16's
            only_linear = id(p) in linear and id(p) not in self._tied
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda p, module=module_of(name), label=label, lin=only_linear:  # noqa: B008 (bound per loop)
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
        """Record the gradient that reaches ``loss`` in backward: the loss scale.

        (Times the micro-batch's weight, where the loss is one micro-batch's share.)
        """
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

