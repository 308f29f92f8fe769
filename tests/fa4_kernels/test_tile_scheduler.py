"""The tile schedulers (fa4_kernels.tile_scheduler) simulated on Python ints: the static
schedule with a split tail for every CTA (each unit of work done once, one merger per split
tile, and the writer/merger protocol the kernel relies on: no CTA waits on a CTA that waits),
and the tile order of the dynamic longest-first schedule (every tile once; with the host's
group size the SMs finish together)."""
import heapq
import random

import pytest

from fa4_kernels.tile_scheduler import (
    MERGER,
    UNBOUNDED_BLOCKS,
    WHOLE,
    WRITER,
    SplitTail,
    StaticPersistentScheduler,
    scale_piece,
)


def work_of(split, cta):
    """Everything ``cta`` does, as the kernel walks it (SplitTail.work until an invalid item):
    (tile, first block, end block) with whole tiles as (tile, 0, n_blocks)."""
    share, item = split.for_cta(cta), 0
    while True:
        tile, lo, hi, valid = share.work(item)
        if not valid:
            return
        yield tile, lo, min(hi, split.n_blocks)
        item += 1


def pieces_of(split, cta):
    """``cta``'s pieces of split tail tiles: (tail tile, first block, end block, role)."""
    first_tail = split.full_rounds * split.grid
    for tile, lo, hi in work_of(split, cta):
        if tile >= first_tail and split.ctas > 0:
            yield tile - first_tail, lo, hi, split.role(lo, hi)


def cases():
    rng = random.Random(1)
    yield 2048, 132, 32, 132  # hd128 at 4k in the benchmark setup
    yield 3072, 132, 8, 132  # hd64 at 1k
    yield 8, 132, 64, 132  # decoding: fewer tiles than SMs, each split many ways
    yield 133, 132, 4, 2
    for _ in range(100):
        grid = rng.choice([1, 2, 7, 16, 132])
        yield rng.randint(1, 5 * grid), grid, rng.randint(1, 70), rng.randint(0, grid + 3)


def test_a_planned_split_tail_is_the_same_split():
    """The launch's values computed once (on the host in the kernels: SplitTail.planned) give every
    CTA the same share, pieces, roles and owners as computing them per CTA."""
    for num_tiles, grid, n_blocks, tail_ctas in cases():
        split = SplitTail(num_tiles, grid, n_blocks, tail_ctas)
        planned = split.planned()
        assert (planned.full_rounds, planned.units, planned.ctas) == (split.full_rounds, split.units, split.ctas)
        if split.ctas:
            assert planned.tail_tiles() == split.tail_tiles() == num_tiles - split.full_rounds * grid
        for cta in range(grid):
            a, b = split.for_cta(cta), planned.for_cta(cta)
            fields = lambda s: (s.first, s.end, s.first_tile, s.rounds, s.split)  # noqa: E731
            assert fields(a) == fields(b)
            assert [a.work(i) for i in range(a.rounds + 3)] == [b.work(i) for i in range(b.rounds + 3)]
            if cta < split.ctas:
                assert a.writers(cta) == b.writers(cta) and a.first_piece_merger() == b.first_piece_merger()
        assert [split.owner(u) for u in range(split.units)] == [planned.owner(u) for u in range(split.units)]


def test_split_tail_covers_every_unit_once_with_one_merger_per_split_tile():
    for num_tiles, grid, n_blocks, tail_ctas in cases():
        split = SplitTail(num_tiles, grid, n_blocks, tail_ctas)
        tail_tiles = num_tiles - split.full_rounds * grid
        assert split.units == tail_tiles * n_blocks
        assert 0 <= split.ctas <= min(grid, max(tail_ctas, 0))
        if split.ctas == 0:  # the unsplit snake: every tile once, whole
            seen = sorted(t for cta in range(grid) for t, lo, hi in work_of(split, cta) if (lo, hi) == (0, n_blocks))
            assert seen == list(range(num_tiles))
            continue
        assert split.start(0) == 0 and split.start(split.ctas) == split.units
        shares = [split.start(c + 1) - split.start(c) for c in range(split.ctas)]
        assert max(shares) - min(shares) <= 1  # balanced
        for c in range(split.ctas):  # the first and last unit of every share
            assert split.owner(split.start(c)) == c == split.owner(split.start(c + 1) - 1)
        covered = [[0] * n_blocks for _ in range(tail_tiles)]
        mergers, writers = {}, {}
        for cta in range(grid):
            got = list(pieces_of(split, cta))
            if cta >= split.ctas:
                assert got == []
                continue
            for idx, (tile, lo, hi, role) in enumerate(got):
                assert 0 <= lo < hi <= n_blocks and 0 <= tile < tail_tiles
                for b in range(lo, hi):
                    covered[tile][b] += 1
                if role == WRITER:
                    assert idx == 0 and lo > 0  # only a share's first piece writes: one slot per CTA
                    writers.setdefault(tile, []).append(cta)
                elif role == MERGER:
                    assert idx == len(got) - 1 and lo == 0 and hi < n_blocks  # a share's last piece
                    assert tile not in mergers
                    mergers[tile] = cta
                else:
                    assert role == WHOLE and (lo, hi) == (0, n_blocks)
        assert all(c == 1 for row in covered for c in row)
        # Every tile's every block exactly once over all CTAs' work, full rounds included.
        done = [[0] * n_blocks for _ in range(num_tiles)]
        for cta in range(grid):
            for tile, lo, hi in work_of(split, cta):
                for b in range(lo, hi):
                    done[tile][b] += 1
        assert all(c == 1 for row in done for c in row), (num_tiles, grid, n_blocks, tail_ctas)
        assert set(mergers) == set(writers)
        for tile, cta in mergers.items():
            # The kernel's merge loop: the CTAs right after the merger.
            assert list(range(cta + 1, cta + 1 + split.writers(cta))) == sorted(writers[tile])


def test_distributed_merge_pieces_agree_on_their_tile_and_own_distinct_slots():
    """split_partials' distributed merging, as the kernel computes it per piece: the tile's block-0
    CTA (``first_piece_merger`` for a writing piece), the piece count (its writers + 1) and the
    piece's index. Every piece of a tile must agree on the first two and hold a distinct index,
    the indices must be the CTAs from the block-0 one on, and no two pieces of a launch may share
    a partial slot (2 per CTA) or a pair of counters (one per block-0 CTA)."""
    from fa4_kernels.split_partials import SplitPartials
    for num_tiles, grid, n_blocks, tail_ctas in cases():
        split = SplitTail(num_tiles, grid, n_blocks, tail_ctas)
        tiles, slots = {}, set()
        for cta in range(split.ctas):
            share = split.for_cta(cta)
            for tile, lo, hi, role in pieces_of(split, cta):
                if role == WHOLE:
                    continue
                merger = cta if role == MERGER else share.first_piece_merger()
                pieces, piece = split.writers(merger) + 1, cta - merger
                assert 0 <= piece < pieces and (piece == 0) == (role == MERGER)
                tiles.setdefault(tile, []).append((merger, pieces, piece))
                slot = SplitPartials.piece_slot(merger, piece)
                assert 0 <= slot < 2 * grid and slot not in slots
                slots.add(slot)
        mergers = [entries[0][0] for entries in tiles.values()]
        assert len(set(mergers)) == len(mergers)  # one pair of counters per split tile
        for entries in tiles.values():
            merger, pieces, _ = entries[0]
            assert all((m, p) == (merger, pieces) for m, p, _ in entries)
            assert sorted(i for _, _, i in entries) == list(range(pieces))


def test_no_split_without_tail_or_request():
    assert SplitTail(264, 132, 32, 132).ctas == 0  # full rounds only
    assert SplitTail(2048, 132, 32, 0).ctas == 0
    assert SplitTail(2048, 132, 32, 500).ctas == 132


def test_kernel_grid_agrees_with_the_host_split():
    """The host picks tail_ctas (fa4.heuristics.split_tail_ctas); the kernel launches
    min(num_sms, max(num_tiles, tail_ctas)) CTAs and must then split the same tail over exactly
    that many, finishing sooner than the unsplit last round would."""
    from fa4.heuristics import split_overhead_blocks, split_tail_ctas

    rng = random.Random(2)
    for _ in range(300):
        num_sms = rng.choice([4, 66, 132])
        num_tiles, n_blocks = rng.randint(1, 4 * num_sms), rng.randint(1, 200)
        head_dim_v = rng.choice([64, 128, 256])
        ctas = split_tail_ctas(num_tiles, num_sms, n_blocks, head_dim_v)
        if not ctas:
            continue
        grid = min(num_sms, max(num_tiles, ctas))
        split = SplitTail(num_tiles, grid, n_blocks, ctas)
        assert split.ctas == ctas and split.units == (num_tiles % num_sms) * n_blocks
        overhead = split_overhead_blocks(head_dim_v)
        longest = max(sum(hi - lo + overhead for _, lo, hi, _ in pieces_of(split, c)) for c in range(ctas))
        assert longest < n_blocks + overhead  # sooner than one more whole tile


def tile_order(num_m_blocks, num_heads, num_batches, heads_per_group, longest_first=True, fast=False):
    """The kernel's tile order, (m_block, head, batch) per tile index, through the same
    ``coordinates`` the kernel runs (``fast``: the with_fast_division path, divisors as ints)."""
    sched = StaticPersistentScheduler(num_m_blocks, num_heads, num_batches, heads_per_group, longest_first, 128)
    if fast:
        sched = sched.with_fast_division(lambda d: d)
    return [sched.coordinates(t) for t in range(sched.num_tiles)]


def test_tile_order_covers_every_tile_once_in_groups():
    rng = random.Random(3)
    shapes = [(32, 16, 4, 7), (8, 12, 3, 30), (5, 7, 1, 3), (1, 1, 1, 1), (3, 5, 2, 4)]
    shapes += [(rng.randint(1, 40), rng.randint(1, 20), rng.randint(1, 6), rng.randint(1, 50)) for _ in range(60)]
    for m_blocks, heads, batches, hpg in shapes:
        num_hb = heads * batches
        for fast in (False, True):
            order = tile_order(m_blocks, heads, batches, hpg, fast=fast)
            assert sorted(order) == sorted((m, h, b) for m in range(m_blocks) for h in range(heads)
                                           for b in range(batches))
            # Groups of heads_per_group pairs, the last one with the remainder too (never a short
            # group at the end of the schedule), each group's tiles together, m_block-major.
            group = min(hpg, num_hb)  # the kernel's groups when heads_per_group > pairs: one
            last = num_hb // group - 1
            group_of = [min((b * heads + h) // group, last) for _, h, b in order]
            assert group_of == sorted(group_of)
            for g in range(last + 1):
                size = group if g < last else num_hb - last * group
                assert group <= size < 2 * group
                tiles = [order[t] for t in range(len(order)) if group_of[t] == g]
                assert len(tiles) == size * m_blocks
                assert [m for m, _, _ in tiles] == sorted((m for m, _, _ in tiles), reverse=True)  # longest first


def makespan_ratio(order, num_sms, tile_cost):
    """The dynamic schedule: CTA c starts with tile c, then each CTA that finishes claims the next
    tile of ``order``. Returns the busiest CTA's time over the average."""
    free = [(tile_cost(order[c]), c) for c in range(min(num_sms, len(order)))]
    heapq.heapify(free)
    for tile in order[len(free):]:
        end, cta = heapq.heappop(free)
        heapq.heappush(free, (end + tile_cost(tile), cta))
    total = sum(tile_cost(t) for t in order)
    return max(end for end, _ in free) / (total / num_sms)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen", [1024, 2048, 3000, 4096, 8192, 16384])
def test_causal_schedule_ends_evenly(head_dim, seqlen):
    """Causal on an H200 (132 SMs, 60 MB L2), tiles costing their K/V blocks plus ~2.2 blocks at
    the boundary (docs/perf_notes.md, eighth session), with fa4.heuristics.heads_per_group's
    groups: the busiest SM works at most 3.5% longer than the average in the FlashAttention
    benchmark shapes (16k tokens, hidden 2048; ncu measured 1.11x at hd128 4k with the previous
    groups, where this model gives 1.09x), at most 2% longer with 16+ tiles per SM, and at most
    10% with 4-16 (where L2-sized groups trade some balance for L2 hits; the previous groups
    left up to 25%)."""
    from fa4.heuristics import heads_per_group
    from fa4_kernels.catalog import VariantKey
    from fa4_kernels.heuristics import fwd_config

    cfg = fwd_config(VariantKey("sm_90a", "bf16", head_dim, head_dim, "causal", False))
    tile_m, tile_n = cfg.tile_m, cfg.tile_n
    num_m_blocks = -(-seqlen // tile_m)
    shift = (-seqlen) % tile_m  # the partial tile first (block_info.row_shift)

    def cost(tile):
        return -(-min((tile[0] + 1) * tile_m - shift, seqlen) // tile_n) + 2.2

    benchmark = (2048 // head_dim, 16384 // seqlen)
    for heads, batches in (benchmark, (12, 3), (32, 1), (40, 2), (28, 4), (16, 7), (32, 8)):
        hpg = heads_per_group(60 << 20, seqlen, head_dim, head_dim, 2, heads * batches, mask="causal",
                              num_m_blocks=num_m_blocks, num_sms=132)
        ratio = makespan_ratio(tile_order(num_m_blocks, heads, batches, hpg), 132, cost)
        tiles_per_sm = num_m_blocks * heads * batches / 132
        if (heads, batches) == benchmark:
            assert ratio <= 1.035, (hpg, ratio)
        if tiles_per_sm >= 16:
            assert ratio <= 1.02, (heads, batches, hpg, ratio)
        elif tiles_per_sm >= 4:
            assert ratio <= 1.10, (heads, batches, hpg, ratio)


def test_kv_cache_pieces_scaled_onto_shorter_sequences_cover_them_once():
    # A KV cache's split counts blocks of its capacity; each piece is scaled onto its sequence's
    # blocks (fwd.block_range), and the scaled pieces of a tile must cover exactly that
    # sequence's blocks, each once, each piece about its share. Whole tiles keep the sequence.
    rng = random.Random(2)
    for num_tiles, grid, n_bound, tail_ctas in cases():
        split = SplitTail(num_tiles, grid, n_bound, tail_ctas)
        n_seq = {t: rng.randint(1, n_bound) for t in range(num_tiles)}  # the blocks each tile's sequence holds
        covered = {t: [] for t in range(num_tiles)}
        for cta in range(grid):
            for tile, lo, hi in work_of(split, cta):
                a, b = scale_piece(lo, hi if (lo, hi) != (0, n_bound) else UNBOUNDED_BLOCKS, n_seq[tile], n_bound)
                covered[tile] += range(a, b)
                assert b - a <= -(-(hi - lo) * n_seq[tile] // n_bound) + 1  # about its share
        for tile, blocks in covered.items():
            assert sorted(blocks) == list(range(n_seq[tile])), (num_tiles, grid, n_bound, tail_ctas, tile)
    # A piece past a CTA's share may end below 0: it scales to an empty piece (the kernel's
    # FastDivmod division is unsigned, so the end is clamped to 0 before it divides).
    for lo, hi in [(0, -5), (3, -1), (2, 0)]:
        a, b = scale_piece(lo, hi, 7, 16, by_n_bound=16)
        assert b <= a and b >= 0, (lo, hi, a, b)


@pytest.mark.parametrize("blocks,heads,batches,q_per_kv",
                         [(32, 8, 4, 4), (32, 16, 4, 1), (32, 32, 4, 1), (64, 16, 1, 1)])
def test_causal_backward_launch_groups_end_evenly(blocks, heads, batches, q_per_kv):
    """The causal backward's CTAs (K/V block n of (batch, head): its query blocks from n on, for
    every query head of the group) started in launch order as SMs free up (132 SMs). In the grid's
    order the last pairs' longest blocks start last (GQA 32/8 at 4 x 4k: the busiest SM works 14%
    longer than the average; fa4 measured 8% faster with groups); the groups of
    fa4.heuristics.bwd_launch_group, through the forward's ``coordinates``, end within 1%."""
    from fa4 import heuristics as rules
    from fa4_kernels.catalog import VariantKey
    from fa4_kernels.heuristics import bwd_config

    cfg = bwd_config(VariantKey("sm_90a", "bf16", 128, 128, "local", False, kernel="bwd"))
    group = rules.bwd_launch_group("causal", varlen=False, deterministic=False)
    assert group > 0
    per_block = cfg.tile_n // cfg.tile_m  # query blocks per K/V block on the diagonal

    def cost(cta):
        return (blocks - cta[0]) * per_block * q_per_kv + 2

    grid = [(n, h, b) for b in range(batches) for h in range(heads) for n in range(blocks)]
    grouped = tile_order(blocks, heads, batches, group, longest_first=False)
    assert sorted(grouped) == sorted(grid)
    assert makespan_ratio(grouped, 132, cost) <= 1.01
    if (blocks, heads, batches) != (32, 32, 4):
        assert makespan_ratio(grid, 132, cost) >= 1.05
