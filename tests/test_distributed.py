"""labkit under torch.distributed: two gloo processes on loopback, a single process as the oracle.

One spawn runs every scenario (starting a process costs a torch import), each rank saves what
it saw, and the tests below compare the ranks with each other and with a single-process run
of the same global batch. A collective that waits longer than ``COLLECTIVE_TIMEOUT`` raises in
the worker, and the whole run is killed after ``RUN_TIMEOUT``: a hang fails, it never blocks CI.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import labkit
from labkit import StepLog, ToyTask, TrainStep
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.faults import Faults
from labkit.triage import Triage

WORLD = 2
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
RUN_TIMEOUT = 150.0
NAN_STEP, OVERFLOW_STEP, STEPS, MAX_NORM = 3, 5, 8, 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard(batch, rank):
    """This rank's half of the global batch: the two halves together are the single-process batch."""
    return tuple(t.tensor_split(WORLD)[rank] for t in batch)


def fault_run(model, rank, precision, out, log_name, process_group=None, accumulation_steps=1):
    """Train STEPS steps; rank 1 alone gets a NaN batch (and, in fp16, an overflow)."""
    import torch.distributed as dist

    task = ToyTask()
    faults = {NAN_STEP: "nan", OVERFLOW_STEP: "overflow"} if rank == 1 else {}
    if precision != "fp16":
        faults.pop(OVERFLOW_STEP, None)
    scaler = labkit.GradScaler("cpu", init_scale=1024.0, growth_interval=2, enabled=precision == "fp16",
                               process_group=process_group)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), task.loss_fn,
                     precision=precision, max_norm=MAX_NORM, scaler=scaler, log=out / log_name,
                     process_group=process_group, accumulation_steps=accumulation_steps,
                     hooks=[SkipAlarm(1), Faults(faults)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            step(*shard(task.batch(i), rank))
    step.log.close()
    dist.barrier()
    return {
        "records": [r.to_dict() for r in step.log],
        "warnings": [w.category.__name__ for w in caught],
    }


def full_params(model):
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in whole.items()}


def scenario_ddp(rank, out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    result = {}
    for precision, accumulation in (("fp32", 1), ("fp16", 1), ("fp32", 2)):
        model, name = DDP(ToyTask().model()), f"{precision}x{accumulation}"
        result[name] = fault_run(
            model, rank, precision, out, f"ddp_{name}.jsonl", accumulation_steps=accumulation
        )
        result[name]["params"] = {k.removeprefix("module."): v for k, v in full_params(model).items()}
    return result


def fully_sharded(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def scenario_fsdp(rank, out):
    import torch.distributed as dist

    task = ToyTask()
    model = fully_sharded(task.model())
    task.loss_fn(model(shard(task.batch(0), rank)[0]), shard(task.batch(0), rank)[1]).backward()
    # this rank's shards only (grad_norm used to return 0 here)
    local = labkit.get_total_norm([p.grad.to_local() for p in model.parameters()])
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), all_reduce(*a, **k))[1]
    try:
        norms = {p: labkit.grad_norm(model.parameters(), p).item() for p in (1.0, 2.0, math.inf)}
    finally:
        dist.all_reduce = all_reduce
    clipped = labkit.clip_grad_norm_(model.parameters(), max_norm=0.5).item()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # a NaN in rank 1's shard of 0.bias only: both ranks see it in the norms and name it
    from labkit.clip import per_tensor_norms
    from labkit.step.record import forensics as _forensics

    named = list(model.named_parameters())
    if rank == 1:
        named[1][1].grad.to_local()[0] = math.nan
    named = [(n, p.grad) for n, p in named]
    norms_with_nan = per_tensor_norms([g for _, g in named], 2.0)
    culprit = _forensics(named, norms_with_nan, None)[1]
    local_culprit = labkit.clip.first_nonfinite([g for _, g in named], [n for n, _ in named])

    model = fully_sharded(task.model())
    run = fault_run(model, rank, "fp32", out, "fsdp_fp32.{rank}.jsonl")
    run["params"] = full_params(model)
    model = fully_sharded(task.model())
    fp16 = fault_run(model, rank, "fp16", out, "fsdp_fp16.jsonl")
    fp16["params"] = full_params(model)
    return {"local": local.item(), "norms": norms, "calls": len(calls) / 3, "clipped_norm": clipped,
            "grads": grads, "fp32": run, "fp16": fp16, "culprit": culprit, "local_culprit": local_culprit,
            "nan_norms": norms_with_nan.tolist()}


def scenario_scaler(rank, out):
    """A plain model per rank (no DDP, so nothing else syncs the gradients); rank 1 overflows."""
    model = torch.nn.Linear(3, 1)
    results = {}
    for name, scaler in (("labkit", labkit.GradScaler("cpu", init_scale=1024.0)),
                         ("torch", torch.amp.GradScaler("cpu", init_scale=1024.0))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for it in range(2):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 3)).sum()).backward()
            if rank == 1 and it == 0:
                model.weight.grad[0, 0] = math.inf
            stepped = scaler.step(opt)
            scaler.update()
            seen.append((stepped, scaler.get_scale()))
        results[name] = seen
    return results


def scenario_groups(rank, out):
    """Each rank in its own group of one: the loss check agrees within the group, not beyond it."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(WORLD)]
    task = ToyTask()
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                     process_group=groups[rank], hooks=[Faults({1: "nan"} if rank == 1 else {})])
    return [step(*shard(task.batch(i), rank)).reason for i in range(3)]


REWIND_SPIKE, REWIND_STEPS = 12, 18


def scenario_rewind(rank, out):
    """Issue 15: a x1000 batch in rank 1's half only; the detector skips it and both ranks rewind together."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.rewind import Rewind
    from labkit.spikes import SpikeDetector

    task = ToyTask()
    model = DDP(task.model())
    rewind = Rewind(back=4, skip=6, every=2)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), task.loss_fn,
                     hooks=[rewind, SpikeDetector(window=8, skip_z=6.0), ClipAlarm(None)])  # rewind runs last
    while step.step_count < REWIND_STEPS:
        index = rewind.data_index(step.step_count)
        x, y = shard(task.batch(index), rank)
        step(x * 1000.0 if rank == 1 and index == REWIND_SPIKE else x, y)
    return {"records": [r.to_dict() for r in step.log], "rewinds": rewind.rewinds,
            "rewound": step.log.rewound, "events": [vars(e) for e in step.log.rewinds],
            "params": {k.removeprefix("module."): v for k, v in full_params(model).items()}}


def poison_grad(module, when):
    """NaN into the gradient arriving at ``module``'s output, on the forwards where ``when()`` holds."""

    def hook(mod, args, out):
        if when():
            out.register_hook(lambda g: g.clone().fill_(math.nan))

    module.register_forward_hook(hook)


DIAGNOSIS_STEPS = 4


def scenario_diagnosis(rank, out):
    """Rank 1 alone: a NaN batch (step 1), finite inputs whose fp16 forward overflows (step 2), a NaN in a
    middle layer's gradient (step 3); and a GPT whose middle block's gradient is NaN on rank 1 only."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.blame import BackwardOrder
    from labkit.clip import per_tensor_norms
    from labkit.step.record import forensics as _forensics
    from labkit.tasks import GPTTask

    task = ToyTask()
    inner = task.model()
    model = DDP(inner)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp16",
                     hooks=[SkipAlarm(None), ClipAlarm(None), Triage()])
    poison_grad(inner[2], lambda: rank == 1 and step.step_count == 3)
    for i in range(DIAGNOSIS_STEPS):
        x, y = shard(task.batch(i), rank)
        if rank == 1 and i == 1:
            x = x.clone().fill_(math.nan)
        if rank == 1 and i == 2:
            x = x * 1e5
        step(x, y)
    toy = [r.to_dict() for r in step.log]

    gpt_task = GPTTask(n_layer=3, n_head=2, n_embd=16, block_size=8, batch_size=4)
    gpt = gpt_task.model()
    model = DDP(gpt)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), gpt_task.loss_fn,
                     hooks=[SkipAlarm(None), ClipAlarm(None)])
    poison_grad(gpt.h[1], lambda: rank == 1)
    gpt_record = step(*shard(gpt_task.batch(0), rank)).to_dict()

    # FSDP2, backward order: rank 0's shard of 2.weight (nearer the loss) and rank 1's of 0.bias hold a NaN
    model = fully_sharded(task.model())
    order = BackwardOrder()
    order.attach(model)
    order.pre_step(None, 0)
    task.loss_fn(model(shard(task.batch(0), rank)[0]), shard(task.batch(0), rank)[1]).backward()
    grads = dict((n, p.grad) for n, p in model.named_parameters())
    grads["2.weight" if rank == 0 else "0.bias"].to_local().view(-1)[0] = math.nan
    named = list(grads.items())
    found = _forensics(named, per_tensor_norms([g for _, g in named], 2.0), None, order.positions, order.uses)
    return {"toy": toy, "gpt": gpt_record, "fsdp_positions": dict(order.positions),
            "fsdp_culprit": (found.first_nonfinite, found.culprit_module)}


GPT_SIZE = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "batch_size": 4}


def scenario_gpt(rank, out):
    """The GPT's logit measurements under DDP: each rank measures its half, the record holds the reduction."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.tasks import GPTTask

    task = GPTTask(**GPT_SIZE)
    raw = task.model()
    model = DDP(raw)
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2), task.loss_fn,
                     hooks=[task.monitor(raw)])
    return [step(*shard(task.batch(i), rank)).to_dict() for i in range(3)]


MONITOR_STEPS = 5


def monitor_run(model, rank=None):
    """AdamW with an UpdateMonitor for MONITOR_STEPS steps of ToyTask (this rank's half of each batch, or all
    of it); return each record's monitor fields."""
    from labkit.update_monitor import UpdateMonitor

    task = ToyTask()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    step = TrainStep(model, opt, task.loss_fn, max_norm=None,
                     hooks=[labkit.SkipAlarm(None), labkit.ClipAlarm(None), UpdateMonitor(threshold=None)])
    return [{k: v for k, v in step(*batch).to_dict().items() if "update" in k}
            for batch in (task.batch(i) if rank is None else shard(task.batch(i), rank)
                          for i in range(MONITOR_STEPS))]


def scenario_monitor(rank, out):
    """UpdateMonitor under FSDP2: each rank holds shards of g, v, theta; the record holds whole tensors'."""
    return monitor_run(fully_sharded(ToyTask().model()), rank)


SCENARIOS = {"monitor": scenario_monitor, "ddp": scenario_ddp, "fsdp": scenario_fsdp,
             "scaler": scenario_scaler, "groups": scenario_groups, "rewind": scenario_rewind,
             "diagnosis": scenario_diagnosis, "gpt": scenario_gpt}


def worker(rank, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two workers on two cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    try:
        results = {name: fn(rank, out) for name, fn in SCENARIOS.items()}
    finally:
        dist.destroy_process_group()
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run every scenario once on two ranks; return each rank's results and the output folder."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("dist")
    ctx = mp.start_processes(worker, args=(free_port(), out), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while not ctx.join(timeout=1.0):  # raises with the worker's traceback if one failed
            if time.monotonic() > deadline:
                pytest.fail(f"the distributed run hung: still running after {RUN_TIMEOUT:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)], out


def single_process(precision, accumulation_steps=1):
    """The oracle: one process, the whole global batch, the same faults."""
    task = ToyTask()
    model = task.model()
    faults = {NAN_STEP: "nan", OVERFLOW_STEP: "overflow"} if precision == "fp16" else {NAN_STEP: "nan"}
    scaler = labkit.GradScaler("cpu", init_scale=1024.0, growth_interval=2, enabled=precision == "fp16")
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), task.loss_fn,
                     precision=precision, max_norm=MAX_NORM, scaler=scaler,
                     accumulation_steps=accumulation_steps, hooks=[SkipAlarm(None), Faults(faults)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(STEPS):
            step(*task.batch(i))
    return step.log, dict(model.state_dict())


def assert_params_close(a, b, rtol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol * 1e-2, msg=lambda m, k=k: f"{k}: {m}")


def assert_rank_agreement(run0, run1, skipped, reasons):
    recs = [run0["records"], run1["records"]]
    for r in recs:
        assert [x["step"] for x in r if x["skipped"]] == skipped
        assert [x["reason"] for x in r if x["skipped"]] == reasons
    # same decision, loss, norm and scale everywhere; only the fault label is rank 1's own
    strip = lambda rs: [{k: v for k, v in x.items() if k != "fault"} for x in rs]  # noqa: E731
    assert repr(strip(recs[0])) == repr(strip(recs[1]))  # repr: NaN == NaN
    assert recs[1][NAN_STEP]["fault"] == "nan" and "fault" not in recs[0][NAN_STEP]  # rank 0 injected none


# ---------------------------------------------------------------- DDP


@pytest.mark.parametrize("precision, accumulation", [("fp32", 1), ("fp16", 1), ("fp32", 2)])
def test_ddp_nan_on_one_rank_skips_the_same_step_on_every_rank(ranks, precision, accumulation):
    (r0, r1), _ = ranks
    run0, run1 = r0["ddp"][f"{precision}x{accumulation}"], r1["ddp"][f"{precision}x{accumulation}"]
    skipped = [NAN_STEP, OVERFLOW_STEP] if precision == "fp16" else [NAN_STEP]
    reasons = ["nonfinite_loss", "nonfinite_grad"] if precision == "fp16" else ["nonfinite_loss"]
    assert_rank_agreement(run0, run1, skipped, reasons)
    for a, b in zip(run0["params"].values(), run1["params"].values()):
        assert torch.equal(a, b)  # bit for bit: the same updates on the same steps
    # and the same as one process training on the whole batch through the same faults
    oracle, params = single_process(precision, accumulation)
    assert oracle.skipped_steps == skipped
    ours = run0["records"]
    tol = 1e-4 if precision == "fp32" else 2e-3
    for mine, theirs in zip(ours, oracle):
        if not mine["skipped"]:
            assert math.isclose(mine["grad_norm"], theirs.grad_norm, rel_tol=tol), mine["step"]
            assert math.isclose(mine["loss"], theirs.loss, rel_tol=tol), mine["step"]
        assert (mine["scale"], mine["next_scale"]) == (theirs.scale, theirs.next_scale)
    assert_params_close(run0["params"], params, rtol=tol)


def test_ddp_scale_moves_together(ranks):
    (r0, r1), _ = ranks
    scales = [[(x["scale"], x["next_scale"]) for x in r["ddp"]["fp16x1"]["records"]] for r in (r0, r1)]
    assert scales[0] == scales[1]
    assert scales[0][NAN_STEP][0] == scales[0][NAN_STEP][1]  # a bad batch does not cost the scale
    assert scales[0][OVERFLOW_STEP][1] == scales[0][OVERFLOW_STEP][0] / 2  # rank 1's overflow: both back off


def test_only_rank_0_writes_the_log_and_raises_the_alarm(ranks):
    (r0, r1), out = ranks
    assert len(StepLog.read_jsonl(out / "ddp_fp32x1.jsonl")) == STEPS  # one writer, not one per rank
    assert "SkipStreakWarning" in r0["ddp"]["fp32x1"]["warnings"]
    assert "SkipStreakWarning" not in r1["ddp"]["fp32x1"]["warnings"]
    # ``{rank}`` in the path: one file per rank
    logs = [StepLog.read_jsonl(out / f"fsdp_fp32.{r}.jsonl") for r in range(WORLD)]
    assert [log.skipped_steps for log in logs] == [[NAN_STEP], [NAN_STEP]]


# ---------------------------------------------------------------- FSDP2


def test_fsdp_norm_is_the_global_norm_of_the_single_process_batch(ranks):
    (r0, r1), _ = ranks
    task = ToyTask()
    model = task.model()
    task.loss_fn(model(task.batch(0)[0]), task.batch(0)[1]).backward()
    for p in (1.0, 2.0, math.inf):
        oracle = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()], p).item()
        assert r0["fsdp"]["norms"][p] == r1["fsdp"]["norms"][p]
        assert math.isclose(r0["fsdp"]["norms"][p], oracle, rel_tol=1e-4), p
    # each rank's shards alone give a smaller norm: the reduction is what makes it global
    assert max(r0["fsdp"]["local"], r1["fsdp"]["local"]) < 0.99 * r0["fsdp"]["norms"][2.0]
    assert r0["fsdp"]["calls"] == 1  # one all-reduce for all sharded gradients, not one per parameter
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).item()
    assert math.isclose(r0["fsdp"]["clipped_norm"], expected, rel_tol=1e-4)
    for n, q in model.named_parameters():
        torch.testing.assert_close(r0["fsdp"]["grads"][n], q.grad, rtol=1e-4, atol=1e-7)


def test_fsdp_a_nan_in_one_ranks_shard_is_seen_and_named_by_every_rank(ranks):
    (r0, r1), _ = ranks
    # rank 0's shard is clean
    assert (r0["fsdp"]["local_culprit"], r1["fsdp"]["local_culprit"]) == (None, "0.bias")
    assert r0["fsdp"]["culprit"] == r1["fsdp"]["culprit"] == "0.bias"
    for norms in (r0["fsdp"]["nan_norms"], r1["fsdp"]["nan_norms"]):
        assert [math.isfinite(v) for v in norms] == [i != 1 for i in range(6)]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_fsdp_trainstep_matches_the_single_process_run(ranks, precision):
    (r0, r1), _ = ranks
    run0, run1 = r0["fsdp"][precision], r1["fsdp"][precision]
    skipped = [NAN_STEP, OVERFLOW_STEP] if precision == "fp16" else [NAN_STEP]
    reasons = ["nonfinite_loss", "nonfinite_grad"] if precision == "fp16" else ["nonfinite_loss"]
    assert_rank_agreement(run0, run1, skipped, reasons)
    oracle, params = single_process(precision)
    tol = 1e-4 if precision == "fp32" else 2e-3
    for mine, theirs in zip(run0["records"], oracle):
        if not mine["skipped"]:
            assert math.isclose(mine["grad_norm"], theirs.grad_norm, rel_tol=tol), mine["step"]
            assert mine["clipped"] == theirs.clipped
        assert (mine["scale"], mine["next_scale"]) == (theirs.scale, theirs.next_scale)
    assert any(r["clipped"] for r in run0["records"]) and not all(r["clipped"] for r in run0["records"])
    for a, b in zip(run0["params"].values(), run1["params"].values()):
        assert torch.equal(a, b)
    assert_params_close(run0["params"], params, rtol=tol)


# ---------------------------------------------------------------- scaler and groups


def test_scaler_backs_off_on_every_rank_when_one_rank_overflows(ranks):
    (r0, r1), _ = ranks
    # labkit: both ranks skip iteration 0 and halve the scale, then both step
    assert r0["scaler"]["labkit"] == r1["scaler"]["labkit"] == [(False, 512.0), (True, 512.0)]
    # the hazard this guards against: torch's GradScaler (no reduction) lets the ranks drift apart
    assert r0["scaler"]["torch"][0] != r1["scaler"]["torch"][0]


def test_process_group_bounds_the_agreement(ranks):
    (r0, r1), _ = ranks
    assert r0["groups"] == [None, None, None]  # rank 0's group of one never saw rank 1's NaN
    assert r1["groups"] == [None, "nonfinite_loss", None]


def test_a_spike_on_one_rank_rewinds_every_rank_together(ranks):
    (r0, r1), _ = ranks
    a, b = r0["rewind"], r1["rewind"]
    assert a["rewinds"] == b["rewinds"] == [(REWIND_SPIKE, 8)]  # 12 + 1 - 8 >= back=4 steps undone
    assert repr(a["records"]) == repr(b["records"])  # the same decisions, z-scores and marks on both ranks
    assert a["events"] == b["events"] and len(a["events"]) == 1
    spike = a["events"][0]
    assert (spike["reason"] in ("spike_loss", "spike_grad")
            and (spike["step"], spike["to"]) == (REWIND_SPIKE, 8))
    assert a["rewound"] == b["rewound"]
    steps = [r["step"] for r in a["records"]]
    assert [s for s, gone in zip(steps, a["rewound"]) if gone] == list(range(8, REWIND_SPIKE + 1))
    assert [s for s, gone in zip(steps, a["rewound"]) if not gone] == list(range(REWIND_STEPS))
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k


# ---------------------------------------------------------------- triage and blame


def test_triage_on_one_ranks_bad_step_gives_every_rank_the_same_reason(ranks):
    (r0, r1), _ = ranks
    a, b = r0["diagnosis"]["toy"], r1["diagnosis"]["toy"]
    assert [r["reason"] for r in a] == [None, "nonfinite_input", "forward_overflow", "nonfinite_grad"]
    assert repr(a) == repr(b)  # the same decisions, reasons, culprits and scales on both ranks
    # scale untouched
    assert [(r["scale"], r["next_scale"]) for r in a[1:3]] == [(a[0]["next_scale"],) * 2] * 2


def test_ranks_agree_on_where_a_nonfinite_gradient_started(ranks):
    (r0, r1), _ = ranks
    # DDP: rank 1's NaN in the middle layer's gradient, all-reduced into both ranks' gradients
    for r in (r0, r1):  # DDP's parameters are named module.*
        toy = r["diagnosis"]["toy"][3]
        assert (
            toy["first_nonfinite"] in ("module.2.weight", "module.2.bias")
            and toy["culprit_module"] == "module.2"
        )
    # a tied GPT: on rank 0 every use of the tied weight saw finite gradients; both ranks still name the block
    gpt = [r["diagnosis"]["gpt"] for r in (r0, r1)]
    assert repr(gpt[0]) == repr(gpt[1])
    assert gpt[0]["skipped"] and gpt[0]["culprit_module"].startswith("module.h.1."), gpt[0]["first_nonfinite"]
    # FSDP2: each rank's shard holds a different NaN; backward order (recorded alike) names 2.weight on both
    positions = r0["diagnosis"]["fsdp_positions"]
    assert positions == r1["diagnosis"]["fsdp_positions"] and len(positions) == 6
    assert positions["2.weight"][0] < positions["0.bias"][0]
    assert r0["diagnosis"]["fsdp_culprit"] == r1["diagnosis"]["fsdp_culprit"] == ("2.weight", "2")
    # and the fp16 overflow fault on rank 1 (the output's gradient) is named at the head on every rank
    for run in ("ddp", "fsdp"):
        overflow = [r[run]["fp16" if run == "fsdp" else "fp16x1"]["records"][OVERFLOW_STEP] for r in (r0, r1)]
        head = "module.4" if run == "ddp" else "4"
        assert overflow[0]["culprit_module"] == overflow[1]["culprit_module"] == head, run


# ---------------------------------------------------------------- single process: nothing changes


def test_the_gpts_logit_measurements_agree_on_every_rank_and_the_largest_logit_is_the_global_one(ranks):
    from labkit.tasks import GPTTask

    run0, run1 = (r["gpt"] for r in ranks[0])
    assert repr(run0) == repr(run1)  # every rank records the same measurements
    task = GPTTask(**GPT_SIZE)
    model = task.model()
    logits = model(task.batch(0)[0])
    whole = model.measurements().tolist()
    assert run0[0]["attn_logit_max"] == {"h.0": whole[0]}  # a max over the halves is the max over the batch
    assert run0[0]["log_z"] == pytest.approx(whole[2], rel=1e-6)  # the mean of two equal halves' means
    whole_loss = task.loss_fn(logits, task.batch(0)[1]).item()
    assert run0[0]["ce_loss"] == run0[0]["loss"] == pytest.approx(whole_loss)
    halves = []
    for rank in range(2):
        model(shard(task.batch(0), rank)[0])
        halves.append(model.measurements().tolist())
    # the most peaked head of either rank's half, and the mean of the halves' mean log Z**2
    assert run0[0]["attn_entropy"] == {"h.0": min(h[1] for h in halves)}
    assert run0[0]["log_z_sq"] == pytest.approx((halves[0][3] + halves[1][3]) / 2, rel=1e-6)


def test_empty_gradients_have_norm_0_for_every_norm_type():
    # FSDP2 gives a rank empty shards when a dim is smaller than the world (here 2.weight is 1 x 64)
    empty, full = torch.zeros(0, 64, requires_grad=True), torch.zeros(2, requires_grad=True)
    empty.grad, full.grad = torch.zeros(0, 64), torch.tensor([3.0, -4.0])
    for p, expected in ((1.0, 7.0), (2.0, 5.0), (math.inf, 4.0)):
        assert labkit.grad_norm([empty, full], p).item() == expected
        assert labkit.grad_norm([empty], p).item() == 0.0
    with pytest.raises(RuntimeError, match="empty tensor"):  # torch has no inf-norm of an empty tensor
        torch.nn.utils.get_total_norm([empty.grad, full.grad], math.inf)


def test_no_collective_when_not_initialized(monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran without an initialized process group")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    task = ToyTask()
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp16",
                     hooks=[Faults({1: "nan", 2: "overflow"})])
    records = [step(*task.batch(i)) for i in range(4)]
    assert [r.reason for r in records] == [None, "nonfinite_loss", "nonfinite_grad", None]


# ---------------------------------------------------------------- the demo under torchrun


def test_demo_under_torchrun_reports_rank_1s_nan_once(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "labkit", "demo", "--steps", "125", "--fault-rank", "1",
           "--no-progress", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).parent.parent
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = StepLog.read_jsonl(out / "log.jsonl")
    assert len(log) == 125 and log.skipped_steps == [120] and log[120].reason == "nonfinite_input"
    assert proc.stdout.count("step  120  SKIP  nonfinite_input") == 1  # rank 0 speaks for both
    assert "ranks       2 (ddp, gloo)" in proc.stdout
    assert (out / "log.csv").exists() and (out / "demo.png").exists()


def test_the_update_monitor_under_fsdp_records_the_whole_tensors_values_on_every_rank(ranks):
    """FSDP2 shards g, v and theta: the per-tensor RMS and the applied update's RMS, reduced across the ranks,
    are a single process's on the whole batch (to rounding: the shards' sums are added in another order)."""
    (r0, r1), _ = ranks
    assert repr(r0["monitor"]) == repr(r1["monitor"])  # every rank records the same numbers
    task = ToyTask()
    oracle = monitor_run(task.model())
    assert r0["monitor"][0] == oracle[0] == {}  # nothing measured before the first optimizer step
    assert [set(r["update_rms"]) for r in r0["monitor"][1:]] == [set(r["update_rms"]) for r in oracle[1:]]
    assert len(oracle[1]["update_rms"]) == 6 and any(v != 1.0 for v in oracle[-1]["update_rms"].values())
    for mine, theirs in zip(r0["monitor"][1:], oracle[1:]):
        for name, value in theirs["update_rms"].items():
            assert math.isclose(mine["update_rms"][name], value, rel_tol=1e-4), (name, mine, theirs)
        assert math.isclose(mine["applied_update_rms"], theirs["applied_update_rms"], rel_tol=1e-4)
        assert (
            mine["update_rms_peak"] == theirs["update_rms_peak"]
            and mine["update_step"] == theirs["update_step"]
        )
