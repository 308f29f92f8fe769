#!/usr/bin/env bash
# Profile the backward's main kernel of one configuration with Nsight Compute: fa4's and, for
# comparison, cuDNN's (SDPA) in the same call. Keeps $OUT/<provider>_<seqlen>_<hd>_<mask>.*.
#   bash scripts/ncu_bwd.sh SEQLEN HEAD_DIM {none,causal} [fa4] [cudnn]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
seqlen=$1 hd=$2 mask=$3; shift 3
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SourceCounters
          --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables"
export FA4_PROFILE_BACKWARD=1
[ $# -gt 0 ] || set -- fa4 cudnn
for provider in "$@"; do
  if [ "$provider" = fa4 ]; then
    kernels=regex:FlashAttentionBackward
  else
    # cuDNN's backward kernel: the longest kernel of a step whose name is not a forward's.
    kernels=$(python3 - "$seqlen" "$hd" "$mask" <<'PY'
import re, sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
s, d, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "causal"
b, h = max(1, 16384 // s), 2048 // d
q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
def step():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), torch.ones_like(q))
step(); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
evts = [(e.device_time, e.name) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
for t, n in sorted(evts, reverse=True):
    print(f"{t:9.1f} us  {n[:160]}", file=sys.stderr)
names = [n for t, n in sorted(evts, reverse=True) if not re.search(r"fprop|fwd|forward", n, re.I)]
print("regex:" + re.escape(names[0][:40]))
PY
)
  fi
  rep="$OUT/${provider}_${seqlen}_${hd}_${mask}"
  echo "== $provider ($kernels)"
  FA4_NCU_SASS=$([ "$provider" = fa4 ] && echo 1 || echo 0) profile_with_ncu "$rep" "$kernels" "$sections" \
      $seqlen $hd $mask 5 16384 $provider
  grep -E "Duration|SM Frequency|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|No Eligible|Tensor|Compute \(SM\) Throughput|Shared Memory|Registers Per" \
      "$rep.details.txt" | head -30
done
