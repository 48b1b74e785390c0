"""One step's batch: checked, moved, split into micro-batches or taken as given; the module's buffers kept."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..faults import Fault, Injection

__all__ = [
    "Batch", "Buffers", "LossCheck", "batch_size", "check_loss", "given_micro_batches", "gradient_sync",
    "split", "to_device",
]


def batch_size(inputs: Any, targets: Any, k: int) -> int:
    """Return the batch size, or raise saying how to pass the batch (before anything is touched).

    >>> batch_size(torch.zeros(8, 3), torch.zeros(8), 2)
    8
    """
    # a tensor first, and shape[0], not len(): the usual batch costs a few attribute reads a step
    if isinstance(inputs, Tensor):
        if not inputs.dim():
            raise ValueError(
                "inputs is a 0-d tensor: a batch needs a first (batch) dimension, e.g. x.unsqueeze(0)."
            )
        n, what = inputs.shape[0], "inputs"
    elif isinstance(inputs, Mapping):
        sizes = {key: v.shape[0] if v.dim() else None for key, v in inputs.items() if isinstance(v, Tensor)}
        if not sizes or None in sizes.values() or len(set(sizes.values())) != 1:
            raise ValueError(
                "a dict batch (model(**batch)) needs tensors that share their first (batch) dimension, "
                f"got sizes {sizes}."
            )
        n, what = next(iter(sizes.values())), "samples in the dict batch"
    else:
        raise TypeError(
            f"inputs must be a torch.Tensor or a dict of tensors (passed as model(**batch)), got "
            f"{type(inputs).__name__}; convert it with torch.as_tensor(...)."
        )
    if targets is not None:
        if not isinstance(targets, Tensor) or not targets.dim():
            raise TypeError(
                "targets must be a torch.Tensor with a batch dimension, or None for a one-argument "
                f"loss_fn(output), "
                f"got {type(targets).__name__ if not isinstance(targets, Tensor) else '0-d tensor'}."
            )
        if targets.shape[0] != n:
            raise ValueError(f"need as many targets as {what}; got {n} {what} and {len(targets)} targets.")
    if n < k:
        raise ValueError(f"need at least accumulation_steps={k} samples to split, got {n}.")
    return n


def split(batch: Any, k: int) -> list[Any]:
    """Return ``k`` micro-batches of a tensor, a dict of tensors (other values repeated) or None."""
    if batch is None:
        return [None] * k
    if isinstance(batch, Tensor):
        return [batch] if k == 1 else list(torch.tensor_split(batch, k))
    parts = {key: torch.tensor_split(v, k) if isinstance(v, Tensor) else [v] * k for key, v in batch.items()}
    return [{key: p[i] for key, p in parts.items()} for i in range(k)]


def to_device(batch: Any, device: torch.device) -> Any:
    """Return ``batch`` (a tensor, a dict of them, or None) on ``device``, copied without blocking."""
    if isinstance(batch, Tensor):  # already there: no dispatch of a .to that does nothing
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(v, device) for key, v in batch.items()}
    return batch


def given_micro_batches(inputs: Any, k: int) -> list[tuple[Any, Any]] | None:
    """Return the micro-batches a loop fetched itself as ``(inputs, targets)`` pairs, or None for one batch.

    A list is the step's micro-batches (``len`` of them; ``k``, ``accumulation_steps``, must
    agree unless it is 1); an iterator gives ``k`` (``next`` ``k`` times, no more: a data
    loader's iterator goes on where the step left it); a callable is called ``k`` times (as
    nanoGPT's ``get_batch``). Each is a tensor or a dict (``loss_fn(output)``), or an
    ``(inputs, targets)`` pair. All are taken before anything changes, so a bad one raises first.

    >>> [x.tolist() for x, _ in given_micro_batches([torch.zeros(1), torch.ones(1)], 1)]
    [[0.0], [1.0]]
    >>> len(given_micro_batches(lambda: (torch.zeros(2, 3), torch.zeros(2)), 4))
    4
    """
    if isinstance(inputs, (Tensor, Mapping)):
        return None
    if isinstance(inputs, tuple):
        raise TypeError(
            "a tuple is ambiguous here: pass one batch as step(inputs, targets), or the micro-batches as a "
            "list, step([(x0, y0), (x1, y1), ...])."
        )
    if isinstance(inputs, list):
        if not inputs:
            raise ValueError("the list of micro-batches is empty: pass at least one.")
        if not _is_batch(inputs[0]):  # nested Python numbers: a batch not yet a tensor (batch_size says so)
            return None
        if k != 1 and len(inputs) != k:
            raise ValueError(f"got {len(inputs)} micro-batches with accumulation_steps={k}: pass {k}, or "
                             "leave accumulation_steps at 1 to take the list's length.")
        items = inputs
    elif isinstance(inputs, Iterator):
        items = list(itertools.islice(inputs, k))
        if len(items) < k:
            raise ValueError(f"the iterator gave {len(items)} micro-batches; accumulation_steps={k} needs "
                             f"{k}.")
    elif callable(inputs):
        items = [inputs() for _ in range(k)]
    else:
        return None  # batch_size says what a batch may be
    pairs = []
    for i, item in enumerate(items):
        if not _is_batch(item):
            raise TypeError(f"micro-batch {i} is a {type(item).__name__}: each must be a tensor, a dict of "
                            "tensors (model(**batch)) or an (inputs, targets) pair of them.")
        pairs.append((item, None) if isinstance(item, (Tensor, Mapping)) else (item[0], item[1]))
        batch_size(*pairs[-1], 1)
    return pairs


def _is_batch(item: Any) -> bool:
    """Whether ``item`` is one micro-batch: a tensor, a dict, or an ``(inputs, targets)`` pair of them."""
    if isinstance(item, (tuple, list)):
        return len(item) == 2 and isinstance(item[0], (Tensor, Mapping))
    return isinstance(item, (Tensor, Mapping))


def gradient_sync(model: nn.Module, on: bool) -> contextlib.AbstractContextManager:
    """Run one micro-batch's forward and backward with the gradient reduction on (the last one) or off.

    Off is DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync(False)`` (switched back
    on after): the gradients accumulate locally and are reduced once per optimizer step, in the
    last micro-batch's backward, as nanoGPT's ``require_backward_grad_sync`` does. Any other
    model runs as it is.

    >>> with gradient_sync(nn.Linear(1, 1), on=False): pass
    """
    return contextlib.nullcontext() if on else _sync_off(model)


@contextlib.contextmanager
def _sync_off(model: nn.Module) -> Iterator[None]:
    # asked of the class (DDP's no_sync and FSDP2's switch are methods): a plain module's __getattr__ would
    # raise and catch an AttributeError for each, every micro-batch
    if callable(getattr(type(model), "no_sync", None)):
        with model.no_sync():  # type: ignore[operator]
            yield
    elif callable(getattr(type(model), "set_requires_gradient_sync", None)):
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
    else:
        yield


def check_loss(loss: Any, *, grad: bool) -> Tensor:
    """Return ``loss`` if backward can run on it (``grad``), else raise saying what loss_fn must return."""
    if not isinstance(loss, Tensor):
        tup = isinstance(loss, (tuple, list))
        hint = " (return the loss alone, not a tuple: e.g. lambda out: out[1])" if tup else ""
        raise TypeError(
            f"loss_fn must return a tensor that requires grad, got {type(loss).__name__}{hint}; a Python "
            "number carries no gradient: return e.g. nn.functional.mse_loss(output, targets)."
        )
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return one number (reduction='mean'), got shape {tuple(loss.shape)}.")
    if grad and not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: it was detached (.item(), .detach(), torch.no_grad()) or no "
            "trainable parameter was used; return the loss tensor straight from the model's output."
        )
    return loss


class Batch:
    """A step's batch, checked (before anything changes), on the device, with the scheduled fault applied.

    One batch is split into ``k`` micro-batches, each weighed by its share of the samples (exact
    for a mean-reduced loss). Micro-batches a loop fetched itself (``given_micro_batches``) are
    each ``loss / k``, as nanoGPT's ``loss / gradient_accumulation_steps``: the gradient is the
    mean of the micro-batches' mean losses.

    >>> b = Batch(torch.zeros(6, 2), torch.zeros(6, 1), 2, torch.device("cpu"), None)
    >>> [(tuple(x.shape), w) for x, _, w in b.micro_batches()]
    [((3, 2), 0.5), ((3, 2), 0.5)]
    """

    def __init__(self, inputs: Any, targets: Any, k: int, device: torch.device, fault: Fault | None) -> None:
        self.injection = Injection(fault) if fault is not None else None
        given = given_micro_batches(inputs, k)
        if given is not None and targets is not None:
            raise TypeError("with micro-batches, pass each one's targets inside it: "
                            "step([(x0, y0), (x1, y1)]).")
        self.given = given is not None
        if given is None:
            self.n, self.k = batch_size(inputs, targets, k), k
            self.inputs, self.targets = self._corrupt(to_device(inputs, device)), to_device(targets, device)
        else:
            self.k = len(given)
            self.parts = [(self._corrupt(to_device(x, device)), to_device(y, device)) for x, y in given]
            self.inputs, self.targets = [x for x, _ in self.parts], [y for _, y in self.parts]

    def _corrupt(self, inputs: Any) -> Any:
        return inputs if self.injection is None else self.injection.batch(inputs)

    def micro_batches(self) -> Iterator[tuple[Any, Any, float]]:
        """Yield ``(inputs, targets, weight)``: each micro-batch's share of a mean-reduced loss."""
        if self.given:
            for x, y in self.parts:
                yield x, y, 1.0 / self.k
            return
        if self.k == 1:
            yield self.inputs, self.targets, 1.0
            return
        for x, y in zip(split(self.inputs, self.k), split(self.targets, self.k)):
            # exact for a mean-reduced loss, even with unequal splits
            yield x, y, batch_size(x, None, 1) / self.n

    def loss(self, model: nn.Module, loss_fn: Any, x: Any, y: Any) -> Tensor:
        """Run one micro-batch's forward and loss, with the step's fault where it acts; return the loss.

        Under ``torch.no_grad()`` (triage's re-run) the loss is not asked to require grad.
        """
        inj = self.injection
        if inj is None:
            out = model(x) if isinstance(x, Tensor) else model(**x)
            return check_loss(loss_fn(out) if y is None else loss_fn(out, y), grad=torch.is_grad_enabled())
        with inj.forward(model):
            out = model(x) if isinstance(x, Tensor) else model(**x)
        loss = check_loss(loss_fn(out) if y is None else loss_fn(out, y), grad=torch.is_grad_enabled())
        return inj.loss(loss)

    def share(self, loss: Tensor, weight: float) -> Tensor:
        """Return a micro-batch's share of the step's loss, the one backward runs on."""
        if weight == 1:  # x1 is exact: one op less
            return loss
        return loss / self.k if self.given else loss * weight

    @property
    def label(self) -> str | None:
        """The fault's label for the record, e.g. ``"spike:10"``, if it acted."""
        return self.injection.label if self.injection is not None else None


class Buffers:
    """A copy of a module's buffers (BatchNorm's running statistics), to put back when the step is skipped.

    The forward changes them before the loss can be checked, so they are copied before it: 2
    numbers per BatchNorm channel, nothing for a model without buffers.
    """

    def __init__(self, model: nn.Module) -> None:
        self.live = _buffers(model)
        self.saved = [b.detach().clone() for b in self.live]

    def restore(self) -> None:
        with torch.no_grad():
            for b, s in zip(self.live, self.saved):
                b.copy_(s)

    def restore_where(self, row: Tensor, index: int) -> None:
        """Put the copy back if ``row[index]`` (a device number) is nonzero (skipped): a select, no sync."""
        if not self.live:
            return
        skipped = row[index] != 0
        with torch.no_grad():
            for b, s in zip(self.live, self.saved):
                b.copy_(torch.where(skipped.to(b.device), s, b))


def _buffers(model: nn.Module) -> list[Tensor]:
    """Return the tensors of ``model.buffers()`` (in another order) in one loop: no generators, names, memo.

    A buffer held by two modules is listed twice; copying it back twice puts back the same value.
    """
    live: list[Tensor] = []
    todo: list[nn.Module | None] = [model]
    while todo:
        m = todo.pop()
        if m is not None:
            if m._buffers:
                live += [b for b in m._buffers.values() if b is not None]
            todo += m._modules.values()
    return live


class LossCheck:
    """Hold the forward's loss and its check.

    The loss is a host float (``bad``: it was not finite, backward was skipped), or with deferred
    records a 0-dim device tensor and ``flag``, the device's "not finite" for the step.
    """

    __slots__ = ("bad", "flag", "value")

    def __init__(self, value: float | Tensor, bad: bool = False, flag: Tensor | None = None) -> None:
        self.value, self.bad, self.flag = value, bad, flag
