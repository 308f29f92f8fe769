"""Inline PTX, for the few places where the DSL's generated code schedules badly.

Each helper is a pure register computation (no side effects), so LLVM and ptxas may still move
or drop it; what they cannot do is look inside and re-fold it (see the callers for why that
matters).
"""
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def pure_asm(result_type, asm: str, constraints: str, args, *, loc=None, ip=None):
    """``asm`` with ``constraints`` ("=r,f,..."; $0 the result) on DSL scalars (Float32/Int32)."""
    return llvm.inline_asm(
        result_type,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        asm,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def f32_asm(asm: str, constraints: str, args, *, loc=None, ip=None) -> Float32:
    return Float32(pure_asm(T.f32(), asm, constraints, args, loc=loc, ip=ip))


def i32_asm(asm: str, constraints: str, args, *, loc=None, ip=None) -> Int32:
    return Int32(pure_asm(T.i32(), asm, constraints, args, loc=loc, ip=ip))


@dsl_user_op
def loop_bound_zero(x: Int32, *, loc=None, ip=None) -> Int32:
    """0 for any ``x`` but INT32_MIN (then 512), computed by volatile inline PTX: the compilers
    can neither fold it to 0 nor hoist it out of the loop it sits in when ``x`` varies there.
    Adding it to an address keeps the address arithmetic inside that loop instead of live in
    registers across it. Callers pass an ``x`` that is never INT32_MIN.
    """
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.eq.s32 p, $1, -2147483648;\nselp.s32 $0, 512, 0, p;\n}",
        "=r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))
