"""The split tail's partials layout (src/fa4_kernels/split_partials.py) against the workspace the
shim allocates (csrc_shims/fa4_shim.c, fa4_split_workspace: tile_m * (head_dim_v + 8) fp32 words
per CTA slot)."""
import pytest

pytest.importorskip("cutlass")
from fa4_kernels.split_partials import CHUNK, chunk_index, partial_words_per_thread  # noqa: E402


@pytest.mark.parametrize("head_dim_v", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("warpgroups", [1, 2, 3])
def test_chunks_fill_the_shims_slots_once(head_dim_v, warpgroups):
    threads, tile_m, slots = 128 * warpgroups, 64 * warpgroups, 3
    words = partial_words_per_thread(head_dim_v)
    assert words % CHUNK == 0  # a thread's words are whole chunks
    slot_words = tile_m * (head_dim_v + 8)
    seen = set()
    for slot in range(slots):
        for t in range(threads):
            for w in range(0, words, CHUNK):
                first = chunk_index(slot, w, t, words, threads) * CHUNK
                # every chunk inside its own slot, and no word written twice
                assert slot * slot_words <= first and first + CHUNK <= (slot + 1) * slot_words
                seen.update(range(first, first + CHUNK))
    assert seen == set(range(slots * slot_words))


def test_a_warps_chunks_are_contiguous():
    # One chunk index over a warp's 32 threads: 512 contiguous bytes (one 128-bit access each).
    words, threads = partial_words_per_thread(128), 256
    for slot, w, warp in [(0, 0, 0), (5, 64, 3), (2, 32, 7)]:
        firsts = [chunk_index(slot, w, warp * 32 + lane, words, threads) for lane in range(32)]
        assert firsts == list(range(firsts[0], firsts[0] + 32))


def test_distributed_merging_where_one_merger_would_read_much():
    from fa4_kernels.split_partials import distributes
    # (CTAs sharing the tail, split tiles, rows holding a query, head_dim_v): the H100 cases
    # split_partials.DISTRIBUTED_MIN_BYTES was set from (bf16 hd128 KV cache, 32/8 heads).
    assert not distributes(128, 8, 4, 128)  # one token at 1 x 4k / 1 x 32k: 16 pieces of 4 rows
    assert not distributes(128, 8, 8, 128)  # 2 tokens
    assert distributes(128, 8, 16, 128)  # 4 tokens (session 57: 15% faster so at 1 x 4k)
    assert distributes(128, 8, 32, 128)  # 8 tokens
    assert not distributes(128, 64, 32, 128)  # 8 x 32k: 2 pieces a tile


@pytest.mark.parametrize("num_tiles, n_blocks, ctas, one_piece", [
    (8, 32, 128, 1),  # 8-token verification at 1 x 4k: 16 pieces of 2 blocks a tile
    (8, 48, 128, 1),  # ... at 6k: 3 blocks a piece
    (8, 33, 128, 0),  # a capacity of 33 blocks: shares of 2 or 3 blocks straddle two tiles
    (160, 256, 132, 0),  # 64-row tiles, 1 x 300 queries at 32k: a round, then 28 tiles over 132 CTAs
    (288, 64, 120, 0),  # 4 x 129 queries at 8k: 24 tiles over 120 CTAs, 12.8 blocks a share
])
def test_distributed_merging_only_where_no_cta_holds_two_pieces(num_tiles, n_blocks, ctas, one_piece):
    """A CTA with pieces of two tiles would chain the distributed waits through every split tile
    (split_partials.distributes): such launches keep the single merger. Checked against the shares
    themselves: the pieces each CTA's work list holds."""
    from fa4_kernels.split_partials import distributes
    from fa4_kernels.tile_scheduler import SplitTail
    split = SplitTail(num_tiles, 132, n_blocks, ctas).planned()
    assert split.one_piece_per_cta() == one_piece
    most = 0
    for cta in range(132):
        mine = split.for_cta(cta)
        pieces = [mine.work(item) for item in range(mine.full_rounds, mine.full_rounds + 3)]
        most = max(most, sum(valid for *_, valid in pieces))
    assert (most == 1) == bool(one_piece)
    assert distributes(ctas, split.tail_tiles(), 32, 128, split.one_piece_per_cta()) == bool(one_piece)


# tests/gpu/test_kv_cache_gpu.py::test_verification_merged_by_every_piece's launches:
# (heads_q, heads_kv, seqlen_q, cache capacity, head_dim, head_dim_v).
DISTRIBUTED_GPU_SHAPES = [(32, 8, 8, 6144, 128, 128), (16, 2, 16, 4096, 64, 64), (8, 2, 8, 4096, 192, 128)]


@pytest.mark.parametrize("shape", DISTRIBUTED_GPU_SHAPES)
def test_the_gpu_tests_distributed_shapes_merge_distributed(shape):
    """The GPU test of distributed merging must take that path on a 132-SM Hopper: the launch's
    tiles and split as the host computes them (fa4.heuristics, the native rules), then the rule."""
    from fa4.heuristics import pack_gqa_factor, split_tail_ctas
    from fa4_kernels import catalog
    from fa4_kernels.heuristics import kv_cache_fwd_config
    from fa4_kernels.kv_cache import FEW_HEAD_ROWS
    from fa4_kernels.split_partials import distributes
    from fa4_kernels.tile_scheduler import SplitTail
    hq, hkv, sq, capacity, d, dv = shape
    (mask,) = catalog.KV_CACHE_MASKS
    cfg = kv_cache_fwd_config(catalog.VariantKey("sm_90a", "bf16", d, dv, mask, False, kv_cache=True))
    assert cfg.distributed_merge
    pack = pack_gqa_factor(hq, hkv, sq, cfg.tile_m, head_rows=min(FEW_HEAD_ROWS))
    block_rows = cfg.tile_m // pack
    tiles = (hq // pack) * -(-sq // block_rows)
    n_blocks = -(-capacity // cfg.tile_n)
    ctas = split_tail_ctas(tiles, 132, n_blocks, dv, min(sq, block_rows) * pack)
    assert ctas > tiles
    one_piece = SplitTail(tiles, 132, n_blocks, ctas).planned().one_piece_per_cta()
    assert distributes(ctas, tiles, min(sq, block_rows) * pack, dv, one_piece)
