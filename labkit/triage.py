"""Why a loss was not finite: bad data, or a low-precision forward that overflowed.

A non-finite loss skips the step before backward and leaves the loss scale alone (the scale
acts on backward only). But "the loss is NaN" has two different causes with two different
fixes: a batch that holds NaN/inf (the data pipeline), and, under fp16 autocast, a forward
whose activations passed 65504 (attention logits, a residual stream that grew), where the data
is fine and the same forward in fp32 gives a finite loss. ``triage`` tells them apart, on bad
steps only:

1. ``nonfinite_input``: a floating tensor of the batch (inputs or targets) holds NaN/inf
   (checked first: one pass over the batch, no forward);
2. ``forward_overflow``: the batch is finite and the forward re-run once in fp32 (no autocast,
   no grad) gives a finite loss: the low-precision forward overflowed, and no loss scale helps;
3. ``nonfinite_loss``: neither (the model's weights, or the loss itself, give NaN in fp32 too).

On a ``forward_overflow`` the hook also names where: ``overflow_module`` re-runs the
low-precision forward once more with a hook on every module and returns the first module, in
the order the forward finishes them, whose inputs were finite and whose output was not (a
module fed a non-finite value only passes it on). The record's ``culprit_module`` says it
(``h.0.attn`` for attention logits past 65504, not the ``c_proj`` after it).

The re-run replays the step's own forward: the same micro-batches, the same output fault
(``Batch.loss``), the dropout masks of the same random state (restored after), and
the module's buffers put back as they were (BatchNorm's running statistics). It costs one
forward in fp32 on a bad step (and one more, in the low precision, on a forward overflow),
none on any other (an fp32 run re-runs nothing: its forward
was already fp32). Under ``torch.distributed`` every rank re-runs its own part and the ranks
agree with one all-reduce of two numbers: any rank's bad input makes it ``nonfinite_input``,
else a finite fp32 global loss makes it ``forward_overflow``. A model whose weights are
themselves fp16/bf16 has no fp32 forward to compare with: nothing is re-run, and its
overflow reads ``nonfinite_loss``.

``Triage`` is the hook (``TrainStep(hooks=[Triage()])``): its
``on_decision`` returns ``Verdict(skip=reason)`` on a step whose loss was not finite; the
step's rules do not change (skipped, the scale untouched, every rank the same).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .autocast import PRECISIONS, autocast
from .distributed import ProcessGroup, all_reduce_, is_distributed
from .faults import floating_tensors
from .hooks import DecisionView, Hook, Verdict
from .reasons import Reason

__all__ = ["Triage", "nonfinite_input", "overflow_module", "rng_state", "triage"]


def nonfinite_input(*batch: Any) -> Tensor:
    """Return a 0-dim bool tensor: does any floating tensor of ``batch`` hold NaN/inf? (no host sync)

    Tensors, dicts of them and tuples are searched; token ids (integers) cannot be non-finite.

    >>> nan = float("nan")
    >>> bool(nonfinite_input(torch.tensor([1.0, nan]), torch.ones(2))), bool(nonfinite_input(torch.ones(2)))
    (True, False)
    """
    flags = [(~torch.isfinite(t)).any() for t in floating_tensors(batch)]
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    return torch.stack([f.to(flags[0].device) for f in flags]).any()


def _micro_batches(batch: Any) -> list[tuple[Any, Any, float]]:
    if hasattr(batch, "micro_batches"):  # the step's Batch: its micro-batches and their weights
        return list(batch.micro_batches())
    inputs, targets = batch if isinstance(batch, tuple) else (batch, None)
    return [(inputs, targets, 1.0)]


def _inputs(batch: Any) -> tuple[Any, Any]:
    if hasattr(batch, "micro_batches"):
        return batch.inputs, batch.targets
    return batch if isinstance(batch, tuple) else (batch, None)


def rng_state(device: torch.device | None) -> tuple[Tensor, Tensor | None]:
    """Return the random state a forward on ``device`` draws its dropout masks from (CPU, and the GPU's)."""
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@torch.no_grad()
def _fp32_loss(model: nn.Module, loss_fn: Callable[..., Tensor], batch: Any,
               rng: tuple[Tensor, Tensor | None] | None) -> Tensor:
    """Re-run the step's forward in fp32 without grad; return its loss (float64, micro-batches weighed)."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = [device] if device.type == "cuda" else []
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        # forked whether or not the step's state is given: the re-run's dropout never moves the run's RNG
        with torch.random.fork_rng(devices=cuda), \
                torch.autocast(device.type, enabled=False):
            if rng is not None:  # the step's own dropout masks
                torch.set_rng_state(rng[0])
                if rng[1] is not None:
                    torch.cuda.set_rng_state(rng[1], device)
            for x, y, weight in _micro_batches(batch):
                if hasattr(batch, "loss"):  # the step's Batch: its fault acts where it acted in the step
                    loss = batch.loss(model, loss_fn, x, y)
                else:
                    out = model(**x) if isinstance(x, Mapping) else model(x)
                    loss = loss_fn(out) if y is None else loss_fn(out, y)
                total = total + loss.detach().to(torch.float64).reshape(()) * weight
    finally:
        for b, saved in buffers:  # the re-run's BatchNorm statistics are not the step's
            b.copy_(saved)
    return total


def _nonfinite(obj: Any) -> list[Tensor]:
    return [(~torch.isfinite(t)).any() for t in floating_tensors(obj)]


@torch.no_grad()
def overflow_module(model: nn.Module, loss_fn: Callable[..., Tensor], batch: Any, *, precision: str,
                    rng: tuple[Tensor, Tensor | None] | None = None,
                    process_group: ProcessGroup | None = None) -> str | None:
    """Return the module whose low-precision output first went non-finite from finite inputs, or None.

    Re-runs the step's forward under ``precision``'s autocast, as ``triage``'s fp32 re-run does
    (the same micro-batches, output fault, dropout masks; the buffers put back), with a forward
    hook on every module. Modules are taken in the order their forward finishes (a child before
    its parent); the first whose floating inputs are finite and whose output is not made the
    non-finite value. The flags stay on the device until one read at the end. Under
    ``torch.distributed`` the ranks agree on the earliest module in ``named_modules`` order (one
    all-reduce). ``""`` is the root module; None: no module's output went non-finite (the loss did).

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> with torch.no_grad(): _ = net[2].weight.fill_(1e5)
    >>> overflow_module(net, nn.functional.mse_loss, (torch.ones(1, 2), torch.zeros(1, 1)), precision="fp16")
    '2'
    """
    names = {m: name for name, m in model.named_modules()}
    index = {name: i for i, name in enumerate(names.values())}
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    seen: list[tuple[str, Tensor, Tensor]] = []

    def watch(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        inputs, outputs = _nonfinite((args, kwargs)), _nonfinite(out)
        if outputs:
            bad_in = torch.stack(inputs).any() if inputs else torch.zeros((), dtype=torch.bool, device=device)
            seen.append((names[module], bad_in, torch.stack(outputs).any()))

    handles = [m.register_forward_hook(watch, with_kwargs=True) for m in names]
    corrupt = getattr(batch, "corrupt_output", lambda out: out)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if rng is not None:
                torch.set_rng_state(rng[0])
                if rng[1] is not None:
                    torch.cuda.set_rng_state(rng[1], device)
            for x, _, _ in _micro_batches(batch):
                with autocast(precision, device):  # the step's own forward
                    corrupt(model(**x) if isinstance(x, Mapping) else model(x))
    finally:
        for h in handles:
            h.remove()
        for b, saved in buffers:
            b.copy_(saved)
    where = len(index)
    if seen:  # one read of every flag: a module that made the non-finite value had none coming in
        flags = torch.stack([torch.stack([i.to(device), o.to(device)]) for _, i, o in seen]).tolist()
        where = next((index[name] for (name, _, _), (bad_in, bad_out) in zip(seen, flags)
                      if bad_out and not bad_in), where)
    if is_distributed():
        where = int(all_reduce_(torch.tensor([where], device=device), "min", process_group).item())
    return list(index)[where] if where < len(index) else None


def triage(model: nn.Module, loss_fn: Callable[..., Tensor], batch: Any, *, precision: str,
           rng: tuple[Tensor, Tensor | None] | None = None,
           process_group: ProcessGroup | None = None) -> Reason:
    """Return why a step's loss was not finite: ``nonfinite_input``, ``forward_overflow``, ``nonfinite_loss``.

    ``batch`` is the step's ``Batch`` (its micro-batches, weights and output fault) or an
    ``(inputs, targets)`` pair (``targets=None``: ``loss_fn(output)``); ``rng`` the random
    state from before the forward (``rng_state``), to replay its dropout. Host syncs: one read
    of the input check, and one of the fp32 loss when the inputs are finite (one read of both
    under ``torch.distributed``, after one all-reduce). Call it on a bad step only.

    >>> net = nn.Linear(2, 1)
    >>> bad = torch.tensor([[float("nan"), 1.0]])
    >>> triage(net, nn.functional.mse_loss, (bad, torch.zeros(1, 1)), precision="fp16")
    <Reason.NONFINITE_INPUT: 'nonfinite_input'>
    >>> with torch.no_grad(): _ = net.weight.fill_(1e4)
    >>> x, y = torch.full((1, 2), 4.0), torch.zeros(1, 1)  # net(x) is 8e4: inf in fp16, finite in fp32
    >>> triage(net, nn.functional.mse_loss, (x, y), precision="fp16")
    <Reason.FORWARD_OVERFLOW: 'forward_overflow'>
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}.")
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    bad = nonfinite_input(*_inputs(batch)).to(device)  # on the model's device: NCCL reduces no CPU tensor
    distributed = is_distributed()
    if not distributed and bool(bad):  # host sync, on a bad step only: no forward needed for bad data
        return Reason.NONFINITE_INPUT
    # fp16/bf16 weights have no fp32 forward to compare with (and fp32 inputs would not fit them); the
    # same on every rank, as the weights' dtypes are
    low = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    if PRECISIONS[precision] is not None and not low:
        loss = _fp32_loss(model, loss_fn, batch, rng)
    else:  # the forward was fp32 already (a re-run would give the same loss), or cannot be
        loss = torch.full((), float("nan"), dtype=torch.float64, device=device)
    # every rank re-ran its own part (a rank that skipped it would leave FSDP's gathers unmatched)
    both = all_reduce_(torch.stack([bad.to(torch.float64), loss]), "sum", process_group)
    inputs, fp32_loss = both.tolist()  # host sync: one read of both
    if inputs > 0:
        return Reason.NONFINITE_INPUT
    if fp32_loss - fp32_loss == 0:  # finite: the low-precision forward overflowed
        return Reason.FORWARD_OVERFLOW
    return Reason.NONFINITE_LOSS


class Triage(Hook):
    """Refine a non-finite loss's skip reason (``triage``): ``nonfinite_input``, ``forward_overflow``, or not.

    On a ``forward_overflow`` its verdict also sets ``culprit_module`` (``overflow_module``).

    With ``TrainStep`` (``hooks=[Triage()]``) it reads the model, the loss
    function, the precision and the process group from the step. In a plain loop pass them,
    call ``pre_step(None, step)`` before the forward (it keeps the random state for the
    re-run's dropout) and, on a non-finite loss, ``on_decision(None, DecisionView(step, loss,
    nan, loss_bad=True, batch=(inputs, targets)))``; its ``skip`` is the reason. It needs the
    loss checked on the host, so ``TrainStep(sync_every=N)`` refuses it.

    >>> from labkit import ToyTask
    >>> task = ToyTask(); model = task.model(); x, y = task.batch(0)
    >>> hook = Triage(model, task.loss_fn, "fp16"); hook.pre_step(None, 0)
    >>> view = DecisionView(0, float("nan"), float("nan"), loss_bad=True, batch=(x * float("inf"), y))
    >>> hook.on_decision(None, view)
    Verdict(skip=<Reason.NONFINITE_INPUT: 'nonfinite_input'>, clip_to=None, clip_reason=None, fields={})
    """

    priority = 50
    per_step = True  # the loss must be checked on the host: with sync_every the check stays on the device

    def __init__(self, model: nn.Module | None = None, loss_fn: Callable[..., Tensor] | None = None,
                 precision: str | None = None, *, process_group: ProcessGroup | None = None) -> None:
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}.")
        self.model, self.loss_fn, self.precision = model, loss_fn, precision
        self.process_group = process_group
        self._rng: tuple[Tensor, Tensor | None] | None = None

    def attach(self, trainer: Any) -> None:
        """Take what is not given from ``trainer``: its model, loss function, precision and process group."""
        self.model = self.model if self.model is not None else trainer.model
        self.loss_fn = self.loss_fn if self.loss_fn is not None else trainer.loss_fn
        self.precision = self.precision if self.precision is not None else trainer.precision
        self.process_group = self.process_group if self.process_group is not None else \
            getattr(trainer, "process_group", None)

    def pre_step(self, trainer: Any, step: int) -> None:
        """Keep the random state the forward will draw from (a copy of a few KB; no host sync)."""
        if self.model is not None:
            first = next(self.model.parameters(), None)
            self._rng = rng_state(first.device if first is not None else None)

    def on_decision(self, trainer: Any, view: DecisionView) -> Verdict | None:
        """On a non-finite loss, return ``Verdict(skip=reason)``; else None."""
        if not view.loss_bad:
            return None
        if self.model is None or self.loss_fn is None or self.precision is None:
            raise RuntimeError("Triage needs the model, the loss function and the precision: pass them, or "
                               "attach(trainer) first (TrainStep does).")
        reason = triage(self.model, self.loss_fn, view.batch, precision=self.precision, rng=self._rng,
                        process_group=self.process_group)
        if reason is not Reason.FORWARD_OVERFLOW:
            return Verdict(skip=reason)
        where = overflow_module(self.model, self.loss_fn, view.batch, precision=self.precision, rng=self._rng,
                                process_group=self.process_group)
        return Verdict(skip=reason, fields={} if where is None else {"culprit_module": where})
