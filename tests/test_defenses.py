"""The lab's spike-defense settings, ledger and figure, and run_experiment with defenses."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import labkit
from labkit.lab.defenses import OUTCOMES, Defenses, ledger, plot_defenses
from labkit.lab.demo import describe
from labkit.lab.experiment import ExperimentConfig, run_experiment


def test_clip_grad_value_has_torchs_signature():
    ours = inspect.signature(labkit.clip_grad_value_).parameters
    theirs = inspect.signature(torch.nn.utils.clip_grad_value_).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


def test_defenses_refuse_bad_settings_before_a_run():
    with pytest.raises(ValueError, match="method must be one of"):
        Defenses(method="clipit")
    with pytest.raises(ValueError, match="feed must be one of"):
        Defenses(method="zclip", feed="maybe")
    with pytest.raises(ValueError, match="rewind_back needs skip_z"):
        Defenses(rewind_back=10)


def test_a_rewound_experiment_ends_at_its_step_count_and_shows_every_outcome():
    d = Defenses(method="zclip", threshold=2.5, window=8, spike_step=25, spike_size=100.0, skip_z=6.0,
                 rewind_back=5, rewind_skip=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log = run_experiment(ExperimentConfig(precision="fp32", steps=40, faults=["12:nan"], defenses=d))
    assert [r.step for r in log if not r.rewound] == list(range(40))
    outcomes = ledger(log)
    assert {"stepped", "rewound", "skip: loss not finite", "skip: z-score spike"} <= set(outcomes)
    trigger = next(r for r in log if r.rewind_to is not None)
    assert trigger.step == 25 and trigger.rewind_to == 20
    lines = describe(trigger, None)
    assert lines[0].startswith("step   25  SKIP  spike_") and "sigma" in lines[0]
    assert lines[1] == "step   25  REWIND to step 20: steps 20-25 undone (marked rewound), a data window skipped"
    fig = plot_defenses({"zclip": log}, window=8)
    top, strip = fig.axes
    assert [t.get_text() for t in top.get_legend().get_texts()][:2] == ["zclip", "threshold"]
    assert [t.get_text() for t in strip.get_legend().get_texts()] == list(OUTCOMES)
    assert strip.get_xlim() == (-0.5, 39.5)
