"""exp2 on the FMA pipe: the softmax's exponentials without the MUFU unit, for a chosen share of
them (heuristics.FwdConfig.exp2_fma), so that both pipes work on a K/V step's exponentials.

Hopper's MUFU.EX2 runs 16 lanes per SM and clock, an eighth of the FP32 pipe's rate, and at
head_dim 64 a step's exponentials take about as long as its two GEMMs. On sm_90a every share
measured slower (docs/perf_notes.md, session 29: the softmax is bound by issue slots, and an
emulated exponential takes about ten), so the heuristics choose 0 there. The emulation:

    x <- clamp(x, -127, 127)                 (the upper clamp only where x may exceed the rescale
                                              threshold: the guessed row max's speculative step)
    t = x + 1.5 * 2^23                       (FADD: round(x) lands in t's low mantissa bits)
    f = x - (t - 1.5 * 2^23)                 (two FADDs: f in [-0.5, 0.5])
    p = 1 + f (c1 + f (c2 + f (c3 + f c4)))  (four FFMAs: 2^f, relative error < 3e-6)
    2^x = bits(t) * 2^23 + bits(p)           (one IMAD: round(x) into p's exponent field; the
                                              constant's own bits shift out of the word)

At x = -127 the result is exactly +0 (p = 1 at f = 0), so masked scores (-inf) give 0 as MUFU's
flush-to-zero form does; below -126 it may give a denormal (< 1.2e-38) where MUFU gives 0.
``tests/fa4_kernels/test_exp2_fma.py`` checks a float model of exactly this arithmetic.
"""
import struct

from cutlass import Float32
from cutlass.cutlass_dsl import dsl_user_op

from fa4_kernels.ptx import f32_asm

# Minimax (relative error) coefficients of 2^f = 1 + c1 f + c2 f^2 + c3 f^3 + c4 f^4 on
# [-0.5, 0.5], the constant term held at 1 (exact 0 at the lower clamp), rounded to fp32.
# Fitted by Lawson's iteration; the model's maximum relative error over [-126, 127] is 2.9e-6
# (degree 3 reaches only 1.0e-4).
COEFFS = (0.6931241750717163, 0.24024099111557007, 0.055906400084495544, 0.009582829661667347)
ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23
LOW = -127.0
HIGH = 127.0


def _hex(value: float) -> str:
    """A PTX fp32 immediate (0fXXXXXXXX) holding exactly ``value`` rounded to fp32."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def _asm(clamp_high: bool) -> str:
    c1, c2, c3, c4 = (_hex(c) for c in COEFFS)
    magic = _hex(ROUNDING_MAGIC)
    high = f"min.f32 xc, xc, {_hex(HIGH)};\n" if clamp_high else ""
    return (
        "{\n.reg .f32 xc, t, n, f, p;\n.reg .b32 tb, pb, rb;\n"
        f"max.f32 xc, $1, {_hex(LOW)};\n{high}"
        f"add.rn.f32 t, xc, {magic};\nsub.rn.f32 n, t, {magic};\nsub.rn.f32 f, xc, n;\n"
        f"fma.rn.f32 p, f, {c4}, {c3};\nfma.rn.f32 p, p, f, {c2};\nfma.rn.f32 p, p, f, {c1};\n"
        f"fma.rn.f32 p, p, f, {_hex(1.0)};\n"
        "mov.b32 tb, t;\nmov.b32 pb, p;\nmad.lo.s32 rb, tb, 8388608, pb;\nmov.b32 $0, rb;\n}"
    )


@dsl_user_op
def exp2_fma(x: Float32, clamp_high: bool = True, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA pipe (inline PTX: the compilers keep the arithmetic as written)."""
    return f32_asm(_asm(clamp_high), "=f,f", (Float32(x),), loc=loc, ip=ip)


def on_fma_pipe(i: int, per_8: int) -> bool:
    """Whether element ``i`` of a row fragment takes the FMA path when ``per_8`` of every 8 do:
    spread evenly (i * per_8 / 8 steps past an integer), not in runs, so that the emulated
    exponentials sit between MUFU ones in the instruction stream."""
    return (i + 1) * per_8 // 8 > i * per_8 // 8
