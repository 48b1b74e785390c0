"""Nothing lost in the log: torn tails, strict JSON, full disks, kill -9, pipes and devices, a bounded window,
a resumable summary."""

import copy
import errno
import json
import math
import os
import select
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
from labkit.alarms import ClipAlarm, LabkitWarning
from labkit.faults import Faults

NAN, INF = float("nan"), float("inf")


def read_to_end(fd: int) -> bytes:
    """Return what a pipe's reading end gets until its writer closes (os.read's b"")."""
    received = b""
    while chunk := os.read(fd, 1 << 16):
        received += chunk
    return received


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
    strict = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in the file"))
        for line in text.splitlines()
    ]
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
    """JSON.parse accepts only RFC 8259 JSON: Python's parser with the three non-standard constants refused is
    the same grammar. The non-finite numbers are there as the strings, and come back as the floats."""
    record = StepRecord(0, NAN, grad_norm=-INF, top_grads=[("a", INF)], lrs=[0.1, NAN], stale={"a": INF})
    line = record.to_json()

    def refuse(constant):
        raise ValueError(f"bare {constant}: JSON.parse would refuse the line")

    strict = json.loads(line, parse_constant=refuse)
    assert (strict["loss"], strict["grad_norm"]) == ("NaN", "-Infinity")
    assert strict["top_grads"] == [["a", "Infinity"]]
    assert strict["lrs"] == [0.1, "NaN"] and strict["stale"] == {"a": "Infinity"}
    back = labkit.records.parse_line(line)
    assert math.isnan(back["loss"]) and back["grad_norm"] == -INF and back["top_grads"] == [["a", INF]]
    assert math.isnan(back["lrs"][1]) and back["stale"] == {"a": INF}


# ---------------------------------------------------------------- a torn tail


def test_a_torn_last_line_is_reported_not_fatal_and_cut_before_anything_is_appended(tmp_path):
    path = tmp_path / "log.jsonl"
    StepLog(records(5)).to_jsonl(path)
    full = path.read_bytes()
    path.write_bytes(full[: len(full) - 40])  # a crash mid-line
    with pytest.warns(LabkitWarning, match="last line is torn"):
        log = StepLog.read_jsonl(path)
    assert [r.step for r in log] == [0, 1, 2, 3] and log.torn_tail and not log.torn_tail.endswith("}")
    with pytest.warns(LabkitWarning, match="cut off a torn last line"):
        nxt = StepLog(stream=path)
    with pytest.warns(LabkitWarning, match=r"holds the records of another run \(steps 0-3\): moved it to"):
        for r in records(3, start=4):  # a new run (no resume): one log per run
            nxt.append(r)
    nxt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # clean: no torn tail any more
        back, before = StepLog.read_jsonl(path), StepLog.read_jsonl(f"{path}.1")
    assert [r.step for r in back] == [4, 5, 6] and back.torn_tail is None
    assert [r.step for r in before] == [0, 1, 2, 3] and before.torn_tail is None


@pytest.mark.parametrize("path", ["append", "flush", "step", "deferred-step"])
def test_the_warning_about_another_runs_log_names_the_users_line(task, tmp_path, monkeypatch, path):
    """The move-aside warning is reached by a StepLog's append, its flush after a refused move, or a
    TrainStep (deferred: through a flush): on every path it names the user's line, not one inside labkit."""
    log_path = tmp_path / "log.jsonl"
    StepLog(records(2)).to_jsonl(log_path)
    if path in ("append", "flush"):
        log = StepLog(stream=log_path)
        if path == "flush":  # the first move is refused: the records wait, and the user's flush moves it
            real = os.rename

            def refused(src, dst):
                raise PermissionError(errno.EACCES, "Permission denied")

            monkeypatch.setattr(os, "rename", refused)
            with pytest.raises(LogWriteError):
                log.append(records(1, start=5)[0])
            monkeypatch.setattr(os, "rename", real)
        with pytest.warns(LabkitWarning, match="another run") as seen:
            log.flush() if path == "flush" else log.append(records(1, start=5)[0])
        log.close()
    else:
        model = task.model()
        step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                                log=log_path, sync_every=2 if path == "deferred-step" else None)
        with pytest.warns(LabkitWarning, match="another run") as seen:
            for i in range(2):
                step(*task.batch(i))
            step.log.flush()
        step.log.close()
    assert [w.filename for w in seen if "another run" in str(w.message)] == [__file__]
    assert [r.step for r in StepLog.read_jsonl(log_path)] == ([5] if path in ("append", "flush") else [0, 1])


def test_a_complete_last_line_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(r.to_json() for r in records(2)))  # no final newline
    log = StepLog(stream=path)
    assert path.read_text().endswith("}\n")
    with pytest.warns(LabkitWarning, match="another run"):
        log.append(records(1, start=2)[0])
    log.close()
    assert [r.step for r in StepLog.read_jsonl(f"{path}.1")] == [0, 1]
    assert [r.step for r in StepLog.read_jsonl(path)] == [2]


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
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                            precision=precision, log=path)
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


FAULTS = ["3:nan", "7:spike:10", "12-13:overflow"]
WRITER = textwrap.dedent(f"""
    import os, sys, torch, labkit
    path, checkpoint = sys.argv[1], sys.argv[2]
    task = labkit.ToyTask()
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = labkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    step = labkit.TrainStep(model, opt, task.loss_fn, precision="fp16", scaler=scaler,
                            hooks=[labkit.Faults({FAULTS!r})], log=path)
    while True:
        record = step(*task.batch(step.step_count))
        print(record.step, flush=True)  # after this line, the record is in the file
        state = {{"model": model.state_dict(), "opt": opt.state_dict(), "train": step.state_dict()}}
        torch.save(state, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)
""")


def fresh(task, path, state=None):
    """The writer's model, optimizer and TrainStep, resumed from ``state`` when given."""
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    scaler = labkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    step = labkit.TrainStep(model, opt, task.loss_fn, precision="fp16", scaler=scaler, log=path,
                            hooks=[Faults(FAULTS)])
    if state is not None:
        step.load_state_dict(state["train"])
    return step


def run_to(step, task, n, close=True):
    while step.step_count < n:
        step(*task.batch(step.step_count))
    if close:
        step.log.close()


@pytest.mark.timeout(120)
def test_kill_9_loses_no_printed_step_and_a_resume_writes_the_uninterrupted_file(task, tmp_path):
    path, checkpoint = tmp_path / "log.jsonl", tmp_path / "checkpoint.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(checkpoint)], env=env,
                            stdout=subprocess.PIPE, text=True)
    printed = []
    try:
        deadline = time.monotonic() + 90
        while len(printed) < 16 and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                assert line, f"the writer died on its own (exit code {proc.poll()})"
                printed.append(int(line))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and len(printed) >= 16
    printed += [int(line) for line in proc.stdout.read().split()]  # what it printed before the kill landed
    proc.stdout.close()
    with warnings.catch_warnings(record=True):  # a torn tail is allowed, and reported
        log = StepLog.read_jsonl(path)
    steps = [r.step for r in log]
    assert printed == list(range(len(printed))) and steps == list(range(len(steps)))
    assert set(printed) <= set(steps)  # every step the writer said it completed is in the file
    assert log[3].reason == "nonfinite_loss" and log[7].clipped and log[12].reason == "nonfinite_grad"

    # the restart: from the last checkpoint, through TrainStep.load_state_dict, appending to the same file
    state = torch.load(checkpoint, weights_only=False)
    assert state["train"]["step"] in (len(steps), len(steps) - 1)  # killed before or after its checkpoint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fresh(task, path, state)
    cuts = [str(w.message) for w in caught if "written after the checkpoint" in str(w.message)]
    assert len(cuts) == (state["train"]["step"] < len(steps))  # a record past the checkpoint: cut, and said
    n = len(steps) + 6
    run_to(resumed, task, n)
    run_to(fresh(task, tmp_path / "uninterrupted.jsonl"), task, n)
    assert path.read_text() == (tmp_path / "uninterrupted.jsonl").read_text()


@pytest.mark.parametrize("crash_after", [7, 9])
def test_a_resume_cuts_the_records_written_after_its_checkpoint_and_says_so(task, tmp_path, crash_after):
    """A crash between the log's append and the checkpoint (the window the test above lands in by chance)."""
    path = tmp_path / "log.jsonl"
    step = fresh(task, path)
    run_to(step, task, 7, close=False)
    state = copy.deepcopy({"model": step.model.state_dict(), "opt": step.optimizer.state_dict(),
                           "train": step.state_dict()})
    run_to(step, task, crash_after)  # the records of steps 7.. reach the file, the next checkpoint does not
    cut = crash_after > 7
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fresh(task, path, state)
    assert [str(w.message).split(": ", 1)[1] for w in caught] == \
        ["cut 2 records (steps 7-8) written after the checkpoint; the resumed run redoes those steps."] * cut
    run_to(resumed, task, 12)
    run_to(fresh(task, tmp_path / "uninterrupted.jsonl"), task, 12)
    assert path.read_text() == (tmp_path / "uninterrupted.jsonl").read_text()


def test_a_resume_leaves_a_file_it_did_not_write_as_it_is(task, tmp_path):
    step = fresh(task, tmp_path / "a.jsonl")
    run_to(step, task, 3, close=False)
    state = {"model": step.model.state_dict(), "opt": step.optimizer.state_dict(), "train": step.state_dict()}
    mine = (tmp_path / "a.jsonl").read_bytes()
    other = tmp_path / "b.jsonl"  # another run's: a line ends where the checkpoint's did, but not its line
    other.write_bytes(mine.replace(b'"step": 2', b'"step": 9') + b"".join(r.to_json().encode() + b"\n"
                                                                       for r in records(2)))
    before = other.read_bytes()
    with pytest.warns(LabkitWarning, match="not the checkpoint's last record; it was left as it is"):
        fresh(task, other, state).log.close()
    assert other.read_bytes() == before
    with pytest.raises(ValueError, match="'stream' must be"):
        StepLog().load_state_dict({**state["train"]["log"], "stream": {"size": -1, "last_line_sha256": "x"}})


# ---------------------------------------------------------------- one log per run


def test_a_new_run_never_appends_to_another_runs_log(task, tmp_path):
    """Re-running a script with the same log_path: the first run's file is moved aside, not appended to."""
    path = tmp_path / "log.jsonl"
    run_to(fresh(task, path), task, 5)
    first = path.read_bytes()
    second = fresh(task, path)
    assert path.read_bytes() == first  # nothing happens to it before the new run logs
    with pytest.warns(LabkitWarning,
                      match=r"log.jsonl holds the records of another run \(steps 0-4\): moved it "
                            r"to '.*log.jsonl.1', and this run's records start"):
        run_to(second, task, 3)
    assert (tmp_path / "log.jsonl.1").read_bytes() == first
    assert [r.step for r in StepLog.read_jsonl(path)] == [0, 1, 2]
    with pytest.warns(LabkitWarning, match="moved it to '.*log.jsonl.2'"):  # a third run: the next free name
        run_to(fresh(task, path), task, 1)
    assert [r.step for r in StepLog.read_jsonl(tmp_path / "log.jsonl.2")] == [0, 1, 2]
    assert [r.step for r in StepLog.read_jsonl(path)] == [0]


def test_a_resumed_run_continues_its_own_log_and_only_its_own(task, tmp_path):
    path = tmp_path / "log.jsonl"
    step = fresh(task, path)
    run_to(step, task, 4, close=False)
    state = {"model": step.model.state_dict(), "opt": step.optimizer.state_dict(), "train": step.state_dict()}
    step.log.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume: no file moved, nothing cut
        run_to(fresh(task, path, copy.deepcopy(state)), task, 6)
    assert ([r.step for r in StepLog.read_jsonl(path)] == list(range(6))
            and not (tmp_path / "log.jsonl.1").exists())
    # the same checkpoint on another run's file (a new run wrote log.jsonl since): that file is not continued
    run_to(fresh(task, path), task, 2)  # a new run: moves the resumed run's file to log.jsonl.1
    with pytest.warns(LabkitWarning, match="not the checkpoint's last record"):
        resumed = fresh(task, path, copy.deepcopy(state))
    with pytest.warns(LabkitWarning, match="another run"):
        run_to(resumed, task, 6)
    assert [r.step for r in StepLog.read_jsonl(path)] == [4, 5]
    assert [r.step for r in StepLog.read_jsonl(tmp_path / "log.jsonl.2")] == [0, 1]


def test_a_plain_steplog_follows_the_same_rule_and_a_stream_is_never_moved(tmp_path):
    path = tmp_path / "log.jsonl"
    first = StepLog(stream=path)
    for r in records(3):
        first.append(r)
    state = first.state_dict()
    first.close()
    again = StepLog(stream=path)
    again.load_state_dict(state)  # the plain loop's resume
    again.append(records(1, start=3)[0])
    again.close()
    assert [r.step for r in StepLog.read_jsonl(path)] == [0, 1, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log = StepLog(stream="/dev/null")  # a stream: nothing to move, nothing to refuse
        log.append(records(1)[0])
        log.close()


# ---------------------------------------------------------------- pipes, FIFOs and devices


@pytest.mark.timeout(30)  # a FIFO opened for writing with no reader would wait forever
def test_a_fifo_gets_every_record_and_one_nobody_reads_is_refused_not_waited_on(task, tmp_path):
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    model = task.model()
    make = lambda: labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05),  # noqa: E731
                                    task.loss_fn, log=fifo)
    with pytest.raises(OSError, match="nothing is reading it. Start its reader first"):
        make()
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that is there, reading after the run
    try:
        step = make()
        for i in range(3):
            step(*task.batch(i))
        step.log.close()
        received = read_to_end(reader)
    finally:
        os.close(reader)
    assert received.decode().splitlines() == [r.to_json() for r in step.log]


PRINTER = textwrap.dedent("""
    import torch, labkit
    from labkit import StepLog, StepRecord
    task = labkit.ToyTask()
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = labkit.TrainStep(model, opt, task.loss_fn, log="/dev/stdout")
    errors = StepLog(stream="/dev/stderr")
    for i in range(3):
        print(f"before step {i}")
        step(*task.batch(i))
    errors.append(StepRecord(7, 0.5))
    print("done")
""")


@pytest.mark.timeout(90)
def test_dev_stdout_and_dev_stderr_through_real_pipes_keep_every_line_in_order(task):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("PYTHONUNBUFFERED", None)  # print() holds its lines in a buffer, as it does in a pipe
    proc = subprocess.run([sys.executable, "-c", PRINTER], env=env, capture_output=True, text=True,
                          timeout=80)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 7 and lines[-1] == "done"
    assert lines[0::2][:3] == [f"before step {i}" for i in range(3)]
    assert [labkit.records.parse_line(line)["step"] for line in lines[1:-1:2]] == [0, 1, 2]
    assert proc.stderr.splitlines()[-1] == StepRecord(7, 0.5).to_json()  # after any warning of torch's


def test_stdout_redirected_to_a_file_gets_the_records_between_the_prints(task, capfd):
    """pytest's capfd points descriptor 1 at a regular file, as ``python train.py > run.log`` does: a second
    descriptor of our own would write at its own offset, and print's next line would overwrite ours."""
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = labkit.TrainStep(model, opt, task.loss_fn, log="/dev/stdout")
    for i in range(3):
        print(f"before step {i}")
        step(*task.batch(i))
    step.log.close()
    out = capfd.readouterr().out.splitlines()
    assert out == [line for i, r in enumerate(step.log) for line in (f"before step {i}", r.to_json())]


@pytest.mark.timeout(30)
def test_dev_null_and_dev_full_never_hang_or_read(task):
    model = task.model()
    make = lambda path: labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05),  # noqa: E731
                                         task.loss_fn, log=path)
    step = make("/dev/null")
    step(*task.batch(0))
    step.log.close()
    full = make("/dev/full")  # reading it for a torn tail never ends (it once ran out of memory after ~9 GB)
    for i in range(2):
        with pytest.raises(LogWriteError, match=f"could not write to '/dev/full' .*steps 0-{i} are not"):
            full(*task.batch(i))
    assert full.step_count == 2 and [r.step for r in full.log] == [0, 1]


def test_a_folder_or_a_socket_as_log_path_is_refused_saying_what_to_give(task, tmp_path):
    import socket

    model = task.model()
    make = lambda path: labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05),  # noqa: E731
                                         task.loss_fn, log=path)
    with pytest.raises(IsADirectoryError, match="it is a folder; give a file in it"):
        make(tmp_path)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "s"))
        with pytest.raises(OSError, match="neither a file, a pipe nor a character device"):
            make(tmp_path / "s")


class Trickle:
    """os.write writing at most ``most`` bytes a call; it fails once after ``fail_after``."""

    def __init__(self, monkeypatch, most=7, fail_after=None):
        self.most, self.fail_after, self.total, self.real = most, fail_after, 0, os.write
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd, data):
        if self.fail_after is not None and self.total >= self.fail_after:
            self.fail_after = None
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        assert self.total < 1 << 20, "the write loop does not advance"  # a bound, not a hang
        n = self.real(fd, data[: self.most])
        self.total += n
        return n


@pytest.mark.timeout(30)
def test_short_writes_continue_where_they_stopped(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    log = StepLog(stream=path)
    Trickle(monkeypatch)
    for r in records(5):
        log.append(r)
    log.close()
    assert path.read_text() == "".join(r.to_json() + "\n" for r in records(5))


@pytest.mark.timeout(30)
def test_a_stream_that_fails_mid_line_gets_the_rest_of_it_once_not_twice(tmp_path, monkeypatch):
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        log = StepLog(stream=fifo)
        log.append(records(1)[0])
        Trickle(monkeypatch, fail_after=30)  # 30 bytes of the second line get through, then an error
        with pytest.raises(LogWriteError, match="steps 1-1 are not in the file yet"):
            log.append(records(2)[1])
        log.append(records(3)[2])  # the rest of line 2, then line 3
        log.close()
        received = read_to_end(reader)
    finally:
        os.close(reader)
    assert received.decode() == "".join(r.to_json() + "\n" for r in records(3))


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
    """A run resumed at step 5 from a checkpoint (model, optimizer, TrainStep) is the uninterrupted run: the
    same records from step 5 on, and the same summary, its counts over all 12 steps."""
    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = labkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)  # grows before step 5
        return labkit.TrainStep(model, opt, task.loss_fn, max_norm=0.3, precision="fp16", scaler=scaler,
                                hooks=[ClipAlarm(None), Faults(["2:nan", "8:overflow"])])

    step = make(task.model())
    for i in range(5):
        step(*task.batch(i))
    checkpoint = copy.deepcopy({"model": step.model.state_dict(), "opt": step.optimizer.state_dict(),
                                "train": step.state_dict()})
    for i in range(5, 12):
        step(*task.batch(i))
    resumed = make(task.model())
    resumed.model.load_state_dict(checkpoint["model"])
    resumed.optimizer.load_state_dict(checkpoint["opt"])
    resumed.load_state_dict(checkpoint["train"])
    for i in range(5, 12):
        resumed(*task.batch(i))
    assert [r.to_json() for r in resumed.log] == [r.to_json() for r in step.log[5:]]
    s = resumed.log.summary()
    assert 0 < s["clipped"] < s["steps"] - s["skipped"]  # both kinds of step, and a skip of each reason
    assert s["skips_by_reason"] == {"nonfinite_loss": 1, "nonfinite_grad": 1} and s["steps"] == 12
    spikes = ("spike_score_loss", "spike_score_grad")  # read from the records held: the resumed run's 7
    assert {k: v for k, v in s.items() if k not in spikes} == \
        {k: v for k, v in step.log.summary().items() if k not in spikes}


def test_a_summary_state_that_does_not_add_up_is_refused():
    log = StepLog(records(3))
    state = log.state_dict()
    state["stepped"] = 7
    with pytest.raises(ValueError, match="add up"):
        StepLog().load_state_dict(state)
