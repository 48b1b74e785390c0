"""What the lab prints: a record's events as lines, a loss scale as a student reads it, a run's title.

Plain text from plain values, no torch: the demo, the widgets and the lessons print these.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..names import module_of
from ..reasons import Reason

if TYPE_CHECKING:
    from ..records import RewindEvent, StepRecord
    from .experiment import ExperimentConfig

__all__ = ["LOSS_WHY", "SKIP_WHY", "attention_note", "culprit", "describe", "describe_rewind", "format_scale",
           "title"]

# Why a spike detector skipped, as the event line says it.
SKIP_WHY = {
    Reason.SPIKE_LOSS: "loss z-score above skip_z",
    Reason.SPIKE_GRAD: "grad-norm z-score above skip_z",
}


# Why a loss was not finite, as the event line says it (the triage's refinements: labkit.triage).
LOSS_WHY = {
    Reason.NONFINITE_LOSS: "loss is not finite",
    Reason.NONFINITE_INPUT: "loss is not finite, an input holds NaN/inf (bad data)",
    Reason.FORWARD_OVERFLOW: "loss is not finite in fp16, finite in fp32 (the forward overflowed)",
}


def culprit(record: StepRecord) -> str | None:
    """Return where a skipped step's non-finite gradient started: the parameter, and its module if another.

    A tied weight is named with the module whose use produced its gradient first in backward.

    >>> from labkit.records import StepRecord
    >>> culprit(StepRecord(0, 1.0, first_nonfinite="4.weight", culprit_module="4"))
    '4.weight'
    >>> culprit(StepRecord(0, 1.0, first_nonfinite="wte.weight", culprit_module="lm_head"))
    'wte.weight, as used by lm_head'
    """
    name, module = record.get("first_nonfinite"), record.get("culprit_module")
    if name is None or module is None or module_of(name) == module:
        return name
    return f"{name}, as used by {module}"


def format_scale(scale: float) -> str:
    """Return a loss scale as a student reads it: an integer, or 2^k once that is shorter and exact.

    >>> [format_scale(s) for s in (1024.0, 2.0**24, 2.0**-20, 3e5, 0.5)]
    ['1024', '2^24', '2^-20', '300000', '0.5']
    """
    text = f"{scale:g}"
    if math.isfinite(scale) and scale > 0:
        exponent = math.log2(scale)
        if exponent.is_integer() and ("e" in text or float(text) != scale):
            return f"2^{int(exponent)}"
    return text


def describe(
    record: StepRecord, max_norm: float | None, fault: str | None = None, *, scaler: bool = True
) -> list[str]:
    """Return the event lines for one record: a skip, a clip, a fault that did neither, a change of scale.

    ``fault`` names the fault when the record cannot (injected on another rank). ``scaler=False``
    (an fp32 or bf16 run: no loss scaler) leaves out what a skip did or could do to a scale.

    >>> from labkit.records import StepRecord
    >>> describe(StepRecord(50, 0.3, grad_norm=34.5, fault="spike:10"), None)
    ['step   50  FAULT spike:10 injected: norm 34.5, not clipped (max_norm none)']
    >>> describe(StepRecord(7, math.nan, skipped=True, reason="nonfinite_loss"), 1.0, scaler=False)
    ['step    7  SKIP  nonfinite_loss: loss is not finite: backward skipped']
    """
    # record.get: a log read back in a process that never imported the hooks that declared the fields
    fault = record.get("fault") or fault
    at, lines, tag = f"step {record.step:4d} ", [], f" [fault {fault}]" if fault else ""
    if record.skipped and record.reason in SKIP_WHY:  # a spike detector's skip
        z = record.get("z_loss" if record.reason == Reason.SPIKE_LOSS else "z_grad", math.nan)
        lines.append(f"{at} SKIP  {record.reason}: {SKIP_WHY[record.reason]} at {z:+.1f} sigma{tag}")
    elif record.skipped:
        if record.reason in LOSS_WHY:
            where = f" in {record.get('culprit_module')}" if record.reason == Reason.FORWARD_OVERFLOW and \
                record.get("culprit_module") is not None else ""
            what = f"{LOSS_WHY[record.reason]}{where}: backward skipped" + \
                (", scale untouched" if scaler else "")
        elif record.get("first_nonfinite") is not None:
            what = f"gradient not finite (first in backward: {culprit(record)})"
        else:
            what = "gradient norm not finite, every gradient finite: their sum of squares overflowed float32"
        lines.append(f"{at} SKIP  {record.reason}: {what}{attention_note(record, scaler=scaler)}{tag}")
    elif record.clipped and record.get("clip_reason") not in (None, "NormClip"):  # an adaptive clip, a z clip
        threshold = record.get("threshold", math.nan)
        level = f" > threshold {threshold:.4g}" if math.isfinite(threshold) else ""
        lines.append(f"{at} CLIP  {record.get('clip_reason')}: norm {record.grad_norm:.4g}{level} "
                     f"(x{record.clip_coef:.3g}){tag}")
    elif record.clipped:
        top = ", ".join(f"{n}={v:.3g}" for n, v in record.get("top_grads", []))
        lines.append(f"{at} CLIP  norm {record.grad_norm:.4g} > max_norm {max_norm:g} "
                     f"(x{record.clip_coef:.3g}); largest: {top}{tag}")
    elif fault:  # a fault nothing caught: say so, or it looks as if it never came
        why = "max_norm none" if max_norm is None else f"below max_norm {max_norm:g}"
        lines.append(f"{at} FAULT {fault} injected: norm {record.grad_norm:.4g}, not clipped ({why})")
    if record.get("lockin"):
        lines.append(f"{at} GUARD lock-in: clipped too many steps in a row, statistics restarted")
    if record.next_scale != record.scale:
        verb = "backoff" if record.next_scale < record.scale else "growth"
        lines.append(f"{at} SCALE {format_scale(record.scale)} -> {format_scale(record.next_scale)} ({verb})")
    return lines


def describe_rewind(event: RewindEvent) -> str:
    """Return the event line of a rewind (the log has it after the record that triggered it).

    >>> from labkit.records import RewindEvent
    >>> describe_rewind(RewindEvent(50, 40, "spike_grad", data_from=40, data_to=60))
    'step   50  REWIND to step 40: steps 40-50 undone (kept in the log), batches 40-59 skipped'
    """
    skipped = "the same batches again" if event.data_from == event.data_to else (
        "a data window skipped" if event.data_from is None or event.data_to is None else
        f"batches {event.data_from}-{event.data_to - 1} skipped")
    return (f"step {event.step:4d}  REWIND to step {event.to}: steps {event.to}-{event.step} undone "
            f"(kept in the log), {skipped}")


def attention_note(record: StepRecord, *, scaler: bool = True) -> str:
    """Name the layers whose attention logits were not finite (a GPT's ``LogitMonitor`` measured them).

    ``scaler=False``: no loss scale ran, so none is said to be unable to help.

    >>> from labkit.records import StepRecord
    >>> attention_note(StepRecord(3, math.nan, attn_logit_max={"h.0": math.inf, "h.1": math.nan}))
    '; attention logits inf in h.0 (then NaN in h.1): the forward overflowed, no loss scale can help'
    """
    logits = record.get("attn_logit_max") or {}
    inf = [layer for layer, v in logits.items() if v == math.inf]
    nan = [layer for layer, v in logits.items() if not math.isfinite(v) and v != math.inf]
    if inf:
        then = f" (then NaN in {', '.join(nan)})" if nan else ""
        return (f"; attention logits inf in {', '.join(inf)}{then}: the forward overflowed"
                + (", no loss scale can help" if scaler else ""))
    return f"; attention logits not finite in {', '.join(nan)}" if nan else ""


def title(config: ExperimentConfig, world: int = 1) -> str:
    """Return a run's figure title: precision, threshold and, under torchrun, the ranks.

    >>> from labkit.lab.experiment import ExperimentConfig
    >>> title(ExperimentConfig(max_norm=None, fault_rank=1), world=2)
    'labkit demo: fp16, max_norm none, 2 ranks (ddp, faults on rank 1)'
    """
    max_norm = "none" if config.max_norm is None else f"{config.max_norm:g}"
    ranks = ""
    if world > 1:
        where = f", faults on rank {config.fault_rank}" if config.fault_rank is not None else ""
        ranks = f", {world} ranks ({config.parallel or 'ddp'}{where})"
    return f"labkit demo: {config.precision}, max_norm {max_norm}{ranks}"
