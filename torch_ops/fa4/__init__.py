"""fa4: FlashAttention for Hopper, AOT-compiled CuTe DSL kernels behind ``torch.ops.fa4``.

    import fa4
    out = fa4.attention(q, k, v, causal=True)     # q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D)
"""
from __future__ import annotations

import torch

from fa4 import _native, log, ops, ops_varlen  # noqa: F401  (define torch.ops.fa4.*)
from fa4.reference import default_scale
from fa4.validation import native_error

log.configure()
_FWD, _FWD_VARLEN = torch.ops.fa4.fwd.default, torch.ops.fa4.fwd_varlen.default  # resolved once: per-call cost

__all__ = ["attention", "attention_varlen"]
__version__ = "0.1.0"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    return_lse: bool = False,
    pack_gqa: bool | None = None,
    deterministic: bool | None = None,
):
    """Scaled dot-product attention, softmax(q k^T * scale) v, FlashAttention-style.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
            v: (batch, seqlen_k, heads_kv, head_dim_v). heads_q must be a multiple of heads_kv
            (GQA/MQA). Any strides with a contiguous last dim: a (B, H, S, D) tensor passed as
            ``x.transpose(1, 2)`` is used without a copy.
        causal: mask keys after the query position. With seqlen_q != seqlen_k the mask is aligned
            to the bottom-right corner (query i sees key j iff j <= i + seqlen_k - seqlen_q).
        scale: score scale, default 1/sqrt(head_dim).
        window: (left, right) sliding window around that same diagonal; -1 leaves a side
            unbounded. causal=True is window (-1, 0).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (Gemma-2 style); None or 0
            disables it. (None is the default rather than 0.0: torch.compile(dynamic=True) would
            treat a float default as a symbolic input and compile the frame twice.)
        return_lse: also return the log-sum-exp of the scaled scores, (batch, heads_q, seqlen_q)
            fp32. Rows that see no key give output 0 and LSE -inf.
        pack_gqa: with GQA/MQA, stack the query heads that share a K/V head in one kernel tile
            (their rows fill it even when seqlen_q is short, e.g. decoding, and K/V are read
            once per group). None: decided per call (``fa4.heuristics.pack_gqa_factor``; a
            group larger than a tile stacks is packed in parts, the largest power of two that
            the tile stacks);
            True needs heads_q / heads_kv in (2, 4, 8, 16) with each head's share of a tile a
            multiple of 8 rows: every head dim stacks up to 8 heads, and 16 where its tiles have
            128 rows or more (hd64, 192-row tiles: 16 only dense without a mask or causal, in
            its 256-row tiles; with a window or packed sequences it raises). Same results
            either way.
        deterministic: make the backward bitwise reproducible (dQ's additions from the K/V
            blocks happen in a fixed order; dK and dV always are). None: on when
            ``torch.use_deterministic_algorithms(True)`` is in effect.

    On CUDA this runs fa4's compiled Hopper kernels, forward and backward; on CPU a chunked
    reference in fp32 (its backward a chunked recomputation in torch ops).
    """
    scale, (window_left, window_right), softcap = _options(q, scale, window, softcap)
    out, lse = _run(_FWD, ops, q, k, v, scale, causal, window_left, window_right, softcap, pack_gqa,
                    _deterministic(deterministic))
    return (out, lse) if return_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    seqused_k: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    return_lse: bool = False,
    pack_gqa: bool | None = None,
    deterministic: bool | None = None,
):
    """Attention over packed variable-length sequences (document packing), FlashAttention's
    ``flash_attn_varlen_func`` layout.

    Args:
        q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim); v: (total_k, heads_kv,
            head_dim_v). Sequence i is rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q and
            cu_seqlens_k[i]:cu_seqlens_k[i+1] of k/v; it attends only to itself.
        cu_seqlens_q, cu_seqlens_k: (num_sequences + 1,) int32 offsets, from 0 to the totals.
            Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: Python ints (FlashAttention's API; the compiled kernel never
            depends on them, so new values never trigger a new variant).
        seqused_k: optional (num_sequences,) int32: use only the first seqused_k[i] keys.
        causal, scale, window, softcap, return_lse, pack_gqa, deterministic: as in :func:`attention`; masks are
            aligned to each sequence's bottom-right corner. LSE is (heads_q, total_q) fp32.
            Automatic pack-GQA looks at max_seqlen_q.
    """
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be a Python int (not a tensor: that would make the compiled "
                             f"graph depend on a device value); got {type(value).__name__}")
    scale, (window_left, window_right), softcap = _options(q, scale, window, softcap)
    out, lse = _run(_FWD_VARLEN, ops_varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                    max_seqlen_k, scale, causal, window_left, window_right, softcap, pack_gqa,
                    _deterministic(deterministic))
    return (out, lse) if return_lse else out


def _options(q, scale, window, softcap) -> tuple[float, tuple[int, int], float]:
    """The public functions' options as the operators take them (softcap None is 0: a None
    default keeps torch.compile(dynamic=True) from making a float default a symbolic input)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if scale is None:
        scale = default_scale(int(q.shape[-1]))  # head_dim is static (it picks the kernel): a constant scale
    left, right = window
    return float(scale), (int(left), int(right)), 0.0 if softcap is None else float(softcap)


def _run(op, module, q, k, *inputs):
    """``op`` through ``ops.call`` with ``module``'s autograd (fa4.ops or fa4.ops_varlen); native
    errors as the Python exceptions they stand for; the launch logged at debug level."""
    try:
        out, lse = ops.call(op, module._setup_context, module._backward, q, k, *inputs)
    except RuntimeError as error:
        raise native_error(error) from None
    if not torch.compiler.is_compiling() and log.debug_enabled() and q.is_cuda:
        log.launched("fwd", f"{op._opname} q {tuple(q.shape)} k {tuple(k.shape)}")
    return out, lse


def _deterministic(requested: bool | None) -> bool:
    """The backward's determinism: as requested, or torch's global setting."""
    if requested is None:
        return torch.are_deterministic_algorithms_enabled()
    return bool(requested)


# FlashAttention-2's API (fa4.flash_attn_interface has FlashAttention-3's).
from fa4.compat import flash_attn_func, flash_attn_varlen_func  # noqa: E402
# torch's FlexAttention API, with the masks and score_mods fa4's kernels read as data.
from fa4 import masks, score_mods  # noqa: E402
from fa4.flex import flex_attention  # noqa: E402
from fa4.kv_cache import attention_with_kvcache, flash_attn_with_kvcache  # noqa: E402

__all__ += ["attention_with_kvcache", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
            "flex_attention", "masks", "score_mods", "trace"]


def __getattr__(name: str):
    # fa4.trace (the timeline module, also the context manager ``with fa4.trace(path):``) is
    # imported on first use, so that ``python -m fa4.trace`` runs a module fa4 did not import yet.
    if name == "trace":
        import importlib

        return importlib.import_module("fa4.trace")
    raise AttributeError(f"module 'fa4' has no attribute {name!r}")
