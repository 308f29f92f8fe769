"""``fa4.flex_attention``: torch's ``flex_attention`` signature and (B, H, S, D) layout, run by
fa4's compiled kernels where the mask and score_mod are ones fa4 reads as data.

Today that is: no mask, ``fa4.masks.causal()`` / ``sliding_window()`` and their intersections
(the block mask's ``mask_mod``; its block data is then not needed), whose top-left-aligned window
maps onto fa4's bottom-right-aligned causal / local kernels (always when seqlen_q == seqlen_k;
otherwise when the shifted window still has both sides >= 0); ``document()`` masks whose
documents are contiguous runs, as packed sequences (fa4.attention_varlen), with a window too (or,
with separate key ids, the same documents in the same order, without one);
``prefix_lm(n)`` with an int n, as two calls over disjoint keys merged by their LSEs; and
``fa4.score_mods.softcap(c)`` with any of them. GQA/MQA with ``enable_gqa``; the LSE
(``return_lse`` or ``return_aux=AuxRequest(lse=True)``); forward and backward, eager and under
torch.compile. Any other BlockMask (documents that are not contiguous runs, per-row prefix
lengths, unions, any other mask_mod, or none: the blocks alone) runs fa4's block-sparse kernels
(fa4.block_sparse: the BlockMask's blocks as tables, its partial blocks as bitmasks), forward and
backward, eager and under torch.compile. ``fa4.score_mods.alibi(slopes)``,
``relative_bias(table)`` and ``bias(tensor)`` run those block-sparse kernels with the bias computed
(or read) inside them (with any BlockMask, or none: a full one), the slopes', table's or tensor's
gradient included. Every other case
(any other score_mod, ``max_scores``, the block-sparse path in CUDA training under
torch.use_deterministic_algorithms) runs torch's flex_attention with the same arguments after a
one-time warning naming the reason: the results are right either way, only the speed differs.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from fa4 import block_sparse, masks, score_mods

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
    plan = _fa4_plan(score_mod, block_mask, return_aux, query.shape[0], sq, sk)
    if isinstance(plan, str) and (block_mask is not None or isinstance(score_mod, _KERNEL_BIASES)):
        plan = _sparse_plan(plan, score_mod, return_aux, query, key, value)
    if isinstance(plan, str):
        _warn_once(plan)
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        return torch_flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, return_lse=return_lse, kernel_options=kernel_options,
                          return_aux=return_aux)
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    if plan.sparse:
        out, lse = _block_sparse(query, key, value, block_mask, plan.softcap, scale, plan.score)
    elif plan.packing is not None:
        out, lse = _packed(query, key, value, plan, scale, want_lse)
    elif plan.prefix is not None:
        out, lse = _prefixed(query, key, value, plan, scale)
    else:
        out, lse = _dense(query, key, value, plan.window, plan.softcap, scale, want_lse)
    if want_lse and query.dtype == torch.float64:  # fp32, as torch's for every dtype but float64
        lse = lse.to(torch.float64)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse, max_scores=None)
    return (out, lse) if return_lse else out


class _Plan(NamedTuple):
    """The fa4 call that computes a flex_attention call."""

    window: tuple[int, int]  # fa4's (left, right), aligned to the bottom-right corner
    softcap: float | None
    packing: masks.Packing | None = None  # documents as packed sequences: fa4.attention_varlen
    kv_packing: masks.Packing | None = None  # the keys' (packing's when queries and keys share ids)
    prefix: int | None = None  # prefix-LM: keys before it unmasked, the rest under ``window``
    sparse: bool = False  # the BlockMask's blocks and bits: fa4::fwd_sparse (window unused)
    # sparse: a score_mod the kernels compute (_KERNEL_BIASES), as fa4::fwd_sparse's (score_mod, score_params)
    score: tuple | None = None


# score_mods fa4's block-sparse kernels compute (fa4.score_mods.kernel_params); with no BlockMask
# they run over a full one (_full_block_mask).
_KERNEL_BIASES = (score_mods.Alibi, score_mods.RelativeBias, score_mods.Bias)


def _dense(query, key, value, window, softcap, scale, want_lse):
    """fa4.attention on (B, S, H, D) views of the (B, H, S, D) inputs: (out, lse or None)."""
    import fa4

    result = fa4.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scale,
                           window=window, softcap=softcap, return_lse=want_lse)
    out, lse = result if want_lse else (result, None)
    return out.transpose(1, 2), lse


def _prefixed(query, key, value, plan: _Plan, scale):
    """Prefix-LM as two fa4 calls over disjoint keys, merged by their LSEs (exact; the gradient
    flows through both outputs and LSEs): the prefix's keys unmasked, the rest under the plan's
    window (rows that see none of them give LSE -inf there, weight 0)."""
    p = plan.prefix
    out_a, lse_a = _dense(query, key[:, :, :p], value[:, :, :p], (-1, -1), plan.softcap, scale, True)
    out_b, lse_b = _dense(query, key[:, :, p:], value[:, :, p:], plan.window, plan.softcap, scale, True)
    lse = torch.logaddexp(lse_a, lse_b)
    acc = torch.promote_types(query.dtype, torch.float32)  # the sum in fp32 at least
    weight_a, weight_b = (torch.exp(x - lse).unsqueeze(-1).to(acc) for x in (lse_a, lse_b))
    out = out_a.to(acc) * weight_a + out_b.to(acc) * weight_b
    return out.to(query.dtype), lse


def _packed(query, key, value, plan: _Plan, scale, want_lse):
    """fa4.attention_varlen over the documents, the batch rows laid end to end (a view for one
    row, a copy for several): (out, lse or None) in flex_attention's layouts."""
    import fa4

    b, hq, sq, _ = query.shape
    sk = key.shape[2]
    pack = lambda t: t.transpose(1, 2).reshape(b * t.shape[2], t.shape[1], t.shape[3])  # noqa: E731
    # max_seqlen only sizes the grids (the kernels clamp it to the rows there are): compiled graphs
    # take the power-of-two bucket, a constant that changes with few batches, not each longest.
    compiling = torch.compiler.is_compiling()
    longest_q, longest_k = ((p.longest_bucket if compiling else p.longest) for p in (plan.packing, plan.kv_packing))
    result = fa4.attention_varlen(pack(query), pack(key), pack(value), plan.packing.offsets(b, sq),
                                  plan.kv_packing.offsets(b, sk), longest_q, longest_k, scale=scale,
                                  window=plan.window, softcap=plan.softcap, return_lse=want_lse)
    out, lse = result if want_lse else (result, None)
    out = out.reshape(b, sq, hq, out.shape[-1]).transpose(1, 2)
    return out, None if lse is None else lse.reshape(hq, b, sq).transpose(0, 1)


def _block_sparse(query, key, value, block_mask, softcap, scale, score=None):
    """fa4::fwd_sparse on (B, S, H, D) views, with the BlockMask's tables at the kernel's tiles
    (and, where a gradient is wanted, the backward's transposed tables at its tiles), and a
    score_mod the kernels compute (``score``: score_mods.kernel_params of one of _KERNEL_BIASES;
    no BlockMask: a full one)."""
    batch, heads = query.shape[:2]
    score = score or (score_mods.NONE, None)
    if block_mask is None:
        block_mask = _full_block_mask(query.shape[2], key.shape[2], query.device)
    kind = score_mods.kernel_kind(*score)
    dims = (query.dtype, query.shape[-1], value.shape[-1], query.device, bool(softcap))
    tile = block_sparse.kernel_tile(*dims, score_mod=kind)
    tables = block_sparse.tables(block_mask, batch, heads, tile)
    backward = (None, None, None, 0, 0)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, score[1])):
        bwd_tile = block_sparse.kernel_tile(*dims, kernel="bwd", score_mod=kind)
        bwd = block_sparse.tables(block_mask, batch, heads, bwd_tile, transposed=True)
        backward = (bwd.counts, bwd.blocks, bwd.bits, *bwd_tile)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    from fa4 import ops

    # Through ops.call, as fa4.attention: below autograd in inference, one autograd.Function in
    # eager training (torch.library's generated autograd costs ~300 us of host time per step).
    out, lse = ops.call(torch.ops.fa4.fwd_sparse.default, ops._fwd_sparse_setup_context, ops._fwd_sparse_backward,
                        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), tables.counts,
                        tables.blocks, tables.bits, tile[0], tile[1], scale, softcap or 0.0, *backward, *score,
                        extra=score[1])
    return out.transpose(1, 2), lse


_FULL_MASKS: dict[tuple, object] = {}


def _full_block_mask(seqlen_q: int, seqlen_k: int, device):
    """A BlockMask of full blocks over (seqlen_q, seqlen_k) (no mask_mod), kept per shape and
    device in eager calls (so the tables built from it are too)."""
    key = (seqlen_q, seqlen_k, str(device))
    if not torch.compiler.is_compiling() and key in _FULL_MASKS:
        return _FULL_MASKS[key]
    from torch.nn.attention.flex_attention import BlockMask

    block = 128
    q_blocks, k_blocks = -(-seqlen_q // block), -(-seqlen_k // block)
    int32 = dict(dtype=torch.int32, device=device)
    mask = BlockMask.from_kv_blocks(
        torch.zeros((1, 1, q_blocks), **int32), torch.zeros((1, 1, q_blocks, k_blocks), **int32),
        torch.full((1, 1, q_blocks), k_blocks, **int32),
        torch.arange(k_blocks, **int32).expand(1, 1, q_blocks, k_blocks).contiguous(),
        BLOCK_SIZE=block, seq_lengths=(seqlen_q, seqlen_k))
    if not torch.compiler.is_compiling():
        if len(_FULL_MASKS) >= 16:
            _FULL_MASKS.clear()
        _FULL_MASKS[key] = mask
    return mask


def _sparse_plan(reason, score_mod, return_aux, query, key, value):
    """The block-sparse plan for a BlockMask fa4 has no dense or packed kernel for, or why not."""
    if (return_aux is not None and return_aux.max_scores) or not (
            score_mod is None or isinstance(score_mod, (score_mods.Softcap, *_KERNEL_BIASES))):
        return reason  # the score_mod / max_scores reason stands
    dims = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    score = score_mods.kernel_params(score_mod, dims, query.device, query.dtype) if score_mod is not None else None
    training = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, score[1] if score else None))
    if training and query.is_cuda and torch.are_deterministic_algorithms_enabled():
        return (f"{reason} (fa4's block-sparse backward adds dQ in any order, and "
                "torch.use_deterministic_algorithms is on)")
    softcap = score_mod.cap if isinstance(score_mod, score_mods.Softcap) else None
    kind = score_mods.kernel_kind(*score) if score else "none"
    try:
        for kernel in ("fwd", "bwd") if training else ("fwd",):
            block_sparse.kernel_tile(query.dtype, query.shape[-1], value.shape[-1], query.device, bool(softcap),
                                     kernel, score_mod=kind)
    except NotImplementedError as missing:
        return f"{reason} ({missing})"
    return _Plan((-1, -1), softcap, sparse=True, score=score)


def _fa4_plan(score_mod, block_mask, return_aux, batch, sq, sk):
    """The fa4 call (_Plan) that computes this flex_attention call, or the reason there is none
    (a str)."""
    if return_aux is not None and return_aux.max_scores:
        return "max_scores has no fa4 kernel"
    softcap = None
    if isinstance(score_mod, score_mods.Softcap):
        softcap = score_mod.cap
    elif isinstance(score_mod, _KERNEL_BIASES):
        return f"{type(score_mod).__name__} has fa4 kernels on the block-sparse path only"
    elif score_mod is not None:
        kind = type(score_mod).__name__ if isinstance(score_mod, score_mods.ScoreMod) else "a custom score_mod"
        return f"{kind} has no fa4 kernel yet"
    mask_mod = None
    if block_mask is not None:
        mask_mod = block_mask.mask_mod
        if mask_mod is None or getattr(mask_mod, "__name__", None) == "noop_mask":
            # The block data alone is the mask (BlockMask.from_kv_blocks): block sparsity.
            return "a BlockMask whose blocks are the mask (no mask_mod)"
    doc, mask_mod = masks.split_document(mask_mod)
    if doc is not None:
        return _document_plan(doc, mask_mod, softcap, batch, sq, sk)
    if isinstance(mask_mod, masks.PrefixLM) and not isinstance(mask_mod.prefix_len, torch.Tensor):
        prefix = int(mask_mod.prefix_len)
        if prefix >= sk:
            return _Plan((-1, -1), softcap)  # every key is in the prefix
        if prefix > 0:
            # The keys from the prefix on, causally: key p + j for query i when j <= i - p; aligned
            # to the bottom-right corner of those sk - p keys, the window's right side is sq - sk.
            if sq < sk:
                return f"a prefix-LM mask with seqlen_q {sq} < seqlen_k {sk} has no fa4 kernel"
            return _Plan((-1, sq - sk), softcap, prefix=prefix)
        mask_mod = masks.causal()
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
    return _Plan((left, right), softcap)


def _document_plan(doc: masks.Document, rest, softcap, batch, sq, sk):
    """Documents as packed sequences (fa4.attention_varlen), within each a window from the other
    parts when queries and keys share the ids (top-left and bottom-right alignment agree: a
    document's queries are its keys)."""
    if doc.packing is None:
        return ("a Document mask whose documents are not contiguous runs, paired between queries and keys, has no "
                "fa4 kernel yet")
    if doc.q_doc_ids.shape[-1] != sq or doc.kv_doc_ids.shape[-1] != sk:
        return (f"a Document mask with ids for ({doc.q_doc_ids.shape[-1]}, {doc.kv_doc_ids.shape[-1]}) tokens over "
                f"seqlen_q {sq} / seqlen_k {sk} has no fa4 kernel")
    if doc.packing.batch_rows not in (None, batch):
        raise ValueError(f"the Document mask's ids hold {doc.packing.batch_rows} batch rows; the inputs have {batch}")
    if doc.kv_packing is not doc.packing:  # cross-attention ids: no window within the documents
        if rest is not None:
            return f"a Document mask with separate key ids and {type(rest).__name__} has no fa4 kernel yet"
        return _Plan((-1, -1), softcap, doc.packing, doc.kv_packing)
    if doc.causal:
        rest = masks.causal() if rest is None else masks.and_masks(masks.causal(), rest)
    window = masks.top_left_window(rest)
    if window is None:
        return f"a Document mask with {type(rest).__name__} has no fa4 kernel yet"
    return _Plan(window, softcap, doc.packing, doc.packing)


def _warn_once(reason: str) -> None:
    if reason in _WARNED or torch.compiler.is_compiling():
        return
    _WARNED.add(reason)
    warnings.warn(f"fa4.flex_attention: {reason}; running torch's flex_attention instead", stacklevel=3)
