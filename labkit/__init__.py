"""labkit: gradient clipping and mixed-precision loss scaling, done right and shown live.

>>> import labkit, torch
>>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
>>> labkit.clip_grad_norm_([w], max_norm=1.0)
tensor(5.)
"""

from .alarms import DeadScaleWarning, LabkitWarning, RepeatedClippingWarning, SkipStreakWarning
from .clip import clip_grad_norm_, clip_grads_with_norm_, grad_norm
from .faults import Fault, FaultSchedule
from .records import LogWriteError, StepLog, StepRecord
from .scaler import GradScaler, ScalerConfig, update_scale
from .step import TrainStep
from .tasks import ToyTask

__version__ = "0.1.0"

__all__ = [
    "DeadScaleWarning",
    "Fault",
    "FaultSchedule",
    "GradScaler",
    "LabkitWarning",
    "LogWriteError",
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
