"""fa4.sdpa on CUDA: F.scaled_dot_product_attention's flash backend and varlen_attn run fa4's
kernels (the profiler's kernel names say so) and give fa4.attention's results."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4
import fa4.sdpa

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper,
              pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"),
                                 reason="torch < 2.10 has no flash-attention provider registry")]


@pytest.fixture
def active():
    fa4.sdpa.activate()
    yield
    fa4.sdpa.deactivate()


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("causal, gqa", [(False, False), (True, False), (True, True)])
def test_sdpa_flash_backend_runs_fa4(active, causal, gqa):
    hk = 2 if gqa else 8
    q = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, hk, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)

    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.1, enable_gqa=gqa)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    names = kernel_names(step)
    assert any("fa4_kernelssm90fwd" in n for n in names), names
    assert any("fa4_kernelssm90bwd" in n for n in names), names
    out, grads = step()
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    want = fa4.attention(t(q), t(k), t(v), causal=causal, scale=0.1)
    want_grads = torch.autograd.grad(want, (q, k, v), t(dout))
    assert torch.equal(out, t(want))
    for got, ref in zip(grads, want_grads):
        assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()  # dQ additions may land in another order


@pytest.mark.skipif(not hasattr(torch.nn.attention, "varlen"), reason="no torch.nn.attention.varlen")
def test_varlen_attn_runs_fa4(active):
    from torch.nn.attention.varlen import varlen_attn

    import inspect

    # causal: is_causal in some torch versions, a (-1, 0) window in others
    causal = {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {
        "window_size": (-1, 0)}
    cu = torch.tensor([0, 100, 357], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(357, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    names = kernel_names(lambda: varlen_attn(q, k, v, cu, cu, 257, 257, **causal))
    assert any("fa4_kernelssm90fwd" in n for n in names), names
    assert torch.equal(varlen_attn(q, k, v, cu, cu, 257, 257, **causal),
                       fa4.attention_varlen(q, k, v, cu, cu, 257, 257, causal=True))


def test_deactivate_restores_pytorch_kernels(active):
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    fa4.sdpa.deactivate()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        names = kernel_names(lambda: F.scaled_dot_product_attention(q, q, q))
    assert not any("fa4_kernels" in n for n in names)
    fa4.sdpa.activate()  # for the fixture's deactivate
