"""The ``torch.ops.fa4`` operators: schemas, device implementations, fake impls, autograd.

``fa4::fwd``  (q, k, v, ...) -> (out, lse): CUDA runs the AOT-compiled kernels, CPU the chunked
              torch reference.
``fa4::bwd``  (dout, q, k, v, out, lse, dlse, ...) -> (dq, dk, dv): CUDA runs the AOT-compiled
              backward (``fa4.backward``), CPU the chunked torch recomputation.
"""
from __future__ import annotations

import functools

import torch

from fa4 import _native, backward, heuristics, reference, settings
from fa4.validation import check_pack_gqa, check_qkv, check_scalars

_MASK_ARGS = "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0"

# ``deterministic`` is a backward option: the forward op carries it for autograd.
torch.library.define(
    "fa4::fwd",
    f"(Tensor q, Tensor k, Tensor v, float softmax_scale, {_MASK_ARGS}, bool? pack_gqa=None, "
    "bool deterministic=False) -> (Tensor out, Tensor lse)",
)
torch.library.define(
    "fa4::bwd",
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
    f"float softmax_scale, {_MASK_ARGS}, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)",
)


def _empty_outputs(q, v):
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[3]))
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    return out, lse


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


@functools.cache
def _variant_table() -> dict:
    """heuristics.select_variant as a dict, {call key: {tile family: variant}}: one lookup per call."""
    table = {}
    for v in _native.manifest()["variants"]:
        table.setdefault(heuristics.manifest_key(v), {})[v.get("tiles", "regular")] = v
    return table


@functools.cache
def _device_facts(index: int) -> tuple[tuple[int, int], int, int]:
    """(compute capability, L2 bytes, multiprocessor count) of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.L2_cache_size, props.multi_processor_count


@functools.cache
def _unused_vector(index: int) -> torch.Tensor:
    """An int32 CUDA vector for kernel arguments a variant ignores (never written)."""
    return torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", index))


def _tile_counter(device: torch.device) -> torch.Tensor:
    """Masked and varlen variants schedule tiles dynamically and count claims in word 0 of the
    semaphores: a fresh zero per call (a memset, captured like any other op under CUDA graphs)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


# Split-tail flags per (device, stream): zero when created, and every kernel leaves them zero
# (each merger resets the flags it consumed), so calls on one stream reuse them without a
# memset. One buffer per stream: kernels on different streams may run at the same time.
_split_semaphores: dict[tuple[int, int], torch.Tensor] = {}


def _split_workspace(device: torch.device, stream: int, words: tuple[int, int]):
    """(semaphores, partials) for a split-tail launch; partials are scratch (any contents)."""
    sem_words, partial_words = words
    partials = torch.empty(partial_words, dtype=torch.float32, device=device)
    if torch.cuda.is_current_stream_capturing():
        # A cached buffer created here would be zeroed inside the graph, not now: a fresh one
        # per captured call instead, its (small) memset replayed with the graph.
        return torch.zeros(sem_words, dtype=torch.int32, device=device), partials
    key = (device.index, stream)
    semaphores = _split_semaphores.get(key)
    if semaphores is None or semaphores.numel() < sem_words:
        semaphores = _split_semaphores[key] = torch.zeros(sem_words, dtype=torch.int32, device=device)
    return semaphores, partials


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a 16-byte aligned base and 16-byte multiple strides; copy the rare view that
    breaks this (any stride with a contiguous last dim is otherwise used in place)."""
    elem = t.element_size()
    if t.data_ptr() % 16 == 0 and all((s * elem) % 16 == 0 and s > 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _unsupported(q, v, mask, softcap, capability) -> NotImplementedError:
    variants = _native.manifest()["variants"]
    arch = heuristics.arch_name(capability)
    if arch is None:
        return NotImplementedError(
            f"fa4 ships CUDA kernels for Hopper (sm_90: H100/H200) only; {q.device} is "
            f"sm_{capability[0]}{capability[1]}. Use torch.nn.functional.scaled_dot_product_attention, "
            "or CPU tensors for fa4's reference implementation."
        )
    dims = heuristics.supported_head_dims(variants, capability)
    key = (q.shape[3], v.shape[3])
    if key not in dims:
        return NotImplementedError(
            f"head_dim={key[0]}, head_dim_v={key[1]} is not compiled into this build of fa4 "
            f"(available (head_dim, head_dim_v): {dims}). Pad the head dimension or use "
            "torch.nn.functional.scaled_dot_product_attention."
        )
    return NotImplementedError(
        f"no compiled fa4 kernel for dtype={q.dtype}, mask={mask.kind}, softcap={softcap > 0} on "
        f"{arch}; this build was filtered (FA4_VARIANTS) or lacks that combination."
    )


def _longest_first(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """Sequence indices by decreasing query length (computed on the GPU, no host sync): the
    kernel schedules the tiles of long sequences first so short ones fill the tail."""
    if cu_seqlens_q.shape[0] <= 2:
        return _unused_vector(cu_seqlens_q.device.index)[: cu_seqlens_q.shape[0] - 1]
    lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def _run_kernel(q, k, v, out, lse, mask, softmax_scale, softcap, varlen=None, pack_gqa=None):
    """Launch the compiled forward. q/k/v/out are 4-D (batch, seqlen, heads, dim) and lse 3-D;
    varlen = (cu_seqlens_q, cu_seqlens_k, seqused_k | None, max_seqlen_q) with batch 1 holding
    the packed rows. pack_gqa: None (heuristics.pack_gqa_factor decides), True or False."""
    if not _native.available():
        raise RuntimeError(
            "fa4's CUDA kernels are unavailable (FA4_DISABLE_NATIVE=1 or the package was not built); "
            "move the tensors to the CPU for the reference implementation."
        )
    capability, l2_bytes, num_sms = _device_facts(q.device.index)
    if varlen is None:
        mask = heuristics.effective_mask(mask, q.shape[1], k.shape[1])
    key = heuristics.call_key(capability, heuristics.DTYPE_NAMES[str(q.dtype)], q.shape[3], v.shape[3],
                              mask.kind, softcap > 0.0, varlen is not None, kernel="fwd")
    families = _variant_table().get(key, {})
    variant = families.get("regular")
    if variant is None:
        raise _unsupported(q, v, mask, softcap, capability)
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    longest_q = q.shape[1] if varlen is None else varlen[3]
    packed = heuristics.pack_gqa_factor(q.shape[2], k.shape[2], longest_q, variant["tile_m"], pack_gqa)
    if len(families) > 1:  # extra tile families: dense hd64 (no mask, causal), hd128 (no mask)
        built = {tiles: found["tile_m"] for tiles, found in families.items() if tiles != "regular"}
        tiles = heuristics.tile_family(longest_q, k.shape[1], packed, variant["tile_m"], built,
                                       settings.tile_family_override(), mask.kind)
        if tiles != "regular":
            variant = families[tiles]
            packed = heuristics.pack_gqa_factor(q.shape[2], k.shape[2], longest_q, variant["tile_m"], pack_gqa)
    tile_m = variant["tile_m"]
    block_rows = tile_m // packed  # query rows of one head per tile
    if varlen is None:
        cu_q = cu_k = used_k = order = _unused_vector(q.device.index)
        pairs, tile_rows, seqlen_k = q.shape[0] * q.shape[2] // packed, 1, k.shape[1]
    else:
        cu_q, cu_k, used_k, _ = varlen
        num_seqs = cu_q.shape[0] - 1
        order = _longest_first(cu_q)
        pairs, seqlen_k = num_seqs * q.shape[2] // packed, max(1, k.shape[1] // max(num_seqs, 1))
        # The kernel sizes its tile range as ceil(rows / block_rows) blocks per sequence; this
        # many rows covers any split of the packed queries without reading cu_seqlens on the host.
        blocks = -(-q.shape[1] // block_rows) + num_seqs
        tile_rows = block_rows * max(1, -(-blocks // max(num_seqs, 1)))
    group = heuristics.heads_per_group(l2_bytes, seqlen_k, q.shape[3], v.shape[3], q.element_size(), pairs,
                                      settings.l2_swizzle_bytes(), mask.kind,
                                      num_m_blocks=-(-q.shape[1] // block_rows) if varlen is None else None,
                                      num_sms=num_sms)
    grid = heuristics.grid_size(num_sms, mask.kind, settings.persistent_override())
    stream = torch.cuda.current_stream(q.device).cuda_stream
    tail_ctas = 0
    if variant.get("split_tail") and grid == num_sms:
        # Static schedule: as many tiles as the kernel counts, each seeing every K/V block.
        num_tiles = q.shape[0] * (q.shape[2] // packed) * -(-q.shape[1] // block_rows)
        n_blocks = -(-k.shape[1] // variant["tile_n"])
        tail_ctas = heuristics.split_tail_ctas(num_tiles, num_sms, n_blocks, v.shape[3],
                                               settings.split_tail_override())
    if tail_ctas:
        semaphores, partials = _split_workspace(
            q.device, stream, _native.split_workspace(variant["name"], v.shape[3], num_sms))
    else:
        dynamic = mask.kind != "none" or varlen is not None  # the kernel claims tiles from a counter
        semaphores = _tile_counter(q.device) if dynamic else _unused_vector(q.device.index)
        partials = _unused_vector(q.device.index).view(torch.float32)
    args = (variant["name"], q, k, v, out, lse, semaphores, partials, cu_q, cu_k,
            used_k if used_k is not None else cu_q, order, softmax_scale, softcap, mask.window_left,
            mask.window_right, group, grid, tile_rows, used_k is not None, packed, tail_ctas, stream)
    if torch.cuda.current_device() == q.device.index:
        _native.fwd(*args)
    else:  # the library launches on the current device
        with torch.cuda.device(q.device):
            _native.fwd(*args)


@torch.library.impl("fa4::fwd", "CUDA")
def _fwd_cuda(q, k, v, softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
              pack_gqa=None, deterministic=False):
    mask = _prepare(q, k, v, softmax_scale, causal, window_left, window_right, softcap, pack_gqa)
    out, lse = _empty_outputs(q, v)
    b, sq, hq, _ = q.shape
    if min(b, sq, hq) == 0:
        return out, lse
    if k.shape[1] == 0:  # nothing to attend to: the empty-row convention
        return out.zero_(), lse.fill_(float("-inf"))
    _run_kernel(q, k, v, out, lse, mask, softmax_scale, softcap, pack_gqa=pack_gqa)
    return out, lse


# ------------------------------------------------------------------------------ backward
@torch.library.register_fake("fa4::bwd")
def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal=False, window_left=-1,
              window_right=-1, softcap=0.0, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.impl("fa4::bwd", "CPU")
def _bwd_cpu(dout, q, k, v, out, lse, dlse, softmax_scale, causal=False, window_left=-1, window_right=-1,
             softcap=0.0, deterministic=False):
    # The reference is deterministic either way.
    mask = _prepare(q, k, v, softmax_scale, causal, window_left, window_right, softcap)
    return reference.attention_backward(dout, q, k, v, out, lse, dlse, softmax_scale, softcap, mask)


def _bwd_variants(q, v, mask, softcap, varlen: bool) -> tuple[dict, dict]:
    """The compiled backward preprocess and main kernel for a call, or a NotImplementedError
    saying what to use."""
    if not _native.available():
        raise RuntimeError(
            "fa4's CUDA kernels are unavailable (FA4_DISABLE_NATIVE=1 or the package was not built); "
            "move the tensors to the CPU for the reference implementation."
        )
    capability = _device_facts(q.device.index)[0]
    dtype, dims = heuristics.DTYPE_NAMES[str(q.dtype)], (q.shape[-1], v.shape[-1])
    main = _variant_table().get(
        heuristics.call_key(capability, dtype, *dims, mask.kind, softcap > 0.0, varlen, kernel="bwd"), {})
    pre = _variant_table().get(heuristics.call_key(capability, dtype, *dims, "none", False, varlen, kernel="bwd_pre"),
                               {})
    if "regular" not in main or "regular" not in pre:
        raise backward.unsupported(q, v, mask, softcap, capability)
    return pre["regular"], main["regular"]


@torch.library.impl("fa4::bwd", "CUDA")
def _bwd_cuda(dout, q, k, v, out, lse, dlse, softmax_scale, causal=False, window_left=-1, window_right=-1,
              softcap=0.0, deterministic=False):
    mask = _prepare(q, k, v, softmax_scale, causal, window_left, window_right, softcap)
    if min(q.shape[0], q.shape[1], q.shape[2], k.shape[1]) == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    mask = heuristics.effective_mask(mask, q.shape[1], k.shape[1])  # as the forward ran
    variants = _bwd_variants(q, v, mask, softcap, varlen=False)
    return backward.run_backward(variants, dout, q, k, v, out, lse, dlse, mask, softmax_scale, softcap,
                                 deterministic=deterministic)


# ------------------------------------------------------------------------------ autograd
def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, _pack_gqa, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap, deterministic)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fa4.bwd(dout, q, k, v, out, lse, dlse, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("fa4::fwd", _backward, setup_context=_setup_context)
