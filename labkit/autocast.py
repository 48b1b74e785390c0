"""The precisions' autocast dtypes and the context a forward runs under: the torch side of ``labkit.names``.

The step's forward and triage's re-run of it both take the dtype from here (one map, keyed by
the torch-free ``labkit.names.PRECISIONS`` the CLI and widgets offer).

>>> PRECISIONS["fp16"], PRECISIONS["fp32"]
(torch.float16, None)
"""

from __future__ import annotations

import contextlib

import torch

from .names import PRECISIONS as NAMES

__all__ = ["PRECISIONS", "autocast"]

# a name added to labkit.names without a dtype here fails at import, not at a student's first fp8 run
PRECISIONS: dict[str, torch.dtype | None] = dict(zip(NAMES, (None, torch.bfloat16, torch.float16),
                                                strict=True))


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Return the context a forward runs under: autocast to ``precision``'s dtype, or nothing for fp32.

    >>> with autocast("bf16", torch.device("cpu")): torch.ones(2, 2).mm(torch.ones(2, 2)).dtype
    torch.bfloat16
    """
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
