"""Why a step was skipped: one name per reason, as the records, the JSONL log and the trackers spell it."""

from __future__ import annotations

from enum import Enum

__all__ = ["Reason"]


class Reason(str, Enum):
    """Why a guarded step was skipped (``StepRecord.reason``); each member is its own string value.

    A member equals its value (``Reason.NONFINITE_LOSS == "nonfinite_loss"``) and prints as it,
    so records, JSONL lines and tracker texts read the same whether a reason came from a live
    step or from a file. Records hold the plain string (``Reason.X.value``): a state dict or a
    record stays loadable with ``torch.load(weights_only=True)``.

    >>> Reason("spike_grad"), f"{Reason.NONFINITE_LOSS}", Reason.NONFINITE_LOSS == "nonfinite_loss"
    (<Reason.SPIKE_GRAD: 'spike_grad'>, 'nonfinite_loss', True)
    """

    NONFINITE_LOSS = "nonfinite_loss"  # the loss was NaN/inf: backward skipped, the scale untouched
    NONFINITE_GRAD = "nonfinite_grad"  # a gradient (or their norm) was NaN/inf: the scale backs off
    DEAD_SCALE = "dead_scale"  # the loss scale is below float32's normal range: 1/scale overflows
    SPIKE_LOSS = "spike_loss"  # a spike detector's loss z-score was above its skip_z
    SPIKE_GRAD = "spike_grad"  # a spike detector's gradient-norm z-score was above its skip_z
    # A non-finite loss told apart (``labkit.triage``, ``hooks=[Triage()]``): an input holds NaN/inf
    # (bad data), or the fp16/bf16 forward overflowed while the same forward in fp32 is finite (the scale
    # cannot help). Backward skipped, the scale untouched, as for nonfinite_loss.
    FORWARD_OVERFLOW = "forward_overflow"
    NONFINITE_INPUT = "nonfinite_input"

    __str__ = str.__str__
    __format__ = str.__format__


# Counted in every summary, with 0 when they never happened (what the scaler's skips are about). The
# triage's refinements are counted when they happen: without triage they never do. ps1's skip decision
# returns one of these (labkit.grading.checks.ps1.REASONS), so its contract stays on nonfinite_loss.
COUNTED = (Reason.NONFINITE_LOSS, Reason.NONFINITE_GRAD)
# Every reason for a non-finite loss: backward never ran and the scale was left alone.
LOSS = (Reason.NONFINITE_LOSS, Reason.NONFINITE_INPUT, Reason.FORWARD_OVERFLOW)
# A spike detector's skips: the trigger of a rewind.
SPIKES = (Reason.SPIKE_LOSS, Reason.SPIKE_GRAD)
