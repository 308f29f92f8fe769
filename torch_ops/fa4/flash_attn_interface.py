"""FlashAttention-3's (Hopper) Python API on fa4's kernels: replace
``from flash_attn_interface import flash_attn_func, flash_attn_varlen_func`` by
``from fa4.flash_attn_interface import ...``. Same argument names, positions and defaults; returns
``out``, or ``(out, softmax_lse)`` with ``return_attn_probs=True``. ``num_splits`` is a hint fa4
takes no orders from (it splits the last round of tiles by its own rule, with the same result);
the other arguments fa4 cannot honour raise NotImplementedError (fa4.compat.check_unsupported).
"""
from __future__ import annotations

from fa4.compat import check_unsupported, run_dense, run_varlen

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's ``flash_attn_func`` (see fa4.compat.flash_attn_func for the layouts)."""
    check_unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      attention_chunk=attention_chunk, sm_margin=sm_margin)
    out, lse = run_dense(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, pack_gqa)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's ``flash_attn_varlen_func``; ``seqused_k`` limits each sequence's keys."""
    check_unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      attention_chunk=attention_chunk, sm_margin=sm_margin, seqused_q=seqused_q)
    out, lse = run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          window_size, softcap, deterministic, seqused_k, pack_gqa)
    return (out, lse) if return_attn_probs else out
