"""Where a training step's GPU time goes: per-kernel device time of one forward + backward step,
fa4 beside SDPA-cuDNN, from the torch profiler (diagnostics for the backward's tuning).

    python3 scripts/bwd_breakdown.py [--head-dims 64 128 256] [--seqlens 1024 4096 16384] [--window 1024]
                                     [--docs 8] [--summary] [--no-peer]

Setup as fa4.bench (bf16, 16k tokens per batch, hidden 2048). For each case: microseconds per
step of each kernel (summed over its launches, mean over the profiled steps), the kernels'
total, and the share of the backward's auxiliary kernels (statistics, zeroing, dQ conversion)
in fa4's step. ``--docs N``: also N random-length causal documents packed in the 16k tokens
(fa4.attention_varlen, the documents of ``fa4.bench --varlen-docs``), per head dim.
"""
import argparse
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import fa4


def kernel_us(step, steps: int = 5) -> dict:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per[evt.name] += evt.device_time / steps
    return per


def short(name: str) -> str:
    for key, label in (("bwd_pre", "fa4 bwd preprocess"), ("fa4_bwd", "fa4 bwd"), ("fa4_fwd", "fa4 fwd"),
                       ("kernel_cutlass", "fa4 kernel")):
        if key in name:
            return label + " (" + name[-40:] + ")"
    return name[:90]


def report(title: str, per: dict, summary: bool) -> None:
    total = sum(per.values())
    if summary:  # one line: the total and each kernel taking over 1% of it
        parts = ", ".join(f"{short(n).split(' (')[0]} {us:.0f}" for n, us in sorted(per.items(), key=lambda kv: -kv[1])
                          if us > 0.01 * total)
        print(f"  {title}: {total:8.1f} us  ({parts})")
        return
    print(f"  {title}: {total:8.1f} us per step")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"    {us:8.1f} us  {100 * us / total:5.1f}%  {short(name)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--window", type=int, default=1024, help="also a (W, 0) window at 16k tokens, hd128 (0: not)")
    ap.add_argument("--docs", type=int, default=0, help="also N packed causal documents (attention_varlen)")
    ap.add_argument("--summary", action="store_true", help="one line per provider and case")
    ap.add_argument("--no-peer", action="store_true", help="fa4 only (no SDPA cuDNN)")
    args = ap.parse_args()
    tokens, hidden = 16384, 2048
    cases = [(d, s, c, None) for d in args.head_dims for s in args.seqlens for c in (False, True)]
    if args.window:
        cases.append((128, tokens, False, args.window))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.docs:
        gen = torch.Generator().manual_seed(0)  # fa4.bench's documents
        cuts = torch.randperm(tokens - 1, generator=gen)[: args.docs - 1].add(1).sort().values
        bounds = [0] + cuts.tolist() + [tokens]
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        for d in args.head_dims:
            h = hidden // d
            q, k, v = (torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            do = torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16)

            def docs_step():
                out = fa4.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
                torch.autograd.grad(out, (q, k, v), do)
            print(f"\nhd{d} {args.docs} causal documents {bounds} heads {h}")
            report("fa4 varlen", kernel_us(docs_step), args.summary)
    for d, s, causal, window in cases:
        b, h = max(1, tokens // s), hidden // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        win = (window, 0) if window else (-1, -1)

        def fa4_step():
            torch.autograd.grad(fa4.attention(q, k, v, causal=causal, window=win), (q, k, v), do)

        print(f"\nhd{d} seqlen {s} batch {b} heads {h} causal={int(causal)} window={win}")
        report("fa4", kernel_us(fa4_step), args.summary)
        if window is None and not args.no_peer:
            qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))

            def cudnn_step():
                torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), dot)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                report("SDPA cuDNN", kernel_us(cudnn_step), args.summary)


if __name__ == "__main__":
    main()
