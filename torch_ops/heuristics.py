"""Run-time decisions as pure functions (unit-tested on CPU): how a call's mask options map to a
compiled mask kind, and which compiled variant serves a call.
"""
from __future__ import annotations

from dataclasses import dataclass

# "Unbounded" window side as passed to the kernel: far beyond any sequence length, yet small
# enough that adding a row index and a sequence length cannot overflow int32.
UNBOUNDED = 1 << 30

DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class MaskSpec:
    kind: str  # "none" | "causal" | "local"
    window_left: int  # >= 0, UNBOUNDED for no limit (kernel argument)
    window_right: int


def resolve_mask(causal: bool, window_left: int, window_right: int) -> MaskSpec:
    """Normalise (causal, window) the way FlashAttention does: -1 means unbounded on that side,
    causal is the window (-1, 0), and a window that bounds nothing is no mask at all."""
    for name, value in (("window_left", window_left), ("window_right", window_right)):
        if value < -1:
            raise ValueError(f"{name} must be >= 0, or -1 for unbounded; got {value}")
    if causal:
        if window_right not in (-1, 0):
            raise ValueError(
                f"causal=True already fixes window_right to 0; got window_right={window_right}. "
                "Pass causal=False with window=(left, right) for a window reaching past the diagonal."
            )
        window_right = 0
    if window_left < 0 and window_right < 0:
        return MaskSpec("none", UNBOUNDED, UNBOUNDED)
    if window_left < 0 and window_right == 0:
        return MaskSpec("causal", UNBOUNDED, 0)
    return MaskSpec(
        "local",
        UNBOUNDED if window_left < 0 else window_left,
        UNBOUNDED if window_right < 0 else window_right,
    )


def effective_mask(mask: MaskSpec, seqlen_q: int, seqlen_k: int) -> MaskSpec:
    """The mask a dense call needs: none when the window hides no key from any row (bottom-right
    aligned, row i sees keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right),
    i.e. left >= seqlen_k - 1 and right >= seqlen_q - 1. Causal decoding (one query row) is the
    common case: it then runs the unmasked kernel, whose static schedule can split the few long
    tiles of a decoding step over all SMs."""
    if mask.kind != "none" and mask.window_left >= seqlen_k - 1 and mask.window_right >= seqlen_q - 1:
        return MaskSpec("none", UNBOUNDED, UNBOUNDED)
    return mask


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
    rows = max(rows, 1)
    return rows / (-(-rows // tile_m) * tile_m)


TILE_FAMILIES = ("regular", "short", "long")
# Where the extra tile families pay (fa4_kernels.heuristics.fwd_config has the measurements):
# hd64's 256-row "short" tiles up to 1024 query rows, hd128's three-warpgroup "long" tiles from
# 2048 keys on (H200, bf16 16k tokens, TFLOP/s, regular -> family, same run):
#   hd64  no mask: seqlen 197 154 -> 220, 512 403 -> 443, 577 320 -> 320, 700 408 -> 430,
#         768 487 -> 478, 1000 440 -> 475, 1536 552 -> 527;
#         causal: 197 85 -> 119, 512 270 -> 291, 700 314 -> 321, 768 345 -> 353, 1000 352 -> 366,
#         1024 372 -> 391, 1536 443 -> 439 (and 2048 474 -> 460-463 in another run);
#   hd128 no mask, both guessing the row max (seventeenth session, two rounds): seqlen 1k 662 ->
#         616-617, 2k 734-735 -> 744-745, 4k 778-779 -> 794-795, 8k 793 -> 836-837; 16k
#         723-738 -> 785-793 (other calls). The long tiles pad 3% at 2k and 4k (11 and 22 tiles
#         of 192 rows) and still win; at 1k they pad 11%. (Before the long tiles guessed, from
#         8k on only: 2k 722 -> 709, 4k 749 -> 738, 8k 757 -> 766, 16k 714 -> 748.)
SHORT_SEQ_MAX = 1024
LONG_SEQ_MIN_K = 2048
LONG_MIN_FILL = 0.96  # of the regular tiles' fill


def tile_family(seqlen_q: int, seqlen_k: int, packed: int, tile_m: int, built: dict[str, int],
                override: str | None = None, mask: str = "none") -> str:
    """The tile family that serves a dense call: "regular" (``tile_m`` rows, ``packed`` its
    pack-GQA factor) or one of the extra families ``built`` for the call's key ({family: its
    tile_m}; ``mask`` its mask kind). Automatic, never for packed GQA (decoding: the regular tiles
    stream the cache well):
    - "short" for queries up to SHORT_SEQ_MAX rows: causal always (its warpgroups skip 64-key
      diagonal blocks: +2% to +40% at every length measured up to 1024, -1% at 1536); without a
      mask where the regular tiles pad and its tiles pad no more (at equal padding its tiles
      won: 700 rows +5%; without padding they lost: 768 -2%);
    - "long" for keys from LONG_SEQ_MIN_K on whose query its taller tiles fill at least
      LONG_MIN_FILL as well (2048 and 4096 rows: 97%; not one decoding row: 1/192 against 1/128).
    ``override`` (FA4_TILES) is taken wherever that family is built."""
    if override is not None:
        return override if override in built else "regular"
    if packed > 1:
        return "regular"
    fill = tile_fill(seqlen_q, tile_m)
    if "short" in built and seqlen_q <= SHORT_SEQ_MAX:
        if mask == "causal" or (fill < 1.0 and tile_fill(seqlen_q, built["short"]) >= fill):
            return "short"
    if "long" in built and seqlen_k >= LONG_SEQ_MIN_K and tile_fill(seqlen_q, built["long"]) >= LONG_MIN_FILL * fill:
        return "long"
    return "regular"


def supported_head_dims(variants: list[dict], capability, kernel: str = "fwd") -> list[tuple[int, int]]:
    arch = arch_name(capability)
    return sorted({(v["head_dim"], v["head_dim_v"]) for v in variants
                   if v["arch"] == arch and v.get("kernel", "fwd") == kernel})


def l2_swizzle_budget(l2_bytes: int, mask: str) -> int:
    """Bytes of K/V one swizzle group of the tile order may hold in L2.

    No mask (static schedule, equal tiles), measured on an H200 (60 MB L2), hd128 bf16, 16k
    tokens, two repeats per budget (scripts/tune_schedule.sh), TFLOP/s:
      2 / 4 / 7.5 / 16 / 32 MB: 1k 553 / 550 / 525 / 485 / 516, 4k 631 / 612 / 624 / 611 / 589
    the CTAs of one head streaming the same K/V block together wins (an L2/24 group holds one
    hd128 head at 4k).
    Causal/local (dynamic longest-first schedule): half the L2, in a power-of-two number of
    pairs (``heads_per_group``). Measured on an H200 with groups of 16 / 32 / 64 MB of K/V
    (causal, bf16, 16k tokens, TFLOP/s; tenth session, docs/perf_notes.md): hd128 1k 514 / 507 /
    431, 4k 694 / 695 / 666; hd256 1k 518 / 518 / 474, 4k 745 / 744 / 728; 44-48 MB groups lost
    1-11% against 16-32 MB ones.
    """
    return l2_bytes // 24 if mask == "none" else l2_bytes // 2


def balance_heads(num_m_blocks: int, num_sms: int) -> int:
    """Fewest (head, batch) pairs per group for the dynamic longest-first schedule to end evenly.

    A causal group's tiles run from num_m_blocks K/V blocks long down to 1, about
    num_m_blocks * (num_m_blocks + 1) / 2 blocks per pair, and its longest tiles start when the
    group does. The last group's longest tiles must be short next to its work per SM, or they
    run on alone after the other SMs ran dry. Simulated (tests/fa4_kernels/
    test_tile_scheduler.py, tiles as K/V blocks plus the boundary cost) with the L2 groups of
    ``heads_per_group``: at least num_sms / (num_m_blocks + 1) pairs (half a longest tile of
    work per SM in the last group) keeps the busiest SM within 1.5% of the average wherever
    there are 16+ tiles per SM. In the benchmark shapes the L2 groups are at least this large
    but for hd256 at 8k and 16k (2 and 1 pairs fit L2/2; 3 and 2 wanted). With few query
    blocks against long keys (chunked prefill) it asks for large groups although such tiles
    are nearly equal in length; harmless there (a group's tiles then all run at once), not
    benchmarked."""
    return max(1, -(-num_sms // (num_m_blocks + 1)))


def heads_per_group(l2_bytes: int, seqlen_k: int, head_dim: int, head_dim_v: int, elem_bytes: int,
                    num_heads_batches: int, budget_bytes: int | None = None, mask: str = "none",
                    num_m_blocks: int | None = None, num_sms: int | None = None) -> int:
    """How many (head, batch) pairs one L2-swizzle group of the tile order holds (>= 1).

    ``l2_swizzle_budget`` of K/V per group. With a mask (dynamic schedule, tiles of unequal
    length) a power of two of them (as FlashAttention-3; in the simulation and on the GPU,
    groups that divide the pairs evenly balance better), and at least ``balance_heads``, rounded
    up to a power of two, when ``num_m_blocks`` and ``num_sms`` are given. An explicit ``budget_bytes``
    (FA4_L2_SWIZZLE_MB) is taken as it is. The kernel's last group also takes the pairs left
    over (fa4_kernels.tile_scheduler)."""
    kv_bytes_per_head = max(1, seqlen_k * (head_dim + head_dim_v) * elem_bytes)
    budget = l2_swizzle_budget(l2_bytes, mask) if budget_bytes is None else budget_bytes
    heads = max(1, budget // kv_bytes_per_head)
    if budget_bytes is None and mask != "none":
        heads = 1 << (heads.bit_length() - 1)
        if num_m_blocks and num_sms:
            heads = max(heads, 1 << (balance_heads(num_m_blocks, num_sms) - 1).bit_length())
    return max(1, min(num_heads_batches, heads))


def grid_size(num_sms: int, mask: str, persistent_override: bool | None = None) -> int:
    """CTAs to launch at most: ``num_sms`` makes the kernel persistent (each CTA loops over
    tiles; the next tile's loads overlap the current epilogue), a huge value gives one CTA per
    tile, handed out by the hardware as SMs free up.

    Persistent in all cases: without a mask tiles are equal and the static order is balanced
    (hd128, H200: 528 vs 474 TFLOP/s at 1k, 585-605 vs 550 at 4k); with causal/local masks the
    kernel claims tiles dynamically from a global counter, so long and short tiles balance.
    """
    return num_sms if persistent_override in (None, True) else (1 << 31) - 1


# The backward's first-store claims count in a counter's high 16 bits (sm90/bwd.py, DQ_CLAIM).
MAX_FIRST_STORE_BLOCKS = 1 << 15


def mean_visible_keys(seqlen_q: int, seqlen_k: int, mask: MaskSpec) -> float:
    """Keys a query row sees on average under a bottom-right aligned mask, in closed form (row i
    sees keys max(0, i + b) .. min(seqlen_k - 1, i + a), a = offset + right, b = offset - left;
    rows with i + a < 0 see none, and every other row sees one at least)."""
    if mask.kind == "none" or seqlen_q <= 0:
        return float(seqlen_k)
    offset = seqlen_k - seqlen_q
    a, b = offset + mask.window_right, offset - mask.window_left

    def linear_sum(x, y, c):  # sum of i + c for x <= i <= y
        return (y - x + 1) * (x + y) // 2 + c * (y - x + 1) if y >= x else 0
    lo, hi = max(0, -a), seqlen_q - 1
    if lo > hi:
        return 0.0
    last = min(hi, seqlen_k - 1 - a)  # rows up to here end at i + a, later ones at the last key
    ends = linear_sum(lo, last, a) + (seqlen_k - 1) * max(0, hi - max(lo, last + 1) + 1)
    starts = linear_sum(max(lo, -b), hi, b)  # rows from -b on start at i + b, earlier ones at key 0
    return (ends - starts + hi - lo + 1) / seqlen_q


# K/V blocks per query block (mean visible keys / tile_n) up to which the first store pays.
STORE_FIRST_MAX_BLOCKS = 48


def bwd_store_first(varlen: bool, num_n_blocks: int, blocks_per_query_block: float = 0.0,
                    override: bool | None = None) -> bool:
    """Whether the backward's first K/V block to reach a query block stores its dQ into the fp32
    accumulator instead of adding to zeros (sm90/bwd.py): the preprocess then zeroes only the
    rows that see no key (keyless_rows), not the whole accumulator (4 bytes per dQ element: 45
    us of 16k tokens of hidden 2048 on an H100). It costs each K/V block's visit to a query
    block a claim (an atomic issued a block ahead), so it pays where a query block has few K/V
    blocks: ``blocks_per_query_block`` (mean_visible_keys / tile_n) up to
    STORE_FIRST_MAX_BLOCKS. Measured (H100, bf16 16k tokens, fwd+bwd, 4 rotated rounds, on/off;
    K/V blocks per query block in brackets): hd128 1k +2.0% (8), causal +9.5% (4), 4k +0.7%
    (32), causal +2.7% (16), 16k -2.9% (128), causal -1.0% (64), a 1024-key window at 16k
    +3.8% (9); hd64 1k +3.4%, causal +6.0%, 4k +1.1%, causal +1.9%, 16k -2.6% (128); hd256
    (64-key blocks) 1k +3.9% (16), causal +10.3% (8), 4k +0.3% (64), causal +1.0% (32), 16k
    -1.7% (256), causal -1.5% (128). Dense calls only (packed sequences' rows outside every
    sequence must be zero for the conversion that reads them). ``override``: False never,
    True wherever it can run."""
    if override is False or varlen or num_n_blocks >= MAX_FIRST_STORE_BLOCKS:
        return False
    return override is True or blocks_per_query_block <= STORE_FIRST_MAX_BLOCKS


def bwd_rotate(mask: str, deterministic: bool, store_first: bool, override: bool | None = None) -> bool:
    """Whether the backward's K/V blocks start on query blocks of their own (no mask, default
    mode; sm90/bwd.py): with store_first, the blocks of a head would otherwise reach each query
    block together and wait for its first store (H100, bf16 16k tokens, fwd+bwd, store_first
    without -> with rotation: hd128 1k +2.1%, 4k +2.9%, 16k +2.7%; hd256 1k +4%, 4k +2.4%). On
    its own it measured -1.3% to +1.4% (hd128 1k -1.3%, 16k -1.8%; hd256 +1.1-1.4%), so it goes
    with store_first. Deterministic mode keeps the K/V-block order its turns follow."""
    if mask != "none" or deterministic:
        return False
    return store_first if override is None else override


def keyless_rows(seqlen_q: int, seqlen_k: int, mask: MaskSpec) -> int:
    """Query rows, from row 0, that see no key: with the bottom-right alignment row i's last key
    is i + seqlen_k - seqlen_q + window_right, so the first seqlen_q - seqlen_k - window_right
    rows see none (none without a right bound: unmasked and local windows reaching past it)."""
    return min(seqlen_q, max(0, seqlen_q - seqlen_k - mask.window_right))


# Split tail (static schedule, no mask). Pieces are at least MIN_PIECE_BLOCKS K/V blocks long.
MIN_PIECE_BLOCKS = 2


def split_overhead_blocks(head_dim_v: int) -> int:
    """K/V blocks' worth of time a piece of a split tile costs beyond its own blocks: it loads
    its own Q, its first Q @ K^T and last P @ V have no partner GEMM to overlap, and its partial
    result (tile_m x head_dim_v fp32) goes to L2 and back while the merger waits. Measured on an
    H200 (bf16, 16k tokens, split on vs off, same runs): with 2 blocks assumed, hd128 at 1k (8
    blocks a tile, 5 a piece) lost 1% and hd256 at 1k (13 a tile, 10 a piece) 1-3%, while the
    4k/16k splits gained 1-3%; so 3 blocks, and 5 for the wide partials of head_dim_v > 128."""
    return 3 if head_dim_v <= 128 else 5


def split_tail_ctas(num_tiles: int, num_sms: int, n_blocks: int, head_dim_v: int = 128,
                    override: bool | None = None) -> int:
    """CTAs to split the static schedule's last round of tiles over (0: no split).

    Equal tiles on a persistent grid take ceil(num_tiles / num_sms) rounds, the last one only
    partly filled (hd128 in the FlashAttention benchmark setup: 2048 tiles on 132 SMs leave 68
    tiles for round 16, while 64 SMs idle). Cutting those tiles into pieces of K/V blocks dealt
    out over all SMs shortens that round from n_blocks to about tail * n_blocks / num_sms blocks
    plus split_overhead_blocks. With fewer tiles than SMs (small batches, decoding) every tile
    is split this way. ``override``: False never splits, True splits whenever pieces can
    outnumber the tiles.
    """
    tail = num_tiles % num_sms  # all of them when there are fewer tiles than SMs
    if override is False or tail == 0 or n_blocks < MIN_PIECE_BLOCKS:
        return 0
    units = tail * n_blocks
    ctas = min(num_sms, units // MIN_PIECE_BLOCKS)
    if ctas <= tail:  # no more pieces than tiles: nothing to gain
        return 0
    if override is None and -(-units // ctas) + split_overhead_blocks(head_dim_v) >= n_blocks:
        return 0
    return ctas


PACKABLE_GROUPS = (2, 4, 8, 16)  # query heads per K/V head that pack-GQA can stack in a tile


def _stacks(group: int, tile_m: int) -> bool:
    """Each head's share of a tile is loaded in 8-row pieces."""
    return tile_m % group == 0 and (tile_m // group) % 8 == 0


def pack_gqa_factor(heads_q: int, heads_kv: int, seqlen_q: int, tile_m: int, override: bool | None = None) -> int:
    """Query heads stacked in one tile (1: none). Pack-GQA puts the heads_q / heads_kv query
    heads that share a K/V head into the rows of one tile (tile_m / factor rows of each), so a
    short query (decoding: 1 row) still fills the tile and K/V are read once per group.

    Automatic choice, as FlashAttention-3: pack when the unpacked tiles would be under 90% as
    full as the packed ones (short or ragged seqlen_q). Only groups of 2, 4, 8 or 16 heads
    are packed, and only as many as give each head a multiple of 8 rows of the tile (192-row
    hd64 tiles: up to 8).
    """
    group = heads_q // max(heads_kv, 1)
    packable = group in PACKABLE_GROUPS and heads_q == group * heads_kv
    stackable = packable and _stacks(group, tile_m)
    if override is True and packable and not stackable:
        most = max(g for g in (1,) + PACKABLE_GROUPS if _stacks(g, tile_m))
        raise ValueError(f"pack_gqa=True: this head_dim's {tile_m}-row tiles stack at most {most} heads "
                         f"(in 8-row pieces), not {group}; use pack_gqa=None or False")
    if override is False or not stackable:
        return 1
    if override is True:
        return group
    seqlen_q = max(seqlen_q, 1)
    return group if tile_fill(seqlen_q, tile_m) < 0.9 * tile_fill(seqlen_q * group, tile_m) else 1
