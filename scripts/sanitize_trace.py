"""Traced forwards under compute-sanitizer (gpu_check.sh with FA4_SANITIZE=1
FA4_SANITIZE_SCRIPTS=scripts/sanitize_trace.py): each kind of trace twin once, small shapes: the
dynamic schedule claimed and dealt (causal, packed), the static one with a split tail (no mask),
a KV-cache decode split over the SMs."""
import os
import tempfile

import torch

import fa4
from fa4 import trace as fa4_trace


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v = (randn(2, 700, 4, 128) for _ in range(3))
    lengths = [900, 33, 250]
    cu = torch.tensor([0, 900, 933, 1183], device="cuda", dtype=torch.int32)
    qp, kp, vp = (randn(1183, 4, 128) for _ in range(3))
    qd, kd, vd = randn(1, 1, 32, 128), randn(1, 2048, 8, 128), randn(1, 2048, 8, 128)
    cached = torch.full((1,), 2000, device="cuda", dtype=torch.int32)
    path = os.path.join(tempfile.mkdtemp(), "trace.jsonl")
    for schedule in (None, "static"):
        with fa4.trace(path, schedule=schedule):
            fa4.attention(q, k, v, causal=True)
            fa4.attention(q, k, v)
            fa4.attention_varlen(qp, kp, vp, cu, cu, max(lengths), max(lengths), causal=True)
            fa4.attention_with_kvcache(qd, kd, vd, cached)
    torch.cuda.synchronize()
    for call in fa4_trace.load(path):
        print(fa4_trace.describe(call), fa4_trace.summary(call)["tiles"], "records")


if __name__ == "__main__":
    main()
