"""What a spike leaves in Adam: the second moment ``exp_avg_sq`` and the step size it allows.

Adam divides each coordinate's update by ``sqrt(v_hat) + eps``, with ``v`` an EMA of the
squared gradients (``beta2``) and ``v_hat = v / (1 - beta2**t)`` (Kingma & Ba 2015, Alg. 1;
``torch.optim.Adam``). So a constant factor on every gradient cancels (up to ``eps``): clipping
every step to a fixed norm under Adam is close to normalising the gradient, not a
learning-rate cut as it is under SGD (lesson 05 measures both). What does hurt is one
huge gradient entering ``v``: ``v`` then decays by ``beta2`` per step, a factor ``e`` every
``1 / (1 - beta2)`` steps (20 for LLM runs' 0.95, 1000 for torch's default 0.999), and every
update is shrunk by ``sqrt(v_hat)`` until it has. A clipped spike still enters ``v`` (at the
clip's norm) and ``m`` (its direction); a skipped step enters neither, which is why OLMo-core
skips outliers on top of clipping at 1.0. Its ``SkipStepAdamW`` (``optim/adamw.py``,
``adamw_step``) still runs the whole AdamW math with a 0/1 ``step_factor`` multiplied into the
moments' new terms and the update: that saves a host sync, not the arithmetic, and keeps a
spike out, not a NaN (``step_factor * grad * grad`` is NaN when ``grad`` is).

``AdamWatch`` reads Adam's own state after every step; ``plot_adam_moments`` draws it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from ..hooks import Hook
from ..steplog import StepLog

__all__ = ["AdamWatch", "plot_adam_moments"]


class AdamWatch(Hook):
    """Record, per optimizer step, Adam's ``v_hat``, the step size it allows, and the update applied.

    A ``labkit.hooks.Hook``: pass it to the step (``run_experiment(config, observer=watch)``,
    or ``TrainStep(hooks=[watch])``), which attaches it to its optimizer and
    calls it around every optimizer step; a plain loop passes ``optimizer=`` and calls
    ``before_step``/``after_step`` around ``optimizer.step()``. After
    each step it reads the optimizer's own ``exp_avg_sq`` and ``step`` (nothing is recomputed)
    and records, over every coordinate of every parameter:

    - ``v_hat``: the median of ``exp_avg_sq / (1 - beta2**t)``;
    - ``step_size``: the median of ``lr / (sqrt(v_hat) + eps)``, the step Adam takes per unit of
      ``m_hat`` (the effective learning rate of a typical coordinate);
    - ``update``: the RMS of the update really applied, ``w_after - w_before`` (also for SGD,
      whose ``v_hat`` and ``step_size`` are NaN).

    A skipped step is recorded too (``v`` as it was, update 0). Cost, on every step: a copy of
    the weights, a median over all coordinates and one host sync: a lab instrument.

    >>> w = torch.nn.Parameter(torch.zeros(3)); opt = torch.optim.Adam([w], lr=0.1, betas=(0.9, 0.5))
    >>> watch = AdamWatch(optimizer=opt)
    >>> for g in (1.0, 100.0, 1.0):
    ...     w.grad = torch.full((3,), g); watch.before_step([("w", w)], 0); opt.step()
    ...     watch.after_step([("w", w)], None)
    >>> [round(v, 1) for v in watch.v_hat]  # the 100x gradient's square lingers: v = 0.5 v + 0.5 g^2
    [1.0, 6667.0, 2857.9]
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.optimizer = optimizer
        self.steps: list[int] = []
        self.v_hat: list[float] = []
        self.step_size: list[float] = []
        self.update: list[float] = []
        self._before: list[Tensor] | None = None

    def attach(self, trainer: Any) -> None:
        """Watch ``trainer.optimizer`` (a ``TrainStep``'s)."""
        self.optimizer = trainer.optimizer

    def pre_optim_step(self, trainer: Any, step: int, params: Sequence[tuple[str, Tensor]]) -> None:
        """The step's moment before ``optimizer.step()``: ``before_step``."""
        self.before_step(params, step)

    def post_step(self, trainer: Any, params: Sequence[tuple[str, Tensor]], record: Any) -> None:
        """The step's moment after the optimizer step or skip: ``after_step``."""
        self.after_step(params, record)

    def before_step(self, params: Sequence[tuple[str, Tensor]], step: int) -> None:
        """Keep a copy of the weights the optimizer is about to change."""
        self._before = [p.detach().clone() for _, p in params]

    def after_step(self, params: Sequence[tuple[str, Tensor]], record: Any) -> None:
        """Read the optimizer's state and append this step's numbers."""
        if self.optimizer is None:
            raise RuntimeError("AdamWatch has no optimizer: pass optimizer=, or attach(trainer) before "
                               "training.")
        before, self._before = self._before, None
        skipped = before is None or bool(getattr(record, "skipped", False))
        moved = torch.zeros((), device=params[0][1].device if params else None)  # stacked with v_hat's below
        if not skipped:
            moved = torch.stack([(p.detach().float() - b.float()).pow(2).sum()
                                 for (_, p), b in zip(params, before)]).sum()
        count = sum(p.numel() for _, p in params)
        v_hats, sizes = [], []
        for group in self.optimizer.param_groups:
            beta2, eps = group.get("betas", (math.nan, math.nan))[1], group.get("eps", math.nan)
            lr = group["lr"]
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                if "exp_avg_sq" not in state:
                    continue
                t = float(state["step"])
                v_hat = state["exp_avg_sq"].detach().float().flatten() / (1.0 - beta2**t)
                v_hats.append(v_hat)
                sizes.append(lr / (v_hat.sqrt() + eps))
        if v_hats:
            v_all, s_all = torch.cat(v_hats), torch.cat(sizes)
            numbers = torch.stack([v_all.median(), s_all.median(), moved]).tolist()  # the one host sync
        else:
            numbers = [math.nan, math.nan, moved.item()]
        step = getattr(record, "step", len(self.steps))
        self.steps.append(step)
        self.v_hat.append(numbers[0])
        self.step_size.append(numbers[1])
        self.update.append(math.sqrt(numbers[2] / max(count, 1)))


def plot_adam_moments(watches: Mapping[str, AdamWatch], logs: Mapping[str, StepLog] | None = None, *,
                      spike_step: int | None = None, beta2: float | None = None,
                      title: str | None = None) -> Figure:
    """Draw each run's ``v_hat`` and effective step size (and its loss, given ``logs``) against step.

    ``spike_step`` marks the spike; ``beta2`` marks ``1 / (1 - beta2)`` steps after it, the
    time ``v`` takes to fall by a factor ``e``.

    >>> w = AdamWatch()
    >>> w.steps, w.v_hat, w.step_size, w.update = [0, 1], [1e-6, 1e-2], [3.0, 0.03], [0.1, 0.1]
    >>> fig = plot_adam_moments({"run": w}, spike_step=1)
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['v_hat (median)', 'lr / (sqrt(v_hat) + eps)']
    """
    if not watches:
        raise ValueError("watches must hold at least one run: {'name': AdamWatch}.")
    panels = ["v", "step"] + (["loss"] if logs else [])
    fig = Figure(figsize=(9, 1.9 * len(panels) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(zip(panels, fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]))
    styles = ("-", "--", ":", "-.")
    for i, (name, watch) in enumerate(watches.items()):
        style = {"color": f"C{i}", "ls": styles[i % len(styles)], "lw": 1.4, "label": name}
        axes["v"].plot(watch.steps, watch.v_hat, **style)
        axes["step"].plot(watch.steps, watch.step_size, **style)
        if logs and name in logs:
            live = logs[name].kept()
            losses = [r.loss if math.isfinite(r.loss) else math.nan for r in live]
            axes["loss"].plot([r.step for r in live], losses, **style)
    axes["v"].set_ylabel("v_hat (median)")
    axes["step"].set_ylabel("lr / (sqrt(v_hat) + eps)")
    if "loss" in axes:
        axes["loss"].set_ylabel("loss")
    for name, ax in axes.items():
        ax.set_yscale("log")
        if spike_step is not None:
            ax.axvline(spike_step, color="C3", lw=0.8, ls=":")
            if beta2 is not None and name == "v":
                end = spike_step + 1.0 / (1.0 - beta2)
                ax.axvspan(spike_step, end, color="C3", alpha=0.08, lw=0)
                ax.text(end, 0.95, f" 1/(1-beta2) = {1.0 / (1.0 - beta2):g} steps", fontsize=7, va="top",
                        color="C3", transform=ax.get_xaxis_transform())
    axes["v"].legend(fontsize=7, loc="upper left")
    axes[panels[-1]].set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
