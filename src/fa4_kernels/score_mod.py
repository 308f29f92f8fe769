"""Built-in score_mods evaluated inside the kernels (fa4.score_mods): an additive bias on each
score of a tile held in WGMMA accumulator registers, and, in the backward, the gradient of its
learnable parameters.

Kinds (catalog.SCORE_MODS):
  "alibi"   bias = slopes[h] * (key - query)                     params (heads, 1)
  "relbias" bias = table[h, clamp(query - key, -c, c) + c]       params (heads, 2c + 1)
  "bias"    bias = tensor[b, h, query, key]                      params (batch, heads, seqlen_q,
            seqlen_k), strides 0 where broadcast, keys contiguous, fp32
  "bias16"  the same, the tensor in the inputs' 16-bit dtype (read as such: half the bytes)
The bias is divided by the softmax scale (``inv_scale``) and added to the raw scores q . k that
the accumulators hold (the softmax multiplies them by the scale). The parameters' gradient is
that of the scaled score, dS, summed over the pairs each parameter touches (fp32, into a zeroed
tensor of the parameters' shape; a broadcast bias's gradient has its own zero strides, so the
reductions sum over the broadcast dims).

Coordinates fold as in mask.AttentionMask: a thread's columns are thread 0's (compile-time
constants) shifted by its own column offset, so key - query is one per-row base plus an
immediate. The backward's S^T tiles (rows: keys, columns: queries) use the same code with the
sign of the columns flipped (``transposed``).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from fa4_kernels.catalog import TENSOR_SCORE_MODS
from fa4_kernels.hopper_mma import rows_cols_view
from fa4_kernels.ptx import f32_asm, i32_asm, inline_asm, loop_bound_zero, prefetch_l2


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
def red_add_shared(address: Int32, value: Float32, *, loc=None, ip=None) -> None:
    """``*address += value`` in shared memory (``address``: a shared-window address)."""
    inline_asm(None, "red.shared.add.f32 [$0], $1;", "r,f,~{memory}", (Int32(address), Float32(value)),
               volatile=True, loc=loc, ip=ip)


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


@dsl_user_op
def red_add_if_below(address: Int64, offset: int, value: Float32, q: Int32, q_end: Int32, k: Int32, k_end: Int32, *,
                     loc=None, ip=None) -> None:
    """``*(address + offset bytes) += value`` (fp32 reduction in L2, no result; ``offset`` an
    immediate) when q < q_end and k < k_end."""
    inline_asm(None, "{\n.reg .pred p;\nsetp.lt.s32 p, $2, $3;\nsetp.lt.and.s32 p, $4, $5, p;\n"
               f"@p red.global.add.f32 [$0+{int(offset)}], $1;\n}}",
               "l,f,r,r,r,r,~{memory}", (Int64(address), Float32(value), Int32(q), Int32(q_end), Int32(k),
                                         Int32(k_end)), volatile=True, loc=loc, ip=ip)


@dsl_user_op
def load_global_f32(address: Int64, offset: int, *, loc=None, ip=None) -> Float32:
    """The fp32 at ``address + offset`` bytes (``offset`` an immediate of the load: no address
    register per element), through the read-only path (the bias is not written by the kernel)."""
    return f32_asm(f"ld.global.nc.f32 $0, [$1+{int(offset)}];", "=f,l", (Int64(address),), loc=loc, ip=ip)


@dsl_user_op
def load_global_16(address: Int64, offset: int, is_bf16: bool, *, loc=None, ip=None) -> Float32:
    """The bf16 or fp16 at ``address + offset`` bytes, as fp32 (read-only path)."""
    kind = "bf16" if is_bf16 else "f16"
    return f32_asm(f"{{\n.reg .b16 h16;\nld.global.nc.b16 h16, [$1+{int(offset)}];\ncvt.f32.{kind} $0, h16;\n}}",
                   "=f,l", (Int64(address),), loc=loc, ip=ip)


@dsl_user_op
def load_global_16x2(address: Int64, offset: int, is_bf16: bool, *, loc=None, ip=None):
    """The two bf16 or fp16 at ``address + offset`` bytes, 4-byte aligned, as fp32 (one 32-bit load)."""
    kind = "bf16" if is_bf16 else "f16"
    both = i32_asm(f"ld.global.nc.b32 $0, [$1+{int(offset)}];", "=r,l", (Int64(address),), loc=loc, ip=ip)
    unpack = "{{\n.reg .b16 h16a, h16b;\nmov.b32 {{h16a, h16b}}, $1;\ncvt.f32.%s $0, %s;\n}}" % (kind, "{}")
    low = f32_asm(unpack.format("h16a"), "=f,r", (both,), loc=loc, ip=ip)
    high = f32_asm(unpack.format("h16b"), "=f,r", (both,), loc=loc, ip=ip)
    return low, high


@dsl_user_op
def load_global_f32x2(address: Int64, offset: int, *, loc=None, ip=None):
    """The two fp32 at ``address + offset`` bytes, 8-byte aligned (one 64-bit load: a warp's
    scalar loads of a score fragment's column pairs use half of each 32-byte sector)."""
    both = Int64(inline_asm(T.i64(), f"ld.global.nc.b64 $0, [$1+{int(offset)}];", "=l,l", (Int64(address),), loc=loc,
                            ip=ip))
    low = f32_asm("{\n.reg .b32 unused;\nmov.b64 {$0, unused}, $1;\n}", "=f,l", (both,), loc=loc, ip=ip)
    high = f32_asm("{\n.reg .b32 unused;\nmov.b64 {unused, $0}, $1;\n}", "=f,l", (both,), loc=loc, ip=ip)
    return low, high


@cute.jit
def warp_sum(x: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
    return x


# The kinds that read a bias tensor (fp32, or the inputs' 16-bit dtype).
TENSOR_KINDS = TENSOR_SCORE_MODS


@dataclass(frozen=True)
class ScoreBias:
    kind: cutlass.Constexpr[str]  # "alibi" | "relbias" | TENSOR_KINDS
    tile_rows: cutlass.Constexpr[int]  # the score tile's shape as held: (tile_m, tile_n), or S^T's
    tile_cols: cutlass.Constexpr[int]
    transposed: cutlass.Constexpr[bool]  # rows are keys and columns queries (the backward's S^T)
    params: cute.Tensor  # (heads, width) fp32; TENSOR_KINDS: (batch, heads, seqlen_q, seqlen_k)
    head: Int32
    # alibi: the head's slope / softmax scale; relbias: 1 / softmax scale (read once per head or
    # tile: a load per K/V step sat between the score GEMM's wait and the softmax).
    factor: Float32
    batch: Int32  # TENSOR_KINDS only: the batch index of the tiles
    # relbias: tiles whose distances all clamp to one end of the table take one entry
    # (_clamped_end) instead of one per diagonal (heuristics.FwdConfig.bias_uniform_tiles).
    uniform_tiles: cutlass.Constexpr[bool] = True

    @staticmethod
    def create(kind: str, tile_rows: int, tile_cols: int, transposed: bool, params: cute.Tensor, head: Int32,
               inv_scale: Float32, batch: Int32 = None, uniform_tiles: bool = True) -> "ScoreBias":
        factor = inv_scale
        if const_expr(kind == "alibi"):
            factor = params[head, 0] * inv_scale
        return ScoreBias(kind, tile_rows, tile_cols, transposed, params, head, factor,
                         Int32(0) if batch is None else batch, uniform_tiles)

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
        if const_expr(self.kind in TENSOR_KINDS):
            return self._tensor_load(thr_mma, first_row, first_col)
        tScS, t0ScS = self._coords(thr_mma)
        rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
        offsets = self._diagonal_offsets(t0ScS, rows, cols)
        center = cute.size(self.params.shape[1]) // 2
        # The head's row is addressed afresh at each tile (loop_bound_zero): held across the K/V
        # loop, its address spilled hd256's forward.
        dist = self._reference_distance(tScS, first_row, first_col)
        row = self.params[self.head + loop_bound_zero(first_col), None]
        values = cute.make_rmem_tensor((len(offsets),), Float32)
        uniform, uniform_value = Int32(0), Float32(0.0)
        if const_expr(self.uniform_tiles):
            uniform, end = self._clamped_end(dist, offsets, center)
            if uniform != 0:
                uniform_value = row[end]
                for i in cutlass.range_constexpr(len(offsets)):  # (unread: defined on every path, or they spill)
                    values[i] = uniform_value
            else:
                self._load_diagonals(values, row, dist, offsets, center)
        else:
            self._load_diagonals(values, row, dist, offsets, center)
        return values, uniform, uniform_value

    @cute.jit
    def _load_diagonals(self, values: cute.Tensor, row: cute.Tensor, dist: Int32, offsets: list, center: Int32):
        """values[i] = the table row's entry of diagonal i (``load``)."""
        if dist + min(offsets) > -center and dist + max(offsets) < center:
            for i, k in enumerate(offsets):
                values[i] = row[dist + center + k]
        else:
            for i, k in enumerate(offsets):
                values[i] = row[cutlass.min(cutlass.max(dist + k, -center), center) + center]

    @cute.jit
    def _clamped_end(self, dist: Int32, offsets: list, center: Int32):
        """relbias: (1 where every distance of the warp's fragments clamps to the same end of the
        table, else 0; that end's index). Warp-uniform (a vote), so the branches on it hold
        whole warps (the gradient's warp sums need every lane). Such tiles (all but a band of
        about tile + 2c keys around the diagonal when the table is short against the sequence)
        add one constant to every score: no per-diagonal loads, adds or reductions."""
        high = cute.arch.vote_all_sync(dist + min(offsets) >= center)
        low = cute.arch.vote_all_sync(dist + max(offsets) <= -center)
        uniform, end = Int32(0), Int32(0)
        if high:
            uniform, end = Int32(1), 2 * center
        if low:
            uniform = Int32(1)
        return uniform, end

    @cute.jit
    def load_uniform(self, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32):
        """relbias: (_clamped_end's flag, the entry every score of the tile then takes) for
        ``add``, read ahead of it (under the score GEMMs: read where it is added, its latency
        stood between the GEMM's wait and the exponentials of every tile); None for the other
        kinds. The entry is read whatever the flag (a branch-free load of the table's row)."""
        if const_expr(self.kind != "relbias"):
            return None
        tScS, t0ScS = self._coords(thr_mma)
        offsets = self._diagonal_offsets(t0ScS, cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1]))
        center = cute.size(self.params.shape[1]) // 2
        uniform, end = self._clamped_end(self._reference_distance(tScS, first_row, first_col), offsets, center)
        return uniform, self.params[self.head + loop_bound_zero(first_col), end]

    @cute.jit
    def add(self, acc: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32,
            waves: cutlass.Constexpr[int] = 4, uniform=None):
        """``apply`` with its loads made here, in ``waves``: each wave's entries are read after the
        last of the wave before has landed and been added (zero_after), so only one wave's are
        live (the backward's "keys" layout: entries held at once beside its S and dP accumulators
        spilled registers). ``uniform``: relbias's ``load_uniform`` of the tile."""
        if const_expr(self.kind == "alibi"):
            self.apply(acc, thr_mma, first_row, first_col)
        elif const_expr(self.kind in TENSOR_KINDS):
            self._tensor_add(acc, thr_mma, first_row, first_col, waves)
        else:
            acc_mn = rows_cols_view(acc)
            tScS, t0ScS = self._coords(thr_mma)
            rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
            offsets = self._diagonal_offsets(t0ScS, rows, cols)
            groups = list(self._diagonals(t0ScS, rows, cols).values())
            center = cute.size(self.params.shape[1]) // 2
            dist = self._reference_distance(tScS, first_row, first_col)
            row = self.params[self.head, None]
            if const_expr(uniform is None):
                uniform = self.load_uniform(thr_mma, first_row, first_col)
            flag, entry = uniform
            if flag != 0:
                value = entry * self.factor
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + value
            else:
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
    def apply(self, acc: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32, loaded=None,
              row_offsets: cutlass.Constexpr[bool] = False):
        """acc[r, c] += bias at (first_row + row r, first_col + column c) of the sequence
        (``loaded``: this tile's ``load``). ``row_offsets`` (relbias, the forward): a tile whose
        bias is one constant (_clamped_end) gets nothing added; the constant comes back per row,
        as apply_split's row part, for the softmax (OnlineSoftmax.step's ``offsets``; 0 on the
        other tiles)."""
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
        elif const_expr(self.kind in TENSOR_KINDS):
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cols):
                    acc_mn[r, c] = acc_mn[r, c] + loaded[r * cols + c] * self.factor
        else:
            values, uniform, uniform_value = loaded
            offsets = None
            if const_expr(not self.uniform_tiles):
                self._add_diagonals(acc_mn, t0ScS, rows, cols, values)
            else:
                offsets = cute.make_rmem_tensor((rows,), Float32)
                if uniform != 0:
                    value = uniform_value * self.factor
                    for r in cutlass.range_constexpr(rows):
                        offsets[r] = value
                    if const_expr(not row_offsets):
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            acc[i] = acc[i] + value
                else:
                    for r in cutlass.range_constexpr(rows):
                        offsets[r] = Float32(0.0)
                    self._add_diagonals(acc_mn, t0ScS, rows, cols, values)
            if const_expr(row_offsets):
                return offsets

    def _add_diagonals(self, acc_mn: cute.Tensor, t0ScS, rows: int, cols: int, values: cute.Tensor):
        """relbias: each diagonal's entry (``load``'s values) onto its members' scores."""
        for i, members in enumerate(self._diagonals(t0ScS, rows, cols).values()):
            for r1, c1 in members:
                acc_mn[r1, c1] = acc_mn[r1, c1] + values[i] * self.factor

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

    @cute.jit
    def alibi_row_offsets(self, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32):
        """ALiBi's bias less its per-column part (the forward's alibi_by_mma: the tensor cores add
        slope * the key's offset in the block): slope * (the block's first key - the row), per
        row of this thread's fragment, for the softmax (as apply_split's row part)."""
        tScS, _ = self._coords(thr_mma)
        rows = cute.size(tScS, mode=[0])
        offsets = cute.make_rmem_tensor((rows,), Float32)
        for r in cutlass.range_constexpr(rows):
            offsets[r] = self.factor * Float32(first_col - (first_row + tScS[r, 0][0]))
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
    def grad_ends(self):
        """This thread's sums of dS onto the parameters' entries that whole tiles add to (alibi's
        slope; relbias's two clamped ends), carried over a head's query blocks (accumulate_grad)
        and added to the gradient once (flush_grad); None for the tensor kinds. Reduced per tile,
        every warp of every CTA of a head added to the same entry: the L2's same-address
        reductions took 1.9 of 6.5 ms of a 16k-token causal relative-bias backward (H100; 4.6 ms
        without the table's gradient)."""
        if const_expr(self.kind in TENSOR_KINDS):
            return None
        ends = cute.make_rmem_tensor((1 if const_expr(self.kind == "alibi") else 2,), Float32)
        for i in range(cute.size(ends)):
            ends[i] = Float32(0.0)
        return ends

    @cute.jit
    def flush_grad(self, ends, grad: cute.Tensor, enabled: Int32):
        """grad_ends' sums of the head into its gradient row (entry 0, and relbias's last), one
        reduction per warp and entry, when ``enabled``; nothing for the tensor kinds."""
        if const_expr(ends is not None):
            width = cute.size(self.params.shape[1])
            row_address = grad.iterator.toint() + Int64(self.head * width) * 4
            flush = Int32(0)
            if enabled != 0 and cute.arch.lane_idx() == 0:
                flush = Int32(1)
            red_add_when(row_address, warp_sum(ends[0]), flush)
            if const_expr(self.kind == "relbias"):
                red_add_when(row_address + Int64(width - 1) * 4, warp_sum(ends[1]), flush)

    def grad_window(self, thr_mma: cute.ThrMma) -> int:
        """relbias: the distances (query - key) one warp's fragment of a tile spans, padded to a
        multiple of 32: the floats of the warp's shared window that _diagonal_grad sums a tile's
        diagonals in (a compile-time count; heuristics.BwdConfig.grad_window budgets it)."""
        low, high = self._warp_span(thr_mma)
        return -(-(high - low + 1) // 32) * 32

    def _warp_span(self, thr_mma: cute.ThrMma):
        """(lowest, highest) query - key of a warp's fragment of a tile, relative to lane 0's first
        element (compile-time: every warp's lanes hold the same pattern of coordinates)."""
        cS = cute.make_identity_tensor((self.tile_rows, self.tile_cols))
        t0ScS = rows_cols_view(thr_mma.get_slice(0).partition_C(cS))
        offsets = self._diagonal_offsets(t0ScS, cute.size(t0ScS, mode=[0]), cute.size(t0ScS, mode=[1]))
        deltas = [self._lane_distance(thr_mma, cS, lane) - self._lane_distance(thr_mma, cS, 0)
                  for lane in range(cute.arch.WARP_SIZE)]
        return min(deltas) + min(offsets), max(deltas) + max(offsets)

    def _lane_distance(self, thr_mma: cute.ThrMma, cS, lane: int) -> int:
        """query - key at lane ``lane``'s first element of the tile (compile-time)."""
        row, col = rows_cols_view(thr_mma.get_slice(lane).partition_C(cS))[0, 0]
        query, key = self._query_key(row, col)
        return query - key

    @cute.jit
    def accumulate_grad(self, dS: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32,
                        grad: cute.Tensor, enabled: Int32, address_per_tile: cutlass.Constexpr[bool] = False,
                        ends=None, window=None):
        """Add this tile's dS into the parameters' gradient ``grad`` when ``enabled``: alibi's
        slope gets sum(dS * (key - query)), added to ``ends`` (grad_ends); relbias's entries their
        diagonals' sums, gathered per warp in its shared ``window`` (grad_window floats), one L2
        reduction per distance the warp's fragment spans, except the two clamped ends, added to
        ``ends`` (whole tiles can clamp to one end). No other sums live across the query-block
        loop (the backward has no registers to spare there)."""
        if const_expr(self.kind in TENSOR_KINDS):
            self._tensor_grad(dS, thr_mma, first_row, first_col, grad, enabled)
        else:
            self._param_grad(dS, thr_mma, first_row, first_col, grad, enabled, address_per_tile, ends, window)

    @cute.jit
    def _param_grad(self, dS: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32,
                    grad: cute.Tensor, enabled: Int32, address_per_tile: cutlass.Constexpr[bool], ends=None,
                    window=None):
        """accumulate_grad for the (heads, width) parameter kinds."""
        dS_mn = rows_cols_view(dS)
        tScS, t0ScS = self._coords(thr_mma)
        sign = self._col_sign()
        rows = cute.size(dS_mn.shape[0])
        cols = cute.size(dS_mn.shape[1])
        width = cute.size(self.params.shape[1])
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
            ends[0] = ends[0] + total
        else:
            row = self.head * width
            if const_expr(address_per_tile):  # computed here at each tile, not held across the loop
                row = row + loop_bound_zero(first_col)
            row_address = grad.iterator.toint() + Int64(row) * 4
            center = width // 2
            offsets = self._diagonal_offsets(t0ScS, rows, cols)
            dist = self._reference_distance(tScS, first_row, first_col)
            uniform, end = self._clamped_end(dist, offsets, center)
            if uniform != 0:  # the whole fragment onto one end
                total = Float32(0.0)
                for i in cutlass.range_constexpr(cute.size(dS)):
                    total = total + dS[i]
                ends[0] = ends[0] + keep_if_at_most(total, end, 0)
                ends[1] = ends[1] + keep_if_at_most(total, -end, -1)
            elif enabled != 0:  # (warp-uniform)
                self._diagonal_grad(dS_mn, thr_mma, t0ScS, rows, cols, dist, center, row_address, ends, window)

    @cute.jit
    def _diagonal_grad(self, dS_mn, thr_mma: cute.ThrMma, t0ScS, rows: int, cols: int, dist: Int32, center: Int32,
                       row_address: Int64, ends, window: cute.Tensor):
        """relbias's gradient of a tile whose distances do not all clamp to one end. Each thread's
        diagonal sums go into the warp's shared ``window`` (one slot per distance the warp spans,
        zero between tiles); then each lane takes every 32nd slot, zeroes it and adds it to its
        table entry by one L2 reduction, or to ``ends`` where the distance clamps. A reduction per
        diagonal and thread instead (up to 8 lanes of a warp on one entry, every warp of a head
        on the same entries) cost 1.4 ms of a 5.9 ms backward (H100, 16k tokens causal, a +-256
        table; 4.5 ms without the table's gradient; heuristics.BwdConfig.grad_window). The
        shared reductions compile to compare-and-swap loops (no fp32 add on shared memory)."""
        assert cute.size(window) >= self.grad_window(thr_mma), "the warp's window is smaller than its span"
        low, _ = self._warp_span(thr_mma)
        lowest = cute.arch.shuffle_sync(dist, 0) + low  # the warp's lowest distance: window slot 0
        slot_address = window.iterator.toint() + (dist - lowest) * 4
        for members, k in zip(self._diagonals(t0ScS, rows, cols).values(),
                              self._diagonal_offsets(t0ScS, rows, cols)):
            total = Float32(0.0)
            for r1, c1 in members:
                total = total + dS_mn[r1, c1]
            red_add_shared(slot_address + k * 4, total)
        cute.arch.sync_warp()
        lane = cute.arch.lane_idx()
        lane_address = row_address + Int64(lowest + lane + center) * 4
        for j in cutlass.range_constexpr(cute.size(window) // cute.arch.WARP_SIZE):
            slot = lane + j * cute.arch.WARP_SIZE
            value = window[slot]
            window[slot] = Float32(0.0)
            d = lowest + slot
            ends[0] = ends[0] + keep_if_at_most(value, d, -center)
            ends[1] = ends[1] + keep_if_at_most(value, -d, -center)
            red_add_if(lane_address + j * cute.arch.WARP_SIZE * 4, value, -center, d, center)
        cute.arch.sync_warp()

    # -------------------------------------------------------------- "bias": a tensor
    def _query_key(self, row, col):
        """(query, key) of a tile's (row, column): S^T tiles hold keys on rows."""
        return (col, row) if self.transposed else (row, col)

    def _tensor_elements(self, t0ScS, rows: int, cols: int) -> list:
        """The thread's fragment as ((row, column), query offset, key offset) at compile time,
        ordered by query offset: one row of the tensor after another."""
        elements = [((r, c), *self._query_key(t0ScS[r, 0][0], t0ScS[0, c][1])) for r in range(rows)
                    for c in range(cols)]
        return sorted(elements, key=lambda e: (e[1], e[2]))

    @cute.jit
    def _plane(self, tensor: cute.Tensor):
        """For ``tensor`` (batch, heads, seqlen_q, seqlen_k), keys contiguous: (the address of the
        tiles' (batch, head) plane, the query stride in bytes, seqlen_q, seqlen_k)."""
        size = tensor.element_type.width // 8
        plane = tensor.iterator.toint() + Int64(cute.crd2idx((self.batch, self.head, 0, 0), tensor.layout)) * size
        q_stride = Int64(cute.crd2idx((0, 0, 1, 0), tensor.layout)) * size
        return plane, q_stride, cute.size(tensor, mode=[2]), cute.size(tensor, mode=[3])

    @cute.jit
    def _tensor_origin(self, tensor: cute.Tensor, tScS, first_row: Int32, first_col: Int32):
        """(this thread's first query and key, then ``_plane``'s values)."""
        q0, k0 = self._query_key(first_row + tScS[0, 0][0], first_col + tScS[0, 0][1])
        return q0, k0, *self._plane(tensor)

    @cute.jit
    def _tensor_values(self, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32, elements, values):
        """values[row * cols + column] = the tensor's entry at each of ``elements`` (see
        _tensor_elements). Where the tile lies inside (seqlen_q, seqlen_k), one address per
        tensor row and the entries at immediate offsets from it; elsewhere each entry at its
        position clamped into the tensor (the scores past the sequences are masked, or their rows
        dropped, whatever is added to them)."""
        tScS, _ = self._coords(thr_mma)
        cols = cute.size(tScS, mode=[1])
        q0, k0, plane, q_stride, seqlen_q, seqlen_k = self._tensor_origin(self.params, tScS, first_row, first_col)
        q_first, k_first = self._query_key(first_row, first_col)
        tile_q, tile_k = self._query_key(self.tile_rows, self.tile_cols)
        size = self.params.element_type.width // 8
        if q_first + tile_q <= seqlen_q and k_first + tile_k <= seqlen_k:
            origin = plane + Int64(q0) * q_stride + Int64(k0) * size
            row_address = {dq: origin + q_stride * dq for dq in sorted({e[1] for e in elements})}
            if const_expr(self.transposed):
                self._load_entries(values, cols, elements, row_address, False)
            elif ((plane | q_stride) & (2 * size - 1)) == 0:
                # Rows aligned to a pair (the thread's first key is even): column pairs in one load.
                self._load_entries(values, cols, elements, row_address, True)
            else:
                self._load_entries(values, cols, elements, row_address, False)
        else:
            for (r, c), dq, dk in elements:
                q = cutlass.min(q0 + dq, seqlen_q - 1)
                k = cutlass.min(k0 + dk, seqlen_k - 1)
                values[r * cols + c] = self._load_entry(plane + Int64(q) * q_stride + Int64(k) * size, 0)

    def _load_entry(self, address: Int64, offset: int) -> Float32:
        """The tensor's entry at ``address + offset`` bytes, as fp32."""
        element = self.params.element_type
        if element == Float32:
            return load_global_f32(address, offset)
        return load_global_16(address, offset, element == cutlass.BFloat16)

    def _load_entries(self, values, cols: int, elements, row_address: dict, pairs: bool):
        """values[...] = the entries at ``elements`` from their rows' addresses, adjacent keys of a
        row in one load where ``pairs``."""
        element = self.params.element_type
        size = element.width // 8
        position = {(dq, dk): r * cols + c for (r, c), dq, dk in elements}
        for (r, c), dq, dk in elements:
            if pairs and dk % 2 == 0 and (dq, dk + 1) in position:
                if element == Float32:
                    pair = load_global_f32x2(row_address[dq], size * dk)
                else:
                    pair = load_global_16x2(row_address[dq], size * dk, element == cutlass.BFloat16)
                values[r * cols + c], values[position[(dq, dk + 1)]] = pair
            elif not (pairs and dk % 2 == 1 and (dq, dk - 1) in position):
                values[r * cols + c] = self._load_entry(row_address[dq], size * dk)

    @cute.jit
    def prefetch(self, first_row: Int32, first_col: Int32, thread: Int32, threads: cutlass.Constexpr[int]):
        """A bias tensor's tile at (first_row, first_col) into L2, a step before its loads (their
        latency otherwise stands between the score GEMM and the softmax): each of ``threads``
        threads prefetches its share of the tile's 128-byte lines (positions clamped into the
        tensor). Nothing for the other kinds."""
        if const_expr(self.kind in TENSOR_KINDS):
            q_first, k_first = self._query_key(first_row, first_col)
            tile_q, tile_k = self._query_key(self.tile_rows, self.tile_cols)
            size = self.params.element_type.width // 8
            per_row = -(-tile_k * size // 128)
            lines = tile_q * per_row
            plane, q_stride, seqlen_q, seqlen_k = self._plane(self.params)
            for i in cutlass.range_constexpr(-(-lines // threads)):
                line = thread + i * threads
                q = cutlass.min(q_first + line // per_row, seqlen_q - 1)
                k = cutlass.min(k_first + (line % per_row) * (128 // size), seqlen_k - 1)
                if line < lines:
                    prefetch_l2(plane + Int64(q) * q_stride + Int64(k) * size)

    @cute.jit
    def _tensor_load(self, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32):
        """Every entry of the thread's fragment (``load``), in fragment order."""
        tScS, t0ScS = self._coords(thr_mma)
        rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
        values = cute.make_rmem_tensor((rows * cols,), Float32)
        self._tensor_values(thr_mma, first_row, first_col, self._tensor_elements(t0ScS, rows, cols), values)
        return values

    @cute.jit
    def _tensor_add(self, acc: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32,
                    waves: cutlass.Constexpr[int]):
        """``add`` for a tensor: its entries read and added in ``waves`` (see add)."""
        acc_mn = rows_cols_view(acc)
        tScS, t0ScS = self._coords(thr_mma)
        rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
        elements = self._tensor_elements(t0ScS, rows, cols)
        per_wave = -(-len(elements) // waves)
        values = cute.make_rmem_tensor((rows * cols,), Float32)
        delay = Int32(0)
        for start in cutlass.range_constexpr(0, len(elements), per_wave):
            wave = elements[start:start + per_wave]
            self._tensor_values(thr_mma, first_row + delay, first_col, wave, values)
            for (r, c), _, _ in wave:
                acc_mn[r, c] = acc_mn[r, c] + values[r * cols + c] * self.factor
            (r, c), _, _ = wave[-1]
            delay = delay + zero_after(values[r * cols + c])

    @cute.jit
    def _tensor_grad(self, dS: cute.Tensor, thr_mma: cute.ThrMma, first_row: Int32, first_col: Int32,
                     grad: cute.Tensor, enabled: Int32):
        """dS into the tensor's gradient ``grad`` (its shape, fp32, zero strides where the bias
        broadcasts: the reductions sum there), one L2 reduction per score inside (seqlen_q,
        seqlen_k), none when not ``enabled``."""
        dS_mn = rows_cols_view(dS)
        tScS, t0ScS = self._coords(thr_mma)
        rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
        q0, k0, plane, q_stride, seqlen_q, seqlen_k = self._tensor_origin(grad, tScS, first_row, first_col)
        q_end = seqlen_q
        if enabled == 0:
            q_end = Int32(0)
        origin = plane + Int64(q0) * q_stride + Int64(k0) * 4
        elements = self._tensor_elements(t0ScS, rows, cols)
        row_address = {dq: origin + q_stride * dq for dq in sorted({e[1] for e in elements})}
        for (r, c), dq, dk in elements:
            red_add_if_below(row_address[dq], 4 * dk, dS_mn[r, c], q0 + dq, q_end, k0 + dk, seqlen_k)
