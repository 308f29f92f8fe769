"""Operator registration, fake impls, opcheck and torch.compile on the CPU path."""
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa4
from fa4.testing import naive_attention


def test_ops_are_registered():
    assert hasattr(torch.ops.fa4, "fwd") and hasattr(torch.ops.fa4, "bwd")
    schema = str(torch.ops.fa4.fwd.default._schema)
    assert "Tensor q, Tensor k, Tensor v, float softmax_scale" in schema and "-> (Tensor out, Tensor lse)" in schema


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128)])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fake_impl_shapes_dtypes_strides(dtype, dims, heads, device):
    d, dv = dims
    hq, hk = heads
    with FakeTensorMode():
        q = torch.empty(3, 7, hq, d, dtype=dtype, device=device)
        k = torch.empty(3, 11, hk, d, dtype=dtype, device=device)
        v = torch.empty(3, 11, hk, dv, dtype=dtype, device=device)
        out, lse = torch.ops.fa4.fwd(q, k, v, 0.1, True)
        dq, dk, dv_ = torch.ops.fa4.bwd(out, q, k, v, out, lse, None, 0.1, True)
    assert out.shape == (3, 7, hq, dv) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (3, hq, 7) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.device.type == device
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)


def test_fake_impl_validates():
    with FakeTensorMode():
        q = torch.empty(1, 4, 3, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="multiple of heads of k/v"):
            torch.ops.fa4.fwd(q, k, k, 0.1)


def _opcheck_args(dtype=torch.float32):
    q = torch.randn(2, 9, 4, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 13, 2, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 13, 2, 8, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_left": 3, "window_right": 2, "softcap": 4.0},
                                    {"causal": True, "pack_gqa": True}])
def test_opcheck_fwd_cpu(kwargs):
    q, k, v = _opcheck_args()
    torch.library.opcheck(torch.ops.fa4.fwd.default, (q, k, v, 0.25), kwargs)


def test_opcheck_bwd_cpu():
    q, k, v = (t.detach() for t in _opcheck_args())
    out, lse = torch.ops.fa4.fwd(q, k, v, 0.25, True)
    torch.library.opcheck(torch.ops.fa4.bwd.default, (torch.randn_like(out), q, k, v, out, lse, None, 0.25, True))
    torch.library.opcheck(torch.ops.fa4.bwd.default, (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), 0.25, True))


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window": (3, 2), "softcap": 2.0},
                                    {"causal": True, "deterministic": True}])
def test_gradcheck_float64_reference(kwargs):
    """The CPU reference backward against finite differences (GQA, seqlen_q != seqlen_k, a row
    that sees no key under the causal mask); the gradient through the returned LSE against
    autograd of the naive float64 attention (the LSE is fp32 by contract: too coarse for
    finite differences)."""
    q = torch.randn(1, 6, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: fa4.attention(q, k, v, **kwargs), (q, k, v), eps=1e-6,
                                    atol=1e-5)
    w = torch.randn(1, 4, 6, dtype=torch.float64)
    mask = {key: value for key, value in kwargs.items() if key != "deterministic"}
    # The LSE does not depend on v: its gradient there is zero (fa4) or absent (the naive one).
    got = torch.autograd.grad(fa4.attention(q, k, v, return_lse=True, **kwargs)[1].nan_to_num(0, 0, 0).mul(w).sum(),
                              (q, k, v))
    want = torch.autograd.grad(naive_attention(q, k, v, **mask)[1].nan_to_num(0, 0, 0).mul(w).sum(), (q, k))
    assert torch.count_nonzero(got[2]) == 0
    for g, r in zip(got, want):
        assert torch.allclose(g, r, atol=1e-5), (g - r).abs().max()


def test_gradcheck_float64_reference_varlen():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(7, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: fa4.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True), (q, k, v), eps=1e-6, atol=1e-5)


class Block(torch.nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        return self.o(fa4.attention(q, k, v, causal=True).reshape(b, s, -1))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_no_graph_break(backend):
    torch._dynamo.reset()
    block = Block()
    x = torch.randn(2, 24, 64)
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out = compiled(x)
    assert torch.allclose(out, eager, atol=1e-5)
    out.sum().backward()  # the backward graph goes through fa4::bwd
    assert block.q.weight.grad is not None
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0


def test_compile_dynamic_shapes_single_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    block = Block()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for s in (8, 13, 21, 100, 300, 777):
        x = torch.randn(1, s, 64)
        assert torch.allclose(compiled(x), block(x), atol=1e-5)
    assert counter.frame_count == 1  # one graph serves every length: nothing specialises on it


def test_runs_without_the_dsl_installed():
    """Run time needs torch and our library only: block every `cutlass` import and use fa4."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('cutlass', 'cuda', 'fa4_kernels'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, fa4\n"
        "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "dt = torch.bfloat16 if dev == 'cuda' else torch.float32\n"
        "q = torch.randn(1, 33, 2, 64, device=dev, dtype=dt)\n"
        "out = fa4.attention(q, q, q, causal=True)\n"
        "assert torch.isfinite(out.float()).all()\n"
        "assert not any(m.split('.')[0] in ('cutlass', 'fa4_kernels') for m in sys.modules)\n"
        "print('ok', dev)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
