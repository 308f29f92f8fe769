"""A decoding call between other kernels, by the kind of kernel between them (issue 26's "step").

`fa4.bench --decode`'s step column puts a 1024-element `add_` after each call. A serving step puts
GEMMs there (projections), and norms. Whether the kernel before a decoding call changes what the
call costs (its launch, its shared-memory carve-out, PDL having nothing to overlap) decides how
much of the step column's gap is the call's own. Per case and spacer: CUDA-graph us per call of
the call followed by the spacer, less the spacer alone (best of 5 replays of 20 pairs), for fa4 and
SDPA; "none" is back to back. ``--profile``: instead, one replay of 20 (call, add_) pairs per case
under torch.profiler, each kernel's mean span and the mean gap before it (where the step's time goes).

    python3 scripts/decode_step_probe.py [--profile] [BATCHxLENGTH ...]     (default 1x4096 1x32768)
"""
import os
import sys

import torch

import fa4
from fa4.bench_kvcache import captured, graph_ms

sys.path.insert(0, os.path.dirname(__file__))
import decode_cases  # noqa: E402
from decode_cases import case_tensors  # noqa: E402


def spacers():
    """name -> a kernel of the kinds a serving step runs between attention calls."""
    dev = dict(device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(1024, device="cuda")
    x1, x16 = torch.randn(1, 4096, **dev), torch.randn(16, 4096, **dev)
    w = torch.randn(4096, 4096, **dev)
    xs, ws = torch.randn(256, 512, **dev), torch.randn(512, 512, **dev)
    norm_in, norm_w = torch.randn(1, 4096, **dev), torch.ones(4096, **dev)
    q, k, v, lens, _ = case_tensors("1x256")
    return {
        "add_ 1k": lambda: small.add_(1.0),
        "gemv 1x4096x4096": lambda: torch.mm(x1, w),
        "gemm 16x4096x4096": lambda: torch.mm(x16, w),
        "gemm 256x512x512": lambda: torch.mm(xs, ws),
        "rms_norm 1x4096": lambda: torch.nn.functional.rms_norm(norm_in, (4096,), norm_w),
        "fa4 decode 1x256": lambda: fa4.attention_with_kvcache(q, k, v, lens),
    }


def best_us(fn) -> float:
    return decode_cases.best_us(graph_ms, fn)


def profile(cases):
    spacer = torch.zeros(1024, device="cuda")
    for case in cases:
        q, k, v, lens, reference = case_tensors(case)
        for name, fn in {"fa4": lambda: fa4.attention_with_kvcache(q, k, v, lens), "SDPA": reference}.items():
            graph = captured(lambda fn=fn: (fn(), spacer.add_(1.0)), 20)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                            key=lambda e: e.time_range.start)
            spans, gaps = {}, {}
            for before, e in zip(events, events[1:]):
                spans.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
                gaps.setdefault(e.name, []).append(e.time_range.start - before.time_range.end)
            period = (events[-1].time_range.end - events[0].time_range.start) / 20
            print(f"{case} {name} + add_: {period:.2f} us per (call, add_), first start to last end")
            for kname in spans:
                print(f"   span {sum(spans[kname]) / len(spans[kname]):6.2f} us, gap before "
                      f"{sum(gaps[kname]) / len(gaps[kname]):5.2f}: {kname[:100]}")


def main(cases):
    space = spacers()
    alone = {name: best_us(fn) for name, fn in space.items()}
    print("spacer alone (graph us): " + ", ".join(f"{n} {t:.2f}" for n, t in alone.items()))
    for case in cases:
        q, k, v, lens, reference = case_tensors(case)
        calls = {"fa4": lambda: fa4.attention_with_kvcache(q, k, v, lens), "SDPA": reference}
        print(f"\n{case}: graph us per call, less the spacer's own")
        print(f"{'spacer':<22}" + "".join(f"{p:>10}" for p in calls) + "   fa4/SDPA")
        rows = {"none": {p: best_us(fn) for p, fn in calls.items()}}
        for name, spacer in space.items():
            rows[name] = {p: best_us(lambda fn=fn, spacer=spacer: (fn(), spacer())) - alone[name]
                          for p, fn in calls.items()}
        for name, row in rows.items():
            print(f"{name:<22}" + "".join(f"{row[p]:>10.2f}" for p in calls) + f"   {row['SDPA'] / row['fa4']:.3f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--profile"]
    (profile if "--profile" in sys.argv else main)(args or ["1x4096", "1x32768"])
