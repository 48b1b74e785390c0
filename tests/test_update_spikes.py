"""Lesson 08's runs: the fixed-batch task, the arms, the disk cache, the series, the spike finder, figures."""

import math
import types

import pytest
import torch

from labkit.lab import update_spikes
from labkit.lab.experiment import ExperimentConfig, make_optimizer
from labkit.lab.update_spikes import (
    ARMS,
    Beta2Panel,
    Memorise,
    loss_spikes,
    plot_update_spikes,
    run_monitored,
    update_series,
)
from labkit.optim import StableAdamW, read_update_rms
from labkit.tasks import FixedBatch, GPTTask

TINY = Memorise(steps=8, warmup=2)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(update_spikes.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(update_spikes, "_MEMORY", {})
    return tmp_path


def test_a_fixed_batch_task_trains_on_one_batch_with_the_tasks_model_and_loss():
    task = GPTTask(seed=3)
    fixed = FixedBatch(task, index=2)
    for step in (0, 5, 999):
        assert all(torch.equal(a, b) for a, b in zip(fixed.batch(step), task.batch(2)))
    assert fixed.name == "gpt" and fixed.loss_fn is task.loss_fn
    assert torch.equal(fixed.model().wte.weight, task.model().wte.weight)
    with pytest.raises(TypeError, match="loss_fn"):
        FixedBatch(object())
    with pytest.raises(ValueError, match="index"):
        FixedBatch(task, index=-1)


def test_each_arm_is_its_optimizer_and_clip_and_the_rest_is_shared():
    configs = {arm: Memorise().config(arm, seed=1) for arm in ARMS}
    params = [torch.nn.Parameter(torch.zeros(2))]
    kinds = {arm: type(make_optimizer(c, params)) for arm, c in configs.items()}
    assert kinds == {"AdamW": torch.optim.AdamW, "AdamW+clip(1.0)": torch.optim.AdamW,
                     "StableAdamW": StableAdamW}
    assert [c.max_norm for c in configs.values()] == [None, 1.0, None]
    shared = {(c.lr, c.betas, c.weight_decay, c.warmup, c.scheduler, c.steps, c.task)
              for c in configs.values()}
    assert shared == {(1e-2, (0.9, 0.99), 0.0, 10, None, 1000, FixedBatch(GPTTask(seed=1, measure=False)))}
    assert Memorise(fixed_batch=False).config("AdamW").task == GPTTask(seed=0, measure=False)
    with pytest.raises(ValueError, match="arm must be one of"):
        Memorise().config("SGD")
    with pytest.raises(ValueError, match="beta2"):
        Memorise(beta2=1.0)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        ExperimentConfig(optimizer="lion")


def test_the_series_is_what_a_plain_loop_reads_from_the_optimizer_after_each_step():
    # the oracle: torch's AdamW on the same model and batch, read_update_rms after every step
    task = GPTTask(seed=0, measure=False)
    model = task.model()
    x, y = task.batch(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (t + 1) / 3 if t < 2 else 1.0)
    losses, peaks = [], []
    for _ in range(TINY.steps):
        opt.zero_grad()
        loss = task.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        peaks.append(max(v.item() for v in read_update_rms(opt)))
    s = update_series(run_monitored(TINY, "AdamW", cache=False))
    assert s["step"] == list(range(TINY.steps)) and s["loss"] == losses
    assert s["rms"][:-1] == peaks[:-1] and math.isnan(s["rms"][-1])  # the monitor is one record late
    assert all(p is not None for p in s["peak"][:-1])


def test_a_run_is_kept_on_disk_and_read_back_number_for_number(cache, monkeypatch):
    fresh = run_monitored(TINY, "StableAdamW", seed=1)
    files = list((cache / "lesson08").glob("*.jsonl"))
    assert len(files) == 1 and files[0].name.startswith("StableAdamW-s1-")
    monkeypatch.setattr(update_spikes, "_MEMORY", {})
    again = run_monitored(TINY, "StableAdamW", seed=1)
    assert again is not fresh
    assert repr(update_series(again)) == repr(update_series(fresh))  # every float, NaN included
    assert [r.update_rms for r in again] == [r.update_rms for r in fresh]
    # another machine's path, another arm or another setting is another file
    monkeypatch.setenv("LABKIT_PERTURB", "1")
    run_monitored(TINY, "StableAdamW", seed=1)
    run_monitored(TINY, "AdamW", seed=1)
    assert len(list((cache / "lesson08").glob("*.jsonl"))) == 3


def test_a_damaged_cache_file_is_trained_again(cache, monkeypatch):
    log = run_monitored(TINY, "AdamW")
    [path] = (cache / "lesson08").glob("*.jsonl")
    path.write_text(path.read_text()[: len(path.read_text()) // 3] + "\n{not json\n" + "x" * 10)
    monkeypatch.setattr(update_spikes, "_MEMORY", {})
    again = run_monitored(TINY, "AdamW")
    assert [r.loss for r in again] == [r.loss for r in log] and len(again) == TINY.steps


def fake_log(losses, rms, peak="h.0.ln_1.weight", norm=0.05):
    """Records as the monitor writes them: record t + 1 carries optimizer step t's RMS."""
    out = []
    for t, loss in enumerate(losses):
        prev = t - 1 if t else None
        out.append(types.SimpleNamespace(
            step=t, loss=loss, grad_norm=norm, update_step=prev,
            update_rms_max=rms[prev] if prev is not None else math.nan,
            update_rms_peak=peak if prev is not None else None,
            applied_update_rms=0.1 if prev is not None else math.nan))
    return out


def test_a_spike_is_found_with_the_rms_that_came_before_it():
    losses = [0.02] * 300
    losses[150:153] = [0.05, 1.5, 0.9]  # doubles at 150, peaks at 151
    losses[250] = 0.045  # doubles too, but peaks under 0.5
    rms = [1.0] * 300
    rms[147], rms[149] = 2.5, 6.0
    [spike] = loss_spikes(fake_log(losses, rms), min_peak=0.5)
    assert (spike.onset, spike.peak_step, spike.peak, spike.floor) == (150, 151, 1.5, 0.02)
    assert (spike.rms_before, spike.first_above, spike.tensor, spike.grad_norm_there) == (
        6.0, 149, "h.0.ln_1.weight", 0.05)
    assert [s.onset for s in loss_spikes(fake_log(losses, rms))] == [150, 250]
    assert loss_spikes(fake_log([0.02] * 300, rms)) == []
    quiet = loss_spikes(fake_log(losses, [1.0] * 300), min_peak=0.5)
    assert quiet[0].first_above is None and math.isnan(quiet[0].grad_norm_there)


def test_the_figure_draws_every_arm_on_the_same_steps_with_its_marks():
    log = fake_log([0.5, 0.2, 0.1, 0.05], [1.0, 2.0, 9.0, 1.0])
    fig = plot_update_spikes({"AdamW": {0: log, 1: log}, "StableAdamW": {0: log}}, beta2=0.99)
    assert len(fig.axes) == 8 and [ax.get_title() for ax in fig.axes[:2]] == ["seed 0", "seed 1"]
    rms_ax = fig.axes[4]
    assert rms_ax.get_ylabel() == "max RMS(g/sqrt(v_hat))" and rms_ax.get_yscale() == "log"
    labels = [line.get_label() for line in rms_ax.get_lines()]
    assert labels == ["AdamW", "StableAdamW", "alarm 3", "bound 1/sqrt(1-beta2) = 10"]
    assert list(rms_ax.get_lines()[0].get_ydata()[:3]) == [1.0, 2.0, 9.0]
    assert [line.get_ydata()[0] for line in fig.axes[2].get_lines()[-1:]] == [1.0]  # the clip threshold
    [key] = fig.legends  # one key under the figure: every arm and mark, each drawn
    assert [t.get_text() for t in key.get_texts()] == ["AdamW", "StableAdamW", "clip threshold 1", "alarm 3",
                                                       "bound 1/sqrt(1-beta2) = 10"]
    with pytest.raises(ValueError, match="at least one seed"):
        plot_update_spikes({"AdamW": {}})


def test_the_beta2_panel_shows_the_setting_on_its_slider(cache):
    panel = Beta2Panel(Memorise(steps=12, warmup=1))
    assert panel.shown == 0.99 and panel.figure_mismatches() == [] and panel.image.value
    panel.controls["beta2"].value = 0.95  # what a student's drag does
    assert panel.shown == 0.95 and panel.error is None and "beta2 0.95" in panel.status.value
    assert "bound 4.47" in panel.status.value
    assert sorted(panel.logs) == [0.95, 0.99]
