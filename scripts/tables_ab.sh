#!/usr/bin/env bash
# One device call for issues 26 and 23 that is worth its start on either kind of GPU (starts are
# scarce: session 70 got none in 15 asks, docs/perf_notes.md):
# - FA4_CHECK_LIB (a build under build/ab/): the KV-cache GPU tests with the sanitizers on it
#   (FA4_CHECK_TESTS=0: not); then, on it or on the carried library, `fa4.bench $FA4_CHECK_BENCH`
#   (e.g. "--decode --decode-parts prefill --rounds 2") and `python3 $FA4_CHECK_PY` (e.g.
#   scripts/kv_tile_fill.py);
# - on an H200, the issues' device, where the carried torch_ops/fa4/_native is a full catalog (and
#   FA4_TABLES is not 0): the decoding table (`fa4.bench --decode`) and the backward table
#   (`--backward`, hd 64/128/256; fa4, its deterministic mode and cuDNN);
# - scripts/decode_ab.sh over the KV-cache builds named.
# torch_ops/fa4/_native is as carried again at the end. Logs under $OUT; a summary at the end.
#   run (device tool) with carry ["torch_ops/fa4/_native", "build/ab/A", "build/ab/B"]:
#     FA4_CHECK_LIB=B bash scripts/tables_ab.sh A B A B
# FA4_DECODE_CASES: the A/B's cases (scripts/decode_cases.py; default below).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $gpu" | tee "$OUT/summary.txt"
carried=0
[ -d torch_ops/fa4/_native ] && carried=1 && rm -rf /tmp/fa4_main_native && cp -r torch_ops/fa4/_native /tmp/fa4_main_native
full=$(python3 -c "import json; print(len(json.load(open('torch_ops/fa4/_native/variants.json'))['variants']))" 2>/dev/null)
quiet() { grep -v -i warn; }
if [ -n "${FA4_CHECK_LIB:-}" ]; then
  rm -rf torch_ops/fa4/_native && cp -r "build/ab/$FA4_CHECK_LIB" torch_ops/fa4/_native
  if [ "${FA4_CHECK_TESTS:-1}" = 1 ]; then
    FA4_TESTS="tests/gpu/test_kv_cache_gpu.py" FA4_SANITIZE=1 FA4_SANITIZE_SCRIPTS=scripts/sanitize_kv_cache.py \
      FA4_BENCH=0 FA4_FA3_JAX=0 FA4_TEST_TIMEOUT=150 timeout 220 bash scripts/gpu_check.sh > "$OUT/check.txt" 2>&1
    echo "check of $FA4_CHECK_LIB: exit $?" >> "$OUT/summary.txt"
  fi
fi
# On FA4_CHECK_LIB, or the carried library without it:
if [ -n "${FA4_CHECK_BENCH:-}" ]; then
  timeout 150 python3 -m fa4.bench $FA4_CHECK_BENCH 2>&1 | quiet > "$OUT/check_bench.txt"
fi
# FA4_CHECK_PY: a probe script (e.g. scripts/kv_tile_fill.py)
[ -n "${FA4_CHECK_PY:-}" ] && timeout 150 python3 $FA4_CHECK_PY 2>&1 | quiet > "$OUT/check_py.txt"
if [[ "$gpu" == *H200* ]] && [ "${full:-0}" -gt 400 ] && [ "${FA4_TABLES:-1}" = 1 ]; then
  rm -rf torch_ops/fa4/_native && cp -r /tmp/fa4_main_native torch_ops/fa4/_native
  timeout 170 python3 -m fa4.bench --decode --rounds 2 2>&1 | quiet > "$OUT/decode.txt"
  timeout 90 python3 -m fa4.bench --backward --head-dims 64 128 256 --providers fa4,fa4det,cuDNN --rounds 1 \
    --calls-per-sample 1 2>&1 | quiet > "$OUT/backward.txt"
fi
if [[ "$gpu" == *H200* ]]; then
  cases=${FA4_DECODE_CASES:-"1x32768x1x64/1 1x32768x1x32/2 1x4096 1x32768 64x4096"}
else
  cases=${FA4_DECODE_CASES:-"1x32768x1x64/1 1x32768x1x32/2 1x4096x1x32/2 1x4096 1x32768"}
fi
if [ $# -gt 0 ]; then
  FA4_DECODE_CASES="$cases" timeout "${FA4_AB_TIMEOUT:-200}" bash scripts/decode_ab.sh "$@" 2>&1 | quiet > "$OUT/ab.txt"
fi
rm -rf torch_ops/fa4/_native
[ "$carried" = 1 ] && cp -r /tmp/fa4_main_native torch_ops/fa4/_native
for f in check_bench check_py decode backward ab; do
  [ -f "$OUT/$f.txt" ] && { echo "=== $f"; tail -50 "$OUT/$f.txt"; }
done
[ -f "$OUT/check.txt" ] && tail -8 "$OUT/check.txt"
cat "$OUT/summary.txt"
