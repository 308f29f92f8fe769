#!/usr/bin/env bash
# One device call's worth of the clock-stamp diagnostic (src/fa4_kernels/stamps.py):
#   build here:  FA4_DIAG_STAMPS=1 (or =tiles: tile boundaries only) python -m fa4_kernels.aot --out build/diag --lib build/ab/stamps$HD \
#                    --filter bf16_d${HD}x${HD}_none
#   run (device tool) with carry ["torch_ops/fa4/_native", "build/ab"]:  bash scripts/stamps_run.sh [HEAD_DIM]
# Times the plain and the stamped build side by side (how much the stamps perturb), then prints
# scripts/stamps_report.py for the stamped one. Leaves torch_ops/fa4/_native as it found it.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
hd=${1:-128}
rm -rf /tmp/fa4_native_plain && cp -r torch_ops/fa4/_native /tmp/fa4_native_plain
for build in plain stamped plain stamped; do
  rm -rf torch_ops/fa4/_native && mkdir -p torch_ops/fa4/_native
  if [ $build = plain ]; then cp /tmp/fa4_native_plain/* torch_ops/fa4/_native/; else cp build/ab/stamps$hd/* torch_ops/fa4/_native/; fi
  echo "=== $build" | tee -a "$OUT/stamps_bench$hd.log"
  FA4_SPLIT_TAIL=0 python3 -m fa4.bench --providers fa4 --head-dims $hd --causal no 2>&1 | grep "hd=" | tee -a "$OUT/stamps_bench$hd.log"
done
python3 scripts/stamps_report.py --head-dim $hd --seqlens 1024 4096 16384 2>&1 | tee "$OUT/stamps$hd.log"
rm -rf torch_ops/fa4/_native && cp -r /tmp/fa4_native_plain torch_ops/fa4/_native
