"""One schema for every tracker: what a ``StepRecord`` is called there, named once.

Every value is the record's own, unscaled (the loss and gradient norms are what the model
saw, never multiplied by the loss scale, unlike ``wandb.watch`` under a GradScaler); the
x-axis is the record's ``step``, which counts skipped steps too, so it never stalls.

=========================  =======================================================
tag                        record field
=========================  =======================================================
``train/loss``             ``loss`` (NaN/inf on a skipped bad batch, as recorded)
``train/lr``               ``lr``
``grad/norm_preclip``      ``grad_norm`` (unscaled, before clipping)
``grad/norm_postclip``     ``post_clip_norm`` (``grad_norm * clip_coef``; NaN when skipped)
``grad/clip_coef``         ``clip_coef``
``grad/clipped``           ``clipped`` (0 or 1)
``amp/loss_scale``         ``scale`` (the scale this step used)
``amp/next_loss_scale``    ``next_scale``
``amp/skipped``            ``skipped`` (0 or 1)
``amp/skip_streak``        ``skip_streak``
``amp/skip_reason``        ``reason`` (text)
``amp/first_nonfinite``    ``first_nonfinite`` (text: the first non-finite gradient in backward order)
``amp/culprit_module``     ``culprit_module`` (text: the module that produced it)
``train/fault``            ``fault`` (text: the injected fault)
``layers/<name>/grad_norm``  ``top_grads`` (the top-k tensors, on clipped/skipped steps)
``spikes/z_loss``          ``z_loss`` (spike detector, when the record has it)
``spikes/z_grad``          ``z_grad``
``spikes/score_7sigma``    ``spike_score``
``spikes/rewound``         ``rewound`` (0 or 1, in an older labkit's logs: now a rewind is an event)
``grad/clip_threshold``    ``threshold`` (an adaptive clipper's threshold)
``precision/stale_fraction``  ``stale_fraction`` (a number, or ``<tag>/<layer>`` per layer)
``attn/logit_max/<layer>``  ``attn_logit_max`` (the GPT's largest ``q.k / sqrt(d)``; inf: fp16 overflow)
``attn/entropy_min/<layer>``  ``attn_entropy`` (the most peaked head's entropy, nats)
``logits/log_z``           ``log_z`` (the output logits' mean log Z, pulled to 0 by z-loss; None: unmeasured)
``logits/log_z_sq``        ``log_z_sq`` (their mean log Z**2: the z-loss term is its coefficient times it)
``train/ce_loss``          ``ce_loss`` (the cross-entropy: ``loss`` less the z-loss term)
``record/<field>``         any other field a record carries (numbers and text)
=========================  =======================================================

A log whose step goes *back* (a rewind) keeps every record: the tracker is told where the
run went back to (``events/rewind``, and TensorBoard's ``purge_step``), nothing is erased
from the JSONL. Histograms are of ``floor(log2|g|)`` per parameter, one bin per binade
(``LOG2_EDGES``), of the gradient the optimizer stepped with (unscaled, clipped).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["LOG2_EDGES", "SCALARS", "TEXTS", "Histogram", "Row", "log2_histogram", "row"]

SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "grad/norm_preclip",
    "post_clip_norm": "grad/norm_postclip",
    "clip_coef": "grad/clip_coef",
    "clipped": "grad/clipped",
    "scale": "amp/loss_scale",
    "next_scale": "amp/next_loss_scale",
    "skipped": "amp/skipped",
    "skip_streak": "amp/skip_streak",
    # fields other issues add; exported when a record carries them
    "z_loss": "spikes/z_loss",
    "z_grad": "spikes/z_grad",
    "spike_score": "spikes/score_7sigma",
    "rewound": "spikes/rewound",
    "threshold": "grad/clip_threshold",
    "stale_fraction": "precision/stale_fraction",
    "attn_logit_max": "attn/logit_max",
    "attn_entropy": "attn/entropy_min",
    "log_z": "logits/log_z",
    "log_z_sq": "logits/log_z_sq",
    "ce_loss": "train/ce_loss",
}
TEXTS = {"reason": "amp/skip_reason", "first_nonfinite": "amp/first_nonfinite",
         "culprit_module": "amp/culprit_module", "fault": "train/fault"}
_NOT_METRICS = {"step", "top_grads"}

# One bin per binade, 2**-48 .. 2**16: fp16's subnormals start at 2**-24 and its max is
# just under 2**16; values outside land in the end bins, zeros and non-finite are counted apart.
LOG2_EDGES = tuple(range(-48, 17))


@dataclass
class Row:
    """The metrics of one record, as every tracker gets them."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


def row(record: Any) -> Row:
    """Return the tracker metrics of one ``StepRecord`` (or its JSONL dict): unscaled, named once.

    >>> from labkit import StepRecord
    >>> r = row(StepRecord(3, 0.5, grad_norm=4.0, clip_coef=0.25, clipped=True,
    ...                    top_grads=[("fc.weight", 3.0)]))
    >>> (r.step, r.scalars["grad/norm_preclip"], r.scalars["grad/norm_postclip"],
    ...  r.scalars["layers/fc.weight/grad_norm"])
    (3, 4.0, 1.0, 3.0)
    >>> row({"step": 4, "loss": float("nan"), "skipped": True, "reason": "nonfinite_loss",
    ...      "z_loss": 7.5}).texts
    {'amp/skip_reason': 'nonfinite_loss'}
    """
    d: Mapping[str, Any] = record if isinstance(record, Mapping) else record.to_dict()
    out = Row(int(d["step"]))
    values = dict(d)
    if "grad_norm" in d:
        # the record's own formula (StepRecord.post_clip_norm), so the bits agree
        values["post_clip_norm"] = math.nan if d.get("skipped") else d["grad_norm"] * d.get("clip_coef", 1.0)
    for name, value in values.items():
        if name in _NOT_METRICS or value is None:
            continue
        tag = SCALARS.get(name) or TEXTS.get(name) or f"record/{name}"
        if isinstance(value, Mapping):  # per-layer values, e.g. a stale fraction per layer
            for key, v in value.items():
                _put(out, f"{tag}/{key}", v)
        else:
            _put(out, tag, value)
    for name, norm in d.get("top_grads") or []:
        out.scalars[f"layers/{name}/grad_norm"] = float(norm)
    return out


def _put(out: Row, tag: str, value: Any) -> None:
    if isinstance(value, (bool, int, float)):
        out.scalars[tag] = float(value)
    elif isinstance(value, str):
        out.texts[tag] = value


@dataclass
class Histogram:
    """Counts of ``floor(log2|g|)`` over ``LOG2_EDGES`` (bin i holds ``[2**e_i, 2**e_{i+1})``)."""

    counts: list[int]
    zeros: int
    nonfinite: int

    @property
    def edges(self) -> list[float]:
        return [float(e) for e in LOG2_EDGES]


def log2_histogram(grads: Iterable[torch.Tensor]) -> Histogram:
    """Count ``floor(log2|g|)`` of every finite non-zero entry, one bin per binade.

    The exponent comes from ``torch.frexp`` (exact, where ``log2`` rounds near a power of
    two). Costs one pass over the gradients and one small host copy: call it every N steps.

    >>> import torch
    >>> h = log2_histogram([torch.tensor([1.0, 1.5, 0.25, 0.0, float("inf")])])
    >>> h.counts[LOG2_EDGES.index(0)], h.counts[LOG2_EDGES.index(-2)], h.zeros, h.nonfinite
    (2, 1, 1, 1)
    """
    import torch  # here, not above: labkit.export (the CLI's flag checks) loads without torch

    lo, bins = LOG2_EDGES[0], len(LOG2_EDGES) - 1
    counts, zeros, nonfinite = None, 0, 0
    stats = []
    for g in grads:
        g = g.detach().reshape(-1).float()
        finite = torch.isfinite(g)
        nonzero = finite & (g != 0)
        _, exp = torch.frexp(g[nonzero])  # |g| = m * 2**exp, m in [0.5, 1): floor(log2|g|) = exp - 1
        idx = (exp - 1 - lo).clamp_(0, bins - 1)
        c = torch.bincount(idx, minlength=bins)
        counts = c if counts is None else counts + c.to(counts.device)
        stats.append(torch.stack([(~finite).sum(), (finite & (g == 0)).sum()]).to(c.device))
    if counts is None:
        return Histogram([0] * bins, 0, 0)
    nonfinite, zeros = (int(x) for x in torch.stack(stats).sum(0).tolist())
    return Histogram([int(x) for x in counts.tolist()], zeros, nonfinite)
