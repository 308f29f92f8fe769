"""Per-tile scheduler trace: what trace variants (catalog.VariantKey.trace) record, and where.

A traced forward writes one record per tile (or split-tail piece) it works on: the SM and CTA
that ran it, the schedule's cursor, the tile's coordinates and K/V block range, and the
``%globaltimer`` nanoseconds at its start, when its Q had landed and at its end, and its CTA's way
to its first tile (PROLOGUE: what a launch costs before a tile starts). The records go
into the forward's ``semaphores`` vector past the words the scheduler uses; the host lays out a
header there (fa4_ops.cpp, ``trace_call``) and writes the records to the trace file that
``python -m fa4.trace`` renders. Production variants compile none of this.

Header words of the semaphores vector (word 0 is the dynamic schedule's tile counter, split
flags start at split_partials.FLAGS_BASE = 32):
  COUNTER_WORD: records claimed so far (zero at launch; may exceed the capacity: the excess
    records are dropped, and the host reports how many);
  BASE_WORD: the word where record 0 starts; CAPACITY_WORD: how many records fit;
  DEAL_WORD: nonzero makes a dynamically scheduled variant deal its tiles round-robin (CTA c
    takes c, c + grid, ...) in the same tile order instead of claiming them from the counter:
    the static schedule to compare it with (``FA4_TRACE_SCHEDULE=static``).

One consumer thread (thread 0 of the first consumer warpgroup) writes a tile's record; the
times are that warpgroup's. Times are split into 32-bit halves (the vector is int32); the start
carries both, the later marks (MARKS) and the end their low halves only (the renderer unwraps
them against the start).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from fa4_kernels.ptx import inline_asm

COUNTER_WORD, BASE_WORD, CAPACITY_WORD, DEAL_WORD = 1, 2, 3, 4
# The words of one record, in order. "flags": FLAG_* below.
FIELDS = ("sm", "cta", "cursor", "m_block", "head", "batch", "n_block_min", "n_block_max", "flags",
          "start_lo", "start_hi", "q_ready_lo", "blocks_done_lo", "partials_ready_lo", "merged_lo", "end_lo",
          "entry_lo", "k_ready_lo", "setup_lo", "consume_lo", "pre_wait_lo")
# Times of a tile besides its start and end (low words; 0 where a tile has no such point):
# Q landed; its last P @ V done (the K/V loop over); a split tile's merger: every writer's partial
# visible, then all of them folded in (before the epilogue); its first K block landed (seen after Q).
MARKS = ("q_ready_lo", "blocks_done_lo", "partials_ready_lo", "merged_lo", "k_ready_lo")
# The CTA's way to its first tile (every record of a CTA repeats them): it entered the kernel; the
# shared-memory set-up (barriers, descriptor prefetches, the CTA-wide sync) was done; the consumer
# warpgroup entered its role (after setmaxnreg); it had its first tile's schedule arithmetic done
# and was about to wait for the previous grid (PDL; the tile's start follows that wait).
PROLOGUE = ("entry_lo", "setup_lo", "consume_lo", "pre_wait_lo")
RECORD_WORDS = len(FIELDS)
FIELD = {name: i for i, name in enumerate(FIELDS)}
FLAG_DYNAMIC = 1  # the tile came from the dynamic schedule (its counter or, dealt, its order)
FLAG_SPLIT_WRITER = 2  # a split-tail piece that left its partial result for the merger
FLAG_SPLIT_MERGER = 4  # the split tile's piece that merged the others' and stored O
FLAG_DEALT = 8  # dealt round-robin (DEAL_WORD) rather than claimed
FLAGS = {"dynamic": FLAG_DYNAMIC, "split_writer": FLAG_SPLIT_WRITER, "split_merger": FLAG_SPLIT_MERGER,
         "dealt": FLAG_DEALT}


@dsl_user_op
def global_ns(*, loc=None, ip=None) -> Int64:
    """``%globaltimer``: nanoseconds on a clock every SM shares (volatile: read where written)."""
    return Int64(inline_asm(T.i64(), "mov.u64 $0, %globaltimer;", "=l", (), volatile=True, loc=loc, ip=ip))


@dsl_user_op
def sm_id(*, loc=None, ip=None) -> Int32:
    return Int32(inline_asm(T.i32(), "mov.u32 $0, %smid;", "=r", (), volatile=True, loc=loc, ip=ip))


@cute.jit
def deal_round_robin(semaphores: cute.Tensor) -> cutlass.Boolean:
    """Producer: whether this traced launch deals its tiles round-robin (DEAL_WORD)."""
    return semaphores[DEAL_WORD] != 0


@dataclass(frozen=True)
class TileTrace:
    """The consumers' side; thread 0 of the consumers (``tidx``) writes the records."""
    semaphores: cute.Tensor
    tidx: Int32

    @cute.jit
    def _time(self, slot: Int32, lo_field: cutlass.Constexpr[int], hi_field: cutlass.Constexpr[int], t=None):
        if const_expr(t is None):
            t = global_ns()
        at = self.semaphores[BASE_WORD] + slot * RECORD_WORDS
        self.semaphores[at + lo_field] = Int32(t)
        if const_expr(hi_field >= 0):
            self.semaphores[at + hi_field] = Int32(t >> 32)

    @cute.jit
    def begin(self, cursor: Int32, m_block: Int32, head: Int32, batch: Int32, flags: Int32, prologue) -> Int32:
        """A tile starts: claim its record and write who runs it, what it is and when (``prologue``:
        the CTA's ``global_ns`` at each of PROLOGUE). Returns the record's slot (-1: none, the buffer
        is full or this thread does not write)."""
        slot = Int32(-1)
        if self.tidx == 0:
            # The start is read before the record is claimed: the claim's atomic and the capacity's
            # load are two round trips to the L2 (~0.5 us) that the tile does not wait for.
            start = global_ns()
            claimed = cute.arch.atomic_add(self.semaphores.iterator + COUNTER_WORD, Int32(1))
            if claimed < self.semaphores[CAPACITY_WORD]:
                slot = claimed
                at = self.semaphores[BASE_WORD] + slot * RECORD_WORDS
                self.semaphores[at + FIELD["sm"]] = sm_id()
                self.semaphores[at + FIELD["cta"]] = Int32(cute.arch.block_idx()[0])
                self.semaphores[at + FIELD["cursor"]] = cursor
                self.semaphores[at + FIELD["m_block"]] = m_block
                self.semaphores[at + FIELD["head"]] = head
                self.semaphores[at + FIELD["batch"]] = batch
                self.semaphores[at + FIELD["flags"]] = flags
                for field, t in zip(PROLOGUE, prologue):
                    self.semaphores[at + FIELD[field]] = Int32(t)
                self._time(slot, FIELD["start_lo"], FIELD["start_hi"], start)
        return slot

    @cute.jit
    def blocks(self, slot: Int32, n_block_min: Int32, n_block_max: Int32):
        """The tile's K/V block range [n_block_min, n_block_max)."""
        if slot >= 0:
            at = self.semaphores[BASE_WORD] + slot * RECORD_WORDS
            self.semaphores[at + FIELD["n_block_min"]] = n_block_min
            self.semaphores[at + FIELD["n_block_max"]] = n_block_max

    @cute.jit
    def mark(self, slot: Int32, field: cutlass.Constexpr[str]):
        """Now, into one of the MARKS."""
        if slot >= 0:
            self._time(slot, FIELD[field], -1)

    @cute.jit
    def end(self, slot: Int32, flags: Int32):
        """The tile is done (its O store issued); ``flags`` are or-ed into the record's."""
        if slot >= 0:
            at = self.semaphores[BASE_WORD] + slot * RECORD_WORDS
            self.semaphores[at + FIELD["flags"]] = self.semaphores[at + FIELD["flags"]] | flags
            self._time(slot, FIELD["end_lo"], -1)
