#!/usr/bin/env bash
# One device call: the GPU test suite and the benchmark, from carried build outputs.
#   run (device tool) with carry ["torch_ops/_native", "build/aot"]:  bash scripts/gpu_check.sh
# Needs no DSL and no compiler on the GPU machine: fa4 is put on PYTHONPATH as a link.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fa4_out}
mkdir -p "$OUT" /tmp/fa4_pkgs
ln -sfn "$PWD/torch_ops" /tmp/fa4_pkgs/fa4
export PYTHONPATH=/tmp/fa4_pkgs:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/device.txt"
status=0
timeout "${FA4_TEST_TIMEOUT:-300}" python3 -m pytest -q tests/gpu tests/torch_ops/test_ops.py::test_runs_without_the_dsl_installed -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
timeout "${FA4_BENCH_TIMEOUT:-240}" python3 -m fa4.bench ${FA4_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
