"""Backward preprocess: the row statistics the backward kernel (sm90/bwd.py) reads, in its layout.

For each block of tile_m query rows of one head (tile_m the statistics' padding unit,
heuristics.STATS_BLOCK_ROWS; tile_m / ROWS_PER_CTA CTAs of 128 threads share it):
  dPsum[row]    = sum_d dO[row, d] * O[row, d] - dLSE[row]   (fp32; dLSE: the gradient flowing
                  into the returned LSE, d LSE / d s = p, so it folds into the row sum)
  LSE_log2[row] = LSE[row] * log2(e), +inf where LSE = -inf (a row that sees no key: its
                  probabilities exp2(s - LSE_log2) are then 0, as the row's output is)
for every row of the block, the padding past the sequence's rows included (+inf and 0: the
backward kernel loads whole blocks and relies on it). The statistics rows of packed sequences
start at (cu_seqlens_q[i] + i * tile_m) rounded down to a multiple of tile_m (bwd.stats_offset),
and every sequence writes at least one block (the backward visits one even with no rows). Packed
or dense is a run-time argument: one kernel per (dtype, head dims) serves both (the choice is a
few scalar loads per CTA; a twin per layout cost the build ~10 s).
It also zeroes what the main kernel will not write:
  dense batches: the fp32 dQ accumulator's rows below ``zero_rows`` of each batch (all of them, or
    with the main kernel's first stores into query blocks only those that see no key, whose query
    blocks no K/V block may visit);
  every call: the main kernel's per-sequence done counts (``mSeqDone``);
  packed sequences: in each sequence, the accumulator's rows that see no key and those of its last
    query block when that block is partial (the main kernel only adds into it: a store of the
    whole block would overwrite the next sequence's first rows), or every row without first
    stores; dK and dV on the keys past ``seqused_k``; and, shared by all the grid's CTAs, every
    row outside all sequences (before cu_seqlens[0], from cu_seqlens[-1] on) of the
    accumulator, dK and dV. The main kernel then needs no zeroed
    buffers (session 40: the memsets of the accumulator, dK and dV were ~4.6% of an 8-document
    training step).

Each row is read by a group of threads in 16-byte vectors (the group's size a power of two
dividing head_dim_v / 8) and summed with shuffles. It is a pass over O and dO at memory speed,
which takes many warps with their loads in flight: a CTA takes ROWS_PER_CTA rows of a statistics
block (1-4 passes of its 128 threads, every load issued at once: 52 registers at hd128, 9
CTAs per SM), the row sums meet in shared memory, and 32 threads store the rows' statistics in
one coalesced store each. The rows' LSE and dLSE are loaded first, one per thread: no store
stands between those loads and O's. Measured on an H200 (Nsight Compute, fa4.bench's 8 documents
in 16k tokens of hidden 2048): whole 128-row blocks per CTA, 16 loads per thread in flight (128
registers, 4 CTAs per SM), ran at 61% of the DRAM bandwidth (48 us); the same blocks staged in
shared memory by cp.async (64 KB per CTA, 3 CTAs per SM) at 52% (56 us).

Packed sequences take a flat grid over the statistics blocks (x: every block of every sequence,
each CTA finding its sequence by the sequences' first blocks, bwd.stats_offset), not the box
(longest sequence's blocks) x (sequences): with random lengths most of the box's CTAs had no
rows and each still held its SM slot through a load of cu_seqlens (session 40: ~2.6 ns of the
kernel per idle CTA; 5152 of 7200 CTAs at 8 documents).
"""
import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_kernels.packed_sequences import last_sequence_at_or_before
from fa4_kernels.seqlen_info import SeqlenInfo
from fa4_kernels.sm90.bwd import stats_offset
from fa4_kernels.sm90.common import LOG2_E

THREADS = 128
VECTOR = 8  # 16-bit elements per 16-byte load
ROWS_PER_CTA = 32  # a statistics block's rows are shared by tile_m / ROWS_PER_CTA CTAs


def rows_before_first_key(seqlen_q, seqlen_k, window_right):
    """Query rows, from row 0, that see no key under the bottom-right aligned mask's right side
    (window_right >= 2**30: none) when seqlen_k >= 1: the rule of csrc_shims/fa4_rules.c's
    fa4_keyless_rows, which the CPU tests hold this one to. Pure integer arithmetic (DSL integers
    in the kernel, Python ints in the tests), in steps that cannot overflow 32 bits."""
    return cutlass.min(seqlen_q, cutlass.max(cutlass.max(seqlen_q - seqlen_k, 0) - window_right, 0))


def first_stats_block(offset_q, batch_idx, tile_m: int):
    """The first statistics block (of tile_m rows) of packed sequence ``batch_idx`` starting at
    row ``offset_q``: bwd.stats_offset / tile_m (the CPU tests hold the two together). Blocks of
    later sequences start later: the offsets do not decrease and each sequence adds tile_m."""
    return (offset_q + batch_idx * tile_m) // tile_m


def row_plan(head_dim_v: int) -> tuple[int, int, int]:
    """(threads per row, 16-byte vectors of O (and of dO) per thread and row, passes): a pass is
    THREADS // threads_per_row rows, ROWS_PER_CTA rows in all."""
    threads_per_row = math.gcd(head_dim_v // VECTOR, 16)
    vectors = head_dim_v // VECTOR // threads_per_row
    return threads_per_row, vectors, ROWS_PER_CTA // (THREADS // threads_per_row)


class BackwardPreprocessSm90:
    def __init__(self, dtype, head_dim: int, head_dim_v: int, tile_m: int):
        assert head_dim_v % VECTOR == 0 and head_dim % 4 == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.tile_m = tile_m
        self.threads_per_row, self.vectors_per_thread, self.passes = row_plan(head_dim_v)
        self.rows_per_pass = THREADS // self.threads_per_row
        assert self.passes >= 1 and tile_m % ROWS_PER_CTA == 0 and ROWS_PER_CTA <= THREADS
        self.ctas_per_block = tile_m // ROWS_PER_CTA

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim_v)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim_v)
        mLSE: cute.Tensor,  # (batch, heads_q, seqlen_q) fp32, the forward's
        mdLSE: cute.Tensor,  # like mLSE; read when has_dlse
        mLSE2: cute.Tensor,  # (batch, heads_q, padded rows) fp32
        mdPsum: cute.Tensor,  # (batch, heads_q, padded rows) fp32
        mdQaccum: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim) fp32; zeroed where unwritten (module doc)
        mdK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim): packed sequences' unwritten rows zeroed
        mdV: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim_v): as mdK
        mCuSeqlensQ: cute.Tensor,  # packed sequences: (batch + 1,) int32
        mCuSeqlensK: cute.Tensor,  # packed sequences: (batch + 1,) int32
        mSeqUsedK: cute.Tensor,  # packed sequences: (batch,) keys used, read when has_seqused_k
        mSeqDone: cute.Tensor,  # (sequences,) int32: the main kernel's done counts, zeroed here
        has_dlse: Int32,
        zero_rows: Int32,  # dense: the accumulator's rows below it zeroed in each batch
        num_m_blocks: Int32,  # dense, query blocks per batch; packed, statistics blocks
        is_varlen: Int32,  # 1: packed sequences delimited by mCuSeqlensQ (batch dim 1)
        store_first: Int32,  # packed: 1 when the main kernel stores its first dQ into whole query blocks
        window_right: Int32,  # packed: the mask's right side (>= 2^30: none), for the rows that see no key
        has_seqused_k: Int32,
        stream: cuda.CUstream,
    ):
        mO, mdO, mdQaccum, mdK, mdV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                                       for t in (mO, mdO, mdQaccum, mdK, mdV)]
        mLSE, mdLSE, mLSE2, mdPsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                                      for t in (mLSE, mdLSE, mLSE2, mdPsum)]
        batches = cute.size(mO.shape[3])
        if is_varlen != 0:
            batches = 1  # x walks every sequence's statistics blocks

        @cute.struct
        class SharedStorage:
            row_sums: cute.struct.Align[cute.struct.MemRange[Float32, ROWS_PER_CTA], 16]

        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mdPsum, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
                    mSeqDone, has_dlse, zero_rows, is_varlen, store_first, window_right, has_seqused_k,
                    SharedStorage).launch(
            grid=(num_m_blocks * self.ctas_per_block, cute.size(mO.shape[2]), batches), block=[THREADS, 1, 1],
            stream=stream, smem=SharedStorage.size_in_bytes(), use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor,
        mLSE2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        mSeqDone: cute.Tensor,
        has_dlse: Int32,
        zero_rows: Int32,
        is_varlen: Int32,
        store_first: Int32,
        window_right: Int32,
        has_seqused_k: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        # Launched with programmatic dependent launch (see the main kernel's start): nothing is read
        # before the previous kernel's end; the main kernel's CTAs may launch as ours exit.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        tidx = cute.arch.thread_idx()[0]
        cta, head, batch_idx = cute.arch.block_idx()
        if cta == 0 and head == 0 and batch_idx == 0:
            # The main kernel counts its K/V blocks done per sequence from zero (bwd.count_done);
            # it starts after this grid ends (its griddepcontrol.wait).
            for i in cutlass.range(tidx, cute.size(mSeqDone.shape[0]), THREADS, unroll=1):
                mSeqDone[i] = Int32(0)
        smem = cutlass.utils.SmemAllocator()
        row_sums = smem.allocate(SharedStorage).row_sums.get_tensor(cute.make_layout(ROWS_PER_CTA))
        m_block = cta // self.ctas_per_block  # the statistics block (packed: flat, over all sequences)
        part = cta % self.ctas_per_block  # which ROWS_PER_CTA rows of it
        flat_block = m_block
        seqlen_q, offset_q = mO.shape[0], Int32(0)
        data_batch, stats_row0 = batch_idx, Int32(0)
        has_rows = m_block < cutlass.max(cute.ceil_div(seqlen_q, self.tile_m), 1)
        # Dense: the accumulator's rows below zero_rows. Packed: set below.
        zero_lo, zero_hi = Int32(0), cutlass.min(zero_rows, seqlen_q)
        zero_tail_lo = seqlen_q
        first_q, last_q, first_k, last_k = Int32(0), Int32(0), Int32(0), Int32(0)
        if is_varlen != 0:
            data_batch = Int32(0)
            # Where the sequences start and end (for the rows outside them, zeroed at the end):
            # loaded with find_block's loads.
            first_q, last_q, first_k, last_k = self.sequence_bounds(mCuSeqlensQ, mCuSeqlensK, mdQaccum.shape[0],
                                                                    mdK.shape[0])
            batch_idx = self.find_block(mCuSeqlensQ, flat_block, seqlen_q)
            has_rows = batch_idx >= 0
            if has_rows:
                packed = SeqlenInfo.create(batch_idx, mO.shape[0], mdK.shape[0], True, mCuSeqlensQ, mCuSeqlensK,
                                           mSeqUsedK, has_seqused_k)
                seqlen_q, offset_q = packed.seqlen_q, packed.offset_q
                stats_row0 = stats_offset(packed, batch_idx, self.tile_m, True)
                m_block = flat_block - stats_row0 // self.tile_m
                seq_blocks = cutlass.max(cute.ceil_div(seqlen_q, self.tile_m), 1)
                # Past this sequence's blocks: the at most one block between it and the next.
                has_rows = m_block < seq_blocks
                zero_lo, zero_hi, zero_tail_lo = Int32(0), seqlen_q, seqlen_q
                if store_first != 0:
                    # The rows that see no key (bottom-right aligned: the first seqlen_q - seqlen_k -
                    # window_right; all of them without keys), and the last query block's rows when
                    # it is partial (counted in this kernel's blocks, which the main kernel's divide:
                    # a few whole blocks' rows more, which their first stores overwrite).
                    zero_hi = seqlen_q
                    if packed.seqlen_k > 0:
                        zero_hi = rows_before_first_key(seqlen_q, packed.seqlen_k, window_right)
                    zero_tail_lo = seqlen_q // self.tile_m * self.tile_m
                # dK and dV of the keys past seqused_k: the main kernel's CTAs stop there. Spread
                # over this sequence's CTAs of K/V head `head`, ROWS_PER_CTA rows each, round after
                # round.
                if has_rows and has_seqused_k != 0 and head < mdK.shape[2]:
                    keys = SeqlenInfo.create(batch_idx, mO.shape[0], mdK.shape[0], True, mCuSeqlensQ, mCuSeqlensK,
                                             mSeqUsedK, Int32(0))
                    self.zero_spread(mdK, mdV, keys.offset_k + packed.seqlen_k, keys.offset_k + keys.seqlen_k,
                                     head, tidx, m_block * self.ctas_per_block + part,
                                     seq_blocks * self.ctas_per_block)
        if has_rows:
            rows_lo = m_block * self.tile_m + part * ROWS_PER_CTA  # this CTA's rows of the sequence
            self.row_stats(mO, mdO, mLSE, mdLSE, mLSE2, mdPsum, row_sums, has_dlse, rows_lo, seqlen_q, offset_q,
                           head, data_batch, stats_row0, tidx)
            # The CTA's rows of dQ's fp32 accumulator in [zero_lo, zero_hi) and from zero_tail_lo
            # on (within the sequence).
            rows_hi = cutlass.min(rows_lo + ROWS_PER_CTA, seqlen_q)
            for lo, hi in ((zero_lo, zero_hi), (zero_tail_lo, seqlen_q)):
                lo, hi = cutlass.max(lo, rows_lo), cutlass.min(hi, rows_hi)
                if lo < hi:
                    self.zero_rows(mdQaccum, offset_q + lo, offset_q + hi, head, data_batch, tidx)
        if is_varlen != 0:
            self.zero_outside(mdQaccum, mdK, mdV, (first_q, last_q, first_k, last_k), cta, head, tidx)

    @cute.jit
    def find_block(self, mCuSeqlensQ: cute.Tensor, flat_block: Int32, total_q: Int32):
        """The packed sequence whose statistics blocks start at or before ``flat_block`` last (-1:
        none): first_stats_block grows with the sequence's index."""
        return last_sequence_at_or_before(mCuSeqlensQ, flat_block, total_q,
                                          lambda start, i: first_stats_block(start, i, self.tile_m))

    @cute.jit
    def row_stats(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
                  mLSE2: cute.Tensor, mdPsum: cute.Tensor, row_sums: cute.Tensor, has_dlse: Int32, rows_lo: Int32,
                  seqlen_q: Int32, offset_q: Int32, head: Int32, data_batch: Int32, stats_row0: Int32, tidx: Int32):
        """dPsum and LSE_log2 of the ROWS_PER_CTA rows from ``rows_lo``: every thread's loads of O
        and dO at once, each row's sum over its threads' shuffles into shared memory, then thread
        r < ROWS_PER_CTA stores row r's statistics (one coalesced store per warp)."""
        lane = tidx % self.threads_per_row
        # Row r's LSE (and dLSE) by thread r first: no store stands between these loads and O's.
        stats_row = rows_lo + tidx
        lse, dlse = Float32(float("inf")), Float32(0.0)
        if tidx < ROWS_PER_CTA and stats_row < seqlen_q:
            lse = mLSE[offset_q + stats_row, head, data_batch]
            if has_dlse != 0:
                dlse = mdLSE[offset_q + stats_row, head, data_batch]
        rO = cute.make_rmem_tensor((VECTOR, self.vectors_per_thread, self.passes), self.dtype)
        rdO = cute.make_rmem_tensor((VECTOR, self.vectors_per_thread, self.passes), self.dtype)
        rO.fill(0.0)
        rdO.fill(0.0)
        for p in cutlass.range_constexpr(self.passes):
            row = rows_lo + p * self.rows_per_pass + tidx // self.threads_per_row
            if row < seqlen_q:
                for v in cutlass.range_constexpr(self.vectors_per_thread):
                    col = (v * self.threads_per_row + lane) * VECTOR
                    for src, dst in ((mO, rO), (mdO, rdO)):
                        cute.autovec_copy(cute.local_tile(src[offset_q + row, None, head, data_batch], (VECTOR,),
                                                          (col // VECTOR,)), dst[None, v, p])
        for p in cutlass.range_constexpr(self.passes):
            total = Float32(0.0)
            for v in cutlass.range_constexpr(self.vectors_per_thread):
                for i in cutlass.range_constexpr(VECTOR):
                    total += Float32(rO[i, v, p]) * Float32(rdO[i, v, p])
            for i in cutlass.range_constexpr(int(math.log2(self.threads_per_row))):
                total += cute.arch.shuffle_sync_bfly(total, offset=1 << i)
            if lane == 0:
                row_sums[p * self.rows_per_pass + tidx // self.threads_per_row] = total
        cute.arch.barrier()
        if tidx < ROWS_PER_CTA:
            # Rows past the sequence: +inf and 0 (module doc).
            lse2, dpsum = Float32(float("inf")), Float32(0.0)
            if stats_row < seqlen_q:
                dpsum = row_sums[tidx] - dlse
                if lse != Float32(-float("inf")):
                    lse2 = lse * LOG2_E
            mLSE2[stats_row0 + stats_row, head, data_batch] = lse2
            mdPsum[stats_row0 + stats_row, head, data_batch] = dpsum

    @cute.jit
    def sequence_bounds(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, total_q: Int32, total_k: Int32):
        """Packed sequences: (first_q, last_q, first_k, last_k), where the sequences start and end
        in the query and key rows, clamped into the tensors."""
        ends = cute.size(mCuSeqlensQ.shape[0]) - 1
        last_q = cutlass.min(cutlass.max(mCuSeqlensQ[ends], 0), total_q)
        first_q = cutlass.min(cutlass.max(mCuSeqlensQ[0], 0), last_q)
        last_k = cutlass.min(cutlass.max(mCuSeqlensK[ends], 0), total_k)
        first_k = cutlass.min(cutlass.max(mCuSeqlensK[0], 0), last_k)
        return first_q, last_q, first_k, last_k

    @cute.jit
    def zero_outside(self, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, bounds, cta: Int32,
                     head: Int32, tidx: Int32):
        """Packed sequences: the rows before the first sequence and after the last one (``bounds``,
        sequence_bounds): the accumulator's for query head ``head``, dK and dV for K/V head
        ``head``; spread over the grid's x (usually none)."""
        first_q, last_q, first_k, last_k = bounds
        stride = Int32(cute.arch.grid_dim()[0])
        for lo, hi in ((Int32(0), first_q), (last_q, Int32(mdQaccum.shape[0]))):
            self.zero_spread(mdQaccum, None, lo, hi, head, tidx, cta, stride)
        if head < mdK.shape[2]:
            for lo, hi in ((Int32(0), first_k), (last_k, Int32(mdK.shape[0]))):
                self.zero_spread(mdK, mdV, lo, hi, head, tidx, cta, stride)

    @cute.jit
    def zero_spread(self, mA: cute.Tensor, mB, lo: Int32, hi: Int32, head: Int32, tidx: Int32, index: Int32,
                    stride: Int32):
        """Rows [lo, hi) of mA (and of mB, unless None) for head ``head`` (batch 0), in chunks of
        ROWS_PER_CTA rows shared by ``stride`` CTAs: the one numbered ``index`` zeroes chunks index,
        index + stride, ..."""
        for chunk in cutlass.range(lo + index * ROWS_PER_CTA, hi, stride * ROWS_PER_CTA, unroll=1):
            chunk_hi = cutlass.min(chunk + ROWS_PER_CTA, hi)
            self.zero_rows(mA, chunk, chunk_hi, head, Int32(0), tidx)
            if const_expr(mB is not None):
                self.zero_rows(mB, chunk, chunk_hi, head, Int32(0), tidx)

    @cute.jit
    def zero_rows(self, mT: cute.Tensor, lo: Int32, hi: Int32, head: Int32, data_batch: Int32, tidx: Int32):
        """Rows [lo, hi) of (seqlen, dim, head, batch) mT in 16-byte stores, the CTA's threads taking
        consecutive ones (a loop, not unrolled: every call site would otherwise hold up to 64
        stores, and the preprocess took 4-6x longer to compile)."""
        per_16_bytes = 128 // mT.element_type.width
        per_row = cute.size(mT.shape[1]) // per_16_bytes
        zeros = cute.make_rmem_tensor((per_16_bytes,), mT.element_type)
        zeros.fill(0.0)
        for idx in cutlass.range(tidx, (hi - lo) * per_row, THREADS, unroll=1):
            cute.autovec_copy(zeros, cute.local_tile(mT[lo + idx // per_row, None, head, data_batch], (per_16_bytes,),
                                                     (idx % per_row,)))
