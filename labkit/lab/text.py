"""What the lab prints: a record's events as lines, a loss scale as a student reads it, a run's title.

Plain text from plain values, no torch: the demo, the widgets and the lessons print these.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..names import module_of
from ..reasons import Reason

if TYPE_CHECKING:
    from ..records import StepRecord
    from .experiment import ExperimentConfig

__all__ = ["LOSS_WHY", "SKIP_WHY", "attention_note", "culprit", "describe", "format_scale", "title"]

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
    name, module = record.first_nonfinite, record.culprit_module
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


def describe(record: StepRecord, max_norm: float | None, fault: str | None = None) -> list[str]:
    """Return the event lines for one record: a skip, a clip, a fault that did neither, a change of scale.

    ``fault`` names the fault when the record cannot (injected on another rank).

    >>> from labkit.records import StepRecord
    >>> describe(StepRecord(50, 0.3, grad_norm=34.5, fault="spike:10"), None)
    ['step   50  FAULT spike:10 injected: norm 34.5, not clipped (max_norm none)']
    """
    fault = record.fault or fault
    at, lines, tag = f"step {record.step:4d} ", [], f" [fault {fault}]" if fault else ""
    if record.skipped and record.reason in SKIP_WHY:  # a spike detector's skip
        z = record.z_loss if record.reason == Reason.SPIKE_LOSS else record.z_grad
        lines.append(f"{at} SKIP  {record.reason}: {SKIP_WHY[record.reason]} at {z:+.1f} sigma{tag}")
    elif record.skipped:
        if record.reason in LOSS_WHY:
            where = f" in {record.culprit_module}" if record.reason == Reason.FORWARD_OVERFLOW and \
                record.culprit_module is not None else ""
            what = f"{LOSS_WHY[record.reason]}{where}: backward skipped, scale untouched"
        elif record.first_nonfinite is not None:
            what = f"gradient not finite (first in backward: {culprit(record)})"
        else:
            what = "gradient norm not finite, every gradient finite: their sum of squares overflowed float32"
        lines.append(f"{at} SKIP  {record.reason}: {what}{attention_note(record)}{tag}")
    elif record.clipped and record.clip_reason not in (None, "NormClip"):  # an adaptive clipper's, a z clip
        level = f" > threshold {record.threshold:.4g}" if math.isfinite(record.threshold) else ""
        lines.append(f"{at} CLIP  {record.clip_reason}: norm {record.grad_norm:.4g}{level} "
                     f"(x{record.clip_coef:.3g}){tag}")
    elif record.clipped:
        top = ", ".join(f"{n}={v:.3g}" for n, v in record.top_grads)
        lines.append(f"{at} CLIP  norm {record.grad_norm:.4g} > max_norm {max_norm:g} "
                     f"(x{record.clip_coef:.3g}); largest: {top}{tag}")
    elif fault:  # a fault nothing caught: say so, or it looks as if it never came
        why = "max_norm none" if max_norm is None else f"below max_norm {max_norm:g}"
        lines.append(f"{at} FAULT {fault} injected: norm {record.grad_norm:.4g}, not clipped ({why})")
    if record.lockin:
        lines.append(f"{at} GUARD lock-in: clipped too many steps in a row, statistics restarted")
    if record.rewind_to is not None:
        lines.append(f"{at} REWIND to step {record.rewind_to}: steps {record.rewind_to}-{record.step} "
                     "undone (marked rewound), a data window skipped")
    if record.next_scale != record.scale:
        verb = "backoff" if record.next_scale < record.scale else "growth"
        lines.append(f"{at} SCALE {format_scale(record.scale)} -> {format_scale(record.next_scale)} ({verb})")
    return lines


def attention_note(record: StepRecord) -> str:
    """Name the layers whose attention logits were not finite (a GPT's ``LogitMonitor`` measured them).

    >>> from labkit.records import StepRecord
    >>> attention_note(StepRecord(3, math.nan, attn_logit_max={"h.0": math.inf, "h.1": math.nan}))
    '; attention logits inf in h.0 (then NaN in h.1): the forward overflowed, no loss scale can help'
    """
    inf = [layer for layer, v in record.attn_logit_max.items() if v == math.inf]
    nan = [layer for layer, v in record.attn_logit_max.items() if not math.isfinite(v) and v != math.inf]
    if inf:
        then = f" (then NaN in {', '.join(nan)})" if nan else ""
        return (f"; attention logits inf in {', '.join(inf)}{then}: the forward overflowed, "
                "no loss scale can help")
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
