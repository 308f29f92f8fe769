"""Masking of one (tile_m, tile_n) score tile held in WGMMA accumulator registers."""
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from fa4_kernels.block_info import row_in_head
from fa4_kernels.hopper_mma import rows_cols_view
from fa4_kernels.ptx import f32_asm


@dsl_user_op
def neg_inf_unless_below(x: Float32, col: int, limit: Int32, *, loc=None, ip=None) -> Float32:
    """``x if col < limit else -inf`` as one compare and one select.

    Written as inline PTX on purpose: as plain selects, LLVM folds the -inf into the row-max
    reduction that follows and unrolls it into a cascade of ~16 selects per element (1,000+
    FSEL per masked tile on hd128).
    """
    return f32_asm("{\n.reg .pred p;\nsetp.lt.s32 p, $2, $3;\nselp.f32 $0, $1, 0fFF800000, p;\n}",
                   "=f,f,r,r", (Float32(x), Int32(col), Int32(limit)), loc=loc, ip=ip)


@dsl_user_op
def neg_inf_unless_between(x: Float32, col: int, low: Int32, limit: Int32, *, loc=None, ip=None) -> Float32:
    """``x if low <= col < limit else -inf`` (see ``neg_inf_unless_below``)."""
    return f32_asm("{\n.reg .pred p;\nsetp.lt.s32 p, $2, $4;\nsetp.ge.and.s32 p, $2, $3, p;\n"
                   "selp.f32 $0, $1, 0fFF800000, p;\n}",
                   "=f,f,r,r,r", (Float32(x), Int32(col), Int32(low), Int32(limit)), loc=loc, ip=ip)


@dsl_user_op
def neg_inf_unless_bit(x: Float32, word: Int32, bit: int, *, loc=None, ip=None) -> Float32:
    """``x if word has bit `bit` set else -inf`` (bit a compile-time constant): ptxas folds the
    test into one LOP3 writing a predicate, then one select."""
    return f32_asm("{\n.reg .pred p;\n.reg .b32 t;\n"
                   f"and.b32 t, $2, 0x{1 << bit:08x};\n"
                   "setp.ne.b32 p, t, 0;\nselp.f32 $0, $1, 0fFF800000, p;\n}",
                   "=f,f,r", (Float32(x), Int32(word)), loc=loc, ip=ip)


# Bits per word of a block-sparse call's bitmask (fa4.block_sparse packs them): row r of a tile's
# slot holds tile_n bits in tile_n / 32 int32 words, key j of the block in bit j % 32 of word j // 32;
# the backward's transposed slots hold per key row tile_m bits, query i in bit i % 32 of word i // 32.
BITS_PER_WORD = 32


# A column bound no column reaches: for the sides of apply_transposed's window that bound nothing.
UNMASKED_COLS = 1 << 30


@dataclass(frozen=True)
class AttentionMask:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    seqlen_q: Int32
    seqlen_k: Int32
    pack_log2: Int32  # log2(pack_gqa): tile rows stack heads tile_m >> pack_log2 rows apart
    window_left: Optional[Int32] = None
    window_right: Optional[Int32] = None

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        thr_mma: cute.ThrMma,
        first_row: Int32,  # sequence row of tile row 0 (TileRows.first_row)
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool],
    ):
        """Set to -inf every score whose key is past seqlen_k (``mask_seqlen``) or outside the
        row's causal/local window. Column coordinates come from thread 0's partition (compile-time
        constants) shifted by this thread's column offset, so the compares fold to immediates.
        """
        acc_mn = rows_cols_view(acc_S)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = rows_cols_view(thr_mma.partition_C(cS))
        t0ScS = rows_cols_view(thr_mma.get_slice(0).partition_C(cS))
        col_offset = tScS[0][1]
        seqlen_col_limit = self.seqlen_k - n_block * self.tile_n - col_offset
        if const_expr(not mask_causal and not mask_local):
            if const_expr(mask_seqlen):
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        acc_mn[r, c] = neg_inf_unless_below(acc_mn[r, c], t0ScS[0, c][1], seqlen_col_limit)
        else:
            # col_limit_right - row index: first key index (relative to this thread's first
            # column of the block) that row 0 of the tile may not see.
            diag = self.seqlen_k - self.seqlen_q - n_block * self.tile_n - col_offset + first_row
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                # Tile row -> row of its head's sequence (pack-GQA stacks heads block_rows apart).
                row = row_in_head(tScS[r, 0][0], self.tile_m, self.pack_log2)
                right_limit = row + diag + 1
                if const_expr(mask_local):
                    right_limit = right_limit + self.window_right
                if const_expr(mask_seqlen):
                    right_limit = cutlass.min(right_limit, seqlen_col_limit)
                if const_expr(mask_local):
                    left_limit = row + diag - self.window_left
                    for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                        acc_mn[r, c] = neg_inf_unless_between(acc_mn[r, c], t0ScS[0, c][1], left_limit, right_limit)
                else:
                    for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                        acc_mn[r, c] = neg_inf_unless_below(acc_mn[r, c], t0ScS[0, c][1], right_limit)

    @cute.jit
    def apply_transposed(
        self,
        acc_St: cute.Tensor,
        thr_mma: cute.ThrMma,
        m_block: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool],
    ):
        """The backward's transposed tile S^T (rows: the tile_n keys of K/V block n_block,
        columns: the tile_m queries of query block m_block): -inf where the query may not see
        the key: outside the window (``mask_local``; causal is the window with an unbounded left
        side) or, with ``mask_seqlen``, past seqlen_q (columns) and seqlen_k (rows). Column
        coordinates fold to immediates as in ``apply``."""
        acc_mn = rows_cols_view(acc_St)
        cS = cute.make_identity_tensor((self.tile_n, self.tile_m))
        tScS = rows_cols_view(thr_mma.partition_C(cS))
        t0ScS = rows_cols_view(thr_mma.get_slice(0).partition_C(cS))
        first_col = m_block * self.tile_m + tScS[0][1]  # query of this thread's column 0
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            key = n_block * self.tile_n + tScS[r, 0][0]
            # Query i sees key j iff j - offset - window_right <= i <= j - offset + window_left.
            diag = key - (self.seqlen_k - self.seqlen_q) - first_col
            low = Int32(-UNMASKED_COLS)
            high = Int32(UNMASKED_COLS)
            if const_expr(mask_local):
                low = diag - self.window_right
                high = diag + self.window_left + 1
            if const_expr(mask_seqlen):
                high = cutlass.min(high, self.seqlen_q - first_col)
                if key >= self.seqlen_k:
                    high = low
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                acc_mn[r, c] = neg_inf_unless_between(acc_mn[r, c], t0ScS[0, c][1], low, high)

    # ------------------------------------------------------------- block-sparse partial blocks
    def bits_tile(self, transposed: bool):
        """(rows, columns) of the score tile a slot covers: (tile_m, tile_n), or the backward's
        S^T (tile_n, tile_m)."""
        return (self.tile_n, self.tile_m) if transposed else (self.tile_m, self.tile_n)

    @cute.jit
    def load_bits(self, mBits: cute.Tensor, slot: Int32, thr_mma: cute.ThrMma,
                  transposed: cutlass.Constexpr[bool] = False) -> cute.Tensor:
        """This thread's words of bitmask slot ``slot`` (mBits: flat int32, slots of ``rows``
        rows of ``cols`` / 32 words, bits_tile; the slot is clamped into it), one (row, word) pair
        per accumulator row and word, each shifted right by the thread's first column so that
        the bit of a column is that of thread 0's column (a compile-time constant; the shift keeps
        every bit a thread tests within its word: columns sit at c % 32 <= 25 for thread 0,
        shifts <= 6)."""
        tile_rows, tile_cols = self.bits_tile(transposed)
        words = tile_cols // BITS_PER_WORD
        cS = cute.make_identity_tensor((tile_rows, tile_cols))
        tScS = rows_cols_view(thr_mma.partition_C(cS))
        rows = cute.size(tScS, mode=[0])
        num_slots = cute.size(mBits.shape[0]) // (tile_rows * words)
        slot = cutlass.min(cutlass.max(slot, 0), num_slots - 1)
        col_offset = tScS[0][1]
        bits = cute.make_rmem_tensor((rows * words,), Int32)
        for r in cutlass.range_constexpr(rows):
            base = (slot * tile_rows + tScS[r, 0][0]) * words
            for w in cutlass.range_constexpr(words):
                bits[r * words + w] = mBits[base + w] >> col_offset
        return bits

    @cute.jit
    def apply_bits(self, acc_S: cute.Tensor, thr_mma: cute.ThrMma, bits: cute.Tensor,
                   transposed: cutlass.Constexpr[bool] = False):
        """-inf at every score whose bit (``load_bits``) is clear."""
        tile_rows, tile_cols = self.bits_tile(transposed)
        words = tile_cols // BITS_PER_WORD
        acc_mn = rows_cols_view(acc_S)
        cS = cute.make_identity_tensor((tile_rows, tile_cols))
        t0ScS = rows_cols_view(thr_mma.get_slice(0).partition_C(cS))
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                col = t0ScS[0, c][1]
                acc_mn[r, c] = neg_inf_unless_bit(acc_mn[r, c], bits[r * words + col // BITS_PER_WORD],
                                                  col % BITS_PER_WORD)
