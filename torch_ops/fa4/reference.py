"""Memory-efficient attention in plain torch ops (any device, fp32 accumulation).

Serves as the CPU implementation of ``fa4::fwd`` and as the backward of every device until the
backward kernel lands: the backward recomputes probabilities chunk by chunk from the saved
log-sum-exp, so memory stays O(chunk x seqlen_k) instead of O(seqlen_q x seqlen_k).
"""
from __future__ import annotations

import math

import torch

from fa4 import settings
from fa4.heuristics import MaskSpec


def _chunk_rows(batch: int, heads: int, seqlen_k: int) -> int:
    """Query rows per chunk so that a few fp32 (rows x seqlen_k) score tiles fit the budget."""
    per_row = 4 * 4 * max(batch * heads * seqlen_k, 1)  # scores, probs and two temporaries
    return max(1, min(4096, settings.reference_chunk_bytes() // per_row))


def _visible(mask: MaskSpec, rows: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor | None:
    """(rows, seqlen_k) bool: which keys each query row may see (None: all of them)."""
    if mask.kind == "none":
        return None
    cols = torch.arange(seqlen_k, device=rows.device)[None, :]
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    ok = cols <= diag + mask.window_right
    if mask.kind == "local":
        ok &= cols >= diag - mask.window_left
    return ok


def _acc(t: torch.Tensor) -> torch.Tensor:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return t.double() if t.dtype == torch.float64 else t.float()


def _scores(q_chunk, k, scale: float, softcap: float, mask: MaskSpec, rows, seqlen_q: int, visible_rows=None,
            bias=None):
    """Scores (b, hkv, group, rows, sk) after softcap, an additive ``bias(rows)`` (broadcastable
    to them) and masking (``visible_rows``: a further mask, broadcastable to them), and tanh for
    the backward."""
    s = torch.einsum("bihgd,bjhd->bhgij", _acc(q_chunk), _acc(k)) * scale
    tanh = None
    if softcap > 0.0:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    if bias is not None:
        s = s + bias(rows).to(s.dtype)
    visible = _visible(mask, rows, seqlen_q, k.shape[1])
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if visible_rows is not None:
        s = s.masked_fill(~visible_rows, float("-inf"))
    return s, tanh


def _grouped(q, heads_kv: int):
    b, sq, hq, d = q.shape
    return q.view(b, sq, heads_kv, hq // heads_kv, d)


def attention_forward(q, k, v, scale: float, softcap: float, mask: MaskSpec, visible=None, bias=None):
    """(out (b, sq, hq, dv) in q's dtype, lse (b, hq, sq) fp32). Rows that see no key give 0 / -inf.
    ``visible``: an extra (b or 1, hq or 1, sq, sk) bool mask (block-sparse calls); ``bias``: an
    additive bias on the scaled scores, ``bias(rows)`` broadcastable to (b, hkv, group, rows, sk)
    (score_mods)."""
    b, sq, hq, _ = q.shape
    hk, dv = k.shape[2], v.shape[3]
    out = q.new_empty(b, sq, hq, dv)
    lse = torch.empty(b, hq, sq, device=q.device, dtype=torch.float32)
    if min(b, sq, hq) == 0:
        return out, lse
    if k.shape[1] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    qg = _grouped(q, hk)
    vf = _acc(v)
    step = _chunk_rows(b, hq, k.shape[1])
    for start in range(0, sq, step):
        rows = torch.arange(start, min(start + step, sq), device=q.device)
        visible_rows = None
        if visible is not None:
            g = visible.expand(b, hq, sq, k.shape[1])[:, :, start:start + len(rows)]
            visible_rows = g.reshape(b, hk, hq // hk, len(rows), k.shape[1])
        s, _ = _scores(qg[:, start:start + len(rows)], k, scale, softcap, mask, rows, sq, visible_rows, bias)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        o = torch.einsum("bhgij,bjhd->bihgd", p / denom.clamp_min(1e-30), vf)
        chunk_lse = (m + denom.log()).squeeze(-1)  # (b, hkv, g, rows); log(0) = -inf for empty rows
        out[:, start:start + len(rows)] = o.reshape(b, len(rows), hq, dv).to(q.dtype)
        lse[:, :, start:start + len(rows)] = chunk_lse.reshape(b, hq, len(rows))
    return out, lse


def attention_backward(dout, q, k, v, out, lse, dlse, scale: float, softcap: float, mask: MaskSpec, visible=None,
                       bias=None, bias_grad=None):
    """(dq, dk, dv) by chunked recomputation from the saved LSE (fp32 accumulation).

    ``dlse`` (optional) is the gradient flowing into the returned LSE: d lse / d s = p.
    ``visible``: an extra (b or 1, hq or 1, sq, sk) bool mask (block-sparse calls). ``bias``: the
    forward's (attention_forward); ``bias_grad(rows, ds)`` receives the gradient of each chunk's
    scaled scores (b, hkv, group, rows, sk), the bias's gradient there.
    """
    b, sq, hq, d = q.shape
    hk, sk, dv_dim = k.shape[2], k.shape[1], v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(b, sq, hq, d, device=q.device, dtype=acc)
    dk = torch.zeros(b, sk, hk, d, device=q.device, dtype=acc)
    dv = torch.zeros(b, sk, hk, dv_dim, device=q.device, dtype=acc)
    if min(b, sq, hq, sk) > 0:
        g = hq // hk
        qg, dog, og = _grouped(q, hk), _grouped(dout, hk), _grouped(out, hk)
        kf, vf = _acc(k), _acc(v)
        lse_g = lse.reshape(b, hk, g, sq)
        dlse_g = None if dlse is None else dlse.to(acc).reshape(b, hk, g, sq)
        step = _chunk_rows(b, hq, sk)
        for start in range(0, sq, step):
            n = min(step, sq - start)
            rows = torch.arange(start, start + n, device=q.device)
            visible_rows = None
            if visible is not None:
                visible_rows = visible.expand(b, hq, sq, sk)[:, :, start:start + n].reshape(b, hk, g, n, sk)
            s, tanh = _scores(qg[:, start:start + n], k, scale, softcap, mask, rows, sq, visible_rows, bias)
            row_lse = lse_g[..., start:start + n, None]
            # exp(s - lse), with rows that saw no key (lse = -inf) contributing nothing.
            p = torch.exp(s - torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse))
            p = torch.where(torch.isinf(row_lse), torch.zeros_like(p), p)
            do = _acc(dog[:, start:start + n])
            dv += torch.einsum("bhgij,bihgd->bjhd", p, do)
            dp = torch.einsum("bihgd,bjhd->bhgij", do, vf)
            delta = (do * _acc(og[:, start:start + n])).sum(-1).permute(0, 2, 3, 1)[..., None]
            if dlse_g is not None:
                delta = delta - dlse_g[..., start:start + n, None]
            ds = p * (dp - delta)
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            if bias_grad is not None:
                bias_grad(rows, ds)
            ds = ds * scale
            dq[:, start:start + n] = torch.einsum("bhgij,bjhd->bihgd", ds, kf).reshape(b, n, hq, d)
            dk += torch.einsum("bhgij,bihgd->bjhd", ds, _acc(qg[:, start:start + n]))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
