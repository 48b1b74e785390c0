"""The GPT task on the stdlib's source, and what happens in it with nothing injected.

Each phenomenon is checked on a small GPT (1 layer, width 16, 16-byte context, batches of 4)
that trains in well under a second per run on two CPU cores; the notebook shows the same on
the default size.
"""

import hashlib
import importlib.util
import math
import statistics
from pathlib import Path

import pytest
import torch

from labkit import ToyTask, TrainStep
from labkit.lab.demo import main
from labkit.lab.experiment import ExperimentConfig, run_experiment
from labkit.lab.gradients import GradientProbe, Probed
from labkit.steplog import StepLog
from labkit.tasks import TASKS, GPTTask, Task, TextCorpus, make_task

SMALL = GPTTask(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4)


def run(task=SMALL, **kw):
    probe = GradientProbe()
    log = run_experiment(ExperimentConfig(task=Probed(task, probe), device="cpu", **kw))
    return log, probe


# --- the corpus -------------------------------------------------------------------------------

def test_corpus_is_the_selected_stdlib_files_in_order_with_their_sha256():
    c = TextCorpus(modules=("bisect", "colorsys"))
    files = [Path(importlib.util.find_spec(m).origin).read_bytes() for m in ("bisect", "colorsys")]
    assert c.data == files[0] + files[1]
    assert c.sha256 == hashlib.sha256(files[0] + files[1]).hexdigest()
    assert TextCorpus(modules=("colorsys", "bisect")).sha256 != c.sha256  # the order is part of the data


def test_corpus_split_is_one_cut_and_tokens_round_trip():
    c = TextCorpus()
    assert len(c.train) == int(len(c.data) * 0.9) and torch.equal(torch.cat([c.train, c.val]), c.tokens)
    assert c.decode(c.train[:200]) == c.data[:200].decode()
    assert c.vocab_size == len(set(c.data)) and int(c.tokens.max()) == c.vocab_size - 1


@pytest.mark.parametrize("kwargs, message", [
    ({"modules": ("sys",)}, "no .py source"),
    ({"modules": "textwrap"}, "tuple of module names"),
    ({"val_fraction": 0.9}, "val_fraction"),
])
def test_bad_corpus_settings_say_how_to_fix_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _ = TextCorpus(**kwargs).data


# --- the task ---------------------------------------------------------------------------------

def test_batches_are_windows_of_the_split_a_function_of_seed_and_step():
    x, y = SMALL.batch(3)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, GPTTask(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4).batch(3)[0])
    assert not torch.equal(x, SMALL.batch(4)[0])
    train, val = SMALL.corpus.train.tolist(), SMALL.corpus.val.tolist()
    text = lambda row: ",".join(map(str, row.tolist()))  # noqa: E731
    assert text(x[0]) in ",".join(map(str, train))
    xv, _ = SMALL.batch(0, split="val")
    assert text(xv[0]) in ",".join(map(str, val))


def test_model_shapes_weight_tying_and_seeded_init():
    m = SMALL.model()
    logits = m(SMALL.batch(0)[0])
    assert logits.shape == (4, 16, SMALL.corpus.vocab_size)
    assert m.lm_head.weight is m.wte.weight
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), SMALL.model().parameters()))
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_an_untied_head_has_its_own_weight_and_leaves_every_other_weight_as_the_tied_models():
    import dataclasses

    untied_task = dataclasses.replace(SMALL, tie_head=False)
    tied, untied = SMALL.model(), untied_task.model()
    assert untied.lm_head.weight is not untied.wte.weight
    names = dict(tied.named_parameters())
    assert set(dict(untied.named_parameters())) - set(names) == {"lm_head.weight"}
    assert all(torch.equal(p, names[n]) for n, p in untied.named_parameters() if n != "lm_head.weight")
    head = untied.lm_head.weight
    assert not torch.equal(head, untied.wte.weight) and head.std().item() == pytest.approx(0.02, rel=0.1)
    # a step moves the head and the embedding apart: the head's gradient is the head's own
    log = run_experiment(
        ExperimentConfig(task=untied_task, device="cpu", steps=3, optimizer="adamw", lr=1e-2)
    )
    assert len(log) == 3 and all(math.isfinite(r.loss) for r in log)
    with pytest.raises(ValueError, match="tie_head must be True or False"):
        GPTTask(tie_head=0)


def test_the_untrained_loss_is_log_vocab_and_matches_torch():
    x, y = SMALL.batch(0)
    logits = SMALL.model()(x)
    loss = SMALL.loss_fn(logits, y)
    assert loss.item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    )
    assert loss.item() == pytest.approx(math.log(SMALL.corpus.vocab_size), abs=0.1)


def test_toy_and_gpt_tasks_are_interchangeable():
    for name in TASKS:
        task = make_task(name, seed=2)
        assert isinstance(task, Task) and task.name == name
        model = task.model("cpu")
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), task.loss_fn)
        assert math.isfinite(step(*task.batch(0, "cpu")).loss)
    assert make_task("gpt", device="cuda").n_embd > make_task("gpt", device="cpu").n_embd
    assert isinstance(ToyTask(), Task)
    with pytest.raises(ValueError, match="unknown task 'bert'"):
        make_task("bert")
    with pytest.raises(ValueError, match="task must be one of"):
        ExperimentConfig(task="bert")


def test_same_config_same_log_and_the_validation_loss_falls():
    config = dict(precision="fp32", optimizer="adam", lr=1e-2, steps=40)
    a, probe = run(**config)
    b, _ = run(**config)
    assert a.column("loss") == b.column("loss") and a.column("grad_norm") == b.column("grad_norm")
    assert SMALL.val_loss(probe.model) < SMALL.val_loss(SMALL.model()) - 0.8
    log = run_experiment(ExperimentConfig(task="gpt", precision="fp32", steps=2, device="cpu"))
    assert len(log) == 2


# --- what happens with nothing injected ------------------------------------------------------

def test_the_sawtooth_fp16_overflows_by_itself_backs_off_and_grows_again():
    log, _ = run(precision="fp16", optimizer="adam", lr=3e-3, steps=40, init_scale=2.0**16, growth_interval=2)
    skips = [r for r in log if r.skipped]
    assert len(skips) >= 3
    assert all(
        r.reason == "nonfinite_grad" and r.fault is None and r.next_scale == r.scale / 2 for r in skips
    )
    after_first = [r for r in log if r.step > skips[0].step and r.next_scale > r.scale]
    assert after_first, "the scale never grew back"


def test_underflow_without_a_scaler_is_measured_and_slows_the_loss():
    weight = 2.0**-12  # the gradient size of a batch 4096 times as large (the loss is a mean over tokens)
    val, flushed = {}, {}
    for name, changes in {"fp32": {"precision": "fp32"}, "raw": {"precision": "fp16", "loss_scaling": False},
                          "scaled": {"precision": "fp16", "init_scale": 2.0**16}}.items():
        log, probe = run(optimizer="adam", lr=1e-2, steps=40, loss_weight=weight, **changes)
        val[name], flushed[name] = SMALL.val_loss(probe.model), statistics.mean(probe.zero_fraction)
        # the probe reads the scale off the loss's gradient
        assert probe.loss_scale[-1] == log[-1].scale * weight
    assert flushed["raw"] > 0.5 and flushed["fp32"] < 0.01 and flushed["scaled"] < 0.02
    assert val["raw"] > val["fp32"] + 0.05
    assert val["scaled"] == pytest.approx(val["fp32"], abs=0.02)


def test_a_too_high_learning_rate_diverges_unclipped_and_the_clipped_run_ends_lower():
    # divergence, not a spike (notebook 04, section 3): the norm climbs far above its running median
    # and the run does not come back; clipped, it never does
    def spike(log):
        n = log.column("grad_norm")
        return max(
            n[i] / statistics.median(n[max(0, i - 20):i]) for i in range(5, len(n)) if math.isfinite(n[i])
        )

    unclipped, probe = run(precision="fp32", optimizer="sgd", lr=0.8, steps=60, max_norm=None)
    clipped, _ = run(precision="fp32", optimizer="sgd", lr=0.8, steps=60, max_norm=1.0)
    assert all(r.fault is None for r in unclipped)
    assert spike(unclipped) >= 10 and max(unclipped.column("loss")) > 2 * unclipped[0].loss
    assert spike(clipped) < 10
    final = lambda log: statistics.mean(log.column("loss")[-10:])  # noqa: E731
    assert final(clipped) < final(unclipped) or not math.isfinite(final(unclipped))
    # per layer: the probe's norms are the step's, and the global norm is theirs combined
    norms = probe.layer_norms
    for i in (0, 10):
        total = math.sqrt(sum(n[i] ** 2 for n in norms.values()))
        assert total == pytest.approx(unclipped[i].grad_norm, rel=1e-4)
    assert probe.layers[0] == "wte" and "h.0.attn.c_attn" in probe.layers


def test_demo_runs_the_gpt_task_without_faults_and_prints_the_fingerprint(tmp_path, capsys):
    assert (
        main(["--task", "gpt", "--steps", "4", "--no-progress", "--device", "cpu", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert f"data sha256 {make_task('gpt').fingerprint}" in out
    log = StepLog.read_jsonl(tmp_path / "log.jsonl")
    assert len(log) == 4 and all(r.fault is None for r in log) and log[0].lr == 0.3
