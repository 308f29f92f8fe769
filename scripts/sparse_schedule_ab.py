"""A/B of the block-sparse forward's tile schedule (issue 25): run once per build, each build's
libfa4.so copied into torch_ops/fa4/_native first (scripts/ab_bench.sh's way), e.g. the shipped
dynamic schedule (tiles claimed through an atomic counter, longest first) against a static one
(the same longest-first order dealt out in fixed snake rounds):

    for v in dynamic static dynamic static; do cp build/ab/$v/* torch_ops/fa4/_native/; \\
        python3 scripts/sparse_schedule_ab.py --label $v; done

Each run first checks its outputs against a float64 formula on odd shapes, then times the
forward of fa4.flex_attention on three masks with unequal tiles (16k tokens, hd128, 16 heads):
8 random-length causal documents written as a plain mask_mod (so the block-sparse kernels run
them), causal with ALiBi, and random blocks (half kept, half of those partial). TFLOP/s of
useful work.
"""
import argparse

import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import fa4
from fa4 import score_mods
from fa4.bench import time_ms


def check(label):
    g = torch.Generator().manual_seed(1)
    sq, sk, h, d = 1000, 777, 4, 128
    q, k, v = (torch.randn(2, h, n, d, generator=g).cuda().to(torch.bfloat16) for n in (sq, sk, sk))
    keep = (torch.rand(sq // 64 + 1, sk // 64 + 1, generator=g) < 0.6).cuda()
    mod = lambda b, hh, i, j: keep[i // 64, j // 64] & ((i + j) % 3 != 0)  # noqa: E731
    bm = create_block_mask(mod, None, None, sq, sk, device="cuda")
    slopes = torch.linspace(0.01, 0.1, h, device="cuda")
    out = fa4.flex_attention(q, k, v, block_mask=bm, score_mod=score_mods.alibi(slopes))
    s = (q.double() @ k.double().transpose(-1, -2)) * d ** -0.5
    s = s + slopes.double()[:, None, None] * (torch.arange(sk, device="cuda")[None, :] -
                                              torch.arange(sq, device="cuda")[:, None]).double()
    s = s.masked_fill(~create_mask(mod, None, None, sq, sk, device="cuda"), float("-inf"))
    want = torch.softmax(s, -1).nan_to_num(0.0) @ v.double()
    err = (out.double() - want).abs().max().item()
    print(f"{label}: max abs error against float64 {err:.2e}", flush=True)
    assert err < 3e-2, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    check(args.label)
    n, d = args.tokens, 128
    heads = 2048 // d
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:7] + 1).values
    doc = torch.zeros(n, dtype=torch.long)
    doc[cuts] = 1
    doc = doc.cumsum(0).cuda()
    cells = -(-n // 128)
    keep, partial = ((torch.rand(cells, cells, generator=g) < 0.5).cuda() for _ in range(2))
    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
    cases = {
        "documents": (lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None),
        "causal + alibi": (lambda b, h, i, j: i >= j, score_mods.alibi(slopes)),
        "random blocks": (lambda b, h, i, j: keep[i // 128, j // 128] & (~partial[i // 128, j // 128]
                                                                         | ((i * 7 + j * 3) % 5 != 0)), None),
    }
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, (mod, score_mod) in cases.items():
        bm = create_block_mask(mod, None, None, n, n, device="cuda")
        pairs = int(create_mask(mod, None, None, n, n, device="cuda").sum())
        fa4.flex_attention(q, k, v, block_mask=bm, score_mod=score_mod)  # tables built and cached
        ms = min(time_ms(lambda i: fa4.flex_attention(q, k, v, block_mask=bm, score_mod=score_mod), 5, 20)
                 for _ in range(3))
        print(f"{args.label}: {torch.cuda.get_device_name()} {name}: {4 * heads * pairs * d / ms / 1e9:.1f} TFLOP/s "
              f"({ms:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
