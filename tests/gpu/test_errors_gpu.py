"""Bad input raises the same exception, with the same message, on CUDA tensors (the native
operators' checks, csrc_shims/fa4_ops.cpp) as on CPU tensors (fa4.validation, which the CPU path
and the fake impls run). The rules live in both: the fake impls check symbolic shapes under
torch.compile(dynamic=True), which a C function would specialise to numbers. This grid keeps the
two in step."""
import pytest
import torch

import fa4

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]


def _t(device, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=device, dtype=dtype)


def _dense(q_shape=(1, 9, 4, 64), k_shape=(1, 11, 2, 64), v_shape=(1, 11, 2, 64), dtypes=None, **options):
    """A call of fa4.attention on ``device`` with the given shapes, dtypes and options."""
    dq, dk, dv = dtypes or (torch.bfloat16,) * 3

    def call(device):
        q, k, v = _t(device, *q_shape, dtype=dq), _t(device, *k_shape, dtype=dk), _t(device, *v_shape, dtype=dv)
        return fa4.attention(q, k, v, **options)
    return call


def _strided_k(device):
    q = _t(device, 1, 9, 4, 64)
    k = _t(device, 1, 11, 2, 128)[..., ::2]  # last dim not contiguous
    return fa4.attention(q, k, _t(device, 1, 11, 2, 64))


def _varlen(cu_q=(0, 4, 9), cu_k=(0, 5, 11), seqused=None, dtype=torch.int32, q_rank=3):
    def call(device):
        q = _t(device, 9, 4, 64) if q_rank == 3 else _t(device, 1, 9, 4, 64)
        k, v = _t(device, 11, 2, 64), _t(device, 11, 2, 64)
        used = None if seqused is None else torch.tensor(seqused, dtype=torch.int32, device=device)
        return fa4.attention_varlen(q, k, v, torch.tensor(cu_q, dtype=dtype, device=device),
                                    torch.tensor(cu_k, dtype=dtype, device=device), 5, 6, seqused_k=used)
    return call


CASES = {
    "q 3-D": _dense(q_shape=(1, 9, 64)),
    "dtypes differ": _dense(dtypes=(torch.bfloat16, torch.float16, torch.bfloat16)),
    "batch differs": _dense(k_shape=(2, 11, 2, 64), v_shape=(2, 11, 2, 64)),
    "seqlen_k differs": _dense(v_shape=(1, 12, 2, 64)),
    "kv heads differ": _dense(v_shape=(1, 11, 4, 64)),
    "head_dim differs": _dense(k_shape=(1, 11, 2, 96)),
    "heads not a multiple": _dense(q_shape=(1, 9, 3, 64)),
    "last dim strided": _strided_k,
    "scale not finite": _dense(scale=float("inf")),
    "softcap negative": _dense(softcap=-1.0),
    "window below -1": _dense(window=(-5, 0)),
    "pack_gqa group 3": _dense(q_shape=(1, 9, 6, 64), pack_gqa=True),
    "varlen q 4-D": _varlen(q_rank=4),
    "varlen offsets int64": _varlen(dtype=torch.int64),
    "varlen offsets differ in length": _varlen(cu_k=(0, 11)),
    "varlen seqused_k length": _varlen(seqused=(3,)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_and_cpu_reject_alike(case):
    call = CASES[case]
    with pytest.raises(Exception) as on_cpu:
        call("cpu")
    with pytest.raises(Exception) as on_cuda:
        call("cuda")
    assert type(on_cuda.value) is type(on_cpu.value), (on_cpu.value, on_cuda.value)
    assert type(on_cpu.value) in (ValueError, TypeError), on_cpu.value
    assert str(on_cuda.value) == str(on_cpu.value)
