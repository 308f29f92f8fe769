"""FlashAttention 2/3 signatures (fa4.compat, fa4.flash_attn_interface) against fa4.attention:
the same calls through both give the same tensors (CPU here; tests/gpu/test_compat_gpu.py on
CUDA)."""
import pytest
import torch

import fa4
from fa4 import flash_attn_interface as fa3

CASES = [  # (heads_q, heads_kv, causal, window, softcap)
    (4, 4, False, (-1, -1), 0.0),
    (4, 2, True, (-1, -1), 0.0),
    (4, 1, False, (5, 3), 0.0),
    (2, 2, True, (-1, -1), 10.0),
]


def qkv(b, sq, sk, hq, hk, d=32, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    make = lambda s, h: torch.randn(b, s, h, d, generator=g).to(device, dtype)  # noqa: E731
    return make(sq, hq), make(sk, hk), make(sk, hk)


@pytest.mark.parametrize("hq, hk, causal, window, softcap", CASES)
def test_dense_signatures_match_attention(hq, hk, causal, window, softcap):
    q, k, v = qkv(2, 13, 17, hq, hk)
    want, lse = fa4.attention(q, k, v, causal=causal, scale=0.3, window=window, softcap=softcap, return_lse=True)
    # FlashAttention-2: dropout_p is the fourth positional argument.
    out2 = fa4.flash_attn_func(q, k, v, 0.0, 0.3, causal, window, softcap)
    out2b, lse2, probs = fa4.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, window_size=window,
                                             softcap=softcap, return_attn_probs=True)
    # FlashAttention-3: softmax_scale is.
    out3 = fa3.flash_attn_func(q, k, v, 0.3, causal, window_size=window, softcap=softcap)
    out3b, lse3 = fa3.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, window_size=window, softcap=softcap,
                                      num_splits=0, pack_gqa=hq != hk, return_attn_probs=True)
    for out in (out2, out2b, out3, out3b):
        assert torch.equal(out, want)
    assert torch.equal(lse2, lse) and torch.equal(lse3, lse) and probs is None


def test_varlen_signatures_match_attention_varlen():
    lengths = [5, 0, 11, 3]
    cu = torch.tensor([0, 5, 5, 16, 19], dtype=torch.int32)
    q, k, v = (t[0] for t in qkv(1, 19, 19, 4, 2))
    used = torch.tensor([4, 0, 11, 2], dtype=torch.int32)
    want, lse = fa4.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_lse=True)
    out2, lse2, _ = fa4.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, 0.0, None, True, return_attn_probs=True)
    out3, lse3 = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True, return_attn_probs=True)
    assert torch.equal(out2, want) and torch.equal(out3, want) and torch.equal(lse2, lse) and torch.equal(lse3, lse)
    used_want = fa4.attention_varlen(q, k, v, cu, cu, 11, 11, seqused_k=used)
    assert torch.equal(fa3.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, seqused_k=used), used_want)
    # max_seqlen as a 0-d tensor, as some callers pass it
    assert torch.equal(fa4.flash_attn_varlen_func(q, k, v, cu, cu, torch.tensor(11), torch.tensor(11),
                                                  causal=True), want)


def test_gradients_match_attention():
    q, k, v = (t.requires_grad_() for t in qkv(1, 9, 9, 2, 1))
    dout = torch.randn(1, 9, 2, 32)
    want = torch.autograd.grad(fa4.attention(q, k, v, causal=True), (q, k, v), dout)
    for fn in (fa4.flash_attn_func, fa3.flash_attn_func):
        got = torch.autograd.grad(fn(q, k, v, causal=True), (q, k, v), dout)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("call, match", [
    (lambda q: fa4.flash_attn_func(q, q, q, 0.1), "dropout"),
    (lambda q: fa4.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2)), "ALiBi"),
    (lambda q: fa4.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 4, 4, block_table=torch.zeros(1)),
     "paged KV cache"),
    (lambda q: fa3.flash_attn_func(q, q, q, q_descale=torch.ones(1)), "FP8"),
    (lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=128), "chunked attention"),
    (lambda q: fa3.flash_attn_func(q, q, q, sm_margin=8), "sm_margin"),
    (lambda q: fa3.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 4, 4, seqused_q=torch.ones(1)), "seqused_q"),
])
def test_unsupported_arguments_say_what_to_use(call, match):
    q = torch.randn(1, 4, 2, 32)
    with pytest.raises(NotImplementedError, match=match):
        call(q)
