"""Backward postprocess: dQ from its fp32 accumulator (sm90/bwd.py adds into it, already scaled) to
the input dtype, each sequence's rows as soon as that sequence's main-kernel CTAs are done.

The accumulator and dQ are both contiguous with the same shape, so the conversion is one flat
pass: each thread turns VECTOR consecutive floats (two 16-byte loads) into one 16-byte store.
The caller launches it on ranges of fewer than 2^31 elements that are multiples of VECTOR and
start on a row (fa4_shim.c, fa4_bwd_postprocess), so a 32-bit index covers every range.

It launches with programmatic dependent launch behind the main kernel, i.e. once every
main-kernel CTA has started, and does not wait for that grid's end: a CTA waits (acquire polls)
until the main kernel has counted every K/V block of the sequences its rows belong to
(``mSeqDone``, bwd.count_done: num_n_blocks * heads_kv per sequence), then converts them. So the
sequences that finish early (packed documents launch in order, as do dense batches) are
converted on the SMs the grid's last CTAs leave idle, instead of after the whole grid (the
ragged end of fa4.bench's 8 documents: ~5% of the main kernel, session 44). The CTAs walk the
rows forward, in the order the sequences finish; the rows outside every sequence (zeroed by the
preprocess) wait for the nearest sequence.

It replaced a torch copy (aoti_torch_copy_), which cost ~10-12 us of host time per backward on an
H100 machine (TensorIterator's setup) against one launch here (csrc_shims/fa4_ops.cpp's host
phases, FA4_DIAG_HOST_TIMING).
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4_kernels.packed_sequences import last_sequence_at_or_before
from fa4_kernels.ptx import nanosleep, trap

THREADS = 256
VECTOR = 8  # floats per thread: 32 bytes in, 16 bytes out
# Polls of a sequence's count before the kernel gives up (trap: a launch error, not a hang): at
# ~2 us a poll over an hour, since the main kernel of one huge call may run for minutes.
WAIT_LIMIT = (1 << 31) - 1
# The back-off between polls. 256 and 2048 ns measured the same (H200, packed documents and dense
# batches, session 45); the longer one keeps ~1000 waiting CTAs' loads off the counts' L2 slice.
POLL_SLEEP_NS = 2048


class BackwardPostprocessSm90:
    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        mAccum: cute.Tensor,  # (n,) fp32, n a multiple of VECTOR, 16-byte aligned
        mOut: cute.Tensor,  # (n,) in the input dtype, 16-byte aligned
        mSeqDone: cute.Tensor,  # (sequences,) int32: the main kernel's K/V blocks done per sequence
        mCuSeqlensQ: cute.Tensor,  # packed sequences: (sequences + 1,) int32
        first_row: Int32,  # the query row (token) mAccum[0] belongs to
        row_words: Int32,  # floats per row: heads_q * head_dim, a multiple of VECTOR
        batch_rows: Int32,  # dense batches: rows per batch (seqlen_q); packed: the rows in all
        expected: Int32,  # the count at which a sequence is done
        is_varlen: Int32,  # 1: sequences delimited by mCuSeqlensQ
        stream: cuda.CUstream,
    ):
        vectors = cute.size(mAccum.shape[0]) // VECTOR
        self.kernel(mAccum, mOut, mSeqDone, mCuSeqlensQ, vectors, first_row, row_words, batch_rows, expected,
                    is_varlen).launch(
            grid=(cute.ceil_div(vectors, THREADS), 1, 1), block=[THREADS, 1, 1], stream=stream, use_pdl=True,
        )

    @cute.kernel
    def kernel(self, mAccum: cute.Tensor, mOut: cute.Tensor, mSeqDone: cute.Tensor, mCuSeqlensQ: cute.Tensor,
               vectors: Int32, first_row: Int32, row_words: Int32, batch_rows: Int32, expected: Int32,
               is_varlen: Int32):
        tidx = cute.arch.thread_idx()[0]
        block = cute.arch.block_idx()[0]
        vector = block * THREADS + tidx
        if cute.arch.warp_idx() == 0:
            first_vector = block * THREADS
            last_vector = cutlass.min(first_vector + THREADS, vectors) - 1
            per_row = row_words // VECTOR
            row_lo, row_hi = first_row + first_vector // per_row, first_row + last_vector // per_row
            lo = self.sequence_of(row_lo, mCuSeqlensQ, batch_rows, is_varlen)
            hi = lo
            if row_hi != row_lo:  # a CTA's 2048 floats: one row from hq * d = 2048 on
                hi = self.sequence_of(row_hi, mCuSeqlensQ, batch_rows, is_varlen)
            # Lane j waits for sequences lo + j, lo + j + 32, ... (one almost always).
            for seq in cutlass.range(lo + cute.arch.lane_idx(), hi + 1, cute.arch.WARP_SIZE, unroll=1):
                polls = Int32(0)
                while cute.arch.load(mSeqDone.iterator + seq, Int32, sem="acquire", scope="gpu") < expected:
                    nanosleep(POLL_SLEEP_NS)
                    polls += 1
                    if polls == WAIT_LIMIT:
                        trap()
        # The acquire loads above, then the barrier: every thread's loads below see the sequences'
        # additions.
        cute.arch.sync_threads()
        if vector < vectors:
            acc = cute.make_rmem_tensor((VECTOR,), Float32)
            cute.autovec_copy(cute.local_tile(mAccum, (VECTOR,), (vector,)), acc)
            out = cute.make_rmem_tensor((VECTOR,), self.dtype)
            out.store(acc.load().to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mOut, (VECTOR,), (vector,)))
        if block == cute.arch.grid_dim()[0] - 1:
            # This grid must not end before the main kernel's (what runs next waits for this one):
            # its last CTA waits for it, after its own rows (the last sequence's, done last).
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def sequence_of(self, row: Int32, mCuSeqlensQ: cute.Tensor, batch_rows: Int32, is_varlen: Int32):
        """The sequence (dense: batch) whose rows hold ``row``, clamped to an existing one: rows
        outside every packed sequence belong to the nearest (they were zeroed before the main
        kernel started; its counts order them all the same). All lanes of the warp take part."""
        seq = row // cutlass.max(batch_rows, 1)
        if is_varlen != 0:
            found = last_sequence_at_or_before(mCuSeqlensQ, row, batch_rows, lambda start, i: start)
            seq = cutlass.min(cutlass.max(found, 0), cute.size(mCuSeqlensQ.shape[0]) - 2)
        return seq
