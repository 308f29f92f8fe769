"""The backward preprocess's host-checkable rules: its rows that see no key (the per-sequence
zeroing of packed sequences' dQ accumulator) against the native rule the dense path uses,
fa4_keyless_rows; the flat grid over packed sequences' statistics blocks against the layout
the main kernel reads (bwd.stats_offset) and the rows the host allocates (fa4_stats_rows); how
every head dim's rows split over a CTA's threads."""
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("cutlass")

from fa4 import heuristics  # noqa: E402
from fa4_kernels import catalog  # noqa: E402
from fa4_kernels.heuristics import STATS_BLOCK_ROWS  # noqa: E402
from fa4_kernels.sm90.bwd import stats_offset  # noqa: E402
from fa4_kernels.sm90.bwd_preprocess import (  # noqa: E402
    ROWS_PER_CTA, THREADS, first_stats_block, row_plan, rows_before_first_key)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (False, (-1, 7)),
                                           (False, (4, -1)), (False, (0, 0))])
def test_rows_before_first_key_is_the_native_rule(causal, window):
    mask = heuristics.resolve_mask(causal, *window)
    for sq in (1, 2, 63, 64, 70, 129, 300, 6339):
        for sk in (1, 3, 64, 70, 200, 6339, 1 << 29):
            got = rows_before_first_key(sq, sk, mask.window_right)
            assert got == heuristics.keyless_rows(sq, sk, mask), (sq, sk, mask)


def flat_block_owner(cu, flat_block, tile_m):
    """find_block's answer in Python: the last sequence whose first statistics block is at or
    before flat_block (-1: none), from the count of those (a prefix of the sequences)."""
    starts = [first_stats_block(cu[i], i, tile_m) for i in range(len(cu) - 1)]
    count = sum(1 for s in starts if s <= flat_block)
    assert all(s <= flat_block for s in starts[:count])  # a prefix: the kernel counts by ballots
    return count - 1


@pytest.mark.parametrize("seed", range(6))
def test_flat_grid_covers_every_statistics_block_once(seed):
    """Each CTA of the packed grid (x over fa4_stats_rows / tile_m blocks) finds its sequence and
    block; together they write every block the main kernel reads (each sequence's first max(ceil(
    seqlen / tile_m), 1) blocks from stats_offset) exactly once, and no CTA writes past the rows."""
    rng = random.Random(seed)
    tile_m = STATS_BLOCK_ROWS
    n = rng.choice([1, 2, 8, 127, 128, 129, 300])
    lens = [rng.choice([0, 1, rng.randrange(1, 3 * tile_m), tile_m, 2 * tile_m]) for _ in range(n)]
    cu = [rng.randrange(0, 50)]
    for length in lens:
        cu.append(cu[-1] + length)
    total = cu[-1] + rng.randrange(0, 200)
    grid = heuristics.stats_rows(total, tile_m, n) // tile_m
    written = {}
    for x in range(grid):
        seq = flat_block_owner(cu, x, tile_m)
        if seq < 0:
            continue
        start = stats_offset(SimpleNamespace(offset_q=cu[seq]), seq, tile_m, True)
        m_block = x - start // tile_m
        if m_block < max(-(-lens[seq] // tile_m), 1):
            assert x not in written
            written[x] = (seq, m_block)
    needed = {}
    for i, length in enumerate(lens):
        start = stats_offset(SimpleNamespace(offset_q=cu[i]), i, tile_m, True) // tile_m
        for m in range(max(-(-length // tile_m), 1)):
            needed[start + m] = (i, m)
    assert written == needed
    assert max(needed) < grid


def test_first_stats_block_is_the_main_kernels_layout():
    rng = random.Random(0)
    for _ in range(1000):
        offset, i = rng.randrange(0, 1 << 20), rng.randrange(0, 5000)
        assert first_stats_block(offset, i, STATS_BLOCK_ROWS) * STATS_BLOCK_ROWS == stats_offset(
            SimpleNamespace(offset_q=offset), i, STATS_BLOCK_ROWS, True)


def test_row_plan_fits_every_head_dim():
    """Every head dim's rows split evenly over the threads and passes, each thread's loads all in
    flight at once within ~64 registers of data (16 vectors of O and dO)."""
    dims = {(k.head_dim, k.head_dim_v) for k in catalog.all_variants() if k.kernel == "bwd_pre"}
    assert (128, 128) in dims and (256, 256) in dims
    for _, dv in dims:
        threads_per_row, vectors, passes = row_plan(dv)
        assert threads_per_row * vectors * 8 == dv and THREADS % threads_per_row == 0
        assert passes >= 1 and passes * (THREADS // threads_per_row) == ROWS_PER_CTA
        assert 2 * vectors * passes <= 16
    assert STATS_BLOCK_ROWS % ROWS_PER_CTA == 0
