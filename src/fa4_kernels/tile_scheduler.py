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
  have K/V fitting a share of L2 (chosen on the host, ``fa4.heuristics.heads_per_group``); the
  last group also takes the pairs left over (it holds heads_per_group to 2 * heads_per_group - 1
  of them), never fewer than the others: the end of a longest-first schedule must be a long
  run of ever shorter tiles for the dynamic claims to even out, and a small last group starts
  its few longest tiles just before the end (hd128 causal at 4k on an H200 with 7-pair groups
  of 64 pairs: the busiest SM worked 1.11x the average);
* inside a group the tiles go m_block-major, interleaving the group's heads, so the CTAs
  running together stream the same K/V through L2;
* with ``longest_first`` (causal/local: later m_blocks see more keys) m_blocks run from the
  last to the first, so the long tiles start early and the short ones fill the tail.

Split tail (static mode): equal tiles rarely fill the last round (hd128 in the FlashAttention
benchmark setup: 2048 tiles on 132 SMs is 15.5 rounds, so half the SMs idle through the 16th).
The tiles of that last round are cut into pieces of consecutive K/V blocks and dealt out evenly
to ``tail_ctas`` CTAs (``SplitTail``). A piece that does not end its tile's K/V range stores its
unnormalised partial result (``split_partials``); the CTA holding the tile's block 0 reaches
that piece last, at the end of its share, merges the other pieces' partials and writes the
output. Each CTA writes at most one partial (its first piece) and merges at most one tile (its
last), and writers never wait, so the grid (one CTA per SM, all resident) cannot deadlock.
"""
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


# Piece roles of the split tail.
WHOLE, WRITER, MERGER = 0, 1, 2
UNBOUNDED_BLOCKS = 1 << 30  # the K/V block bound of a whole tile
# Packed sequences up to this many are put in scheduling order by each CTA (``rank_sequences``,
# into shared memory); more of them by the host (a sort of their lengths, several small kernels).
SEQ_ORDER_IN_KERNEL = 128


def scale_piece(lo, hi, n_blocks, n_bound, by_n_bound=None):
    """A split piece [lo, hi) counted in n_bound blocks (a KV cache's capacity), scaled onto a
    sequence of n_blocks >= 1 blocks: [lo * n_blocks // n_bound, hi * n_blocks // n_bound). The
    pieces of one tile partition [0, n_bound), so the scaled ones partition [0, n_blocks) (some
    empty), each about its share of the sequence's blocks. hi is clamped to [0, n_bound] first (a
    whole tile's bound is UNBOUNDED_BLOCKS; a piece past a CTA's share may end below 0, and stays
    empty: lo >= 0). ``by_n_bound``: n_bound's FastDivmod divisor (the split's plan), whose
    division is unsigned: a multiply-high and a shift where the kernel would otherwise divide after
    its cache_seqlens load, on the way to its first K load. Integer arithmetic: DSL integers in
    the kernel, ints on the CPU."""
    hi = cutlass.max(cutlass.min(hi, n_bound), 0)
    by = n_bound if by_n_bound is None else by_n_bound
    return lo * n_blocks // by, hi * n_blocks // by


@dataclass(frozen=True)
class SplitTail:
    """The static schedule's last round, split into pieces of K/V blocks (see the module doc).

    Pure integer arithmetic (no branches): the kernels run it on DSL integers, the CPU tests on
    Python ints. Units are (tail tile, K/V block) pairs numbered tile-major; CTA c of the first
    ``ctas`` takes a contiguous range of them, the first ``units % ctas`` CTAs one unit more.
    ``for_cta`` fixes one CTA's share once, so that the divisions stay out of the tile loop
    (``piece``, ``in_tail``: multiplies and adds only; measured: at 1k, 2-3% of a tile).
    """
    num_tiles: int
    grid: int
    n_blocks: int  # K/V blocks of every tile (no mask: all tiles see all keys)
    tail_ctas: int  # CTAs the host wants the tail split over (0: no split)
    # Set by for_cta: the CTA, the full rounds, 1 when the tail is split (for every CTA, also
    # those with an empty share), the CTA's share [first, end) of the tail's units and the tail
    # tile holding its first unit.
    cta: int = 0
    rounds: int = 0
    split: int = 0
    first: int = 0
    end: int = 0
    first_tile: int = 0
    # The launch's values, computed once on the host (``planned``: in the launch function, whose
    # arithmetic runs on the CPU) and passed to the kernel: (full_rounds, units, ctas, per_cta,
    # extra, and divisors by n_blocks, per_cta + 1 and max(per_cta, 1)). Without them every CTA
    # computed them before its first load, a chain of integer divisions (docs/perf_notes.md,
    # session 66); the divisors are FastDivmod ones in the kernel (a multiply-high and a shift),
    # the plain ints on the CPU.
    plan: tuple | None = None

    def planned(self, divisor=lambda d: d):
        """This split with ``plan`` computed (``divisor``: cute.fast_divmod_create_divisor_v2 in
        the launch function)."""
        ctas = cutlass.max(self.ctas, 1)
        per_cta = self.units // ctas
        return replace(self, plan=(self.full_rounds, self.units, self.ctas, per_cta, self.units % ctas,
                                   divisor(cutlass.max(self.n_blocks, 1)), divisor(per_cta + 1),
                                   divisor(cutlass.max(per_cta, 1))))

    @property
    def full_rounds(self):
        return self.plan[0] if self.plan is not None else self.num_tiles // self.grid

    @property
    def units(self):
        if self.plan is not None:
            return self.plan[1]
        return (self.num_tiles - self.full_rounds * self.grid) * self.n_blocks

    @property
    def ctas(self):
        """CTAs sharing the tail: 0 when there is none or no split was asked for."""
        if self.plan is not None:
            return self.plan[2]
        return cutlass.min(cutlass.max(self.tail_ctas, 0), self.grid, self.units)

    def _shares(self):
        """(per_cta, extra): every CTA's units, and how many CTAs take one more."""
        if self.plan is not None:
            return self.plan[3], self.plan[4]
        ctas = cutlass.max(self.ctas, 1)
        return self.units // ctas, self.units % ctas

    def by_n_blocks(self):
        """n_blocks as a divisor: the plan's FastDivmod one, or the integer."""
        return self.plan[5] if self.plan is not None else self.n_blocks

    def tail_tiles(self):
        """Tiles in the split tail."""
        return self.units // self.by_n_blocks()

    def start(self, cta):
        """First unit of ``cta``'s share (``units`` for CTAs beyond ``ctas``)."""
        per_cta, extra = self._shares()
        cta = cutlass.min(cta, cutlass.max(self.ctas, 1))
        return cta * per_cta + cutlass.min(cta, extra)

    def for_cta(self, cta):
        """This split with ``cta``'s share fixed (CTAs past ``ctas`` get an empty share)."""
        first = self.start(cta)
        return replace(self, cta=cta, rounds=self.full_rounds, split=cutlass.min(self.ctas, 1), first=first,
                       end=self.start(cta + 1), first_tile=first // self.by_n_blocks())

    def in_tail(self, item):
        """1 when the CTA's ``item``-th piece of work comes from a split tail, else 0."""
        return self.split * cutlass.min(cutlass.max(item - self.rounds + 1, 0), 1)

    def work(self, item):
        """(tile, first K/V block, end K/V block, valid: 0/1) of the for_cta'd CTA's item-th
        piece of work: round ``item`` of the snake (see the module doc), or after the full
        rounds of a split tail the pieces of its share (block bounds to intersect with the
        tile's own range; whole tiles get [0, UNBOUNDED_BLOCKS)).

        The choice is arithmetic, not a branch: values merged from branches lose their place on
        the uniform datapath in ptxas, and with them the K/V loop's trip count and every WGMMA
        descriptor in it (docs/perf_notes.md)."""
        odd = item % 2  # odd rounds run the other way
        tile = item * self.grid + self.cta + odd * (self.grid - 1 - 2 * self.cta)
        in_tail = self.in_tail(item)
        tail_tile, lo, hi = self.piece(cutlass.max(item - self.rounds, 0))
        tile = tile + in_tail * (self.rounds * self.grid + tail_tile - tile)
        kv_lo = in_tail * lo
        kv_hi = UNBOUNDED_BLOCKS + in_tail * (hi - UNBOUNDED_BLOCKS)
        in_grid = cutlass.min(cutlass.max(self.num_tiles - tile, 0), 1)
        return tile, kv_lo, kv_hi, in_grid * (1 - in_tail + in_tail * cutlass.min(cutlass.max(hi - lo, 0), 1))

    def piece(self, j):
        """(tail tile, first block, end block) of the share's j-th piece, empty (hi <= lo) past
        the share. Pieces after the first start at their tile's block 0; a piece that ends
        before ``n_blocks`` is cut at the share's end."""
        tile = self.first_tile + j
        lo = cutlass.max(self.first - tile * self.n_blocks, 0)
        hi = cutlass.min(self.end - tile * self.n_blocks, self.n_blocks)
        return tile, lo, hi

    def role(self, lo, hi):
        """WHOLE, WRITER (the piece misses its tile's block 0: store a partial) or MERGER (it
        holds block 0 but not the whole tile: merge the others' partials, then store O)."""
        writer = cutlass.min(lo, 1)
        merger = cutlass.min(self.n_blocks - hi, 1) * (1 - writer)
        return writer * WRITER + merger * MERGER

    def owner(self, unit):
        """The CTA whose share holds ``unit`` (< units)."""
        per_cta, extra = self._shares()
        by_long, by_short = (self.plan[6], self.plan[7]) if self.plan is not None else (
            per_cta + 1, cutlass.max(per_cta, 1))
        long_units = extra * (per_cta + 1)  # the first ``extra`` CTAs take per_cta + 1 units
        in_long = cutlass.min(cutlass.max(long_units - unit, 0), 1)
        return in_long * (unit // by_long) + (1 - in_long) * (extra + cutlass.max(unit - long_units, 0) // by_short)

    def first_piece_merger(self):
        """The CTA holding block 0 of the tile of this CTA's first piece: where a writing piece
        (always its share's first) belongs, the tile's first CTA."""
        return self.owner(self.first_tile * self.n_blocks)

    def one_piece_per_cta(self):
        """1 when every CTA's share lies inside one tile (equal shares, a whole number of them per
        tile), so that no CTA holds pieces of two tiles; else 0."""
        _, extra = self._shares()
        tiles = cutlass.max(self.tail_tiles(), 1)
        return (1 - cutlass.min(extra, 1)) * (1 - cutlass.min(cutlass.max(self.ctas, 1) % tiles, 1))

    def writers(self, cta):
        """For ``cta``'s merging piece (its last, cut at its share's end): how many CTAs after
        it hold the rest of that tile, each as a written partial (their first pieces)."""
        end = self.start(cta + 1)
        tile_end = (end // self.by_n_blocks() + 1) * self.n_blocks
        return self.owner(tile_end - 1) - cta


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
    sSeqOrder: cute.Tensor | None = None  # ... or this one, up to SEQ_ORDER_IN_KERNEL sequences
    split: SplitTail | None = None  # static mode: the last round's split
    # From the host (``with_fast_division``): the divisors of ``coordinates``, each a
    # multiply-high and shift per tile instead of a ~20-instruction division.
    fast: tuple | None = None

    def group_layout(self):
        """(index of the last group, pairs in it): the last group takes the remainder."""
        num_hb = self.num_heads * self.num_batches
        last_group = cutlass.max(num_hb // self.heads_per_group - 1, 0)
        return last_group, num_hb - last_group * self.heads_per_group

    def with_fast_division(self, divisor):
        """This scheduler with precomputed divisors (``divisor(d)``: one for d; once per launch,
        on the host): group_tiles, heads_per_group, the last group's pair count (the only group
        that may differ), num_heads."""
        last_group, last_heads = self.group_layout()
        fast = (divisor(self.heads_per_group * self.num_m_blocks), divisor(self.heads_per_group), divisor(last_heads),
                divisor(self.num_heads), last_group)
        return replace(self, fast=fast)

    @property
    def num_tiles(self):
        return self.num_m_blocks * self.num_heads * self.num_batches

    @staticmethod
    def first_tile():
        return Int32(cute.arch.block_idx()[0])

    @cute.jit
    def static_work(self, item: Int32):
        """Static mode: (tile, first K/V block, end K/V block, valid) of this CTA's item-th piece
        of work (SplitTail.work)."""
        if const_expr(self.split is not None):
            tile, kv_lo, kv_hi, valid = self.split.work(item)  # for_cta'd: this CTA's share
            return tile, kv_lo, kv_hi, valid > 0
        grid = Int32(cute.arch.grid_dim()[0])
        cta = Int32(cute.arch.block_idx()[0])
        tile = item * grid + cta
        if item % 2 == 1:
            tile = item * grid + grid - 1 - cta
        return tile, Int32(0), Int32(UNBOUNDED_BLOCKS), tile < self.num_tiles

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
        order[0], then order[1], ... (only blocks that hold queries; longest sequences first:
        ``rank_sequences``' order in shared memory, or the host's for more sequences). Within a
        sequence the last m_block comes first when ``longest_first``.

        Called by whole warps: the lanes look at 32 sequences at once (lane l at sequences l,
        l + 32, ...), the warp sums their block counts by shuffles, and a ballot names the lane
        whose sequence holds block g: one round of loads per 32 sequences. Walking the sequences
        one at a time (a load of the order, then of cu_seqlens, per sequence) took ~0.17 us per
        sequence (H200, 8 documents: 1.95 us between a CTA's tiles; with this scan and the
        producer's hand-off of the result, 0.54-0.60; dense batches 0.6; fa4.trace)."""
        head = tile % self.num_heads
        g = tile // self.num_heads
        lane = cute.arch.lane_idx()
        batch = Int32(0)
        m_idx = Int32(0)
        n_blocks = Int32(0)
        found = Int32(0)
        before = Int32(0)  # blocks of the sequences in earlier rounds of 32
        for first in cutlass.range(0, self.num_batches, cute.arch.WARP_SIZE, unroll=1):
            i = first + lane
            b = Int32(0)
            nb = Int32(0)
            if i < self.num_batches:
                ranked_here = False  # the CTA's own order (rank_sequences), else the host's
                if const_expr(self.sSeqOrder is not None):
                    ranked_here = self.num_batches <= SEQ_ORDER_IN_KERNEL
                if ranked_here:
                    b = self.sSeqOrder[i]
                else:
                    b = cutlass.min(cutlass.max(self.mSeqOrder[i], 0), self.num_batches - 1)  # never out of range
                nb = cute.ceil_div(self.mCuSeqlensQ[b + 1] - self.mCuSeqlensQ[b], self.block_rows)
            upto = nb  # blocks of this round's sequences up to lane's, inclusive
            for k in cutlass.range_constexpr(5):
                below = cute.arch.shuffle_sync_up(upto, offset=1 << k)
                if lane >= (1 << k):
                    upto = upto + below
            lo = before + upto - nb
            holder = cute.arch.vote_ballot_sync(g >= lo and g < lo + nb)
            if found == 0 and holder != 0:
                src = 31 - Int32(cute.arch.clz(holder))  # the one lane whose sequence holds block g
                batch = cute.arch.shuffle_sync(b, src)
                m_idx = g - cute.arch.shuffle_sync(lo, src)
                n_blocks = cute.arch.shuffle_sync(nb, src)
                found = Int32(1)
            before = before + cute.arch.shuffle_sync(upto, cute.arch.WARP_SIZE - 1)
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = n_blocks - 1 - m_idx
        return m_block, head, batch, found != 0

    def coordinates(self, tile):
        """Linear tile index -> (m_block, head, batch). Plain arithmetic (no branch on run-time
        values), so the CPU tests run it on Python ints; ``fast`` may then hold plain ints."""
        hpg = self.heads_per_group
        group_tiles = hpg * self.num_m_blocks
        if const_expr(self.fast is not None):
            by_group_tiles, by_group_heads, by_last_group_heads, by_heads, last_group = self.fast
        else:
            last_group, last_heads = self.group_layout()
            by_group_tiles, by_heads = group_tiles, self.num_heads
        group = cutlass.min(tile // by_group_tiles, last_group)
        idx = tile - group * group_tiles
        in_last = cutlass.min(cutlass.max(group - last_group + 1, 0), 1)  # group == last_group
        heads_in_group = hpg + in_last * (self.num_heads * self.num_batches - last_group * hpg - hpg)
        if const_expr(self.fast is not None):
            m_full, m_last = idx // by_group_heads, idx // by_last_group_heads
            m_idx = m_full + in_last * (m_last - m_full)
        else:
            m_idx = idx // heads_in_group
        hb = group * hpg + idx - m_idx * heads_in_group
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_idx
        batch = hb // by_heads
        return m_block, hb - batch * self.num_heads, batch


@cute.jit
def rank_sequences(mCuSeqlensQ: cute.Tensor, sLengths: cute.Tensor, sOrder: cute.Tensor, tidx: Int32,
                   num_threads: cutlass.Constexpr[int]):
    """Packed sequences' scheduling order, longest first (ties by index: the host's stable sort
    of the lengths gives the same permutation), into sOrder, when there are at most
    SEQ_ORDER_IN_KERNEL of them. Every thread of the CTA calls it; thread i ranks sequence i
    against all the others' lengths, staged in sLengths. The caller's next CTA-wide barrier
    publishes sOrder. Run by each CTA at its start, instead of the host's sort of the lengths:
    seven small GPU operations (a diff, a sort and its copies, a cast) before every packed
    forward, whose launches and gaps the forward waited behind (H200, bf16 hd128, 16 heads, 8 x
    2048 tokens causal: 235 us per call against the kernel's 217 and a dense batch's 213; 524-530
    -> 614-615 TFLOP/s with the ranks here, 32 random documents 222 -> 375)."""
    assert num_threads >= SEQ_ORDER_IN_KERNEL
    num_seqs = cute.size(mCuSeqlensQ.shape[0]) - 1
    in_kernel = num_seqs <= SEQ_ORDER_IN_KERNEL
    if in_kernel and tidx < num_seqs:
        sLengths[tidx] = mCuSeqlensQ[tidx + 1] - mCuSeqlensQ[tidx]
    cute.arch.sync_threads()
    if in_kernel and tidx < num_seqs:
        mine = sLengths[tidx]
        rank = Int32(0)
        for j in cutlass.range(num_seqs, unroll=4):
            other = sLengths[j]
            if other > mine or (other == mine and j < tidx):
                rank += 1
        sOrder[rank] = tidx


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
# block apart (ping-pong), so meeting stalls the one ahead. A slot holds one word (the tile
# index) or, for packed sequences, DECODED_WORDS: the index and the coordinates the producer has
# decoded (varlen_coordinates reads the sequences; the consumers would repeat it at their tile
# boundary, on their critical path).
HANDOFF_SLOTS = 2
DECODED_WORDS = 5  # tile index, m_block, head, batch, valid


@cute.jit
def handoff_init(mbar: cute.Pointer, num_consumer_threads: cutlass.Constexpr[int]):
    """One thread, before the CTA-wide barrier that follows mbarrier initialisation."""
    for i in cutlass.range_constexpr(HANDOFF_SLOTS):
        cute.arch.mbarrier_init(mbar + i, 1)
        cute.arch.mbarrier_init(mbar + HANDOFF_SLOTS + i, num_consumer_threads)


@cute.jit
def handoff_publish(slots: cute.Tensor, mbar: cute.Pointer, count: Int32, words: tuple):
    """Producer warp: publish ``words`` (the tile index, and the decoded coordinates where slots
    have room: (HANDOFF_SLOTS, words) tensor) as hand-off number ``count`` (0, 1, 2, ...)."""
    idx = count % HANDOFF_SLOTS
    # A fresh mbarrier counts its (nonexistent) previous phase as complete: the first round
    # of slots is free without any consumer arrival.
    cute.arch.mbarrier_wait(mbar + HANDOFF_SLOTS + idx, ((count // HANDOFF_SLOTS) % 2) ^ 1)
    if cute.arch.lane_idx() == 0:
        for w in cutlass.range_constexpr(len(words)):
            slots[idx, w] = words[w]
        cute.arch.mbarrier_arrive(mbar + idx)  # release: the slot writes are visible to the waiters


@cute.jit
def handoff_receive(slots: cute.Tensor, mbar: cute.Pointer, count: Int32, num_words: cutlass.Constexpr[int]):
    """Every consumer thread: the ``num_words`` words of hand-off number ``count`` (a tuple);
    frees the slot."""
    idx = count % HANDOFF_SLOTS
    cute.arch.mbarrier_wait(mbar + idx, (count // HANDOFF_SLOTS) % 2)
    words = tuple(slots[idx, w] for w in range(num_words))
    cute.arch.mbarrier_arrive(mbar + HANDOFF_SLOTS + idx)
    return words
