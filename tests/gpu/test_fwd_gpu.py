"""The compiled Hopper forward against a float64 reference (skipped without a Hopper GPU).

Every check poisons the output memory first (NaN-filled caching-allocator blocks, which the
native operators allocate from too) so an unwritten element cannot pass, and compares
with SDPA's math backend in the same dtype: fa4's error must stay within 2x of it.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4
from fa4 import _native
from fa4.testing import lse_error, naive_attention, rel_error, rising_scores

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]

DTYPES = [torch.bfloat16, torch.float16]


def poison_allocator(nbytes=256 << 20):
    """Fill free caching-allocator memory with NaN so fresh outputs start as garbage."""
    blob = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).fill_(float("nan"))
    del blob


def sdpa_math_error(q, k, v, ref, causal, window, softcap, scale):
    """Error of SDPA's math backend in the input dtype against the same fp64 reference."""
    hq, hk = q.shape[2], k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(hq // hk, 1)
    vt = v.transpose(1, 2).repeat_interleave(hq // hk, 1)
    sq, sk = q.shape[1], k.shape[1]
    left, right = window
    if causal:
        right = 0
    if softcap > 0:  # no softcap in SDPA: emulate in the input dtype
        s = (qt @ kt.transpose(-1, -2)) * scale
        s = softcap * torch.tanh(s / softcap)
    else:
        s = None
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        vis &= j <= i + sk - sq + right
    if left >= 0:
        vis &= j >= i + sk - sq - left
    with sdpa_kernel(SDPBackend.MATH):
        if s is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=vis, scale=scale)
        else:
            p = torch.softmax(s.masked_fill(~vis, float("-inf")).float(), -1).to(q.dtype)
            out = p @ vt
    out = out.transpose(1, 2).nan_to_num(0.0)
    return rel_error(out, ref)


def check(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, pack_gqa=None):
    poison_allocator()
    out, lse = fa4.attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale, return_lse=True,
                             pack_gqa=pack_gqa)
    torch.cuda.synchronize()
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale)
    err = rel_error(out, ref_out)
    base = sdpa_math_error(q, k, v, ref_out, causal, window, softcap, scale if scale else 1 / math.sqrt(q.shape[-1]))
    assert err <= 2 * base + 1e-4, f"fa4 error {err:.3e} vs SDPA-math {base:.3e}"
    assert lse_error(lse, ref_lse) < 1e-3
    return err


SEQLENS = [1, 17, 127, 129, 1000, 4097]
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)]
# Each head-dim case runs one tile family whatever the automatic choice would be (FA4_TILES): the
# regular tiles, hd64's "short" ones (256 x 64, four consumer warpgroups) or hd128's "long" ones
# (192 x 80, three), where a call can use them (dense, no mask; elsewhere the regular kernel).
TILE_CASES = [(d, dv, "regular") for d, dv in HEAD_DIMS] + [(64, 64, "short"), (128, 128, "long")]


@pytest.fixture(params=TILE_CASES, ids=lambda c: f"{c[0]}x{c[1]}" + ("" if c[2] == "regular" else f"-{c[2]}"))
def dims(request, monkeypatch):
    d, dv, tiles = request.param
    monkeypatch.setenv("FA4_TILES", tiles)
    return d, dv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_square(dtype, dims, causal, seqlen):
    d, dv = dims
    b, h = (1, 2) if seqlen > 1000 else (3, 4)
    q, k = (torch.randn(b, seqlen, h, d, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(b, seqlen, h, dv, device="cuda", dtype=dtype)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_row_max_jumps_between_key_blocks(dtype, dims, causal):
    """Keys come in 50-key runs of very different magnitudes, so from one K/V block to the next
    a row's max rises by far more than the rescale threshold (2^8) on some blocks and by less
    on others, in the kernel's visiting order (last block first) as well as the reverse: both
    the kept-max and the rescale paths run, and the first visited block is not the largest."""
    d, dv = dims
    g = torch.Generator(device="cuda").manual_seed(1234)
    sq, sk = 700, 900
    q = torch.randn(2, sq, 4, d, device="cuda", generator=g)
    k = torch.randn(2, sk, 2, d, device="cuda", generator=g)
    level = torch.rand(2, sk // 50 + 1, 1, 1, device="cuda", generator=g) * 2.0
    k = k * level.repeat_interleave(50, dim=1)[:, :sk].exp()
    v = torch.randn(2, sk, 2, dv, device="cuda", generator=g)
    check(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_row_max_rises_past_the_exp2_range(dtype, dims, causal):
    """Scores grow by ~1.6 powers of two per key towards key 0, which the kernel visits last:
    every K/V block after a tile's first raises each row's max by ~200 powers of two, so an
    exponential against the previous max overflows to +inf (the speculative step's guess then
    fails with no probability left to rescale, and the block must be redone from its scores)."""
    d, dv = dims
    g = torch.Generator(device="cuda").manual_seed(4321)
    q, k, v = rising_scores(2, 333, 900, 4, 2, d, dv, generator=g)
    check(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal)


@pytest.mark.parametrize("options", [dict(window=(70, 30)), dict(window=(-1, 0), softcap=20.0), dict(softcap=5.0)])
def test_head_dims_with_window_and_softcap(dims, options):
    d, dv = dims
    q = torch.randn(2, 333, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 400, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 400, 2, dv, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(1, 1000), (17, 129), (129, 17), (1000, 127), (127, 4097), (4097, 1000)])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_rectangular_gqa(causal, sq, sk, gqa):
    hk = 2 if gqa < 8 else 1
    q = torch.randn(2, sq, hk * gqa, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize("group, hk", [(2, 3), (4, 2), (8, 1), (16, 1)])
@pytest.mark.parametrize("sq, sk", [(1, 1000), (3, 77), (17, 129), (129, 17), (1000, 1000)])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (40, 7)}, {"softcap": 10.0, "causal": True}])
def test_pack_gqa(pack_gqa, group, hk, sq, sk, kw):
    """Query heads of a group stacked in one tile (decode-like short queries included), against
    the same reference as the unpacked kernel."""
    q = torch.randn(2, sq, hk * group, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check(q, k, v, pack_gqa=pack_gqa, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_pack_gqa_head_dims(dims, causal):
    d, dv = dims
    q = torch.randn(3, 45, 8, d, device="cuda", dtype=torch.float16).transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.randn(3, 300, 2, d, device="cuda", dtype=torch.float16)
    v = torch.randn(3, 300, 2, dv, device="cuda", dtype=torch.float16)
    check(q, k, v, causal=causal, pack_gqa=True)


@pytest.mark.parametrize("sq, sk", [(1, 1000), (17, 129), (700, 700)])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"softcap": 10.0}])
def test_pack_gqa_16_heads_at_hd64(sq, sk, kw):
    """hd64's 192-row tiles cannot stack 16 heads in 8-row pieces; a forced pack_gqa=True runs its
    256-row tiles instead (dense, no mask or causal), and says so where it cannot (a window)."""
    q = torch.randn(2, sq, 32, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check(q, k, v, pack_gqa=True, **kw)
    fa4.attention(q, k, v, pack_gqa=True, **kw)
    launch = _native.last_launch("fwd")
    assert launch["pack_gqa"] == 16 and launch["name"].endswith("_shortseq"), launch
    with pytest.raises(ValueError, match="192-row tiles stack at most 8 heads"):
        fa4.attention(q, k, v, pack_gqa=True, window=(30, 0))


def test_pack_gqa_is_chosen_for_decoding():
    from fa4.heuristics import pack_gqa_factor
    assert pack_gqa_factor(32, 8, 1, 128) == 4
    assert pack_gqa_factor(32, 8, 4096, 128) == 1


@pytest.mark.parametrize("group, dims, pack, family", [
    (32, 128, 16, ""),  # 128-row tiles stack 16 of the 32 heads: K/V read twice
    (16, 64, 16, "_shortseq"),  # hd64: the 256-row tiles stack all 16, the 192-row ones 8
    (32, 64, 32, "_shortseq"),  # 32 in 256 rows
    (8, 64, 8, ""),
])
@pytest.mark.parametrize("causal", [False, True])
def test_automatic_pack_gqa_of_large_groups(group, dims, pack, family, causal):
    """Decoding rows with more query heads per K/V head than a tile stacks: the automatic choice
    packs the largest part of the group that stacks, in the family that stacks the most."""
    q = torch.randn(2, 3, 2 * group, dims, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 777, 2, dims, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check(q, k, v, causal=causal)
    fa4.attention(q, k, v, causal=causal)
    launch = _native.last_launch("fwd")
    assert launch["pack_gqa"] == pack and launch["name"].endswith(("_causal" if causal else "_none") + family), launch


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_batches_and_bhsd_strides(batch):
    # (B, H, S, D) storage passed as (B, S, H, D) views: no copy, non-contiguous strides.
    qh = torch.randn(batch, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    kh = torch.randn(batch, 2, 333, 64, device="cuda", dtype=torch.bfloat16)
    vh = torch.randn(batch, 2, 333, 64, device="cuda", dtype=torch.bfloat16)
    check(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), causal=True)


def test_sliced_inputs_with_padded_strides():
    base = torch.randn(2, 200, 6, 160, device="cuda", dtype=torch.bfloat16)
    q, k, v = base[..., :128], base[:, :150, 2:4, 16:144], base[:, :150, 4:6, 32:160]
    assert not q.is_contiguous()
    check(q, k, v)


def test_misaligned_views_fall_back_to_a_copy():
    base = torch.randn(1 * 64 * 2 * 64 + 3, device="cuda", dtype=torch.float16)
    q = base[3:].view(1, 64, 2, 64)  # 6-byte offset: TMA cannot use it in place
    check(q, q, q)


@pytest.mark.parametrize("window", [(0, 0), (16, 0), (100, 50), (-1, 33), (257, -1)])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (300, 777), (777, 300)])
def test_local_window(window, sq, sk):
    q = torch.randn(2, sq, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check(q, k, v, window=window)


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(causal):
    q, k, v = (torch.randn(2, 555, 4, 128, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3))
    check(q, k, v, causal=causal, softcap=10.0)


def test_custom_scale():
    q, k, v = (torch.randn(1, 200, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    check(q, k, v, causal=True, scale=0.3)


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(300, 40)), dict()])
@pytest.mark.parametrize("seqlen_q", [1024, 1026])
def test_lse_bulk_and_row_stores(dims, seqlen_q, mask):
    """Masked variants store a warpgroup's LSE rows with one bulk copy when they all lie in the
    sequence and start 16-byte aligned in the LSE tensor (1024 rows: every tile of every head),
    row by row otherwise (1026: tiles start 126 rows above row 0, so the first is partly above
    it and the others 8 bytes off); unmasked ones always row by row."""
    d, dv = dims
    q = torch.randn(2, seqlen_q, 3, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1100, 3, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1100, 3, dv, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, **mask)


def test_rows_without_keys_are_zero_with_minus_inf_lse():
    q = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 40, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = fa4.attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :260] == 0) and torch.all(torch.isneginf(lse[..., :260]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., 260:]).all()


def test_native_op_writes_every_output_element():
    q, k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    poison_allocator()
    out, lse = torch.ops.fa4.fwd(q, k, v, 0.088, True)
    assert _native.last_launch("fwd")["name"] == "fa4_fwd_sm_90a_bf16_d128x128_causal"
    assert not out.isnan().any() and not lse.isnan().any()


def test_cuda_calls_never_enter_python_below_the_op():
    """The CUDA implementations are native (csrc_shims/fa4_ops.cpp): a Python profiler sees no
    Python function of fa4 run during a forward or backward op call."""
    import sys

    assert _native._unavailable_reason is None
    q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.ops.fa4.fwd(q, k, v, 0.088, True)
    package = os.path.dirname(fa4.__file__)
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        torch.ops.fa4.fwd(q, k, v, 0.088, True)
        torch.ops.fa4.bwd(out, q, k, v, out, lse, None, 0.088, True, -1, -1, 0.0, False)
    finally:
        sys.setprofile(None)
    assert seen == []


def test_native_errors_keep_their_python_type():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="window_left must be >= 0"):
        fa4.attention(q, q, q, window=(-5, 0))
    with pytest.raises(TypeError, match="share one dtype"):
        fa4.attention(q, q.half(), q)
    with pytest.raises(RuntimeError, match=r"\[fa4 ValueError\] softcap must be >= 0"):
        torch.ops.fa4.fwd(q, q, q, 0.1, False, -1, -1, -1.0)  # the op itself: tagged RuntimeError


@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_k_a_multiple_of_the_block(dims, causal):
    """A tile's first K/V block then ends exactly at seqlen_k and skips the seqlen mask."""
    d, dv = dims
    family = "regular" if causal else os.environ["FA4_TILES"]  # the fixture's family, if this call can use it
    tile_n = next(v["tile_n"] for v in _native.manifest()["variants"]
                  if (v["head_dim"], v["head_dim_v"]) == dims and v.get("tiles", "regular") == family
                  and v["mask"] == ("causal" if causal else "none"))
    q = torch.randn(2, 333, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 5 * tile_n, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 5 * tile_n, 2, dv, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, causal=causal)


SPLIT_SHAPES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
    (1, 4097, 4097, 2, 2),  # fewer tiles than SMs: each split in two
    (1, 129, 17000, 8, 8),  # 16 long tiles: each split about eight ways
    (3, 1, 5000, 16, 4),  # decoding with pack-GQA: 12 tiles, many ways each
    (2, 1000, 3000, 4, 1),  # GQA without packing
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SPLIT_SHAPES)
@pytest.mark.parametrize("softcap", [0.0, 7.0])
def test_split_tail(monkeypatch, dtype, dims, shape, softcap):
    """Tiles cut into pieces of K/V blocks over all SMs, partials merged (FA4_SPLIT_TAIL=1
    splits whenever pieces can outnumber tiles). The partials buffer comes from the poisoned
    allocator, so a merge that reads an unwritten slot fails."""
    monkeypatch.setenv("FA4_SPLIT_TAIL", "1")
    b, sq, sk, hq, hk = shape
    d, dv = dims
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype)
    check(q, k, v, softcap=softcap)


def test_split_tail_after_full_rounds_by_default():
    """The benchmark's case: full rounds of tiles, then a partial last round that the default
    heuristic splits (1152 tiles = 8 rounds of 132 + 96; 16 K/V blocks each)."""
    from fa4.heuristics import split_tail_ctas
    q, k, v = (torch.randn(1, 2048, 72, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert split_tail_ctas(16 * 72, num_sms, 16) > 0
    check(q, k, v)


def device_words(address: int, words: int) -> list[int]:
    """int32 words of device memory at ``address`` (a buffer the native library owns)."""
    import ctypes

    torch.cuda.synchronize()
    host = (ctypes.c_int32 * words)()
    assert ctypes.CDLL("libcudart.so.13").cudaMemcpy(host, ctypes.c_void_p(address), words * 4, 2) == 0
    return list(host)


def test_split_tail_flags_are_left_zero_and_results_repeat():
    q, k, v = (torch.randn(1, 3000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = fa4.attention(q, k, v)
    launch = _native.last_launch("fwd")
    assert launch["tail_ctas"] > 0
    for _ in range(3):
        assert torch.equal(fa4.attention(q, k, v), first)
        assert _native.last_launch("fwd")["semaphores"] == launch["semaphores"]  # one buffer per stream
    assert not any(device_words(launch["semaphores"], launch["semaphore_words"]))


def test_split_tail_on_concurrent_streams():
    """Each stream has its own flags: two split launches running at once do not mix partials."""
    inputs = [tuple(torch.randn(1, 2500, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
              for _ in range(2)]
    want = [fa4.attention(*x) for x in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(10):
        for i, (s, x) in enumerate(zip(streams, inputs)):
            with torch.cuda.stream(s):
                outs[i].append(fa4.attention(*x))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(o, want[i]) for o in outs[i])


def test_results_are_deterministic():
    q, k, v = (torch.randn(4, 1500, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = fa4.attention(q, k, v, causal=True)
    for _ in range(3):
        assert torch.equal(fa4.attention(q, k, v, causal=True), first)


@pytest.mark.parametrize("causal", [True, False])  # dynamic schedule; static with a split tail
def test_cuda_graph_capture_and_replay(causal):
    # 64 tiles of 16 K/V blocks: without a mask the tail (all of it) is split over every SM.
    q, k, v = (torch.randn(1, 2048, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fa4.attention(q, k, v, causal=causal)  # load the module before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fa4.attention(q, k, v, causal=causal)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fa4.attention(q, k, v, causal=causal))


def test_opcheck_cuda():
    q = torch.randn(2, 130, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 70, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 70, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for kwargs in ({"causal": True}, {"causal": True, "pack_gqa": True}):
        torch.library.opcheck(torch.ops.fa4.fwd.default, (q, k, v, 0.125), kwargs,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_cuda():
    torch._dynamo.reset()

    def block(x, wq, wkv):
        b, s, _ = x.shape
        q = (x @ wq).view(b, s, 8, 64)
        k, v = (x @ wkv).view(b, s, 2, 2, 64).unbind(2)
        return fa4.attention(q, k, v, causal=True).sum(-1)

    x = torch.randn(2, 333, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wq = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) / 16
    wkv = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) / 16
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, wq, wkv)
    assert torch.allclose(out.float(), block(x, wq, wkv).float(), atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_backward_matches_reference():
    q, k, v = (torch.randn(1, 257, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = fa4.attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_out, _ = naive_attention(q, k, v, causal=True)
    ref = torch.autograd.grad(ref_out, (q, k, v), g.double())
    for got, want in zip(grads, ref):
        assert rel_error(got, want) < 2e-2


@pytest.mark.parametrize("kw", [{"causal": True}, {"window": (300, 0)}, {"window": (100, 20)}])
def test_more_tiles_than_sms(dims, kw):
    """Every CTA of the persistent grid runs several diagonal tiles (192-256 of them here), in
    which warpgroups holding a tile's upper rows sit out its rightmost blocks while the others
    compute them, and with O staged in V's buffer (hd192x192, hd256) the previous tile's O
    store still holds V: the next tile must neither hang nor read a stage early."""
    d, dv = dims
    q, k = (torch.randn(4, 1000, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(4, 1000, 8, dv, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, **kw)


@pytest.mark.parametrize("persistent", ["0", "1"])
def test_grid_choices_agree(monkeypatch, persistent):
    monkeypatch.setenv("FA4_PERSISTENT", persistent)
    q, k, v = (torch.randn(3, 1100, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    check(q, k, v, causal=True)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128)])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (90, 20)}])
def test_tile_order_groups_with_a_remainder(monkeypatch, dims, kw):
    """10 (head, batch) pairs in groups of 3: the last group takes 4 (tile_scheduler)."""
    d, dv = dims
    sq = sk = 700
    kv_bytes = sk * (d + dv) * 2
    monkeypatch.setenv("FA4_L2_SWIZZLE_MB", str(3.5 * kv_bytes / 2**20))
    q = torch.randn(2, sq, 5, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 5, x, device="cuda", dtype=torch.bfloat16) for x in (d, dv))
    check(q, k, v, **kw)


@pytest.mark.parametrize("d, sq, sk, family", [
    (64, 1000, 1000, "short"), (64, 197, 197, "short"), (64, 512, 3000, "short"), (64, 700, 700, "short"),
    (64, 768, 768, "regular"), (64, 1500, 1500, "regular"), (64, 1, 3000, "regular"), (64, 960, 960, "regular"),
    (128, 1500, 8192, "long"), (128, 1500, 2048, "long"), (128, 1500, 1024, "regular"),
    (128, 1000, 4096, "regular"), (128, 1, 8192, "regular"),
])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_family_by_sequence_length(monkeypatch, d, sq, sk, family, causal):
    """Automatic choice (fa4.heuristics.tile_family), dense: hd64 takes 256-row tiles without a mask
    up to 1024 query rows that 192-row ones pad (and they no more), causal at any length; hd128
    192-row tiles from 2048 keys on, where they pad about as little, without a mask or causal;
    neither for one unpacked decoding row."""
    monkeypatch.delenv("FA4_TILES", raising=False)
    q = torch.randn(2, sq, 2, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fa4.attention(q, k, v, causal=causal)
    launched = [_native.last_launch("fwd")["name"]]
    check(q, k, v, causal=causal)
    if causal and d == 64 and sq > 1:  # causal: short tiles at any length, padded or not
        family = "short"
    suffix = "" if family == "regular" else f"_{family}seq"
    mask = "causal" if causal and sq > 1 else "none"  # one bottom-right causal row sees every key
    assert len(launched) == 1 and launched[0].endswith(f"_{mask}{suffix}"), launched


def test_unsupported_head_dim_names_the_alternatives():
    q = torch.randn(1, 8, 2, 40, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="head_dim=40"):
        fa4.attention(q, q, q)


def test_wrong_device_mix_is_rejected():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one device"):
        fa4.attention(q, q.cpu(), q)


def test_counters_stay_zeroed_across_arena_passes():
    """Masked launches count tiles in zeroed counters taken from a per-stream arena, zeroed again
    when a pass over it ends (csrc_shims/fa4_ops.cpp, zeroed_counters): thousands of calls, on two
    streams and at two sizes, all give the first call's result."""
    q, k, v = (torch.randn(1, 300, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = fa4.attention(q, k, v, causal=True)
    dout = torch.randn_like(first)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(fa4.attention(qg, kg, vg, causal=True, deterministic=True), (qg, kg, vg), dout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs = []
    for i in range(2500):  # 2048 calls fill an arena of 64k words at 32 words per call
        with torch.cuda.stream(side if i % 3 == 0 else torch.cuda.current_stream()):
            outs.append(fa4.attention(q, k, v, causal=True))
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(o, first) for o in outs)
    for _ in range(3):
        again = torch.autograd.grad(fa4.attention(qg, kg, vg, causal=True, deterministic=True), (qg, kg, vg), dout)
        assert all(torch.equal(a, b) for a, b in zip(again, grads))


def test_debug_log_names_each_launch(caplog):
    """FA4_LOG=debug (here the logger's level set directly): each eager call logs its launch."""
    import logging

    caplog.set_level(logging.DEBUG, logger="fa4")
    q = torch.randn(1, 300, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    fa4.attention(q, k, v, causal=True).sum().backward()
    assert "fa4_fwd_sm_90a_bf16_d128x128_causal" in caplog.text and "pack_gqa" in caplog.text
    # The backward runs causal as a window (catalog.BWD_MASKS), its CTAs in launch groups.
    assert "fa4_bwd_sm_90a_bf16_d128x128_local" in caplog.text and "first store" in caplog.text
    assert "launch group 4" in caplog.text


def test_compile_dynamic_serves_every_length_with_one_graph():
    """torch.compile(dynamic=True) over fa4.attention: one compile for lengths 100 to 1500, forward
    and backward (no guard on the sequence length)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(lambda q, k, v: fa4.attention(q, k, v, causal=True), dynamic=True, backend=counter)
    for s in (100, 300, 777, 1500):
        q, k, v = (torch.randn(2, s, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = fn(q, k, v)
        out.sum().backward()
        assert torch.equal(out, fa4.attention(q, k, v, causal=True))
    assert counter.frame_count == 1
