"""Warnings for runs that are going wrong slowly: skip streaks and habitual clipping.

A skipped step now and then is the scaler doing its job; many in a row means the data or
the model is broken. Clipping now and then catches a spike. Clipping most steps is a symptom to
investigate when it is not the design: a fixed threshold that used to clip rarely is now fighting
the learning rate or the data (under SGD it also cuts the learning rate by a factor nobody chose).
Some setups clip most steps on purpose: a percentile clipper such as AutoClip at p=10 (about 90 %
of steps on a steady norm), or the first steps of a pretraining run at max_norm=1.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import deque
from typing import Any

from .hooks import Hook
from .reasons import Reason
from .records import Field, put
from .validate import check_int, check_number

__all__ = ["ClipAlarm", "DeadScaleWarning", "LabkitWarning", "RepeatedClippingWarning", "SkipAlarm",
           "SkipStreakWarning"]


class LabkitWarning(UserWarning):
    """Base class of labkit's warnings (filter them all with this)."""


class SkipStreakWarning(LabkitWarning):
    """Many consecutive steps were skipped."""


class RepeatedClippingWarning(LabkitWarning):
    """Most recent steps were clipped."""


class DeadScaleWarning(LabkitWarning):
    """The loss scale left float32's normal range: every step from now on skips."""


# What a streak of each kind of skip asks of you (the skip-streak warning names those in the streak).
REMEDIES = {
    Reason.NONFINITE_LOSS: (
        "nonfinite_loss: the loss itself was NaN/inf, which no loss scale can fix: bad batches (NaN/inf in "
        "the inputs or labels) or, under fp16, a forward pass that overflowed (activations beyond 65504, "
        "e.g. attention logits): check the batch for NaN/inf and run its forward in fp32 "
        "(TrainStep(hooks=[Triage()]) does both and names the cause)."),
    Reason.NONFINITE_INPUT: (
        "nonfinite_input: the batches hold NaN/inf: fix the data pipeline (the loader, the normalisation, "
        "the labels); no loss scale, learning rate or clipping repairs data."),
    Reason.FORWARD_OVERFLOW: (
        "forward_overflow: the fp16 forward overflowed (activations beyond 65504) while the same forward in "
        "fp32 is finite; the loss scale acts on backward and cannot help: lower the learning rate, add "
        "qk-layernorm (attention logits) or train in bf16; the record's culprit_module names the module "
        "whose fp16 output first overflowed."),
    Reason.NONFINITE_GRAD: (
        "nonfinite_grad: gradients overflow at every scale tried: lower the learning rate, check for an fp16 "
        "overflow in the forward, or train in bf16; the record's first_nonfinite and culprit_module name "
        "where backward first held inf."),
}


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning]) -> None:
    """Warn, attributed to the first caller outside labkit: the user's ``step(x, y)`` (or their loop's call).

    The alarms are reached through the hooks, the step and, with deferred records, a flush:
    a fixed ``stacklevel`` would point into labkit on some of those paths.
    """
    frame, level = sys._getframe(1), 2  # 2: the caller of warn()
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _check_state(state: Any, keys: tuple[str, ...], owner: str) -> None:
    if not isinstance(state, dict) or not set(keys) <= state.keys():
        raise KeyError(f"{owner} state must be a dict with {list(keys)}; pass what {owner}.state_dict() "
                       "returned.")


def _quiet_off_rank_0(trainer: Any) -> bool:
    # the records are the same on every rank: N ranks would warn N times (torch is loaded by then)
    from .distributed import rank

    return rank() != 0


class SkipAlarm(Hook):
    """Count consecutive skips and warn once per streak when it reaches ``threshold``.

    As a hook (``on_record``) it writes the streak into each record's ``skip_streak``. One of
    ``TrainStep``'s default hooks (``SkipAlarm(8)``): pass your own to retune it
    (``hooks=[SkipAlarm(20)]``) or to silence it (``SkipAlarm(None)``: the streak still counted).
    Under ``torch.distributed`` only rank 0's warns.

    >>> alarm = SkipAlarm(threshold=None)
    >>> [alarm.observe(True, "nonfinite_loss", step=i) for i in range(3)]
    [1, 2, 3]
    """

    priority = 100
    state_key = "skip_alarm"
    record_fields = {"skip_streak": Field(0)}  # consecutive skips up to this step

    def __init__(self, threshold: int | None) -> None:
        self.threshold = check_int("SkipAlarm threshold", threshold, 1, none="off")
        self.streak = 0
        self.reasons: list[str] = []
        self.quiet = False  # another rank's: it counts, rank 0 warns

    def attach(self, trainer: Any) -> None:
        self.quiet = _quiet_off_rank_0(trainer)

    def observe(self, skipped: bool, reason: str | None, step: int) -> int:
        """Record one step; return the current streak of consecutive skips."""
        if not skipped:
            if self.streak:  # a streak ends: no new list on every stepped step
                self.streak, self.reasons = 0, []
            return 0
        self.streak += 1
        self.reasons.append(reason or "?")
        if self.quiet:
            return self.streak
        if reason == Reason.DEAD_SCALE and self.reasons.count(reason) == 1:  # it never recovers: say so now
            warn(
                f"step {step} skipped because the loss scale is dead (below float32's normal range, 1/scale "
                "overflows): every later step will skip too. It was set below 2**-126 by hand "
                "(update(new_scale)); set it back with scaler.update(new_scale=2.0**16).",
                DeadScaleWarning,
            )
        if self.streak == self.threshold:
            kinds = ", ".join(f"{r} x{self.reasons.count(r)}" for r in dict.fromkeys(self.reasons))
            remedies = " ".join(REMEDIES[r] for r in dict.fromkeys(self.reasons) if r in REMEDIES)
            warn(
                f"{self.streak} steps skipped in a row (steps {step - self.streak + 1}-{step}: {kinds}). "
                f"{remedies}",
                SkipStreakWarning,
            )
        return self.streak

    def __repr__(self) -> str:
        return f"SkipAlarm(threshold={self.threshold})"

    def on_record(self, trainer: Any, record: Any) -> None:
        put(record.fields, "skip_streak", self.observe(record.skipped, record.reason, record.step))

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "reasons": list(self.reasons)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak, self.reasons = self.parse_state(state)

    def check_state(self, state: Any) -> None:
        self.parse_state(state)

    @staticmethod
    def parse_state(state: dict[str, Any]) -> tuple[int, list[str]]:
        """Return ``(streak, reasons)`` from a ``state_dict``, or raise saying what is wrong."""
        _check_state(state, ("streak", "reasons"), "SkipAlarm")
        streak, reasons = check_int("SkipAlarm state['streak']", state["streak"], 0), state["reasons"]
        if not isinstance(reasons, list) or len(reasons) != streak or not all(isinstance(r, str)
                                                                              for r in reasons):
            raise ValueError(f"SkipAlarm state['reasons'] must be a list of {streak} reasons (one per skip), "
                             f"got {reasons!r}.")
        return streak, list(reasons)


class ClipAlarm(Hook):
    """Warn once when over ``rate`` of the last ``window`` stepped steps were clipped, and not less lately.

    Design or symptom: clipping that subsides is the design (the first steps of a max_norm=1
    run clip most steps while the norm falls towards the threshold: nanoGPT clips 63-70 % of its
    early steps at 1.0); clipping that holds or grows is the symptom (the learning rate, the
    data, a threshold below the model's usual norm). So the alarm compares the run with its own
    clip rate: it fires when more than ``rate`` of the last ``window`` stepped steps clipped *and*
    the last half-window clipped at least as often as every stepped step before it. From the
    first full window: a 120-step lesson run that clips every step still warns. The cost: a slow
    decline is judged on few steps at first (a clip rate falling from 95 % to 20 % over 300 steps
    fired in 40 of 200 random draws in a simulation; a steady 70 % fires in all of them).

    One of ``TrainStep``'s default hooks (``ClipAlarm(0.5, window=100)``): pass your own to
    retune it (``hooks=[ClipAlarm(0.9, window=200)]``) or to silence it (``ClipAlarm(None)``).
    Under ``torch.distributed`` only rank 0's warns.

    >>> alarm = ClipAlarm(rate=0.5, window=4)
    >>> import warnings; warnings.simplefilter("ignore")
    >>> [alarm.observe(True, step=i) for i in range(4)]
    [False, False, False, True]
    >>> falling = ClipAlarm(rate=0.5, window=4)
    >>> [falling.observe(c, step=i) for i, c in enumerate([True, True, True, False, True, False])]  # falls
    [False, False, False, False, False, False]
    """

    priority = 100
    state_key = "clip_alarm"

    def __init__(self, rate: float | None = 0.5, window: int = 100) -> None:
        check_number("ClipAlarm rate", rate, 0, 1, high_open=True, none="off", noun="a fraction")
        self.rate, self.window = rate, check_int("ClipAlarm window", window, 1)
        self.recent: deque[bool] = deque(maxlen=window)
        self.earlier = [0, 0]  # the stepped steps before the window: [clipped, all]
        self.fired = False
        self.quiet = False  # another rank's: it counts, rank 0 warns

    def attach(self, trainer: Any) -> None:
        self.quiet = _quiet_off_rank_0(trainer)

    def observe(self, clipped: bool, step: int) -> bool:
        """Record one stepped step; return True on the step the warning fires."""
        if len(self.recent) == self.window:  # the oldest leaves the window for the run's earlier rate
            self.earlier[0] += self.recent[0]
            self.earlier[1] += 1
        self.recent.append(bool(clipped))
        if self.rate is None or self.fired or len(self.recent) < self.window:
            return False
        frac, half = sum(self.recent) / self.window, max(self.window // 2, 1)
        recent = list(self.recent)
        before = [self.earlier[0] + sum(recent[:-half]), self.earlier[1] + len(recent) - half]
        later = sum(recent[-half:]) / half
        if frac <= self.rate or (before[1] and later < before[0] / before[1]):  # rare, or falling: by design
            return False
        self.fired = True
        if self.quiet:
            return True
        warn(
            f"repeated clipping: {frac:.0%} of the last {self.window} steps (up to step {step}) were "
            "clipped, and not less often lately. "
            "If that is the design (a percentile clipper such as AutoClip at p=10, the first steps of a "
            "run at max_norm=1), retune the alarm (hooks=[ClipAlarm(0.9)]) or silence it "
            "(hooks=[ClipAlarm(None)]). If not, investigate: the learning rate (too high?), the data "
            "(outliers, unnormalised inputs) or max_norm (too low for this model's usual norm; under SGD a "
            "constant clip cuts the learning rate).",
            RepeatedClippingWarning,
        )
        return True

    def __repr__(self) -> str:
        return f"ClipAlarm(rate={self.rate}, window={self.window})"

    def on_record(self, trainer: Any, record: Any) -> None:
        if not record.skipped:  # a skipped step says nothing about clipping
            self.observe(record.clipped, record.step)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "fired": self.fired, "earlier": list(self.earlier)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        recent, self.fired = self.parse_state(state)
        self.recent = deque(recent, maxlen=self.window)
        self.earlier = list(state.get("earlier", [0, 0]))  # a state from before the baseline: none yet

    def check_state(self, state: Any) -> None:
        self.parse_state(state)

    @staticmethod
    def parse_state(state: dict[str, Any]) -> tuple[list[bool], bool]:
        """Return ``(recent, fired)`` from a ``state_dict``, or raise saying what is wrong."""
        _check_state(state, ("recent", "fired"), "ClipAlarm")
        recent, fired = state["recent"], state["fired"]
        bools = isinstance(recent, list) and all(isinstance(x, bool) for x in recent)
        if not bools or not isinstance(fired, bool):
            raise ValueError(f"ClipAlarm state must hold a list of bools 'recent' and a bool 'fired', "
                             f"got {state!r}.")
        earlier = state.get("earlier", [0, 0])
        if not (isinstance(earlier, list) and len(earlier) == 2 and all(type(x) is int for x in earlier)
                and 0 <= earlier[0] <= earlier[1]):
            raise ValueError(f"ClipAlarm state['earlier'] must be [clipped, steps] with 0 <= clipped <= "
                             f"steps, got {earlier!r}.")
        return recent, fired
