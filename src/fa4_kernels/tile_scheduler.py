"""Persistent tile schedulers: which (m_block, head, batch) tiles a CTA works on.

Two ways to walk the order below: static (fixed snake assignment, no communication: best
when all tiles are equally long) and dynamic (each CTA takes the next unclaimed tile from a
global atomic counter when it starts its current one, so long and short tiles balance out
across SMs: causal/local masks). In the dynamic mode the producer warp claims the next tile
and hands it to the consumer warps through a small ring of shared-memory slots guarded by
mbarriers (``handoff_*`` below).

Static mode: the grid has at most one CTA per SM and walks one global tile order in rounds of ``grid``
tiles; in round r CTA c takes tile r * grid + c when r is even and r * grid + grid - 1 - c when
r is odd. This snake keeps the sum of work per CTA even when the order runs from long tiles to
short ones (a plain stride would give CTA 0 the longest tile of every round). With a grid of
one CTA per tile (``num_sms`` large) it is an ordinary grid that the hardware hands out in
order. The order is FlashAttention-3's longest-processing-time-first order with an L2 swizzle:

* (head, batch) pairs are taken ``heads_per_group`` at a time, a group being as many heads as
  have K/V fitting a share of L2 (chosen on the host, ``fa4.heuristics.heads_per_group``);
* inside a group the tiles go m_block-major, interleaving the group's heads, so the CTAs
  running together stream the same K/V through L2;
* with ``longest_first`` (causal/local: later m_blocks see more keys) m_blocks run from the
  last to the first, so the long tiles start early and the short ones fill the tail.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class StaticPersistentScheduler:
    num_m_blocks: Int32  # varlen: blocks of the longest sequence (an upper bound)
    num_heads: Int32
    num_batches: Int32
    heads_per_group: Int32
    longest_first: cutlass.Constexpr[bool]
    block_rows: Int32  # query rows of one sequence per tile (tile_m, or tile_m / pack_gqa)
    mCuSeqlensQ: cute.Tensor | None = None  # varlen: tiles are enumerated per sequence ...
    mSeqOrder: cute.Tensor | None = None  # ... taking the sequences in this order (a permutation)

    @property
    def num_tiles(self):
        return self.num_m_blocks * self.num_heads * self.num_batches

    @staticmethod
    def first_tile():
        return Int32(cute.arch.block_idx()[0])

    @cute.jit
    def next_tile(self, tile: Int32):
        """The tile this CTA takes in the next round of the snake."""
        grid = Int32(cute.arch.grid_dim()[0])
        cta = Int32(cute.arch.block_idx()[0])
        round_start = tile - tile % grid + grid
        # (tile // grid) is the current round; the next one runs the other way.
        nxt = round_start + cta
        if (tile // grid) % 2 == 0:
            nxt = round_start + grid - 1 - cta
        return nxt

    @cute.jit
    def decode(self, tile: Int32):
        """Tile index -> (m_block, head, batch, valid). Tiles are claimed in increasing order, so
        the first invalid one ends a CTA's loop."""
        if const_expr(self.mCuSeqlensQ is None):
            m_block, head, batch = self.coordinates(tile)
            return m_block, head, batch, tile < self.num_tiles
        else:
            return self.varlen_coordinates(tile)

    @cute.jit
    def varlen_coordinates(self, tile: Int32):
        """Packed sequences: tile = g * heads + head, g running over the m_blocks of sequence
        order[0], then order[1], ... (only blocks that hold queries; the host passes the longest
        sequences first). Within a sequence the last m_block comes first when ``longest_first``.
        Cost: one pass over the batch per tile."""
        head = tile % self.num_heads
        g = tile // self.num_heads
        batch = Int32(0)
        m_idx = Int32(0)
        n_blocks = Int32(0)
        prefix = Int32(0)
        found = Int32(0)
        for i in cutlass.range(self.num_batches, unroll=1):
            b = cutlass.min(cutlass.max(self.mSeqOrder[i], 0), self.num_batches - 1)  # never out of range
            nb = cute.ceil_div(self.mCuSeqlensQ[b + 1] - self.mCuSeqlensQ[b], self.block_rows)
            if found == 0:
                if g < prefix + nb:
                    batch = b
                    m_idx = g - prefix
                    n_blocks = nb
                    found = Int32(1)
                else:
                    prefix = prefix + nb
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = n_blocks - 1 - m_idx
        return m_block, head, batch, found != 0

    @cute.jit
    def coordinates(self, tile: Int32):
        """Linear tile index -> (m_block, head, batch)."""
        num_hb = self.num_heads * self.num_batches
        group_tiles = self.heads_per_group * self.num_m_blocks
        group = tile // group_tiles
        idx = tile - group * group_tiles
        heads_in_group = cutlass.min(self.heads_per_group, num_hb - group * self.heads_per_group)
        m_idx = idx // heads_in_group
        hb = group * self.heads_per_group + idx - m_idx * heads_in_group
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_idx
        batch = hb // self.num_heads
        return m_block, hb - batch * self.num_heads, batch


@cute.jit
def claim_next_tile(counter_ptr: cute.Pointer) -> Int32:
    """Dynamic mode, whole producer warp: the next unclaimed tile (>= num_tiles: none left).
    The first ``grid`` tiles are taken by block index, so claims start after them."""
    nxt = Int32(0)
    if cute.arch.lane_idx() == 0:
        nxt = Int32(cute.arch.grid_dim()[0]) + cute.arch.atomic_add(counter_ptr, Int32(1))
    return cute.arch.shuffle_sync(nxt, 0)


# Dynamic mode hand-off: a ring of HANDOFF_SLOTS tile indices in shared memory, each guarded by a
# "full" mbarrier (the producer warp's lane 0 arrives once it wrote the slot) and an "empty" one
# (every consumer thread arrives once it read the slot, so each read is ordered before the next
# write by the reader's own arrive). mbarriers, not named barriers: a named barrier would make
# every consumer warpgroup meet the others at each tile boundary, and the warpgroups run half a
# block apart (ping-pong), so meeting stalls the one ahead.
HANDOFF_SLOTS = 2


@cute.jit
def handoff_init(mbar: cute.Pointer, num_consumer_threads: cutlass.Constexpr[int]):
    """One thread, before the CTA-wide barrier that follows mbarrier initialisation."""
    for i in cutlass.range_constexpr(HANDOFF_SLOTS):
        cute.arch.mbarrier_init(mbar + i, 1)
        cute.arch.mbarrier_init(mbar + HANDOFF_SLOTS + i, num_consumer_threads)


@cute.jit
def handoff_publish(slots: cute.Tensor, mbar: cute.Pointer, count: Int32, tile: Int32):
    """Producer warp: publish ``tile`` as hand-off number ``count`` (0, 1, 2, ...)."""
    idx = count % HANDOFF_SLOTS
    # A fresh mbarrier counts its (nonexistent) previous phase as complete: the first round
    # of slots is free without any consumer arrival.
    cute.arch.mbarrier_wait(mbar + HANDOFF_SLOTS + idx, ((count // HANDOFF_SLOTS) % 2) ^ 1)
    if cute.arch.lane_idx() == 0:
        slots[idx] = tile
        cute.arch.mbarrier_arrive(mbar + idx)  # release: the slot write is visible to the waiters


@cute.jit
def handoff_receive(slots: cute.Tensor, mbar: cute.Pointer, count: Int32) -> Int32:
    """Every consumer thread: the tile of hand-off number ``count``; frees the slot."""
    idx = count % HANDOFF_SLOTS
    cute.arch.mbarrier_wait(mbar + idx, (count // HANDOFF_SLOTS) % 2)
    tile = slots[idx]
    cute.arch.mbarrier_arrive(mbar + HANDOFF_SLOTS + idx)
    return tile
