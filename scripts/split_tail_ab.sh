#!/usr/bin/env bash
# One device call for the split tail: the GPU tests, compute-sanitizer on the new paths, and an
# A/B of the forward against the previous package (build/ab/base_pkg/fa4: its Python sources and
# native library, as its interface differs) and with the split switched off (FA4_SPLIT_TAIL=0),
# in alternating rounds, cuDNN timed once per round.
#   run (device tool) with carry ["torch_ops/_native", "build/ab"]:  bash scripts/split_tail_ab.sh
# FA4_AB_ROUNDS (default 2), FA4_AB_ARGS (bench arguments), FA4_AB_TESTS (pytest -k filter, or
# "all"; "none" skips the tests and the sanitizers).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
tests=${FA4_AB_TESTS:-split or graph or native_call or deterministic}
if [ "$tests" != none ]; then
  filter=$([ "$tests" = all ] && echo "" || echo "-k")
  timeout 300 python3 -m pytest -q tests/gpu tests/torch_ops/test_ops.py::test_runs_without_the_dsl_installed \
    $filter ${filter:+"$tests"} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -4
  for tool in racecheck synccheck memcheck; do
    timeout 80 compute-sanitizer --tool $tool --error-exitcode 3 python3 scripts/sanitize_new_paths.py \
      > "$OUT/$tool.log" 2>&1; echo "$tool rc=$? $(grep -E 'SUMMARY' "$OUT/$tool.log" | tail -1)"
  done
fi
args=${FA4_AB_ARGS:-"--head-dims 64 128 256 --iters 20"}
for round in $(seq ${FA4_AB_ROUNDS:-2}); do
  for v in cuDNN base new new_nosplit; do
    echo "=== $v round $round" | tee -a "$OUT/ab.log"
    pkgs=$([ $v = base ] && echo "$PWD/build/ab/base_pkg" || echo /tmp/fa4_pkgs)
    split=$([ $v = new_nosplit ] && echo 0 || echo "")
    provider=$([ $v = cuDNN ] && echo cuDNN || echo fa4)
    FA4_SPLIT_TAIL=$split PYTHONPATH=$pkgs:$PWD/src timeout 90 python3 -m fa4.bench $args --providers $provider \
      2>&1 | grep -E "^hd=" | tee -a "$OUT/ab.log"
  done
done
for split in "" 0; do
  echo "=== decoding, FA4_SPLIT_TAIL=$split" | tee -a "$OUT/decode.log"
  FA4_SPLIT_TAIL=$split timeout 45 python3 -m fa4.bench --head-dims 128 --seqlens 1024 --causal no --providers fa4 \
    --gqa-decode --decode-batches 1 16 2>&1 | grep -E "^GQA|^seqlen_q" | tee -a "$OUT/decode.log"
done
