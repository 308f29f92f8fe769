"""Attention against a KV cache: ``fa4::fwd_kvcache`` and the public ``attention_with_kvcache``.

The cache is contiguous, (batch_cache, seqlen_cache, heads_kv, d) with ``cache_batch_idx`` naming
each batch row's cache row, or paged, (num_pages, page_size, heads_kv, d) with ``page_table``
(batch, max_pages) int32 naming each sequence's pages in order. Sequence b holds
``cache_seqlens[b]`` keys; ``k_new``/``v_new`` (batch, seqlen_new, heads_kv, d) are written into the
cache after them (inside the kernel on CUDA; the operator declares k_cache and v_cache mutated)
and attended to in the same call, so the sequence then holds cache_seqlens[b] + seqlen_new keys.
Masks align to the bottom right of each sequence, as everywhere in fa4.

CUDA: the kernel reads cache_seqlens and the tables on the device, with no host sync (CUDA graphs
replay with new values). It cannot check their values: lengths beyond the cache are clamped to its
capacity and page ids into the cache, which gives wrong rows, never an access outside it. The CPU
path checks them and raises.
"""
from __future__ import annotations

import torch

from fa4 import heuristics, ops, reference, rotary  # fa4.ops defines the operators
from fa4.validation import check_pack_gqa, check_qkv, check_scalars

_FWD_KVCACHE = torch.ops.fa4.fwd_kvcache.default


def _check(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, cache_batch_idx, softmax_scale, causal,
           window_left, window_right, softcap, pack_gqa, num_splits):
    """The shape and dtype rules (also those of fa4_ops.cpp's fwd_kvcache) -> the mask."""
    check_qkv(q, k_cache, v_cache, same_batch=False)
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: fa4 chooses, 1: no split); got {num_splits}")
    check_scalars(softmax_scale, softcap)
    check_pack_gqa(pack_gqa, q.shape[2], k_cache.shape[2])
    b = q.shape[0]
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"k_cache and v_cache must have the same (pages or batch, rows) shape; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must be a (batch = {b},) torch.int32 tensor; got "
                         f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is not None:
        want = (b, k_new.shape[1], k_cache.shape[2])
        if (k_new.dim() != 4 or v_new.dim() != 4 or tuple(k_new.shape[:3]) != want or tuple(v_new.shape[:3]) != want
                or k_new.shape[3] != k_cache.shape[3] or v_new.shape[3] != v_cache.shape[3]):
            raise ValueError(f"k_new/v_new must be (batch = {b}, seqlen_new, heads_kv = {k_cache.shape[2]}, "
                             f"head_dim); got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
        if k_new.dtype != q.dtype or v_new.dtype != q.dtype:
            raise TypeError("k_new and v_new must have q's dtype")
    if page_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for contiguous caches; a paged cache names each sequence's pages "
                             "in page_table")
        if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != b:
            raise ValueError(f"page_table must be a (batch = {b}, max_pages) torch.int32 tensor; got "
                             f"{page_table.dtype} {tuple(page_table.shape)}")
        heuristics.check_kv_page_size(k_cache.shape[1], page_table.shape[1])
    else:
        if cache_batch_idx is None:
            raise ValueError("give cache_batch_idx (contiguous cache) or page_table (paged cache)")
        if cache_batch_idx.dtype != torch.int32 or cache_batch_idx.dim() != 1 or cache_batch_idx.shape[0] != b:
            raise ValueError(f"cache_batch_idx must be a (batch = {b},) torch.int32 tensor")
        heuristics.check_kv_page_size(k_cache.shape[1], None)
    return heuristics.resolve_mask(causal, window_left, window_right)


@torch.library.register_fake("fa4::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, page_table=None,
                      cache_batch_idx=None, softmax_scale=1.0, causal=False, window_left=-1, window_right=-1,
                      softcap=0.0, pack_gqa=None, num_splits=0):
    _check(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, cache_batch_idx, softmax_scale, causal,
           window_left, window_right, softcap, pack_gqa, num_splits)
    return ops._empty_outputs(q, v_cache)


def _rows(b: int, length: int, page_table, cache_batch_idx, k_cache):
    """(cache index, row) tensors of sequence b's first ``length`` rows, checked against the cache."""
    rows = torch.arange(length)
    if page_table is None:
        index = int(cache_batch_idx[b])
        if not 0 <= index < k_cache.shape[0]:
            raise ValueError(f"cache_batch_idx[{b}] = {index} is outside the cache's {k_cache.shape[0]} rows")
        return torch.full_like(rows, index), rows
    page = k_cache.shape[1]
    slots = rows // page
    if length > page_table.shape[1] * page:
        raise ValueError(f"sequence {b} holds {length} keys, more than its {page_table.shape[1]} pages of {page}")
    pages = page_table[b].long().cpu()[slots]
    if length and not bool(((pages >= 0) & (pages < k_cache.shape[0])).all()):
        raise ValueError(f"page_table[{b}] names a page outside the cache's {k_cache.shape[0]} pages")
    return pages, rows % page


@torch.library.impl("fa4::fwd_kvcache", "CPU")
def _fwd_kvcache_cpu(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, page_table=None,
                     cache_batch_idx=None, softmax_scale=1.0, causal=False, window_left=-1, window_right=-1,
                     softcap=0.0, pack_gqa=None, num_splits=0):
    mask = _check(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, cache_batch_idx, softmax_scale,
                  causal, window_left, window_right, softcap, pack_gqa, num_splits)
    out, lse = ops._empty_outputs(q, v_cache)
    capacity = k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    for b in range(q.shape[0]):
        cached = int(cache_seqlens[b])
        if not 0 <= cached <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens[{b}] = {cached}: with {seqlen_new} appended rows the sequence must fit "
                             f"the cache's {capacity} rows per sequence")
        length = cached + seqlen_new
        index, rows = _rows(b, length, page_table, cache_batch_idx, k_cache)
        if seqlen_new:
            k_cache[index[cached:], rows[cached:]] = k_new[b]
            v_cache[index[cached:], rows[cached:]] = v_new[b]
        keys, values = k_cache[index, rows][None], v_cache[index, rows][None]
        o, row_lse = reference.attention_forward(q[b:b + 1], keys, values, softmax_scale, softcap, mask)
        out[b], lse[b] = o[0], row_lse[0]
    return out, lse


_PAGE_ROWS: dict[int, int] = {}


@torch._dynamo.assume_constant_result  # a ctypes call into the rules: run at graph capture
def _kernel_page_rows(page_size: int) -> int:
    rows = _PAGE_ROWS.get(page_size)  # not a ctypes call on every eager call
    if rows is None:
        rows = _PAGE_ROWS[page_size] = heuristics.kv_kernel_page_rows(page_size)
    return rows


def _kernel_pages(k_cache, v_cache, page_table):
    """The cache and table as the kernel reads them (heuristics.kv_kernel_page_rows): pages of a
    power-of-two size as they are; other multiples of 16 as 16-row pages, the cache viewed as
    (num_pages * boxes, 16, heads, dim) and page id p of the table expanded into p * boxes + 0 ..
    boxes - 1 (one small op per call; writes through the views land in the caller's cache)."""
    if k_cache.dim() != 4 or v_cache.dim() != 4 or page_table.dim() != 2 or k_cache.shape[1] % 16:
        return k_cache, v_cache, page_table  # the op names what is wrong
    page = k_cache.shape[1]
    rows = _kernel_page_rows(page)
    if rows == page or page_table.shape[1] == 1:
        return k_cache, v_cache, page_table
    boxes = page // rows
    views = []
    for t in (k_cache, v_cache):
        if t.stride(0) != page * t.stride(1):
            raise ValueError(f"a cache of {page}-row pages (not a power of two) must have its rows contiguous "
                             f"across pages (stride(0) == page_size * stride(1)); got strides {t.stride()}")
        views.append(t.as_strided((t.shape[0] * boxes, rows) + t.shape[2:], (rows * t.stride(1),) + t.stride()[1:],
                                  t.storage_offset()))
    offsets = torch.arange(boxes, dtype=page_table.dtype, device=page_table.device)
    table = (page_table[:, :, None] * boxes + offsets).reshape(page_table.shape[0], -1)
    return views[0], views[1], table


_IDENTITY: dict[tuple[torch.device, int], torch.Tensor] = {}


def _identity_rows(batch: int, device: torch.device) -> torch.Tensor:
    """cache_batch_idx 0..batch-1, cached per device and batch: a dict lookup per eager call, where
    slicing a cached arange made a view each call (~2-3 us of host time, a decoding step at 1 x 4k
    taking ~12 us of GPU time). Made afresh inside a CUDA graph capture, where a tensor allocated
    from the graph's pool must not outlive the capture."""
    cached = _IDENTITY.get((device, batch))
    if cached is not None:
        return cached
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _IDENTITY[(device, batch)] = rows
    return rows


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, cache_batch_idx=None,
                           page_table=None, causal=True, window=(-1, -1), softcap=0.0, scale=None, num_splits=0,
                           pack_gqa=None, return_lse=False):
    """Attention of q (batch, seqlen_q, heads_q, d) against a KV cache, after appending k_new/v_new.

    k_cache/v_cache: (batch_cache, seqlen_cache, heads_kv, d[_v]) with ``cache_batch_idx``
    (batch,) int32 (default: row b for batch row b), or paged (num_pages, page_size, heads_kv,
    d[_v]) with ``page_table`` (batch, max_pages) int32. ``cache_seqlens``: (batch,) int32 or an
    int, the keys each sequence holds before the call. ``k_new``/``v_new``: (batch, seqlen_new,
    heads_kv, d[_v]), written into the cache at cache_seqlens (the caller advances cache_seqlens
    afterwards). ``causal``/``window``: bottom-right aligned on each sequence (a single query
    token sees its whole sequence). ``num_splits``: 0 lets fa4 cut each sequence's K/V range
    into pieces over the GPU when its tiles would not fill it; 1 never splits; n > 1 cuts every
    tile of the schedule's last round into n pieces (n + 1 where a CTA's share straddles two
    tiles), as far as one piece per SM and one K/V block per piece go (a window's pieces share
    the blocks its rows see). Returns out (batch, seqlen_q, heads_q, d_v), and lse (batch,
    heads_q, seqlen_q) fp32 with ``return_lse``. Inference only: no gradient flows through the
    cache."""
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, seqlen_q, heads_q, head_dim); got {tuple(q.shape)}")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if page_table is None and cache_batch_idx is None:
        cache_batch_idx = _identity_rows(q.shape[0], q.device)
    if page_table is not None:
        k_cache, v_cache, page_table = _kernel_pages(k_cache, v_cache, page_table)
    window_left, window_right = window
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _FWD_KVCACHE(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, cache_batch_idx,
                            float(scale), bool(causal), int(window_left), int(window_right), float(softcap or 0.0),
                            pack_gqa, int(num_splits))
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """FlashAttention's ``flash_attn_with_kvcache`` (its argument names and returns) on fa4.
    ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2) rotate q and the new keys ``k``
    before the call, in torch operations (fa4.rotary says at which positions and what it costs)."""
    refused = {"cache_leftpad": cache_leftpad, "alibi_slopes": alibi_slopes}
    for name, value in refused.items():
        if value is not None:
            raise NotImplementedError(
                f"fa4.flash_attn_with_kvcache: {name} is not supported. Keep sequences left-aligned in the cache, "
                "and use fa4.flex_attention with fa4.score_mods.alibi for ALiBi.")
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if cache_seqlens is None:
        cache_seqlens = capacity
    if rotary_cos is not None or rotary_sin is not None:
        rotary.check_rotary(rotary_cos, rotary_sin, q, k, capacity)
        # FlashAttention's rule: every query token at its own position under a causal mask or a
        # window side that bounds anything, else all of them at cache_seqlens.
        left, right = window_size
        per_token = causal or 0 <= left < capacity - 1 or 0 <= right < q.shape[1] - 1
        q, k = rotary.rotate_for_cache(q, k, rotary_cos, rotary_sin, cache_seqlens, per_token, rotary_interleaved)
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=k, v_new=v,
                                  cache_batch_idx=cache_batch_idx, page_table=block_table, causal=causal,
                                  window=window_size, softcap=softcap, scale=softmax_scale, num_splits=num_splits,
                                  return_lse=return_softmax_lse)
