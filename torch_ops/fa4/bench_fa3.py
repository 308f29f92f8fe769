"""FlashAttention-3 as a benchmark peer: a ctypes wrapper for libfa3_peer.so (built by
peers/fa3/build.sh from upstream's Hopper forward, bf16, hdim 64/128/256; never shipped).

    from fa4 import bench_fa3
    bench_fa3.load("build/peers/fa3/libfa3_peer.so")
    out, lse = bench_fa3.fa3_forward(q, k, v, causal=True)

q: (B, Sq, H, D), k/v: (B, Sk, Hk, D), torch CUDA bfloat16, last-dim stride 1 (other strides
arbitrary but multiples of 8 elements, pointers 16-byte aligned: TMA requirements).
H must be a multiple of Hk (GQA/MQA). D must be a multiple of 8 and <= 256; the kernels are the
FA3 hdim 64/128/256 instantiations (D is rounded up to one of those, as in FA3).
Returns out (B, Sq, H, D) bf16 and lse (B, H, Sq) float32 (natural-log logsumexp of the scaled
scores, as FA3's softmax_lse).
"""
import ctypes
import math
import os

import torch

_lib = None


def load(path):
    """Load libfa3_peer.so from ``path`` (peers/fa3/build.sh writes build/peers/fa3/libfa3_peer.so
    in a source checkout; an installed fa4 has no such file, hence no default). Returns the CDLL."""
    global _lib
    if not os.path.isfile(path):
        raise FileNotFoundError(f"bench_fa3.load: no FlashAttention-3 peer library at {path!r} "
                                "(build it with peers/fa3/build.sh)")
    lib = ctypes.CDLL(os.path.abspath(path))
    ll = ctypes.c_longlong
    lib.fa3_peer_fwd.restype = ctypes.c_int
    lib.fa3_peer_fwd.argtypes = (
        [ctypes.c_void_p] * 5                      # q, k, v, o, softmax_lse
        + [ctypes.c_int] * 6                       # batch, seqlen_q, seqlen_k, heads, heads_k, head_dim
        + [ll] * 12                                # q/k/v/o batch,row,head strides (elements)
        + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    )
    lib.fa3_peer_workspace_bytes.restype = ctypes.c_int
    lib.fa3_peer_workspace_bytes.argtypes = []
    lib.fa3_peer_semaphore_bytes.restype = ctypes.c_int
    lib.fa3_peer_semaphore_bytes.argtypes = []
    _lib = lib
    return lib


def _get_lib():
    if _lib is None:
        raise RuntimeError("bench_fa3: call bench_fa3.load(path_to_libfa3_peer.so) first")
    return _lib


def fa3_forward(q, k, v, causal: bool, softmax_scale=None):
    lib = _get_lib()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise RuntimeError(f"fa3_forward: {name} must be a CUDA tensor")
        if t.dtype != torch.bfloat16:
            raise RuntimeError(f"fa3_forward: {name} must be bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise RuntimeError(f"fa3_forward: {name} must be 4-D (B, S, H, D), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise RuntimeError(f"fa3_forward: {name} must have a contiguous last dimension")
        if t.device != q.device:
            raise RuntimeError("fa3_forward: q, k, v must be on the same device")
    B, Sq, H, D = q.shape
    Bk, Sk, Hk, Dk = k.shape
    if Bk != B or Dk != D or tuple(v.shape) != (B, Sk, Hk, D):
        raise RuntimeError(f"fa3_forward: shape mismatch q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)

    dev = q.device
    out = torch.empty((B, Sq, H, D), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=dev)
    if B == 0 or Sq == 0 or H == 0:
        return out, lse
    if Sk == 0:  # what mha_fwd does for an empty key sequence
        out.zero_()
        lse.fill_(float("inf"))
        return out, lse

    with torch.cuda.device(dev):
        # Only the causal path (DynamicPersistentTileScheduler) uses the semaphore, of the size
        # the launcher reports. fa3_peer_fwd zeroes it itself with cudaMemsetAsync on `stream`
        # before the kernel, so empty() is enough (same cost as mha_fwd's torch.empty + zero_).
        sem_bytes = lib.fa3_peer_semaphore_bytes()
        sem = torch.empty(sem_bytes, dtype=torch.uint8, device=dev) if causal else None
        ws_bytes = lib.fa3_peer_workspace_bytes()
        assert ws_bytes == 0, "this wrapper does not allocate launcher workspace"
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        stream = torch.cuda.current_stream(dev).cuda_stream
        rc = lib.fa3_peer_fwd(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            B, Sq, Sk, H, Hk, D,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            float(softmax_scale), int(bool(causal)), int(num_sms),
            sem.data_ptr() if sem is not None else None,
            stream,
        )
    if rc != 0:
        raise RuntimeError(f"fa3_peer_fwd failed with code {rc} (see stderr)")
    return out, lse
