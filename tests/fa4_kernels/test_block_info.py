"""K/V block ranges (fa4_kernels.block_info.BlockInfo) against brute force on small shapes.
The kernels call the same methods with DSL integers; here they run on Python ints."""
import random

import pytest

from fa4_kernels.block_info import BlockInfo

INF = 1 << 30


def visible(row, key, seqlen_q, seqlen_k, left, right):
    offset = seqlen_k - seqlen_q
    return row + offset - left <= key <= row + offset + right


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
        shift = (-seqlen_q) % block_rows if mask != "none" else 0
        for m_block in range(-(-(seqlen_q + shift) // block_rows)):
            yield tile_n, block_rows, seqlen_q, seqlen_k, mask, left, right, shift, m_block


@pytest.mark.parametrize("chunk", range(4))
def test_block_ranges_cover_every_visible_key_and_skip_masks_only_where_safe(chunk):
    for i, (tile_n, block_rows, sq, sk, mask, left, right, shift, m_block) in enumerate(cases()):
        if i % 4 != chunk:
            continue
        info = BlockInfo(block_rows, tile_n, mask == "causal", mask == "local",
                         left if mask == "local" else None, right if mask == "local" else None)
        sq_tiled = sq + shift
        # DSL Int32 constants -> int
        n_min, n_max = map(int, info.n_block_range(sq_tiled, sk, m_block))
        assert 0 <= n_min < n_max <= max(1, -(-sk // tile_n))  # never empty
        first_row = m_block * block_rows - shift
        tile = range(first_row, min(first_row + block_rows, sq))  # rows above 0: computed, not stored
        rows = [r for r in tile if r >= 0]
        seen = {k // tile_n for r in rows for k in range(sk) if visible(r, k, sq, sk, left, right)}
        assert all(n_min <= b < n_max for b in seen), (first_row, sq, sk, mask, n_min, n_max, sorted(seen))
        # No block is visited in vain (the first and last hold a key some row of the tile sees).
        seen_tile = {k // tile_n for r in tile for k in range(sk) if visible(r, k, sq, sk, left, right)}
        if seen_tile:
            assert n_max - 1 in seen_tile and n_min in seen_tile
        if mask == "none":
            continue
        n_right = int(info.n_block_min_right_mask(sq_tiled, sk, m_block, n_min))
        n_left = int(info.n_block_min_no_left_mask(sq_tiled, sk, m_block, n_min))
        for b in range(n_min, n_max):
            keys = range(b * tile_n, min((b + 1) * tile_n, sk))
            if b < n_right:  # no per-element right-edge mask needed
                assert all(k <= r + sk - sq + right for r in rows for k in keys), (b, n_right)
            if b >= n_left:  # no left-edge mask needed
                assert all(k >= r + sk - sq - left for r in rows for k in keys), (b, n_left)
