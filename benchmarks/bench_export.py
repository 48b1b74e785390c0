"""What streaming into each tracker costs per record: replay a 300-step demo log into each, timed.

Usage: python benchmarks/bench_export.py   (needs requirements-trackers.txt; writes into a temp folder)
The first open of a tracker (its import, W&B's service start, MLflow's schema) is timed apart
from the per-record cost. MLflow uses its file store here (MLFLOW_ALLOW_FILE_STORE), as the tests do.
"""

import os
import platform
import subprocess
import tempfile
import time

from labkit.export import Telemetry
from labkit.export.replay import read_records
from labkit.lab.experiment import ExperimentConfig, run_experiment


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        lines = out.splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
        flags = next(line for line in lines if line.startswith("Flags"))
        return f"{name}, {'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}"
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    root = tempfile.mkdtemp()
    os.environ.update(TRACKIO_DIR=os.path.join(root, "trackio"), WANDB_SILENT="true",
                      MLFLOW_ALLOW_FILE_STORE="true",
                      MLFLOW_TRACKING_URI="file:" + os.path.join(root, "mlruns"))
    import warnings

    warnings.simplefilter("ignore")
    run_experiment(ExperimentConfig(precision="fp32", steps=300, faults=["50:spike:10", "120:nan"]),
                   log_path=os.path.join(root, "log.jsonl"))
    records = read_records(os.path.join(root, "log.jsonl"))
    print(f"{len(records)} records, {cpu()}")
    for name in ("tensorboard", "trackio", "mlflow", "wandb"):
        t0 = time.perf_counter()
        t = Telemetry.open(name, os.path.join(root, name), run_name=name)
        t1 = time.perf_counter()
        for r in records:
            t.write(r)
        t2 = time.perf_counter()
        t.close()
        t3 = time.perf_counter()
        per_record = 1e3 * (t2 - t1) / len(records)
        print(f"{name:<12} open {t1 - t0:6.2f} s   per record {per_record:6.2f} ms   close {t3 - t2:5.2f} s")


if __name__ == "__main__":
    main()
