"""Nothing lost in the log: torn tails, strict JSON, full disks, kill -9, a bounded window, a resumable summary."""

import errno
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
import warnings

import pytest
import torch

import labkit
from labkit import LogWriteError, StepLog, StepRecord
from labkit.alarms import LabkitWarning

NAN, INF = float("nan"), float("inf")


@pytest.fixture
def task():
    return labkit.ToyTask()


def records(n, start=0):
    return [StepRecord(i, 1.0 / (i + 1), grad_norm=INF if i % 3 == 1 else 0.5, scale=2.0 ** (10 - i % 4),
                       next_scale=2.0 ** (10 - (i + 1) % 4), skipped=i % 3 == 1,
                       reason="nonfinite_grad" if i % 3 == 1 else None, clipped=i % 3 == 2, lr=0.1,
                       top_grads=[("w", NAN)], lrs=[0.1, -INF])
            for i in range(start, start + n)]


def same(a, b):
    assert json.loads(a.to_json()) == json.loads(b.to_json())


# ---------------------------------------------------------------- strict JSON, both forms read


def test_jsonl_is_strict_json_that_any_reader_accepts(tmp_path):
    path = tmp_path / "log.jsonl"
    StepLog(records(4)).to_jsonl(path)
    text = path.read_text()
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in the file")) for line in text.splitlines()]
    assert strict[1]["grad_norm"] == "Infinity" and strict[0]["top_grads"] == [["w", "NaN"]]
    assert strict[0]["lrs"] == [0.1, "-Infinity"]
    back = StepLog.read_jsonl(path)
    assert back[1].grad_norm == INF and math.isnan(back[0].top_grads[0][1]) and back[0].lrs[1] == -INF


def test_logs_written_with_bare_nan_still_read(tmp_path):
    path = tmp_path / "old.jsonl"
    old = {**StepRecord(0, NAN, grad_norm=INF).to_dict()}
    del old["lrs"]  # written before the field existed
    path.write_text(json.dumps(old) + "\n")  # Python's json: bare NaN / Infinity
    r = StepLog.read_jsonl(path)[0]
    assert math.isnan(r.loss) and r.grad_norm == INF and r.lrs == []


def test_strict_json_parses_in_javascript_terms():
    """JSON.parse accepts only RFC 8259 JSON: Python's strict mode is the same grammar."""
    line = StepRecord(0, NAN, grad_norm=-INF, top_grads=[("a", INF)]).to_json()
    json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


# ---------------------------------------------------------------- a torn tail


def test_a_torn_last_line_is_reported_not_fatal_and_appending_continues_cleanly(tmp_path):
    path = tmp_path / "log.jsonl"
    StepLog(records(5)).to_jsonl(path)
    full = path.read_bytes()
    path.write_bytes(full[: len(full) - 40])  # a crash mid-line
    with pytest.warns(LabkitWarning, match="last line is torn"):
        log = StepLog.read_jsonl(path)
    assert [r.step for r in log] == [0, 1, 2, 3] and log.torn_tail and not log.torn_tail.endswith("}")
    with pytest.warns(LabkitWarning, match="cut off a torn last line"):
        resumed = StepLog(stream=path)
    for r in records(3, start=4):
        resumed.append(r)
    resumed.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # clean: no torn tail any more
        back = StepLog.read_jsonl(path)
    assert [r.step for r in back] == [0, 1, 2, 3, 4, 5, 6] and back.torn_tail is None


def test_a_complete_last_line_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(r.to_json() for r in records(2)))  # no final newline
    log = StepLog(stream=path)
    log.append(records(1, start=2)[0])
    log.close()
    assert [r.step for r in StepLog.read_jsonl(path)] == [0, 1, 2]


def test_a_damaged_line_in_the_middle_is_an_error_naming_it(tmp_path):
    path = tmp_path / "log.jsonl"
    lines = [r.to_json() for r in records(3)]
    lines[1] = lines[1][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 2 is not a StepRecord"):
        StepLog.read_jsonl(path)


# ---------------------------------------------------------------- a full disk


class FullDisk:
    """os.write that fails with ENOSPC while ``full``, after writing ``partial`` bytes once."""

    def __init__(self, monkeypatch, partial=0):
        self.full, self.partial, self.real = False, partial, os.write
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd, data):
        if not self.full:
            return self.real(fd, data)
        if self.partial:
            n, self.partial = self.real(fd, data[: self.partial]), 0
            return n
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_full_disk_loses_no_record_and_no_step_number(task, tmp_path, monkeypatch, precision):
    path = tmp_path / "log.jsonl"
    model = task.model()
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision=precision,
                            log_path=path)
    disk = FullDisk(monkeypatch, partial=25)
    step(*task.batch(0))
    disk.full = True
    for i in (1, 2):
        with pytest.raises(LogWriteError, match=f"steps 1-{i} are not in the file yet") as info:
            step(*task.batch(i))
        assert info.value.errno == errno.ENOSPC
    assert step.step_count == 3 and [r.step for r in step.log] == [0, 1, 2]  # complete, numbered, kept
    disk.full = False  # space freed: the next step writes what was pending, in order
    step(*task.batch(3))
    step.log.close()
    assert [r.step for r in StepLog.read_jsonl(path)] == [0, 1, 2, 3]
    for a, b in zip(StepLog.read_jsonl(path), step.log):
        same(a, b)


# ---------------------------------------------------------------- kill -9


WRITER = textwrap.dedent("""
    import sys, torch, labkit
    task = labkit.ToyTask()
    model = task.model()
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                            faults=["3:nan", "7:spike"], log_path=sys.argv[1])
    i = 0
    while True:
        step(*task.batch(i)); i += 1
""")


def test_kill_9_leaves_a_readable_log_and_a_clean_restart(tmp_path):
    path = tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while (not path.exists() or path.read_text().count("\n") < 10) and time.monotonic() < deadline:
            assert proc.poll() is None, "the writer died on its own"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with warnings.catch_warnings(record=True):  # a torn tail is allowed, and reported
        log = StepLog.read_jsonl(path)
    steps = [r.step for r in log]
    assert len(steps) >= 10 and steps == list(range(len(steps)))
    assert log[3].reason == "nonfinite_loss" and log[7].clipped
    # an appending restart, as after the crash: numbering continues, the file stays clean
    with open(path, "ab") as f:
        f.write(b'{"step": 99, "lo')  # make sure there is a torn tail to cut
    with pytest.warns(LabkitWarning, match="torn"):
        restart = StepLog(stream=path)
    restart.append(StepRecord(len(steps), 0.1))
    restart.close()
    assert [r.step for r in StepLog.read_jsonl(path)] == list(range(len(steps) + 1))


# ---------------------------------------------------------------- bounded window, exact and resumable summary


def test_a_window_keeps_the_last_records_and_an_exact_summary():
    every, window = StepLog(), StepLog(window=4)
    for r in records(50):
        every.append(r)
        window.append(r)
    assert len(window) == 4 and [r.step for r in window] == [46, 47, 48, 49] and window[-1].step == 49
    assert window.summary() == every.summary()
    assert window.summary()["steps"] == 50 and window.summary()["skipped"] == 17


def test_memory_per_record_is_what_the_docstring_says():
    log = StepLog()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for r in records(2000):
        log.append(r)
    per_record = (tracemalloc.get_traced_memory()[0] - base) / 2000
    tracemalloc.stop()
    assert 200 < per_record < 1000  # "0.4-0.8 KB per step"
    bounded = StepLog(window=10)
    for r in records(2000):
        bounded.append(r)
    assert len(bounded) == 10


def test_the_summary_survives_a_resume(task):
    model = task.model()
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, max_norm=0.1,
                            faults=["2:nan"])
    for i in range(5):
        step(*task.batch(i))
    state = step.state_dict()
    resumed = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, max_norm=0.1,
                               faults=["2:nan"])
    resumed.load_state_dict(state)
    for i in range(5, 8):
        step(*task.batch(i))
    for i in range(5, 8):  # the same batches on the same (already trained) model: only the counts matter here
        resumed(*task.batch(i))
    s = resumed.log.summary()
    assert len(resumed.log) == 3 and s["steps"] == 8 and s["skips_by_reason"]["nonfinite_loss"] == 1
    assert s["clipped"] + s["skipped"] <= 8 and s["steps"] == step.log.summary()["steps"]


def test_a_summary_state_that_does_not_add_up_is_refused():
    log = StepLog(records(3))
    state = log.state_dict()
    state["stepped"] = 7
    with pytest.raises(ValueError, match="add up"):
        StepLog().load_state_dict(state)
