#!/usr/bin/env bash
# Sweep the tile-order knobs (FA4_PERSISTENT, FA4_L2_SWIZZLE_MB) against cuDNN in one GPU call.
#   bash scripts/tune_schedule.sh "--head-dims 128 --causal yes"
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
ARGS=${1:---head-dims 128 --causal yes}
for persistent in 0 1; do
  for mb in 1 8 40; do
    echo "== FA4_PERSISTENT=$persistent FA4_L2_SWIZZLE_MB=$mb"
    FA4_PERSISTENT=$persistent FA4_L2_SWIZZLE_MB=$mb python3 -m fa4.bench $ARGS --providers fa4,cuDNN --iters 20 | grep "^hd="
  done
done
