"""``LatestRun``: run a panel's work one at a time, and once more with the latest settings after a change.

A widget's callbacks come from the comm thread while a run is going: running two at once would
race on the figure, and queueing every change would replay settings nobody looks at any more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["LatestRun"]


class LatestRun:
    """Call ``work`` at most once at a time; a call during a run makes it run once more when it ends.

    >>> calls = []
    >>> latest = LatestRun(lambda: calls.append(len(calls)))
    >>> latest(), latest(), calls, latest.running
    (True, True, [0, 1], False)
    """

    def __init__(self, work: Callable[[], object]) -> None:
        self.work = work
        self._lock = threading.Lock()
        self.running = self._again = False

    def __call__(self) -> bool:
        """Run now and return True; during a run, ask for one more run and return False at once."""
        with self._lock:
            if self.running:
                self._again = True
                return False
            self.running = True
        try:
            while True:
                self.work()
                with self._lock:  # the check and the release in one hold: a call in between is not lost
                    if not self._again:
                        self.running = False
                        return True
                    self._again = False
        except BaseException:
            with self._lock:
                self.running = self._again = False
            raise
