"""One KV-cache decoding shape (bf16 hd128, 32/8 heads or HEADS_Q/HEADS_KV, one query token or
SEQLEN_Q causal ones: speculative verification), for profilers: the kernels each call launches
and their GPU times (torch.profiler over CUDA-graph replays) and the boundaries between them
(programmatic dependent launch lets a kernel start before its predecessor ends), fa4 beside SDPA;
or, with ``ncu``, just the calls to profile.

    python3 scripts/decode_profile.py BATCH LENGTH [kernels|fa4|sdpa|trace] [NUM_SPLITS[,NUM_SPLITS...]] \
        [SEQLEN_Q] [HEADS_Q/HEADS_KV]
    ncu --clock-control none -k regex:kvcache --launch-skip 3 --launch-count 1 \
        python3 scripts/decode_profile.py 1 4096 fa4
"""
import sys

import torch
import torch.nn.functional as F

import fa4
from fa4.bench_kvcache import captured

batch, length = int(sys.argv[1]), int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "kernels"
split_counts = [int(n) for n in sys.argv[4].split(",")] if len(sys.argv) > 4 else [0]
seqlen_q = int(sys.argv[5]) if len(sys.argv) > 5 else 1
heads_q, heads_kv = (int(h) for h in (sys.argv[6] if len(sys.argv) > 6 else "32/8").split("/"))
gen = torch.Generator(device="cuda").manual_seed(0)
k, v = (torch.randn(batch, length, heads_kv, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
q = torch.randn(batch, seqlen_q, heads_q, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
# The queries are the sequence's last seqlen_q keys' tokens: causal, aligned to the bottom right
# (as attention_with_kvcache's default); one token sees every key.
visible = torch.ones(seqlen_q, length, dtype=torch.bool, device="cuda").tril(length - seqlen_q)
calls = {
    **{("fa4" if n == 0 else f"fa4 splits={n}"): (lambda n=n: fa4.attention_with_kvcache(q, k, v, lens, num_splits=n))
       for n in split_counts},
    "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   attn_mask=None if seqlen_q == 1 else visible, enable_gqa=True),
}
if mode == "trace":  # the trace twin's timeline of a few eager calls (fa4.trace), summarised
    import tempfile

    from fa4 import trace as fa4_trace
    for n in split_counts:
        fa4.attention_with_kvcache(q, k, v, lens, num_splits=n)
        with tempfile.TemporaryDirectory() as tmp:
            with fa4.trace(f"{tmp}/decode.jsonl"):
                for _ in range(6):
                    fa4.attention_with_kvcache(q, k, v, lens, num_splits=n)
                torch.cuda.synchronize()
            traced = [fa4_trace.summary(c) for c in fa4_trace.load(f"{tmp}/decode.jsonl")[1:]]
        fields = ("makespan_us", "q_wait_us_mean", "k_wait_us_mean", "after_blocks_us_mean", "merge_wait_us_mean",
                  "merge_us_mean", "prologue_us_mean", "setup_us_mean", "role_us_mean", "schedule_us_mean",
                  "grid_wait_us_mean", "entry_spread_us", "entry_to_end_us")
        print(f"trace {batch}x{length} q{seqlen_q} {heads_q}/{heads_kv} splits={n}: " + ", ".join(
            f"{f} {sum(t.get(f, 0.0) for t in traced) / len(traced):.2f}" for f in fields))
    sys.exit(0)
if mode in ("fa4", "sdpa"):  # fa4: the first split count's call
    call = calls["sdpa"] if mode == "sdpa" else next(iter(calls.values()))
    for _ in range(6):
        call()
    torch.cuda.synchronize()
    sys.exit(0)
for name, call in calls.items():
    graph = captured(call, 20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    per_call = start.elapsed_time(end) / 20 * 1e3
    moved = 2 * batch * length * heads_kv * 128 * 2
    print(f"{name} {batch}x{length} q{seqlen_q} {heads_q}/{heads_kv}: {per_call:.1f} us per call in a graph "
          f"({moved / per_call / 1e3:.0f} GB/s)")
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = {}
    for e in events:
        kernels.setdefault(e.name, []).append(e.device_time)
    for kname, times in kernels.items():
        print(f"   {len(times) // 20} x {kname[:110]}: {sum(times) / len(times):.1f} us")
    # The replay's kernels in start order: the gap from each kernel's end to the next one's start
    # (negative where a kernel launched with programmatic dependent launch began before its
    # predecessor ended) and the start-to-start period, to set the kernels' own time apart from
    # the boundaries between them.
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    if len(spans) > 1:
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
        print(f"   boundaries: gap end->next start mean {sum(gaps) / len(gaps):.2f} us "
              f"(min {min(gaps):.2f}, max {max(gaps):.2f}); first start to last end "
              f"{spans[-1][1] - spans[0][0]:.1f} us for {len(spans)} kernels")
