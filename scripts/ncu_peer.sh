#!/usr/bin/env bash
# Nsight Compute counters of fa4, cuDNN (SDPA) and, when build/peers/fa3/libfa3_peer.so is there,
# FlashAttention-3 on the same configuration, one kernel each.
#   bash scripts/ncu_peer.sh SEQLEN HEAD_DIM {none,causal}   (needs torch_ops/fa4/_native)
# Prints duration, SM clock, tensor-pipe and issue utilisation, occupancy, and the spread of SM
# busy cycles (min / avg / max: a low min or avg next to max is load imbalance across SMs);
# full details under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
seqlen=$1 hd=$2 mask=$3
# The tensor-pipe metric's name differs between ncu versions: take whichever this one has.
tensor_metrics=$(ncu --query-metrics 2>/dev/null | awk '{print $1}' | grep -E '^sm__pipe_tensor_op_(gmma|hmma)_cycles_active$' | \
                 sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
balance=sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,smsp__inst_executed.sum
providers="fa4 cudnn"; [ -f build/peers/fa3/libfa3_peer.so ] && providers="$providers fa3"
for provider in $providers; do
  case $provider in
    fa4) kernels="regex:kernel_cutlass" ;;
    cudnn) kernels="regex:(sdpa|fmha|attn|cudnn)" ;;
    fa3) kernels="regex:device_kernel|FlashAttnFwd" ;;
  esac
  rep="$OUT/ncu_${provider}_${seqlen}_${hd}_${mask}"
  profile_with_ncu "$rep" "$kernels" "--section SpeedOfLight --section ComputeWorkloadAnalysis
      --section WarpStateStats --section Occupancy --section LaunchStats --metrics $balance${tensor_metrics:+,$tensor_metrics}" \
      "$seqlen" "$hd" "$mask" 6 16384 $provider
  echo "=== $provider seqlen $seqlen hd $hd $mask"
  grep -E "^  [a-z_]+.*(Kernel|kernel)|Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|No Eligible|Registers Per|Achieved Occupancy|_cycles_active|Grid Size|Block Size|Dynamic Shared|inst_executed" "$rep.details.txt" | head -24
done
