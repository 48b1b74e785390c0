"""Why a loss was not finite (``labkit.triage``): bad data, a low-precision forward that overflowed, or
neither.

The oracles: the batch itself (NaN put in it), torch's own fp32 forward of the same model (finite
where fp16's is not), and a run without triage, which every later step must equal bit for bit.
fp16 is emulated on most CPUs: the models here are ToyTask's (64 x 16 inputs) and a few steps.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

import labkit
from labkit import SkipStreakWarning, StepRecord, ToyTask, TrainStep
from labkit.alarms import REMEDIES, ClipAlarm, SkipAlarm
from labkit.faults import Faults
from labkit.hooks import DecisionView, Verdict
from labkit.lab import describe
from labkit.lab.defenses import OUTCOMES, ledger
from labkit.reasons import Reason
from labkit.triage import Triage, _fp32_loss, nonfinite_input, overflow_module, rng_state, triage

NAN = float("nan")


def step_for(model, task, precision="fp16", hooks=(), **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return TrainStep(model, opt, task.loss_fn, precision=precision, **kw,
                     hooks=[SkipAlarm(None), ClipAlarm(None), *hooks])


def overflowing_head(task):
    """ToyTask's model with its output layer x1e6: outputs ~1e5, inf in fp16, finite (MSE ~1e10) in fp32."""
    model = task.model()
    with torch.no_grad():
        model[4].weight.mul_(1e6)
    return model


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_a_nan_batch_reads_nonfinite_input(precision):
    task = ToyTask()
    model = task.model()
    step = step_for(model, task, precision, hooks=[Triage(), Faults({1: "nan"})])
    forwards = []
    model.register_forward_pre_hook(lambda m, args: forwards.append(step.step_count))
    records = [step(*task.batch(i)) for i in range(3)]
    assert [r.reason for r in records] == [None, "nonfinite_input", None]
    assert forwards == [0, 1, 2]  # bad data is told without a second forward
    bad = records[1]
    assert bad.skipped and math.isnan(bad.loss) and bad.next_scale == bad.scale  # the scale untouched
    assert bad.first_nonfinite is None and bad.top_grads == []  # backward never ran
    x, y = task.batch(1)
    x = x.clone()
    x.view(-1)[0] = NAN
    assert not torch.isfinite(task.loss_fn(step.model(x), y))  # torch agrees: the loss is NaN on that batch


def test_an_fp16_forward_overflow_on_finite_data_reads_forward_overflow():
    task = ToyTask()
    model = overflowing_head(task)
    x, y = task.batch(0)
    with torch.no_grad():  # the oracle: torch's forward, in fp32 and under fp16 autocast
        assert torch.isfinite(task.loss_fn(model(x), y)) and torch.isfinite(x).all()
        with torch.autocast("cpu", dtype=torch.float16):
            assert not torch.isfinite(task.loss_fn(model(x), y))
    step = step_for(model, task, hooks=[Triage()])
    record = step(x, y)
    assert (record.skipped, record.reason) == (True, "forward_overflow")
    assert record.next_scale == record.scale  # the scale cannot help: it is left alone
    assert step_for(overflowing_head(task), task)(x, y).reason == "nonfinite_loss"  # without triage


def test_a_forward_overflow_names_the_module_whose_fp16_output_first_went_nonfinite():
    task = ToyTask()
    model = overflowing_head(task)
    x, y = task.batch(0)
    outs = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: outs.setdefault(n, o) is None or None)
             for n, m in model.named_children()]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):  # the oracle: torch's own fp16 forward
        model(x)
    for h in hooks:
        h.remove()
    assert torch.isfinite(outs["3"]).all() and not torch.isfinite(outs["4"]).all()  # layer 4 made the inf
    step = step_for(model, task, hooks=[Triage()])
    record = step(x, y)
    assert (record.reason, record.culprit_module) == ("forward_overflow", "4")
    assert "(the forward overflowed) in 4" in describe(record, 1.0)[0]
    good = step_for(task.model(), task, hooks=[Triage()])(x, y)
    assert good.culprit_module is None  # a good step: no re-run


def test_the_gpts_attention_overflow_is_named_at_the_attention_not_the_projection_after_it():
    """q.k past 65504 in block 1's attention: its input is finite, its output (and c_proj's) not."""
    task = labkit.tasks.GPTTask(attention="explicit", measure=False)
    torch.manual_seed(0)
    model = task.model()
    with torch.no_grad():
        model.h[1].attn.c_attn.weight.mul_(1e3)
    x, y = task.batch(0)
    seen = {}
    attn = model.h[1].attn
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: seen.setdefault(n, (a[0], o)) is None or None)
             for n, m in (("attn", attn), ("c_attn", attn.c_attn), ("c_proj", attn.c_proj))]
    with torch.no_grad():
        assert torch.isfinite(task.loss_fn(model(x), y))  # fp32: finite
        seen.clear()
        with torch.autocast("cpu", dtype=torch.float16):
            assert not torch.isfinite(task.loss_fn(model(x), y))
    for h in hooks:
        h.remove()
    assert torch.isfinite(seen["attn"][0]).all() and torch.isfinite(seen["c_attn"][1]).all()
    assert not torch.isfinite(seen["c_proj"][0]).all()  # c_proj is fed the non-finite value: not its origin
    record = step_for(model, task, hooks=[Triage()])(x, y)
    assert (record.reason, record.culprit_module) == ("forward_overflow", "h.1.attn")


def test_nan_weights_read_nonfinite_loss():
    task = ToyTask()
    model = task.model()
    with torch.no_grad():
        model[2].weight[0, 0] = NAN
    record = step_for(model, task, hooks=[Triage()])(*task.batch(0))
    assert (record.skipped, record.reason) == (True, "nonfinite_loss")


def test_triage_is_off_by_default_and_ps1_sees_nonfinite_loss():
    from labkit.grading.checks.ps1 import REASONS

    task = ToyTask()
    step = step_for(task.model(), task, hooks=[Faults({0: "nan"})])
    assert not any(isinstance(h, Triage) for h in step.hooks.members)
    assert step(*task.batch(0)).reason == "nonfinite_loss" and "nonfinite_loss" in REASONS
    assert "nonfinite_input" not in REASONS  # a student's skip decision is graded on the two reasons


def test_triage_is_refused_with_deferred_records_and_the_old_keyword_says_what_to_write():
    task = ToyTask()
    with pytest.raises(ValueError, match="Triage"):
        step_for(task.model(), task, sync_every=4, hooks=[Triage()])
    with pytest.raises(TypeError, match=r"TrainStep\(triage=...\) was removed: write hooks=\[Triage\(\)\]"):
        step_for(task.model(), task, triage=True)
    with pytest.raises(ValueError, match="precision"):
        Triage(precision="fp8")


class DropoutNet(nn.Module):
    """Dropout and BatchNorm: the re-run must replay the step's masks and leave the running statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5),
                                 nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


def batches(task, n, overflow_at):
    """ToyTask's batches; at ``overflow_at`` the inputs x1e5: finite, but past fp16's range in the forward."""
    return [(x * 1e5 if i == overflow_at else x, y) for i, (x, y) in ((i, task.batch(i)) for i in range(n))]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_fp32_rerun_leaves_dropout_and_batchnorm_as_a_run_without_triage(accumulation):
    # with 2 micro-batches the step stops at the first one's bad loss while the re-run runs both: the
    # random state must still be the one the step left
    task = ToyTask()
    runs = {}
    for on in (True, False):
        torch.manual_seed(1)  # the dropout masks come from the global generator
        model = DropoutNet()
        step = step_for(model, task, accumulation_steps=accumulation, hooks=[*([Triage()] if on else [])])
        records = [step(x, y) for x, y in batches(task, 5, overflow_at=2)]
        runs[on] = (records, model.state_dict(), torch.get_rng_state())
    (with_t, params_t, rng_t), (without, params, rng) = runs[True], runs[False]
    assert [r.reason for r in with_t] == [None, None, "forward_overflow", None, None]
    assert [r.reason for r in without] == [None, None, "nonfinite_loss", None, None]
    for a, b in zip(with_t, without):
        if a.step != 2:
            assert repr(a.to_dict()) == repr(b.to_dict())  # every later step, to the bit (repr: NaN == NaN)
    for k in params:
        assert torch.equal(params_t[k], params[k]), k
    assert torch.equal(rng_t, rng)


def test_the_rerun_replays_the_steps_dropout_masks_and_puts_the_buffers_back():
    task = ToyTask()
    model = DropoutNet()
    x, y = task.batch(0)
    rng = rng_state(None)
    with torch.no_grad():
        want = task.loss_fn(model(x), y).double()  # the step's forward (it moves the running statistics)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    after = torch.get_rng_state()
    got = _fp32_loss(model, task.loss_fn, (x, y), rng)
    assert got.item() == want.item()  # the same masks: the same loss, to the bit
    assert torch.equal(torch.get_rng_state(), after)  # the re-run drew nothing from the run's generator
    for k, v in model.state_dict().items():
        assert torch.equal(v, stats[k]), k  # the running statistics are the step's, not the re-run's
    other = _fp32_loss(model, task.loss_fn, (x, y), None)  # other masks: another loss
    assert other.item() != want.item()


def test_the_hook_in_a_plain_loop():
    task = ToyTask()
    model = overflowing_head(task)
    hook = Triage(model, task.loss_fn, "fp16")
    x, y = task.batch(0)
    hook.pre_step(None, 0)
    assert hook.on_decision(None, DecisionView(0, 1.0, 1.0, batch=(x, y))) is None  # a finite loss: no say
    verdict = hook.on_decision(None, DecisionView(0, math.inf, NAN, loss_bad=True, batch=(x, y)))
    assert verdict.skip == Reason.FORWARD_OVERFLOW
    inf = x.clone().fill_(math.inf)
    assert triage(model, task.loss_fn, (inf, y), precision="fp16") == Reason.NONFINITE_INPUT
    # an fp32 forward is not re-run: it would give the same loss
    assert triage(model, task.loss_fn, (x, y), precision="fp32") == Reason.NONFINITE_LOSS
    with pytest.raises(RuntimeError, match="attach"):
        Triage().on_decision(None, DecisionView(0, NAN, NAN, loss_bad=True, batch=(x, y)))


@pytest.mark.parametrize("reason, remedy", [
    ("nonfinite_input", "fix the data pipeline"),
    ("forward_overflow", "the loss scale acts on backward and cannot help"),
    ("nonfinite_loss", "run its forward in fp32 (TrainStep(hooks=[Triage()]) does both"),
])
def test_a_skip_streak_names_each_reasons_remedy(reason, remedy):
    task = ToyTask()
    model = overflowing_head(task) if reason == "forward_overflow" else task.model()
    faults = {i: "nan" for i in range(3)} if reason != "forward_overflow" else None
    step = step_for(model, task,
                    hooks=[SkipAlarm(3), *([Triage()] if reason != "nonfinite_loss" else []), Faults(faults)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = [step(*task.batch(i)) for i in range(3)]
    assert [r.reason for r in records] == [reason] * 3
    messages = [str(w.message) for w in caught if issubclass(w.category, SkipStreakWarning)]
    assert len(messages) == 1
    assert f"steps 0-2: {reason} x3" in messages[0] and remedy in messages[0]
    assert messages[0].endswith(REMEDIES[Reason(reason)])  # only the reasons in the streak


@pytest.mark.parametrize("reason, line", [
    ("nonfinite_loss", "loss is not finite: backward skipped, scale untouched"),
    ("nonfinite_input", "loss is not finite, an input holds NaN/inf (bad data): backward skipped, "
                        "scale untouched"),
    ("forward_overflow", "loss is not finite in fp16, finite in fp32 (the forward overflowed): "
                         "backward skipped, scale untouched"),
])
def test_describe_says_why_the_loss_was_not_finite(reason, line):
    record = StepRecord(5, NAN, skipped=True, reason=reason, fault="nan")
    assert describe(record, 1.0) == [f"step    5  SKIP  {reason}: {line} [fault nan]"]
    assert ledger([record]) == [OUTCOMES[2]]  # the ledger's "loss not finite" row


def test_summary_counts_the_new_reasons_and_the_trackers_take_them(tmp_path):
    from test_export import read_tensorboard

    from labkit.export import replay

    task = ToyTask()
    step = step_for(task.model(), task, log=tmp_path / "run.jsonl", hooks=[Triage(), Faults({1: "nan"})])
    for i in range(3):
        step(*task.batch(i))
    step.log.append(StepRecord(3, NAN, skipped=True, reason="forward_overflow"))
    step.log.append(StepRecord(4, 1.0, grad_norm=math.inf, skipped=True, reason="nonfinite_grad",
                               first_nonfinite="wte.weight", culprit_module="lm_head"))
    assert step.log.summary()["skips_by_reason"] == {"nonfinite_loss": 0, "nonfinite_grad": 1,
                                                    "nonfinite_input": 1, "forward_overflow": 1}
    step.log.close()
    path = tmp_path / "all.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in step.log))
    replay(path, "tensorboard", tmp_path)
    _, texts, _ = read_tensorboard(tmp_path / "tensorboard" / "all")
    assert texts[(1, "amp/skip_reason")] == "nonfinite_input"
    assert texts[(3, "amp/skip_reason")] == "forward_overflow"
    assert (texts[(4, "amp/first_nonfinite")], texts[(4, "amp/culprit_module")]) == ("wte.weight", "lm_head")
    assert labkit.StepLog.read_jsonl(tmp_path / "run.jsonl")[1].reason == "nonfinite_input"


def test_fp16_weights_have_no_fp32_forward_and_read_nonfinite_loss_without_raising():
    task = ToyTask()
    model = overflowing_head(task).half()
    x, y = task.batch(0)  # fp32: autocast casts them for the fp16 weights; an fp32 re-run could not
    assert triage(model, task.loss_fn, (x, y), precision="fp16") is Reason.NONFINITE_LOSS
    record = step_for(model, task, hooks=[Triage()])(x, y)
    assert record.skipped and record.reason == "nonfinite_loss"


def test_the_rerun_never_moves_the_runs_random_state_even_without_the_steps():
    task = ToyTask()
    model = nn.Sequential(overflowing_head(task), nn.Dropout(0.5))
    x, y = task.batch(0)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert triage(model, task.loss_fn, (x, y), precision="fp16") is Reason.FORWARD_OVERFLOW  # no rng given
    assert torch.equal(torch.get_rng_state(), before)


def test_a_model_without_parameters_is_triaged_on_the_cpu():
    """A loss computed from the inputs alone (no parameters to say where the model lives) is triaged on the
    CPU: NaN data, a fp32 forward that overflows by itself (1e30 squared), or a finite one."""
    model, y = nn.Identity(), torch.zeros(1, 2)
    assert triage(model, nn.functional.mse_loss, (torch.tensor([[NAN, 1.0]]), y), precision="fp16") \
        is Reason.NONFINITE_INPUT
    assert triage(model, nn.functional.mse_loss, (torch.full((1, 2), 1e30), y), precision="fp16") \
        is Reason.NONFINITE_LOSS
    assert triage(model, nn.functional.mse_loss, (torch.full((1, 2), 3.0), y), precision="fp16") \
        is Reason.FORWARD_OVERFLOW
    hook = Triage(model, nn.functional.mse_loss, "fp16")
    hook.pre_step(None, 0)  # the CPU's random state: no parameter says where else the forward runs
    view = DecisionView(0, math.inf, NAN, loss_bad=True, batch=(torch.full((1, 2), 1e30), y))
    assert hook.on_decision(None, view) == Verdict(skip=Reason.NONFINITE_LOSS)


def test_triages_fp32_rerun_sees_the_output_of_the_steps_own_dropout_masks():
    """``triage(..., rng=rng_state(...))`` replays the step's forward with the random state from before it:
    the loss function is handed the step's output again, to the bit (its dropout masks, not new ones)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5))
    seen = []

    def loss_fn(out, y):
        seen.append(out.detach().clone())
        return (out - y).pow(2).mean()

    x, y = torch.ones(2, 4), torch.zeros(2, 64)
    rng = rng_state(None)
    with torch.no_grad():
        loss_fn(model(x), y)  # the step's forward (here in fp32: its output to compare with)
    assert triage(model, loss_fn, (x, y), precision="fp16", rng=rng) is Reason.FORWARD_OVERFLOW
    step, rerun = seen
    assert (step == 0).any() and torch.equal(rerun, step)


def test_the_hook_replays_the_steps_dropout_masks_in_both_reruns():
    """``Triage.pre_step`` keeps the random state the step's forward draws from: the fp32 re-run and the
    fp16 one that names the module drop the units the step dropped."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 1))
    with torch.no_grad():  # 32-odd kept units of 2 x 2 x 1e4: ~1e6, past fp16's 65504, finite in fp32
        model[0].weight.fill_(0.5), model[0].bias.zero_(), model[2].weight.fill_(1e4)
    dropped = []
    model[1].register_forward_hook(lambda m, args, out: dropped.append(out.detach() == 0))
    hook = Triage(model, nn.functional.mse_loss, "fp16")
    x, y = torch.ones(2, 4), torch.zeros(2, 1)
    hook.pre_step(None, 0)
    with torch.autocast("cpu", dtype=torch.float16):  # the step's forward
        loss = nn.functional.mse_loss(model(x), y)
    assert not torch.isfinite(loss)
    verdict = hook.on_decision(None, DecisionView(0, loss.item(), NAN, loss_bad=True, batch=(x, y)))
    assert verdict.skip is Reason.FORWARD_OVERFLOW and verdict.fields == {"culprit_module": "2"}
    step, fp32, fp16 = dropped
    assert step.any() and torch.equal(fp32, step) and torch.equal(fp16, step)


def test_an_overflow_in_the_loss_itself_names_no_module():
    """No module's fp16 output went non-finite (400 is in range), the loss's square did (160000): the
    verdict is the skip alone, with no ``culprit_module`` (None would stand for "no module" there too)."""
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(100.0), model.bias.zero_()
    x = torch.full((1, 2), 2.0)

    def loss_fn(out):
        return (out * out).sum()

    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(x)).all() and not torch.isfinite(loss_fn(model(x)))
    hook = Triage(model, loss_fn, "fp16")
    hook.pre_step(None, 0)
    verdict = hook.on_decision(None, DecisionView(0, math.inf, NAN, loss_bad=True, batch=(x, None)))
    assert verdict == Verdict(skip=Reason.FORWARD_OVERFLOW)


def test_nonfinite_input_is_a_0_dim_bool_for_any_batch():
    """``nonfinite_input`` answers with a 0-dim bool tensor: for one tensor, several, and a batch of token
    ids (no floating tensor: nothing can be non-finite)."""
    for batch, want in [((torch.ones(2),), False), ((torch.tensor([1.0, NAN]),), True),
                        ((torch.ones(2), {"y": torch.tensor([math.inf])}), True),
                        ((torch.tensor([[1, 2]]), torch.tensor([3])), False)]:
        got = nonfinite_input(*batch)
        assert got.dtype == torch.bool and got.shape == () and bool(got) is want


def test_bad_data_is_told_without_a_forward():
    """``triage`` checks the batch first: NaN inputs read ``nonfinite_input`` and the model never runs."""
    model = nn.Linear(2, 1, bias=False)  # one parameter
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))
    y = torch.zeros(1, 1)
    assert triage(model, nn.functional.mse_loss, (torch.tensor([[NAN, 1.0]]), y), precision="fp16") \
        is Reason.NONFINITE_INPUT
    assert calls == []
    assert triage(model, nn.functional.mse_loss, (torch.ones(1, 2), y), precision="fp16") \
        is Reason.FORWARD_OVERFLOW and calls == [1]  # finite data: one fp32 re-run


def test_triage_takes_a_steps_batch_a_mapping_or_a_bare_tensor():
    """The batch ``triage`` is handed: the step's ``Batch`` (its micro-batches), inputs as a mapping
    (``model(**x)``) or a bare tensor (``loss_fn(output)``), NaN in it or not."""
    from labkit.step.batch import Batch

    task = ToyTask()
    model = overflowing_head(task)
    x, y = task.batch(0)
    cpu = torch.device("cpu")
    assert triage(model, task.loss_fn, Batch(x, y, 2, cpu, None), precision="fp16") is Reason.FORWARD_OVERFLOW
    bad = x.clone()
    bad[-1, 0] = NAN  # in the second micro-batch
    assert triage(model, task.loss_fn, Batch(bad, y, 2, cpu, None), precision="fp16") \
        is Reason.NONFINITE_INPUT

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = overflowing_head(task)

        def forward(self, x):
            return self.net(x)

    def mean_square(out):
        return out.pow(2).mean()

    kw = Keyword()
    assert triage(kw, mean_square, {"x": x}, precision="fp16") is Reason.FORWARD_OVERFLOW
    assert triage(kw, mean_square, {"x": bad}, precision="fp16") is Reason.NONFINITE_INPUT
    assert triage(model, mean_square, x, precision="fp16") is Reason.FORWARD_OVERFLOW
    assert triage(model, mean_square, bad, precision="fp16") is Reason.NONFINITE_INPUT


def test_overflow_module_names_the_layer_whose_output_overflowed():
    """Called on its own: the Linear whose fp16 output passed 65504 (4e5) from finite inputs, not the ReLU
    or the Linear after it; None when no module's output went non-finite."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    batch = (torch.ones(1, 2), torch.zeros(1, 1))
    with torch.no_grad():
        net[0].weight.fill_(1.0), net[0].bias.zero_()
    assert overflow_module(net, nn.functional.mse_loss, batch, precision="fp16") is None
    with torch.no_grad():
        net[1].weight.fill_(1e5)
    assert overflow_module(net, nn.functional.mse_loss, batch, precision="fp16") == "1"


def test_the_hooks_verdict_on_bad_data_or_bad_weights_is_the_reason_alone():
    """``Triage.on_decision`` skips with the reason and names no module when the forward did not overflow."""
    task = ToyTask()
    model = task.model()
    hook = Triage(model, task.loss_fn, "fp16")
    x, y = task.batch(0)
    hook.pre_step(None, 0)
    view = DecisionView(0, NAN, NAN, loss_bad=True, batch=(x * NAN, y))
    assert hook.on_decision(None, view) == Verdict(skip=Reason.NONFINITE_INPUT)
    with torch.no_grad():
        model[0].weight.fill_(NAN)
    view = DecisionView(0, NAN, NAN, loss_bad=True, batch=(x, y))
    assert hook.on_decision(None, view) == Verdict(skip=Reason.NONFINITE_LOSS)
    # a loop that never calls pre_step: the re-run draws fresh masks, and still reads the weights
    assert Triage(model, task.loss_fn, "fp16").on_decision(None, view) == Verdict(skip=Reason.NONFINITE_LOSS)


def test_what_the_hook_was_given_wins_over_the_trainers():
    """``attach`` takes from the trainer only what was not given: a model, loss function and precision
    passed to ``Triage`` stay (an fp16 overflow is triaged as fp16 even on an fp32 trainer)."""
    from types import SimpleNamespace

    task = ToyTask()
    model, other, loss_fn = overflowing_head(task), task.model(), task.loss_fn
    x, y = task.batch(0)
    trainer = SimpleNamespace(model=other, loss_fn=lambda out, y: out.sum() * NAN, precision="fp32",
                              process_group=None)
    given = Triage(model, loss_fn, "fp16")
    given.attach(trainer)
    assert given.model is model and given.loss_fn is loss_fn and given.precision == "fp16"
    given.pre_step(None, 0)
    view = DecisionView(0, math.inf, NAN, loss_bad=True, batch=(x, y))
    assert given.on_decision(None, view).skip is Reason.FORWARD_OVERFLOW
    taken = Triage()
    taken.attach(trainer)
    assert taken.model is other and taken.loss_fn is trainer.loss_fn and taken.precision == "fp32"
