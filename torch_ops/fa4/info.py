"""``python -m fa4.info``: what this install of fa4 holds and whether it serves this machine.

Prints fa4's and torch's versions, the native operators' state (loaded, or why not) and the
oldest torch their stable ABI build serves, the compiled kernels (archs, kinds, head dims,
dtypes), the run-time settings in effect, and for each visible CUDA device whether fa4's kernels
run on it and, if not, why.
"""
from __future__ import annotations

import ctypes
from collections import Counter

import torch

import fa4
from fa4 import _native, heuristics, settings


def torch_target() -> str | None:
    """'major.minor' of the oldest torch the operators' library was built for, or None."""
    if not _native.OPS_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(_native.OPS_PATH))
    except OSError:
        return None
    if not hasattr(lib, "fa4_torch_target_version"):
        return None
    lib.fa4_torch_target_version.restype = ctypes.c_uint64
    version = lib.fa4_torch_target_version()
    return f"{version >> 56}.{(version >> 48) & 0xFF}"


def device_verdict(index: int, variants: list[dict]) -> str:
    """Whether fa4's CUDA kernels serve device ``index``, and why not."""
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    name = f"cuda:{index} {props.name} (sm_{props.major}{props.minor})"
    if _native._unavailable_reason is not None:
        return f"{name}: not served: {_native._unavailable_reason}"
    arch = heuristics.arch_name(capability)
    if arch is None:
        return f"{name}: not served: fa4 ships Hopper (sm_90) kernels only"
    dims = heuristics.supported_head_dims(variants, capability)
    if not dims:
        return f"{name}: not served: this build has no {arch} kernels (FA4_ARCHS / FA4_VARIANTS at build time)"
    return f"{name}: served ({arch}; (head_dim, head_dim_v) {dims})"


def report() -> str:
    manifest = _native.manifest()
    variants = manifest["variants"]
    lines = [f"fa4 {fa4.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda})"]
    target = torch_target()
    state = "loaded" if _native._unavailable_reason is None else f"not loaded: {_native._unavailable_reason}"
    lines.append(f"native operators: {state}; built for torch >= {target or '?'} (stable ABI)")
    if variants:
        kinds = Counter(v.get("kernel", "fwd") for v in variants)
        lines.append(f"kernels: {len(variants)} variants ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}) "
                     f"for {', '.join(manifest.get('archs', []))}, CuTe DSL {manifest.get('dsl_version', '?')}"
                     + (f", filtered by FA4_VARIANTS={manifest['filter']!r}" if manifest.get("filter") else "")
                     + f"; {sum(bool(v.get('trace')) for v in variants)} of the forwards are trace twins (fa4.trace)")
        dims = sorted({(v["head_dim"], v["head_dim_v"]) for v in variants if v["head_dim"]})  # not the postprocess
        dtypes = sorted({v["dtype"] for v in variants})
        lines.append(f"  (head_dim, head_dim_v): {dims}; dtypes: {dtypes}")
    else:
        lines.append("kernels: none in this install (built with FA4_SKIP_AOT=1, or not built): CPU reference only")
    tuning = {name: value for name, value in heuristics.tuning().items() if value is not None}
    lines.append(f"settings: FA4_LOG={settings.log_level()}, tuning {tuning or 'defaults'}, "
                 f"native disabled: {settings.native_disabled()}")
    if torch.cuda.is_available():
        lines += [device_verdict(i, variants) for i in range(torch.cuda.device_count())]
    else:
        lines.append("CUDA: not available to this torch (CPU tensors run fa4's reference)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
