"""FlashAttention 2/3 signatures (fa4.compat, fa4.flash_attn_interface) against fa4.attention:
the same calls through both give the same tensors (CPU here; tests/gpu/test_compat_gpu.py on
CUDA)."""
import pytest
import torch

import fa4
from fa4 import flash_attn_interface as fa3
from fa4.compat import run_paged_varlen
from fa4.testing import naive_attention

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
    (lambda q: fa3.flash_attn_func(q, q, q, q_descale=torch.ones(1)), "FP8"),
    (lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=128), "chunked attention"),
    (lambda q: fa3.flash_attn_func(q, q, q, sm_margin=8), "sm_margin"),
    (lambda q: fa3.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 4, 4, seqused_q=torch.ones(1)), "seqused_q"),
])
def test_unsupported_arguments_say_what_to_use(call, match):
    q = torch.randn(1, 4, 2, 32)
    with pytest.raises(NotImplementedError, match=match):
        call(q)


def paged(lengths, pages_each, page_size, hkv, d, gen):
    """A paged cache holding len(lengths) sequences (shuffled pages, one spare) and its table."""
    num_pages = len(lengths) * pages_each + 1
    k = torch.randn(num_pages, page_size, hkv, d, dtype=torch.float64, generator=gen)
    table = torch.randperm(num_pages, generator=gen)[:len(lengths) * pages_each].reshape(len(lengths), -1)
    return k, torch.randn_like(k), table.to(torch.int32)


@pytest.mark.parametrize("q_lengths", [[1, 1, 1], [3, 3, 3], [1, 4, 0], [2, 1, 5]])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(3, 0)),
                                     dict(causal=True, softcap=4.0)])
@pytest.mark.parametrize("lengths_from", ["cu_seqlens_k", "seqused_k"])
def test_varlen_with_block_table_matches_each_sequence(q_lengths, options, lengths_from):
    """FlashAttention-2's varlen call on a paged cache (block_table), uniform query counts (q viewed
    without a copy) and mixed ones (each sequence's queries in the bottom rows of a block), against
    a float64 formula per sequence: its queries are the sequence's last tokens."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, page_size = 4, 2, 16, 16
    k_lengths = [9, 23, 40]
    k_cache, v_cache, table = paged(k_lengths, 3, page_size, hkv, d, gen)
    cu_q = torch.tensor([0] + q_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + k_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=torch.float64, generator=gen)
    if lengths_from == "seqused_k":  # FA2's entry point takes cu_seqlens_k; the runner takes either
        left, right = options.get("window_size", (-1, -1))
        out, lse = run_paged_varlen(q, k_cache, v_cache, cu_q, None, max(q_lengths), table, None,
                                    options["causal"], (left, right), options.get("softcap", 0.0),
                                    seqused_k=torch.tensor(k_lengths, dtype=torch.int32))
    else:
        out, lse, _ = fa4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lengths), max(k_lengths),
                                                 block_table=table, return_attn_probs=True, **options)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    for b, (n_q, n_k) in enumerate(zip(q_lengths, k_lengths)):
        rows = torch.arange(n_k)
        at = table[b].long()[rows // page_size], rows % page_size
        window = options.get("window_size", (-1, -1))
        ref, ref_lse = naive_attention(q[None, cu_q[b]:cu_q[b + 1]], k_cache[at][None], v_cache[at][None],
                                       causal=options["causal"], window=window, softcap=options.get("softcap", 0.0))
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], ref[0].nan_to_num(0.0))
        torch.testing.assert_close(lse[:, cu_q[b]:cu_q[b + 1]].double(), ref_lse[0], atol=1e-5, rtol=1e-6)


def test_varlen_with_block_table_rules():
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, table = paged([5, 5], 1, 16, 2, 16, gen)
    q = torch.randn(4, 4, 16, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="must bound every sequence's queries"):
        fa4.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, 1, 5, block_table=table)
    with pytest.raises(ValueError, match="cu_seqlens_q must hold"):
        fa4.flash_attn_varlen_func(q, k_cache, v_cache, cu[:2], cu, 2, 5, block_table=table)
    with pytest.raises(ValueError, match="each sequence's key count"):
        fa4.flash_attn_varlen_func(q, k_cache, v_cache, cu, None, 2, 5, block_table=table)
