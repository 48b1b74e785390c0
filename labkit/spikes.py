"""Spike detection: rolling z-scores of the loss and the gradient norm, and a graded response.

OLMo-core's ``SkipStepOptimizer`` and llm.c's ``OutlierDetector`` both keep the last 128
values and compare the new one with their mean and standard deviation; OLMo-core skips the
step at 6 sigma. Here the same rule logs ``z_loss``/``z_grad`` on every record, and a
``SpikeDetector`` may also clip or skip by z. NaN and inf never enter the window (llm.c's
detector is disabled for good by one NaN loss: research note §1.3a), and neither do the
steps it skipped (llm.c PR #711), so a spike does not widen the band that judges the next.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from .hooks import DecisionView, Hook, Verdict
from .reasons import Reason
from .records import Field
from .validate import check_int, check_number

__all__ = ["SpikeDetector", "format_z", "rolling_z", "spike_score"]


def rolling_z(window: Sequence[float], x: float, min_count: int) -> float:
    """Return the z-score of ``x`` against ``window`` (the previous values), NaN when it cannot say.

    ``z = (x - mean) / std`` with the population std of ``window`` (divided by n, as llm.c's
    detector), comparing ``x - mean`` with ``k * std`` over the previous values (the current one
    excluded) as OLMo-core does. OLMo-core's ``torch.std_mean`` is Bessel-corrected (n - 1): its
    z is ``sqrt((n - 1) / n)`` of this one, 0.4 % smaller at its window of 128. NaN
    when ``x`` is not finite or fewer than ``min_count`` values are in; ``+-inf`` when the
    window is constant and ``x`` differs from it.

    >>> rolling_z([1.0, 2.0, 3.0], 5.0, min_count=2)
    3.6742346141747673
    >>> rolling_z([1.0], 5.0, min_count=2)
    nan
    """
    n = len(window)
    if n < min_count or n == 0 or not math.isfinite(x):
        return math.nan
    mean = math.fsum(window) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in window) / n)
    if std == 0.0:
        return 0.0 if x == mean else math.copysign(math.inf, x - mean)
    return (x - mean) / std


def spike_score(values: Iterable[float], window: int = 1000, k: float = 7.0, min_count: int = 20) -> float:
    """Return OLMo 2's spike score: % of values >= ``k`` sigma from the rolling mean of the last ``window``.

    Non-finite values are left out (they are counted as skips elsewhere). OLMo 2 (arXiv
    2501.00656) reports it for the loss and the gradient norm, with ``window=1000, k=7``.

    >>> spike_score([1.0, 1.1] * 20 + [50.0, 1.0], window=100)
    2.380952380952381
    """
    history: deque[float] = deque(maxlen=window)
    spikes = total = 0
    for v in values:
        if not math.isfinite(v):
            continue
        z = rolling_z(history, v, min_count)
        spikes += abs(z) >= k
        total += 1
        history.append(v)
    return 100.0 * spikes / total if total else 0.0


def format_z(name: str, value: float, z: float, cap: float = 100.0) -> str:
    """Return llm.c's log fragment, e.g. ``loss 3.21 (+0.5z)``; beyond ``cap`` sigma, ``(>+100z)``.

    Past a hundred sigma the number says how quiet the window was (its std is tiny), not how
    bad the step is; ``inf`` (a constant window) reads the same.

    >>> format_z("loss", 3.2104, 0.53), format_z("norm", 1.5, float("nan")), format_z("loss", 881.0, 278543.1)
    ('loss 3.21 (+0.5z)', 'norm 1.5 (z n/a)', 'loss 881 (>+100z)')
    """
    if math.isnan(z):
        return f"{name} {value:.3g} (z n/a)"
    if abs(z) > cap:
        return f"{name} {value:.3g} ({'>+' if z > 0 else '<-'}{cap:g}z)"
    return f"{name} {value:.3g} ({z:+.1f}z)"


class SpikeDetector(Hook):
    """Score each step's loss and gradient norm by rolling z, and say whether to skip or clip it.

    ``window=128`` and ``skip_z=6.0`` are OLMo-core's ``SkipStepOptimizer`` defaults (inactive
    until ``window // 2`` values, as there); llm.c uses the same window with its ``-sl``/``-sg``
    off by default (``skip_z=None``: log only). ``clip_z`` clips the gradient norm to
    ``mean + clip_z * std`` of its window instead of skipping (between the two: clip, then
    skip). Only increases count (a loss drop is good news). The state is plain Python floats:
    its inputs are the host values ``TrainStep`` already holds for the record, so it adds no
    sync. ``TrainStep(..., hooks=[SpikeDetector()])`` logs ``z_loss``/``z_grad`` on every record.
    As a hook: ``on_decision`` scores and decides (a ``Verdict``), ``on_record`` admits the
    step; in a plain loop call ``score``, ``decide`` and ``observe`` yourself.

    >>> det = SpikeDetector(window=8, skip_z=6.0)
    >>> for i in range(8): det.observe(1.0 + 0.01 * (i % 3), 2.0 + 0.01 * (i % 2), admitted=True)
    >>> z_loss, z_grad = det.score(1.0, 40.0); det.decide(z_loss, z_grad)
    ('skip', 'spike_grad')
    """

    state_key = "detector"
    # z-scores of the loss and the norm against the windows (NaN: not enough history, or not scored)
    record_fields = {"z_loss": Field(math.nan), "z_grad": Field(math.nan)}
    per_step = True  # it decides from windows of every step's values

    def __init__(self, window: int = 128, skip_z: float | None = 6.0, clip_z: float | None = None,
                 min_count: int | None = None) -> None:
        check_int("window", window, 2, hint="(OLMo-core and llm.c use 128)")
        for name, z in (("skip_z", skip_z), ("clip_z", clip_z)):
            check_number(name, z, 0, low_open=True, none="off", noun="a number of standard deviations")
        if skip_z is not None and clip_z is not None and clip_z >= skip_z:
            raise ValueError(
                f"clip_z ({clip_z}) must be below skip_z ({skip_z}): clip moderate spikes, skip the big ones."
            )
        self.window, self.skip_z, self.clip_z = window, skip_z, clip_z
        self.min_count = window // 2 if min_count is None else min_count
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)

    def score(self, loss: float, norm: float) -> tuple[float, float]:
        """Return ``(z_loss, z_grad)`` of this step against the previous admitted steps."""
        return rolling_z(self.losses, loss, self.min_count), rolling_z(self.norms, norm, self.min_count)

    def decide(self, z_loss: float, z_grad: float) -> tuple[str | None, str | None]:
        """Return ``(action, reason)``: a skip, a clip, or ``(None, None)``.

        A skip is ``("skip", "spike_loss"|"spike_grad")``, a clip ``("clip", "z_grad")``.
        """
        if self.skip_z is not None:
            if z_loss > self.skip_z:
                return "skip", Reason.SPIKE_LOSS.value
            if z_grad > self.skip_z:
                return "skip", Reason.SPIKE_GRAD.value
        if self.clip_z is not None and z_grad > self.clip_z:
            return "clip", "z_grad"
        return None, None

    def clip_limit(self) -> float:
        """Return the norm ``clip`` cuts to: ``mean + clip_z * std`` of the norm window."""
        n = len(self.norms)
        mean = math.fsum(self.norms) / n
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in self.norms) / n)
        return mean + (self.clip_z or 0.0) * std

    def observe(self, loss: float, norm: float, admitted: bool) -> None:
        """Admit one step into the windows: only finite values of steps that were not skipped."""
        if admitted and math.isfinite(loss) and math.isfinite(norm):
            self.losses.append(float(loss))
            self.norms.append(float(norm))

    def on_decision(self, trainer: Any, view: DecisionView) -> Verdict | None:
        """Score this step and return the verdict: a skip, a clip, or the scores alone.

        A skip's reason is ``spike_loss`` or ``spike_grad``.
        """
        if view.loss_bad or not math.isfinite(view.norm):  # nothing to score: the step skips anyway
            return None
        z_loss, z_grad = self.score(view.loss, view.norm)
        action, why = self.decide(z_loss, z_grad)
        fields = {"z_loss": z_loss, "z_grad": z_grad}
        if action == "skip":
            return Verdict(skip=why, fields=fields)
        if action == "clip":
            return Verdict(clip_to=self.clip_limit(), clip_reason=why, fields=fields)
        return Verdict(fields=fields)

    def on_record(self, trainer: Any, record: Any) -> None:
        """Admit the step as it was taken: a z clip's own cut, never a skipped or non-finite step."""
        seen = record.post_clip_norm if record.clip_reason == "z_grad" else record.grad_norm
        self.observe(record.loss, seen, admitted=not record.skipped)

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque((float(v) for v in state["losses"]), maxlen=self.window)
        self.norms = deque((float(v) for v in state["norms"]), maxlen=self.window)

    def __repr__(self) -> str:
        return f"SpikeDetector(window={self.window}, skip_z={self.skip_z}, clip_z={self.clip_z})"
