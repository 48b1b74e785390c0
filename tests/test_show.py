"""``python -m labkit show LOG.jsonl``: the event lines, the summary and the PNG of a log from any loop."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import labkit
from labkit.alarms import ClipAlarm
from labkit.faults import Faults
from labkit.lab import plot_log
from labkit.lab.show import main
from labkit.records import StepRecord
from labkit.steplog import StepLog

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trainstep_log(tmp_path_factory):
    """A fp16 TrainStep run: a NaN batch at step 2, a x10 spike at step 5 (its scaled gradients overflow)."""
    path = tmp_path_factory.mktemp("show") / "run.jsonl"
    task = labkit.ToyTask()
    model = task.model()
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                            precision="fp16", max_norm=0.5, log=path,
                            hooks=[ClipAlarm(None), Faults(["2:nan", "5:spike:10"])])
    for i in range(8):
        step(*task.batch(i))
    step.log.close()
    return path, step.log


def test_show_prints_the_event_lines_and_the_summary_and_leaves_the_png(trainstep_log, capsys):
    path, log = trainstep_log
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    skip = ("step    2  SKIP  nonfinite_loss: loss is not finite: backward skipped, scale untouched "
            "[fault nan]")
    assert skip in lines
    assert any(line.startswith("step    5  SKIP  nonfinite_grad: gradient not finite (first in backward: ")
               and line.endswith("[fault spike:10]") for line in lines)
    assert "step    5  SCALE 65536 -> 32768 (backoff)" in lines
    assert any(line.startswith("step    6  CLIP  norm") and "> max_norm 0.5" in line for line in lines)
    assert "  skipped     2 (nonfinite_loss 1, nonfinite_grad 1)" in lines
    assert "  loss scale  min 32768, max 65536, final 32768" in lines
    s = log.summary()
    assert f"  clipped     {s['clipped']} ({s['clip_rate']:.1%} of stepped steps)" in lines
    png = path.with_suffix(".png")
    assert f"  figure      {png}" in lines
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plain_loops_log_shows_too(tmp_path, capsys):
    """No TrainStep: records a hand-written loop appended to its own StepLog stream."""
    path = tmp_path / "mine.jsonl"
    log = StepLog(stream=path)
    for i, norm in enumerate([0.5, 3.0, math.inf, 0.4]):
        skipped = not math.isfinite(norm)
        log.append(StepRecord(i, math.nan if skipped else 1.0 / (i + 1), grad_norm=norm,
                              clip_coef=min(1.0, 1 / norm), clipped=norm > 1.0, skipped=skipped,
                              reason="nonfinite_grad" if skipped else None))
    log.close()
    assert main([str(path), "--png", str(tmp_path / "fig.png"), "--max-norm", "1"]) == 0
    out = capsys.readouterr().out
    assert "step    1  CLIP  norm 3 > max_norm 1 (x0.333); largest: " in out
    assert "step    2  SKIP  nonfinite_grad" in out and "  steps       4" in out
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_show_from_the_command_line(trainstep_log, tmp_path):
    path, _ = trainstep_log
    png = tmp_path / "cli.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "labkit", "show", str(path), "--png", str(png)],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "summary" in done.stdout and "SKIP  nonfinite_loss" in done.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    missing = subprocess.run([sys.executable, "-m", "labkit", "show", str(tmp_path / "none.jsonl")],
                             cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
    assert missing.returncode == 1 and "No such file" in missing.stderr
    assert not (tmp_path / "none.png").exists()


def test_plot_log_marks_finite_points_that_sit_alone_between_skips():
    """Steps 1 and 3 are finite with a skip on each side: a line alone draws nothing there."""
    skipped = {0, 2, 4}
    records = [StepRecord(i, math.nan if i in skipped else 1.0,
                          grad_norm=math.inf if i in skipped else 2.0 + i, skipped=i in skipped,
                          reason="nonfinite_grad" if i in skipped else None)
               for i in range(7)]
    fig = plot_log(StepLog(records), max_norm=1.0)
    norm_ax = fig.axes[0]
    pre = next(line for line in norm_ax.get_lines() if line.get_label() == "pre-clip (logged)")
    assert pre.get_marker() == "o" and pre.get_markevery() == [1, 3]  # the line joins 5-6 itself
    ys = list(pre.get_ydata())
    assert [ys[i] for i in (1, 3)] == [3.0, 5.0] and all(math.isnan(ys[i]) for i in skipped)
    loss = fig.axes[1].get_lines()[0]
    assert loss.get_markevery() == [1, 3]


def test_plot_log_draws_no_marker_on_a_run_without_gaps():
    fig = plot_log(StepLog([StepRecord(i, 1.0, grad_norm=1.0 + i) for i in range(4)]))
    assert fig.axes[0].get_lines()[0].get_marker() == "None"
