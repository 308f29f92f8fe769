"""Which K/V blocks a query tile visits, and which of them need masking.

Masks are aligned to the bottom-right corner when seqlen_q != seqlen_k (as FlashAttention
does): query row i may see key j iff  i + (seqlen_k - seqlen_q) - window_left <= j
<= i + (seqlen_k - seqlen_q) + window_right. Causal is window (inf, 0).
"""
from dataclasses import dataclass
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
