#!/usr/bin/env bash
# What requirements-trackers.txt adds to .ci/run: a fresh venv with the core requirements, then the
# trackers' pip lines of .ci/run, timed (no pip cache: what a clean CI machine downloads).
# Usage: bash benchmarks/ci_trackers_install.sh   (from the repository root; takes a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir -r requirements.txt -r requirements-nbgrader.txt
start=$(date +%s.%N)
"$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir -r requirements-trackers.txt
"$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-deps trackio==0.43.0
end=$(date +%s.%N)
echo "requirements-trackers.txt + trackio: $(echo "$end - $start" | bc) s on $(lscpu | sed -n 's/^Model name: *//p')"
"$venv/bin/pip" check | grep -v "trackio 0.43.0 has requirement pillow<13.0.0" || true
rm -rf "$(dirname "$venv")"
