"""Small helpers around Hopper warpgroup MMA (WGMMA) fragments.

The accumulator of an SM90 WGMMA is laid out per thread as ((2, 2, N/8), MMA_M, MMA_N).
Softmax wants a (rows, cols) view of it, and the second GEMM (P @ V, P in registers) wants
it as an A-operand fragment ((2, 2, 2), MMA_M, (N/16, MMA_N)). Both are pure relayouts.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.cute.nvgpu import warpgroup

from fa4_kernels.ptx import i32_asm


def acc_rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)): mode 0 rows, mode 1 cols."""
    col_major = cute.make_layout(acc_layout.shape)
    shape = (
        (col_major.shape[0][1], col_major.shape[1]),
        (col_major.shape[0][0], col_major.shape[0][2], col_major.shape[2]),
    )
    stride = (
        (col_major.stride[0][1], col_major.stride[1]),
        (col_major.stride[0][0], col_major.stride[0][2], col_major.stride[2]),
    )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def rows_cols_view(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_rows_cols_layout(acc.layout))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a 16-bit-destined accumulator ((2, 2, N/8), M, N) as an RS-WGMMA A fragment."""
    layout = acc.layout
    assert layout.shape[0][2] % 2 == 0, "tile_n must be a multiple of 16"
    div = cute.logical_divide(layout, ((None, None, 2), None, None))
    frag = cute.make_layout(
        (
            (div.shape[0][0], div.shape[0][1], div.shape[0][2][0]),
            div.shape[1],
            (div.shape[0][2][1], div.shape[2]),
        ),
        stride=(
            (div.stride[0][0], div.stride[0][1], div.stride[0][2][0]),
            div.stride[1],
            (div.stride[0][2][1], div.stride[2]),
        ),
    )
    return cute.make_tensor(acc.iterator, frag)


@dsl_user_op
def pack_16bit_pair(lo: Float32, hi: Float32, is_bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to bf16/fp16 in one 32-bit register (lo in the low half)."""
    cvt = "cvt.rn.bf16x2.f32" if is_bf16 else "cvt.rn.f16x2.f32"
    return i32_asm(f"{cvt} $0, $2, $1;", "=r,f,f", (Float32(lo), Float32(hi)), loc=loc, ip=ip)


@cute.jit
def store_as_operand_a(acc: cute.Tensor, frag_a: cute.Tensor):
    """frag_a (16-bit RS-WGMMA A fragment) <- acc (fp32 accumulator), converted two values per
    32-bit register. Converting through a 16-bit vector instead (``.load().to(dtype)``) leaves
    ptxas splitting and re-packing register halves with PRMTs when tile_n / 16 is odd (hd256's
    80, hd192's 112); those PRMTs sit between the P @ V WGMMAs that read the registers, and
    ptxas then waits for each WGMMA before issuing the next. Inline PTX, not the NVVM
    conversion op: that one gives shorter loops but measured 2-4% slower for hd64/hd128
    (docs/perf_notes.md), the opaque form leaves the conversions where they are written."""
    src = acc_as_operand_a(acc)
    words = cute.recast_tensor(frag_a, Int32)
    is_bf16 = const_expr(frag_a.element_type == cutlass.BFloat16)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = pack_16bit_pair(src[2 * i], src[2 * i + 1], is_bf16)


def transpose_smem_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly staged) shared-memory tensor: V (n, d) -> Vt (d, n)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


@cute.jit
def wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    accumulate,  # Python bool or run-time Boolean; False: the first K slice overwrites acc
    wait_groups: cutlass.Constexpr[int],
    more_k=None,
):
    """Issue one warpgroup GEMM acc (+)= A @ B over all K slices and commit it as one group;
    ``more_k``: (A, B) fragments of further K slices accumulated in the same group.

    ``wait_groups`` >= 0 waits until at most that many committed groups are in flight; -1 returns
    with the GEMM still running (the caller waits later, overlapping other work with it).
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    if const_expr(more_k is not None):
        tCrA2, tCrB2 = more_k
        for k in cutlass.range_constexpr(cute.size(tCrA2.shape[2])):
            cute.gemm(atom, acc, tCrA2[None, None, k], tCrB2[None, None, k], acc)
    warpgroup.commit_group()
    if const_expr(wait_groups >= 0):
        warpgroup.wait_group(wait_groups)


def new_accumulator(thr_mma: cute.ThrMma, shape_mn) -> cute.Tensor:
    return cute.make_rmem_tensor(thr_mma.partition_shape_C(shape_mn), Float32)


@dsl_user_op
def always_one_after(a: Float32, b: Float32, *, loc=None, ip=None) -> Int32:
    """1, computed from ``a`` and ``b``: guarding an instruction with it keeps ptxas from
    scheduling that instruction before ``a`` and ``b`` exist.

    The all-ones bit pattern is a NaN no arithmetic produces (GPUs return the canonical NaN
    0x7fffffff), so the result is always 1, which ptxas cannot know.
    """
    return i32_asm("{\n.reg .pred p;\nsetp.ne.b32 p, $1, -1;\nsetp.ne.and.b32 p, $2, -1, p;\n"
                   "selp.u32 $0, 1, 0, p;\n}",
                   "=r,f,f", (Float32(a), Float32(b)), loc=loc, ip=ip)
