"""``python -m fa4.bench --sweep``: every strategy fa4's run-time rules can be forced into, timed per
shape, against the one the rules pick; writes the table and the regret (automatic time / best
time) to --sweep-out (default docs/heuristics.md).

Strategies, each forced by the keyword or ``FA4_`` setting that tests and users have (README,
"Environment variables"): the forward's tile family (``FA4_TILES``), grid (``FA4_PERSISTENT``),
split tail (``FA4_SPLIT_TAIL``) and pack-GQA (``pack_gqa=``); the KV-cache forward's split count
(``num_splits=``); the backward's first dQ store (``FA4_BWD_STORE_FIRST``), rotated visits
(``FA4_BWD_ROTATE``), causal launch groups (``FA4_BWD_LAUNCH_GROUP``) and 2-CTA clusters
(``FA4_BWD_CLUSTERS``). Candidates that end in
the same launch (``fa4._native.last_launch``: the variant and the decisions taken for it; a
family that is not built falls back to the regular one) are timed once. Compile-time strategies
(the scheduler kind of each mask, the forward's cluster size, exp2 emulation) are not switchable
at run time and not swept.

Timing: GPU time of a CUDA graph of ``CALLS`` calls (no host time: the rules choose kernels,
launch cost is the host path's business), the median of --sweep-rounds rounds with the
candidates in a rotated order each round.
"""
from __future__ import annotations

import itertools
import math
import os
import statistics
from dataclasses import dataclass, field

import torch

import fa4
from fa4 import _native

CALLS = 10
TOKENS = 32768
HIDDEN = 2048


@dataclass
class Shape:
    kind: str  # "fwd" | "varlen" | "decode" | "bwd"
    label: str
    call: object  # call(**kwargs) runs one call with the candidate's keywords
    candidates: list = field(default_factory=list)  # (label, env dict, kwargs dict)


def _fwd_candidates(gqa: bool):
    out = []
    for tiles, persistent, split in itertools.product(("regular", "short", "long"), ("0", "1"), ("0", "1")):
        env = {"FA4_TILES": tiles, "FA4_PERSISTENT": persistent, "FA4_SPLIT_TAIL": split}
        label = f"tiles={tiles} persistent={persistent} split_tail={split}"
        for pack in ((False, True) if gqa else (None,)):
            out.append((label + ("" if pack is None else f" pack_gqa={int(pack)}"), env,
                        {} if pack is None else {"pack_gqa": pack}))
    return out


def _bwd_candidates(causal: bool, hd: int):
    # Causal calls also sweep their CTAs' launch groups (FA4_BWD_LAUNCH_GROUP; 0: the grid's order),
    # hd256 its 2-CTA cluster kernels (FA4_BWD_CLUSTERS; the only head dim they are built for).
    groups = ("0", "4", "8") if causal else ("",)
    clusters = ("0", "1") if hd == 256 else ("",)
    return [(f"store_first={s} rotate={r}" + (f" launch_group={g}" if g else "") + (f" clusters={c}" if c else ""),
             {"FA4_BWD_STORE_FIRST": s, "FA4_BWD_ROTATE": r, "FA4_BWD_LAUNCH_GROUP": g, "FA4_BWD_CLUSTERS": c}, {})
            for s, r, g, c in itertools.product(("0", "1"), ("0", "1"), groups, clusters)]


def _dense(hd, seqlen, causal, batch=None, heads_q=None, heads_kv=None, dtype=torch.bfloat16):
    heads_q = heads_q or HIDDEN // hd
    heads_kv = heads_kv or heads_q
    batch = batch or max(1, TOKENS // seqlen)
    q = torch.randn(batch, seqlen, heads_q, hd, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, seqlen, heads_kv, hd, device="cuda", dtype=dtype) for _ in range(2))
    gqa = "" if heads_kv == heads_q else f" gqa {heads_q}/{heads_kv}"
    label = f"hd{hd} {batch}x{seqlen}{gqa} {'causal' if causal else 'full'}"
    return Shape("fwd", label, lambda **kw: fa4.attention(q, k, v, causal=causal, **kw),
                 _fwd_candidates(heads_kv != heads_q))


def _varlen(hd, causal, long_doc=TOKENS // 2, docs=8, dtype=torch.bfloat16):
    """One long document and ``docs - 1`` random short ones in TOKENS tokens (skewed lengths)."""
    g = torch.Generator().manual_seed(hd + causal)
    rest = TOKENS - long_doc
    cuts = torch.randperm(rest - 1, generator=g)[:docs - 2].add(1).sort().values.tolist()
    lengths = [long_doc] + [b - a for a, b in zip([0] + cuts, cuts + [rest])]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    heads = HIDDEN // hd
    q, k, v = (torch.randn(TOKENS, heads, hd, device="cuda", dtype=dtype) for _ in range(3))
    label = f"hd{hd} varlen {docs} docs (one of {long_doc}) {'causal' if causal else 'full'}"
    return Shape("varlen", label,
                 lambda **kw: fa4.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal, **kw),
                 _fwd_candidates(False))


def _decode(batch, length, heads_q=32, heads_kv=8, dtype=torch.bfloat16):
    k, v = (torch.randn(batch, length, heads_kv, 128, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn(batch, 1, heads_q, 128, device="cuda", dtype=dtype)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    candidates = [(f"num_splits={n}", {}, {"num_splits": n}) for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    return Shape("decode", f"decode hd128 {heads_q}/{heads_kv} {batch}x{length // 1024}k",
                 lambda **kw: fa4.attention_with_kvcache(q, k, v, lens, **kw), candidates)


def _backward(hd, seqlen, causal, batch=None, heads_q=None, heads_kv=None, dtype=torch.bfloat16):
    heads_q = heads_q or HIDDEN // hd
    heads_kv = heads_kv or heads_q
    batch = batch or max(1, TOKENS // seqlen)
    q, dout = (torch.randn(batch, seqlen, heads_q, hd, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(batch, seqlen, heads_kv, hd, device="cuda", dtype=dtype) for _ in range(2))
    out, lse = fa4.attention(q, k, v, causal=causal, return_lse=True)
    scale = hd ** -0.5
    right = 0 if causal else -1

    def call(**kw):
        torch.ops.fa4.bwd(dout, q, k, v, out, lse, None, scale, causal, -1, right, 0.0, False)
    gqa = "" if heads_kv == heads_q else f" gqa {heads_q}/{heads_kv}"
    return Shape("bwd", f"bwd hd{hd} {batch}x{seqlen}{gqa} {'causal' if causal else 'full'}", call,
                 _bwd_candidates(causal, hd))


def shapes(quick: bool = False):
    """The swept shapes, built lazily (each allocates its inputs when reached)."""
    out = []
    for hd, seqlen, causal in itertools.product((64, 128, 256), (512, 2048, 8192, 32768), (False, True)):
        out.append(lambda hd=hd, s=seqlen, c=causal: _dense(hd, s, c))
    for batch, causal in itertools.product((1, 64), (False, True)):
        out.append(lambda b=batch, c=causal: _dense(128, 1024, c, batch=b, heads_q=16))
    for seqlen, causal in itertools.product((1024, 4096, 16384), (False, True)):
        out.append(lambda s=seqlen, c=causal: _dense(128, s, c, batch=max(1, 16384 // s), heads_q=32, heads_kv=8))
    for hd, causal in itertools.product((64, 128), (False, True)):
        out.append(lambda hd=hd, c=causal: _varlen(hd, c))
    for batch, length in itertools.product((1, 8, 64), (4096, 32768)):
        out.append(lambda b=batch, n=length: _decode(b, n))
    # Groups of 16 and 64 query heads per K/V head: one tile of 16 or 64 live rows per K/V head.
    for (heads_q, heads_kv), (batch, length) in itertools.product(((32, 2), (64, 1)),
                                                                  ((1, 4096), (1, 32768), (1, 131072), (8, 32768))):
        out.append(lambda b=batch, n=length, h=heads_q, g=heads_kv: _decode(b, n, h, g))
    for hd, seqlen, causal in itertools.product((64, 128, 256), (1024, 4096, 16384), (False, True)):
        out.append(lambda hd=hd, s=seqlen, c=causal: _backward(hd, s, c))
    for seqlen, causal in itertools.product((4096, 16384), (False, True)):
        out.append(lambda s=seqlen, c=causal: _backward(128, s, c, batch=16384 // s, heads_q=32, heads_kv=8))
    return out[::7] if quick else out


class _Env:
    """FA4_ settings for one capture (the operators read them at each call)."""

    def __init__(self, env):
        self.env = env

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch_key(kind):
    record = _native.last_launch("bwd" if kind == "bwd" else "fwd")
    if record is None:
        return None
    fields = (("store_first", "rotate", "launch_group") if kind == "bwd"
              else ("pack_gqa", "tail_ctas", "grid", "heads_per_group"))
    return (record["name"],) + tuple(record[f] for f in fields)


def _capture(shape, env, kwargs):
    """(graph, launch key) of CALLS calls under the candidate's settings; None where it cannot run."""
    with _Env(env):
        try:
            shape.call(**kwargs)  # warm-up, outside the graph (and the key of what it launched)
            torch.cuda.synchronize()
            key = _launch_key(shape.kind)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(CALLS):
                    shape.call(**kwargs)
        except (RuntimeError, ValueError, NotImplementedError):
            return None, None
    return graph, key


def _replay_ms(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def sweep_shape(shape, rounds: int):
    """{"auto": (key, ms), "candidates": [(label, key, ms)]}: distinct launches timed."""
    auto_graph, auto_key = _capture(shape, {}, {})
    graphs = {auto_key: auto_graph}
    labels = {auto_key: "auto"}
    for label, env, kwargs in shape.candidates:
        graph, key = _capture(shape, env, kwargs)
        if graph is None or key in graphs:
            continue
        graphs[key], labels[key] = graph, label
    keys = list(graphs)
    times = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(_replay_ms(graphs[key]))
    medians = {key: statistics.median(t) for key, t in times.items()}
    return {"auto": (auto_key, medians[auto_key]),
            "candidates": [(labels[key], key, medians[key]) for key in keys]}


def regret_summary(rows) -> tuple[float, float]:
    """(geometric-mean regret, worst regret) over rows of (label, auto_ms, best_ms, ...)."""
    regrets = [auto / best for _, auto, best, *_ in rows]
    return math.exp(sum(map(math.log, regrets)) / len(regrets)), max(regrets)


def markdown(rows, device: str) -> str:
    geo, worst = regret_summary(rows)
    lines = [
        "# Run-time strategy choices, measured",
        "",
        f"`python -m fa4.bench --sweep` on {device}: per shape, every run-time strategy (fa4/bench_sweep.py "
        "says which) timed as a CUDA graph of back-to-back calls (GPU time), the automatic choice's time, "
        "the best candidate's, and the regret (automatic / best). bf16; forward shapes 32k tokens of hidden "
        "2048 unless the label says otherwise; backward shapes the backward op alone.",
        "",
        f"Geometric-mean regret {geo:.3f}, worst {worst:.3f} (targets: <= 1.03, <= 1.15).",
        "",
        "A launch is written as its variant and the decisions taken for it: forward (pack-GQA factor, split-tail "
        "CTAs (0: none), grid (2147483647: one CTA per tile), query heads per L2 group); backward (first K/V "
        "block stores dQ, rotation period, launch group). A best candidate named without a launch is the "
        "automatic one; differences under ~2% are within run-to-run noise.",
        "",
        "| shape | automatic choice | ms | best candidate | ms | regret |",
        "|---|---|---:|---|---:|---:|",
    ]
    for label, auto, best, auto_desc, best_desc in rows:
        lines.append(f"| {label} | {auto_desc} | {auto:.3f} | {best_desc} | {best:.3f} | {auto / best:.3f} |")
    return "\n".join(lines) + "\n"


def _describe(key) -> str:
    name, *decisions = key
    return f"{name.replace('fa4_', '').replace('_sm_90a', '')} {tuple(decisions)}"


def run(args) -> None:
    rows = []
    for make in shapes(args.sweep_quick):
        shape = make()
        if args.sweep_only and args.sweep_only not in shape.label:
            continue
        result = sweep_shape(shape, args.sweep_rounds)
        auto_key, auto_ms = result["auto"]
        best_label, best_key, best_ms = min(result["candidates"], key=lambda c: c[2])
        rows.append((shape.label, auto_ms, best_ms, _describe(auto_key),
                     best_label if best_key == auto_key else f"{best_label}: {_describe(best_key)}"))
        print(f"{shape.label}: auto {auto_ms:.3f} ms, best {best_ms:.3f} ({best_label}), regret "
              f"{auto_ms / best_ms:.3f}  [{len(result['candidates'])} distinct launches]", flush=True)
        del shape, result
        torch.cuda.empty_cache()
    text = markdown(rows, torch.cuda.get_device_name())
    print("\n" + text)
    if args.sweep_out:
        with open(args.sweep_out, "w") as f:
            f.write(text)
