#!/usr/bin/env bash
# Profile one configuration of several A/B builds (build/ab/<version>) with Nsight Compute.
#   bash scripts/ncu_ab.sh SEQLEN HEAD_DIM {none,causal} VERSION...
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
seqlen=$1 hd=$2 mask=$3; shift 3
for v in "$@"; do
  rm -rf torch_ops/fa4/_native && mkdir -p torch_ops/fa4/_native && cp build/ab/$v/* torch_ops/fa4/_native/
  rep="$OUT/${v}_${seqlen}_${hd}_${mask}"
  FA4_NCU_SASS=1 profile_with_ncu "$rep" regex:kernel_cutlass \
      "--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SourceCounters
       --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis" $seqlen $hd $mask 5
  grep -E "Duration|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|No Eligible|Tensor|Compute \(SM\) Throughput" "$rep.details.txt" | head -20
done
