"""The record and its log against their contracts (issue 37: the mutants of records, steplog, logfile, hooks).

A record reads every core number through ``get``; a reason is kept as the text it was, whatever it
spells; a record read from any line (a field named like a Python protocol, ``__deepcopy__``) copies
and pickles as itself; a field keyed by floats (a histogram's bucket edges, the last one +inf) is
written as strict JSON; ``put`` says which of its three rules a name broke.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import pathlib
import pickle
import re
import stat
import sys
import threading
import time
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_log_recovery import read_to_end

from labkit import LogWriteError, logfile
from labkit.alarms import LabkitWarning
from labkit.hooks import DecisionView, Hook, Hooks, Verdict
from labkit.logfile import MAX_LINE
from labkit.records import CORE, NONFINITE, Field, RewindEvent, StepRecord, declare, put, read_line
from labkit.steplog import StepLog

FAST = settings(max_examples=60, deadline=None, database=None)


def strict(line: str) -> dict:
    """Parse ``line`` as strict JSON (JavaScript's JSON.parse: no bare NaN or Infinity)."""
    def refuse(token: str) -> None:
        raise ValueError(f"bare {token} is not strict JSON")
    return json.loads(line, parse_constant=refuse)


def test_get_reads_every_core_number_as_its_attribute():
    r = StepRecord(3, 0.5, grad_norm=2.0, clip_coef=0.25, clipped=True, scale=8.0, next_scale=16.0,
                   skipped=False, reason="spike_grad", lr=0.1, lrs=[0.1, 0.05], z_loss=1.5)
    for name in CORE:
        assert r.get(name, "absent") == getattr(r, name), name
    assert r.get("z_loss") == 1.5 and r.get("nobody_set_this", "absent") == "absent"


REASONS = st.sampled_from(sorted(NONFINITE)) | st.text(max_size=12)


@FAST
@given(reason=REASONS)
def test_a_reason_reads_back_as_the_text_it_was_whatever_it_spells(reason):
    r = StepRecord(1, 0.5, skipped=True, reason=reason)
    [back] = read_line(r.to_json())
    assert back.reason == reason and back == r
    assert StepRecord.from_dict(r.to_dict()).reason == reason


PROTOCOL = st.sampled_from(["__deepcopy__", "__copy__", "__getnewargs_ex__", "__setstate__", "__len__"])
NAMES = (PROTOCOL | st.text(min_size=1, max_size=8)).filter(lambda k: k not in (*CORE, "rewound",
                                                                                 "rewind_to", "event"))


@FAST
@given(fields=st.dictionaries(NAMES, st.integers(-5, 5), min_size=1, max_size=4))
def test_a_record_read_from_any_line_copies_and_pickles_as_itself(fields):
    # from_dict keeps every key beyond the core as a field, "whatever labkit wrote them"
    [r] = read_line(json.dumps({"step": 2, "loss": 0.5, **fields}))
    assert {k: r.get(k) for k in fields} == fields
    for twin in (copy.deepcopy(r), copy.copy(r), pickle.loads(pickle.dumps(r))):
        assert twin.to_json() == r.to_json()  # (== would compare the NaN norms)


def test_a_record_not_built_yet_has_no_attribute_rather_than_recursing():
    r = StepRecord.__new__(StepRecord)  # what a protocol that bypasses __init__ holds before setting it up
    assert not hasattr(r, "fields") and not hasattr(r, "z_loss") and getattr(r, "loss", None) is None


def test_a_field_keyed_by_floats_up_to_infinity_is_written_as_strict_json():
    # a histogram by bucket edge, the last edge +inf (as Prometheus's le="+Inf"): json writes a float key
    # as its text; a non-finite one as the record's own spelling of it
    r = StepRecord(0, 1.0, grad_hist={0.5: 3, 1.0: 2, math.inf: 1})
    line = r.to_json()
    assert strict(line)["grad_hist"] == {"0.5": 3, "1.0": 2, "Infinity": 1}
    [back] = read_line(line)
    assert back.grad_hist == {"0.5": 3, "1.0": 2, "Infinity": 1}


def test_put_says_which_rule_a_name_broke():
    declare("TestMutantsLog", {"mlog_flat": Field(0.0), "mlog_layers": Field({}, per_layer=True)})
    with pytest.raises(ValueError, match="'loss' is the core's, not a per-layer field"):
        put({}, "loss/h.0", 1.0)
    with pytest.raises(ValueError, match="'mlog_nobody' is declared by no hook"):
        put({}, "mlog_nobody", 1.0)
    with pytest.raises(ValueError, match="'mlog_flat' is not per layer"):
        put({}, "mlog_flat/h.0", 1.0)
    fields: dict = {}
    put(fields, "mlog_layers/h.0", 2.0)
    put(fields, "mlog_flat", 1.0)
    assert fields == {"mlog_layers": {"h.0": 2.0}, "mlog_flat": 1.0}


# --- the log (steplog.StepLog) -------------------------------------------------------------------------


def run(scales, skips=()):
    """Records of a run whose loss scale was ``scales[i]`` at step i (next: the following one)."""
    nexts = [*scales[1:], scales[-1]]
    return [StepRecord(i, 1.0 / (i + 1), grad_norm=1.0, scale=s, next_scale=nexts[i], skipped=i in skips,
                       reason="nonfinite_grad" if i in skips else None, clipped=i % 2 == 0)
            for i, s in enumerate(scales)]


@FAST
@given(scales=st.lists(st.sampled_from([2.0**k for k in range(-3, 17)]), min_size=1, max_size=12))
def test_the_summarys_scale_range_is_the_min_and_max_of_every_scale_it_saw(scales):
    rs = run(scales)
    summary = StepLog(rs, window=1).summary()  # counted as they came, however few are kept
    every = [r.scale for r in rs] + [rs[-1].next_scale]
    assert (summary["min_scale"], summary["max_scale"]) == (min(every), max(every))


def test_a_resumed_summary_is_the_uninterrupted_one_to_the_letter():
    rs = run([8.0, 4.0, 4.0, 8.0, 2.0, 2.0], skips={1, 4})
    whole = StepLog(rs)
    first = StepLog(rs[:3])
    resumed = StepLog()
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    for r in rs[3:]:
        resumed.append(r)
    assert json.dumps(resumed.summary()) == json.dumps(whole.summary())  # counts as ints, as counted
    assert resumed.summary()["steps"] == 6 and resumed.summary()["skipped"] == 2
    again = StepLog()  # resumed a second time, from the resumed run's own checkpoint
    again.load_state_dict(resumed.state_dict())
    assert json.dumps(again.summary()) == json.dumps(whole.summary())


def good_state():
    return StepLog(run([8.0, 4.0, 8.0], skips={1})).state_dict()


@pytest.mark.parametrize("change", [
    {"steps": 3.0, "stepped": 2.0},           # counts are ints
    {"stepped": True, "steps": 2},            # ... not bools
    {"stepped": 3, "reasons": {"nonfinite_grad": -1}, "steps": 2},  # ... >= 0, even when they add up
    {"steps": 4},                             # stepped + skipped = steps
    {"clipped": 3},                           # clipped <= stepped
])
def test_a_state_whose_counts_are_not_counts_is_refused(change):
    with pytest.raises(ValueError, match="counts must be ints >= 0"):
        StepLog().load_state_dict({**good_state(), **change})


def test_a_states_float_totals_come_back_python_floats_whatever_number_type_was_saved():
    """A state saved with a scale as a 0-dim tensor (or a whole number as an int, as a hand-written or
    another tool's state has it) is resumed with Python floats: the summary stays JSON, and equal."""
    import torch

    want = StepLog()
    want.load_state_dict(good_state())
    odd = {**good_state(), "min_scale": torch.tensor(good_state()["min_scale"]), "final_loss": 8}
    log = StepLog()
    log.load_state_dict(odd)
    summary = log.summary()
    assert type(summary["min_scale"]) is float and type(summary["final_loss"]) is float
    assert json.dumps(summary) == json.dumps({**want.summary(), "final_loss": 8.0})


@pytest.mark.parametrize("key", ["final_loss", "reasons", "min_scale"])
def test_a_state_missing_a_total_or_holding_another_is_refused(key):
    state = good_state()
    del state[key]
    with pytest.raises(KeyError, match="state_dict"):
        StepLog().load_state_dict(state)
    with pytest.raises(KeyError, match="state_dict"):
        StepLog().load_state_dict({**good_state(), "from_elsewhere": 1})


@pytest.mark.parametrize("size", [1, 2, 1 << 40])
def test_a_stream_mark_of_any_positive_size_is_accepted_and_of_none_refused(size):
    mark = {"size": size, "last_line_sha256": "0" * 64}
    StepLog().load_state_dict({**good_state(), "stream": mark})  # no file: validated, then nothing to cut
    with pytest.raises(ValueError, match="'size': int > 0"):
        StepLog().load_state_dict({**good_state(), "stream": {**mark, "size": 0}})


@pytest.mark.parametrize("window", [0, -1, 1.5, True, "2"])
def test_a_window_is_an_int_of_at_least_one(window):
    with pytest.raises(ValueError, match=r"\bwindow must be an int >= 1"):
        StepLog(window=window)


def test_a_window_of_one_keeps_the_last_record_and_none_keeps_every_one():
    rs = run([1.0] * 4)
    assert list(StepLog(rs, window=1)) == rs[-1:] and list(StepLog(rs, window=None)) == rs
    assert StepLog(rs, window=3)[1:] == rs[2:] and StepLog(rs)[1:3] == rs[1:3]


def test_a_log_built_from_another_keeps_its_events():
    log = StepLog(run([1.0] * 4))
    log.append_event(RewindEvent(step=3, to=2))
    copy_ = StepLog(log)
    assert copy_.events == log.events and copy_.rewound == [False, False, True, True]
    assert StepLog(log, window=2).rewound == [True, True]


def test_every_sink_gets_every_record_as_it_is_appended():
    class Sink:
        def __init__(self):
            self.got, self.closed = [], False

        def write(self, record):
            self.got.append(record)

        def close(self):
            self.closed = True

    sinks = [Sink(), Sink()]
    log = StepLog(sinks=sinks)
    rs = run([1.0] * 3)
    for r in rs:
        log.append(r)
    log.close()
    assert all(s.got == rs and s.closed for s in sinks)


def test_events_after_names_only_the_records_held_that_triggered_them():
    log = StepLog(window=2)
    for r in run([1.0] * 5):
        log.append(r)
        if r.step in (1, 3):  # rewinds triggered by step 1 (no longer held) and by step 3 (held first)
            log.append_event(RewindEvent(step=r.step, to=r.step))
    assert [r.step for r in log] == [3, 4]
    assert log.events_after() == {0: [log.events[1][1]]}
    log.append_event(RewindEvent(step=4, to=4))
    assert log.events_after() == {0: [log.events[1][1]], 1: [log.events[2][1]]}


def test_a_log_torn_inside_a_character_reads_its_complete_records(tmp_path):
    # a crash can cut a line inside a multi-byte UTF-8 character: still a torn last line, not an error
    rs = [StepRecord(0, 1.0, reason="é"), StepRecord(1, 0.5, reason="naïve")]
    path = tmp_path / "log.jsonl"
    StepLog(rs).to_jsonl(path)
    path.write_bytes(path.read_bytes() + '{"step": 2, "reason": "ü'.encode()[:-1])  # half the ü
    with pytest.warns(LabkitWarning, match="torn"):
        back = StepLog.read_jsonl(path)
    assert [r.to_json() for r in back] == [r.to_json() for r in rs] and back.torn_tail is not None


def test_an_empty_or_blank_lined_log_reads_every_record_it_has(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"")
    assert len(StepLog.read_jsonl(path)) == 0
    rs = run([1.0] * 3)
    lines = [r.to_json() for r in rs]
    path.write_text(lines[0] + "\n\n  \n" + "\n".join(lines[1:]) + "\n", encoding="utf-8")
    assert [r.to_json() for r in StepLog.read_jsonl(path)] == [r.to_json() for r in rs]


# --- the log file (logfile.JsonlFile) -------------------------------------------------------------------
# This process's stdout and stderr are named through /proc/self/fd (under capfd: pytest's capture files),
# never through /dev: a rename of a /proc name is refused, so no mutant can move a device aside.


def lines(rs):
    return [r.to_json() for r in rs]


@pytest.mark.parametrize("fd, name", [(1, "stdout"), (2, "stderr")])
def test_a_log_to_this_processs_own_stdout_or_stderr_keeps_print_order(fd, name, monkeypatch, capfd):
    print("earlier", file=getattr(sys, name), flush=True)  # the stream holds text: still no other run's file
    buffered = open(os.dup(fd), "w", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, name, buffered)
    log = StepLog(stream=f"/proc/self/fd/{fd}")
    assert log.file.kind == name
    rs = run([1.0] * 2)
    for i, r in enumerate(rs):
        print(f"print {i}", file=buffered)  # still in print's buffer when the record is written
        log.append(r)
    log.close()
    buffered.close()
    out = capfd.readouterr()
    assert getattr(out, "out" if fd == 1 else "err").splitlines() == ["earlier", "print 0", lines(rs)[0],
                                                                      "print 1", lines(rs)[1]]


class NoFlush:
    def write(self, text):
        return len(text)


class FailingFlush(NoFlush):
    def flush(self):
        raise BrokenPipeError(errno.EPIPE, "pipe")


@pytest.mark.parametrize("replaced", [NoFlush(), FailingFlush(), "closed"])
def test_a_log_to_stdout_is_written_whatever_sys_stdout_was_replaced_by(replaced, monkeypatch, capfd):
    if replaced == "closed":
        replaced = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (closed at once)
        replaced.close()
    log = StepLog(stream="/proc/self/fd/1")
    monkeypatch.setattr(sys, "stdout", replaced)
    rs = run([1.0] * 2)
    for r in rs:
        log.append(r)
    log.close()
    monkeypatch.undo()
    assert capfd.readouterr().out.splitlines() == lines(rs)


@pytest.mark.parametrize("rank, plain, each", [(0, "log.jsonl", "log.0.jsonl"), (3, None, "log.3.jsonl")])
def test_rank_0_writes_a_plain_path_and_every_rank_its_own_rank_path(rank, plain, each, monkeypatch):
    monkeypatch.setattr(logfile, "rank", lambda: rank)
    assert logfile.rank_path("log.jsonl") == plain and logfile.rank_path("log.{rank}.jsonl") == each
    assert logfile.rank_path(pathlib.Path("runs") / "{rank}" / "log.jsonl") == f"runs/{rank}/log.jsonl"


def test_a_new_log_file_is_plain_data_nobody_executes(tmp_path):
    path = tmp_path / "log.jsonl"
    StepLog(stream=path).close()
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode & 0o111 == 0 and mode & 0o600 == 0o600


@FAST
@given(old=st.sampled_from([b"\n", b"{}\n", b"x\n", b" \n\n"]))
def test_a_file_holding_anything_is_another_runs_and_this_run_starts_afresh(old, tmp_path_factory):
    path = tmp_path_factory.mktemp("log") / "log.jsonl"
    path.write_bytes(old)
    log = StepLog(stream=path)
    rs = run([1.0] * 2)
    with pytest.warns(LabkitWarning, match="holds the records of another run"):
        for r in rs:
            log.append(r)
    log.close()
    assert path.read_text(encoding="utf-8").splitlines() == lines(rs)
    assert pathlib.Path(f"{path}.1").read_bytes() == old


class Flaky:
    """os.write failing (EAGAIN) once at each of ``at`` (bytes written so far), writing up to it exactly."""

    def __init__(self, monkeypatch, at):
        self.at, self.total, self.real = list(at), 0, os.write
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd, data):
        if self.at and self.total >= self.at[0]:
            self.at.pop(0)
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        n = self.real(fd, data[: self.at[0] - self.total] if self.at else data)
        self.total += n
        return n


@pytest.mark.timeout(30)
def test_a_stream_failing_at_and_inside_lines_delivers_each_line_once(tmp_path, monkeypatch):
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    rs = run([1.0] * 4)
    a, b = (len(x) + 1 for x in lines(rs)[:2])
    try:
        log = StepLog(stream=fifo)
        assert log.file.kind == "stream"
        Flaky(monkeypatch, at=[0, a, a + b + 30, a + b + 60])
        expected = ["steps 0-0", "steps 1-1", "steps 2-2", "steps 2-3"]  # the lines not (wholly) sent yet
        for r, missing in zip(rs, expected):
            with pytest.raises(LogWriteError, match=f"{missing} are not in the file yet"):
                log.append(r)
        log.close()
        received = read_to_end(reader)
    finally:
        os.close(reader)
    assert received.decode().splitlines() == lines(rs)


@pytest.mark.timeout(30)
def test_a_fifo_nobody_reads_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="nothing is reading it"):
        StepLog(stream=fifo)


@pytest.mark.timeout(30)
def test_a_slow_reader_slows_the_log_and_loses_nothing(tmp_path):
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    got = []

    def read_later():
        time.sleep(0.2)
        os.set_blocking(reader, True)
        while chunk := os.read(reader, 1 << 16):
            got.append(chunk)

    rs = [StepRecord(i, 1.0, pad="x" * 4000) for i in range(40)]  # 160 KB: more than a pipe holds
    log = StepLog(stream=fifo)
    thread = threading.Thread(target=read_later)
    thread.start()
    try:
        for r in rs:
            log.append(r)
        log.close()
    finally:
        thread.join(10)
        os.close(reader)
    assert b"".join(got).decode().splitlines() == lines(rs)


def test_a_checkpoint_after_a_failed_first_write_marks_where_the_file_will_end(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    log = StepLog(stream=path)
    rs = run([1.0] * 2)
    with monkeypatch.context() as m:
        Flaky(m, at=[0, 0])
        for r in rs:
            with pytest.raises(LogWriteError):
                log.append(r)
        state = log.state_dict()
    log.flush()  # the disk has room again
    assert os.path.getsize(path) == state["stream"]["size"]
    assert path.read_text(encoding="utf-8").splitlines() == lines(rs)


def test_a_log_that_cannot_move_another_runs_file_names_the_steps_it_holds_back(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    path.write_text(lines(run([1.0]))[0] + "\n", encoding="utf-8")
    log = StepLog(stream=path)
    monkeypatch.setattr(os, "rename", lambda *a: (_ for _ in ()).throw(PermissionError(errno.EACCES, "no")))
    rs = run([1.0] * 2)
    with pytest.raises(LogWriteError, match="steps 0-0 are not in the file yet"):
        log.append(rs[0])
    with pytest.raises(LogWriteError, match="steps 0-1 are not in the file yet"):
        log.append(rs[1])


def test_a_torn_tail_is_cut_to_the_byte_and_the_warning_counts_it(tmp_path):
    path = tmp_path / "log.jsonl"
    for head, torn in ((b"", b"x" * 5), (b"\n", b"y" * (1 << 16)), (b"{}\n", b'{"step": 3, "lo')):
        path.write_bytes(head + torn)
        with pytest.warns(LabkitWarning, match=rf"\({len(torn)} bytes"):
            logfile.cut_torn_tail(path)
        assert path.read_bytes() == head  # the lines before the torn one, each byte of them


def big(step, n):
    """A record whose line, newline included, is ``n`` bytes."""
    return StepRecord(step, 1.0, pad="x" * (n - len(StepRecord(step, 1.0, pad="").to_json()) - 1))


@pytest.mark.parametrize("n, kept", [(MAX_LINE, True), (MAX_LINE + 1, False)])
def test_a_last_line_without_its_newline_is_a_record_up_to_max_line_bytes(n, kept, tmp_path):
    path = tmp_path / "log.jsonl"
    whole = big(1, n + 1).to_json().encode()  # n bytes, complete but for its newline
    for head in (b"", big(0, MAX_LINE - 10).to_json().encode() + b"\n"):  # also after a long first line
        path.write_bytes(head + whole)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if not kept else "error")
            logfile.cut_torn_tail(path)
        assert path.read_bytes() == (head + whole + b"\n" if kept else head)


@pytest.mark.parametrize("n", [MAX_LINE, MAX_LINE + 5])
def test_a_resume_names_the_steps_it_cuts_or_past_max_line_bytes_how_many_bytes(n, tmp_path):
    path = tmp_path / "log.jsonl"
    log = StepLog(stream=path)
    log.append(StepRecord(0, 1.0))
    state = log.state_dict()
    log.append(big(1, n))  # up to MAX_LINE bytes a record; a longer line is none: only its bytes are counted
    log.close()
    extra = os.path.getsize(path) - state["stream"]["size"]
    what = "1 records (steps 1-1)" if n <= MAX_LINE else f"{extra} bytes"
    with pytest.warns(LabkitWarning, match=re.escape(f"cut {what} written after the checkpoint")):
        StepLog(stream=path).load_state_dict(state)
    assert os.path.getsize(path) == state["stream"]["size"]


# --- the hook protocol (hooks.Hooks) --------------------------------------------------------------------


class Seen(Hook):
    """Records every moment it is called at, with the arguments it was given."""

    def __init__(self):
        self.calls = []

    def attach(self, trainer):
        self.calls.append(("attach", trainer))

    def pre_step(self, trainer, step):
        self.calls.append(("pre_step", trainer, step))

    def pre_forward(self, trainer, step):
        self.calls.append(("pre_forward", trainer, step))

    def post_backward(self, trainer, step):
        self.calls.append(("post_backward", trainer, step))

    def gradient_order(self, trainer, step):
        self.calls.append(("gradient_order", trainer, step))

    def on_decision(self, trainer, view):
        self.calls.append(("on_decision", trainer, view))

    def pre_optim_step(self, trainer, step, params):
        self.calls.append(("pre_optim_step", trainer, step, params))

    def post_step(self, trainer, params, record):
        self.calls.append(("post_step", trainer, params, record))

    def on_record(self, trainer, record):
        self.calls.append(("on_record", trainer, record))


def test_hooks_call_each_moment_of_every_member_with_the_steps_own_arguments():
    members = [Seen(), Seen()]
    hooks, trainer, params, record = Hooks(members), object(), [("w", None)], StepRecord(7, 0.5)
    view = DecisionView(7, 0.5, 1.0)
    hooks.attach(trainer)
    hooks.pre_step(trainer, 7)
    assert hooks.pre_forward(trainer, 7) is None and hooks.post_backward(trainer, 7) == {}
    assert hooks.gradient_order(trainer, 7) is None
    hooks.on_decision(trainer, view)
    hooks.pre_optim_step(trainer, 7, params)
    hooks.post_step(trainer, params, record)
    assert hooks.on_record(trainer, record) == []
    expected = [("attach", trainer), ("pre_step", trainer, 7), ("pre_forward", trainer, 7),
                ("post_backward", trainer, 7), ("gradient_order", trainer, 7), ("on_decision", trainer, view),
                ("pre_optim_step", trainer, 7, params), ("post_step", trainer, params, record),
                ("on_record", trainer, record)]
    assert all(h.calls == expected for h in members)


class Decides(Hook):
    def on_decision(self, trainer, view):
        return Verdict(clip_to=1.0)


class EveryStep(Hook):
    per_step = True


@pytest.mark.parametrize("members, decides, per_step", [
    ([], False, False), ([Hook()], False, False), ([Decides()], True, False),
    ([Hook(), Decides()], True, False), ([EveryStep()], False, True),
    ([Hook(), EveryStep(), Decides()], True, True),
])
def test_hooks_decide_if_a_member_decides_and_need_every_step_if_a_member_does(members, decides, per_step):
    hooks = Hooks(members)
    assert hooks.decides is decides and hooks.per_step is per_step


def test_another_runs_lines_longer_than_max_line_are_no_records_in_its_warning(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(big(5, MAX_LINE + 2).to_json().encode() + b"\n")  # JSON, but too long to be a record
    log = StepLog(stream=path)
    with pytest.warns(LabkitWarning, match=r"another run \(steps None-None\)"):
        log.append(StepRecord(0, 1.0))
    log.close()


def test_stderr_is_found_when_stdout_is_closed(capfd):
    saved = os.dup(1)
    os.close(1)  # a daemon without stdout: fd 1 cannot be compared, fd 2 still is
    try:
        log = StepLog(stream="/proc/self/fd/2")
        kind = log.file.kind
        log.close()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert kind == "stderr"


def test_a_skip_without_a_reason_is_counted_under_a_question_mark():
    """A record skipped with no reason (one a user made by hand) still counts, under "?"."""
    summary = StepLog([StepRecord(0, 1.0, skipped=True), StepRecord(1, 1.0)]).summary()
    assert summary["skipped"] == 1 and summary["skips_by_reason"]["?"] == 1
