"""FlashAttention 2/3 signatures on the CUDA kernels: the same calls as fa4.attention give the
same tensors, forward and backward."""
import pytest
import torch

import fa4
from fa4 import flash_attn_interface as fa3

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 20))])
def test_signatures_match_attention_on_cuda(causal, window):
    q = torch.randn(2, 333, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 301, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    want, lse = fa4.attention(q, k, v, causal=causal, window=window, return_lse=True, deterministic=True)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    out2, lse2, _ = fa4.flash_attn_func(q, k, v, 0.0, None, causal, window, deterministic=True,
                                        return_attn_probs=True)
    out3, lse3 = fa3.flash_attn_func(q, k, v, None, causal, window_size=window, deterministic=True,
                                     return_attn_probs=True)
    for out in (out2, out3):
        assert torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), grads))
    assert torch.equal(lse2, lse) and torch.equal(lse3, lse)


def test_varlen_signatures_match_on_cuda():
    cu = torch.tensor([0, 100, 100, 357], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(357, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    want = fa4.attention_varlen(q, k, v, cu, cu, 257, 257, causal=True)
    assert torch.equal(fa4.flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, causal=True), want)
    assert torch.equal(fa3.flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, causal=True), want)
