"""Instabilities clipping cannot fix: the GPT's stability options, its logit measurements, the LR sweep.

The phenomena of Wortsman et al. 2023 (arXiv 2309.14322) are checked on the smallest GPT where
they show within a test's budget; notebooks/07_small_scale_instabilities.ipynb shows the same at
the lesson's size, and ``python -m labkit sweep`` the full grid.
"""

import copy
import csv
import dataclasses
import io
import json
import math

import pytest
import torch
import torch.nn.functional as F
from gpt_before_options import GPTTask as GPTTaskBefore

import labkit
from labkit.export.schema import row
from labkit.lab import describe
from labkit.lab.experiment import ExperimentConfig, make_optimizer, make_scheduler, run_experiment
from labkit.lab.sweep import Recipe, lr_grid, lr_sensitivity, main, run_point, stable_lrs, summarize, sweep
from labkit.reasons import LOSS
from labkit.records import StepRecord
from labkit.steplog import StepLog
from labkit.tasks import GPTTask
from labkit.tasks.gpt import LogitMonitor, cross_entropy_with_z_loss
from labkit.tasks.perturb import PERTURB_ENV

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4)
# the CPU default's width, context and heads (head dim 16), as in lesson 07
LESSON = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8)


def before_logits(r):
    """The record without the logit measurements (LogitMonitor's fields), as the GPT before them wrote it."""
    return bitwise({k: v for k, v in r.to_dict().items() if k not in LogitMonitor.record_fields})


def bitwise(x):
    return repr(x)  # repr: NaN equals NaN, -0.0 differs from 0.0, every digit of a float


# --- off by default, and nothing changes when off ---------------------------------------------

@pytest.mark.parametrize("precision, optimizer, lr",
                         [("fp32", "adam", 3e-3), ("fp16", "sgd", 0.3), ("bf16", "adam", 3e-3)])
def test_options_are_off_by_default_and_records_are_bitwise_those_of_the_gpt_before_them(precision, optimizer,
                                                                                        lr, monkeypatch):
    # the oracle is the code from before LABKIT_PERTURB, which never nudges: compare unperturbed
    # (the nudge itself is tested in test_perturb.py)
    monkeypatch.delenv(PERTURB_ENV, raising=False)
    task = GPTTask(**TINY)
    assert (task.qk_norm, task.z_loss, task.logit_softcap, task.attn_softcap, task.attention) == \
        (False, 0.0, None, None, "sdpa")
    config = dict(precision=precision, optimizer=optimizer, lr=lr, steps=24, device="cpu", init_scale=2.0**16,
                  growth_interval=2, scheduler="cosine")
    before = run_experiment(ExperimentConfig(task=GPTTaskBefore(**TINY), **config))
    now = run_experiment(ExperimentConfig(task=task, **config))
    assert [before_logits(r) for r in now] == \
        [before_logits(r) for r in before]
    if precision == "fp16":
        assert now.skipped_steps, "the fp16 run should include the sawtooth's overflow skips"
    assert all(len(r.attn_logit_max) == 1 and math.isfinite(r.log_z) for r in now)  # and it measured
    assert [r.ce_loss for r in now] == [r.loss for r in now]  # no z-loss: the loss is the cross-entropy
    # the same initial weights as before, and qk_norm draws the same ones (a contrast on one seed)
    old, new, qk = GPTTaskBefore(**TINY).model(), task.model(), GPTTask(**TINY, qk_norm=True).model()
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))
    assert all(torch.equal(qk.state_dict()[k], v) for k, v in new.state_dict().items())


# --- the measurements ------------------------------------------------------------------------

def reference_measurements(model, idx):
    """The attention logits and log Z formed by hand from the model's weights, in float64."""
    model = copy.deepcopy(model).double()
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    maxes, entropies = [], []
    for block in model.h:
        a = block.attn
        h = block.ln_1(x)
        B, T, C = h.shape
        q, k, v = (t.view(B, T, a.n_head, -1).transpose(1, 2) for t in a.c_attn(h).split(C, dim=2))
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        logits = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])
        if a.softcap is not None:
            logits = a.softcap * torch.tanh(logits / a.softcap)
        logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        p = logits.softmax(-1)
        maxes.append(logits.max().item())
        entropies.append(min((-(p * p.log()).nan_to_num().sum(-1)).mean((0, 2)).tolist()))
        x = x + a.c_proj((p @ v).transpose(1, 2).reshape(B, T, C))
        x = x + block.mlp(block.ln_2(x))
    out = model.lm_head(model.ln_f(x))
    if model.logit_softcap is not None:
        out = model.logit_softcap * torch.tanh(out / model.logit_softcap)
    lse = out.logsumexp(-1)
    return maxes, entropies, lse.mean().item(), lse.square().mean().item()


@pytest.mark.parametrize("options", [{}, {"qk_norm": True}, {"attention": "explicit"},
                                     {"attention": "explicit", "attn_softcap": 0.5, "logit_softcap": 2.0}],
                         ids=["sdpa", "qk_norm", "explicit", "softcaps"])
def test_measurements_are_the_attention_logits_entropy_and_log_z_formed_by_hand(options):
    task = GPTTask(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=4, **options)
    model = task.model()
    with torch.no_grad():  # weights that give logits far from 0, so a wrong scale or mask shows
        for p in model.parameters():
            p.mul_(8.0 if p.dim() >= 2 else 1.0)
    x, _ = task.batch(0)
    silent = task.model()
    silent.load_state_dict(model.state_dict())
    silent.measure = False
    out = model(x)
    assert torch.equal(out, silent(x)), "measuring must not change the forward"
    assert silent.measurements().isnan().all(), "measure=False: nothing measured"
    values = model.measurements().tolist()
    maxes, entropies, log_z, log_z2 = reference_measurements(model, x)
    assert values[:2] == pytest.approx(maxes, rel=1e-4)
    assert values[2:4] == pytest.approx(entropies, rel=1e-4, abs=1e-6)
    assert values[4:] == pytest.approx([log_z, log_z2], rel=1e-5)
    if "attn_softcap" in options:
        assert 0.4 < max(values[:2]) <= 0.5 and out.abs().max() <= 2.0
    else:
        assert max(maxes) > 1.0
    assert model.measurements().isnan().all(), "a read resets them"
    model.eval()
    model(x)
    assert model.measurements().isnan().all(), "eval forwards (validation) are not measured"


HOST_READS = ("tolist", "item", "__float__", "__bool__", "__int__")  # what copies a tensor's value to Python


@pytest.mark.parametrize("sync_every", [None, 4], ids=["per_step", "sync_every_4"])
def test_the_measurements_ride_the_records_one_read(monkeypatch, sync_every):
    task = GPTTask(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=4)
    x0, _ = task.batch(0)
    expected = reference_measurements(task.model(), x0)  # step 0's forward: the initial weights

    def train(monitored):
        model = task.model()
        step = labkit.TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2), task.loss_fn,
                                sync_every=sync_every, hooks=[task.monitor(model)] if monitored else [])
        records, reads = [step(*task.batch(0))], [0]  # the first step does one-time work: not counted
        with monkeypatch.context() as m:
            for name in HOST_READS:
                def counted(self, *args, _read=getattr(torch.Tensor, name), **kwargs):  # noqa: B008 (binds this name's)
                    reads[0] += 1
                    return _read(self, *args, **kwargs)
                m.setattr(torch.Tensor, name, counted)
            records += [step(*task.batch(i)) for i in range(1, 8)]
            step.flush()
            records = [StepRecord(**r.to_dict()) for r in records]
        return records, reads[0]

    (plain, plain_reads), (measured, measured_reads) = train(False), train(True)
    assert measured_reads == plain_reads, "the monitor read the device on its own"
    assert [before_logits(r) for r in measured] == \
        [before_logits(r) for r in plain]
    maxes, entropies, log_z, log_z_sq = expected
    first = measured[0]
    assert list(first.attn_logit_max.values()) == pytest.approx(maxes, rel=1e-4)
    assert list(first.attn_entropy.values()) == pytest.approx(entropies, rel=1e-4)
    assert (first.log_z, first.log_z_sq) == pytest.approx((log_z, log_z_sq), rel=1e-5)
    assert all(r.ce_loss == r.loss and len(r.attn_logit_max) == 2 for r in measured)
    assert plain[0].attn_logit_max == {} and plain[0].log_z is None


def test_the_monitor_in_a_plain_loop_records_what_it_records_under_trainstep():
    from labkit.records import put

    task = GPTTask(**TINY, z_loss=1e-2)
    measured = ("attn_logit_max", "attn_entropy", "log_z", "log_z_sq", "ce_loss")

    def run(plain):
        model = task.model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = task.monitor(model)
        step = None if plain else labkit.TrainStep(model, opt, task.loss_fn, max_norm=None, hooks=[monitor])
        out = []
        for i in range(3):
            if step is not None:
                record = step(*task.batch(i))
                out.append({k: record.to_dict()[k] for k in measured})
                continue
            monitor.pre_step(None, i)
            opt.zero_grad()
            loss = task.loss_fn(model(task.batch(i)[0]), task.batch(i)[1])
            loss.backward()
            record = StepRecord(i, loss.item())
            for name, value in monitor.post_backward(None, i).items():  # a loop reads them when it likes
                put(record.fields, name, value.item())
            monitor.on_record(None, record)
            opt.step()
            out.append({k: record.to_dict()[k] for k in measured})
        return out

    plain, guarded = run(True), run(False)
    assert bitwise(plain) == bitwise(guarded) and plain[0]["attn_logit_max"] and plain[2]["log_z_sq"] > 0


def test_a_hook_measuring_a_field_the_record_lacks_is_refused_before_the_step_decides():
    class Typo(labkit.hooks.Hook):
        def post_backward(self, trainer, step):
            return {"attn_logit/h.0": torch.tensor(1.0)}

    task = GPTTask(**TINY)
    model = task.model()
    before = copy.deepcopy(model.state_dict())
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task.loss_fn, hooks=[Typo()])
    with pytest.raises(ValueError, match="'attn_logit' is declared by no hook"):
        step(*task.batch(0))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and step.step_count == 0


def test_measurements_of_several_forwards_before_a_read_are_the_worst_and_the_mean():
    task = GPTTask(**TINY)
    model = task.model()
    (xa, _), (xb, _) = task.batch(0), task.batch(1)
    model(xa)
    a = model.measurements()
    model(xb)
    b = model.measurements()
    model(xa)
    model(xb)
    both = model.measurements()
    assert both[0] == max(a[0], b[0]) and both[1] == min(a[1], b[1])
    assert both[2:].tolist() == pytest.approx(((a[2:] + b[2:]) / 2).tolist())


def test_z_loss_is_palms_and_the_record_carries_log_z_and_the_cross_entropy_apart():
    logits, y = torch.randn(3, 5, 7) * 4, torch.randint(0, 7, (3, 5))
    lse = torch.logsumexp(logits.double(), -1)
    expected = F.cross_entropy(logits.double().flatten(0, 1), y.flatten()) + 1e-2 * lse.square().mean()
    assert cross_entropy_with_z_loss(logits, y, 1e-2).item() == pytest.approx(expected.item(), rel=1e-6)
    task = GPTTask(**TINY, z_loss=1e-2)
    assert task.loss_fn(logits, y).item() == cross_entropy_with_z_loss(logits, y, 1e-2).item()
    config = ExperimentConfig(task=task, precision="fp32", optimizer="adam", lr=1e-2, steps=3, device="cpu")
    log = run_experiment(config)
    for r in log:
        assert r.loss - r.ce_loss == pytest.approx(1e-2 * r.log_z_sq, rel=1e-5) and r.loss - r.ce_loss > 0.1
        assert r.log_z_sq == pytest.approx(r.log_z**2, rel=0.05)  # log Z varies little over a batch here
    # the oracle: step 0's cross-entropy, of the initial weights on batch 0, computed apart
    x, y = task.batch(0)
    with torch.no_grad():
        logits = task.model().eval()(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert log[0].ce_loss == pytest.approx(ce, rel=1e-5)
    assert log[0].log_z_sq == pytest.approx(logits.logsumexp(-1).square().mean().item(), rel=1e-5)
    model = task.model()
    assert task.val_loss(model) == GPTTask(**TINY).val_loss(model), "validation: the cross-entropy alone"


@pytest.mark.parametrize("kwargs, message", [
    ({"z_loss": -1e-4}, "z_loss"), ({"z_loss": math.nan}, "z_loss"), ({"logit_softcap": 0}, "logit_softcap"),
    ({"attn_softcap": 50.0}, "attention='explicit'"), ({"attention": "flash"}, "attention must be one of"),
    ({"qk_norm": 1}, "qk_norm must be True or False"),
])
def test_bad_options_say_how_to_fix_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTTask(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"weight_decay": -0.1}, "weight_decay"), ({"betas": (0.9, 1.0)}, "betas"), ({"betas": 0.9}, "betas"),
    ({"warmup": 200, "steps": 100}, "warmup"), ({"warmup": -1}, "warmup"),
    ({"optimizer": "lion"}, "optimizer"),
])
def test_bad_optimizer_settings_say_how_to_fix_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExperimentConfig(**kwargs)


def test_warmup_is_nanogpts_linear_ramp_then_cosine_and_adamw_is_torchs():
    config = ExperimentConfig(steps=20, warmup=5, scheduler="cosine", lr=0.1, optimizer="adamw",
                              betas=(0.9, 0.95), weight_decay=0.01)
    w = torch.zeros(2, requires_grad=True)
    opt = make_optimizer(config, [w])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95)
    assert opt.defaults["weight_decay"] == 0.01 and opt.defaults["eps"] == 1e-8
    schedule, lrs = make_scheduler(config, opt), []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    # nanoGPT's get_lr: lr * (it + 1) / (warmup + 1), then 0.5 * (1 + cos(pi * ratio)) * lr, to min_lr = 0
    expected = [0.1 * (t + 1) / 6 if t < 5 else 0.05 * (1 + math.cos(math.pi * (t - 5) / 15))
                for t in range(20)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert make_scheduler(ExperimentConfig(steps=20), opt) is None
    assert isinstance(make_scheduler(ExperimentConfig(steps=20, scheduler="cosine"), opt),
                      torch.optim.lr_scheduler.CosineAnnealingLR)  # no warm-up: the schedule of before


# --- resume ---------------------------------------------------------------------------------

def _checkpoint(*objs):
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in objs], buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("options", [
    {"qk_norm": True}, {"z_loss": 1e-2}, {"logit_softcap": 5.0},
    {"attention": "explicit", "attn_softcap": 2.0},
    {"qk_norm": True, "z_loss": 1e-4, "weight_decay": 0.1, "warmup": 4},
], ids=["qk_norm", "z_loss", "logit_softcap", "attn_softcap", "all+adamw_wd_warmup"])
def test_every_option_resumes_exactly_from_state_dict(options):
    options = dict(options)
    opt_options = {k: options.pop(k) for k in ("weight_decay", "warmup") if k in options}
    task = GPTTask(**TINY, **options)
    config = ExperimentConfig(task=task, precision="fp32", optimizer="adamw", lr=3e-2, betas=(0.9, 0.95),
                              steps=12, scheduler="cosine", **opt_options)

    def fresh():
        model = task.model()
        opt = make_optimizer(config, model.parameters())
        return labkit.TrainStep(model, opt, task.loss_fn, scheduler=make_scheduler(config, opt), max_norm=1.0,
                                hooks=[task.monitor(model)])

    def run(step, start, n):
        return [step(*task.batch(i)) for i in range(start, start + n)]

    full = fresh()
    straight = run(full, 0, 12)
    first = fresh()
    run(first, 0, 6)
    saved = _checkpoint(first, first.model, first.optimizer, first.scheduler)
    resumed = fresh()
    for obj, state in zip((resumed, resumed.model, resumed.optimizer, resumed.scheduler), saved):
        obj.load_state_dict(state)
    again = run(resumed, 6, 6)
    assert [bitwise(r.to_dict()) for r in again] == [bitwise(r.to_dict()) for r in straight[6:]]
    weights = zip(resumed.model.state_dict().values(), full.model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in weights)
    assert any(r.attn_logit_max for r in again)


# --- the phenomena ---------------------------------------------------------------------------

def test_attention_logits_grow_without_qk_norm_and_qk_norm_lowers_the_lr_sensitivity():
    # one layer of the lesson's GPT, 200 steps: the smallest run where the loss curves part too
    recipe = Recipe(**{**LESSON, "n_layer": 1}, steps=200, val_batches=8)
    lrs = [3e-3, 0.1, 0.3]
    points = sweep(recipe, lrs, ["baseline", "qk_norm"])
    by = {(p.variant, p.lr): p for p in points}
    assert by["baseline", 0.3].attn_logit_max > 100 * by["qk_norm", 0.3].attn_logit_max
    assert by["baseline", 0.3].attn_logit_max > 1e3 > 100 > by["qk_norm", 0.3].attn_logit_max
    s = summarize(points)
    assert s["qk_norm"]["sensitivity"] < s["baseline"]["sensitivity"] - 0.03
    assert by["qk_norm", 0.3].final_loss < by["baseline", 0.3].final_loss
    assert abs(by["qk_norm", 3e-3].final_loss - by["baseline", 3e-3].final_loss) < 0.1  # a tie at a good lr


def test_z_loss_keeps_log_z_near_zero_where_the_baseline_drifts():
    recipe = Recipe(**TINY, steps=100, val_batches=1)
    base = run_point(recipe, "baseline", 3e-2)[1]
    pinned = run_point(dataclasses.replace(recipe, z_loss=0.1), "z_loss", 3e-2)[1]
    late = slice(50, None)
    assert all(abs(r.log_z) < 0.5 for r in pinned[late])
    assert all(r.log_z > 3.0 for r in base[late])
    assert abs(pinned[0].log_z - base[0].log_z) < 1e-6  # the same start: ln(vocabulary) with logits near 0


def _fp16_steps(variant, lr, steps, until=None, triage=False):
    """Train the lesson's GPT in fp16, explicit attention, on the 100-step schedule, for ``steps`` steps."""
    recipe = Recipe(**LESSON, steps=100, precision="fp16", attention="explicit", triage=triage)
    config = recipe.config(variant, lr)
    assert config.triage is triage
    task = config.task
    model = task.model()
    opt = make_optimizer(config, model.parameters())
    scaler = labkit.GradScaler("cpu", init_scale=config.init_scale, growth_interval=config.growth_interval)
    step = labkit.TrainStep(model, opt, task.loss_fn, precision="fp16", scaler=scaler, max_norm=1.0,
                            scheduler=make_scheduler(config, opt), hooks=[task.monitor(model)],
                            skip_alarm=None, triage=config.triage)
    records = []
    for i in range(steps):
        records.append(step(*task.batch(i)))
        if until is not None and until(records[-1]):
            break
    return task, model, step, records


def test_with_triage_the_gpts_fp16_overflow_reads_forward_overflow_and_keeps_what_the_step_measured():
    loss_skip = lambda r: r.reason in LOSS  # noqa: E731  # backward overflows come first, as in the test below
    task, model, step, records = _fp16_steps("baseline", 1.0, 60, until=loss_skip, triage=True)
    record = records[-1]
    assert record.reason == "forward_overflow", f"step {record.step}: {record.reason}"
    assert record.next_scale == record.scale and not math.isfinite(record.loss)
    assert record.attn_logit_max["h.0"] == math.inf  # the fp32 re-run's measurements stay out of the record
    assert "forward overflowed" in describe(record, 1.0)[0]


def test_fp16_forward_overflow_skips_losses_that_the_fp32_forward_of_the_same_step_does_not_have():
    overflowed = lambda r: r.reason == "nonfinite_loss"  # noqa: E731
    task, model, step, records = _fp16_steps("baseline", 1.0, 60, until=overflowed)
    record = records[-1]
    assert record.reason == "nonfinite_loss", "no forward overflow in 60 steps at lr 1"
    assert not math.isfinite(record.loss) and record.next_scale == record.scale  # the scale cannot help
    assert record.attn_logit_max["h.0"] == math.inf  # the measurement names the overflow
    assert "attention logits inf in h.0" in describe(record, 1.0)[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the fp32 forward of the same step, same weights (the skip left them), same batch: finite
    x, y = task.batch(record.step)
    with torch.no_grad():
        loss32 = task.loss_fn(model(x), y)
        q_k = []
        h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
        for block in model.h:
            q, k, _ = block.attn.c_attn(block.ln_1(h)).split(h.shape[-1], dim=2)
            B, T, C = q.shape
            q, k = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (q, k))
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            q_k.append((q @ k.transpose(-2, -1)).masked_fill(~causal, 0).max())
            h = block(h)
    model.measurements()
    assert torch.isfinite(loss32)
    assert max(q_k) > 65504  # q.k before the 1/sqrt(d): past fp16's largest number
    # and it storms: the next steps skip too, the scale untouched
    after = [step(*task.batch(j)) for j in range(record.step + 1, record.step + 9)]
    assert sum(r.reason == "nonfinite_loss" for r in after) >= 6
    # each loss skip leaves the scale where it was (a backward overflow among them may halve it:
    # whether one does depends on the machine's bits, as under LABKIT_PERTURB=1)
    assert all(r.next_scale == r.scale for r in after if r.reason == "nonfinite_loss")


def test_qk_norm_keeps_the_steps_where_the_baseline_overflows_in_fp16_finite():
    base = _fp16_steps("baseline", 0.3, 45, until=lambda r: r.reason == "nonfinite_loss")[3]
    assert base[-1].reason == "nonfinite_loss"
    qk = _fp16_steps("qk_norm", 0.3, 45)[3]
    assert not [r for r in qk if r.reason == "nonfinite_loss"]
    assert max(v for r in qk for v in r.attn_logit_max.values()) < 100


# --- records, trackers, events -----------------------------------------------------------------

def test_the_measurements_round_trip_through_jsonl_and_csv_and_reach_the_trackers(tmp_path):
    r = StepRecord(7, math.nan, skipped=True, reason="nonfinite_loss",
                   attn_logit_max={"h.0": math.inf, "h.1": 80.5},
                   attn_entropy={"h.0": math.nan, "h.1": 0.25}, log_z=5.5, ce_loss=math.nan)
    log = StepLog([r, StepRecord(8, 2.0, attn_logit_max={"h.0": 3.0}, log_z=-0.25, ce_loss=1.75)])
    log.to_jsonl(tmp_path / "log.jsonl")
    back = StepLog.read_jsonl(tmp_path / "log.jsonl")
    assert bitwise([x.to_dict() for x in back]) == bitwise([x.to_dict() for x in log])
    first = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert first["attn_logit_max"]["h.0"] == "Infinity"
    log.to_csv(tmp_path / "log.csv")
    rows = list(csv.DictReader((tmp_path / "log.csv").read_text().splitlines()))
    assert rows[0]["attn_logit_max"] == "h.0=inf;h.1=80.5" and rows[1]["log_z"] == "-0.25"
    metrics = row(r)
    assert metrics.scalars["attn/logit_max/h.0"] == math.inf
    assert metrics.scalars["attn/entropy_min/h.1"] == 0.25
    assert metrics.scalars["logits/log_z"] == 5.5 and "train/ce_loss" in row(log[1]).scalars
    assert describe(r, 1.0) == [
        "step    7  SKIP  nonfinite_loss: loss is not finite: backward skipped, scale untouched; "
        "attention logits inf in h.0: the forward overflowed, no loss scale can help"]


def test_the_monitor_hands_the_step_what_the_forward_measured_and_refuses_other_models():
    task = GPTTask(**TINY)
    model = task.model()
    model(task.batch(0)[0])
    expected = model.measurements(reset=False).tolist()
    monitor = LogitMonitor(model)
    measures = monitor.post_backward(None, 0)
    assert all(t.dim() == 0 for t in measures.values())  # device tensors: the step reads them
    assert {k: t.item() for k, t in measures.items()} == {
        "attn_logit_max/h.0": expected[0], "attn_entropy/h.0": expected[1], "log_z": expected[2],
        "log_z_sq": expected[3]}
    model(task.batch(1)[0])
    monitor.pre_step(None, 1)  # a forward outside the step (the lesson's fp32 recompute) is forgotten
    assert model.measurements().isnan().all()
    record = StepRecord(0, 3.0, log_z_sq=4.0)
    LogitMonitor(model, z_loss=0.25).on_record(None, record)
    assert record.ce_loss == 2.0  # the loss less 0.25 * mean log Z**2
    with pytest.raises(TypeError, match="labkit GPT"):
        LogitMonitor(torch.nn.Linear(2, 2))
    assert GPTTask(measure=False).monitor(model) is None
    config = ExperimentConfig(task=GPTTask(**TINY, measure=False), precision="fp32", steps=2, device="cpu")
    log = run_experiment(config)
    assert all(r.attn_logit_max == {} and r.log_z is None and r.ce_loss is None for r in log)
    assert "logits/log_z" not in row(log[0]).scalars  # not measured: nothing in the trackers


# --- the sweep ---------------------------------------------------------------------------------

def test_lr_sensitivity_is_the_papers_mean_gap_to_the_best_capped_at_the_initial_loss():
    final = {1e-3: 3.0, 1e-2: 2.5, 1e-1: 6.0, 1.0: math.inf}
    # min(loss, 5) - 2.5 for each: 0.5, 0, 2.5, 2.5
    assert lr_sensitivity(final, init_loss=5.0) == pytest.approx(5.5 / 4)
    assert lr_sensitivity({1e-3: 2.0, 1e-2: 2.0}, 5.0) == 0.0
    assert stable_lrs(final, tolerance=0.5) == [1e-3, 1e-2]
    assert lr_grid(1e-4, 1, 9) == [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0]
    with pytest.raises(ValueError, match="count >= 2"):
        lr_grid(1e-3, 1e-1, 1)


def test_the_sweep_command_writes_csv_png_and_logs_and_resumes_a_half_finished_grid(tmp_path, capsys):
    args = ["--lrs", "1e-2,1e-1", "--variants", "baseline,qk_norm", "--steps", "4", "--layers", "1",
            "--width", "16", "--heads", "2", "--context", "8", "--batch", "2", "--device", "cpu",
            "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("final loss") == 4 and "LR sensitivity" in out
    rows = list(csv.DictReader((tmp_path / "sweep.csv").read_text().splitlines()))
    assert [(r["variant"], float(r["lr"])) for r in rows] == [("baseline", 0.01), ("baseline", 0.1),
                                                              ("qk_norm", 0.01), ("qk_norm", 0.1)]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert len(StepLog.read_jsonl(tmp_path / "runs" / "qk_norm_lr0.1_seed0.jsonl")) == 4
    # stop it half-way: the third row gone, the last torn mid-number (it still parses: it must run again)
    lines = (tmp_path / "sweep.csv").read_text().splitlines()
    (tmp_path / "sweep.csv").write_text("\n".join(lines[:3]) + "\n" + lines[4][:-1])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "resuming: 2 of 4 points" in out and out.count("final loss") == 2
    again = list(csv.DictReader((tmp_path / "sweep.csv").read_text().splitlines()))
    point = lambda r: (r["variant"], r["lr"], r["final_loss"], r["attn_logit_max"])  # noqa: E731
    assert [point(r) for r in again] == [point(r) for r in rows]  # the same numbers as the first time
    # another recipe in the same folder is refused, with the way out
    assert main([a if a != "4" else "5" for a in args]) == 2
    assert "another recipe (differs in ['steps'])" in capsys.readouterr().err
    # a sweep.json written before a recipe field existed resumes, the field at its default
    meta = json.loads((tmp_path / "sweep.json").read_text())
    del meta["triage"]
    (tmp_path / "sweep.json").write_text(json.dumps(meta))
    assert main(args) == 0 and "resuming: 4 of 4 points" in capsys.readouterr().out
    assert main([a if a != "4" else "5" for a in args]) == 2  # and another one is still refused
    with pytest.raises(SystemExit) as e:
        main(["--variants", "adam"])
    assert e.value.code == 2


def test_the_sweep_runs_the_papers_output_logit_condition_untied_no_decay_constant_lr(tmp_path, capsys):
    # Wortsman et al. §3.1.2: output-logit divergence in models with no weight decay, late in training;
    # their models have an untied head (§2.1). The flags reach the recipe, the task and the optimizer.
    args = ["--lrs", "0.1", "--variants", "qk_norm,qk_norm+z_loss", "--steps", "20", "--layers", "1",
            "--width", "16", "--heads", "2", "--context", "8", "--batch", "2", "--device", "cpu",
            "--untied-head", "--weight-decay", "0", "--schedule", "constant", "--warmup", "0.05",
            "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "constant lr after 5% warm-up, weight decay 0, untied head" in out
    meta = json.loads((tmp_path / "sweep.json").read_text())
    settings = (meta["tie_head"], meta["schedule"], meta["weight_decay"], meta["warmup"])
    assert settings == (False, "constant", 0.0, 0.05)
    recipe = Recipe(**meta)
    config = recipe.config("qk_norm+z_loss", 0.1)
    assert config.scheduler is None and config.weight_decay == 0.0 and config.warmup == 1
    assert config.task.tie_head is False and config.task.z_loss == 1e-4
    model = config.task.model()
    assert model.lm_head.weight is not model.wte.weight
    log = StepLog.read_jsonl(tmp_path / "runs" / "qk_norm_lr0.1_seed0.jsonl")
    assert [r.lr for r in log[1:]] == [0.1] * 19  # held after the one warm-up step
    with pytest.raises(ValueError, match="schedule must be one of"):
        Recipe(schedule="linear")


def test_the_sweep_figure_marks_overflows_and_gives_no_lr_sensitivity_for_one_lr():
    from labkit.lab.sweep import Point, plot_sweep

    def point(variant, lr, loss, logit):
        return Point(variant, lr, 0, loss, 5.0, loss, logit, logit, 4.0, 0, -1, 0.0, 1.0)

    points = [point("baseline", 0.01, 2.4, 50.0), point("baseline", 0.1, 2.9, math.inf),
              point("qk_norm", 0.1, 2.5, 9.0)]
    fig = plot_sweep(points)
    loss_ax, logit_ax = fig.axes[:2]
    labels = loss_ax.get_legend_handles_labels()[1]
    assert "baseline (LR sensitivity 0.25)" in labels and "qk_norm (one lr: no LR sensitivity)" in labels
    marks = [line for line in logit_ax.lines if line.get_label() == "not finite (overflow)"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [0.1]  # the baseline's inf at 0.1, on the edge
    assert not [line for line in loss_ax.lines if line.get_label() == "not finite (overflow)"]


@pytest.mark.parametrize("flag, value, message", [("--heads", "3", "multiple of n_head"),
                                                  ("--layers", "0", "n_layer must be an int >= 1"),
                                                  ("--context", "0", "block_size must be an int >= 1")])
def test_a_model_size_that_cannot_be_built_is_refused_before_the_sweep_writes_anything(tmp_path, capsys, flag,
                                                                                     value, message):
    with pytest.raises(SystemExit) as e:
        main([flag, value, "--out", str(tmp_path / "grid"), "--no-progress"])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "grid").exists()
