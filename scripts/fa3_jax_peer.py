"""FlashAttention-3 (upstream's Hopper kernels, forward and backward) timed through the
``flash-attn3-jax`` wheel, on the grid ``python -m fa4.bench --backward`` uses: bf16, --tokens per
batch, hidden --hidden, (B, S, H, D). Prints TFLOP/s of the forward, the backward alone and a
forward + backward step (FLOPs 1x, 2.5x and 3.5x the forward's, as fa4.bench counts them).

Run beside fa4.bench in the same device call (the wheel carried in .whl, installed to
/tmp/site; JAX is on the GPU machine; a separate process keeps JAX's and torch's allocators apart):

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site python3 scripts/fa3_jax_peer.py
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flash_attn3_jax import flash_mha
from flash_attn3_jax.flash import _flash_mha_bwd, _flash_mha_fwd


def flops(batch, heads, seqlen, dim, causal):
    return 4 * batch * heads * seqlen * seqlen * dim / (2 if causal else 1)


def median_seconds(fn, args, iters=10, samples=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The wheel's kernels stop at head_dim 128 ("FlashAttention forward only supports head
    # dimension at most 128", seen on the H100 machine, 2026-11-25).
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    key = jax.random.PRNGKey(0)
    print("FA3 (flash-attn3-jax): TFLOP/s  fwd | bwd | fwd+bwd")
    for dim in args.head_dims:
        heads = args.hidden // dim
        for causal in (False, True):
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                shape = (batch, seqlen, heads, dim)
                q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) for i in range(4))
                scale = dim ** -0.5
                window = (-1, -1)
                fwd = jax.jit(lambda q, k, v: _flash_mha_fwd(q, k, v, scale, causal, window))
                out, lse = fwd(q, k, v)
                bwd = jax.jit(lambda do, q, k, v, o, lse: _flash_mha_bwd(do, q, k, v, o, lse, scale, causal, window))
                step = jax.jit(lambda q, k, v, do: jax.vjp(
                    lambda q, k, v: flash_mha(q, k, v, softmax_scale=scale, is_causal=causal), q, k, v)[1](do))
                f = flops(batch, heads, seqlen, dim, causal)
                t_f = median_seconds(fwd, (q, k, v))
                t_b = median_seconds(bwd, (do, q, k, v, out, lse))
                t_s = median_seconds(step, (q, k, v, do))
                print(f"FA3 hd={dim:3d} seqlen={seqlen:5d} causal={int(causal)}  {f / t_f / 1e12:6.1f} | "
                      f"{2.5 * f / t_b / 1e12:6.1f} | {3.5 * f / t_s / 1e12:6.1f}", flush=True)


if __name__ == "__main__":
    main()
