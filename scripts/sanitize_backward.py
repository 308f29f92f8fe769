"""Small runs of the backward kernel's paths for compute-sanitizer (memcheck / racecheck /
synccheck): both dQ splits (hd64: by rows, 128-row query blocks; hd128: by columns), causal
and local blocks whose query range starts and ends inside the sequence, several query blocks
per CTA (the Q/dO rings and the dS stages wrap), GQA groups looped inside a CTA, softcap,
packed sequences with partial last K/V blocks (row-predicated dK/dV stores), empty and
one-row documents, keys cut by seqused_k, and the gradient through the returned LSE.

    compute-sanitizer --tool racecheck python3 scripts/sanitize_backward.py
"""
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


for d in (64, 128):
    q, k, v = (torch.randn(2, 300, 4, d, device=dev, dtype=bf16) for _ in range(3))
    for kwargs in ({}, {"causal": True}, {"window": (70, 9)}, {"softcap": 20.0, "causal": True}):
        step(lambda q, k, v: fa4.attention(q, k, v, **kwargs), q, k, v)
    # GQA: 6 query heads on 2 K/V heads, seqlen_q != seqlen_k, gradient through the LSE.
    q = torch.randn(1, 333, 6, d, device=dev, dtype=bf16)
    k, v = (torch.randn(1, 200, 2, d, device=dev, dtype=bf16) for _ in range(2))
    step(lambda q, k, v: fa4.attention(q, k, v, causal=True, return_lse=True), q, k, v)
    # Packed documents (one empty, one of one row), keys cut by seqused_k.
    lens_q, lens_k = [0, 1, 150, 270], [5, 130, 90, 300]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    used = torch.tensor([5, 100, 90, 250], dtype=torch.int32, device=dev)
    q = torch.randn(sum(lens_q), 4, d, device=dev, dtype=bf16)
    k, v = (torch.randn(sum(lens_k), 2, d, device=dev, dtype=bf16) for _ in range(2))
    step(lambda q, k, v: fa4.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True), q, k, v)
    step(lambda q, k, v: fa4.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=used,
                                              window=(40, 40)), q, k, v)
torch.cuda.synchronize()
print("done")
