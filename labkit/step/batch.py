"""One step's batch: checked, moved to the device, split into micro-batches; the module's buffers kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..faults import Fault

__all__ = [
    "PRECISIONS", "Batch", "Buffers", "LossCheck", "autocast", "batch_size", "check_loss", "split",
    "to_device",
]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Return the context a forward runs under: autocast to ``precision``'s dtype, or nothing for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def batch_size(inputs: Any, targets: Any, k: int) -> int:
    """Return the batch size, or raise saying how to pass the batch (before anything is touched).

    >>> batch_size(torch.zeros(8, 3), torch.zeros(8), 2)
    8
    """
    if isinstance(inputs, Mapping):
        sizes = {key: v.shape[0] if v.dim() else None for key, v in inputs.items() if isinstance(v, Tensor)}
        if not sizes or None in sizes.values() or len(set(sizes.values())) != 1:
            raise ValueError(
                "a dict batch (model(**batch)) needs tensors that share their first (batch) dimension, "
                f"got sizes {sizes}."
            )
        n, what = next(iter(sizes.values())), "samples in the dict batch"
    elif isinstance(inputs, Tensor):
        if inputs.dim() == 0:
            raise ValueError(
                "inputs is a 0-d tensor: a batch needs a first (batch) dimension, e.g. x.unsqueeze(0)."
            )
        n, what = len(inputs), "inputs"
    else:
        raise TypeError(
            f"inputs must be a torch.Tensor or a dict of tensors (passed as model(**batch)), got "
            f"{type(inputs).__name__}; convert it with torch.as_tensor(...)."
        )
    if targets is not None:
        if not isinstance(targets, Tensor) or targets.dim() == 0:
            raise TypeError(
                "targets must be a torch.Tensor with a batch dimension, or None for a one-argument "
                f"loss_fn(output), "
                f"got {type(targets).__name__ if not isinstance(targets, Tensor) else '0-d tensor'}."
            )
        if len(targets) != n:
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
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(v, device) for key, v in batch.items()}
    return batch


def check_loss(loss: Any) -> Tensor:
    """Return ``loss`` if backward can run on it, else raise saying what ``loss_fn`` must return."""
    if not isinstance(loss, Tensor):
        hint = " (return the loss alone, not a tuple)" if isinstance(loss, (tuple, list)) else ""
        raise TypeError(
            f"loss_fn must return a tensor that requires grad, got {type(loss).__name__}{hint}; a Python "
            "number carries no gradient: return e.g. nn.functional.mse_loss(output, targets)."
        )
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return one number (reduction='mean'), got shape {tuple(loss.shape)}.")
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: it was detached (.item(), .detach(), torch.no_grad()) or no "
            "trainable parameter was used; return the loss tensor straight from the model's output."
        )
    return loss


class Batch:
    """A step's batch, checked (before anything changes), on the device, with the scheduled fault applied.

    >>> b = Batch(torch.zeros(6, 2), torch.zeros(6, 1), 2, torch.device("cpu"), None)
    >>> [(tuple(x.shape), w) for x, _, w in b.micro_batches()]
    [((3, 2), 0.5), ((3, 2), 0.5)]
    """

    def __init__(self, inputs: Any, targets: Any, k: int, device: torch.device, fault: Fault | None) -> None:
        self.n, self.k, self.fault = batch_size(inputs, targets, k), k, fault
        self.inputs, self.targets = to_device(inputs, device), to_device(targets, device)
        if fault is not None:
            self.inputs = fault.corrupt_batch(self.inputs)  # before anything changes: it may refuse the batch

    def micro_batches(self) -> Iterator[tuple[Any, Any, float]]:
        """Yield ``(inputs, targets, weight)``: each micro-batch's share of a mean-reduced loss."""
        if self.k == 1:
            yield self.inputs, self.targets, 1.0
            return
        for x, y in zip(split(self.inputs, self.k), split(self.targets, self.k)):
            # exact for a mean-reduced loss, even with unequal splits
            yield x, y, batch_size(x, None, 1) / self.n

    def corrupt_output(self, out: Any) -> Any:
        """Return the model's output with the scheduled fault applied (``overflow``), or as it is."""
        return out if self.fault is None else self.fault.corrupt_output(out)

    @property
    def label(self) -> str | None:
        """The fault's label for the record, e.g. ``"spike:10"``."""
        return self.fault.label if self.fault is not None else None


class Buffers:
    """A copy of a module's buffers (BatchNorm's running statistics), to put back when the step is skipped.

    The forward changes them before the loss can be checked, so they are copied before it: 2
    numbers per BatchNorm channel, nothing for a model without buffers.
    """

    def __init__(self, model: nn.Module) -> None:
        self.live = list(model.buffers())
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


class LossCheck:
    """Hold the forward's loss and its check.

    The loss is a host float (``bad``: it was not finite, backward was skipped), or with deferred
    records a 0-dim device tensor and ``flag``, the device's "not finite" for the step.
    """

    __slots__ = ("bad", "flag", "value")

    def __init__(self, value: float | Tensor, bad: bool = False, flag: Tensor | None = None) -> None:
        self.value, self.bad, self.flag = value, bad, flag
