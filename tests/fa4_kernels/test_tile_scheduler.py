"""The static schedule with a split tail (fa4_kernels.tile_scheduler.SplitTail) simulated on
Python ints for every CTA: each unit of work done once, one merger per split tile, and the
writer/merger protocol the kernel relies on (no CTA waits on a CTA that waits)."""
import random

from fa4_kernels.tile_scheduler import MERGER, WHOLE, WRITER, SplitTail


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
