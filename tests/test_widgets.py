"""The control panel, headless: set a widget's value as a student's mouse would, check the run and plot."""

import dataclasses
import html
import math
import threading

import numpy as np
import pytest

import labkit.lab.widgets as widgets
from labkit.lab.experiment import ExperimentConfig, run_experiment
from labkit.lab.widgets import ControlPanel, config_from, episode, event_rows

BASE = ExperimentConfig(precision="fp32", steps=20, device="cpu")


@pytest.fixture
def runs(monkeypatch):
    """Every config the panel ran, in order (the real run_experiment still runs)."""
    seen = []

    def spy(config, on_record=None, **kwargs):
        seen.append(config)
        return run_experiment(config, on_record, **kwargs)

    monkeypatch.setattr(widgets, "run_experiment", spy)
    return seen


def test_episode_specs():
    assert episode("nan", 7) == ("7:nan",)
    assert episode("inf", 3, 4) == ("3-6:inf",)
    assert episode("spike", 60, 2, 30.0) == ("60-61:spike:30",)
    assert episode("none", 60, 5) == ()
    with pytest.raises(ValueError, match="fault must be 'none' or one of spike, nan, inf, overflow"):
        episode("bad", 1)
    with pytest.raises(ValueError, match="fault_count must be an int >= 1"):
        episode("nan", 1, 0)


def test_config_from_maps_each_control_and_leaves_the_base_alone():
    base = ExperimentConfig(faults=["1:nan"])
    assert config_from(base, {}) == base
    c = config_from(base, {"max_norm": 0.5, "init_scale": 12, "growth_interval": 9, "precision": "bf16",
                           "loss_scaling": False})
    assert ((c.max_norm, c.init_scale, c.growth_interval, c.precision, c.loss_scaling)
            == (0.5, 4096.0, 9, "bf16", False))
    assert c.faults == ("1:nan",) and base.max_norm == 1.0
    assert config_from(base, {"max_norm": math.inf}).max_norm is None
    # any fault control makes one episode; the others take EPISODE's defaults
    assert config_from(base, {"fault_step": 9}).faults == ("9:spike:1000",)
    assert config_from(base, {"fault": "overflow", "fault_count": 3}).faults == ("50-52:overflow",)
    assert config_from(base, {"fault": "none"}).faults == ()
    with pytest.raises(KeyError, match="unknown controls \\['clip'\\]"):
        config_from(base, {"clip": 1.0})
    for exponent in (2000, 2.5, True):
        with pytest.raises(ValueError, match="the init_scale control is log2 of the scale"):
            config_from(base, {"init_scale": exponent})


def test_event_rows_are_the_last_events_in_step_order():
    logs = {"a": run_experiment(ExperimentConfig(precision="fp32", steps=12,
                                                 faults=["3:nan", "8:spike:1000"])),
            "b": run_experiment(ExperimentConfig(precision="fp32", steps=12, faults=["5:inf"]))}
    rows = event_rows(logs, 1.0)
    assert [(run, line.split()[1], line.split()[2]) for run, line in rows] == [
        ("a", "3", "SKIP"), ("b", "5", "SKIP"), ("a", "8", "CLIP")]
    assert event_rows(logs, 1.0, last=1) == rows[-1:] and event_rows(logs, 1.0, last=0) == []


def test_moving_a_slider_reruns_with_the_new_value_and_redraws(runs):
    panel = ControlPanel(
        BASE, {"max_norm": 1.0, "fault_step": 5, "fault_magnitude": 1000.0}, fixed={"fault": "spike"}
    )
    assert panel.logs == {} and runs == []
    panel.run()
    assert panel.logs["run"].clipped_steps == [5] and runs[-1].faults == ("5:spike:1000",)
    panel.controls["fault_step"].value = 11
    assert len(runs) == 2 and runs[-1] == panel.config and panel.config.faults == ("11:spike:1000",)
    log = panel.logs["run"]
    assert log.clipped_steps == [11]
    # the plot shows this run: the drawn pre-clip norm is the log's
    np.testing.assert_array_equal(panel.dashboard.line("norm").get_ydata(), log.column("grad_norm"))
    assert panel.dashboard.draws == 2
    panel.controls["max_norm"].value = math.inf  # the slider's "off"
    assert panel.config.max_norm is None and panel.logs["run"].clipped_steps == []
    assert "0 clipped, final loss" in panel.status.value and " s on cpu" in panel.status.value
    assert "scale" not in panel.status.value  # fp32 runs no scaler: "scale 1 -> 1" would be noise
    panel.controls["fault_magnitude"].value = 1.0  # a spike of x1 is no spike
    assert "0 skipped, 0 clipped" in panel.status.value
    assert "FAULT spike:1 injected" in panel.table.value and "CLIP" not in panel.table.value


def test_sliders_fire_on_release_only():
    panel = ControlPanel(BASE, {name: value for name, value in [
        ("max_norm", 1.0), ("fault_step", 3), ("fault_count", 1), ("fault_magnitude", 10.0),
        ("init_scale", 1024.0), ("growth_interval", 5)]})
    assert all(w.continuous_update is False for w in panel.controls.values())
    assert panel.controls["init_scale"].value == 10  # the exponent
    assert panel.controls["max_norm"].label == "1"


def test_variants_run_side_by_side_on_one_dashboard(runs):
    panel = ControlPanel(BASE, {"max_norm": 1.0}, fixed={"fault": "spike", "fault_step": 4},
                         variants={"clipped": {}, "unclipped": {"max_norm": None}}, panels=("norm", "loss"))
    logs = panel.run()
    assert [c.max_norm for c in runs] == [1.0, None]
    assert logs["clipped"].clipped_steps == [4] and logs["unclipped"].clipped_steps == []
    # same data, same weights up to the spike
    assert logs["clipped"][4].grad_norm == logs["unclipped"][4].grad_norm
    assert len(panel.dashboard.line("loss", "unclipped").get_ydata()) == 20
    assert "<th>run</th>" in panel.table.value and "clipped" in panel.status.value


def test_each_runs_event_lines_name_its_own_threshold():
    panel = ControlPanel(BASE, {"max_norm": 1000.0},
                         fixed={"fault": "spike", "fault_step": 4, "fault_magnitude": 10.0},
                         variants={"clipped": {}, "unclipped": {"max_norm": None}}, panels=("norm",))
    panel.run()
    rows = [line for _, line in event_rows(panel.logs, {"clipped": 1000.0, "unclipped": None})]
    assert [line.split("injected: ")[1].split(", ", 1)[1] for line in rows] == [
        "not clipped (below max_norm 1000)", "not clipped (max_norm none)"]
    assert all(html.escape(line) in panel.table.value for line in rows)  # what the panel's table shows


def test_without_auto_run_only_the_button_runs_and_it_is_disabled_while_running(runs):
    states = []
    panel = ControlPanel(BASE, {"fault": "nan", "fault_step": 2}, auto_run=False, live=True, every=5)
    real_update = panel.dashboard.update

    def watch(record, run=None):
        states.append(panel.run_button.disabled)
        real_update(record, run)

    panel.dashboard.update = watch
    panel.controls["fault_step"].value = 6
    assert runs == [] and panel.config.faults == ("6:nan",)
    panel.run_button.click()
    assert len(runs) == 1 and panel.logs["run"].skipped_steps == [6]
    assert states == [True] * 20 and panel.run_button.disabled is False
    assert panel.dashboard.draws == 20 // 5 + 1  # live redraws in the loop, then the final one


def test_a_change_during_a_run_starts_one_more_run_after_it_not_a_nested_one(runs):
    panel = ControlPanel(BASE, {"fault_step": 2}, fixed={"fault": "nan"}, live=True, every=100)
    real_update = panel.dashboard.update

    def student_moves_the_slider(record, run=None):
        real_update(record, run)
        if record.step == 10 and len(runs) == 1:
            # what a callback on ipykernel's subshell thread does mid-run: settings only
            panel.controls["fault_step"].value = 7
            panel.controls["fault_step"].value = 8
            assert len(runs) == 1  # nothing nested

    panel.dashboard.update = student_moves_the_slider
    panel.run()
    assert [c.faults for c in runs] == [("2:nan",), ("8:nan",)]  # the latest settings, once
    assert panel.logs["run"].skipped_steps == [8] and not panel.running


def test_a_callback_from_another_thread_while_running_is_picked_up(runs):
    started, release = threading.Event(), threading.Event()
    panel = ControlPanel(BASE, {"fault_step": 2}, fixed={"fault": "nan"}, live=True, every=100)
    real_update = panel.dashboard.update

    def slow(record, run=None):
        real_update(record, run)
        if len(runs) == 1 and record.step == 0:
            started.set()
            assert release.wait(10)

    panel.dashboard.update = slow
    worker = threading.Thread(target=panel.run)
    worker.start()
    assert started.wait(10)
    panel.controls["fault_step"].value = 13  # on this thread, as a subshell callback would
    assert panel.run_button.disabled and len(runs) == 1
    release.set()
    worker.join(30)
    assert not worker.is_alive()
    assert [c.faults for c in runs] == [("2:nan",), ("13:nan",)] and panel.logs["run"].skipped_steps == [13]
    assert panel.run_button.disabled is False


def test_alarms_are_shown_in_the_status():
    panel = ControlPanel(BASE, {"fault": "nan", "fault_step": 3, "fault_count": 9})
    panel.run()
    assert panel.alarms == {"run": ["SkipStreakWarning"]}
    assert "alarm</b>: SkipStreakWarning" in panel.status.value
    assert panel.table.value.count("SKIP") == 8  # the last 8 events


def test_a_failing_run_is_reported_in_the_panel_and_the_next_one_works(monkeypatch):
    panel = ControlPanel(BASE, {"fault_step": 3})
    calls = []

    def broken(config, on_record=None, **kwargs):
        calls.append(config)
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(widgets, "run_experiment", broken)
    panel.run()
    assert isinstance(panel.error, RuntimeError) and "CUDA out of memory" in panel.status.value
    assert panel.run_button.disabled is False and not panel.running
    monkeypatch.setattr(widgets, "run_experiment", run_experiment)
    panel.controls["fault_step"].value = 4
    assert panel.error is None and panel.logs["run"].clipped_steps == [4]


def test_an_invalid_combination_of_controls_is_reported_not_run(runs):
    panel = ControlPanel(ExperimentConfig(precision="fp32", steps=20), {"fault": "nan", "fault_count": 1})
    panel.controls["fault"].value = "spike"
    assert runs[-1].faults == ("50:spike:1000",)  # past the end of a 20-step run: no fault, no error
    before = len(runs)
    panel.base = ExperimentConfig(precision="fp32", steps=20, max_norm=None)
    panel.fixed["init_scale"] = 3000  # 2**3000 is not a float32 scale
    panel.controls["fault_count"].value = 2
    assert len(runs) == before and isinstance(panel.error, ValueError)
    assert "log2 of the scale" in panel.status.value


@pytest.mark.parametrize("kwargs, error, message", [
    ({"controls": {"init_scale": 1000.0}}, ValueError, "powers of two"),
    ({"controls": {"wobble": 1}}, KeyError, "unknown control 'wobble'"),
    ({"controls": {"fault": "nan"}, "fixed": {"fault": "inf"}}, ValueError, "both as controls and as fixed"),
    ({"controls": {}, "variants": {"bad": {"precision": "fp8"}}}, ValueError, "precision must be one of"),
    ({"controls": {}, "variants": {"bad": {"clip": 1}}}, TypeError, "clip"),
    ({"controls": {}, "cache_size": -1}, ValueError, "cache_size must be an int >= 0"),
])
def test_bad_panel_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        ControlPanel(BASE, **kwargs)


def test_the_panel_displays_as_one_widget():
    panel = ControlPanel(BASE, {"max_norm": 1.0})
    bundle = panel._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.widget.model_id
    children = panel.widget.children
    assert children[0] is panel.controls["max_norm"] and panel.dashboard.widget in children
    # the CSS hooks the browser tests find widgets by
    assert "labkit-control-max_norm" in panel.controls["max_norm"]._dom_classes
    assert [w._dom_classes for w in (panel.widget, panel.run_button, panel.status, panel.table,
                                     panel.dashboard.widget)] == [
        ("labkit-panel",), ("labkit-run",), ("labkit-status",), ("labkit-events",), ("labkit-dashboard",)]


def test_the_initial_scale_slider_moves_the_start_of_the_plotted_scale_curve():
    panel = ControlPanel(ExperimentConfig(precision="fp16", steps=12, device="cpu"), {"init_scale": 2.0**10})
    panel.run()
    assert (
        panel.dashboard.line("scale").get_ydata()[0] == 1024.0 and "scale 1024 &rarr;" in panel.status.value
    )
    panel.controls["init_scale"].value = 24
    log = panel.logs["run"]
    assert log[0].scale == 2.0**24 and panel.dashboard.line("scale").get_ydata()[0] == 2.0**24
    assert "scale 2^24 &rarr;" in panel.status.value  # not 1.67772e+07
    assert log.skipped_steps[:1] == [0]  # 2**24 overflows fp16 on the first step and backs off


def test_a_slider_back_on_a_seen_value_redraws_from_the_cache_without_training(runs):
    panel = ControlPanel(BASE, {"fault_step": 3}, fixed={"fault": "nan"}, cache_size=2)
    panel.run()
    panel.controls["fault_step"].value = 5
    panel.controls["fault_step"].value = 3
    assert [c.faults for c in runs] == [("3:nan",), ("5:nan",)]  # the way back ran nothing
    assert panel.logs["run"].skipped_steps == [3] and panel.dashboard.draws == 3
    assert list(np.flatnonzero(np.isnan(panel.dashboard.line("loss").get_ydata()))) == [3]  # what is drawn
    assert "shown again (already run)" in panel.status.value and " s on cpu" not in panel.status.value
    panel.controls["fault_step"].value = 7
    panel.controls["fault_step"].value = 5  # pushed out of a cache of 2 by 7 and 3: runs again
    assert [c.faults for c in runs][2:] == [("7:nan",), ("5:nan",)]


def test_one_runs_many_skips_do_not_push_the_other_runs_clip_out_of_the_table():
    nan = ExperimentConfig(precision="fp32", steps=12, faults=["4-10:nan"], max_norm=None)
    logs = {"clipped": run_experiment(ExperimentConfig(precision="fp32", steps=12, faults=["2:spike:1000"])),
            "unclipped": run_experiment(nan)}
    rows = event_rows(logs, 1.0, last=4)
    assert [(run, line.split()[1], line.split()[2]) for run, line in rows] == [
        ("clipped", "2", "CLIP"), ("unclipped", "8", "SKIP"), ("unclipped", "9", "SKIP"),
        ("unclipped", "10", "SKIP")]


def test_a_run_without_a_scaler_shows_a_note_in_the_scale_panel_and_no_scale_in_the_status():
    panel = ControlPanel(ExperimentConfig(precision="fp16", steps=8, device="cpu"), {"precision": "fp16"},
                         panels=("scale",))
    panel.run()
    assert panel.dashboard.line("scale").get_visible() and "scale 1024 &rarr; 1024" in panel.status.value
    panel.controls["precision"].value = "bf16"
    scale_ax = panel.dashboard.figure.axes[0]
    assert not panel.dashboard.line("scale").get_visible()
    assert [t.get_text() for t in scale_ax.texts] == ["bf16: no loss scaler in this run"]
    assert "scale" not in panel.status.value


def test_the_panel_says_which_controls_its_figure_does_not_show(runs):
    # 04's hidden check did this: a run in fp32 from code, the control put back to fp16, no new run
    panel = ControlPanel(BASE, {"precision": "fp16", "fault_step": 3}, fixed={"fault": "nan"}, auto_run=False)
    assert panel.figure_mismatches() == []  # nothing drawn yet
    panel.controls["precision"].value = "fp32"
    panel.run()
    assert panel.figure_mismatches() == [] and panel.shown_values["precision"] == "fp32"
    panel.controls["precision"].value = "fp16"
    assert panel.figure_mismatches() == ["precision: the control says 'fp16', the figure shows 'fp32'"]
    assert panel.dashboard.figure._suptitle.get_text().startswith("run:") and runs[-1].precision == "fp32"
    panel.run()
    assert panel.figure_mismatches() == [] and runs[-1].precision == "fp16"
    # with auto_run a slider's release re-runs, so the figure follows it
    live = ControlPanel(BASE, {"fault_step": 3}, fixed={"fault": "nan"})
    live.run()
    live.controls["fault_step"].value = 9
    assert live.figure_mismatches() == [] and live.shown_values == {"fault": "nan", "fault_step": 9}


def test_clear_leaves_no_run_on_screen_that_the_controls_do_not_describe(runs):
    panel = ControlPanel(dataclasses.replace(BASE, precision="fp16"), {"precision": "fp16", "fault": "nan",
                                                                       "fault_step": 3}, auto_run=False)
    panel.controls["precision"].value = "fp32"  # a check runs the cheap precision from code...
    panel.run()
    assert panel.logs["run"].skipped_steps == [3] and len(panel.dashboard.line("loss").get_xdata()) == 20
    panel.controls["precision"].value = "fp16"  # ...puts the control back...
    panel.clear()  # ...and takes the fp32 run off the screen
    assert panel.logs == {} and panel.status.value == "not run yet" and panel.table.value == ""
    assert all(len(panel.dashboard.line(key).get_xdata()) == 0 for key in ("norm", "loss", "scale", "skip"))
    legend = panel.dashboard.figure.axes[0].get_legend()  # only the threshold line is still drawn and listed
    assert [t.get_text() for t in legend.get_texts()] == ["max_norm"]
    assert panel.config.precision == "fp16" and len(runs) == 1 and panel.figure_mismatches() == []


def test_a_skip_in_a_run_without_a_scaler_says_nothing_of_a_scale():
    # issue 32 #26: an fp32 run's event table said "scale untouched" where no scaler ran
    panel = ControlPanel(ExperimentConfig(precision="fp16", steps=6, device="cpu"),
                         {"precision": "fp16"}, fixed={"fault": "nan", "fault_step": 2}, panels=("loss",))
    panel.run()
    assert "backward skipped, scale untouched" in panel.table.value
    panel.controls["precision"].value = "fp32"
    assert "SKIP" in panel.table.value and "backward skipped" in panel.table.value
    assert "scale" not in panel.table.value
    rows = event_rows(panel.logs, 1.0, scaler={"run": False})
    assert rows and all("scale" not in line for _, line in rows)
    # the default: a scaler ran
    assert any("scale untouched" in line for _, line in event_rows(panel.logs, 1.0))


def test_the_lr_slider_holds_its_value_exactly_on_its_grid():
    # issue 32 #28: lesson 04's slider offered 0.794 and 0.891, never the text's 0.8
    for lr in (0.8, 3e-3, 0.3, 0.0123):
        slider = widgets._control("lr", lr, 10)
        assert slider.value == lr and lr in [v for _, v in slider.options]
    panel = ControlPanel(BASE, {"lr": 0.8})
    panel.controls["lr"].value = 0.3
    panel.controls["lr"].value = 0.8  # a student's drag back to the text's value
    assert panel.config.lr == 0.8 and panel.logs["run"][0].lr == 0.8


def test_a_panel_waiting_for_run_says_its_settings_changed_and_comes_back_when_they_are_put_back():
    panel = ControlPanel(BASE, {"fault": "nan", "fault_step": 2}, auto_run=False)
    panel.controls["fault_step"].value = 3  # before any run: nothing on screen to contradict
    assert panel.status.value == "not run yet"
    panel.run()
    shown = panel.status.value
    assert "settings changed" not in shown
    panel.controls["fault_step"].value = 4
    assert panel.status.value.startswith("settings changed (fault_step): press Run")
    assert panel.figure_mismatches() == ["fault_step: the control says 4, the figure shows 3"]
    panel.controls["fault_step"].value = 3  # put back: the figure shows the controls again
    assert panel.status.value == shown and panel.figure_mismatches() == []
