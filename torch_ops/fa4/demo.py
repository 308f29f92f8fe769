"""A short demonstration: ``python -m fa4.demo``.

On a Hopper GPU: checks fa4 against PyTorch SDPA on one causal GQA problem and times both.
Elsewhere: runs the CPU reference implementation on a small problem and checks it.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import fa4
from fa4.bench import attention_flops


def _sdpa(q, k, v, causal):
    hq, hk = q.shape[2], k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def main():
    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    b, s, hq, hk, d = (4, 4096, 16, 4, 128) if on_gpu else (2, 256, 4, 2, 64)
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype)
    k = torch.randn(b, s, hk, d, device=device, dtype=dtype)
    v = torch.randn(b, s, hk, d, device=device, dtype=dtype)
    out = fa4.attention(q, k, v, causal=True)
    ref = _sdpa(q, k, v, causal=True)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    where = torch.cuda.get_device_name() if on_gpu else "CPU (reference implementation)"
    print(f"fa4 {fa4.__version__} on {where}: causal GQA attention {tuple(q.shape)} -> {tuple(out.shape)}")
    print(f"relative difference to torch SDPA: {err:.2e}")
    if on_gpu:
        flops = attention_flops(b, hq, s, d, d, causal=True)
        for name, fn in (("fa4", lambda: fa4.attention(q, k, v, causal=True)), ("SDPA", lambda: _sdpa(q, k, v, True))):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / 20 * 1e3
            print(f"{name:5s}: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s")
    else:
        print("no Hopper GPU here: ran the CPU reference; `python -m fa4.bench` times the kernels on one.")


if __name__ == "__main__":
    main()
