"""A/B of the block-sparse kernels' tile order (one GPU call): the tables' longest-first order
(block_sparse.build_tables) against the natural order (each row's tiles in index order), same
tables otherwise, forward and forward + backward, on the masks of `fa4.bench --flex-sparse`.

    python3 scripts/sparse_order_ab.py [--tokens 16384] [--head-dim 128]
"""
import argparse
import statistics

import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from fa4 import block_sparse
from fa4.bench import time_ms


def natural(tables):
    counts = tables.counts.clone()
    counts[..., 3] = torch.arange(counts.shape[2], device=counts.device, dtype=torch.int32)
    return tables._replace(counts=counts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n, d = args.tokens, args.head_dim
    heads = 2048 // d
    g = torch.Generator().manual_seed(0)
    cells = -(-n // 128)
    keep, partial = ((torch.rand(cells, cells, generator=g) < 0.5).cuda() for _ in range(2))
    masks = {
        "random blocks": lambda b, h, q, kv: keep[q // 128, kv // 128] & (~partial[q // 128, kv // 128]
                                                                          | ((q * 7 + kv * 3) % 5 != 0)),
        "causal": lambda b, h, q, kv: q >= kv,
    }
    q, k, v = (torch.randn(1, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    dev = torch.device("cuda")
    for name, mod in masks.items():
        bm = create_block_mask(mod, None, None, n, n, device="cuda")
        pairs = int(create_mask(mod, None, None, n, n, device="cuda").sum())
        flops = 2 * heads * pairs * 2 * d
        tile, bwd_tile = block_sparse.kernel_tile(q.dtype, d, d, dev), block_sparse.kernel_tile(q.dtype, d, d, dev,
                                                                                               kernel="bwd")
        fwd_t = block_sparse.build_tables(bm, 1, heads, tile)
        bwd_t = block_sparse.build_tables(bm, 1, heads, bwd_tile, transposed=True)
        variants = {"longest first": (fwd_t, bwd_t), "natural": (natural(fwd_t), natural(bwd_t))}
        result = {}
        for r in range(args.rounds):
            for label in list(variants)[r % 2:] + list(variants)[:r % 2]:
                f, b = variants[label]

                def call(i, f=f, b=b):
                    return torch.ops.fa4.fwd_sparse(q, k, v, f.counts, f.blocks, f.bits, *tile, d ** -0.5, 0.0,
                                                    b.counts, b.blocks, b.bits, *bwd_tile)

                ms_f = time_ms(lambda i, f=f: torch.ops.fa4.fwd_sparse(
                    q.detach(), k.detach(), v.detach(), f.counts, f.blocks, f.bits, *tile, d ** -0.5), 5, 10)
                ms_s = time_ms(lambda i: torch.autograd.grad(call(i)[0], (q, k, v), dout), 5, 10)
                result.setdefault(label, []).append((flops / ms_f / 1e9, 3.5 * flops / ms_s / 1e9))
        med = {label: [statistics.median(x[i] for x in v) for i in (0, 1)] for label, v in result.items()}
        cells = "  ".join(f"{label} {f:6.1f} / {s:6.1f}" for label, (f, s) in med.items())
        print(f"{torch.cuda.get_device_name()} hd{d} {n} tokens, {name}: fwd / fwd+bwd TFLOP/s  {cells}", flush=True)


if __name__ == "__main__":
    main()
