"""The CPU implementation (chunked, fp32 accumulation) against the naive float64 oracle."""
import pytest
import torch

import fa4
from fa4 import settings
from fa4.testing import lse_error, naive_attention, rel_error

CASES = [
    # (b, sq, sk, hq, hk, d, dv)
    (1, 1, 1, 1, 1, 16, 16),
    (2, 17, 17, 4, 4, 64, 64),
    (1, 33, 129, 8, 2, 32, 48),
    (2, 129, 33, 4, 1, 64, 64),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (8, 3)), (True, (5, -1))])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_cpu_matches_fp64(case, causal, window, softcap):
    b, sq, sk, hq, hk, d, dv = case
    q = torch.randn(b, sq, hq, d)
    k = torch.randn(b, sk, hk, d)
    v = torch.randn(b, sk, hk, dv)
    out, lse = fa4.attention(q, k, v, causal=causal, window=window, softcap=softcap, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal, window=window, softcap=softcap)
    assert rel_error(out, ref_out) < 1e-5
    assert lse_error(lse, ref_lse) < 1e-4


def test_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    out, lse = fa4.attention(q, k, v, causal=True, return_lse=True)  # rows 0..4 see nothing
    assert torch.all(out[:, :5] == 0) and torch.all(torch.isinf(lse[..., :5]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., 5:]).all()


def test_chunking_does_not_change_results(monkeypatch):
    q, k, v = torch.randn(2, 70, 4, 32), torch.randn(2, 90, 2, 32), torch.randn(2, 90, 2, 32)
    full = fa4.attention(q, k, v, causal=True)
    monkeypatch.setattr(settings, "reference_chunk_bytes", lambda: 1)  # one row per chunk
    assert torch.allclose(fa4.attention(q, k, v, causal=True), full, atol=1e-6)


def test_non_contiguous_bhsd_views_match_contiguous():
    qh, kh, vh = (torch.randn(2, 4, 37, 32) for _ in range(3))
    out = fa4.attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), causal=True)
    ref = fa4.attention(*(t.transpose(1, 2).contiguous() for t in (qh, kh, vh)), causal=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_accumulate_in_fp32(dtype):
    q, k, v = (torch.randn(1, 65, 2, 64, dtype=dtype) for _ in range(3))
    out = fa4.attention(q, k, v)
    ref, _ = naive_attention(q, k, v)
    assert out.dtype == dtype and rel_error(out, ref) < 1e-2


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (6, 2), 3.0)])
def test_backward_matches_fp64_autograd(causal, window, softcap):
    q = torch.randn(2, 23, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 31, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 31, 2, 24, dtype=torch.float64, requires_grad=True)
    out, lse = fa4.attention(q, k, v, causal=causal, window=window, softcap=softcap, return_lse=True)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    finite = torch.isfinite(lse)
    grads = torch.autograd.grad((out * g_out).sum() + (lse.where(finite, 0) * g_lse).sum(), (q, k, v))
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal, window=window, softcap=softcap)
    ref = torch.autograd.grad((ref_out * g_out).sum() + (ref_lse.where(finite, 0) * g_lse).sum(), (q, k, v))
    for got, want in zip(grads, ref):
        assert rel_error(got, want) < 1e-5  # LSE is stored in fp32, as in FlashAttention
