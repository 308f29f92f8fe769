"""First light on the GPU: raw native forward vs fp64 reference, plus one timing vs cuDNN."""
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa4 import _native


def ref(q, k, v, causal):
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    hq, hk = qf.shape[1], kf.shape[1]
    kf = kf.repeat_interleave(hq // hk, dim=1)
    vf = vf.repeat_interleave(hq // hk, dim=1)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


def run(b, sq, sk, hq, hk, d, causal, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    o = torch.full((b, sq, hq, d), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    name = f"fa4_fwd_sm_90a_bf16_d{d}x{d}_{'causal' if causal else 'none'}"
    _native.fwd(name, q, k, v, o, lse, 1 / math.sqrt(d), 0.0, 0, 0, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ro, rlse = ref(q, k, v, causal)
    err = (o.double() - ro).norm() / ro.norm()
    lerr = (lse.double() - rlse).abs().nan_to_num(0.0).max().item()
    print(f"b={b} sq={sq} sk={sk} hq={hq} hk={hk} d={d} causal={causal}: rel_err={err:.2e} lse_maxerr={lerr:.2e} nan={o.isnan().any().item()}", flush=True)
    return err


def bench(seqlen, causal, d=128):
    b, h = 16384 // seqlen, 2048 // d
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    lse = torch.empty(b, h, seqlen, device="cuda", dtype=torch.float32)
    name = f"fa4_fwd_sm_90a_bf16_d{d}x{d}_{'causal' if causal else 'none'}"
    s = torch.cuda.current_stream().cuda_stream
    f_fa4 = lambda: _native.fwd(name, q, k, v, o, lse, 1 / math.sqrt(d), 0.0, 0, 0, s)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    def f_cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    flops = 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    res = {}
    for nm, f in (("fa4", f_fa4), ("cudnn", f_cudnn)):
        for _ in range(5):
            f()
        times = []
        for _ in range(30):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); f(); e1.record(); torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        times.sort()
        res[nm] = flops / (times[len(times) // 2] * 1e-3) / 1e12
    print(f"seqlen={seqlen} causal={causal}: fa4 {res['fa4']:.0f} cudnn {res['cudnn']:.0f} ratio {res['fa4']/res['cudnn']:.3f}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    for causal in (False, True):
        run(1, 128, 128, 2, 2, 128, causal)
        run(2, 1000, 1000, 4, 4, 128, causal)
        run(1, 17, 1000, 8, 2, 128, causal)
        run(2, 1000, 17, 4, 1, 128, causal)
    for causal in (False, True):
        for s in (1024, 4096, 16384):
            bench(s, causal)
