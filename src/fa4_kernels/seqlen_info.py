"""Per-batch sequence lengths and row offsets: fixed for dense batches, read from
``cu_seqlens`` for packed variable-length ones (documents concatenated along one axis)."""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class SeqlenInfo:
    seqlen_q: Int32
    seqlen_k: Int32
    offset_q: Int32  # first row of this batch's queries in the packed tensor (0 when dense)
    offset_k: Int32

    @staticmethod
    @cute.jit
    def create(batch_idx: Int32, seqlen_q_dense: Int32, seqlen_k_dense: Int32, is_varlen: cutlass.Constexpr[bool],
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor, has_seqused_k: Int32):
        seqlen_q, seqlen_k = seqlen_q_dense, seqlen_k_dense
        offset_q, offset_k = Int32(0), Int32(0)
        if const_expr(is_varlen):
            # seqlen_*_dense are the packed totals here. Offsets are clamped into them, so that
            # malformed cu_seqlens (not checked on the host: that would need a sync) give
            # garbage rows, never accesses outside the tensors.
            total_q, total_k = seqlen_q_dense, seqlen_k_dense
            offset_q = cutlass.min(cutlass.max(mCuSeqlensQ[batch_idx], 0), total_q)
            offset_k = cutlass.min(cutlass.max(mCuSeqlensK[batch_idx], 0), total_k)
            seqlen_q = cutlass.min(cutlass.max(mCuSeqlensQ[batch_idx + 1], offset_q), total_q) - offset_q
            seqlen_k = cutlass.min(cutlass.max(mCuSeqlensK[batch_idx + 1], offset_k), total_k) - offset_k
            if has_seqused_k != 0:  # keys actually used, e.g. a partly filled KV cache
                seqlen_k = cutlass.min(cutlass.max(mSeqUsedK[batch_idx], 0), seqlen_k)
        return SeqlenInfo(seqlen_q, seqlen_k, offset_q, offset_k)

    @staticmethod
    @cute.jit
    def of_cache(batch_idx: Int32, seqlen_q: Int32, capacity: Int32, mCacheSeqlens: cute.Tensor, seqlen_new: Int32):
        """A KV cache's sequence (kv_cache.py): cache_seqlens[b] cached keys plus the seqlen_new
        appended ones, clamped into the cache's capacity (values past it are not checked on the
        host: that would need a sync), so a bad length gives wrong rows, never accesses outside
        the cache."""
        seqlen_k = cutlass.min(cutlass.max(mCacheSeqlens[batch_idx], 0) + seqlen_new, capacity)
        return SeqlenInfo(seqlen_q, seqlen_k, Int32(0), Int32(0))
