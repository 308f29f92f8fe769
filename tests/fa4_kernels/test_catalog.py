import dataclasses

import pytest

from fa4_kernels import catalog, heuristics


def forward_variants():
    return [v for v in catalog.all_variants() if v.kernel == "fwd"]


def test_names_are_unique_and_symbol_safe():
    variants = catalog.all_variants()
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    assert all(n.replace("_", "").isalnum() for n in names)


def test_catalog_covers_the_foundation_matrix():
    have = {(v.dtype, v.head_dim, v.mask) for v in catalog.all_variants()}
    for dtype in ("bf16", "fp16"):
        for hd in (64, 128):
            for mask in ("none", "causal"):
                assert (dtype, hd, mask) in have


def test_filter_keeps_only_matching_variants():
    picked = catalog.select_variants(catalog.all_variants(), "bf16,d128x128_causal")
    assert picked and all("bf16" in v.name and "d128x128_causal" in v.name for v in picked)
    assert catalog.select_variants(catalog.all_variants(), "") == catalog.all_variants()
    # "|" separates alternatives, each a comma-separated conjunction.
    either = catalog.select_variants(catalog.all_variants(), "bwd_sm,d64x64|fwd,bf16,d96x96_none")
    assert either and all(("fa4_bwd_sm" in v.name and "d64x64" in v.name)
                          or ("fwd" in v.name and "bf16" in v.name and "d96x96_none" in v.name) for v in either)
    assert {v.kernel for v in either} == {"bwd", "fwd"}
    # A fragment ending in "$" ends the name: the variant itself, not its softcap or varlen twins.
    exact = catalog.select_variants(catalog.all_variants(), "bwd_sm_90a_bf16_d192x192_none$")
    assert [v.name for v in exact] == ["fa4_bwd_sm_90a_bf16_d192x192_none"]
    assert len(catalog.select_variants(catalog.all_variants(), "bwd_sm_90a_bf16_d192x192_none")) > 1


def test_backward_variants_cover_their_head_dims_and_fit_shared_memory():
    backward = [v for v in catalog.all_variants() if v.kernel == "bwd"]
    preprocess = [v for v in catalog.all_variants() if v.kernel == "bwd_pre"]
    assert {(v.head_dim, v.head_dim_v) for v in backward} == set(catalog.BWD_HEAD_DIMS)
    assert {v.score_mod for v in backward if v.mask != catalog.SPARSE_MASK} == {"none"}
    assert {(v.mask, v.softcap, v.varlen, v.dtype) for v in backward} == {
        (m, sc, vl, d) for m in catalog.BWD_MASKS for sc in (False, True) for vl in (False, True)
        for d in catalog.DTYPES
    } | {(catalog.SPARSE_MASK, sc, False, d) for sc in (False, True) for d in catalog.DTYPES}
    for key in backward:
        cfg = heuristics.bwd_config(key)
        assert cfg.smem_bytes(key.head_dim, key.head_dim_v) <= heuristics.SMEM_LIMIT_SM90, key.name
        # Packed sequences' statistics start on STATS_BLOCK_ROWS rows: their query blocks divide it.
        assert heuristics.STATS_BLOCK_ROWS % cfg.tile_m == 0 or not key.varlen, key.name
        assert (cfg.tile_m == 128) == (cfg.dq_split == "rows"), key.name
        # Query blocks that are not a multiple of the 64-row WGMMA take dQ transposed (queries as N).
        assert cfg.tile_m % 64 == 0 or (cfg.dq_transposed and cfg.tile_m % 16 == 0), key.name
        assert not cfg.dq_transposed or (cfg.layout == "keys" and cfg.dq_split == "cols"
                                          and not cfg.dq_stage_exchange), key.name
        # "keys": 64 keys per consumer warpgroup; "keys_roles": 64 keys shared by both, one
        # holding dV and the other dK, where dK and dV of 64 keys would not fit one warpgroup,
        # each computing half of dQ.
        if key.head_dim <= 128:
            assert cfg.layout == "keys" and cfg.tile_n == 128, key.name
        else:
            assert cfg.layout == "keys_roles" and (cfg.tile_m, cfg.tile_n) == (64, 64), key.name
            assert cfg.dq_split == "cols", key.name
        # dQ halves by columns start on K's swizzle atoms (16 columns at least: hd96's 48 not).
        if cfg.dq_split == "cols":
            assert key.head_dim in (128, 192, 256), key.name
        # dQ through the finished Q/dO stages only where a staging buffer does not fit.
        with_staging = dataclasses.replace(cfg, dq_store="tma").smem_bytes(key.head_dim, key.head_dim_v)
        assert (cfg.dq_store == "stage") == (with_staging > heuristics.SMEM_LIMIT_SM90), key.name
        # Each main kernel has the preprocess of its dtype and head dims (dense or packed is the
        # preprocess's run-time argument).
        assert dataclasses.replace(key, kernel="bwd_pre", mask="none", softcap=False, score_mod="none",
                                   varlen=False, tiles="regular") in preprocess
        # 2-CTA clusters: the "long" family only, each beside its 1-CTA twin (the fallback), with the
        # twin's shapes and the same launch (one CTA per SM).
        if key.tiles != "regular":
            assert cfg.cluster_n == 2 and catalog.bwd_tile_family_built(key), key.name
            twin = dataclasses.replace(key, tiles="regular")
            assert twin in backward and dataclasses.replace(cfg, cluster_n=1) == heuristics.bwd_config(twin)
        else:
            assert cfg.cluster_n == 1, key.name
    clustered = sorted(v.name for v in backward if v.tiles != "regular")
    assert clustered == sorted(f"fa4_bwd_sm_90a_{dtype}_d256x256_local_longseq" for dtype in catalog.DTYPES)
    assert all(heuristics.kernel_config(p).tile_m == heuristics.STATS_BLOCK_ROWS for p in preprocess)
    assert all((p.mask, p.softcap, p.varlen) == ("none", False, False) for p in preprocess)
    # One postprocess (dQ's flat conversion) per (arch, dtype), serving every head dim.
    postprocess = [v for v in catalog.all_variants() if v.kernel == "bwd_post"]
    assert sorted((v.arch, v.dtype) for v in postprocess) == sorted({(v.arch, v.dtype) for v in backward})
    assert all((v.head_dim, v.head_dim_v, v.varlen) == (0, 0, False) for v in postprocess)
    assert len({v.name for v in catalog.all_variants()}) == len(catalog.all_variants())
    # hd64 with softcap takes 64-query blocks (128 spilled); hd128 always does.
    key = catalog.VariantKey("sm_90a", "bf16", 64, 64, "local", True, kernel="bwd")
    assert heuristics.bwd_config(key).tile_m == 64
    assert heuristics.bwd_config(dataclasses.replace(key, softcap=False)).tile_m == 128
    assert heuristics.bwd_config(catalog.VariantKey("sm_90a", "bf16", 256, 256, "none", False, kernel="bwd")).dq_store \
        == "stage"
    # hd128: 80-query blocks with dQ transposed for dense batches without softcap, else 64.
    dense = catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False, kernel="bwd")
    for key, tile_m in [(dense, 80), (dataclasses.replace(dense, mask="local"), 80),
                        (dataclasses.replace(dense, varlen=True), 64), (dataclasses.replace(dense, softcap=True), 64),
                        (dataclasses.replace(dense, mask="sparse"), 64)]:
        cfg = heuristics.bwd_config(key)
        assert (cfg.tile_m, cfg.dq_transposed) == (tile_m, tile_m == 80), key.name
    with pytest.raises(ValueError, match="no backward kernel"):
        heuristics.bwd_config(catalog.VariantKey("sm_90a", "bf16", 320, 320, "none", False, kernel="bwd"))


def test_exchanged_dq_stores_only_where_measured_and_spill_free():
    """BwdConfig.dq_stage_exchange: "keys" kernels whose dQ goes out by halves (hd128 columns,
    hd64 rows) through the staging buffer, but not the variants that spilled with it."""
    def exchange(head_dim, mask="none", softcap=False, varlen=False, score_mod="none", dtype="bf16"):
        key = catalog.VariantKey("sm_90a", dtype, head_dim, head_dim, mask, softcap, varlen=varlen,
                                 score_mod=score_mod, kernel="bwd")
        return heuristics.bwd_config(key).dq_stage_exchange

    for dtype in catalog.DTYPES:
        assert exchange(128, varlen=True, dtype=dtype) and exchange(128, "local", varlen=True, dtype=dtype)
        assert exchange(64, dtype=dtype) and exchange(64, "local", dtype=dtype)
    assert exchange(128, catalog.SPARSE_MASK, score_mod="alibi") and exchange(64, catalog.SPARSE_MASK)
    # Spilled with it: hd128 with softcap or loaded biases, hd64 with ALiBi or a varlen window.
    assert not exchange(128, softcap=True) and not exchange(128, catalog.SPARSE_MASK, score_mod="relbias")
    assert not exchange(128, catalog.SPARSE_MASK, score_mod="bias")
    assert not exchange(64, catalog.SPARSE_MASK, score_mod="alibi") and not exchange(64, "local", varlen=True)
    # Not with dQ transposed (hd128's dense 80-query blocks: dQ^T's pairs are two rows apart).
    assert not exchange(128) and not exchange(128, "local")
    # Not measured: dQ by one warpgroup (hd96, hd64 with softcap) and the role layout.
    assert not exchange(96) and not exchange(64, softcap=True) and not exchange(192) and not exchange(256)
    for key in catalog.all_variants():
        if key.kernel == "bwd" and heuristics.bwd_config(key).dq_stage_exchange:
            cfg = heuristics.bwd_config(key)
            assert cfg.layout == "keys" and cfg.dq_store == "tma" and cfg.dq_split in ("cols", "rows"), key.name


def test_k_in_registers_only_where_measured_and_spill_free():
    """BwdConfig.k_in_registers: hd64's dense unmasked 128-query blocks, in both dtypes; not
    causal or packed (they spilled with it), not hd128 (WGMMAs serialised), not softcap's blocks."""
    def k_regs(head_dim, mask="none", softcap=False, varlen=False, dtype="bf16"):
        key = catalog.VariantKey("sm_90a", dtype, head_dim, head_dim, mask, softcap, varlen=varlen, kernel="bwd")
        return heuristics.bwd_config(key).k_in_registers

    for dtype in catalog.DTYPES:
        assert k_regs(64, dtype=dtype)
    assert not k_regs(64, "local") and not k_regs(64, varlen=True) and not k_regs(64, softcap=True)
    assert not k_regs(64, catalog.SPARSE_MASK) and not any(k_regs(d) for d in (96, 128, 192, 256))
    on = [key.name for key in catalog.all_variants()
          if key.kernel == "bwd" and heuristics.bwd_config(key).k_in_registers]
    assert sorted(on) == sorted(f"fa4_bwd_sm_90a_{dtype}_d64x64_none" for dtype in catalog.DTYPES)


def test_compute_capability_from_arch():
    key = catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False)
    assert key.compute_capability == (9, 0)
    assert catalog.VariantKey("sm_100a", "bf16", 128, 128, "none", False).compute_capability == (10, 0)


def test_every_variant_has_a_config_that_fits_shared_memory():
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        # two consumer warpgroups of 64 rows; three for hd64 (short GEMMs next to the softmax) and
        # hd128's long-sequence tiles, four for hd64's short-sequence tiles; block-sparse tiles two;
        # KV-cache tiles one, their long ones (chunked prefill) the dense kernel's regular tiles
        regular = 192 if key.head_dim <= 64 and key.mask != "sparse" else 128
        if key.kv_cache:
            assert cfg.tile_m == (regular if key.tiles == "long" else 64), key.name
        else:
            assert cfg.tile_m == {"short": 256, "long": 192}.get(key.tiles, regular)
        assert cfg.tile_n % 16 == 0 and cfg.num_stages >= 2
        assert cfg.smem_bytes(key.head_dim, key.head_dim_v) <= heuristics.SMEM_LIMIT_SM90


def test_o_gets_its_own_buffer_where_it_fits_and_v_is_large_enough_otherwise():
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        own = dataclasses.replace(cfg, o_in_v=False)
        fits_own = own.smem_bytes(key.head_dim, key.head_dim_v) <= heuristics.SMEM_LIMIT_SM90
        assert cfg.o_in_v == (not fits_own), key.name
        if cfg.o_in_v:  # the O tile is staged in the V stages
            assert cfg.num_stages * cfg.tile_n >= cfg.tile_m, key.name
    # hd128 keeps its own O buffer (per-warpgroup epilogue); hd256 cannot.
    assert not heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False)).o_in_v
    assert heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 256, 256, "none", False)).o_in_v
    with pytest.raises(ValueError, match="fits shared memory"):
        heuristics.place_buffers(heuristics.FwdConfig(tile_m=128, tile_n=256, num_stages=2), 256, 256)
    with pytest.raises(ValueError, match="fits shared memory"):  # fits, but O outgrows the V stages
        heuristics.place_buffers(heuristics.FwdConfig(tile_m=192, tile_n=64, num_stages=2), 256, 256)


def test_block_sparse_tiles_map_flex_blocks_and_bitmask_words():
    """One sparse forward and backward per (dtype, head dims, softcap), dense batches: forward
    128-row tiles whose tile_n divides FlexAttention's 128-key blocks and is a whole number of
    32-bit words; backward the dense shapes, whose query blocks (the transposed bits' rows) are
    whole words too."""
    sparse = [v for v in forward_variants() if v.mask == catalog.SPARSE_MASK]
    # Per (dtype, head dims): softcap or not, and each in-kernel score_mod (without softcap).
    assert len(sparse) == len(catalog.DTYPES) * len(catalog.HEAD_DIMS) * (2 + len(catalog.SCORE_MODS))
    assert {(v.softcap, v.score_mod) for v in sparse} == {(False, "none"), (True, "none")} | {
        (False, s) for s in catalog.SCORE_MODS}
    for key in sparse:
        cfg = heuristics.fwd_config(key)
        assert not key.varlen and key.tiles == "regular"
        assert cfg.tile_m == 128 and cfg.tile_n % 32 == 0 and 128 % cfg.tile_n == 0, key.name
        assert not cfg.split_tail and not cfg.skip_dead_blocks and cfg.lse_bulk_store, key.name
        # ALiBi's per-column part by the tensor cores, and so the guessed row max as without a bias;
        # the other score_mods add per score and take the row max.
        assert cfg.alibi_by_mma == (key.score_mod == "alibi"), key.name
        if key.score_mod != "none":
            assert cfg.speculative_max == (key.score_mod == "alibi"), key.name
        assert cfg.smem_bytes(key.head_dim, key.head_dim_v) <= heuristics.SMEM_LIMIT_SM90, key.name
    assert {heuristics.fwd_config(k).tile_n for k in sparse if k.head_dim_v > 128} == {64}
    for key in (k for k in sparse if k.score_mod in catalog.TENSOR_SCORE_MODS):
        # A bias tensor's entries: loaded under the score GEMM at hd64/hd128 with 64-key blocks
        # (one register per score), elsewhere in waves where they are added, the plain tiles.
        cfg, plain = heuristics.fwd_config(key), heuristics.fwd_config(dataclasses.replace(key, score_mod="alibi"))
        if key.head_dim in (64, 128):
            assert cfg.tile_n == 64 and cfg.bias_waves == 0, key.name
        else:
            assert cfg.tile_n == plain.tile_n and cfg.bias_waves == 4, key.name
    assert all(heuristics.fwd_config(k).bias_waves == 0 for k in forward_variants()
               if k.score_mod not in catalog.TENSOR_SCORE_MODS)
    # A relative bias's one-entry tiles (score_mod._clamped_end) in the forward: every head dim but
    # 256 (which it spilled); no other kind.
    assert {(k.score_mod, k.head_dim) for k in forward_variants() if heuristics.fwd_config(k).bias_uniform_tiles} \
        == {("relbias", d) for d, _ in catalog.HEAD_DIMS if d < 256}
    sparse_bwd = [v for v in catalog.all_variants() if v.kernel == "bwd" and v.mask == catalog.SPARSE_MASK]
    assert len(sparse_bwd) == len(sparse)
    for key in sparse_bwd:
        cfg = heuristics.bwd_config(key)
        assert cfg.tile_m % 32 == 0 and not key.varlen, key.name
        # The shapes of packed sequences without a mask (hd128's dense batches take 80-query blocks;
        # the tables' transposed bits need whole 32-bit words of queries).
        dense = heuristics.bwd_config(dataclasses.replace(key, mask="none", score_mod="none", varlen=True))
        if (key.score_mod == "relbias" or key.score_mod in catalog.TENSOR_SCORE_MODS) and key.head_dim <= 64:
            # The table's or tensor's reads and reductions take hd64's softcap shape: 64-query blocks.
            dense = heuristics.bwd_config(dataclasses.replace(key, mask="none", score_mod="none", softcap=True,
                                                              varlen=True))
            assert cfg.tile_m == 64, key.name
        # The relative bias's gradient address per tile where it measured spill-free.
        assert cfg.grad_address_per_tile == (key.score_mod == "relbias" and key.head_dim == 128), key.name
        # A bias tensor's entries in the fewest waves that do not spill ("keys" layout).
        waves = {64: 1, 96: 1, 128: 2}.get(key.head_dim, 4) if key.score_mod in catalog.TENSOR_SCORE_MODS else 4
        assert cfg.bias_waves == waves, key.name
        # A relative bias's diagonal sums meet in a shared window per warp: its 16 keys' distances
        # to tile_m queries, padded to 32 floats, within the shared-memory budget.
        assert cfg.grad_window == ((15 + cfg.tile_m + 31) // 32 * 32 if key.score_mod == "relbias" else 0), key.name
        assert cfg.smem_bytes(key.head_dim, key.head_dim_v) <= heuristics.SMEM_LIMIT_SM90, key.name
        # The score_mods' own fields, the exchanged dQ stores that some of them spill with, and K in
        # registers (dense unmasked hd64 only: not measured with the tables).
        assert dataclasses.replace(cfg, grad_address_per_tile=False, bias_waves=4, grad_window=0,
                                   dq_stage_exchange=dense.dq_stage_exchange,
                                   k_in_registers=dense.k_in_registers) == dense, key.name


def test_dead_blocks_are_skipped_where_warpgroups_contend():
    # Masked tiles only; three or four consumer warpgroups (MUFU/tensor contention) or dv > 128
    # (long P @ V). hd96-hd192x128 on two warpgroups measured (hd128) a little slower with it.
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        expected = key.mask in ("causal", "local") and (cfg.tile_m > 128 or key.head_dim_v > 128)
        assert cfg.skip_dead_blocks == (expected and not key.kv_cache), key.name
    on = {(v.head_dim, v.head_dim_v) for v in forward_variants() if heuristics.fwd_config(v).skip_dead_blocks}
    assert on == {(64, 64), (128, 128), (192, 192), (256, 256)}  # hd128: its long causal tiles


def test_rescale_threshold_where_o_rescale_is_costly_or_the_max_is_guessed():
    # hd64's O is 32 registers per thread: skipping its rescale alone measured 0 to -2%; from
    # hd96 on it is 48-128 registers and the threshold pays (docs/perf_notes.md). The guessed
    # row max (speculative_max) needs it whatever the head dim.
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        # hd64's short-sequence tiles rescale O every 64 columns: there it pays (+3%)
        costly = key.head_dim > 64 or key.tiles == "short"
        expected = heuristics.RESCALE_THRESHOLD if costly or cfg.speculative_max else 0.0
        assert cfg.rescale_threshold == expected, key.name
    assert 0.0 < heuristics.RESCALE_THRESHOLD <= 16.0  # probabilities up to 2^threshold: bf16/fp16-safe


def test_speculative_max_everywhere_but_with_softcap_or_a_per_score_bias():
    # Measured +2-12% without softcap, 17-28% slower with it; with an in-kernel score_mod adding per
    # score it ran two exponentials per score (docs/perf_notes.md); ALiBi's bias comes from the
    # tensor cores (alibi_by_mma) and guesses.
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        assert cfg.speculative_max == (not key.softcap and key.score_mod in ("none", "alibi")), key.name
        if cfg.speculative_max:
            # the guess holds where a row keeps its max, which only the threshold makes the rule;
            # and the P @ V wait after all exponentials kept every probability live (spills)
            assert cfg.rescale_threshold > 0.0 and cfg.pv_wait != "softmax", key.name


def test_epilogue_addresses_per_tile_under_the_dynamic_schedule():
    # Measured +1-8% there (masked, varlen; hd64's masked 192-row kernels need it for the guessed
    # max), -1 to -4% on equal static tiles, the short ones and with O of hd256 (docs/perf_notes.md).
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        expected = (key.mask != "none" or key.varlen or key.kv_cache) and key.tiles != "short" and key.head_dim_v <= 128
        assert cfg.epilogue_addresses_per_tile == expected, key.name


def test_schedule_rebuilt_per_tile_only_where_the_registers_need_it():
    # hd128's long tiles spilled 2-3 of the static schedule's held values with the guessed row
    # max, and the KV-cache kernels of hd192x192 and hd256 up to 37 words; elsewhere the precomputed divisors
    # keep the consumers' tile boundary short.
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        expected = ((key.tiles == "long" and cfg.speculative_max and cfg.split_tail and not key.kv_cache)
                    or (key.kv_cache and key.head_dim_v >= 192))
        if key.kv_cache and key.tiles == "long":  # and hd64's 160-register consumers of three warpgroups
            expected = key.head_dim_v >= 192 or cfg.tile_m > 128
        assert cfg.rebuild_schedule == expected, key.name
        assert not cfg.rebuild_schedule or cfg.split_tail, key.name  # the static schedule only


def test_kv_cache_tiles_split_statically():
    # Decoding's and speculative verification's few tiles spread over the GPU: every KV-cache
    # variant (one per dtype, head dims and softcap: the window is a run-time argument; the
    # unmasked twins without softcap) runs the static schedule with the split tail, its LSE rows
    # stored as the unmasked kernels do.
    for key in forward_variants():
        if key.kv_cache:
            cfg = heuristics.fwd_config(key)
            assert key.mask in catalog.KV_CACHE_MASKS or (key.mask in catalog.KV_CACHE_TWIN_MASKS and not key.softcap)
            assert cfg.split_tail and not cfg.lse_bulk_store, key.name
    for mask in catalog.KV_CACHE_TWIN_MASKS:  # the twins have no softcap
        with pytest.raises(AssertionError, match="window at run time"):
            heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 128, 128, mask, True, kv_cache=True))


def test_split_merges_with_helpers_in_pairs_and_kv_cache_launches_programmatically():
    # A decoding tile's merger folds up to 15 writers' partials: with the warps' idle lanes up to
    # head_dim_v 128 (the shuffle tree spilled above it; heuristics.merge_helpers_fit), two per step
    # where a second row fits beside O too (the 64-row KV-cache tiles; heuristics.merge_pairs_fit).
    # Only the KV-cache forwards launch with programmatic dependent launch (FwdConfig.pdl).
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        assert cfg.merge_helpers == (cfg.split_tail and key.head_dim_v <= 128), key.name
        decoding = key.kv_cache and key.tiles == "regular"  # (chunked prefill's split tiles have few pieces)
        assert cfg.merge_pairs == (decoding and key.head_dim_v <= 128), key.name
        assert not cfg.merge_pairs or cfg.merge_helpers, key.name
        assert cfg.pdl == key.kv_cache, key.name


def test_kv_cache_tiles_store_few_rows_from_registers():
    # FwdConfig.few_rows_from_registers: the KV-cache forwards up to head_dim_v 192 (hd256's fp16
    # images spilled with it; none of them stages O in V's buffer, which goes back to the producer
    # through the staged epilogue), no other forward.
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        decoding = key.kv_cache and key.tiles == "regular"
        assert cfg.few_rows_from_registers == (decoding and key.head_dim_v <= 192), key.name
        assert not (cfg.few_rows_from_registers and cfg.o_in_v), key.name


def test_early_q_release_only_for_the_short_tiles():
    # Measured +1.2% at hd64 1k on the short tiles and -0.8% at hd128 4k (docs/perf_notes.md).
    for key in forward_variants():
        assert heuristics.fwd_config(key).early_q_release == (key.tiles == "short"), key.name


def test_lse_bulk_store_for_masked_variants_and_counted_in_shared_memory():
    # Measured +0.5-1.6% causal, 0 to -1% without a mask (docs/perf_notes.md); the KV cache's
    # tiles are split statically like unmasked ones (test_kv_cache_tiles_split_statically).
    for key in forward_variants():
        cfg = heuristics.fwd_config(key)
        masked = key.mask != "none" and not key.kv_cache
        assert cfg.lse_bulk_store == masked, key.name
        without = dataclasses.replace(cfg, lse_bulk_store=False)
        extra = cfg.smem_bytes(key.head_dim, key.head_dim_v) - without.smem_bytes(key.head_dim, key.head_dim_v)
        assert extra == (4 * cfg.tile_m if cfg.lse_bulk_store else 0), key.name


def test_tile_families_are_dense_variants_beside_a_regular_one():
    variants = catalog.all_variants()
    # (trace twins: test_trace_layout; the backward's clusters: test_backward_variants_cover_...)
    extra = [v for v in variants if v.tiles != "regular" and not v.trace and v.kernel == "fwd" and not v.kv_cache]
    want = {(t, d, sc, hd, mask) for t, dims in catalog.TILE_FAMILIES.items() for d in catalog.DTYPES
            for sc in (False, True) for hd, _ in dims for mask in catalog.TILE_FAMILY_MASKS[t]}
    assert {(v.tiles, v.dtype, v.softcap, v.head_dim, v.mask) for v in extra} == want
    assert {(v.tiles, v.mask) for v in extra} == {("short", "none"), ("short", "causal"), ("long", "none"),
                                                   ("long", "causal")}
    shapes = {"short": (64, 256, 64), "long": (128, 192, 80)}  # head_dim, tile_m, tile_n
    for key in extra:
        assert (key.head_dim_v, key.varlen) == (key.head_dim, False)
        assert key.name.endswith(f"_{key.tiles}seq")
        assert dataclasses.replace(key, tiles="regular") in variants
        cfg = heuristics.fwd_config(key)
        assert (key.head_dim, cfg.tile_m, cfg.tile_n) == shapes[key.tiles]
        # equal unmasked tiles split the static schedule's tail; causal ones skip dead blocks
        assert cfg.split_tail == (key.mask == "none") and cfg.skip_dead_blocks == (key.mask == "causal")
    with pytest.raises(AssertionError, match="dense"):
        heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 64, 64, "causal", False, True, tiles="short"))
    with pytest.raises(AssertionError, match="no mask or causal"):
        heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 64, 64, "local", False, tiles="short"))
    with pytest.raises(AssertionError, match="no mask or causal"):
        heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 128, 128, "local", False, tiles="long"))
    with pytest.raises(AssertionError, match="tuned for hd128"):
        heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 64, 64, "none", False, tiles="long"))


def test_kv_cache_variants_are_one_warpgroup_forwards_of_every_dense_kind():
    # One consumer warpgroup (64-row tiles): a decoding tile holds one row per packed head, and
    # 128-row tiles' padding made a block's GEMMs and exponentials as long as its load
    # (heuristics.kv_cache_fwd_config). Every head dim, dtype and softcap, one mask kind (the window,
    # taken at run time); forward only. (The long tiles: test_kv_cache_long_tiles_are_the_dense_ones.)
    kv = [v for v in catalog.all_variants() if v.kv_cache and not v.trace and v.tiles == "regular"]
    want = {(d, hd, hdv, mask, sc) for d in catalog.DTYPES for hd, hdv in catalog.HEAD_DIMS
            for mask in catalog.KV_CACHE_MASKS for sc in (False, True)}
    # ... and the unmasked twins of the calls whose rows see every key, without softcap.
    want |= {(d, hd, hdv, mask, False) for d in catalog.DTYPES for hd, hdv in catalog.HEAD_DIMS
             for mask in catalog.KV_CACHE_TWIN_MASKS}
    assert {(v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap) for v in kv} == want
    # Those twins have append twins (kv_cache.py: appended rows patched into the loaded stages),
    # configured as they are.
    appending = {v for v in kv if v.kv_append}
    assert appending == {dataclasses.replace(v, kv_append=True) for v in kv
                         if v.mask in catalog.KV_CACHE_TWIN_MASKS and not v.kv_append}
    for key in appending:
        assert key.name.endswith("_kvcache_append")
        assert heuristics.fwd_config(key) == heuristics.fwd_config(dataclasses.replace(key, kv_append=False))
    for key in kv:
        assert key.kernel == "fwd" and not key.varlen and key.tiles == "regular"
        assert key.name.endswith("_kvcache_append" if key.kv_append else "_kvcache")
        cfg = heuristics.fwd_config(key)
        dense = heuristics.fwd_config(dataclasses.replace(key, kv_cache=False, kv_append=False))
        assert (cfg.tile_m, cfg.tile_n, cfg.split_tail) == (64, dense.tile_n, True), key.name
        assert cfg.tile_n % 16 == 0  # whole 16-row page boxes (kv_cache.CHUNK_ROWS)


def test_kv_cache_long_tiles_are_the_dense_ones():
    # Chunked prefill (heuristics.kv_cache_long_config): the window kernel, every head dim, dtype and
    # softcap, in the dense kernel's tiles (two or three consumer warpgroups), statically scheduled
    # with the split tail; no warpgroup sits out blocks (the first zeroes stale V rows for all).
    variants = catalog.all_variants()
    long = [v for v in variants if v.kv_cache and v.tiles == "long" and not v.trace]
    want = {(d, hd, hdv, mask, sc) for d in catalog.DTYPES for hd, hdv in catalog.HEAD_DIMS
            for mask in catalog.KV_CACHE_TILE_FAMILIES["long"] for sc in (False, True)}
    assert {(v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap) for v in long} == want
    for key in long:
        assert key.name.endswith("_kvcache_longseq") and not key.kv_append
        assert dataclasses.replace(key, tiles="regular") in variants
        cfg = heuristics.fwd_config(key)
        dense = heuristics.fwd_config(dataclasses.replace(key, kv_cache=False, tiles="regular"))
        assert (cfg.tile_m, cfg.tile_n, cfg.pv_wait, cfg.speculative_max) == \
            (dense.tile_m, dense.tile_n, dense.pv_wait, dense.speculative_max), key.name
        assert cfg.tile_m > 64 and cfg.tile_n % 16 == 0, key.name
        assert cfg.split_tail and cfg.pdl and not (cfg.skip_dead_blocks or cfg.distributed_merge), key.name
        assert cfg.appends_from_new, key.name  # a chunk's appended rows loaded from k_new/v_new
        assert cfg.whole_block_boxes, key.name  # blocks inside one page in one box
    # ... and no other variant (decoding's few appended rows are stored before the loads, its
    # blocks come in page boxes).
    assert not any(heuristics.fwd_config(k).appends_from_new or heuristics.fwd_config(k).whole_block_boxes
                   for k in variants if k.kernel == "fwd" and k.tiles == "regular" and not k.trace)
    with pytest.raises(AssertionError, match="window kernel"):
        heuristics.fwd_config(catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False, kv_cache=True,
                                                 tiles="long"))
