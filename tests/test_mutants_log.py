"""The record and its log against their contracts (issue 37: the mutants of records, steplog, logfile, hooks).

A record reads every core number through ``get``; a reason is kept as the text it was, whatever it
spells; a record read from any line (a field named like a Python protocol, ``__deepcopy__``) copies
and pickles as itself; a field keyed by floats (a histogram's bucket edges, the last one +inf) is
written as strict JSON; ``put`` says which of its three rules a name broke.
"""

from __future__ import annotations

import copy
import json
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.alarms import LabkitWarning
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
