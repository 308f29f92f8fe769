"""Same-run A/B of fa4's run-time backward settings: forward + backward steps timed under several
FA4_* environments in one process (fa4 reads its run-time settings at every call), the
settings rotated between rounds like fa4.bench's providers, so clock and temperature drift
land on all of them alike.

    python3 scripts/bwd_ab.py base:FA4_BWD_STORE_FIRST=0,FA4_BWD_ROTATE=0 new: \\
        [--head-dims 128 64 256] [--seqlens 1024 4096 16384] [--window 1024] [--docs 8] [--group 4] [--hidden 4096]
        [--rounds 3] [--iters 10]

Each positional argument is NAME:VAR=VALUE,... (an empty list: the defaults; ``deterministic=1``
is not a variable but runs that setting's steps with ``deterministic=True``). Setup as
fa4.bench (bf16, 16k tokens per batch, hidden 2048); TFLOP/s of fwd+bwd (3.5x the forward's
FLOPs, useful FLOPs for the window row), the ratio of each setting to the first.
"""
import argparse
import os

import torch

import fa4
from fa4 import _native, bench


def settings(text: str) -> tuple[str, dict]:
    name, _, assignments = text.partition(":")
    env = dict(a.split("=", 1) for a in assignments.split(",") if a)
    return name, env


def launches(fns, inputs) -> str:
    """What each setting's backward launched (one step each; autograd's thread made the launch):
    the variant, and the rotation period, launch group and clusters the host chose."""
    cells = []
    for name, fn in fns.items():
        fn(*inputs)
        record = _native.last_launch("bwd", any_thread=True)
        cell = f"{name} {record['name'].removeprefix('fa4_bwd_sm_90a_')} rotate {record['rotate']} " \
               f"group {record['launch_group']}"
        if record["active_clusters"] >= 0:
            cell += f" clusters held {record['active_clusters']}"
        cells.append(cell)
    return "; ".join(cells)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("settings", nargs="+", type=settings)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--window", type=int, default=0, help="also a (W, 0) window at 16k tokens, hd128")
    ap.add_argument("--docs", type=int, default=0,
                    help="also N random-length causal documents packed in 16k tokens (fa4.bench's), per head dim")
    ap.add_argument("--group", type=int, default=1, help="query heads per K/V head (GQA)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    # One step per sample: the GPU spin ahead of it (~2.5 ms) outlasts a step's host time, so
    # short steps are timed on the GPU, not the host.
    ap.add_argument("--calls-per-sample", type=int, default=1)
    args = ap.parse_args()
    tokens, hidden = 16384, args.hidden
    cases = [(d, s, c, None) for d in args.head_dims for c in {"both": [False, True], "yes": [True], "no": [False]}[
        args.causal] for s in args.seqlens]
    if args.window:
        cases.append((128, tokens, False, args.window))
    if args.docs:
        cases += [(d, 0, True, None) for d in args.head_dims]  # seqlen 0: the documents
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("fwd+bwd TFLOP/s; " + ", ".join(f"{n} = {e or 'defaults'}" for n, e in args.settings))
    keys = {k for _, e in args.settings for k in e} - {"deterministic"}
    gen = torch.Generator().manual_seed(0)  # fa4.bench's documents
    cuts = torch.randperm(tokens - 1, generator=gen)[: max(args.docs, 2) - 1].add(1).sort().values
    bounds = [0] + cuts.tolist() + [tokens]
    lengths = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    for d, s, causal, window in cases:
        docs = s == 0
        b, h = (1, hidden // d) if docs else (max(1, tokens // s), hidden // d)
        win = (window, 0) if window else (-1, -1)
        if docs:
            pairs = sum(bench.visible_pairs(n, n, -1, 0) for n in lengths)
        else:
            pairs = bench.visible_pairs(s, s, window, 0) if window else s * s // (2 if causal else 1)
        flops = 3.5 * 4 * b * h * pairs * d
        rows = tokens if docs else s

        lead = () if docs else (b,)  # packed documents: (tokens, heads, dim)

        def make():
            out = []
            for _ in range(3):
                q = torch.randn(*lead, rows, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k, v = (torch.randn(*lead, rows, h // args.group, d, device="cuda", dtype=torch.bfloat16,
                                    requires_grad=True) for _ in range(2))
                out.append((q, k, v, torch.randn(*lead, rows, h, d, device="cuda", dtype=torch.bfloat16)))
            return out

        def step_with(env):
            env = dict(env)
            deterministic = env.pop("deterministic", "0") == "1"

            def step(q, k, v, do):
                for key in keys:
                    os.environ.pop(key, None)
                os.environ.update(env)
                if docs:
                    out = fa4.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                               deterministic=deterministic)
                else:
                    out = fa4.attention(q, k, v, causal=causal, window=win, deterministic=deterministic)
                return torch.autograd.grad(out, (q, k, v), do)
            return step
        fns = {name: step_with(env) for name, env in args.settings}
        print(f"hd{d} s{s} launches: {launches(fns, make()[0])}", flush=True)
        result = bench.time_providers(fns, make, flops, args, f"hd{d} s{s}")
        first = result[args.settings[0][0]][0]
        cells = "  ".join(f"{n} {t:6.1f} ({t / first:.3f}; rounds {min(r):.0f}-{max(r):.0f})"
                          for n, (t, r) in result.items())
        what = f"{len(lengths)} causal documents" if docs else f"seqlen {s:5d} causal={int(causal)} window={win}"
        print(f"hd{d} {what}: {cells}", flush=True)


if __name__ == "__main__":
    main()
