"""``expect``: a lesson's hidden check that stops the tests, never the student.

A lesson checks what it teaches on the run it just made; on another machine (other kernels,
another CPU, a GPU) a run can take another path, and a check written for one machine's
trajectory may not hold. In a student's kernel a failed check prints one line and the
lesson goes on to its live panels; under ``LABKIT_STRICT=1`` (the test suite sets it for
nbval, the browser tests and the portability pass) the same check raises.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["STRICT_ENV", "expect", "strict"]

STRICT_ENV = "LABKIT_STRICT"


def strict() -> bool:
    """Return whether a failed check raises (``LABKIT_STRICT`` set to anything but ``""`` or ``"0"``)."""
    return os.environ.get(STRICT_ENV, "").strip() not in ("", "0")


@contextlib.contextmanager
def expect(what: str) -> Iterator[None]:
    """Check, in the block, that ``what`` (the phenomenon the lesson teaches) holds on this run.

    >>> with expect("the loss went down"):
    ...     assert 0.5 < 2.0
    >>> import os; saved = os.environ.pop(STRICT_ENV, None)  # a student's kernel
    >>> with expect("the loss went down"):
    ...     assert 3.0 < 2.0, "final 3.0, first 2.0"
    check not met on this machine: the loss went down (final 3.0, first 2.0); the text may not match this run.
    >>> if saved is not None: os.environ[STRICT_ENV] = saved
    """
    try:
        yield
    except Exception as e:  # any error in a check: an index not found is as much a miss as a false assert
        if strict():
            raise AssertionError(f"lesson check failed: {what} ({type(e).__name__}: {e})") from e
        detail = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message holds
        print(f"check not met on this machine: {what} ({detail}); the text may not match this run.")
