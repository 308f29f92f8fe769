"""Every run-time FA4_* environment variable, read here and nowhere else (see the README).

Build-time variables (FA4_ARCHS, FA4_VARIANTS, FA4_BUILD_JOBS) belong to the build driver,
``fa4_kernels.aot.env_settings``.
"""
import os

from .heuristics import TILE_FAMILIES


def native_disabled() -> bool:
    """FA4_DISABLE_NATIVE=1: never call the compiled kernels (CUDA inputs raise instead)."""
    return os.environ.get("FA4_DISABLE_NATIVE", "") == "1"


def reference_chunk_bytes() -> int:
    """FA4_REF_CHUNK_MB: working-set budget of the chunked torch reference/backward (default 256)."""
    return int(float(os.environ.get("FA4_REF_CHUNK_MB", "256")) * 2**20)


def l2_swizzle_bytes() -> int | None:
    """FA4_L2_SWIZZLE_MB: L2 share the tile order may fill with one group's K/V, taken as it is
    (tuning knob; unset: fa4.heuristics.heads_per_group's choice, which with a mask also makes
    groups large enough for the longest-first schedule to end evenly)."""
    value = os.environ.get("FA4_L2_SWIZZLE_MB")
    return int(float(value) * 2**20) if value else None


def persistent_override() -> bool | None:
    """FA4_PERSISTENT=0/1: force a one-CTA-per-tile grid or the persistent one (tuning knob)."""
    value = os.environ.get("FA4_PERSISTENT")
    return None if value in (None, "") else value == "1"


def split_tail_override() -> bool | None:
    """FA4_SPLIT_TAIL=0/1: never split the last round of tiles, or split it whenever there is one
    (tuning knob; default: fa4.heuristics.split_tail_ctas's choice)."""
    value = os.environ.get("FA4_SPLIT_TAIL")
    return None if value in (None, "") else value == "1"


def bwd_store_first_override() -> bool | None:
    """FA4_BWD_STORE_FIRST=0/1: zero the backward's dQ accumulator and add every K/V block's part,
    or let each query block's first K/V block store (tuning knob; default:
    fa4.heuristics.bwd_store_first)."""
    value = os.environ.get("FA4_BWD_STORE_FIRST")
    return None if value in (None, "") else value == "1"


def bwd_rotate_override() -> bool | None:
    """FA4_BWD_ROTATE=0/1: every backward K/V block walks the query blocks from the first one, or
    (no mask) from a query block of its own (tuning knob; default: fa4.heuristics.bwd_rotate)."""
    value = os.environ.get("FA4_BWD_ROTATE")
    return None if value in (None, "") else value == "1"


def tile_family_override() -> str | None:
    """FA4_TILES=regular/short/long: run that tile family wherever it is built (dense: hd64 "short"
    without a mask or causal, hd128 "long" without a mask), the regular tiles elsewhere (tuning
    and test knob; default: fa4.heuristics.tile_family)."""
    value = os.environ.get("FA4_TILES", "")
    if value and value not in TILE_FAMILIES:
        raise ValueError(f"FA4_TILES must be one of {', '.join(TILE_FAMILIES)}; got {value!r}")
    return value or None
