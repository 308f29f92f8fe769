"""Bad input gets a clear Python exception naming the argument and the rule."""
import pytest
import torch

import fa4


def qkv(b=1, sq=8, sk=8, hq=2, hk=2, d=16, dv=16, dtype=torch.float32):
    return torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype), torch.randn(b, sk, hk, dv, dtype=dtype)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "not supported on cpu"),
        (lambda q, k, v: (q, k[:, :, :1], v), ValueError, "same number of heads"),
        (lambda q, k, v: (q, k[:, :4], v), ValueError, "same seqlen_k"),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, "batch sizes differ"),
        (lambda q, k, v: (q[..., :8], k, v), ValueError, "head_dim differ"),
        (lambda q, k, v: (torch.randn(1, 8, 3, 16), k, v), ValueError, r"multiple of heads of k/v"),
        (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), ValueError, "contiguous in its last dimension"),
        (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_inputs(mutate, error, match):
    q, k, v = mutate(*qkv())
    with pytest.raises(error, match=match):
        fa4.attention(q, k, v)


def test_bad_scalars():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale must be finite"):
        fa4.attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        fa4.attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="causal=True already fixes window_right"):
        fa4.attention(q, k, v, causal=True, window=(4, 4))


@pytest.mark.parametrize("shape", [(0, 8, 8), (1, 0, 8), (1, 8, 0)])
def test_empty_tensors(shape):
    b, sq, sk = shape
    q, k, v = qkv(b=b, sq=sq, sk=sk)
    out, lse = fa4.attention(q, k, v, return_lse=True)
    assert out.shape == (b, sq, 2, 16) and lse.shape == (b, 2, sq)
    if sk == 0 and b * sq:
        assert torch.all(out == 0) and torch.all(torch.isinf(lse))


def test_cuda_tensors_on_a_machine_without_cuda_fail_cleanly():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises((RuntimeError, AssertionError)):
        fa4.attention(*(t.cuda() for t in qkv()))


def test_pack_gqa_argument_is_checked():
    from fa4.validation import check_pack_gqa

    q, k = torch.randn(1, 5, 6, 64), torch.randn(1, 5, 2, 64)
    with pytest.raises(ValueError, match=r"pack_gqa=True needs heads_q / heads_kv in \(2, 4, 8, 16\)"):
        fa4.attention(q, k, k, pack_gqa=True)
    with pytest.raises(TypeError, match="pack_gqa must be None"):
        check_pack_gqa(2, 8, 2)
    q8 = torch.randn(1, 5, 8, 64)
    for pack in (None, True, False):  # CPU reference: same result, the option only steers the kernel
        torch.testing.assert_close(fa4.attention(q8, k, k, pack_gqa=pack), fa4.attention(q8, k, k))
