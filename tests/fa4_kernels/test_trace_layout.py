"""Trace twins (catalog.VariantKey.trace) and the record layout the kernels, the native library and
``fa4.trace`` share (fa4_kernels/trace.py is its source; aot generates the native constants)."""
import dataclasses
import re

import pytest

from fa4_kernels import aot, catalog, heuristics


def test_trace_twins_are_forwards_beside_their_production_kernel():
    variants = catalog.all_variants()
    twins = [v for v in variants if v.trace]
    plain = set(variants) - set(twins)
    assert twins and all(v.name.endswith("_trace") and v.kernel == "fwd" for v in twins)
    for twin in twins:
        base = dataclasses.replace(twin, trace=False)
        assert base in plain and catalog.shipped_trace(base)
        assert heuristics.kernel_config(twin) == heuristics.kernel_config(base)  # the same kernel, recording
    # The shipped set: bf16 hd128 without a mask or causal, dense, packed and KV cache (its window
    # kernel, which takes every mask, and its unmasked twin), every tile family built for them.
    assert {(v.dtype, v.head_dim, v.mask, v.softcap, v.kv_cache) for v in twins} == {
        ("bf16", 128, m, False, kv) for m, kv in (("none", False), ("causal", False), ("local", True))} | {
        ("bf16", 128, m, False, True) for m in catalog.KV_CACHE_TWIN_MASKS}
    assert {(v.varlen, v.kv_cache, v.tiles) for v in twins} == {
        (False, False, "regular"), (True, False, "regular"), (False, True, "regular"), (False, False, "long"),
        (False, True, "long")}
    everything = catalog.all_variants(trace="all")
    # (the append twins excepted: traced calls run the twin they stand beside)
    assert {dataclasses.replace(v, trace=False) for v in everything if v.trace} == {
        v for v in plain if v.kernel == "fwd" and v.mask != catalog.SPARSE_MASK and not v.kv_append}
    with pytest.raises(AssertionError):
        catalog.all_variants(trace="some")


def test_trace_builds_keep_the_production_cache(monkeypatch):
    key = catalog.VariantKey("sm_90a", "bf16", 128, 128, "causal", False)
    twin = dataclasses.replace(key, trace=True)
    # A production key hashes without the field (caches from before trace twins stay valid); its
    # twin hashes apart.
    assert "trace" not in re.sub(r"\\s", "", str(aot.variant_digest(key, "s", "v")))
    assert aot.variant_digest(twin, "s", "v") != aot.variant_digest(key, "s", "v")
    monkeypatch.setenv("FA4_TRACE_VARIANTS", "all")
    assert aot.env_settings()["trace_variants"] == "all"
    monkeypatch.setenv("FA4_TRACE_VARIANTS", "most")
    with pytest.raises(ValueError, match="FA4_TRACE_VARIANTS='most'"):
        aot.env_settings()


def test_native_constants_follow_the_kernel_layout():
    pytest.importorskip("cutlass")
    from fa4_kernels import split_partials, trace

    c = "\n".join(aot.trace_layout_c())
    assert f'fa4_trace_fields = "{",".join(trace.FIELDS)}";' in c
    assert f"fa4_trace_record_words = {trace.RECORD_WORDS};" in c
    header = (trace.COUNTER_WORD, trace.BASE_WORD, trace.CAPACITY_WORD, trace.DEAL_WORD)
    assert f"fa4_trace_header[4] = {{{', '.join(map(str, header))}}};" in c
    # The header sits between the dynamic schedule's counter (word 0) and the split flags, and
    # below the 16 words the operator writes before the launch.
    assert len(set(header)) == 4 and 0 < min(header) and max(header) < min(16, split_partials.FLAGS_BASE)
    for name, bit in trace.FLAGS.items():
        assert f"{name}={bit}" in c and bit & (bit - 1) == 0
    assert set(trace.FIELD) == set(trace.FIELDS) and len(trace.FIELDS) == trace.RECORD_WORDS


def test_the_renderer_decodes_every_mark_the_kernels_write():
    pytest.importorskip("cutlass")
    import dataclasses as dc

    from fa4 import trace as fa4_trace
    from fa4_kernels import trace

    # Each time mark is a record field, and fa4.trace.Tile carries it (without the "_lo" suffix).
    assert set(trace.MARKS) <= set(trace.FIELDS)
    tile_fields = {f.name for f in dc.fields(fa4_trace.Tile)}
    assert {mark.removesuffix("_lo") for mark in trace.MARKS} <= tile_fields
    assert {"start", "end"} <= tile_fields
