"""``fa4.flex_attention``: torch's ``flex_attention`` signature and (B, H, S, D) layout, run by
fa4's compiled kernels where the mask and score_mod are ones fa4 reads as data.

Today that is: no mask, ``fa4.masks.causal()`` / ``sliding_window()`` and their intersections
(the block mask's ``mask_mod``; its block data is then not needed), whose top-left-aligned window
maps onto fa4's bottom-right-aligned causal / local kernels (always when seqlen_q == seqlen_k;
otherwise when the shifted window still has both sides >= 0), and ``fa4.score_mods.softcap(c)``;
GQA/MQA with ``enable_gqa``; the LSE (``return_lse`` or ``return_aux=AuxRequest(lse=True)``);
forward and backward, eager and under torch.compile. Every other combination (document and
prefix-LM masks, unions, any other mask_mod or score_mod, ``max_scores``) runs torch's
flex_attention with the same arguments after a one-time warning naming the reason: the results
are right either way, only the speed differs.
"""
from __future__ import annotations

import warnings

import torch

from fa4 import masks, score_mods

_WARNED: set[str] = set()


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """FlexAttention through fa4's kernels: ``torch.nn.attention.flex_attention.flex_attention``'s
    arguments and returns (see the module docstring for what runs fa4's kernels).
    ``kernel_options`` tune torch's Triton kernels: fa4 passes them on when it falls back and
    otherwise ignores them."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seqlen, head_dim)")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got "
                         f"Hq={query.shape[1]} and Hkv={key.shape[1]}. Try setting enable_gqa=True for GQA.")
    if return_lse and return_aux is not None:
        raise ValueError("Cannot specify both return_lse and return_aux; use return_aux=AuxRequest(lse=True)")
    sq, sk = query.shape[2], key.shape[2]
    if block_mask is not None and tuple(block_mask.seq_lengths) != (sq, sk):
        raise ValueError(f"block_mask was made for (seqlen_q, seqlen_k) = {tuple(block_mask.seq_lengths)}; the "
                         f"inputs have ({sq}, {sk})")
    plan = _fa4_plan(score_mod, block_mask, return_aux, sq, sk)
    if isinstance(plan, str):
        _warn_once(plan)
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        return torch_flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, return_lse=return_lse, kernel_options=kernel_options,
                          return_aux=return_aux)
    window, softcap = plan
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    import fa4

    result = fa4.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scale,
                           window=window, softcap=softcap, return_lse=want_lse)
    out = (result[0] if want_lse else result).transpose(1, 2)
    lse = None
    if want_lse:  # fp32, as torch's for every dtype but float64 (the CPU path's), where it is float64
        lse = result[1].to(torch.float64) if query.dtype == torch.float64 else result[1]
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse, max_scores=None)
    return (out, lse) if return_lse else out


def _fa4_plan(score_mod, block_mask, return_aux, sq, sk):
    """((window_left, window_right), softcap) of the fa4.attention call that computes this
    flex_attention call, or the reason there is none (a str)."""
    if return_aux is not None and return_aux.max_scores:
        return "max_scores has no fa4 kernel"
    softcap = None
    if isinstance(score_mod, score_mods.Softcap):
        softcap = score_mod.cap
    elif score_mod is not None:
        kind = type(score_mod).__name__ if isinstance(score_mod, score_mods.ScoreMod) else "a custom score_mod"
        return f"{kind} has no fa4 kernel yet"
    mask_mod = None
    if block_mask is not None:
        mask_mod = block_mask.mask_mod
        if mask_mod is None or getattr(mask_mod, "__name__", None) == "noop_mask":
            # The block data alone is the mask (BlockMask.from_kv_blocks): block sparsity.
            return "a BlockMask whose blocks are the mask (no mask_mod) has no fa4 kernel yet"
    window = masks.top_left_window(mask_mod)
    if window is None:
        kind = type(mask_mod).__name__ if isinstance(mask_mod, masks.MaskMod) else "a custom mask_mod"
        return f"{kind} has no fa4 kernel yet"
    # fa4's window is aligned to the bottom-right corner: query i sees keys
    # i + (sk - sq) - left .. i + (sk - sq) + right.
    shift = sk - sq
    left, right = window
    left = masks.UNBOUNDED if left == masks.UNBOUNDED else left + shift
    right = masks.UNBOUNDED if right == masks.UNBOUNDED else right - shift
    if (window[0] != masks.UNBOUNDED and left < 0) or (window[1] != masks.UNBOUNDED and right < 0):
        return (f"a window reaching past the diagonal fa4's kernels align to (seqlen_q {sq}, seqlen_k {sk}) has no "
                f"fa4 kernel")
    return (left, right), softcap


def _warn_once(reason: str) -> None:
    if reason in _WARNED or torch.compiler.is_compiling():
        return
    _WARNED.add(reason)
    warnings.warn(f"fa4.flex_attention: {reason}; running torch's flex_attention instead", stacklevel=3)
