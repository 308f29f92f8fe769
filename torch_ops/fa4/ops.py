"""The ``torch.ops.fa4`` operators: schemas, fake impls, the CPU implementations, autograd.

``fa4::fwd``  (q, k, v, ...) -> (out, lse): CPU runs the chunked torch reference.
``fa4::bwd``  (dout, q, k, v, out, lse, dlse, ...) -> (dq, dk, dv): CPU runs the chunked torch
              recomputation.
The operators and their CUDA implementations (fa4::fwd_varlen's and fa4::bwd_varlen's too) are
native code (csrc_shims/fa4_schemas.c, fa4_ops.cpp), defined by loading the library
(``fa4._native.define_operators``): a CUDA call never enters Python below the op.
"""
from __future__ import annotations

import torch

from fa4 import _native, block_sparse, heuristics, log, reference, score_mods
from fa4.validation import check_pack_gqa, check_qkv, check_scalars, native_error

_native.define_operators()  # the schemas and native CUDA kernels of every fa4 operator


def _empty_outputs(q, v):
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[3]))
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    return out, lse


def _contiguous_like(t):
    """A fake gradient: the native backward ops return contiguous tensors whatever the inputs'
    strides (empty_like would keep a permuted input's, and mismatch them under torch.compile)."""
    return t.new_empty(t.shape)


def _prepare(q, k, v, softmax_scale, causal, window_left, window_right, softcap, pack_gqa=None):
    check_qkv(q, k, v)
    check_scalars(softmax_scale, softcap)
    check_pack_gqa(pack_gqa, q.shape[2], k.shape[2])
    return heuristics.resolve_mask(causal, window_left, window_right)


# ------------------------------------------------------------------------------- forward
@torch.library.register_fake("fa4::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
              pack_gqa=None, deterministic=False):
    _prepare(q, k, v, softmax_scale, causal, window_left, window_right, softcap, pack_gqa)
    return _empty_outputs(q, v)


@torch.library.impl("fa4::fwd", "CPU")
def _fwd_cpu(q, k, v, softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
             pack_gqa=None, deterministic=False):
    mask = _prepare(q, k, v, softmax_scale, causal, window_left, window_right, softcap, pack_gqa)
    return reference.attention_forward(q, k, v, softmax_scale, softcap, mask)


# ------------------------------------------------------------------ block-sparse forward
def _check_sparse(q, k, v, kv_counts, kv_blocks, kv_bits, tile_m, tile_n, softmax_scale, softcap):
    check_qkv(q, k, v)
    check_scalars(softmax_scale, softcap)
    b, sq, hq, _ = q.shape
    m_tiles = -(-sq // tile_m) if tile_m > 0 else -1
    for name, t, rank in (("kv_counts", kv_counts, 4), ("kv_blocks", kv_blocks, 4), ("kv_bits", kv_bits, 1)):
        if t.dtype != torch.int32 or t.dim() != rank:
            raise TypeError(f"{name} must be a {rank}-D torch.int32 tensor; got {t.dim()}-D {t.dtype}")
    if tile_m <= 0 or tile_n <= 0 or tile_n % block_sparse.BITS_PER_WORD:
        raise ValueError(f"tile_m must be > 0 and tile_n a positive multiple of 32; got ({tile_m}, {tile_n})")
    if tuple(kv_counts.shape) != (b, hq, m_tiles, block_sparse.COUNT_FIELDS):
        raise ValueError(f"kv_counts must have shape (batch, heads_q, ceil(seqlen_q / {tile_m}), "
                         f"{block_sparse.COUNT_FIELDS}) = {(b, hq, m_tiles, block_sparse.COUNT_FIELDS)}; got "
                         f"{tuple(kv_counts.shape)}. Build the tables with fa4.block_sparse.tables.")
    if tuple(kv_blocks.shape[:3]) != (b, hq, m_tiles) or kv_blocks.shape[3] < 1:
        raise ValueError(f"kv_blocks must have shape (batch, heads_q, {m_tiles}, width >= 1); got "
                         f"{tuple(kv_blocks.shape)}")
    slot_words = tile_m * tile_n // block_sparse.BITS_PER_WORD
    if kv_bits.numel() < slot_words or kv_bits.numel() % slot_words:
        raise ValueError(f"kv_bits must hold whole slots of {slot_words} words; got {kv_bits.numel()}")


def _check_score_mod(q, k, softcap, score_mod, score_params):
    score_mods.check_kernel_params(score_mod, score_params, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]),
                                   q.device, q.dtype)
    if score_mod != score_mods.NONE and softcap != 0.0:
        raise ValueError("a score_mod with softcap: fa4 has no such kernel; use torch.nn.attention.flex_attention "
                         "with both in one score_mod")


@torch.library.register_fake("fa4::fwd_sparse")
def _fwd_sparse_fake(q, k, v, kv_counts, kv_blocks, kv_bits, tile_m, tile_n, softmax_scale, softcap=0.0,
                     q_counts=None, q_blocks=None, q_bits=None, bwd_tile_m=0, bwd_tile_n=0, score_mod=0,
                     score_params=None):
    _check_sparse(q, k, v, kv_counts, kv_blocks, kv_bits, tile_m, tile_n, softmax_scale, softcap)
    _check_score_mod(q, k, softcap, score_mod, score_params)
    return _empty_outputs(q, v)


_NO_MASK = heuristics.MaskSpec("none", heuristics.UNBOUNDED, heuristics.UNBOUNDED)


@torch.library.impl("fa4::fwd_sparse", "CPU")
def _fwd_sparse_cpu(q, k, v, kv_counts, kv_blocks, kv_bits, tile_m, tile_n, softmax_scale, softcap=0.0,
                    q_counts=None, q_blocks=None, q_bits=None, bwd_tile_m=0, bwd_tile_n=0, score_mod=0,
                    score_params=None):
    _check_sparse(q, k, v, kv_counts, kv_blocks, kv_bits, tile_m, tile_n, softmax_scale, softcap)
    _check_score_mod(q, k, softcap, score_mod, score_params)
    tables = block_sparse.SparseTables(kv_counts, kv_blocks, kv_bits, (tile_m, tile_n))
    visible = block_sparse.dense_mask(tables, q.shape[1], k.shape[1])
    bias = None
    if score_mod != score_mods.NONE:
        bias = score_mods.reference_bias(score_mod, score_params, k.shape[2], k.shape[1], q.shape[2])[0]
    return reference.attention_forward(q, k, v, softmax_scale, softcap, _NO_MASK, visible, bias)


def _check_sparse_bwd(q, k, q_counts, q_blocks, q_bits, tile_m, tile_n):
    b, _, hq, _ = q.shape
    n_tiles = -(-k.shape[1] // tile_n) if tile_n > 0 else -1
    for name, t, rank in (("q_counts", q_counts, 4), ("q_blocks", q_blocks, 4), ("q_bits", q_bits, 1)):
        if t.dtype != torch.int32 or t.dim() != rank:
            raise TypeError(f"{name} must be a {rank}-D torch.int32 tensor; got {t.dim()}-D {t.dtype}")
    if tile_n <= 0 or tile_m <= 0 or tile_m % block_sparse.BITS_PER_WORD:
        raise ValueError(f"tile_m must be a positive multiple of 32 and tile_n > 0; got ({tile_m}, {tile_n})")
    if tuple(q_counts.shape) != (b, hq, n_tiles, block_sparse.COUNT_FIELDS) or \
            tuple(q_blocks.shape[:3]) != (b, hq, n_tiles):
        raise ValueError(f"q_counts / q_blocks must have shape (batch, heads_q, ceil(seqlen_k / {tile_n}) = {n_tiles}, "
                         f"{block_sparse.COUNT_FIELDS} / width); got {tuple(q_counts.shape)} and "
                         f"{tuple(q_blocks.shape)}. Build them with fa4.block_sparse.tables(..., transposed=True).")


def _empty_score_grad(q, score_mod, score_params, score_grad):
    """fa4::bwd_sparse's dscore: score_params' shape with score_grad, else that shape with 0 rows
    ((0, 0) without a score_mod); fp32, float64 for float64 parameters (CPU)."""
    shape = list(score_params.shape) if score_mod != score_mods.NONE else [0, 0]
    if not (score_grad and score_mod != score_mods.NONE):
        shape[0] = 0
    dtype = torch.float64 if score_params is not None and score_params.dtype == torch.float64 else torch.float32
    return torch.empty(shape, dtype=dtype, device=q.device)


@torch.library.register_fake("fa4::bwd_sparse")
def _bwd_sparse_fake(dout, q, k, v, out, lse, dlse, q_counts, q_blocks, q_bits, tile_m, tile_n, softmax_scale,
                     softcap=0.0, score_mod=0, score_params=None, score_grad=False):
    _check_sparse_bwd(q, k, q_counts, q_blocks, q_bits, tile_m, tile_n)
    _check_score_mod(q, k, softcap, score_mod, score_params)
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v), _empty_score_grad(q, score_mod, score_params,
                                                                                           score_grad)


@torch.library.impl("fa4::bwd_sparse", "CPU")
def _bwd_sparse_cpu(dout, q, k, v, out, lse, dlse, q_counts, q_blocks, q_bits, tile_m, tile_n, softmax_scale,
                    softcap=0.0, score_mod=0, score_params=None, score_grad=False):
    _check_sparse_bwd(q, k, q_counts, q_blocks, q_bits, tile_m, tile_n)
    _check_score_mod(q, k, softcap, score_mod, score_params)
    tables = block_sparse.SparseTables(q_counts, q_blocks, q_bits, (tile_m, tile_n), transposed=True)
    visible = block_sparse.dense_mask(tables, q.shape[1], k.shape[1])
    bias = bias_grad = None
    dscore = _empty_score_grad(q, score_mod, score_params, score_grad)
    if score_mod != score_mods.NONE:
        bias, grad, bias_grad = score_mods.reference_bias(score_mod, score_params, k.shape[2], k.shape[1], q.shape[2])
        if score_grad:
            dscore = grad
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, dlse, softmax_scale, softcap, _NO_MASK,
                                              visible, bias, bias_grad if score_grad else None)
    return dq, dk, dv, dscore


def _fwd_sparse_setup_context(ctx, inputs, output):
    (q, k, v, _, _, _, _, _, softmax_scale, softcap, q_counts, q_blocks, q_bits, bwd_tile_m, bwd_tile_n,
     *score) = inputs
    score_mod, score_params = (score + [0, None])[:2]
    out, lse = output
    ctx.has_tables = q_counts is not None and q_blocks is not None and q_bits is not None
    ctx.score_grad = score_params is not None and score_params.requires_grad
    ctx.save_for_backward(q, k, v, out, lse, *((q_counts, q_blocks, q_bits) if ctx.has_tables else ()),
                          *((score_params,) if score_mod != score_mods.NONE else ()))
    ctx.options = (bwd_tile_m, bwd_tile_n, softmax_scale, softcap, score_mod)
    ctx.set_materialize_grads(False)


def _fwd_sparse_backward(ctx, dout, dlse):
    if not ctx.has_tables:
        raise RuntimeError("fa4::fwd_sparse was called without the backward's tables (q_counts, q_blocks, q_bits: "
                           "fa4.block_sparse.tables(..., transposed=True)); fa4.flex_attention passes them")
    q, k, v, out, lse, q_counts, q_blocks, q_bits, *score_params = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    score_params = score_params[0] if score_params else None
    dq, dk, dv, dscore = run_backward(_BWD_SPARSE, dout, q, k, v, out, lse, dlse, q_counts, q_blocks, q_bits,
                                      *ctx.options, score_params, ctx.score_grad)
    return (dq, dk, dv) + (None,) * 13 + (dscore.to(score_params.dtype) if ctx.score_grad else None,)


torch.library.register_autograd("fa4::fwd_sparse", _fwd_sparse_backward, setup_context=_fwd_sparse_setup_context)


# ------------------------------------------------------------------------------ backward
@torch.library.register_fake("fa4::bwd")
def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal=False, window_left=-1,
              window_right=-1, softcap=0.0, deterministic=False):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


@torch.library.impl("fa4::bwd", "CPU")
def _bwd_cpu(dout, q, k, v, out, lse, dlse, softmax_scale, causal=False, window_left=-1, window_right=-1,
             softcap=0.0, deterministic=False):
    # The reference is deterministic either way.
    mask = _prepare(q, k, v, softmax_scale, causal, window_left, window_right, softcap)
    return reference.attention_backward(dout, q, k, v, out, lse, dlse, softmax_scale, softcap, mask)


# ------------------------------------------------------------------------------ autograd
def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, _pack_gqa, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    ctx.set_materialize_grads(False)  # an unused LSE gets no zeros: the backward takes dlse=None


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = run_backward(_BWD, dout, q, k, v, out, lse, dlse, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("fa4::fwd", _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------- eager calls
_below_autograd = torch._C._AutoDispatchBelowAutograd
_functorch_active = torch._C._are_functorch_transforms_active


class _EagerAutograd(torch.autograd.Function):
    """Autograd of an eager fa4 call: the op runs below autograd, with the registered
    setup_context and backward (fa4.ops, fa4.ops_varlen). torch.library's generated autograd for
    the registered formula costs about 300 us of Python per training step on an H100 host
    (fill_defaults, redispatch; scripts/host_breakdown.py), more than the step's kernels; this
    wrapper costs one autograd.Function. torch.compile and torch.func keep the registered path."""

    @staticmethod
    def forward(ctx, op, setup_context, backward, *inputs):
        with _below_autograd():
            output = op(*inputs)
        setup_context(ctx, inputs, output)
        ctx.backward_fn = backward
        return output

    @staticmethod
    def backward(ctx, *grads):
        grads = tuple(ctx.backward_fn(ctx, *grads))
        if log.debug_enabled() and grads[0].is_cuda:
            log.launched("bwd", f"q {tuple(grads[0].shape)} k {tuple(grads[1].shape)}")
        return (None, None, None) + grads


_BWD = torch.ops.fa4.bwd.default
_BWD_SPARSE = torch.ops.fa4.bwd_sparse.default


def run_backward(op, *args):
    """A backward operator (fa4::bwd, fa4::bwd_varlen) from an autograd backward: below autograd
    when the engine runs it without grad mode (the usual case; the op has no autograd formula of
    its own, so this skips only the dispatcher's fallback for it), through the dispatcher
    otherwise (create_graph, torch.compile, torch.func). Native errors become their Python types."""
    try:
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or _functorch_active():
            return op(*args)
        with _below_autograd():
            return op(*args)
    except RuntimeError as error:
        raise native_error(error) from None


def call(op, setup_context, backward, *inputs, extra=None):
    """Run ``op`` (an OpOverload of a forward op whose first three inputs are q, k, v) as cheaply
    as the context allows: below autograd when no input needs a gradient (q, k, v, or the
    ``extra`` tensor input), through _EagerAutograd in eager training, through the registered
    autograd under torch.compile or a torch.func transform. Every check here is on the per-call
    path (host time is measured)."""
    if torch.compiler.is_compiling() or _functorch_active():
        return op(*inputs)
    q, k, v = inputs[0], inputs[1], inputs[2]
    if (q.requires_grad or k.requires_grad or v.requires_grad or (extra is not None and extra.requires_grad)) \
            and torch.is_grad_enabled():
        return _EagerAutograd.apply(op, setup_context, backward, *inputs)
    with _below_autograd():
        return op(*inputs)
