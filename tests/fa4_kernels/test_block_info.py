"""K/V block ranges (fa4_kernels.block_info.BlockInfo) against brute force on small shapes.
The kernels call the same methods with DSL integers; here they run on Python ints."""
import random

from fa4_kernels.block_info import Q_PIECE_ROWS, BlockInfo, head_of_row, partial_tile_shift, row_in_head
from fa4_kernels.kv_cache import FEW_HEAD_ROWS

INF = 1 << 30


def visible_keys(row, seqlen_q, seqlen_k, left, right):
    """The keys row ``row`` attends to (bottom-right aligned window), as a range."""
    offset = seqlen_k - seqlen_q
    return range(max(0, row + offset - left), min(seqlen_k, row + offset + right + 1))


def blocks_seen(rows, seqlen_q, seqlen_k, left, right, tile_n):
    seen = set()
    for r in rows:
        keys = visible_keys(r, seqlen_q, seqlen_k, left, right)
        if keys:
            seen.update(range(keys[0] // tile_n, keys[-1] // tile_n + 1))
    return seen


def cases():
    rng = random.Random(0)
    for _ in range(400):
        tile_n = rng.choice([16, 64, 80, 128])
        block_rows = rng.choice([16, 64, 128, 192])
        seqlen_q, seqlen_k = rng.randint(1, 700), rng.randint(1, 700)
        mask = rng.choice(["none", "causal", "local"])
        left, right = (INF, INF) if mask == "none" else (INF, 0) if mask == "causal" else (
            rng.choice([0, 5, 100, 333]), rng.choice([0, 7, 64, 250]))
        # Tiles as the kernel lays them out: causal/local ones shifted so that the first is the
        # partial one, which BlockInfo sees as a sequence of seqlen_q + shift rows.
        shift = 0
        if mask != "none":
            shift = partial_tile_shift(block_rows, seqlen_q)
            assert 0 <= shift < block_rows and (seqlen_q + shift) % block_rows == 0  # last tile full
        for m_block in range(-(-(seqlen_q + shift) // block_rows)):
            yield tile_n, block_rows, seqlen_q, seqlen_k, mask, left, right, shift, m_block


def test_block_ranges_cover_every_visible_key_and_skip_masks_only_where_safe():
    for tile_n, block_rows, sq, sk, mask, left, right, shift, m_block in cases():
        info = BlockInfo(block_rows, tile_n, mask == "causal", mask == "local",
                         left if mask == "local" else None, right if mask == "local" else None)
        sq_tiled = sq + shift
        # DSL Int32 constants -> int
        n_min, n_max = map(int, info.n_block_range(sq_tiled, sk, m_block))
        assert 0 <= n_min < n_max <= max(1, -(-sk // tile_n))  # never empty
        first_row = m_block * block_rows - shift
        tile = range(first_row, min(first_row + block_rows, sq))  # rows above 0: computed, not stored
        rows = [r for r in tile if r >= 0]
        seen = blocks_seen(rows, sq, sk, left, right, tile_n)
        assert all(n_min <= b < n_max for b in seen), (first_row, sq, sk, mask, n_min, n_max, sorted(seen))
        # No block is visited in vain (the first and last hold a key some row of the tile sees).
        seen_tile = blocks_seen(tile, sq, sk, left, right, tile_n)
        if seen_tile:
            assert n_max - 1 in seen_tile and n_min in seen_tile
        if mask == "none":
            continue
        n_right = int(info.n_block_min_right_mask(sq_tiled, sk, m_block, n_min))
        n_left = int(info.n_block_min_no_left_mask(sq_tiled, sk, m_block, n_min))
        offset = sk - sq
        for b in range(n_min, n_max):
            first_key, last_key = b * tile_n, min((b + 1) * tile_n, sk) - 1
            if b < n_right:  # no per-element right-edge mask: every key visible from every row
                assert last_key <= rows[0] + offset + right, (b, n_right)
            if b >= n_left:  # no left-edge mask needed
                assert first_key >= rows[-1] + offset - left, (b, n_left)


def test_packed_rows_by_shifts_match_division_by_block_rows():
    """TileRows maps a tile row to (head offset, row) with shifts and a division by the
    compile-time tile_m; it must agree with dividing by block_rows = tile_m / pack_gqa for every
    tile shape and pack the shim accepts (pack_gqa a power of two, block_rows a multiple of 8)."""
    for tile_m in (64, 128, 192, 256):
        for pack_log2 in range(5):
            block_rows = tile_m >> pack_log2
            if block_rows % 8 or block_rows << pack_log2 != tile_m:
                continue
            for tile_row in range(tile_m):
                assert head_of_row(tile_row, tile_m, pack_log2) == tile_row // block_rows
                assert row_in_head(tile_row, tile_m, pack_log2) == tile_row % block_rows


def test_deterministic_dq_order_counts_the_k_v_blocks_that_visit_a_query_block():
    """The backward's CTA of K/V block n visits query blocks m_block_range(n); the blocks visiting
    one query block must be consecutive, from first_n_block_of(m) to last_n_block_of(m) (in
    deterministic mode each waits for the ones before it in its order), for every mask and
    shape, with the ranges' never-empty rule included."""
    rng = random.Random(1)
    for _ in range(600):
        tile_n, block_rows = rng.choice([(128, 64), (128, 128), (64, 64)])
        sq, sk = rng.randint(0, 700), rng.randint(1, 700)
        mask = rng.choice(["none", "causal", "local"])
        left, right = (rng.choice([0, 5, 100, 333, 1 << 30]), rng.choice([0, 7, 64, 250, 1 << 30])) \
            if mask == "local" else (None, None)
        info = BlockInfo(block_rows, tile_n, mask == "causal", mask == "local", left, right)
        n_blocks = -(-sk // tile_n)
        ranges = [tuple(map(int, info.m_block_range(sq, sk, n))) for n in range(n_blocks)]
        for m in range(max(1, -(-sq // block_rows))):
            visitors = [n for n, (lo, hi) in enumerate(ranges) if lo <= m < hi]
            if visitors:
                assert visitors == list(range(visitors[0], visitors[-1] + 1)), (sq, sk, mask, left, right, m)
                assert int(info.first_n_block_of(sq, sk, m)) == visitors[0], (sq, sk, mask, left, right, m)
                if mask != "none":  # masked kernels order the blocks from the last one down
                    assert int(info.last_n_block_of(sq, sk, m)) == visitors[-1], (sq, sk, mask, left, right, m)


def test_q_piece_rows_agree_with_the_native_rules():
    """The kernels' Q piece (block_info.Q_PIECE_ROWS) is the rows the native pack-GQA rules make a
    packed head's share a multiple of (FA4_Q_PIECE_ROWS, through fa4.heuristics), and the KV-cache
    kernels' fewer rows per head divide it (a piece holds whole heads' rows)."""
    from fa4 import heuristics

    assert heuristics.rules().fa4_q_piece_rows() == Q_PIECE_ROWS
    assert all(r < Q_PIECE_ROWS and Q_PIECE_ROWS % r == 0 for r in FEW_HEAD_ROWS)
