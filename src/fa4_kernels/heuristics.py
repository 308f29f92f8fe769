"""Kernel configuration as pure functions of the variant key (unit-tested on CPU).

The numbers follow FlashAttention-3's Hopper tile table (hopper/tile_size.h) adapted to a
two-consumer-warpgroup kernel whose P operand stays in registers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from fa4_kernels import catalog
from fa4_kernels.catalog import VariantKey

SMEM_LIMIT_SM90 = 227 * 1024  # opt-in dynamic shared memory per block on H100/H200
# Beyond the tiles: the mbarriers before the first (1024-byte aligned) tile buffer, and after the
# last the tile hand-off slots and packed sequences' lengths and order (1 KB,
# tile_scheduler.SEQ_ORDER_IN_KERNEL).
SMEM_RESERVED = 3072
BWD_CONSUMER_WARPS = 8  # the backward's two consumer warpgroups (sm90/bwd.py)
PV_WAITS = ("row_max", "first_exps", "softmax")
# Powers of two a row max may rise by before O is rescaled: probabilities stay <= 256.
RESCALE_THRESHOLD = 8.0


@dataclass(frozen=True)
class FwdConfig:
    tile_m: int
    tile_n: int
    num_stages: int
    # Where the wait for P @ V of block j+1 goes in the softmax of block j (see
    # FlashAttentionForwardSm90.overlapped_step): "row_max" wherever ptxas puts it (in practice
    # right after the row max, before any exponential, or after a few of them, depending on
    # unrelated code), "first_exps" pinned after a few exponentials (upstream FA4's placement),
    # "softmax" after all of them. Measured, bf16, 16k tokens, same runs (docs/perf_notes.md):
    # hd128 "first_exps" vs "row_max" on an H100: non-causal 1k/4k/16k 601/682/659 -> 623/717/712
    # TFLOP/s, causal unchanged to +1%; hd64 causal 4k/16k 501/540 -> 514/559; hd64 without a
    # mask lost 2-3% pinned until P was packed two values per register (store_as_operand_a),
    # now gains: 4k/16k 557-561/577-581 -> 564/589 (two rounds); "softmax" pays off when P @ V
    # is long next to the softmax (head_dim_v > 128: hd256 16k 656 -> 694 on an H200; for hd128
    # after the rescale threshold it is 3% slower, "row_max" 0.5-1%).
    pv_wait: str = "first_exps"
    # > 0: keep a row's running max (and skip rescaling O) until a block raises it by more than
    # this many powers of two (OnlineSoftmax.rescale_threshold). Pays where the O rescale is a
    # large share of the loop's instructions, i.e. head_dim_v >= 96 next to tile_n <= 128:
    # measured on an H100 (bf16 16k tokens, same runs, with the packed P conversion): hd256
    # non-causal 1k/4k/16k 624/751/755 -> 652/784/799 TFLOP/s, hd128 4k 720 -> 730, 16k
    # 707 -> 715-736; hd64 (O is 32 registers) 0 to -2%, so it keeps 0 unless it guesses the
    # row max (speculative_max needs the threshold).
    rescale_threshold: float = 0.0
    # O staged in V's buffer for want of its own (place_buffers): the next tile's V then waits
    # for the O store, and both warpgroups store O together.
    o_in_v: bool = False
    # Equal tiles (no mask, dense batch) are scheduled statically, and the last round's tiles
    # may be split into pieces of K/V blocks over all SMs (tile_scheduler.SplitTail; the host
    # decides per call how many CTAs take part, fa4.heuristics.split_tail_ctas). Masked and
    # packed variable-length tiles differ in length and are scheduled dynamically instead.
    split_tail: bool = False
    # The split tail's merger (split_partials.SplitPartials.merge) folds with the warps' idle lanes
    # and a shuffle tree (merge_helpers_fit says where), and loads two writers' partial rows before
    # folding either, one round of load latency for two (merge_pairs_fit).
    merge_helpers: bool = False
    merge_pairs: bool = False
    # Every piece of a split tile folds a share of the tile's partials and stores that share of
    # O (split_partials, "distributed"), instead of one merger folding them all: KV-cache
    # variants up to head_dim_v 128 (kv_cache_fwd_config), in the launches that
    # split_partials.distributes picks (speculative verification of 8 tokens and more).
    distributed_merge: bool = False
    # Launched with programmatic dependent launch (sm90/fwd.py: griddepcontrol.wait before any
    # global access, then launch_dependents): the CTAs' launch and setup overlap the previous
    # kernel's end. KV-cache variants, whose decoding calls take microseconds. Measured (H200, bf16
    # hd128, 32/8 heads, one token, CUDA-graph us per call of back-to-back calls, two rounds, off ->
    # on): 1x4k 14.0-15.1 -> 13.3-13.5, 8x4k 41.1-41.2 -> 39.8, 1x128k 130.3-130.7 -> 128.8-129.2,
    # 1x32k 42.3 -> 42.0-42.4, 8x32k 244.8-245.0 -> 244.1-244.2. Not measured elsewhere (off).
    # Since session 49 each role waits for the previous grid only after its first tile's schedule
    # arithmetic (FlashAttentionForwardSm90.wait_previous_grid), not right after the CTA's
    # set-up. With few_rows_from_registers and the merger's 32 ns poll (split_partials), same
    # H100 call, CUDA-graph us per call: 1x4k 13.1-13.7 -> 11.5-12.4 (SDPA 11.2-12.2 beside),
    # 1x32k 54.0-54.8 -> 53.3-53.9 (SDPA 52.6-53.5); the traced makespan moved 0.43 us of that.
    # ptxas had still hoisted the wait above most of that arithmetic (ACQBULK 146 instructions
    # before the producer's cache_seqlens load, bf16 hd128); since session 68 the wait takes its
    # results as inputs (ptx.grid_wait_after: 27 there). Same H100 call, two alternations, graph
    # us: 1x4k 9.62-9.68 -> 9.55, 1x32k 50.88-50.90 -> 50.68-50.70, 64x4k 348.2-349.0 -> 347.0-347.1
    # (SDPA 9.65-9.67, 50.77-50.85, 349.6-350.7); between other kernels unchanged, as expected.
    pdl: bool = False
    # A tile whose heads hold at most half their rows' queries (a decoding step's pack-GQA tile:
    # one row in 16 per head) stores O straight from the accumulator registers, each live row's
    # column pairs by 4-byte stores, instead of staging the tile in shared memory behind two
    # barriers and copying its rows out (sm90/fwd.py, FlashAttentionForwardSm90.epilogue).
    # KV-cache variants (few_rows_fit). Measured (H100, bf16 hd128, 32/8 heads, one token, the
    # trace twin's makespan of eager calls, with the two changes of FwdConfig.pdl's note): 1x4k
    # 8.78 -> 8.35 us.
    few_rows_from_registers: bool = False
    # KV cache: K/V blocks wholly inside the rows a call appends are loaded from k_new/v_new, not
    # read back from the cache, so a tile waits only for the new rows of the one block that
    # straddles the cached and appended rows, and the cache stores of the rest are shared among
    # the tiles (sm90/fwd.py). The long tiles: a chunk appended by its prefill call (session 71,
    # H100: every tile storing all its blocks' appended rows before its loads cost 13%; session 72,
    # same call: 1.1%).
    appends_from_new: bool = False
    # KV cache: a K/V block inside one page and inside the sequence is loaded in one TMA box over
    # the cache, not as tile_n / 16 page boxes. The long tiles: their consumers take a block
    # about twice as fast as the decoding tiles' one warpgroup, so the producer's 16 boxes a step
    # (8 each for K and V, each with its page lookup) came close to a consumer step (session 71,
    # H100: 2048-row chunk at 0.84x the dense kernel). With it (session 72, H100, same call):
    # contiguous 525 -> 636 TFLOP/s, the dense kernel's rate. Decoding measured no difference
    # (session 61, H200: within 2% at every batch x length), so its tiles keep one path.
    whole_block_boxes: bool = False
    # Causal/local: a consumer warpgroup sits out the tile's rightmost K/V blocks that hide all
    # of its rows' keys (FlashAttentionForwardSm90.skip_blocks; the warpgroup holding the tile's
    # last rows never does). Pays where the warpgroups contend for the tensor cores or the MUFU,
    # i.e. three or four consumer warpgroups or a long P @ V: measured (H200, bf16 16k tokens,
    # two rounds, causal TFLOP/s, off -> on): hd64 1k 350-351 -> 369, 4k 525-528 -> 537, 16k
    # 571-576 -> 574-581; hd256 1k 512-513 -> 526, 4k 740-741 -> 744-745, 16k unchanged; hd192
    # (dv 192, one round) 1k 495 -> 502, 4k 718 -> 726, 16k 805 -> 809. Not for
    # two warpgroups with dv <= 128, whose period is each warpgroup's own issue + softmax chain:
    # hd128 1k 512 -> 507-508, 4k 689-692 -> 685-687.
    skip_dead_blocks: bool = False
    # The consumers release Q in the tile's last K/V step, once its Q @ K^T has completed,
    # instead of after the K/V loop: the next tile's Q then loads under that step's softmax and
    # the last P @ V. Pays where tiles are short and Q is large next to a step (the "short"
    # family: 16 steps per tile at 1k, a 32 KB Q); elsewhere it measured neutral to slightly
    # slower (H200, bf16 16k tokens, two rounds, TFLOP/s): hd64 short no mask 1k 501-503 ->
    # 507-508, causal 1k 387-390 -> 392; hd128 1k 660-661 -> 661-663, 4k 748-750 -> 742-743;
    # hd256 1k/4k unchanged.
    early_q_release: bool = False
    # A warpgroup's LSE rows go to shared memory and out in one bulk copy beside O's TMA store
    # (when they all lie in the sequence and start 16-byte aligned), instead of a global store
    # per row with its own 64-bit address chain at the tile boundary. Measured (H200, bf16 16k
    # tokens, two rounds, TFLOP/s, off -> on), built into every variant: causal hd64 1k
    # 390.5-392.6 -> 396.9-398.7, hd128 1k 506 -> 510-511, 2k 610-611 -> 615.5, 4k 680 ->
    # 683-684, hd256 +0.1-0.2%; without a mask (the static schedule) hd64 1k 504.5 -> 505, 2k
    # 547 -> 544, 4k 570 -> 567, hd128 2k 710.5 -> 707, 4k 746.7 -> 739, hd256 2k 781 -> 778.
    # Then on for masked variants only (another machine): causal hd64 1k 393.7-393.9 -> 400.3-400.6,
    # hd128 1k 515.6-515.8 -> 519.5-519.9, 2k 623 -> 629, 4k 695 -> 699, hd256 +0.1%; the
    # variants without a mask, unchanged, within 0.3%.
    lse_bulk_store: bool = False
    # With a rescale threshold: K/V steps after a tile's first take their exponentials against
    # the running max without computing the block's row max first, and check afterwards (a
    # thread's block sum per row at most 2^threshold) that no max rose past the threshold; a
    # warp where one did redoes the block the exact way (OnlineSoftmax.speculative_step).
    # The row max's FMNMX chains and shuffles otherwise stand between each step's Q @ K^T wait
    # and its first exponential. Measured (H200, bf16 16k tokens, two rounds, TFLOP/s, off ->
    # on): hd128 no mask 1k 647-662 -> 663-677, 4k 748-754 -> 777-780, causal +0.2-0.7%; hd64
    # short tiles 1k 504-507 -> 552-559, causal 388-393 -> 410-422; hd64 192-row dense 4k
    # 573-577 -> 633-640, 16k 554-570 -> 628-638; hd256 no mask +1%, causal -0.6 to +0.2%.
    # Where it is on: speculative_max_pays.
    speculative_max: bool = False
    # The consumers rebuild the static schedule's tile-invariant values (the split tail's share
    # of this CTA, the tile decode's sizes) from the kernel parameters at every tile, a few
    # integer divisions, instead of holding ~8 registers across the K/V loop. For hd128's long
    # tiles, whose 160-register consumers spilled 2-3 of them (4-12 LDL/STL outside the loop)
    # once they kept the scores beside the probabilities (speculative_max).
    rebuild_schedule: bool = False
    # The epilogue computes its per-thread addresses (O's stmatrix and row-copy addresses, the
    # LSE rows') at every tile from an opaque per-tile zero, rather than once before the tile
    # loop and held across the K/V loop. Where the tiles are long and differ (masked, varlen:
    # the dynamic schedule): it lets hd64's masked and varlen 192-row kernels keep the scores
    # for the guessed row max without spills (2-11 LDL/STL without it). Measured (H200, bf16 16k
    # tokens, two rounds, TFLOP/s, off -> on, with the guess there): hd64 causal 4k 537-539 ->
    # 564, 16k 578-579 -> 622-624, window (1024, 1024) at 4k 482 -> 503, varlen (8 documents)
    # 480 -> 505; hd128 causal 4k 700-702 -> 709-711, 16k 752-755 -> 760-768. Elsewhere it costs
    # at the tile boundary: hd64 short tiles 1k no mask 556-557 -> 538-540, causal 420 -> 403-406;
    # hd64 dense 4k 640 -> 634; hd256 causal (128 O registers' worth of addresses) 1k 563-565 ->
    # 555-556, 4k 758-761 -> 751-755. So: the dynamic schedule, head_dim_v <= 128.
    epilogue_addresses_per_tile: bool = False
    # A bias tensor's entries (score_mod "bias", "bias16") read where they are added, in this many waves
    # (score_mod.ScoreBias.add), instead of all at once under the score GEMM (0): beside hd192/256's
    # O accumulator the early loads spilled (hd256: 22 words with 64-key blocks).
    bias_waves: int = 0
    # Relative-bias score_mods: a tile whose distances all clamp to one end of the table adds that
    # one entry, folded into the softmax's row offsets (score_mod.ScoreBias._clamped_end), instead
    # of a load and an add per diagonal. Measured (H100, bf16 hd128, 16k tokens, 16 heads, causal
    # BlockMask, a +-256 table, forward TFLOP/s, two rounds): 482-501 -> 682-690 (fa4's causal
    # kernel 797). Not at head_dim 256, which it spilled (one word).
    bias_uniform_tiles: bool = False
    # Of every 8 probabilities, how many the softmax computes on the FMA pipe instead of MUFU
    # (exp2_fma.py; FA4_EXP2_FMA overrides it at build time). 0 everywhere: every share measured
    # slower (H100, bf16 16k tokens, same call, TFLOP/s at 1k/4k/16k, share 0 -> 1/8 -> 1/4 -> 1/2
    # -> 3/4): hd64 561/646-649/637-652 -> 512/537/550 -> 480/570/580 -> 429/469/475 ->
    # 372/418/426, causal 420-423/554-572/620-622 -> 404/499/542 -> 373/508/550 -> 343/441/458 ->
    # 294/383/408; hd96 577-583/677-679/659-663 -> 560/647/634 -> 543/621/616 -> 509/587/581 ->
    # 467/528/505; hd128 667-668/789-791/831-843 -> 636/760/799 -> 612/703/723 -> 561/631/642 ->
    # 519/578/577. Hopper's softmax is bound by issue slots, not by MUFU: an emulated exponential
    # takes ~10 issue slots (clamp, 3 FADD, 4 FFMA, IMAD) where MUFU takes one.
    exp2_fma: int = 0
    # ALiBi (block-sparse variants): the bias's per-column part, slope * the key's offset in its
    # block, added by the tensor cores as one more k16 step of Q @ K^T (A: the row's slope /
    # softmax_scale split into three 16-bit terms, B: the key offsets; sm90/fwd.py), so no FFMA
    # per score, and the row max guessed as without a bias. H100, same call, hd128 causal 16k
    # tokens, forward TFLOP/s (fa4's causal kernel 715-790 beside): per-score FFMA and row max
    # 667-668, by MMA 725-731, by MMA with the guess 754-765 (0.99-1.06x causal); fwd+bwd 559-568
    # -> 591-593.
    alibi_by_mma: bool = False

    def smem_bytes(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        q = self.tile_m * head_dim
        o = 0 if self.o_in_v else self.tile_m * head_dim_v
        kv = self.num_stages * self.tile_n * (head_dim + head_dim_v)
        lse = self.tile_m * 4 if self.lse_bulk_store else 0
        # alibi_by_mma's two 16-column operands, each 1024-byte aligned.
        alibi = (self.tile_m + self.tile_n) * catalog.ALIBI_MMA_COLS * elem_bytes + 1024 if self.alibi_by_mma else 0
        return (q + o + kv) * elem_bytes + lse + alibi + SMEM_RESERVED


def place_buffers(cfg: FwdConfig, head_dim: int, head_dim_v: int) -> FwdConfig:
    """O in its own shared-memory buffer when it fits beside Q and the K/V stages (each consumer
    warpgroup then stores its rows on its own), else in V's buffer. A second Q buffer (the next
    tile's Q loading while this tile reads its own) fits hd64-hd128 but measured slower where
    it matters: its per-stage Q address costs the K/V loop ~20 instructions (docs/perf_notes.md)."""
    for o_in_v in (False, True):
        placed = replace(cfg, o_in_v=o_in_v)
        o_fits = not o_in_v or cfg.num_stages * cfg.tile_n >= cfg.tile_m  # the O tile in V's stages
        if o_fits and placed.smem_bytes(head_dim, head_dim_v) <= SMEM_LIMIT_SM90:
            return placed
    raise ValueError(f"no buffer placement of {cfg} fits shared memory")


def speculative_max_pays(key: VariantKey) -> bool:
    """Where the K/V steps guess the row max (FwdConfig.speculative_max): everywhere but with
    softcap. Without softcap every variant keeps a step's scores beside its probabilities
    without spills (read off the SASS of each): hd128's long tiles with rebuild_schedule,
    hd64's masked and varlen 192-row kernels with epilogue_addresses_per_tile. With softcap it
    was measured much slower (H200, bf16 16k tokens, two rounds, TFLOP/s, guess -> none): hd64
    short tiles 1k 270 -> 345-348, hd128 1k 446 -> 528-531, 4k 487-488 -> 600, causal 1k 372 ->
    434, 4k 454 -> 552; hd128's long tiles 4k 497 -> 607 (not explained: the tanh shares the
    MUFU pipe with the exponentials, and without the row max between them nothing else fills
    the issue slots); hd192/256 spilled 8-32 with it."""
    return not key.softcap


def sparse_fwd_config(key: VariantKey) -> FwdConfig:
    """Block-sparse forwards: 128-row tiles (two consumer warpgroups) at every head dim, so that
    FlexAttention's default 128 x 128 blocks map one to one onto tiles (hd64's 192-row tiles
    would mix blocks), and tile_n a multiple of 32 (the bitmask's words) dividing 128: 128 up to
    head_dim_v 128, 64 above it (hd192x192's dense 112 is neither; hd256 takes 64 anyway). The
    rest as for any dynamically scheduled variant (partial blocks never guess the row max)."""
    assert key.kernel == "fwd" and key.tiles == "regular" and not key.varlen
    tile_n = 128 if key.head_dim_v <= 128 else 64
    bias_waves = 0
    if key.score_mod in catalog.TENSOR_SCORE_MODS and key.head_dim in (64, 128):
        # A bias tensor's entries are loaded under the score GEMM, one register per score: with
        # 128-key blocks (64 per thread) hd128 spilled 38 words; 64-key blocks do not.
        tile_n = 64
    elif key.score_mod in catalog.TENSOR_SCORE_MODS:
        # Elsewhere loaded where they are added, in waves: loaded early, hd96 and hd192x128 spilled
        # 2 words with 64-key blocks and hd256 22.
        bias_waves = 4
    cfg = FwdConfig(tile_m=128, tile_n=tile_n, num_stages=2,
                    pv_wait="softmax" if key.head_dim_v > 128 else "first_exps")
    # In-kernel score_mods with a per-score add take the row max: with the speculative path their
    # variants executed two exponentials per score (ncu, hd128 causal 16k: 134M MUFU against 68M,
    # 1.92 ms; without it 70M, 1.63 ms; the same tables without a bias 1.42 ms). ALiBi's bias
    # comes from the tensor cores instead (FwdConfig.alibi_by_mma) and guesses as without one.
    if key.score_mod == "alibi":
        cfg = replace(cfg, alibi_by_mma=True)
    if speculative_max_pays(key) and key.score_mod in ("none", "alibi"):
        cfg = replace(cfg, rescale_threshold=RESCALE_THRESHOLD, speculative_max=True, pv_wait="first_exps")
    elif key.head_dim_v > 64:
        cfg = replace(cfg, rescale_threshold=RESCALE_THRESHOLD)
    cfg = replace(cfg, lse_bulk_store=True, epilogue_addresses_per_tile=key.head_dim_v <= 128, bias_waves=bias_waves,
                  bias_uniform_tiles=key.score_mod == "relbias" and key.head_dim_v < 256)
    cfg = place_buffers(cfg, key.head_dim, key.head_dim_v)
    assert cfg.tile_n % 32 == 0 and 128 % cfg.tile_n == 0
    return cfg


def kv_cache_fwd_config(key: VariantKey) -> FwdConfig:
    """KV-cache forwards (fa4.attention_with_kvcache): 64-row tiles, one consumer warpgroup. A
    decoding tile holds one query row per packed head (4 of 128 rows with 32/8 heads), and with
    128-row tiles the padding rows' GEMMs and exponentials made a K/V block cost about as long as
    its load (H200, bf16 hd128, 32/8 heads, one token, GB/s of K+V, eager | CUDA graph: 64 x 32k
    3703 | 3434 and 1 x 32k 2377 | 2394 against SDPA's 4469 | 4461 and 3245 | 3542). Otherwise
    the dense kernel's choices for the head dims."""
    assert key.kernel == "fwd" and key.tiles in ("regular", "long") and not key.varlen
    assert key.mask in catalog.KV_CACHE_MASKS or (key.mask in catalog.KV_CACHE_TWIN_MASKS and not key.softcap), \
        "KV-cache calls take their window at run time (the twins without softcap: catalog.KV_CACHE_TWIN_MASKS)"
    assert not key.kv_append or key.mask in catalog.KV_CACHE_TWIN_MASKS, "append twins: of the unmasked twins"
    dense = fwd_config(replace(key, kv_cache=False, kv_append=False, tiles="regular"))
    if key.tiles == "long":
        return kv_cache_long_config(key, dense)
    # The epilogue's addresses per tile: held across the K/V loop, one of them spilled (hd128).
    # Every window is scheduled statically with the split tail (sm90/fwd.py): decoding and
    # speculative verification's few tiles then spread over the GPU, and a window's tiles are of
    # equal length anyway. The split's tiles store their LSE rows as the unmasked kernels do (the
    # bulk copy is the dynamic ones'). hd192x192 and hd256 rebuild the static schedule per tile:
    # held, it spilled their consumers with the window's values beside it (hd256 with softcap 37
    # words, hd192x192's causal kernel before this one 17; read off each variant's SASS, with the
    # one-warpgroup register split of sm90/fwd.py). hd128 holds it: rebuilt there, it cost the
    # merger's path 0.6-0.8 us per decoding call (session 51's "new3"), and with the distributed
    # merge's items in a run-time loop it no longer spills.
    cfg = replace(dense, tile_m=64, skip_dead_blocks=False, rebuild_schedule=key.head_dim_v >= 192,
                  epilogue_addresses_per_tile=key.head_dim_v <= 128, split_tail=True, lse_bulk_store=False)
    # distributed_merge: split_partials.distributes picks the launches whose tiles merge that way
    # (the measurements are there); the others keep the merger. Not above head_dim_v 128: with
    # both merges in the kernel, hd192x192 still spilled 2 words (sass_report).
    cfg = replace(cfg, merge_helpers=merge_helpers_fit(cfg, key), merge_pairs=merge_pairs_fit(cfg, key), pdl=True,
                  distributed_merge=key.head_dim_v <= 128)
    cfg = place_buffers(cfg, key.head_dim, key.head_dim_v)
    return replace(cfg, few_rows_from_registers=few_rows_fit(cfg, key))


def kv_cache_long_config(key: VariantKey, dense: FwdConfig) -> FwdConfig:
    """The KV cache's "long" tiles (catalog.KV_CACHE_TILE_FAMILIES): chunked prefill, many query
    rows of each head against a long cache, where the 64-row tiles' one consumer warpgroup left
    the tensor cores idle through its softmax (session 64, H100, bf16 hd128, 2048 queries against
    a 32k cache, causal: 356 TFLOP/s, against 651 for the dense forward on the same tensors). So
    the dense kernel's tiles and K/V steps (two consumer warpgroups, three for hd64), with the
    KV cache's static schedule and split tail: a chunk's tiles differ in length by at most its
    own keys. Not the decoding-only parts: the distributed merge and the merger's pairs (a
    prefill's split tiles have few pieces, where a second partial mostly repeats the first with
    weight 0), O from registers for tiles of few rows. Every warpgroup visits every block of
    the tile (sm90/fwd.py: the first zeroes a block's stale V rows ahead of the others)."""
    assert key.mask in catalog.KV_CACHE_MASKS and not key.kv_append, "long KV-cache tiles: the window kernel"
    cfg = replace(dense, skip_dead_blocks=False, split_tail=True, lse_bulk_store=False, pdl=True,
                  rebuild_schedule=key.head_dim_v >= 192 or dense.tile_m > 128,
                  epilogue_addresses_per_tile=key.head_dim_v <= 128, appends_from_new=True,
                  whole_block_boxes=True)
    cfg = replace(cfg, merge_helpers=merge_helpers_fit(cfg, key))
    return place_buffers(cfg, key.head_dim, key.head_dim_v)


def few_rows_fit(cfg: FwdConfig, key: VariantKey) -> bool:
    """FwdConfig.few_rows_from_registers: KV-cache variants (decoding and speculative
    verification tiles hold one to a few rows per packed head) up to head_dim_v 192, with O in
    its own buffer (a tile in V's buffer hands that buffer back through the staged epilogue's
    barriers). At head_dim_v 256 the fp16 images spilled 10 and 21 words with it (sass_report;
    none without it)."""
    return key.kv_cache and not cfg.o_in_v and key.head_dim_v <= 192


def merge_helpers_fit(cfg: FwdConfig, key: VariantKey) -> bool:
    """FwdConfig.merge_helpers: split tails up to head_dim_v 128. Measured (H200, bf16 hd128
    KV-cache decoding, 32/8 heads, one token, CUDA-graph us per call, two rounds, serial fold ->
    helpers): 1x4k 17.0-18.5 -> 14.0-15.1, 1x32k 50.2-50.9 -> 43.4-44.2, 1x128k 136.3-138.5 ->
    128.8-131.9; the merger's fold (fa4.trace) 5.1 -> 2.6 us at 1x4k, 9.8 -> 3.7-4.3 us at 1x32k.
    Above head_dim_v 128 the shuffle tree spilled one word (hd192x192's KV-cache tiles without a
    mask, hd256's causal ones with softcap: read off their SASS), so they keep the serial fold."""
    return cfg.split_tail and key.head_dim_v <= 128


def merge_pairs_fit(cfg: FwdConfig, key: VariantKey) -> bool:
    """FwdConfig.merge_pairs: KV-cache split tails (decoding tiles have up to 15 writers each; the
    dense forward's split tiles have a few, where the second load would mostly repeat the first
    with weight 0) whose consumers have room for a second partial's row beside O. Measured
    (H200, bf16 hd128 KV-cache decoding, 32/8 heads, one token, CUDA-graph us per call, two
    rounds, one partial per step -> two): 1x4k 14.2-15.1 -> 14.3-14.7, 1x32k
    43.4-43.5 -> 42.5-42.7, 1x128k 128.8-129.6 -> 128.8; the merger's fold (fa4.trace) 2.62 ->
    2.47 us at 1x4k, 3.72 -> 3.33 us at 1x32k. Not above head_dim_v 128 (O is 96-128 registers)
    nor on 192-row tiles (160-register consumers: hd128's softcap ones spilled 14 words)."""
    return key.kv_cache and merge_helpers_fit(cfg, key) and cfg.tile_m <= 128


def fwd_config(key: VariantKey) -> FwdConfig:
    # tile_m is 128: two consumer warpgroups of 64 rows (the WGMMA M size) each. tile_n sets the
    # S accumulator (tile_n / 2 fp32 registers per thread) next to the O accumulator
    # (head_dim_v / 2): both must fit the 240-register consumer budget with the softmax state,
    # and two K/V stages must fit shared memory. Values follow FlashAttention-3's
    # tile_size_fwd_sm90 for its register-P, intra-warpgroup-overlap configurations.
    assert key.kernel == "fwd", "fwd_config configures the forward kernel"
    assert key.tiles == "regular" or not key.varlen, "tile families are dense"
    if key.kv_cache:
        return kv_cache_fwd_config(key)
    assert key.tiles != "long" or key.mask != "local", "long-sequence tiles: no mask or causal"
    assert key.tiles != "short" or key.mask != "local", "short-sequence tiles: no mask or causal"
    if key.mask == "sparse":
        return sparse_fwd_config(key)
    if key.tiles == "short":
        assert key.head_dim == 64, "short-sequence tiles are tuned for hd64"
        # Four consumer warpgroups (256-row tiles) at 112 registers each, so S gets 64 columns.
        # Where 192-row tiles leave a partial last tile (seqlen 1024 = 5 x 192 + 64: 11% of the
        # rows computed are padding) and tile boundaries weigh most, they pay; their K/V steps
        # are slower (smaller GEMMs, the same per-row softmax costs per 64 columns).
        # Measured (H200, bf16 16k tokens, two rounds, TFLOP/s, 192x128 -> 256x64): hd64 seqlen
        # 512 403-405 -> 438-442, 1k 467-471 -> 501-502, 2k 548-549 -> 536-538, 4k 571-572 ->
        # 557, 16k 562-563 -> 533-535. Causal: unchanged at 1k until warpgroups sat out the
        # diagonal blocks hiding their rows' keys (skip_dead_blocks: with 64-row warpgroups and
        # 64-key blocks, warpgroup w of 4 skips 3 - w blocks per tile, a 15% cut at 1k); then,
        # both with the skip, 192x128 -> 256x64: 512 270 -> 290-292, 1k 369 -> 389-391, 2k 474
        # -> 460-463, 4k 536 -> 511-513. Skipping the O rescale, which is now
        # once per 32 exponentials per thread, is worth 3% here (it is not with 128 columns);
        # the P @ V wait after the row max ("row_max") 1% over "first_exps", "softmax" -1%;
        # 3 or 4 K/V stages the same.
        cfg = FwdConfig(tile_m=256, tile_n=64, num_stages=4, pv_wait="row_max",
                        rescale_threshold=RESCALE_THRESHOLD, split_tail=key.mask == "none",
                        skip_dead_blocks=key.mask != "none", early_q_release=True,
                        lse_bulk_store=key.mask != "none")
        cfg = replace(cfg, speculative_max=speculative_max_pays(key))
        cfg = replace(cfg, merge_helpers=merge_helpers_fit(cfg, key))
        return place_buffers(cfg, key.head_dim, key.head_dim_v)
    if key.tiles == "long":
        # hd128 on three consumer warpgroups (192-row tiles, as hd64; 160 registers each, so
        # tile_n <= 80: 96 spills). Measured (H200, bf16 16k tokens, two rounds, TFLOP/s,
        # 128x128 -> 192x80): non-causal 1k 661-662 -> 615-616, 4k 763 -> 752, 8k 772-773 ->
        # 777-781, 16k 706-724 -> 743-747; causal within +-1% from 4k on, 1k -6%. Both guessing
        # the row max (speculative_max; here it needs rebuild_schedule), same runs: 1k 662 ->
        # 616-617, 2k 734-735 -> 744-745, 4k 778-779 -> 794-795, 8k 793 -> 836-837; the long
        # tiles without -> with the guess: 8k 761-780 -> 834-836, 16k 718-720 -> 785-793.
        # The mask-dependent options below apply as to any 192-row kernel.
        assert key.head_dim == 128, "long-sequence tiles are tuned for hd128"
        cfg = FwdConfig(tile_m=192, tile_n=80, num_stages=2)
    elif key.head_dim <= 64:
        # Three consumer warpgroups (192-row tiles, FlashAttention-3's hd64 shape): hd64's GEMMs
        # are short next to its softmax, and a third warpgroup keeps the tensor cores fed.
        # Pinning the P @ V wait pays off; with softcap it spills some of the 160-register
        # consumers (the predicate keeps early probabilities live).
        cfg = FwdConfig(tile_m=192, tile_n=128, num_stages=2,
                        pv_wait="row_max" if key.softcap else "first_exps")
    elif key.head_dim <= 128:
        # FlashAttention-3 takes tile_n 176 for hd128 without a mask. Here, with O staged in V's
        # buffer as it needs (H100, bf16 16k tokens, two rounds, TFLOP/s at 1k/4k/16k): 128
        # gives 637-643/733-746/730-743, 160 579-583/719/728-734, 176 600-604/705/719-724,
        # 192 581-582/729/750-757. All but 128 leave a partial last block at power-of-two
        # sequence lengths; 192's longer blocks pay that back only at 16k (+2%).
        cfg = FwdConfig(tile_m=128, tile_n=128, num_stages=2)
    elif key.head_dim <= 192:
        # O takes 64 (dv 128) or 96 (dv 192) registers; 112 columns of S keep dv 192 in budget.
        cfg = FwdConfig(tile_m=128, tile_n=128 if key.head_dim_v <= 128 else 112, num_stages=2,
                        pv_wait="softmax" if key.head_dim_v > 128 else "first_exps")
    elif key.head_dim <= 256:
        # O alone is 128 registers per thread and two K/V stages fill shared memory (O then
        # lives in V's buffer). tile_n 64 (FlashAttention-3 takes 80) leaves no partial last
        # block at power-of-two lengths (1024 = 12.8 x 80); its shorter steps cost nothing
        # measurable. H200, bf16 16k tokens, two rounds, TFLOP/s, 80 -> 64: causal 1k 524-527
        # -> 539, 2k 653-654 -> 664, 4k 741-742 -> 749-750, 16k the same; no mask 1k 698-702 ->
        # 697, 2k 772 -> 771-775, 4k 806-807 -> 811-813, 16k 814-819 -> 817-821.
        # (With the guessed row max, below, the wait goes after the first exponentials.)
        cfg = FwdConfig(tile_m=128, tile_n=64, num_stages=2, pv_wait="softmax")
    else:
        raise ValueError(f"head_dim {key.head_dim} > 256 is not supported on sm90")
    if speculative_max_pays(key):
        # The guessed row max needs the threshold (it is what keeps a max); with it, the P @ V
        # wait goes after the first exponentials for every head dim: "softmax" kept all of a
        # block's probabilities live beside its scores and spilled hd192/hd256.
        cfg = replace(cfg, rescale_threshold=RESCALE_THRESHOLD, speculative_max=True,
                      pv_wait="first_exps" if cfg.pv_wait == "softmax" else cfg.pv_wait)
    elif key.head_dim_v > 64:  # O is 48+ registers per thread: skipping its rescale pays (above)
        cfg = replace(cfg, rescale_threshold=RESCALE_THRESHOLD)
    dynamic = key.mask != "none" or key.varlen
    cfg = replace(cfg, split_tail=not dynamic,
                  skip_dead_blocks=key.mask != "none" and (cfg.tile_m > 128 or key.head_dim_v > 128),
                  lse_bulk_store=key.mask != "none", epilogue_addresses_per_tile=dynamic and key.head_dim_v <= 128)
    if key.tiles == "long":
        # Its guessing consumers hold nothing of the static schedule across the K/V loop.
        cfg = replace(cfg, rebuild_schedule=cfg.speculative_max and cfg.split_tail)
    cfg = replace(cfg, merge_helpers=merge_helpers_fit(cfg, key), merge_pairs=merge_pairs_fit(cfg, key))
    cfg = place_buffers(cfg, key.head_dim, key.head_dim_v)
    assert cfg.pv_wait in PV_WAITS
    return cfg


@dataclass(frozen=True)
class BwdConfig:
    """The backward kernel's shape (sm90/bwd.py): tile_n keys per CTA, query blocks of tile_m
    rows, num_stages-deep Q/dO rings, how the two consumer warpgroups share the work
    (``layout``: bwd.LAYOUTS) and the dQ GEMM (``dq_split``: bwd.DQ_SPLITS), and how dQ reaches
    its fp32 accumulator (``dq_store``: bwd.DQ_STORES). FlashAttention-3's Hopper shapes
    (hopper/flash_bwd_launch_template.h): hd64 128 x 128 with dQ split by rows; hd96 and
    hd128 64 x 128; hd192 64 x 96 and hd256 64 x 80 with S, P and dS not transposed and dK/dV
    computed transposed (every GEMM's operands in shared memory; fa4's "keys_roles" keeps them
    in registers instead); hd128 without a mask 80 x 128 with dQ transposed (``dq_transposed``,
    which fa4 also uses for causal and window masks). Registers per consumer thread, hd128 at
    64 queries: dK and dV 64 each, S^T and dP^T 32 each, dQ 32 (of 240); at 80: 40 each."""
    tile_m: int
    tile_n: int
    num_stages: int
    dq_split: str
    layout: str = "keys"
    dq_store: str = "tma"
    # Relative-bias score_mods: the gradient's row address recomputed at each query block
    # (ptx.loop_bound_zero) rather than held across the loop. Measured per head dim: hd128 spilled
    # 3 registers without it, hd96 6 with it (score_mod.ScoreBias.accumulate_grad).
    grad_address_per_tile: bool = False
    # Relative-bias score_mods: floats of shared memory per consumer warp in which a tile's
    # diagonal sums meet before their L2 reductions (score_mod.ScoreBias.grad_window); 0 elsewhere.
    grad_window: int = 0
    # Score_mods whose entries are loaded ("keys" layout): read where they are added, in this many
    # waves (score_mod.ScoreBias.add), each after the one before has landed.
    bias_waves: int = 4
    # dQ staged for the writer with the lanes of odd accumulator rows exchanging pairs, so that
    # every 8-byte store is conflict-free (FlashAttentionBackwardSm90.stage_dq_pairs; "tma" dQ
    # only). Same call, H200, bf16 16k tokens, backward alone TFLOP/s, 1k / 4k / 16k, off -> on
    # (two alternations): hd128 492-494 / 595-598 / 578-580 -> 500 / 597-600 / 581-586, causal
    # 362-363 / 556 / 587 -> 366 / 562 / 590, deterministic 16k 551-552 -> 569-570; hd64
    # 427 / 513-520 / 512-515 -> 439 / 527-530 / 528-534, causal 307 / 475-476 / 517 -> 314 /
    # 486-489 / 535-536. Its 16 store addresses are held across the loop: off where that spills.
    dq_stage_exchange: bool = False
    # S^T = K @ Q^T with K's A operand in registers, loaded once per CTA by ldmatrix ("keys"), so
    # that the GEMM reads only Q from shared memory (the resource the backward is bound by, see
    # docs/perf_notes.md). At hd64 the fragment is 16 registers. Same call, H200, bf16 16k tokens,
    # backward alone TFLOP/s, two alternations, off -> on: hd64 without a mask 1k 444 -> 448, 4k
    # 536-539 -> 551-555, 16k 531-534 -> 542-543; causal, where it spilled one word, 1k 313-314 ->
    # 305-306, 4k 492 -> 474-477, 16k 540-542 -> 520. V's fragment beside it (dP^T) spilled 18
    # words at hd64; hd128's 32-register fragment made ptxas serialise every WGMMA (C7512).
    k_in_registers: bool = False
    # CTAs per cluster along the K/V blocks: the "long" family's two CTAs take adjacent K/V blocks
    # of one (batch, head) and share each Q/dO tile (and its LSE/dPsum) by TMA multicast, halving
    # the Q/dO reads into shared memory per key. Pays where a CTA's 64 keys read each Q/dO tile
    # twice as often per key as hd128's 128 (hd256), on long causal sequences: H200, bf16 16k
    # tokens, fwd+bwd TFLOP/s, same call, 1 CTA -> 2: causal 4k 484 -> 463, 8k 514 -> 519, 16k
    # 531 -> 549, 32k 520 -> 537 (the pair walks in step, without the causal launch groups: short
    # sequences lose); without a mask 0.99-1.00x from 4k on, so only the window kernel (causal)
    # has a twin; hd128 and hd64 lose or tie (session 38). Run where FA4_BWD_CLUSTERS=1 asks
    # (fa4_bwd_tile_family: off by default since an H100 lost 13% at causal 16k, session 52), with
    # the occupancy fallback to the 1-CTA twin (fa4_clusters_fit; docs/perf_notes.md, session 39).
    cluster_n: int = 1
    # dQ^T = K^T @ dS^T ("keys" layout, dQ by column halves): the queries are the dQ GEMM's N, so
    # tile_m need not be a multiple of 64. FlashAttention-3's hd128 blocks without a mask are 80
    # queries by 128 keys this way: 25% more work per block than 64 x 128 for 5% fewer
    # shared-memory bytes per FLOP (the backward's bound, docs/perf_notes.md).
    dq_transposed: bool = False

    def smem_bytes(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        """The kernel's SharedStorage (sm90/bwd.py), in its order: mbarriers and the statistics
        (128-byte aligned), then the 1024-byte aligned tiles, then the P buffer and the score_mod
        windows."""
        stats = 2 * self.num_stages * -(-self.tile_m // 32) * 32 * 4  # stages 128-byte aligned
        header = -(-(128 + stats) // 1024) * 1024
        q_do = self.num_stages * self.tile_m * (head_dim + head_dim_v) * elem_bytes
        kv = self.tile_n * (head_dim + head_dim_v) * elem_bytes
        # dS, one tile per stage; "keys_roles": one dS tile and one fp32 P^T tile.
        tile = self.tile_m * self.tile_n
        ds = (1 if self.layout == "keys_roles" else self.num_stages) * tile * elem_bytes
        p = tile * 4 if self.layout == "keys_roles" else 128
        # "stage" puts dQ in the finished Q/dO stages.
        dq = self.tile_m * head_dim * 4 if self.dq_store == "tma" else 0
        grad_windows = max(1, BWD_CONSUMER_WARPS * self.grad_window) * 4
        return header + q_do + kv + ds + dq + p + grad_windows


def bwd_config(key: VariantKey) -> BwdConfig:
    assert key.kernel == "bwd" and key.tiles in ("regular", "long")
    if key.tiles == "long":
        assert catalog.bwd_tile_family_built(key), key
        return replace(bwd_config(replace(key, tiles="regular")), cluster_n=2)
    if key.head_dim <= 64 and (key.softcap or key.score_mod == "relbias" or key.score_mod in catalog.TENSOR_SCORE_MODS):
        # With softcap the probabilities and dS come out of one pass after both GEMMs (tanh is
        # recomputed there): with 128-query blocks its 64 S^T and 64 dP^T registers beside the
        # LSE/dPsum of 32 columns spilled 2-29 registers; 64-query blocks (dQ by one warpgroup,
        # as 32-column halves do not fit K's 128-byte swizzle) do not spill. A relative-bias
        # table's reads and reductions (score_mod.py) spilled 40 with 128-query blocks, too.
        cfg = BwdConfig(tile_m=64, tile_n=128, num_stages=2, dq_split="single")
    elif key.head_dim <= 64:
        cfg = BwdConfig(tile_m=128, tile_n=128, num_stages=2, dq_split="rows")
    elif key.head_dim <= 96:
        # 48-column dQ halves do not fit K's 64-byte swizzle (32 columns): warpgroup 0 alone
        # computes dQ, the other one starts the next block's S^T meanwhile.
        cfg = BwdConfig(tile_m=64, tile_n=128, num_stages=2, dq_split="single")
    elif key.head_dim <= 128 and key.mask in ("none", "local") and not (key.varlen or key.softcap):
        # Dense batches: 80-query blocks, dQ transposed (BwdConfig.dq_transposed). Same call, H200,
        # bf16 16k tokens, backward alone TFLOP/s, 64 -> 80, two alternations: 1k 500-501 -> 516,
        # 4k 605-606 -> 622-632, 16k 589-594 -> 618; causal 366 -> 364-365, 556 -> 564-565,
        # 591-592 -> 611-615; deterministic fwd+bwd 4k 593 -> 605, 16k 636 -> 655; a 1024-key
        # window 481 -> 480. Packed sequences keep 64 (their statistics start on
        # STATS_BLOCK_ROWS rows), as does softcap (its tanh pass beside 40-register S^T and
        # dP^T tiles not tried).
        cfg = BwdConfig(tile_m=80, tile_n=128, num_stages=2, dq_split="cols", dq_transposed=True)
    elif key.head_dim <= 128:
        cfg = BwdConfig(tile_m=64, tile_n=128, num_stages=2, dq_split="cols")
    elif key.head_dim <= 256:
        # dK and dV of 64 keys: 192-256 registers per thread, so one warpgroup holds dV (with S^T
        # and P^T), the other dK (with dP^T and dS^T); dQ by halves (48-64 registers). Every GEMM
        # with an operand in registers or at N >= 64 (sm90/bwd.py). Before, S/dP at N = 32 per
        # warpgroup and dK^T/dV^T with both operands in shared memory ("queries", removed),
        # measured on one H100 (fa4.bench --backward, fwd+bwd TFLOP/s at 1k/4k/16k):
        # hd192 256/311/329 -> 357/471/502, causal 223/301/330 -> 274/439/492; hd192x128
        # 299/396/409 -> 314/410/439, causal 235/372/413 -> 242/384/431.
        cfg = BwdConfig(tile_m=64, tile_n=64, num_stages=2, dq_split="cols", layout="keys_roles")
        if cfg.smem_bytes(key.head_dim, key.head_dim_v) > SMEM_LIMIT_SM90:
            # hd256: no room for a 64 KB staging buffer. Each warpgroup's dQ half (64 x 128 fp32)
            # goes out through the Q or dO stage it is done with instead; global reductions from
            # registers, the alternative, ran at the L2's atomic rate (~1.7 TB/s of dQ):
            # 283/327/345 -> 353/473/493, causal 227/304/340 -> 277/442/501. Where both fit
            # (hd192x192), the staging buffer measured faster: 4k/16k 445/453 through the
            # stages, 471/502 through the buffer (a stage goes back to the producer later).
            cfg = replace(cfg, dq_store="stage")
    else:
        raise ValueError(f"no backward kernel for head_dim {key.head_dim}")
    if key.score_mod == "relbias" and key.head_dim == 128:
        cfg = replace(cfg, grad_address_per_tile=True)
    if key.score_mod == "relbias":
        # A warp's 16 keys against tile_m queries span 15 + tile_m distances (its S^T fragment),
        # padded to a multiple of 32. Measured (H100, bf16 hd128, 16 heads, 16k tokens causal,
        # backward kernel ms, one L2 reduction per diagonal and thread -> the windows): a +-256
        # table 5.90 -> 4.90 (4.49 without the table's gradient), +-16 4.88 -> 4.76, +-2048 8.50 ->
        # 6.90 (4.76); fwd+bwd at +-256 394 -> 522 TFLOP/s (fa4's causal kernel 617).
        cfg = replace(cfg, grad_window=-(-(15 + cfg.tile_m) // 32) * 32)
    if key.score_mod in catalog.TENSOR_SCORE_MODS and cfg.layout == "keys":
        # A bias tensor's entries in as few waves as fit: one wave spilled hd128 (78 words), two do
        # not; hd64 and hd96 take one (each wave waits for its loads to land).
        cfg = replace(cfg, bias_waves=1 if key.head_dim <= 96 else 2)
    # The exchanged dQ stores where they were measured (hd128's dQ by column halves, hd64's by
    # row halves; not dQ by one warpgroup, hd96 and hd64 with softcap, nor "keys_roles") and do
    # not spill (sass_report, LDL/STL words with them): hd128 with softcap (3-18) or a
    # relative-bias / bias-tensor score_mod (16-18), hd64's 128-query blocks with ALiBi (12) or a
    # varlen window (2).
    spills = (cfg.dq_split == "cols" and (key.softcap or key.score_mod == "relbias"
                                          or key.score_mod in catalog.TENSOR_SCORE_MODS)) or \
        (cfg.dq_split == "rows" and (key.score_mod == "alibi" or (key.mask == "local" and key.varlen)))
    cfg = replace(cfg, dq_stage_exchange=cfg.layout == "keys" and cfg.dq_split in ("cols", "rows") and not spills
                  and not cfg.dq_transposed)
    # K in registers where measured faster and spill-free: hd64's 128-query blocks without a mask,
    # dense (packed sequences spilled 19 words with it; softcap's 64-query blocks not measured).
    cfg = replace(cfg, k_in_registers=key.head_dim == 64 and cfg.dq_split == "rows" and key.mask == "none"
                  and not key.varlen)
    assert cfg.smem_bytes(key.head_dim, key.head_dim_v) <= SMEM_LIMIT_SM90
    # Packed sequences' statistics start on STATS_BLOCK_ROWS rows (sm90/bwd.py, stats_offset).
    assert STATS_BLOCK_ROWS % cfg.tile_m == 0 or not key.varlen
    # Block-sparse: the same shapes; the transposed bitmask holds 32 queries per word.
    assert key.mask != "sparse" or (cfg.tile_m % 32 == 0 and not key.varlen)
    return cfg


# The backward's row statistics (LSE, dPsum) are padded in blocks of this many rows, a multiple of
# every backward query block (packed sequences start on a block: sm90/bwd.py, stats_offset). The
# preprocess writes one such block per CTA. Generated into the native variant table too.
STATS_BLOCK_ROWS = 128


@dataclass(frozen=True)
class BwdPreConfig:
    """The backward preprocess's blocks: STATS_BLOCK_ROWS rows of one head per CTA."""
    tile_m: int = STATS_BLOCK_ROWS


def bwd_pre_config(key: VariantKey) -> BwdPreConfig:
    assert key.kernel == "bwd_pre"
    return BwdPreConfig()


@dataclass(frozen=True)
class BwdPostConfig:
    """The backward postprocess (dQ's conversion): a flat pass with no tiles (tile_m 0)."""
    tile_m: int = 0


def bwd_post_config(key: VariantKey) -> BwdPostConfig:
    assert key.kernel == "bwd_post"
    return BwdPostConfig()


def kernel_config(key: VariantKey):
    """The config of any variant, by its kernel kind."""
    return {"fwd": fwd_config, "bwd": bwd_config, "bwd_pre": bwd_pre_config,
            "bwd_post": bwd_post_config}[key.kernel](key)
