"""Agreeing across ranks: the few small collectives labkit runs under ``torch.distributed``.

When no process group is initialized every function here is a pass-through that runs no
collective and costs no sync, so single-process code is unchanged. When one is: the loss
check is one all-reduce of one number per micro-batch (every rank then skips backward
together, so DDP's gradient all-reduce never waits for a rank that skipped); the scaler's
``found_inf`` is one all-reduce of one number; sharded (FSDP2 ``DTensor``) gradients add
one all-reduce of the per-tensor norms per mesh. None of them is per parameter.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_reduce_", "is_distributed", "local_tensor", "mean_across", "rank", "reduce_sharded_norms_",
           "reduce_sharded_sums_"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, which a build without distributed lacks


def is_distributed() -> bool:
    """Return whether a default process group is initialized (False in a plain process).

    >>> is_distributed()
    False
    """
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Return this process's global rank, 0 when not distributed (rank 0 writes the logs).

    >>> rank()
    0
    """
    return dist.get_rank() if is_distributed() else 0


def all_reduce_(tensor: Tensor, op: str, group: ProcessGroup | None = None) -> Tensor:
    """Reduce ``tensor`` in place across ``group`` (default: the world) by ``"sum"``, ``"max"`` or ``"min"``.

    Not distributed: return ``tensor`` untouched, with no collective.

    >>> all_reduce_(torch.tensor([1.0, 2.0]), "max")
    tensor([1., 2.])
    """
    if op not in ("sum", "max", "min"):
        raise ValueError(f"op must be 'sum', 'max' or 'min', got {op!r}.")
    if is_distributed():
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=group)
    return tensor


def mean_across(value: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Return the mean of a one-element ``value`` over the ranks of ``group``; itself when not distributed.

    One all-reduce (SUM) of one float64 carries both the global-batch mean and the skip
    decision: a NaN or inf on any rank makes the sum non-finite on every rank, so all of
    them skip. float64, so that two large finite fp32 losses do not add up to inf.

    >>> mean_across(torch.tensor(0.5))
    tensor(0.5000)
    """
    if not is_distributed():
        return value
    total = value.detach().reshape(1).to(torch.float64)
    all_reduce_(total, "sum", group)
    return total[0] / dist.get_world_size(group)


def _dtensor_type() -> type | None:
    # A DTensor can only exist once its module is imported; importing it here would slow
    # ``import labkit`` down for every user who never shards.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_tensor(t: Tensor) -> Tensor:
    """Return the local shard of a ``DTensor`` (a view: writing to it writes the DTensor), else ``t``.

    >>> w = torch.ones(2); local_tensor(w) is w
    True
    """
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def _shard_groups(t: Tensor) -> tuple:
    """Return the process groups across which ``t`` is sharded (empty: replicated or plain)."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return ()
    if any(p.is_partial() for p in t.placements):
        raise ValueError(
            f"a gradient is a DTensor with a Partial placement {t.placements}: its norm is not the norm of "
            "its "
            "shards. Reduce it first (grad.redistribute(placements=[Replicate()]) or let FSDP2's backward "
            "reduce-scatter it into Shard) before asking for the norm."
        )
    mesh = t.device_mesh
    return tuple(mesh.get_group(d) for d, p in enumerate(t.placements) if p.is_shard())


def reduce_sharded_norms_(norms: Tensor, grads: list[Tensor], norm_type: float) -> Tensor:
    """Turn the local norms of sharded ``DTensor`` gradients into the norms of the whole tensors, in place.

    ``norms[i]`` is the norm of ``grads[i]``'s local shard. For every group of ranks a
    gradient is sharded over, the p-th powers are summed (the largest is taken for
    ``inf``) in one all-reduce for all the gradients sharded alike, in float64 so that
    ``norm**p`` does not overflow. Plain and replicated gradients (DDP: already averaged,
    identical on every rank) are left alone and cost no collective.

    >>> reduce_sharded_norms_(torch.tensor([3.0, 4.0]), [torch.ones(1), torch.ones(1)], 2.0)
    tensor([3., 4.])
    """
    if _dtensor_type() is None:
        return norms
    buckets: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        groups = _shard_groups(g)
        if groups:
            buckets.setdefault(groups, []).append(i)
    for groups, idx in buckets.items():
        index = torch.tensor(idx, device=norms.device)
        values = norms.index_select(0, index).to(torch.float64)
        if math.isinf(norm_type):
            for group in groups:
                all_reduce_(values, "max" if norm_type > 0 else "min", group)
        elif norm_type == 0:  # a count of non-zeros: the shards' counts add up
            for group in groups:
                all_reduce_(values, "sum", group)
        else:
            values = values.pow(norm_type)
            for group in groups:
                all_reduce_(values, "sum", group)
            values = values.pow(1.0 / norm_type)
        norms.index_copy_(0, index, values.to(norms.dtype))
    return norms


def reduce_sharded_sums_(sums: Tensor, tensors: list[Tensor]) -> Tensor:
    """Turn sums over the local shards of sharded ``DTensor``s into sums over the whole tensors, in place.

    ``sums[i]`` is a sum over ``tensors[i]``'s local shard; one all-reduce (SUM) per group of ranks,
    for every tensor sharded alike (as ``reduce_sharded_norms_``). Plain and replicated tensors
    are left alone and cost no collective.

    >>> reduce_sharded_sums_(torch.tensor([3.0, 4.0]), [torch.ones(1), torch.ones(1)])
    tensor([3., 4.])
    """
    if _dtensor_type() is None:
        return sums
    buckets: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups = _shard_groups(t)
        if groups:
            buckets.setdefault(groups, []).append(i)
    for groups, idx in buckets.items():
        index = torch.tensor(idx, device=sums.device)
        values = sums.index_select(0, index)
        for group in groups:
            all_reduce_(values, "sum", group)
        sums.index_copy_(0, index, values)
    return sums
