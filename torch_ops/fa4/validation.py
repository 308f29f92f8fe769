"""Argument checks with messages that name the argument and the rule it breaks."""
from __future__ import annotations

import re

import torch

from fa4.heuristics import PACKABLE_GROUPS

CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CUDA_DTYPES = (torch.float16, torch.bfloat16)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_batch: bool = True) -> None:
    """Shape/dtype/device rules shared by every path (fake tensors included). ``same_batch``: k
    and v have q's batch (not a KV cache, whose first dim counts pages or cache rows)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim); got shape {tuple(t.shape)}. "
                "For packed variable-length batches use fa4.attention_varlen."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    allowed = CUDA_DTYPES if q.device.type == "cuda" else CPU_DTYPES
    if q.dtype not in allowed:
        raise TypeError(f"q dtype {q.dtype} is not supported on {q.device.type}; use one of {allowed}")
    if same_batch and (q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same seqlen_k; got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of heads; got {k.shape[2]} and {v.shape[2]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head_dim differ: {q.shape[3]} vs {k.shape[3]}")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError("head_dim must be positive")
    if k.shape[2] == 0 and q.shape[2] != 0:
        raise ValueError("k and v have 0 heads but q has some")
    if k.shape[2] and q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"heads of q ({q.shape[2]}) must be a multiple of heads of k/v ({k.shape[2]}) (GQA/MQA)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dimension (stride(-1) == 1); got strides "
                f"{tuple(t.stride())}. Call .contiguous() on it first."
            )


def check_scalars(softmax_scale: float, softcap: float) -> None:
    if not (softmax_scale == softmax_scale) or softmax_scale in (float("inf"), float("-inf")):
        raise ValueError(f"scale must be finite; got {softmax_scale}")
    if softcap < 0.0 or softcap != softcap:
        raise ValueError(f"softcap must be >= 0 (0 disables it); got {softcap}")


def check_pack_gqa(pack_gqa, heads_q: int, heads_kv: int) -> None:
    """pack_gqa=True stacks the heads_q / heads_kv query heads that share a K/V head in one tile;
    the kernels do that for 2, 4, 8 or 16 heads per K/V head."""
    if pack_gqa is None or pack_gqa is False:
        return
    if pack_gqa is not True:
        raise TypeError(f"pack_gqa must be None (automatic), True or False; got {pack_gqa!r}")
    group = heads_q // max(heads_kv, 1)
    if group not in PACKABLE_GROUPS:
        raise ValueError(
            f"pack_gqa=True needs heads_q / heads_kv in {PACKABLE_GROUPS}; got {heads_q} / {heads_kv}. "
            "Use pack_gqa=None (automatic) or False."
        )


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Packed (total_tokens, heads, head_dim) inputs and their int32 sequence offsets.

    The offsets' values are checked only on the CPU (reading them on the GPU would need a host
    sync); the kernels clamp them, so wrong values give wrong rows, never a fault.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(
                f"{name} must be a 3-D tensor (total_tokens, heads, head_dim) for attention_varlen; "
                f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    check_qkv(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k)):
        if t is None and name == "seqused_k":
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            raise TypeError(f"{name} must be a 1-D torch.int32 tensor")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q; got {t.device}")
    if cu_seqlens_q.shape[0] < 2 or cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both hold num_sequences + 1 >= 2 offsets; got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    if seqused_k is not None and seqused_k.shape[0] != cu_seqlens_q.shape[0] - 1:
        raise ValueError(f"seqused_k must hold one count per sequence ({cu_seqlens_q.shape[0] - 1}); "
                         f"got {seqused_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a Python int >= 0 (not a tensor); got {value!r}")


def check_varlen_offsets(cu_seqlens: torch.Tensor, total: int, name: str) -> list[int]:
    """CPU-side value check: offsets start at 0, never decrease and end at the packed total."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at {total}; got {offsets}")
    return offsets


# The native operators' errors name the Python exception they stand for (csrc_shims/fa4_ops.cpp).
_NATIVE_ERROR = re.compile(r"\[fa4 (ValueError|TypeError|NotImplementedError|RuntimeError)\] (.*)", re.S)
_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError,
                "RuntimeError": RuntimeError}


def native_error(error: RuntimeError) -> Exception:
    """The exception a native operator's error stands for (the CPU path raises the same type),
    or ``error`` itself when it is not one of fa4's."""
    found = _NATIVE_ERROR.search(str(error))
    if found is None:
        return error
    return _ERROR_TYPES[found.group(1)](found.group(2).strip())
