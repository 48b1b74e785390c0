"""The spike detector and rewind-and-skip, through TrainStep on the toy task."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import StepLog, ToyTask, TrainStep
from labkit.alarms import ClipAlarm, LabkitWarning
from labkit.clippers import ZClip
from labkit.records import RewindEvent
from labkit.rewind import Rewind
from labkit.spikes import SpikeDetector, format_z, rolling_z, spike_score

SPIKE_AT, STEPS = 30, 48


@settings(max_examples=15, deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=0, max_size=30), st.floats(-100, 100))
def test_rolling_z_matches_numpy(window, x):
    z = rolling_z(window, x, min_count=2)
    if len(window) < 2:
        assert math.isnan(z)
    elif np.std(window) > 1e-9 * max(1.0, np.max(np.abs(window))):
        assert z == pytest.approx((x - np.mean(window)) / np.std(window), rel=1e-6, abs=1e-6)


def test_nonfinite_values_never_enter_the_window():
    det = SpikeDetector(window=8)
    for i in range(8):
        det.observe(1.0 + 0.1 * (i % 2), 2.0, admitted=True)
    before = det.state_dict()
    det.observe(math.nan, 2.0, admitted=True)
    det.observe(1.0, math.inf, admitted=True)
    det.observe(50.0, 2.0, admitted=False)  # a step it skipped
    assert det.state_dict() == before
    assert det.score(math.nan, 2.0)[0] != det.score(math.nan, 2.0)[0]  # NaN z for a NaN loss, not a crash
    assert det.score(50.0, 2.0)[0] > 6  # and it still fires afterwards (llm.c's never does again)


def test_spike_score_is_olmo2s_percent_beyond_7_sigma():
    rng = np.random.default_rng(0)
    values = (1.0 + 0.01 * rng.standard_normal(300)).tolist()
    values[150] = values[250] = 5.0
    assert spike_score(values) == pytest.approx(100 * 2 / 300)
    assert spike_score(values[:100]) == 0.0


def test_format_z_is_llmcs():
    assert format_z("loss", 3.214, 0.53) == "loss 3.21 (+0.5z)"


def data(task, index, spike_at=SPIKE_AT, rank_slice=None):
    """The toy batch at ``index``; the one at ``spike_at`` has inputs x1000 (a bad batch in the data)."""
    x, y = task.batch(index)
    if index == spike_at:
        x = x * 1000.0
    return x, y


def detector_of(step):
    [detector] = [h for h in step.hooks.members if isinstance(h, SpikeDetector)]
    return detector


def make(task, rewind=None, detector=True):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    return TrainStep(model, opt, task.loss_fn, precision="fp32", clipper=ZClip(warmup=5), scheduler=sched,
                     hooks=[*[h for h in (SpikeDetector(window=16, skip_z=6.0) if detector else None, rewind)
                              if h], ClipAlarm(None)])


def test_a_spike_is_detected_at_the_step_it_happens():
    task = ToyTask()
    step = make(task)
    records = [step(*data(task, i)) for i in range(SPIKE_AT + 2)]
    assert [r.step for r in records if r.skipped] == [SPIKE_AT]
    spike = records[SPIKE_AT]
    assert spike.reason in ("spike_loss", "spike_grad") and max(spike.z_loss, spike.z_grad) > 6
    assert all(math.isnan(r.z_grad) for r in records[:8])  # window // 2 values before it speaks
    assert all(math.isfinite(r.z_grad) and abs(r.z_grad) < 6 for r in records[8:SPIKE_AT])
    assert step.log.summary()["skips_by_reason"][spike.reason] == 1


def test_rewound_run_equals_a_run_that_never_saw_the_skipped_window():
    task, back, skip = ToyTask(), 8, 12
    rewind = Rewind(back=back, skip=skip, every=4)
    step = make(task, rewind)
    while step.step_count < STEPS:
        step(*data(task, rewind.data_index(step.step_count)))
    # the oracle: no detector action needed, it simply never sees batches 20..31
    restart = 20  # the newest snapshot that undoes at least `back` steps (24 would undo 24..30: 7); every 4
    oracle = make(task)
    for i in range(STEPS):
        oracle(*data(task, i if i < restart else i + skip))
    assert rewind.rewinds == [(SPIKE_AT, restart)]
    for (n, a), b in zip(step.model.state_dict().items(), oracle.model.state_dict().values()):
        assert torch.equal(a, b), n
    assert repr(step.optimizer.state_dict()) == repr(oracle.optimizer.state_dict())
    assert step.scheduler.state_dict() == oracle.scheduler.state_dict()
    assert step.scaler.state_dict() == oracle.scaler.state_dict()
    for k, v in step.clipper.state_dict().items():
        assert torch.equal(v, oracle.clipper.state_dict()[k]), k
    assert detector_of(step).state_dict() == detector_of(oracle).state_dict()
    # the records tell the truth: the undone steps are kept as written, a rewind event after them, and the
    # step numbers repeat
    log = step.log
    assert len(log) == STEPS + (SPIKE_AT + 1 - restart)
    assert log.rewound_steps == list(range(restart, SPIKE_AT + 1))
    assert log.rewinds == [RewindEvent(SPIKE_AT, restart, log[SPIKE_AT].reason, restart, restart + skip)]
    assert log[SPIKE_AT].reason.startswith("spike")
    kept = log.kept()
    assert [r.step for r in kept] == list(range(STEPS))
    assert [r.loss for r in kept] == [r.loss for r in oracle.log]
    assert log.summary()["rewinds"] == 1
    # a rewind does not rewind the summary: the undone steps stay counted
    assert log.summary()["steps"] == len(log)



def test_rewind_with_skip_0_redoes_the_steps_on_the_same_batches():
    """skip=0 is a valid setting: rewind and replay the same data (a transient fault, not a bad batch), so
    the steps kept are the ones a run that never rewound takes."""
    task = ToyTask()
    fired = []

    def once(record):  # fires at step 12, once, whatever the record says
        if record.step == 12 and not fired:
            fired.append(record.step)
            return True
        return False

    rewind = Rewind(back=4, skip=0, every=4, trigger=once)
    step = make(task, rewind, detector=False)
    while step.step_count < 20:
        step(*data(task, rewind.data_index(step.step_count), spike_at=None))
    oracle = make(task, detector=False)
    for i in range(20):
        oracle(*data(task, i, spike_at=None))
    assert rewind.rewinds == [(12, 8)] and rewind.data_index(15) == 15
    assert step.log.rewinds == [RewindEvent(12, 8, None, 8, 8)]  # no data skipped
    kept = step.log.kept()
    assert [r.step for r in kept] == list(range(20))
    assert [r.loss for r in kept] == [r.loss for r in oracle.log]

def test_rewind_refuses_bad_settings():
    with pytest.raises(ValueError, match="every must be"):
        Rewind(back=4, every=8)
    with pytest.raises(ValueError, match="skip_z"):
        SpikeDetector(skip_z=3.0, clip_z=4.0)


def test_detector_can_clip_instead_of_skip():
    task = ToyTask()
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, max_norm=None,
                     hooks=[SpikeDetector(window=16, skip_z=None, clip_z=4.0), ClipAlarm(None)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(SPIKE_AT):
            step(*data(task, i))
        limit = detector_of(step).clip_limit()
        spike = step(*data(task, SPIKE_AT))
    assert not spike.skipped and spike.clipped and spike.clip_reason == "z_grad" and spike.z_grad > 4
    assert spike.grad_norm * spike.clip_coef == pytest.approx(limit, rel=1e-3)
    # the window admits the clipped norm
    assert max(detector_of(step).norms) == pytest.approx(limit, rel=1e-3)


def test_format_z_caps_what_it_prints_beyond_a_hundred_sigma():
    assert format_z("loss", 881.0, 278543.1) == "loss 881 (>+100z)"
    assert format_z("norm", 0.01, -1e9) == "norm 0.01 (<-100z)"
    assert format_z("norm", 2.0, math.inf) == "norm 2 (>+100z)"
    assert (
        format_z("loss", 3.0, 99.94) == "loss 3 (+99.9z)"
        and format_z("loss", 3.0, 7.5, cap=5) == "loss 3 (>+5z)"
    )


# ---------------------------------------------------------------- a rewind is an event; it moves the data on


def test_a_rewind_is_an_event_so_the_log_read_back_from_its_file_says_what_the_live_one_says(tmp_path):
    """Issue 33's run: 20 steps with log_path, Rewind(back=3, skip=2), a detector and a spike at step 12. The
    rewind undoes steps 9-12; the file (appended as the run went, never edited) gives the same rewound steps,
    events, records and summary. The spike is in the data (index 12), so the run replays past it."""
    task, path = ToyTask(), tmp_path / "log.jsonl"
    with pytest.warns(LabkitWarning, match="skip shorter than the steps undone"):
        rewind = Rewind(back=3, skip=2)
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, log=path,
                     hooks=[SpikeDetector(window=8, skip_z=6.0), rewind, ClipAlarm(None)])
    fed = []
    while step.step_count < 20:
        fed.append(rewind.data_index(step.step_count))
        step(*data(task, fed[-1], spike_at=12))
    step.log.close()
    live = step.log
    assert rewind.rewinds == [(12, 9)] and live.rewinds == [RewindEvent(12, 9, live[12].reason, 9, 13)]
    assert live[12].reason.startswith("spike") and fed == [*range(13), *range(13, 24)]  # 9.. is fed 13..
    assert live.rewound_steps == [9, 10, 11, 12] and [r.step for r in live.kept()] == list(range(20))
    back = StepLog.read_jsonl(path)
    assert back.rewound_steps == live.rewound_steps and back.rewinds == live.rewinds
    assert [r.to_dict() for r in back] == [r.to_dict() for r in live] or \
        [repr(sorted(r.to_dict().items())) for r in back] == [repr(sorted(r.to_dict().items())) for r in live]
    assert repr(back.summary()) == repr(live.summary()) and back.summary()["rewinds"] == 1
    assert path.read_text().count('"event": "rewind"') == 1


def test_a_rewind_moves_past_the_bad_batch_once_and_the_loss_recovers():
    """Issue 34's run: Rewind(back=20, skip=10) and a garbage batch at data index 100. Before, each rewind
    returned to step 80 with data offset 10, met index 100 again at step 90 and rewound 10 times. Now the
    rewind skips the window from the snapshot to the spike: one rewind, index 100 never fed again."""
    task = ToyTask()
    with pytest.warns(LabkitWarning, match="Rewind\\(back=20, skip=10\\)"):
        rewind = Rewind(back=20, skip=10)
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                     hooks=[SpikeDetector(), rewind, ClipAlarm(None)])
    fed, losses = [], {}
    while step.step_count < 140:
        fed.append(rewind.data_index(step.step_count))
        record = step(*data(task, fed[-1], spike_at=100))
        losses[fed[-1]] = record.loss
    assert rewind.rewinds == [(100, 80)] and len(step.log.rewinds) == 1
    assert (step.log.rewinds[0].data_from, step.log.rewinds[0].data_to) == (80, 101)
    assert fed.count(100) == 1 and fed[-1] == 160 and fed[101:] == list(range(101, 161))
    before = sum(losses[i] for i in range(90, 100)) / 10
    after = [r.loss for r in step.log.kept()[-10:]]
    assert losses[100] > 100 * before and max(after) < 1.5 * before  # the spike, then the loss as it was


def test_repeated_rewinds_add_up_their_skips_and_running_out_says_which_steps():
    task = ToyTask()
    model = task.model()
    # a trigger that fires at these steps, each once (a replayed step does not fire again)
    asks = [10, 12, 14]

    def trigger(record):
        if asks and record.step == asks[0]:
            asks.pop(0)
            return True
        return False

    rewind = Rewind(back=4, skip=4, every=4, max_rewinds=2, trigger=trigger)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                     hooks=[rewind, ClipAlarm(None)])
    with pytest.warns(LabkitWarning, match=r"step 14 asked for a rewind .* max_rewinds=2 were made \(steps "
                                           r"10->4, 12->8\); the run goes on without rewinding"):
        while step.step_count < 16:
            step(*task.batch(rewind.data_index(step.step_count)))
    # 10 -> 4: step 4 is fed batch 11 (past the 10th, farther than skip=4 would); 12 -> 8: step 8 had been fed
    # batch 15 and step 12 batch 19, so step 8 is now fed batch 20: the second skip adds to the first
    assert rewind.rewinds == [(10, 4), (12, 8)]
    assert [(e.data_from, e.data_to) for e in step.log.rewinds] == [(4, 11), (15, 20)]
    assert rewind.data_index(8) == 20


def test_rewind_refuses_a_bad_skip_saying_what_it_means():
    with pytest.raises(ValueError, match="skip"):
        Rewind(back=4, skip=-1)
    with warnings.catch_warnings():
        # skip >= back, and skip=0 (replay), are the two settings that say nothing
        warnings.simplefilter("error")
        Rewind(back=4, skip=4)
        Rewind(back=4, skip=0)
