"""The README's ten-line integration runs as printed (a newcomer copies it first)."""

from pathlib import Path

import torch

from labkit import StepLog

README = Path(__file__).parent.parent / "README.md"


def test_the_readmes_own_loop_snippet_runs_and_writes_its_log(tmp_path, monkeypatch, capsys):
    section = README.read_text().split("## Add labkit to your own loop")[1]
    block = section.split("```python\n")[1].split("```")[0]
    assert "labkit.TrainStep(" in block and "MyModel().cuda()" in block
    # the reader's model and data stand in for MyModel and loader; the rest runs as printed
    code = block.replace("MyModel().cuda()", "torch.nn.Linear(4, 3)")
    torch.manual_seed(0)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"loader": loader})
    log = StepLog.read_jsonl(tmp_path / "log.jsonl")
    assert len(log) == 3 and not log.skipped_steps
    assert "steps" in capsys.readouterr().out
