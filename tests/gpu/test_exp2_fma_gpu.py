"""Forward variants that compute part of the softmax's exponentials on the FMA pipe
(heuristics.FwdConfig.exp2_fma, src/fa4_kernels/exp2_fma.py) against the float64 reference.

The library's manifest says which variants do; the wheel's rules may build none (then these
tests skip), and an A/B build with FA4_EXP2_FMA=k has them all. The LSE is the sensitive part:
it is the log of a row's summed exponentials, so an emulation a few 1e-5 off would show in it
beyond the GEMM's fp32 rounding, where the bf16 output would hide it."""
import pytest
import torch

import fa4
from fa4 import _native
from fa4.testing import lse_error, naive_attention, rel_error

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]

# LSE error against float64 of the MUFU kernels on these shapes: 2-6e-6 (H100, the same inputs
# through an A/B build with FA4_EXP2_FMA=0); the emulation adds at most its 2.9e-6 relative error.
LSE_TOLERANCE = 2e-5


def emulating_variants():
    try:
        variants = _native.manifest()["variants"]
    except Exception:  # noqa: BLE001 - no native library: nothing to check
        return []
    return [v for v in variants if v.get("exp2_fma", 0) > 0 and v["kernel"] == "fwd" and v["mask"] in ("none", "causal")
            and not v["varlen"] and not v["kv_cache"] and v["dtype"] == "bf16"]


@pytest.mark.parametrize("variant", emulating_variants() or [None], ids=lambda v: v["name"] if v else "none-built")
@pytest.mark.parametrize("seqlen", [129, 1000])
def test_emulated_exponentials_match_float64(variant, seqlen, monkeypatch):
    if variant is None:
        pytest.skip("no forward variant of this build computes exponentials on the FMA pipe")
    monkeypatch.setenv("FA4_TILES", variant["tiles"])
    d, causal = variant["head_dim"], variant["mask"] == "causal"
    q, k, v = (torch.randn(2, seqlen, 4, d, device="cuda", dtype=torch.bfloat16) * 1.5 for _ in range(3))
    out, lse = fa4.attention(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal)
    exact_rounded = rel_error(ref_out.to(torch.bfloat16), ref_out)
    assert rel_error(out, ref_out) <= 2 * exact_rounded + 1e-4
    assert lse_error(lse, ref_lse) < LSE_TOLERANCE
