"""The same guarantees on CUDA; skipped cleanly where there is no GPU (CI never has one)."""

import copy

import pytest
import torch

import labkit
from labkit.faults import Faults
from labkit.lab.moments import AdamWatch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CPU is the tested path"),
]


def test_grad_norm_and_clip_match_torch_on_cuda():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    ref = copy.deepcopy(model)  # before backward: a Parameter's deepcopy leaves its .grad behind
    x = torch.randn(32, 64, device="cuda")
    for m in (model, ref):
        m(x).pow(2).mean().backward()
    norm = labkit.clip_grad_norm_(model.parameters(), 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_scaler_trajectory_matches_torch_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).cuda()
    ref = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    ours, theirs = (
        labkit.GradScaler("cuda", growth_interval=2),
        torch.amp.GradScaler("cuda", growth_interval=2),
    )
    for i in range(12):
        x = torch.randn(4, 8, device="cuda")
        for m, opt, s in ((model, opts[0], ours), (ref, opts[1], theirs)):
            opt.zero_grad()
            s.scale(m(x).sum()).backward()
            if i % 5 == 3:
                m.weight.grad[0, 0] = float("inf")
            s.step(opt)
            s.update()
        assert ours.get_scale() == theirs.get_scale()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_trainstep_skips_and_backs_off_on_cuda(precision):
    task = labkit.ToyTask()
    model = task.model("cuda")
    step = labkit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn,
                            precision=precision, hooks=[Faults({3: "nan", 5: "overflow"})])
    log = [step(*task.batch(i, "cuda")) for i in range(8)]
    assert log[3].reason == "nonfinite_loss" and log[3].next_scale == log[3].scale
    if precision == "fp16":
        assert log[5].reason == "nonfinite_grad" and log[5].next_scale == log[5].scale / 2
    else:
        assert not log[5].skipped


def test_adam_watch_reads_a_skipped_step_on_cuda():
    # a skipped step moved nothing: its zero is stacked with v_hat's medians on the weights' device
    w = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    opt = torch.optim.Adam([w], lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    watch = AdamWatch(optimizer=opt)
    w.grad = torch.full((4,), 0.25, device="cuda")
    watch.before_step([("w", w)], 0)
    opt.step()
    watch.after_step([("w", w)], None)
    watch.after_step([("w", w)], None)  # no before_step: the step was skipped
    assert watch.v_hat == pytest.approx([0.0625] * 2, rel=1e-6)
    assert watch.update == pytest.approx([0.01, 0.0], rel=1e-4)
