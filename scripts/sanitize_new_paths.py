"""Small runs of the kernel paths compute-sanitizer should see (racecheck / synccheck):
three consumer warpgroups (hd64, hd128's long-sequence tiles) and four (hd64's short-sequence
tiles, causal too), packed sequences' tile decode over 40 and 150 documents, warpgroups sitting out
diagonal blocks (hd64, and hd256 with several tiles per CTA: 256 tiles below), pack-GQA (dense
and varlen), dynamic scheduling with the mbarrier tile hand-off cycling through its slots,
per-warpgroup epilogues, causal tiles shifted above row 0 (dense, varlen, and the whole-tile
epilogue of hd256, O in V's buffer),
split tails (partials written and merged across CTAs, flags reset; FA4_SPLIT_TAIL=1 below),
LSE rows stored by bulk copy from shared memory (masked variants, rows aligned: seqlen 1000),
K/V steps whose guessed row max fails and is redone (speculative_max).

    compute-sanitizer --tool racecheck python3 scripts/sanitize_new_paths.py
"""
import os

import torch

os.environ["FA4_SPLIT_TAIL"] = "1"  # split every partial last round (fa4.settings reads it per call)
os.environ["FA4_TILES"] = "regular"  # the regular tile families unless said below (read per call)
import fa4  # noqa: E402
from fa4.testing import rising_scores  # noqa: E402

torch.manual_seed(0)
dev, bf16 = "cuda", torch.bfloat16
# hd64: 192-row tiles, 3 consumer warpgroups, causal (dynamic scheduler) and not (static).
q, k, v = (torch.randn(2, 500, 4, 64, device=dev, dtype=bf16) for _ in range(3))
for causal in (False, True):
    fa4.attention(q, k, v, causal=causal)
# hd64's short-sequence tiles: 256 rows, 4 consumer warpgroups (112 registers each), static
# schedule with more tiles than SMs and a split last round (600 tiles), and pack-GQA rows.
os.environ["FA4_TILES"] = "short"
q, k, v = (torch.randn(3, 1000, 50, 64, device=dev, dtype=bf16) for _ in range(3))
fa4.attention(q, k, v)
# ... causal (dynamic schedule), where warpgroups sit out up to three diagonal blocks per tile.
fa4.attention(q, k, v, causal=True)
q = torch.randn(2, 37, 8, 64, device=dev, dtype=bf16)
k, v = (torch.randn(2, 300, 2, 64, device=dev, dtype=bf16) for _ in range(2))
fa4.attention(q, k, v, pack_gqa=True)
# hd128's long-sequence tiles: 192 rows, 3 consumer warpgroups, 80-key blocks (a partial last
# one), split last round.
os.environ["FA4_TILES"] = "long"
q, k, v = (torch.randn(1, 1000, 30, 128, device=dev, dtype=bf16) for _ in range(3))
fa4.attention(q, k, v)
# ... causal (dynamic schedule, dead blocks skipped, guessed row max off the diagonal).
fa4.attention(q, k, v, causal=True)
os.environ["FA4_TILES"] = "regular"
# pack-GQA, dense: 8 query heads on 2 K/V heads, short queries, causal.
q = torch.randn(2, 37, 8, 128, device=dev, dtype=bf16)
k, v = (torch.randn(2, 300, 2, 128, device=dev, dtype=bf16) for _ in range(2))
fa4.attention(q, k, v, causal=True, pack_gqa=True)
fa4.attention(q, k, v, pack_gqa=True)
# pack-GQA, varlen, documents scheduled longest first.
lens = [5, 0, 200, 31, 140]
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
q = torch.randn(sum(lens), 8, 128, device=dev, dtype=bf16)
k, v = (torch.randn(sum(lens), 2, 128, device=dev, dtype=bf16) for _ in range(2))
fa4.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, pack_gqa=True)
# More tiles than SMs (each CTA takes several through the hand-off ring), shifted causal tiles.
q, k, v = (torch.randn(4, 1000, 8, 128, device=dev, dtype=bf16) for _ in range(3))
fa4.attention(q, k, v, causal=True)
fa4.attention(q, k, v, window=(100, 20))
# Varlen without pack-GQA: shifted first tiles, rows above a document's start not stored.
q, k, v = (torch.randn(sum(lens), 2, 128, device=dev, dtype=bf16) for _ in range(3))
fa4.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
# 40 documents (one of them empty): the tile decode's two rounds of 32 sequences per warp, the
# CTA's own longest-first ranks in shared memory, and the producer handing the consumers decoded
# tiles through every hand-off slot; hd64's three consumer warpgroups too. 150 documents: the
# host's order (more than tile_scheduler.SEQ_ORDER_IN_KERNEL).
for n, runs in ((40, ((128, True), (128, False), (64, True))), (150, ((128, True),))):
    lens_n = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    lens_n[3] = 0
    cu_n = torch.tensor([0] + torch.tensor(lens_n).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    for d, causal in runs:
        q, k, v = (torch.randn(sum(lens_n), 4, d, device=dev, dtype=bf16) for _ in range(3))
        fa4.attention_varlen(q, k, v, cu_n, cu_n, max(lens_n), max(lens_n), causal=causal)
# hd256: O staged in V's buffer (the producer holds the next tile's V loads until the O store
# has read it), whole-tile epilogue, shifted; more tiles than SMs, TMA-stored and row-copied
# (pack-GQA) tiles.
q, k, v = (torch.randn(1, 300, 2, 256, device=dev, dtype=bf16) for _ in range(3))
fa4.attention(q, k, v, causal=True)
q, k, v = (torch.randn(2, 1000, 16, 256, device=dev, dtype=bf16) for _ in range(3))
fa4.attention(q, k, v)
fa4.attention(q, k, v, causal=True)
q = torch.randn(2, 37, 8, 256, device=dev, dtype=bf16)
k, v = (torch.randn(2, 300, 2, 256, device=dev, dtype=bf16) for _ in range(2))
fa4.attention(q, k, v, pack_gqa=True)
# Split tails: full rounds then a split last round (hd128, per-warpgroup epilogue), tiles split
# many ways (hd256: whole-tile epilogue, O in V's buffer), hd64's three warpgroups, decoding.
q, k, v = (torch.randn(1, 300, 150, 128, device=dev, dtype=bf16) for _ in range(3))
fa4.attention(q, k, v)
q, k, v = (torch.randn(1, 130, 2, 256, device=dev, dtype=bf16) for _ in range(3))
k, v = (torch.randn(1, 3000, 2, 256, device=dev, dtype=bf16) for _ in range(2))
fa4.attention(q, k, v)
q, k, v = (torch.randn(1, 400, 3, 64, device=dev, dtype=bf16) for _ in range(3))
fa4.attention(q, k, v)
q = torch.randn(2, 1, 32, 128, device=dev, dtype=bf16)
k, v = (torch.randn(2, 4000, 8, 128, device=dev, dtype=bf16) for _ in range(2))
fa4.attention(q, k, v, causal=True)
# Guessed row maxima that fail (speculative_max): scores rising by ~1.6 powers of two per key
# towards key 0, visited last, so every K/V step after a tile's first redoes its block
# (hd128 regular, hd64's 192-row tiles, hd256, then hd128's long tiles, whose consumers
# rebuild the split schedule at each tile).
for d in (128, 64, 256):
    q, k, v = rising_scores(1, 500, 700, 4, 4, d, d, device=dev)
    fa4.attention(q.to(bf16), k.to(bf16), v.to(bf16))
os.environ["FA4_TILES"] = "long"
q, k, v = rising_scores(1, 500, 700, 4, 4, 128, 128, device=dev)
fa4.attention(q.to(bf16), k.to(bf16), v.to(bf16))
os.environ["FA4_TILES"] = "regular"
torch.cuda.synchronize()
print("done")
