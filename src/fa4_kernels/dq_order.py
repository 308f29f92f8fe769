"""The order of the backward's visits without a mask: where each K/V block starts in its
query range, and, in deterministic mode, the turn it takes in each query block's dQ additions.

Rotation: the K/V blocks of a head are cut into chunks of ``period`` consecutive blocks (the last
one may be shorter), and block ``local`` of a chunk of ``size`` starts at query block
``local * m_blocks // size`` of its range and wraps round. The blocks of a chunk then work on
different query blocks at any time instead of all on query block 0 at once.

Turns (deterministic mode): a query block's additions go chunk by chunk, and inside a chunk in the
order the blocks reach it, one query block per step: first the block that starts there (or the
nearest start below it), then the next start below, wrapping round to the chunk's last starts;
blocks sharing a start (more K/V blocks than query blocks) go in block order. A block then waits
only for blocks that reached the query block at an earlier step, never for one behind it, so the
turns cost no skew. They do let a block wait for a block launched after it (a later block of its
chunk), which cannot deadlock while a whole chunk is resident at once: the host keeps ``period``
at most the number of CTAs the GPU holds (one per SM), and with the chunks' turns ascending a CTA
otherwise waits only for CTAs launched before it (the grid's x is the K/V block, so a head's
blocks launch together). With one chunk (``period`` >= the blocks) this is the plain rotation.

Pure integer arithmetic: DSL integers in the kernel, Python ints in the CPU tests.
"""
import cutlass


def _chunk(n_block, n_blocks, period):
    """(first block of n_block's chunk, n_block's place in it, the chunk's size)."""
    chunk_first = n_block // period * period
    return chunk_first, n_block - chunk_first, cutlass.min(period, n_blocks - chunk_first)


def rotation_start(n_block, n_blocks, m_blocks, period):
    """How many query blocks into its range of ``m_blocks`` K/V block ``n_block`` (of
    ``n_blocks``) starts."""
    _, local, size = _chunk(n_block, n_blocks, period)
    return local * m_blocks // size


def _starts_up_to(x, size, m_blocks):
    """Blocks of a chunk of ``size`` whose start is <= x (x >= -1): local * m_blocks // size <= x
    holds for local < (x + 1) * size / m_blocks."""
    return cutlass.min(size, ((x + 1) * size + m_blocks - 1) // m_blocks)


def rotated_turn(n_block, visit, n_blocks, m_blocks, period):
    """K/V block n_block's turn (0-based, among the n_blocks blocks) in the dQ additions of the
    query block ``visit`` blocks into the range (0 <= visit < m_blocks)."""
    chunk_first, local, size = _chunk(n_block, n_blocks, period)
    start = local * m_blocks // size
    at_or_below = _starts_up_to(visit, size, m_blocks)
    # Blocks with a start in (start, visit], cyclically: they reached the query block earlier.
    earlier = (at_or_below - _starts_up_to(start, size, m_blocks) + size) % size
    same_start_before = local - _starts_up_to(start - 1, size, m_blocks)
    return chunk_first + earlier + same_start_before
