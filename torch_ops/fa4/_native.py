"""The native libraries: ``libfa4_ops.so`` (the CUDA implementations of the ``torch.ops.fa4``
operators, csrc_shims/fa4_ops.cpp, on torch's stable ABI), registered when fa4 is imported, and
``libfa4.so`` (the kernels behind it, csrc_shims/fa4_shim.c), read here through ctypes only for
its variant names. Importing fa4 loads the libraries but never touches the GPU.
"""
from __future__ import annotations

import ctypes
import functools
import json
import sys
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent / "_native"
LIB_PATH = NATIVE_DIR / "libfa4.so"
OPS_PATH = NATIVE_DIR / "libfa4_ops.so"
MANIFEST_PATH = NATIVE_DIR / "variants.json"

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


class _Launch(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("variant", "pack_gqa", "tail_ctas", "heads_per_group", "grid",
                                                    "store_first", "rotate", "deterministic", "launch_group")] + [
        ("semaphores", ctypes.c_void_p), ("semaphore_words", ctypes.c_int64), ("active_clusters", ctypes.c_int32)]


def last_launch(kind: str = "fwd", any_thread: bool = False) -> dict | None:
    """What the last forward ("fwd") or backward ("bwd") launch on this thread ran (``any_thread``:
    on any thread, such as autograd's backward thread): the variant's name and the decisions made
    for it (fa4_shim.h, fa4_launch); None before any."""
    record = _Launch()
    get = library().fa4_last_launch_any_thread if any_thread else library().fa4_last_launch
    get(("fwd", "bwd").index(kind), ctypes.byref(record))
    if record.variant < 0:
        return None
    out = {name: getattr(record, name) for name, _ in _Launch._fields_}
    out["name"] = library().fa4_variant_name(record.variant).decode()
    return out


def pretend_active_clusters(clusters: int) -> None:
    """Tests: clustered launches take ``clusters`` as what the device holds at once instead of
    asking it (0 forces their 1-CTA fallback); -1 asks the device again."""
    library().fa4_test_pretend_active_clusters(ctypes.c_int32(clusters))


def available() -> bool:
    from fa4 import settings

    return LIB_PATH.exists() and not settings.native_disabled()


# Why the CUDA implementations are not registered (None once they are).
_unavailable_reason: str | None = "fa4._native.define_operators() has not run"

OPERATORS = ("fwd", "bwd", "fwd_varlen", "bwd_varlen", "fwd_sparse", "bwd_sparse", "fwd_kvcache")


def define_operators() -> str | None:
    """Define fa4's operators. Loading libfa4_ops.so defines them (schemas: csrc_shims/
    fa4_schemas.c) with their native CUDA kernels; the Python modules then add fake, CPU and
    autograd kernels. Where the library cannot load (FA4_DISABLE_NATIVE=1, an unbuilt checkout,
    a torch older than the stable ABI it targets, no CUDA runtime), the same schemas come from
    libfa4_rules.so and CUDA calls raise an error saying why. Returns that reason, or None."""
    global _unavailable_reason
    import torch

    from fa4 import heuristics, settings

    if _unavailable_reason is None or hasattr(torch.ops.fa4, "fwd"):
        return _unavailable_reason  # defined already (this process imported fa4 before)
    reason = None
    if settings.native_disabled():
        reason = "FA4_DISABLE_NATIVE=1 is set"
    elif not OPS_PATH.exists():
        reason = (f"the native library is missing ({OPS_PATH}): this checkout was not built; run `pip install .` "
                  "(or `python -m fa4_kernels.aot`) on a machine with nvidia-cutlass-dsl")
    else:
        try:
            _preload_cudart()
            torch.ops.load_library(str(OPS_PATH))
        except OSError as error:  # e.g. a torch older than 2.10, or no libcudart.so.13
            reason = f"loading {OPS_PATH.name} failed ({error}); fa4's CUDA path needs torch >= 2.10 built for CUDA 13"
    _unavailable_reason = reason
    if reason is not None:
        rules = heuristics.rules()
        for i in range(rules.fa4_schema_count()):
            schema = rules.fa4_schema(i).decode()
            name, rest = schema.split("(", 1)
            torch.library.define(f"fa4::{name}", "(" + rest)
            torch.library.impl(f"fa4::{name}", "CUDA")(_refuse)
    return reason


def _refuse(*args, **kwargs):
    raise RuntimeError(f"fa4's CUDA kernels are unavailable: {_unavailable_reason}. Move the tensors to the CPU "
                       "for the reference implementation.")
