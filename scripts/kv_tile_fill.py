"""Where the KV cache's long tiles pay (fa4_kv_cache_tile_family, csrc_shims/fa4_rules.c): causal
query chunks of a few to a thousand rows against a cache, on the 64-row tiles (FA4_TILES=regular)
and on the long ones (FA4_TILES=long), CUDA-graph time per call, TFLOP/s of the visible pairs, and
the family the rule picks.

    python3 scripts/kv_tile_fill.py   # needs a build with the long KV-cache tiles
"""
import torch

import fa4
from fa4 import _native
from fa4.bench_kvcache import graph_ms, with_tiles

# (batch, seqlen_q, heads_q, heads_kv, head_dim, cache length)
CASES = [(1, sq, 32, 8, 128, 32768) for sq in (8, 16, 32, 64, 100, 129, 200, 300, 512, 1024)] + [
    (4, sq, 32, 8, 128, 8192) for sq in (16, 32, 100, 129, 300)] + [
    (1, sq, 32, 8, 64, 32768) for sq in (16, 70, 100, 130, 200, 512)]


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, sq, hq, hkv, d, length in CASES:
        k = torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        full = torch.full((b,), length, dtype=torch.int32, device="cuda")
        pairs = sq * (length - sq) + sq * (sq + 1) // 2
        flops = 4 * pairs * d * hq * b
        cells = []
        for family in ("regular", "long"):
            call = with_tiles(family, lambda: fa4.attention_with_kvcache(q, k, v, full))
            us = 1e3 * graph_ms(call, iters=7, calls=10)
            launch = _native.last_launch("fwd")
            cells.append(f"{family} {us:8.2f} us {flops / us / 1e6:6.1f} TF/s (pack {launch['pack_gqa']}, "
                         f"split {launch['tail_ctas']})")
        fa4.attention_with_kvcache(q, k, v, full)
        auto = "long" if _native.last_launch("fwd")["name"].endswith("_longseq") else "regular"
        print(f"{b} x {sq:4d} q, {hq}/{hkv}, hd{d}, {length // 1024}k: " + " | ".join(cells) + f" | rule: {auto}",
              flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
