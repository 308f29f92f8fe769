"""FlexAttention BlockMasks as the tables fa4's block-sparse kernels read (``fa4::fwd_sparse``).

A kernel tile of (tile_m queries, tile_n keys) is *empty* when every BlockMask block it overlaps
is empty (never loaded), *full* when every one is full and it ends within the keys (no mask
evaluated), and *partial* otherwise: then its mask is a bitmask, one bit per (query, key), made
here with torch ops. Inside a BlockMask's partial blocks the bits are the ``mask_mod``'s (evaluated
with ``torch.vmap``, as ``create_mask`` does), inside its full blocks all set, elsewhere and past
the sequences clear. So BlockMask block sizes need not match the kernel's tiles: a tile that
mixes kinds is partial. As in torch's kernels, ``mask_mod`` sees the call's batch and head
indices: where the BlockMask broadcasts along a dimension the mask_mod reads (found by tracing
it), the tables are built per index of that dimension.

Tables (layout: ``fa4_fwd`` / ``fa4_bwd`` in csrc_shims/fa4_shim.h; kernel side:
fa4_kernels.block_info.SparseBlocks and mask.AttentionMask.load_bits), broadcast over batch and
heads where the BlockMask is; the backward's are *transposed*: per K/V tile its query tiles, and
per slot one row of bits over the queries for each key:
  counts (B, H, M, 4) int32: per query tile its partial blocks, all its blocks, and the bitmask
         slot of its first partial block (its i-th partial block reads slot first + i); and per
         position the tile of the row that runs at it (the row's tiles by blocks visited, most
         first: the forward's dynamic schedule, the backward's launch order);
  blocks (B, H, M, N) int32: its K/V blocks, partial ones first;
  bits   (slots * tile_m * tile_n / 32,) int32: slot 0 all clear (the one block a tile that
         sees no key visits), then one slot per partial tile, in table order.
Eager calls give each partial tile one slot, which reads the number of partial tiles on the host
(one sync), and reuse the tables of a BlockMask they have seen (``tables`` caches them per
BlockMask object). Under torch.compile every table entry gets a slot (one bit per (query, key)
pair of every (batch, head) grid the tables hold: 32 MB for a broadcast 16k x 16k mask), so the
build is free of data-dependent shapes and traces into the graph.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import NamedTuple

import torch

BITS_PER_WORD = 32  # fa4_kernels.mask.BITS_PER_WORD
COUNT_FIELDS = 4  # fa4_kernels.block_info.SPARSE_COUNT_FIELDS
_EMPTY, _PARTIAL, _FULL = 0, 1, 2
# Partial tiles whose mask_mod is evaluated at once (tiles x tile_m x tile_n booleans).
_EVAL_ELEMENTS = 1 << 26
# The tile the CPU implementation's tables use when no kernel is built (any shape works there).
CPU_TILE = (128, 128)


class SparseTables(NamedTuple):
    counts: torch.Tensor
    blocks: torch.Tensor
    bits: torch.Tensor
    tile: tuple[int, int]  # (tile_m, tile_n) the tables were built for
    transposed: bool = False  # the backward's: rows of the tables are K/V tiles


def kernel_tile(dtype: torch.dtype, head_dim: int, head_dim_v: int, device: torch.device, softcap: bool = False,
                kernel: str = "fwd", score_mod: str = "none") -> tuple[int, int]:
    """(tile_m, tile_n) of the block-sparse ``kernel`` ("fwd" or "bwd") that serves this call
    (``score_mod``: "none", "alibi" or "relbias", the kernels' bias): the build's manifest
    (fa4_kernels.heuristics decided it: hd64's backward with softcap takes 64-query blocks,
    without 128), CPU_TILE on the CPU."""
    if device.type != "cuda":
        return CPU_TILE
    from fa4 import heuristics

    tile = _built_tile(heuristics.DTYPE_NAMES.get(str(dtype)), head_dim, head_dim_v, bool(softcap), kernel,
                       score_mod)
    if tile is not None:
        return tile
    what = "kernel" if kernel == "fwd" else "backward kernel"
    bias = "" if score_mod == "none" else f", score_mod={score_mod}"
    raise NotImplementedError(f"this build of fa4 has no block-sparse {what} for dtype={dtype}, head_dim={head_dim}, "
                              f"head_dim_v={head_dim_v}{bias}; use torch.nn.attention.flex_attention")


@torch._dynamo.assume_constant_result  # read at graph-capture time (a file read dynamo cannot trace)
def _built_tile(dtype: str | None, head_dim: int, head_dim_v: int, softcap: bool, kernel: str, score_mod: str):
    """(tile_m, tile_n) of the build manifest's block-sparse ``kernel`` variant, or None."""
    return _built_tiles().get((kernel, dtype, head_dim, head_dim_v, softcap, score_mod))


@functools.cache
def _built_tiles() -> dict:
    """{(kernel, dtype, head_dim, head_dim_v, softcap, score_mod): (tile_m, tile_n)} of the
    manifest's block-sparse variants, read once (a scan of the manifest per call was tens of
    microseconds)."""
    from fa4 import _native

    return {(v.get("kernel", "fwd"), v["dtype"], v["head_dim"], v["head_dim_v"], bool(v["softcap"]),
             v.get("score_mod", "none")): (v["tile_m"], v["tile_n"])
            for v in _native.manifest()["variants"] if v["mask"] == "sparse" and not v.get("varlen")}


# ------------------------------------------------------------------------------ tables
_CACHE: dict[tuple, tuple[weakref.ref, SparseTables]] = {}


def tables(block_mask, batch: int, heads: int, tile: tuple[int, int], transposed: bool = False) -> SparseTables:
    """The tables of ``block_mask`` for (batch, heads) query heads and kernel tiles ``tile``
    (``transposed``: the backward's); eager calls reuse them for the same BlockMask object
    (torch.compile traces the build)."""
    if torch.compiler.is_compiling():
        return build_tables(block_mask, batch, heads, tile, transposed)
    key = (id(block_mask), batch, heads, tile, transposed)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is block_mask:
        return hit[1]
    built = build_tables(block_mask, batch, heads, tile, transposed)
    try:
        ref = weakref.ref(block_mask, lambda _, key=key: _CACHE.pop(key, None))
    except TypeError:  # not weakly referenceable: no caching
        return built
    _CACHE[key] = (ref, built)
    return built


def _block_kinds(block_mask) -> torch.Tensor:
    """(Bm, Hm, QB, KB) int8: each BlockMask block empty, partial or full."""
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    kinds = torch.zeros(idx.shape, dtype=torch.int8, device=idx.device)
    width = idx.shape[-1]

    def mark(num, idx, kind):
        listed = torch.arange(width, device=idx.device) < num[..., None]
        kinds.scatter_reduce_(-1, idx.long().clamp(0, width - 1), (listed * kind).to(torch.int8), reduce="amax")

    mark(num, idx, _PARTIAL)
    if block_mask.full_kv_num_blocks is not None:
        mark(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, _FULL)
    return kinds


def _tile_kinds(kinds, block_size, seq_lengths, tile):
    """(Bm, Hm, M, N) int8 kinds of the kernel tiles, from the blocks' kinds on a grid of
    gcd(tile, block) cells."""
    (bq, bk), (sq, sk), (tm, tn) = block_size, seq_lengths, tile
    gq, gk = math.gcd(tm, bq), math.gcd(tn, bk)
    m_tiles, n_tiles = -(-sq // tm), -(-sk // tn)
    dev = kinds.device
    rows = torch.arange(m_tiles * tm // gq, device=dev) * gq  # first row of each cell
    cols = torch.arange(n_tiles * tn // gk, device=dev) * gk
    cells = kinds[:, :, (rows // bq).clamp(max=kinds.shape[2] - 1)][..., (cols // bk).clamp(max=kinds.shape[3] - 1)]
    row_real, col_real = (rows < sq)[:, None], (cols < sk)[None, :]
    # Cells past seqlen_q do not count; cells reaching past seqlen_k make a tile partial (its bits
    # clear there): a BlockMask's own full block may cross it (BlockMask.from_kv_blocks).
    col_whole = (cols + gk <= sk)[None, :]
    visible = (cells > _EMPTY) & row_real & col_real
    full = ((cells == _FULL) & col_whole) | ~row_real
    shape = (*kinds.shape[:2], m_tiles, tm // gq, n_tiles, tn // gk)
    visible = visible.reshape(shape).any(5).any(3)
    full = full.reshape(shape).all(5).all(3)
    return torch.where(full, _FULL, torch.where(visible, _PARTIAL, _EMPTY)).to(torch.int8)


def _vmapped(mask_mod):
    """mask_mod over (tiles) x (tile_m rows) x (tile_n cols): b, h (P,), q (P, tm), kv (P, tn)."""
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    return torch.vmap(fn, in_dims=(0, 0, 0, 0))


def _tile_bits(block_mask, kinds, where, tile, transposed) -> torch.Tensor:
    """(1 + P, tile_m, tile_n / 32) int32 bitmasks: slot 0 all clear, then the partial tiles at
    ``where`` (P x (b, h, m, n)); ``transposed``: (1 + P, tile_n, tile_m / 32), a row of bits over
    the queries per key. Indices are int32, as the mask_mod's are inside torch's flex kernels:
    each bit costs a few dozen index operations, and int64 ones take several instructions each."""
    (bq, bk), (sq, sk), (tm, tn) = block_mask.BLOCK_SIZE, block_mask.seq_lengths, tile
    dev = kinds.device
    shape = (tn, tm // BITS_PER_WORD) if transposed else (tm, tn // BITS_PER_WORD)
    out = torch.empty((1 + where.shape[0], *shape), dtype=torch.int32, device=dev)
    out[0] = 0
    # Bit i of a word is element 32w + i: the words are sums of distinct powers of two, bit 31's
    # weight -2^31, so an int32 sum is exact (no partial sum leaves int32's range). One level in
    # int32: bytes, then int64 words, then wrapped to int32 were three kernels per chunk under
    # torch.compile, plus a copy into the slots.
    weights = torch.tensor([1 << i for i in range(BITS_PER_WORD - 1)] + [-(1 << (BITS_PER_WORD - 1))],
                           dtype=torch.int32, device=dev)
    mask_mod = block_mask.mask_mod
    evaluate = None if mask_mod is None or getattr(mask_mod, "__name__", None) == "noop_mask" else _vmapped(mask_mod)
    step = max(1, _EVAL_ELEMENTS // (tm * tn))
    for start in range(0, where.shape[0], step):
        b, h, m, n = where[start:start + step].unbind(1)
        q = m[:, None] * tm + torch.arange(tm, device=dev, dtype=torch.int32)
        kv = n[:, None] * tn + torch.arange(tn, device=dev, dtype=torch.int32)
        cell = kinds[b[:, None, None], h[:, None, None], (q // bq).clamp(max=kinds.shape[2] - 1)[:, :, None],
                     (kv // bk).clamp(max=kinds.shape[3] - 1)[:, None, :]]
        bits = cell == _FULL
        if evaluate is not None:
            partial = evaluate(b, h, q.clamp(max=sq - 1), kv.clamp(max=sk - 1))
            bits |= (cell == _PARTIAL) & partial
        else:  # no mask_mod: a partial block is all visible (BlockMask.from_kv_blocks)
            bits |= cell == _PARTIAL
        bits &= (q < sq)[:, :, None] & (kv < sk)[:, None, :]
        if transposed:
            bits = bits.transpose(1, 2)
        words = (bits.reshape(*bits.shape[:2], -1, BITS_PER_WORD).to(torch.int32) * weights).sum(-1, dtype=torch.int32)
        out[1 + start:1 + start + step] = words
    return out


# _reads_batch_and_head's answers per mask_mod (eager calls): its trace was two thirds of an eager
# table build (16 of 24 ms for a causal mask_mod at 4k tokens on the CPU machine).
_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mask_reads(mask_mod, device) -> tuple[bool, bool]:
    """Does ``mask_mod`` read its batch / head index? fa4.masks' say so themselves (and their
    combinations with other functions are assumed to read both); any other is traced, once per
    function object and device in eager calls (torch.compile traces it once per graph)."""
    from fa4 import masks

    if isinstance(mask_mod, masks.MaskMod):
        return mask_mod.reads_batch_and_head()
    if torch.compiler.is_compiling():
        return _reads_batch_and_head(mask_mod, device)
    try:
        per_device = _READS.setdefault(mask_mod, {})
    except TypeError:  # not hashable or not weakly referenceable: traced every time
        return _reads_batch_and_head(mask_mod, device)
    if device not in per_device:
        per_device[device] = _reads_batch_and_head(mask_mod, device)
    return per_device[device]


@torch._dynamo.assume_constant_result  # traced at graph-capture time, a constant in the graph
def _reads_batch_and_head(mask_mod, device) -> tuple[bool, bool]:
    """Does ``mask_mod`` read its batch / head index? From a trace of it under vmap (make_fx;
    distinct input tensors on the mask's device, so each placeholder is its own); (True, True)
    where it cannot be traced."""
    if mask_mod is None or getattr(mask_mod, "__name__", None) == "noop_mask":
        return False, False
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        args = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4)]
        graph = make_fx(_vmapped_grid(mask_mod))(*args).graph
    except Exception:  # noqa: BLE001 (any failure: assume it reads both)
        return True, True
    users = [len(n.users) for n in graph.nodes if n.op == "placeholder"]
    return users[0] > 0, users[1] > 0


def _vmapped_grid(mask_mod):
    """mask_mod over (b) x (h) x (q) x (kv), as torch's create_mask evaluates it."""
    fn = mask_mod
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims)
    return fn


def build_tables(block_mask, batch: int, heads: int, tile: tuple[int, int], transposed: bool = False,
                 compact: bool | None = None) -> SparseTables:
    """The tables (module doc); ``compact``: one slot per partial tile (a host sync; default
    outside torch.compile) or one per table entry."""
    compact = not torch.compiler.is_compiling() if compact is None else compact
    tm, tn = tile
    if (tm if transposed else tn) % BITS_PER_WORD:
        raise ValueError(f"tile {tile}: the bits' row ({'tile_m' if transposed else 'tile_n'}) must be a multiple "
                         f"of {BITS_PER_WORD}")
    bm, hm = block_mask.kv_num_blocks.shape[:2]
    if bm not in (1, batch) or hm not in (1, heads):
        raise ValueError(f"block_mask has (batch, heads) = ({bm}, {hm}); the inputs have ({batch}, {heads}) "
                         "(a BlockMask broadcasts only along size-1 dimensions)")
    kinds = _block_kinds(block_mask)
    # Along a broadcast dimension the mask_mod reads, its partial blocks differ per index.
    reads_b, reads_h = _mask_reads(block_mask.mask_mod, str(kinds.device))
    kinds = kinds.expand(batch if reads_b else -1, heads if reads_h else -1, -1, -1)
    tiles = _tile_kinds(kinds, block_mask.BLOCK_SIZE, block_mask.seq_lengths, tile)
    if transposed:  # per K/V tile, its query tiles (rows contiguous: the kernel reads them so)
        tiles = tiles.transpose(2, 3).contiguous()
    n_tiles = tiles.shape[-1]
    cols = torch.arange(n_tiles, device=tiles.device, dtype=torch.int32)
    order = torch.where(tiles == _PARTIAL, cols, torch.where(tiles == _FULL, n_tiles + cols, 2 * n_tiles + cols))
    blocks = (order.sort(-1).values % n_tiles).to(torch.int32)
    num_partial = (tiles == _PARTIAL).sum(-1, dtype=torch.int32)
    total = (tiles != _EMPTY).sum(-1, dtype=torch.int32)
    if compact:
        first_slot = (num_partial.flatten().cumsum(0, dtype=torch.int32) - num_partial.flatten() + 1).view_as(
            num_partial)
        # Partial tiles in slot order: each tile's first num_partial list entries, tiles in table order.
        listed = torch.arange(n_tiles, device=tiles.device) < num_partial[..., None]
        b, h, row, j = (i.to(torch.int32) for i in listed.nonzero(as_tuple=True))  # the one host sync
    else:
        # Entry j of table row r takes slot 1 + r * n_tiles + j (its bits unused past num_partial).
        rows = torch.arange(num_partial.numel(), device=tiles.device, dtype=torch.int32).view_as(num_partial)
        first_slot = 1 + rows * n_tiles
        b, h, row, j = (g.flatten() for g in torch.meshgrid(
            *(torch.arange(n, device=tiles.device, dtype=torch.int32) for n in blocks.shape), indexing="ij"))
    col = blocks[b, h, row, j]
    where = torch.stack((b, h, col, row) if transposed else (b, h, row, col), 1)  # (b, h, query tile, K/V tile)
    bits = _tile_bits(block_mask, kinds, where, tile, transposed)
    # A tile that sees no key visits block 0 through the all-clear slot 0.
    empty = total == 0
    num_partial = torch.where(empty, 1, num_partial)
    first_slot = torch.where(empty, 0, first_slot)
    total = torch.where(empty, 1, total)
    # Longest first (stable: equal tiles keep their order, and with it the heads' L2 sharing).
    order = torch.sort(total, dim=-1, descending=True, stable=True).indices.to(torch.int32)
    counts = torch.stack((num_partial, total, first_slot, order), -1)
    flat_bits = bits.reshape(-1)
    expand = lambda t: t.expand(batch, heads, *t.shape[2:])  # noqa: E731
    return SparseTables(expand(counts), expand(blocks), flat_bits, (tm, tn), transposed)


# -------------------------------------------------------------------------- the CPU side
def dense_mask(tables: SparseTables, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(B, H, seqlen_q, seqlen_k) bool: the mask the tables describe (the CPU implementation, tests)."""
    if tables.transposed:  # decode as a forward's tables of the transposed problem
        tm, tn = tables.tile
        flipped = SparseTables(tables.counts, tables.blocks, tables.bits, (tn, tm))
        return dense_mask(flipped, seqlen_k, seqlen_q).transpose(2, 3)
    counts, blocks, bits = tables.counts, tables.blocks, tables.bits
    tm, tn = tables.tile
    words = tn // BITS_PER_WORD
    b, h, m_tiles, width = blocks.shape
    n_tiles = -(-seqlen_k // tn)
    dev = blocks.device
    slots = bits.reshape(-1, tm, words)
    shifts = torch.arange(BITS_PER_WORD, device=dev)
    slot_bits = ((slots[..., None] >> shifts) & 1).bool().reshape(slots.shape[0], tm, tn)
    mask = torch.zeros((b, h, m_tiles * tm, n_tiles * tn), dtype=torch.bool, device=dev)
    tile_view = mask.view(b, h, m_tiles, tm, n_tiles, tn)
    num_partial, total, first = (counts[..., i].clamp(min=0) for i in range(3))
    total = total.clamp(1, width)
    num_partial = torch.minimum(num_partial, total)
    for i in range(width):
        n = blocks[..., i].long().clamp(0, n_tiles - 1)
        is_partial, is_listed = i < num_partial, i < total
        slot = (first + i).long().clamp(0, slots.shape[0] - 1)
        tile_bits = torch.where(is_partial[..., None, None], slot_bits[slot],
                                torch.ones((), dtype=torch.bool, device=dev))
        tile_bits &= is_listed[..., None, None]
        bi, hi, mi = torch.meshgrid(torch.arange(b, device=dev), torch.arange(h, device=dev),
                                    torch.arange(m_tiles, device=dev), indexing="ij")
        current = tile_view[bi, hi, mi, :, n]  # (b, h, m, tm, tn)
        tile_view[bi, hi, mi, :, n] = current | tile_bits
    return mask[:, :, :seqlen_q, :seqlen_k]
