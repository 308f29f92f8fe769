#!/usr/bin/env bash
# Profile one configuration of several A/B builds (build/ab/<version>) with Nsight Compute.
#   bash scripts/ncu_ab.sh SEQLEN HEAD_DIM {none,causal} VERSION...
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
seqlen=$1 hd=$2 mask=$3; shift 3
for v in "$@"; do
  rm -rf torch_ops/_native && mkdir -p torch_ops/_native && cp build/ab/$v/* torch_ops/_native/
  rep="$OUT/${v}_${seqlen}_${hd}_${mask}"
  ncu --clock-control none --launch-skip 3 --launch-count 1 -k regex:kernel_cutlass \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section SourceCounters --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
      -o "$rep" -f python3 scripts/profile_one.py $seqlen $hd $mask 5 > "$rep.log" 2>&1
  ncu --import "$rep.ncu-rep" --page details > "$rep.details.txt" 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
  rm -f "$rep.ncu-rep"
  grep -E "Duration|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|No Eligible|Tensor|Compute \(SM\) Throughput" "$rep.details.txt" | head -20
done
