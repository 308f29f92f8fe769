#!/usr/bin/env bash
# One device call: the GPU test suite and the benchmark, from carried build outputs.
#   run (device tool) with carry ["torch_ops/fa4/_native"]:  bash scripts/gpu_check.sh
# With build/peers/fa3/libfa3_peer.so carried too (peers/fa3/build.sh), tests/peers checks
# FlashAttention-3 and the benchmark times it beside fa4 (--fa3-lib).
# Needs no DSL and no compiler on the GPU machine: fa4 is put on PYTHONPATH as a link.
# FA4_SANITIZE=1: also compute-sanitizer racecheck/synccheck/memcheck on the sanitizer scripts
# (FA4_SANITIZE_SCRIPTS, default scripts/sanitize_new_paths.py scripts/sanitize_backward.py),
# run while the tests run (the call takes the longer of the two, not their sum).
# FA4_TESTS: the pytest selection (default: the GPU tests and the peers' checks).
# FA4_CLOCK_PROBE=1: also SM clock and power under sustained load (scripts/clock_probe.py).
# FA4_BENCH=0: skip the benchmark. With the flash-attn3-jax wheel in .whl (carry [".whl"]),
# scripts/fa3_jax_peer.py times FlashAttention-3's forward and backward after it (FA4_FA3_JAX=0: not).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/device.txt"
status=0
# The sanitizers (one process after another) run beside the tests, not after them: device time
# is scarce, and neither is timed. Their summaries print once both are done.
sanitize() {
  for script in ${FA4_SANITIZE_SCRIPTS:-scripts/sanitize_new_paths.py scripts/sanitize_backward.py}; do
    for tool in racecheck synccheck memcheck; do
      log="$OUT/$tool-$(basename "$script" .py).log"
      timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 python3 "$script" > "$log" 2>&1
      rc=$?
      # The exit status too: a script that fails before its kernels run reports a clean summary.
      echo "$(basename "$script") $tool: $(grep -E 'SUMMARY' "$log" | tail -1) (exit $rc)" >> "$OUT/sanitize.txt"
    done
  done
}
sanitizer_pid=""
if [ "${FA4_SANITIZE:-0}" = 1 ]; then
  : > "$OUT/sanitize.txt"
  sanitize & sanitizer_pid=$!
fi
timeout "${FA4_TEST_TIMEOUT:-300}" python3 -m pytest -q ${FA4_TESTS:-tests/gpu tests/peers tests/torch_ops/test_ops.py::test_runs_without_the_dsl_installed} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
if [ -n "$sanitizer_pid" ]; then
  wait "$sanitizer_pid"
  cat "$OUT/sanitize.txt"
  grep -qv "(exit 0)$" "$OUT/sanitize.txt" && status=1
fi
fa3=""; [ -f build/peers/fa3/libfa3_peer.so ] && fa3="--fa3-lib build/peers/fa3/libfa3_peer.so"
if [ "${FA4_BENCH:-1}" = 1 ]; then
  timeout "${FA4_BENCH_TIMEOUT:-240}" python3 -m fa4.bench ${FA4_BENCH_ARGS:-} $fa3 2>&1 | tee "$OUT/bench.log" || status=1
fi
# FlashAttention-3's forward and backward through the flash-attn3-jax wheel, when carried in .whl
# (a separate process: JAX beside torch; FA4_FA3_JAX_ARGS as scripts/fa3_jax_peer.py takes them).
if ls .whl/flash_attn3_jax-*.whl > /dev/null 2>&1 && [ "${FA4_FA3_JAX:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flash_attn3_jax-*.whl
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site timeout "${FA4_FA3_JAX_TIMEOUT:-180}" \
    python3 scripts/fa3_jax_peer.py ${FA4_FA3_JAX_ARGS:-} 2>&1 | tee "$OUT/fa3_jax.log" || status=1
fi
if [ "${FA4_CLOCK_PROBE:-0}" = 1 ]; then
  timeout 120 python3 scripts/clock_probe.py --seconds 2 2>&1 | tee "$OUT/clock.log" || status=1
fi
exit $status
