"""Where fa4's host time per call goes (diagnostics for issue 24's host path): CPU time per call
of the layers between ``fa4.attention`` and the native operator, beside SDPA-cuDNN, then a
Python profile and a torch-profiler op table of forward + backward steps. ``--kvcache``: one
decoding token against a short KV cache instead (issue 26's eager rows), contiguous and paged,
with and without an appended token, through ``fa4.attention_with_kvcache`` and the operator.

    python3 scripts/host_breakdown.py [--head-dim 64] [--calls 300] [--causal]
    python3 scripts/host_breakdown.py --kvcache [--calls 300]
"""
import argparse
import cProfile
import pstats

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4
from fa4.bench_host import measure, per_call_us


def print_phases(fn, calls: int) -> None:
    """Per-phase host time of the native operators, from a diagnostics build of libfa4_ops.so
    (FA4_DIAG_HOST_TIMING=1: csrc_shims/fa4_ops.cpp, Phases); nothing otherwise."""
    import ctypes

    ops = ctypes.CDLL(str(fa4._native.OPS_PATH))
    if not hasattr(ops, "fa4_diag_host_phases"):
        return
    buf = ctypes.create_string_buffer(1 << 16)
    kernels = ctypes.CDLL(str(fa4._native.OPS_PATH.parent / "libfa4.so"))
    timed_launches = hasattr(kernels, "fa4_diag_launch_time")  # a diagnostics build of libfa4.so too
    n, us = ctypes.c_long(), ctypes.c_double()
    for _ in range(20):
        fn()
    ops.fa4_diag_host_phases(buf, len(buf))  # reset
    if timed_launches:
        kernels.fa4_diag_launch_time(ctypes.byref(n), ctypes.byref(us))
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    ops.fa4_diag_host_phases(buf, len(buf))
    print("native phases, us per call:")
    for line in buf.value.decode().splitlines():
        *name, count, total = line.split()
        print(f"  {' '.join(name):32s} {float(total) / int(count):8.2f}")
    if timed_launches:
        kernels.fa4_diag_launch_time(ctypes.byref(n), ctypes.byref(us))
        print(f"  kernel launches: {n.value / calls:.0f} per call, {us.value / max(n.value, 1):.2f} us each "
              f"in cudaLaunchKernelEx")


def kvcache(calls: int) -> None:
    """Host us per decoding call (bf16 hd128, 32 / 8 heads, 256 cached keys: the GPU keeps up),
    then the native phases of each (a diagnostics build)."""
    b, n, hq, hkv, d, page = 1, 256, 32, 8, 128, 64
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, new = make(b, 1, hq, d), make(b, 1, hkv, d)
    k, v = make(b, n + 64, hkv, d), make(b, n + 64, hkv, d)
    kp, vp = make(b * (n // page + 1), page, hkv, d), make(b * (n // page + 1), page, hkv, d)
    table = torch.arange(b * (n // page + 1), dtype=torch.int32, device="cuda").reshape(b, -1)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    index = torch.arange(b, dtype=torch.int32, device="cuda")
    op = torch.ops.fa4.fwd_kvcache.default
    scale = d ** -0.5
    fns = {
        "contiguous": lambda: fa4.attention_with_kvcache(q, k, v, lens),
        "contiguous + append": lambda: fa4.attention_with_kvcache(q, k, v, lens, k_new=new, v_new=new),
        "paged 64": lambda: fa4.attention_with_kvcache(q, kp, vp, lens, page_table=table),
        "paged 64 + append": lambda: fa4.attention_with_kvcache(q, kp, vp, lens, k_new=new, v_new=new,
                                                                page_table=table),
        "op, contiguous": lambda: op(q, k, v, lens, None, None, None, index, scale, True, -1, -1, 0.0, None, 0),
        "op, contiguous + append": lambda: op(q, k, v, lens, new, new, None, index, scale, True, -1, -1, 0.0, None,
                                              0),
        "op, paged 64": lambda: op(q, kp, vp, lens, None, None, table, None, scale, True, -1, -1, 0.0, None, 0),
    }
    us = measure({name: (fn, None) for name, fn in fns.items()}, calls)
    print(f"host us per decoding call (median of 5 rounds of {calls}), bf16 hd128, {hq}/{hkv} heads, {n} keys")
    for name, value in us.items():
        print(f"  {name:32s} {value:8.2f}")
    for name, fn in fns.items():
        print(f"{name}:")
        print_phases(fn, calls)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--kvcache", action="store_true")
    args = p.parse_args()
    if args.kvcache:
        return kvcache(args.calls)
    d, causal = args.head_dim, args.causal
    make = lambda grad=False: torch.randn(1, args.tokens, args.heads, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                          requires_grad=grad)
    q, k, v = make(), make(), make()
    qg, kg, vg = make(True), make(True), make(True)
    scale = d ** -0.5
    out, lse = torch.ops.fa4.fwd(q, k, v, scale, causal)
    dout = torch.randn_like(out)
    rows = {}
    rows["empty_like(q)"] = per_call_us(lambda: torch.empty_like(q), args.calls)
    rows["fa4.attention"] = per_call_us(lambda: fa4.attention(q, k, v, causal=causal), args.calls)
    rows["torch.ops.fa4.fwd"] = per_call_us(lambda: torch.ops.fa4.fwd(q, k, v, scale, causal), args.calls)

    def below_autograd():
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.fa4.fwd.default(q, k, v, scale, causal)
    rows["fwd.default below autograd"] = per_call_us(below_autograd, args.calls)
    rows["torch.ops.fa4.bwd"] = per_call_us(
        lambda: torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, causal), args.calls)
    step = lambda: torch.autograd.grad(fa4.attention(qg, kg, vg, causal=causal), (qg, kg, vg), dout)  # noqa: E731
    rows["fa4 step (autograd.grad)"] = per_call_us(step, args.calls)
    fwd_grad = lambda: fa4.attention(qg, kg, vg, causal=causal)  # noqa: E731
    rows["fa4 forward with grad"] = per_call_us(fwd_grad, args.calls)
    qt, kt, vt = (t.transpose(1, 2) for t in (qg, kg, vg))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        rows["SDPA cuDNN forward (no grad)"] = per_call_us(
            lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=causal), args.calls)
        rows["SDPA cuDNN forward with grad"] = per_call_us(
            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), args.calls)
        rows["SDPA cuDNN step"] = per_call_us(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), dout.transpose(1, 2)),
            args.calls)
    print(f"host us per call, hd{d}, {args.tokens} tokens, {args.heads} heads, causal={causal}")
    for name, us in rows.items():
        print(f"  {name:32s} {us:8.1f}")
    print_phases(lambda: (below_autograd(), torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, causal)),
                 args.calls)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        step()
    profile.disable()
    torch.cuda.synchronize()
    print("\nPython profile of 100 fa4 steps (tottime, s):")
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
