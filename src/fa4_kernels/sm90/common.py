"""What the Hopper kernels (sm90/fwd.py, sm90/bwd.py) share: warpgroup sizes, the exp2 base change
and the swizzled shared-memory tile layout."""
from typing import Optional

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

LOG2_E = 1.4426950408889634

THREADS_PER_WG = 128
ROWS_PER_WG = 64  # the WGMMA M size: each consumer warpgroup owns 64 rows of a tile


def make_smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None, atom_cols: Optional[int] = None):
    """K-major (row-major) swizzled shared-memory layout for a (rows, cols[, stages]) tile: the
    widest swizzle atom (64, 32 or 16 16-bit columns) that divides ``atom_cols`` (default cols),
    where column slices of that width must be operands of their own."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols), dtype
    )
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    order = (0, 1) if stages is None else (0, 1, 2)
    return cute.tile_to_shape(atom, shape, order=order)
