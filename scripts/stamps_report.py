"""Where a consumer warpgroup's cycles go, from a stamped build (FA4_DIAG_STAMPS=1, stamps.py).

Run on the GPU machine with a stamped libfa4.so in torch_ops/fa4/_native (dense, no-mask variant):
    python scripts/stamps_report.py --head-dim 128 --seqlens 1024 4096
Prints, per sequence length, the median cycles of each segment of a K/V step for each consumer
warpgroup of CTA 0 (and the step period next to the tensor-bound period the GEMMs alone would
take), a few consecutive steps of both warpgroups on one time line, and the per-tile segments.
"""
import argparse
import os
import re
import statistics
import types
from pathlib import Path

import torch

import fa4

# The record layout's constants, read from the kernel module's source (the GPU machine has no
# DSL to import it with).
_SRC = (Path(__file__).resolve().parent.parent / "src" / "fa4_kernels" / "stamps.py").read_text()
st = types.SimpleNamespace(**{m[1]: int(m[2]) for m in re.finditer(r"^([A-Z_]+) = (\d+)$", _SRC, re.M)})
st.buffer_words = lambda: st.CTAS * st.MAX_WG * (st.STEPS * st.STEP_POINTS + st.TILES * st.TILE_POINTS)

STEP_NAMES = ("K wait", "turn wait", "GEMM issue", "QK^T wait", "softmax+PV wait+convert")
TILE_NAMES = ("Q wait", "first block", "K/V loop", "last PV", "normalise O", "convert O", "sO free",
              "stmatrix", "LSE", "O store", "tile end")
TENSOR_FLOP_PER_CLK = 4096  # dense bf16 per SM per clock on H100/H200


class StampsBuffer:
    """The per-device buffer a stamped build's kernels write into (csrc_shims/fa4_ops.cpp,
    fa4_diag_stamps), zeroed and read back through the CUDA runtime."""

    def __init__(self):
        import ctypes

        torch.zeros(1, device="cuda")  # the CUDA context
        ops = ctypes.CDLL(str(fa4._native.OPS_PATH))
        self.cudart = ctypes.CDLL("libcudart.so.13")
        self.data, words = ctypes.c_void_p(), ctypes.c_int64()
        if not hasattr(ops, "fa4_diag_stamps"):
            raise SystemExit("this build has no clock stamps: rebuild with FA4_DIAG_STAMPS=1 (or tiles)")
        ops.fa4_diag_stamps(torch.cuda.current_device(), ctypes.byref(self.data), ctypes.byref(words))
        self.words = words.value

    def zero_(self):
        torch.cuda.synchronize()
        self.cudart.cudaMemset(self.data, 0, self.words * 4)

    def view(self, dtype):
        out = torch.empty(self.words, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        self.cudart.cudaMemcpy(ctypes_ptr(out), self.data, self.words * 4, 3)  # device to device
        return out.view(dtype)


def ctypes_ptr(t):
    import ctypes

    return ctypes.c_void_p(t.data_ptr())


def run(batch, seqlen, heads, head_dim, buf):
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(5):
        fa4.attention(q, k, v)
    torch.cuda.synchronize()
    buf.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fa4.attention(q, k, v)
    end.record()
    torch.cuda.synchronize()
    return buf.view(torch.float32).cpu().tolist(), start.elapsed_time(end)


def step_records(words, cta, wg):
    row = cta * st.MAX_WG + wg
    out = []
    for s in range(st.STEPS):
        rec = words[(row * st.STEPS + s) * st.STEP_POINTS:][:st.STEP_POINTS]
        out.append(rec if any(rec) else None)
    return out


def tile_records(words, cta, wg):
    off = st.CTAS * st.MAX_WG * st.STEPS * st.STEP_POINTS
    row = cta * st.MAX_WG + wg
    out = []
    for t in range(st.TILES):
        rec = words[off + (row * st.TILES + t) * st.TILE_POINTS:][:st.TILE_POINTS]
        out.append(rec if any(rec) else None)
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--tiles", default="regular", help="tile family of the variant the seqlens run (FA4_TILES)")
    args = p.parse_args()
    os.environ["FA4_SPLIT_TAIL"] = "0"  # a split would use the partials buffer the stamps go to
    os.environ["FA4_TILES"] = args.tiles
    d = args.head_dim
    heads = 2048 // d
    buf = StampsBuffer()
    # The tile shape the build chose (variants.json), for the dense no-mask bf16 variant timed.
    variant = next(v for v in fa4._native.manifest()["variants"]
                   if (v["head_dim"], v["head_dim_v"], v["dtype"], v["mask"], v["softcap"], v["varlen"])
                   == (d, d, "bf16", "none", False, False) and v["tiles"] == args.tiles)
    tile_m, tile_n = variant["tile_m"], variant["tile_n"]
    num_wg = tile_m // 64
    for seqlen in args.seqlens:
        batch = args.tokens // seqlen
        words, ms = run(batch, seqlen, heads, d, buf)
        print(f"\n=== hd{d} seqlen {seqlen} batch {batch} heads {heads}: {ms * 1e3:.0f} us for the stamped call")
        gemm_clk = 2 * 2 * tile_m * tile_n * d / TENSOR_FLOP_PER_CLK  # every WG's QK^T + PV of a step
        for cta in range(st.CTAS):
            for wg in range(num_wg):
                recs = step_records(words, cta, wg)
                full = [r for r in recs if r is not None]
                segs = [[r[i + 1] - r[i] for r in full] for i in range(st.STEP_POINTS - 1)]
                periods = sorted(recs[i + 1][0] - recs[i][0] for i in range(len(recs) - 1)
                                 if recs[i] is not None and recs[i + 1] is not None)
                if not full:  # a tiles-only build (FA4_DIAG_STAMPS=tiles)
                    print(f"cta {cta} wg {wg}: no step stamps")
                else:
                    print(f"cta {cta} wg {wg}: {len(full)} steps; median cycles: "
                          + ", ".join(f"{n} {med(s):.0f}" for n, s in zip(STEP_NAMES, segs))
                          + f"; step period {med(periods):.0f} (tensor-bound {gemm_clk:.0f}; "
                          + f"p10 {periods[len(periods) // 10] if periods else 0:.0f}, "
                          + f"p90 {periods[9 * len(periods) // 10] if periods else 0:.0f})")
                tiles = [t for t in tile_records(words, cta, wg) if t is not None]
                tsegs = [[t[i + 1] - t[i] for t in tiles] for i in range(st.TILE_POINTS - 1)]
                tper = [tiles[i + 1][0] - tiles[i][0] for i in range(len(tiles) - 1)]
                print(f"    tiles {len(tiles)}: " + ", ".join(f"{n} {med(s):.0f}" for n, s in zip(TILE_NAMES, tsegs))
                      + f"; tile period {med(tper):.0f}")
        # Both warpgroups of CTA 0 around one tile boundary, on one time line.
        ts = [tile_records(words, 0, wg) for wg in range(num_wg)]
        t_mid = next((i for i in range(4, st.TILES) if all(r[i] for r in ts)), None)
        if t_mid is not None:
            t0 = ts[0][t_mid][3]
            print("tile boundary (cycles from wg0's loop end; points: " + ", ".join(TILE_NAMES[2:]) + ")")
            for i in (t_mid, t_mid + 1):
                for wg, r in enumerate(ts):
                    if i < st.TILES and r[i]:
                        print(f"  tile {i} wg{wg}: " + " ".join(f"{x - t0:7.0f}" for x in r[i]))
        # Both warpgroups of CTA 0 on one time line, a few steps from the middle of the record.
        rs = [step_records(words, 0, wg) for wg in range(num_wg)]
        mid = next((i for i in range(40, st.STEPS) if all(r[i] for r in rs)), None)
        if mid is not None:
            t0 = rs[0][mid][0]
            print("time line (cycles from wg0's step start; points: entry, K ready, turn, issued, QK^T done, end)")
            for i in range(mid, min(mid + 4, st.STEPS)):
                for wg, r in enumerate(rs):
                    if r[i]:
                        print(f"  step {i} wg{wg}: " + " ".join(f"{x - t0:7.0f}" for x in r[i]))


if __name__ == "__main__":
    main()
