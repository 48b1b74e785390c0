"""labkit.export: a run written to TensorBoard, trackio, MLflow and W&B (offline), read back by each
tracker's own reader and compared with the JSONL bit for bit; alarms in the trackers' alert stores;
a missing package fails with its install line; replays and rewinds."""

import glob
import importlib.util
import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import SkipStreakWarning, StepRecord
from labkit.__main__ import main as labkit_main
from labkit.export import LOG2_EDGES, log2_histogram, replay, row
from labkit.export.replay import read_records
from labkit.lab.demo import main as demo_main
from labkit.lab.experiment import ExperimentConfig, run_experiment

TRACKERS = ["tensorboard", "trackio", "mlflow", "wandb"]
PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "mlflow": "mlflow", "wandb": "wandb"}

# The oracle: the schema's names written out by hand from the issue, not read from labkit.export.
BY_HAND = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "grad/norm_preclip", "clip_coef": "grad/clip_coef",
    "clipped": "grad/clipped", "scale": "amp/loss_scale", "next_scale": "amp/next_loss_scale",
    "skipped": "amp/skipped", "skip_streak": "amp/skip_streak",
    # hooks' fields: on a record when its hook set them (a record holds no default it was not given)
    "z_loss": "spikes/z_loss", "z_grad": "spikes/z_grad", "rewound": "spikes/rewound",
    "threshold": "grad/clip_threshold", "lockin": "record/lockin",
}


def expected_scalars(r):
    """Every scalar a record must show in a tracker: tag -> value, straight from the JSONL dict."""
    out = {tag: float(r[field]) for field, tag in BY_HAND.items() if field in r}
    out["grad/norm_postclip"] = math.nan if r["skipped"] else r["grad_norm"] * r["clip_coef"]
    out.update({f"layers/{name}/grad_norm": norm for name, norm in r.get("top_grads", [])})
    return out


def bits(x):
    """The float64 bit pattern (0.0 != -0.0, one ulp apart differs); every NaN is one NaN, as JSON's ``NaN``
    has no sign or payload to keep."""
    x = float(x)
    return b"nan" if math.isnan(x) else struct.pack("<d", x)


def assert_same_bits(got, want, where):
    """``got``/``want``: {(step, tag): value}; every value the JSONL has, and no other, with the same bits."""
    assert got.keys() == want.keys(), f"{where}: missing {sorted(want.keys() - got.keys())[:5]}, " \
                                      f"extra {sorted(got.keys() - want.keys())[:5]}"
    diffs = [(k, got[k], want[k]) for k in want if bits(got[k]) != bits(want[k])]
    assert not diffs, f"{where}: {diffs[:5]}"


def want_all(records):
    return {(r["step"], tag): v for r in records for tag, v in expected_scalars(r).items()}


def need(name):
    if importlib.util.find_spec(PACKAGES[name]) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"CI=true but {name} is not installed: .ci/run must install requirements-trackers.txt"
            )
        pytest.skip(f"{name} is not installed (pip install -r requirements-trackers.txt); CI runs this test")


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """trackio's folder (read once, when trackio is imported) in tmp for this module, and MLflow's default
    store: no MLFLOW_TRACKING_URI, so each run goes to SQLite under its ``out`` folder, as a user's does."""
    for name in TRACKERS:
        need(name)
    root = tmp_path_factory.mktemp("trackers")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRACKIO_DIR", str(root / "trackio"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.setenv("WANDB_SILENT", "true")
    if "trackio" in sys.modules:
        import trackio.utils

        mp.setattr(trackio.utils, "TRACKIO_DIR", root / "trackio")
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def live_run(tracker_env):
    """One fp16 run streamed into all four trackers: a NaN batch, an overflow streak (skip alarm), clips.

    Its MLflow store is the default one, created here through labkit's own path: ``out/mlflow.db``
    (SQLite: MLflow's schema migrations run once for the module; the tests that follow reuse it)."""
    out, elsewhere = tracker_env / "live", tracker_env / "cwd"
    out.mkdir()
    elsewhere.mkdir()
    config = ExperimentConfig(
        precision="fp16", steps=24, max_norm=0.5, faults=["3:nan", "8-16:overflow", "20:spike:50"]
    )
    with pytest.warns(SkipStreakWarning), pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)  # the process's folder: a default store must not land there (./mlruns)
        log = run_experiment(
            config, log_path=out / "log.jsonl", log_to=",".join(TRACKERS), histogram_every=10
        )
    assert (out / "mlflow.db").is_file() and (out / "mlflow-artifacts").is_dir()
    assert list(elsewhere.iterdir()) == []
    return out, read_records(out / "log.jsonl"), log


# ------------------------------------------------------------------------------------------- readers

def read_tensorboard(log_dir):
    """TensorBoard's own reader (the plugin accumulator its data plugins read through, which purges)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.histogram.metadata import PLUGIN_NAME as HISTOGRAMS
    from tensorboard.plugins.text.metadata import PLUGIN_NAME as TEXT
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    scalars, texts, hists = {}, {}, {}
    for tag in acc.Tags()["tensors"]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        for e in acc.Tensors(tag):
            value = tensor_util.make_ndarray(e.tensor_proto)
            if plugin == TEXT:
                texts[(e.step, tag[: -len("/text_summary")])] = value.item().decode()
            elif plugin == HISTOGRAMS:
                hists[(e.step, tag)] = value  # rows of (left edge, right edge, count)
            else:
                # written in double precision, not TensorBoard's float32
                assert value.dtype == np.float64, tag
                scalars[(e.step, tag)] = value.item()
    return scalars, texts, hists


def read_trackio(project, run):
    from trackio.sqlite_storage import SQLiteStorage

    scalars, texts = {}, {}
    for entry in SQLiteStorage.get_logs(project, run):
        step = entry["step"]
        for k, v in entry.items():
            if k in ("step", "timestamp"):
                continue
            if isinstance(v, str):
                texts[(step, k)] = v
            elif isinstance(v, float):
                scalars[(step, k)] = v
            elif isinstance(v, dict) and v.get("_type") == "trackio.histogram":
                scalars[(step, k)] = v  # kept apart by the caller
    hists = {k: scalars.pop(k) for k in [k for k, v in scalars.items() if isinstance(v, dict)]}
    return scalars, texts, hists, SQLiteStorage.get_alerts(project, run_name=run)


def read_mlflow(out, run_name):
    """MLflow's own client on the default store under ``out`` (``sqlite:///out/mlflow.db``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("labkit")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    scalars = {(m.step, key): m.value for key in run.data.metrics
               for m in client.get_metric_history(run.info.run_id, key)}
    files = {}
    for name in ("events.txt", "alerts.txt"):
        try:
            files[name] = Path(client.download_artifacts(run.info.run_id, name)).read_text()
        except Exception:  # noqa: BLE001 (no alerts: no alerts.txt)
            files[name] = ""
    return scalars, files, run.data.tags


def wandb_records(path):
    """The records of a W&B offline run file (a LevelDB-style log of wandb's own protobuf ``Record``s).

    wandb 0.31 writes them from its Go core and ships no Python reader; the framing is 7 bytes of
    file header, then 32 KiB blocks of (crc32, length, type) chunks; the payload is wandb's protobuf.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):  # FIRST, MIDDLE
            pending += chunk


def read_wandb(out, run_name):
    (path,) = [p for p in glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
               if any(r.WhichOneof("record_type") == "run" and r.run.display_name == run_name
                      for r in wandb_records(p))]
    scalars, texts, hists, alerts = {}, {}, {}, []
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "alert":
            alerts.append((r.alert.title, r.alert.text))
        if kind != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item
        }
        step = items.pop("train/step")
        for k, v in items.items():
            if k.startswith("_"):
                continue
            if isinstance(v, str):
                texts[(step, k)] = v
            elif isinstance(v, (int, float)):
                scalars[(step, k)] = v
        for k in [k[: -len("/_type")] for k in items if k.endswith("/_type")]:
            hists[(step, k)] = (items[k + "/values"], items[k + "/bins"])
    return scalars, texts, hists, alerts


# ------------------------------------------------------------------------------------------- a live run

def test_the_run_kept_skips_clips_and_a_skip_streak(live_run):
    _, records, log = live_run
    assert [r["step"] for r in records] == list(range(24))
    assert records[3]["reason"] == "nonfinite_input" and records[8]["reason"] == "nonfinite_grad"
    assert any(r["clipped"] for r in records) and max(r["skip_streak"] for r in records) >= 8
    assert len(log) == len(records)


def test_tensorboard_reads_back_every_value_bit_for_bit(live_run):
    out, records, _ = live_run
    scalars, texts, hists = read_tensorboard(out / "tensorboard" / "live")
    assert_same_bits(scalars, want_all(records), "tensorboard")
    assert texts[(3, "amp/skip_reason")] == "nonfinite_input" and texts[(20, "train/fault")] == "spike:50"
    assert texts[(8, "amp/skip_reason")] == "nonfinite_grad"
    assert "8 steps skipped in a row" in texts[(15, "alerts/SkipStreakWarning")]  # no alert API: as text
    # a histogram per parameter every 10 steps; its counts cover every finite non-zero gradient entry
    # (step 10 overflowed: no finite gradient, no histogram)
    assert sorted(s for s, t in hists if t == "layers/0.weight/log2_abs_grad") == [0, 20]
    h = hists[(0, "layers/0.weight/log2_abs_grad")]
    assert (h[:, 1] - h[:, 0] == 1).all() and 0 < h[:, 2].sum() <= 64 * 16  # one binade per bucket


def test_trackio_store_reads_back_every_value_bit_for_bit_and_holds_the_alert(live_run):
    _, records, _ = live_run
    scalars, texts, hists, alerts = read_trackio("labkit", "live")
    assert_same_bits(scalars, want_all(records), "trackio")
    assert texts[(3, "amp/skip_reason")] == "nonfinite_input"
    assert [(a["title"], a["step"], a["level"]) for a in alerts] == [("SkipStreakWarning", 15, "warn")]
    assert "8 steps skipped in a row (steps 8-15" in alerts[0]["text"]
    assert sorted(s for s, t in hists if t == "layers/0.weight/log2_abs_grad") == [0, 20]
    h = hists[(20, "layers/0.weight/log2_abs_grad")]
    assert h["bins"] == [float(e) for e in LOG2_EDGES] and len(h["values"]) == len(LOG2_EDGES) - 1


def sqlite_clamped(want):
    """What MLflow's SQLite store keeps: +-inf as +-max float, else the bits."""
    return {k: math.copysign(sys.float_info.max, v) if math.isinf(v) else v for k, v in want.items()}


def test_mlflow_client_reads_back_every_value_bit_for_bit(live_run):
    out, records, _ = live_run
    scalars, files, tags = read_mlflow(out, "live")
    assert_same_bits(scalars, sqlite_clamped(want_all(records)), "mlflow")  # NaN norms and losses as NaN
    assert "step 3  amp/skip_reason: nonfinite_input" in files["events.txt"]
    assert "step 15  SkipStreakWarning: 8 steps skipped in a row" in files["alerts.txt"]
    assert tags["labkit.alerts"] == "1"


def test_wandb_offline_run_file_reads_back_every_value_bit_for_bit_and_holds_the_alert(live_run):
    out, records, _ = live_run
    scalars, texts, hists, alerts = read_wandb(out, "live")
    assert_same_bits(scalars, want_all(records), "wandb")
    assert texts[(3, "amp/skip_reason")] == "nonfinite_input"
    assert (len(alerts) == 1 and alerts[0][0] == "SkipStreakWarning"
            and alerts[0][1].startswith("step 15: 8 steps"))
    assert sorted(s for s, t in hists if t == "layers/0.weight/log2_abs_grad") == [0, 20]
    counts, edges = hists[(20, "layers/0.weight/log2_abs_grad")]
    assert edges == list(LOG2_EDGES) and len(counts) == len(LOG2_EDGES) - 1 and sum(counts) > 0


def test_the_trackers_with_histograms_hold_the_same_log2_counts(live_run):
    out, _, _ = live_run
    tag = "layers/2.weight/log2_abs_grad"
    for step in (0, 20):
        tb = read_tensorboard(out / "tensorboard" / "live")[2][(step, tag)]
        tk = read_trackio("labkit", "live")[2][(step, tag)]
        wb_counts, _ = read_wandb(out, "live")[2][(step, tag)]
        # TensorBoard drops empty buckets
        by_exponent = {int(right) - 1: int(count) for _, right, count in tb if count}
        assert by_exponent == {e: c for e, c in zip(LOG2_EDGES, tk["values"]) if c}
        assert wb_counts == tk["values"] and 0 < sum(wb_counts) <= 64 * 64


# ------------------------------------------------------------------------------------------- replay, rewind

def test_export_cli_replays_the_jsonl_with_the_clipping_alarm_too(live_run, tmp_path, capsys):
    out, records, _ = live_run
    rc = labkit_main(["export", str(out / "log.jsonl"), "--to", "tensorboard,trackio", "--out", str(tmp_path),
                      "--name", "replayed", "--clip-window", "4", "--clip-alarm", "0.5"])
    assert rc == 0, capsys.readouterr().err
    assert "(2 alerts)" in capsys.readouterr().out
    scalars, texts, _ = read_tensorboard(tmp_path / "tensorboard" / "replayed")
    assert_same_bits(scalars, want_all(records), "tensorboard replay")
    _, _, _, alerts = read_trackio("labkit", "replayed")
    titles = [a["title"] for a in alerts]
    assert titles.count("SkipStreakWarning") == 1 and titles.count("RepeatedClippingWarning") == 1


def test_a_rewind_is_marked_not_erased_and_extra_fields_get_their_names(tracker_env, tmp_path):
    """Steps 0-5, then a rewind to 3 (an older labkit's records, which marked the undone ones
    ``rewound``): the JSONL keeps all 9, TensorBoard purges the abandoned branch (purge_step), trackio
    keeps both, marked."""
    recs = ([StepRecord(i, 1.0 + i).to_dict() for i in range(6)]
            + [StepRecord(i, 10.0 + i).to_dict() for i in (3, 4, 5)])
    for r in recs[3:6]:
        r["rewound"] = True
    for r in recs:
        r.update(z_loss=0.5 * r["step"], z_grad=-1.25, stale_fraction={"0.weight": 0.125}, spike_score=0.0)
    path = tmp_path / "rewound.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    replay(path, "tensorboard,trackio", tmp_path)
    scalars, texts, _ = read_tensorboard(tmp_path / "tensorboard" / "rewound")
    assert [scalars[(s, "train/loss")] for s in range(6)] == [1.0, 2.0, 3.0, 13.0, 14.0, 15.0]
    assert texts[(3, "events/rewind")] == "rewound to step 3 (the run had reached step 5)"
    assert scalars[(4, "spikes/z_loss")] == 2.0 and scalars[(4, "spikes/z_grad")] == -1.25
    assert scalars[(4, "precision/stale_fraction/0.weight")] == 0.125
    # the kept branch has no mark; the rewound 1.0 was purged with its branch
    assert (4, "spikes/rewound") not in scalars
    from trackio.sqlite_storage import SQLiteStorage

    # trackio keeps every row: the abandoned branch, marked, and the kept one
    rows = [
        (e["step"], e["train/loss"], e.get("spikes/rewound"))
        for e in SQLiteStorage.get_logs("labkit", "rewound")
    ]
    # only the marked records carry it
    assert rows == [(0, 1.0, None), (1, 2.0, None), (2, 3.0, None), (3, 4.0, 1.0), (4, 5.0, 1.0),
                    (5, 6.0, 1.0), (3, 13.0, None), (4, 14.0, None), (5, 15.0, None)]


# ------------------------------------------------------------------------------------------- missing packages

@pytest.mark.parametrize("name", TRACKERS)
def test_a_missing_tracker_fails_with_its_install_line_before_training(name, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, PACKAGES[name], None)  # what an uninstalled package looks like to import
    hint = f"pip install 'labkit[{name}]'"
    with pytest.raises(ModuleNotFoundError, match=hint.replace("[", r"\[").replace("]", r"\]")):
        run_experiment(ExperimentConfig(steps=5), log_path=tmp_path / "log.jsonl", log_to=name)
    assert not (tmp_path / "log.jsonl").exists()  # nothing started
    with pytest.raises(SystemExit) as e:
        demo_main(["--log-to", name, "--out", str(tmp_path), "--steps", "5"])
    assert e.value.code == 2
    (tmp_path / "log.jsonl").write_text(json.dumps(StepRecord(0, 1.0).to_dict()) + "\n")
    assert labkit_main(["export", str(tmp_path / "log.jsonl"), "--to", name]) == 2


def test_unknown_tracker_names_are_refused_with_the_choices(capsys, tmp_path):
    with pytest.raises(ValueError, match="choose from tensorboard, trackio, mlflow, wandb"):
        run_experiment(ExperimentConfig(steps=1), log_to="tensorbord")
    with pytest.raises(SystemExit):
        demo_main(["--log-to", "tb", "--out", str(tmp_path)])
    assert "--log-to: unknown tracker 'tb'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- the schema

def test_row_names_every_field_once_from_a_record_or_its_jsonl():
    r = StepRecord(7, 0.25, grad_norm=3.0, clip_coef=1 / 3, clipped=True, scale=512.0, next_scale=512.0,
                   lr=0.1, fault="spike:10", top_grads=[("fc.weight", 2.5), ("fc.bias", 1.0)])
    for source in (r, json.loads(json.dumps(r.to_dict()))):
        got = row(source)
        assert got.step == 7
        assert {k: bits(v) for k, v in got.scalars.items()} == {
            k: bits(v) for k, v in expected_scalars(r.to_dict()).items()
        }
        assert got.texts == {"train/fault": "spike:10"}
        assert got.scalars["grad/norm_postclip"] == r.post_clip_norm


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64))
def test_log2_histogram_counts_what_numpy_counts(values):
    x = np.array(values, dtype=np.float32)
    h = log2_histogram([torch.from_numpy(x)])
    finite = x[np.isfinite(x) & (x != 0)]
    exps = np.clip(np.floor(np.log2(np.abs(finite.astype(np.float64)))), LOG2_EDGES[0], LOG2_EDGES[-2])
    want = np.histogram(exps, bins=np.array(LOG2_EDGES, dtype=np.float64))[0]
    assert h.counts == want.tolist()
    assert h.zeros == int(np.sum(x == 0)) and h.nonfinite == int(np.sum(~np.isfinite(x)))


def test_a_hand_written_trainstep_loop_streams_through_its_log_as_the_quickstart_shows(tracker_env, tmp_path):
    from labkit import ToyTask, TrainStep
    from labkit.export import Telemetry

    task = ToyTask(seed=0)
    model = task.model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05), task.loss_fn, precision="fp32",
                     log=tmp_path / "log.jsonl")
    step.log.sinks.append(Telemetry.open("tensorboard", tmp_path))
    for i in range(3):
        step(*task.batch(i))
    step.log.close()
    scalars, _, _ = read_tensorboard(tmp_path / "tensorboard" / tmp_path.name)
    assert_same_bits(scalars, want_all(read_records(tmp_path / "log.jsonl")), "tensorboard, own loop")


def test_demo_log_to_writes_the_run_into_the_tracker_under_out(tracker_env, tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo_main(["--log-to", "tensorboard", "--out", str(out), "--steps", "6", "--inject", "2:nan",
                      "--no-progress"]) == 0
    scalars, texts, hists = read_tensorboard(out / "tensorboard" / "demo")
    assert_same_bits(scalars, want_all(read_records(out / "log.jsonl")), "demo --log-to tensorboard")
    assert texts == {(2, "amp/skip_reason"): "nonfinite_input", (2, "train/fault"): "nan"}
    assert {s for s, _ in hists} == {0}  # every 10 steps, from step 0


def test_mlflow_default_store_is_sqlite_under_out_and_a_second_run_joins_it(live_run, tmp_path, monkeypatch):
    """The store users get without MLFLOW_TRACKING_URI: SQLite, MLflow's recommended local backend, artifacts
    beside it (not in ./mlruns). The live run made it in its out; an export to that out adds a run."""
    out, _, _ = live_run
    monkeypatch.chdir(tmp_path)
    recs = [StepRecord(0, 0.1, grad_norm=1 / 3, lr=0.05).to_dict(),
            StepRecord(1, math.inf, skipped=True, reason="nonfinite_loss").to_dict()]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert labkit_main(["export", str(tmp_path / "log.jsonl"), "--to", "mlflow", "--out", str(out),
                        "--name", "exported"]) == 0
    got, files, _ = read_mlflow(out, "exported")
    want = want_all(recs)
    # SQLite's clamp
    assert want[(1, "train/loss")] == math.inf and got[(1, "train/loss")] == sys.float_info.max
    assert_same_bits(got, sqlite_clamped(want), "mlflow sqlite")
    assert "nonfinite_loss" in files["events.txt"]
    assert sorted(p.name for p in out.glob("mlflow*")) == ["mlflow-artifacts", "mlflow.db"]
    assert list(tmp_path.iterdir()) == [tmp_path / "log.jsonl"]  # no ./mlruns where the command ran
