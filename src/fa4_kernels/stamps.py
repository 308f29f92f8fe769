"""Diagnostic clock stamps of the consumer loop (build option FA4_DIAG_STAMPS=1; never shipped).

Lane 0 of each consumer warpgroup of the first ``CTAS`` CTAs writes the SM clock, relative to
its own start, at fixed points of every K/V step and of every tile into a float32 buffer (the
split-tail partials buffer, which a launch without a split does not otherwise touch). Floats
hold those differences exactly below 2^24 cycles (~10 ms). ``scripts/stamps_report.py`` reads
them back. The stores are predicated per thread and perturb the loop a little: compare the
timing of a stamped build with the plain one before trusting the numbers.

Layout: step records [cta][warpgroup][block count][STEP_POINTS], then tile records
[cta][warpgroup][tile count][TILE_POINTS]; counts beyond STEPS / TILES are not recorded.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from fa4_kernels.ptx import inline_asm

CTAS = 2
STEPS = 192
TILES = 24
# overlapped_step: entry, K ready, turn granted, GEMMs issued, Q @ K^T done, end (softmax
# done, P @ V done, P converted, O rescaled). No stamp inside the softmax: a clock read there
# moved ptxas's P @ V wait from after the 13th exponential to after the last (a different
# schedule, which ran 2-5% slower unstamped), so the softmax and the P @ V wait stay one segment.
STEP_POINTS = 6
# tile: start, Q ready, first block done, K/V loop done, last P @ V done, O normalised, O
# converted, sO free (barrier), O in sO, LSE stored, O store issued, tile done.
TILE_POINTS = 12
TILE_END = 11
# hd64's short tiles run four consumer warpgroups.
MAX_WG = 4


def buffer_words() -> int:
    return CTAS * MAX_WG * (STEPS * STEP_POINTS + TILES * TILE_POINTS)


@dsl_user_op
def clock_now(*, loc=None, ip=None) -> Int32:
    """%clock read by volatile inline PTX: stays where it is written relative to other stamps."""
    return Int32(inline_asm(T.i32(), "mov.u32 $0, %clock;", "=r", (), volatile=True, loc=loc, ip=ip))


@dataclass(frozen=True)
class Stamps:
    buf: cute.Tensor
    base: Int32
    lane: Int32  # thread index within the warpgroup: lane 0 writes
    cta: Int32
    row: Int32  # cta * MAX_WG + warpgroup

    @staticmethod
    def create(buf: cute.Tensor, tidx: Int32, wg: Int32):
        """Only in stamped builds: the kernel guards creation and every stamp with its flag."""
        cta = Int32(cute.arch.block_idx()[0])
        return Stamps(buf, clock_now(), tidx % 128, cta, cta * MAX_WG + wg)

    @cute.jit
    def step(self, count: Int32, point: cutlass.Constexpr[int]):
        t = clock_now()
        if self.lane == 0 and self.cta < CTAS and count < STEPS:
            self.buf[(self.row * STEPS + count) * STEP_POINTS + point] = Float32(t - self.base)

    @cute.jit
    def tile(self, count: Int32, point: cutlass.Constexpr[int]):
        t = clock_now()
        if self.lane == 0 and self.cta < CTAS and count < TILES:
            off = CTAS * MAX_WG * STEPS * STEP_POINTS
            self.buf[off + (self.row * TILES + count) * TILE_POINTS + point] = Float32(t - self.base)
