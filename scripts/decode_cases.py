"""KV-cache calls for A/B runs of builds (`scripts/decode_ab.sh` swaps the libraries; this times
one): per case, the kernel fa4 ran (variant, pack-GQA factor, split CTAs), its error against
SDPA, and the CUDA-graph and "step" us per call (fa4.bench_kvcache's graph_ms / step_ms: the
best of 5) beside SDPA's. bf16, head_dim 128, contiguous caches filled to their length.

    python3 scripts/decode_cases.py BATCHxLENGTH[xTOKENS[xHEADS_Q/HEADS_KV]][+append][+bhsd] ...
    python3 scripts/decode_cases.py 1x4096 1x4096x4 1x4096x1x32/2 1x32768x1x64/1

TOKENS (default 1) are causal query tokens at the sequence's end (speculative verification);
HEADS default 32/8; +append: the call appends the tokens' K/V (k_new/v_new) as the sequence's
last ones, into the same slots each call; +bhsd: the caches stored head by head, (batch, heads,
length, dims), and passed as (batch, length, heads, dims) views (each head's rows contiguous,
against 256-byte rows at a heads x 256-byte stride; SDPA reads the same memory). Add
``--no-step`` to skip the step column, ``--no-sdpa`` to skip SDPA.
"""
import sys

import torch
import torch.nn.functional as F

import fa4
from fa4 import _native
from fa4.bench_kvcache import graph_ms, step_ms


def parse(case: str):
    case = case.split("+")[0]
    parts = case.split("x")
    batch, length = int(parts[0]), int(parts[1])
    tokens = int(parts[2]) if len(parts) > 2 else 1
    heads_q, heads_kv = (int(h) for h in parts[3].split("/")) if len(parts) > 3 else (32, 8)
    return batch, length, tokens, heads_q, heads_kv


def case_tensors(case: str):
    """(q, k, v, lens, reference) of a case: bf16 hd128 caches filled to their length (head by head
    with +bhsd), the query tokens the sequence's last, and SDPA's call on the same memory."""
    batch, length, tokens, heads_q, heads_kv = parse(case)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if "+bhsd" in case:
        k, v = (torch.randn(batch, heads_kv, length, 128, device="cuda", dtype=torch.bfloat16,
                            generator=gen).transpose(1, 2) for _ in range(2))
    else:
        k, v = (torch.randn(batch, length, heads_kv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
    q = torch.randn(batch, tokens, heads_q, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    # The tokens are the sequence's last: causal, aligned to the bottom right.
    visible = torch.ones(tokens, length, dtype=torch.bool, device="cuda").tril(length - tokens)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def reference():
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=None if tokens == 1 else visible,
                                              enable_gqa=True)
    return q, k, v, lens, reference


def best_us(timer, fn) -> float:
    return min(timer(fn, 10) for _ in range(5)) * 1e3


def main(argv):
    step = "--no-step" not in argv
    sdpa = "--no-sdpa" not in argv
    for case in (a for a in argv if not a.startswith("--")):
        _, length, tokens, _, _ = parse(case)
        append = "+append" in case
        q, k, v, lens, reference = case_tensors(case)

        # +append: the tokens' K/V are written into the cache's last slots by the call (the same
        # slots every call), attended to as the sequence's end.
        k_new = v_new = None
        if append:
            k_new, v_new = k[:, length - tokens:].clone(), v[:, length - tokens:].clone()
        cached = lens - tokens if append else lens

        def fa():
            return fa4.attention_with_kvcache(q, k, v, cached, k_new=k_new, v_new=v_new)

        out = fa()
        launch = _native.last_launch("fwd")
        err = (out.float() - reference().transpose(1, 2).float()).abs().max().item()
        cells = [f"{launch['name'].removeprefix('fa4_fwd_sm_90a_')} pack {launch['pack_gqa']} "
                 f"split {launch['tail_ctas']} err {err:.1e}", f"fa4 graph {best_us(graph_ms, fa):7.2f}"]
        if step:
            cells.append(f"step {best_us(step_ms, fa):7.2f}")
        if sdpa:
            cells.append(f"SDPA graph {best_us(graph_ms, reference):7.2f}")
            if step:
                cells.append(f"step {best_us(step_ms, reference):7.2f}")
        print(f"{case}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
