"""A/B of score_mod builds (libs under build/ab/<version>/) in one device call: per version, the
float64 GPU tests of the score_mods its library has (`-k` filter from --tests), then TFLOP/s of
useful work of fa4.flex_attention with each in-kernel score_mod the library has, and of the
causal BlockMask without one and fa4's causal kernel where it has them, forward and forward +
backward (fa4.bench.forward_and_step), bf16, 16 heads, causal BlockMask.

    run (device tool) with carry ["build/ab/A", "build/ab/B"]:
        python3 scripts/score_mod_ab.py A B A B [--head-dim 128] [--tokens 16384] [--tests relbias-d128]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "torch_ops", "fa4", "_native")


def install(version):
    shutil.rmtree(NATIVE, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "build", "ab", version), NATIVE)


def time_version(args):
    """In a fresh process (the library is loaded once per process)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import fa4
    from fa4.bench import forward_and_step

    names = {v["name"] for v in json.load(open(os.path.join(NATIVE, "variants.json")))["variants"]}
    tag = f"bf16_d{args.head_dim}x{args.head_dim}"
    tokens, heads, d = args.tokens, 2048 // args.head_dim, args.head_dim
    torch.manual_seed(0)
    causal = create_block_mask(fa4.masks.causal(), None, None, tokens, tokens, device="cuda")
    plain = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, tokens, tokens, device="cuda")
    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
    table = (0.1 * torch.randn(heads, 2 * args.table_center + 1, device="cuda")).requires_grad_()
    fns = {}
    if any(n.startswith(f"fa4_fwd_sm_90a_{tag}_causal") for n in names):
        fns["causal kernel"] = lambda q, k, v: fa4.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    if f"fa4_fwd_sm_90a_{tag}_sparse" in names:
        fns["sparse none"] = lambda q, k, v: fa4.flex_attention(q, k, v, block_mask=plain)
    learned_slopes = slopes.clone().requires_grad_()  # the slopes' gradient too
    for name, kind, mod in (("alibi", "alibi", fa4.score_mods.alibi(slopes)),
                            ("alibi learned", "alibi", fa4.score_mods.alibi(learned_slopes)),
                            ("relbias", "relbias", fa4.score_mods.relative_bias(table))):
        if f"fa4_fwd_sm_90a_{tag}_sparse_{kind}" in names:
            fns[name] = lambda q, k, v, mod=mod: fa4.flex_attention(q, k, v, score_mod=mod, block_mask=causal)
    sets = [tuple(torch.randn(1, heads, tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3)) for _ in range(3)]
    dout = torch.randn(1, heads, tokens, d, device="cuda", dtype=torch.bfloat16)
    flops = 2 * heads * (tokens * (tokens + 1) // 2) * 2 * d
    for what, med in forward_and_step(fns, sets, dout, flops, args):
        print(f"  {what}: " + "  ".join(f"{n} {t:6.1f}" for n, t in med.items()), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--table-center", type=int, default=256)
    parser.add_argument("--tests", default="", help="pytest -k filter over tests/gpu/test_score_mods_gpu.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.timing_only:
        time_version(args)
        return
    for version in args.versions:
        install(version)
        print(f"=== {version}", flush=True)
        if args.tests:
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/gpu/test_score_mods_gpu.py", "-k",
                            args.tests, "-p", "no:cacheprovider"], cwd=ROOT, check=False)
        subprocess.run([sys.executable, __file__, version, "--timing-only", "--head-dim", str(args.head_dim),
                        "--tokens", str(args.tokens), "--table-center", str(args.table_center),
                        "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--iters", str(args.iters)],
                       cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
