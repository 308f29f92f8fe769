"""Small runs of the KV-cache forward for compute-sanitizer (memcheck, racecheck, synccheck):
decoding with the split K/V range (pieces scaled onto short sequences, empty ones included),
paged (16-, 48- and 64-row pages) and contiguous caches, appended rows written by the consumers
and read by the producer's TMA after the KV_APPEND barrier, causal chunks of queries (static
schedule, split like a decoding step) with appends, explicit split counts, a local window
(dynamic schedule), page ids past the cache (clamped: no access outside it), and verification
tiles whose pieces all merge, groups of 16 to 64 query heads per K/V head, and chunked prefill on
the long tiles. Calls whose rows
see every key (one token; non-causal without a window) run the unmasked twin
(catalog.KV_CACHE_TWIN_MASKS), with rows to append its append twin (rows copied into the loaded
stages, or waited for where they straddle two blocks or exceed kv_cache.PATCHED_ROWS), the others
the window kernel.

    compute-sanitizer --tool memcheck python3 scripts/sanitize_kv_cache.py
"""
import torch

import fa4

torch.manual_seed(0)
dev, bf16 = "cuda", torch.bfloat16
b, hq, hkv, d = 3, 16, 4, 128
lengths = torch.tensor([0, 37, 1500], dtype=torch.int32, device=dev)
q1 = torch.randn(b, 1, hq, d, device=dev, dtype=bf16)
q7 = torch.randn(b, 7, hq, d, device=dev, dtype=bf16)
for page in (16, 48, 64):
    max_pages = -(-2048 // page)
    k = torch.randn(b * max_pages + 1, page, hkv, d, device=dev, dtype=bf16)
    v = torch.randn_like(k)
    table = torch.randperm(b * max_pages, device=dev).to(torch.int32).reshape(b, max_pages)
    for q in (q1, q7):
        sq = q.shape[1]
        new = torch.randn(b, sq, hkv, d, device=dev, dtype=bf16)
        fa4.attention_with_kvcache(q, k, v, lengths, k_new=new, v_new=new, page_table=table)
        fa4.attention_with_kvcache(q, k, v, lengths, page_table=table, causal=False)
        fa4.attention_with_kvcache(q, k, v, lengths, page_table=table, num_splits=5)
    bad = table.clone()
    bad[:, -1] = 1 << 20  # past the cache: clamped on the device
    fa4.attention_with_kvcache(q1, k, v, torch.full_like(lengths, 2047), page_table=bad)
k = torch.randn(b + 1, 4096, hkv, d, device=dev, dtype=bf16)
v = torch.randn_like(k)
index = torch.tensor([3, 0, 1], dtype=torch.int32, device=dev)
new = torch.randn(b, 1, hkv, d, device=dev, dtype=bf16)
fa4.attention_with_kvcache(q1, k, v, lengths, k_new=new, v_new=new, cache_batch_idx=index)
fa4.attention_with_kvcache(q1, k, v, lengths, cache_batch_idx=index, window=(200, 0), causal=False, softcap=10.0)
# Verification of 8 tokens over 4 tiles: each split 16 ways, every piece folding a share of the
# partials (split_partials.distributes), twice (the tile counters reset for the next launch).
q8 = torch.randn(1, 8, hq, d, device=dev, dtype=bf16)
new8 = torch.randn(1, 8, hkv, d, device=dev, dtype=bf16)
for _ in range(2):
    fa4.attention_with_kvcache(q8, k[:1], v[:1], lengths[2:].clone(), k_new=new8, v_new=new8)
# Groups of 16, 32 and 64 query heads per K/V head: Q pieces across heads of 4, 2 and 1 rows
# (kv_cache.FEW_HEAD_ROWS), one token appended and 3 causal tokens.
k2, v2 = (torch.randn(b + 1, 4096, 2, d, device=dev, dtype=bf16) for _ in range(2))
for heads_q in (32, 64, 128):
    for sq in (1, 3):
        q = torch.randn(b, sq, heads_q, d, device=dev, dtype=bf16)
        new = torch.randn(b, sq, 2, d, device=dev, dtype=bf16)
        fa4.attention_with_kvcache(q, k2, v2, lengths, k_new=new, v_new=new, cache_batch_idx=index)
# The append twin: 1 and 16 rows in the first block (copied into its stages), 2 rows across a
# block boundary and 17 rows (the producer waits), one decoding token each.
for seqlen_new, length in ((1, 127), (16, 100), (2, 127), (17, 40)):
    new = torch.randn(b, seqlen_new, hkv, d, device=dev, dtype=bf16)
    fa4.attention_with_kvcache(q1, k, v, torch.full_like(lengths, length), k_new=new, v_new=new, cache_batch_idx=index)
# Chunked prefill on the long tiles (two consumer warpgroups, the first zeroing stale V rows in its
# turn: catalog.KV_CACHE_TILE_FAMILIES): causal chunks of 129 rows appended to caches of 4096 rows
# (a sequence of 129 keys: tiles of one K/V block), contiguous and paged, and 16 tiles of 128 rows
# whose K/V range is split.
q129 = torch.randn(b, 129, hq, d, device=dev, dtype=bf16)
new129 = torch.randn(b, 129, hkv, d, device=dev, dtype=bf16)
fa4.attention_with_kvcache(q129, k, v, lengths, k_new=new129, v_new=new129, cache_batch_idx=index)
kp, vp = (torch.randn(b * 64 + 1, 64, hkv, d, device=dev, dtype=bf16) for _ in range(2))
table = torch.randperm(b * 64, device=dev).to(torch.int32).reshape(b, 64)
fa4.attention_with_kvcache(q129, kp, vp, lengths, k_new=new129, v_new=new129, page_table=table, window=(300, 0),
                           causal=False)
fa4.attention_with_kvcache(q129[:1, :128], k[:1], v[:1], lengths[2:].clone())
torch.cuda.synchronize()
print("kv-cache sanitizer runs done")
