"""Checks of settings, each raising one message that names the setting, the rule and the value.

A bool is not a number here (``True`` is 1 to Python, but ``window=True`` is a slip, not a
window of one), NaN fails every comparison, and a string never reaches an optimizer as a
learning rate. No torch: the CLIs import this before torch.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_int", "check_number", "real"]


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ``TypeError`` naming the setting.

    >>> real("growth_factor", 2)
    2.0
    >>> real("growth_factor", "2")
    Traceback (most recent call last):
    ...
    TypeError: growth_factor must be a number, got str '2'.
    """
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    return float(value)


def _none(none: str | None) -> str:
    return f" or None ({none})" if none is not None else ""


def _hint(hint: str) -> str:
    return f" {hint}" if hint else ""


def check_int(
    name: str, value: Any, low: int | None = None, high: int | None = None, *, none: str | None = None,
    hint: str = "",
) -> Any:
    """Return ``value`` if it is an int (not a bool) in ``[low, high]``, else raise ``ValueError``.

    ``none`` says what ``None`` means; then ``None`` is accepted (and returned). ``hint`` is
    added to the message, e.g. the usual value.

    >>> check_int("window", 128, 2)
    128
    >>> check_int("sync_every", 0, 1, none="read every step")
    Traceback (most recent call last):
    ...
    ValueError: sync_every must be an int >= 1 or None (read every step), got 0.
    """
    if value is None and none is not None:
        return None
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        ends = (low is not None and f">= {low}", high is not None and f"<= {high}")
        bounds = " and ".join(b for b in ends if b)
        raise ValueError(f"{name} must be an int{' ' + bounds if bounds else ''}{_hint(hint)}{_none(none)}, "
                         f"got {value!r}.")
    return int(value)


def check_number(
    name: str, value: Any, low: float | None = None, high: float | None = None, *, low_open: bool = False,
    high_open: bool = False, finite: bool = False, none: str | None = None, noun: str = "a number",
    hint: str = "",
) -> Any:
    """Return ``value`` as a float if it is a number (not a bool) in the range, else raise ``ValueError``.

    The range is ``[low, high]``, with ``low_open``/``high_open`` excluding an end; a missing
    end is unbounded (``low=0, low_open=True``: "> 0"); ``finite=True`` refuses ``inf`` too.
    NaN is always refused. ``none`` accepts ``None`` as in ``check_int``.

    >>> check_number("alpha", 0.97, 0, 1, low_open=True, high_open=True)
    0.97
    >>> check_number("clip_alarm", "half", 0, 1, high_open=True, none="off", noun="a fraction")
    Traceback (most recent call last):
    ...
    ValueError: clip_alarm must be a fraction in [0, 1) or None (off), got 'half'.
    """
    if value is None and none is not None:
        return None
    v = float(value) if _is_real(value) else math.nan
    inside = not math.isnan(v) and not (finite and math.isinf(v))
    if low is not None:
        inside = inside and (v > low if low_open else v >= low)
    if high is not None:
        inside = inside and (v < high if high_open else v <= high)
    if not inside:
        if low is not None and high is not None:
            rule = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            rule = f"{'>' if low_open else '>='} {low:g}"
        elif high is not None:
            rule = f"{'<' if high_open else '<='} {high:g}"
        else:
            rule = ""
        rule = f" {rule}" if rule else ""
        raise ValueError(f"{name} must be {noun}{rule}{_hint(hint)}{_none(none)}, got {value!r}.")
    return v
