"""The names the CLI, the widgets, the triage and the blame share, torch-free (``--help`` stays instant).

>>> PRECISIONS, FP16_MAX, module_of("h.0.attn.c_proj.weight"), module_of("weight")
(('fp32', 'bf16', 'fp16'), 65504.0, 'h.0.attn.c_proj', '')
"""

from __future__ import annotations

__all__ = ["FP16_MAX", "PRECISIONS", "module_of"]

PRECISIONS = ("fp32", "bf16", "fp16")  # labkit.step.PRECISIONS maps each to its autocast dtype
FP16_MAX = 65504.0  # float16's largest finite number: an activation or a scaled gradient past it is inf


def module_of(name: str) -> str:
    """Return the module path of a parameter's name (``""`` for a parameter of the root module)."""
    return name.rpartition(".")[0]
