"""Clipping and loss scaling bit for bit against torch (issue 37: the mutants that survived the suite).

``clip_grad_norm_`` and ``clip_coef`` against ``torch.nn.utils.clip_grad_norm_``'s rule (it adds 1e-6
to the norm: a drop-in that subtracts it gives other gradients), and the scaler's dead-scale guard and
``inf_check_`` against the rule they promise.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit
from labkit import GradScaler
from labkit.clip import clip_coef

FAST = settings(max_examples=60, deadline=None, database=None)


def grads_of(values, scale):
    out = []
    for v in values:
        p = torch.zeros(len(v), requires_grad=True)
        p.grad = torch.tensor(v, dtype=torch.float32) * scale
        out.append(p)
    return out


@FAST
@given(values=st.lists(st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=4), min_size=1,
                       max_size=3),
       scale=st.sampled_from([1e-7, 1e-6, 1e-4, 1.0, 300.0]),
       max_norm=st.sampled_from([1e-6, 1e-3, 0.5, 1.0, 7.0]), foreach=st.sampled_from([None, False]))
def test_clip_grad_norm_is_torchs_bit_for_bit(values, scale, max_norm, foreach):
    ours, theirs = grads_of(values, scale), grads_of(values, scale)
    norm = labkit.clip_grad_norm_(ours, max_norm, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
    assert torch.equal(norm, want)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad), (p.grad, q.grad)


@pytest.mark.parametrize("norm", [0.0, 1e-7, 1e-6, 3e-6, 0.5, 1.0, 2.0, 1e3])
@pytest.mark.parametrize("max_norm", [1e-6, 0.25, 1.0])
def test_clip_coef_is_torchs_factor_for_a_float_and_a_tensor_limit(norm, max_norm):
    n = torch.tensor(norm)
    want = torch.clamp(max_norm / (n + 1e-6), max=1.0)  # torch.nn.utils.clip_grads_with_norm_
    assert torch.equal(clip_coef(n, max_norm), want)
    limit = torch.tensor(max_norm)
    assert torch.equal(clip_coef(n, limit), torch.clamp(limit / (n + 1e-6), max=1.0))


@pytest.mark.parametrize("norm", [math.inf, -math.inf, math.nan, -1.0])
def test_clip_coef_is_one_where_there_is_no_norm_to_clip_by(norm):
    assert float(clip_coef(torch.tensor(norm), 1.0)) == 1.0
    assert float(clip_coef(torch.tensor(norm), torch.tensor(1.0))) == 1.0


def test_clip_grads_with_norm_is_torchs_with_the_same_norm():
    ours, theirs = grads_of([[3e-7, 4e-7], [1.0]], 1.0), grads_of([[3e-7, 4e-7], [1.0]], 1.0)
    labkit.clip_grads_with_norm_(ours, 0.5, torch.tensor(1.0))
    torch.nn.utils.clip_grads_with_norm_(theirs, 0.5, torch.tensor(1.0))
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad)


def one_param_step(scaler, grad):
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale(w.sum())  # the scaler's state is created on the loss's device
    w.grad = torch.tensor(grad)
    return w, opt


def test_a_dead_scale_skips_and_backs_off_onto_the_floor_instead_of_stepping_on_inf():
    """A scale set below float32's normal range has 1/scale = inf: finite gradients would become inf."""
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=1e-40)  # subnormal in float32: > 0, so update() takes it
    w, opt = one_param_step(scaler, [1.0, -2.0])
    assert scaler.step(opt) is False  # skipped: the parameters were not moved by inf
    assert torch.equal(w, torch.zeros(2))
    scaler.update()
    assert scaler.get_scale() == 2.0**-126 and scaler.skip_count == 1  # revived at the floor


@pytest.mark.parametrize("found", [True, False])
def test_inf_check_takes_a_host_bool(found):
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    w, opt = one_param_step(scaler, [1.0, 1.0])
    scaler.inf_check_(opt, found, unscaled=True)
    assert scaler.will_skip(opt) is found
    assert scaler.step(opt) is (not found)
    scaler.update()
    assert scaler.get_scale() == (512.0 if found else 2048.0)
    assert torch.equal(w, torch.zeros(2) if found else -torch.ones(2))


@pytest.mark.parametrize("found", [1.0, 0.0])
def test_inf_check_takes_a_device_tensor(found):
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    _, opt = one_param_step(scaler, [1.0, 1.0])
    scaler.inf_check_(opt, torch.tensor([found]), unscaled=True)
    assert scaler.will_skip(opt) is bool(found)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == (512.0 if found else 2048.0)
