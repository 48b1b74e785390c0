"""AdamWatch reads Adam's own second moment; a spike lingers in it, a skipped spike never enters it."""

import math
import warnings

import pytest
import torch

from labkit.lab.defenses import Defenses
from labkit.lab.experiment import ExperimentConfig, run_experiment
from labkit.lab.moments import AdamWatch, plot_adam_moments


def test_a_constant_gradient_gives_v_hat_its_square_at_every_step():
    # Kingma & Ba's bias correction makes v_hat exactly g**2 for a constant g, from the first step on
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([w], lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    watch = AdamWatch(optimizer=opt)
    for _ in range(5):
        w.grad = torch.full((4,), 0.25)
        watch.before_step([("w", w)], 0)
        opt.step()
        watch.after_step([("w", w)], None)
    assert watch.v_hat == pytest.approx([0.0625] * 5, rel=1e-6)
    assert watch.step_size == pytest.approx([0.01 / (0.25 + 1e-8)] * 5, rel=1e-6)
    assert watch.update == pytest.approx([0.01] * 5, rel=1e-4)  # m_hat / sqrt(v_hat) = 1: each step moves lr


def test_without_an_optimizer_the_watch_says_how_to_give_it_one():
    w = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(RuntimeError, match="attach"):
        AdamWatch().after_step([("w", w)], None)


def run(watch, **defenses):
    config = ExperimentConfig(precision="fp32", optimizer="adam", lr=0.003, betas=(0.9, 0.95), steps=24,
                              defenses=Defenses(spike_step=16, spike_size=100.0, window=8, **defenses))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_experiment(config, observer=watch)


def test_an_unclipped_spike_lingers_in_v_and_a_skipped_one_never_enters():
    watches = {name: AdamWatch() for name in ("unclipped", "skipped")}
    logs = {"unclipped": run(watches["unclipped"], method="none"),
            "skipped": run(watches["skipped"], method="none", skip_z=6.0)}
    for watch in watches.values():
        assert watch.steps == list(range(24))
    up, skip = watches["unclipped"], watches["skipped"]
    assert logs["skipped"][16].skipped and skip.update[16] == 0.0 and skip.v_hat[16] == skip.v_hat[15]
    assert up.v_hat[16] > 1e4 * up.v_hat[15] and up.step_size[16] < 1e-2 * up.step_size[15]
    # seven steps later it is still there: v decays by beta2 = 0.95 per step
    assert up.v_hat[23] > 1e3 * skip.v_hat[23]
    fig = plot_adam_moments(watches, logs, spike_step=16, beta2=0.95)
    assert [ax.get_ylabel() for ax in fig.axes] == ["v_hat (median)", "lr / (sqrt(v_hat) + eps)", "loss"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["unclipped", "skipped"]
    drawn = [line.get_ydata().tolist() for line in fig.axes[1].get_lines()[:2]]
    assert drawn == [up.step_size, skip.step_size]


def test_under_sgd_the_watch_measures_the_update_only():
    watch = AdamWatch()
    config = ExperimentConfig(precision="fp32", optimizer="sgd", lr=0.05, steps=3)
    run_experiment(config, observer=watch)
    assert all(math.isnan(v) for v in watch.v_hat) and all(u > 0 for u in watch.update)


def test_betas_reach_adam_and_are_refused_for_sgd():
    watch = AdamWatch()
    config = ExperimentConfig(precision="fp32", optimizer="adam", betas=(0.8, 0.9), steps=1)
    run_experiment(config, observer=watch)
    assert watch.optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match="betas are Adam's"):
        ExperimentConfig(optimizer="sgd", betas=(0.9, 0.95))
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\)"):
        ExperimentConfig(optimizer="adam", betas=(0.9, 1.0))


def test_the_watch_is_a_hook_the_step_attaches_and_equals_the_plain_loop():
    from labkit import ToyTask, TrainStep
    from labkit.hooks import Hook
    from labkit.lab import AdamWatch as FromTheFront

    assert FromTheFront is AdamWatch and isinstance(AdamWatch(), Hook)
    task = ToyTask()
    watches = {}
    for how in ("hooks", "loop"):
        model = task.model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if how == "hooks":  # no attach by hand: the step hands the watch its optimizer
            watches[how] = watch = AdamWatch()
            step = TrainStep(model, opt, task.loss_fn, hooks=[watch], faults={2: "nan"}, skip_alarm=None)
            for i in range(4):
                step(*task.batch(i))
        else:
            watches[how] = watch = AdamWatch(optimizer=opt)
            params = list(model.named_parameters())
            for i in range(4):
                x, y = task.batch(i)
                opt.zero_grad()
                if i == 2:  # the step above skips the NaN batch before backward: no optimizer step
                    continue
                task.loss_fn(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                watch.before_step(params, i)
                opt.step()
                watch.after_step(params, None)
    assert watches["hooks"].steps == [0, 1, 3]
    for name in ("v_hat", "step_size", "update"):  # the same steps (the clip may round apart)
        assert getattr(watches["hooks"], name) == pytest.approx(getattr(watches["loop"], name), rel=1e-5)
    assert watches["hooks"].update[2] > 0  # the NaN step left no trace: step 3 moved
