"""The lab's spike-defense settings, ledger and figure, and run_experiment with defenses."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

import labkit
from labkit.lab.defenses import KNOBS, Defenses, ledger, plot_defenses
from labkit.lab.experiment import ExperimentConfig, run_experiment
from labkit.lab.explorer import DefenseExplorer
from labkit.lab.text import describe, describe_rewind


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
    assert [r.step for r in log.kept()] == list(range(40))
    outcomes = ledger(log)
    assert {"stepped", "rewound", "skip: loss not finite", "skip: z-score spike"} <= set(outcomes)
    [(i, [event])] = log.events_after().items()
    trigger = log[i]
    assert (
        trigger.step == event.step == 25 and event.to == 20 and (event.data_from, event.data_to) == (20, 28)
    )
    lines = describe(trigger, None)
    assert lines[0].startswith("step   25  SKIP  spike_") and "sigma" in lines[0]
    assert describe_rewind(event) == \
        "step   25  REWIND to step 20: steps 20-25 undone (kept in the log), batches 20-27 skipped"
    fig = plot_defenses({"zclip": log}, window=8, z=6.0)
    top, strip = fig.axes
    assert top.get_title(loc="left") == "zclip"
    shown = [t.get_text() for t in top.get_legend().get_texts()]
    assert shown == ["grad norm (raw)", "threshold", "skip above mean + 6 sigma", "rewound (undone)"]
    # the ledger's legend names the outcomes that happened, in the ledger's order, and no other
    assert [t.get_text() for t in strip.get_legend().get_texts()] == [
        "stepped", "skip: loss not finite", "skip: z-score spike", "rewound"]
    assert strip.get_xlim() == (-0.5, 39.5)


def test_each_run_gets_its_own_panel_and_the_guard_is_marked_where_it_fired():
    shift = dict(method="zclip", threshold=2.5, window=8, shift_step=12, shift_size=30.0, feed="clipped")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logs = {
            name: run_experiment(ExperimentConfig(precision="fp32", optimizer="adam", lr=0.003, steps=30,
                                                  defenses=Defenses(max_consecutive_clips=bound, **shift)))
            for name, bound in (("locked", None), ("guarded", 6))
        }
    fired = [r.step for r in logs["guarded"] if r.lockin]
    assert fired and not any(r.lockin for r in logs["locked"])
    fig = plot_defenses(logs, window=8)
    locked, guarded, strip = fig.axes
    assert [ax.get_title(loc="left") for ax in (locked, guarded)] == ["locked", "guarded"]
    marks = [line for line in guarded.get_lines() if line.get_label() in ("lock-in guard fired", "_guard")]
    assert [line.get_xdata()[0] for line in marks] == fired
    assert "lock-in guard fired" in [t.get_text() for t in guarded.get_legend().get_texts()]
    assert "lock-in guard fired" not in [t.get_text() for t in locked.get_legend().get_texts()]
    n_clipped = sum(r.clipped for r in logs["locked"])
    assert f"clipped ({n_clipped})" in [t.get_text() for t in locked.get_legend().get_texts()]
    for ax in (locked, guarded):  # every value drawn is inside the panel
        lo, hi = ax.get_ylim()
        ys = [y for line in ax.get_lines() if line.get_label() not in ("lock-in guard fired", "_guard")
              for y in line.get_ydata() if math.isfinite(y)]
        assert lo <= min(ys) and max(ys) <= hi


def test_the_explorer_gives_each_method_its_own_knob_and_never_raises(monkeypatch):
    base = ExperimentConfig(precision="fp32", optimizer="adam", lr=0.003, steps=16,
                            defenses=Defenses(spike_step=12, shift_step=8))
    ex = DefenseExplorer(base, window=4)
    assert ex.error is None and ex.log[12].clipped  # ZClip at z=2.5 cut the x100 batch
    for method, (name, options, default) in KNOBS.items():
        ex.controls["method"].value = method  # what a student's click does
        knob = ex.controls["knob"]
        assert (knob.description, knob.value, [v for _, v in knob.options]) == (name, default, list(options))
        assert ex.error is None and ex.status.value == ""
        assert ex.controls["feed"].disabled == (method in ("norm", "agc"))
        assert ex.figure.texts[0].get_text() == ex.title() and ex.title().startswith(
            f"{method} {name}={default:g}"
        )
    assert ex.defenses().clipper() is not None
    ex.controls["method"].value = "zclip"
    ex.controls["window"].value = 14  # longer than the run before the spike: ZClip is still warming up there
    assert ex.error is None and not ex.log[12].clipped
    assert ex.status.value == ("ZClip warms up for window=14 steps: at the spike (step 12) it is still "
                               "warming up and cannot clip it; choose a window below 12.")
    assert "\n" not in ex.status.value and "Traceback" not in ex.status.value
