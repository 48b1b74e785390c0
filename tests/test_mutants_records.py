"""The log's promises, read back (issue 37: the mutants that survived the suite).

A log written to JSONL reads back as the live log (records and rewind events in place, also when a
``window`` dropped the oldest records); a column reads a declared field's default where a record
lacks it and None for an undeclared one; the CSV writes per-layer fields, ``top_grads`` and ``lrs``
as ``name=value;...``. Also llm.c's z fragment at exactly its cap, and a clipper resumed from its
state that does not report its old lock-in releases again.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import shutil
import sys
import warnings

import pytest
import torch

from labkit import LogWriteError
from labkit.alarms import LabkitWarning
from labkit.clippers import AGC, AdaGC, AutoClip, NormClip, ValueClip, ZClip
from labkit.clippers.agc import unitwise_norm
from labkit.logfile import MAX_LINE, JsonlFile
from labkit.records import Field, RewindEvent, StepRecord, declare, declared, parse_line, put
from labkit.spikes import format_z
from labkit.steplog import StepLog


def records(n, **fields):
    return [StepRecord(i, 1.0 + i, grad_norm=2.0, **fields) for i in range(n)]


def test_to_jsonl_reads_back_as_the_live_log(tmp_path):
    log = StepLog()
    for r in records(5):
        log.append(r, [RewindEvent(step=r.step, to=1, reason="spike_grad", data_from=1, data_to=9)]
                   if r.step == 2 else ())
    log.append_event(RewindEvent(step=4, to=3, reason="spike_loss", data_from=3, data_to=7))  # after the last
    log.to_jsonl(tmp_path / "log.jsonl")
    back = StepLog.read_jsonl(tmp_path / "log.jsonl")
    assert [r.step for r in back] == [0, 1, 2, 3, 4]
    assert back.events == log.events and back.events_after() == {2: [log.events[0][1]], 4: [log.events[1][1]]}
    assert back.rewound == log.rewound


def test_a_windowed_log_writes_its_events_after_the_records_that_triggered_them(tmp_path):
    log = StepLog(window=3)
    for r in records(6):
        log.append(r, [RewindEvent(step=4, to=2, reason="spike_grad", data_from=2, data_to=8)]
                   if r.step == 4 else ())
    log.to_jsonl(tmp_path / "log.jsonl")
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    kinds = ["event" if "to" in json.loads(line) else "record" for line in lines]
    assert kinds == ["record", "record", "event", "record"]  # records 3, 4, the rewind 4 -> 2, record 5
    assert StepLog.read_jsonl(tmp_path / "log.jsonl").events_after() == {1: [log.events[0][1]]}


def test_a_column_reads_a_declared_fields_default_and_none_for_an_undeclared_one():
    with_z = StepRecord(0, 1.0)
    with_z.fields["z_loss"] = 2.5
    old = StepRecord(1, 1.0)
    old.fields["fault"] = "nan"  # a field of an older labkit, declared by nobody here
    log = StepLog([with_z, old, StepRecord(2, 1.0)])
    z = log.column("z_loss")
    assert z[0] == 2.5 and math.isnan(z[1]) and math.isnan(z[2])  # SpikeDetector's default: NaN
    assert log.column("fault") == [None, "nan", None]
    assert log.column("loss") == [1.0, 1.0, 1.0]


def test_to_csv_writes_per_layer_fields_top_grads_and_lrs_as_name_value_lists(tmp_path):
    r = StepRecord(0, 0.5, lr=0.1, lrs=[0.1, 0.025])
    r.fields["top_grads"] = [("h.0.w", 3.25), ("h.1.w", 1.0)]
    r.fields["fault"] = {"h.0": 1.5, "h.1": 2.0}
    StepLog([r]).to_csv(tmp_path / "log.csv")
    with open(tmp_path / "log.csv", newline="", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert row["top_grads"] == "h.0.w=3.25;h.1.w=1" and row["fault"] == "h.0=1.5;h.1=2"
    assert row["lrs"] == "0.1;0.025" and row["loss"] == "0.5" and row["rewound"] == "False"


def test_format_z_at_exactly_its_cap_still_prints_the_number():
    """Beyond the cap the fragment says '>+cap'; at the cap it is still a number."""
    assert format_z("loss", 2.0, 100.0) == "loss 2 (+100.0z)"
    assert format_z("loss", 2.0, -100.0) == "loss 2 (-100.0z)"
    assert format_z("loss", 2.0, 0.7, cap=0.5) == "loss 2 (>+0.5z)"
    assert format_z("loss", 2.0, -0.7, cap=0.5) == "loss 2 (<-0.5z)"


def shifted(clipper, steps=120):
    for i in range(steps):
        p = torch.zeros(1, requires_grad=True)
        p.grad = torch.tensor([1.0 if i < steps // 3 else 6.0])
        clipper.clip_([p])


def test_a_resumed_clipper_does_not_report_the_lockins_before_its_checkpoint():
    for make in (lambda: AdaGC(warmup=5, max_consecutive_clips=10),
                 lambda: ZClip(warmup=5, max_consecutive_clips=10)):
        clipper = make()
        shifted(clipper)
        assert clipper.releases() >= 1
        resumed = make()
        resumed.load_state_dict(clipper.state_dict())
        assert resumed.releases() == clipper.releases()
        assert resumed.lockin() is False  # reported before the checkpoint; nothing fired since


# ---------------------------------------------------------------- records: declare, to_dict, ==, repr


def test_a_field_declared_at_run_time_is_listed_read_as_its_default_and_set_by_put():
    """declare registers a field: declared() lists it, a record reads its default, put sets it."""
    declare("MrecTest", {"mrec_hits": Field(7), "mrec_layers": Field({}, per_layer=True)})
    assert declared()["mrec_hits"] == Field(7) and declared()["mrec_layers"] == Field({}, per_layer=True)
    r = StepRecord(0, 1.0)
    assert (r.mrec_hits, r.mrec_layers) == (7, {})
    put(r.fields, "mrec_layers/h.0", 2.5)
    put(r.fields, "mrec_hits", 8)
    assert (r.mrec_hits, r.mrec_layers) == (8, {"h.0": 2.5})
    declare("MrecTest", {"mrec_hits": Field(7)})  # the same again is harmless; another default is refused
    with pytest.raises(ValueError, match="MrecTest declares otherwise"):
        declare("Other", {"mrec_hits": Field(0)})


@pytest.mark.parametrize("name", ["mrec-dash", "2mrec", "mrec dot", "mrec/x"])
def test_a_field_name_is_a_python_name(name):
    """declare refuses a name that is no Python identifier: a record reads its fields as attributes."""
    with pytest.raises(ValueError, match="a field is a Python name"):
        declare("MrecTest", {name: Field(0)})
    assert name not in declared()


def test_to_dict_is_a_copy_changing_it_leaves_the_record_as_built():
    """to_dict returns a copy at every depth: the record's lists and per-layer dicts are not shared."""
    r = StepRecord(0, 1.0, lrs=[0.1], stale={"h.0": 0.5}, top_grads=[("w", 1.0)])
    d = r.to_dict()
    d["lrs"].append(9.0)
    d["stale"]["h.0"] = 9.0
    d["top_grads"].clear()
    assert r.lrs == [0.1] and r.stale == {"h.0": 0.5} and r.top_grads == [("w", 1.0)]


def test_records_are_equal_when_their_core_and_fields_are():
    """== compares the core and the fields; a JSON round trip is equal; a non-record is unequal."""
    a = StepRecord(3, 0.5, grad_norm=2.0, lrs=[0.1], z_loss=1.0)
    assert a == StepRecord(3, 0.5, grad_norm=2.0, lrs=[0.1], z_loss=1.0)
    assert a == StepRecord.from_dict(json.loads(a.to_json()))
    assert a != StepRecord(3, 0.5, grad_norm=2.0, lrs=[0.1], z_loss=1.5)
    assert a != StepRecord(3, 0.5, grad_norm=2.5, lrs=[0.1], z_loss=1.0)
    assert a != StepRecord(3, 0.5, grad_norm=2.0, lrs=[0.1])
    assert (a == "a record") is False and a != 3


def test_a_records_repr_names_every_core_number_and_builds_the_same_record():
    """repr(record) is the constructor call: evaluated, it gives an equal record."""
    r = StepRecord(2, 0.5, grad_norm=3.0, clip_coef=0.25, clipped=True, scale=8.0, next_scale=16.0,
                   skipped=False, reason="r", lr=0.1, lrs=[0.1, 0.2], z_loss=1.5)
    text = repr(r)
    assert text.startswith("StepRecord(step=2, loss=0.5, grad_norm=3.0, clip_coef=0.25, clipped=True, ")
    assert eval(text, {"StepRecord": StepRecord}) == r


# ---------------------------------------------------------------- steplog: state, flush, column, to_jsonl


def test_a_summary_state_is_a_snapshot_later_steps_do_not_change_it():
    """state_dict is the totals at that step: skips appended after it do not leak into a checkpoint."""
    log = StepLog([StepRecord(0, 1.0), StepRecord(1, math.nan, skipped=True, reason="nonfinite_loss")])
    state = log.state_dict()
    for i in range(2, 5):
        log.append(StepRecord(i, math.nan, skipped=True, reason="nonfinite_loss"))
    assert state["reasons"] == {"nonfinite_loss": 1} and state["steps"] == 2
    resumed = StepLog()
    resumed.load_state_dict(state)
    assert resumed.summary()["skips_by_reason"]["nonfinite_loss"] == 1 and resumed.summary()["steps"] == 2


def test_flush_of_a_log_without_a_file_does_nothing():
    """flush writes a file's pending lines; a log with no file has none, and flush is a no-op."""
    log = StepLog([StepRecord(0, 1.0)])
    log.flush()
    assert len(log) == 1


def test_a_column_of_a_field_nobody_declared_reads_none_where_a_record_lacks_it():
    """column of an undeclared field (a newer labkit's) gives its values, None where a record has none."""
    a, b = StepRecord(0, 1.0, mrec_from_the_future=3), StepRecord(1, 2.0)
    log = StepLog([a, b, StepRecord(2, 3.0, mrec_from_the_future=5)])
    assert "mrec_from_the_future" not in declared()
    assert log.column("mrec_from_the_future") == [3, None, 5]
    assert log.column("loss") == [1.0, 2.0, 3.0] and log.column("step") == [0, 1, 2]


def test_to_jsonl_writes_every_event_after_the_last_record(tmp_path):
    """Events appended after the last record are all written, in order, and read back."""
    log = StepLog(records(3))
    events = [RewindEvent(step=2, to=1, reason="spike_grad"), RewindEvent(step=2, to=0, reason="spike_loss"),
              RewindEvent(step=2, to=2)]
    for e in events:
        log.append_event(e)
    log.to_jsonl(tmp_path / "log.jsonl")
    back = StepLog.read_jsonl(tmp_path / "log.jsonl")
    assert back.rewinds == events and back.events == log.events


# ---------------------------------------------------------------- the log file: marks, resumes, stdout


def steps_in(path):
    return [json.loads(line)["step"] for line in open(path, encoding="utf-8") if line.strip()]


def test_a_checkpoint_marks_only_a_file_with_lines_and_counts_the_lines_still_pending(tmp_path, monkeypatch):
    """state_dict's 'stream': none for a stream or a file with no line yet; after a failed write, the size the
    file has once its pending lines are written (a resume from it cuts nothing)."""
    null = StepLog(stream=os.devnull)
    null.append(StepRecord(0, 1.0))
    assert "stream" not in null.state_dict()
    path = tmp_path / "log.jsonl"
    log = StepLog(stream=path)
    assert "stream" not in log.state_dict()
    log.append(StepRecord(0, 1.0))
    real = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    for i in (1, 2):
        with pytest.raises(LogWriteError):
            log.append(StepRecord(i, 1.0))
    state = log.state_dict()
    monkeypatch.setattr(os, "write", real)
    log.close()
    assert steps_in(path) == [0, 1, 2] and state["stream"]["size"] == os.path.getsize(path)
    resumed = StepLog(stream=path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
        resumed.append(StepRecord(3, 1.0))
    resumed.close()
    assert steps_in(path) == [0, 1, 2, 3]


def test_a_file_this_run_has_written_is_never_cut_by_a_resume(tmp_path):
    """JsonlFile.resume continues only a file this run has not written to: a late resume cuts nothing."""
    path = str(tmp_path / "log.jsonl")
    f = JsonlFile(path)
    f.write(StepRecord(0, 1.0))
    mark = f.mark()
    f.write(StepRecord(1, 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f.resume(mark)
    f.write(StepRecord(2, 1.0))
    f.close()
    assert steps_in(path) == [0, 1, 2]


def test_a_closed_log_resumes_nothing(tmp_path):
    """load_state_dict on a log whose file is closed carries the summary and leaves the file as it is."""
    path = tmp_path / "log.jsonl"
    log = StepLog(stream=path)
    log.append(StepRecord(0, 1.0))
    state = log.state_dict()
    log.append(StepRecord(1, 1.0))
    log.close()
    again = StepLog(stream=path)
    again.close()
    again.load_state_dict(state)
    assert steps_in(path) == [0, 1] and again.summary()["steps"] == 1


def test_a_log_whose_path_names_another_file_now_is_not_continued_through_the_old_one(tmp_path):
    """A resume checks that the path still names the file it opened: replaced (same bytes), it is another
    run's file, moved aside at the first record, which goes to the path."""
    path = tmp_path / "log.jsonl"
    log = StepLog(stream=path)
    for i in range(2):
        log.append(StepRecord(i, 1.0))
    state = log.state_dict()
    log.close()
    again = StepLog(stream=path)
    shutil.copyfile(path, tmp_path / "copy")
    os.replace(tmp_path / "copy", path)
    with pytest.warns(LabkitWarning, match="not the checkpoint's last record"):
        again.load_state_dict(state)
    with pytest.warns(LabkitWarning, match="holds the records of another run"):
        again.append(StepRecord(2, 1.0))
    again.close()
    assert steps_in(path) == [2] and steps_in(f"{path}.1") == [0, 1]


def test_a_checkpoints_last_line_up_to_max_line_resumes_and_a_longer_one_is_no_record(tmp_path):
    """MAX_LINE bounds what a resume reads: a last line of exactly MAX_LINE bytes (after another line) is
    read and resumed; one byte more is no record: the file is left as another run's."""
    def big(step, n):  # a record whose line, newline included, is n bytes
        return StepRecord(step, 1.0, pad="x" * (n - len(StepRecord(step, 1.0, pad="").to_json()) - 1))

    for n, resumes in ((MAX_LINE, True), (MAX_LINE + 1, False)):
        path = tmp_path / f"log{n}.jsonl"
        log = StepLog(stream=path)
        log.append(StepRecord(0, 1.0))
        log.append(big(1, n))
        state = log.state_dict()
        log.append(StepRecord(2, 1.0))
        log.close()
        tail = len(StepRecord(2, 1.0).to_json()) + 1
        assert os.path.getsize(path) == state["stream"]["size"] + tail
        with pytest.warns(LabkitWarning, match="cut 1 records" if resumes else "not the checkpoint's last"):
            StepLog(stream=path).load_state_dict(state)
        assert os.path.getsize(path) - state["stream"]["size"] == (0 if resumes else tail)


class BadStdout:
    def __init__(self, error):
        self.error = error

    def write(self, text):
        return len(text)

    def flush(self):
        raise self.error


@pytest.mark.parametrize("replaced", [object(), "closed", BadStdout(BrokenPipeError(errno.EPIPE, "pipe"))],
                         ids=["no-flush", "closed", "flush-fails"])
def test_a_log_to_stdout_writes_its_lines_whatever_sys_stdout_was_replaced_by(replaced, monkeypatch, capfd):
    """Before a line to stdout labkit flushes print()'s buffer; a sys.stdout without flush, closed, or whose
    flush fails, has nothing to order against: the records are still written."""
    if replaced == "closed":
        replaced = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (closed at once)
        replaced.close()
    log = StepLog(stream="/dev/stdout")
    monkeypatch.setattr(sys, "stdout", replaced)
    for i in range(2):
        log.append(StepRecord(i, 1.0))
    log.close()
    monkeypatch.undo()
    assert capfd.readouterr().out.splitlines() == [StepRecord(i, 1.0).to_json() for i in range(2)]


# ---------------------------------------------------------------- clippers: repr, releases, resume, stages


@pytest.mark.parametrize("clip, text", [
    (NormClip(1.0), "NormClip(max_norm=1)"),
    (NormClip(0.5, norm_type=math.inf), "NormClip(max_norm=0.5, norm_type=inf)"),
    (NormClip(2.0, norm_type=3.0), "NormClip(max_norm=2, norm_type=3)"),
])
def test_normclip_repr_is_its_constructor_call(clip, text):
    """repr(NormClip) names max_norm, and norm_type unless it is 2: evaluated, the same clipper."""
    assert repr(clip) == text
    back = eval(text, {"NormClip": NormClip, "inf": math.inf})
    assert (back.max_norm, back.norm_type) == (clip.max_norm, clip.norm_type)


@pytest.mark.parametrize("make", [lambda: NormClip(0.1), lambda: ValueClip(0.1), lambda: AGC(0.01)],
                         ids=["NormClip", "ValueClip", "AGC"])
def test_a_clipper_without_a_lockin_guard_never_reports_a_release(make):
    """releases() counts the lock-in guard's restarts: a clipper without one has 0, and check_lockin never
    warns, however many steps in a row it clips."""
    clip = make()
    for _ in range(5):
        w = torch.nn.Parameter(torch.ones(2))
        w.grad = torch.full((2,), 100.0)
        clip.clip_([w])
        assert w.grad.abs().max() < 100.0  # clipped every step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clip.releases() == 0 and clip.check_lockin() is False and clip.lockin() is False


def feed(clip, series):
    out = []
    for g in series:
        w = torch.zeros(2, requires_grad=True)
        w.grad = torch.tensor([g, 0.5 * g])
        clip.clip_([w])
        out.append(w.grad.clone())
    return out


@pytest.mark.parametrize("make", [lambda: ZClip(warmup=3), lambda: AutoClip(history=8)],
                         ids=["ZClip", "AutoClip"])
def test_a_state_saved_in_another_dtype_resumes_in_the_clippers_own(make):
    """load_state_dict casts each tensor to the clipper's own dtype (a checkpoint cast to float64 or int32
    on the way): the resumed run clips bit for bit as the uninterrupted one."""
    series = [1.0, 1.3, 0.8, 1.1, 6.0, 1.2, 0.9, 9.0, 1.0, 1.4]
    whole = make()
    expected = feed(whole, series)
    first = make()
    feed(first, series[:5])
    state = {k: v.double() if v.is_floating_point() else v.int() for k, v in first.state_dict().items()}
    resumed = make()
    resumed.load_state_dict(state)
    dtypes = {k: v.dtype for k, v in make().state_dict().items()}
    assert {k: v.dtype for k, v in resumed.state_dict().items()} == dtypes
    got = feed(resumed, series[5:])
    assert all(torch.equal(a, b) for a, b in zip(got, expected[5:]))


class CappedZClip(ZClip):
    """ZClip with a per-tensor cap on top: a GlobalClipper subclass with its own clip_unscaled_."""

    seen: list

    def clip_unscaled_(self, params, norms, norm):
        self.seen = [norms, norm]
        for p, n in zip(params, norms):
            p.grad.mul_(torch.clamp(2.0 / (n + 1e-6), max=1.0))
        return None


def test_a_global_clippers_own_per_tensor_stage_gets_the_per_tensor_norms_and_the_float32_norm():
    """GlobalClipper.clip_with_norms_ runs Clipper's stages with the per-tensor norms and the global norm as
    float32 (the clippers' state dtype), whatever the gradients' dtype."""
    a = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    clip = CappedZClip(warmup=5)
    norm = clip.clip_([a, b])
    norms, seen = clip.seen
    assert norms.tolist() == [5.0, 1.0]
    assert seen.dtype == torch.float32 and seen.item() == pytest.approx(norm.item())
    assert torch.allclose(a.grad, torch.tensor([1.2, 1.6], dtype=torch.float64))  # cut to 2 by its own stage


@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (2, 3, 4), (3, 2, 2, 2)])
def test_unitwise_norm_is_the_whole_norm_up_to_one_dim_and_each_rows_norm_beyond(shape):
    """NFNets' unit-wise norm (timm's unitwise_norm): a scalar or a vector is one unit; a matrix or a conv
    weight has one unit per output row/filter, its norm kept broadcastable against the tensor (keepdim)."""
    x = torch.arange(1.0, 1.0 + math.prod(shape)).reshape(shape)
    got = unitwise_norm(x)
    if len(shape) <= 1:
        expected = torch.tensor(math.sqrt(sum(v * v for v in x.flatten().tolist())))
    else:
        rows = [math.sqrt(sum(v * v for v in row.flatten().tolist())) for row in x]
        expected = torch.tensor(rows).reshape(shape[0], *[1] * (len(shape) - 1))
    assert got.shape == expected.shape and torch.allclose(got, expected)


def test_a_log_that_cannot_move_another_runs_file_aside_keeps_its_records(tmp_path, monkeypatch):
    """(A bug this found: the next record raised a bare AssertionError.) Another run's file that cannot be
    moved aside is a LogWriteError that changes nothing; once it can be, every record is written, in order."""
    path = tmp_path / "log.jsonl"
    old = StepLog(stream=path)
    old.append(StepRecord(0, 1.0))
    old.close()
    log = StepLog(stream=path)
    real = os.rename

    def refused(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "rename", refused)
    for i in (5, 6):
        with pytest.raises(LogWriteError, match=r"could not move .*another run's log \(steps 0-0\), aside"):
            log.append(StepRecord(i, 1.0))
    assert steps_in(path) == [0] and [r.step for r in log] == [5, 6]
    monkeypatch.setattr(os, "rename", real)
    with pytest.warns(LabkitWarning, match="holds the records of another run"):
        log.flush()
    log.append(StepRecord(7, 1.0))
    log.close()
    assert steps_in(path) == [5, 6, 7] and steps_in(f"{path}.1") == [0]


def test_no_fresh_file_after_the_move_puts_another_runs_log_back_and_retries(tmp_path, monkeypatch):
    """Moved aside but no fresh file opened (out of descriptors): the old file goes back where it was, the
    records stay in memory (a LogWriteError), and the next line moves it again and writes them all."""
    import labkit.logfile

    path = tmp_path / "log.jsonl"
    old = StepLog(stream=path)
    old.append(StepRecord(0, 1.0))
    old.close()
    log = StepLog(stream=path)
    real = labkit.logfile._open_stream

    def no_descriptors(where):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(labkit.logfile, "_open_stream", no_descriptors)
    refused = r"could not move .*another run's log \(steps 0-0\), aside .* afresh"
    with pytest.raises(LogWriteError, match=refused):
        log.append(StepRecord(5, 1.0))
    assert steps_in(path) == [0] and not os.path.exists(f"{path}.1") and [r.step for r in log] == [5]
    monkeypatch.setattr(labkit.logfile, "_open_stream", real)
    with pytest.warns(LabkitWarning, match=r"another run \(steps 0-0\)"):
        log.append(StepRecord(6, 1.0))
    log.close()
    assert steps_in(path) == [5, 6] and steps_in(f"{path}.1") == [0]


@pytest.mark.parametrize("tail", [b"\n", b"\n\n", b" \n\n \n", b"\n" * 70_000])
def test_another_runs_last_step_is_its_last_record_past_blank_lines(tmp_path, tail):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(StepRecord(i, 1.0).to_json().encode() + b"\n" for i in range(4)) + tail[1:])
    log = StepLog(stream=path)
    with pytest.warns(LabkitWarning, match=r"another run \(steps 0-3\)"):
        log.append(StepRecord(0, 1.0))
    log.close()


def test_parse_line_keeps_every_list_a_list_and_the_reason_a_string():
    """parse_line decodes non-finite numbers at any depth, never a reason (a hook's may read "NaN"), and
    turns no list into a tuple (JSON has none)."""
    d = parse_line('{"step": 1, "loss": "NaN", "reason": "NaN", "m": {"t": [["w", "Infinity"]]}, '
                   '"n": [[["w", 1.0]]]}')
    assert d["reason"] == "NaN" and math.isnan(d["loss"])
    assert d["m"] == {"t": [["w", math.inf]]} and d["n"] == [[["w", 1.0]]]


def test_from_dict_reads_name_value_pairs_as_tuples_at_any_depth():
    """StepRecord.from_dict turns each list of [name, value] pairs into tuples, inside dicts and lists too."""
    r = StepRecord.from_dict(json.loads('{"step": 1, "loss": 1.0, "m": {"t": [["w", "NaN"]]}, '
                                        '"n": [[["w", 1.0]]], "top_grads": [["b", 2.0]]}'))
    assert r.m["t"][0][0] == "w" and isinstance(r.m["t"][0], tuple) and math.isnan(r.m["t"][0][1])
    assert r.n == [[("w", 1.0)]] and r.top_grads == [("b", 2.0)]


def test_a_streamed_log_writes_its_events_to_the_file(tmp_path):
    """append_event streams the event after the records before it: the file reads back as the live log."""
    log = StepLog(stream=tmp_path / "log.jsonl")
    for r in records(3):
        log.append(r)
    log.append_event(RewindEvent(step=2, to=1, reason="spike_grad"))
    log.close()
    back = StepLog.read_jsonl(tmp_path / "log.jsonl")
    assert back.events == log.events and back.rewound == [False, True, True]


def test_an_adagc_that_has_not_stepped_has_no_release():
    """A fresh AdaGC (no state) restarted nothing: releases() 0, lockin() and check_lockin() False."""
    clip = AdaGC(max_consecutive_clips=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clip.releases() == 0 and clip.lockin() is False and clip.check_lockin() is False
