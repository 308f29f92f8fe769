"""Inline PTX, for the few places where the DSL's generated code schedules badly, and for the
instructions it has no op for (``bulk_store_s2g``, a non-tensor bulk copy;
``fence_proxy_async_global``; ``barrier_sync_unaligned``).

The register helpers are computations the compilers cannot look inside and re-fold (see the
callers for why that matters). Pure ones may still be moved or dropped; ``loop_bound_zero`` is
volatile on purpose, so it stays where it is written.
"""
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def inline_asm(result_type, asm: str, constraints: str, args, *, volatile: bool = False, loc=None, ip=None):
    """``asm`` with ``constraints`` ("=r,f,..."; $0 the result, none for a None result_type) on
    DSL scalars (Float32/Int32/Int64). ``volatile``: the compilers must neither drop nor move it
    (LLVM's has_side_effects)."""
    return llvm.inline_asm(
        result_type,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        asm,
        constraints,
        has_side_effects=volatile,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def f32_asm(asm: str, constraints: str, args, *, loc=None, ip=None) -> Float32:
    return Float32(inline_asm(T.f32(), asm, constraints, args, loc=loc, ip=ip))


def i32_asm(asm: str, constraints: str, args, *, loc=None, ip=None) -> Int32:
    return Int32(inline_asm(T.i32(), asm, constraints, args, loc=loc, ip=ip))


@dsl_user_op
def loop_bound_zero(x: Int32, *, loc=None, ip=None) -> Int32:
    """0 for any ``x`` but INT32_MIN (then 512), computed by volatile inline PTX: the compilers
    can neither fold it to 0 nor hoist it out of the loop it sits in when ``x`` varies there.
    Adding it to an address keeps the address arithmetic inside that loop instead of live in
    registers across it. Callers pass an ``x`` that is never INT32_MIN.
    """
    return Int32(inline_asm(T.i32(), "{\n.reg .pred p;\nsetp.eq.s32 p, $1, -2147483648;\nselp.s32 $0, 512, 0, p;\n}",
                            "=r,r", (Int32(x),), volatile=True, loc=loc, ip=ip))


@dsl_user_op
def grid_wait_after(values, *, loc=None, ip=None) -> None:
    """``griddepcontrol.wait`` (programmatic dependent launch: the previous grid done and its
    writes visible) placed after the arithmetic that produces ``values`` (Int32s), so that it
    overlaps the previous kernel's end. The wait is predicated on every value differing from
    INT32_MIN, which callers' values (indices and counts) never equal: ptxas must compute them
    first. Unpredicated (the DSL's own wait, or this asm with unused inputs), ptxas hoisted the
    wait above a decoding tile's schedule arithmetic, which then ran between the wait and the
    first load (146 instructions before the bf16 hd128 KV-cache kernel's cache_seqlens load; 27
    with this). A memory clobber keeps every load after it."""
    checks = "".join(f"setp.ne.and.s32 p, ${i}, -2147483648, p;\n" for i in range(1, len(values)))
    asm = ("{\n.reg .pred p;\nsetp.ne.s32 p, $0, -2147483648;\n" + checks + "@p griddepcontrol.wait;\n}")
    constraints = ",".join(["r"] * len(values) + ["~{memory}"])
    inline_asm(None, asm, constraints, [Int32(v) for v in values], volatile=True, loc=loc, ip=ip)


# Polls (each after a ~0.1-1 us nanosleep) before a waiter gives up on a flag or counter and traps:
# tens of seconds, far beyond any real wait. A writer that never comes is a bug, and an error from
# the launch is better than a hang.
SPIN_LIMIT = 1 << 26


@dsl_user_op
def nanosleep(ns: int = 256, *, loc=None, ip=None) -> None:
    """Back off for up to ``ns`` nanoseconds between polls (the hardware's sleep is
    approximate): keeps a waiting warp off the issue slots."""
    inline_asm(None, f"nanosleep.u32 {ns};", "", (), volatile=True, loc=loc, ip=ip)


@dsl_user_op
def ctaid_z_here(*, loc=None, ip=None) -> Int32:
    """The CTA's grid z, read where this is written (a volatile read the compiler neither merges
    with an earlier one nor moves: a value it would otherwise keep live across a role's loop)."""
    return Int32(inline_asm(T.i32(), "mov.u32 $0, %ctaid.z;", "=r", (), volatile=True, loc=loc, ip=ip))


@dsl_user_op
def select_f32(flag: Int32, if_set: Float32, if_clear: Float32, *, loc=None, ip=None) -> Float32:
    """``if_set`` where ``flag`` != 0, else ``if_clear``: one SEL, a per-lane choice of register."""
    return f32_asm("{\n.reg .pred p;\nsetp.ne.s32 p, $1, 0;\nselp.f32 $0, $2, $3, p;\n}", "=f,r,f,f",
                   (Int32(flag), Float32(if_set), Float32(if_clear)), loc=loc, ip=ip)


@dsl_user_op
def barrier_sync_unaligned(barrier_id, num_threads, *, loc=None, ip=None) -> None:
    """``barrier.cta.sync`` without ``.aligned``: a named barrier that warps may reach from
    different instructions (two roles' code paths). ``bar.sync`` (the aligned form) requires
    every participating warp to execute the same one, which compute-sanitizer's synccheck
    reports as divergence otherwise."""
    inline_asm(None, "barrier.cta.sync $0, $1;", "r,r,~{memory}", (Int32(barrier_id), Int32(num_threads)),
               volatile=True, loc=loc, ip=ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the kernel (the launch then fails with an error instead of hanging)."""
    inline_asm(None, "trap;", "", (), volatile=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_store_s2g(dst_global, src_shared, num_bytes, *, loc=None, ip=None) -> None:
    """One bulk (non-tensor) copy of ``num_bytes`` from shared to global memory, in the issuing
    thread's current bulk async-group (commit and wait as for TMA stores). Both addresses 16-byte
    aligned, ``num_bytes`` a multiple of 16."""
    inline_asm(None, "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", "l,r,r,~{memory}",
               (Int64(dst_global), Int32(src_shared), Int32(num_bytes)), volatile=True, loc=loc, ip=ip)


@dsl_user_op
def fence_proxy_async_global(*, loc=None, ip=None) -> None:
    """Order this thread's global accesses through the async proxy (bulk copies, TMA) with its
    generic-proxy ones (a flag store or load next to a TMA reduce-add)."""
    inline_asm(None, "fence.proxy.async.global;", "~{memory}", (), volatile=True, loc=loc, ip=ip)


@dsl_user_op
def prefetch_l1(address, *, loc=None, ip=None) -> None:
    """Bring the global-memory line holding ``address`` (an integer address) into L1: the load
    that follows after a wait then hits L1 instead of waiting on L2."""
    inline_asm(None, "prefetch.global.L1 [$0];", "l", (Int64(address),), volatile=True, loc=loc, ip=ip)


@dsl_user_op
def prefetch_l2(address, *, loc=None, ip=None) -> None:
    """Bring the global-memory line holding ``address`` (an integer address) into L2 (a hint: no
    register waits for it)."""
    inline_asm(None, "prefetch.global.L2 [$0];", "l", (Int64(address),), volatile=True, loc=loc, ip=ip)
