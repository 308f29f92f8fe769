"""Which K/V blocks a query tile visits, and which of them need masking.

Masks are aligned to the bottom-right corner when seqlen_q != seqlen_k (as FlashAttention
does): query row i may see key j iff  i + (seqlen_k - seqlen_q) - window_left <= j
<= i + (seqlen_k - seqlen_q) + window_right. Causal is window (inf, 0).
"""
from dataclasses import dataclass, replace
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class BlockInfo:
    # Query rows of one head per tile: tile_m, or tile_m / pack_gqa when the tile stacks the
    # rows of pack_gqa heads (a run-time value then). Masks work on sequence rows.
    block_rows: Int32
    tile_n: cutlass.Constexpr[int]
    is_causal: cutlass.Constexpr[bool]
    is_local: cutlass.Constexpr[bool]
    window_left: Optional[Int32] = None  # local only; already clamped to >= 0 on the host
    window_right: Optional[Int32] = None

    def for_rows(self, rows):
        """This BlockInfo with ``rows``' (a TileRows) block_rows: the forward builds it per tile,
        from the tile's rows, so that no value derived from pack_gqa is held from before the
        roles split (ptxas spilled one such value in hd192x192's window kernels with softcap)."""
        return replace(self, block_rows=rows.block_rows)

    def n_block_range(self, seqlen_q, seqlen_k, m_block):
        """[n_block_min, n_block_max) of K/V blocks with at least one visible key.

        Never empty: a tile whose rows see no key still visits block 0, fully masked, so the
        producer and consumers agree on the trip count and the rows come out as O=0, LSE=-inf.
        """
        n_block_max = cute.ceil_div(seqlen_k, self.tile_n)
        offset = seqlen_k - seqlen_q
        if const_expr(self.is_causal or self.is_local):
            right = (m_block + 1) * self.block_rows + offset
            if const_expr(self.is_local):
                right = right + self.window_right
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(right, 0), self.tile_n))
        n_block_min = Int32(0)
        if const_expr(self.is_local):
            left = m_block * self.block_rows + offset - self.window_left
            n_block_min = cutlass.max(left, 0) // self.tile_n
        n_block_max = cutlass.max(n_block_max, 1)
        n_block_min = cutlass.min(n_block_min, n_block_max - 1)
        return n_block_min, n_block_max

    def n_block_max_of_rows(self, rows_end, seqlen_q, seqlen_k, n_block_min, n_block_max):
        """The right-edge bound of [n_block_min, n_block_max) for the query rows below sequence
        row ``rows_end`` (causal/local): a consumer warpgroup holding a tile's upper rows sees
        fewer blocks on the diagonal than the tile. Never below n_block_min + 1 (a warpgroup
        whose rows see no key still visits the tile's first block, fully masked)."""
        right = rows_end + seqlen_k - seqlen_q
        if const_expr(self.is_local):
            right = right + self.window_right
        bound = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(right, 0), self.tile_n))
        return cutlass.max(bound, n_block_min + 1)

    def n_block_min_right_mask(self, seqlen_q, seqlen_k, m_block, n_block_min):
        """Blocks at or above this index may hold keys right of some row's limit (causal/local)."""
        first_row_limit = m_block * self.block_rows + seqlen_k - seqlen_q + 1
        if const_expr(self.is_local):
            first_row_limit = first_row_limit + self.window_right
        return cutlass.max(n_block_min, cutlass.max(first_row_limit, 0) // self.tile_n)

    def n_block_min_no_left_mask(self, seqlen_q, seqlen_k, m_block, n_block_min):
        """Blocks below this index may hold keys left of some row's window (local only)."""
        if const_expr(not self.is_local):
            return n_block_min
        last_row_left = (m_block + 1) * self.block_rows - 1 + seqlen_k - seqlen_q - self.window_left
        return cutlass.max(n_block_min, cute.ceil_div(cutlass.max(last_row_left, 0), self.tile_n))

    # ----------------------------------------------------------------- backward: K/V-block view
    # A backward CTA owns K/V block n_block and walks query blocks of block_rows rows.
    def m_block_range(self, seqlen_q, seqlen_k, n_block):
        """[m_block_min, m_block_max) of query blocks with a row that sees a key of K/V block
        n_block. Never empty, as n_block_range: a block whose keys no row sees still visits
        query block m_block_min, fully masked, so its dK and dV come out as zeros."""
        m_block_max = cute.ceil_div(seqlen_q, self.block_rows)
        offset = seqlen_k - seqlen_q
        m_block_min = Int32(0)
        if const_expr(self.is_causal or self.is_local):
            # Key j is seen from row j - offset - window_right on.
            first_row = n_block * self.tile_n - offset
            if const_expr(self.is_local):
                first_row = first_row - self.window_right
            m_block_min = cutlass.max(first_row, 0) // self.block_rows
        if const_expr(self.is_local):
            # ... and up to row j - offset + window_left.
            rows_end = (n_block + 1) * self.tile_n - offset + self.window_left
            m_block_max = cutlass.min(m_block_max, cute.ceil_div(cutlass.max(rows_end, 0), self.block_rows))
        m_block_max = cutlass.max(m_block_max, 1)
        m_block_min = cutlass.min(m_block_min, m_block_max - 1)
        return m_block_min, m_block_max

    def first_n_block_of(self, seqlen_q, seqlen_k, m_block):
        """The lowest K/V block whose query range (``m_block_range``) holds query block m_block.
        Both ends of that range grow with n_block, so the blocks holding m_block are consecutive
        from this one on: the deterministic backward orders their dQ additions by n_block minus
        this. Causal and dense: 0; local: the first block whose last key a row of m_block (its
        first row, window_left to the left) still sees; query block 0 is in every block's range
        (the range is never empty)."""
        if const_expr(not self.is_local):
            return Int32(0)
        left = m_block * self.block_rows + (seqlen_k - seqlen_q) - self.window_left
        return cutlass.min(m_block, 1) * (cutlass.max(left, 0) // self.tile_n)

    def last_n_block_of(self, seqlen_q, seqlen_k, m_block):
        """The highest K/V block whose query range (``m_block_range``) holds query block m_block
        (causal/local; the blocks holding it run from first_n_block_of on). A block's range
        starts at or below m_block when its first seeing row is in or above m_block (B below)
        or when no row sees it and its range falls back to its last query block (A below,
        the K/V blocks whose window ends by query block m_block + 1; every block for the last
        query block)."""
        n_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        offset = seqlen_k - seqlen_q
        right = offset
        if const_expr(self.is_local):
            right = right + self.window_right
        below = cute.ceil_div(cutlass.max((m_block + 1) * self.block_rows + right, 0), self.tile_n)
        if const_expr(self.is_local):
            m_blocks = cutlass.max(cute.ceil_div(seqlen_q, self.block_rows), 1)
            ended = cutlass.max((m_block + 1) * self.block_rows + offset - self.window_left, 0) // self.tile_n
            ended = cutlass.max(ended, (m_block + 1) // m_blocks * n_blocks)
            below = cutlass.max(below, ended)
        return cutlass.min(below, n_blocks) - 1

    def m_block_min_no_right_mask(self, seqlen_q, seqlen_k, n_block, m_block_max):
        """Query blocks below this one may hold rows that must not see some key of K/V block
        n_block (causal/local right edge): from it on, every row sees every key of the block."""
        last_key = cutlass.min((n_block + 1) * self.tile_n, seqlen_k) - 1
        bound = last_key - (seqlen_k - seqlen_q)
        if const_expr(self.is_local):
            bound = bound - self.window_right
        return cutlass.min(cute.ceil_div(cutlass.max(bound, 0), self.block_rows), m_block_max)

    def m_block_max_no_left_mask(self, seqlen_q, seqlen_k, n_block, m_block_min):
        """Query blocks at or above this one may hold rows whose window starts after some key of
        K/V block n_block (local left edge); below it every row sees every key of the block."""
        rows_end = n_block * self.tile_n - (seqlen_k - seqlen_q) + self.window_left + 1
        return cutlass.max(cutlass.max(rows_end, 0) // self.block_rows, m_block_min)


# Pack-GQA tiles load Q in pieces of this many rows, each of one head (sm90/fwd.py; the KV-cache
# kernels' pieces may span heads: kv_cache.FEW_HEAD_ROWS), so a packed head's share of a tile is a
# multiple of it. The native rules' FA4_Q_PIECE_ROWS (fa4_rules.h) is the same number: the
# generated variant table asserts it (aot.generate_table), tests/fa4_kernels/test_block_info.py too.
Q_PIECE_ROWS = 8


@dataclass(frozen=True)
class TileRows:
    """Which query head and sequence row each row of a query tile holds.

    One head per tile (pack_gqa = 1): tile row r is row first_row + r of the tile's head, with
    first_row = m_block * tile_m - shift (see ``row_shift``: rows above row 0 are loaded as
    zeros, masked, and never stored).
    Pack-GQA: the tile stacks block_rows = tile_m / pack_gqa rows of each of pack_gqa query
    heads of one K/V head (the whole group or a power-of-two part of it; the scheduler's head
    counts these packs): tile row r is row first_row + r % block_rows of query head
    head_idx * pack_gqa + r // block_rows, first_row = m_block * block_rows.
    """
    tile_m: cutlass.Constexpr[int]
    pack_log2: Int32  # log2(pack_gqa): pack_gqa is a power of two (the shim checks)
    first_row: Int32  # sequence row of tile row 0 (negative when shifted)
    head_idx: Int32  # the scheduler's head: a pack of query heads when packed

    @property
    def pack_gqa(self):
        return Int32(1) << self.pack_log2

    @property
    def block_rows(self):
        # Recomputed where used rather than kept: one register less across the K/V loop.
        return Int32(self.tile_m) >> self.pack_log2

    def head(self, tile_row):
        return self.head_idx * self.pack_gqa + head_of_row(tile_row, self.tile_m, self.pack_log2)

    def row(self, tile_row):
        return self.first_row + row_in_head(tile_row, self.tile_m, self.pack_log2)


# Tile rows map to (head, row) by shifts and a division by the compile-time tile_m: a division
# by the run-time block_rows is a ~20-instruction sequence per use, and the epilogue's LSE
# stores, the mask and the tile set-up use it per row (measured: ~700 of the epilogue's cycles).
def head_of_row(tile_row, tile_m: int, pack_log2):
    """tile_row // block_rows, block_rows = tile_m >> pack_log2."""
    return (tile_row << pack_log2) // tile_m


def row_in_head(tile_row, tile_m: int, pack_log2):
    """tile_row % block_rows."""
    return tile_row - head_of_row(tile_row, tile_m, pack_log2) * (tile_m >> pack_log2)


def block_rows(tile_m: int, pack_gqa):
    """Sequence rows of one head in a tile (pack_gqa: a power of two). In the kernel a shift:
    the DSL's ``//`` is a signed floor division, whose result, taken before the roles split,
    ptxas kept in local memory in hd192x192's window kernels with softcap (3 words)."""
    if isinstance(pack_gqa, int):
        return tile_m // pack_gqa
    return Int32(tile_m) >> cute.arch.popc(pack_gqa - 1)


@cute.jit
def row_shift(tile_m: cutlass.Constexpr[int], pack_gqa: Int32, seqlen_q: Int32,
              partial_tile_first: cutlass.Constexpr[bool]) -> Int32:
    """Rows the first tile of a sequence starts above its row 0.

    ``partial_tile_first`` (causal/local masks): the last tile of a sequence sees every key and
    the first the fewest, so the sequence's partial tile goes first, where it is cheap: tiles
    start shift = (-seqlen_q) mod tile_m rows above row 0 (the tile count is unchanged). hd64's
    192-row tiles at seqlen 1024 do a sixth less work. K/V block ranges then see a sequence of
    seqlen_q + shift rows, which keeps their bottom-right alignment. Not with pack-GQA, whose
    Q pieces (Q_PIECE_ROWS rows) need aligned rows.
    """
    shift = Int32(0)
    if const_expr(partial_tile_first):
        if pack_gqa == 1:
            shift = partial_tile_shift(tile_m, seqlen_q)
    return shift


def partial_tile_shift(tile_m: int, seqlen_q):
    """(-seqlen_q) mod tile_m, the shift of ``row_shift``, as plain arithmetic: on DSL integers
    in the kernels, on Python ints in the CPU tests."""
    return (tile_m - seqlen_q % tile_m) % tile_m


# ------------------------------------------------------------------- block-sparse: from tables
# The per-tile counts a block-sparse call passes (fa4.block_sparse builds them from a BlockMask):
# the tile's partial blocks, all its blocks, and the bitmask slot of its first partial block; and,
# by position rather than by tile, the schedule: the tile of its row that runs position-th
# (longest first). FA4_SPARSE_COUNT_FIELDS in csrc_shims/fa4_shim.h is the same number.
SPARSE_PARTIAL, SPARSE_TOTAL, SPARSE_FIRST_SLOT, SPARSE_ORDER = 0, 1, 2, 3
SPARSE_COUNT_FIELDS = 4


@dataclass(frozen=True)
class SparseBlocks:
    """The K/V blocks one query tile visits in a block-sparse call, in visiting order: its
    partial blocks (those whose keys some row of the tile does not see) first, then its full
    ones. Partial block i takes its mask from bitmask slot first_slot + i. A tile that sees no
    block at all is given one partial block of the all-zero slot by the host, so the producer
    and consumers agree on a trip count of at least one, as with ``BlockInfo.n_block_range``.

    The tables are read as they are: counts are clamped into the table's width and block
    indices into the key range, so malformed tables give wrong results, never accesses outside
    the tensors (the bitmask slot is clamped where it is read: ``AttentionMask.load_bits``)."""
    blocks: cute.Tensor  # the tile's row of the blocks table
    num_partial: Int32
    num_total: Int32
    first_slot: Int32

    @staticmethod
    def of_tile(mCounts: cute.Tensor, mBlocks: cute.Tensor, batch_idx, head_idx, m_block):
        """mCounts (batch, head, m_block, SPARSE_COUNT_FIELDS), mBlocks (batch, head, m_block,
        width) int32, broadcast dims with stride 0."""
        width = cute.size(mBlocks.shape[3])
        total = cutlass.min(cutlass.max(mCounts[batch_idx, head_idx, m_block, SPARSE_TOTAL], 1), width)
        partial = cutlass.min(cutlass.max(mCounts[batch_idx, head_idx, m_block, SPARSE_PARTIAL], 0), total)
        first_slot = cutlass.max(mCounts[batch_idx, head_idx, m_block, SPARSE_FIRST_SLOT], 0)
        return SparseBlocks(mBlocks[batch_idx, head_idx, m_block, None], partial, total, first_slot)

    def n_block(self, i, n_blocks):
        """The i-th block visited, clamped into [0, n_blocks)."""
        return cutlass.min(cutlass.max(self.blocks[i], 0), n_blocks - 1)

    @staticmethod
    def scheduled_tile(mCounts: cute.Tensor, batch_idx, head_idx, position, num_tiles):
        """The tile of its table row that runs at ``position`` of the row's schedule (longest
        first: the host sorts the rows' tiles by blocks visited), clamped into [0, num_tiles)."""
        tile = mCounts[batch_idx, head_idx, position, SPARSE_ORDER]
        return cutlass.min(cutlass.max(tile, 0), num_tiles - 1)
