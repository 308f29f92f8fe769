"""The build driver's pure parts: cache keys and the generated C variant table."""
import json
import textwrap
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
    return "".join(struct(a, 3, 3) for a in ("mQ", "mK", "mV", "mO")) + struct("mLSE", 3, 2) + vectors


def test_variant_digest_changes_with_sources_and_dsl_version():
    a = aot.variant_digest(KEY, "src1", "4.8.1")
    assert a == aot.variant_digest(KEY, "src1", "4.8.1")
    assert a != aot.variant_digest(KEY, "src2", "4.8.1")
    assert a != aot.variant_digest(KEY, "src1", "4.9.0")
    other = catalog.VariantKey("sm_90a", "bf16", 128, 128, "none", False)
    assert a != aot.variant_digest(other, "src1", "4.8.1")


def test_generated_table_fills_every_dynamic_field(tmp_path: Path):
    header = tmp_path / f"{KEY.name}.h"
    header.write_text(_fake_header(KEY.name))
    c = aot.generate_table([(KEY, header)])
    assert f'{{"{KEY.name}", 9, 0, 0, 128, 0,' in c  # not varlen, tile_m 128, no split tail (causal)
    for src in ("q", "k", "v", "o"):
        assert f"t_{src}.dynamic_strides[2] = {src}->stride[2];" in c
    assert "t_lse.dynamic_strides[1] = lse->stride[1];" in c
    assert "t_lse.dynamic_strides[2]" not in c
    assert "t_semaphores.dynamic_shapes[0] = (int32_t)semaphores->shape[0];" in c
    assert "&t_semaphores, &t_partials," in c and "p->tail_ctas, stream" in c
    assert "t_cu_seqlens_q.dynamic_shapes[0] = (int32_t)cu_seqlens_q->shape[0];" in c
    assert "t_seqused_k.dynamic_strides" not in c
    assert "t_seq_order.dynamic_shapes[0] = (int32_t)seq_order->shape[0];" in c
    assert "&t_seqused_k, &t_seq_order," in c and "p->pack_gqa, p->tail_ctas, stream" in c
    assert "fa4_variant_count = 1;" in c


def test_unexpected_header_is_rejected(tmp_path: Path):
    header = tmp_path / f"{KEY.name}.h"
    header.write_text(_fake_header(KEY.name).replace("mLSE", "mOther"))
    with pytest.raises(RuntimeError, match="unexpected tensor arguments"):
        aot.generate_table([(KEY, header)])
