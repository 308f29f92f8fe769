"""score_mod constructors for ``fa4.flex_attention`` that are also ordinary FlexAttention
score_mods: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled score
(q . k * scale) as torch's flex_attention applies them. ``softcap(c)`` runs fa4's compiled softcap
kernels; ``alibi(slopes)``, ``relative_bias(table)`` and ``bias(tensor)`` run fa4's block-sparse
kernels with the bias computed (or read) inside them, forward and backward, with the slopes',
the table's or the tensor's gradient when they require one.
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
    """score + table[h, clamp(q_idx - kv_idx, -c, c) + c]: a learned bias per head and relative
    position, table (heads, 2c + 1); distances beyond c share the end entries (T5-style)."""

    table: torch.Tensor

    def __call__(self, score, b, h, q_idx, kv_idx):
        center = self.table.shape[1] // 2
        return score + self.table[h, torch.clamp(q_idx - kv_idx, -center, center) + center]


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
    """table (heads, 2c + 1): entry c + d biases query i against key i - d, |d| <= c; longer
    distances take the end entries."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] % 2 != 1:
        raise ValueError("relative_bias table must be (heads, 2 * max_distance + 1)")
    return RelativeBias(table)


def bias(tensor: torch.Tensor) -> Bias:
    """An additive bias on the scaled scores; it is expanded to 4-D (a (seqlen_q, seqlen_k) bias
    applies to every batch and head), each dim (batch, heads, seqlen_q, seqlen_k) or 1. fa4's
    kernels read it at every score, in fp32 or, when it has the inputs' bf16/fp16 dtype, as it is
    (any other dtype is converted to fp32 once per call; size-1 dims are read with stride 0, never
    copied) and, when it requires a gradient, add dS into an fp32 gradient of its own shape
    (summed over the dims it broadcasts), returned in its dtype. -inf entries mask their scores."""
    if not isinstance(tensor, torch.Tensor) or not 2 <= tensor.dim() <= 4:
        raise ValueError("bias must be a tensor broadcastable to (batch, heads, seqlen_q, seqlen_k), 2-D to 4-D")
    while tensor.dim() < 4:
        tensor = tensor.unsqueeze(0)
    return Bias(tensor)


# ------------------------------------------------------------------- in-kernel score_mods
# Codes of fa4::fwd_sparse's score_mod argument (fa4_score_mod in csrc_shims/fa4_shim.h).
NONE, ALIBI, RELATIVE_BIAS, BIAS = 0, 1, 2, 3
_CODE_NAMES = {ALIBI: "alibi", RELATIVE_BIAS: "relative_bias", BIAS: "bias"}


def _bias_sizes_ok(shape, dims) -> bool:
    """Each of a bias's first three sizes is the call's (batch, heads, seqlen_q) or 1, its last the
    call's seqlen_k (``dims``: the four)."""
    return len(shape) == 4 and all(n in (1, full) for n, full in zip(shape[:3], dims[:3])) and shape[3] == dims[3]


def kernel_params(score_mod, dims, device: torch.device, input_dtype: torch.dtype | None = None):
    """(code, params) for fa4's block-sparse kernels (``dims``: the call's (batch, heads_q,
    seqlen_q, seqlen_k)): ALiBi's slopes as (heads, 1), a relative-bias table as (heads, 2c + 1),
    a bias tensor as itself with its keys materialised and contiguous (broadcast dims stay size
    1: the kernels read them with stride 0); fp32 (float64 kept on the CPU; a bias already in the
    inputs' 16-bit ``input_dtype`` kept too: kernels read it as such; the casts are
    differentiable: gradients reach the user's tensor) on ``device``; None for score_mods with no
    kernel."""
    heads = dims[1]
    dtype = torch.float32
    if isinstance(score_mod, Bias):
        params, seqlen_k = score_mod.bias, dims[3]
        if not all(n in (1, full) for n, full in zip(params.shape, dims)):
            raise ValueError(f"bias must broadcast to (batch, heads, seqlen_q, seqlen_k) = {tuple(dims)}, each dim "
                             f"that size or 1; got {tuple(params.shape)}")
        if (params.dtype == torch.float64 and device.type == "cpu") or (
                params.dtype == input_dtype and params.dtype in (torch.bfloat16, torch.float16)):
            dtype = params.dtype
        params = params.to(device=device, dtype=dtype)
        if params.shape[3] != seqlen_k:  # a bias constant along the keys: the kernels read keys contiguous
            params = params.expand(*params.shape[:3], seqlen_k)
        if params.stride(3) != 1:
            params = params.contiguous()
        return BIAS, params
    if isinstance(score_mod, Alibi):
        params, what = score_mod.slopes, "alibi slopes must have one entry per query head"
        if params.shape != (heads,):
            raise ValueError(f"{what}, ({heads},); got {tuple(params.shape)}")
        code, params = ALIBI, params.reshape(heads, 1)
    elif isinstance(score_mod, RelativeBias):
        params = score_mod.table
        if params.shape[0] != heads:
            raise ValueError(f"relative_bias table must have one row per query head ({heads}); got "
                             f"{tuple(params.shape)}")
        code = RELATIVE_BIAS
    else:
        return None
    if params.dtype == torch.float64 and device.type == "cpu":
        dtype = torch.float64
    return code, params.to(device=device, dtype=dtype)


def kernel_kind(code: int, params) -> str:
    """The kernels' name of a score_mod code (fa4_kernels.catalog.SCORE_MODS): a bias tensor in a
    16-bit dtype runs the "bias16" variants."""
    if code == BIAS and params is not None and params.dtype in (torch.bfloat16, torch.float16):
        return "bias16"
    return {NONE: "none", ALIBI: "alibi", RELATIVE_BIAS: "relbias", BIAS: "bias"}[code]


def check_kernel_params(code: int, params, dims, device, input_dtype: torch.dtype | None = None) -> None:
    """fa4::fwd_sparse's score_mod arguments (the native op makes the same checks; ``dims``: the
    call's (batch, heads_q, seqlen_q, seqlen_k); a bias tensor may also be in the inputs'
    ``input_dtype``)."""
    if code not in (NONE, ALIBI, RELATIVE_BIAS, BIAS):
        raise ValueError(f"score_mod must be 0 (none), 1 (alibi), 2 (relative_bias) or 3 (bias); got {code}")
    if code == NONE:
        return
    name = _CODE_NAMES[code]
    heads = dims[1]
    if params is None:
        raise ValueError(f"score_params is required with score_mod={name}")
    rank = 4 if code == BIAS else 2
    ok = params.dtype == torch.float32 or (params.dtype == torch.float64 and device.type == "cpu") or (
        code == BIAS and params.dtype == input_dtype)
    if not ok or params.dim() != rank:
        also = " or one of q's dtype" if code == BIAS else ""
        raise TypeError(f"score_params{' for bias' if code == BIAS else ''} must be a {rank}-D torch.float32 tensor"
                        f"{also} (float64 on the CPU); got {params.dim()}-D {params.dtype}")
    if params.device != device:
        raise ValueError("score_params must be on q's device")
    if code == BIAS:
        if not _bias_sizes_ok(params.shape, dims) or params.stride(3) != 1:
            raise ValueError(f"score_params for bias must be (batch or 1, heads_q or 1, seqlen_q or 1, seqlen_k) = "
                             f"({dims[0]} or 1, {dims[1]} or 1, {dims[2]} or 1, {dims[3]}) with keys contiguous; got "
                             f"{tuple(params.shape)} strides {params.stride()}")
        return
    if params.shape[0] != heads or (code == ALIBI and params.shape[1] != 1) or \
            (code == RELATIVE_BIAS and params.shape[1] % 2 != 1):
        want = f"({heads}, 1)" if code == ALIBI else f"({heads}, 2 * max_distance + 1)"
        raise ValueError(f"score_params for {name} must be {want}; got {tuple(params.shape)}")


def reference_bias(code: int, params, heads_kv: int, seqlen_k: int, heads: int | None = None):
    """(bias, grad, bias_grad) for fa4.reference: ``bias(rows)`` (1 or batch, hkv, group, rows,
    seqlen_k) on the scaled scores, and ``bias_grad(rows, ds)``, which adds the gradient of ds into
    ``grad`` (params' shape, fp32 or fp64). ``heads``: the query heads (a bias tensor's may be 1)."""
    if code == BIAS:
        return _reference_tensor_bias(params, heads_kv, heads)
    acc = torch.float64 if params.dtype == torch.float64 else torch.float32
    heads, width = params.shape
    group = heads // heads_kv
    grad = torch.zeros((heads, width), dtype=acc, device=params.device)
    cols = torch.arange(seqlen_k, device=params.device)
    p = params.to(acc)

    def key_minus_query(rows):
        return (cols[None, :] - rows[:, None]).to(acc)

    def index(rows):  # relative bias: the table entry of each (row, key)
        center = width // 2
        return (rows[:, None] - cols[None, :]).clamp(-center, center) + center

    def bias(rows):
        if code == ALIBI:
            b = p[:, 0, None, None] * key_minus_query(rows)
        else:
            b = p[:, index(rows)]
        return b.reshape(1, heads_kv, group, len(rows), seqlen_k)

    def bias_grad(rows, ds):
        ds = ds.to(acc).sum(0).reshape(heads, len(rows), seqlen_k)
        if code == ALIBI:
            grad[:, 0] += (ds * key_minus_query(rows)).sum((1, 2))
        else:
            grad.index_add_(1, index(rows).reshape(-1), ds.reshape(heads, -1))

    return bias, grad, bias_grad


def _reference_tensor_bias(params, heads_kv: int, heads: int):
    """reference_bias for a bias tensor (batch or 1, heads or 1, seqlen_q or 1, seqlen_k): its
    gradient sums over the dims it broadcasts."""
    acc = torch.float64 if params.dtype == torch.float64 else torch.float32
    grad = torch.zeros(params.shape, dtype=acc, device=params.device)
    p = params.to(acc)

    def grouped(t):  # (b, heads or 1, ...) -> (b, hkv, group, ...), heads broadcast
        t = t.expand(t.shape[0], heads, *t.shape[2:])
        return t.reshape(t.shape[0], heads_kv, heads // heads_kv, *t.shape[2:])

    def bias(rows):
        return grouped(p if p.shape[2] == 1 else p[:, :, rows])

    def bias_grad(rows, ds):
        ds = ds.to(acc).reshape(ds.shape[0], heads, len(rows), ds.shape[-1])
        if grad.shape[0] == 1:
            ds = ds.sum(0, keepdim=True)
        if grad.shape[1] == 1:
            ds = ds.sum(1, keepdim=True)
        if grad.shape[2] == 1:
            grad[:, :, :1] += ds.sum(2, keepdim=True)
        else:
            grad[:, :, rows] += ds

    return bias, grad, bias_grad
