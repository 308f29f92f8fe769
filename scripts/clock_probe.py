"""SM clock and board power while one attention configuration runs back to back.

    python scripts/clock_probe.py [--seconds 3] [--head-dim 128] [--seqlen 16384]

For fa4 and cuDNN, causal and not, keeps the GPU busy with one configuration for a few
seconds while a thread samples ``nvidia-smi`` (SM clock, power draw), then prints the median
clock and power next to the TFLOP/s reached in that window. Tells whether two kernels differ
in work per clock or in the clock the power limit leaves them.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4
from fa4.bench import attention_flops


def sample_smi(stop: threading.Event, out: list):
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    while not stop.is_set():
        text = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()[0]
        clock, power = (float(x) for x in text.split(","))
        out.append((clock, power))
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    d, s = args.head_dim, args.seqlen
    b, h = max(1, args.tokens // s), 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        flops = attention_flops(b, h, s, d, d, causal)
        for name in ("fa4", "cuDNN"):
            if name == "fa4":
                def fn():
                    return fa4.attention(q, k, v, causal=causal)
            else:
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def fn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            samples, stop = [], threading.Event()
            thread = threading.Thread(target=sample_smi, args=(stop, samples))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            thread.start()
            start.record()
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                for _ in range(10):
                    fn()
                calls += 10
                torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
            stop.set()
            thread.join()
            ms = start.elapsed_time(end) / calls
            clocks = [c for c, _ in samples[2:]] or [float("nan")]
            powers = [p for _, p in samples[2:]] or [float("nan")]
            print(f"hd={d} s={s} causal={int(causal)} {name:6s} {flops / ms / 1e9:6.1f} TFLOP/s  "
                  f"SM clock median {statistics.median(clocks):6.0f} MHz (min {min(clocks):.0f})  "
                  f"power median {statistics.median(powers):5.0f} W  ({len(samples)} samples)", flush=True)


if __name__ == "__main__":
    main()
