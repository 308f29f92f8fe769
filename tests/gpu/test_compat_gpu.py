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


@pytest.mark.parametrize("q_lengths", [[1, 1, 1, 1], [4, 4, 4, 4], [1, 7, 0, 130]])
def test_varlen_with_block_table_on_cuda(q_lengths):
    """FlashAttention-2's varlen call on a paged cache (the KV-cache kernels) against the same call
    in float64 on the CPU path."""
    from fa4 import _native
    if "fa4_fwd_sm_90a_bf16_d128x128_local_kvcache" not in _native.variant_index():
        pytest.skip("this build lacks the bf16 hd128 KV-cache kernel")
    gen = torch.Generator(device="cuda").manual_seed(7)
    k_lengths, page_size, pages_each = [300, 17, 1000, 640], 64, 16
    k_cache, v_cache = (torch.randn(4 * pages_each + 1, page_size, 2, 128, device="cuda", dtype=torch.bfloat16,
                                    generator=gen) for _ in range(2))
    table = torch.randperm(4 * pages_each + 1, device="cuda", generator=gen)[:4 * pages_each].reshape(4, -1)
    table = table.to(torch.int32)
    cu_q = torch.tensor([0] + q_lengths, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lengths, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse, _ = fa4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lengths), max(k_lengths),
                                             causal=True, block_table=table, return_attn_probs=True)
    cpu = [t.cpu() for t in (q, k_cache, v_cache, cu_q, cu_k, table)]
    want, want_lse, _ = fa4.flash_attn_varlen_func(cpu[0].double(), cpu[1].double(), cpu[2].double(), cpu[3], cpu[4],
                                                   max(q_lengths), max(k_lengths), causal=True, block_table=cpu[5],
                                                   return_attn_probs=True)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu().double(), want_lse.double(), atol=1e-3, rtol=1e-3)
