"""Where the block-sparse tables' build goes under torch.compile (issue 25: fa4.flex_attention
compiled rebuilds them inside the graph at every call, one bitmask slot per table entry).

    python scripts/sparse_tables_profile.py [--tokens 16384] [--heads 16] [--head-dim 128] [--impl FILE]

For the bench's two mask_mods (random blocks, half partial; causal as a plain function), prints
the compiled build's time per call (forward tables, backward's transposed tables), the eager
build's (one slot per partial tile, a host sync), and the compiled build's kernels by device
time. Run with TORCH_LOGS=output_code to see Inductor's kernels. ``--impl FILE`` builds with
another version of fa4/block_sparse.py (an A/B in one process)."""
import argparse
import importlib.util
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from fa4 import bench, block_sparse


def timed(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--impl", default=None, help="a block_sparse.py to build the tables with instead of fa4's")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    impl = block_sparse
    if args.impl:
        spec = importlib.util.spec_from_file_location("fa4.block_sparse_under_test", args.impl)
        impl = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = impl  # dataclasses and dynamo look modules up by name
        spec.loader.exec_module(impl)
    tokens = args.tokens
    dims = (torch.bfloat16, args.head_dim, args.head_dim, torch.device("cuda"))
    tile, bwd_tile = impl.kernel_tile(*dims), impl.kernel_tile(*dims, kernel="bwd")
    for label, mask_mod in bench.sparse_bench_masks(tokens).items():
        block_mask = create_block_mask(mask_mod, None, None, tokens, tokens, device="cuda")
        for name, t, transposed in (("forward", tile, False), ("backward", bwd_tile, True)):
            eager = lambda: impl.build_tables(block_mask, 1, args.heads, t, transposed)  # noqa: E731
            compiled = torch.compile(lambda: impl.build_tables(block_mask, 1, args.heads, t, transposed))
            ref, got = eager(), compiled()
            # The compiled tables have a slot per entry: compare the masks both describe.
            n_words = t[0] * t[1] // 32
            if tokens <= 4096:
                assert torch.equal(impl.dense_mask(ref, tokens, tokens), impl.dense_mask(got, tokens, tokens))
            ms_eager, ms_compiled = timed(eager), timed(compiled)
            print(f"{label}, {name} tables ({t[0]} x {t[1]}): eager {ms_eager:.3f} ms "
                  f"({ref.bits.numel() // n_words - 1} partial slots), compiled {ms_compiled:.3f} ms "
                  f"({got.bits.numel() // n_words - 1} slots)", flush=True)
            if args.no_profile:
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                compiled()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
