import pytest
import torch

from fa4 import heuristics
from fa4.heuristics import UNBOUNDED, MaskSpec, resolve_mask


@pytest.mark.parametrize(
    "causal, window, expected",
    [
        (False, (-1, -1), MaskSpec("none", UNBOUNDED, UNBOUNDED)),
        (True, (-1, -1), MaskSpec("causal", UNBOUNDED, 0)),
        (False, (-1, 0), MaskSpec("causal", UNBOUNDED, 0)),
        (True, (-1, 0), MaskSpec("causal", UNBOUNDED, 0)),
        (True, (64, -1), MaskSpec("local", 64, 0)),
        (False, (32, 8), MaskSpec("local", 32, 8)),
        (False, (-1, 5), MaskSpec("local", UNBOUNDED, 5)),
        (False, (0, -1), MaskSpec("local", 0, UNBOUNDED)),
    ],
)
def test_resolve_mask(causal, window, expected):
    assert resolve_mask(causal, *window) == expected


def test_causal_with_right_window_is_rejected():
    with pytest.raises(ValueError, match="causal=True already fixes window_right"):
        resolve_mask(True, 16, 4)


def test_negative_window_is_rejected():
    with pytest.raises(ValueError, match="window_left must be >= 0"):
        resolve_mask(False, -2, 0)


VARIANTS = [
    dict(arch="sm_90a", dtype="bf16", head_dim=128, head_dim_v=128, mask="causal", softcap=False, name="a"),
    dict(arch="sm_90a", dtype="bf16", head_dim=64, head_dim_v=64, mask="none", softcap=True, name="b"),
]


def test_select_variant_exact_match_only():
    assert heuristics.select_variant(VARIANTS, (9, 0), "bf16", 128, 128, "causal", False)["name"] == "a"
    assert heuristics.select_variant(VARIANTS, (9, 0), "bf16", 128, 128, "none", False) is None
    assert heuristics.select_variant(VARIANTS, (8, 0), "bf16", 128, 128, "causal", False) is None
    assert heuristics.supported_head_dims(VARIANTS, (9, 0)) == [(64, 64), (128, 128)]
    assert heuristics.arch_name((10, 0)) is None
    varlen = dict(VARIANTS[0], varlen=True, name="c")
    assert heuristics.select_variant(VARIANTS + [varlen], (9, 0), "bf16", 128, 128, "causal", False, True)["name"] == "c"
    short = dict(VARIANTS[1], tiles="short", name="d")
    assert heuristics.select_variant(VARIANTS + [short], (9, 0), "bf16", 64, 64, "none", True)["name"] == "b"
    assert heuristics.select_variant(VARIANTS + [short], (9, 0), "bf16", 64, 64, "none", True,
                                     tiles="short")["name"] == "d"


HD64 = {"short": 256}  # hd64: regular 192-row tiles, "short" 256
HD128 = {"long": 192}  # hd128: regular 128-row tiles, "long" 192


@pytest.mark.parametrize("tile_m, built, sq, sk, packed, override, expected", [
    (192, HD64, 1024, 1024, 1, None, "short"),    # 192-row tiles: 5 full + 64 rows (89% real); 256: 4 full
    (192, HD64, 512, 8192, 1, None, "short"),     # 89% vs 100%, whatever the keys
    (192, HD64, 197, 197, 1, None, "short"),      # ViT-style: 51% vs 77%
    (192, HD64, 768, 768, 1, None, "regular"),    # both exact: the regular tiles' faster steps win
    (192, HD64, 960, 960, 1, None, "regular"),    # regular exact (5 x 192), short pads 64
    (192, HD64, 700, 700, 1, None, "short"),      # both pad to 768: measured +5%
    (192, HD64, 1, 8192, 1, None, "regular"),     # one unpacked decoding row: 1/256 against 1/192
    (192, HD64, 1025, 1025, 1, None, "regular"),  # beyond SHORT_SEQ_MAX
    (192, HD64, 1024, 1024, 4, None, "regular"),  # pack-GQA
    (192, HD64, 4096, 4096, 1, "short", "short"),        # FA4_TILES=short
    (192, HD64, 1024, 1024, 1, "regular", "regular"),    # FA4_TILES=regular
    (192, HD64, 1024, 1024, 1, "long", "regular"),       # not built for hd64
    (128, HD128, 16384, 16384, 1, None, "long"),   # 192-row tiles pad 0.5%
    (128, HD128, 8192, 8192, 1, None, "long"),
    (128, HD128, 4096, 4096, 1, None, "long"),     # 97% vs 100% full: measured +2%
    (128, HD128, 2048, 2048, 1, None, "long"),     # the same fill: +1.5%
    (128, HD128, 4096, 1024, 1, None, "regular"),  # below LONG_SEQ_MIN_K
    (128, HD128, 1024, 1024, 1, None, "regular"),  # 89% vs 100%: measured -7%
    (128, HD128, 1000, 16384, 1, None, "regular"), # 87% vs 98%
    (128, HD128, 1, 8192, 1, None, "regular"),     # unpacked decoding: 1/192 against 1/128
    (128, HD128, 10000, 10000, 1, None, "long"),   # 98.3% against 98.9%
    (128, HD128, 16384, 16384, 2, None, "regular"),
    (128, {}, 1024, 1024, 1, "short", "regular"),  # nothing else built for this key
])
def test_tile_family(tile_m, built, sq, sk, packed, override, expected):
    assert heuristics.tile_family(sq, sk, packed, tile_m, built, override) == expected


@pytest.mark.parametrize("sq, sk, packed, expected", [
    (1024, 1024, 1, "short"),
    (768, 768, 1, "short"),     # no padding either way, yet causal: measured +2.3%
    (197, 197, 1, "short"),
    (512, 8192, 1, "short"),    # chunked prefill against a long cache
    (1536, 1536, 1, "short"),   # causal at any length: measured +5% (session 39, H200)
    (4096, 4096, 1, "short"),   # +1-2%
    (32768, 32768, 1, "short"),  # a tie
    (1024, 1024, 2, "regular"),  # pack-GQA
])
def test_tile_family_causal(sq, sk, packed, expected):
    assert heuristics.tile_family(sq, sk, packed, 192, HD64, None, "causal") == expected


def test_tile_fill():
    assert heuristics.tile_fill(1024, 256) == 1.0
    assert heuristics.tile_fill(1024, 192) == pytest.approx(1024 / 1152)
    assert heuristics.tile_fill(0, 128) == 1 / 128  # an empty query still takes one tile


def test_heads_per_group_fits_l2_budget():
    mb = 1 << 20
    # 4k keys, d=128: 2 MB of K/V per head; L2/24 of 60 MB holds 1 head, L2/2 holds 15: 8 of them.
    assert heuristics.heads_per_group(60 * mb, 4096, 128, 128, 2, 64, mask="none") == 1
    assert heuristics.heads_per_group(60 * mb, 4096, 128, 128, 2, 64, mask="causal") == 8
    assert heuristics.heads_per_group(60 * mb, 1024, 64, 64, 2, 2) == 2  # capped by the pairs
    assert heuristics.heads_per_group(50 * mb, 1 << 20, 256, 256, 2, 64) == 1  # huge heads: one at a time
    assert heuristics.heads_per_group(0, 16, 64, 64, 2, 4) == 1
    assert heuristics.heads_per_group(48 * mb, 4096, 128, 128, 2, 64, budget_bytes=4 * mb) == 2


def test_heads_per_group_balances_masked_schedules():
    mb = 1 << 20
    # The FlashAttention benchmark shapes on an H200: hd256 causal 4k is 4 MB a head, 4 heads
    # in L2/2 (the best measured); 32 tiles per head need >= 132 / 33 = 4 for balance.
    assert heuristics.balance_heads(32, 132) == 4
    assert heuristics.heads_per_group(60 * mb, 4096, 256, 256, 2, 32, mask="causal", num_m_blocks=32,
                                      num_sms=132) == 4
    assert heuristics.heads_per_group(60 * mb, 1024, 256, 256, 2, 128, mask="causal", num_m_blocks=8,
                                      num_sms=132) == 16
    # Few query blocks against long keys (chunked prefill: 2 blocks, 8 MB of K/V a head): L2/2
    # holds 3 heads, balance wants 44, i.e. 64; hd256 at 8k (8 MB a head): 2 in L2/2, 3 for
    # balance, so 4.
    assert heuristics.heads_per_group(60 * mb, 16384, 128, 128, 2, 64, mask="causal", num_m_blocks=2,
                                      num_sms=132) == 64
    assert heuristics.heads_per_group(60 * mb, 8192, 256, 256, 2, 16, mask="causal", num_m_blocks=64,
                                      num_sms=132) == 4
    # No mask: equal tiles on the static schedule, the L2 share alone decides.
    assert heuristics.heads_per_group(60 * mb, 4096, 128, 128, 2, 64, mask="none", num_m_blocks=2,
                                      num_sms=132) == 1
    # An explicit budget (FA4_L2_SWIZZLE_MB) is taken as it is.
    assert heuristics.heads_per_group(60 * mb, 4096, 128, 128, 2, 64, budget_bytes=12 * mb, mask="causal",
                                      num_m_blocks=32, num_sms=132) == 6


def test_grid_size():
    assert heuristics.grid_size(132, "none") == 132 and heuristics.grid_size(132, "causal") == 132
    assert heuristics.grid_size(132, "causal", persistent_override=False) > 1 << 30
    assert heuristics.grid_size(132, "none", persistent_override=False) > 1 << 30


@pytest.mark.parametrize("hq, hk, sq, override, expected", [
    (32, 8, 1, None, 4),        # decoding: 4 heads fill 4 rows instead of 1 of 128
    (32, 8, 40, None, 4),       # short queries pack
    (32, 8, 4096, None, 1),     # full tiles either way: no packing
    (32, 8, 4096, True, 4),     # forced
    (32, 8, 1, False, 1),       # disabled
    (24, 8, 1, None, 1),        # 3 heads per K/V head: not a packable group
    (16, 16, 1, None, 1),       # MHA
    (64, 2, 1, None, 16),       # 32 heads per K/V head: the 16 the tile stacks
    (64, 2, 1, False, 1),
    (16, 1, 1, None, 16),
    (48, 4, 1, None, 4),        # 12 heads: their largest power-of-two part
    (24, 1, 1, None, 8),
    (12, 4, 1, None, 1),        # 3 heads: no even part
])
def test_pack_gqa_factor(hq, hk, sq, override, expected):
    assert heuristics.pack_gqa_factor(hq, hk, sq, 128, override) == expected


def test_pack_gqa_factor_respects_the_tile_height():
    assert heuristics.pack_gqa_factor(16, 1, 1, 192) == 8  # 12 rows per head of 16: not a multiple of 8
    assert heuristics.pack_gqa_factor(8, 1, 1, 192) == 8
    assert heuristics.pack_gqa_factor(16, 1, 1, 64) == 8  # 64 rows in 8-row pieces of one head
    assert heuristics.pack_gqa_factor(16, 1, 1, 256) == 16
    assert heuristics.pack_gqa_factor(64, 2, 1, 256) == 32
    assert heuristics.pack_gqa_factor(64, 1, 1, 256) == 32


@pytest.mark.parametrize("hq, hk, sq, expected", [
    (16, 1, 1, 16),    # 4 rows a head
    (64, 1, 1, 64),    # MQA decoding: one row a head
    (128, 1, 1, 64),   # the most a 64-row tile stacks
    (32, 8, 1, 4),
    (32, 2, 7, 16),    # verification: 7 of each head's 4 rows fill two tiles
    (32, 2, 64, 1),    # full tiles unpacked
    (24, 2, 1, 4),     # 12 heads: their largest power-of-two part
])
def test_pack_gqa_factor_of_the_kv_cache_tiles(hq, hk, sq, expected):
    """The KV-cache kernels load Q in pieces that span heads (kv_cache.FEW_HEAD_ROWS), so their
    64-row tiles stack up to 64 heads of one row each."""
    assert heuristics.pack_gqa_factor(hq, hk, sq, 64, head_rows=1) == expected
    with pytest.raises(ValueError, match="192-row tiles stack at most 8 heads"):
        heuristics.pack_gqa_factor(16, 1, 1, 192, True)


@pytest.mark.parametrize("hq, hk, sq, sk, long_tile_m, expected", [
    (32, 8, 2048, 32768, 128, "long"),     # chunked prefill: unpacked, both full
    (32, 8, 1, 32768, 128, "regular"),     # decoding: 4 packed rows, 1/32 of a tile against 1/16
    (32, 8, 8, 32768, 128, "regular"),     # verification: 32 packed rows, 1/4 against 1/2
    (32, 8, 16, 32768, 128, "regular"),    # 64 packed rows: 1/2 against 1
    (32, 8, 32, 32768, 128, "long"),       # 128 packed rows fill both
    (32, 8, 129, 4096, 128, "long"),       # 516 packed rows in each: 81% of 5 tiles against 90% of 9
    (16, 2, 300, 4096, 128, "long"),       # packed only in the long tiles: 2400 rows (99%) against 300 (94%)
    (8, 8, 100, 8192, 128, "long"),        # unpacked, 100 of 128 rows in both
    (32, 8, 2048, 1024, 128, "regular"),   # below LONG_SEQ_MIN_K (the cache's capacity)
    (32, 8, 2048, 32768, 0, "regular"),    # not built
    (64, 1, 1, 32768, 128, "regular"),     # MQA decoding: 64 heads' rows, half a long tile against one
    (8, 8, 130, 8192, 192, "long"),        # hd64's three warpgroups: 130 of 192 rows against 130 of 192
    (8, 8, 70, 8192, 192, "regular"),      # 70 of 192 against 70 of 128
])
def test_kv_cache_tile_family(hq, hk, sq, sk, long_tile_m, expected):
    """The KV cache's taller tiles (chunked prefill) where they hold a call's rows, packed or not,
    about as fully as the 64-row decoding tiles."""
    assert heuristics.kv_cache_tile_family(hq, hk, sq, sk, 64, long_tile_m) == expected
    # FA4_TILES takes a family wherever it is built.
    assert heuristics.kv_cache_tile_family(hq, hk, sq, sk, 64, long_tile_m, override="long") == \
        ("long" if long_tile_m else "regular")
    assert heuristics.kv_cache_tile_family(hq, hk, sq, sk, 64, long_tile_m, override="regular") == "regular"
    assert heuristics.kv_cache_tile_family(hq, hk, sq, sk, 64, long_tile_m, override="short") == "regular"


def test_split_tail_takes_every_sm_for_a_partial_last_round():
    split = heuristics.split_tail_ctas
    assert split(2048, 132, 32) == 132  # hd128 at 4k: 68 tiles in round 16 over all 132 SMs
    assert split(2048, 132, 8) == 0  # at 1k: 5 blocks a CTA + 3 overhead do not beat a tile of 8
    assert split(3072, 132, 8, head_dim_v=64) == 108  # hd64 at 1k: 36 tail tiles, 3 pieces each
    assert split(8, 132, 64) == 128  # decoding-sized: 8 tiles, 16 pieces each (132 would straddle tiles)
    assert split(64, 132, 32) == 128  # decoding 8 x 4k (hd128 32/8): 2 pieces a tile, not 2.06
    assert split(100, 132, 64) == 132  # fewer than two pieces a tile: the whole grid
    assert split(64, 132, 256) == 128  # 8 x 32k: pieces of 128 blocks, not 125 straddling ones
    assert split(60, 132, 256) == 132  # 120 CTAs would make pieces of 128 blocks, not 117: share decides
    assert split(264, 132, 32) == 0  # full rounds only
    assert split(2048, 132, 32, override=False) == 0
    assert split(1024, 132, 13, head_dim_v=256) == 0  # hd256 at 1k: wide partials, measured slower
    assert split(1024, 132, 52, head_dim_v=256) == 132
    assert split(2048, 132, 1) == 0  # single-block tiles cannot be cut
    assert split(100, 132, 3) == 0  # 300 blocks on 132 SMs: 3 each + overhead, no better than one tile
    assert split(100, 132, 3, override=True) == 132
    assert split(131, 132, 2, override=True) == 0  # 131 two-block pieces: no more pieces than tiles
    assert split(1, 132, 256) == 64  # MQA decoding at 1 x 32k, one tile: at most 64 pieces a tile
    assert split(2, 132, 1024) == 128  # 32 / 2 heads at 1 x 128k: 64 pieces each, not 66
    # Tiles of at most 16 live query rows (decoding's pack-GQA tiles) take one-block pieces.
    assert split(8, 132, 16) == 64 and split(8, 132, 16, live_rows=4) == 128  # 32 / 8 heads at 1 x 2k
    assert split(2, 132, 32, live_rows=16) == 64  # 32 / 2 at 1 x 4k: 32 pieces of one block each
    assert split(2, 132, 64, live_rows=16) == 128  # 32 / 2 at 1 x 8k
    assert split(1, 132, 64, live_rows=64) == 32  # 64 / 1 at 1 x 8k: 64 live rows keep two-block pieces
    assert split(8, 132, 1, live_rows=4) == 0  # one-block tiles cannot be cut


def test_masks_that_hide_nothing_are_dropped():
    causal, none = resolve_mask(True, -1, -1), resolve_mask(False, -1, -1)
    assert heuristics.effective_mask(causal, 1, 5000) == none  # decoding: the one row sees every key
    assert heuristics.effective_mask(causal, 2, 5000) == causal
    assert heuristics.effective_mask(resolve_mask(False, 99, 0), 1, 100) == none
    assert heuristics.effective_mask(resolve_mask(False, 98, 0), 1, 100).kind == "local"
    assert heuristics.effective_mask(resolve_mask(False, 10, 20), 21, 11) == none
    assert heuristics.effective_mask(resolve_mask(False, 10, 19), 21, 11).kind == "local"


def test_explicit_split_counts_and_page_sizes():
    # num_splits pieces per tile of the last round, one CTA each, within the grid and a block a piece.
    assert heuristics.split_ctas_for(8, 132, 512, 4) == 32
    assert heuristics.split_ctas_for(8, 132, 512, 1) == 0  # 1: never split
    assert heuristics.split_ctas_for(8, 132, 512, 0) == 0  # 0 is split_tail_ctas's call, not this
    assert heuristics.split_ctas_for(64, 132, 512, 4) == 128  # as far as the grid goes, in whole pieces
    assert heuristics.split_ctas_for(100, 132, 512, 4) == 132  # under two pieces a tile: all of the grid
    assert heuristics.split_ctas_for(8, 132, 2, 4) == 16  # a block a piece at least
    assert heuristics.split_ctas_for(264, 132, 512, 4) == 0  # no partial last round: nothing to split
    assert heuristics.split_ctas_for(140, 132, 512, 2) == 16  # the last round's 8 tiles
    for page, pages in ((16, 8), (64, 8), (256, 8), (48, 1), (80, None), (48, None)):
        heuristics.check_kv_page_size(page, pages)
    for page, pages, rule in ((8, 4, "paged cache's page_size .* multiple of 16"), (40, 4, "page_size"),
                              (0, 4, "page_size"), (40, None, "contiguous cache's seqlen .* pad the cache"),
                              (48, 2, "power-of-two size .* 16-row pages")):
        with pytest.raises(ValueError, match=rule):
            heuristics.check_kv_page_size(page, pages)
    assert [heuristics.kv_kernel_page_rows(p) for p in (16, 48, 64, 80, 96, 256)] == [16, 16, 64, 16, 16, 256]


def test_backward_store_first_and_rotation():
    assert heuristics.bwd_store_first(32, 32)
    assert heuristics.bwd_store_first(64, 25)  # 8 causal documents in 16k tokens (the longest 6339)
    assert not heuristics.bwd_store_first(128, 128)  # many K/V blocks per query block: claims cost
    assert heuristics.bwd_store_first(128, 128, override=True)
    assert not heuristics.bwd_store_first(heuristics.MAX_FIRST_STORE_BLOCKS, 8, override=True)  # 15 bits
    assert not heuristics.bwd_store_first(8, 8, override=False)
    # Default mode: one chunk of every K/V block, with the first store.
    assert heuristics.bwd_rotate("none", False, store_first=True, num_n_blocks=256, num_sms=132) == 256
    assert heuristics.bwd_rotate("none", False, False, 256, 132) == 0  # it goes with the first store
    assert heuristics.bwd_rotate("none", False, False, 256, 132, override=True) == 256
    assert heuristics.bwd_rotate("causal", False, True, 256, 132) == 0
    assert heuristics.bwd_rotate("none", False, True, 256, 132, override=False) == 0
    # Deterministic: square-block kernels whose head's blocks the GPU holds at once (the turns
    # may wait for later CTAs); forced, chunks of at most one block per SM.
    assert heuristics.bwd_rotate("none", True, False, 64, 132, tile=(64, 64)) == 64
    assert heuristics.bwd_rotate("none", True, False, 64, 132, tile=(64, 128)) == 0  # measured slower
    assert heuristics.bwd_rotate("none", True, True, 256, 132, tile=(64, 64)) == 0  # a head too long
    assert heuristics.bwd_rotate("none", True, True, 256, 132, tile=(64, 128), override=True) == 132
    assert heuristics.bwd_rotate("none", True, True, 64, 132, tile=(64, 64), override=False) == 0
    assert heuristics.bwd_rotate("local", True, False, 64, 132) == 0
    # Deterministic, spaced turns: the chunk cut into `spacing` chunks (the last may be shorter).
    assert heuristics.bwd_rotate("none", True, False, 64, 132, tile=(64, 64), spacing=1) == 64
    assert heuristics.bwd_rotate("none", True, False, 64, 132, tile=(64, 64), spacing=2) == 32
    assert heuristics.bwd_rotate("none", True, False, 65, 132, tile=(64, 64), spacing=2) == 33
    assert heuristics.bwd_rotate("none", True, False, 16, 132, tile=(64, 64), spacing=3) == 6
    assert heuristics.bwd_rotate("none", True, True, 256, 132, tile=(64, 64), override=True, spacing=2) == 66
    assert heuristics.bwd_rotate("none", True, True, 256, 132, tile=(64, 64), spacing=2) == 0  # not rotated
    assert heuristics.bwd_rotate("none", False, True, 64, 132, tile=(64, 64), spacing=2) == 64  # default mode


def test_causal_backward_launches_in_groups_of_pairs():
    """Dense, non-deterministic causal calls only: packed sequences, windows and deterministic
    turns keep the grid's order (the kernel runs causal as a window: its mask kind cannot tell)."""
    group = heuristics.bwd_launch_group("causal", varlen=False, deterministic=False)
    assert group == 4
    assert heuristics.bwd_launch_group("causal", varlen=True, deterministic=False) == 0
    assert heuristics.bwd_launch_group("causal", varlen=False, deterministic=True) == 0
    for mask in ("none", "local"):
        assert heuristics.bwd_launch_group(mask, varlen=False, deterministic=False) == 0
    assert heuristics.bwd_launch_group("causal", False, False, override=0) == 0
    assert heuristics.bwd_launch_group("causal", False, False, override=16) == 16
    assert heuristics.bwd_launch_group("causal", False, True, override=16) == 0


def test_spaced_deterministic_turns_launch_chunk_by_chunk():
    """Unmasked deterministic calls rotated in several chunks launch every pair's first chunk
    before its second: as many pairs as keep one chunk of each within the SMs (a turn may wait
    for a later CTA of its chunk), none where fewer than two fit or the rotation has one chunk."""
    def group(*args, pairs=64, **kwargs):
        return heuristics.bwd_launch_group(*args, pairs=pairs, **kwargs)

    assert group("none", False, True, rotate=32, num_n_blocks=64, num_sms=132) == 4
    assert group("none", False, True, rotate=64, num_n_blocks=128, num_sms=132) == 2
    assert group("none", False, True, rotate=8, num_n_blocks=16, num_sms=132) == 16
    assert group("none", False, True, rotate=64, num_n_blocks=64, num_sms=132) == 0  # one chunk
    assert group("none", False, True, rotate=0, num_n_blocks=64, num_sms=132) == 0
    assert group("none", False, True, rotate=66, num_n_blocks=256, num_sms=132) == 2
    assert group("none", False, True, rotate=100, num_n_blocks=200, num_sms=132) == 0  # one pair's chunk
    assert group("none", False, True, rotate=32, num_n_blocks=64, num_sms=132, override=2) == 2
    assert group("none", False, True, rotate=32, num_n_blocks=64, num_sms=132, override=64) == 4  # capped
    assert group("none", False, True, rotate=32, num_n_blocks=64, num_sms=132, override=0) == 0
    assert group("none", True, True, rotate=32, num_n_blocks=64, num_sms=132) == 0  # packed sequences
    assert group("none", False, False, rotate=32, num_n_blocks=64, num_sms=132) == 0  # no turns
    for kind in ("causal", "local"):
        assert group(kind, False, True, rotate=32, num_n_blocks=64, num_sms=132) == 0
    # The last group takes the leftover pairs: 66 pairs in groups of 4 end with one of 6 (192
    # CTAs per chunk), so 3 (the last of 3 + 0) or fewer.
    assert group("none", False, True, rotate=32, num_n_blocks=64, pairs=66, num_sms=132) == 3
    assert group("none", False, True, rotate=32, num_n_blocks=64, pairs=3, num_sms=132) == 4  # one group of 3
    # Through both rules, for the square-block kernels where deterministic calls rotate: every
    # group, the last one included, keeps a chunk of each of its pairs within the SMs.
    for blocks in (8, 16, 33, 64, 100, 128, 132):
        for spacing in (1, 2, 3, 4):
            for pairs in (1, 2, 5, 16, 63, 64, 66, 97):
                rotate = heuristics.bwd_rotate("none", True, False, blocks, 132, tile=(64, 64), spacing=spacing)
                size = group("none", False, True, rotate, blocks, pairs=pairs, num_sms=132)
                last = pairs if size == 0 or pairs <= size else size + pairs % size
                assert rotate * (last if size else 1) <= 132 or size == 0
                if spacing == 1 or blocks == 1:
                    assert size == 0


def test_backward_clusters_only_where_forced():
    """The 2-CTA family only with FA4_BWD_CLUSTERS=1, where built; never packed or deterministic
    (the pair walks one query order); by default never (an H100 lost 13% with it)."""
    family = heuristics.bwd_tile_family
    assert family(False, False, True) == "regular"
    assert family(False, False, True, override=False) == "regular"
    assert family(False, False, True, override=True) == "long"
    for forced in (True, False, None):  # never where not built, packed or deterministic
        assert family(False, False, False, override=forced) == "regular"
        assert family(True, False, True, override=forced) == "regular"
        assert family(False, True, True, override=forced) == "regular"


def test_backward_dq_writers():
    """Deterministic turns of the hd192 / hd256 kernels take two dQ writer warps where session 54
    measured them faster (csrc_shims/fa4_rules.c), with the rotation then cut into 2 chunks; the
    default mode passes 0 (no turns) whatever the setting; FA4_BWD_DQ_WRITERS overrides."""
    writers, spacing = heuristics.bwd_dq_writers, heuristics.bwd_turn_spacing
    sms = 132
    for d in (192, 256):
        assert writers(False, d, "none", 16, sms) == 0 and writers(False, d, "none", 16, sms, override=2) == 0
        # Rotated turns (a head's blocks within the SMs), 1k-8k: two writers, two chunks.
        for blocks in (16, 64, 128, sms):
            assert writers(True, d, "none", blocks, sms) == 2
        # Causal: one writer up to 8k, two at 16k (blocks in (sms, 2 sms]), one at 32k.
        for blocks, want in ((16, 1), (64, 1), (128, 1), (256, 2), (512, 1)):
            assert writers(True, d, "causal", blocks, sms) == want, (d, blocks)
        assert writers(True, d, "local", 256, sms) == 1  # windows: not measured
        assert writers(True, d, "none", 256, sms, varlen=True) == 1  # packed sequences: not measured
        assert writers(True, d, "none", 512, sms) == 1
    # Unmasked 16k chains: hd192's staging buffer gains, hd256's Q/dO stage loses.
    assert writers(True, 192, "none", 256, sms) == 2 and writers(True, 256, "none", 256, sms) == 1
    for d in (64, 96, 128):  # "keys" kernels: one writer
        assert writers(True, d, "none", 16, sms) == 1 and writers(True, d, "causal", 256, sms) == 1
    assert writers(True, 128, "none", 16, sms, override=2) == 2 and writers(True, 256, "none", 16, sms, override=1) == 1
    assert spacing(2) == 2 and spacing(1) == 1 and spacing(0) == 1
    assert spacing(2, override=1) == 1 and spacing(1, override=3) == 3


def test_clusters_run_only_where_the_device_fits_them():
    """No cluster: fall back; clusters that leave more than 4% of the SMs idle: fall back."""
    fit = heuristics.clusters_fit
    assert fit(66, 2, 132) and fit(65, 2, 132) and fit(64, 2, 132)  # 128 of 132 SMs: 97.0%, 126: 95.5%
    assert not fit(63, 2, 132) and not fit(0, 2, 132) and not fit(-1, 2, 132)
    assert fit(8, 2, 16) and not fit(7, 2, 16)
    assert not fit(66, 2, 0) and not fit(66, 0, 132)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (False, (-1, 7)),
                                           (False, (4, -1))])
def test_keyless_rows_are_exactly_the_rows_that_see_no_key(causal, window):
    for sq, sk in [(1, 1), (200, 70), (70, 200), (300, 1), (64, 64), (129, 3)]:
        mask = heuristics.resolve_mask(causal, *window)
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        seen = (j <= i + sk - sq + mask.window_right) & (j >= i + sk - sq - mask.window_left)
        blind = (~seen.any(1)).nonzero().flatten().tolist()
        assert blind == list(range(heuristics.keyless_rows(sq, sk, mask))), (sq, sk, mask)


def test_mean_visible_keys_matches_brute_force():
    for sq, sk in [(1024, 1024), (4096, 4096), (300, 700), (700, 300), (1, 4096)]:
        for causal, window in [(False, (-1, -1)), (True, (-1, -1)), (False, (1024, 0)), (False, (50, 70)),
                               (False, (0, 0)), (False, (-1, 5)), (False, (3, -1))]:
            mask = heuristics.resolve_mask(causal, *window)
            i = torch.arange(sq)[:, None]
            j = torch.arange(sk)[None, :]
            seen = (j <= i + sk - sq + mask.window_right) & (j >= i + sk - sq - mask.window_left)
            exact = seen.sum().item() / sq
            assert abs(heuristics.mean_visible_keys(sq, sk, mask) - exact) < 1e-9, (sq, sk, mask)


def test_python_constants_match_the_rules_library():
    """fa4.heuristics names a few constants of csrc_shims/fa4_rules.c; they must agree."""
    import ctypes

    lib = heuristics.rules()
    assert ctypes.c_int32.in_dll(lib, "fa4_rule_unbounded").value == heuristics.UNBOUNDED
    assert ctypes.c_int32.in_dll(lib, "fa4_rule_max_first_store_blocks").value == heuristics.MAX_FIRST_STORE_BLOCKS
    for group in range(0, 33):
        assert bool(lib.fa4_packable_group(group)) == (group in heuristics.PACKABLE_GROUPS)


def test_tuning_settings_are_read_per_call(monkeypatch):
    for name in ("FA4_L2_SWIZZLE_MB", "FA4_PERSISTENT", "FA4_TILES", "FA4_SPLIT_TAIL", "FA4_BWD_STORE_FIRST",
                 "FA4_BWD_ROTATE", "FA4_BWD_LAUNCH_GROUP", "FA4_BWD_CLUSTERS", "FA4_BWD_TURN_SPACING", "FA4_TRACE",
                 "FA4_TRACE_SCHEDULE", "FA4_BWD_DQ_WRITERS"):
        monkeypatch.delenv(name, raising=False)
    assert heuristics.tuning() == {"l2_swizzle_bytes": None, "persistent": None, "tiles": None, "split_tail": None,
                                   "bwd_store_first": None, "bwd_rotate": None, "bwd_launch_group": None,
                                   "bwd_clusters": None, "bwd_turn_spacing": None, "bwd_dq_writers": None,
                                   "trace_schedule": None, "trace_path": None}
    monkeypatch.setenv("FA4_L2_SWIZZLE_MB", "1.5")
    monkeypatch.setenv("FA4_PERSISTENT", "0")
    monkeypatch.setenv("FA4_TILES", "long")
    monkeypatch.setenv("FA4_BWD_ROTATE", "1")
    monkeypatch.setenv("FA4_BWD_LAUNCH_GROUP", "0")
    monkeypatch.setenv("FA4_TRACE", "/tmp/some trace.jsonl")
    monkeypatch.setenv("FA4_TRACE_SCHEDULE", "static")
    monkeypatch.setenv("FA4_BWD_CLUSTERS", "0")
    monkeypatch.setenv("FA4_BWD_TURN_SPACING", "2")
    monkeypatch.setenv("FA4_BWD_DQ_WRITERS", "2")
    assert heuristics.tuning() == {"l2_swizzle_bytes": 3 << 19, "persistent": False, "tiles": "long",
                                   "split_tail": None, "bwd_store_first": None, "bwd_rotate": True,
                                   "bwd_launch_group": 0, "bwd_clusters": False, "bwd_turn_spacing": 2,
                                   "bwd_dq_writers": 2, "trace_schedule": "static",
                                   "trace_path": "/tmp/some trace.jsonl"}
    for bad in ("0", "17", "two"):
        monkeypatch.setenv("FA4_BWD_TURN_SPACING", bad)
        with pytest.raises(ValueError, match="FA4_BWD_TURN_SPACING must be a number of chunks from 1 to 16"):
            heuristics.tuning()
    monkeypatch.delenv("FA4_BWD_TURN_SPACING")
    for bad in ("0", "3"):
        monkeypatch.setenv("FA4_BWD_DQ_WRITERS", bad)
        with pytest.raises(ValueError, match="FA4_BWD_DQ_WRITERS must be a number of warps from 1 to 2"):
            heuristics.tuning()
    monkeypatch.delenv("FA4_BWD_DQ_WRITERS")
    monkeypatch.setenv("FA4_BWD_LAUNCH_GROUP", "8")
    assert heuristics.tuning()["bwd_launch_group"] == 8
    monkeypatch.setenv("FA4_BWD_LAUNCH_GROUP", "four")
    with pytest.raises(ValueError, match="FA4_BWD_LAUNCH_GROUP must be a number"):
        heuristics.tuning()
    monkeypatch.delenv("FA4_BWD_LAUNCH_GROUP")
    monkeypatch.setenv("FA4_TRACE", "")  # empty: off, as unset
    monkeypatch.setenv("FA4_TRACE_SCHEDULE", "dynamic")
    assert heuristics.tuning()["trace_path"] is None and heuristics.tuning()["trace_schedule"] == "dynamic"
    monkeypatch.setenv("FA4_TRACE_SCHEDULE", "round-robin")
    with pytest.raises(ValueError, match="FA4_TRACE_SCHEDULE must be static or dynamic"):
        heuristics.tuning()
    monkeypatch.delenv("FA4_TRACE_SCHEDULE")
    monkeypatch.setenv("FA4_TILES", "tall")
    with pytest.raises(ValueError, match="FA4_TILES must be one of regular, short, long"):
        heuristics.tuning()


@pytest.mark.parametrize("group, tile_m, built, family", [
    (8, 192, {"short": 256}, "regular"),   # 24 rows each: the regular tiles stack it
    (16, 192, {"short": 256}, "short"),    # 12 rows each do not; 256-row tiles give 16
    (16, 192, {}, "regular"),              # no taller tiles built (local, varlen): refused later
    (16, 128, {"long": 192}, "regular"),   # 8 rows each
    (3, 192, {"short": 256}, "regular"),   # not packable at all
])
def test_packing_family_for_forced_pack_gqa(group, tile_m, built, family):
    assert heuristics.packing_family(group * 2, 2, tile_m, built) == family


@pytest.mark.parametrize("group, seqlen_q, tile_m, built, family", [
    (16, 1, 192, {"short": 256}, "short"),      # 16 heads in 256 rows against 8 in 192
    (32, 1, 192, {"short": 256}, "short"),      # 16 of the 32 against 8
    (8, 1, 192, {"short": 256}, "regular"),     # both stack all 8: the regular tiles
    (16, 4096, 192, {"short": 256}, "regular"),  # full tiles: no packing either way
    (16, 1, 192, {}, "regular"),
    (16, 1, 128, {"long": 192}, "regular"),     # 16 in 128 rows; 192 stack 8
    (3, 1, 192, {"short": 256}, "regular"),
])
def test_packing_family_for_automatic_pack_gqa(group, seqlen_q, tile_m, built, family):
    assert heuristics.packing_family(group * 2, 2, tile_m, built, seqlen_q, None) == family
    assert heuristics.packing_family(group * 2, 2, tile_m, built, seqlen_q, False) == "regular"
