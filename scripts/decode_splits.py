"""One KV-cache decoding case under several split counts (attention_with_kvcache's num_splits; 0:
the rule's choice): the split CTAs each ran and the CUDA-graph us per call (best of 5), SDPA's
beside. Cases as scripts/decode_cases.py takes them (BATCHxLENGTH[xTOKENS[xHEADS_Q/HEADS_KV]]).

    python3 scripts/decode_splits.py 1x32768x1x32/2 1x32768x1x64/1 --splits 0 8 16 32 64
"""
import argparse

import fa4
from fa4 import _native
from fa4.bench_kvcache import graph_ms
from decode_cases import best_us, case_tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 4, 8, 16, 24, 32, 48, 64])
    args = parser.parse_args()
    for case in args.cases:
        q, k, v, lens, reference = case_tensors(case)
        expected = reference().transpose(1, 2).float()
        cells = []
        for splits in args.splits:
            def fa(splits=splits):
                return fa4.attention_with_kvcache(q, k, v, lens, num_splits=splits)
            err = (fa().float() - expected).abs().max().item()
            ctas = _native.last_launch("fwd")["tail_ctas"]
            cells.append(f"{splits}:{ctas} {best_us(graph_ms, fa):.2f}" + (f" err {err:.0e}" if err > 2e-2 else ""))
        cells.append(f"SDPA {best_us(graph_ms, reference):.2f}")
        print(f"{case}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
