"""Run-time decisions as pure functions (unit-tested on CPU): how a call's mask options map to a
compiled mask kind, and which compiled variant serves a call.
"""
from __future__ import annotations

from dataclasses import dataclass

# "Unbounded" window side as passed to the kernel: far beyond any sequence length, yet small
# enough that adding a row index and a sequence length cannot overflow int32.
UNBOUNDED = 1 << 30

DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class MaskSpec:
    kind: str  # "none" | "causal" | "local"
    window_left: int  # >= 0, UNBOUNDED for no limit (kernel argument)
    window_right: int


def resolve_mask(causal: bool, window_left: int, window_right: int) -> MaskSpec:
    """Normalise (causal, window) the way FlashAttention does: -1 means unbounded on that side,
    causal is the window (-1, 0), and a window that bounds nothing is no mask at all."""
    for name, value in (("window_left", window_left), ("window_right", window_right)):
        if value < -1:
            raise ValueError(f"{name} must be >= 0, or -1 for unbounded; got {value}")
    if causal:
        if window_right not in (-1, 0):
            raise ValueError(
                f"causal=True already fixes window_right to 0; got window_right={window_right}. "
                "Pass causal=False with window=(left, right) for a window reaching past the diagonal."
            )
        window_right = 0
    if window_left < 0 and window_right < 0:
        return MaskSpec("none", UNBOUNDED, UNBOUNDED)
    if window_left < 0 and window_right == 0:
        return MaskSpec("causal", UNBOUNDED, 0)
    return MaskSpec(
        "local",
        UNBOUNDED if window_left < 0 else window_left,
        UNBOUNDED if window_right < 0 else window_right,
    )


def arch_name(capability: tuple[int, int]) -> str | None:
    """Compiled arch for a device capability; None when fa4 has no kernels for it."""
    return {(9, 0): "sm_90a"}.get(tuple(capability))


def select_variant(variants: list[dict], capability, dtype: str, head_dim: int, head_dim_v: int,
                   mask: str, softcap: bool) -> dict | None:
    """The compiled variant that serves exactly this call, or None."""
    arch = arch_name(capability)
    for v in variants:
        if (v["arch"], v["dtype"], v["head_dim"], v["head_dim_v"], v["mask"], v["softcap"]) == (
            arch, dtype, head_dim, head_dim_v, mask, softcap,
        ):
            return v
    return None


def supported_head_dims(variants: list[dict], capability) -> list[tuple[int, int]]:
    arch = arch_name(capability)
    return sorted({(v["head_dim"], v["head_dim_v"]) for v in variants if v["arch"] == arch})
