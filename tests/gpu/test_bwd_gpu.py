"""The compiled Hopper backward against float64 autograd (skipped without a Hopper GPU).

Gradients come from fa4's forward + backward on fresh random data; the oracle is autograd
through the naive attention in float64, and fa4's error must stay within 2x the error of the
same naive math run in the input dtype (plus a small floor), and under an absolute ceiling. The
caching allocator is poisoned with NaN first, so an unwritten gradient element cannot pass.
"""
import math

import pytest
import torch

import fa4
from fa4 import reference
from fa4.testing import naive_attention, rel_error

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]

BWD_HEAD_DIMS = [(64, 64), (128, 128)]
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
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        vis &= j <= i + sk - sq + right
    if left >= 0:
        vis &= j >= i + sk - sq - left
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
    dq = grads(lambda q, k, v: fa4.attention(q, k, v, causal=True), (q, k, v), torch.ones_like(q))[0]
    assert torch.all(dq[:, :130] == 0)
    q, k, v = qkv(1, 70, 300, 2, 2, d, dv, torch.bfloat16)
    check_grads(q, k, v, window=(0, 0), label="unseen keys")
    _, dk, dv_ = grads(lambda q, k, v: fa4.attention(q, k, v, window=(0, 0)), (q, k, v), torch.randn_like(q))
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


@pytest.mark.parametrize("dims", BWD_HEAD_DIMS, ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("seqused", [False, True], ids=["all_keys", "seqused_k"])
def test_varlen(dims, mask, seqused):
    d, dv = dims
    _, causal, window = mask
    gen = torch.Generator().manual_seed(1)
    # Empty and one-row documents among random ones; keys differ in length from queries.
    cu_q = torch.tensor([0, 0, 1, 150, 151, 500, 777], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 90, 300, 555, 900], dtype=torch.int32)
    hq, hk = 4, 2
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), hk, dv, device="cuda", dtype=torch.bfloat16)
    lens_k = (cu_k[1:] - cu_k[:-1])
    used = (lens_k - torch.randint(0, 40, lens_k.shape, generator=gen)).clamp(min=0).to(torch.int32) if seqused else None
    dout = torch.randn(q.shape[0], hq, dv, device="cuda", dtype=torch.bfloat16)
    poison_allocator()
    cuq, cuk = cu_q.cuda(), cu_k.cuda()
    usedc = used.cuda() if used is not None else None
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int(lens_k.max())
    got = grads(lambda q, k, v: fa4.attention_varlen(q, k, v, cuq, cuk, max_q, max_k, seqused_k=usedc,
                                                     causal=causal, window=window), (q, k, v), dout)
    torch.cuda.synchronize()
    ref = [torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v)]
    for i in range(len(cu_q) - 1):
        rq = slice(int(cu_q[i]), int(cu_q[i + 1]))
        nk = int(lens_k[i]) if used is None else int(used[i])
        rk = slice(int(cu_k[i]), int(cu_k[i]) + nk)
        if rq.stop == rq.start:
            continue
        if nk == 0:
            continue  # no keys: output 0, every gradient 0
        g = grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window)[0],
                  (q[rq][None].double(), k[rk][None].double(), v[rk][None].double()), dout[rq][None].double())
        ref[0][rq], ref[1][rk], ref[2][rk] = g[0][0], g[1][0], g[2][0]
    for name, g, r in zip("qkv", got, ref):
        assert rel_error(g, r) < 1e-2, f"d{name}: {rel_error(g, r):.3e}"


def test_cuda_backward_never_runs_the_reference(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CUDA backward ran the torch reference")

    monkeypatch.setattr(reference, "attention_backward", refuse)
    q, k, v = qkv(1, 130, 130, 2, 2, 128, 128, torch.bfloat16)
    grads(lambda q, k, v: fa4.attention(q, k, v, causal=True), (q, k, v), torch.randn_like(q))


def test_head_dim_without_a_backward_kernel_says_what_to_use():
    q, k, v = qkv(1, 64, 64, 2, 2, 96, 96, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="scaled_dot_product_attention"):
        grads(lambda q, k, v: fa4.attention(q, k, v), (q, k, v), torch.randn_like(q))
