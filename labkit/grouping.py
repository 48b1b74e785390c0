"""Tensors grouped by (device, dtype), for one foreach kernel per group: torch's own grouping.

``group_by_device_and_dtype`` wraps ``torch.utils._foreach_utils._group_tensors_by_device_and_dtype``
(what torch's ``clip_grad_norm_`` and foreach optimizers group with), whose contract does not fit
as it is: it takes lists of lists (an optimizer's params, grads, states side by side) and refuses an
empty list, where labkit has one list that may be empty (a step without gradients).

>>> groups = group_by_device_and_dtype([torch.ones(2), torch.ones(1, dtype=torch.float64), torch.ones(3)])
>>> sorted((str(dtype), where) for (_, dtype), (_, where) in groups.items())
[('torch.float32', [0, 2]), ('torch.float64', [1])]
"""

from __future__ import annotations

import torch
import torch.utils._foreach_utils  # torch's private grouping, reached by its full name where it is called
from torch import Tensor

__all__ = ["group_by_device_and_dtype"]


Groups = dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[int]]]


def group_by_device_and_dtype(tensors: list[Tensor]) -> Groups:
    """Return ``{(device, dtype): (tensors, their indices)}``, in order within a group; {} for none."""
    if not tensors:
        return {}
    grouped = torch.utils._foreach_utils._group_tensors_by_device_and_dtype([tensors], with_indices=True)
    return {key: (group, where) for key, ([group], where) in grouped.items()}  # type: ignore[misc]
