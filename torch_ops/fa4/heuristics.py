"""The run-time rules, as Python functions over their one implementation in C
(csrc_shims/fa4_rules.c, built into ``_native/libfa4_rules.so`` on every install, CPU-only ones
included; the native operators link the same code). Each rule's measurements are in its comment
there. Also the variant lookup over the build's manifest (keys as in fa4_kernels.catalog).
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

RULES_PATH = Path(__file__).resolve().parent / "_native" / "libfa4_rules.so"

# Kept in step with fa4_rules.h (test_heuristics checks them against the library).
UNBOUNDED = 1 << 30
_AUTO = -1
MASK_KINDS = ("none", "causal", "local", "sparse")  # fa4_mask_kind
TILE_FAMILIES = ("regular", "short", "long")  # fa4_tile_family
PACKABLE_GROUPS = (2, 4, 8, 16)  # query heads per K/V head that pack-GQA can stack in a tile

DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class MaskSpec:
    kind: str  # "none" | "causal" | "local"
    window_left: int  # >= 0, UNBOUNDED for no limit (kernel argument)
    window_right: int


class _Tuning(ctypes.Structure):
    _fields_ = [("l2_swizzle_bytes", ctypes.c_int64)] + [
        (name, ctypes.c_int32) for name in ("persistent", "tiles", "split_tail", "bwd_store_first", "bwd_rotate",
                                            "bwd_launch_group", "bwd_clusters", "bwd_turn_spacing",
                                            "bwd_dq_writers", "trace_schedule")] + [
        ("trace_path", ctypes.c_char_p)]


class _Mask(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32)]


@functools.cache
def rules() -> ctypes.CDLL:
    if not RULES_PATH.exists():
        raise RuntimeError(f"fa4's rules library is missing ({RULES_PATH}): this checkout was not built; run "
                           "`pip install -e .` (FA4_SKIP_AOT=1 builds just this library, without kernels)")
    lib = ctypes.CDLL(str(RULES_PATH))
    i32, i64, f64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_double
    signatures = {
        "fa4_rules_error": (ctypes.c_char_p, []),
        "fa4_resolve_mask": (i32, [i32, i64, i64, ctypes.POINTER(_Mask)]),
        "fa4_effective_mask": (_Mask, [_Mask, i64, i64]),
        "fa4_tile_fill": (f64, [i64, i64]),
        "fa4_tile_family": (i32, [i64, i64, i32, i32, i32, i32, i32, i32]),
        "fa4_pack_gqa_factor": (i32, [i64, i64, i64, i32, i32, i32, ctypes.POINTER(i32)]),
        "fa4_q_piece_rows": (i32, []),
        "fa4_packable_group": (i32, [i64]),
        "fa4_packing_family": (i32, [i64, i64, i64, i32, i32, i32, i32, i32]),
        "fa4_kv_cache_tile_family": (i32, [i64, i64, i64, i64, i32, i32, i32, i32, i32]),
        "fa4_l2_swizzle_budget": (i64, [i64, i32]),
        "fa4_balance_heads": (i64, [i64, i32]),
        "fa4_heads_per_group": (i32, [i64, i64, i32, i32, i32, i64, i64, i32, i64, i32]),
        "fa4_grid_size": (i32, [i32, i32, i32]),
        "fa4_split_overhead_blocks": (i32, [i32]),
        "fa4_split_tail_ctas": (i32, [i64, i32, i64, i32, i32, i32]),
        "fa4_split_ctas_for": (i32, [i64, i32, i64, i64]),
        "fa4_kv_page_size": (i32, [i64, i64]),
        "fa4_kv_kernel_page_rows": (i64, [i64]),
        "fa4_mean_visible_keys": (f64, [i64, i64, _Mask]),
        "fa4_bwd_store_first": (i32, [i64, f64, i32]),
        "fa4_bwd_rotate": (i32, [i32, i32, i32, i64, i32, i32, i32, i32, i32]),
        "fa4_bwd_launch_group": (i32, [i32, i32, i32, i32, i64, i64, i32, i32]),
        "fa4_bwd_tile_family": (i32, [i32, i32, i32, i32]),
        "fa4_bwd_dq_writers": (i32, [i32, i32, i32, i32, i64, i32, i32]),
        "fa4_bwd_turn_spacing": (i32, [i32, i32]),
        "fa4_clusters_fit": (i32, [i32, i32, i32]),
        "fa4_keyless_rows": (i64, [i64, i64, _Mask]),
        "fa4_stats_rows": (i64, [i64, i32, i64]),
        "fa4_read_tuning": (i32, [ctypes.POINTER(_Tuning)]),
        "fa4_schema_count": (i32, []),
        "fa4_schema": (ctypes.c_char_p, [i32]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _error() -> str:
    return rules().fa4_rules_error().decode()


def _tri(value: bool | None) -> int:
    return _AUTO if value is None else int(bool(value))


def _native_mask(mask: MaskSpec) -> _Mask:
    return _Mask(MASK_KINDS.index(mask.kind), mask.window_left, mask.window_right)


def _spec(mask: _Mask) -> MaskSpec:
    return MaskSpec(MASK_KINDS[mask.kind], mask.window_left, mask.window_right)


# Tuning settings that are numbers, not switches.
_COUNTS = ("l2_swizzle_bytes", "bwd_launch_group", "bwd_turn_spacing", "bwd_dq_writers")


def tuning() -> dict:
    """The run-time tuning settings as the native operators read them now (FA4_L2_SWIZZLE_MB in
    bytes, FA4_BWD_LAUNCH_GROUP's pairs, FA4_BWD_TURN_SPACING's chunks, FA4_BWD_DQ_WRITERS's warps,
    FA4_TRACE's path, FA4_TRACE_SCHEDULE's word, the others None for unset, a bool, or FA4_TILES's family name);
    ValueError for a value a variable does not take."""
    out = _Tuning()
    if rules().fa4_read_tuning(ctypes.byref(out)):
        raise ValueError(_error())
    values = {name: getattr(out, name) for name, _ in _Tuning._fields_}
    trace_path = values.pop("trace_path")
    settings = {name: None if value == _AUTO else
                (TILE_FAMILIES[value] if name == "tiles" else value if name in _COUNTS else
                 ("dynamic", "static")[value] if name == "trace_schedule" else bool(value))
                for name, value in values.items()}
    return dict(settings, trace_path=None if trace_path is None else os.fsdecode(trace_path))


def resolve_mask(causal: bool, window_left: int, window_right: int) -> MaskSpec:
    """FlashAttention's normalisation: -1 means unbounded on that side, causal is the window
    (-1, 0), and a window that bounds nothing is no mask at all."""
    out = _Mask()
    if rules().fa4_resolve_mask(int(bool(causal)), int(window_left), int(window_right), ctypes.byref(out)):
        raise ValueError(_error())
    return _spec(out)


def effective_mask(mask: MaskSpec, seqlen_q: int, seqlen_k: int) -> MaskSpec:
    """The mask a dense call needs: none when the window hides no key from any row."""
    return _spec(rules().fa4_effective_mask(_native_mask(mask), seqlen_q, seqlen_k))


def arch_name(capability: tuple[int, int]) -> str | None:
    """Compiled arch for a device capability; None when fa4 has no kernels for it."""
    return {(9, 0): "sm_90a"}.get(tuple(capability))


def manifest_key(variant: dict) -> tuple:
    """Lookup key of one compiled variant as the build's manifest describes it; the variants of
    one key differ only in their tile family (``variant["tiles"]``, see ``tile_family``)."""
    return (variant["arch"], variant["dtype"], variant["head_dim"], variant["head_dim_v"], variant["mask"],
            variant["softcap"], variant.get("varlen", False), variant.get("kernel", "fwd"))


def call_key(capability, dtype: str, head_dim: int, head_dim_v: int, mask: str, softcap: bool,
             varlen: bool = False, kernel: str = "fwd") -> tuple:
    """Lookup key of the variants a call can use (matches ``manifest_key``); ``kernel`` "fwd" or
    "bwd"."""
    return (arch_name(capability), dtype, head_dim, head_dim_v, mask, softcap, varlen, kernel)


def select_variant(variants: list[dict], capability, dtype: str, head_dim: int, head_dim_v: int,
                   mask: str, softcap: bool, varlen: bool = False, tiles: str = "regular") -> dict | None:
    """The compiled variant that serves exactly this call in tile family ``tiles``, or None."""
    want = call_key(capability, dtype, head_dim, head_dim_v, mask, softcap, varlen)
    return next((v for v in variants if manifest_key(v) == want and v.get("tiles", "regular") == tiles), None)


def tile_fill(rows: int, tile_m: int) -> float:
    """Share of the rows a head's tiles compute that are real rows (the rest pad the last tile)."""
    return rules().fa4_tile_fill(rows, tile_m)


def tile_family(seqlen_q: int, seqlen_k: int, packed: int, tile_m: int, built: dict[str, int],
                override: str | None = None, mask: str = "none") -> str:
    """The tile family that serves a dense call: "regular" (``tile_m`` rows, ``packed`` its
    pack-GQA factor) or one of the extra families ``built`` for the call's key ({family: its
    tile_m}); ``override`` (FA4_TILES) is taken wherever that family is built."""
    family = rules().fa4_tile_family(seqlen_q, seqlen_k, packed, tile_m, built.get("short", 0), built.get("long", 0),
                                     _AUTO if override is None else TILE_FAMILIES.index(override),
                                     MASK_KINDS.index(mask))
    return TILE_FAMILIES[family]


def supported_head_dims(variants: list[dict], capability, kernel: str = "fwd") -> list[tuple[int, int]]:
    arch = arch_name(capability)
    return sorted({(v["head_dim"], v["head_dim_v"]) for v in variants
                   if v["arch"] == arch and v.get("kernel", "fwd") == kernel})


def l2_swizzle_budget(l2_bytes: int, mask: str) -> int:
    """Bytes of K/V one swizzle group of the tile order may hold in L2."""
    return rules().fa4_l2_swizzle_budget(l2_bytes, MASK_KINDS.index(mask))


def balance_heads(num_m_blocks: int, num_sms: int) -> int:
    """Fewest (head, batch) pairs per group for the dynamic longest-first schedule to end evenly."""
    return rules().fa4_balance_heads(num_m_blocks, num_sms)


def heads_per_group(l2_bytes: int, seqlen_k: int, head_dim: int, head_dim_v: int, elem_bytes: int,
                    num_heads_batches: int, budget_bytes: int | None = None, mask: str = "none",
                    num_m_blocks: int | None = None, num_sms: int | None = None) -> int:
    """How many (head, batch) pairs one L2-swizzle group of the tile order holds (>= 1)."""
    return rules().fa4_heads_per_group(l2_bytes, seqlen_k, head_dim, head_dim_v, elem_bytes, num_heads_batches,
                                       -1 if budget_bytes is None else budget_bytes, MASK_KINDS.index(mask),
                                       num_m_blocks or 0, num_sms or 0)


def grid_size(num_sms: int, mask: str, persistent_override: bool | None = None) -> int:
    """CTAs to launch at most: ``num_sms`` (persistent), or a huge value for one CTA per tile."""
    return rules().fa4_grid_size(num_sms, MASK_KINDS.index(mask), _tri(persistent_override))


def mean_visible_keys(seqlen_q: int, seqlen_k: int, mask: MaskSpec) -> float:
    """Keys a query row sees on average under a bottom-right aligned mask."""
    return rules().fa4_mean_visible_keys(seqlen_q, seqlen_k, _native_mask(mask))


# The backward's first-store claims count in a counter's high 16 bits (sm90/bwd.py, DQ_CLAIM).
MAX_FIRST_STORE_BLOCKS = 1 << 15


def bwd_store_first(num_n_blocks: int, blocks_per_query_block: float = 0.0, override: bool | None = None) -> bool:
    """Whether the backward's first K/V block to reach a query block stores its dQ (up to a number
    of K/V blocks per query block; packed sequences too, whole query blocks only); ``override``
    False never, True wherever it can run."""
    return bool(rules().fa4_bwd_store_first(num_n_blocks, blocks_per_query_block, _tri(override)))


def bwd_rotate(mask: str, deterministic: bool, store_first: bool, num_n_blocks: int, num_sms: int,
               tile: tuple[int, int] = (128, 128), override: bool | None = None, spacing: int | None = None) -> int:
    """The backward's rotation period (0: none): without a mask, K/V blocks start on query blocks
    of their own, in chunks of this many blocks (src/fa4_kernels/dq_order.py). Deterministic mode
    rotates only the (tile_m, tile_n) = ``tile`` kernels it measured faster on, and only where a
    head's blocks fit the GPU at once (``num_sms``), since its turns may wait for later CTAs; it
    cuts that chunk into ``spacing`` chunks (None: 1; the native op passes bwd_turn_spacing's
    choice: 2 with two dQ writers), whose visitors of a query block come ``spacing`` steps apart."""
    return rules().fa4_bwd_rotate(MASK_KINDS.index(mask), int(deterministic), int(store_first), num_n_blocks,
                                  num_sms, tile[0], tile[1], _tri(override), _AUTO if spacing is None else spacing)


def bwd_launch_group(mask: str, varlen: bool, deterministic: bool, rotate: int = 0, num_n_blocks: int = 0,
                     pairs: int = 0, num_sms: int = 0, override: int | None = None) -> int:
    """(batch, head) pairs per launch group of the backward's CTAs (0: the grid's order): dense,
    non-deterministic causal calls (``override``, FA4_BWD_LAUNCH_GROUP, sets the size), and
    dense unmasked deterministic calls whose rotation (period ``rotate``) cuts a head's
    ``num_n_blocks`` into several chunks: as many of the call's ``pairs`` (batch * K/V heads) as
    keep one chunk of each within ``num_sms``, the last group's leftovers too (``override`` caps
    it), so that every pair's first chunk runs before its second."""
    return rules().fa4_bwd_launch_group(MASK_KINDS.index(mask), int(varlen), int(deterministic), rotate,
                                        num_n_blocks, pairs, num_sms, _AUTO if override is None else override)


def bwd_tile_family(varlen: bool, deterministic: bool, long_built: bool, override: bool | None = None) -> str:
    """The backward's tile family: "long" (2-CTA clusters, where built: hd256 dense, the window
    kernel, which serves causal calls too) only where ``override`` (FA4_BWD_CLUSTERS=1) forces it,
    never deterministic or packed; by default "regular" (they lost 13% on an H100,
    csrc_shims/fa4_rules.c)."""
    family = rules().fa4_bwd_tile_family(int(varlen), int(deterministic), int(long_built), _tri(override))
    return TILE_FAMILIES[family]


def bwd_dq_writers(deterministic: bool, head_dim: int, mask: str, num_n_blocks: int, num_sms: int,
                   varlen: bool = False, override: int | None = None) -> int:
    """The backward kernel's deterministic argument: 0 (dQ added in any order), else the dQ writer
    warps of its deterministic turns: 2 for the hd192 / hd256 kernels of dense batches where
    measured faster (rotated turns without a mask; 16k-token chains, not hd256's unmasked ones),
    else 1; ``override`` (FA4_BWD_DQ_WRITERS) sets it (csrc_shims/fa4_rules.c)."""
    return rules().fa4_bwd_dq_writers(int(deterministic), int(varlen), MASK_KINDS.index(mask), head_dim,
                                      num_n_blocks, num_sms, _AUTO if override is None else override)


def bwd_turn_spacing(writers: int, override: int | None = None) -> int:
    """The chunks a deterministic rotation is cut into: 2 with two dQ writers, else 1
    (``override``: FA4_BWD_TURN_SPACING)."""
    return rules().fa4_bwd_turn_spacing(writers, _AUTO if override is None else override)


def clusters_fit(active_clusters: int, cluster_size: int, num_sms: int) -> bool:
    """Whether a clustered launch runs where the device holds ``active_clusters`` of its clusters
    at once (else its 1-CTA twin runs): some, leaving at most a few percent of the SMs idle."""
    return bool(rules().fa4_clusters_fit(active_clusters, cluster_size, num_sms))


def keyless_rows(seqlen_q: int, seqlen_k: int, mask: MaskSpec) -> int:
    """Query rows, from row 0, that see no key (bottom-right alignment)."""
    return rules().fa4_keyless_rows(seqlen_q, seqlen_k, _native_mask(mask))


def stats_rows(total_q: int, block: int, num_seqs: int | None) -> int:
    """Rows of the backward's padded statistics, in blocks of ``block`` rows: dense
    ceil(total_q / block) blocks; packed sequences num_seqs + 1 more."""
    return rules().fa4_stats_rows(total_q, block, -1 if num_seqs is None else num_seqs)


def split_overhead_blocks(head_dim_v: int) -> int:
    """K/V blocks' worth of time a piece of a split tile costs beyond its own blocks."""
    return rules().fa4_split_overhead_blocks(head_dim_v)


def split_tail_ctas(num_tiles: int, num_sms: int, n_blocks: int, head_dim_v: int = 128, live_rows: int = 128,
                    override: bool | None = None) -> int:
    """CTAs to split the static schedule's last round of tiles over (0: no split); ``live_rows``
    the query rows a tile holds (decoding: the heads pack-GQA stacks); ``override`` False never
    splits, True splits whenever pieces can outnumber the tiles."""
    return rules().fa4_split_tail_ctas(num_tiles, num_sms, n_blocks, head_dim_v, live_rows, _tri(override))


def split_ctas_for(num_tiles: int, num_sms: int, n_blocks: int, num_splits: int) -> int:
    """CTAs to split the last round over when the caller asks for ``num_splits`` pieces per tile
    (attention_with_kvcache): as far as the grid and one block a piece go; 1 never splits."""
    return rules().fa4_split_ctas_for(num_tiles, num_sms, n_blocks, num_splits)


def check_kv_page_size(page_size: int, pages_per_sequence: int | None) -> None:
    """Raise ValueError naming the rule where fa4::fwd_kvcache cannot read a KV cache's pages of
    ``page_size`` rows (``pages_per_sequence`` None: a contiguous cache, one page of its seqlen)."""
    if rules().fa4_kv_page_size(page_size, -1 if pages_per_sequence is None else pages_per_sequence):
        raise ValueError(_error())


def kv_kernel_page_rows(page_size: int) -> int:
    """The page size the kernel reads a paged cache of ``page_size`` rows (a multiple of 16) with:
    the page itself when a power of two, else its 16-row boxes (attention_with_kvcache expands
    the page table)."""
    return rules().fa4_kv_kernel_page_rows(page_size)


def packing_family(heads_q: int, heads_kv: int, tile_m: int, built: dict[str, int], seqlen_q: int = 1,
                   override: bool | None = True, head_rows: int | None = None) -> str:
    """The tile family a call runs in for pack-GQA (``built``: the extra families' tile_m): with
    pack_gqa=True the one whose tiles stack the group, with None the one that packs the most heads
    for ``seqlen_q`` rows (the regular tiles on a tie). ``head_rows`` as for pack_gqa_factor."""
    return TILE_FAMILIES[rules().fa4_packing_family(heads_q, heads_kv, seqlen_q, tile_m, built.get("short", 0),
                                                    built.get("long", 0), _head_rows(head_rows), _tri(override))]


def kv_cache_tile_family(heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, tile_m: int, long_tile_m: int,
                         pack_override: bool | None = None, override: str | None = None, head_rows: int = 1) -> str:
    """The tile family of a KV-cache call (``seqlen_k``: the cache's capacity): "long" (the
    taller tiles of chunked prefill, ``long_tile_m`` rows where built, else 0) where they hold
    the call's rows, each family packed as pack_gqa_factor packs it (``head_rows``: the KV-cache
    kernels' 1), at least 0.75 as fully as the 64-row ones (fa4_rules.c says why); ``override``
    (FA4_TILES) is taken wherever that family is built."""
    family = rules().fa4_kv_cache_tile_family(heads_q, heads_kv, seqlen_q, seqlen_k, tile_m, long_tile_m, head_rows,
                                              _tri(pack_override),
                                              _AUTO if override is None else TILE_FAMILIES.index(override))
    return TILE_FAMILIES[family]


def _head_rows(head_rows: int | None) -> int:
    return rules().fa4_q_piece_rows() if head_rows is None else head_rows


def pack_gqa_factor(heads_q: int, heads_kv: int, seqlen_q: int, tile_m: int, override: bool | None = None,
                    head_rows: int | None = None) -> int:
    """Query heads stacked in one tile (1: none); ValueError where pack_gqa=True cannot stack
    this group in ``tile_m`` rows. ``head_rows``: the rows a packed head's share of the tile is a
    multiple of (None: the dense kernels' 8-row Q pieces; 1 for the KV-cache kernels, whose Q
    pieces span heads)."""
    factor = ctypes.c_int32()
    if rules().fa4_pack_gqa_factor(heads_q, heads_kv, seqlen_q, tile_m, _head_rows(head_rows), _tri(override),
                                   ctypes.byref(factor)):
        raise ValueError(_error())
    return factor.value
