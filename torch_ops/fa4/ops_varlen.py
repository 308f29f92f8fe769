"""``fa4::fwd_varlen`` / ``fa4::bwd_varlen``: packed variable-length sequences (document packing).

q (total_q, heads_q, head_dim), k/v (total_k, heads_kv, head_dim[_v]); sequence i is rows
cu_seqlens[i]:cu_seqlens[i + 1] (keys: only the first seqused_k[i] of them when given).
out (total_q, heads_q, head_dim_v), lse (heads_q, total_q) fp32. CUDA: native, as fa4.ops says.
"""
from __future__ import annotations

import torch

from fa4 import heuristics, ops, reference  # fa4.ops defines the operators
from fa4.validation import check_pack_gqa, check_scalars, check_varlen, check_varlen_offsets

_BWD_VARLEN = torch.ops.fa4.bwd_varlen.default


def _prepare(q, k, v, cu_q, cu_k, used_k, max_q, max_k, softmax_scale, causal, window_left, window_right, softcap,
             pack_gqa=None):
    check_varlen(q, k, v, cu_q, cu_k, used_k, max_q, max_k)
    check_scalars(softmax_scale, softcap)
    check_pack_gqa(pack_gqa, q.shape[1], k.shape[1])
    return heuristics.resolve_mask(causal, window_left, window_right)


def _empty_outputs(q, v):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.register_fake("fa4::fwd_varlen")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal=False, window_left=-1, window_right=-1, softcap=0.0, pack_gqa=None, deterministic=False):
    _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             causal, window_left, window_right, softcap, pack_gqa)
    return _empty_outputs(q, v)


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """(q rows, k rows used, k rows) slices per sequence, read on the host (reference paths)."""
    offs_q = check_varlen_offsets(cu_seqlens_q.cpu(), q.shape[0], "cu_seqlens_q")
    offs_k = check_varlen_offsets(cu_seqlens_k.cpu(), k.shape[0], "cu_seqlens_k")
    used = seqused_k.tolist() if seqused_k is not None else None
    for i in range(len(offs_q) - 1):
        k_len = offs_k[i + 1] - offs_k[i]
        k_used = k_len if used is None else max(0, min(used[i], k_len))
        yield slice(offs_q[i], offs_q[i + 1]), slice(offs_k[i], offs_k[i] + k_used)


@torch.library.impl("fa4::fwd_varlen", "CPU")
def _fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             causal=False, window_left=-1, window_right=-1, softcap=0.0, pack_gqa=None, deterministic=False):
    mask = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, window_left, window_right, softcap, pack_gqa)
    out, lse = _empty_outputs(q, v)
    for rows, keys in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k):
        o, l = reference.attention_forward(q[rows][None], k[keys][None], v[keys][None], softmax_scale, softcap, mask)
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse


@torch.library.register_fake("fa4::bwd_varlen")
def _bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0, deterministic=False):
    return ops._contiguous_like(q), ops._contiguous_like(k), ops._contiguous_like(v)


@torch.library.impl("fa4::bwd_varlen", "CPU")
def _bwd_cpu(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0, deterministic=False):
    """Per-sequence chunked recomputation in torch ops (reads the offsets on the host)."""
    mask = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, window_left, window_right, softcap)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k):
        g = reference.attention_backward(
            dout[rows][None], q[rows][None], k[keys][None], v[keys][None], out[rows][None], lse[:, rows][None],
            None if dlse is None else dlse[:, rows][None], softmax_scale, softcap, mask)
        dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used_k, max_q, max_k, scale, causal, wl, wr, softcap, _pack_gqa, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_k)
    ctx.options = (max_q, max_k, scale, causal, wl, wr, softcap, deterministic)
    ctx.set_materialize_grads(False)  # an unused LSE gets no zeros: the backward takes dlse=None


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, used_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = ops.run_backward(_BWD_VARLEN, dout, q, k, v, out, lse, dlse, cu_q, cu_k, used_k, *ctx.options)
    return (dq, dk, dv) + (None,) * 12


torch.library.register_autograd("fa4::fwd_varlen", _backward, setup_context=_setup_context)
