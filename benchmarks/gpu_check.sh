#!/usr/bin/env bash
# One script for one CUDA GPU, under 8 minutes: the cuda tests, the notebooks under nbval on
# CUDA, the benchmarks on CUDA, and the host syncs per TrainStep step counted by
# torch.cuda.set_sync_debug_mode("warn") (each synchronizing CUDA call warns once).
#
#   bash benchmarks/gpu_check.sh            # PYTHON=... to pick the interpreter (default .venv/bin/python)
#
# Without a GPU it says so and runs the parts a CPU can: the sync count (torch has no CUDA syncs
# to report there, so it prints the trapped host reads instead) and the benchmark at --quick sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=$PWD
start=$SECONDS
part() { echo; echo "== $1 (t=$((SECONDS - start)) s)"; }

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  gpu=1
  "$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
else
  gpu=0
  echo "No CUDA GPU here: the cuda tests, nbval on CUDA and the full-size benchmark are skipped."
fi

rc=0
if [ "$gpu" = 1 ]; then
  part "cuda tests (tests marked cuda, incl. tests/test_fused.py's)"
  timeout 120 "$PY" -m pytest -q -p no:randomly -m cuda tests || rc=1

  part "notebooks under nbval (they run on CUDA when torch.cuda.is_available())"
  timeout 120 "$PY" -m pytest -q -p no:randomly notebooks/*.ipynb || rc=1
fi

part "host syncs per step (set_sync_debug_mode('warn') on CUDA; trapped host reads on CPU)"
timeout 90 "$PY" - <<'EOF' || rc=1
import sys
import warnings

import torch

import labkit

cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
sys.path.insert(0, "benchmarks")
from bench_step import SyncCounter  # noqa: E402  (the CPU fallback: counts .item()/bool()/... from labkit)


def run(fused, sync_every, steps=9):
    torch.manual_seed(0)
    task = labkit.ToyTask()
    model = task.model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    step = labkit.TrainStep(model, opt, task.loss_fn, precision="fp16", sync_every=sync_every)
    batches = [task.batch(i, device) for i in range(steps)]  # on the device already: no H2D copy counted
    step(*batches[0])
    step.flush()
    if cuda:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for x, y in batches[1:]:
                    step(x, y)
                step.flush()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n = sum("synchronizing" in str(w.message) for w in caught)
    else:
        with SyncCounter() as c:
            for x, y in batches[1:]:
                step(x, y)
            step.flush()
        n = c.count
    return n / (steps - 1)


for fused in (False, True):
    for every in (None, 8):
        print(f"  AdamW {'fused  ' if fused else 'foreach'} sync_every={str(every):<4} {run(fused, every):5.2f} syncs/step", flush=True)
EOF

part "benchmarks"
if [ "$gpu" = 1 ]; then
  timeout 150 "$PY" benchmarks/bench_step.py --device cuda || rc=1
else
  timeout 600 "$PY" benchmarks/bench_step.py --device cpu --quick || rc=1
fi

part "done, rc=$rc"
exit "$rc"
