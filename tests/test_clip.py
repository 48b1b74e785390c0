import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import labkit

INF = float("inf")
NAN = float("nan")
NORM_TYPES = [2.0, 1.0, 3.5, 0.5, INF]
NORM_IDS = ["l2", "l1", "p3.5", "p0.5", "linf"]
FOREACH = [None, True, False]
FOREACH_IDS = ["foreach-default", "foreach", "for-loop"]
HALF_DTYPES = [torch.float16, torch.bfloat16]
HALF_IDS = ["fp16", "bf16"]
INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}

# Shapes of the parameters of a fake model, and the indices of those left without a .grad.
MODELS = {
    "one-matrix": [(7, 5)],
    "mixed-shapes": [(3, 4), (4,), (2, 3, 5), (1,), (6, 1)],
    "scalar-and-big": [(), (64, 33), (33,)],
}
GRADLESS = {"one-matrix": (), "mixed-shapes": (1, 3), "scalar-and-big": (0,)}


# ---------------------------------------------------------------- helpers


def make_params(shapes, dtype=torch.float32, seed=0, gradless=(), scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        p = torch.zeros(shape, dtype=dtype, requires_grad=True)
        if i not in gradless:
            p.grad = (torch.randn(shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


def params_from_values(values, dtype=torch.float32):
    """One parameter per row, its gradient the row; ``dtype`` is one for all or a list, one per row."""
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(values)
    params = []
    for row, dtype in zip(values, dtypes, strict=True):
        p = torch.zeros(len(row), dtype=dtype, requires_grad=True)
        p.grad = torch.tensor(row, dtype=dtype)
        params.append(p)
    return params


def clone_params(params):
    clones = []
    for p in params:
        c = p.detach().clone().requires_grad_(True)
        c.grad = None if p.grad is None else p.grad.clone()
        clones.append(c)
    return clones


def cast_params(params, dtype):
    cast = []
    for p in params:
        c = p.detach().to(dtype).requires_grad_(True)
        c.grad = None if p.grad is None else p.grad.to(dtype)
        cast.append(c)
    return cast


def grads_of(params):
    return [p.grad.clone() for p in params if p.grad is not None]


def bits(t):
    return t.view(INT_VIEW[t.dtype])


def assert_bitwise_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(bits(a), bits(e)), f"{a} != {e}"


def assert_grads_match(actual, expected, norm_type):
    if norm_type == 2.0:
        assert_bitwise_equal(actual, expected)
    else:
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=0)


def ref_norm(grads, norm_type):
    flat = torch.cat([g.detach().double().flatten() for g in grads])
    return torch.linalg.vector_norm(flat, norm_type).item()


def assert_scalar_f32(norm):
    assert isinstance(norm, torch.Tensor)
    assert norm.dtype == torch.float32
    assert norm.shape == ()


def measure_norms(params, norm_type, foreach):
    # grad_norm takes no foreach; clip_grad_norm_ with max_norm=inf measures along each path.
    return [
        labkit.grad_norm(params, norm_type),
        labkit.clip_grad_norm_(params, INF, norm_type, foreach=foreach),
    ]


def two_layer_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return model


class HostSync(Exception):
    pass


def forbid_host_sync(m):
    def trap(*args, **kwargs):
        raise HostSync("host sync")

    for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
        m.setattr(torch.Tensor, name, trap)


# ---------------------------------------------------------------- 1. parity with torch (fp32)


@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=NORM_IDS)
def test_grad_norm_matches_torch_get_total_norm(model, foreach, norm_type):
    params = make_params(MODELS[model], gradless=GRADLESS[model])
    expected = torch.nn.utils.get_total_norm(grads_of(params), norm_type, foreach=foreach)
    for norm in measure_norms(params, norm_type, foreach):
        assert_scalar_f32(norm)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("ratio", [0.3, 3.0], ids=["clips", "no-op"])
@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=NORM_IDS)
def test_clip_grad_norm_matches_torch(model, foreach, norm_type, ratio):
    ours = make_params(MODELS[model], seed=1, gradless=GRADLESS[model])
    theirs = clone_params(ours)
    before = grads_of(ours)
    max_norm = ratio * ref_norm(before, norm_type)

    norm = labkit.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=foreach)

    assert_scalar_f32(norm)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    assert_grads_match(grads_of(ours), grads_of(theirs), norm_type)
    assert [p.grad is None for p in ours] == [p.grad is None for p in theirs]
    if ratio > 1:
        assert_bitwise_equal(grads_of(ours), before)
    else:
        torch.testing.assert_close(ref_norm(grads_of(ours), norm_type), max_norm, rtol=1e-5, atol=0)


@pytest.mark.parametrize("total", [0.0, 0.5, 5.0, 50.0], ids=["zero", "below", "above", "far-above"])
@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
def test_clip_grads_with_norm_matches_torch_and_formula(foreach, total):
    max_norm = 2.0
    ours = make_params(MODELS["mixed-shapes"], seed=2, gradless=GRADLESS["mixed-shapes"])
    theirs = clone_params(ours)
    before = grads_of(ours)
    total_norm = torch.tensor(total)

    labkit.clip_grads_with_norm_(ours, max_norm, total_norm, foreach=foreach)
    torch.nn.utils.clip_grads_with_norm_(theirs, max_norm, total_norm, foreach=foreach)

    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    assert_bitwise_equal(grads_of(ours), grads_of(theirs))
    assert_bitwise_equal(grads_of(ours), [g * coef for g in before])
    assert math.isclose(coef.item(), min(1.0, max_norm / (total + 1e-6)), rel_tol=1e-6)


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=NORM_IDS)
def test_clip_grad_norm_equals_its_two_halves(norm_type):
    whole = make_params(MODELS["mixed-shapes"], seed=3, scale=5.0)
    halves = clone_params(whole)
    norm = labkit.clip_grad_norm_(whole, 1.0, norm_type)
    measured = labkit.grad_norm(halves, norm_type)
    labkit.clip_grads_with_norm_(halves, 1.0, measured)
    assert torch.equal(norm, measured)
    assert_bitwise_equal(grads_of(whole), grads_of(halves))


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=NORM_IDS)
def test_foreach_and_for_loop_agree(norm_type):
    a = make_params(MODELS["scalar-and-big"], seed=4, scale=3.0)
    b = clone_params(a)
    na = labkit.clip_grad_norm_(a, 0.7, norm_type, foreach=True)
    nb = labkit.clip_grad_norm_(b, 0.7, norm_type, foreach=False)
    torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)
    assert_grads_match(grads_of(a), grads_of(b), norm_type)


def test_string_inf_norm_type_is_accepted_like_torch():
    params = make_params(MODELS["mixed-shapes"], seed=5)
    expected = torch.nn.utils.get_total_norm(grads_of(params), "inf")
    assert torch.equal(labkit.grad_norm(params, "inf"), expected)
    assert torch.equal(labkit.grad_norm(params, INF), expected)


@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
def test_float64_grad_norm_stays_float64_and_correct(foreach):
    params = make_params(MODELS["mixed-shapes"], dtype=torch.float64, seed=6)
    expected = torch.nn.utils.get_total_norm(grads_of(params), 2.0, foreach=foreach)
    for norm in measure_norms(params, 2.0, foreach):
        assert norm.dtype == torch.float64 and norm.dim() == 0
        assert torch.equal(norm, expected)


@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
def test_float64_norm_beyond_float32_range_is_finite_and_clips_like_torch(foreach):
    """[3e20, 4e20] in float64: a float32 norm would be inf and leave the gradients unclipped."""
    ours = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    ours.grad = torch.tensor([3e20, 4e20], dtype=torch.float64)
    theirs = ours.detach().clone().requires_grad_()
    theirs.grad = ours.grad.clone()
    norm = labkit.clip_grad_norm_([ours], 1.0, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_([theirs], 1.0, foreach=foreach)
    assert norm.item() == 5e20 and torch.equal(norm, expected)
    assert torch.equal(ours.grad, theirs.grad)
    torch.testing.assert_close(ours.grad, torch.tensor([0.6, 0.8], dtype=torch.float64))


def test_mixed_float32_float64_norm_is_float64_like_torch():
    params = make_params(MODELS["mixed-shapes"], seed=6)
    big = torch.zeros(params[0].shape, dtype=torch.float64, requires_grad=True)
    big.grad = params[0].grad.double() * 1e30
    params[0] = big
    norm = labkit.grad_norm(params)
    expected = torch.nn.utils.get_total_norm(grads_of(params))
    assert norm.dtype == torch.float64 and math.isfinite(norm.item())
    torch.testing.assert_close(norm, expected, rtol=1e-12, atol=0)


def test_float64_clip_matches_torch():
    ours = make_params(MODELS["mixed-shapes"], dtype=torch.float64, seed=6, scale=3.0)
    theirs = clone_params(ours)
    norm = labkit.clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm.dtype == torch.float64
    assert math.isclose(norm.item(), expected.item(), rel_tol=1e-12)
    for a, e in zip(grads_of(ours), grads_of(theirs)):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- 2. fp16 / bf16


@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_half_grad_norm_matches_float64_reference(dtype, norm_type, foreach):
    params = make_params(MODELS["scalar-and-big"], dtype=dtype, seed=7, scale=10.0)
    for norm in measure_norms(params, norm_type, foreach):
        assert_scalar_f32(norm)
        assert math.isclose(norm.item(), ref_norm(grads_of(params), norm_type), rel_tol=1e-5)


def test_mixed_dtypes_norm_matches_float64_reference():
    params = (
        make_params([(5, 5)], torch.float16, seed=8)
        + make_params([(7,)], torch.bfloat16, seed=9)
        + make_params([(3, 2)], torch.float32, seed=10)
    )
    for norm_type in NORM_TYPES:
        norm = labkit.grad_norm(params, norm_type)
        assert_scalar_f32(norm)
        assert math.isclose(norm.item(), ref_norm(grads_of(params), norm_type), rel_tol=1e-5)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_a_dtype_whose_gradients_are_all_empty_leaves_the_other_dtypes_norms_torchs(norm_type):
    """An FSDP2 rank can hold only empty shards of one dtype: the other dtypes' norms still count, an
    empty one's is 0 (torch has no inf-norm of an empty tensor: it raises)."""
    f64 = torch.float64
    empty, first = torch.zeros(0), torch.tensor([3.0, 4.0], dtype=f64)
    grads = [first, empty, torch.tensor([12.0], dtype=f64), empty]
    norms, _ = labkit.clip.grouped_norms(grads, norm_type)  # torch groups the empty float32 first here
    assert norms.dtype == f64 and norms.tolist() == [first.norm(norm_type).item(), 0.0, 12.0, 0.0]
    ours = labkit.clip.get_total_norm(grads, norm_type)
    if norm_type == math.inf:
        assert ours.item() == 12.0
    else:
        theirs = torch.nn.utils.get_total_norm(grads, norm_type)
        assert ours.dtype == theirs.dtype == f64 and torch.equal(ours, theirs)


def fp16_big_one_tensor():
    return params_from_values([[60000.0] * 300], torch.float16)


def fp16_big_many_tensors():
    return params_from_values([[50000.0]] * 4, torch.float16)  # each norm fits fp16, the total does not


FP16_BIG = {"one-tensor": fp16_big_one_tensor, "many-tensors": fp16_big_many_tensors}


@pytest.mark.parametrize("case", FP16_BIG, ids=list(FP16_BIG))
def test_torch_fp16_norm_overflows_and_zeroes_grads(case):
    params = FP16_BIG[case]()
    assert torch.isinf(torch.nn.utils.get_total_norm(grads_of(params)))
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads_of(params))


@pytest.mark.parametrize("case", FP16_BIG, ids=list(FP16_BIG))
def test_fp16_norm_above_65504_is_finite_and_clips(case):
    params = FP16_BIG[case]()
    before = grads_of(params)
    expected = ref_norm(before, 2.0)
    assert expected > 65504

    norm = labkit.clip_grad_norm_(params, 1.0)

    assert_scalar_f32(norm)
    assert math.isclose(norm.item(), expected, rel_tol=1e-5)
    coef = 1.0 / (expected + 1e-6)
    for g, b in zip(grads_of(params), before):
        assert g.dtype == torch.float16
        torch.testing.assert_close(g.double(), b.double() * coef, rtol=1e-3, atol=0)
    assert math.isclose(ref_norm(grads_of(params), 2.0), 1.0, rel_tol=1e-3)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_half_clip_scales_like_float32(dtype):
    params = make_params(MODELS["mixed-shapes"], dtype=dtype, seed=11, scale=4.0, gradless=(2,))
    as_f32 = cast_params(params, torch.float32)
    norm = labkit.clip_grad_norm_(params, 1.0)
    norm32 = labkit.clip_grad_norm_(as_f32, 1.0)
    assert_scalar_f32(norm)
    torch.testing.assert_close(norm, norm32, rtol=1e-5, atol=0)
    for g, g32 in zip(grads_of(params), grads_of(as_f32)):
        assert g.dtype == dtype
        torch.testing.assert_close(g, g32.to(dtype))  # default half tolerances: about one ulp


# ---------------------------------------------------------------- 3. non-finite gradients


def params_with_bad_value(bad, dtype=torch.float32):
    params = make_params([(3, 2), (4,), (2, 2)], dtype=dtype, seed=12, gradless=(1,))
    params[2].grad[1, 0] = bad
    return params


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=NORM_IDS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_nonfinite_grad_gives_nonfinite_norm(bad, norm_type):
    norm = labkit.grad_norm(params_with_bad_value(bad), norm_type)
    assert_scalar_f32(norm)
    if math.isnan(bad):
        assert torch.isnan(norm)
    else:
        assert torch.isinf(norm) and norm > 0


@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=["fp32", *HALF_IDS])
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_clip_leaves_grads_bitwise_unchanged_when_norm_nonfinite(bad, dtype, foreach):
    params = params_with_bad_value(bad, dtype)
    before = grads_of(params)
    norm = labkit.clip_grad_norm_(params, 1.0, foreach=foreach)
    assert not torch.isfinite(norm)
    assert_bitwise_equal(grads_of(params), before)
    assert params[1].grad is None


@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_torch_clip_corrupts_grads_when_norm_nonfinite(bad):
    params = params_with_bad_value(bad)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    finite_grad = params[0].grad
    if math.isnan(bad):
        assert torch.isnan(finite_grad).all()
    else:
        assert torch.equal(finite_grad, torch.zeros_like(finite_grad))


def test_error_if_nonfinite_names_first_bad_parameter_by_index():
    params = make_params([(2,), (3,), (2, 2), (4,)], seed=13, gradless=(0,))
    params[2].grad[0, 1] = NAN
    params[3].grad[2] = INF
    before = grads_of(params)
    with pytest.raises(RuntimeError, match=r"parameter 2\b"):
        labkit.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert_bitwise_equal(grads_of(params), before)


def test_error_if_nonfinite_names_parameter_by_module_name():
    model = two_layer_model()
    model[1].weight.grad[0, 0] = INF
    before = grads_of(model.parameters())
    with pytest.raises(RuntimeError, match=r"\b1\.weight\b"):
        labkit.clip_grad_norm_(model.named_parameters(), 1.0, error_if_nonfinite=True)
    assert_bitwise_equal(grads_of(model.parameters()), before)


def test_error_if_nonfinite_with_finite_grads_clips_normally():
    ours = make_params(MODELS["mixed-shapes"], seed=14, scale=3.0)
    theirs = clone_params(ours)
    norm = labkit.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=True)
    assert torch.equal(norm, expected)
    assert_bitwise_equal(grads_of(ours), grads_of(theirs))


# ---------------------------------------------------------------- 4. empty inputs

EMPTY = {
    "empty-list": lambda: [],
    "all-grads-none": lambda: make_params([(2,), (3, 3)], gradless=(0, 1)),
    "empty-generator": lambda: (p for p in []),
    "named-no-grads": lambda: nn.Linear(3, 2).named_parameters(),
}


@pytest.mark.parametrize("fn", ["grad_norm", "clip_grad_norm_"])
@pytest.mark.parametrize("case", EMPTY, ids=list(EMPTY))
def test_no_gradients_give_zero_norm(case, fn):
    params = EMPTY[case]()
    if fn == "grad_norm":
        norm = labkit.grad_norm(params)
    elif case == "empty-generator":  # torch's warning: an exhausted model.parameters() is a common bug
        with pytest.warns(UserWarning, match="empty generator, no gradient clipping will occur"):
            norm = labkit.clip_grad_norm_(params, 1.0)
    else:
        norm = labkit.clip_grad_norm_(params, 1.0)
    assert_scalar_f32(norm)
    assert torch.equal(norm, torch.tensor(0.0))


def test_single_tensor_parameter():
    w = torch.zeros(2, requires_grad=True)
    w.grad = torch.tensor([3.0, 4.0])
    assert torch.equal(labkit.grad_norm(w), torch.tensor(5.0))
    assert torch.equal(labkit.clip_grad_norm_(w, 1.0), torch.tensor(5.0))
    expected = torch.tensor([3.0, 4.0]) * torch.clamp(1.0 / (torch.tensor(5.0) + 1e-6), max=1.0)
    assert torch.equal(w.grad, expected)
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8]))


# ---------------------------------------------------------------- 5. bad arguments


@pytest.mark.parametrize("max_norm", [0, -1.0, NAN, "abc"], ids=["zero", "negative", "nan", "string"])
def test_bad_max_norm_raises_before_writing(max_norm):
    params = make_params(MODELS["mixed-shapes"], seed=15, scale=10.0)
    before = grads_of(params)
    with pytest.raises(ValueError, match="max_norm") as info:
        labkit.clip_grad_norm_(params, max_norm)
    assert "> 0" in str(info.value)
    with pytest.raises(ValueError, match="max_norm"):
        labkit.clip_grads_with_norm_(params, max_norm, torch.tensor(100.0))
    assert_bitwise_equal(grads_of(params), before)


@pytest.mark.parametrize("norm_type", [NAN, "l2"], ids=["nan", "string"])
def test_bad_norm_type_raises_before_writing(norm_type):
    params = make_params(MODELS["mixed-shapes"], seed=16, scale=10.0)
    before = grads_of(params)
    with pytest.raises(ValueError, match="norm_type") as info:
        labkit.clip_grad_norm_(params, 1.0, norm_type)
    assert "2.0 for the usual L2 norm" in str(info.value)
    with pytest.raises(ValueError, match="norm_type"):
        labkit.grad_norm(params, norm_type)
    assert_bitwise_equal(grads_of(params), before)


@pytest.mark.parametrize("norm_type", [0, -1.0, -2.0, -INF], ids=["zero", "-1", "-2", "-inf"])
def test_zero_and_negative_norm_orders_match_torch(norm_type):
    """torch accepts them: 0 counts the non-zeros, -inf is the smallest |g|."""
    ours = make_params(MODELS["mixed-shapes"], seed=16, scale=10.0)
    theirs = clone_params(ours)
    norm = labkit.clip_grad_norm_(ours, 1.0, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert torch.equal(norm, expected)
    assert_bitwise_equal(grads_of(ours), grads_of(theirs))


def test_grad_norm_of_tensors_without_grad_says_use_get_total_norm():
    grads = [torch.tensor([3.0]), torch.tensor([4.0])]
    with pytest.raises(ValueError, match="get_total_norm"):
        labkit.grad_norm(grads)
    assert torch.equal(labkit.get_total_norm(grads), torch.nn.utils.get_total_norm(grads))



def _w():
    w = torch.zeros(2, requires_grad=True)
    w.grad = torch.tensor([3.0, 4.0])
    return w


WRONG_ITERABLES = {  # what was passed -> what the message says it was
    "a None among them": (lambda w: [w, None], "item 1 is None"),
    "a pair the wrong way round": (lambda w: [(w, "w")], r"item 0 is a tuple of 2 \(Tensor, str\)"),
    "a triple": (lambda w: [("w", w, 1)], r"item 0 is a tuple of 3 \(str, Tensor, int\)"),
    "a 1-tuple": (lambda w: [(w,)], r"item 0 is a tuple of 1 \(Tensor\)"),
    "a nested list": (lambda w: [[w]], "item 0 is a list"),
    "a dict": (lambda w: {"w": w}, r"got a dict \(pass its .values\(\) or .items\(\)\)"),
    "a dict's keys": (lambda w: list({"w": w}), r"item 0 is the str 'w' \(the keys of a dict\?"),
    "a number": (lambda w: 5, "got an int"),
}
CLIP_FUNCTIONS = {
    "clip_grad_norm_": lambda p: labkit.clip_grad_norm_(p, 1.0),
    "clip_grads_with_norm_": lambda p: labkit.clip_grads_with_norm_(p, 1.0, torch.tensor(5.0)),
    "grad_norm": labkit.grad_norm,
    "get_total_norm": labkit.get_total_norm,
    "clip_grad_value_": lambda p: labkit.clip_grad_value_(p, 1.0),
    "ZClip.clip_": lambda p: labkit.clippers.ZClip().clip_(p),
    "UpdateNormClip.begin_": lambda p: labkit.clippers.UpdateNormClip().begin_(p),
}


@pytest.mark.parametrize("fn", CLIP_FUNCTIONS)
@pytest.mark.parametrize("wrong", WRONG_ITERABLES)
def test_the_wrong_kind_of_iterable_says_what_was_passed_and_what_to_pass(fn, wrong):
    w = _w()
    make, what = WRONG_ITERABLES[wrong]
    with pytest.raises(TypeError, match=what) as info:
        CLIP_FUNCTIONS[fn](make(w))
    assert "tensors (model.parameters()), (name, tensor) pairs (model.named_parameters())" in str(info.value)
    assert torch.equal(w.grad, torch.tensor([3.0, 4.0]))  # nothing clipped before the error


def test_get_total_norm_of_integer_tensors_says_to_convert_them():
    with pytest.raises(TypeError, match=r"floating-point tensors \(gradients\); item 1 is a torch.int64"):
        labkit.get_total_norm([torch.tensor([3.0]), torch.tensor([4])])
    assert labkit.get_total_norm([torch.tensor([3.0]), torch.tensor([4]).float()]).item() == 5.0


@pytest.mark.parametrize("total", [True, False, "5", None, [5.0]],
                         ids=["True", "False", "str", "None", "list"])
def test_clip_grads_with_norm_refuses_a_total_norm_that_is_no_number_or_tensor(total):
    """A bool is an int to Python: True would clip with a norm of 1.0 (a coefficient of 1 / (1 + 1e-6))."""
    w = _w()
    with pytest.raises(TypeError, match="total_norm must be a tensor or a number"):
        labkit.clip_grads_with_norm_([w], 0.5, total)
    assert torch.equal(w.grad, torch.tensor([3.0, 4.0]))


# ---------------------------------------------------------------- 6. reads only, generators


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=["fp32", *HALF_IDS])
def test_grad_norm_never_writes(dtype, norm_type):
    params = make_params(MODELS["mixed-shapes"], dtype=dtype, seed=17, gradless=(3,))
    before = grads_of(params)
    versions = [p.grad._version for p in params if p.grad is not None]
    labkit.grad_norm(params, norm_type)
    assert_bitwise_equal(grads_of(params), before)
    assert [p.grad._version for p in params if p.grad is not None] == versions


@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
def test_generator_is_not_exhausted_before_clipping(named):
    model = two_layer_model(seed=1)
    reference = clone_params(model.parameters())
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.01)
    params = model.named_parameters() if named else model.parameters()
    norm = labkit.clip_grad_norm_(params, 0.01)
    assert torch.equal(norm, expected)
    assert norm > 0.01
    assert_bitwise_equal(grads_of(model.parameters()), grads_of(reference))
    assert math.isclose(ref_norm(grads_of(model.parameters()), 2.0), 0.01, rel_tol=1e-4)


def test_named_parameters_and_plain_list_agree():
    model = two_layer_model(seed=2)
    plain = clone_params(model.parameters())
    assert torch.equal(labkit.grad_norm(model.named_parameters()), labkit.grad_norm(plain))
    labkit.clip_grad_norm_(list(model.named_parameters()), 0.1)
    labkit.clip_grad_norm_(plain, 0.1)
    assert_bitwise_equal(grads_of(model.parameters()), grads_of(plain))


# ---------------------------------------------------------------- 7. no host sync


def test_host_sync_trap_is_armed(monkeypatch):
    t = torch.tensor([1.5])
    with monkeypatch.context() as m:
        forbid_host_sync(m)
        for sync in (t.item, t.tolist, lambda: bool(t), lambda: float(t), lambda: int(t)):
            with pytest.raises(HostSync):
                sync()
    assert t.item() == 1.5


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "linf"])
@pytest.mark.parametrize("bad", [None, NAN, INF], ids=["finite", "nan", "inf"])
def test_no_host_sync(monkeypatch, bad, norm_type):
    params = make_params(MODELS["mixed-shapes"], seed=18, scale=10.0, gradless=(1,))
    if bad is not None:
        params[2].grad[0, 0, 0] = bad
    before = grads_of(params)
    with monkeypatch.context() as m:
        forbid_host_sync(m)
        measured = labkit.grad_norm(params, norm_type)
        norm = labkit.clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=False)
        labkit.clip_grads_with_norm_(clone_params(params), 1.0, norm)
    torch.testing.assert_close(measured, norm, rtol=0, atol=0, equal_nan=True)
    if bad is None:
        assert math.isclose(ref_norm(grads_of(params), norm_type), 1.0, rel_tol=1e-5)
    else:
        assert_bitwise_equal(grads_of(params), before)


# ---------------------------------------------------------------- 8. properties

finite_f32 = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)
grad_values = st.lists(st.lists(finite_f32, min_size=1, max_size=16), min_size=1, max_size=4)
norm_types = st.sampled_from(NORM_TYPES)
max_norms = st.floats(1.0, 1e4)
PROPERTY = settings(max_examples=100, deadline=None, database=None)


@PROPERTY
@given(values=grad_values, norm_type=norm_types)
def test_property_grad_norm_matches_float64(values, norm_type):
    params = params_from_values(values)
    norm = labkit.grad_norm(params, norm_type)
    assert_scalar_f32(norm)
    assert math.isclose(norm.item(), ref_norm(grads_of(params), norm_type), rel_tol=1e-5, abs_tol=1e-6)


@PROPERTY
@given(values=grad_values, norm_type=norm_types, max_norm=max_norms)
def test_property_clipped_norm_is_at_most_max_norm(values, norm_type, max_norm):
    params = params_from_values(values)
    labkit.clip_grad_norm_(params, max_norm, norm_type)
    assert ref_norm(grads_of(params), norm_type) <= max_norm * (1 + 1e-5)


@PROPERTY
@given(values=grad_values, norm_type=norm_types, max_norm=max_norms)
def test_property_returns_grad_norm_before_clipping(values, norm_type, max_norm):
    params = params_from_values(values)
    expected = labkit.grad_norm(params, norm_type)
    assert torch.equal(labkit.clip_grad_norm_(params, max_norm, norm_type), expected)


@PROPERTY
@given(values=grad_values, norm_type=norm_types, max_norm=max_norms)
def test_property_clipping_preserves_direction(values, norm_type, max_norm):
    params = params_from_values(values)
    before = grads_of(params)
    norm = labkit.clip_grad_norm_(params, max_norm, norm_type)
    coef = min(1.0, max_norm / (norm.item() + 1e-6))
    assert 0.0 <= coef <= 1.0
    for g, b in zip(grads_of(params), before):
        # atol: products below fp32's smallest normal (1.2e-38) lose relative precision.
        torch.testing.assert_close(g.double(), b.double() * coef, rtol=1e-6, atol=1e-37)


@PROPERTY
@given(values=grad_values, norm_type=norm_types, factor=st.floats(1.001, 100.0))
def test_property_no_op_below_max_norm(values, norm_type, factor):
    params = params_from_values(values)
    before = grads_of(params)
    labkit.clip_grad_norm_(params, ref_norm(before, norm_type) * factor + 1e-3, norm_type)
    for g, b in zip(grads_of(params), before):
        torch.testing.assert_close(g, b, rtol=1e-6, atol=0)


@PROPERTY
@given(values=grad_values, norm_type=norm_types, max_norm=max_norms)
def test_property_clipping_is_idempotent(values, norm_type, max_norm):
    params = params_from_values(values)
    labkit.clip_grad_norm_(params, max_norm, norm_type)
    once = grads_of(params)
    labkit.clip_grad_norm_(params, max_norm, norm_type)
    for g, o in zip(grads_of(params), once):
        torch.testing.assert_close(g, o, rtol=1e-5, atol=0)


@settings(max_examples=300, deadline=None, database=None)
@given(x=st.floats(allow_nan=False)
       | st.sampled_from([3.4028235e38, 3.40282357e38, 3.4028236e38, 1e-46, -1e39]))
def test_property_round_to_float32_is_torchs_cast(x):
    from labkit.clip import round_to
    assert round_to(x, torch.float32) == torch.tensor(x, dtype=torch.float64).float().item()
    assert round_to(x, torch.float64) == x


# ---------------------------------------------------------------- 9. clip_grads_with_norm_ by hand


@pytest.mark.parametrize("foreach", FOREACH, ids=FOREACH_IDS)
@pytest.mark.parametrize("total", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_clip_grads_with_nonfinite_norm_leaves_grads_unchanged(total, foreach):
    params = make_params(MODELS["mixed-shapes"], seed=19, gradless=(0,))
    theirs = clone_params(params)
    before = grads_of(params)
    labkit.clip_grads_with_norm_(params, 1.0, torch.tensor(total), foreach=foreach)
    assert_bitwise_equal(grads_of(params), before)
    torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, torch.tensor(total), foreach=foreach)
    assert not all(torch.equal(a, b) for a, b in zip(grads_of(theirs), before))


def test_clip_grads_with_norm_on_no_gradients_is_a_no_op():
    params = make_params([(2,), (3,)], gradless=(0, 1))
    assert labkit.clip_grads_with_norm_(params, 1.0, torch.tensor(5.0)) is None
    assert all(p.grad is None for p in params)


# ---------------------------------------------------------------- CPU norms over torch's threads


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_splits_the_norms_over_a_pool_of_its_own():
    """The norms' thread pool, made in a parent that then forks, is not the child's: the child's work runs."""
    from labkit import clip as clip_module

    assert clip_module._pool(1).submit(int, 3).result(timeout=10) == 3  # the parent's pool, its thread up
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only, never return into pytest
        try:
            ok = clip_module._pool(1).submit(int, 7).result(timeout=10) == 7
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def two_threads(monkeypatch):
    from labkit import clip as clip_module

    monkeypatch.setattr(clip_module, "OMP_THREADS_SLEEP", True)  # as under OMP_WAIT_POLICY=passive
    # two threads as foreach_norm counts them, not torch's own: the split hands slices to Python threads;
    # an OpenMP team of two in this process would deadlock a child forked from it (libgomp is not
    # fork-safe: a mutation run forks a child per mutant from the process that ran these tests)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


@pytest.mark.parametrize("sizes, handed", [
    ([3_000_000] * 3, [1]),                 # cut where half the elements are reached: 2 + 1 tensors
    ([1, 9_000_000, 5], [1]),
    ([5_000_000, 4_000_000, 0, 7], [3]),    # the first tensor alone is past half
    ([9_000_000], []),                      # one tensor: nothing to split
    ([4_500_000, 4_500_000], [1]),          # exactly half at the first: cut there
    ([4_500_000, 4_500_001], []),           # one element short of half: the last tensor is never cut off
    ([4_500_000, 4_500_000, 0], [2]),       # two threads, two slices: no second cut, however it falls
], ids=["even", "one-large", "with-empty", "one-tensor", "half", "short-of-half", "no-third"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0])
def test_norms_split_over_threads_are_torchs_to_the_bit(two_threads, monkeypatch, sizes, handed, dtype,
                                                        norm_type):
    """Large CPU lists are normed in contiguous slices of about equal elements on two threads (the second
    handed to the pool): the same bits as torch's one call, in order, for any order of norm."""
    from labkit import clip as clip_module

    given = []
    real = clip_module._pool

    def counting(workers):
        pool = real(workers)
        submit = pool.submit
        return type(
            "Pool", (), {"submit": lambda self, fn, part: given.append(len(part)) or submit(fn, part)}
        )()

    monkeypatch.setattr(clip_module, "_pool", counting)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = (torch.randn(p.numel()) * 3).to(dtype)
    grads = [p.grad for p in params]
    acc = torch.float32 if dtype == torch.float16 else None
    ours = clip_module.foreach_norm(grads, norm_type, acc)
    assert given == handed
    assert [t.dtype for t in ours] == [acc or dtype] * len(grads)
    assert all(torch.equal(a, b) for a, b in zip(ours, torch._foreach_norm(grads, norm_type, dtype=acc)))
    if dtype != torch.float16:  # (torch's own fp16 norm is the deliberate deviation tested above)
        theirs = [nn.Parameter(p.detach().clone()) for p in params]
        for t, p in zip(theirs, params):
            t.grad = p.grad.clone()
        assert torch.equal(labkit.clip_grad_norm_(params, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0))
        assert all(torch.equal(p.grad, t.grad) for p, t in zip(params, theirs))


def test_split_norms_keep_the_callers_grad_mode(two_threads):
    from labkit import clip as clip_module

    leaves = [torch.ones(5_000_000, requires_grad=True), torch.ones(5_000_000, requires_grad=True)]
    with torch.no_grad():
        assert not any(t.requires_grad for t in clip_module.foreach_norm(leaves, 2.0))
    assert all(t.requires_grad for t in clip_module.foreach_norm(leaves, 2.0))


def test_small_lists_one_thread_and_spinning_openmp_threads_are_not_split(two_threads, monkeypatch):
    from labkit import clip as clip_module

    monkeypatch.setattr(
        clip_module, "_pool", lambda workers: pytest.fail("a small list was handed to a thread")
    )
    grads = [torch.ones(1000), torch.ones(1000)]  # two threads, but less than SPLIT_NUMEL a slice
    assert ([t.item() for t in clip_module.foreach_norm(grads, 2.0)]
            == [pytest.approx(math.sqrt(1000), rel=1e-6)] * 2)
    big = [torch.ones(5_000_000), torch.ones(5_000_000)]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert [t.item() for t in clip_module.foreach_norm(big, 1.0)] == [5e6, 5e6]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(clip_module, "OMP_THREADS_SLEEP", False)  # libgomp's default: its threads spin
    assert [t.item() for t in clip_module.foreach_norm(big, 1.0)] == [5e6, 5e6]
