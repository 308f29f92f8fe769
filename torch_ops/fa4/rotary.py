"""Rotary position embeddings for the KV-cache API: FlashAttention's ``flash_attn_with_kvcache``
``rotary_cos`` / ``rotary_sin`` / ``rotary_interleaved``.

q and the appended keys are rotated at their positions in the sequence before the kernel reads
them, so the cache receives rotated keys, as FlashAttention's kernel writes them. Positions
follow FlashAttention: the appended key i of sequence b sits at ``cache_seqlens[b] + i``; query
token i too under a causal mask or a bounded window, and at ``cache_seqlens[b]`` (every token)
otherwise. The first ``rotary_dim = 2 * cos.shape[1]`` features are rotated, in pairs (2j, 2j+1)
when interleaved, else (j, j + rotary_dim / 2) (GPT-NeoX); the rest pass through.

These are torch operations (float32 arithmetic, the input's dtype out): in eager mode 15 small
kernels for a decoding step's q and k (positions, the tables' rows, four elementwise kernels a
tensor), which torch.compile fuses. FlashAttention applies rotary inside its kernel;
fa4's kernels do not, so a decoding step that cares about a few microseconds applies rotary in
the kernel that produces q and k (the QKV projection's epilogue) and passes them unrotated here.
"""
from __future__ import annotations

import torch


def check_rotary(cos, sin, q: torch.Tensor, k_new, capacity: int) -> None:
    """Raise where ``cos``/``sin`` cannot rotate q and ``k_new`` for a cache of ``capacity`` rows
    per sequence (FlashAttention's rules, except that any even rotary_dim and any float dtype
    are accepted)."""
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k_new is None:
        raise ValueError("rotary_cos/rotary_sin rotate q and the appended keys: pass the new tokens' k and v "
                         "too (as FlashAttention requires), or rotate q yourself")
    if q.dim() != 4 or k_new.dim() != 4 or k_new.shape[0] != q.shape[0] or k_new.shape[3] != q.shape[3]:
        raise ValueError(f"q (batch, seqlen_q, heads_q, head_dim) and k (batch, seqlen_new, heads_kv, head_dim) "
                         f"must agree in batch and head_dim to be rotated; got {tuple(q.shape)} and "
                         f"{tuple(k_new.shape)}")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a (seqlen_ro, rotary_dim / 2) floating-point tensor; got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {t.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape; got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= q.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be in 1 .. head_dim = "
                         f"{q.shape[-1]}")
    if cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos/rotary_sin hold {cos.shape[0]} positions, fewer than the cache's {capacity} "
                         "rows per sequence (FlashAttention's rule: seqlen_ro >= the cache's length)")


def positions(cache_seqlens, batch: int, seqlen: int, per_token: bool, limit: int, device) -> torch.Tensor:
    """(batch, seqlen) int32 positions: cache_seqlens[b] + i, or cache_seqlens[b] for every token
    without ``per_token``; clamped into 0 .. limit - 1 (lengths are not checked on the host, which
    would need a sync: a bad one rotates by a wrong angle, never indexes outside the tables)."""
    if not isinstance(cache_seqlens, torch.Tensor):
        start = min(max(int(cache_seqlens), 0), limit - 1)
        return torch.arange(start, start + seqlen, dtype=torch.int32, device=device).clamp_(max=limit - 1).expand(
            batch, seqlen) if per_token else torch.full((batch, seqlen), start, dtype=torch.int32, device=device)
    if not per_token:
        return cache_seqlens[:, None].clamp(0, limit - 1).expand(batch, seqlen)
    return (cache_seqlens[:, None] + torch.arange(seqlen, dtype=torch.int32, device=device)).clamp_(0, limit - 1)


def apply_rotary(x: torch.Tensor, cos_rows: torch.Tensor, sin_rows: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, d) rotated by cos_rows/sin_rows (batch, seqlen, rotary_dim / 2)
    float32, the tables' rows at each token's position. Four elementwise kernels (x's dtype in,
    float32 arithmetic by type promotion, the rounding to x's dtype in the last one), a fifth for
    the features past rotary_dim."""
    half = cos_rows.shape[-1]
    c, s = cos_rows[:, :, None], sin_rows[:, :, None]  # one angle for every head
    x1, x2 = (x[..., 0:2 * half:2], x[..., 1:2 * half:2]) if interleaved else (x[..., :half], x[..., half:2 * half])
    if torch.compiler.is_compiling():  # Dynamo takes no strided out=; Inductor fuses these anyway
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
        y = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
        return torch.cat((y.to(x.dtype), x[..., 2 * half:]), -1)
    out = torch.empty_like(x)
    y1, y2 = (out[..., 0:2 * half:2], out[..., 1:2 * half:2]) if interleaved else \
        (out[..., :half], out[..., half:2 * half])
    torch.addcmul(x1 * c, x2, s, value=-1, out=y1)
    torch.addcmul(x2 * c, x1, s, out=y2)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


def rotate_for_cache(q, k_new, cos, sin, cache_seqlens, per_token_q: bool, interleaved: bool):
    """(q, k_new) rotated at their positions (module docstring); the tables are read once when
    q's positions are k_new's."""
    batch = q.shape[0]
    k_pos = positions(cache_seqlens, batch, k_new.shape[1], True, cos.shape[0], q.device)
    same = q.shape[1] == k_new.shape[1] and (per_token_q or q.shape[1] == 1)
    q_pos = k_pos if same else positions(cache_seqlens, batch, q.shape[1], per_token_q, cos.shape[0], q.device)
    k_rows = cos[k_pos].float(), sin[k_pos].float()
    q_rows = k_rows if q_pos is k_pos else (cos[q_pos].float(), sin[q_pos].float())
    return apply_rotary(q, *q_rows, interleaved), apply_rotary(k_new, *k_rows, interleaved)
