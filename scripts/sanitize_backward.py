"""Small runs of every backward kernel family for compute-sanitizer (memcheck / racecheck /
synccheck): "keys" kernels with dQ split by rows (hd64), by one warpgroup (hd96, and hd64 with
softcap) and by columns (hd128); "keys_roles" kernels (both warpgroups on the same keys, one
holding dV and the other dK) with dQ staged for the TMA writer (hd192x128, hd192x192) or put in
the finished Q/dO stage (hd256). Each runs causal and local blocks whose query
range starts and ends inside the sequence, several query blocks per CTA (the Q/dO rings and the
dS/P stages wrap), GQA groups looped inside a CTA, softcap, the gradient through the returned
LSE, packed sequences with partial last K/V blocks (row-predicated dK/dV stores), empty and
one-row documents, keys cut by seqused_k, and deterministic mode (the dQ turn counters; without a
mask in the rotated order).

    compute-sanitizer --tool racecheck python3 scripts/sanitize_backward.py [DIM ...]

DIM: 64 96 128 192x128 192 256 (default: all).
"""
import sys

import torch

import fa4

torch.manual_seed(0)
dev, bf16 = "cuda", torch.bfloat16


def step(fn, *inputs):
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out, lse = out if isinstance(out, tuple) else (out, None)
    loss = (out.float() * torch.randn_like(out, dtype=torch.float32)).sum()
    if lse is not None:
        loss = loss + lse.sum()
    torch.autograd.grad(loss, inputs)


def family(d, dv):
    q, k = (torch.randn(2, 300, 4, d, device=dev, dtype=bf16) for _ in range(2))
    v = torch.randn(2, 300, 4, dv, device=dev, dtype=bf16)
    for kwargs in ({}, {"causal": True}, {"window": (70, 9)}, {"softcap": 20.0, "causal": True},
                   {"causal": True, "deterministic": True}, {"deterministic": True}):
        step(lambda q, k, v: fa4.attention(q, k, v, **kwargs), q, k, v)
    # GQA: 6 query heads on 2 K/V heads, seqlen_q != seqlen_k, gradient through the LSE.
    q = torch.randn(1, 333, 6, d, device=dev, dtype=bf16)
    k = torch.randn(1, 200, 2, d, device=dev, dtype=bf16)
    v = torch.randn(1, 200, 2, dv, device=dev, dtype=bf16)
    step(lambda q, k, v: fa4.attention(q, k, v, causal=True, return_lse=True), q, k, v)
    step(lambda q, k, v: fa4.attention(q, k, v, window=(50, 50), deterministic=True), q, k, v)
    # Packed documents (one empty, one of one row), keys cut by seqused_k.
    lens_q, lens_k = [0, 1, 150, 270], [5, 130, 90, 300]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    used = torch.tensor([5, 100, 90, 250], dtype=torch.int32, device=dev)
    q = torch.randn(sum(lens_q), 4, d, device=dev, dtype=bf16)
    k = torch.randn(sum(lens_k), 2, d, device=dev, dtype=bf16)
    v = torch.randn(sum(lens_k), 2, dv, device=dev, dtype=bf16)
    step(lambda q, k, v: fa4.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True), q, k, v)
    step(lambda q, k, v: fa4.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=used,
                                              window=(40, 40), deterministic=True), q, k, v)
    # Without a mask, deterministic: rotated starts and arrival-order turns per sequence.
    step(lambda q, k, v: fa4.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), deterministic=True),
         q, k, v)


DIMS = {"64": (64, 64), "96": (96, 96), "128": (128, 128), "192x128": (192, 128), "192": (192, 192),
        "256": (256, 256)}
for name in sys.argv[1:] or DIMS:
    family(*DIMS[name])
torch.cuda.synchronize()
print("done")
