"""``python -m fa4.bench --decode`` (or ``--kvcache``): attention against a KV cache
(fa4.attention_with_kvcache): decoding, speculative verification and chunked prefill.

One query token, bf16, head_dim 128, 32 query heads on 8 K/V heads, batch x cache length as in
the serving issue. Reported as GB/s of K and V read (batch * length * heads_kv * (d + d_v) * 2
bytes per call), three ways: eager back-to-back calls (host time included: what a Python serving
loop gets), CUDA-graph replays of back-to-back calls (GPU time), and "step": CUDA-graph replays
with a small unrelated kernel between the calls, whose own time is taken off. Each column is the
best of ``--rounds`` rounds over every provider, in a rotated order each round. In a serving step
attention sits between other kernels (projections, norms), so a kernel launched with
programmatic dependent launch cannot start its set-up under the previous attention call's end
there, as it can back to back. Beside fa4 (contiguous cache; paged with 16- and
64-row pages, the same memory seen through a shuffled page table; contiguous with one appended
token), torch SDPA (default backend, enable_gqa) and a device copy of the same bytes (read +
write over time; by cudaMemcpyAsync and by an SM kernel, which differ under graphs), all in the
same run.

GQA groups: one token over 64/8, 32/2 and 64/1 heads against SDPA. Speculative verification: 4
and 8 query tokens per sequence (causal, bottom-right: each sees the
cache and the drafts before it), the same GB/s and its ratio to the one-token call. Chunked
prefill: 2048 query tokens against a 32k cache, causal (bottom-right), TFLOP/s of the visible
pairs (contiguous, paged with 16-, 64- and 128-row pages, the chunk appended by the call, and on
the 64-row decoding tiles), beside cuDNN on the same shape (SDPA, the lower-right causal bias) and fa4's dense forward.
``--decode-parts`` picks some of these tables.
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4

SHAPES = ((1, 4096), (1, 32768), (1, 131072), (8, 32768), (64, 4096), (64, 32768))
DECODE_PARTS = ("decode", "speculative", "gqa", "prefill")  # the tables, in order (--decode-parts)


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


def captured(fn, calls: int = 20) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of fn (after one eager warm-up call), replayed
    once."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_ms(fn, iters: int, calls: int = 20) -> float:
    """The same, replaying a CUDA graph of ``calls`` calls (GPU time only)."""
    graph = captured(fn, calls)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def step_ms(fn, iters: int, calls: int = 20) -> float:
    """``graph_ms`` of the calls with a small elementwise kernel after each one, less that kernel's
    own graph time per call: the call's cost where other kernels run before and after it."""
    spacer = torch.zeros(1024, device="cuda")

    def bump():
        spacer.add_(1.0)

    def call_then_bump():
        fn()
        bump()
    return graph_ms(call_then_bump, iters, calls) - graph_ms(bump, iters, calls)


def rate(moved: float, fn, iters: int) -> tuple[float, float]:
    """(eager, graph) per second of ``moved`` (bytes or FLOPs) for one call of fn."""
    return moved / (eager_ms(fn, iters) * 1e-3), moved / (graph_ms(fn, iters) * 1e-3)


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
    # The same bytes by an elementwise kernel: captured in a CUDA graph, copy_'s cudaMemcpyAsync
    # becomes a memcpy node, and those ran at ~2.43 TB/s on an H100 where the eager calls copied
    # ~3.0 TB/s (session 52's table, every row of 0.5 GB and more; why is not known). The better
    # of the two copies is the baseline.
    calls["copy SM"] = lambda: torch.neg(source, out=flat)
    return calls, 2 * k.numel() * k.element_size()


def speculative(args, dtype, heads_q=32, heads_kv=8, d=128) -> None:
    """Verification of 4 and 8 draft tokens against the one-token call, contiguous and paged 64."""
    print("\nspeculative verification: GB/s of K+V read, eager | CUDA graph; (ratio to 1 token, graph)")
    for batch, length in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(batch, length, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn_like(k)
        full = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        pages = batch * length // 64
        table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).reshape(batch, -1)
        kp, vp = k.view(pages, 64, heads_kv, d), v.view(pages, 64, heads_kv, d)
        nbytes = 2 * k.numel() * k.element_size()
        cells, one = [], {}
        for tokens in (1, 4, 8):
            q = torch.randn(batch, tokens, heads_q, d, device="cuda", dtype=dtype, generator=gen)
            for name, fn in (("", lambda: fa4.attention_with_kvcache(q, k, v, full)),
                             (" page64", lambda: fa4.attention_with_kvcache(q, kp, vp, full, page_table=table))):
                eager, graph = rate(nbytes, fn, args.iters)
                one.setdefault(name, graph)
                cells.append(f"q{tokens}{name} {eager / 1e9:5.0f} | {graph / 1e9:5.0f} ({graph / one[name]:.2f})")
        print(f"{batch:3d} x {length // 1024:4d}k  " + "   ".join(cells), flush=True)


def gqa_groups(args, dtype, d=128) -> None:
    """One decoding token over other query heads per K/V head than the table's 4: 8 (64/8), 16
    (32/2, 128/8's ratio) and MQA (64/1), against SDPA, at 1 x 32k and 8 x 32k. The KV-cache
    tiles stack up to 64 heads (kv_cache.FEW_HEAD_ROWS), so each of these reads its K/V once."""
    print("\nGQA groups, one query token: GB/s of K+V read, eager | CUDA graph (fa4 / SDPA, graph)")
    for batch, length in ((1, 32768), (8, 32768)):
        cells = []
        for heads_q, heads_kv in ((64, 8), (32, 2), (64, 1)):
            gen = torch.Generator(device="cuda").manual_seed(0)
            k = torch.randn(batch, length, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn_like(k)
            q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=dtype, generator=gen)
            full = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            nbytes = 2 * k.numel() * k.element_size()
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            try:
                fa = rate(nbytes, lambda: fa4.attention_with_kvcache(q, k, v, full), args.iters)
                sdpa = rate(nbytes, lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), args.iters)
                cells.append(f"{heads_q}/{heads_kv} {fa[0] / 1e9:5.0f} | {fa[1] / 1e9:5.0f} against "
                             f"{sdpa[0] / 1e9:5.0f} | {sdpa[1] / 1e9:5.0f} ({fa[1] / sdpa[1]:.2f})")
            except Exception as e:  # say so and go on
                cells.append(f"{heads_q}/{heads_kv} failed: {type(e).__name__}: {str(e)[:80]}")
        print(f"{batch:3d} x {length // 1024:4d}k  " + "   ".join(cells), flush=True)
        torch.cuda.empty_cache()


def with_tiles(family: str, fn):
    """fn with FA4_TILES set to ``family`` for its calls (read per call by the native library)."""
    def call():
        before = os.environ.get("FA4_TILES")
        os.environ["FA4_TILES"] = family
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["FA4_TILES"]
            else:
                os.environ["FA4_TILES"] = before
    return call


def chunked_prefill(args, dtype, chunk=2048, length=32768, heads_q=32, heads_kv=8, d=128) -> None:
    """A 2048-token chunk against a 32k cache (the chunk's keys its last 2048 rows), causal:
    contiguous, paged (16-, 64- and 128-row pages), with the chunk's keys appended by the call (as a serving
    engine's prefill step does), and the contiguous call on the 64-row decoding tiles (FA4_TILES
    =regular) beside the automatic choice's taller ones."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, length, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(1, chunk, heads_q, d, device="cuda", dtype=dtype, generator=gen)
    full = torch.full((1,), length, dtype=torch.int32, device="cuda")
    before_chunk = full - chunk
    k_new, v_new = k[:, length - chunk:].clone(), v[:, length - chunk:].clone()
    def paged(page_size):
        """The cache seen through a shuffled page table of page_size-row pages."""
        pages = length // page_size
        table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).reshape(1, -1)
        kp, vp = k.view(pages, page_size, heads_kv, d), v.view(pages, page_size, heads_kv, d)
        return lambda: fa4.attention_with_kvcache(q, kp, vp, full, page_table=table)
    pairs = chunk * (length - chunk) + chunk * (chunk + 1) // 2
    flops = 4 * pairs * d * heads_q
    from torch.nn.attention.bias import causal_lower_right

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    bias = causal_lower_right(chunk, length)
    calls = {
        "fa4 kvcache": lambda: fa4.attention_with_kvcache(q, k, v, full),
        "fa4 kv 64-row": with_tiles("regular", lambda: fa4.attention_with_kvcache(q, k, v, full)),
        "fa4 kv page16": paged(16),
        "fa4 kv page64": paged(64),
        "fa4 kv page128": paged(128),
        "fa4 kv +append": lambda: fa4.attention_with_kvcache(q, k, v, before_chunk, k_new=k_new, v_new=v_new),
        "fa4 dense": lambda: fa4.attention(q, k, v, causal=True),
    }
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, enable_gqa=True)
        calls[f"SDPA {name}"] = sdpa
    print(f"\nchunked prefill: {chunk} query tokens against a {length // 1024}k cache, causal (bottom-right), "
          "TFLOP/s eager | CUDA graph")
    results = {}
    for name, fn in calls.items():
        try:
            results[name] = rate(flops, fn, args.iters)
            print(f"  {name:14s} {results[name][0] / 1e12:6.1f} | {results[name][1] / 1e12:6.1f}", flush=True)
        except Exception as e:  # a backend may refuse the bias or GQA; say so
            print(f"  {name:14s} failed: {type(e).__name__}: {str(e)[:100]}")
    ratios = (("fa4 kvcache", "SDPA cuDNN"), ("fa4 kv page64", "SDPA cuDNN"), ("fa4 kvcache", "fa4 kv 64-row"),
              ("fa4 kv page16", "fa4 kvcache"), ("fa4 kv page64", "fa4 kvcache"), ("fa4 kv page128", "fa4 kvcache"),
              ("fa4 kv +append", "fa4 kvcache"))
    for name, peer in ratios:
        if name in results and peer in results:
            print(f"  {name} / {peer}: {results[name][1] / results[peer][1]:.3f} (graph)")


def run(args, dtype) -> None:
    parts = getattr(args, "decode_parts", DECODE_PARTS)
    if "decode" in parts:
        decoding(args, dtype)
    if "speculative" in parts:
        speculative(args, dtype)
    if "gqa" in parts:
        gqa_groups(args, dtype)
    if "prefill" in parts:
        chunked_prefill(args, dtype)


def decoding(args, dtype) -> None:
    print("\nKV-cache decoding: bf16 hd128, 32 query / 8 K/V heads, 1 query token; GB/s of K+V read "
          "(copy: read + write), eager back-to-back | CUDA graph | step (graph, a kernel between calls); "
          f"the best of {args.rounds} rounds, the providers in a rotated order each round")
    for batch, length in SHAPES:
        calls, nbytes = providers(batch, length, dtype)
        best = {name: [float("inf")] * 3 for name in calls}
        failed = {}
        names = list(calls)
        # Rounds over every provider, each round in another order, and each column's best round:
        # an eager call at 1 x 4k is host-bound (~20-40 us of host time against ~10 us on the
        # GPU), and the GPU machine's host speed drifted by up to half between rounds (session 56),
        # so providers timed one after another once compared host speeds, not host paths.
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in failed:
                    continue
                try:
                    times = (eager_ms(calls[name], args.iters), graph_ms(calls[name], args.iters),
                             step_ms(calls[name], args.iters))
                except Exception as e:  # a peer may not run a shape; say so and go on
                    failed[name] = f"{type(e).__name__}: {str(e)[:80]}"
                    continue
                best[name] = [min(b, t) for b, t in zip(best[name], times)]
        cells = []
        for name in names:
            if name in failed:
                cells.append(f"{name} failed: {failed[name]}")
                continue
            moved = 2 * nbytes if name.startswith("copy") else nbytes
            cells.append(f"{name} " + " | ".join(f"{moved / (t * 1e-3) / 1e9:5.0f}" for t in best[name]))
        if "fa4" not in failed and "SDPA" not in failed:
            cells.append("fa4 / SDPA " + " | ".join(f"{s / f:.2f}" for f, s in zip(best["fa4"], best["SDPA"])))
        print(f"{batch:3d} x {length // 1024:4d}k  " + "   ".join(cells), flush=True)
        del calls
        torch.cuda.empty_cache()
