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
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_demo_cli_writes_logs_and_figure_and_reports_every_event(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("demo", "--out", str(out), "--steps", "220", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    log = StepLog.read_jsonl(out / "log.jsonl")
    assert len(log) == 220
    # the default schedule: a spike that is clipped, a NaN batch that is skipped without
    # touching the scale, and an overflow episode that skips and halves the scale each step
    assert log[50].fault == "spike:10" and log[50].clipped and not log[50].skipped
    assert log[120].reason == "nonfinite_loss" and log[120].next_scale == log[120].scale
    assert log.skipped_steps == [120, 200, 201, 202, 203, 204]
    assert [r.next_scale / r.scale for r in log[200:205]] == [0.5] * 5
    # growth every 50 counted clean steps: the NaN step 120 is not counted and not punished
    grew = [r.step for r in log if r.next_scale > r.scale]
    assert grew == [49, 99, 150]
    assert "step   50  CLIP" in proc.stdout
    assert "step  120  SKIP  nonfinite_loss" in proc.stdout
    assert proc.stdout.count("(backoff)") == 5
    assert "skipped     6 (nonfinite_loss 1, nonfinite_grad 5)" in proc.stdout
    csv_lines = (out / "log.csv").read_text().splitlines()
    assert len(csv_lines) == 221 and csv_lines[0].startswith("step,loss,grad_norm")
    png = (out / "demo.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    assert not (out / "log.jsonl.partial").exists()


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
    assert log[5].reason == "nonfinite_loss" and log[5].fault == "inf"
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
    from labkit.lab.demo import describe
    from labkit.records import StepRecord

    named = StepRecord(7, 1.0, grad_norm=math.inf, skipped=True, reason="nonfinite_grad", first_nonfinite="0.weight")
    overflowed = StepRecord(8, 1.0, grad_norm=math.inf, skipped=True, reason="nonfinite_grad")
    assert describe(named, 1.0) == ["step    7  SKIP  nonfinite_grad: gradient not finite (first: 0.weight)"]
    assert describe(overflowed, 1.0) == ["step    8  SKIP  nonfinite_grad: gradient norm not finite, every gradient "
                                         "finite: their sum of squares overflowed float32"]
