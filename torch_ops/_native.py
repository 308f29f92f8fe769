"""ctypes binding of libfa4 (csrc_shims/ + the AOT-exported kernels).

Loaded lazily on the first CUDA call: importing fa4 never touches the GPU or the library.
"""
from __future__ import annotations

import ctypes
import functools
import json
import sys
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent / "_native"
LIB_PATH = NATIVE_DIR / "libfa4.so"
MANIFEST_PATH = NATIVE_DIR / "variants.json"
MAX_RANK = 4


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_RANK),
        ("stride", ctypes.c_int64 * MAX_RANK),
    ]


class FwdParams(ctypes.Structure):
    _fields_ = [
        ("softmax_scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("heads_per_group", ctypes.c_int32),
        ("num_sms", ctypes.c_int32),
        ("max_seqlen_q", ctypes.c_int32),
        ("has_seqused_k", ctypes.c_int32),
        ("pack_gqa", ctypes.c_int32),
        ("tail_ctas", ctypes.c_int32),
    ]


class BwdParams(ctypes.Structure):
    _fields_ = [
        ("softmax_scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("num_n_blocks", ctypes.c_int32),
        ("has_seqused_k", ctypes.c_int32),
        ("deterministic", ctypes.c_int32),
        ("rotate", ctypes.c_int32),
        ("store_first", ctypes.c_int32),
    ]


class BwdPreParams(ctypes.Structure):
    _fields_ = [
        ("has_dlse", ctypes.c_int32),
        ("zero_rows", ctypes.c_int32),
        ("num_m_blocks", ctypes.c_int32),
    ]


class NativeError(RuntimeError):
    pass


def _preload_cudart() -> None:
    """Make libcudart.so.13 resolvable: torch has normally loaded it already; otherwise look
    in the NVIDIA runtime wheels next to torch."""
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    for base in map(Path, sys.path):
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib"):
            candidate = base / sub / "libcudart.so.13"
            if candidate.exists():
                ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
                return


@functools.cache
def library() -> ctypes.CDLL:
    if not LIB_PATH.exists():
        raise NativeError(
            f"fa4's native library is missing ({LIB_PATH}). This checkout was not built: run "
            "`pip install .` (or `python -m fa4_kernels.aot`) on a machine with nvidia-cutlass-dsl."
        )
    import torch  # noqa: F401  (loads the CUDA runtime the library links against)

    _preload_cudart()
    lib = ctypes.CDLL(str(LIB_PATH))
    lib.fa4_num_variants.restype = ctypes.c_int32
    lib.fa4_variant_name.restype = ctypes.c_char_p
    lib.fa4_variant_name.argtypes = [ctypes.c_int32]
    lib.fa4_last_error.restype = ctypes.c_char_p
    ptr = ctypes.POINTER(Tensor)
    lib.fa4_fwd.restype = ctypes.c_int32
    lib.fa4_fwd.argtypes = [ctypes.c_int32] + [ptr] * 11 + [ctypes.POINTER(FwdParams), ctypes.c_void_p]
    lib.fa4_bwd.restype = ctypes.c_int32
    lib.fa4_bwd.argtypes = [ctypes.c_int32] + [ptr] * 13 + [ctypes.POINTER(BwdParams), ctypes.c_void_p]
    lib.fa4_bwd_preprocess.restype = ctypes.c_int32
    lib.fa4_bwd_preprocess.argtypes = [ctypes.c_int32] + [ptr] * 8 + [ctypes.POINTER(BwdPreParams), ctypes.c_void_p]
    lib.fa4_split_workspace.restype = ctypes.c_int32
    words = ctypes.POINTER(ctypes.c_int64)
    lib.fa4_split_workspace.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, words, words]
    return lib


@functools.cache
def manifest() -> dict:
    """{"variants": [{name, arch, dtype, head_dim, ...}]} written by the build; empty if unbuilt."""
    if not MANIFEST_PATH.exists():
        return {"variants": []}
    return json.loads(MANIFEST_PATH.read_text())


@functools.cache
def variant_index() -> dict[str, int]:
    lib = library()
    return {lib.fa4_variant_name(i).decode(): i for i in range(lib.fa4_num_variants())}


@functools.cache
def _index(name: str) -> int:
    return variant_index()[name]


def as_native(t) -> Tensor:
    out = Tensor()
    out.data = t.data_ptr()
    out.rank = t.dim()
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        out.shape[i] = size
        out.stride[i] = stride
    return out


@functools.cache
def split_workspace(name: str, head_dim_v: int, num_sms: int) -> tuple[int, int]:
    """(semaphore words, partial words) a split-tail launch of this variant needs."""
    sems, partials = ctypes.c_int64(), ctypes.c_int64()
    if library().fa4_split_workspace(_index(name), head_dim_v, num_sms, ctypes.byref(sems), ctypes.byref(partials)):
        raise NativeError(library().fa4_last_error().decode())
    return sems.value, partials.value


def fwd(name: str, q, k, v, out, lse, semaphores, partials, cu_seqlens_q, cu_seqlens_k, seqused_k, seq_order,
        softmax_scale: float, softcap: float, window_left: int, window_right: int,
        heads_per_group: int, num_sms: int, max_seqlen_q: int, has_seqused_k: bool, pack_gqa: int,
        tail_ctas: int, stream: int) -> None:
    """Launch one compiled forward (see csrc_shims/fa4_shim.h for the argument rules).

    ``semaphores``: int32 CUDA vector of zeros (the kernel may count tiles and raise flags in
    it, and leaves the flags zero); ``partials``: fp32 CUDA scratch vector. With ``tail_ctas``
    > 0 both must have the sizes ``split_workspace`` gives. Dense variants ignore the
    cu_seqlens/seqused_k vectors (any int32 CUDA vectors).
    """
    lib = library()
    params = FwdParams(softmax_scale, softcap, window_left, window_right, heads_per_group, num_sms,
                       max_seqlen_q, int(has_seqused_k), pack_gqa, tail_ctas)
    status = lib.fa4_fwd(
        _index(name), as_native(q), as_native(k), as_native(v), as_native(out), as_native(lse),
        as_native(semaphores), as_native(partials), as_native(cu_seqlens_q), as_native(cu_seqlens_k),
        as_native(seqused_k), as_native(seq_order),
        ctypes.byref(params), ctypes.c_void_p(stream),
    )
    if status != 0:
        raise NativeError(f"fa4 forward kernel: {lib.fa4_last_error().decode()}")


def bwd(name: str, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k,
        dq_semaphore, softmax_scale: float, softcap: float, window_left: int, window_right: int,
        num_n_blocks: int, has_seqused_k: bool, deterministic: bool, rotate: bool, store_first: bool,
        stream: int) -> None:
    """Launch one compiled backward (see csrc_shims/fa4_shim.h, fa4_bwd, for the argument rules)."""
    lib = library()
    params = BwdParams(softmax_scale, softcap, window_left, window_right, num_n_blocks, int(has_seqused_k),
                       int(deterministic), int(rotate), int(store_first))
    status = lib.fa4_bwd(
        _index(name), as_native(q), as_native(k), as_native(v), as_native(dout), as_native(lse_log2),
        as_native(dpsum), as_native(dq_accum), as_native(dk), as_native(dv), as_native(cu_seqlens_q),
        as_native(cu_seqlens_k), as_native(seqused_k), as_native(dq_semaphore), ctypes.byref(params),
        ctypes.c_void_p(stream),
    )
    if status != 0:
        raise NativeError(f"fa4 backward kernel: {lib.fa4_last_error().decode()}")


def bwd_preprocess(name: str, out, dout, lse, dlse, lse_log2, dpsum, dq_accum, cu_seqlens_q, has_dlse: bool,
                   zero_rows: int, num_m_blocks: int, stream: int) -> None:
    """Launch one compiled backward preprocess (csrc_shims/fa4_shim.h, fa4_bwd_preprocess)."""
    lib = library()
    params = BwdPreParams(int(has_dlse), zero_rows, num_m_blocks)
    status = lib.fa4_bwd_preprocess(
        _index(name), as_native(out), as_native(dout), as_native(lse), as_native(dlse), as_native(lse_log2),
        as_native(dpsum), as_native(dq_accum), as_native(cu_seqlens_q), ctypes.byref(params),
        ctypes.c_void_p(stream),
    )
    if status != 0:
        raise NativeError(f"fa4 backward preprocess: {lib.fa4_last_error().decode()}")


def available() -> bool:
    from fa4 import settings

    return LIB_PATH.exists() and not settings.native_disabled()
