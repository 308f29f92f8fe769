"""One forward of fa4's block-sparse kernel with a causal BlockMask, without a bias and with each
in-kernel score_mod (hd128, bf16, 16k tokens, 16 heads), for Nsight Compute:

    ncu --clock-control none -k regex:sparse --section WarpStateStats --section InstructionStats \
        python3 scripts/profile_score_mods.py
"""
import torch
from torch.nn.attention.flex_attention import create_block_mask

import fa4

tokens, heads, d = 16384, 16, 128
q, k, v = (torch.randn(1, heads, tokens, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
plain = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, tokens, tokens, device="cuda")
causal = create_block_mask(fa4.masks.causal(), None, None, tokens, tokens, device="cuda")
slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
table = 0.1 * torch.randn(heads, 513, device="cuda")
for _ in range(2):  # the second round is the one to read (tables cached, modules loaded)
    fa4.flex_attention(q, k, v, block_mask=plain)
    fa4.flex_attention(q, k, v, block_mask=causal, score_mod=fa4.score_mods.alibi(slopes))
    fa4.flex_attention(q, k, v, block_mask=causal, score_mod=fa4.score_mods.relative_bias(table))
torch.cuda.synchronize()
print("ok")
