"""Online softmax over score tiles held in WGMMA accumulators (fp32, base-2 exponentials).

Each thread owns whole row fragments; a row is spread over the 4 threads of a quad, so
row maxima are reduced with two butterfly shuffles. Row sums stay thread-local until
``finalize`` (one quad reduction per tile instead of one per K/V block).
"""
import math
import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cutlass_dsl import dsl_user_op
from cutlass._mlir.dialects import nvvm

from fa4_kernels.exp2_fma import exp2_fma, on_fma_pipe
from fa4_kernels.hopper_mma import rows_cols_view


@dsl_user_op
def fmax(a, b, *, loc=None, ip=None) -> Float32:
    return Float32(
        nvvm.fmax(Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    )


@cute.jit
def row_max(x: cute.TensorSSA, init):
    """Max of a row fragment with 4 independent chains (keeps the FMNMX pipe busy)."""
    vals = cute.make_rmem_tensor(x.shape, Float32)
    vals.store(x)
    n = cute.size(x.shape)
    acc = [vals[0], vals[1], vals[2], vals[3]]
    for i in cutlass.range_constexpr(4, n, 4):
        for j in cutlass.range_constexpr(4):
            acc[j] = fmax(acc[j], vals[i + j])
    m = fmax(fmax(acc[0], acc[1]), fmax(acc[2], acc[3]))
    if const_expr(init is not None):
        m = fmax(m, init)
    return m


@cute.jit
def quad_allreduce(val, op: cutlass.Constexpr):
    for i in cutlass.range_constexpr(2):
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=1 << i))
    return val


@cute.jit
def exp2_row(x: cute.TensorSSA, per_8: cutlass.Constexpr[int], clamp_high: cutlass.Constexpr[bool]) -> cute.TensorSSA:
    """2^x of a row fragment, ``per_8`` of every 8 elements on the FMA pipe (exp2_fma), the rest
    on MUFU. ``clamp_high``: x may exceed 127 (exp2_fma then needs its upper clamp)."""
    if const_expr(per_8 == 0):
        return cute.math.exp2(x, fastmath=True)
    vals = cute.make_rmem_tensor(x.shape, Float32)
    vals.store(x)
    for i in cutlass.range_constexpr(cute.size(x.shape)):
        if const_expr(on_fma_pipe(i, per_8)):
            vals[i] = exp2_fma(vals[i], clamp_high)
        else:
            vals[i] = cute.math.exp2(vals[i], fastmath=True)
    return vals.load()


@dataclass
class OnlineSoftmax:
    scale_log2: Float32  # softmax scale * log2(e): exponentials are exp2(s * scale_log2 - max)
    row_max: cute.Tensor
    row_sum: cute.Tensor
    # > 0: a row keeps its running max until a block raises it by more than this many powers
    # of two (probabilities then reach at most 2^threshold: harmless in fp32 sums and in
    # bf16/fp16 P), so O needs rescaling only on those rare blocks (see ``rescale``).
    rescale_threshold: cutlass.Constexpr[float] = 0.0
    # Of every 8 probabilities, how many are computed on the FMA pipe (exp2_row).
    exp2_fma: cutlass.Constexpr[int] = 0

    @staticmethod
    def create(scale_log2: Float32, num_rows: cutlass.Constexpr[int], rescale_threshold: cutlass.Constexpr[float] = 0.0,
               exp2_fma: cutlass.Constexpr[int] = 0):
        return OnlineSoftmax(
            scale_log2,
            cute.make_rmem_tensor(num_rows, Float32),
            cute.make_rmem_tensor(num_rows, Float32),
            rescale_threshold,
            exp2_fma,
        )

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool], offsets=None) -> cute.Tensor:
        """Turn scores into unnormalised probabilities in place; return the per-row factor by
        which the running output must be rescaled. ``offsets``: a per-row value this thread's
        scores lack (the scores are acc_S + offsets[r]; an ALiBi bias's part that is constant
        along the thread's row fragment, score_mod.ScoreBias.apply_split), added to its row max
        and taken off the exponentials' shift instead of added to every score."""
        acc_mn = rows_cols_view(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = acc_mn[r, None].load()
            prev_max = self.row_max[r]
            if const_expr(offsets is None):
                cur_max = row_max(row, None if const_expr(is_first) else prev_max)
            else:
                cur_max = row_max(row, None) + offsets[r]
                if const_expr(not is_first):
                    cur_max = fmax(cur_max, prev_max)
            cur_max = quad_allreduce(cur_max, fmax)
            if const_expr(not is_first and self.rescale_threshold > 0.0):
                # Same decision in the 4 threads of a row (quad-reduced max). Both -inf: NaN
                # compares false and the row keeps -inf, as without the threshold.
                if not (cur_max - prev_max) * self.scale_log2 > Float32(self.rescale_threshold):
                    cur_max = prev_max
            self.row_max[r] = cur_max
            # A row with every score masked keeps max -inf; use 0 so exp2 gives 0, not NaN.
            safe_max = Float32(0.0) if cur_max == -Float32.inf else cur_max
            max_scaled = safe_max * self.scale_log2
            if const_expr(offsets is not None):
                max_scaled = (safe_max - offsets[r]) * self.scale_log2
            # At most rescale_threshold above the kept max: no upper clamp.
            p = exp2_row(row * self.scale_log2 - max_scaled, self.exp2_fma, clamp_high=False)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            else:
                row_scale[r] = cute.math.exp2((prev_max - safe_max) * self.scale_log2, fastmath=True)
                self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r] * row_scale[r], 0)
            acc_mn[r, None].store(p)
        return row_scale

    def local_view(self) -> "OnlineSoftmax":
        """The same state through new tensor objects over the same registers."""
        return OnlineSoftmax(
            self.scale_log2,
            cute.make_tensor(self.row_max.iterator, self.row_max.layout),
            cute.make_tensor(self.row_sum.iterator, self.row_sum.layout),
            self.rescale_threshold,
            self.exp2_fma,
        )

    @cute.jit
    def speculative_step(self, acc_S: cute.Tensor, probs: cute.Tensor, offsets=None) -> cute.Tensor:
        """Probabilities of a block after the first against the running max, with no row max:
        the max's reduction (FMNMX chains and quad shuffles) otherwise stands between the
        Q @ K^T wait and the first exponential of every K/V step. ``probs`` (shaped like
        acc_S) receives them and acc_S keeps the scores, for ``step`` to redo the block where
        the guess fails. Returns this thread's per-row sums of the block (``holds`` checks
        them; ``accept`` adds them to the row sums).

        The guess holds where ``step`` would keep the running max, i.e. where no score rose
        more than ``rescale_threshold`` powers of two above it: then no probability exceeds
        2^threshold, which a thread's block sum of at most 2^threshold implies. A row with no
        max yet (-inf) gives +inf or NaN exponentials and fails the check."""
        s_mn = rows_cols_view(acc_S)
        p_mn = rows_cols_view(probs)
        block_sum = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            shift = self.row_max[r] * self.scale_log2
            if const_expr(offsets is not None):  # see step
                shift = (self.row_max[r] - offsets[r]) * self.scale_log2
            # A failed guess may put x anywhere: clamped, so the check below sees a large sum.
            p = exp2_row(s_mn[r, None].load() * self.scale_log2 - shift, self.exp2_fma, clamp_high=True)
            block_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            p_mn[r, None].store(p)
        return block_sum

    @cute.jit
    def holds(self, block_sum: cute.Tensor):
        """Whether ``speculative_step``'s guess holds for every row of this warp (warp-uniform,
        so the quad shuffles of a redo see all four threads of each row). NaN compares false."""
        bound = Float32(2.0 ** self.rescale_threshold)
        ok = block_sum[0] <= bound
        for r in cutlass.range_constexpr(1, cute.size(block_sum)):
            ok = ok and block_sum[r] <= bound
        return cute.arch.vote_all_sync(ok)

    @cute.jit
    def accept(self, block_sum: cute.Tensor):
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            self.row_sum[r] = self.row_sum[r] + block_sum[r]

    @cute.jit
    def row_totals(self) -> cute.Tensor:
        """Row sums reduced over the quad (the thread-local ``row_sum`` is left as it is)."""
        totals = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            totals[r] = quad_allreduce(self.row_sum[r], operator.add)
        return totals

    @cute.jit
    def finalize(self, totals: cute.Tensor) -> cute.Tensor:
        """Return 1/rowsum per row and replace row_sum by the natural-log LSE (-inf when the
        row saw no key, with a 0 output instead of NaN). ``totals``: ``row_totals()`` of the
        current state (taken early, so that its shuffles overlap the last P @ V)."""
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = totals[r]
            empty = total == 0.0 or total != total
            row_scale[r] = cute.arch.rcp_approx(Float32(1.0) if empty else total)
            lse = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * math.log(2.0)
            self.row_sum[r] = -Float32.inf if empty else lse
        return row_scale

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, row_scale: cute.Tensor, always: cutlass.Constexpr[bool] = False):
        """O *= row_scale per row. With a rescale threshold, the running rescale is skipped by
        whole warps when none of their rows moved its max (the common case after the first
        blocks): the FMULs over O are a large share of the loop's instructions. ``always``:
        no such test (the final normalisation, or a block known to have moved a max)."""
        acc_mn = rows_cols_view(acc_O)
        if const_expr(always or self.rescale_threshold == 0.0):
            for r in cutlass.range_constexpr(cute.size(row_scale)):
                acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])
        else:
            moved = row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(row_scale)):
                moved = moved or row_scale[r] != Float32(1.0)
            if cute.arch.vote_any_sync(moved):
                for r in cutlass.range_constexpr(cute.size(row_scale)):
                    acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])
