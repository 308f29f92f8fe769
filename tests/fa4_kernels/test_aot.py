"""The build driver's pure parts: cache keys, the generated C stubs and variant table."""
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from fa4_kernels import aot, catalog

KEY = catalog.VariantKey("sm_90a", "bf16", 128, 128, "causal", False)


def _fake_header(name):
    def struct(arg, n_shapes, n_strides):
        return textwrap.dedent(f"""
        typedef struct {{
            void *data;
            int32_t dynamic_shapes[{n_shapes}];
            int64_t dynamic_strides[{n_strides}];
        }} {name}_Tensor_{arg}_t;
        """)
    vectors = "".join(
        f"typedef struct {{\n    void *data;\n    int32_t dynamic_shapes[1];\n}} {name}_Tensor_{a}_t;\n"
        for a in ("mSemaphores", "mPartials", "mCuSeqlensQ", "mCuSeqlensK", "mSeqUsedK", "mSeqOrder")
    )
    tables = struct("mSparseCounts", 3, 3) + struct("mSparseBlocks", 4, 3) + (
        f"typedef struct {{\n    void *data;\n    int32_t dynamic_shapes[1];\n}} {name}_Tensor_mSparseBits_t;\n")
    score = struct("mScoreParams", 2, 1)
    kv_cache = struct("mPageTable", 2, 1) + struct("mKNew", 3, 3) + struct("mVNew", 3, 3)
    return ("".join(struct(a, 3, 3) for a in ("mQ", "mK", "mV", "mO")) + struct("mLSE", 3, 2) + vectors + tables
            + score + kv_cache)


def _generated_c(entries):
    """The table and every entry's stub, as one text."""
    return aot.generate_table([key for key, _ in entries]) + "".join(aot.generate_stub(k, h) for k, h in entries)


def test_variant_digest_changes_with_sources_and_dsl_version(monkeypatch):
    a = aot.variant_digest(KEY, "src1", "4.8.1")
    assert a == aot.variant_digest(KEY, "src1", "4.8.1")
    assert a != aot.variant_digest(KEY, "src2", "4.8.1")
    assert a != aot.variant_digest(KEY, "src1", "4.9.0")
    other = catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False)
    assert a != aot.variant_digest(other, "src1", "4.8.1")
    # Keys without the fields added later (trace, kv_append) hash as before them, so the objects
    # built before stay valid; the KV cache's append twin hashes apart from its twin.
    cache = catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False, kv_cache=True)
    digest = aot.variant_digest(cache, "s", "v")
    appending = replace(cache, kv_append=True)
    assert aot.variant_digest(appending, "s", "v") != digest
    as_dict = catalog.VariantKey.as_dict
    monkeypatch.setattr(catalog.VariantKey, "as_dict",
                        lambda key: {k: v for k, v in as_dict(key).items() if k not in ("trace", "kv_append")})
    assert aot.variant_digest(cache, "s", "v") == digest


def test_build_overrides_reach_the_config_and_the_cache_key(monkeypatch):
    """FA4_EXP2_FMA replaces the heuristics' value in the forwards (and so their cache keys), and
    nowhere else."""
    bwd = catalog.VariantKey("sm_90a", "bf16", 128, 128, "local", False, kernel="bwd")
    default = {k: (aot.build_config(k), aot.variant_digest(k, "s", "v")) for k in (KEY, bwd)}
    assert default[KEY][0].exp2_fma == 0
    monkeypatch.setenv("FA4_EXP2_FMA", "2")
    assert aot.build_config(KEY).exp2_fma == 2 and aot.variant_digest(KEY, "s", "v") != default[KEY][1]
    assert aot.variant_digest(bwd, "s", "v") == default[bwd][1]
    monkeypatch.setenv("FA4_EXP2_FMA", "9")
    with pytest.raises(ValueError, match="FA4_EXP2_FMA"):
        aot.build_config(KEY)


def test_generated_table_fills_every_dynamic_field(tmp_path: Path):
    header = tmp_path / f"{KEY.name}.h"
    header.write_text(_fake_header(KEY.name))
    c = _generated_c([(KEY, header)])
    # forward kind, sm_90, its call key (bf16, 128 x 128, causal, no softcap, regular tiles, not
    # varlen, no KV cache, not traced), tile_m 128, tile_n 128, no split tail (causal), fwd launcher only
    assert (f'{{"{KEY.name}", FA4_KERNEL_FWD, 9, 0, FA4_DTYPE_BF16, 128, 128, FA4_MASK_CAUSAL, 0, '
            'FA4_SCORE_NONE, FA4_TILES_REGULAR, 0, FA4_KV_CACHE_NONE, 0, 128, 128, 0,') in c
    assert f"{KEY.name}_fwd, NULL, NULL, NULL}}" in c
    for src in ("q", "k", "v", "o"):
        assert f"t_{src}.dynamic_strides[2] = {src}->stride[2];" in c
    assert "t_lse.dynamic_strides[1] = lse->stride[1];" in c
    assert "t_lse.dynamic_strides[2]" not in c
    assert "t_semaphores.dynamic_shapes[0] = (int32_t)semaphores->shape[0];" in c
    assert "&t_semaphores, &t_partials," in c and "params->tail_ctas, params->page_size" in c
    assert "t_cu_seqlens_q.dynamic_shapes[0] = (int32_t)cu_seqlens_q->shape[0];" in c
    assert "t_seqused_k.dynamic_strides" not in c
    assert "t_seq_order.dynamic_shapes[0] = (int32_t)seq_order->shape[0];" in c
    assert "&t_seqused_k, &t_seq_order," in c and "params->pack_gqa, params->tail_ctas, params->page_size" in c
    # The block-sparse tables (any fwd variant takes them; dense ones get placeholders).
    assert "t_sparse_blocks.dynamic_shapes[3] = (int32_t)sparse_blocks->shape[3];" in c
    assert "t_sparse_counts.dynamic_strides[2] = sparse_counts->stride[2];" in c
    assert "&t_seq_order, &t_sparse_counts," in c and "&t_sparse_bits, &t_score_params, &t_page_table" in c
    # A score_mod's parameters (any fwd variant takes them too).
    assert "t_score_params.dynamic_shapes[1] = (int32_t)score_params->shape[1];" in c
    assert "t_score_params.dynamic_strides[0] = score_params->stride[0];" in c
    # A KV cache's page table and appended rows (placeholders elsewhere), and their scalars.
    assert "t_page_table.dynamic_strides[0] = page_table->stride[0];" in c
    assert "&t_page_table, &t_k_new," in c
    assert "t_k_new.dynamic_strides[2] = k_new->stride[2];" in c
    assert "params->tail_ctas, params->page_size, params->seqlen_new, stream" in c
    assert "fa4_variant_count = 1;" in c
    assert "fa4_stats_block_rows = 128;" in c
    assert "fa4_seq_order_in_kernel = 128;" in c  # tile_scheduler.SEQ_ORDER_IN_KERNEL
    assert "fa4_kv_cache_mask = FA4_MASK_LOCAL;" in c  # catalog.KV_CACHE_MASKS, the native lookup's
    assert "fa4_kv_cache_twin_masks = (1 << FA4_MASK_NONE);" in c  # catalog.KV_CACHE_TWIN_MASKS
    assert "fa4_bwd_causal_mask = FA4_MASK_LOCAL;" in c  # catalog.BWD_MASKS
    assert "_Static_assert(FA4_Q_PIECE_ROWS == 8," in c  # block_info.Q_PIECE_ROWS, checked at the link


def test_generated_table_marks_the_kv_cache_kernels(tmp_path: Path):
    """A KV-cache forward and its append twin (catalog.VariantKey.kv_append): the kinds the native
    lookup tells apart (fa4_kv_cache_kind), on 64-row tiles that split their tail."""
    twin = catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False, kv_cache=True)
    entries = []
    for key in (twin, replace(twin, kv_append=True)):
        path = tmp_path / f"{key.name}.h"
        path.write_text(_fake_header(key.name))
        entries.append((key, path))
    c = _generated_c(entries)
    for key, kind in zip((twin, replace(twin, kv_append=True)), ("FA4_KV_CACHE_PLAIN", "FA4_KV_CACHE_APPEND")):
        assert (f'{{"{key.name}", FA4_KERNEL_FWD, 9, 0, FA4_DTYPE_BF16, 128, 128, FA4_MASK_NONE, 0, '
                f'FA4_SCORE_NONE, FA4_TILES_REGULAR, 0, {kind}, 0, 64, 128, 2,') in c


def test_generated_table_launches_the_backward_kernels(tmp_path: Path):
    def header(name, tensors):
        return "".join(f"typedef struct {{\n    void *data;\n    int32_t dynamic_shapes[3];\n"
                       f"    int64_t dynamic_strides[2];\n}} {name}_Tensor_{t}_t;\n" for t in tensors)
    main = catalog.VariantKey("sm_90a", "bf16", 128, 128, "local", True, True, kernel="bwd")
    pre = catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False, kernel="bwd_pre")
    post = catalog.VariantKey("sm_90a", "fp16", 0, 0, "none", False, kernel="bwd_post")
    entries = []
    for key in (main, pre):
        path = tmp_path / f"{key.name}.h"
        path.write_text(header(key.name, aot.TENSOR_ARGS[key.kernel]))
        entries.append((key, path))
    flat = "".join(f"typedef struct {{\n    void *data;\n    int32_t dynamic_shapes[1];\n}} {post.name}_Tensor_{t}_t;\n"
                   for t in aot.TENSOR_ARGS["bwd_post"])
    (tmp_path / f"{post.name}.h").write_text(flat)
    entries.append((post, tmp_path / f"{post.name}.h"))
    c = _generated_c(entries)
    # The main kernel: hd128's 64 x 128 blocks, varlen; its launcher takes the backward's arguments.
    assert (f'{{"{main.name}", FA4_KERNEL_BWD, 9, 0, FA4_DTYPE_BF16, 128, 128, FA4_MASK_LOCAL, 1, '
            'FA4_SCORE_NONE, FA4_TILES_REGULAR, 1, FA4_KV_CACHE_NONE, 0, 64, 128, 0,') in c
    assert f"NULL, {main.name}_bwd, NULL, NULL}}" in c
    assert "params->num_n_blocks," in c
    assert ("params->has_seqused_k, params->deterministic, params->rotate, params->store_first, "
            "params->launch_group, stream") in c
    assert "t_dq_accum.dynamic_strides[1]" in c and "&t_dq_semaphore, &t_seq_done, &t_sparse_counts" in c
    assert "&t_sparse_bits, &t_score_params, &t_score_grad," in c
    # The preprocess: statistics blocks of 128 rows, no K/V blocks; dense or packed is its
    # run-time argument.
    assert (f'{{"{pre.name}", FA4_KERNEL_BWD_PRE, 9, 0, FA4_DTYPE_BF16, 128, 128, FA4_MASK_NONE, 0, '
            'FA4_SCORE_NONE, FA4_TILES_REGULAR, 0, FA4_KV_CACHE_NONE, 0, 128, 0, 0,') in c
    assert f"NULL, NULL, {pre.name}_bwd_pre, NULL}}" in c
    # The postprocess: one per dtype (head dims 0), a flat range in and out.
    assert post.name == "fa4_bwd_post_sm_90a_fp16"
    assert (f'{{"{post.name}", FA4_KERNEL_BWD_POST, 9, 0, FA4_DTYPE_FP16, 0, 0, FA4_MASK_NONE, 0, '
            'FA4_SCORE_NONE, FA4_TILES_REGULAR, 0, FA4_KV_CACHE_NONE, 0, 0, 0, 0,') in c
    assert f"NULL, NULL, NULL, {post.name}_bwd_post}}" in c
    # It waits per sequence for the main kernel's counts (seq_done), so it takes them and the rows.
    assert "t_dq.dynamic_shapes[0] = (int32_t)dq->shape[0];" in c
    assert ("&t_dq_accum, &t_dq, &t_seq_done, &t_cu_seqlens_q, params->first_row, params->row_words, "
            "params->batch_rows, params->expected, params->varlen, stream") in c
    assert ("params->has_dlse, params->zero_rows, params->num_m_blocks, params->varlen, params->store_first, "
            "params->window_right, params->has_seqused_k, stream") in c
    assert "&t_dq_accum, &t_dk, &t_dv, &t_cu_seqlens_q, &t_cu_seqlens_k, &t_seqused_k, &t_seq_done," in c


def test_unexpected_header_is_rejected(tmp_path: Path):
    header = tmp_path / f"{KEY.name}.h"
    header.write_text(_fake_header(KEY.name).replace("mLSE", "mOther"))
    with pytest.raises(RuntimeError, match="unexpected tensor arguments"):
        aot.generate_stub(KEY, header)


def test_kernel_only_sources_list_every_kind_that_imports_them():
    """An object's cache key hashes the kernel-only files of its own kind: a kernel file that
    imports another kind's file (the preprocess takes stats_offset from sm90/bwd.py), or a shared
    module that imports a kind's file, must have that file list its kind too, or edits there would
    leave its objects stale."""
    import re

    every_kind = {kind for kinds in aot.KERNEL_ONLY_SOURCES.values() for kind in kinds}
    for path in sorted(aot.KERNEL_DIR.rglob("*.py")):
        rel = path.relative_to(aot.KERNEL_DIR).as_posix()
        kinds = aot.KERNEL_ONLY_SOURCES.get(rel, every_kind)
        if path.name in ("aot.py", "catalog.py", "heuristics.py"):
            continue
        text = path.read_text()
        for other, other_kinds in aot.KERNEL_ONLY_SOURCES.items():
            module = "fa4_kernels." + other.removesuffix(".py").replace("/", ".")
            if other != rel and re.search(rf"^from {re.escape(module)} import", text, re.M):
                assert set(kinds) <= set(other_kinds), (rel, other)


def test_compile_worker_reports_failures_and_keeps_serving(tmp_path: Path):
    """A worker answers a failed compile with the traceback and serves the next request; one
    that dies is reported with its output, never waited on forever."""
    worker = aot.CompileWorker("sm_90a")
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="compiling fa4_no_such_variant failed"):
                worker.compile("fa4_no_such_variant", tmp_path / "obj")
        worker.proc.kill()
        with pytest.raises(RuntimeError, match="the worker exited"):
            worker.compile("fa4_no_such_variant", tmp_path / "obj")
    finally:
        worker.proc.kill()
        worker.close()
    assert not (tmp_path / "obj").exists()
