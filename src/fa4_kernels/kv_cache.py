"""A KV cache the forward kernel reads through a page table and appends to (sm90/fwd.py, kv_cache
variants; fa4.attention_with_kvcache).

The cache is paged: K and V are (num_pages, page_size, heads_kv, dim), and row r of sequence b
lives in page ``page_table[b, r // page_size]`` at row ``r % page_size``. A contiguous cache
(batch_cache, seqlen_cache, heads_kv, dim) is the same thing with one page per sequence:
page_size = seqlen_cache and page_table = cache_batch_idx as a column. A sequence holds
``cache_seqlens[b] + seqlen_new`` keys, the last seqlen_new of them appended by the call.

Loads: a K or V block of tile_n rows arrives as tile_n / CHUNK_ROWS TMA boxes of CHUNK_ROWS rows,
each from its own page (page sizes are multiples of CHUNK_ROWS), all on the stage's one
transaction barrier. A box wholly past the sequence's end gets a row coordinate just past its
page: the TMA fills it with zeros and still counts its bytes, and the page table entry behind it
(serving engines leave entries past a sequence's pages unset) is never used. The rows past the
end inside the sequence's last box (at most CHUNK_ROWS - 1) come from the cache as they are: their
scores are masked (a select, so inf or NaN there is harmless) and the consumer zeroes them in V
before the P @ V (sm90/fwd.py clear_stale_v_rows), where 0 * inf would be NaN.

Append: at the start of a tile the consumer threads copy the appended rows of k_new / v_new that
fall in the tile's K/V blocks into their cache slots, fence them (generic to async proxy) and
arrive on a named barrier, which the producer waits on before the tile's loads (the producer's 24
registers cannot hold the copies' addresses: they spilled). Every tile that visits such a block
writes them, with the same values (the tiles of one K/V head's query heads, query blocks, or
split pieces), so no tile waits for another (FlashAttention-3 appends the same way,
hopper/flash_fwd_kernel_sm90.h).

The long tiles (chunked prefill: heuristics.kv_cache_long_config) load a block in fewer boxes,
decided per block by the producer (PagedKV.load_block): one whole-block box where the block lies
inside one page and inside the sequence (a contiguous cache, pages of tile_n rows or more), and
a block wholly inside the appended rows from k_new / v_new themselves. Their consumers then store
before the producer's wait only the appended rows of the block that straddles the cached and
appended rows; the rest are stored in shares among the tiles of the first packed query head, and
no tile reads them back (FwdConfig.appends_from_new, whole_block_boxes). H100, a 2048-row chunk
against a 32k cache (session 72): 525 -> 636 TFLOP/s, the same chunk appended by its call 451 ->
625, the dense forward 630-661 on the same tensors.

The append twin (catalog.VariantKey.kv_append: the unmasked twin again, run by calls with rows to
append) shortens that wait. A decoding step appends a row or a few, all in the sequence's last
block, which is a tile's first visited block: where that holds for at most PATCHED_ROWS rows, the
twin's producer loads that block without waiting (the appended slots may arrive old or new), and the consumers copy the
appended rows into the loaded K and V stages themselves (``patch_rows``) before the block's GEMMs
(``waits_for_append`` decides, alike in the producer and the consumers). Only the twin carries
that code: in every kernel it grew the image by ~300-400 instructions (hd128), which a decoding
CTA fetches through instruction-cache misses, and calls with nothing to append got 0.25-0.3 us
slower at 1 x 4k (docs/perf_notes.md, session 58).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from fa4_kernels.ptx import prefetch_l1

CHUNK_ROWS = 16  # rows per TMA box; page sizes are multiples of it
# Rows of one packed query head in a KV-cache tile below the 8 of a Q piece (block_info.Q_PIECE_ROWS):
# a piece then holds these rows of each of 8 / rows heads, so a 64-row tile stacks up to 64 heads (one
# decoding token of an MQA group). fa4_rules.c takes the fewest (fa4_kv_cache_head_rows).
FEW_HEAD_ROWS = (4, 2, 1)
VECTOR_BYTES = 16  # one append copy per lane and step
PATCHED_ROWS = 16  # appends up to this many rows into the first block's stages (see above)


@cute.jit
def waits_for_append(seqlen_new: Int32, seqlen_k: Int32, last_block: Int32, tile_n: cutlass.Constexpr[int],
                     patches: cutlass.Constexpr[bool]):
    """1 where a tile whose K/V blocks end with ``last_block`` must wait for its consumers'
    append before its loads. Without ``patches`` (every kernel but the append twin) whenever rows
    are appended; with it, where its blocks hold appended rows that it does not patch in (some lie
    before the last block, or more than PATCHED_ROWS of them). The producer and the consumers
    decide alike."""
    wait = Int32(0)
    if seqlen_new > 0:
        if const_expr(patches):
            new_first = seqlen_k - seqlen_new
            if (last_block + 1) * tile_n > new_first:
                if new_first < last_block * tile_n or seqlen_new > PATCHED_ROWS:
                    wait = Int32(1)
        else:
            wait = Int32(1)
    return wait


@cute.jit
def patch_rows(sT: cute.Tensor, mNew: cute.Tensor, head: Int32, batch_idx: Int32, seqlen_new: Int32,
               seqlen_k: Int32, block: Int32, tile_n: cutlass.Constexpr[int], dim: cutlass.Constexpr[int],
               dtype: cutlass.Constexpr, thread: Int32, num_threads: cutlass.Constexpr[int]):
    """Copy the appended rows of mNew ((seqlen_new, dim, heads, batch) view) that fall in K/V
    block ``block`` into its loaded stage sT ((tile_n, dim)), one 16-byte vector per thread and
    step (the caller fences them for the GEMM and syncs). Their cache stores, made at the tile's
    start, bring the rows into L1."""
    vec = VECTOR_BYTES * 8 // dtype.width
    per_row = dim // vec
    new_first = seqlen_k - seqlen_new
    block_first = block * tile_n
    lo = cutlass.max(new_first, block_first)
    count = cutlass.max(cutlass.min(seqlen_k, block_first + tile_n) - lo, 0) * per_row
    for i in cutlass.range(thread, count, num_threads, unroll=1):
        row = lo + i // per_row
        col = i - (i // per_row) * per_row
        src = cute.local_tile(mNew[None, None, head, batch_idx], (1, vec), (row - new_first, col))
        dst = cute.local_tile(sT, (1, vec), (row - block_first, col))
        dst.store(src.load())


@dataclass(frozen=True)
class PagedKV:
    """One sequence's view of the cache: where each CHUNK_ROWS-row box of a K/V block lives."""
    page_table: cute.Tensor  # (batch, max_pages) int32
    page_size: Int32  # rows per page, a multiple of CHUNK_ROWS
    batch_idx: Int32
    seqlen_k: Int32  # keys of this sequence: cached + appended
    tile_n: cutlass.Constexpr[int]

    @staticmethod
    def capacity(page_table: cute.Tensor, page_size: Int32) -> Int32:
        """Rows a sequence can hold: the bound of every K/V block range."""
        return cute.size(page_table.shape[1]) * page_size

    def slot_of(self, row: Int32):
        """The page table column of sequence row ``row``: row // page_size by a shift, since paged
        caches have power-of-two pages (checked on the host); a contiguous cache (one page per
        sequence, of any length) always gets column 0 from the clamp. Divisions by a run-time
        page size, and the values they keep, spilled the 24-register producer."""
        shift = cute.arch.popc(self.page_size - 1)
        return cutlass.min(row >> shift, cute.size(self.page_table.shape[1]) - 1)

    def box(self, n_block: Int32, c: Int32):
        """(page, box index inside the page) of box c of K/V block n_block. Arithmetic selects,
        no branches: a box past the end reads page 0 at the first box past the page (zeros)."""
        row = n_block * self.tile_n + c * CHUNK_ROWS
        live = cutlass.min(cutlass.max(self.seqlen_k - row, 0), 1)
        slot = self.slot_of(row)
        entry = self.page_table[self.batch_idx, slot]
        in_page = (row - slot * self.page_size) // CHUNK_ROWS
        past_page = self.page_size // CHUNK_ROWS
        return entry * live, in_page * live + past_page * (1 - live)

    def prefetch(self, n_block: Int32):
        """The page table entries of block n_block into L1 (issued before the wait for its stage,
        so the lookups after it hit L1: the producer holds too few registers to carry a block's
        page ids across the wait). One line holds 32 entries, more than a block spans."""
        slot = self.slot_of(n_block * self.tile_n)
        entry = self.page_table.iterator + cute.crd2idx((self.batch_idx, slot), self.page_table.layout)
        prefetch_l1(entry.toint())

    @cute.jit
    def load_block(self, tma_atom: cute.CopyAtom, mT: cute.Tensor, head: Int32, s_stage: cute.Tensor,
                   n_block: Int32, dim: cutlass.Constexpr[int], barrier, new=None, whole=None):
        """TMA loads of K or V block n_block into the (tile_n, dim) stage s_stage; mT is the
        cache in the (page_size, dim, heads, pages) view, tma_atom's box CHUNK_ROWS x dim: by
        default a box per CHUNK_ROWS rows, each from its page (load_boxes). Decoding measured that
        path against one whole-block box for blocks inside one page (H200, bf16 hd128, 32/8 heads:
        the same GB/s to 2% at every batch x length), so its tiles keep it. Two options, decided
        per block (per box, they made the 16 boxes of a long tile's K/V step cost the producer
        more than the consumers' step: session 71, 525 -> 386 TFLOP/s on a 2048-row chunk, H100):
        - ``new`` (atom of a whole-block box, TMA view of k_new or v_new as (seqlen_new, dim,
          heads, batch), seqlen_new): a block wholly inside the appended rows comes from there in
          one box at its rows' offset (rows past seqlen_new arrive as zeros), not from the cache,
          whose stores of those rows no tile waits for (FwdConfig.appends_from_new);
        - ``whole`` (atom of a whole-block box, TMA view of the cache as mT): a block inside one
          page and inside the sequence comes in one box (FwdConfig.whole_block_boxes)."""
        if const_expr(new is None and whole is None):
            self.load_boxes(tma_atom, mT, head, s_stage, n_block, dim, barrier)
        else:
            row = n_block * self.tile_n
            # 0: page boxes; 1: from k_new / v_new; 2: one box from the cache.
            source = Int32(0)
            first_new = Int32(0)
            if const_expr(new is not None):
                first_new = row - (self.seqlen_k - new[2])
                if new[2] > 0 and first_new >= 0:
                    source = Int32(1)
            slot = self.slot_of(row)
            in_page = row - slot * self.page_size
            if const_expr(whole is not None):
                if source == 0 and in_page + self.tile_n <= self.page_size and row + self.tile_n <= self.seqlen_k:
                    source = Int32(2)
            if source == 0:
                self.load_boxes(tma_atom, mT, head, s_stage, n_block, dim, barrier)
            if const_expr(new is not None):
                if source == 1:
                    self.load_whole(new[0], new[1][None, None, head, self.batch_idx], first_new, s_stage, dim, barrier)
            if const_expr(whole is not None):
                if source == 2:
                    self.load_whole(whole[0], whole[1][None, None, head, self.page_table[self.batch_idx, slot]],
                                    in_page, s_stage, dim, barrier)

    @cute.jit
    def load_whole(self, tma_atom: cute.CopyAtom, mRows: cute.Tensor, first: Int32, s_stage: cute.Tensor,
                   dim: cutlass.Constexpr[int], barrier):
        """One (tile_n, dim) box of mRows ((rows, dim), a TMA view) from row ``first`` into s_stage."""
        g = cute.local_tile(cute.domain_offset((first, 0), mRows), (self.tile_n, dim), (0, 0))
        tS, tG = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(s_stage, 0, 2),
                                       cute.group_modes(g, 0, 2))
        cute.copy(tma_atom, tG, tS, tma_bar_ptr=barrier)

    @cute.jit
    def load_boxes(self, tma_atom: cute.CopyAtom, mT: cute.Tensor, head: Int32, s_stage: cute.Tensor,
                   n_block: Int32, dim: cutlass.Constexpr[int], barrier):
        """load_block from the cache: its CHUNK_ROWS-row boxes, each from its page."""
        for c in cutlass.range(self.tile_n // CHUNK_ROWS, unroll=1):
            page, in_page = self.box(n_block, c)
            g = cute.local_tile(mT[None, None, head, page], (CHUNK_ROWS, dim), (in_page, 0))
            s = cute.local_tile(s_stage, (CHUNK_ROWS, dim), (c, 0))
            tS, tG = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                           cute.group_modes(g, 0, 2))
            cute.copy(tma_atom, tG, tS, tma_bar_ptr=barrier)

    @cute.jit
    def append(self, mNew: cute.Tensor, mT: cute.Tensor, head: Int32, seqlen_new: Int32, first_row: Int32,
               end_row: Int32, dim: cutlass.Constexpr[int], dtype: cutlass.Constexpr, thread: Int32,
               num_threads: cutlass.Constexpr[int]):
        """Copy the appended rows in [first_row, end_row) (sequence rows) of mNew ((seqlen_new,
        dim, heads, batch) view) into the cache (mT: (page_size, dim, heads, pages)), one 16-byte
        vector per thread and step over num_threads threads. The caller fences the writes."""
        vec = VECTOR_BYTES * 8 // dtype.width
        per_row = dim // vec
        new_first = self.seqlen_k - seqlen_new  # the first appended row
        lo = cutlass.max(first_row, new_first)
        hi = cutlass.min(end_row, self.seqlen_k)
        count = cutlass.max(hi - lo, 0) * per_row
        for i in cutlass.range(thread, count, num_threads, unroll=1):
            row = lo + i // per_row
            col = i - (i // per_row) * per_row
            slot = self.slot_of(row)
            # A page id out of range (the caller's table is not checked on the device) is clamped:
            # a wrong page, never an out-of-bounds write.
            page = cutlass.min(cutlass.max(self.page_table[self.batch_idx, slot], 0), cute.size(mT.shape[3]) - 1)
            src = cute.local_tile(mNew[None, None, head, self.batch_idx], (1, vec), (row - new_first, col))
            dst = cute.local_tile(mT[None, None, head, page], (1, vec), (row - slot * self.page_size, col))
            dst.store(src.load())
