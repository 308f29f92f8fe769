"""fa4 as the kernels behind PyTorch's flash-attention backend (torch >= 2.10's provider registry).

    import fa4.sdpa
    fa4.sdpa.activate()      # F.scaled_dot_product_attention on the flash backend now runs fa4
    ...
    fa4.sdpa.deactivate()    # PyTorch's own flash kernels again

``activate`` registers fa4 under the name ``"fa4"`` with
``torch.nn.attention.register_flash_attention_impl`` and activates it: the CUDA kernels of the
aten flash ops (``_scaled_dot_product_flash_attention`` and its backward, which SDPA's flash
backend calls, and ``_flash_attention_forward``/``_backward``, which
``torch.nn.attention.varlen.varlen_attn`` calls) become fa4's, so ``is_causal``, ``scale``,
``enable_gqa`` and packed sequences run fa4's forward and backward. Importing fa4 never activates
it. Calls fa4 cannot serve (dropout, a debug mask, ALiBi, a paged cache, a head dim or dtype
without a kernel) raise an error saying so; ``deactivate()`` gives the default kernels back.
"""
from __future__ import annotations

import torch
from torch.library import Library

NAME = "fa4"

# The aten ops whose CUDA kernels fa4 provides, where the installed torch has them.
_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward")


class _Handle:
    """What activation holds: the aten library fragment carrying fa4's kernels."""

    def __init__(self, library: Library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _registry():
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        raise RuntimeError(f"fa4.sdpa needs torch >= 2.10 (its flash-attention provider registry); this is "
                           f"torch {torch.__version__}. Call fa4.attention directly instead.")
    return attention


def activate() -> None:
    """Make SDPA's flash backend (and varlen_attn) run fa4's kernels until ``deactivate()``."""
    attention = _registry()
    attention.register_flash_attention_impl(NAME, register_fn=_register)
    attention.activate_flash_attention_impl(NAME)


def deactivate() -> None:
    """Restore PyTorch's own flash-attention kernels (if fa4's are active)."""
    attention = _registry()
    if attention.current_flash_attention_impl() == NAME:
        attention.restore_flash_attention_impl()


def _register() -> _Handle:
    library = Library("aten", "IMPL")
    kernels = {"_scaled_dot_product_flash_attention": _sdpa_forward,
               "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
               "_flash_attention_forward": _flash_forward, "_flash_attention_backward": _flash_backward}
    for op in _OPS:
        if hasattr(torch.ops.aten, op):
            library.impl(op, kernels[op], "CUDA")
    return _Handle(library)


def _refuse(dropout_p=0.0, return_debug_mask=False, alibi_slopes=None, block_table=None, **_) -> None:
    reasons = []
    if dropout_p:
        reasons.append(f"dropout_p={dropout_p}")
    if return_debug_mask:
        reasons.append("return_debug_mask")
    if alibi_slopes is not None:
        reasons.append("alibi_slopes")
    if block_table is not None:
        reasons.append("a paged KV cache (block_table)")
    if reasons:
        raise RuntimeError(f"fa4's flash-attention provider does not support {', '.join(reasons)}; call "
                           "fa4.sdpa.deactivate() for PyTorch's own kernels")


def _window(left, right, is_causal):
    """aten's window arguments (None or -1: unbounded) as fa4.ops take them."""
    left = -1 if left is None else int(left)
    right = -1 if right is None else int(right)
    return is_causal, left, right


def _scale(scale, head_dim):
    return float(scale) if scale is not None else head_dim ** -0.5


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                   *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                   **kwargs):
    """aten::_flash_attention_forward: dense (B, S, H, D), or packed (T, H, D) with cum_seq_*.
    Returns (out, lse, rng_state, philox_offset, debug_mask)."""
    _refuse(dropout_p, return_debug_mask, alibi_slopes, **kwargs)
    causal, left, right = _window(window_size_left, window_size_right, is_causal)
    softmax_scale = _scale(scale, query.shape[-1])
    if cum_seq_q is None:
        out, lse = torch.ops.fa4.fwd(query, key, value, softmax_scale, causal, left, right)
    else:
        out, lse = torch.ops.fa4.fwd_varlen(query, key, value, cum_seq_q, cum_seq_k, seqused_k, int(max_q),
                                            int(max_k), softmax_scale, causal, left, right)
    if kwargs.get("out") is not None:  # torch's variants that write into a given output
        kwargs["out"].copy_(out)
        out = kwargs["out"]
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    philox_offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    return out, lse, rng_state, philox_offset, torch.empty(0, dtype=query.dtype, device=query.device)


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, philox_seed, philox_offset, *, scale=None, window_size_left=None,
                    window_size_right=None, **kwargs):
    """aten::_flash_attention_backward: (dq, dk, dv)."""
    _refuse(dropout_p)
    causal, left, right = _window(window_size_left, window_size_right, is_causal)
    softmax_scale = _scale(scale, query.shape[-1])
    deterministic = torch.are_deterministic_algorithms_enabled()
    if cum_seq_q is None:
        return torch.ops.fa4.bwd(grad_out, query, key, value, out, logsumexp, None, softmax_scale, causal, left,
                                 right, 0.0, deterministic)
    return torch.ops.fa4.bwd_varlen(grad_out, query, key, value, out, logsumexp, None, cum_seq_q, cum_seq_k,
                                    kwargs.get("seqused_k"), int(max_q), int(max_k), softmax_scale, causal, left,
                                    right, 0.0, deterministic)


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention, (B, H, S, D) tensors (used in place through a
    transposed view). Returns (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
    philox_offset, debug_mask)."""
    out, lse, seed, offset, debug = _flash_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, query.shape[2],
        key.shape[2], dropout_p, is_causal, return_debug_mask, scale=scale)
    return out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], seed, offset, debug


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward: (dq, dk, dv) in (B, H, S, D)."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv = _flash_backward(t(grad_out), t(query), t(key), t(value), t(out), logsumexp, None, None, max_q,
                                 max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
    return t(dq), t(dk), t(dv)
