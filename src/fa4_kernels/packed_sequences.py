"""Which packed sequence a row (or a block of rows) belongs to, found by one warp from
``cu_seqlens``: lane l looks at sequences l, l + 32, ... of a round (their loads go out together),
and ballots count the sequences that start at or before the target (a prefix: the starts do not
decrease). Up to SEQS_PER_ROUND sequences per round of loads, rounds until the prefix ends.

Used where each CTA must find its own sequence without a host-side table: the backward's
preprocess (its flat grid over statistics blocks) and its dQ conversion (each CTA's rows wait
for their sequence's main-kernel CTAs)."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32

SEQS_PER_ROUND = 4 * 32


@cute.jit
def last_sequence_at_or_before(mCuSeqlens: cute.Tensor, target: Int32, total: Int32, first_of):
    """The last packed sequence i (of len(mCuSeqlens) - 1) with ``first_of(start_i, i) <= target``
    (-1: none), start_i = cu_seqlens[i] clamped into [0, total] as SeqlenInfo clamps it.
    ``first_of`` maps a start to what ``target`` counts in (rows: the start itself; blocks:
    their first block) and must not decrease with i. Each warp on its own (no barrier); every
    lane returns the answer."""
    num_seqs = cute.size(mCuSeqlens.shape[0]) - 1
    lane = cute.arch.lane_idx()
    count = Int32(0)
    searching = Int32(1)
    for first in cutlass.range(0, num_seqs, SEQS_PER_ROUND, unroll=1):
        if searching != 0:
            found = Int32(0)
            for j in cutlass.range_constexpr(SEQS_PER_ROUND // cute.arch.WARP_SIZE):
                i = first + j * cute.arch.WARP_SIZE + lane
                at_or_before = False
                if i < num_seqs:
                    start = cutlass.min(cutlass.max(mCuSeqlens[i], 0), total)
                    at_or_before = first_of(start, i) <= target
                found += cute.arch.popc(cute.arch.vote_ballot_sync(at_or_before))
            count += found
            if found < SEQS_PER_ROUND:
                searching = Int32(0)
    return count - 1
