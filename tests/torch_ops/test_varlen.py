"""fa4.attention_varlen on the CPU path: reference semantics, ops, errors."""
import pytest
import torch

import fa4
from fa4.testing import lse_error, naive_attention, rel_error


def packed(lengths_q, lengths_k, hq=4, hk=2, d=16, dv=16, dtype=torch.float32, device="cpu"):
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=dtype, device=device)
    k = torch.randn(int(cu_k[-1]), hk, d, dtype=dtype, device=device)
    v = torch.randn(int(cu_k[-1]), hk, dv, dtype=dtype, device=device)
    return q, k, v, cu_q, cu_k


def per_sequence_reference(q, k, v, cu_q, cu_k, seqused_k=None, **kw):
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if seqused_k is not None:
            d = c + min(int(seqused_k[i]), d - c)
        o, l = naive_attention(q[a:b][None], k[c:d][None], v[c:d][None], **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (5, 2)}, {"softcap": 3.0, "causal": True}])
def test_matches_per_sequence_reference(kw):
    lengths_q, lengths_k = [5, 0, 1, 17, 9], [3, 4, 0, 20, 9]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dv=24)
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, 17, 20, return_lse=True, **kw)
    ref_out, ref_lse = per_sequence_reference(q, k, v, cu_q, cu_k, **kw)
    assert out.shape == (q.shape[0], 4, 24) and lse.shape == (4, q.shape[0])
    assert rel_error(out, ref_out) < 1e-5 and lse_error(lse, ref_lse) < 1e-4


def test_seqused_k():
    q, k, v, cu_q, cu_k = packed([4, 6], [10, 10])
    used = torch.tensor([3, 10], dtype=torch.int32)
    out = fa4.attention_varlen(q, k, v, cu_q, cu_k, 6, 10, seqused_k=used)
    ref, _ = per_sequence_reference(q, k, v, cu_q, cu_k, seqused_k=used)
    assert rel_error(out, ref) < 1e-5


def test_backward_matches_reference():
    q, k, v, cu_q, cu_k = packed([3, 7, 1], [4, 7, 2], dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_()
    out = fa4.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref, _ = per_sequence_reference(q, k, v, cu_q, cu_k, causal=True)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, want):
        assert rel_error(a, b) < 1e-5


def test_opcheck_and_fake():
    q, k, v, cu_q, cu_k = packed([3, 7], [4, 7])
    torch.library.opcheck(torch.ops.fa4.fwd_varlen.default, (q, k, v, cu_q, cu_k, None, 7, 7, 0.25), {"causal": True})
    out, lse = torch.ops.fa4.fwd_varlen(q, k, v, cu_q, cu_k, None, 7, 7, 0.25)
    torch.library.opcheck(torch.ops.fa4.bwd_varlen.default,
                          (torch.randn_like(out), q, k, v, out, lse, None, cu_q, cu_k, None, 7, 7, 0.25))


def test_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = packed([3, 7, 2], [3, 7, 2])
    f = torch.compile(lambda q, k, v: fa4.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True), fullgraph=True,
                      backend="aot_eager")
    assert torch.allclose(f(q, k, v), fa4.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True))


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda a: dict(a, q=a["q"][None]), ValueError, "q must be a 3-D tensor"),
        (lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q must be a 1-D torch.int32"),
        (lambda a: dict(a, cu_seqlens_k=a["cu_seqlens_k"][:2]), ValueError, "num_sequences \\+ 1"),
        (lambda a: dict(a, max_seqlen_q=torch.tensor(3)), ValueError, "max_seqlen_q must be a Python int"),
        (lambda a: dict(a, cu_seqlens_q=torch.tensor([0, 5, 4, 12], dtype=torch.int32)), ValueError, "non-decreasing"),
        (lambda a: dict(a, cu_seqlens_q=torch.tensor([0, 3, 10, 11], dtype=torch.int32)), ValueError, "end at 12"),
        (lambda a: dict(a, seqused_k=torch.tensor([1], dtype=torch.int32)), ValueError, "one count per sequence"),
    ],
)
def test_bad_inputs(mutate, error, match):
    q, k, v, cu_q, cu_k = packed([3, 7, 2], [3, 7, 2])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=7)
    with pytest.raises(error, match=match):
        fa4.attention_varlen(**mutate(args))
