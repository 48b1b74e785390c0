"""``LatestRun``: one run at a time, and a change during a run is never lost (the panels' rule)."""

import threading

import pytest

from labkit.lab.latest import LatestRun


def test_a_call_during_a_run_runs_once_more_after_it_however_many_came():
    started, release, calls = threading.Event(), threading.Event(), []

    def work():
        calls.append(len(calls))
        if len(calls) == 1:
            started.set()
            release.wait(5)

    latest = LatestRun(work)
    first = threading.Thread(target=latest)
    first.start()
    started.wait(5)
    assert latest.running and [latest(), latest(), latest()] == [False, False, False]  # asked, not run
    release.set()
    first.join(5)
    assert calls == [0, 1] and not latest.running  # three changes during the run: one more run


def test_a_failed_run_leaves_it_ready_to_run_again():
    def fail():
        raise ValueError("bad setting")

    latest = LatestRun(fail)
    with pytest.raises(ValueError, match="bad setting"):
        latest()
    assert not latest.running
    latest.work = lambda: None
    assert latest() is True
