"""Run one fa4 forward configuration a few times (for ncu / compute-sanitizer wrappers).

    python3 scripts/profile_one.py SEQLEN HEAD_DIM {causal,none} [ITERS] [TOKENS]
    ncu --clock-control none --launch-skip 3 --launch-count 1 python3 scripts/profile_one.py 4096 128 causal
    compute-sanitizer --tool racecheck python3 scripts/profile_one.py 512 128 causal 1 1024
"""
import sys

import torch

import fa4

seqlen, head_dim, mask = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 16384
batch, heads = max(1, tokens // seqlen), 2048 // head_dim
q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 5):
    fa4.attention(q, k, v, causal=mask == "causal")
torch.cuda.synchronize()
