"""Backward postprocess: dQ from its fp32 accumulator (sm90/bwd.py adds into it, already scaled) to
the input dtype.

The accumulator and dQ are both contiguous with the same shape, so the conversion is one flat
pass: each thread turns VECTOR consecutive floats (two 16-byte loads) into one 16-byte store.
The caller launches it on ranges of fewer than 2^31 elements that are multiples of VECTOR
(fa4_shim.c, fa4_bwd_postprocess), so a 32-bit index covers every range.

It replaces a torch copy (aoti_torch_copy_), which cost ~10-12 us of host time per backward on an
H100 machine (TensorIterator's setup) against one launch here (csrc_shims/fa4_ops.cpp's host
phases, FA4_DIAG_HOST_TIMING).
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 256
VECTOR = 8  # floats per thread: 32 bytes in, 16 bytes out


class BackwardPostprocessSm90:
    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        mAccum: cute.Tensor,  # (n,) fp32, n a multiple of VECTOR, 16-byte aligned
        mOut: cute.Tensor,  # (n,) in the input dtype, 16-byte aligned
        stream: cuda.CUstream,
    ):
        vectors = cute.size(mAccum.shape[0]) // VECTOR
        self.kernel(mAccum, mOut, vectors).launch(
            grid=(cute.ceil_div(vectors, THREADS), 1, 1), block=[THREADS, 1, 1], stream=stream, use_pdl=True,
        )

    @cute.kernel
    def kernel(self, mAccum: cute.Tensor, mOut: cute.Tensor, vectors: cutlass.Int32):
        # Launched with programmatic dependent launch after the main kernel (see its start): nothing is
        # read before that kernel's end.
        cute.arch.griddepcontrol_wait()
        tidx = cute.arch.thread_idx()[0]
        # The last rows first: the main kernel added into them last (packed sequences launch in
        # order, the last one's K/V blocks at the end), so some are still in L2.
        block = cute.arch.grid_dim()[0] - 1 - cute.arch.block_idx()[0]
        vector = block * THREADS + tidx
        if vector < vectors:
            acc = cute.make_rmem_tensor((VECTOR,), Float32)
            cute.autovec_copy(cute.local_tile(mAccum, (VECTOR,), (vector,)), acc)
            out = cute.make_rmem_tensor((VECTOR,), self.dtype)
            out.store(acc.load().to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mOut, (VECTOR,), (vector,)))
