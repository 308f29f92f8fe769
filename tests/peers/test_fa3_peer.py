"""The FlashAttention-3 benchmark peer (peers/fa3, fa4.bench_fa3): its outputs against the float64
reference (fa4.testing.naive_attention), so a fa4/FA3 ratio is never taken against a broken
build. Needs a Hopper GPU and the library built by peers/fa3/build.sh
(build/peers/fa3/libfa3_peer.so); skips otherwise."""
from pathlib import Path

import pytest
import torch

from fa4 import bench_fa3
from fa4.testing import naive_attention
from tests.conftest import requires_hopper

LIB = Path(__file__).resolve().parents[2] / "build" / "peers" / "fa3" / "libfa3_peer.so"
needs_lib = pytest.mark.skipif(not LIB.exists(), reason="FA3 peer not built (peers/fa3/build.sh)")


CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, strided q)
    (2, 1024, 1024, 16, 16, False),
    (1, 1000, 1000, 8, 2, False),  # GQA, not a multiple of the tile
    (3, 128, 777, 4, 4, False),  # seqlen_q != seqlen_k
    (2, 513, 513, 6, 3, True),  # q a strided view
    (2, 1, 300, 4, 4, False),  # one query row
]


@requires_hopper
@needs_lib
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_fa3_peer_matches_reference(head_dim, causal, case):
    bench_fa3.load(str(LIB))
    b, sq, sk, h, hk, strided = case
    q = torch.randn(b, sq, h, 2 * head_dim if strided else head_dim, device="cuda", dtype=torch.bfloat16)
    q = q[..., :head_dim]
    k, v = (torch.randn(b, sk, hk, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = bench_fa3.fa3_forward(q, k, v, causal=causal)
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal)
    assert (out.double() - ref_out).abs().max().item() < 2e-2
    valid = torch.isfinite(ref_lse)
    assert (lse - ref_lse)[valid].abs().max().item() < 1e-2


@requires_hopper
@needs_lib
def test_fa3_peer_causal_repeats_exactly():
    """The causal kernel's tile counter must start from zero on every call."""
    bench_fa3.load(str(LIB))
    q = torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16)
    first, _ = bench_fa3.fa3_forward(q, q, q, causal=True)
    for _ in range(5):
        again, _ = bench_fa3.fa3_forward(q, q, q, causal=True)
        assert torch.equal(first, again)
