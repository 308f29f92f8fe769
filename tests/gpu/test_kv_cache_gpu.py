"""fa4.attention_with_kvcache on CUDA: the kv_cache forward variants (src/fa4_kernels/kv_cache.py)
against a float64 formula, within twice the error of SDPA's math backend in the input dtype, per
sequence: contiguous caches (with cache_batch_idx) and paged ones (page sizes 16 to 256), cache
lengths 0 and 1 and random ones, seqlen_q 1/2/7/128, GQA 1 to 16, with and without appended rows,
windows and softcap, the decode's K/V split (pieces past a short sequence included). The append
writes exactly its slots (the rest of the cache compared bit for bit), and slots past a sequence's
end (inf, NaN) never reach its output; CUDA graphs replay with new lengths and tables;
torch.compile keeps the cache mutation."""
import math

import pytest
import torch

import fa4
from fa4 import _native
from fa4.testing import lse_error, naive_attention, rel_error
from fa4_kernels import catalog, heuristics

from ..conftest import requires_hopper
from .test_fwd_gpu import poison_allocator, sdpa_math_error

pytestmark = [pytest.mark.gpu, requires_hopper]

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def require_variant(dtype, d, dv, softcap):
    """Skip where this build lacks the kernel the call runs: one per dtype, head dims and softcap,
    the mask a window given at run time (catalog.KV_CACHE_MASKS)."""
    (mask,) = catalog.KV_CACHE_MASKS
    key = catalog.VariantKey("sm_90a", DTYPE_NAMES[dtype], d, dv, mask, softcap > 0, kv_cache=True)
    # A name the catalog does not have is this test's mistake, not a smaller build: fail on it
    # (variants renamed in the catalog once made every test here skip).
    assert key in catalog.all_variants(), f"{key.name} is not a catalog variant"
    if key.name not in _native.variant_index():
        pytest.skip(f"{key.name} is not in this build")


def make_cache(b, capacity, hkv, d, dv, page_size, dtype, gen):
    """(k_cache, v_cache, page_table, cache_batch_idx): paged with shuffled pages, or contiguous with
    one spare row and shuffled rows."""
    if page_size is None:
        rows = b + 1
        k = torch.randn(rows, capacity, hkv, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(rows, capacity, hkv, dv, device="cuda", dtype=dtype, generator=gen)
        index = torch.randperm(rows, device="cuda", generator=gen)[:b].to(torch.int32)
        return k, v, None, index
    max_pages = -(-capacity // page_size)
    num_pages = b * max_pages + 3
    k = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(num_pages, page_size, hkv, dv, device="cuda", dtype=dtype, generator=gen)
    table = torch.randperm(num_pages, device="cuda", generator=gen)[:b * max_pages].reshape(b, max_pages)
    return k, v, table.to(torch.int32).contiguous(), None


def sequence_rows(cache, table, index, b, length):
    """Rows 0..length-1 of sequence b of a (pages or rows, rows, heads, dim) cache."""
    rows = torch.arange(length, device=cache.device)
    if table is None:
        return cache[int(index[b]), :length]
    page = cache.shape[1]
    return cache[table[b].long()[rows // page], rows % page]


def poison_past_the_end(k, v, table, index, lengths):
    """Slots past each sequence's end: inf inside its last 16-row page box (loaded, then masked in
    the scores and zeroed in V: sm90/fwd.py clear_stale_v_rows), NaN after it (never loaded)."""
    b = len(lengths)
    page = k.shape[1]
    capacity = page * (table.shape[1] if table is not None else 1)
    for i in range(b):
        rows = torch.arange(lengths[i], capacity, device=k.device)
        if rows.numel() == 0:
            continue
        boxed = rows < -(-lengths[i] // 16) * 16
        for t in (k, v):
            value = torch.where(boxed, float("inf"), float("nan"))[:, None, None].to(t.dtype)
            if table is None:
                t[int(index[i]), rows] = value.expand(-1, t.shape[2], t.shape[3])
            else:
                t[table[i].long()[rows // page], rows % page] = value.expand(-1, t.shape[2], t.shape[3])


def run(b, sq, hq, hkv, d, dv, lengths, seqlen_new, page_size, capacity, *, causal=True, window=(-1, -1),
        softcap=0.0, dtype=torch.bfloat16, seed=0, num_splits=0):
    require_variant(dtype, d, dv, softcap)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache, table, index = make_cache(b, capacity, hkv, d, dv, page_size, dtype, gen)
    final = [n + seqlen_new for n in lengths]
    poison_past_the_end(k_cache, v_cache, table, index, final)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k_new = v_new = None
    if seqlen_new:
        k_new = torch.randn(b, seqlen_new, hkv, d, device="cuda", dtype=dtype, generator=gen)
        v_new = torch.randn(b, seqlen_new, hkv, dv, device="cuda", dtype=dtype, generator=gen)
        for i, n in enumerate(lengths):  # the slots the append writes hold NaN until then
            rows = torch.arange(n, n + seqlen_new, device="cuda")
            for t in (k_cache, v_cache):
                if table is None:
                    t[int(index[i]), rows] = float("nan")
                else:
                    t[table[i].long()[rows // t.shape[1]], rows % t.shape[1]] = float("nan")
    before_k, before_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    poison_allocator()
    out, lse = fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new,
                                          cache_batch_idx=index, page_table=table, causal=causal, window=window,
                                          softcap=softcap, num_splits=num_splits, return_lse=True)
    torch.cuda.synchronize()
    # The append wrote exactly its slots.
    expect_k, expect_v = before_k.clone(), before_v.clone()
    if seqlen_new:
        for i, n in enumerate(lengths):
            rows = torch.arange(n, n + seqlen_new, device="cuda")
            for t, new in ((expect_k, k_new), (expect_v, v_new)):
                if table is None:
                    t[int(index[i]), rows] = new[i]
                else:
                    t[table[i].long()[rows // t.shape[1]], rows % t.shape[1]] = new[i]
    assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16)), "k_cache: wrong slots written"
    assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16)), "v_cache: wrong slots written"
    scale = 1 / math.sqrt(d)
    for i, n in enumerate(final):
        keys = sequence_rows(k_cache, table, index, i, n)[None]
        values = sequence_rows(v_cache, table, index, i, n)[None]
        ref_out, ref_lse = naive_attention(q[i:i + 1], keys, values, causal=causal, window=window, softcap=softcap)
        err = rel_error(out[i:i + 1], ref_out)
        if n == 0:
            assert err == 0 and bool(torch.isneginf(lse[i]).all()), f"sequence {i} holds no key"
            continue
        base = sdpa_math_error(q[i:i + 1], keys, values, ref_out, causal, window, softcap, scale)
        assert err <= 2 * base + 1e-4, f"sequence {i} ({n} keys): error {err:.3e} vs SDPA-math {base:.3e}"
        assert lse_error(lse[i:i + 1], ref_lse) < 1e-3, f"sequence {i}: lse"
    return out


PAGES = [None, 16, 48, 64, 128, 256]  # 48: not a power of two


@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("seqlen_new", [0, 1])
def test_decode_gqa_32_8(page_size, seqlen_new):
    run(4, 1, 32, 8, 128, 128, [0, 1, 700, 2047], seqlen_new, page_size, 2304)


@pytest.mark.parametrize("group", [1, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("page_size", [None, 64])
def test_gqa_groups(group, page_size):
    run(3, 1, 2 * group, 2, 128, 128, [5, 333, 1024], 1, page_size, 1536)
    # A 64-row tile stacks up to 64 heads (Q pieces across heads: kv_cache.FEW_HEAD_ROWS); 128
    # heads pack 64 per tile, whose two tiles append the same K/V head's rows (the run above
    # compares the whole cache).
    assert _native.last_launch("fwd")["pack_gqa"] == min(group, 64)


@pytest.mark.parametrize("sq, group", [(2, 16), (7, 16), (3, 32), (5, 64)])
@pytest.mark.parametrize("page_size", [None, 16])
def test_verification_with_heads_of_few_rows(sq, group, page_size):
    """Causal verification tokens with 4, 2 or 1 tile rows per packed head: a head's rows span
    tiles, and every Q piece holds rows of several heads."""
    run(3, sq, 2 * group, 2, 128, 128, [0, 40, 700], sq, page_size, 768)
    assert _native.last_launch("fwd")["pack_gqa"] == group


@pytest.mark.parametrize("sq", [2, 7, 128])
@pytest.mark.parametrize("page_size", [None, 16, 80, 128])
@pytest.mark.parametrize("append", [False, True])
def test_queries_beyond_one(sq, page_size, append):
    # Speculative verification / chunked prefill: causal, bottom-right aligned on each sequence.
    run(3, sq, 8, 2, 128, 128, [0, 130, 900], sq if append else 0, page_size, 1280)


@pytest.mark.parametrize("options", [dict(window=(100, 0), causal=False), dict(softcap=30.0),
                                     dict(window=(64, 0), causal=False, softcap=20.0)])
@pytest.mark.parametrize("sq", [1, 7])
def test_window_and_softcap(options, sq):
    run(2, sq, 8, 2, 128, 128, [300, 1111], sq, 64, 1280, **options)


@pytest.mark.parametrize("case", [
    # (sq, options, the kernel's mask): one token sees its whole sequence, causal or not, and runs
    # the unmasked twin; several causal tokens, a left window or softcap the window kernel.
    (1, dict(), "none"), (1, dict(causal=False), "none"), (3, dict(causal=False), "none"),
    (1, dict(causal=False, window=(-1, 5)), "none"),
    (3, dict(), "local"), (3, dict(causal=False, window=(-1, 0)), "local"),
    (1, dict(causal=False, window=(100, 0)), "local"), (3, dict(causal=False, window=(-1, 1)), "local"),
    (1, dict(softcap=30.0), "local"), (3, dict(softcap=30.0), "local"),
])
def test_kv_cache_calls_run_their_masks_twin(case):
    sq, options, kernel_mask = case
    for mask in catalog.KV_CACHE_TWIN_MASKS:
        twin = catalog.VariantKey("sm_90a", "bf16", 128, 128, mask, False, kv_cache=True)
        if twin.name not in _native.variant_index():
            pytest.skip(f"{twin.name} is not in this build")
    run(2, sq, 8, 2, 128, 128, [300, 1111], sq, 64, 1280, **options)
    name = _native.last_launch("fwd")["name"]
    assert f"_d128x128_{kernel_mask}_" in name, name


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (256, 256)])
@pytest.mark.parametrize("seqlen_new", [1, 2, 16, 17])
def test_append_twin(page_size, dims, seqlen_new):
    """One-token decoding with rows to append runs the append twin (catalog.VariantKey.kv_append):
    appended rows inside the tile's first K/V block are copied into its loaded stages, rows that
    straddle two blocks or more than kv_cache.PATCHED_ROWS of them go through the producer's wait.
    run() fills every appended slot with NaN before the call, so a row the patch missed is seen."""
    d, dv = dims
    twin = catalog.VariantKey("sm_90a", "bf16", d, dv, "none", False, kv_cache=True, kv_append=True)
    assert twin in catalog.all_variants(), f"{twin.name} is not a catalog variant"
    if twin.name not in _native.variant_index():
        pytest.skip(f"{twin.name} is not in this build")
    tile_n = heuristics.kernel_config(twin).tile_n
    # The last key ends a block's first rows, the block's last row, the cache's first block.
    lengths = [tile_n - 2, 3 * tile_n - 1, 0, 5]
    run(4, 1, 16, 4, d, dv, lengths, seqlen_new, page_size, 4 * tile_n)
    assert _native.last_launch("fwd")["name"] == twin.name
    run(4, 1, 16, 4, d, dv, lengths, seqlen_new, page_size, 4 * tile_n, num_splits=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (192, 128), (192, 192), (256, 256)])
def test_head_dims(dtype, dims):
    run(2, 1, 8, 2, *dims, [77, 1000], 1, 64, 1024, dtype=dtype)
    run(2, 3, 8, 2, *dims, [77, 1000], 3, None, 1024, dtype=dtype)


def require_long_tiles(dtype, d, dv, softcap):
    """Skip where this build lacks the window kernel's "long" tiles (catalog.KV_CACHE_TILE_FAMILIES)."""
    (mask,) = catalog.KV_CACHE_MASKS
    key = catalog.VariantKey("sm_90a", DTYPE_NAMES[dtype], d, dv, mask, softcap > 0, kv_cache=True, tiles="long")
    assert key in catalog.all_variants(), f"{key.name} is not a catalog variant"
    if key.name not in _native.variant_index():
        pytest.skip(f"{key.name} is not in this build")
    return key.name


@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("b, sq, lengths, append", [
    (2, 300, [2000, 61], 300),  # a chunk appended and attended to; a sequence shorter than its chunk
    (1, 2048, [2900], 0),
    (3, 129, [0, 77, 3900], 5),  # tiles of one K/V block and of none
    (1, 130, [1000], 333),  # more rows appended than queried: every query block stores a share
])
def test_chunked_prefill_runs_the_long_tiles(b, sq, lengths, append, page_size):
    """Many causal query rows of each head against a cache of 2048+ keys run the dense kernel's
    taller tiles (two consumer warpgroups: heuristics.kv_cache_long_config); the first warpgroup
    zeroes the stale V rows ahead of the other (run() puts inf there). Appended rows are loaded
    from k_new/v_new but for the K/V block they share with cached rows (cached lengths 61, 77,
    3900, 1000 end inside a block), and their cache stores are shared among the tiles: run()
    compares the whole cache."""
    name = require_long_tiles(torch.bfloat16, 128, 128, 0.0)
    run(b, sq, 32, 8, 128, 128, lengths, append, page_size, 4096)
    assert _native.last_launch("fwd")["name"] == name
    # Few tiles (one per query head): their K/V range split over the GPU, merged by the merger.
    run(1, 128, 16, 2, 128, 128, [3000], 0, page_size, 4096, seed=1)
    launch = _native.last_launch("fwd")
    assert launch["name"] == name and launch["tail_ctas"] > 0, launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (192, 128), (192, 192), (256, 256)])
def test_long_tiles_head_dims(dtype, dims):
    # hd64's tiles have three consumer warpgroups, hd256's stage O in V's buffer.
    name = require_long_tiles(dtype, *dims, 0.0)
    run(2, 257, 8, 2, *dims, [1500, 3333], 100, 64, 4096, dtype=dtype)
    assert _native.last_launch("fwd")["name"] == name
    # Pages of 128 rows: blocks inside one page come in one box, those across two (hd192's
    # 112-row blocks) in page boxes (FwdConfig.whole_block_boxes).
    run(2, 190, 8, 2, *dims, [2222, 700], 45, 128, 4096, dtype=dtype)
    assert _native.last_launch("fwd")["name"] == name
    run(1, 200, 8, 2, *dims, [2100], 0, None, 2304, dtype=dtype, num_splits=3)


@pytest.mark.parametrize("options, kernel", [
    (dict(window=(700, 0), causal=False), "long"), (dict(softcap=30.0), "long"),
    (dict(window=(333, 40), causal=False, softcap=20.0), "long"),
    (dict(causal=False), "twin"),  # every row sees every key: the unmasked twin, which has no long tiles
])
def test_long_tiles_window_and_softcap(options, kernel):
    name = require_long_tiles(torch.bfloat16, 128, 128, options.get("softcap", 0.0))
    run(2, 400, 16, 4, 128, 128, [2500, 900], 400, 16, 4096, **options)
    launched = _native.last_launch("fwd")["name"]
    assert (launched == name) == (kernel == "long"), launched


@pytest.mark.parametrize("sq, group", [(1, 4), (1, 32), (3, 64)])
def test_forced_long_tiles_pack_decoding_heads(sq, group, monkeypatch):
    """FA4_TILES=long runs the long tiles wherever they are built, also for packed decoding tiles:
    32, 4 and 2 rows of each head (the last two Q loaded in pieces across heads)."""
    name = require_long_tiles(torch.bfloat16, 128, 128, 0.0)
    monkeypatch.setenv("FA4_TILES", "long")
    run(3, sq, 2 * group, 2, 128, 128, [0, 40, 1700], sq, 64, 2048, causal=False, window=(100, 0))
    launch = _native.last_launch("fwd")
    assert launch["name"] == name and launch["pack_gqa"] == group, launch


@pytest.mark.parametrize("b, sq, length", [(1, 300, 32768), (4, 129, 8192)])
def test_regular_tiles_split_tail_after_a_full_round(b, sq, length, monkeypatch):
    """64-row tiles that fill the grid once and leave a few tiles (28, 24) for the split tail,
    about five pieces each, shares straddling two tiles: merged by one merger, not distributed
    (split_partials.distributes; distributed, they ran 2-4x slower than the rounds predict)."""
    monkeypatch.setenv("FA4_TILES", "regular")
    run(b, sq, 32, 8, 128, 128, [length] * b, 0, None, length)
    launch = _native.last_launch("fwd")
    assert launch["tail_ctas"] > 0 and not launch["name"].endswith("_longseq"), launch


def test_split_over_a_mostly_empty_cache():
    # Few tiles: the decode's K/V range is split over the GPU, by pieces scaled onto each
    # sequence; most pieces of the short sequence are empty.
    run(1, 1, 16, 2, 128, 128, [3000], 1, None, 16384)
    launch = _native.last_launch("fwd")
    assert launch["tail_ctas"] > 0, launch
    run(2, 1, 16, 2, 128, 128, [0, 9000], 1, 256, 16384)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40, 1000])
def test_explicit_split_counts(num_splits):
    # 8 tiles (one per K/V head, 4 query heads packed): num_splits pieces each, within the grid
    # (whole pieces per tile where it caps them).
    run(1, 1, 32, 8, 128, 128, [2900], 1, 48, 6144, num_splits=num_splits)
    launch = _native.last_launch("fwd")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert launch["tail_ctas"] == (0 if num_splits == 1 else 8 * min(num_splits, sms // 8)), launch


# (b, sq, hq, hkv, d, dv, lengths, capacity) whose split tiles every piece merges: a single merger
# would fold >= split_partials.DISTRIBUTED_MIN_BYTES of partials (speculative verification of 8-16
# tokens over few tiles). tests/fa4_kernels/test_split_partials.py checks that they take that path.
DISTRIBUTED_SHAPES = [(1, 8, 32, 8, 128, 128, [2900], 6144), (1, 16, 16, 2, 64, 64, [3001], 4096),
                      (1, 8, 8, 2, 192, 128, [4000], 4096)]


@pytest.mark.parametrize("shape", DISTRIBUTED_SHAPES)
@pytest.mark.parametrize("page_size", [None, 64])
def test_verification_merged_by_every_piece(shape, page_size):
    b, sq, hq, hkv, d, dv, lengths, capacity = shape
    run(b, sq, hq, hkv, d, dv, lengths, sq, page_size, capacity)
    # A second call in a row: the tile counters were left at zero for it.
    run(b, sq, hq, hkv, d, dv, lengths, 0, page_size, capacity, seed=1)


@pytest.mark.parametrize("num_splits", [0, 3, 40])
@pytest.mark.parametrize("window", [(300, 0), (1000, 64)])
def test_window_splits(window, num_splits):
    # A window's decoding tiles are split too (the static schedule of every KV-cache call): the
    # pieces share the blocks the tile's rows see, from the window's first on; with many pieces
    # most are empty (one masked block past the sequence each, no weight in the merge).
    run(1, 1, 32, 8, 128, 128, [2900], 1, 64, 6144, causal=False, window=window, num_splits=num_splits)
    assert _native.last_launch("fwd")["tail_ctas"] > 0
    run(2, 2, 32, 8, 128, 128, [5000, 40], 2, None, 6144, causal=False, window=window, num_splits=num_splits)


@pytest.mark.parametrize("sq", [4, 8])
def test_speculative_verification_splits(sq):
    # A few causal query rows against a long cache: the same split as one token (static schedule).
    run(1, sq, 32, 8, 128, 128, [7000], 0, 64, 8192)
    assert _native.last_launch("fwd")["tail_ctas"] > 0
    run(2, sq, 32, 8, 128, 128, [6001, 17], sq, None, 8192)


def test_cuda_graph_replays_with_new_lengths_and_tables():
    require_variant(torch.bfloat16, 128, 128, 0.0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    b, hq, hkv, d, page, max_pages = 2, 8, 2, 128, 64, 16
    k_cache = torch.randn(b * max_pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(b * max_pages, device="cuda", dtype=torch.int32).reshape(b, max_pages).contiguous()
    seqlens = torch.tensor([10, 500], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table)
    for lengths, order in (([10, 500], False), ([999, 3], True), ([0, 1024], False)):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        if order:
            table.copy_(torch.flip(table, [0]))
        graph.replay()
        expect = fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table)
        assert torch.equal(out, expect), lengths


def test_cuda_graph_of_split_decoding_replays_without_a_memset():
    # The split flags of a captured call are zeroed at capture, outside the graph, and every
    # kernel leaves them zero: replays run the kernels alone, and stay right replay after replay.
    require_variant(torch.bfloat16, 128, 128, 0.0)
    gen = torch.Generator(device="cuda").manual_seed(4)
    k_cache, v_cache = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                        for _ in range(2))
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor([4096], dtype=torch.int32, device="cuda")
    fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens, num_splits=n) for n in (0, 8, 0)]
    assert _native.last_launch("fwd")["tail_ctas"] > 0
    for length in (4096, 1000, 17, 4096):
        seqlens.fill_(length)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(names) == 3 and not any("memset" in n.lower() for n in names), names
        ref, _ = naive_attention(q, k_cache[:, :length], v_cache[:, :length])
        for out in outs:
            assert rel_error(out, ref) < 1e-2, length


def test_compile_keeps_the_append():
    require_variant(torch.bfloat16, 128, 128, 0.0)
    gen = torch.Generator(device="cuda").manual_seed(2)
    b, hq, hkv, d, capacity = 2, 8, 2, 128, 512
    k_cache = torch.randn(b, capacity, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_new = torch.randn_like(k_new)
    seqlens = torch.tensor([7, 300], dtype=torch.int32, device="cuda")

    def step(q, k_cache, v_cache, seqlens, k_new, v_new):
        return fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new) * 2

    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    expect = step(q, k_eager, v_eager, seqlens, k_new, v_new)
    got = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, seqlens, k_new, v_new)
    assert torch.equal(got, expect)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)


def test_flash_attn_signature():
    require_variant(torch.bfloat16, 128, 128, 0.0)
    gen = torch.Generator(device="cuda").manual_seed(3)
    k_cache = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, 4, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor([40, 200], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                           return_softmax_lse=True)
    expect, expect_lse = fa4.attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=True, return_lse=True)
    assert torch.equal(out, expect) and torch.equal(lse, expect_lse)


@pytest.mark.parametrize("interleaved", [True, False])
def test_flash_attn_rotary_matches_the_cpu_path(interleaved):
    """rotary_cos/rotary_sin (fa4.rotary, torch operations before the kernel) on CUDA against the
    same call in float64 on the CPU: the keys the cache receives and the output."""
    require_variant(torch.bfloat16, 128, 128, 0.0)
    gen = torch.Generator(device="cuda").manual_seed(4)
    b, hq, hkv, d, capacity, new = 2, 8, 2, 128, 256, 3
    k_cache = torch.randn(b, capacity, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, new, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new, v_new = (torch.randn(b, new, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    angles = torch.arange(capacity, device="cuda")[:, None] * 10000.0 ** (-torch.arange(32, device="cuda") / 32)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()  # rotary_dim 64 of 128
    seqlens = torch.tensor([17, 200], dtype=torch.int32, device="cuda")
    cpu = [t.cpu().double() for t in (q, k_cache, v_cache, k_new, v_new, cos, sin)]
    out = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=seqlens, causal=True, rotary_interleaved=interleaved)
    expect = fa4.flash_attn_with_kvcache(cpu[0], cpu[1], cpu[2], k=cpu[3], v=cpu[4], rotary_cos=cpu[5],
                                         rotary_sin=cpu[6], cache_seqlens=seqlens.cpu(), causal=True,
                                         rotary_interleaved=interleaved)
    assert rel_error(out.cpu(), expect) < 1e-2
    for i, n in enumerate(seqlens.tolist()):
        # bf16 keys rotated in fp32 on both paths, stored in bf16 on CUDA.
        torch.testing.assert_close(k_cache[i, n:n + new].double().cpu(), cpu[1][i, n:n + new], atol=2e-2, rtol=2e-2)
