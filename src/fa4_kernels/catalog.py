"""The variant catalog: every kernel the wheel ships, as typed keys.

Plain Python (no DSL import) so the runtime, the build and the CPU tests share it. A key holds
only what changes generated code; per-call values (sequence lengths, window sizes, softcap
value, scale) are kernel arguments and never part of a key.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace

ARCHS = ("sm_90a",)
DTYPES = ("bf16", "fp16")
# (head_dim, head_dim_v): the FlashAttention-3 set, plus DeepSeek-style (192, 128).
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))
MASKS = ("none", "causal", "local")
# Block-sparse kernels (FlexAttention BlockMasks through fa4.block_sparse's tables; partial
# blocks masked by bits): a mask kind of their own, forward and backward, dense batches, every head dim.
SPARSE_MASK = "sparse"
# Built-in score_mods evaluated in the kernel (fa4.score_mods; src/fa4_kernels/score_mod.py): an
# additive bias per score, with its parameters' gradient in the backward. Block-sparse kernels only
# (fa4.flex_attention's path: any mask becomes tables), every head dim, without softcap. A bias
# tensor is read as fp32 ("bias") or in the inputs' dtype ("bias16").
TENSOR_SCORE_MODS = ("bias", "bias16")  # the kinds that read a bias tensor
SCORE_MODS = ("alibi", "relbias") + TENSOR_SCORE_MODS
# ALiBi's per-column part by the tensor cores (heuristics.FwdConfig.alibi_by_mma): one k16 slice of
# Q @ K^T whose first ALIBI_SLOPE_TERMS columns hold the slope's 16-bit terms (A) and the keys'
# offsets (B). Used by the kernel (sm90/fwd.py) and its shared-memory count (heuristics).
ALIBI_MMA_COLS = 16
ALIBI_SLOPE_TERMS = 3
# KV-cache forwards (fa4.attention_with_kvcache; src/fa4_kernels/kv_cache.py): K/V through a page
# table (a contiguous cache is one page per sequence), appended rows written by the kernel. Dense
# query batches, every head dim and softcap; 64-row tiles (chunked prefill's taller ones:
# KV_CACHE_TILE_FAMILIES). One mask kind, the window: no mask and
# causal are windows whose sides are unbounded (fa4_resolve_mask), so the masks are run-time
# arguments here (the decoding calls they serve are bound by memory, not by the mask's compares;
# measured in docs/perf_notes.md, "KV-cache masks at run time").
KV_CACHE_MASKS = ("local",)
# ... and beside it, without softcap, an unmasked twin per (dtype, head dims) for the calls left
# with no mask (one decoding token sees its whole sequence, causal or not, without a left window):
# the window kernel carries three K/V loop bodies (the diagonal's right mask, none, a window's left
# edge) and their masks, ~1.6k of its ~8.7k instructions (hd128) that the twin drops, and a
# decoding CTA runs its code once, through instruction-cache misses (ncu: a third of a 1 x 4k
# call's stall samples). A causal twin (~1k fewer) measured nothing for 4- and 8-token
# verification and 1.6% slower for a 2048-token chunk. Both in docs/perf_notes.md ("KV-cache twins
# for one-token decoding").
KV_CACHE_TWIN_MASKS = ("none",)
# ... and for those twins an append twin (VariantKey.kv_append), which calls with rows to append
# run: it copies up to kv_cache.PATCHED_ROWS appended rows into the first K/V block's loaded stages
# instead of its producer waiting for their cache stores. Code the other twin does without (calls
# with nothing to append ran 0.25-0.3 us slower at 1 x 4k with it, H100 and H200, session 58);
# appends at 1 x 4k 10.05-10.16 -> 9.82-9.88 us under CUDA graphs (H100). Not traced.
# ... and a "long" tile family of the window kernel (heuristics.kv_cache_long_config): the dense
# kernel's taller tiles for chunked prefill, picked by fa4_kv_cache_tile_family (caches of 2048+
# rows, a call's rows per K/V head filling them about as well as the 64-row ones: not decoding).
KV_CACHE_TILE_FAMILIES = {"long": KV_CACHE_MASKS}
# Trace variants (fa4.trace; src/fa4_kernels/trace.py): forwards that also record a timeline of
# their tiles. The wheel ships them for these keys (dense, packed and KV-cache, with every tile
# family built for them; the KV cache's window kernel stands for all three masks, beside its
# unmasked twin); a build with
# FA4_TRACE_VARIANTS=all adds one beside every dense, packed and
# KV-cache forward.
TRACE_DTYPES = ("bf16",)
# hd128 only: its twins cover the regular, "long", packed and KV-cache kernels and both schedules;
# hd64's (7 more variants, ~20 s of the 2-core build) were dropped to make room for the backward's
# cluster kernels within the build's 20 minutes (FA4_TRACE_VARIANTS=all still builds them).
TRACE_HEAD_DIMS = ((128, 128),)
TRACE_MASKS = ("none", "causal")
TRACE_CHOICES = ("shipped", "all")
# Kernel kinds: the forward, the backward's main kernel (dQ/dK/dV), its preprocess (the row
# statistics it reads) and its postprocess (dQ's conversion to the input dtype).
KERNELS = ("fwd", "bwd", "bwd_pre", "bwd_post")
# (head_dim, head_dim_v) with a backward kernel: all of them.
BWD_HEAD_DIMS = HEAD_DIMS
# The backward's main kernels, per mask kind: causal runs the window kernel with an unbounded left
# side (fa4_resolve_mask). Its S^T tiles were masked by the same two compares per score either way
# (mask.apply_transposed), and the causal launch order is a run-time choice (fa4_bwd_launch_group);
# measured in docs/perf_notes.md, "Causal as a window".
BWD_MASKS = ("none", "local")


@dataclass(frozen=True, order=True)
class VariantKey:
    arch: str  # "sm_90a"
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    head_dim_v: int
    mask: str  # "none" | "causal" | "local" | "sparse" (fwd and bwd)
    softcap: bool
    varlen: bool = False  # packed sequences delimited by cu_seqlens
    # Tile family (heuristics.fwd_config): "regular", or an extra dense variant the runtime
    # picks by sequence length (fa4.heuristics.tile_family): "short" (hd64, no mask or causal:
    # taller tiles that pad short queries less, and on the causal diagonal each warpgroup's
    # 64 rows skip 64-key blocks of their own), "long" (hd128, no mask: three consumer
    # warpgroups, faster K/V steps that pay for their costlier tile boundaries only on long keys);
    # backward: "long" (hd256: 2-CTA clusters, BWD_TILE_FAMILIES).
    tiles: str = "regular"
    kernel: str = "fwd"  # KERNELS
    score_mod: str = "none"  # "none" | SCORE_MODS (block-sparse fwd and bwd)
    kv_cache: bool = False  # K/V from a paged KV cache (fwd only)
    kv_append: bool = False  # the KV cache's append twin (KV_CACHE_TWIN_MASKS; kv_cache.py)
    trace: bool = False  # records a per-tile timeline (fwd only, not block-sparse: TRACE_*)

    @property
    def name(self) -> str:
        """Symbol-safe unique name, also the exported function prefix."""
        if self.kernel == "bwd_post":  # a flat conversion: its key is the dtype alone
            return f"fa4_bwd_post_{self.arch}_{self.dtype}"
        sc = "_softcap" if self.softcap else ""
        vl = "_varlen" if self.varlen else ""
        tl = "" if self.tiles == "regular" else f"_{self.tiles}seq"
        sm = "" if self.score_mod == "none" else f"_{self.score_mod}"
        kv = "_kvcache" + ("_append" if self.kv_append else "") if self.kv_cache else ""
        tr = "_trace" if self.trace else ""
        return (f"fa4_{self.kernel}_{self.arch}_{self.dtype}_d{self.head_dim}x{self.head_dim_v}_{self.mask}"
                f"{sc}{sm}{vl}{kv}{tl}{tr}")

    @property
    def compute_capability(self) -> tuple[int, int]:
        digits = self.arch.removeprefix("sm_").rstrip("a")
        return int(digits[:-1]), int(digits[-1])

    def as_dict(self) -> dict:
        return asdict(self)


# The extra tile families, dense only, for the head dims and masks where they measured faster:
# hd64 short queries (<= 1k) without a mask, and causal, hd128 keys from 2k on without a mask
# or causal. Local windows and varlen keep the regular tiles.
TILE_FAMILIES = {"short": ((64, 64),), "long": ((128, 128),)}
TILE_FAMILY_MASKS = {"short": ("none", "causal"), "long": ("none", "causal")}
# The backward's "long" family: 2-CTA clusters sharing each Q/dO tile (heuristics.BwdConfig.cluster_n),
# for dense batches without softcap or score_mod, in the window kernel that serves causal calls (the
# only calls they measured faster for, on an H200: without a mask they lost 0.3-1.2% at 4k-32k); run
# only where FA4_BWD_CLUSTERS=1 asks (fa4_bwd_tile_family: an H100 lost 13% with them) and the device
# fits the clusters, else the regular twin (fa4_clusters_fit).
BWD_TILE_FAMILIES = {"long": ((256, 256),)}
BWD_TILE_FAMILY_MASKS = {"long": ("local",)}


def bwd_tile_family_built(key: VariantKey) -> bool:
    """Whether the backward ``key``'s extra tile family (key.tiles) is in the catalog."""
    return (key.kernel == "bwd" and (key.head_dim, key.head_dim_v) in BWD_TILE_FAMILIES.get(key.tiles, ())
            and key.mask in BWD_TILE_FAMILY_MASKS.get(key.tiles, ()) and not (key.softcap or key.varlen or key.trace)
            and key.score_mod == "none")


def traceable(key: VariantKey) -> bool:
    """Whether ``key`` may have a trace twin: a dense, packed or KV-cache forward."""
    return key.kernel == "fwd" and key.mask != SPARSE_MASK and not key.trace and not key.kv_append


def shipped_trace(key: VariantKey) -> bool:
    """Whether the wheel ships ``key``'s trace twin (TRACE_*)."""
    return (traceable(key) and key.dtype in TRACE_DTYPES and (key.head_dim, key.head_dim_v) in TRACE_HEAD_DIMS
            and (key.kv_cache or key.mask in TRACE_MASKS) and not key.softcap)


def all_variants(archs=ARCHS, trace: str = "shipped") -> list[VariantKey]:
    """Every variant of ``archs``; trace twins for the shipped keys or, with ``trace="all"``,
    for every traceable one (FA4_TRACE_VARIANTS)."""
    assert trace in TRACE_CHOICES, trace
    regular = [
        VariantKey(arch, dtype, hd, hdv, mask, softcap, varlen)
        for arch, dtype, (hd, hdv), mask, softcap, varlen in itertools.product(
            archs, DTYPES, HEAD_DIMS, MASKS, (False, True), (False, True)
        )
    ]
    extra = [
        VariantKey(arch, dtype, hd, hdv, mask, softcap, False, tiles=tiles)
        for tiles, dims in TILE_FAMILIES.items()
        for arch, dtype, (hd, hdv), mask, softcap in itertools.product(
            archs, DTYPES, dims, TILE_FAMILY_MASKS[tiles], (False, True))
    ]
    sparse = [
        VariantKey(arch, dtype, hd, hdv, SPARSE_MASK, softcap, kernel=kernel)
        for kernel, arch, dtype, (hd, hdv), softcap in itertools.product(
            ("fwd", "bwd"), archs, DTYPES, HEAD_DIMS, (False, True))
    ] + [
        VariantKey(arch, dtype, hd, hdv, SPARSE_MASK, False, kernel=kernel, score_mod=score_mod)
        for score_mod, kernel, arch, dtype, (hd, hdv) in itertools.product(
            SCORE_MODS, ("fwd", "bwd"), archs, DTYPES, HEAD_DIMS)
    ]
    kv_cache = [
        VariantKey(arch, dtype, hd, hdv, mask, softcap, kv_cache=True)
        for arch, dtype, (hd, hdv), mask, softcap in itertools.product(
            archs, DTYPES, HEAD_DIMS, KV_CACHE_MASKS, (False, True))
    ] + [
        VariantKey(arch, dtype, hd, hdv, mask, False, kv_cache=True, kv_append=append)
        for arch, dtype, (hd, hdv), mask, append in itertools.product(
            archs, DTYPES, HEAD_DIMS, KV_CACHE_TWIN_MASKS, (False, True))
    ] + [
        VariantKey(arch, dtype, hd, hdv, mask, softcap, kv_cache=True, tiles=tiles)
        for tiles, masks in KV_CACHE_TILE_FAMILIES.items()
        for arch, dtype, (hd, hdv), mask, softcap in itertools.product(archs, DTYPES, HEAD_DIMS, masks, (False, True))
    ]
    backward = [
        VariantKey(arch, dtype, hd, hdv, mask, softcap, varlen, kernel="bwd")
        for arch, dtype, (hd, hdv), mask, softcap, varlen in itertools.product(
            archs, DTYPES, BWD_HEAD_DIMS, BWD_MASKS, (False, True), (False, True)
        )
    ]
    backward += [
        VariantKey(arch, dtype, hd, hdv, mask, False, False, tiles=tiles, kernel="bwd")
        for tiles, dims in BWD_TILE_FAMILIES.items()
        for arch, dtype, (hd, hdv), mask in itertools.product(archs, DTYPES, dims, BWD_TILE_FAMILY_MASKS[tiles])
    ]
    # The preprocess depends on no mask or softcap, and takes packed sequences as a run-time
    # argument: one per backward (dtype, head dims).
    preprocess = [
        VariantKey(arch, dtype, hd, hdv, "none", False, kernel="bwd_pre")
        for arch, dtype, (hd, hdv) in itertools.product(archs, DTYPES, BWD_HEAD_DIMS)
    ]
    # The postprocess converts a flat range: one per dtype (head dims 0: it serves every one).
    postprocess = [VariantKey(arch, dtype, 0, 0, "none", False, kernel="bwd_post")
                   for arch, dtype in itertools.product(archs, DTYPES)]
    plain = regular + extra + sparse + kv_cache + backward + preprocess + postprocess
    wanted = traceable if trace == "all" else shipped_trace
    return plain + [replace(key, trace=True) for key in plain if wanted(key)]


def select_variants(variants, pattern: str | None) -> list[VariantKey]:
    """Keep variants whose name contains every comma-separated fragment of ``pattern``, or of one
    of its ``|``-separated alternatives ("bwd,d128|fwd,d128x128_causal"); a fragment ending in
    ``$`` must end the name ("bf16_d192x192_none$": not its softcap or varlen twins)."""
    if not pattern:
        return list(variants)
    alternatives = [[p.strip() for p in alt.split(",") if p.strip()] for alt in pattern.split("|")]

    def has(name: str, fragment: str) -> bool:
        return name.endswith(fragment[:-1]) if fragment.endswith("$") else fragment in name

    return [v for v in variants if any(all(has(v.name, p) for p in parts) for parts in alternatives if parts)]
