"""StepRecord and StepLog: fields, columns, summaries, JSONL/CSV export and streaming."""

import csv
import json
import math

import pytest
import torch

import labkit
import labkit.step  # noqa: F401  the step's parts declare their record fields (blame, clippers, faults, alarms)
from labkit import StepLog, StepRecord
from labkit.alarms import SkipAlarm
from labkit.blame import BackwardOrder
from labkit.faults import Faults
from labkit.formats.bf16 import StaleMonitor
from labkit.records import CORE, Field, RewindEvent, declare, declared, put
from labkit.spikes import SpikeDetector
from labkit.tasks.gpt import LogitMonitor

NAN = float("nan")
INF = float("inf")
# every field an older labkit wrote on every line, in its order: a log in that schema still reads
OLD_FLAT = [
    "step", "loss", "grad_norm", "clip_coef", "clipped", "scale", "next_scale", "skipped", "reason",
    "skip_streak", "lr", "fault", "top_grads", "first_nonfinite", "culprit_module",
    "stale", "lrs",
    "z_loss", "z_grad", "threshold", "clip_reason", "lockin", "rewound", "rewind_to",  # issue 15
    "attn_logit_max", "attn_entropy", "log_z", "log_z_sq", "ce_loss",  # the GPT's logits (LogitMonitor)
]


def same_value(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def assert_records_equal(a, b):
    da, db = a.to_dict(), b.to_dict()
    diffs = {k: (da[k], db[k]) for k in da if not same_value(da[k], db[k])}
    assert not diffs, f"step {da['step']}: {diffs}"
    assert [type(t) for t in a.top_grads] == [type(t) for t in b.top_grads]


@pytest.fixture
def log():
    """Six steps covering every case: clean, bad batch, clipped, overflow, clipped, scale drop."""
    return StepLog([
        StepRecord(0, 1.0, grad_norm=0.5, scale=1024.0, next_scale=1024.0, lr=0.1),
        StepRecord(1, NAN, scale=1024.0, next_scale=1024.0, skipped=True, reason="nonfinite_loss",
                   skip_streak=1, lr=0.1, fault="nan"),
        StepRecord(2, 0.9, grad_norm=3.0, clip_coef=1 / 3, clipped=True, scale=1024.0, next_scale=2048.0,
                   lr=0.1, fault="spike:1000",
                   top_grads=[("0.weight", 2.5), ("2.weight", 1.5), ("0.bias", 0.5)]),
        StepRecord(3, 0.8, grad_norm=INF, scale=2048.0, next_scale=1024.0, skipped=True,
                   reason="nonfinite_grad", skip_streak=1, lr=0.05, fault="overflow",
                   top_grads=[("4.weight", INF), ("2.weight", NAN), ("0.bias", 2.0)],
                   first_nonfinite="4.weight", culprit_module="4"),
        StepRecord(4, 0.7, grad_norm=2.0, clip_coef=0.5, clipped=True, scale=1024.0, next_scale=1024.0,
                   lr=0.05, top_grads=[("2.bias", 1.25)]),
        StepRecord(5, 0.6, grad_norm=0.4, scale=1024.0, next_scale=512.0, lr=0.05),
    ])


@pytest.fixture
def task():
    return labkit.ToyTask()


# ---------------------------------------------------------------- StepRecord


def test_the_core_is_small_and_each_hook_declares_its_own_fields():
    assert CORE == ("step", "loss", "grad_norm", "clip_coef", "clipped", "scale", "next_scale", "skipped",
                    "reason", "lr", "lrs")
    owners = {SkipAlarm: {"skip_streak"}, BackwardOrder: {"top_grads", "first_nonfinite", "culprit_module"},
              StaleMonitor: {"stale"}, SpikeDetector: {"z_loss", "z_grad"},
              LogitMonitor: {"attn_logit_max", "attn_entropy", "log_z", "log_z_sq", "ce_loss"}}
    for hook, names in owners.items():
        assert set(hook.record_fields) == names, hook
    # the clipper's and the fault schedule's (not hooks: declared by their modules); no rewind marks any more
    assert set(declared()) >= {*set().union(*owners.values()), "threshold", "clip_reason", "lockin", "fault"}
    assert not {"rewound", "rewind_to"} & set(declared())
    assert set(OLD_FLAT) - set(CORE) - set(declared()) == {"rewound", "rewind_to"}


def test_record_defaults():
    r = StepRecord(step=0, loss=0.5)
    assert math.isnan(r.grad_norm) and math.isnan(r.lr)
    assert (r.clip_coef, r.clipped, r.scale, r.next_scale) == (1.0, False, 1.0, 1.0)
    assert (r.skipped, r.reason, r.skip_streak, r.fault) == (False, None, 0, None)
    assert r.top_grads == [] and r.first_nonfinite is None and math.isnan(r.z_loss) and r.stale == {}
    assert StepRecord(1, 0.5).top_grads is not r.top_grads  # no shared mutable default
    assert r.fields == {} and r.get("fault", "none") == "none"  # a default is no field: nothing is written
    with pytest.raises(AttributeError, match="StepRecord has no field 'culprit'"):
        r.culprit  # noqa: B018


def test_the_core_is_immutable_and_fields_are_set_only_if_declared():
    r = StepRecord(0, 1.0)
    with pytest.raises(AttributeError, match="not changed once built"):
        r.loss = 2.0
    with pytest.raises(AttributeError, match="not changed once built"):
        r.z_loss = 2.0
    put(r.fields, "z_loss", 3.0)
    put(r.fields, "stale/h.0", 0.25)
    assert (r.z_loss, r.stale) == (3.0, {"h.0": 0.25})
    for bad, why in (("nope", "declared by no hook"), ("loss", "the core's"),
                     ("z_loss/h.0", "not per layer")):
        with pytest.raises(ValueError, match=why):
            put(r.fields, bad, 1.0)
    assert set(r.fields) == {"z_loss", "stale"}  # a refused field changed nothing
    declare("ThisTest", {"z_loss": Field(NAN)})  # the same declaration again is harmless; another is refused
    with pytest.raises(ValueError, match="SpikeDetector declares otherwise"):
        declare("ThisTest", {"z_loss": Field(0.0)})
    with pytest.raises(ValueError, match="not one of the core's"):
        declare("ThisTest", {"loss": Field(0.0)})


@pytest.mark.parametrize(
    "record, expected",
    [
        (StepRecord(0, 1.0, grad_norm=0.5), 0.5),
        (StepRecord(0, 1.0, grad_norm=4.0, clip_coef=0.25, clipped=True), 1.0),
        (StepRecord(0, 1.0, grad_norm=INF, skipped=True, reason="nonfinite_grad"), NAN),
        (StepRecord(0, NAN, skipped=True, reason="nonfinite_loss"), NAN),
    ],
    ids=["unclipped", "clipped", "skipped-grad", "skipped-loss"],
)
def test_post_clip_norm(record, expected):
    assert same_value(record.post_clip_norm, expected)


def test_older_and_newer_jsonl_lines_are_read(tmp_path):
    """A line without culprit_module (written before it existed) reads as None; a field this labkit does
    not know (written by a newer one) is left out instead of failing the whole file."""
    older = (
        '{"step": 3, "loss": 0.8, "skipped": true, "reason": "nonfinite_grad", "first_nonfinite": "0.weight"}'
    )
    newer = (
        '{"step": 4, "loss": 0.7, "first_nonfinite": null, "culprit_module": null, "from_a_newer_labkit": 1}'
    )
    path = tmp_path / "mixed.jsonl"
    path.write_text(older + "\n" + newer + "\n")
    a, b = StepLog.read_jsonl(path)
    assert (a.first_nonfinite, a.culprit_module, a.reason) == ("0.weight", None, "nonfinite_grad")
    assert b.step == 4 and b.from_a_newer_labkit == 1  # kept: a field of a hook this labkit does not have
    with pytest.raises(TypeError):  # not a record at all
        StepRecord.from_dict({"loss": 1.0})


def test_to_dict_from_dict_round_trip(log):
    for r in log:
        assert_records_equal(StepRecord.from_dict(r.to_dict()), r)
    # from_dict turns JSON's lists back into tuples
    assert StepRecord.from_dict({"step": 0, "loss": 1.0, "top_grads": [["a", 1.0]]}).top_grads == [("a", 1.0)]


# ---------------------------------------------------------------- StepLog as a sequence


def test_log_is_a_sequence(log):
    assert len(log) == 6
    assert log[2].step == 2 and log[-1].step == 5
    assert [r.step for r in log[1:3]] == [1, 2]
    assert [r.step for r in log] == list(range(6))
    assert "6 records" in repr(log) and "[1, 3]" in repr(log)


def test_empty_log():
    log = StepLog()
    assert len(log) == 0 and log.skipped_steps == [] and log.clipped_steps == []
    s = log.summary()
    assert (s["steps"], s["skipped"], s["clipped"], s["clip_rate"]) == (0, 0, 0, 0.0)
    assert s["skips_by_reason"] == {"nonfinite_loss": 0, "nonfinite_grad": 0}
    assert all(math.isnan(s[k]) for k in ("min_scale", "max_scale", "final_scale", "final_loss"))


def test_append(log):
    log.append(StepRecord(6, 0.5))
    assert len(log) == 7 and log[-1].step == 6


# ---------------------------------------------------------------- columns and summary


@pytest.mark.parametrize(
    "name, expected",
    [
        ("step", [0, 1, 2, 3, 4, 5]),
        ("scale", [1024.0, 1024.0, 1024.0, 2048.0, 1024.0, 1024.0]),
        ("next_scale", [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 512.0]),
        ("skipped", [False, True, False, True, False, False]),
        ("reason", [None, "nonfinite_loss", None, "nonfinite_grad", None, None]),
        ("fault", [None, "nan", "spike:1000", "overflow", None, None]),
        ("first_nonfinite", [None, None, None, "4.weight", None, None]),
        ("lr", [0.1, 0.1, 0.1, 0.05, 0.05, 0.05]),
        ("post_clip_norm", [0.5, NAN, 1.0, NAN, 1.0, 0.4]),
        ("loss", [1.0, NAN, 0.9, 0.8, 0.7, 0.6]),
    ],
)
def test_column(log, name, expected):
    assert same_value(log.column(name), expected)


@pytest.mark.parametrize("name", ["nope", "Loss", "post_clip", ""])
def test_unknown_column_raises_key_error(log, name):
    with pytest.raises(KeyError, match="no column"):
        log.column(name)


def test_skipped_and_clipped_steps(log):
    assert log.skipped_steps == [1, 3]
    assert log.clipped_steps == [2, 4]


def test_summary(log):
    assert log.summary() == {
        "steps": 6,
        "skipped": 2,
        "skips_by_reason": {"nonfinite_loss": 1, "nonfinite_grad": 1},
        "clipped": 2,
        "clip_rate": 0.5,  # 2 clipped of the 4 steps that stepped
        "min_scale": 512.0,  # the last next_scale counts
        "max_scale": 2048.0,
        "final_scale": 512.0,
        "final_loss": 0.6,
        "spike_score_loss": 0.0,  # too few steps for a rolling 7-sigma test
        "spike_score_grad": 0.0,
        "rewinds": 0,
    }


def test_summary_final_loss_is_the_last_real_step():
    log = StepLog([StepRecord(0, 0.3), StepRecord(1, NAN, skipped=True, reason="nonfinite_loss")])
    s = log.summary()
    assert s["final_loss"] == 0.3 and s["skipped"] == 1 and s["clip_rate"] == 0.0



def test_summary_spike_scores_are_over_the_steps_taken_only():
    """OLMo 2's score (% of values >= 7 sigma from the rolling mean): a stepped spike counts; skipped and
    rewound steps, whatever their values, are not steps taken."""
    calm = [StepRecord(i, 1.0 + 0.01 * (i % 3), grad_norm=0.5 + 0.01 * (i % 2)) for i in range(40)]
    spike = [StepRecord(40, 50.0, grad_norm=30.0)]
    untaken = [StepRecord(41, 1e6, grad_norm=1e6, skipped=True, reason="nonfinite_grad"),
               StepRecord(42, 2e6, grad_norm=2e6),  # undone by the rewind appended after it
               StepRecord(43, -1e6, grad_norm=0.0, skipped=True, reason="spike_loss")]
    later = [StepRecord(44 + i, 1.0 + 0.01 * (i % 3), grad_norm=0.5) for i in range(9)]
    log = StepLog(calm + spike + untaken[:2])
    log.append_event(RewindEvent(step=42, to=42))
    for r in untaken[2:] + later:
        log.append(r)
    s = log.summary()
    assert log.rewound_steps == [42] and s["rewinds"] == 1
    assert s["spike_score_loss"] == s["spike_score_grad"] == pytest.approx(100 / 50)  # 1 in 50 steps taken
    clean = StepLog(calm + spike + later).summary()
    scores = ("spike_score_loss", "spike_score_grad")
    assert [clean[k] for k in scores] == [s[k] for k in scores]

# ---------------------------------------------------------------- JSONL


def test_jsonl_round_trip(log, tmp_path):
    path = tmp_path / "run.jsonl"
    log.to_jsonl(path)
    lines = path.read_text().splitlines()
    assert len(lines) == len(log)
    assert all(json.loads(line)["step"] == i for i, line in enumerate(lines))
    back = StepLog.read_jsonl(path)
    assert len(back) == len(log)
    for a, b in zip(back, log):
        assert_records_equal(a, b)
    assert back[3].top_grads[0] == ("4.weight", INF)
    assert math.isnan(back[3].top_grads[1][1])
    assert back[3].grad_norm == INF and math.isnan(back[1].loss)
    assert all(isinstance(t, tuple) for r in back for t in r.top_grads)


def test_jsonl_overwrites_and_reader_skips_blank_lines(log, tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("garbage that must be overwritten\n")
    log.to_jsonl(path)
    path.write_text(path.read_text() + "\n   \n")
    assert len(StepLog.read_jsonl(path)) == 6


# ---------------------------------------------------------------- CSV


def test_csv_has_a_header_with_every_field_and_one_row_per_record(log, tmp_path):
    path = tmp_path / "run.csv"
    log.to_csv(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        # the core, whether a rewind undid the record, then every field a record holds (in order of
        # appearance)
        assert reader.fieldnames == [*CORE, "rewound", "skip_streak", "fault", "top_grads", "first_nonfinite",
                                     "culprit_module"]
    assert len(rows) == len(log)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4, 5]
    assert same_value([float(r["loss"]) for r in rows], log.column("loss"))
    assert same_value([float(r["grad_norm"]) for r in rows], log.column("grad_norm"))
    assert [float(r["next_scale"]) for r in rows] == log.column("next_scale")
    assert [r["skipped"] for r in rows] == ["False", "True", "False", "True", "False", "False"]
    assert [r["reason"] for r in rows] == ["", "nonfinite_loss", "", "nonfinite_grad", "", ""]
    assert rows[3]["first_nonfinite"] == "4.weight" and rows[3]["culprit_module"] == "4"
    assert rows[2]["top_grads"] == "0.weight=2.5;2.weight=1.5;0.bias=0.5"
    assert rows[3]["top_grads"] == "4.weight=inf;2.weight=nan;0.bias=2"
    assert rows[0]["top_grads"] == ""


def test_csv_of_an_empty_log_is_just_the_header(tmp_path):
    path = tmp_path / "empty.csv"
    StepLog().to_csv(path)
    assert path.read_text().strip() == ",".join([*CORE, "rewound"])


# ---------------------------------------------------------------- streaming


def test_trainstep_streams_one_flushed_line_per_step(task, tmp_path):
    path = tmp_path / "live.jsonl"
    model = task.model()
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, max_norm=0.1,
                            log=path, hooks=[Faults({1: "nan"})])
    try:
        for i in range(4):
            record = step(*task.batch(i))
            # read while the TrainStep (and its open file) is still alive
            lines = path.read_text(encoding="utf-8").splitlines()
            assert len(lines) == i + 1
            assert_records_equal(StepRecord.from_dict(json.loads(lines[-1])), record)
        streamed = StepLog.read_jsonl(path)
        assert streamed.skipped_steps == [1] and streamed.clipped_steps == [0, 2, 3]
        assert math.isnan(streamed[1].loss) and streamed[1].reason == "nonfinite_loss"
        assert streamed[0].top_grads and isinstance(streamed[0].top_grads[0], tuple)
        for a, b in zip(streamed, step.log):
            assert_records_equal(a, b)
    finally:
        step.log.close()
    step.log.close()  # closing twice is harmless


def test_streaming_continues_an_existing_file_only_on_resume(tmp_path):
    path = tmp_path / "resumed.jsonl"
    first = StepLog(stream=path)
    first.append(StepRecord(0, 1.0))
    state = first.state_dict()
    first.close()
    second = StepLog(stream=path)
    second.load_state_dict(state)
    second.append(StepRecord(1, 0.5))
    second.close()
    assert [r.step for r in StepLog.read_jsonl(path)] == [0, 1]
    assert len(second) == 1 and second.summary()["steps"] == 2


def test_no_stream_writes_nothing(tmp_path, log):
    log.append(StepRecord(6, 0.1))
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_a_log_in_the_old_flat_schema_reads_as_the_same_records_and_events(tmp_path):
    """An older labkit wrote every field on every line and marked a rewind on its records (the trigger got
    ``rewind_to``; the undone ones were marked in memory after they were written). Read now: the same core
    and fields, the marks turned into one RewindEvent, and rewound derived from it (so the file's summary
    is right)."""
    def old(step, loss, **changes):
        line = {name: None for name in OLD_FLAT}
        line.update(step=step, loss=loss, grad_norm=0.5, clip_coef=1.0, clipped=False, scale=1.0,
                    next_scale=1.0, skipped=False, skip_streak=0, lr=0.1, top_grads=[], stale={}, lrs=[0.1],
                    z_loss="NaN", z_grad="NaN", threshold="NaN", lockin=False, rewound=False,
                    attn_logit_max={}, attn_entropy={})
        line.update(changes)
        assert list(line) == OLD_FLAT
        return json.dumps(line)

    lines = [old(0, 1.0), old(1, 0.9, z_loss=0.5), old(2, 0.8), old(3, 0.7, z_loss="Infinity"),
             old(4, 50.0, skipped=True, reason="spike_loss", skip_streak=1, z_loss=9.5, rewound=True,
                 rewind_to=2, top_grads=[["0.weight", "Infinity"]], first_nonfinite="0.weight",
                 culprit_module="0"),
             old(2, 0.75), old(3, 0.7)]
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(lines) + "\n")
    log = StepLog.read_jsonl(path)
    assert [r.step for r in log] == [0, 1, 2, 3, 4, 2, 3]
    assert log.rewinds == [RewindEvent(step=4, to=2, reason="spike_loss")]
    assert log.rewound == [False, False, True, True, True, False, False] and log.rewound_steps == [2, 3, 4]
    spike = log[4]
    assert ((spike.reason, spike.skip_streak, spike.z_loss, spike.culprit_module)
            == ("spike_loss", 1, 9.5, "0"))
    assert spike.top_grads == [("0.weight", INF)] and log[3].z_loss == INF and math.isnan(log[0].threshold)
    assert "rewound" not in spike.fields and "rewind_to" not in spike.fields
    s = log.summary()
    assert (s["steps"], s["skipped"], s["rewinds"], s["skips_by_reason"]["spike_loss"]) == (7, 1, 1, 1)
    # written back by this labkit: the event is its own line, after the record that triggered it
    log.to_jsonl(tmp_path / "new.jsonl")
    new = (tmp_path / "new.jsonl").read_text().splitlines()
    assert json.loads(new[5]) == {"event": "rewind", "step": 4, "to": 2, "reason": "spike_loss",
                                  "data_from": None, "data_to": None}
    again = StepLog.read_jsonl(tmp_path / "new.jsonl")
    assert again.rewound == log.rewound and repr(again.summary()) == repr(s)
