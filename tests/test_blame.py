"""Where a non-finite gradient started: backward order (``labkit.blame``) against registration order.

Each test injects the non-finite value at a known place (a tensor hook on one module's output
gradient: the value enters backward there and spreads to every layer upstream), so the oracle is
the place chosen; registration order (``labkit.clip.first_nonfinite`` over ``named_parameters``)
is computed alongside to show it would blame the wrong layer.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch import nn

from labkit import ToyTask, TrainStep
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.blame import BackwardOrder
from labkit.clip import first_nonfinite, per_tensor_norms
from labkit.lab import describe
from labkit.step.record import forensics
from labkit.tasks import GPTTask


def poison_output(module: nn.Module, value: float, when=lambda: True):
    """Make the gradient arriving at ``module``'s output hold ``value`` (inf or NaN) in one entry."""

    def hook(mod, args, out):
        if when():
            def poison(g):
                g = g.clone()
                g.view(-1)[0] = value
                return g
            out.register_hook(poison)

    return module.register_forward_hook(hook)


def registration_order_culprit(model: nn.Module) -> str | None:
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    return first_nonfinite([g for _, g in named], [n for n, _ in named])


def order_of(step):
    """The step's ``BackwardOrder``: one of its default hooks."""
    (order,) = [h for h in step.hooks.members if isinstance(h, BackwardOrder)]
    return order


def step_on(task, **kw):
    """Return ``(task, model, step)``: a fresh model of ``task`` under a quiet SGD ``TrainStep``."""
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                     hooks=[SkipAlarm(None), ClipAlarm(None)], **kw)
    return task, model, step


def toy_step(**kw):
    return step_on(ToyTask(), **kw)


def tiny_gpt():
    return GPTTask(n_layer=3, n_head=2, n_embd=16, block_size=8, batch_size=2)


def gpt_step(**kw):
    return step_on(tiny_gpt(), **kw)


def test_an_overflow_at_the_output_layer_is_blamed_on_the_head_not_the_input_layer():
    task, model, step = toy_step()
    poison_output(model[4], math.inf)
    record = step(*task.batch(0))
    assert record.skipped and record.reason == "nonfinite_grad"
    assert not any(math.isfinite(v) for _, v in record.top_grads)  # the inf reached every layer
    assert registration_order_culprit(model) == "0.weight"  # what registration order would say
    assert record.first_nonfinite in ("4.weight", "4.bias") and record.culprit_module == "4"
    assert describe(record, 1.0) == ["step    0  SKIP  nonfinite_grad: gradient not finite "
                                      f"(first in backward: {record.first_nonfinite})"]


def test_a_nan_in_a_middle_activation_gradient_is_blamed_on_that_block():
    task, model, step = toy_step()
    poison_output(model[2], math.nan)  # the middle Linear's output: the head's gradients stay finite
    record = step(*task.batch(0))
    finite = {n: bool(torch.isfinite(p.grad).all()) for n, p in model.named_parameters()}
    assert finite == {"0.weight": False, "0.bias": False, "2.weight": False, "2.bias": False,
                      "4.weight": True, "4.bias": True}
    assert registration_order_culprit(model) == "0.weight"
    assert record.first_nonfinite in ("2.weight", "2.bias") and record.culprit_module == "2"


def test_a_nan_in_a_middle_transformer_block_is_blamed_on_that_block_not_the_tied_embedding():
    # wte's gradient is non-finite too (the NaN reaches the embedding's use), but the head's use of
    # the tied weight saw finite gradients: the block is where it started
    task, model, step = gpt_step()
    poison_output(model.h[1], math.nan)
    record = step(*task.batch(0))
    assert record.skipped and not torch.isfinite(model.wte.weight.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in model.h[2].parameters())
    assert registration_order_culprit(model) == "wte.weight"
    assert record.culprit_module.startswith("h.1."), record.first_nonfinite
    assert record.first_nonfinite.startswith("h.1.")


def test_the_tied_head_weight_is_blamed_on_lm_head():
    task, model, step = gpt_step()
    poison_output(model.lm_head, math.inf)
    record = step(*task.batch(0))
    assert registration_order_culprit(model) == "wte.weight"  # one tensor, named by its first owner
    assert (record.first_nonfinite, record.culprit_module) == ("wte.weight", "lm_head")
    assert describe(record, 1.0)[0].endswith("(first in backward: wte.weight, as used by lm_head)")


@pytest.mark.parametrize("sync_every, module", [(None, "wte"), (2, "lm_head")], ids=["read", "deferred"])
def test_the_tied_weight_poisoned_at_the_embedding_is_placed_there_unless_the_record_was_deferred(
    sync_every, module
):
    """Only the embedding's use of the tied weight saw a NaN: a record read at its step places the weight
    there. A deferred record, filled by a flush that one rank may start alone (a collective there could
    hang), keeps it at its first use in backward, the head (labkit.step.record.forensics)."""
    task, model, step = gpt_step(sync_every=sync_every)
    poison_output(model.wte, math.nan)
    record = step(*task.batch(0))
    assert record.skipped
    assert [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()] == ["wte.weight"]
    assert (record.first_nonfinite, record.culprit_module) == ("wte.weight", module)


def test_the_tied_head_weight_alone_overflowing_is_blamed_on_lm_head():
    # the head's share of the tied weight overflows while every activation gradient stays finite (04's
    # sawtooth): nothing upstream is non-finite, the head is where it started
    task = tiny_gpt()
    model = task.model()
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    model.lm_head.weight.register_hook(lambda g: g * math.inf)  # the whole tied gradient, on completion
    x, y = task.batch(0)
    task.loss_fn(model(x), y).backward()
    named = [(n, p.grad) for n, p in model.named_parameters()]
    bad = [n for n, g in named if not torch.isfinite(g).all()]
    assert bad == ["wte.weight"]
    found = forensics(named, per_tensor_norms([g for _, g in named], 2.0), None, order.positions, order.uses)
    assert (found.first_nonfinite, found.culprit_module) == ("wte.weight", "lm_head")


def test_accumulation_keeps_the_first_micro_batchs_order():
    task, model, step = toy_step(accumulation_steps=2)
    _, one_model, one = toy_step()
    calls = {"n": 0}

    def second_micro_batch():
        calls["n"] += 1
        return calls["n"] == 2

    poison_output(model[4], math.inf, when=second_micro_batch)  # the head overflows in micro-batch 2 only
    record = step(*task.batch(0))
    one(*task.batch(0))
    assert order_of(step).positions == order_of(one).positions  # the first micro-batch's order
    ranks = sorted(order_of(step).positions.items(), key=lambda kv: kv[1][0])
    assert [name for name, _ in ranks][:2] in (["4.bias", "4.weight"], ["4.weight", "4.bias"])
    assert [module for _, (_, module) in ranks] == ["4", "4", "2", "2", "0", "0"]
    assert record.skipped and record.culprit_module == "4"


def test_a_plain_torch_loop_with_backward_order_alone():
    task = ToyTask()
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    order = BackwardOrder()
    order.attach(model)
    now = {"step": 0}
    poison_output(model[2], math.inf, when=lambda: now["step"] == 2)
    culprits = []
    for step in range(4):
        order.pre_step(None, step)
        now["step"] = step
        opt.zero_grad()
        x, y = task.batch(step)
        task.loss_fn(model(x), y).backward()
        named = [(n, p.grad) for n, p in model.named_parameters()]
        norms = per_tensor_norms([g for _, g in named], 2.0)
        found = forensics(named, norms, None, order.positions, order.uses)
        culprits.append(found.culprit_module)
        if found.first_nonfinite is None:
            opt.step()
    assert culprits == [None, None, "2", None]
    assert sorted(order.positions, key=lambda n: order.positions[n][0])[-2:] in (["0.bias", "0.weight"],
                                                                               ["0.weight", "0.bias"])
    assert repr(order.positions) == repr(dict(order.positions)) and repr(order) == "BackwardOrder()"
    order.detach()
    order.pre_step(None, 4)
    model(task.batch(4)[0]).sum().backward()
    assert order.positions == {}  # unhooked


def test_the_fp16_sawtooth_names_the_tensor_the_probe_saw_overflow_first():
    """04's sawtooth (its settings, 30 steps): on every backoff the record's culprit is the first weight
    gradient, in the probe's backward-order trace, whose value times the scale passed fp16's 65504."""
    from labkit.lab.experiment import ExperimentConfig, run_experiment
    from labkit.lab.gradients import GradientProbe, Probed
    from labkit.tasks import make_task

    probe = GradientProbe()
    log = run_experiment(ExperimentConfig(task=Probed(make_task("gpt"), probe), optimizer="adam", lr=3e-3,
                                          steps=30, device="cpu", precision="fp16", init_scale=2.0**16,
                                          growth_interval=3))
    skips = [r for r in log if r.skipped]
    assert len(skips) >= 3 and all(r.reason == "nonfinite_grad" for r in skips)
    modules = set()
    for r in skips:
        i = probe.steps.index(r.step)
        s = probe.loss_scale[i]
        first = next(g.name for g in probe.trace[i]
                     if g.kind == "weight" and not (math.isfinite(g.amax) and g.amax * s < 65520))
        if first.endswith(" (this use)"):  # the tied weight's share computed by that module
            expected = ("wte.weight", first.removesuffix(".weight (this use)"))
        else:
            expected = (first.split(" = ")[0], first.split(" = ")[0].rpartition(".")[0])
        assert (r.first_nonfinite, r.culprit_module) == expected, r.step
        modules.add(r.culprit_module)
    assert "lm_head" in modules  # the head's share of the tied weight overflowed, not the embedding


@pytest.mark.parametrize("bad", ["head", "middle"])
def test_deferred_records_name_the_same_culprit(bad):
    task, model, step = toy_step(sync_every=2)
    _, ref_model, ref = toy_step()
    for m in (model, ref_model):
        poison_output(m[4] if bad == "head" else m[2], math.inf)
    records = [step(*task.batch(i)) for i in range(2)]
    expected = [ref(*task.batch(i)) for i in range(2)]
    assert [(r.first_nonfinite, r.culprit_module) for r in records] == \
        [(r.first_nonfinite, r.culprit_module) for r in expected]
    assert expected[0].culprit_module == ("4" if bad == "head" else "2")


def test_the_hooks_keep_no_step_output_alive():
    """A hook on the graph must not hold the output it hooks (a cycle through C++ that no gc frees)."""
    import gc
    import weakref

    task, model, step = gpt_step()
    outputs = []
    model.lm_head.register_forward_hook(lambda mod, args, out: outputs.append(weakref.ref(out)))
    for i in range(3):
        step(*task.batch(i))
    gc.collect()
    assert len(outputs) == 3 and all(ref() is None for ref in outputs)


def test_a_dropped_trainstep_takes_its_hooks_off_the_model():
    import gc

    task = tiny_gpt()
    model = task.model()
    for _ in range(3):  # three runs on one model, as a lesson's re-runs would
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                         hooks=[SkipAlarm(None), ClipAlarm(None)])
        step(*task.batch(0))
        del step
        gc.collect()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn)
    assert len(model.lm_head._forward_hooks) == 1
    assert len(model.wpe.weight._post_accumulate_grad_hooks) == 1
    del step
    gc.collect()
    assert not model.lm_head._forward_hooks and not model.wpe.weight._post_accumulate_grad_hooks


def test_parameters_unfrozen_in_place_are_put_in_backward_order():
    task = ToyTask()
    model = task.model()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model[4].parameters():
        p.requires_grad_(True)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                     hooks=[SkipAlarm(None), ClipAlarm(None)])
    step(*task.batch(0))
    for p in model.parameters():  # unfrozen in place: the optimizer already holds them
        p.requires_grad_(True)
    poison_output(model[2], math.inf)
    record = step(*task.batch(1))
    assert record.skipped and registration_order_culprit(model) == "0.weight"
    assert record.culprit_module == "2"


class TiedNet(nn.Module):
    """pre -> wte -> mid -> lm_head, wte and lm_head sharing one weight (a tied head, a layer before it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.wte, self.mid = nn.Linear(3, 3), nn.Linear(3, 3, bias=False), nn.Linear(3, 3)
        self.lm_head = nn.Linear(3, 3, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        return self.lm_head(self.mid(self.wte(self.pre(x))))


def test_a_tied_weights_uses_in_a_plain_loop():
    """Backward order with a tied weight, no TrainStep: the weight at its first use (``lm_head``), the
    layer before its second use still placed, each use's largest |output gradient| (1 for a sum), and a
    NaN that a user's hook put into the head's output gradient counted at the head."""
    model = TiedNet()
    order = BackwardOrder()
    order.attach(model)
    x = torch.ones(2, 3)
    with torch.no_grad():  # an evaluation forward: nothing to hook
        model(x)
    order.pre_step(None, 0)
    model(x).sum().backward()
    ranks = {n: r for n, (r, _) in order.positions.items()}
    assert set(ranks) == {"wte.weight", "mid.weight", "mid.bias", "pre.weight", "pre.bias"}
    assert ranks["wte.weight"] < min(ranks["mid.weight"], ranks["mid.bias"]) \
        <= max(ranks["mid.weight"], ranks["mid.bias"]) < min(ranks["pre.weight"], ranks["pre.bias"])
    assert order.positions["wte.weight"] == (0, "lm_head")
    uses = order.uses["wte.weight"]
    assert set(uses) == {"lm_head", "wte"} and uses["lm_head"][1].item() == 1.0
    order.pre_step(None, 1)
    out = model(x)
    out.register_hook(lambda g: torch.full_like(g, math.nan))  # a hook of the user's, after labkit's
    out.sum().backward()
    assert math.isnan(order.uses["wte.weight"]["lm_head"][1].item())


def test_past_its_bound_the_order_keeps_the_latest_gradients_and_every_use_a_rank(monkeypatch):
    """The order holds at most FIRED_MAX entries a step (memory stays bounded however many micro-batches):
    past it the oldest go, and a use recorded once the bound is reached still gets a rank, after the rest."""
    import labkit.blame

    monkeypatch.setattr(labkit.blame, "FIRED_MAX", 3)
    model = TiedNet()
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    model(torch.ones(2, 3)).sum().backward()
    ranks = {n: r for n, (r, _) in order.positions.items()}
    assert sorted(ranks.values()) == [0, 1, 2] and {"pre.weight", "pre.bias"} <= set(ranks)  # the last three
    uses = {path: rank for path, (rank, _) in order.uses["wte.weight"].items()}
    assert uses == {"lm_head": 0, "wte": 3}  # the second use, past the bound: after every kept gradient


def test_a_later_micro_batchs_nan_counts_at_that_use():
    """Two micro-batches in one step: the order stays the first's, and a NaN in the second's output
    gradient at the head makes that use non-finite (the largest |gradient| over both)."""
    model = TiedNet()
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    model(torch.ones(2, 3)).sum().backward()
    first = dict(order.positions)
    out = model(torch.ones(2, 3))
    out.register_hook(lambda g: torch.full_like(g, math.nan))
    out.sum().backward()
    assert dict(order.positions) == first
    uses = order.uses["wte.weight"]
    assert math.isnan(uses["lm_head"][1].item())


def test_positions_read_mid_step_are_worked_out_again_after_more_gradients():
    """Reading ``positions`` after part of a step's backward does not freeze them: the next read has
    the rest."""
    model = TiedNet()
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    model.mid(torch.ones(2, 3)).sum().backward()
    assert set(order.positions) == {"mid.weight", "mid.bias"}
    model(torch.ones(2, 3)).sum().backward()
    assert set(order.positions) == {"wte.weight", "mid.weight", "mid.bias", "pre.weight", "pre.bias"}


def test_a_tied_use_whose_output_is_the_weight_itself():
    """A module that returns its (tied) weight as it is, a leaf with no node: its use is marked by a hook on
    the weight, which sees the weight's whole gradient."""

    class Table(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self):
            return self.weight

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3, bias=False)
            self.table = Table(self.lin.weight)

        def forward(self, x):
            return self.lin(x) @ self.table().T

    model = Net()
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    model(torch.ones(2, 3)).sum().backward()
    uses = order.uses["lin.weight"]
    assert set(uses) == {"lin", "table"}
    assert uses["table"][1].item() == model.lin.weight.grad.abs().max().item()


def test_a_compiled_regions_gradients_are_ranked_as_one():
    """A compiled module is one node to autograd: its gradients take one rank, the number of gradients placed
    before the region's first, whether compiled in place (``module.compile()``) or wrapped (``torch.compile``:
    ``_orig_mod``); two regions keep two ranks."""
    both = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    both[0].compile(backend="eager")
    both[2].compile(backend="eager")
    wrapped = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    wrapped[2] = torch.compile(wrapped[2], backend="eager")
    for model, want in [
        (both, {"2.bias": (0, "2"), "2.weight": (0, "2"), "0.bias": (2, "0"), "0.weight": (2, "0")}),
        (wrapped, {"2._orig_mod.bias": (0, "2._orig_mod"), "2._orig_mod.weight": (0, "2._orig_mod"),
                   "0.bias": (2, "0"), "0.weight": (3, "0")}),
    ]:
        order = BackwardOrder()
        order.attach(model)
        order.pre_step(None, 0)
        model(torch.ones(2, 3)).sum().backward()
        assert dict(order.positions) == want


def test_a_fresh_order_reads_empty_and_starts_a_step_before_any_attach():
    """Before attach there is nothing to order: empty mappings; a step start (a trainer's too) is a no-op."""
    order = BackwardOrder()
    assert dict(order.positions) == {} and dict(order.uses) == {}
    layer = nn.Linear(2, 1)
    order.pre_step(types.SimpleNamespace(optimizer=torch.optim.SGD(layer.parameters(), lr=0.1)), 0)
    assert dict(order.positions) == {} and order.model is None


def test_a_tied_weight_inside_a_compiled_region_gets_no_per_use_hooks():
    """No hooks inside a compiled graph: the tied weight is ranked with its region, and no use is recorded."""
    model = TiedNet()
    model.wte.compile(backend="eager")
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    model(torch.ones(2, 3)).sum().backward()
    assert dict(order.uses) == {} and "wte.weight" in order.positions


def test_parameters_swapped_in_for_frozen_ones_are_hooked_at_the_next_step():
    """Progressive unfreezing with the count unchanged: one layer frozen, another unfrozen and given to the
    optimizer in its place. The order follows what trains now (pre_step hooks a frozen parameter unfrozen)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    step = TrainStep(model, opt, torch.nn.functional.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    first = step(x, y)
    for p in model[2].parameters():
        p.requires_grad_(False)
    for p in model[0].parameters():
        p.requires_grad_(True)
    opt.param_groups[0]["params"] = list(model[0].parameters())
    model.zero_grad(set_to_none=True)
    poison_output(model[0], math.nan)
    second = step(x, y)
    assert not first.skipped
    assert second.skipped and second.culprit_module == "0"
    assert second.first_nonfinite in ("0.weight", "0.bias")
    assert set(step.hooks.gradient_order(step, 1)[0]) == {"0.weight", "0.bias"}


def test_a_layer_added_mid_run_and_given_to_the_optimizer_is_hooked_at_the_next_step():
    """A module appended to the model and handed to the optimizer (``add_param_group``) after the hooks were
    attached: nothing was frozen, so the new group is what tells pre_step to hook again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, torch.nn.functional.mse_loss)
    x = torch.randn(8, 4)
    step(x, torch.randn(8, 4))
    model.append(nn.Linear(4, 1))
    opt.add_param_group({"params": list(model[2].parameters())})
    model.zero_grad(set_to_none=True)
    step(x, torch.randn(8, 1))
    positions = step.hooks.gradient_order(step, 1)[0]
    assert sorted(positions, key=lambda n: positions[n][0]) == ["2.bias", "2.weight", "0.bias", "0.weight"]


def test_a_whole_compiled_model_is_one_region_every_gradient_ranked_first():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    model.compile(backend="eager")
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    model(torch.ones(2, 3)).sum().backward()
    assert {rank for rank, _ in order.positions.values()} == {0} and len(order.positions) == 4
