"""FlashAttention's Python API on fa4's kernels: existing code switches by changing the import.

    from fa4 import flash_attn_func, flash_attn_varlen_func          # was: from flash_attn import ...
    from fa4.flash_attn_interface import flash_attn_func             # was: from flash_attn_interface import ...

``flash_attn_func`` / ``flash_attn_varlen_func`` here take FlashAttention-2's arguments, positions
and defaults and return what it returns: ``out``, or ``(out, softmax_lse, None)`` with
``return_attn_probs=True`` (the third value, the dropout-encoded probabilities, exists only with
dropout, which fa4 does not have). ``fa4.flash_attn_interface`` has FlashAttention-3's (Hopper)
signatures: ``out``, or ``(out, softmax_lse)``. Both run ``fa4.attention`` /
``fa4.attention_varlen``; an argument fa4 cannot honour raises NotImplementedError naming what to
use instead, never a silently different result.
"""
from __future__ import annotations

import torch

import fa4


def _refuse(name: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"fa4 does not support {name}; {instead}")


def check_unsupported(*, dropout_p=0.0, alibi_slopes=None, qv=None, q_descale=None,
                      k_descale=None, v_descale=None, attention_chunk=0, sm_margin=0, seqused_q=None) -> None:
    """Arguments of FlashAttention 2/3 fa4 has no kernel for: each refused with the alternative."""
    if dropout_p:
        raise _refuse(f"attention dropout (dropout_p={dropout_p})", "use flash_attn, or "
                      "torch.nn.functional.scaled_dot_product_attention with dropout_p, for training with dropout")
    if alibi_slopes is not None:
        raise _refuse("ALiBi (alibi_slopes)", "use fa4.flex_attention with score_mod=fa4.score_mods.alibi(slopes) "
                      "(fa4's kernels; with causal, a causal BlockMask: FlashAttention's causal ALiBi differs from it "
                      "by a constant per row, which softmax ignores), or flash_attn")
    if qv is not None or q_descale is not None or k_descale is not None or v_descale is not None:
        raise _refuse("qv or FP8 descaling (q_descale/k_descale/v_descale)",
                      "use FlashAttention-3 (flash_attn_interface) for FP8 attention")
    if attention_chunk:
        raise _refuse(f"chunked attention (attention_chunk={attention_chunk})",
                      "use FlashAttention-3, or fa4 with a block mask when fa4.flex_attention lands")
    if sm_margin:
        raise _refuse(f"sm_margin={sm_margin} (fa4's persistent kernels use every SM)",
                      "leave sm_margin at 0, or use FlashAttention-3 to keep SMs free for overlapped work")
    if seqused_q is not None:
        raise _refuse("seqused_q", "pass the used query rows in cu_seqlens_q instead")


def run_dense(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, pack_gqa=None):
    """(out, lse) of fa4.attention with FlashAttention's argument conventions."""
    left, right = window_size
    return fa4.attention(q, k, v, causal=causal, scale=softmax_scale, window=(int(left), int(right)),
                         softcap=float(softcap), return_lse=True, pack_gqa=pack_gqa, deterministic=deterministic)


def run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
               softcap, deterministic, seqused_k=None, pack_gqa=None):
    """(out, lse) of fa4.attention_varlen with FlashAttention's argument conventions (max_seqlen_*
    may come as 0-d tensors from some callers: read once here, as FlashAttention does)."""
    left, right = window_size
    if isinstance(max_seqlen_q, torch.Tensor):
        max_seqlen_q = int(max_seqlen_q)
    if isinstance(max_seqlen_k, torch.Tensor):
        max_seqlen_k = int(max_seqlen_k)
    return fa4.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                seqused_k=seqused_k, causal=causal, scale=softmax_scale,
                                window=(int(left), int(right)), softcap=float(softcap), return_lse=True,
                                pack_gqa=pack_gqa, deterministic=deterministic)


def run_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, softmax_scale,
                     causal, window_size, softcap, seqused_k=None):
    """(out (total_q, heads_q, d_v), lse (heads_q, total_q)) of packed queries against a paged KV
    cache (FlashAttention-2's ``flash_attn_varlen_func`` with ``block_table``): sequence b's keys are
    the first ``seqused_k[b]`` (or cu_seqlens_k[b + 1] - cu_seqlens_k[b]) rows of its pages, and its
    queries are its last tokens (masks aligned to the bottom right). Runs
    fa4.attention_with_kvcache without an append. Where every sequence has max_seqlen_q queries
    (decoding: one each; speculative verification) q is viewed as (sequences, max_seqlen_q, ...)
    without a copy. Otherwise each sequence's queries are copied into the bottom rows of a
    (sequences, max_seqlen_q) block and the outputs gathered back: correct for any lengths, at the
    cost of max_seqlen_q rows per sequence (a decoding batch with one long prefill chunk computes
    the chunk's rows for every sequence), so mixed batches are better split by the caller."""
    if isinstance(max_seqlen_q, torch.Tensor):
        max_seqlen_q = int(max_seqlen_q)
    if q.dim() != 3 or block_table.dim() != 2:
        raise ValueError(f"q must be (total_q, heads_q, head_dim) and block_table (sequences, max_pages); got "
                         f"{tuple(q.shape)} and {tuple(block_table.shape)}")
    seqs, (total_q, heads, dim) = block_table.shape[0], q.shape
    if cu_seqlens_q.shape != (seqs + 1,):
        raise ValueError(f"cu_seqlens_q must hold block_table's {seqs} sequences + 1 offsets; got "
                         f"{tuple(cu_seqlens_q.shape)}")
    if max_seqlen_q < 1 or total_q > seqs * max_seqlen_q:
        raise ValueError(f"max_seqlen_q = {max_seqlen_q} must bound every sequence's queries: {total_q} queries "
                         f"in {seqs} sequences")
    if seqused_k is None:
        if cu_seqlens_k is None or cu_seqlens_k.shape != (seqs + 1,):
            raise ValueError(f"give seqused_k ({seqs},) or cu_seqlens_k ({seqs + 1},): each sequence's key count")
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    left, right = window_size
    options = dict(page_table=block_table, causal=causal, window=(int(left), int(right)), softcap=float(softcap),
                   scale=softmax_scale, return_lse=True)
    if total_q == seqs * max_seqlen_q:  # every sequence has max_seqlen_q queries
        out, lse = fa4.attention_with_kvcache(q.view(seqs, max_seqlen_q, heads, dim), k_cache, v_cache, seqused_k,
                                              **options)
        return out.view(total_q, heads, -1), lse.transpose(0, 1).reshape(heads, total_q)
    # Each packed query's row in the block: its sequence's block, counted from the bottom (no host
    # sync; offsets are clamped, so malformed cu_seqlens_q give wrong rows, never a fault).
    token = torch.arange(total_q, device=q.device, dtype=cu_seqlens_q.dtype)
    seq = torch.searchsorted(cu_seqlens_q[1:], token, right=True).clamp_(max=seqs - 1)
    end = cu_seqlens_q[seq + 1]
    row = (seq * max_seqlen_q + max_seqlen_q - end + token).clamp_(0, seqs * max_seqlen_q - 1)
    block = q.new_zeros(seqs * max_seqlen_q, heads, dim)
    block[row] = q
    out, lse = fa4.attention_with_kvcache(block.view(seqs, max_seqlen_q, heads, dim), k_cache, v_cache, seqused_k,
                                          **options)
    return out.reshape(seqs * max_seqlen_q, heads, -1)[row], lse.transpose(0, 1).reshape(heads, -1)[:, row]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention-2's ``flash_attn_func``: q (batch, seqlen_q, heads_q, head_dim), k/v
    (batch, seqlen_k, heads_kv, head_dim), GQA/MQA by fewer K/V heads, causal and window_size
    aligned to the bottom-right corner. Returns ``out``, or ``(out, softmax_lse, None)`` with
    ``return_attn_probs`` (softmax_lse (batch, heads_q, seqlen_q) fp32)."""
    check_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    out, lse = run_dense(q, k, v, softmax_scale, causal, window_size, softcap, deterministic)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention-2's ``flash_attn_varlen_func``: packed (total_tokens, heads, head_dim)
    sequences delimited by int32 ``cu_seqlens``; with ``block_table`` (sequences, max_pages) int32,
    k/v are a paged KV cache (num_pages, page_size, heads_kv, head_dim) and cu_seqlens_k counts each
    sequence's keys (run_paged_varlen). Returns ``out``, or ``(out, softmax_lse, None)`` with
    ``return_attn_probs`` (softmax_lse (heads_q, total_q) fp32)."""
    check_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    if block_table is not None:  # k/v are a paged cache (inference: no gradient, as in FlashAttention)
        out, lse = run_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, softmax_scale,
                                    causal, window_size, softcap)
    else:
        out, lse = run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                              causal, window_size, softcap, deterministic)
    return (out, lse, None) if return_attn_probs else out
