"""The headless demo, end to end through its command line."""

import json
import math
import subprocess
import sys

import pytest

from labkit import StepLog
from labkit.lab.demo import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_demo_cli_writes_logs_and_figure_and_reports_every_event(tmp_path):
    """Through real pipes (as ``> run.log``): the event lines and a plain progress line every 10%, no bar."""
    out = tmp_path / "run"
    proc = run_cli("demo", "--out", str(out), "--steps", "220")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout + proc.stderr and "step/s" not in proc.stderr  # no bar, not even once
    lines = proc.stdout.splitlines()
    progress = [line for line in lines if line.startswith("progress")]
    assert [line.split()[1] for line in progress] == [f"{22 * k}/220" for k in range(1, 11)]
    assert progress[1].startswith("progress  44/220 steps (20%), loss ") and ", scale 1024" in progress[1]
    clip = lines.index(next(line for line in lines if line.startswith("step   50  CLIP")))
    assert lines[clip - 2:clip] == [progress[1], "step   49  SCALE 1024 -> 2048 (growth)"]  # in order
    assert lines[clip + 1] == progress[2]
    log = StepLog.read_jsonl(out / "log.jsonl")
    assert len(log) == 220
    # the default schedule: a spike that is clipped, a NaN batch that is skipped without
    # touching the scale, and an overflow episode that skips and halves the scale each step
    assert log[50].fault == "spike:10" and log[50].clipped and not log[50].skipped
    assert log[120].reason == "nonfinite_input" and log[120].next_scale == log[120].scale  # triaged: bad data
    assert log.skipped_steps == [120, 200, 201, 202, 203, 204]
    assert [r.next_scale / r.scale for r in log[200:205]] == [0.5] * 5
    # growth every 50 counted clean steps: the NaN step 120 is not counted and not punished
    grew = [r.step for r in log if r.next_scale > r.scale]
    assert grew == [49, 99, 150]
    assert "step   50  CLIP" in proc.stdout
    assert (
        "step  120  SKIP  nonfinite_input: loss is not finite, an input holds NaN/inf (bad data)"
        in proc.stdout
    )
    assert proc.stdout.count("(backoff)") == 5
    assert "skipped     6 (nonfinite_loss 0, nonfinite_grad 5, nonfinite_input 1)" in proc.stdout
    csv_lines = (out / "log.csv").read_text().splitlines()
    assert len(csv_lines) == 221 and csv_lines[0].startswith("step,loss,grad_norm")
    png = (out / "demo.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    assert not (out / "log.jsonl.partial").exists()



@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "file"])
def test_the_progress_bar_draws_on_a_terminal_only(tmp_path, capsys, monkeypatch, terminal):
    for stream in (sys.stdout, sys.stderr):  # capsys's streams, standing in for a terminal or a file
        monkeypatch.setattr(stream, "isatty", lambda: terminal)
    assert main(["--out", str(tmp_path), "--steps", "20", "--inject", "5:nan"]) == 0
    out, err = capsys.readouterr()
    assert "step    5  SKIP  nonfinite_input" in out
    assert ("\r" in err and "20/20" in err) is terminal  # tqdm's bar, redrawn in place
    assert ("\nprogress 20/20 steps (100%), loss " in out) is not terminal
    if terminal:
        assert main(["--out", str(tmp_path), "--steps", "20", "--no-progress"]) == 0
        out, err = capsys.readouterr()
        assert "\nprogress " not in out and "\r" not in err  # neither, on a terminal or not

def test_demo_flags_change_the_run(tmp_path, capsys):
    out = tmp_path / "clean"
    assert main(["--out", str(out), "--steps", "30", "--precision", "fp32", "--max-norm", "none",
                 "--inject", "none", "--no-progress"]) == 0
    log = StepLog.read_jsonl(out / "log.jsonl")
    assert log.skipped_steps == [] and set(log.column("scale")) == {1.0}
    assert not any(log.column("clipped"))

    out = tmp_path / "custom"
    assert main(["--out", str(out), "--steps", "12", "--init-scale", "256", "--growth-interval", "4",
                 "--inject", "5:inf", "--inject", "9:spike:1000", "--seed", "3", "--no-progress"]) == 0
    log = StepLog.read_jsonl(out / "log.jsonl")
    assert log[0].scale == 256.0 and log[4].next_scale == 512.0  # grew after 4 clean steps
    assert log[5].reason == "nonfinite_input" and log[5].fault == "inf"
    assert log[9].fault == "spike:1000"
    capsys.readouterr()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--inject", "5:boom"], "unknown fault kind"),
        (["--inject", "abc"], "STEP:KIND"),
        (["--max-norm", "0"], "--max-norm"),
        (["--max-norm", "nan"], "--max-norm"),
        (["--steps", "0"], "--steps"),
        (["--init-scale", "-1"], "--init-scale"),
        (["--growth-interval", "1.5"], "--growth-interval"),
        (["--precision", "fp8"], "--precision"),
        (["--device", "cuda"], "CUDA is not available"),
        (["--device", "tpu9"], "unknown device 'tpu9'"),
        (["--bogus"], "unrecognized arguments"),
        (["--parallel", "fsdp2"], "launch under torchrun"),
        (["--parallel", "tp"], "--parallel"),
        (["--fault-rank", "1"], "must be a rank in 0..0"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_bad_flags_exit_2_with_a_message(args, message, tmp_path, capsys):
    if args == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_rejects_unknown_commands():
    proc = run_cli("train")
    assert proc.returncode == 2 and "unknown command 'train'" in proc.stderr
    assert run_cli().returncode == 2
    help_ = run_cli("demo", "--help")
    assert help_.returncode == 0 and "--inject" in help_.stdout


def test_jsonl_lines_are_valid_python_json(tmp_path):
    out = tmp_path / "run"
    assert main(["--out", str(out), "--steps", "3", "--inject", "1:nan", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["skipped"] is True


def test_a_skip_names_the_first_nonfinite_gradient_or_says_the_norm_overflowed():
    from labkit.lab import describe
    from labkit.records import StepRecord

    named = StepRecord(7, 1.0, grad_norm=math.inf, skipped=True, reason="nonfinite_grad",
                       first_nonfinite="4.weight", culprit_module="4")
    tied = StepRecord(9, 1.0, grad_norm=math.inf, skipped=True, reason="nonfinite_grad",
                      first_nonfinite="wte.weight", culprit_module="lm_head")
    overflowed = StepRecord(8, 1.0, grad_norm=math.inf, skipped=True, reason="nonfinite_grad")
    assert describe(named, 1.0) == [
        "step    7  SKIP  nonfinite_grad: gradient not finite (first in backward: 4.weight)"
    ]
    assert describe(tied, 1.0) == ["step    9  SKIP  nonfinite_grad: gradient not finite (first in backward: "
                                   "wte.weight, as used by lm_head)"]
    assert describe(overflowed, 1.0) == ["step    8  SKIP  nonfinite_grad: gradient norm not finite, "
                                         "every gradient finite: their sum of squares overflowed float32"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--init-scale", "1e40"], "--init-scale: must be at most 3.40282e+38"),
        (["--out", "/proc/forbidden/run"], "--out: cannot"),
        (["--out", "FILE"], "is a file, not a folder"),
        (["--max-norm", "inf"], "--max-norm"),
    ],
    ids=["init-scale beyond float32", "out not writable", "out is a file", "max-norm inf"],
)
def test_bad_settings_exit_2_with_a_message_and_leave_nothing_behind(
    args, message, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as exc:
        main([*args, "--steps", "3", "--no-progress"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no runs/demo/ left behind
    assert (tmp_path / "FILE").read_text() == "mine"


def test_a_failing_run_removes_the_folder_it_created(tmp_path, monkeypatch):
    import labkit.lab.experiment as experiment

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(experiment, "run_experiment", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        main(["--out", str(tmp_path / "new" / "run"), "--steps", "3", "--no-progress"])
    assert list(tmp_path.iterdir()) == []


def test_a_fault_past_the_last_step_is_reported_and_a_run_with_every_step_skipped_says_so(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "late"), "--inject", "500:nan", "--inject", "2:nan", "--steps", "10",
                 "--precision", "fp32", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "--inject puts faults at steps 500, past the last step (9); they never fire" in err
    assert "step    2  SKIP" in out

    # 1e38 overflows every step: all skipped, every loss finite; "final loss nan" would be a lie
    assert main(["--out", str(tmp_path / "huge"), "--init-scale", "1e38", "--steps", "20", "--inject", "none",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    log = StepLog.read_jsonl(tmp_path / "huge" / "log.jsonl")
    assert len(log.skipped_steps) == 20 and all(math.isfinite(r.loss) for r in log)
    assert (
        "final loss  none: every step was skipped, the model never stepped; the last finite loss was" in out
    )
    assert "nan" not in out.split("summary")[1]


def test_an_unclipped_spike_is_reported_and_a_run_without_a_scaler_shows_no_scale(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--precision", "fp32", "--max-norm", "none", "--steps", "12",
                 "--inject", "5:spike:10", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "step    5  FAULT spike:10 injected: norm" in out and "not clipped (max_norm none)" in out
    assert "loss scale  none (fp32 runs without a loss scaler)" in out and "SCALE" not in out


def test_scales_print_as_powers_of_two_once_they_are_long():
    from labkit.lab.text import describe, format_scale
    from labkit.records import StepRecord

    assert describe(StepRecord(3, 1.0, scale=2.0**24, next_scale=2.0**23), 1.0) == [
        "step    3  SCALE 2^24 -> 2^23 (backoff)"
    ]
    assert format_scale(4096.0) == "4096"


def test_a_fault_on_another_rank_keeps_its_tag_and_the_title_says_how_many_ranks():
    from labkit.lab.experiment import ExperimentConfig
    from labkit.lab.text import describe, title
    from labkit.records import StepRecord

    # rank 0's record: no fault of its own
    skipped = StepRecord(120, math.nan, skipped=True, reason="nonfinite_loss")
    assert describe(skipped, 1.0, fault="nan on rank 1")[0].endswith("[fault nan on rank 1]")
    assert title(ExperimentConfig(fault_rank=1, parallel="fsdp2"), world=2) == \
        "labkit demo: fp16, max_norm 1, 2 ranks (fsdp2, faults on rank 1)"


def test_help_answers_without_importing_torch():
    code = ("import sys\nfrom labkit.__main__ import main\ntry:\n    main(['demo', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("False"), proc.stderr
    for flag in ("--precision", "--steps", "--lr", "--seed", "--device", "--out"):
        assert "(default" in proc.stdout.split(flag, 2)[2].split("--")[0], flag  # each flag says its default
