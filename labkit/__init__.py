"""labkit: gradient clipping and mixed-precision loss scaling, done right and shown live.

>>> import labkit, torch
>>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
>>> labkit.clip_grad_norm_([w], max_norm=1.0)
tensor(5.)
"""

import importlib
import typing

# Imported on first use (PEP 562), not here: `python -m labkit demo --help` and the grading CLI
# load this package first, and importing torch costs seconds before any flag is read.
_LAZY = {
    ".alarms": ("ClipAlarm", "DeadScaleWarning", "LabkitWarning", "RepeatedClippingWarning", "SkipAlarm",
                "SkipStreakWarning"),
    ".clip": ("clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm", "grad_norm"),
    ".clippers": ("clip_grad_value_",),
    ".faults": ("Fault", "FaultSchedule", "Faults"),
    ".logfile": ("LogWriteError",),
    ".records": ("StepRecord",),
    ".scaler": ("GradScaler", "ScalerConfig", "ScalerUsageError", "ScalerValueError", "update_scale"),
    ".step": ("TrainStep",),
    ".steplog": ("StepLog",),
    ".tasks": ("ToyTask",),
    ".triage": ("Triage",),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

if typing.TYPE_CHECKING:  # what type checkers and IDEs see
    from .alarms import (
        ClipAlarm,
        DeadScaleWarning,
        LabkitWarning,
        RepeatedClippingWarning,
        SkipAlarm,
        SkipStreakWarning,
    )
    from .clip import clip_grad_norm_, clip_grads_with_norm_, get_total_norm, grad_norm
    from .clippers import clip_grad_value_
    from .faults import Fault, Faults, FaultSchedule
    from .logfile import LogWriteError
    from .records import StepRecord
    from .scaler import GradScaler, ScalerConfig, ScalerUsageError, ScalerValueError, update_scale
    from .step import TrainStep
    from .steplog import StepLog
    from .tasks import ToyTask
    from .triage import Triage


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name], __name__), name)
    else:  # a submodule: `import labkit; labkit.clip.grad_norm` keeps working
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "ClipAlarm",
    "DeadScaleWarning",
    "Fault",
    "FaultSchedule",
    "Faults",
    "GradScaler",
    "LabkitWarning",
    "LogWriteError",
    "RepeatedClippingWarning",
    "ScalerConfig",
    "ScalerUsageError",
    "ScalerValueError",
    "SkipAlarm",
    "SkipStreakWarning",
    "StepLog",
    "StepRecord",
    "ToyTask",
    "TrainStep",
    "Triage",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "get_total_norm",
    "grad_norm",
    "update_scale",
]
