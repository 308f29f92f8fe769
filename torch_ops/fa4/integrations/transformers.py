"""fa4 as a Hugging Face transformers attention implementation.

    import fa4.integrations.transformers
    fa4.integrations.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fa4")

``register()`` adds ``"fa4"`` to transformers' ``AttentionInterface`` (and its masks to
``AttentionMaskInterface``: like FlashAttention's, a padding mask only, or none) for the models
that dispatch attention through it (Llama, Mistral, Qwen and most decoders of transformers 4.48
on). Every layout the flash-attention path of transformers takes is served: a dense batch (with
GQA, causal, a sliding window, softcap), a padded batch (unpadded into packed sequences),
padding-free packed batches (``position_ids`` restarting at 0, or the ``cu_seq_lens_*`` /
``max_length_*`` a flattening data collator passes), and cached decoding (queries aligned to the
end of the keys). transformers is never imported by ``import fa4``.
"""
from __future__ import annotations

import torch

import fa4

NAME = "fa4"


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` select fa4 in transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' sliding_window (a query sees that many keys, itself included) as fa4's."""
    if not sliding_window:
        return -1, -1
    return sliding_window - 1, 0 if causal else sliding_window - 1


def _packed_offsets(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens, longest) of a padding-free batch whose position_ids restart at 0 per
    sequence, or None when they do not restart (one sequence). Reads the longest length on the
    host, as transformers' flash path does."""
    positions = position_ids.reshape(-1)
    starts = (positions == 0).nonzero().reshape(-1)
    if starts.numel() <= 1:
        return None
    ends = torch.tensor([positions.numel()], device=positions.device)
    cu = torch.cat([starts, ends]).to(torch.int32)
    return cu, int(cu.diff().max())


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query/key/value (batch, heads, seq, head_dim);
    returns ((batch, seq, heads, head_dim) output, None)."""
    if dropout and module.training:
        raise NotImplementedError("fa4 has no attention dropout; set the model's attention_dropout to 0, or use "
                                  "attn_implementation='sdpa' for training with it")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("fa4 does not return attention weights; use attn_implementation='eager'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    batch, seq_q = q.shape[0], q.shape[1]
    options = dict(causal=causal, scale=scaling, window=_window(sliding_window, causal), softcap=softcap or 0.0)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and kwargs.get("max_length_q") is not None:
        out = fa4.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q.to(torch.int32),
                                   cu_k.to(torch.int32), int(kwargs["max_length_q"]), int(kwargs["max_length_k"]),
                                   **options)
        return out.view(batch, seq_q, *out.shape[1:]), None
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        return _padded(q, k, v, attention_mask.bool(), options), None
    position_ids = kwargs.get("position_ids")
    if attention_mask is None and position_ids is not None and batch == 1:
        packed = _packed_offsets(position_ids)
        if packed is not None:
            cu, longest = packed
            out = fa4.attention_varlen(q[0], k[0], v[0], cu, cu, longest, longest, **options)
            return out[None], None
    return fa4.attention(q, k, v, **options), None


def _padded(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """A padded batch ((batch, seq_k) mask, True for real tokens; the queries are the last seq_q
    positions of each row, as in cached decoding) as packed sequences, scattered back with zeros
    in the padding."""
    batch, seq_q = q.shape[0], q.shape[1]
    keys = mask.flatten().nonzero().reshape(-1)
    lengths_k = mask.sum(-1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(lengths_k.cumsum(0, dtype=torch.int32), (1, 0))
    query_mask = mask[:, -seq_q:]
    queries = query_mask.flatten().nonzero().reshape(-1)
    lengths_q = query_mask.sum(-1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(lengths_q.cumsum(0, dtype=torch.int32), (1, 0))
    out = fa4.attention_varlen(q.flatten(0, 1)[queries], k.flatten(0, 1)[keys], v.flatten(0, 1)[keys], cu_q, cu_k,
                               int(lengths_q.max()), int(lengths_k.max()), **options)
    full = out.new_zeros(batch * seq_q, *out.shape[1:])
    full[queries] = out
    return full.view(batch, seq_q, *out.shape[1:])
