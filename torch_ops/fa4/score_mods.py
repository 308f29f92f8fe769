"""score_mod constructors for ``fa4.flex_attention`` that are also ordinary FlexAttention
score_mods: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled score
(q . k * scale) as torch's flex_attention applies them. ``softcap(c)`` runs fa4's compiled softcap
kernels (forward and backward); the others run torch's flex_attention for now, with a one-time
warning (``fa4.flex``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class ScoreMod:
    """A score_mod fa4 can inspect: subclasses hold its parameters."""

    def __call__(self, score, b, h, q_idx, kv_idx):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __repr__(self) -> str:
        # Plain text (no dataclass repr, whose recursion guard torch.compile cannot trace: torch's
        # vmap prints the mask_mod / score_mod it wraps while create_block_mask or flex traces it).
        return f"fa4.{type(self).__module__.rsplit('.', 1)[-1]}.{type(self).__name__}"


@dataclass(frozen=True, repr=False)
class Softcap(ScoreMod):
    """cap * tanh(score / cap) (Gemma-2's logit softcapping)."""

    cap: float

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)


@dataclass(frozen=True, eq=False, repr=False)
class Alibi(ScoreMod):
    """score + slopes[h] * (kv_idx - q_idx): ALiBi's linear penalty on distance (slopes (heads,),
    positive for the usual penalty on earlier keys)."""

    slopes: torch.Tensor

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.slopes[h] * (kv_idx - q_idx)


@dataclass(frozen=True, eq=False, repr=False)
class RelativeBias(ScoreMod):
    """score + table[h, (q_idx - kv_idx) + center]: a learned bias per head and relative position,
    table (heads, 2 * max_distance + 1) with center = max_distance."""

    table: torch.Tensor

    def __call__(self, score, b, h, q_idx, kv_idx):
        center = self.table.shape[1] // 2
        return score + self.table[h, q_idx - kv_idx + center]


@dataclass(frozen=True, eq=False, repr=False)
class Bias(ScoreMod):
    """score + bias[b, h, q_idx, kv_idx], bias broadcastable to (batch, heads, seqlen_q, seqlen_k)."""

    bias: torch.Tensor

    def __call__(self, score, b, h, q_idx, kv_idx):
        t = self.bias  # size-1 dims broadcast: index 0 there
        index = tuple(i if n > 1 else 0 for i, n in zip((b, h, q_idx, kv_idx), t.shape))
        return score + t[index]


def softcap(cap: float) -> Softcap:
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"softcap must be a number > 0; got {cap!r}")
    return Softcap(float(cap))


def alibi(slopes: torch.Tensor) -> Alibi:
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
        raise ValueError("alibi slopes must be a 1-D tensor, one slope per query head")
    return Alibi(slopes)


def relative_bias(table: torch.Tensor) -> RelativeBias:
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] % 2 != 1:
        raise ValueError("relative_bias table must be (heads, 2 * max_distance + 1)")
    return RelativeBias(table)


def bias(tensor: torch.Tensor) -> Bias:
    """An additive bias; it is expanded to 4-D (a (seqlen_q, seqlen_k) bias applies to every
    batch and head)."""
    if not isinstance(tensor, torch.Tensor) or not 2 <= tensor.dim() <= 4:
        raise ValueError("bias must be a tensor broadcastable to (batch, heads, seqlen_q, seqlen_k), 2-D to 4-D")
    while tensor.dim() < 4:
        tensor = tensor.unsqueeze(0)
    return Bias(tensor)
