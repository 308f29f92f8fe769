"""Run one forward configuration a few times (for ncu / compute-sanitizer wrappers), with fa4
or, for comparison, with cuDNN through SDPA or FlashAttention-3 (peers/fa3; FA3_LIB defaults to
build/peers/fa3/libfa3_peer.so).

    python3 scripts/profile_one.py SEQLEN HEAD_DIM {causal,none} [ITERS] [TOKENS] [fa4|cudnn|fa3] [FA3_LIB]
    ncu --clock-control none --launch-skip 3 --launch-count 1 python3 scripts/profile_one.py 4096 128 causal
    compute-sanitizer --tool racecheck python3 scripts/profile_one.py 512 128 causal 1 1024

FA4_PROFILE_BACKWARD=1: each iteration is a forward and a backward (fa4 or cuDNN; the backward's
kernels are then the ones to select, e.g. ncu -k regex:FlashAttentionBackward).
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4
from fa4 import bench_fa3

seqlen, head_dim, mask = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 16384
batch, heads = max(1, tokens // seqlen), 2048 // head_dim
backward = os.environ.get("FA4_PROFILE_BACKWARD") == "1"
q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
           for _ in range(3))
do = torch.randn_like(q)
provider = sys.argv[6] if len(sys.argv) > 6 else "fa4"
if provider == "fa3":
    bench_fa3.load(sys.argv[7] if len(sys.argv) > 7 else "build/peers/fa3/libfa3_peer.so")
if provider == "cudnn":
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (B, H, S, D) view of the same memory
for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 5):
    if provider == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask == "causal")
    elif provider == "fa3":
        out = bench_fa3.fa3_forward(q, k, v, causal=mask == "causal")
    else:
        out = fa4.attention(q, k, v, causal=mask == "causal")
    if backward:
        torch.autograd.grad(out, (q, k, v), do.transpose(1, 2) if provider == "cudnn" else do)
torch.cuda.synchronize()
