"""Benchmark: fa4 vs cuDNN and FA2 (through SDPA) and optionally FlexAttention, same run.

    python -m fa4.bench                       # FlashAttention-3 paper setup, head_dim 64 and 128
    python -m fa4.bench --head-dims 128 --seqlens 4096 16384 --flex
    python -m fa4.bench --head-dims 192x128      # head_dim 192 for q/k, 128 for v
    python -m fa4.bench --backward            # forward + backward steps and the backward alone
    python -m fa4.bench --host                # host (CPU) time per call against SDPA (bench_host)
    python -m fa4.bench --flex-docs 8         # documents and a window through FlexAttention's API
    python -m fa4.bench --flex-sparse         # a random block-sparse mask_mod (fa4's bitmask path)
    python -m fa4.bench --flex-score          # in-kernel score_mods (alibi, relative bias, bias tensor) + causal
    python -m fa4.bench --context-parallel    # ring attention over every visible GPU, fa4 vs cuDNN (bench_cp)
    python -m fa4.bench --sweep               # every run-time strategy per shape vs the automatic one (bench_sweep)
    python -m fa4.bench --backward --providers fa4,cuDNN,FA4up   # upstream FlashAttention-4 too (flash_attn.cute)

Setup: bf16, 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (heads = 2048 / head_dim),
causal and not. TFLOP/s = 2 * batch * heads * seqlen^2 * (head_dim + head_dim_v) / time, halved
when causal.
Median of CUDA-event-timed runs after warm-up; each provider runs on its own set of
inputs, rotated between runs so the 50-60 MB L2 does not serve repeats. Each case is timed in
--rounds rounds, the providers in a rotated order each round (inputs allocated once, before the
first), so what one provider leaves behind (clocks, allocator state) does not always land on
the same next one; a provider's number is the median of all its samples, and the per-case line
shows the spread of fa4's round medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4
from fa4 import bench_host
from fa4.bench_kvcache import DECODE_PARTS


DEFAULT_PROVIDERS = "fa4,cuDNN,FA2"


def time_ms(fn, warmup: int, iters: int, calls_per_sample: int = 5) -> float:
    """Median over ``iters`` samples of the mean time of ``calls_per_sample`` back-to-back calls."""
    return statistics.median(sample_ms(fn, warmup, iters, calls_per_sample))


def sample_ms(fn, warmup: int, iters: int, calls_per_sample: int = 5) -> list[float]:
    """``iters`` samples, each the mean time of ``calls_per_sample`` back-to-back calls.

    Calls are queued without synchronising in between, so the CPU runs ahead and a sample
    measures GPU time (as in real training loops), not Python launch overhead. The GPU first
    spins for ~2.5 ms so that the start event and every call are queued before any of them runs:
    otherwise the first call's host time (launch latency, 30-200 us depending on the provider
    and the machine) would be timed as GPU time. Host time per call is reported separately.
    """
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for it in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(5_000_000)
        start.record()
        for j in range(calls_per_sample):
            fn(it * calls_per_sample + j)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls_per_sample)
    return times


def time_providers(fns, make_inputs_for, flops: float, args, where: str) -> dict:
    """TFLOP/s of each provider on one case: ``args.rounds`` rounds of ``args.iters`` samples,
    the provider order rotated by one each round, every provider on its own inputs (allocated
    before the first round). Returns name -> (median over all samples, [median per round]);
    NaN for a provider that fails on the case."""
    inputs = {name: make_inputs_for() for name in fns}
    samples = {name: [] for name in fns}
    per_round = {name: [] for name in fns}
    order = list(fns)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:
            if samples[name] is None:
                continue
            fn, ins = fns[name], inputs[name]
            try:
                times = sample_ms(lambda i: fn(*ins[i % len(ins)]), args.warmup, args.iters, args.calls_per_sample)
            except Exception as e:  # a peer may not support a shape; say so and go on
                print(f"  {name} failed at {where}: {type(e).__name__}: {str(e)[:120]}")
                samples[name] = None
                continue
            samples[name] += times
            per_round[name].append(flops / (statistics.median(times) * 1e-3) / 1e12)
    return {name: (flops / (statistics.median(t) * 1e-3) / 1e12, per_round[name]) if t else (float("nan"), [])
            for name, t in samples.items()}


def round_spread(per_round: list[float]) -> str:
    """"  (fa4 rounds LO-HI)" for the per-case line; empty with fewer than two timed rounds (one
    round, or fa4 failing on the case)."""
    return f"  (fa4 rounds {min(per_round):.0f}-{max(per_round):.0f})" if len(per_round) > 1 else ""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def head_dim_pair(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "192x128" -> (192, 128): head_dim of q/k, head_dim of v."""
    dims = [int(d) for d in text.lower().split("x")]
    if len(dims) not in (1, 2) or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"head dim {text!r}: expected D or DxDV, e.g. 128 or 192x128")
    return dims[0], dims[-1]


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, head_dim_v: int, causal: bool) -> float:
    """FLOPs of one forward call as FlashAttention counts them: Q @ K^T and P @ V over the full
    square (2 * s^2 * d and 2 * s^2 * dv per head), halved for a causal mask."""
    return 2 * batch * heads * seqlen * seqlen * (head_dim + head_dim_v) / (2 if causal else 1)


def head_dim_label(head_dim: int, head_dim_v: int) -> str:
    return str(head_dim) if head_dim == head_dim_v else f"{head_dim}x{head_dim_v}"


def make_inputs(batch, seqlen, heads, head_dim, dtype, copies, layout, head_dim_v=None):
    """Tensors as every provider sees them, (B, H, S, D), stored either that way ("bhsd") or
    as (B, S, H, D) ("bshd", fa4's native layout) and transposed: no provider copies."""
    def one(dim):
        if layout == "bhsd":
            return torch.randn(batch, heads, seqlen, dim, device="cuda", dtype=dtype)
        return torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
    dims = (head_dim, head_dim, head_dim if head_dim_v is None else head_dim_v)
    return [tuple(one(d) for d in dims) for _ in range(copies)]


def upstream_fa4(causal: bool):
    """Upstream FlashAttention-4 (``flash_attn.cute``, CuTe DSL compiled at the first call of each
    configuration) as a (B, H, S, D) provider with autograd. Imported at its first call, so only
    runs that ask for it load the DSL (not a dependency of fa4: scripts/upstream_fa4_env.sh stages
    it on the GPU machine)."""
    def fn(q, k, v):
        from flash_attn.cute import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return fn


def providers(causal: bool, flex: bool, fa3: bool = False):
    def fa4_fn(q, k, v):
        return fa4.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)

    def sdpa(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fn

    out = {"fa4": fa4_fn, "cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION), "FA2": sdpa(SDPBackend.FLASH_ATTENTION),
           "FA4up": upstream_fa4(causal)}
    if fa3:  # FlashAttention-3 (peers/fa3), loaded by main from --fa3-lib
        from fa4 import bench_fa3

        out["FA3"] = lambda q, k, v: bench_fa3.fa3_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)[0]
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        masks = {}

        def flex_fn(q, k, v):
            key = q.shape
            if causal and key not in masks:
                masks[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[2], k.shape[2])
            return compiled(q, k, v, block_mask=masks.get(key))
        out["Flex"] = flex_fn
    return out


def backward_providers(causal: bool, names):
    """{name: {"fwd+bwd": fn, "bwd": fn}} for the forward providers in ``names``: a training step
    (forward, then the gradients of q, k, v for a given dout), and the backward alone (the
    gradients through a forward graph built once per input set and kept)."""
    forward = {name: fn for name, fn in providers(causal, False).items() if name in names}
    # (B, H, S, Dv) like SDPA's, so one dout serves every provider; "fa4det": deterministic mode.
    for name, deterministic in (("fa4", False), ("fa4det", True)):
        if name in names:
            forward[name] = lambda q, k, v, d=deterministic: fa4.attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                deterministic=d).transpose(1, 2)
    out = {}
    for name, fn in forward.items():
        def step(q, k, v, dout, fn=fn):
            return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

        graphs = {}

        def bwd_only(q, k, v, dout, fn=fn, graphs=graphs):
            if id(q) not in graphs:
                graphs[id(q)] = fn(q, k, v)
            return torch.autograd.grad(graphs[id(q)], (q, k, v), dout, retain_graph=True)

        def fwd_only(q, k, v, dout, fn=fn):
            with torch.no_grad():
                return fn(q, k, v)
        out[name] = {"fwd": fwd_only, "fwd+bwd": step, "bwd": bwd_only}
    return out


def bench_backward(args, dtype) -> list:
    """The forward alone, forward + backward steps (FLOPs: 3.5x the forward's) and the backward
    alone (2.5x), every provider on its own inputs; rows for the summary table."""
    # fa4's deterministic mode ("fa4det") runs unless --providers names a set without it.
    asked = args.providers.split(",")
    names = [n for n in asked if n in ("fa4", "cuDNN", "FA2", "FA4up")]
    if "fa4det" in asked or args.providers == DEFAULT_PROVIDERS:
        names.append("fa4det")
    rows = []
    print("\nbackward: TFLOP/s of the forward, of forward + backward steps (3.5x forward FLOPs) and of the "
          "backward alone (2.5x)")
    for head_dim, head_dim_v in args.head_dims:
        heads = args.hidden // head_dim
        label = head_dim_label(head_dim, head_dim_v)
        for causal in {"both": [False, True], "yes": [True], "no": [False]}[args.causal]:
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                flops = attention_flops(batch, heads, seqlen, head_dim, head_dim_v, causal)

                def make():
                    sets = make_inputs(batch, seqlen, heads, head_dim, dtype, 3, args.layout, head_dim_v)
                    grads = [tuple(t.detach().requires_grad_() for t in qkv) for qkv in sets]
                    return [(*qkv, torch.randn(batch, seqlen, heads, head_dim_v, device="cuda",
                                               dtype=dtype).transpose(1, 2)) for qkv in grads]
                cells, result = [], {}
                fns = backward_providers(causal, names)
                for kind, factor in (("fwd", 1.0), ("fwd+bwd", 3.5), ("bwd", 2.5)):
                    # The deterministic mode's forward is the default one: not timed twice.
                    timed = time_providers({n: f[kind] for n, f in fns.items() if (n, kind) != ("fa4det", "fwd")},
                                           make, factor * flops, args, f"hd={label} s={seqlen} {kind}")
                    result[kind] = {n: r[0] for n, r in timed.items()}
                    cells.append(f"{kind}: " + "  ".join(f"{n} {r[0]:6.1f}" for n, r in timed.items()))
                ratio = (result["fwd+bwd"].get("fa4", float("nan")) / result["fwd+bwd"]["cuDNN"]
                         if "cuDNN" in result["fwd+bwd"] else float("nan"))
                print(f"hd={label:>3s} seqlen={seqlen:5d} causal={int(causal)}  " + "  |  ".join(cells)
                      + f"  fa4/cuDNN fwd+bwd {ratio:.3f}", flush=True)
                rows.append((label, seqlen, causal, result))
    names_done = list(rows[0][3]["fwd+bwd"]) if rows else []  # every provider times fwd+bwd
    peers = [n for n in names_done if n != "fa4"]
    kinds = ("fwd+bwd", "bwd", "fwd")
    header = ("| head_dim | seqlen | causal | " + " | ".join(f"{n} {kind}" for kind in kinds for n in names_done)
              + "".join(f" | fa4/{p} fwd+bwd" for p in peers) + " |")
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for label, seqlen, causal, r in rows:
        fb = r["fwd+bwd"]
        print(f"| {label} | {seqlen} | {'yes' if causal else 'no'} | "
              + " | ".join(f"{r[kind].get(n, float('nan')):.0f}" for kind in kinds for n in names_done)
              + "".join(f" | {fb['fa4'] / fb[p]:.3f}" for p in peers if "fa4" in fb) + " |")
    return rows


def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """(query, key) pairs a bottom-right aligned window (left, right; -1 unbounded) lets through."""
    total = 0
    for i in range(seqlen_q):
        diag = i + seqlen_k - seqlen_q
        lo = 0 if left < 0 else max(0, diag - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, diag + right)
        total += max(0, hi - lo + 1)
    return total


def bench_backward_shapes(args, dtype) -> None:
    """fa4 training steps (forward + backward, 3.5x the forward's useful FLOPs) on the shapes
    issue 23 compares with dense rows of the same run: GQA 32/8 heads against MHA 32/32 (equal
    FLOPs), a 1024-key causal sliding window at 16k tokens, and --varlen-docs random-length
    documents against dense causal batches of the same tokens. hd128."""
    d, step = 128, lambda fn: (lambda q, k, v, do: torch.autograd.grad(fn(q, k, v), (q, k, v), do))

    def sets(b, sq, sk, hq, hk):
        out = []
        for _ in range(3):
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
            out.append((q, k, v, torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)))
        return out

    def tflops(fn, inputs, pairs, heads):
        ms = time_ms(lambda i: step(fn)(*inputs[i % 3]), args.warmup, args.iters, args.calls_per_sample)
        return 3.5 * 4 * d * pairs * heads / (ms * 1e-3) / 1e12

    print("\nbackward shapes (hd128, fa4 fwd+bwd TFLOP/s of useful work):")
    seqlen = 4096
    batch = max(1, args.tokens // seqlen)
    for causal in (False, True):
        pairs = batch * visible_pairs(seqlen, seqlen, -1, 0 if causal else -1)
        fn = lambda q, k, v: fa4.attention(q, k, v, causal=causal)  # noqa: E731
        gqa, mha = tflops(fn, sets(batch, seqlen, seqlen, 32, 8), pairs, 32), \
            tflops(fn, sets(batch, seqlen, seqlen, 32, 32), pairs, 32)
        print(f"  GQA 32/8 vs MHA 32/32, {batch}x{seqlen}, causal={int(causal)}: {gqa:6.1f} vs {mha:6.1f}  "
              f"ratio {gqa / mha:.3f}", flush=True)
    window = 1024
    pairs = visible_pairs(args.tokens, args.tokens, window, 0)
    heads = args.hidden // d
    fn = lambda q, k, v: fa4.attention(q, k, v, window=(window, 0))  # noqa: E731
    print(f"  sliding window ({window}, 0), 1x{args.tokens}, {heads} heads: "
          f"{tflops(fn, sets(1, args.tokens, args.tokens, heads, heads), pairs, heads):6.1f}", flush=True)
    docs = max(args.varlen_docs, 8)
    gen = torch.Generator().manual_seed(0)
    cuts = torch.randperm(args.tokens - 1, generator=gen)[: docs - 1].add(1).sort().values
    bounds = [0] + cuts.tolist() + [args.tokens]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    packed = [tuple(t[0] for t in one) for one in sets(1, args.tokens, args.tokens, heads, heads)]
    fn = lambda q, k, v: fa4.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)  # noqa: E731
    varlen = tflops(fn, packed, sum(visible_pairs(n, n, -1, 0) for n in lengths), heads)
    seq = args.tokens // docs
    fn = lambda q, k, v: fa4.attention(q, k, v, causal=True)  # noqa: E731
    dense = tflops(fn, sets(docs, seq, seq, heads, heads), docs * visible_pairs(seq, seq, -1, 0), heads)
    print(f"  varlen {docs} documents {lengths}, causal: {varlen:6.1f} vs dense {docs}x{seq} {dense:6.1f}  "
          f"ratio {varlen / dense:.3f}", flush=True)


def host_step_us(head_dim: int, causal: bool = True, calls: int = 100) -> tuple[float, float]:
    """CPU time per fa4 forward + backward step and per SDPA (cuDNN) step on a tiny problem
    (bench_host: launches queued, no sync in between; cuDNN chosen outside the loop)."""
    return bench_host.step_us(head_dim, causal, calls)


def bench_varlen(args, dtype) -> None:
    """Packed documents (random lengths summing to --tokens) against dense causal batches of the
    same total tokens and head shape. TFLOP/s count only useful FLOPs (within documents)."""
    gen = torch.Generator().manual_seed(0)
    print(f"\nvarlen: {args.varlen_docs} random-length documents in {args.tokens} tokens, causal")
    for head_dim, head_dim_v in args.head_dims:
        heads = args.hidden // head_dim
        cuts = torch.randperm(args.tokens - 1, generator=gen)[: args.varlen_docs - 1].add(1).sort().values
        bounds = [0] + cuts.tolist() + [args.tokens]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        flops = sum(attention_flops(1, heads, s, head_dim, head_dim_v, causal=True) for s in lengths)
        inputs = [tuple(torch.randn(args.tokens, heads, d, device="cuda", dtype=dtype)
                        for d in (head_dim, head_dim, head_dim_v)) for _ in range(3)]
        ms = time_ms(lambda i: fa4.attention_varlen(*inputs[i % 3], cu, cu, max(lengths), max(lengths), causal=True),
                     args.warmup, args.iters)
        varlen_tflops = flops / (ms * 1e-3) / 1e12
        seqlen = args.tokens // args.varlen_docs
        dense = make_inputs(args.varlen_docs, seqlen, heads, head_dim, dtype, 3, "bshd", head_dim_v)
        dense_flops = attention_flops(args.varlen_docs, heads, seqlen, head_dim, head_dim_v, causal=True)
        ms_dense = time_ms(lambda i: providers(True, False)["fa4"](*dense[i % 3]), args.warmup, args.iters)
        dense_tflops = dense_flops / (ms_dense * 1e-3) / 1e12
        print(f"hd={head_dim_label(head_dim, head_dim_v):>3s} docs={lengths}\n  varlen {varlen_tflops:6.1f} TFLOP/s  dense causal "
              f"{args.varlen_docs}x{seqlen} {dense_tflops:6.1f}  ratio {varlen_tflops / dense_tflops:.3f}", flush=True)


def forward_and_step(fns, sets, dout, flops, args, forward_only=()):
    """[("fwd", medians), ("fwd+bwd", medians)]: each provider's TFLOP/s (forward, and forward +
    backward at 3.5x the FLOPs; not for the providers named in ``forward_only``), the median over
    --rounds rounds, the providers in a rotated order each round, inputs taken in turn from
    ``sets`` (q, k, v needing gradients)."""
    out = []
    for what, factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        result = {}
        names = [n for n in fns if what == "fwd" or n not in forward_only]
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn = fns[name]
                if what == "fwd":
                    call = lambda i, fn=fn: fn(*(t.detach() for t in sets[i % 3]))  # noqa: E731
                else:
                    call = lambda i, fn=fn: torch.autograd.grad(fn(*sets[i % 3]), sets[i % 3], dout)  # noqa: E731
                ms = time_ms(call, args.warmup, args.iters)
                result.setdefault(name, []).append(factor * flops / (ms * 1e-3) / 1e12)
        out.append((what, {name: statistics.median(v) for name, v in result.items()}))
    return out


def bench_flex_masks(args, dtype) -> None:
    """Masks through FlexAttention's API, one BlockMask each: --flex-docs random-length causal
    documents in --tokens tokens (``fa4.masks.document``) and a causal 1024-key sliding window over
    them (``fa4.masks.sliding_window``). Providers: ``fa4.flex_attention``, fa4's own API for the
    same mask (``attention_varlen`` / ``attention(window=...)``: the flex path should cost nothing
    over it) and torch's ``flex_attention`` compiled; forward and forward + backward (3.5x the
    forward's FLOPs), TFLOP/s of useful work, the providers taking turns in each round. The
    document mask's preparation time is printed beside it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    gen = torch.Generator().manual_seed(0)
    docs, tokens, window = args.flex_docs, args.tokens, 1024
    cuts = torch.randperm(tokens - 1, generator=gen)[: docs - 1].add(1).sort().values
    bounds = [0] + cuts.tolist() + [tokens]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    ids = torch.repeat_interleave(torch.arange(docs), torch.tensor(lengths))
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")

    def prepare():
        mask = fa4.masks.document(ids, causal=True, device="cuda")  # the runs: read on the host, CPU ids
        return create_block_mask(mask, None, None, tokens, tokens, device="cuda")

    prepare()  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    documents = prepare()
    torch.cuda.synchronize()
    prepare_ms = (time.perf_counter() - start) * 1e3
    windowed = create_block_mask(fa4.masks.and_masks(fa4.masks.causal(), fa4.masks.sliding_window(window, 0)),
                                 None, None, tokens, tokens, device="cuda")
    # (1, H, S, D) -> (S, H, D), a view whose backward is a view too (indexing t[0] would make
    # autograd zero-fill and copy each gradient: ~15% of the step in this benchmark)
    packed = lambda t: t.transpose(1, 2).reshape(tokens, t.shape[1], t.shape[3])  # noqa: E731
    longest = max(lengths)
    cases = {  # name: (block mask, fa4's own API on (B, H, S, D) inputs, visible (query, key) pairs)
        f"{docs} causal documents": (documents, lambda q, k, v: fa4.attention_varlen(
            packed(q), packed(k), packed(v), cu, cu, longest, longest, causal=True),
            sum(n * (n + 1) // 2 for n in lengths)),
        f"causal window {window}": (windowed, lambda q, k, v: fa4.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=(window, 0)),
            visible_pairs(tokens, tokens, window, 0)),
    }
    print(f"\nFlexAttention's API, {tokens} tokens: fa4.flex_attention, fa4's own API, torch flex_attention "
          f"compiled; TFLOP/s of useful work. Document mask preparation (fa4.masks.document from CPU ids + "
          f"create_block_mask, synchronised): {prepare_ms:.2f} ms")
    for head_dim, head_dim_v in args.head_dims:
        heads = args.hidden // head_dim
        sets = [tuple(torch.randn(1, heads, tokens, d, device="cuda", dtype=dtype, requires_grad=True)
                      for d in (head_dim, head_dim, head_dim_v)) for _ in range(3)]
        dout = torch.randn(1, heads, tokens, head_dim_v, device="cuda", dtype=dtype)
        for case, (block_mask, own, pairs) in cases.items():
            flops = 2 * heads * pairs * (head_dim + head_dim_v)
            fns = {"fa4.flex": lambda q, k, v, bm=block_mask: fa4.flex_attention(q, k, v, block_mask=bm),
                   "fa4": lambda q, k, v, own=own: own(q, k, v).reshape(1, tokens, heads, -1).transpose(1, 2),
                   "Flex": lambda q, k, v, bm=block_mask: compiled(q, k, v, block_mask=bm)}
            cells = []
            for what, med in forward_and_step(fns, sets, dout, flops, args):
                cells.append(f"{what}: " + "  ".join(f"{n} {t:6.1f}" for n, t in med.items())
                             + f"  flex/own {med['fa4.flex'] / med['fa4']:.3f}  fa4.flex/Flex "
                               f"{med['fa4.flex'] / med['Flex']:.3f}")
            print(f"hd={head_dim_label(head_dim, head_dim_v):>3s} {case}:\n  " + "\n  ".join(cells), flush=True)


def sparse_bench_masks(tokens: int, block: int = 128) -> dict:
    """--flex-sparse's mask_mods over ``tokens`` (CUDA): half of the ``block``-sized blocks kept at
    random (seed 0), half of those partial (4 keys in 5 kept), and causal as a plain function."""
    gen = torch.Generator().manual_seed(0)
    cells = -(-tokens // block)
    keep = (torch.rand(cells, cells, generator=gen) < 0.5).cuda()
    partial = (torch.rand(cells, cells, generator=gen) < 0.5).cuda()

    def random_blocks(b, h, q, kv):
        cq, ck = q // block, kv // block
        return keep[cq, ck] & (~partial[cq, ck] | ((q * 7 + kv * 3) % 5 != 0))

    def causal(b, h, q, kv):
        return q >= kv

    return {"random 50% of blocks, half of them partial": random_blocks, "causal as a plain mask_mod": causal}


def bench_flex_sparse(args, dtype) -> None:
    """mask_mods fa4 reads only through their BlockMask and bits (fa4.block_sparse), at --tokens:
    half of the 128 x 128 blocks kept at random, half of those partial (a per-element pattern
    keeping 4 keys in 5); and causal written as a plain function (unequal tiles: the schedules'
    longest-first order matters), beside fa4's own causal kernel. fa4.flex_attention eager and
    compiled (its tables built inside the graph) against torch's flex_attention compiled, forward
    and forward + backward (3.5x the forward's FLOPs), TFLOP/s of useful work; the BlockMask's and
    fa4's tables' (forward and backward) preparation times."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    compiled = torch.compile(flex_attention)
    tokens = args.tokens
    for label, mask_mod in sparse_bench_masks(tokens).items():
        create_block_mask(mask_mod, None, None, tokens, tokens, device="cuda")  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        block_mask = create_block_mask(mask_mod, None, None, tokens, tokens, device="cuda")
        torch.cuda.synchronize()
        mask_ms = (time.perf_counter() - start) * 1e3
        pairs = int(create_mask(mask_mod, None, None, tokens, tokens, device="cuda").sum())
        print(f"\nBlock-sparse mask_mod: {label}, {tokens} tokens ({pairs / tokens ** 2:.1%} of pairs visible): "
              f"create_block_mask {mask_ms:.2f} ms")
        for head_dim, head_dim_v in args.head_dims:
            bench_flex_sparse_case(args, dtype, block_mask, pairs, head_dim, head_dim_v, compiled,
                                   own_causal=mask_mod.__name__ == "causal")


def bench_flex_sparse_case(args, dtype, block_mask, pairs, head_dim, head_dim_v, compiled, own_causal):
    from fa4 import block_sparse

    tokens = args.tokens
    tile = block_sparse.kernel_tile(dtype, head_dim, head_dim_v, torch.device("cuda"))
    heads = args.hidden // head_dim
    bwd_tile = block_sparse.kernel_tile(dtype, head_dim, head_dim_v, torch.device("cuda"), kernel="bwd")
    block_sparse.build_tables(block_mask, 1, heads, tile)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    tables = block_sparse.build_tables(block_mask, 1, heads, tile)
    torch.cuda.synchronize()
    tables_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    block_sparse.build_tables(block_mask, 1, heads, bwd_tile, transposed=True)
    torch.cuda.synchronize()
    bwd_tables_ms = (time.perf_counter() - start) * 1e3
    partial_tiles = tables.bits.numel() // (tile[0] * tile[1] // 32) - 1
    sets = [tuple(torch.randn(1, heads, tokens, d, device="cuda", dtype=dtype, requires_grad=True)
                  for d in (head_dim, head_dim, head_dim_v)) for _ in range(3)]
    dout = torch.randn(1, heads, tokens, head_dim_v, device="cuda", dtype=dtype)
    flops = 2 * heads * pairs * (head_dim + head_dim_v)
    fns = {"fa4.flex": lambda q, k, v: fa4.flex_attention(q, k, v, block_mask=block_mask),
           "Flex": lambda q, k, v: compiled(q, k, v, block_mask=block_mask),
           # The tables built inside the graph at every call (a slot per entry).
           "fa4.flex compiled": torch.compile(lambda q, k, v: fa4.flex_attention(q, k, v, block_mask=block_mask))}
    if own_causal:
        fns["fa4 causal kernel"] = lambda q, k, v: fa4.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    cells = []
    for what, med in forward_and_step(fns, sets, dout, flops, args):
        cells.append(f"{what}: " + "  ".join(f"{n} {t:6.1f}" for n, t in med.items())
                     + f"  fa4.flex/Flex {med['fa4.flex'] / med['Flex']:.3f}")
    print(f"hd={head_dim_label(head_dim, head_dim_v):>3s}:\n  " + "\n  ".join(cells) + f"\n  fa4 tables "
          f"({tile[0]} x {tile[1]} tiles, {partial_tiles} partial) {tables_ms:.2f} ms, backward's "
          f"({bwd_tile[0]} x {bwd_tile[1]}) {bwd_tables_ms:.2f} ms", flush=True)


def bench_flex_score(args, dtype) -> None:
    """fa4's in-kernel score_mods with a causal BlockMask at --tokens: ALiBi (fixed slopes), a
    learned relative-bias table (+-256 positions, clamped beyond; its gradient computed in the
    backward) and a learned (tokens, tokens) bias tensor (fp32, and in the inputs' dtype), through
    fa4.flex_attention, beside fa4's own causal kernel (no bias: the cost of the bias) and torch's
    flex_attention compiled with the same score_mods (forward only where its backward does not
    compile); forward and forward + backward (3.5x the forward's FLOPs), TFLOP/s of useful work."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    tokens = args.tokens
    block_mask = create_block_mask(fa4.masks.causal(), None, None, tokens, tokens, device="cuda")
    plain_causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, tokens, tokens, device="cuda")
    pairs = tokens * (tokens + 1) // 2
    print(f"\nIn-kernel score_mods with a causal BlockMask, {tokens} tokens: fa4.flex_attention, fa4's causal "
          f"kernel (no bias), torch flex_attention compiled; TFLOP/s of useful work")
    for head_dim, head_dim_v in args.head_dims:
        # Each score_mod compiles torch's flex_attention a few times (forward, backward, inputs
        # with and without gradients): past dynamo's recompile limit it would run unfused.
        torch._dynamo.reset()
        heads = args.hidden // head_dim
        slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)  # ALiBi's geometric slopes
        table = (0.1 * torch.randn(heads, 2 * 256 + 1, device="cuda")).requires_grad_()
        # A learned (tokens, tokens) bias broadcast over batch and heads, fp32 and in the inputs'
        # dtype (read as such): read at every score, its gradient summed over the heads by the
        # backward's reductions.
        bias = (0.1 * torch.randn(tokens, tokens, device="cuda")).requires_grad_()
        bias16 = bias.detach().to(dtype).requires_grad_()
        mods = {"alibi": fa4.score_mods.alibi(slopes), "relbias": fa4.score_mods.relative_bias(table),
                "bias": fa4.score_mods.bias(bias), "bias16": fa4.score_mods.bias(bias16)}
        sets = [tuple(torch.randn(1, heads, tokens, d, device="cuda", dtype=dtype, requires_grad=True)
                      for d in (head_dim, head_dim, head_dim_v)) for _ in range(3)]
        dout = torch.randn(1, heads, tokens, head_dim_v, device="cuda", dtype=dtype)
        flops = 2 * heads * pairs * (head_dim + head_dim_v)
        forward_only = set()
        fns = {"fa4 causal": lambda q, k, v: fa4.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2),
               # Causal as a plain mask_mod without a score_mod: the block-sparse kernels' own cost
               # (the same tables; fa4.masks.causal() alone would run the causal kernel).
               "fa4.flex none": lambda q, k, v: fa4.flex_attention(q, k, v, block_mask=plain_causal)}
        for name, mod in mods.items():
            fns[f"fa4.flex {name}"] = lambda q, k, v, mod=mod: fa4.flex_attention(q, k, v, score_mod=mod,
                                                                                 block_mask=block_mask)
            flex = lambda q, k, v, mod=mod: compiled(q, k, v, score_mod=mod, block_mask=block_mask)  # noqa: E731
            try:  # torch's Triton kernels may not compile for a score_mod at this head dim
                flex(*(t.detach() for t in sets[0]))
                fns[f"Flex {name}"] = flex
                torch.autograd.grad(flex(*sets[0]), sets[0], dout)
            except Exception as error:  # noqa: BLE001
                print(f"  Flex {name} at hd{head_dim_label(head_dim, head_dim_v)} failed"
                      f"{' (timed forward only)' if f'Flex {name}' in fns else ''}: {str(error)[-160:]}")
                forward_only.add(f"Flex {name}")
        cells = []
        for what, med in forward_and_step(fns, sets, dout, flops, args, forward_only):
            ratios = "  ".join(f"{name}/causal {med[f'fa4.flex {name}'] / med['fa4 causal']:.3f}" + (
                f"  {name} fa4/Flex {med[f'fa4.flex {name}'] / med[f'Flex {name}']:.3f}" if f"Flex {name}" in med
                else "") for name in mods)
            cells.append(f"{what}: " + "  ".join(f"{n} {t:6.1f}" for n, t in med.items()) + "\n    " + ratios)
        print(f"hd={head_dim_label(head_dim, head_dim_v):>3s}:\n  " + "\n  ".join(cells), flush=True)


def bench_gqa_decode(args, dtype):
    """Short queries against a long KV cache with GQA (32 query heads on 8 K/V heads, hd128):
    pack-GQA stacks the 4 query heads of a K/V head in one tile. Memory-bound, so reported as
    microseconds per call and GB/s of q/k/v/o traffic; SDPA (default backend, enable_gqa) is
    the peer."""
    hq, hk, d, sk = 32, 8, 128, 8192
    for batch in args.decode_batches:
        print(f"\nGQA {hq}/{hk} heads, hd{d}, batch {batch}, seqlen_k {sk}, causal (bottom-right): us per call (GB/s)")
        bench_gqa_decode_batch(args, dtype, batch, hq, hk, d, sk)


def bench_gqa_decode_batch(args, dtype, batch, hq, hk, d, sk):
    for sq in (1, 16, 64):
        inputs = [(torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype),
                   torch.randn(batch, sk, hk, d, device="cuda", dtype=dtype),
                   torch.randn(batch, sk, hk, d, device="cuda", dtype=dtype)) for _ in range(3)]
        nbytes = 2 * (2 * batch * sq * hq * d + 2 * batch * sk * hk * d)
        causal_mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)  # built once, untimed
        cells = []
        for name, fn in (
            ("fa4 packed", lambda q, k, v: fa4.attention(q, k, v, causal=True, pack_gqa=True)),
            ("fa4 unpacked", lambda q, k, v: fa4.attention(q, k, v, causal=True, pack_gqa=False)),
            ("SDPA", lambda q, k, v: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True,
                attn_mask=causal_mask)),
        ):
            try:
                ms = time_ms(lambda i: fn(*inputs[i % 3]), args.warmup, args.iters)
                cells.append(f"{name} {ms * 1e3:7.1f} ({nbytes / (ms * 1e-3) / 1e9:5.0f})")
            except Exception as e:
                cells.append(f"{name} failed: {type(e).__name__}")
        print(f"seqlen_q={sq:3d}  " + "  ".join(cells), flush=True)


def bench_gemm_ceiling(args, dtype) -> None:
    """Dense GEMM (cuBLAS through torch.matmul) in the same run: the tensor-core throughput an
    attention kernel, two GEMMs plus a softmax per block, cannot exceed."""
    print("\ndense GEMM ceiling (torch.matmul, same run):")
    for n in (4096, 8192):
        a = [torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(3)]
        ms = time_ms(lambda i: a[i % 3] @ a[(i + 1) % 3], args.warmup, args.iters)
        print(f"  {n}x{n}x{n}: {2 * n ** 3 / (ms * 1e-3) / 1e12:6.1f} TFLOP/s", flush=True)


def host_overhead_us(causal: bool, head_dim: int, head_dim_v: int, calls: int = 200) -> float:
    """CPU time per fa4.attention call on a tiny problem (launches queued, no sync in between):
    the floor under which GPU time per call stops mattering."""
    q, k, v = (torch.randn(1, 128, 2, d, device="cuda", dtype=torch.bfloat16) for d in (head_dim, head_dim, head_dim_v))
    return bench_host.per_call_us(lambda: fa4.attention(q, k, v, causal=causal), calls)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=head_dim_pair, nargs="+", default=[(64, 64), (128, 128)],
                    help="D (q/k/v) or DxDV (q/k, v), e.g. 64 128 192x128")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--iters", type=positive_int, default=15, help="timed samples per provider and round")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="rounds per case, providers in a rotated order each round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--calls-per-sample", type=positive_int, default=5,
                    help="back-to-back calls per timed sample (1: GPU time of calls whose host time is below "
                         "the ~2.5 ms GPU spin ahead of each sample, e.g. 1k-token training steps)")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (torch.compile)")
    ap.add_argument("--flex-docs", type=int, default=0,
                    help="also time masks through FlexAttention's API: this many random-length causal documents "
                         "in --tokens, and a causal 1024-key window (fa4.flex_attention, fa4's own API, torch's "
                         "flex_attention compiled)")
    ap.add_argument("--flex-sparse", action="store_true",
                    help="also time a random block-sparse mask_mod through FlexAttention's API (fa4's bitmask path)")
    ap.add_argument("--flex-score", action="store_true",
                    help="also time fa4's in-kernel score_mods (alibi, a learned relative bias, a learned bias "
                         "tensor) with a causal mask")
    ap.add_argument("--providers", default=DEFAULT_PROVIDERS,
                    help="comma-separated subset to time (the backward adds fa4det, fa4's deterministic mode, "
                         "unless a set without it is given); FA4up: upstream FlashAttention-4 (flash_attn.cute must "
                         "import: scripts/upstream_fa4_env.sh)")
    ap.add_argument("--varlen-docs", type=int, default=0,
                    help="also time attention_varlen on this many random-length documents per batch")
    ap.add_argument("--gqa-decode", action="store_true",
                    help="also time short-query GQA against a long KV cache, pack-GQA on and off")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[16],
                    help="batch sizes of the --gqa-decode cases")
    ap.add_argument("--decode", "--kvcache", dest="kvcache", action="store_true",
                    help="attention against a KV cache: decoding (contiguous and paged, beside SDPA and a device "
                         "copy), speculative verification, chunked prefill (beside cuDNN)")
    ap.add_argument("--decode-parts", nargs="+", choices=DECODE_PARTS, default=list(DECODE_PARTS),
                    help="with --decode: these of its tables only")
    ap.add_argument("--context-parallel", action="store_true",
                    help="ring attention (torch's context_parallel) over every visible GPU against one GPU, fa4 and "
                         "cuDNN as SDPA's kernels (needs two GPUs or more)")
    ap.add_argument("--cp-seqlens", type=positive_int, nargs="+", default=[32768, 65536, 131072],
                    help="sequence lengths of the --context-parallel cases")
    ap.add_argument("--cp-iters", type=positive_int, default=3,
                    help="timed steps per --context-parallel case and provider (a 128k step takes seconds)")
    ap.add_argument("--sweep", action="store_true",
                    help="time every run-time strategy (tile family, grid, split tail, pack-GQA, KV-cache splits, "
                         "the backward's first store and rotation) on ~60 shapes against the automatic choice")
    ap.add_argument("--sweep-out", default="docs/heuristics.md", help="where --sweep writes its table ('' for none)")
    ap.add_argument("--sweep-rounds", type=positive_int, default=3, help="timed rounds per --sweep candidate")
    ap.add_argument("--sweep-quick", action="store_true", help="every 7th --sweep shape only (a smoke run)")
    ap.add_argument("--sweep-only", default="", help="--sweep only the shapes whose label contains this text")
    ap.add_argument("--gemm", action="store_true", help="also time a dense GEMM (the tensor-core ceiling)")
    ap.add_argument("--fa3-lib", default=None,
                    help="also time FlashAttention-3 from this libfa3_peer.so (peers/fa3/build.sh; bf16, hd 64/128/256)")
    ap.add_argument("--layout", choices=["bshd", "bhsd"], default="bshd",
                    help="storage of q/k/v (default bshd: fa4's and FlashAttention's layout)")
    ap.add_argument("--backward", action="store_true",
                    help="time forward + backward steps and the backward alone instead of the forward")
    ap.add_argument("--backward-shapes", action="store_true",
                    help="with --backward: also GQA, sliding-window and varlen training steps (hd128)")
    ap.add_argument("--plot", metavar="FILE.png", default=None,
                    help="also write the forward table as a figure (needs matplotlib: the plot extra)")
    ap.add_argument("--host", action="store_true",
                    help="host time per call (eager, forward + backward, torch.compile, first call, host "
                         "syncs) against SDPA, at the first --head-dims entry, instead of GPU time")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fa4.bench needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  cuDNN {torch.backends.cudnn.version()}")
    if args.host:
        bench_host.report(args.head_dims[0][0])
        return
    if args.sweep:
        from fa4 import bench_sweep

        bench_sweep.run(args)
        return
    if args.context_parallel:
        from fa4 import bench_cp

        bench_cp.run(args)
        return
    if args.kvcache:
        from fa4 import bench_kvcache

        bench_kvcache.run(args, dtype)
        return
    if "fa4" in args.providers.split(","):  # a head dim and mask being timed: partial builds have no other
        hd, hdv = args.head_dims[0]
        per_call = ", ".join(f"{host_overhead_us(c, hd, hdv):.0f} us ({'causal' if c else 'no mask'})" for c in causals)
        print(f"host time per fa4.attention call (hd{head_dim_label(hd, hdv)}): {per_call}")
    print(f"{args.dtype}, {args.tokens} tokens/batch, hidden {args.hidden}, {args.layout} storage; "
          f"TFLOP/s (median of {args.rounds} x {args.iters} samples of 5 back-to-back calls, "
          f"providers rotated between rounds)")
    if args.backward:
        # The last mask timed (causal unless --causal no): partial builds may lack the other.
        fa4_us, cudnn_us = host_step_us(args.head_dims[0][0], causals[-1])
        print(f"host time per forward + backward step (hd{args.head_dims[0][0]}, "
              f"{'causal' if causals[-1] else 'no mask'}): fa4 {fa4_us:.0f} us, "
              f"SDPA cuDNN {cudnn_us:.0f} us")
        bench_backward(args, dtype)
        if args.backward_shapes:
            bench_backward_shapes(args, dtype)
        return
    if args.fa3_lib:
        from fa4 import bench_fa3

        bench_fa3.load(args.fa3_lib)
    names = None
    rows = []
    for head_dim, head_dim_v in args.head_dims:
        heads = args.hidden // head_dim
        label = head_dim_label(head_dim, head_dim_v)
        for causal in causals:
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                flops = attention_flops(batch, heads, seqlen, head_dim, head_dim_v, causal)
                wanted = (set(args.providers.split(",")) | ({"Flex"} if args.flex else set())
                          | ({"FA3"} if args.fa3_lib else set()))
                fns = {name: fn for name, fn in providers(causal, args.flex, bool(args.fa3_lib)).items()
                       if name in wanted}
                result = time_providers(fns, make_inputs_for=lambda: make_inputs(
                    batch, seqlen, heads, head_dim, dtype, 3, args.layout, head_dim_v),
                    flops=flops, args=args, where=f"hd={label} s={seqlen}")
                names = list(result)
                rows.append((label, seqlen, causal, {n: r[0] for n, r in result.items()}))
                cells = "  ".join(f"{n} {r[0]:6.1f}" for n, r in result.items())
                ratio = result["fa4"][0] / result["cuDNN"][0] if {"fa4", "cuDNN"} <= set(result) else float("nan")
                spread = round_spread(result["fa4"][1] if "fa4" in result else [])
                print(f"hd={label:>3s} seqlen={seqlen:5d} causal={int(causal)}  {cells}  fa4/cuDNN {ratio:.3f}{spread}",
                      flush=True)
    if args.varlen_docs:
        bench_varlen(args, dtype)
    if args.flex_docs:
        bench_flex_masks(args, dtype)
    if args.flex_sparse:
        bench_flex_sparse(args, dtype)
    if args.flex_score:
        bench_flex_score(args, dtype)
    if args.gqa_decode:
        bench_gqa_decode(args, dtype)
    if args.gemm:
        bench_gemm_ceiling(args, dtype)
    peers = [n for n in ("cuDNN", "FA4up", "FA3", "FA2", "Flex") if n in names and "fa4" in names]
    header = "| head_dim | seqlen | causal | " + " | ".join(names) + "".join(f" | fa4/{p}" for p in peers) + " |"
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for label, seqlen, causal, r in rows:
        print(f"| {label} | {seqlen} | {'yes' if causal else 'no'} | "
              + " | ".join(f"{r[n]:.0f}" for n in names)
              + "".join(f" | {r['fa4'] / r[p]:.3f}" for p in peers) + " |")
    if args.plot:
        from fa4.bench_plot import plot_rows

        plot_rows(rows, names, args.plot, f"{torch.cuda.get_device_name()}, {args.dtype}, {args.tokens} tokens, "
                                          f"hidden {args.hidden}: TFLOP/s, same run")
        print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
