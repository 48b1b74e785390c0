"""Faults and fault schedules: parsing, what each kind does to a batch, and how TrainStep reacts."""

import math
import re

import pytest
import torch

import labkit
from labkit.faults import Faults

FP16_MAX = torch.finfo(torch.float16).max
KINDS = ["spike", "nan", "inf", "overflow"]


@pytest.fixture
def task():
    return labkit.ToyTask()


@pytest.fixture
def batch(task):
    return task.batch(0)


def train_step(task, precision="fp32", **kwargs):
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return labkit.TrainStep(model, opt, task.loss_fn, precision=precision, **kwargs)


def record_dicts(log):
    """Records as dicts with NaN replaced by a marker, so that == compares them exactly."""
    def fix(v):
        if isinstance(v, float) and math.isnan(v):
            return "NaN"
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        return v

    return [{k: fix(v) for k, v in r.to_dict().items()} for r in log]


# ---------------------------------------------------------------- Fault


@pytest.mark.parametrize(
    "fault, label",
    [
        (labkit.Fault("spike"), "spike:1000"),
        (labkit.Fault("spike", 2.5), "spike:2.5"),
        (labkit.Fault("spike", 1e6), "spike:1e+06"),
        (labkit.Fault("nan"), "nan"),
        (labkit.Fault("inf"), "inf"),
        (labkit.Fault("overflow"), "overflow"),
        (labkit.Fault("nan", 7.0), "nan"),  # magnitude is ignored outside spike
    ],
    ids=["spike-default", "spike-2.5", "spike-1e6", "nan", "inf", "overflow", "nan-with-magnitude"],
)
def test_fault_labels(fault, label):
    assert fault.label == label


def test_fault_default_magnitude():
    assert labkit.Fault("spike").magnitude == 1000.0


@pytest.mark.parametrize(
    "kind, magnitude",
    [("boom", 1000.0), ("NaN", 1000.0), ("spike", 0.0), ("spike", -3.0), ("spike", math.inf),
     ("spike", math.nan)],
    ids=["unknown-kind", "case-sensitive", "spike-0", "spike-negative", "spike-inf", "spike-nan"],
)
def test_bad_faults(kind, magnitude):
    with pytest.raises(ValueError):
        labkit.Fault(kind, magnitude)


@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_inputs_never_mutates_the_callers_tensor(batch, kind):
    x = batch[0]
    before = x.clone()
    out = labkit.Fault(kind).corrupt_inputs(x)
    assert torch.equal(x, before)
    assert out.shape == x.shape and out.dtype == x.dtype
    if kind != "overflow":
        assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("magnitude", [1000.0, 3.0, 0.5])
def test_spike_multiplies_by_magnitude(batch, magnitude):
    x = batch[0]
    out = labkit.Fault("spike", magnitude).corrupt_inputs(x)
    assert torch.equal(out, x * magnitude)


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_nan_and_inf_put_exactly_one_nonfinite_entry(batch, kind):
    x = batch[0]
    out = labkit.Fault(kind).corrupt_inputs(x)
    bad = ~torch.isfinite(out)
    assert bad.sum().item() == 1
    value = out[bad].item()
    assert math.isnan(value) if kind == "nan" else value == math.inf
    assert torch.equal(out[~bad], x[~bad])


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(8, 16).T, lambda: torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last),
     lambda: torch.randn(8, 32)[:, ::2]],
    ids=["transposed", "channels-last", "strided-slice"],
)
def test_nan_and_inf_on_non_contiguous_inputs(kind, make):
    """A batch need not be contiguous (a transposed view, a channels_last image batch)."""
    x = make()
    before = x.clone()
    out = labkit.Fault(kind).corrupt_inputs(x)
    assert (~torch.isfinite(out)).sum().item() == 1
    assert torch.equal(x, before)


def test_overflow_leaves_inputs_and_forward_value_unchanged(batch):
    x = batch[0]
    fault = labkit.Fault("overflow")
    assert torch.equal(fault.corrupt_inputs(x), x)
    out = torch.randn(5, 3, requires_grad=True)
    assert torch.equal(fault.corrupt_output(out), out)


@pytest.mark.parametrize("kind", ["spike", "nan", "inf"])
def test_other_faults_leave_the_output_alone(kind):
    out = torch.randn(5, 3)
    assert labkit.Fault(kind).corrupt_output(out) is out


def test_overflow_backward_peaks_at_twice_fp16_max():
    out = torch.randn(6, 2, requires_grad=True)
    weights = torch.randn(6, 2)
    (labkit.Fault("overflow").corrupt_output(out) * weights).sum().backward()
    assert out.grad.abs().max().item() == pytest.approx(2 * FP16_MAX)
    # same direction as the true gradient, just rescaled
    torch.testing.assert_close(out.grad / out.grad.abs().max(), weights / weights.abs().max())


def test_overflow_backward_in_fp16_is_inf():
    out = torch.randn(6, 2, dtype=torch.float16, requires_grad=True)
    labkit.Fault("overflow").corrupt_output(out).sum().backward()
    assert out.grad.dtype == torch.float16
    assert torch.isinf(out.grad).all()


def _grads_under(task, precision):
    model = task.model()
    x, y = task.batch(0)
    dtype = {"fp16": torch.float16, "fp32": None}[precision]
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        out = labkit.Fault("overflow").corrupt_output(model(x))
        loss = task.loss_fn(out, y)
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


def test_overflow_under_fp16_autocast_gives_nonfinite_grads(task):
    loss, grads = _grads_under(task, "fp16")
    assert math.isfinite(loss.item())
    assert not all(torch.isfinite(g).all() for g in grads)


def test_overflow_under_fp32_gives_large_finite_grads(task):
    loss, grads = _grads_under(task, "fp32")
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(g).all() for g in grads)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    assert 1e4 < norm < math.inf


# ---------------------------------------------------------------- FaultSchedule


def test_parse_the_documented_example():
    s = labkit.FaultSchedule.parse(["50:spike:1000", "120:nan", "200-203:overflow"])
    assert list(s) == [50, 120, 200, 201, 202, 203]
    assert len(s) == 6
    assert s[50] == labkit.Fault("spike", 1000.0)
    assert s.get(120).label == "nan"
    assert {s[i].label for i in range(200, 204)} == {"overflow"}
    assert s.get(199) is None and s.get(204) is None and s.get(0) is None
    assert 203 in s and 204 not in s


def test_parse_range_is_inclusive_and_single_step_ranges_work():
    assert list(labkit.FaultSchedule.parse(["3-5:inf"])) == [3, 4, 5]
    assert list(labkit.FaultSchedule.parse(["7-7:nan"])) == [7]


@pytest.mark.parametrize(
    "spec, step, label",
    [("0:spike", 0, "spike:1000"), ("4:spike:2.5", 4, "spike:2.5"), ("9:spike:1e3", 9, "spike:1000"),
     (" 12:inf ", 12, "inf"), ("8:overflow", 8, "overflow")],
    ids=["spike-default", "spike-magnitude", "spike-exponent", "whitespace", "overflow"],
)
def test_parse_labels(spec, step, label):
    s = labkit.FaultSchedule.parse([spec])
    assert list(s) == [step]
    assert s[step].label == label


def test_parse_empty():
    s = labkit.FaultSchedule.parse([])
    assert len(s) == 0 and s.get(0) is None


def test_schedule_iterates_in_step_order_and_has_a_repr():
    s = labkit.FaultSchedule({9: "nan", 2: labkit.Fault("spike", 10.0)})
    assert list(s) == [2, 9]
    assert repr(s) == "FaultSchedule({2: 'spike:10', 9: 'nan'})"


BAD_SPECS = ["x", "5:boom", "5:nan:3", "9-3:nan", "-1:nan", "5:spike:0"]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_parse_bad_specs_raise_value_error_naming_the_spec(spec):
    with pytest.raises(ValueError) as info:
        labkit.FaultSchedule.parse([spec])
    assert repr(spec) in str(info.value)


def _valid_examples(message):
    """The spec-like words in a message that FaultSchedule.parse accepts."""
    ok = []
    for word in re.findall(r"\d+(?:-\d+)?:[a-z]+(?::[0-9.e+]+)?", message):
        try:
            labkit.FaultSchedule.parse([word])
        except ValueError:
            continue
        ok.append(word)
    return ok


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_parse_bad_specs_show_a_valid_example(spec):
    """Every bad-spec error shows how to write a good one (e.g. 50:spike:1000)."""
    with pytest.raises(ValueError) as info:
        labkit.FaultSchedule.parse([spec])
    assert _valid_examples(str(info.value)), f"no example in: {info.value}"


@pytest.mark.parametrize("step", [-1, "3", 2.0, True], ids=["negative", "str", "float", "bool"])
def test_schedule_rejects_bad_steps(step):
    with pytest.raises(ValueError):
        labkit.FaultSchedule({step: "nan"})


def test_schedule_rejects_bad_kind_in_mapping():
    with pytest.raises(ValueError):
        labkit.FaultSchedule({3: "boom"})


# ---------------------------------------------------------------- faults inside TrainStep


def test_trainstep_accepts_a_dict_or_a_schedule(task):
    a = train_step(task, hooks=[Faults({1: "nan", 2: labkit.Fault("spike", 10.0)})])
    b = train_step(task, hooks=[Faults(labkit.FaultSchedule.parse(["1:nan", "2:spike:10"]))])
    for step in (a, b):
        records = [step(*task.batch(i)) for i in range(4)]
        assert [r.fault for r in records] == [None, "nan", "spike:10", None]


def test_trainstep_never_mutates_the_callers_batch(task):
    step = train_step(task, accumulation_steps=2,
                      hooks=[Faults(labkit.FaultSchedule.parse(["0:spike", "1:nan", "2:inf", "3:overflow"]))])
    for i in range(4):
        x, y = task.batch(i)
        x0, y0 = x.clone(), y.clone()
        step(x, y)
        assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bad_data_faults_skip_as_nonfinite_loss(task, precision, kind):
    record = train_step(task, precision, hooks=[Faults({0: kind})])(*task.batch(0))
    assert record.skipped and record.reason == "nonfinite_loss" and record.fault == kind
    assert not math.isfinite(record.loss)


def test_nan_fault_on_a_transposed_batch_is_skipped_not_crashed(task):
    x, y = task.batch(0)
    x_t = x.T.contiguous().T  # same values, column-major storage
    assert not x_t.is_contiguous()
    record = train_step(task, hooks=[Faults({0: "nan"})])(x_t, y)
    assert record.skipped and record.reason == "nonfinite_loss"


def test_spike_in_fp32_is_clipped(task):
    step = train_step(task, hooks=[Faults({1: "spike"})])
    clean, spiked = step(*task.batch(0)), step(*task.batch(1))
    assert not clean.clipped
    assert spiked.clipped and not spiked.skipped and spiked.fault == "spike:1000"
    assert spiked.grad_norm > 1000 * clean.grad_norm
    assert spiked.post_clip_norm == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("backoff", [0.5, 0.25])
def test_overflow_in_fp16_skips_and_backs_off(task, backoff):
    scaler = labkit.GradScaler("cpu", init_scale=2.0**10, backoff_factor=backoff)
    step = train_step(task, "fp16", scaler=scaler, hooks=[Faults({1: "overflow"})])
    step(*task.batch(0))
    params = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    record = step(*task.batch(1))
    assert record.skipped and record.reason == "nonfinite_grad" and record.fault == "overflow"
    assert math.isfinite(record.loss)  # the forward was fine
    assert record.next_scale == record.scale * backoff == 2.0**10 * backoff
    bad = [n for n, p in step.model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert bad[0] == "0.weight"  # the inf spread back to the input layer...
    # ...from the output layer, where it began
    assert record.first_nonfinite in bad and record.culprit_module == "4"
    for n, p in step.model.named_parameters():
        assert torch.equal(p, params[n])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_overflow_in_fp32_and_bf16_is_a_clipped_spike(task, precision):
    step = train_step(task, precision, hooks=[Faults({0: "overflow"})])
    record = step(*task.batch(0))
    assert not record.skipped and record.reason is None
    assert math.isfinite(record.grad_norm) and record.grad_norm > 1e4
    assert record.clipped and record.first_nonfinite is None
    assert record.top_grads and all(math.isfinite(v) for _, v in record.top_grads)


def test_identical_runs_give_identical_logs(task):
    schedule = labkit.FaultSchedule.parse(["1:spike:100", "3:nan", "4-5:overflow", "7:inf"])

    def go():
        step = train_step(task, "fp16", max_norm=0.5, hooks=[Faults(schedule)])
        for i in range(9):
            step(*task.batch(i))
        return step

    a, b = go(), go()
    assert record_dicts(a.log) == record_dicts(b.log)
    assert a.log.skipped_steps == [1, 3, 4, 5, 7]  # under fp16 the spike overflows too
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_nonfinite_faults_refuse_integer_inputs_with_a_fix(kind):
    ids = torch.arange(6).reshape(2, 3)
    with pytest.raises(TypeError, match="floating-point inputs"):
        labkit.Fault(kind).corrupt_inputs(ids)
    assert torch.equal(ids, torch.arange(6).reshape(2, 3))
