"""The log's promises, read back (issue 37: the mutants that survived the suite).

A log written to JSONL reads back as the live log (records and rewind events in place, also when a
``window`` dropped the oldest records); a column reads a declared field's default where a record
lacks it and None for an undeclared one; the CSV writes per-layer fields, ``top_grads`` and ``lrs``
as ``name=value;...``. Also llm.c's z fragment at exactly its cap, and a clipper resumed from its
state that does not report its old lock-in releases again.
"""

from __future__ import annotations

import csv
import json
import math

import torch

from labkit.clippers import AdaGC, ZClip
from labkit.records import RewindEvent, StepRecord
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
