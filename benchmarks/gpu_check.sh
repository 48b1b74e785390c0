#!/usr/bin/env bash
# One script for one CUDA GPU: the cuda tests, every lesson and problem set under nbval on CUDA and
# again under LABKIT_PERTURB=1 (the portability pass: each runs to the end, no error output), the
# host syncs per TrainStep step counted by torch.cuda.set_sync_debug_mode("warn") (each
# synchronizing CUDA call warns once), and the benchmarks on CUDA. It prints what failed, part by
# part, at the end, and exits 1 if anything did.
#
#   bash benchmarks/gpu_check.sh                  # every part; PYTHON=... picks the interpreter
#   bash benchmarks/gpu_check.sh nbval perturb    # only these parts (tests nbval perturb syncs bench)
#
# Each part has its own timeout (a part that runs out is reported as failed). Where one call may
# run at most 10 minutes, run it in two: `tests nbval` and `perturb syncs bench`.
# Without a GPU it says so and runs the parts a CPU can: the sync count (torch has no CUDA syncs
# to report there, so it prints the trapped host reads instead) and the benchmark at --quick sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# The caller's PYTHONPATH stays after the checkout: packages carried to a bare GPU machine live there.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
parts=${*:-tests nbval perturb syncs bench}
start=$SECONDS
rc=0
failed=$(mktemp)
trap 'rm -f "$failed"' EXIT

want() { [[ " $parts " == *" $1 "* ]]; }

# check NAME SECONDS COMMAND...: run one part; its pytest FAILED/ERROR lines (or why it failed) go to the summary
check() {
  local name=$1 seconds=$2 log status
  shift 2
  echo; echo "== $name (t=$((SECONDS - start)) s)"
  log=$(mktemp)
  set +e
  timeout "$seconds" "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    rc=1
    sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^(FAILED|ERROR) ' | sed "s/^/$name: /" >> "$failed" || true
    if [ "$status" -eq 124 ]; then
      echo "$name: timed out after $seconds s" >> "$failed"
    elif ! grep -qF "$name: " "$failed"; then
      echo "$name: exited with $status" >> "$failed"
    fi
  fi
  rm -f "$log"
}

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  gpu=1
  "$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
  # The stored outputs and the lessons' torch facts (an fp8 cast's saturation, _scaled_mm's row scales on
  # a CPU) are the pinned torch's: another version fails those cells without any labkit fault.
  pin=$(sed -n 's/^torch==//p' requirements.txt)
  "$PY" -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(v != '$pin')" ||
    echo "NOTE: torch here is not the pinned $pin: cells that print torch's own behaviour may differ."
else
  gpu=0
  echo "No CUDA GPU here: the cuda tests, the notebooks on CUDA and the full-size benchmark are skipped."
fi

if [ "$gpu" = 1 ]; then
  # -rf: the short summary lists each failed test (a notebook's cell under nbval) on a FAILED line
  # tests/browser is left out: it needs Chromium and JupyterLab's server, which a GPU machine need not have.
  want tests && check "cuda tests" 120 "$PY" -m pytest -q -rf -m cuda --ignore=tests/browser tests
  # The stored outputs are the CPU's: a cell tagged nbval-check-output that differs on CUDA fails here.
  want nbval && check "nbval on CUDA" 480 "$PY" -m pytest -q -rf notebooks/0*.ipynb notebooks/exercises/*.ipynb
  # Under LABKIT_PERTURB no stored output can hold, so this pass only asks that each notebook runs
  # to the end with no error output (tests/portability.py; the lessons pick CUDA themselves).
  want perturb && check "LABKIT_PERTURB=1 on CUDA" 480 env LABKIT_PORTABILITY=LABKIT_PERTURB=1 \
    "$PY" -m pytest -q -rf -m portability tests/test_portability*.py
fi

want syncs && check "host syncs per step (set_sync_debug_mode('warn') on CUDA; trapped host reads on CPU)" \
  90 "$PY" - <<'EOF'
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

if want bench; then
  if [ "$gpu" = 1 ]; then
    check "benchmarks" 240 "$PY" benchmarks/bench_step.py --device cuda  # (b) builds its loops twice
  else
    check "benchmarks (--quick, CPU)" 600 "$PY" benchmarks/bench_step.py --device cpu --quick
  fi
fi

echo; echo "== summary (t=$((SECONDS - start)) s; parts: $parts)"
if [ -s "$failed" ]; then
  echo "FAILED:"; sed 's/^/  /' "$failed"
else
  echo "all passed"
fi
exit "$rc"
