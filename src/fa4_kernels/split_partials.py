"""Partial results of split tiles (tile_scheduler.SplitTail) in global memory.

A piece of a tile that misses the tile's block 0 ("writer") stores, per consumer thread, its
unnormalised O accumulator, row maxima and thread-local row sums, then raises its warpgroup's
flag. The piece holding block 0 ("merger") waits for the writers' flags and folds each partial
into its own state exactly as the online softmax folds a K/V block in: rescale both sides to
the larger row max and add. The merged state then goes through the usual finalize/epilogue.
Rows that hold no query (most of a decoding tile) are neither stored nor loaded.

Workspace layout (the ABI with csrc_shims/fa4_shim.c, fa4_split_workspace):
  semaphores (int32): word 0 the dynamic scheduler's tile counter; from FLAGS_BASE one flag per
      (CTA slot, consumer warpgroup), zero at launch and zero again when the kernel ends (each
      merger resets the flags it consumed, so a workspace can be reused without a memset).
  partials (fp32): one slot per CTA of the grid (num_sms of them), each holding, for every
      consumer thread t, words [w * threads + t for w in range(WORDS)]: the thread's O
      accumulator (rows-major), its row maxima, then its row sums. Consecutive threads write
      consecutive words.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_kernels.hopper_mma import rows_cols_view
from fa4_kernels.ptx import SPIN_LIMIT, nanosleep, trap

FLAGS_BASE = 32  # semaphore words before the flags (word 0: the tile counter)


def partial_words_per_thread(head_dim_v: int) -> int:
    """O accumulator (64 rows x dv over 128 threads: dv / 2) + 2 row maxima + 2 row sums."""
    return head_dim_v // 2 + 4


@dataclass(frozen=True)
class SplitPartials:
    semaphores: cute.Tensor  # int32
    partials: cute.Tensor  # fp32
    num_threads: cutlass.Constexpr[int]  # consumer threads of a CTA
    num_wg: cutlass.Constexpr[int]  # consumer warpgroups (one flag each per slot)
    words: cutlass.Constexpr[int]  # partial_words_per_thread

    def word(self, slot: Int32, w: int, tidx: Int32):
        return (slot * self.words + w) * self.num_threads + tidx

    def flag_ptr(self, slot: Int32, wg: Int32):
        return self.semaphores.iterator + (FLAGS_BASE + slot * self.num_wg + wg)

    @cute.jit
    def store(self, slot: Int32, wg: Int32, tidx: Int32, acc_O: cute.Tensor, row_max: cute.Tensor,
              row_sum: cute.Tensor, live: tuple, barrier_id: Int32):
        """Writer: store this thread's state in ``slot`` (rows whose ``live`` flag is false hold
        no query and are skipped: most of a decoding tile's rows), then, once the whole warpgroup
        has, raise the warpgroup's flag with release semantics."""
        o = rows_cols_view(acc_O)
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        for r in cutlass.range_constexpr(rows):
            if live[r]:
                for c in cutlass.range_constexpr(cols):
                    self.partials[self.word(slot, r * cols + c, tidx)] = o[r, c]
                self.partials[self.word(slot, rows * cols + r, tidx)] = row_max[r]
                self.partials[self.word(slot, rows * cols + rows + r, tidx)] = row_sum[r]
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        if tidx % 128 == 0:
            # The barrier orders the warpgroup's stores before this thread's fence; the fence
            # makes them visible at GPU scope before the flag (cumulativity).
            cute.arch.fence_acq_rel_gpu()
            cute.arch.store(self.flag_ptr(slot, wg), Int32(1), sem="relaxed", scope="gpu")

    @cute.jit
    def wait(self, first_slot: Int32, count: Int32, wg: Int32, tidx: Int32, barrier_id: Int32):
        """Merger: wait until slots first_slot .. first_slot + count - 1 hold this warpgroup's
        partials (a tile split many ways, as in decoding, has many: the warpgroup's threads poll
        them in parallel, one each), and reset their flags for the next launch."""
        i = tidx % 128
        while i < count:
            flag = self.flag_ptr(first_slot + i, wg)
            polls = Int32(0)
            while cute.arch.load(flag, Int32, sem="acquire", scope="gpu") == 0:
                nanosleep()
                polls += 1
                if polls == SPIN_LIMIT:
                    trap()
            cute.arch.store(flag, Int32(0), sem="relaxed", scope="gpu")
            i += 128
        # Each flag's acquire, then the barrier: every partial's words are visible to all threads.
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)

    @cute.jit
    def merge(self, slot: Int32, tidx: Int32, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
              live: tuple, scale_log2: Float32):
        """Merger, after ``wait``: fold ``slot``'s partial of this thread's ``live`` rows into
        (acc_O, row_max, row_sum)."""
        o = rows_cols_view(acc_O)
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        for r in cutlass.range_constexpr(rows):
            if live[r]:
                other_max = self.partials[self.word(slot, rows * cols + r, tidx)]
                other_sum = self.partials[self.word(slot, rows * cols + rows + r, tidx)]
                new_max = cutlass.max(row_max[r], other_max)
                # Both -inf (a row that saw no key in either piece): scale both by exp2(-inf) = 0.
                safe_max = Float32(0.0) if new_max == -Float32.inf else new_max
                mine = cute.math.exp2((row_max[r] - safe_max) * scale_log2, fastmath=True)
                theirs = cute.math.exp2((other_max - safe_max) * scale_log2, fastmath=True)
                row_max[r] = new_max
                row_sum[r] = row_sum[r] * mine + other_sum * theirs
                for c in cutlass.range_constexpr(cols):
                    o[r, c] = o[r, c] * mine + self.partials[self.word(slot, r * cols + c, tidx)] * theirs
