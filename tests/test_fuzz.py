"""Bad input, generated: every public constructor and call either raises a clear labkit error before
anything changed, or gives the reference's result; after an error the next valid call is the reference's.

Bounded (max_examples, derandomized) so CI stays fast and repeatable.
"""

import copy
import os
import re
import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import labkit
from labkit import FaultSchedule, GradScaler, TrainStep
from labkit.alarms import ClipAlarm, SkipAlarm
from labkit.clippers import NormClip
from labkit.faults import Faults
from labkit.lab.experiment import ExperimentConfig

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LABKIT = os.path.dirname(labkit.__file__)
CLEAR = (TypeError, ValueError, KeyError, FileNotFoundError)
F32 = torch.finfo(torch.float32)
NAN, INF = float("nan"), float("inf")


def assert_clear(exc):
    """A clear labkit error: raised by labkit's own checks (not deep in torch), with a message saying why."""
    assert isinstance(exc, CLEAR), f"{type(exc).__name__}: {exc}"
    where = traceback.extract_tb(exc.__traceback__)[-1].filename
    assert where.startswith(LABKIT), f"raised in {where}, not by labkit: {type(exc).__name__}: {exc}"
    assert len(str(exc)) > 25, f"too terse: {exc}"


ODD = [None, True, "2", "nan", [], {}, object(), NAN, INF, -INF, -1, 0, 0.0, 1e-300, 1e-45, 2**31, 2**63,
       1e300, torch.tensor(0.5), 1.5, 3]
numbers = st.one_of(
    st.sampled_from(ODD), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 2**33)
)


# ---------------------------------------------------------------- GradScaler: torch is the reference


def drive(scaler, pattern):
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    scales = []
    for bad in pattern:
        opt.zero_grad()
        scaler.scale((w * (NAN if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@FUZZ
@given(
    init_scale=st.one_of(numbers, st.sampled_from([2.0**16, 1.0, 2.0**-10])),
    growth_factor=st.one_of(numbers, st.just(2.0)),
    backoff_factor=st.one_of(numbers, st.just(0.5)),
    growth_interval=st.one_of(numbers, st.integers(1, 4)),
    pattern=st.lists(st.booleans(), min_size=1, max_size=12),
)
def test_grad_scaler_is_torch_or_refuses(init_scale, growth_factor, backoff_factor, growth_interval, pattern):
    kwargs = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                  growth_interval=growth_interval)
    try:
        ours = GradScaler("cpu", **kwargs)
    except Exception as e:  # noqa: BLE001 - the assertion is on what was raised
        assert_clear(e)
        return
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    expected = [s for s in drive(theirs, pattern)]
    got = drive(ours, pattern)
    alive = [s >= F32.tiny for s in expected]
    n = alive.index(False) if False in alive else len(expected)
    assert got[:n] == expected[:n]  # torch's trajectory, as long as torch's scale is alive
    assert all(F32.tiny <= s <= F32.max for s in got)  # and ours never dies
    assert ours.skip_count == sum(pattern)


@settings(FUZZ, max_examples=25)
@given(key=st.sampled_from(["scale", "_growth_tracker", "_hysteresis_left", "skip_count", "skip_streak",
                            "growth_interval", "backoff_factor", "hysteresis", "min_scale"]),
       value=numbers)
def test_scaler_load_state_dict_is_atomic(key, value):
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=3, hysteresis=2)
    drive(scaler, [True, False, False])
    good = scaler.state_dict()
    ref = GradScaler("cpu", init_scale=2.0**8, growth_interval=3, hysteresis=2)
    ref.load_state_dict(good)
    try:
        scaler.load_state_dict({**good, key: value})
    except Exception as e:  # noqa: BLE001
        assert_clear(e)
        assert scaler.state_dict() == good  # nothing was written
        # next valid call = reference
        assert drive(scaler, [False, True, False]) == drive(ref, [False, True, False])
        return
    state = scaler.state_dict()
    assert F32.tiny <= state["scale"] <= F32.max and 0 <= state["_growth_tracker"] < state["growth_interval"]
    assert (
        0 <= state["_hysteresis_left"] <= state["hysteresis"]
        and 0 <= state["skip_streak"] <= state["skip_count"]
    )


# ---------------------------------------------------------------- FaultSchedule.parse: a reference parser


SPEC = re.compile(r"^(\d+)(?:-(\d+))?:(spike|nan|inf|overflow)(?::([^:]+))?$")


def reference_parse(specs):
    """The documented grammar, in plain Python: {step: label} for the steps 0..99."""
    table = {}
    for spec in specs:
        m = SPEC.match(spec.strip())
        first, last, kind, mag = m.groups()
        magnitude = float(mag) if mag is not None else 1000.0
        label = f"spike:{magnitude:g}" if kind == "spike" else kind
        for step in range(int(first), min(int(last or first), 99) + 1):
            table[step] = label
    return table


spec_text = st.one_of(
    st.builds(lambda a, n, k: f"{a}{'-' + str(a + n) if n else ''}:{k}", st.integers(0, 60),
              st.integers(0, 30),
              st.sampled_from(["nan", "inf", "overflow", "spike", "spike:10", "spike:-1", "boom", "nan:3"])),
    st.text(alphabet="0123456789-:naspike ", max_size=12),
)


@FUZZ
@given(specs=st.one_of(st.lists(spec_text, max_size=4), spec_text, st.sampled_from([None, 5, [5], [None]])))
def test_fault_specs_parse_like_the_grammar_or_refuse(specs):
    try:
        schedule = FaultSchedule.parse(specs)
    except Exception as e:  # noqa: BLE001
        assert_clear(e)
        return
    expected = reference_parse(specs)
    assert {s: schedule[s].label for s in range(100) if schedule.get(s) is not None} == expected


# ---------------------------------------------------------------- ExperimentConfig


@FUZZ
@given(field=st.sampled_from(["seed", "lr", "loss_weight", "init_scale", "steps", "growth_interval",
                              "max_norm", "fault_rank", "device", "faults", "precision"]),
       value=st.one_of(numbers, st.sampled_from(["cpu", "cuda", "gpu", "fp16", ["5:nan"], ("1-2:inf",),
                                                 "5:nan"])))
def test_experiment_config_is_valid_or_refuses(field, value):
    try:
        config = ExperimentConfig(**{field: value})
    except Exception as e:  # noqa: BLE001
        assert_clear(e)
        return
    got = getattr(config, field)
    assert got == (tuple(value) if field == "faults" else value)
    if field in ("lr", "loss_weight", "init_scale"):
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < INF
    if field == "seed":
        assert isinstance(value, int) and 0 <= value < 2**32


# ---------------------------------------------------------------- TrainStep: construction


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


SETTINGS = {
    "precision": ["fp32", "fp16", "bf16", "FP16", None, 16],
    "max_norm": [None, 1.0, 0.1, 0, -1.0, NAN, "1", INF],
    "norm_type": [2.0, 1, INF, 0, -2.0, "fro", None],
    "accumulation_steps": [1, 2, 0, 2.0, True, 100],
    "skip_alarm": [None, 1, 8, 0, 1.5],
    "clip_alarm": [None, 0.5, 1.0, -0.1, "x"],
    "clip_window": [1, 100, 0, None],
    "faults": [None, {}, ["1:nan"], {1: "overflow"}, "1:nan", [1], {1: 5}, {-1: "nan"},
               ["0-1000000000:spike"]],
    "log": [None, "log.jsonl", "nope/log.jsonl", 7],
}


def spelled(kwargs):
    """Return TrainStep's keywords for a draw: the norm order in a NormClip, alarms and faults as hooks."""
    out = {k: kwargs[k] for k in ("precision", "max_norm", "accumulation_steps", "log") if k in kwargs}
    if "norm_type" in kwargs:
        limit = out.pop("max_norm", 1.0)
        out["clipper"] = NormClip(1.0 if limit is None else limit, norm_type=kwargs["norm_type"])
    hooks = []
    if "skip_alarm" in kwargs:
        hooks.append(SkipAlarm(kwargs["skip_alarm"]))
    if "clip_alarm" in kwargs or "clip_window" in kwargs:
        hooks.append(ClipAlarm(kwargs.get("clip_alarm", 0.5), window=kwargs.get("clip_window", 100)))
    if "faults" in kwargs:
        hooks.append(Faults(kwargs["faults"]))
    return {**out, "hooks": hooks}


@settings(FUZZ, max_examples=20)
@given(st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in SETTINGS.items()}))
def test_trainstep_construction_refuses_clearly_or_trains_like_its_canonical_twin(tmp_path_factory, kwargs):
    tmp = tmp_path_factory.mktemp("fuzz")
    if isinstance(kwargs.get("log"), str):
        kwargs["log"] = str(tmp / kwargs["log"])
    task = labkit.ToyTask(batch_size=8)
    model = bn_model()
    try:
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, **spelled(kwargs))
    except Exception as e:  # noqa: BLE001
        assert_clear(e)
        assert list(tmp.iterdir()) == []  # not even the log file was created
        return
    # the reference: the same run with every setting spelled canonically
    canon = dict(kwargs)
    if "faults" in kwargs:
        canon["faults"] = FaultSchedule.coerce(kwargs["faults"])
    canon["log"] = None
    for key in ("max_norm", "norm_type"):
        if kwargs.get(key) is not None:
            canon[key] = float(kwargs[key])
    ref_model = bn_model()
    ref = TrainStep(
        ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.05), task.loss_fn, **spelled(canon)
    )
    if kwargs.get("accumulation_steps", 1) > task.batch_size:  # only a batch can refuse it: at the call
        with pytest.raises(ValueError, match="need at least accumulation_steps") as e:
            step(*task.batch(0))
        assert_clear(e.value)
        return
    for i in range(2):
        a, b = step(*task.batch(i)), ref(*task.batch(i))
        assert a.to_json() == b.to_json()
    step.log.close()
    if kwargs.get("log"):
        assert [r.step for r in labkit.StepLog.read_jsonl(kwargs["log"])] == [0, 1]


# ---------------------------------------------------------------- TrainStep: calls


def bad_calls(task):
    x, y = task.batch(0)
    user_error = RuntimeError("the user's loss broke")

    def raising_loss(out, t):
        raise user_error

    return {
        "0-d": ((torch.tensor(1.0), y), None),
        "list": ((x.tolist(), y), None),
        "numpy": ((x.numpy(), y), None),
        "targets-none": ((x, None), None),  # a two-argument loss called with one: the user's TypeError
        "targets-list": ((x, y.tolist()), None),
        "short-targets": ((x, y[:3]), None),
        "dict-targets": (({"features": x}, y), None),  # model(**batch) with a keyword the model lacks
        "ragged-dict": (({"a": x, "b": y[:2]}, None), None),
        "int-inputs": ((x.long(), y), None),
        "wrong-width": ((x[:, :5], y), None),
        "float-loss": ((x, y), lambda out, t: 1.0),
        "detached-loss": ((x, y), lambda out, t: nn.functional.mse_loss(out, t).detach()),
        "vector-loss": ((x, y), lambda out, t: (out - t) ** 2),
        "raising-loss": ((x, y), raising_loss),
    }


def state_of(step):
    return {
        "model": copy.deepcopy(step.model.state_dict()),
        "opt": copy.deepcopy(step.optimizer.state_dict()),
        "step": step.state_dict(),
        "records": [r.to_json() for r in step.log],
    }


def assert_same_state(a, b):
    assert a["step"] == b["step"] and a["records"] == b["records"]
    for part in ("model", "opt"):
        flat_a, flat_b = (
            torch.utils._pytree.tree_flatten(a[part])[0],
            torch.utils._pytree.tree_flatten(b[part])[0],
        )
        for u, v in zip(flat_a, flat_b):
            assert (torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v), part


@settings(FUZZ, max_examples=12)
@given(precision=st.sampled_from(["fp32", "fp16"]),
       calls=st.lists(st.one_of(st.none(), st.sampled_from(sorted(bad_calls(labkit.ToyTask(batch_size=8))))),
                      min_size=1, max_size=4))
def test_trainstep_calls_refuse_without_changing_state_and_then_match_the_reference(precision, calls):
    task = labkit.ToyTask(batch_size=8)
    bad = bad_calls(task)

    def make():
        model = bn_model()
        return TrainStep(model, torch.optim.Adam(model.parameters(), lr=1e-2), task.loss_fn,
                         precision=precision, hooks=[SkipAlarm(None), Faults({2: "nan", 3: "overflow"})])

    step, ref = make(), make()
    i = 0
    for call in calls + [None]:  # always end with a valid call
        if call is None:
            a, b = step(*task.batch(i)), ref(*task.batch(i))
            assert a.to_json() == b.to_json()
            i += 1
            continue
        args, loss_fn = bad[call]
        before = state_of(step)
        step.loss_fn = loss_fn or task.loss_fn
        try:
            step(*args)
        except Exception as e:  # noqa: BLE001
            if call not in ("raising-loss", "targets-none", "dict-targets", "wrong-width", "int-inputs"):
                # labkit's own check; the others are the user's model's/loss's errors, unchanged
                assert_clear(e)
            elif call == "raising-loss":
                assert str(e) == "the user's loss broke"
        else:
            pytest.fail(f"{call} was accepted")
        finally:
            step.loss_fn = task.loss_fn
        assert_same_state(state_of(step), before)
