"""labkit: gradient clipping and mixed-precision loss scaling, done right and shown live.

>>> import labkit, torch
>>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
>>> labkit.clip_grad_norm_([w], max_norm=1.0)
tensor(5.)
"""

# name -> the module that defines it, imported on first use: `python -m labkit.grading --help`
# (and the grader's start) then costs no torch import (~3 s)
_EXPORTS = {
    "LabkitWarning": "alarms", "RepeatedClippingWarning": "alarms", "SkipStreakWarning": "alarms",
    "clip_grad_norm_": "clip", "clip_grads_with_norm_": "clip", "grad_norm": "clip",
    "Fault": "faults", "FaultSchedule": "faults",
    "StepLog": "records", "StepRecord": "records",
    "GradScaler": "scaler", "ScalerConfig": "scaler", "update_scale": "scaler",
    "TrainStep": "step",
    "ToyTask": "tasks",
}


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "Fault",
    "FaultSchedule",
    "GradScaler",
    "LabkitWarning",
    "RepeatedClippingWarning",
    "ScalerConfig",
    "SkipStreakWarning",
    "StepLog",
    "StepRecord",
    "ToyTask",
    "TrainStep",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "grad_norm",
    "update_scale",
]
