"""The compiled Hopper backward against float64 autograd (skipped without a Hopper GPU).

Gradients come from fa4's forward + backward on fresh random data; the oracle is autograd
through the naive attention in float64, and fa4's error must stay within 2x the error of the
same naive math run in the input dtype (plus a small floor), and under an absolute ceiling. The
caching allocator is poisoned with NaN first, so an unwritten gradient element cannot pass.
"""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fa4
from fa4 import _native, reference
from fa4.testing import naive_attention, rel_error, visible_keys

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]

# Every (head_dim, head_dim_v) the forward serves: "keys" kernels (hd64 with dQ by rows, hd96
# by one warpgroup, hd128 by columns) and "keys_roles" kernels (hd192x128, hd192x192 and hd256:
# dQ by columns, staged in a buffer of its own or, hd256, in the finished Q/dO stage).
BWD_HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)]
CEILING = 2e-2  # no gradient relative error above this passes, whatever the baseline


def poison_allocator(nbytes=256 << 20):
    blob = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).fill_(float("nan"))
    del blob


def naive_in_dtype(q, k, v, causal, window, softcap, scale):
    """The naive attention in the inputs' own dtype (the baseline's arithmetic)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(hq // hk, 1)
    vt = v.transpose(1, 2).repeat_interleave(hq // hk, 1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_keys(sq, sk, causal, window, q.device)
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    return (p @ vt).transpose(1, 2)


def grads(fn, inputs, dout):
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, dout)


def check_grads(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, label=""):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device=q.device, dtype=q.dtype)
    poison_allocator()
    got = grads(lambda q, k, v: fa4.attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale),
                (q, k, v), dout)
    torch.cuda.synchronize()
    ref = grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                                scale=scale)[0],
                (q.double(), k.double(), v.double()), dout.double())
    low = grads(lambda q, k, v: naive_in_dtype(q, k, v, causal, window, softcap, scale), (q, k, v), dout)
    for name, g, r, b in zip("qkv", got, ref, low):
        assert g.shape == r.shape and g.dtype == q.dtype
        err, base = rel_error(g, r), rel_error(b, r)
        assert err <= min(2 * base + 1e-3, CEILING), f"{label} d{name}: fa4 {err:.3e}, same math in dtype {base:.3e}"


def qkv(b, sq, sk, hq, hk, d, dv, dtype, layout="bshd"):
    if layout == "bhsd":  # (B, H, S, D) storage passed as a transposed view: non-contiguous strides
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(b, hk, sk, d, device="cuda", dtype=dtype).transpose(1, 2)
        v = torch.randn(b, hk, sk, dv, device="cuda", dtype=dtype).transpose(1, 2)
        return q, k, v
    return (torch.randn(b, sq, hq, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype))


MASKS = [("none", False, (-1, -1)), ("causal", True, (-1, -1)), ("local", False, (37, 5))]


@pytest.mark.parametrize("dims", BWD_HEAD_DIMS, ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("seqlens", [(17, 17), (127, 129), (300, 700), (700, 300), (1000, 1000)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_grads_match_float64(dims, dtype, mask, seqlens):
    d, dv = dims
    _, causal, window = mask
    q, k, v = qkv(2, seqlens[0], seqlens[1], 3, 3, d, dv, dtype)
    check_grads(q, k, v, causal=causal, window=window, label=f"{mask[0]} {seqlens}")


@pytest.mark.parametrize("dims", BWD_HEAD_DIMS, ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
def test_softcap(dims, mask):
    d, dv = dims
    _, causal, window = mask
    q, k, v = qkv(2, 257, 300, 2, 2, d, dv, torch.bfloat16)
    check_grads(q * 3, k * 3, v, causal=causal, window=window, softcap=5.0, label="softcap")


@pytest.mark.parametrize("dims", BWD_HEAD_DIMS, ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 3)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_gqa_and_strides(dims, heads, causal):
    d, dv = dims
    q, k, v = qkv(2, 333, 259, heads[0], heads[1], d, dv, torch.bfloat16, layout="bhsd")
    check_grads(q, k, v, causal=causal, label=f"gqa {heads}")


@pytest.mark.parametrize("dims", BWD_HEAD_DIMS, ids=lambda d: f"d{d[0]}")
def test_rows_that_see_no_key_get_zero_gradient(dims):
    # Bottom-right causal with seqlen_q > seqlen_k: the first rows see no key; a window
    # (0, 0) with seqlen_q < seqlen_k leaves most keys unseen (their dK, dV must be 0).
    d, dv = dims
    q, k, v = qkv(1, 200, 70, 2, 2, d, dv, torch.bfloat16)
    check_grads(q, k, v, causal=True, label="empty rows")
    dq = grads(lambda q, k, v: fa4.attention(q, k, v, causal=True), (q, k, v), q.new_ones(q.shape[:-1] + (dv,)))[0]
    assert torch.all(dq[:, :130] == 0)
    q, k, v = qkv(1, 70, 300, 2, 2, d, dv, torch.bfloat16)
    check_grads(q, k, v, window=(0, 0), label="unseen keys")
    _, dk, dv_ = grads(lambda q, k, v: fa4.attention(q, k, v, window=(0, 0)), (q, k, v),
                       torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype))
    assert torch.all(dk[:, :230] == 0) and torch.all(dv_[:, :230] == 0)


@pytest.mark.parametrize("dims", BWD_HEAD_DIMS, ids=lambda d: f"d{d[0]}")
def test_gradient_through_lse(dims):
    d, dv = dims
    q, k, v = qkv(2, 190, 250, 4, 2, d, dv, torch.bfloat16)
    w_out = torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype)
    w_lse = torch.randn(2, 4, 190, device="cuda")

    def loss_fa4(q, k, v):
        out, lse = fa4.attention(q, k, v, causal=True, return_lse=True)
        return (out.float() * w_out).sum() + (lse * w_lse).sum()

    def loss_ref(q, k, v):
        out, lse = naive_attention(q, k, v, causal=True)
        return (out * w_out.double()).sum() + (lse * w_lse.double()).sum()

    for weights in (w_lse, torch.ones(()).expand(2, 4, 190)):  # random, and lse.sum()'s expanded ones
        w_lse = weights.to("cuda")
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        got = torch.autograd.grad(loss_fa4(*inputs), inputs)
        inputs = [x.double().detach().requires_grad_() for x in (q, k, v)]
        ref = torch.autograd.grad(loss_ref(*inputs), inputs)
        for name, g, r in zip("qkv", got, ref):
            assert rel_error(g, r) < 1e-2, f"d{name}: {rel_error(g, r):.3e}"


def random_docs(num_docs, total, generator):
    cuts = torch.randperm(total - 1, generator=generator)[: num_docs - 1] + 1
    bounds = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([total])])
    return bounds.to(torch.int32)


def check_varlen_grads(dims, mask, cu_q, cu_k, used=None, total=None, dtype=torch.bfloat16):
    """fa4.attention_varlen's gradients against float64 per sequence, on poisoned memory. ``total``:
    (rows of q, rows of k) when the tensors reach past the sequences (default: cu_q[-1], cu_k[-1]);
    rows outside every sequence and keys past seqused_k must get zero gradients."""
    d, dv = dims
    _, causal, window = mask
    hq, hk = 4, 2
    total_q, total_k = total or (int(cu_q[-1]), int(cu_k[-1]))
    q = torch.randn(total_q, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(total_k, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(total_k, hk, dv, device="cuda", dtype=dtype)
    lens_k = (cu_k[1:] - cu_k[:-1])
    dout = torch.randn(q.shape[0], hq, dv, device="cuda", dtype=dtype)
    poison_allocator()
    cuq, cuk = cu_q.cuda(), cu_k.cuda()
    usedc = used.cuda() if used is not None else None
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int(lens_k.max())
    got = grads(lambda q, k, v: fa4.attention_varlen(q, k, v, cuq, cuk, max_q, max_k, seqused_k=usedc,
                                                     causal=causal, window=window), (q, k, v), dout)
    torch.cuda.synchronize()
    ref = [torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v)]
    # Rows no gradient reaches (outside every sequence, keys past seqused_k, rows that see no key
    # and keys no row sees) must be exact zeros.
    live_q = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    live_k = torch.zeros(total_k, dtype=torch.bool, device="cuda")
    for i in range(len(cu_q) - 1):
        rq = slice(int(cu_q[i]), int(cu_q[i + 1]))
        nk = int(lens_k[i]) if used is None else int(used[i])
        rk = slice(int(cu_k[i]), int(cu_k[i]) + nk)
        if rq.stop == rq.start:
            continue
        if nk == 0:
            continue  # no keys: output 0, every gradient 0
        seen = visible_keys(rq.stop - rq.start, nk, causal, window, "cuda")
        live_q[rq], live_k[rk] = seen.any(1), seen.any(0)
        g = grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window)[0],
                  (q[rq][None].double(), k[rk][None].double(), v[rk][None].double()), dout[rq][None].double())
        ref[0][rq], ref[1][rk], ref[2][rk] = g[0][0], g[1][0], g[2][0]
    for name, g, r, live in zip("qkv", got, ref, (live_q, live_k, live_k)):
        assert torch.isfinite(g).all(), f"d{name}: unwritten (poisoned) elements"
        assert rel_error(g, r) < 1e-2, f"d{name}: {rel_error(g, r):.3e}"
        assert torch.all(g[~live] == 0), f"d{name}: rows no gradient reaches are not zero"
    return got


@pytest.mark.parametrize("dims", BWD_HEAD_DIMS, ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("seqused", [False, True], ids=["all_keys", "seqused_k"])
def test_varlen(dims, mask, seqused):
    gen = torch.Generator().manual_seed(1)
    # Empty and one-row documents among random ones; keys differ in length from queries (more
    # queries than keys in the fifth: its first rows see no key under the causal mask).
    cu_q = torch.tensor([0, 0, 1, 150, 151, 500, 777], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 90, 300, 555, 900], dtype=torch.int32)
    lens_k = (cu_k[1:] - cu_k[:-1])
    used = (lens_k - torch.randint(0, 40, lens_k.shape, generator=gen)).clamp(min=0).to(torch.int32)
    check_varlen_grads(dims, mask, cu_q, cu_k, used if seqused else None)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 192)], ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("n_docs", [127, 128, 129, 300])
def test_varlen_many_sequences(dims, n_docs):
    """More sequences than the preprocess's CTAs look at in one round of loads (128: its flat
    grid finds each CTA's sequence round after round), empty ones and multi-block ones among
    them, the buffers reaching past the last sequence."""
    gen = torch.Generator().manual_seed(n_docs)
    lens = torch.randint(0, 40, (n_docs,), generator=gen)
    lens[:: 7] = 0
    lens[3], lens[-2] = 300, 129  # several statistics blocks, one of them partial
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    total = int(cu[-1]) + 50
    check_varlen_grads(dims, MASKS[1], cu, cu, total=(total, total))


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)], ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("store_first", ["0", "1"], ids=["zeroed", "first_stores"])
def test_varlen_rows_outside_every_sequence(monkeypatch, dims, mask, store_first):
    """Rows before the first sequence and after the last one (a buffer with room to spare), and
    sequences whose last query block is partial or whole (128 and 256 rows: whole in every
    kernel's blocks), get exact zeros where no gradient flows: the preprocess zeroes what the
    main kernel leaves unwritten, with and without first stores."""
    monkeypatch.setenv("FA4_BWD_STORE_FIRST", store_first)
    cu_q = torch.tensor([7, 135, 391, 392, 600], dtype=torch.int32)
    cu_k = torch.tensor([3, 131, 300, 301, 700], dtype=torch.int32)
    used = torch.tensor([128, 100, 0, 250], dtype=torch.int32)
    check_varlen_grads(dims, mask, cu_q, cu_k, total=(650, 777))
    check_varlen_grads(dims, mask, cu_q, cu_k, used, total=(650, 777))


def check_first_store_equals_zeroed(monkeypatch, attend, inputs, dout):
    """Gradients of ``attend(q, k, v, deterministic)`` with first dQ stores (FA4_BWD_STORE_FIRST=1)
    against zero-and-add (=0) on poisoned memory: bitwise equal in deterministic mode (turn 0
    stores, the same order of additions after it), equal up to the order of dQ's fp32 additions
    otherwise. Returns the zero-and-add gradients."""
    def run(store_first, deterministic):
        monkeypatch.setenv("FA4_BWD_STORE_FIRST", store_first)
        poison_allocator()
        return grads(lambda q, k, v: attend(q, k, v, deterministic), inputs, dout)
    zeroed = run("0", True)
    for a, b in zip(run("1", True), zeroed):
        assert torch.equal(a, b)
    for a, b in zip(run("1", False), zeroed):
        assert rel_error(a, b) < 8e-3  # bf16 roundings of dQ may flip
    return zeroed


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)], ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
def test_varlen_first_store_equals_adding_to_zeros(monkeypatch, dims, mask):
    """Packed sequences' first stores (whole query blocks; partial last blocks added into zeros):
    bitwise the zero-and-add gradients in deterministic mode, equal up to the order of dQ's
    additions otherwise."""
    d, dv = dims
    _, causal, window = mask
    cu = torch.tensor([0, 1, 300, 301, 900, 1028, 1400], dtype=torch.int32, device="cuda")
    q = torch.randn(1400, 6, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1400, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1400, 2, dv, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(1400, 6, dv, device="cuda", dtype=torch.bfloat16)

    check_first_store_equals_zeroed(
        monkeypatch, lambda q, k, v, deterministic: fa4.attention_varlen(
            q, k, v, cu, cu, 599, 599, causal=causal, window=window, deterministic=deterministic), (q, k, v), dout)


def test_cuda_backward_never_runs_the_reference(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CUDA backward ran the torch reference")

    monkeypatch.setattr(reference, "attention_backward", refuse)
    q, k, v = qkv(1, 130, 130, 2, 2, 128, 128, torch.bfloat16)
    grads(lambda q, k, v: fa4.attention(q, k, v, causal=True), (q, k, v), torch.randn_like(q))


def test_combination_without_a_backward_kernel_says_what_to_use():
    # No backward kernel for the call (here a head dim without kernels; a filtered FA4_VARIANTS
    # build takes the same path): a clear error, never the slow path.
    q = torch.randn(1, 64, 2, 40, device="cuda", dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match="no backward kernel for head_dim=40.*scaled_dot_product_attention"):
        torch.ops.fa4.bwd(q, q, q, q, q, lse, None, 0.125, False)


def test_opcheck_bwd_cuda():
    q, k, v = qkv(2, 77, 90, 4, 2, 128, 128, torch.bfloat16)
    out, lse = torch.ops.fa4.fwd(q, k, v, 0.125, True)
    dout = torch.randn_like(out)
    for dlse, kwargs in ((None, {}), (torch.randn_like(lse), {"softcap": 5.0}), (None, {"deterministic": True})):
        torch.library.opcheck(torch.ops.fa4.bwd.default, (dout, q, k, v, out, lse, dlse, 0.125, True), kwargs,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# One case per kernel family and mask, with GQA groups and several K/V blocks per query block.
DETERMINISM_CASES = [((64, 64), "causal"), ((96, 96), "none"), ((128, 128), "local"), ((192, 128), "causal"),
                     ((192, 192), "local"), ((256, 256), "causal")]


@pytest.mark.parametrize("dims,mask", DETERMINISM_CASES, ids=[f"d{d[0]}x{d[1]}-{m}" for d, m in DETERMINISM_CASES])
def test_deterministic_mode_is_bitwise_reproducible(dims, mask):
    d, dv = dims
    causal, window = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "local": (False, (300, 40))}[mask]
    q, k, v = qkv(2, 1100, 1000, 8, 2, d, dv, torch.bfloat16)
    dout = torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype)

    def run(deterministic):
        return grads(lambda q, k, v: fa4.attention(q, k, v, causal=causal, window=window,
                                                   deterministic=deterministic), (q, k, v), dout)
    first = run(True)
    for _ in range(9):
        again = run(True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    # The same gradients as the default mode, up to the order of dQ's fp32 additions.
    for a, b in zip(first, run(False)):
        assert rel_error(a, b) < 8e-3  # bf16 roundings of dQ may flip


ROTATION_CASES = [((64, 64), 2, 1100, 1000), ((128, 128), 2, 1100, 1000), ((192, 192), 1, 300, 9000),
                  ((256, 256), 2, 1100, 1000), ((256, 256), 1, 300, 9000)]


@pytest.mark.parametrize("dims,batch,seqlen_q,seqlen_k", ROTATION_CASES,
                         ids=[f"d{c[0][0]}-{c[2]}x{c[3]}" for c in ROTATION_CASES])
def test_deterministic_rotated_turns(monkeypatch, dims, batch, seqlen_q, seqlen_k):
    """Without a mask, deterministic mode may rotate the K/V blocks' starts and order each query
    block's dQ additions by arrival (src/fa4_kernels/dq_order.py), in chunks the GPU holds at once
    (forced here, FA4_BWD_ROTATE=1; 9000 keys: 141 blocks of 64, more than an H100's or H200's
    132 SMs, so two chunks). Bitwise reproducible, and the gradients of the ascending turns
    (FA4_BWD_ROTATE=0) up to the order of fp32 additions."""
    d, dv = dims
    q, k, v = qkv(batch, seqlen_q, seqlen_k, 4, 2, d, dv, torch.bfloat16)
    dout = torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype)

    def run(rotate):
        monkeypatch.setenv("FA4_BWD_ROTATE", rotate)
        poison_allocator()
        grads_ = grads(lambda q, k, v: fa4.attention(q, k, v, deterministic=True), (q, k, v), dout)
        # The launch record is per thread (autograd's backward runs on its own): the op directly.
        scale = d ** -0.5
        out, lse = torch.ops.fa4.fwd(q, k, v, scale, False)
        torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, False, deterministic=True)
        return grads_, _native.last_launch("bwd")["rotate"]
    rotated, period = run("1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 0 < period <= sms
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(rotated, run("1")[0]))
    ascending, none = run("0")
    assert none == 0
    for a, b in zip(rotated, ascending):
        assert rel_error(a, b) < 8e-3  # bf16 roundings of dQ may flip
    assert not torch.equal(rotated[0], ascending[0])  # another order of additions: it did rotate


# (dims, batch, seqlen_q, seqlen_k, heads_q, heads_kv, spacing): hd192 at 4000 keys is 63 blocks,
# chunks of 32 in groups of 3 of its 6 pairs on 132 SMs (4 would leave a last group of 6 spread
# over 192 CTAs); the others make one group.
SPACED_CASES = [((64, 64), 4, 1000, 1000, 8, 2, 2), ((192, 192), 3, 777, 4000, 4, 2, 2),
                ((256, 256), 2, 1300, 1300, 6, 3, 3)]


@pytest.mark.parametrize("dims,batch,seqlen_q,seqlen_k,heads_q,heads_kv,spacing", SPACED_CASES,
                         ids=[f"d{c[0][0]}-{c[2]}x{c[3]}-s{c[6]}" for c in SPACED_CASES])
def test_deterministic_spaced_turns(monkeypatch, dims, batch, seqlen_q, seqlen_k, heads_q, heads_kv, spacing):
    """FA4_BWD_TURN_SPACING cuts a deterministic call's rotation into chunks launched chunk by chunk
    over launch groups of (batch, K/V head) pairs (fa4.heuristics.bwd_rotate / bwd_launch_group):
    the launch takes the rules' period and group, the gradients are bitwise reproducible, match the
    float64 reference, and those of one chunk up to the order of dQ's fp32 additions."""
    from fa4 import heuristics

    d, dv = dims
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, dv, torch.bfloat16)
    scale = d ** -0.5
    dout = torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype)
    out, lse = torch.ops.fa4.fwd(q, k, v, scale, False)

    def run(setting):
        monkeypatch.setenv("FA4_BWD_TURN_SPACING", setting)
        poison_allocator()
        got = torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, False, deterministic=True)
        return got, _native.last_launch("bwd")
    spaced, record = run(str(spacing))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = -(-seqlen_k // (128 if d == 64 else 64))
    period = heuristics.bwd_rotate("none", True, False, blocks, sms, tile=(1, 1), spacing=spacing)
    group = heuristics.bwd_launch_group("none", False, True, period, blocks, pairs=batch * heads_kv, num_sms=sms)
    assert (record["rotate"], record["launch_group"]) == (period, group) and period < blocks and group >= 2
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(spaced, run(str(spacing))[0]))
    one_chunk, record = run("1")
    assert (record["rotate"], record["launch_group"]) == (blocks, 0)
    for a, b in zip(spaced, one_chunk):
        assert rel_error(a, b) < 8e-3  # bf16 roundings of dQ may flip
    ref = grads(lambda q, k, v: naive_attention(q, k, v, scale=scale)[0], (q.double(), k.double(), v.double()),
                dout.double())
    for name, g, r in zip("qkv", spaced, ref):
        assert rel_error(g, r) < CEILING, name


# (dims, mask, batch, seqlen_q, seqlen_k, rotate): the hd192 / hd256 kernels ("keys_roles"), the
# staging buffer (192) and the Q/dO stage (256) as dQ's way out, odd lengths, GQA, turns in launch
# order (masks, FA4_BWD_ROTATE=0) and rotated; one case with a single query block per K/V block.
WRITER_CASES = [((192, 192), "none", 2, 1100, 1000, "1"), ((192, 192), "none", 2, 1100, 1000, "0"),
                ((192, 192), "causal", 2, 1100, 1000, "1"), ((192, 192), "local", 1, 700, 1900, "1"),
                ((256, 256), "none", 2, 1100, 1000, "1"), ((256, 256), "causal", 3, 517, 517, "1"),
                ((256, 256), "none", 1, 50, 700, "1")]


@pytest.mark.parametrize("dims,mask,batch,seqlen_q,seqlen_k,rotate", WRITER_CASES,
                         ids=[f"d{c[0][0]}-{c[1]}-{c[3]}x{c[4]}-r{c[5]}" for c in WRITER_CASES])
def test_deterministic_turns_with_two_dq_writers(monkeypatch, dims, mask, batch, seqlen_q, seqlen_k, rotate):
    """FA4_BWD_DQ_WRITERS=2: the hd192 / hd256 kernels' deterministic turns with two dQ writer
    warps taking a CTA's query blocks alternately (sm90/bwd.py write_dq's pair). The turns are the
    same, so the gradients are bitwise those of one writer, run after run."""
    d, dv = dims
    causal, window = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "local": (False, (300, 40))}[mask]
    q, k, v = qkv(batch, seqlen_q, seqlen_k, 8, 2, d, dv, torch.bfloat16)
    scale = d ** -0.5
    dout = torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype)
    monkeypatch.setenv("FA4_BWD_ROTATE", rotate)
    # One rotation for both writer counts (two writers default to 2 chunks: other turns).
    monkeypatch.setenv("FA4_BWD_TURN_SPACING", "1")
    out, lse = torch.ops.fa4.fwd(q, k, v, scale, causal, window[0], window[1])

    def run(writers):
        monkeypatch.setenv("FA4_BWD_DQ_WRITERS", writers)
        poison_allocator()
        got = torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, causal, window_left=window[0],
                                window_right=window[1], deterministic=True)
        return got, _native.last_launch("bwd")["deterministic"]
    one, flag = run("1")
    assert flag == 1
    two, flag = run("2")
    assert flag == 2
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(two, run("2")[0]))
    for name, a, b in zip("qkv", one, two):
        assert torch.equal(a, b), name
    ref = grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window, scale=scale)[0],
                (q.double(), k.double(), v.double()), dout.double())
    for name, g, r in zip("qkv", two, ref):
        assert rel_error(g, r) < CEILING, name


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)], ids=lambda d: f"d{d[0]}")
def test_causal_launch_groups(monkeypatch, dims):
    """Causal calls run the window kernel (catalog.BWD_MASKS) with their CTAs in launch groups of
    (batch, head) pairs (fa4.heuristics.bwd_launch_group): the default groups, the grid's order
    (FA4_BWD_LAUNCH_GROUP=0) and odd group sizes that leave a short last group all give the
    float64 reference's gradients; windows, packed sequences and deterministic calls keep the
    grid's order."""
    d, dv = dims
    q, k, v = qkv(3, 333, 333, 8, 2, d, dv, torch.bfloat16)  # 6 (batch, K/V head) pairs
    scale = d ** -0.5
    dout = torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype)
    out, lse = torch.ops.fa4.fwd(q, k, v, scale, True)
    ref = grads(lambda q, k, v: naive_attention(q, k, v, causal=True, scale=scale)[0],
                (q.double(), k.double(), v.double()), dout.double())

    def run(deterministic=False, window=None):
        poison_allocator()
        if window is None:
            got = torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, True, deterministic=deterministic)
        else:
            got = torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, False, window[0], window[1],
                                    deterministic=deterministic)
        return got, _native.last_launch("bwd")
    for setting, expected in (("", 4), ("0", 0), ("5", 5), ("1", 1)):
        monkeypatch.setenv("FA4_BWD_LAUNCH_GROUP", setting)
        got, record = run()
        assert record["launch_group"] == expected and record["name"].endswith(f"d{d}x{dv}_local"), record
        for name, g, r in zip("qkv", got, ref):
            assert rel_error(g, r) < CEILING, (setting, name)
    monkeypatch.setenv("FA4_BWD_LAUNCH_GROUP", "5")
    assert run(deterministic=True)[1]["launch_group"] == 0
    assert run(window=(100, 0))[1]["launch_group"] == 0


def test_autograd_backward_launch_is_recorded_for_any_thread(monkeypatch):
    """Autograd runs the CUDA backward on a thread of its own, so a probe on the calling thread
    reads that launch with ``last_launch("bwd", any_thread=True)``."""
    q, k, v = qkv(1, 300, 300, 4, 4, 128, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    monkeypatch.setenv("FA4_BWD_LAUNCH_GROUP", "3")  # a value only this call's launch carries
    grads(lambda q, k, v: fa4.attention(q, k, v, causal=True), (q, k, v), dout)
    record = _native.last_launch("bwd", any_thread=True)
    assert record["launch_group"] == 3 and record["name"].endswith("d128x128_local"), record


# The backward's 2-CTA cluster kernels (catalog.BWD_TILE_FAMILIES: hd256, the window kernel that
# serves causal calls): K/V block counts (64 keys) odd and even, so the last cluster's second CTA
# may lie past the keys; seqlen_q != seqlen_k both ways, so a causal pair's query ranges differ;
# GQA groups looped in the CTA.
CLUSTER_SHAPES = [(2, 300, 300, 3, 3), (1, 333, 200, 6, 2), (2, 200, 333, 4, 2), (1, 1000, 1000, 2, 1),
                  (1, 129, 700, 8, 1)]
CLUSTER_MASKS = [m for m in MASKS if m[0] != "none"]  # no mask: no cluster kernel (measured slower)


def bwd_call(q, k, v, dout, causal=False, window=(-1, -1), deterministic=False):
    """(gradients, launch record) of fa4's backward op run on this thread (autograd runs CUDA
    backwards on a thread of its own, whose launch records this thread does not see)."""
    scale = q.shape[-1] ** -0.5
    out, lse = torch.ops.fa4.fwd(q, k, v, scale, causal, window[0], window[1])
    got = torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, causal, window[0], window[1], 0.0, deterministic)
    return got, _native.last_launch("bwd")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", CLUSTER_MASKS, ids=[m[0] for m in CLUSTER_MASKS])
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cluster_kernels_match_float64(monkeypatch, dtype, mask, shape):
    """FA4_BWD_CLUSTERS=1 forces them wherever built (windows too): the float64 reference's
    gradients, every output poisoned first."""
    monkeypatch.setenv("FA4_BWD_CLUSTERS", "1")
    b, sq, sk, hq, hk = shape
    _, causal, window = mask
    q, k, v = qkv(b, sq, sk, hq, hk, 256, 256, dtype)
    check_grads(q, k, v, causal=causal, window=window, label=f"clusters {mask[0]} {shape}")
    record = bwd_call(q, k, v, torch.randn_like(q), causal, window)[1]
    assert record["name"].endswith("_local_longseq") and record["active_clusters"] > 0, record


def test_cluster_kernels_fall_back_where_the_device_does_not_fit_them(monkeypatch):
    """The device's answer (cudaOccupancyMaxActiveClusters) lets them run on an idle H100/H200;
    where it holds none, or too few to keep the SMs busy (fa4.heuristics.clusters_fit), the same
    call runs the 1-CTA twin, with the same gradients up to the order of dQ's fp32 additions."""
    from fa4 import heuristics

    monkeypatch.setenv("FA4_BWD_CLUSTERS", "1")
    q, k, v = qkv(2, 700, 500, 4, 2, 256, 256, torch.bfloat16)
    dout = torch.randn_like(q)

    def run():
        poison_allocator()
        return bwd_call(q, k, v, dout, causal=True)
    clustered, record = run()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert record["name"].endswith("_longseq"), record
    assert heuristics.clusters_fit(record["active_clusters"], 2, sms), record
    print(f"{torch.cuda.get_device_name()}: {record['active_clusters']} clusters of 2 at once, {sms} SMs")
    for pretended in (0, sms // 2 - 5):
        _native.pretend_active_clusters(pretended)
        try:
            got, record = run()
        finally:
            _native.pretend_active_clusters(-1)
        assert record["name"].endswith("d256x256_local") and record["active_clusters"] == pretended, record
        for a, b in zip(got, clustered):
            assert rel_error(a, b) < 8e-3
    assert run()[1]["name"].endswith("_longseq")  # the device's own answer again


def test_cluster_kernels_under_repeated_uneven_calls(monkeypatch):
    """A stress run: causal pairs whose query ranges differ (seqlen_q < seqlen_k, 21 K/V blocks: the
    last cluster's second CTA past the keys), GQA, 30 calls back to back on poisoned memory, each
    equal to the 1-CTA kernel's gradients up to the order of dQ's fp32 additions (a CTA that ran
    ahead of its peer's barriers would show as a hang, NaN or a wrong tile)."""
    q, k, v = qkv(2, 1000, 1300, 6, 2, 256, 256, torch.bfloat16)
    dout = torch.randn_like(q)
    monkeypatch.setenv("FA4_BWD_CLUSTERS", "0")
    want = bwd_call(q, k, v, dout, causal=True)[0]
    monkeypatch.setenv("FA4_BWD_CLUSTERS", "1")
    for _ in range(30):
        poison_allocator(64 << 20)
        got, record = bwd_call(q, k, v, dout, causal=True)
        assert record["name"].endswith("_longseq")
        for a, b in zip(got, want):
            assert rel_error(a, b) < 8e-3


CAPTURED_FIRST = textwrap.dedent('''
    import os, torch
    from fa4 import _native
    from fa4.testing import rel_error
    os.environ["FA4_BWD_CLUSTERS"] = "1"
    q, k, v, dout = (torch.randn(2, 700, 4, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 256 ** -0.5
    out, lse = torch.ops.fa4.fwd(q, k, v, scale, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the process's first clustered launch: asked inside the capture
        captured = torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, True)
    record = _native.last_launch("bwd")
    graph.replay()
    eager = torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, True)
    torch.cuda.synchronize()
    assert max(rel_error(a, b) for a, b in zip(captured, eager)) < 8e-3
    print(record["name"], record["active_clusters"])
''')


def test_cluster_kernels_captured_in_a_cuda_graph_first():
    """A process whose first clustered backward is captured in a CUDA graph asks the device about
    its clusters inside the capture (a refused query would capture the 1-CTA twin, and ask again
    at the next launch): the replay equals an eager call up to the order of dQ's additions."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", CAPTURED_FIRST], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, active = proc.stdout.split()[-2:]
    print(f"captured first: {name}, {active} clusters at once")
    assert name.endswith("_local_longseq") and int(active) > 0, proc.stdout


def test_cluster_kernels_only_where_forced(monkeypatch):
    """Unforced, hd256 causal calls at 8192 keys run the 1-CTA window kernel (the clusters lost 13%
    on an H100: csrc_shims/fa4_rules.c); FA4_BWD_CLUSTERS=1 runs the clustered twin, except for
    deterministic calls."""
    monkeypatch.delenv("FA4_BWD_CLUSTERS", raising=False)
    q, k, v = qkv(1, 128, 8192, 2, 1, 256, 256, torch.bfloat16)
    scale = 256 ** -0.5
    out, lse = torch.ops.fa4.fwd(q, k, v, scale, True)
    dout = torch.randn_like(out)

    def name(causal=True, window=(-1, -1), deterministic=False):  # (the LSE is the causal call's)
        torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, causal, window[0], window[1], 0.0, deterministic)
        return _native.last_launch("bwd")["name"]
    assert name().endswith("d256x256_local")
    assert name(causal=False).endswith("d256x256_none")
    monkeypatch.setenv("FA4_BWD_CLUSTERS", "1")
    assert name().endswith("d256x256_local_longseq")
    assert name(deterministic=True).endswith("d256x256_local")
    monkeypatch.setenv("FA4_BWD_CLUSTERS", "0")
    assert name().endswith("d256x256_local")


def test_deterministic_mode_varlen_and_global_switch():
    cu = torch.tensor([0, 1, 300, 301, 900, 1400], dtype=torch.int32, device="cuda")
    q = torch.randn(1400, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1400, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)

    def run():
        return grads(lambda q, k, v: fa4.attention_varlen(q, k, v, cu, cu, 600, 600, causal=True), (q, k, v), dout)
    torch.use_deterministic_algorithms(True)
    try:
        first = run()
        for _ in range(9):
            assert all(torch.equal(a, b) for a, b in zip(first, run()))
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)], ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
def test_first_store_equals_adding_to_zeros(monkeypatch, dims, mask):
    """Dense calls let each query block's first K/V block store its dQ part instead of adding it
    to a zeroed accumulator (FA4_BWD_STORE_FIRST): in deterministic mode (turn 0 stores, the same
    order of additions after it) the gradients are bitwise those of zero-and-add; in the default
    mode (first by claim, query blocks rotated without a mask) equal up to the order of dQ's fp32
    additions. Rows that see no key (seqlen_q > seqlen_k, causal) are zero; allocations poisoned."""
    d, dv = dims
    _, causal, window = mask
    q, k, v = qkv(2, 333, 200, 6, 2, d, dv, torch.bfloat16)
    dout = torch.randn(q.shape[:-1] + (dv,), device="cuda", dtype=q.dtype)

    zeroed = check_first_store_equals_zeroed(
        monkeypatch, lambda q, k, v, deterministic: fa4.attention(q, k, v, causal=causal, window=window,
                                                                  deterministic=deterministic), (q, k, v), dout)
    if causal:
        assert torch.all(zeroed[0][:, :133] == 0)


def test_backward_replays_in_a_cuda_graph_bitwise():
    q, k, v = qkv(2, 700, 700, 8, 2, 128, 128, torch.bfloat16)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)

    def step():
        out = fa4.attention(q, k, v, causal=True, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        for x, new in zip((q, k, v, dout), qkv(2, 700, 700, 8, 2, 128, 128, torch.bfloat16) + (torch.randn_like(q),)):
            x.data.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        expected = step()
        for got, want in zip(captured, expected):
            assert torch.equal(got, want)
    del eager


class TransformerBlock(torch.nn.Module):
    """RMSNorm, QKV projection, rotary embedding, fa4 attention with GQA, MLP (pre-norm residuals)."""

    def __init__(self, dim=512, heads=8, kv_heads=2, head_dim=64):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, head_dim
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = torch.nn.Linear(heads * head_dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def rotary(self, x):
        s, half = x.shape[1], self.hd // 2
        freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angles = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * freqs
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1)
        q = self.rotary(q.view(b, s, self.heads, self.hd))
        k = self.rotary(k.view(b, s, self.kv_heads, self.hd))
        attn = fa4.attention(q, k, v.view(b, s, self.kv_heads, self.hd), causal=True)
        x = x + self.proj(attn.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def train(model, steps, data, step_fn=None):
    """SGD steps on fp32 weights with the model run under bf16 autocast (fa4 sees bf16)."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    losses = []
    for x, y in data[:steps]:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            out = (model if step_fn is None else step_fn)(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_compiled_training_step_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    # A learnable target (a fixed random linear map of the input), one batch: the loss falls
    # (by ~0.06 of ~2.0 in five steps at this rate, seen on the CPU path).
    target = torch.randn(512, 512, device="cuda") / 512 ** 0.5
    x = torch.randn(2, 333, 512, device="cuda")
    data = [(x, x @ target)] * 5
    eager = TransformerBlock().cuda()
    compiled = TransformerBlock().cuda()
    compiled.load_state_dict(eager.state_dict())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(compiled)(data[0][0])
    assert explanation.graph_break_count == 0
    step = torch.compile(compiled, fullgraph=True)
    got = train(compiled, 5, data, step)
    want = train(eager, 5, data)
    assert got[-1] < got[0] - 0.02, got  # it trains
    for a, b in zip(got, want):
        assert abs(a - b) <= 2e-2 * abs(b), (got, want)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert rel_error(p.float(), q.float()) < 2e-2, name


def test_training_step_replays_in_a_cuda_graph():
    torch.manual_seed(0)
    model = TransformerBlock().cuda()
    reference = TransformerBlock().cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 256, 512, device="cuda")
    y = torch.randn(2, 256, 512, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # as train()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # as train() runs it
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (allocates .grad) outside the capture
        opt.zero_grad(set_to_none=False)
        step()
    torch.cuda.current_stream().wait_stream(stream)
    model.load_state_dict(reference.state_dict())
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        loss = step()
    model.load_state_dict(reference.state_dict())
    want = train(reference, 3, [(x, y)] * 3)
    got = []
    for _ in range(3):
        for p in model.parameters():
            p.grad.zero_()
        graph.replay()
        got.append(loss.item())
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-2 * abs(b), (got, want)
