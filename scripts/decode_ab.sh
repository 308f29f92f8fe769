#!/usr/bin/env bash
# A/B of KV-cache decoding builds (libs under build/ab/<version>/, e.g. one variant each:
# FA4_VARIANTS=bf16,d128x128,local_kvcache): per version, a float64 check of O and LSE over cache
# lengths, split counts and 1-8 causal query tokens, then scripts/decode_profile.py's per-call graph
# time per shape; versions in the order given (repeat one to see drift). FA4_DECODE_SHAPES="1x4096
# 8x32768" picks the shapes (batch x cache length), FA4_DECODE_QS="1 8" the query tokens per call
# (default 1: decoding; more: speculative verification); FA4_DECODE_TRACE=1 adds the trace twins'
# timeline means at 1 x 4k / 32k. FA4_DECODE_CASES="1x4096 1x4096x4 1x4096x1x32/2" times those cases
# with scripts/decode_cases.py instead (the kernel each ran, graph and step us, SDPA beside).
#   run (device tool) with carry ["build/ab/A", "build/ab/B"]:  bash scripts/decode_ab.sh A B A
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
for v in "$@"; do
  rm -rf torch_ops/fa4/_native && mkdir -p torch_ops/fa4/_native && cp build/ab/$v/* torch_ops/fa4/_native/
  echo "=== $v" | tee -a "$OUT/decode_ab.log"
  python3 - <<'PY' 2>&1 | grep -v Warn | tee -a "$OUT/decode_ab.log"
import torch, fa4
from fa4.testing import naive_attention, rel_error
torch.manual_seed(0)
worst = 0.0
for batch, length, splits, seqlen_q in [(2, 1, 0, 1), (2, 17, 0, 1), (3, 300, 7, 1), (2, 2900, 0, 1), (2, 2900, 200, 1),
                                       (1, 40000, 0, 1), (2, 2900, 0, 8), (1, 5000, 0, 4), (3, 700, 9, 3)]:
    capacity = -(-length // 16) * 16  # contiguous caches hold a multiple of 16 tokens
    k = torch.randn(batch, capacity, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, capacity, 8, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, seqlen_q, 32, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.randint(max(seqlen_q, length // 2), length + 1, (batch,), dtype=torch.int32, device="cuda")
    out, lse = fa4.attention_with_kvcache(q, k, v, lens, num_splits=splits, return_lse=True)
    for b in range(batch):
        n = int(lens[b])
        ref, ref_lse = naive_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        worst = max(worst, rel_error(out[b:b + 1], ref), (lse[b:b + 1].double() - ref_lse).abs().max().item())
print(f"worst relative error {worst:.2e}", "OK" if worst < 1e-2 else "BAD")
PY
  if [ -n "${FA4_DECODE_CASES:-}" ]; then
    python3 scripts/decode_cases.py $FA4_DECODE_CASES 2>&1 | grep -v Warn | tee -a "$OUT/decode_ab.log"
    continue
  fi
  for s in ${FA4_DECODE_SHAPES:-1x4096 1x32768 1x131072 8x4096 8x32768}; do
    for q in ${FA4_DECODE_QS:-1}; do
      python3 scripts/decode_profile.py ${s/x/ } kernels 0 $q 2>&1 | grep -E "^(fa4|sdpa)" | tee -a "$OUT/decode_ab.log"
    done
  done
  if [ "${FA4_DECODE_TRACE:-0}" = 1 ]; then  # the trace twins' means (the libs must hold them)
    for s in "1 4096" "1 32768"; do
      for q in ${FA4_DECODE_QS:-1}; do
        python3 scripts/decode_profile.py $s trace 0 $q 2>&1 | grep -E "^trace" | tee -a "$OUT/decode_ab.log"
      done
    done
  fi
done
