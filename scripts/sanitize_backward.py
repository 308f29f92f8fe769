"""Small runs of every backward kernel family for compute-sanitizer (memcheck / racecheck /
synccheck): "keys" kernels with dQ split by rows (hd64), by one warpgroup (hd96, and hd64 with
softcap) and by columns (hd128); "keys_roles" kernels (both warpgroups on the same keys, one
holding dV and the other dK) with dQ staged for the TMA writer (hd192x128, hd192x192) or put in
the finished Q/dO stage (hd256). Each runs causal and local blocks whose query
range starts and ends inside the sequence, several query blocks per CTA (the Q/dO rings and the
dS/P stages wrap), GQA groups looped inside a CTA, softcap, the gradient through the returned
LSE, packed sequences with partial last K/V blocks (row-predicated dK/dV stores), empty and
one-row documents, keys cut by seqused_k, rows outside every sequence (zeroed by the
preprocess), and deterministic mode (the dQ turn counters; without a mask in the rotated order,
also cut into two chunks launched in groups: FA4_BWD_TURN_SPACING=2; hd192 / hd256 also with two
dQ writer warps: FA4_BWD_DQ_WRITERS=2). hd256 also runs its 2-CTA
cluster kernels (FA4_BWD_CLUSTERS=1, the window kernel's): odd K/V block counts (the last
cluster's second CTA past the keys), causal pairs whose query ranges differ (seqlen_q !=
seqlen_k), a window, GQA, and the 1-CTA fallback.

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
    # The rotation cut into 2 chunks launched chunk by chunk over launch groups of pairs.
    deterministic_with({"FA4_BWD_TURN_SPACING": "2"}, [{}], q, k, v)
    if d >= 192:  # "keys_roles": two dQ writer warps taking the query blocks alternately
        deterministic_with({"FA4_BWD_DQ_WRITERS": "2"}, [{}, {"causal": True}, {"window": (70, 9)}], q, k, v)
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
    # The same documents inside larger buffers (rows before the first and after the last one, which
    # the preprocess zeroes), default mode: first stores into whole query blocks by claims (rotated
    # without a mask), partial last blocks added into.
    q = torch.randn(sum(lens_q) + 40, 4, d, device=dev, dtype=bf16)
    k = torch.randn(sum(lens_k) + 20, 2, d, device=dev, dtype=bf16)
    v = torch.randn(sum(lens_k) + 20, 2, dv, device=dev, dtype=bf16)
    for kwargs in ({}, {"causal": True}, {"window": (40, 40), "seqused_k": used}):
        step(lambda q, k, v: fa4.attention_varlen(q, k, v, cu_q + 7, cu_k + 3, max(lens_q), max(lens_k), **kwargs),
             q, k, v)


def deterministic_with(settings, calls, q, k, v):
    """Deterministic steps (each of ``calls``' keyword arguments) under run-time ``settings``."""
    import os

    os.environ.update(settings)
    try:
        for kwargs in calls:
            step(lambda q, k, v: fa4.attention(q, k, v, deterministic=True, **kwargs), q, k, v)
    finally:
        for name in settings:
            del os.environ[name]


def clusters(d, dv):
    """The 2-CTA kernels (hd256, causal and windows): forced on, then their fallback where the
    clusters do not fit. The backward op runs on this thread (autograd's CUDA backward thread keeps
    its own launch records)."""
    import os

    from fa4 import _native

    def run(q, k, v, causal=False, window=(-1, -1)):
        scale = d ** -0.5
        out, lse = torch.ops.fa4.fwd(q, k, v, scale, causal, window[0], window[1])
        torch.ops.fa4.bwd(torch.randn_like(out), q, k, v, out, lse, None, scale, causal, window[0], window[1])
        return _native.last_launch("bwd")["name"]
    os.environ["FA4_BWD_CLUSTERS"] = "1"
    try:
        for sq, sk, hq, hk in ((300, 300, 4, 4), (333, 200, 6, 2), (200, 333, 4, 2), (129, 700, 2, 1)):
            q = torch.randn(1, sq, hq, d, device=dev, dtype=bf16)
            k = torch.randn(1, sk, hk, d, device=dev, dtype=bf16)
            v = torch.randn(1, sk, hk, dv, device=dev, dtype=bf16)
            for causal, window in ((True, (-1, -1)), (False, (70, 9))):
                assert run(q, k, v, causal, window).endswith("_longseq")
        _native.pretend_active_clusters(0)
        assert not run(q, k, v, True).endswith("_longseq")
    finally:
        _native.pretend_active_clusters(-1)
        del os.environ["FA4_BWD_CLUSTERS"]


DIMS = {"64": (64, 64), "96": (96, 96), "128": (128, 128), "192x128": (192, 128), "192": (192, 192),
        "256": (256, 256)}
for name in sys.argv[1:] or DIMS:
    family(*DIMS[name])
    if name == "256":
        clusters(*DIMS[name])
torch.cuda.synchronize()
print("done")
