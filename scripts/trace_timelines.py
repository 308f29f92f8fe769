"""Record the scheduler timelines of docs/trace_*.png (issue 27): imbalanced forward calls under the
dynamic schedule and the same tiles dealt round-robin (FA4_TRACE_SCHEDULE=static), beside the
production kernel's time per call (back-to-back eager calls) to compare with the traces' makespans.

    python scripts/trace_timelines.py OUT_DIR      # then, anywhere with matplotlib:
    python -m fa4.trace OUT_DIR/varlen_long_doc.jsonl --png docs/trace_varlen_long_doc.png
"""
import sys
from pathlib import Path

import torch

import fa4
from fa4 import trace as fa4_trace
from fa4.bench_kvcache import eager_ms


def cases():
    gen = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    # One 12k-token document and 31 of 128 tokens in 16k tokens, causal, 16 heads of 128.
    lengths = [12288] + [128] * 31
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    q, k, v = (randn(sum(lengths), 16, 128) for _ in range(3))
    yield "varlen_long_doc", lambda: fa4.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    # Causal, 2 x 8k tokens, 16 heads of 128.
    qc, kc, vc = (randn(2, 8192, 16, 128) for _ in range(3))
    yield "causal_2x8k", lambda: fa4.attention(qc, kc, vc, causal=True)
    # No mask, 1 x 3k tokens, 16 heads: 384 equal tiles, the static schedule's split last round.
    qn, kn, vn = (randn(1, 3072, 16, 128) for _ in range(3))
    yield "split_tail_1x3k", lambda: fa4.attention(qn, kn, vn)
    # Decoding one token against 4k and 32k cached tokens, 32 query / 8 K/V heads of 128: eight
    # packed tiles split over the SMs (issue 26's small-batch rows).
    for cached in (4096, 32768):
        qd = randn(1, 1, 32, 128)
        kd, vd = (randn(1, cached, 8, 128) for _ in range(2))
        lengths = torch.full((1,), cached, device="cuda", dtype=torch.int32)
        yield f"decode_1x{cached // 1024}k", lambda qd=qd, kd=kd, vd=vd, lengths=lengths: fa4.attention_with_kvcache(
            qd, kd, vd, lengths)


def main(out_dir: str, only: list[str]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(torch.cuda.get_device_name())
    for name, run in cases():
        if only and name not in only:
            continue
        path = out / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        plain = eager_ms(run, iters=3, calls=10) * 1e3
        # A traced call waits for its kernel and writes the file before returning: its events would
        # time that too, so the trace's own makespan (first tile start to last tile end) stands in.
        for schedule in (None, "static"):
            with fa4.trace(path, schedule=schedule):
                for _ in range(3):
                    run()
        print(f"{name}: production kernel {plain:.1f} us per back-to-back eager call")
        for call in fa4_trace.load(path)[2::3]:  # the last call of each schedule
            s = fa4_trace.summary(call)
            print(f"  {fa4_trace.describe(call)}\n    " +
                  ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()))


if __name__ == "__main__":
    # python scripts/trace_timelines.py OUT_DIR [CASE...]: every case, or the named ones
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fa4_out/traces", sys.argv[2:])
