"""Backward preprocess: the row statistics the backward kernel (sm90/bwd.py) reads, in its layout.

One CTA (128 threads) per block of tile_m query rows of one head, tile_m the statistics'
padding unit (heuristics.STATS_BLOCK_ROWS):
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
  packed sequences: in each sequence, the accumulator's rows that see no key and those of its last
    query block when that block is partial (the main kernel only adds into it: a store of the
    whole block would overwrite the next sequence's first rows), or every row without first
    stores; dK and dV on the keys past ``seqused_k``; and, in one more slice of the grid (z =
    the number of sequences), every row outside all sequences (before cu_seqlens[0], from
    cu_seqlens[-1] on) of the accumulator, dK and dV. The main kernel then needs no zeroed
    buffers (session 40: the memsets of the accumulator, dK and dV were ~4.6% of an 8-document
    training step).

Each row is read by a group of threads in 16-byte vectors (the group's size a power of two
dividing head_dim_v / 8) and summed with shuffles. It is a pass over O and dO at memory speed:
every load a thread makes (the rows' LSE and dLSE first, then O and dO in batches of passes) is
issued before the stores that follow it, which the compiler may not move loads across. Loading
a row's LSE next to its store, pass after pass, made 16 dependent round trips per CTA and ran
hd128 at 1.9 TB/s (143 us for 16k tokens of hidden 2048 on an H100, cuDNN's own pass 93 us).
"""
import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_kernels.seqlen_info import SeqlenInfo
from fa4_kernels.sm90.bwd import stats_offset
from fa4_kernels.sm90.common import LOG2_E

THREADS = 128
VECTOR = 8  # 16-bit elements per 16-byte load
LOADS_IN_FLIGHT = 64  # elements of O (and of dO) one thread loads before summing: ~100 registers


def rows_before_first_key(seqlen_q, seqlen_k, window_right):
    """Query rows, from row 0, that see no key under the bottom-right aligned mask's right side
    (window_right >= 2**30: none) when seqlen_k >= 1: the rule of csrc_shims/fa4_rules.c's
    fa4_keyless_rows, which the CPU tests hold this one to. Pure integer arithmetic (DSL integers
    in the kernel, Python ints in the tests), in steps that cannot overflow 32 bits."""
    return cutlass.min(seqlen_q, cutlass.max(cutlass.max(seqlen_q - seqlen_k, 0) - window_right, 0))


class BackwardPreprocessSm90:
    def __init__(self, dtype, head_dim: int, head_dim_v: int, tile_m: int):
        assert head_dim_v % VECTOR == 0 and head_dim % 4 == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.tile_m = tile_m
        self.threads_per_row = math.gcd(head_dim_v // VECTOR, 16)
        self.vectors_per_thread = head_dim_v // VECTOR // self.threads_per_row
        self.rows_per_pass = THREADS // self.threads_per_row
        assert tile_m % self.rows_per_pass == 0
        # Passes whose loads are in flight together: at most LOADS_IN_FLIGHT elements of O and of
        # dO per thread (hd192 and hd256 holding 192-256 each spilled 20-2400 local-memory
        # accesses; 128 each at hd128 took 252 registers, two CTAs per SM).
        passes = tile_m // self.rows_per_pass
        per_batch = max(1, LOADS_IN_FLIGHT // (VECTOR * self.vectors_per_thread))
        self.passes_per_batch = max(d for d in range(1, passes + 1) if passes % d == 0 and d <= per_batch)

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
        has_dlse: Int32,
        zero_rows: Int32,  # dense: the accumulator's rows below it zeroed in each batch
        num_m_blocks: Int32,  # query blocks of the longest sequence (the grid's x)
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
            batches = cute.size(mCuSeqlensQ.shape[0])  # the sequences and the slice outside them
        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mdPsum, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
                    has_dlse, zero_rows, is_varlen, store_first, window_right, has_seqused_k).launch(
            grid=(num_m_blocks, cute.size(mO.shape[2]), batches), block=[THREADS, 1, 1], stream=stream,
            use_pdl=True,
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
        has_dlse: Int32,
        zero_rows: Int32,
        is_varlen: Int32,
        store_first: Int32,
        window_right: Int32,
        has_seqused_k: Int32,
    ):
        # Launched with programmatic dependent launch (see the main kernel's start): nothing is read
        # before the previous kernel's end; the main kernel's CTAs may launch as ours exit.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch_idx = cute.arch.block_idx()
        seqlen_q, offset_q = mO.shape[0], Int32(0)
        data_batch, stats_row0 = batch_idx, Int32(0)
        block_lo = m_block * self.tile_m  # this CTA's query rows: [block_lo, block_lo + tile_m)
        # Dense: the accumulator's rows below zero_rows. Packed: set below.
        zero_lo, zero_hi = Int32(0), cutlass.min(zero_rows, seqlen_q)
        zero_tail_lo = seqlen_q
        outside = Int32(0)  # packed: 1 in the grid's last slice, the rows outside every sequence
        if is_varlen != 0:
            data_batch = Int32(0)
            if batch_idx == cute.size(mCuSeqlensQ.shape[0]) - 1:
                outside = Int32(1)
            else:
                packed = SeqlenInfo.create(batch_idx, mO.shape[0], mdK.shape[0], True, mCuSeqlensQ, mCuSeqlensK,
                                           mSeqUsedK, has_seqused_k)
                seqlen_q, offset_q = packed.seqlen_q, packed.offset_q
                stats_row0 = stats_offset(packed, batch_idx, self.tile_m, True)
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
                # over this sequence's CTAs of K/V head `head`, tile_m rows each, round after round.
                if has_seqused_k != 0 and head < mdK.shape[2]:
                    keys = SeqlenInfo.create(batch_idx, mO.shape[0], mdK.shape[0], True, mCuSeqlensQ, mCuSeqlensK,
                                             mSeqUsedK, Int32(0))
                    self.zero_spread(mdK, mdV, keys.offset_k + packed.seqlen_k, keys.offset_k + keys.seqlen_k,
                                     head, tidx)
        if outside != 0:
            # Rows before the first sequence and after the last one: the accumulator's for query
            # head `head`, dK and dV for K/V head `head`.
            last_q = cutlass.min(cutlass.max(mCuSeqlensQ[cute.size(mCuSeqlensQ.shape[0]) - 1], 0), mO.shape[0])
            first_q = cutlass.min(cutlass.max(mCuSeqlensQ[0], 0), last_q)
            for lo, hi in ((Int32(0), first_q), (last_q, Int32(mO.shape[0]))):
                self.zero_spread(mdQaccum, None, lo, hi, head, tidx)
            if head < mdK.shape[2]:
                last_k = cutlass.min(cutlass.max(mCuSeqlensK[cute.size(mCuSeqlensK.shape[0]) - 1], 0), mdK.shape[0])
                first_k = cutlass.min(cutlass.max(mCuSeqlensK[0], 0), last_k)
                for lo, hi in ((Int32(0), first_k), (last_k, Int32(mdK.shape[0]))):
                    self.zero_spread(mdK, mdV, lo, hi, head, tidx)
        elif m_block < cutlass.max(cute.ceil_div(seqlen_q, self.tile_m), 1):
            lane = tidx % self.threads_per_row
            passes = self.tile_m // self.rows_per_pass
            first_row = block_lo + tidx // self.threads_per_row
            # Every row's LSE (and dLSE) first: no store stands between these loads and O's.
            lse = cute.make_rmem_tensor((passes,), Float32)
            dlse = cute.make_rmem_tensor((passes,), Float32)
            for j in cutlass.range_constexpr(passes):
                row = first_row + j * self.rows_per_pass
                lse[j] = Float32(float("inf"))
                dlse[j] = Float32(0.0)
                if row < seqlen_q:
                    lse[j] = mLSE[offset_q + row, head, data_batch]
                    if has_dlse != 0:
                        dlse[j] = mdLSE[offset_q + row, head, data_batch]
            batch = self.passes_per_batch
            for b in cutlass.range_constexpr(passes // batch):
                # A batch of passes' loads first (in flight together), then their sums.
                rO = cute.make_rmem_tensor((VECTOR, self.vectors_per_thread, batch), self.dtype)
                rdO = cute.make_rmem_tensor((VECTOR, self.vectors_per_thread, batch), self.dtype)
                rO.fill(0.0)
                rdO.fill(0.0)
                for j in cutlass.range_constexpr(batch):
                    row = first_row + (b * batch + j) * self.rows_per_pass
                    if row < seqlen_q:
                        for v in cutlass.range_constexpr(self.vectors_per_thread):
                            col = (v * self.threads_per_row + lane) * VECTOR
                            for src, dst in ((mO, rO), (mdO, rdO)):
                                cute.autovec_copy(cute.local_tile(src[offset_q + row, None, head, data_batch],
                                                                  (VECTOR,), (col // VECTOR,)), dst[None, v, j])
                for j in cutlass.range_constexpr(batch):
                    p = b * batch + j
                    self.store_row_stats(rO, rdO, j, first_row + p * self.rows_per_pass, lane, lse[p], dlse[p],
                                         head, data_batch, stats_row0, mLSE2, mdPsum)
            # The block's rows of dQ's fp32 accumulator in [zero_lo, zero_hi) and from zero_tail_lo
            # on (within the sequence).
            block_hi = cutlass.min(block_lo + self.tile_m, seqlen_q)
            for lo, hi in ((zero_lo, zero_hi), (zero_tail_lo, seqlen_q)):
                lo, hi = cutlass.max(lo, block_lo), cutlass.min(hi, block_hi)
                if lo < hi:
                    self.zero_rows(mdQaccum, offset_q + lo, offset_q + hi, head, data_batch, tidx)

    @cute.jit
    def zero_spread(self, mA: cute.Tensor, mB, lo: Int32, hi: Int32, head: Int32, tidx: Int32):
        """Rows [lo, hi) of mA (and of mB, unless None) for head ``head`` (batch 0), shared by the
        grid's x: CTA x zeroes blocks x, x + grid_x, ... of tile_m rows."""
        stride = Int32(cute.arch.grid_dim()[0]) * self.tile_m
        for block in cutlass.range(lo + cute.arch.block_idx()[0] * self.tile_m, hi, stride, unroll=1):
            block_hi = cutlass.min(block + self.tile_m, hi)
            self.zero_rows(mA, block, block_hi, head, Int32(0), tidx)
            if const_expr(mB is not None):
                self.zero_rows(mB, block, block_hi, head, Int32(0), tidx)

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

    @cute.jit
    def store_row_stats(self, rO: cute.Tensor, rdO: cute.Tensor, j: cutlass.Constexpr[int], row: Int32, lane: Int32,
                        lse: Float32, dlse: Float32, head: Int32, data_batch, stats_row0: Int32, mLSE2: cute.Tensor,
                        mdPsum: cute.Tensor):
        """One row's dPsum (this thread's part of rowsum(dO * O) for loaded pass ``j``, summed over
        the row's threads by shuffles, minus the row's dLSE) and LSE in log2 units (+inf past the
        rows and for rows that see no key), stored by the row's first thread."""
        total = Float32(0.0)
        for v in cutlass.range_constexpr(self.vectors_per_thread):
            for i in cutlass.range_constexpr(VECTOR):
                total += Float32(rO[i, v, j]) * Float32(rdO[i, v, j])
        for i in cutlass.range_constexpr(int(math.log2(self.threads_per_row))):
            total += cute.arch.shuffle_sync_bfly(total, offset=1 << i)
        if lane == 0:
            lse2 = Float32(float("inf"))
            if lse != Float32(-float("inf")):
                lse2 = lse * LOG2_E
            mLSE2[stats_row0 + row, head, data_batch] = lse2
            mdPsum[stats_row0 + row, head, data_batch] = total - dlse
