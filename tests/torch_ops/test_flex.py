"""fa4.flex_attention on the CPU path (float64): torch's flex_attention semantics, the masks and
score_mods fa4 maps onto its kernels checked against a dense float64 formula (values and
gradients), the rest falling back to torch's flex_attention with one warning per reason."""
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import fa4
from fa4 import flex, masks, score_mods


def naive_flex(q, k, v, score_mod=None, mask_mod=None, scale=None, gqa=False):
    """softmax(score_mod(q k^T * scale)) v over the keys mask_mod keeps, densely, in q's dtype;
    rows that keep no key give 0 and LSE -inf (FlexAttention's convention)."""
    hq = q.shape[1]
    if gqa:
        k, v = (t.repeat_interleave(hq // t.shape[1], 1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    idx = [torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate(s.shape)]
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand_as(s), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ v, lse


def assert_matches_formula(out, lse, inputs, score_mod, mask_mod, gqa=False, out_tol=1e-10):
    """``out`` and ``lse`` (from inputs q, k, v that need gradients) against naive_flex: values,
    the LSE and the gradients (within fp32 precision: fa4 keeps the LSE in fp32 and its backward
    reads it)."""
    want, want_lse = naive_flex(*inputs, score_mod, mask_mod, gqa=gqa)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=out_tol, rtol=out_tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(want)
    for a, e in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


def inputs(b=2, hq=4, hkv=4, sq=37, sk=37, d=16, dv=16, grad=False):
    make = lambda *shape: torch.randn(*shape, dtype=torch.float64, requires_grad=grad)  # noqa: E731
    return make(b, hq, sq, d), make(b, hkv, sk, d), make(b, hkv, sk, dv)


def no_fallback(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        return fn()


# Windows whose shifted bottom-right form stays >= 0 at both lengths below (seqlen_k - seqlen_q:
# 0 and -12): fa4's kernels run them (a fallback would warn: no_fallback).
FAST_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.sliding_window(15, 2),
    "left only": masks.sliding_window(13, -1),
    "causal and window": masks.and_masks(masks.causal(), masks.sliding_window(14, 3)),
}


@pytest.mark.parametrize("mask", list(FAST_MASKS))
@pytest.mark.parametrize("lengths", [(37, 37), (41, 29)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fa4_masks_and_softcap_match_the_dense_formula(mask, lengths, softcap):
    sq, sk = lengths
    mask_mod = FAST_MASKS[mask]
    score_mod = None if softcap is None else score_mods.softcap(softcap)
    q, k, v = inputs(sq=sq, sk=sk, grad=True)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, sq, sk, device="cpu")
    out, aux = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                      return_aux=AuxRequest(lse=True)))
    assert aux.max_scores is None
    assert_matches_formula(out, aux.lse, (q, k, v), score_mod, mask_mod)


def test_matches_torch_flex_attention_with_gqa_and_scale():
    q, k, v = inputs(hq=8, hkv=2, sq=33, sk=33)
    block_mask = create_block_mask(masks.causal(), None, None, 33, 33, device="cpu")
    got = no_fallback(lambda: fa4.flex_attention(q, k, v, block_mask=block_mask, scale=0.3, enable_gqa=True))
    want = torch_flex(q, k, v, block_mask=block_mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_return_lse_as_torch_returns_it():
    q, k, v = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates return_lse
        out, lse = fa4.flex_attention(q, k, v, return_lse=True)
        want_out, want_lse = torch_flex(q, k, v, return_lse=True)
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)


def _doc_ids(n):
    return torch.tensor([i * 3 // n for i in range(n)])


SPARSE_MASKS = {  # (mask_mod, lengths, the fallback reason's words): no dense or packed kernel
    "split documents": (lambda: masks.document(torch.arange(37) % 3, causal=True), (37, 37), "Document"),
    "document cross ids, causal": (lambda: masks.document(_doc_ids(37), _doc_ids(37).clone(), causal=True),
                                   (37, 37), "Document"),
    "document cross ids, other order": (lambda: masks.document(_doc_ids(37), _doc_ids(37).flip(0)), (37, 37),
                                        "Document"),
    "prefix lm per row": (lambda: masks.prefix_lm(torch.tensor([9, 3])), (37, 37), "PrefixLM"),
    "union": (lambda: masks.or_masks(masks.causal(), masks.sliding_window(0, 4)), (37, 37), "Or"),
    "custom mask": (lambda: (lambda b, h, q, kv: (q - kv) % 3 == 0), (37, 37), "custom mask_mod"),
    "causal, fewer queries": (lambda: masks.causal(), (29, 41), "window"),
}

FALLBACKS = {  # (mask_mod, score_mod, lengths, the warning's words)
    "custom score": (lambda: None, lambda: (lambda s, b, h, q, kv: s * 0.5), (37, 37), "custom score_mod"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_other_score_mods_fall_back_to_torch_once(case, monkeypatch):
    monkeypatch.setattr(flex, "_WARNED", set())
    make_mask, make_score, (sq, sk), words = FALLBACKS[case]
    mask_mod, score_mod = make_mask(), make_score()
    q, k, v = inputs(sq=sq, sk=sk)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, sq, sk, device="cpu")
    with pytest.warns(UserWarning, match=words):
        out = fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    want, _ = naive_flex(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)  # warned once


@pytest.mark.parametrize("case", list(SPARSE_MASKS))
def test_other_masks_run_the_block_sparse_operators(case):
    """Masks without a dense or packed kernel: fa4::fwd_sparse and, through its autograd,
    fa4::bwd_sparse (their CPU implementations here) from the BlockMask's tables, no fallback;
    values, the LSE and gradients against the dense float64 formula; a softcap rides along."""
    make_mask, (sq, sk), _ = SPARSE_MASKS[case]
    mask_mod = make_mask()
    block_mask = create_block_mask(mask_mod, None, None, sq, sk, device="cpu", BLOCK_SIZE=16)
    plan = flex._sparse_plan("reason", None, None, *inputs(sq=sq, sk=sk, grad=True))
    assert not isinstance(plan, str) and plan.sparse
    for score_mod in (None, score_mods.softcap(3.0)):
        q, k, v = inputs(sq=sq, sk=sk, grad=True)
        out, lse = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                          return_lse=True))
        assert_matches_formula(out, lse, (q, k, v), score_mod, mask_mod)


@pytest.mark.parametrize("case", ["union", "prefix lm per row"])
def test_compiled_block_sparse_matches_eager(case):
    """torch.compile(fullgraph=True) over a step through the block-sparse operators: the tables
    (one slot per entry, no host sync) build inside the graph; the results are eager's."""
    make_mask, (sq, sk), _ = SPARSE_MASKS[case]
    block_mask = create_block_mask(make_mask(), None, None, sq, sk, device="cpu", BLOCK_SIZE=16)
    q, k, v = inputs(sq=sq, sk=sk, grad=True)

    def forward(q, k, v):
        return fa4.flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mods.softcap(4.0))

    graphs = []

    def backend(gm, example_inputs):  # records dynamo's graph, then AOTAutograd as aot_eager does
        graphs.append(str(gm.graph))
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(forward, fullgraph=True, backend=backend)(q, k, v)
    assert len(graphs) == 1 and "fa4.fwd_sparse" in graphs[0] and "flex_attention" not in graphs[0]
    want = forward(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    for a, e in zip(torch.autograd.grad(got.square().sum(), (q, k, v)),  # its backward compiled by AOTAutograd
                    torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


def test_window_alignment_maps_onto_the_bottom_right_window():
    # top-left (left, right) = (5, 2) with seqlen_q 41, seqlen_k 29: fa4's window is shifted by
    # seqlen_k - seqlen_q = -12: (5 - 12, 2 + 12): the left side would be negative.
    assert isinstance(flex._fa4_plan(None, _block(masks.sliding_window(5, 2), 41, 29), None, 1, 41, 29), str)
    plan = flex._fa4_plan(None, _block(masks.sliding_window(15, 2), 41, 29), None, 1, 41, 29)
    assert (plan.window, plan.softcap) == ((3, 14), None)
    assert flex._fa4_plan(None, _block(masks.causal(), 41, 29), None, 1, 41, 29).window == (-1, 12)
    assert flex._fa4_plan(score_mods.softcap(2.0), None, None, 1, 8, 8)[:2] == ((-1, -1), 2.0)


def _block(mask_mod, sq, sk):
    return create_block_mask(mask_mod, None, None, sq, sk, device="cpu")


def test_masks_are_plain_mask_mods():
    """torch's create_block_mask and flex_attention take fa4's masks as they are."""
    q, k, v = inputs(sq=40, sk=40)
    mask_mod = masks.and_masks(masks.document(_doc_ids(40)), masks.sliding_window(8, 0))
    out = torch_flex(q, k, v, block_mask=_block(mask_mod, 40, 40))
    torch.testing.assert_close(out, naive_flex(q, k, v, None, mask_mod)[0], atol=1e-10, rtol=1e-10)


def test_bad_arguments_are_refused():
    q, k, v = inputs(hq=4, hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fa4.flex_attention(q, k, v)
    with pytest.raises(ValueError, match=r"made for \(seqlen_q, seqlen_k\) = \(16, 16\)"):
        fa4.flex_attention(q, k, v, block_mask=_block(masks.causal(), 16, 16), enable_gqa=True)
    with pytest.raises(ValueError, match="4-D"):
        fa4.flex_attention(q[0], k, v)
    with pytest.raises(ValueError, match="sliding_window left"):
        masks.sliding_window(-3, 0)
    with pytest.raises(ValueError, match="softcap"):
        score_mods.softcap(0.0)


def test_compiles_without_graph_breaks_and_matches_eager():
    q, k, v = inputs(sq=40, sk=40, grad=True)
    block_mask = _block(masks.and_masks(masks.causal(), masks.sliding_window(9, 0)), 40, 40)

    def step(q, k, v, block_mask):
        return fa4.flex_attention(q, k, v, score_mod=score_mods.softcap(5.0), block_mask=block_mask)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, block_mask)
    want = step(q, k, v, block_mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    g = torch.randn_like(want)
    for a, e in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12)


DOCUMENTS = {  # (ids, causal, other mask parts, score_mod)
    "shared ids, causal": (lambda: torch.tensor([0] * 9 + [1] * 20 + [2] * 3 + [5] * 8), True, (), None),
    "shared ids": (lambda: torch.tensor([0] * 9 + [1] * 20 + [2] * 3 + [5] * 8), False, (), None),
    "per-row ids, window": (lambda: torch.stack([torch.tensor([0] * 30 + [1] * 10), torch.tensor([4] * 40)]), True,
                            (masks.sliding_window(6, 0),), None),
    "one token documents, softcap": (lambda: torch.arange(40) // 2, False, (), score_mods.softcap(4.0)),
}


@pytest.mark.parametrize("case", list(DOCUMENTS))
def test_contiguous_documents_run_packed_and_match_the_dense_formula(case):
    make_ids, causal, rest, score_mod = DOCUMENTS[case]
    doc = masks.document(make_ids(), causal=causal)
    assert doc.packing is not None
    mask_mod = masks.and_masks(doc, *rest)
    q, k, v = inputs(b=2, hq=4, hkv=2, sq=40, sk=40, grad=True)
    block_mask = _block(mask_mod, 40, 40)
    out, lse = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                      enable_gqa=True, return_aux=AuxRequest(lse=True)))
    assert_matches_formula(out, lse.lse, (q, k, v), score_mod, mask_mod, gqa=True)


def test_document_packing_offsets():
    doc = masks.document(torch.tensor([3, 3, 7, 7, 7, 1]))
    assert doc.packing.row_offsets.tolist() == [0, 2, 5, 6]
    assert (doc.packing.longest, doc.packing.longest_bucket) == (3, 4)
    assert doc.packing.offsets(3, 6).tolist() == [0, 2, 5, 6, 8, 11, 12, 14, 17, 18]
    rows = masks.document(torch.tensor([[0, 0, 1], [2, 2, 2]]))
    assert rows.packing.row_offsets.tolist() == [0, 2, 3, 6] and rows.packing.batch_rows == 2
    assert masks.document(torch.tensor([0, 1, 0])).packing is None  # document 0 in two runs


def test_documents_compile_without_graph_breaks():
    q, k, v = inputs(b=2, sq=40, sk=40, grad=True)
    block_mask = _block(masks.document(torch.tensor([0] * 12 + [1] * 28), causal=True), 40, 40)
    step = lambda q, k, v, bm: fa4.flex_attention(q, k, v, block_mask=bm)  # noqa: E731
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, block_mask)
    want = step(q, k, v, block_mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    g = torch.randn_like(want)
    for a, e in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("prefix", [0, 1, 9, 36, 50])
@pytest.mark.parametrize("lengths", [(37, 37), (45, 37)])
def test_prefix_lm_merges_two_calls_exactly(prefix, lengths):
    sq, sk = lengths
    mask_mod = masks.prefix_lm(prefix)
    q, k, v = inputs(sq=sq, sk=sk, grad=True)
    out, aux = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mods.softcap(6.0),
                                                      block_mask=_block(mask_mod, sq, sk),
                                                      return_aux=AuxRequest(lse=True)))
    # merged through the fp32 LSEs: the output within fp32 precision too
    assert_matches_formula(out, aux.lse, (q, k, v), score_mods.softcap(6.0), mask_mod, out_tol=1e-6)


def test_dynamic_compile_serves_every_length():
    """torch.compile(dynamic=True) compiles once over sequence lengths: for a causal BlockMask, and
    for documents whose longest run stays in one power-of-two bucket (the max_seqlen compiled
    graphs pass; a new bucket compiles again)."""
    import torch._dynamo.testing

    def forward(q, k, v, block_mask):
        return fa4.flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mods.softcap(5.0))

    for name, make_mask in (("causal", lambda n: masks.causal()),
                            ("document", lambda n: masks.document(torch.repeat_interleave(
                                torch.arange(3), torch.tensor([n - 2 * (n // 5), n // 5, n // 5])), causal=True))):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(forward, dynamic=True, fullgraph=True, backend=counter)
        for n in (300, 333, 401, 420):  # the longest document: 180-252 tokens, the 256 bucket
            q, k, v = inputs(b=1, hq=2, hkv=2, sq=n, sk=n)
            block_mask = _block(make_mask(n), n, n)
            torch.testing.assert_close(compiled(q, k, v, block_mask), forward(q, k, v, block_mask),
                                       atol=1e-12, rtol=1e-12)
        assert counter.frame_count == 1, name


@pytest.mark.parametrize("block_size", [64, 128, (128, 64)])
def test_block_sizes_do_not_change_results(block_size):
    """fa4 reads the mask_mod, not the block data: any BlockMask block size gives the same result."""
    q, k, v = inputs(sq=300, sk=300)
    mask_mod = masks.and_masks(masks.document(torch.repeat_interleave(torch.arange(3), torch.tensor([100, 17, 183])),
                                              causal=True), masks.sliding_window(50, 0))
    block_mask = create_block_mask(mask_mod, None, None, 300, 300, device="cpu", BLOCK_SIZE=block_size)
    got = no_fallback(lambda: fa4.flex_attention(q, k, v, block_mask=block_mask))
    torch.testing.assert_close(got, naive_flex(q, k, v, None, mask_mod)[0], atol=1e-10, rtol=1e-10)


def test_documents_match_attention_varlen():
    lengths = [40, 1, 77, 12]
    q, k, v = inputs(b=1, sq=130, sk=130)
    block_mask = _block(masks.document(torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)), causal=True),
                        130, 130)
    got = no_fallback(lambda: fa4.flex_attention(q, k, v, block_mask=block_mask))
    cu = torch.tensor([0, 40, 41, 118, 130], dtype=torch.int32)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    want = fa4.attention_varlen(*packed, cu, cu, 77, 77, causal=True)
    torch.testing.assert_close(got[0].transpose(0, 1), want, atol=0, rtol=0)


@pytest.mark.parametrize("mask", ["causal and window", "document"])
def test_gradcheck_float64_with_softcap(mask):
    """Finite differences through fa4's paths (the reference backward on the CPU), softcap
    included. Not prefix-LM: its merge weights come from the fp32 LSEs (fa4's contract), too coarse
    for finite differences; test_prefix_lm_merges_two_calls_exactly checks its gradients."""
    mask_mod = {"causal and window": masks.and_masks(masks.causal(), masks.sliding_window(3, 1)),
                "document": masks.document(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2]), causal=True)}[mask]
    q, k, v = inputs(b=1, hq=2, hkv=1, sq=9, sk=9, d=8, dv=4, grad=True)
    block_mask = _block(mask_mod, 9, 9)
    assert torch.autograd.gradcheck(
        lambda q, k, v: no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mods.softcap(2.0),
                                                               block_mask=block_mask, enable_gqa=True)),
        (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2])
def test_cross_attention_documents_run_packed(rows):
    """Queries and keys with their own ids (packed encoder-decoder batches), the same documents
    in the same order: fa4's packed-sequence kernels with separate query and key offsets."""
    q_ids = torch.tensor([0] * 5 + [3] * 9 + [7] * 2)
    kv_ids = torch.tensor([0] * 11 + [3] * 4 + [7] * 8)
    if rows == 2:
        q_ids = torch.stack([q_ids, torch.tensor([1] * 16)])
        kv_ids = torch.stack([kv_ids, torch.tensor([1] * 23)])
    mask_mod = masks.document(q_ids, kv_ids)
    assert mask_mod.kv_packing is not None and mask_mod.kv_packing is not mask_mod.packing
    q, k, v = inputs(b=2, hq=4, hkv=2, sq=16, sk=23, grad=True)
    out, aux = no_fallback(lambda: fa4.flex_attention(q, k, v, block_mask=_block(mask_mod, 16, 23), enable_gqa=True,
                                                      return_aux=AuxRequest(lse=True)))
    assert_matches_formula(out, aux.lse, (q, k, v), None, mask_mod, gqa=True)


def test_masks_built_inside_a_compiled_graph():
    """fullgraph over building a document BlockMask and attending with it: no graph break (the
    runs, read on the host, are not looked for there: torch's flex_attention runs the mask)."""
    def forward(q, k, v, ids):
        block_mask = create_block_mask(masks.document(ids, causal=True), None, None, q.shape[2], k.shape[2],
                                       device="cpu")
        return fa4.flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mods.softcap(4.0))

    q, k, v = inputs(b=1, sq=40, sk=40)
    ids = torch.tensor([0] * 15 + [1] * 25)
    want = no_fallback(lambda: forward(q, k, v, ids))  # eager: fa4's packed-sequence path
    got = torch.compile(forward, fullgraph=True, backend="aot_eager")(q, k, v, ids)  # torch's flex
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert repr(masks.causal()) == "fa4.masks.Causal" and repr(score_mods.softcap(2.0)) == "fa4.score_mods.Softcap"

