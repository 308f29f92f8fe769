#!/usr/bin/env bash
# A/B timing of several builds of the same variant subset in one device call.
#   build each version:  libs under build/ab/<version>/ (libfa4.so + variants.json)
#   run (device tool) with carry ["build/ab"]:  bash scripts/ab_bench.sh VERSION... [-- bench args]
# Each version is checked against SDPA (math) on odd shapes before it is timed.
# FA4_AB_RUN: the timing command instead of fa4.bench, e.g. the deterministic backward against the
# default per build: FA4_AB_RUN="python3 scripts/bwd_ab.py default: det:deterministic=1" bash
# scripts/ab_bench.sh base new base new -- --head-dims 192 256 --rounds 1 (FA4_AB_ROUND=2: no checks).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
versions=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done; [ $# -gt 0 ] && shift
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
round=${FA4_AB_ROUND:-1}
for v in "${versions[@]}"; do
  [ -f "build/ab/$v/libfa4.so" ] || { echo "ab_bench.sh: no build/ab/$v/libfa4.so (carry it)" >&2; exit 1; }
  rm -rf torch_ops/fa4/_native && mkdir -p torch_ops/fa4/_native && cp build/ab/$v/* torch_ops/fa4/_native/
  echo "=== $v (round $round)" | tee -a "$OUT/ab.log"
  if [ $round = 1 ]; then
  python3 - <<'PY' 2>&1 | tee -a "$OUT/ab.log"
import json, torch, fa4
from torch.nn.functional import scaled_dot_product_attention as sdpa
man = json.load(open("torch_ops/fa4/_native/variants.json"))["variants"]
torch.manual_seed(0)
worst = 0.0
# Each dense forward's (head dims, causal) once (the backward's variants have forwards beside them;
# the dQ conversion's head dims are 0).
cases = sorted({(v["head_dim"], v["head_dim_v"], v["mask"] == "causal") for v in man
                if v["kernel"] == "fwd" and not v["kv_cache"] and v["mask"] in ("none", "causal")})
for d, dv, causal in cases:
    for (b, sq, sk, hq, hk) in [(2, 1000, 1000, 8, 2), (1, 129, 4097, 4, 4), (3, 517, 517, 6, 1)]:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn(b, sk, hk, dv, device="cuda", dtype=torch.bfloat16)
        o = fa4.attention(q, k, vv, causal=causal)
        qr, kr, vr = (t.double().transpose(1, 2) for t in (q, k, vv))
        kr = kr.repeat_interleave(hq // hk, 1); vr = vr.repeat_interleave(hq // hk, 1)
        mask = None
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)
        ref = sdpa(qr, kr, vr, attn_mask=mask).transpose(1, 2)
        ref = torch.nan_to_num(ref)
        err = (o.double() - ref).abs().max().item()
        worst = max(worst, err)
        if err > 2e-2:
            print("BAD", (d, dv, causal), (b, sq, sk, hq, hk), err)
print("max abs err", worst)
PY
  fi
  ${FA4_AB_RUN:-python3 -m fa4.bench --providers fa4,cuDNN} "$@" 2>&1 | tee -a "$OUT/ab.log"
done
