"""fa4.attention_varlen on Hopper: packed documents against per-document float64 references."""
import math

import pytest
import torch

import fa4
from fa4 import _native
from fa4.testing import lse_error, naive_attention, rel_error

from ..conftest import requires_hopper
from .test_fwd_gpu import poison_allocator, sdpa_math_error

pytestmark = [pytest.mark.gpu, requires_hopper]


def random_documents(n_docs, max_len, allow_empty=True, generator=None):
    lengths = torch.randint(0 if allow_empty else 1, max_len + 1, (n_docs,), generator=generator).tolist()
    if n_docs > 2:
        lengths[0], lengths[1] = 1, 0 if allow_empty else 1  # always a length-1 and an empty one
    return lengths


def offsets(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")


def check_varlen(lengths_q, lengths_k, hq, hk, d, dv, seqused=None, dtype=torch.bfloat16, pack_gqa=None, **kw):
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(int(cu_k[-1]), hk, d, device="cuda", dtype=dtype)
    v = torch.randn(int(cu_k[-1]), hk, dv, device="cuda", dtype=dtype)
    used = None if seqused is None else torch.tensor(seqused, dtype=torch.int32, device="cuda")
    poison_allocator()
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), seqused_k=used,
                                    return_lse=True, pack_gqa=pack_gqa, **kw)
    torch.cuda.synchronize()
    refs, ref_lses, errs_sdpa, weights = [], [], [], []
    for i in range(len(lengths_q)):
        a, b, c, e = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if used is not None:
            e = c + min(int(used[i]), e - c)
        if b == a:
            continue
        qs, ks, vs = q[a:b][None], k[c:e][None], v[c:e][None]
        ro, rl = naive_attention(qs, ks, vs, **kw)
        refs.append(ro[0])
        ref_lses.append(rl[0])
        if e > c:
            scale = kw.get("scale") or 1 / math.sqrt(d)
            errs_sdpa.append(sdpa_math_error(qs, ks, vs, ro, kw.get("causal", False), kw.get("window", (-1, -1)),
                                             kw.get("softcap", 0.0), scale))
            weights.append(ro.norm().item())
    ref = torch.cat(refs)
    err = rel_error(out, ref)
    base = max(errs_sdpa) if errs_sdpa else 0.0
    assert err <= 2 * base + 1e-4, f"fa4 varlen error {err:.3e} vs SDPA-math {base:.3e}"
    assert lse_error(lse, torch.cat(ref_lses, dim=1)) < 1e-3


@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (30, 5)}])
@pytest.mark.parametrize("heads", [(8, 2), (16, 1)])
def test_documents_pack_gqa(pack_gqa, kw, heads):
    gen = torch.Generator().manual_seed(7)
    lengths = random_documents(9, 300, generator=gen)
    check_varlen(lengths, lengths, heads[0], heads[1], 128, 128, pack_gqa=pack_gqa, **kw)


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (30, 5)}])
@pytest.mark.parametrize("heads, d", [((32, 1), 128), ((32, 2), 64)])
def test_documents_pack_part_of_a_large_group(kw, heads, d):
    """Short documents with more query heads per K/V head than a tile stacks: the automatic
    choice packs the largest power-of-two part that does (16 of hd128's 128 rows, 8 of hd64's
    192), and those tiles of one K/V head read its documents' K/V."""
    gen = torch.Generator().manual_seed(11)
    lengths = random_documents(7, 40, generator=gen)
    check_varlen(lengths, lengths, heads[0], heads[1], d, d, **kw)
    assert _native.last_launch("fwd")["pack_gqa"] == (16 if d == 128 else 8)


# 32 and 33 documents: the kernel's tile decode looks at 32 sequences per round (a warp's lanes);
# up to 128 the kernel orders them itself, 129 the host (tile_scheduler.SEQ_ORDER_IN_KERNEL).
@pytest.mark.parametrize("n_docs", [1, 2, 7, 20, 32, 33, 128, 129])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (100, 20)}, {"softcap": 15.0, "causal": True}])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)])
def test_documents(n_docs, kw, heads):
    gen = torch.Generator().manual_seed(n_docs * 7 + len(kw))
    lengths = random_documents(n_docs, 700, generator=gen)
    check_varlen(lengths, lengths, heads[0], heads[1], 128, 128, **kw)


@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(dims, causal):
    gen = torch.Generator().manual_seed(sum(dims))
    lq = random_documents(9, 400, generator=gen)
    lk = random_documents(9, 500, generator=gen)
    check_varlen(lq, lk, 4, 2, dims[0], dims[1], causal=causal, dtype=torch.float16)


def test_seqused_k_and_rectangular():
    lq, lk = [5, 300, 1, 129], [40, 280, 300, 129]
    check_varlen(lq, lk, 4, 4, 128, 128, seqused=[10, 280, 0, 100], causal=True)


def test_large_document_count_and_one_long_document():
    lengths = [1] * 50 + [3000] + [17] * 30
    check_varlen(lengths, lengths, 4, 1, 128, 128, causal=True)


def test_matches_dense_when_all_documents_are_equal():
    b, s, h, d = 3, 555, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = offsets([s] * b)
    dense = fa4.attention(q, k, v, causal=True)
    packed = fa4.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s, causal=True)
    assert torch.equal(packed.view(b, s, h, d), dense)


def test_backward_runs():
    lengths = [3, 70, 0, 33]
    cu = offsets(lengths)
    q, k, v = (torch.randn(int(cu[-1]), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = fa4.attention_varlen(q, k, v, cu, cu, 70, 70, causal=True)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_cuda_graph_with_new_offsets():
    q, k, v = (torch.randn(1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = offsets([100, 400, 500])
    fa4.attention_varlen(q, k, v, cu, cu, 500, 500, causal=True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fa4.attention_varlen(q, k, v, cu, cu, 500, 500, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    cu.copy_(offsets([600, 1, 399]))  # new document boundaries, same graph
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fa4.attention_varlen(q, k, v, cu, cu, 600, 600, causal=True))


