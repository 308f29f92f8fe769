"""Small runs of the block-sparse kernels (fa4::fwd_sparse, and fa4::bwd_sparse through autograd)
for compute-sanitizer: random BlockMasks with empty, partial and full blocks, tiles that see no
key and keys no row sees (the all-clear slot), blocks of 64 and (128, 64) against the kernels'
tiles, GQA (a backward CTA walks several query heads' tables), more tiles than SMs (the dynamic
schedule's hand-off ring), hd128 (128-key tiles, O in its own buffer; backward "keys" layout),
hd64 (128-query backward blocks) and hd256 (64-key tiles, O in V's buffer; backward "keys_roles"
layout, dQ through the stages), softcap; the in-kernel score_mods (alibi, a relative-bias table
shorter than the sequences, bias tensors (fp32 and bf16) broadcast over batch, heads or queries,
whose edge tiles read clamped entries and reduce only inside the sequences), their parameters'
gradient included (a relative bias's tiles clamped whole to one end of its table, and its shared
windows per warp).

    compute-sanitizer --tool racecheck python3 scripts/sanitize_block_sparse.py [score_mods]

(``score_mods``: only the runs with an in-kernel score_mod.)
"""
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask

import fa4
from fa4 import score_mods

torch.manual_seed(0)
dev = "cuda"


ONLY_SCORE_MODS = sys.argv[1:] == ["score_mods"]


def run(sq, sk, hq, hk, d, block, score_mod=None, batch=2, train=True):
    if ONLY_SCORE_MODS and (score_mod is None or isinstance(score_mod, score_mods.Softcap)):
        return
    cells = (-(-sq // 64) + 1, -(-sk // 64) + 1)
    keep, partial = torch.rand(cells, device=dev) < 0.5, torch.rand(cells, device=dev) < 0.5
    keep[0] = False

    def mask_mod(b, h, q, kv):
        return keep[q // 64, kv // 64] & (~partial[q // 64, kv // 64] | ((q + 2 * kv) % 3 != 0))

    block_mask = create_block_mask(mask_mod, None, None, sq, sk, device=dev, BLOCK_SIZE=block)
    q = torch.randn(batch, hq, sq, d, device=dev, dtype=torch.bfloat16, requires_grad=train)
    k, v = (torch.randn(batch, hk, sk, d, device=dev, dtype=torch.bfloat16, requires_grad=train) for _ in range(2))
    out = fa4.flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod, enable_gqa=True)
    if train:
        params = [p for p in (getattr(score_mod, "slopes", None), getattr(score_mod, "table", None),
                              getattr(score_mod, "bias", None)) if p is not None]
        torch.autograd.grad(out, [q, k, v] + [p for p in params if p.requires_grad], torch.randn_like(out))


def alibi(heads):
    return score_mods.alibi(torch.linspace(0.05, 0.5, heads, device=dev).requires_grad_())


def relative_bias(heads, center, learned=True):
    return score_mods.relative_bias(torch.randn(heads, 2 * center + 1, device=dev).requires_grad_(learned))


run(1000, 777, 8, 2, 128, 128)
run(700, 1100, 4, 4, 128, (128, 64), score_mods.softcap(20.0))
run(2000, 2000, 40, 40, 128, 64, batch=1, train=False)  # 640 tiles: several per CTA
run(600, 700, 4, 2, 64, 128, score_mods.softcap(10.0))
run(600, 700, 4, 2, 64, 128)
run(500, 900, 4, 2, 256, 128)
run(1500, 600, 16, 16, 256, 64, batch=1)
run(1000, 777, 8, 2, 128, 128, alibi(8))
run(700, 1100, 4, 4, 64, 128, relative_bias(4, 100))
run(500, 900, 4, 2, 256, 128, relative_bias(4, 2000))
# Tiles clamped whole to either end of a short table and tiles across it (the backward's shared
# windows per warp), GQA (a CTA flushes each query head's sums), a frozen table.
run(1000, 1500, 8, 2, 128, 128, relative_bias(8, 64))
run(900, 700, 4, 4, 192, 128, relative_bias(4, 30, learned=False))
run(600, 500, 4, 4, 192, 64, alibi(4))
run(1000, 777, 8, 2, 128, 128, score_mods.bias(torch.randn(1000, 777, device=dev).requires_grad_()))
run(700, 1100, 4, 4, 64, 128, score_mods.bias(torch.randn(2, 1, 1, 1100, device=dev).requires_grad_()))
run(500, 900, 4, 2, 256, 128, score_mods.bias(torch.randn(1, 4, 500, 900, device=dev).requires_grad_()))
run(333, 555, 4, 4, 96, 64, score_mods.bias(torch.randn(2, 4, 333, 555, device=dev)))
run(777, 1001, 4, 2, 128, 128, score_mods.bias(torch.randn(2, 1, 777, 1001, device=dev, dtype=torch.bfloat16)
                                                  .requires_grad_()))  # read as bf16 ("bias16")
run(500, 900, 4, 4, 256, 64, score_mods.bias(torch.randn(1, 4, 1, 900, device=dev, dtype=torch.bfloat16)))
torch.cuda.synchronize()
print("ok")
