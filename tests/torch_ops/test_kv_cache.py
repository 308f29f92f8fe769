"""fa4.attention_with_kvcache / fa4::fwd_kvcache on the CPU: the reference path against a float64
formula per sequence (contiguous caches with cache_batch_idx, paged ones through shuffled page
tables), the append's slots, masks aligned to each sequence's end, the argument rules, opcheck and
torch.compile (the cache mutation kept)."""
import math

import pytest
import torch

import fa4
from fa4.testing import naive_attention

F64 = torch.float64


def caches(b, capacity, hkv, d, page_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if page_size is None:
        k = torch.randn(b + 2, capacity, hkv, d, dtype=F64, generator=gen)
        index = torch.randperm(b + 2, generator=gen)[:b].to(torch.int32)
        return k, torch.randn_like(k), None, index
    max_pages = -(-capacity // page_size)
    num_pages = b * max_pages + 1
    k = torch.randn(num_pages, page_size, hkv, d, dtype=F64, generator=gen)
    table = torch.randperm(num_pages, generator=gen)[:b * max_pages].reshape(b, max_pages).to(torch.int32)
    return k, torch.randn_like(k), table, None


def rows_of(cache, table, index, b, n):
    r = torch.arange(n)
    if table is None:
        return cache[int(index[b]), :n]
    return cache[table[b].long()[r // cache.shape[1]], r % cache.shape[1]]


@pytest.mark.parametrize("page_size", [None, 16, 32, 48])
@pytest.mark.parametrize("sq,seqlen_new", [(1, 0), (1, 1), (3, 3), (5, 0)])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False), dict(causal=False, window=(6, 1)),
                                     dict(causal=True, softcap=5.0)])
def test_matches_a_float64_formula_per_sequence(page_size, sq, seqlen_new, options):
    b, hq, hkv, d, capacity = 3, 4, 2, 16, 64
    k_cache, v_cache, table, index = caches(b, capacity, hkv, d, page_size)
    lengths = [0, 1, 37]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, sq, hq, d, dtype=F64, generator=gen)
    k_new = v_new = None
    if seqlen_new:
        k_new = torch.randn(b, seqlen_new, hkv, d, dtype=F64, generator=gen)
        v_new = torch.randn(b, seqlen_new, hkv, d, dtype=F64, generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = fa4.attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32),
                                          k_new=k_new, v_new=v_new, cache_batch_idx=index, page_table=table,
                                          return_lse=True, **options)
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):  # only the appended slots change
        assert int((cache != before).any(-1).any(-1).sum()) == b * seqlen_new
    for i, n in enumerate(lengths):
        total = n + seqlen_new
        if seqlen_new:
            assert torch.equal(rows_of(k_cache, table, index, i, total)[n:], k_new[i])
            assert torch.equal(rows_of(v_cache, table, index, i, total)[n:], v_new[i])
        keys = rows_of(k_cache, table, index, i, total)[None]
        values = rows_of(v_cache, table, index, i, total)[None]
        ref, ref_lse = naive_attention(q[i:i + 1], keys, values, **options)
        torch.testing.assert_close(out[i:i + 1], ref.nan_to_num(0.0), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse[i:i + 1].double(), ref_lse, atol=1e-5, rtol=1e-6)  # lse is fp32


def test_contiguous_default_rows_and_int_lengths():
    k_cache, v_cache, _, _ = caches(2, 32, 1, 8, None)
    q = torch.randn(2, 1, 2, 8, dtype=F64)
    out = fa4.attention_with_kvcache(q, k_cache, v_cache, 20)
    for i in range(2):  # batch row i reads cache row i
        ref, _ = naive_attention(q[i:i + 1], k_cache[i:i + 1, :20], v_cache[i:i + 1, :20], causal=True)
        torch.testing.assert_close(out[i:i + 1], ref)
    same = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([20, 20], dtype=torch.int32),
                                       causal=True)
    assert torch.equal(out, same)


def test_argument_rules():
    k_cache, v_cache, table, _ = caches(2, 64, 2, 16, 16)
    q = torch.randn(2, 1, 4, 16, dtype=F64)
    lengths = torch.tensor([3, 4], dtype=torch.int32)
    call = fa4.attention_with_kvcache
    with pytest.raises(ValueError, match="page_size"):
        call(q, k_cache[:, :12], v_cache[:, :12], lengths, page_table=table)
    with pytest.raises(ValueError, match="cache_batch_idx is for contiguous caches"):
        call(q, k_cache, v_cache, lengths, page_table=table, cache_batch_idx=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        call(q, k_cache, v_cache, lengths.long(), page_table=table)
    with pytest.raises(ValueError, match="together"):
        call(q, k_cache, v_cache, lengths, k_new=torch.randn(2, 1, 2, 16, dtype=F64), page_table=table)
    with pytest.raises(ValueError, match="k_new/v_new"):
        new = torch.randn(2, 1, 3, 16, dtype=F64)
        call(q, k_cache, v_cache, lengths, k_new=new, v_new=new, page_table=table)
    with pytest.raises(ValueError, match="fit the cache"):  # checked where it costs no sync: the CPU
        call(q, k_cache, v_cache, torch.tensor([3, 64], dtype=torch.int32), page_table=table,
             k_new=torch.randn(2, 1, 2, 16, dtype=F64), v_new=torch.randn(2, 1, 2, 16, dtype=F64))
    bad = table.clone()
    bad[1, 0] = 999
    with pytest.raises(ValueError, match="outside the cache"):
        call(q, k_cache, v_cache, lengths, page_table=bad)
    with pytest.raises(ValueError, match="multiple of 16"):
        contiguous = torch.randn(2, 40, 2, 16, dtype=F64)
        call(q, contiguous, contiguous, lengths)
    k48, v48, table48, _ = caches(2, 96, 2, 16, 48)  # 48-row pages: the API reads them as 16-row ones
    with pytest.raises(ValueError, match="power-of-two size .* fa4.attention_with_kvcache"):
        torch.ops.fa4.fwd_kvcache(q, k48, v48, lengths, page_table=table48)
    with pytest.raises(ValueError, match="rows contiguous across pages"):
        call(q, k48.transpose(0, 1).contiguous().transpose(0, 1), v48, lengths, page_table=table48)
    with pytest.raises(ValueError, match="num_splits must be >= 0"):
        call(q, k_cache, v_cache, lengths, page_table=table, num_splits=-1)
    assert torch.equal(call(q, k_cache, v_cache, lengths, page_table=table, num_splits=3),
                       call(q, k_cache, v_cache, lengths, page_table=table))  # the CPU path does not split
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        fa4.flash_attn_with_kvcache(q, k_cache, v_cache, cache_leftpad=lengths, cache_seqlens=lengths,
                                    block_table=table)


def test_opcheck():
    k_cache, v_cache, table, _ = caches(2, 64, 2, 16, 16)
    q = torch.randn(2, 2, 4, 16, dtype=F64)
    new = torch.randn(2, 2, 2, 16, dtype=F64)
    args = (q, k_cache, v_cache, torch.tensor([3, 40], dtype=torch.int32), new, new.clone(), table, None,
            1 / math.sqrt(16), True, -1, -1, 0.0, None)
    torch.library.opcheck(torch.ops.fa4.fwd_kvcache.default, args)


def test_compile_keeps_the_cache_mutation():
    k_cache, v_cache, table, _ = caches(2, 64, 2, 16, 16)
    q = torch.randn(2, 1, 4, 16, dtype=F64)
    new = torch.randn(2, 1, 2, 16, dtype=F64)
    lengths = torch.tensor([3, 40], dtype=torch.int32)

    def step(q, k_cache, v_cache, lengths, new):
        return fa4.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=new, v_new=new, page_table=table) + 1

    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    expect = step(q, k_eager, v_eager, lengths, new)
    got = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, lengths, new)
    torch.testing.assert_close(got, expect)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
