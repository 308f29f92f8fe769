#!/usr/bin/env bash
# A/B of KV-cache builds (libs under build/ab/<version>/, e.g. linked with --filter kvcache): per
# version, `python -m fa4.bench --decode` (decoding contiguous and paged, speculative verification,
# chunked prefill; the dense forward's row fails where the lib has only KV-cache variants) and a
# sliding window's decoding and chunked prefill where the version has a kernel for it; versions
# in the order given (repeat one to see drift).
#   run (device tool) with carry ["build/ab/A", "build/ab/B"]:  bash scripts/kvcache_ab.sh A B A
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
for v in "$@"; do
  rm -rf torch_ops/fa4/_native && mkdir -p torch_ops/fa4/_native && cp build/ab/$v/* torch_ops/fa4/_native/
  echo "=== $v" | tee -a "$OUT/kvcache_ab.log"
  python3 -m fa4.bench --decode --iters "${FA4_AB_ITERS:-10}" 2>&1 | grep -v Warn | tee -a "$OUT/kvcache_ab.log"
  python3 - <<'PY' 2>&1 | grep -v Warn | tee -a "$OUT/kvcache_ab.log"
import torch, fa4
from fa4.bench_kvcache import graph_ms
from fa4.testing import naive_attention, rel_error
torch.manual_seed(0)
print("sliding window (1024, 0): decoding GB/s of the window's K+V (CUDA graph); prefill TFLOP/s")
for batch, length, tokens in ((1, 32768, 1), (8, 32768, 1), (64, 4096, 1), (1, 32768, 2048)):
    k = torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
    full = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    call = lambda: fa4.attention_with_kvcache(q, k, v, full, window=(1024, 0))  # noqa: E731
    try:
        out = call()
    except Exception as e:  # the version has no kernel for windows
        print(f"  {batch} x {length // 1024}k q{tokens}: {type(e).__name__}: {str(e)[:90]}")
        continue
    # the chunk's last 64 rows (bottom-right aligned as the whole chunk's): a float64 score matrix
    # of all 2048 would take 17 GB
    ref, _ = naive_attention(q[:1, -64:], k[:1], v[:1], causal=True, window=(1024, 0))
    ms = graph_ms(call, 10)
    seen = min(1024 + tokens, length)
    if tokens == 1:
        rate = f"{batch * seen * 8 * 256 * 2 / (ms * 1e-3) / 1e9:7.0f} GB/s"
    else:
        rate = f"{4 * tokens * 1025 * 128 * 32 / (ms * 1e-3) / 1e12:7.1f} TFLOP/s"
    print(f"  {batch} x {length // 1024}k q{tokens}: {ms * 1e3:8.1f} us  {rate}  rel. error {rel_error(out[:1, -64:], ref):.1e}")
PY
done
