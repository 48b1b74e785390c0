"""run_experiment: a pure function of its config, equal to the hand-written TrainStep loop."""

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

import labkit
from labkit.faults import Faults
from labkit.lab.experiment import ExperimentConfig, default_device, run_experiment
from labkit.triage import Triage


def quiet(config, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", labkit.LabkitWarning)
        return run_experiment(config, **kwargs)


def dicts(log):
    return [json.dumps(r.to_dict(), sort_keys=True) for r in log]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_run_experiment_is_the_hand_written_trainstep_loop(precision):
    config = ExperimentConfig(precision=precision, steps=40, init_scale=2.0**12, growth_interval=7,
                              faults=["5:nan", "9:spike:100", "20-22:overflow"], lr=0.03, seed=3)
    task = labkit.ToyTask(seed=3)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    scaler = labkit.GradScaler("cpu", init_scale=2.0**12, growth_interval=7, enabled=precision == "fp16")
    step = labkit.TrainStep(model, opt, task.loss_fn, precision=precision, max_norm=1.0, scaler=scaler,
                            hooks=[Triage(), Faults(labkit.FaultSchedule.parse(config.faults))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", labkit.LabkitWarning)
        for i in range(40):
            step(*task.batch(i))
    assert dicts(quiet(config)) == dicts(step.log)
    assert step.log[5].reason == "nonfinite_input"  # the lab triages a non-finite loss


def test_equal_configs_give_equal_logs_and_on_record_sees_every_record_in_order():
    config = ExperimentConfig(steps=30, faults=["10:inf", "12-13:overflow"])
    seen = []
    first = quiet(config, on_record=seen.append)
    assert seen == list(first) and [r.step for r in seen] == list(range(30))
    assert dicts(quiet(config)) == dicts(first)
    assert first.skipped_steps == [10, 12, 13]


def test_settings_reach_the_run():
    log = quiet(
        ExperimentConfig(precision="fp16", steps=12, init_scale=256.0, growth_interval=4, max_norm=None)
    )
    assert log[0].scale == 256.0 and log[3].next_scale == 512.0 and log[7].next_scale == 1024.0
    assert not any(log.column("clipped"))
    clipped = quiet(ExperimentConfig(precision="fp32", steps=5, max_norm=0.01))
    assert clipped.clipped_steps == [0, 1, 2, 3, 4]
    assert set(quiet(ExperimentConfig(precision="fp32", steps=3)).column("scale")) == {1.0}
    adam = quiet(ExperimentConfig(precision="fp32", steps=5, optimizer="adam", lr=1e-3))
    sgd = quiet(ExperimentConfig(precision="fp32", steps=5, lr=1e-3))
    assert adam[0].loss == sgd[0].loss and adam[4].loss != sgd[4].loss
    other_seed = quiet(ExperimentConfig(precision="fp32", steps=2, seed=1))
    assert other_seed[0].loss != sgd[0].loss


def test_fp16_without_a_scaler_keeps_scale_one_and_loses_small_gradients():
    small = ExperimentConfig(precision="fp16", steps=60, optimizer="adam", lr=3e-3, loss_weight=1e-5,
                             max_norm=None, init_scale=2.0**16)
    no_scaler = quiet(dataclasses.replace(small, loss_scaling=False))
    scaled = quiet(small)
    fp32 = quiet(dataclasses.replace(small, precision="fp32"))
    assert set(no_scaler.column("scale")) == {1.0} and scaled[0].scale == 2.0**16
    # same data, same start: the first loss is the same; then the unscaled fp16 run falls behind
    assert no_scaler[0].loss == pytest.approx(fp32[0].loss, rel=1e-2)
    assert no_scaler[-1].loss > 1.5 * fp32[-1].loss
    assert scaled[-1].loss == pytest.approx(fp32[-1].loss, rel=0.2)


def test_loss_weight_multiplies_the_loss():
    base = quiet(ExperimentConfig(precision="fp32", steps=1))
    weighted = quiet(ExperimentConfig(precision="fp32", steps=1, loss_weight=1e-3))
    assert weighted[0].loss == pytest.approx(base[0].loss * 1e-3, rel=1e-6)
    assert weighted[0].grad_norm == pytest.approx(base[0].grad_norm * 1e-3, rel=1e-4)


def test_cosine_schedule_does_not_advance_on_skipped_steps():
    log = quiet(ExperimentConfig(precision="fp32", steps=30, scheduler="cosine", faults=["10-14:nan"]))
    lrs = log.column("lr")
    assert lrs[0] == 0.05 and len(set(lrs[10:16])) == 1 and lrs[16] < lrs[15]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 30)
    expected = []
    for _ in range(25):
        expected.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert [r.lr for r in log if not r.skipped] == expected


def test_log_path_streams_the_records(tmp_path):
    path = tmp_path / "run.jsonl"
    log = quiet(ExperimentConfig(precision="fp32", steps=6, faults=["2:nan"]), log_path=path)
    assert dicts(labkit.StepLog.read_jsonl(path)) == dicts(log)


def test_device_none_means_the_gpu_when_there_is_one(monkeypatch):
    assert ExperimentConfig().resolved_device() == torch.device(default_device())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda" and ExperimentConfig().resolved_device() == torch.device("cuda")
    assert ExperimentConfig(device="cpu").resolved_device() == torch.device("cpu")


def test_faults_are_frozen_into_a_tuple():
    specs = ["3:nan"]
    config = ExperimentConfig(faults=specs)
    specs.append("4:inf")
    assert config.faults == ("3:nan",) and hash(config) == hash(ExperimentConfig(faults=("3:nan",)))


@pytest.mark.parametrize("changes, message", [
    ({"precision": "fp8"}, "precision must be one of"),
    ({"max_norm": 0}, "max_norm must be a number > 0 or None"),
    ({"max_norm": math.nan}, "max_norm must be a number > 0 or None"),
    ({"max_norm": "big"}, "max_norm must be a number > 0 or None"),
    ({"init_scale": 0.0}, "init_scale must be a finite number > 0"),
    ({"init_scale": math.inf}, "init_scale must be a finite number > 0"),
    ({"init_scale": 1e39}, "init_scale must be at most 3.403e\\+38"),
    ({"growth_interval": 0}, "growth_interval must be an int >= 1"),
    ({"growth_interval": 2.5}, "growth_interval must be an int >= 1"),
    ({"steps": True}, "steps must be an int >= 1"),
    ({"lr": -1.0}, "lr must be a finite number > 0"),
    ({"loss_weight": 0.0}, "loss_weight must be a finite number > 0"),
    ({"optimizer": "lion"}, "optimizer must be one of"),
    ({"scheduler": "step"}, "scheduler must be one of"),
    ({"faults": ["60:spik"]}, "bad fault spec"),
    ({"device": "gpu0"}, "device must be None"),
    ({"parallel": "zero3"}, "parallel must be one of"),
    ({"fault_rank": -1}, "fault_rank must be None"),
    ({"fault_rank": True}, "fault_rank must be None"),
])
def test_bad_settings_fail_with_a_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        ExperimentConfig(**changes)


def test_one_string_of_faults_is_refused():
    with pytest.raises(TypeError, match=r"a list of specs, e.g. \['60:nan'\]"):
        ExperimentConfig(faults="60:nan")


def test_a_cpu_run_trains_on_one_thread_and_puts_the_setting_back():
    # the toy model's matmuls are too small to split; two threads spin-wait on a busy 2-core CPU
    before, seen = torch.get_num_threads(), []
    run_experiment(ExperimentConfig(precision="fp32", steps=3, device="cpu"),
                   lambda record: seen.append(torch.get_num_threads()))
    assert seen == [1, 1, 1] and torch.get_num_threads() == before


def test_the_quickstart_run_shows_the_scale_back_off_and_grow_back():
    # 00_quickstart's text promises it; its first code cell, as committed, must show it
    cells = json.loads(
        (Path(__file__).parent.parent / "notebooks" / "00_quickstart.ipynb").read_text()
    )["cells"]
    source = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    namespace: dict = {}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec("\n".join(line for line in source.splitlines() if not line.startswith("%")), namespace)
    finally:
        torch.set_num_threads(before)
    log = namespace["step"].log
    assert log.skipped_steps == [120, 200, 201, 202, 203, 204]
    low = log[204].next_scale
    assert low == log[200].scale / 2**5  # backed off once per overflow
    grown = [r.step for r in log[205:] if r.next_scale > r.scale]
    assert grown and log[-1].next_scale > low, "the scale never grew back after the episode"
