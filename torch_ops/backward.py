"""The CUDA backward: two compiled kernels and a conversion.

preprocess  (src/fa4_kernels/sm90/bwd_preprocess.py) the row statistics the main kernel reads,
            in its padded layout: LSE * log2(e) (+inf where a row sees no key and in the
            padding, so those rows' probabilities are 0) and dPsum = rowsum(dO * O) - dLSE (the
            gradient through the returned LSE folds in here: d LSE / d s = p, so
            dS = p * (dP - dPsum + dLSE)); it also zeroes dQ's fp32 accumulator there, for
            dense calls only the rows that see no key (heuristics.bwd_store_first);
main        (sm90/bwd.py) dQ accumulated in fp32 (scaled) by TMA reduce-adds, the first K/V
            block to reach a query block storing instead (dense calls), staged in the
            finished Q/dO stage at hd256; dK and dV written once per K/V block (GQA groups
            summed inside the kernel); one int32 counter per (sequence, head, query block),
            zeroed here per call, holds the first-store claims and, with ``deterministic``,
            orders each query block's dQ additions by K/V block;
postprocess dQ converted to the input dtype (one torch op).
No step reads a device value on the host: varlen offsets stay on the GPU; the grids cover
max_seqlen_q / max_seqlen_k (FlashAttention's contract: they bound every sequence).
"""
from __future__ import annotations

import torch

from fa4 import _native, heuristics, settings


def stats_rows(total_q: int, block: int, num_seqs: int | None) -> int:
    """Rows of the padded statistics (csrc_shims/fa4_shim.c, stats_rows), in blocks of ``block``
    rows (fa4_kernels.heuristics.STATS_BLOCK_ROWS, the preprocess variant's tile_m): dense
    ceil(seqlen_q / block) blocks; packed sequences num_seqs + 1 more (each sequence starts on
    a block)."""
    blocks = -(-total_q // block)
    return (blocks if num_seqs is None else blocks + num_seqs + 1) * block


def unsupported(q, v, mask, softcap, capability) -> NotImplementedError:
    """The error for a CUDA call with no backward kernel: what there is, and what to use."""
    arch = heuristics.arch_name(capability)
    if arch is None:
        return NotImplementedError(
            f"fa4 ships CUDA kernels for Hopper (sm_90: H100/H200) only; {q.device} is "
            f"sm_{capability[0]}{capability[1]}. Use torch.nn.functional.scaled_dot_product_attention."
        )
    dims = heuristics.supported_head_dims(_native.manifest()["variants"], capability, kernel="bwd")
    key = (q.shape[3], v.shape[3])
    if key not in dims:
        return NotImplementedError(
            f"fa4 has no backward kernel for head_dim={key[0]}, head_dim_v={key[1]} in this build "
            f"(backward kernels: (head_dim, head_dim_v) in {dims}). For training with this head dim use "
            "torch.nn.functional.scaled_dot_product_attention (its cuDNN or flash backend), or run "
            "fa4 on CPU tensors for its reference backward."
        )
    return NotImplementedError(
        f"no compiled fa4 backward kernel for dtype={q.dtype}, mask={mask.kind}, softcap={softcap > 0} on "
        f"{arch}; this build was filtered (FA4_VARIANTS) or lacks that combination. Use "
        "torch.nn.functional.scaled_dot_product_attention for training with it."
    )


def dq_semaphores(needed: bool, sequences: int, heads: int, rows: int, tile_m: int, device) -> torch.Tensor:
    """The main kernel's per-query-block counters (deterministic turns, first-store claims):
    zeros (sequences, heads, ceil(rows / tile_m)) int32 (``rows``: the longest sequence's
    queries) when ``needed``, else the ops' token vector viewed with the rank the kernel takes
    (never read)."""
    if not needed:
        from fa4.ops import _unused_vector

        return _unused_vector(device.index).view(1, 1, -1)
    return torch.zeros((sequences, heads, max(1, -(-rows // tile_m))), dtype=torch.int32, device=device)


def run_backward(variants: tuple[dict, dict], dout, q, k, v, out, lse, dlse, mask, softmax_scale: float,
                 softcap: float, varlen=None, deterministic: bool = False):
    """(dq, dk, dv) through the compiled kernels (``variants``: the preprocess and the main kernel).
    Tensors 4-D (batch, seqlen, heads, dim), lse/dlse 3-D; varlen = (cu_seqlens_q, cu_seqlens_k,
    seqused_k | None, max_seqlen_q, max_seqlen_k) with batch 1. ``deterministic``: bitwise
    reproducible dQ (dK and dV always are)."""
    from fa4.ops import _tma_ready, _unused_vector

    pre, main = variants
    # The preprocess works on (and pads the statistics in) blocks of pre["tile_m"] rows.
    stats_block, tile_n = pre["tile_m"], main["tile_n"]
    q, k, v, dout, out = _tma_ready(q), _tma_ready(k), _tma_ready(v), _tma_ready(dout), _tma_ready(out)
    b, sq, hq, _ = q.shape
    unused = _unused_vector(q.device.index)
    if varlen is None:
        cu_q = cu_k = used_k = unused
        num_m_blocks, num_n_blocks = -(-sq // stats_block), -(-k.shape[1] // tile_n)
        blocks = heuristics.mean_visible_keys(sq, k.shape[1], mask) / tile_n  # per query block
        store_first = heuristics.bwd_store_first(False, num_n_blocks, blocks, settings.bwd_store_first_override())
        # The preprocess zeroes dQ's accumulator (with store_first only the rows no K/V block
        # reaches); every key row is in a visited K/V block.
        zero_rows = heuristics.keyless_rows(sq, k.shape[1], mask) if store_first else sq
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:
        cu_q, cu_k, used_k, max_seqlen_q, max_seqlen_k = varlen
        num_m_blocks = max(1, -(-min(max_seqlen_q, sq) // stats_block))
        num_n_blocks = max(1, -(-min(max_seqlen_k, k.shape[1]) // tile_n))
        # Rows outside every sequence and keys past seqused_k get no gradient: zeros.
        store_first, zero_rows = False, 0
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
        dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    rotate = heuristics.bwd_rotate(mask.kind, deterministic, store_first, settings.bwd_rotate_override())
    if varlen is None:
        semaphores = dq_semaphores(deterministic or store_first, b, hq, sq, main["tile_m"], q.device)
    else:
        semaphores = dq_semaphores(deterministic, cu_q.shape[0] - 1, hq, min(max_seqlen_q, sq), main["tile_m"],
                                   q.device)
    rows = stats_rows(sq, stats_block, None if varlen is None else cu_q.shape[0] - 1)
    lse_log2 = torch.empty((b, hq, rows), dtype=torch.float32, device=q.device)
    dpsum = torch.empty((b, hq, rows), dtype=torch.float32, device=q.device)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    # dLSE from autograd may be any view (an expanded ones tensor for lse.sum()): rows contiguous.
    dlse = None if dlse is None else dlse.contiguous()
    pre_args = (pre["name"], out, dout, lse, lse if dlse is None else dlse, lse_log2, dpsum, dq_accum, cu_q,
                dlse is not None, zero_rows, num_m_blocks, stream)
    main_args = (main["name"], q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, cu_q, cu_k,
                 used_k if used_k is not None else cu_q, semaphores, softmax_scale, softcap, mask.window_left,
                 mask.window_right, num_n_blocks, varlen is not None and used_k is not None, deterministic, rotate,
                 store_first, stream)
    if torch.cuda.current_device() == q.device.index:
        _native.bwd_preprocess(*pre_args)
        _native.bwd(*main_args)
    else:  # the library launches on the current device
        with torch.cuda.device(q.device):
            _native.bwd_preprocess(*pre_args)
            _native.bwd(*main_args)
    return dq_accum.to(q.dtype), dk, dv
