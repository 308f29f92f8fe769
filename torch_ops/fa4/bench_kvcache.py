"""``python -m fa4.bench --kvcache``: decoding against a KV cache (fa4.attention_with_kvcache).

One query token, bf16, head_dim 128, 32 query heads on 8 K/V heads, batch x cache length as in
the serving issue. Reported as GB/s of K and V read (batch * length * heads_kv * (d + d_v) * 2
bytes per call), two ways: eager back-to-back calls (host time included: what a Python serving
loop gets) and CUDA-graph replays (GPU time). Beside fa4 (contiguous cache; paged with 16- and
64-row pages, the same memory seen through a shuffled page table; contiguous with one appended
token), torch SDPA (default backend, enable_gqa) and a device copy of the same bytes (read +
write over time), all in the same run.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

import fa4

SHAPES = ((1, 4096), (1, 32768), (1, 131072), (8, 32768), (64, 4096), (64, 32768))


def eager_ms(fn, iters: int, calls: int = 20) -> float:
    """Median over ``iters`` samples of the mean time per call of ``calls`` back-to-back calls,
    the host's time included (no GPU spin ahead of them)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_ms(fn, iters: int, calls: int = 20) -> float:
    """The same, replaying a CUDA graph of ``calls`` calls (GPU time only)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def providers(batch: int, length: int, dtype, heads_q=32, heads_kv=8, d=128):
    """name -> call, over one shared cache."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(batch, length, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, length, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=dtype, generator=gen)
    full = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    one_less = full - 1  # the appended token takes the last slot
    k_new = torch.randn(batch, 1, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v_new = torch.randn_like(k_new)
    calls = {
        "fa4": lambda: fa4.attention_with_kvcache(q, k, v, full),
        "fa4 +append": lambda: fa4.attention_with_kvcache(q, k, v, one_less, k_new=k_new, v_new=v_new),
    }
    for page in (16, 64):
        pages = batch * length // page
        table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).reshape(batch, -1)
        kp, vp = k.view(pages, page, heads_kv, d), v.view(pages, page, heads_kv, d)
        calls[f"fa4 page{page}"] = (lambda kp, vp, table: lambda: fa4.attention_with_kvcache(
            q, kp, vp, full, page_table=table))(kp, vp, table)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    calls["SDPA"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    flat = torch.empty(2 * k.numel(), device="cuda", dtype=dtype)
    source = torch.cat([k.flatten(), v.flatten()])
    calls["copy"] = lambda: flat.copy_(source)
    return calls, 2 * k.numel() * k.element_size()


def run(args, dtype) -> None:
    print("\nKV-cache decoding: bf16 hd128, 32 query / 8 K/V heads, 1 query token; GB/s of K+V read "
          "(copy: read + write), eager back-to-back | CUDA graph")
    for batch, length in SHAPES:
        calls, nbytes = providers(batch, length, dtype)
        cells = []
        for name, fn in calls.items():
            moved = 2 * nbytes if name == "copy" else nbytes
            try:
                eager = eager_ms(fn, args.iters)
                replay = graph_ms(fn, args.iters)
                cells.append(f"{name} {moved / (eager * 1e-3) / 1e9:5.0f} | {moved / (replay * 1e-3) / 1e9:5.0f}")
            except Exception as e:  # a peer may not run a shape; say so and go on
                cells.append(f"{name} failed: {type(e).__name__}: {str(e)[:80]}")
        print(f"{batch:3d} x {length // 1024:4d}k  " + "   ".join(cells), flush=True)
        del calls
        torch.cuda.empty_cache()
