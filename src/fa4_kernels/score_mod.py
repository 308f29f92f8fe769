"""Built-in score_mods evaluated inside the kernels (fa4.score_mods): an additive bias on each
score of a tile held in WGMMA accumulator registers, and, in the backward, the gradient of its
learnable parameters.

Kinds (catalog.SCORE_MODS):
  "alibi"   bias = slopes[h] * (key - query)                     params (heads, 1)
  "relbias" bias = table[h, clamp(query - key, -c, c) + c]       params (heads, 2c + 1)
The bias is divided by the softmax scale (``inv_scale``) and added to the raw scores q . k that
the accumulators hold (the softmax multiplies them by the scale). The parameters' gradient is
that of the scaled score, dS, summed over the pairs each parameter touches (fp32, into a zeroed
(heads, width) tensor).

Coordinates fold as in mask.AttentionMask: a thread's columns are thread 0's (compile-time
constants) shifted by its own column offset, so key - query is one per-row base plus an
immediate. The backward's S^T tiles (rows: keys, columns: queries) use the same code with the
sign of the columns flipped (``transposed``).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from fa4_kernels.hopper_mma import rows_cols_view
from fa4_kernels.ptx import f32_asm, i32_asm, inline_asm, loop_bound_zero


@dsl_user_op
def red_add_if(address: Int64, value: Float32, low: Int32, x: Int32, high: Int32, *, loc=None, ip=None) -> None:
    """``*address += value`` (fp32 reduction in L2, no result) when low < x < high."""
    inline_asm(None, "{\n.reg .pred p;\nsetp.gt.s32 p, $2, $3;\nsetp.lt.and.s32 p, $2, $4, p;\n"
               "@p red.global.add.f32 [$0], $1;\n}",
               "l,f,r,r,r,~{memory}", (Int64(address), Float32(value), Int32(x), Int32(low), Int32(high)),
               volatile=True, loc=loc, ip=ip)


@dsl_user_op
def keep_if_at_most(value: Float32, x: Int32, limit: Int32, *, loc=None, ip=None) -> Float32:
    """``value if x <= limit else 0`` (a compare and a select)."""
    return f32_asm("{\n.reg .pred p;\nsetp.le.s32 p, $2, $3;\nselp.f32 $0, $1, 0f00000000, p;\n}",
                   "=f,f,r,r", (Float32(value), Int32(x), Int32(limit)), loc=loc, ip=ip)


@dsl_user_op
def zero_after(value: Float32, *, loc=None, ip=None) -> Int32:
    """0, computed from ``value`` (a compare the compilers cannot fold): an index plus this waits
    for ``value``'s load, so the loads after it are not issued (and held) before it lands."""
    return i32_asm("{\n.reg .pred p;\nsetp.nan.f32 p, $1, $1;\nselp.s32 $0, 0, 0, p;\n}", "=r,f",
                   (Float32(value),), loc=loc, ip=ip)


@dsl_user_op
def red_add(address: Int64, value: Float32, *, loc=None, ip=None) -> None:
    """``*address += value`` (fp32 reduction in L2, no result)."""
    inline_asm(None, "red.global.add.f32 [$0], $1;", "l,f,~{memory}", (Int64(address), Float32(value)),
               volatile=True, loc=loc, ip=ip)


@dsl_user_op
def red_add_when(address: Int64, value: Float32, flag: Int32, *, loc=None, ip=None) -> None:
    """``*address += value`` (fp32 reduction in L2) when ``flag`` is nonzero."""
    inline_asm(None, "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p red.global.add.f32 [$0], $1;\n}",
               "l,f,r,~{memory}", (Int64(address), Float32(value), Int32(flag)), volatile=True, loc=loc, ip=ip)


@cute.jit
def warp_sum(x: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
    return x


@dataclass(frozen=True)
class ScoreBias:
    kind: cutlass.Constexpr[str]  # "alibi" | "relbias"
    tile_rows: cutlass.Constexpr[int]  # the score tile's shape as held: (tile_m, tile_n), or S^T's
    tile_cols: cutlass.Constexpr[int]
    transposed: cutlass.Constexpr[bool]  # rows are keys and columns queries (the backward's S^T)
    params: cute.Tensor  # (heads, width) fp32
    head: Int32
    # alibi: the head's slope / softmax scale; relbias: 1 / softmax scale (read once per head or
    # tile: a load per K/V step sat between the score GEMM's wait and the softmax).
    factor: Float32

    @staticmethod
    def create(kind: str, tile_rows: int, tile_cols: int, transposed: bool, params: cute.Tensor, head: Int32,
               inv_scale: Float32) -> "ScoreBias":
        factor = inv_scale
        if const_expr(kind == "alibi"):
            factor = params[head, 0] * inv_scale
        return ScoreBias(kind, tile_rows, tile_cols, transposed, params, head, factor)

    @cute.jit
    def _coords(self, thr_mma: cute.ThrMma):
        cS = cute.make_identity_tensor((self.tile_rows, self.tile_cols))
        tScS = rows_cols_view(thr_mma.partition_C(cS))
        t0ScS = rows_cols_view(thr_mma.get_slice(0).partition_C(cS))
        return tScS, t0ScS

    def _col_sign(self) -> int:
        return -1 if self.transposed else 1

    @cute.jit
    def _key_minus_query_base(self, tScS, r, first_row: Int32, first_col: Int32) -> Int32:
        """key - query at this thread's row r and thread 0's column 0 of the tile: the column
        adds col_sign * (its thread-0 column)."""
        row = first_row + tScS[r, 0][0]
        col = first_col + tScS[0][1]
        base = col - row
        if const_expr(self.transposed):
            base = row - col
        return base

    @cute.jit
    def load(self, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32):
        """What ``apply`` adds that comes from memory, read ahead of it (issued under the score
        GEMM): relbias's table entries, one per diagonal of this thread's fragment (the
        ``_diagonals`` order; ``apply`` scales them); None for alibi. Where no distance of the
        fragment clamps (tiles near the diagonal of a long table), the entries are consecutive
        from one address (immediate offsets: no per-entry address registers)."""
        if const_expr(self.kind == "alibi"):
            return None
        tScS, t0ScS = self._coords(thr_mma)
        rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
        offsets = self._diagonal_offsets(t0ScS, rows, cols)
        center = cute.size(self.params.shape[1]) // 2
        # The head's row is addressed afresh at each tile (loop_bound_zero): held across the K/V
        # loop, its address spilled hd256's forward.
        dist = self._reference_distance(tScS, first_row, first_col)
        row = self.params[self.head + loop_bound_zero(first_col), None]
        values = cute.make_rmem_tensor((len(offsets),), Float32)
        if dist + min(offsets) > -center and dist + max(offsets) < center:
            for i, k in enumerate(offsets):
                values[i] = row[dist + center + k]
        else:
            for i, k in enumerate(offsets):
                values[i] = row[cutlass.min(cutlass.max(dist + k, -center), center) + center]
        return values

    @cute.jit
    def add(self, acc: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32,
            waves: cutlass.Constexpr[int] = 4):
        """``apply`` with its loads made here, in ``waves``: each wave's entries are read after the
        last of the wave before has landed and been added (zero_after), so only one wave's are
        live (the backward's "keys" layout: entries held at once beside its S and dP accumulators
        spilled registers)."""
        if const_expr(self.kind == "alibi"):
            self.apply(acc, thr_mma, first_row, first_col)
        else:
            acc_mn = rows_cols_view(acc)
            tScS, t0ScS = self._coords(thr_mma)
            rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
            offsets = self._diagonal_offsets(t0ScS, rows, cols)
            groups = list(self._diagonals(t0ScS, rows, cols).values())
            center = cute.size(self.params.shape[1]) // 2
            dist = self._reference_distance(tScS, first_row, first_col)
            row = self.params[self.head, None]
            per_wave = -(-len(offsets) // waves)
            for start in cutlass.range_constexpr(0, len(offsets), per_wave):
                for i in cutlass.range_constexpr(start, min(start + per_wave, len(offsets))):
                    index = cutlass.min(cutlass.max(dist + offsets[i], -center), center) + center
                    value = row[index] * self.factor
                    for r1, c1 in groups[i]:
                        acc_mn[r1, c1] = acc_mn[r1, c1] + value
                    if const_expr(i == min(start + per_wave, len(offsets)) - 1):
                        dist = dist + zero_after(value)

    @cute.jit
    def apply(self, acc: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32, loaded=None):
        """acc[r, c] += bias at (first_row + row r, first_col + column c) of the sequence
        (``loaded``: this tile's ``load``)."""
        acc_mn = rows_cols_view(acc)
        tScS, t0ScS = self._coords(thr_mma)
        sign = self._col_sign()
        rows = cute.size(acc_mn.shape[0])
        cols = cute.size(acc_mn.shape[1])
        if const_expr(self.kind == "alibi"):
            for r in cutlass.range_constexpr(rows):
                base = Float32(self._key_minus_query_base(tScS, r, first_row, first_col))
                for c in cutlass.range_constexpr(cols):
                    acc_mn[r, c] = acc_mn[r, c] + self.factor * (base + Float32(sign * t0ScS[0, c][1]))
        else:
            for i, members in enumerate(self._diagonals(t0ScS, rows, cols).values()):
                for r1, c1 in members:
                    acc_mn[r1, c1] = acc_mn[r1, c1] + loaded[i] * self.factor

    @cute.jit
    def apply_split(self, acc: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32):
        """ALiBi's bias in two parts (forward): slope * (the column's compile-time offset) added to
        each score, one FFMA with an immediate; slope * (the thread's row base), constant along
        its row fragment, returned per row for the softmax to add to its row max and take off its
        exponentials' shift (OnlineSoftmax.step's ``offsets``): an FFMA per score where the whole
        bias took an FADD and an FFMA (the gain was within noise: docs/perf_notes.md)."""
        acc_mn = rows_cols_view(acc)
        tScS, t0ScS = self._coords(thr_mma)
        sign = self._col_sign()
        rows = cute.size(acc_mn.shape[0])
        offsets = cute.make_rmem_tensor((rows,), Float32)
        for r in cutlass.range_constexpr(rows):
            offsets[r] = self.factor * Float32(self._key_minus_query_base(tScS, r, first_row, first_col))
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                acc_mn[r, c] = acc_mn[r, c] + self.factor * Float32(sign * t0ScS[0, c][1])
        return offsets

    def _diagonals(self, t0ScS, rows: int, cols: int) -> dict:
        """The thread's fragment grouped by diagonal (key - query), at compile time: {first
        (row, column) of a diagonal: its (row, column)s}. Rows 8 apart and columns 8 apart share
        one (the accumulator's 16-row atoms); every thread's offsets keep thread 0's grouping."""
        groups = {}
        for r in range(rows):
            for c in range(cols):
                diagonal = t0ScS[0, c][1] - t0ScS[r, 0][0]
                groups.setdefault(diagonal, []).append((r, c))
        return {members[0]: members for members in groups.values()}

    def _diagonal_offsets(self, t0ScS, rows: int, cols: int) -> list:
        """query - key of each diagonal (``_diagonals`` order) less that of the thread's first
        element (_reference_distance): compile-time constants."""
        offsets = []
        for r, c in self._diagonals(t0ScS, rows, cols):
            row_step, col_step = t0ScS[r, 0][0] - t0ScS[0, 0][0], t0ScS[0, c][1] - t0ScS[0, 0][1]
            offsets.append(col_step - row_step if self.transposed else row_step - col_step)
        return offsets

    @cute.jit
    def _reference_distance(self, tScS, first_row: Int32, first_col: Int32) -> Int32:
        """query - key at this thread's first element of the tile."""
        return -self._key_minus_query_base(tScS, 0, first_row, first_col)

    # -------------------------------------------------------------- backward: the gradient
    @cute.jit
    def accumulate_grad(self, dS: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32,
                        grad: cute.Tensor, enabled: Int32, address_per_tile: cutlass.Constexpr[bool] = False):
        """Add this tile's dS into the parameters' gradient ``grad`` when ``enabled``: alibi's
        slope gets sum(dS * (key - query)), one reduction per warp; relbias's entries their
        diagonals' sums, one L2 reduction per distinct diagonal of the thread's fragment, except
        the two clamped ends, summed per warp first (whole tiles can clamp to one end). All
        per tile: no sums live across the query-block loop (the backward has no registers to
        spare there)."""
        dS_mn = rows_cols_view(dS)
        tScS, t0ScS = self._coords(thr_mma)
        sign = self._col_sign()
        rows = cute.size(dS_mn.shape[0])
        cols = cute.size(dS_mn.shape[1])
        width = cute.size(self.params.shape[1])
        row = self.head * width
        if const_expr(address_per_tile):  # computed here at each tile, not held across the loop
            row = row + loop_bound_zero(first_col)
        row_address = grad.iterator.toint() + Int64(row) * 4
        lane = cute.arch.lane_idx()
        flush = Int32(0)
        if enabled != 0 and lane == 0:
            flush = Int32(1)
        if const_expr(self.kind == "alibi"):
            # sum over the row of dS * (base + sign * column) as base * sum(dS) + sign * sum(column * dS):
            # not the forward's (base + column) terms, which the compiler would otherwise keep
            # from the probabilities, live across the dP GEMM (spills).
            total = Float32(0.0)
            for r in cutlass.range_constexpr(rows):
                base = Float32(self._key_minus_query_base(tScS, r, first_row, first_col))
                row_sum, weighted = Float32(0.0), Float32(0.0)
                for c in cutlass.range_constexpr(cols):
                    row_sum = row_sum + dS_mn[r, c]
                    weighted = weighted + dS_mn[r, c] * Float32(t0ScS[0, c][1])
                total = total + base * row_sum + Float32(sign) * weighted
            red_add_when(row_address, warp_sum(total), flush)
        else:
            center = width // 2
            offsets = self._diagonal_offsets(t0ScS, rows, cols)
            dist = self._reference_distance(tScS, first_row, first_col)
            # One path for every tile (a separate one for tiles that clamp nowhere held the
            # diagonals' sums across the branch: spills): each diagonal's sum goes to its entry
            # by an L2 reduction at an immediate offset from one address, predicated on its
            # distance not clamping; clamped ones into the warp's end sums.
            high = center  # the reductions' open range of distances (-center, high): empty when not enabled
            if enabled == 0:
                high = -center
            low_end, high_end = Float32(0.0), Float32(0.0)
            reference_address = row_address + Int64(dist + center) * 4
            for members, k in zip(self._diagonals(t0ScS, rows, cols).values(), offsets):
                total = Float32(0.0)
                for r1, c1 in members:
                    total = total + dS_mn[r1, c1]
                d = dist + k
                low_end = low_end + keep_if_at_most(total, d, -center)
                high_end = high_end + keep_if_at_most(total, -d, -center)
                red_add_if(reference_address + k * 4, total, -center, d, high)
            red_add_when(row_address, warp_sum(low_end), flush)
            red_add_when(row_address + Int64(width - 1) * 4, warp_sum(high_end), flush)
