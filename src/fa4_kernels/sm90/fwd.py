"""FlashAttention forward for Hopper (sm_90a), warp-specialised, TMA + WGMMA.

Persistent: at most one CTA per SM loops over (m_block, head, batch) tiles in
longest-processing-time order (``tile_scheduler.py``); the loads of the next tile overlap the
epilogue of the current one. Tiles are assigned statically without a mask (all equally long)
and dynamically, through a global atomic counter, with causal/local masks.

Roles (1 + 2 or 3 warpgroups: 384 or 512 threads; tile_m = 64 rows per consumer warpgroup):
  * warpgroup 0, warp 0: producer. Issues TMA loads of the Q tile and of a ring of K and V
    tiles (``num_stages`` deep, one mbarrier pipeline each for K and V), then idles. The whole
    warpgroup gives registers back with ``setmaxnreg``.
  * warpgroups 1, 2 (and 3): consumers, 64 query rows each. ``S = Q @ K^T`` with both operands in
    shared memory, online softmax in fp32 with exp2, ``O += P @ V`` with P from registers.

Overlap (FlashAttention-3):
  * inside a warpgroup, the ``Q @ K^T`` of block j-1 is issued together with the ``P @ V`` of
    block j, so the softmax of block j-1 runs while the tensor cores work;
  * between the consumer warpgroups, named barriers order GEMM issue round-robin so that one
    warpgroup's softmax overlaps the others' GEMMs (ping-pong for two).

Tile boundaries: each consumer warpgroup stages and stores its own 64 rows of O (when O has
its own shared-memory buffer) and, with dynamic scheduling, receives the next tile index through
mbarriers, so the warpgroups never wait for each other between tiles. With causal/local masks a
sequence's partial tile is its first (cheapest) one, not its last (see ``block_info.row_shift``).

Masking is applied only on boundary blocks: the last K block (seqlen_k tail, plus causal/local
right edge), the causal/local diagonal blocks, and the blocks on a local window's left edge.
Blocks entirely outside the mask are never loaded. Block-sparse variants (FlexAttention
BlockMasks) take each tile's blocks from the host's tables instead (block_info.SparseBlocks):
partial blocks first, masked by their bitmask slots, then full ones unmasked; tiles scheduled in
each table row's longest-first order.
"""
from dataclasses import replace
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4_kernels.block_info import Q_PIECE_ROWS, BlockInfo, SparseBlocks, TileRows, block_rows, row_shift
from fa4_kernels.catalog import ALIBI_MMA_COLS, ALIBI_SLOPE_TERMS
from fa4_kernels.kv_cache import CHUNK_ROWS, FEW_HEAD_ROWS, PagedKV, patch_rows, waits_for_append
from fa4_kernels.hopper_mma import (
    always_one_after,
    new_accumulator,
    rows_cols_view,
    store_as_operand_a,
    transpose_smem_view,
    wgmma,
)
from fa4_kernels.mask import AttentionMask
from fa4_kernels.named_barrier import FwdBarrier
from fa4_kernels.ptx import bulk_store_s2g, fence_proxy_async_global, grid_wait_after, loop_bound_zero
from fa4_kernels.score_mod import TENSOR_KINDS, ScoreBias
from fa4_kernels.seqlen_info import SeqlenInfo
from fa4_kernels.softmax import OnlineSoftmax
from fa4_kernels.sm90.common import LOG2_E, ROWS_PER_WG, THREADS_PER_WG, make_smem_layout
from fa4_kernels.split_partials import CHUNK, SplitPartials, distributes, helper_lanes, partial_words_per_thread
from fa4_kernels.stamps import TILE_END, Stamps
from fa4_kernels.trace import (FLAG_DEALT, FLAG_DYNAMIC, FLAG_SPLIT_MERGER, FLAG_SPLIT_WRITER, TileTrace,
                               deal_round_robin, global_ns)
from fa4_kernels.tile_scheduler import (
    MERGER,
    UNBOUNDED_BLOCKS,
    WHOLE,
    WRITER,
    SplitTail,
    StaticPersistentScheduler,
    DECODED_WORDS,
    HANDOFF_SLOTS,
    SEQ_ORDER_IN_KERNEL,
    claim_next_tile,
    handoff_init,
    handoff_publish,
    handoff_receive,
    rank_sequences,
    scale_piece,
)

# Register budget per thread after setmaxnreg, by number of consumer warpgroups: what the
# launch allocates (64K registers / threads, in steps of 8), the producer's share and the
# consumers'. Four consumer warpgroups launch at 96 per thread (640 threads), so 24 * 128 + 112 *
# 512 is the most. With one (the KV cache's kernels) a third of the file would go unused: its
# producer keeps room for the scheduler's and the window's values (at 24 it spilled 3 words in
# hd256's kernel) and its consumers take the most setmaxnreg gives (at 240 hd192x192's and
# hd256's kernels with softcap spilled 34 and 67 words).
PRODUCER_REGS = {1: 64, 2: 24, 3: 24, 4: 24}
CONSUMER_REGS = {1: 256, 2: 240, 3: 160, 4: 112}
STORE_WARP = 4  # first consumer warp: issues the TMA store of a whole O tile
PV_WAIT_AFTER_EXP = 3  # pv_wait "first_exps": the P @ V wait follows row 0's 4th exponential


class FlashAttentionForwardSm90:
    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: int,
        is_causal: bool,
        is_local: bool,
        has_softcap: bool,
        tile_m: int,
        tile_n: int,
        num_stages: int,
        is_varlen: bool = False,
        pv_wait: str = "first_exps",
        rescale_threshold: float = 0.0,
        o_in_v: bool = False,
        split_tail: bool = False,
        merge_helpers: bool = False,
        merge_pairs: bool = False,
        distributed_merge: bool = False,
        pdl: bool = False,
        few_rows_from_registers: bool = False,
        appends_from_new: bool = False,
        whole_block_boxes: bool = False,
        skip_dead_blocks: bool = False,
        early_q_release: bool = False,
        lse_bulk_store: bool = False,
        speculative_max: bool = False,
        rebuild_schedule: bool = False,
        epilogue_addresses_per_tile: bool = False,
        bias_waves: int = 0,
        bias_uniform_tiles: bool = False,
        block_sparse: bool = False,
        score_mod: str = "none",
        kv_cache: bool = False,
        patch_appends: bool = False,
        exp2_fma: int = 0,
        stamps: str = "",
        trace: bool = False,
        alibi_by_mma: bool = False,
    ):
        assert not (is_causal and is_local), "causal is passed as its own variant, not as local"
        assert tile_m // ROWS_PER_WG in CONSUMER_REGS and tile_m % ROWS_PER_WG == 0, "1 to 4 consumer warpgroups"
        assert head_dim % 16 == 0 and head_dim_v % 16 == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.is_causal = is_causal
        self.is_local = is_local
        self.has_softcap = has_softcap
        self.is_varlen = is_varlen
        # Block-sparse (a FlexAttention BlockMask): each tile visits the K/V blocks its row of the
        # host's tables lists, partial ones masked by a bitmask (block_info.SparseBlocks).
        self.block_sparse = block_sparse
        assert not (block_sparse and (is_causal or is_local or is_varlen)), "block-sparse tiles carry their own mask"
        # A built-in score_mod's bias on every score (score_mod.ScoreBias): block-sparse calls only,
        # without softcap (fa4.flex_attention's path).
        self.score_mod = score_mod
        # ALiBi's per-column part (slope * the key's offset in its block) as one more k16 step of
        # Q @ K^T: A holds each row's slope / softmax_scale in three 16-bit terms (their sum is the
        # fp32 value; products with offsets below 256 are exact), B the offsets, written once per
        # CTA (heuristics.FwdConfig.alibi_by_mma).
        self.alibi_by_mma = alibi_by_mma and score_mod == "alibi"
        assert score_mod == "none" or (block_sparse and not has_softcap), "score_mods: block-sparse, no softcap"
        # K/V read from a paged KV cache through a page table, k_new/v_new appended to it (kv_cache.py):
        # dense query batches, every mask; the schedule as for dense calls.
        self.kv_cache = kv_cache
        assert not (kv_cache and (is_varlen or block_sparse)), "a KV cache's sequences come from its page table"
        assert not kv_cache or tile_n % CHUNK_ROWS == 0, "KV cache: K/V blocks of whole page boxes"
        # Decoding tiles have one consumer warpgroup, chunked prefill's ("long" tiles) more: then
        # the first one zeroes a block's stale V rows in its turn of the round-robin, ahead of the
        # others' P @ V (clear_stale_v_rows), and every warpgroup visits every block of the tile.
        assert not (kv_cache and tile_m > ROWS_PER_WG and skip_dead_blocks), "KV cache: no warpgroup skips blocks"
        # The append twin (kv_cache.py): a few appended rows in a tile's first block are copied
        # into its loaded K/V stages by the consumers instead of the producer waiting for them.
        self.patch_appends = patch_appends
        assert not patch_appends or (kv_cache and tile_m == ROWS_PER_WG), "patched appends: one-warpgroup tiles"
        # Boxes of appended rows loaded from k_new/v_new (heuristics.FwdConfig.appends_from_new).
        self.appends_from_new = appends_from_new
        assert not appends_from_new or (kv_cache and not patch_appends), "appends from k_new: KV-cache kernels"
        # Blocks inside one page in one box (heuristics.FwdConfig.whole_block_boxes).
        self.whole_block_boxes = whole_block_boxes
        assert not whole_block_boxes or kv_cache, "whole-block boxes: KV-cache kernels"
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.pv_wait = pv_wait
        self.rescale_threshold = rescale_threshold
        self.num_consumer_wg = tile_m // ROWS_PER_WG
        self.num_threads = THREADS_PER_WG * (1 + self.num_consumer_wg)
        # Masked tiles and packed sequences differ in length: balance them dynamically. Tiles
        # against a KV cache (whose one mask kind is the window, with no mask and causal as
        # unbounded sides) go out statically instead, so that the split tail can spread a few
        # query rows' long K/V range over the GPU (decoding, speculative verification: as few
        # tiles as SMs or fewer); their lengths differ by at most the query chunk's own keys.
        self.dynamic_schedule = ((is_causal or is_local) and not kv_cache) or is_varlen or block_sparse
        # Packed sequences: the producer hands the consumers each next tile decoded (tile_scheduler:
        # DECODED_WORDS), not only its index: their decode reads the sequences' offsets.
        self.handoff_words = DECODED_WORDS if is_varlen else 1
        # Equal tiles go out statically; the last round's tiles may then be split into pieces
        # of K/V blocks over all CTAs (tile_scheduler.SplitTail, split_partials).
        self.split_tail = split_tail
        self.merge_helpers = merge_helpers  # split_partials.SplitPartials.helpers
        self.merge_pairs = merge_pairs  # split_partials.SplitPartials.pairs
        # Every piece of a split tile folds and stores a share of it (split_partials, "distributed").
        self.distributed_merge = distributed_merge
        assert not distributed_merge or (split_tail and kv_cache), "distributed merging: KV-cache split tails"
        self.pdl = pdl  # FwdConfig.pdl: launched with programmatic dependent launch
        # The roles wait for the previous grid after their first tile's schedule arithmetic
        # (wait_previous_grid), which must then read no global memory: the static schedule.
        assert not (pdl and self.dynamic_schedule), "PDL: statically scheduled variants"
        assert not (split_tail and self.dynamic_schedule), "only the static schedule splits its tail"
        # O is staged in V's buffer when it does not fit beside Q, K and V (heuristics.
        # place_buffers; FlashAttention-3's choice): V is free once every consumer has done its
        # last P @ V, and the producer holds the next tile's first V load until the O store has
        # read the buffer (mbar_O). Q keeps its own buffer, so the next tile's Q and first K
        # still load during the epilogue.
        self.o_in_v = o_in_v
        assert not o_in_v or num_stages * tile_n >= tile_m, "O must fit in V's buffer"
        # Each consumer warpgroup stages and stores its own 64 rows of O, synchronising only its
        # own warps, so the warpgroups never meet at a tile boundary and the one ahead in the
        # ping-pong starts the next tile while the other finishes. Not when O shares V's buffer:
        # a warpgroup's O rows would overwrite V rows another warpgroup may still be reading.
        self.wg_epilogue = not self.o_in_v
        # Tiles with few live rows store O from registers (heuristics.FwdConfig).
        self.few_rows_from_registers = few_rows_from_registers
        assert not (few_rows_from_registers and o_in_v), "O in V's buffer goes back through the staged epilogue"
        self.num_mma_threads = THREADS_PER_WG * self.num_consumer_wg
        # Causal/local: warpgroups sit out the diagonal blocks that hide all their rows' keys
        # (skip_blocks; heuristics.FwdConfig.skip_dead_blocks says where it pays).
        self.skip_dead_blocks = skip_dead_blocks and (is_causal or is_local)
        # The next tile's Q may load from the last K/V step on (heuristics.FwdConfig).
        self.early_q_release = early_q_release
        # LSE rows out of shared memory in one bulk copy per warpgroup (heuristics.FwdConfig).
        self.lse_bulk_store = lse_bulk_store
        # K/V steps after a tile's first take their exponentials against the running max and
        # check afterwards that no row's max rose past the rescale threshold (heuristics.
        # FwdConfig.speculative_max); the threshold is what makes keeping the max the rule.
        self.speculative_max = speculative_max
        assert not speculative_max or rescale_threshold > 0.0, "speculative_max needs a rescale threshold"
        # The consumers rebuild the static schedule's state at each tile rather than hold it
        # (heuristics.FwdConfig.rebuild_schedule).
        self.rebuild_schedule = rebuild_schedule
        assert not rebuild_schedule or not self.dynamic_schedule, "only the static schedule is rebuilt"
        # The epilogue computes its per-thread addresses at each tile (heuristics.FwdConfig).
        self.epilogue_addresses_per_tile = epilogue_addresses_per_tile
        # A bias tensor's entries read where they are added, in this many waves, not under the
        # score GEMM (heuristics.FwdConfig.bias_waves).
        self.bias_waves = bias_waves
        self.bias_uniform_tiles = bias_uniform_tiles  # heuristics.FwdConfig
        assert bias_waves == 0 or score_mod in TENSOR_KINDS
        # Of every 8 probabilities, how many are computed on the FMA pipe (exp2_fma.py).
        assert 0 <= exp2_fma <= 8
        self.exp2_fma = exp2_fma
        # Diagnostic build: clock stamps of the consumer loop into the partials buffer (stamps.py).
        self.stamps = stamps
        # Trace variant: a record per tile in the semaphores vector (trace.py); a dynamically
        # scheduled one can also deal its tiles round-robin, the static schedule it is compared with.
        self.trace = trace

    # ------------------------------------------------------------------ host side
    def schedule_plan(self, mQ: cute.Tensor, mK: cute.Tensor, heads_per_group: Int32, max_seqlen_q: Int32,
                      mCuSeqlensQ: cute.Tensor, pack_gqa: Int32, tail_ctas: Int32, num_sms: Int32, seqlen_k=None):
        """Host side (the launch function, whose arithmetic runs on the CPU at every launch): the
        grid, and the schedule's values that are the same for every CTA as one kernel argument
        (``scheduler`` rebuilds the schedule from it): tile counts, the tile decode's divisors
        and the split tail's shares, as FastDivmod divisors where the kernel divides by them.
        Every CTA used to compute them before its first load: a chain of integer divisions that
        took ~1 us of a decoding call (docs/perf_notes.md, session 66).

        mQ, mK in the (seqlen, dim, head, batch) view. With pack-GQA a tile holds tile_m /
        pack_gqa rows of each of pack_gqa query heads of one K/V head (all of its group or a
        part), and the scheduler's head index counts those packs. ``seqlen_k``: the keys every
        tile's range is cut from (default mK's rows; a KV cache's capacity)."""
        rows = block_rows(self.tile_m, pack_gqa)
        num_heads = cute.size(mQ.shape[2]) // pack_gqa
        divisor = lambda d: cute.fast_divmod_create_divisor_v2(cutlass.max(d, 1))  # noqa: E731
        if const_expr(self.is_varlen):
            sched = StaticPersistentScheduler(cute.ceil_div(max_seqlen_q, rows), num_heads,
                                              cute.size(mCuSeqlensQ.shape[0]) - 1, Int32(1),
                                              self.is_causal or self.is_local, rows)
            fast = ()
        else:
            sched = StaticPersistentScheduler(cute.ceil_div(cute.size(mQ.shape[0]), rows), num_heads,
                                              cute.size(mQ.shape[3]), heads_per_group,
                                              self.is_causal or self.is_local, rows)
            fast = sched.with_fast_division(divisor).fast
        num_tiles = sched.num_tiles
        split = ()
        if const_expr(self.split_tail):
            # With fewer tiles than SMs, a split tail spreads them over up to tail_ctas CTAs.
            grid = cutlass.min(num_sms, cutlass.max(num_tiles, tail_ctas))
            # No mask: every tile visits all ceil(seqlen_k / tile_n) K/V blocks.
            n_blocks = cute.ceil_div(cute.size(mK.shape[0]) if const_expr(seqlen_k is None) else seqlen_k,
                                     self.tile_n)
            tail = SplitTail(num_tiles, grid, n_blocks, tail_ctas).planned(divisor)
            split = (tail.num_tiles, tail.grid, tail.n_blocks, tail.tail_ctas, *tail.plan)
        else:
            grid = cutlass.min(num_tiles, num_sms)
        return grid, (sched.num_m_blocks, sched.num_heads, sched.num_batches, sched.heads_per_group, fast, split)

    def scheduler(self, plan, pack_gqa: Int32, mCuSeqlensQ: cute.Tensor, mSeqOrder: cute.Tensor, zero=None,
                  sSeqOrder=None) -> StaticPersistentScheduler:
        """In the kernel: the schedule from ``schedule_plan``'s values, this CTA's share of a split
        tail fixed. ``zero``: an opaque zero (ptx.loop_bound_zero) added to the integers, so that
        what derives from them is computed where this is called rather than once and held in
        registers. ``sSeqOrder``: packed sequences' order in shared memory."""
        num_m_blocks, num_heads, num_batches, heads_per_group, fast, split = plan
        cta = Int32(cute.arch.block_idx()[0])
        plus = lambda v: v  # noqa: E731
        if const_expr(zero is not None):
            plus = lambda v: Int32(v) + zero  # noqa: E731
        num_m_blocks, num_heads, num_batches, heads_per_group, cta = (
            plus(v) for v in (num_m_blocks, num_heads, num_batches, heads_per_group, cta))
        rows = block_rows(self.tile_m, pack_gqa)
        longest_first = self.is_causal or self.is_local
        if const_expr(self.is_varlen):
            return StaticPersistentScheduler(num_m_blocks, num_heads, num_batches, Int32(1), longest_first, rows,
                                             mCuSeqlensQ, mSeqOrder, sSeqOrder)
        *divisors, last_group = fast
        sched = StaticPersistentScheduler(num_m_blocks, num_heads, num_batches, heads_per_group, longest_first, rows,
                                          fast=(*divisors, plus(last_group)))
        if const_expr(self.split_tail):
            ints, divisors = [plus(v) for v in split[:9]], split[9:]
            tail = SplitTail(*ints[:4], plan=(*ints[4:], *divisors))
            sched = replace(sched, split=tail.for_cta(cta))
        return sched

    def seqlen_info(self, batch_idx, seqlen_q, seqlen_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, has_seqused_k,
                    seqlen_new=None):
        if const_expr(self.kv_cache):  # the cached keys (mSeqUsedK: cache_seqlens) plus the appended ones
            return SeqlenInfo.of_cache(batch_idx, seqlen_q, seqlen_k, mSeqUsedK, seqlen_new)
        return SeqlenInfo.create(batch_idx, seqlen_q, seqlen_k, self.is_varlen, mCuSeqlensQ, mCuSeqlensK,
                                 mSeqUsedK, has_seqused_k)

    @cute.jit
    def tile_rows(self, pack_gqa: Int32, m_block: Int32, head_idx: Int32, seqlen_q: Int32):
        """(TileRows of tile m_block, its row shift): see block_info.row_shift."""
        shift = row_shift(self.tile_m, pack_gqa, seqlen_q, self.is_causal or self.is_local)
        # pack_gqa is a power of two. The opaque per-tile zero keeps what derives from pack_log2
        # (rows and heads of the thread's accumulator rows) computed per tile: being invariant
        # shifts, LLVM would hoist them out of the tile loop and keep them live across the K/V
        # loop, which spills the 240-register hd192/hd256 consumers.
        pack_log2 = cute.arch.popc(pack_gqa - 1 + loop_bound_zero(m_block))
        return TileRows(self.tile_m, pack_log2, m_block * (Int32(self.tile_m) >> pack_log2) - shift, head_idx), shift

    def kv_bound(self, mK: cute.Tensor, mPageTable: cute.Tensor, page_size: Int32):
        """Keys a sequence may hold: mK's rows, or a KV cache's capacity (kv_cache.PagedKV)."""
        if const_expr(self.kv_cache):
            return PagedKV.capacity(mPageTable, page_size)
        return mK.shape[0]

    def kv_bound_of_tile(self, seqlen_k: Int32, kv_cache, m_block: Int32):
        """kv_bound inside a tile loop: a KV cache's capacity computed there (an opaque zero from
        the loop's m_block keeps it from being hoisted and held), else seqlen_k."""
        if const_expr(self.kv_cache):
            mPageTable, page_size = kv_cache[0], kv_cache[1]
            return PagedKV.capacity(mPageTable, page_size + loop_bound_zero(m_block))
        return seqlen_k

    def by_bound_blocks(self, scheduler: StaticPersistentScheduler):
        """A KV cache's capacity in K/V blocks as the split plan's FastDivmod divisor (the split's
        blocks are the capacity's), for block_range's scaling of a piece onto its sequence: it
        divides after the producer's cache_seqlens load, on the way to the first K load, where
        two signed divisions sat (hd128: 134 -> 100 instructions from that load to the page
        table's). None where nothing is scaled."""
        if const_expr(self.split_tail and self.kv_cache):
            return scheduler.split.by_n_blocks()
        return None

    def tile_view(self, t: cute.Tensor, head, batch_idx, offset):
        """(seqlen, dim) slice of a (seqlen, dim, head, batch) tensor for one sequence."""
        if const_expr(self.is_varlen):
            return cute.domain_offset((offset, 0), t[None, None, head, 0])
        return t[None, None, head, batch_idx]

    def _tiled_mmas(self):
        qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.num_consumer_wg, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(self.num_consumer_wg, 1, 1),
            tiler_mn=(64, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )
        return qk, pv

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim_v)
        mO: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim_v)
        mLSE: cute.Tensor,  # (batch, heads_q, seqlen_q) fp32
        mSemaphores: cute.Tensor,  # int32: dynamic scheduling's tile counter, split-tail flags (split_partials)
        mPartials: cute.Tensor,  # fp32: partial results of split tiles (split_partials)
        mCuSeqlensQ: cute.Tensor,  # varlen: (batch + 1,) int32 row offsets into the packed q/out
        mCuSeqlensK: cute.Tensor,  # varlen: (batch + 1,) into the packed k/v
        mSeqUsedK: cute.Tensor,  # varlen: (batch,) keys used per sequence when has_seqused_k
        mSeqOrder: cute.Tensor,  # varlen: (batch,) permutation: sequences in scheduling order
        mSparseCounts: cute.Tensor,  # block-sparse: (batch, heads_q, m_blocks, 4) int32 (block_info.SparseBlocks)
        mSparseBlocks: cute.Tensor,  # block-sparse: (batch, heads_q, m_blocks, width) int32 K/V blocks
        mSparseBits: cute.Tensor,  # block-sparse: flat int32 bitmask slots (mask.AttentionMask.load_bits)
        mScoreParams: cute.Tensor,  # score_mod variants: (heads_q, width) fp32, or "bias"'s 4-D tensor (score_mod.py)
        mPageTable: cute.Tensor,  # kv_cache: (batch, max_pages) int32 pages of each sequence (kv_cache.py)
        mKNew: cute.Tensor,  # kv_cache: (batch, seqlen_new, heads_kv, head_dim) keys to append
        mVNew: cute.Tensor,  # kv_cache: (batch, seqlen_new, heads_kv, head_dim_v)
        softmax_scale: Float32,
        softcap: Float32,  # used only by softcap variants
        window_left: Int32,  # used only by local variants; >= 0
        window_right: Int32,
        heads_per_group: Int32,  # tile-order swizzle: (head, batch) pairs whose K/V share L2
        num_sms: Int32,  # persistent grid size (a run-time fact: the build machine has no GPU)
        max_seqlen_q: Int32,  # varlen: the longest sequence (bounds the tile count)
        has_seqused_k: Int32,  # varlen: 1 when mSeqUsedK holds the key counts
        pack_gqa: Int32,  # 1, or a power of two <= 64 dividing heads_q / heads_kv: query heads per tile
        tail_ctas: Int32,  # static schedule: CTAs to split the last round's tiles over (0: none)
        page_size: Int32,  # kv_cache: rows per page of k/v
        seqlen_new: Int32,  # kv_cache: rows of mKNew/mVNew appended to each sequence (0: none)
        stream: cuda.CUstream,
    ):
        """Dense: q (batch, seqlen_q, heads_q, head_dim) etc. Varlen: the same tensors with
        batch 1 holding every sequence back to back, delimited by cu_seqlens. KV cache: k/v
        are (num_pages, page_size, heads_kv, dim) and mSeqUsedK holds cache_seqlens."""
        # Sequence-major views: (seqlen, dim, head, batch) so a tile is (tile, dim) at [.., h, b].
        mQ, mK, mV, mO, mKNew, mVNew = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mO, mKNew, mVNew)
        ]
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))

        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_layout = make_smem_layout(self.dtype, self.tile_m, self.head_dim)
        sK_layout = make_smem_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        sV_layout = make_smem_layout(self.dtype, self.tile_n, self.head_dim_v, self.num_stages)
        if const_expr(self.wg_epilogue):  # one (64, dv) part per consumer warpgroup
            sO_layout = make_smem_layout(self.dtype, ROWS_PER_WG, self.head_dim_v, self.num_consumer_wg)
            sO_store_layout = cute.select(sO_layout, mode=[0, 1])
        else:
            sO_layout = make_smem_layout(self.dtype, self.tile_m, self.head_dim_v)
            sO_store_layout = sO_layout

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, sQ_layout, (self.tile_m, self.head_dim)
        )
        # Pack-GQA loads Q in pieces of Q_PIECE_ROWS rows (one head's rows each) into the same
        # buffer: a piece-high slice of sQ's layout (rows are the fastest mode of its swizzle atoms,
        # so the slices are 1 KB apart and keep the swizzle phase).
        piece = Q_PIECE_ROWS
        sQ_piece = cute.composition(sQ_layout, cute.make_layout((piece, self.head_dim), stride=(1, self.tile_m)))
        tma_atom_Qc, tma_Qc = cpasync.make_tiled_tma_atom(tma_load, mQ, sQ_piece, (piece, self.head_dim))
        # KV cache: a head may take fewer rows of the tile (kv_cache.FEW_HEAD_ROWS), and a piece
        # then holds `rows` rows of each of Q_PIECE_ROWS / rows heads: a (rows, heads, dim) box over
        # the (seqlen, head, dim) view of Q, whose rows land head by head as TileRows maps them.
        # One atom per such row count (the other kernels pass the one-head atom in their place).
        tma_Qh = [(tma_atom_Qc, tma_Qc)] * len(FEW_HEAD_ROWS)
        if const_expr(self.kv_cache):
            mQ_heads = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1, 3]))
            piece_of_heads = lambda r: cute.make_layout((r, piece // r, self.head_dim),  # noqa: E731
                                                        stride=(1, r, self.tile_m))
            tma_Qh = [cpasync.make_tiled_tma_atom(
                tma_load, mQ_heads, cute.composition(sQ_layout, piece_of_heads(r)),
                (r, piece // r, self.head_dim)) for r in FEW_HEAD_ROWS]
        if const_expr(self.kv_cache):
            # One CHUNK_ROWS-row box per page piece (kv_cache.PagedKV.load_block): a row slice of
            # a stage, as for Q's pieces.
            box = lambda layout, dim: cute.composition(  # noqa: E731
                cute.select(layout, mode=[0, 1]), cute.make_layout((CHUNK_ROWS, dim), stride=(1, self.tile_n)))
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, mK, box(sK_layout, self.head_dim),
                                                            (CHUNK_ROWS, self.head_dim), 1)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, mV, box(sV_layout, self.head_dim_v),
                                                            (CHUNK_ROWS, self.head_dim_v), 1)
        else:
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                tma_load, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.head_dim), 1
            )
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                tma_load, mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.head_dim_v), 1
            )
        # The appended rows' boxes, the same shape over k_new/v_new (appends_from_new); the other
        # kernels pass K's and V's in their place.
        whole_k = lambda t: cpasync.make_tiled_tma_atom(  # noqa: E731
            tma_load, t, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.head_dim), 1)
        whole_v = lambda t: cpasync.make_tiled_tma_atom(  # noqa: E731
            tma_load, t, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.head_dim_v), 1)
        tma_atom_KNew, tma_KNew, tma_atom_VNew, tma_VNew = tma_atom_K, tma_K, tma_atom_V, tma_V
        if const_expr(self.appends_from_new):  # whole blocks (PagedKV.load_block)
            (tma_atom_KNew, tma_KNew), (tma_atom_VNew, tma_VNew) = whole_k(mKNew), whole_v(mVNew)
        # Whole-block boxes over the cache (whole_block_boxes); K's and V's page boxes in their place.
        tma_atom_KBlock, tma_KBlock, tma_atom_VBlock, tma_VBlock = tma_atom_K, tma_K, tma_atom_V, tma_V
        if const_expr(self.whole_block_boxes):
            (tma_atom_KBlock, tma_KBlock), (tma_atom_VBlock, tma_VBlock) = whole_k(mK), whole_v(mV)
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_store_layout,
            (cute.size(sO_store_layout, mode=[0]), self.head_dim_v)
        )
        self.tx_bytes_Q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tx_bytes_K = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tx_bytes_V = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        # O gets its own staging buffer when it fits, else it reuses V's (see __init__).
        cosize_O = 0 if const_expr(self.o_in_v) else cute.cosize(sO_layout)
        cosize_alibi = [cute.cosize(layout) if const_expr(self.alibi_by_mma) else 0 for layout in self.alibi_layouts()]

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_K: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_V: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_O: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_O], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m if self.lse_bulk_store else 0], 128]
            sAlibiQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_alibi[0]], 1024]
            sAlibiK: cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_alibi[1]], 1024]
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * HANDOFF_SLOTS]
            next_tile: cute.struct.MemRange[Int32, HANDOFF_SLOTS * self.handoff_words]
            # Packed sequences: their lengths and scheduling order (tile_scheduler.rank_sequences).
            seq_lengths: cute.struct.MemRange[Int32, SEQ_ORDER_IN_KERNEL if self.is_varlen else 0]
            seq_order: cute.struct.MemRange[Int32, SEQ_ORDER_IN_KERNEL if self.is_varlen else 0]

        grid_ctas, schedule = self.schedule_plan(mQ, mK, heads_per_group, max_seqlen_q, mCuSeqlensQ, pack_gqa,
                                                 tail_ctas, num_sms, seqlen_k=self.kv_bound(mK, mPageTable, page_size))
        grid = (grid_ctas, 1, 1)

        if const_expr(self.has_softcap):
            # tanh soft-capping is applied to raw scores: s <- softcap * tanh(s * scale / softcap),
            # after which the exponent needs only the change of base.
            score_scale = softmax_scale / softcap
            scale_log2 = Float32(LOG2_E)
        else:
            score_scale = Float32(1.0)
            scale_log2 = softmax_scale * LOG2_E

        self.kernel(
            tma_Q, tma_Qc, *[t for _, t in tma_Qh], tma_K, tma_V, mO, tma_O, mLSE, mSemaphores, mPartials,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSeqOrder, mSparseCounts, mSparseBlocks, mSparseBits,
            mScoreParams, mPageTable, mK, mV, mKNew, mVNew, max_seqlen_q, has_seqused_k, pack_gqa, tail_ctas,
            page_size, seqlen_new, tma_atom_Q, tma_atom_Qc, *[a for a, _ in tma_Qh], tma_atom_K, tma_atom_V,
            tma_atom_O, scale_log2, score_scale, softcap, window_left, window_right, schedule,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv, SharedStorage, tma_KNew, tma_VNew, tma_atom_KNew, tma_atom_VNew,
            tma_KBlock, tma_VBlock, tma_atom_KBlock, tma_atom_VBlock,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=self.pdl,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mQc: cute.Tensor,
        mQh4: cute.Tensor,  # kv_cache: Q pieces of FEW_HEAD_ROWS rows per head
        mQh2: cute.Tensor,
        mQh1: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,  # plain (seqlen, dim, head, batch) tensor: row-by-row stores
        tma_O: cute.Tensor,  # its TMA view: whole-tile stores
        mLSE: cute.Tensor,
        mSemaphores: cute.Tensor,
        mPartials: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        mSeqOrder: cute.Tensor,
        mSparseCounts: cute.Tensor,
        mSparseBlocks: cute.Tensor,
        mSparseBits: cute.Tensor,
        mScoreParams: cute.Tensor,
        mPageTable: cute.Tensor,
        mKCache: cute.Tensor,  # kv_cache: mK and mV as tensors (the appended rows' stores), not TMA views
        mVCache: cute.Tensor,
        mKNew: cute.Tensor,
        mVNew: cute.Tensor,
        max_seqlen_q: Int32,
        has_seqused_k: Int32,
        pack_gqa: Int32,
        tail_ctas: Int32,
        page_size: Int32,
        seqlen_new: Int32,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_Qc: cute.CopyAtom,
        tma_atom_Qh4: cute.CopyAtom,
        tma_atom_Qh2: cute.CopyAtom,
        tma_atom_Qh1: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        scale_log2: Float32,
        score_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        schedule,  # schedule_plan's values
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        tma_KNew: cute.Tensor,  # appends_from_new: k_new's and v_new's TMA views (else K's and V's)
        tma_VNew: cute.Tensor,
        tma_atom_KNew: cute.CopyAtom,
        tma_atom_VNew: cute.CopyAtom,
        tma_KBlock: cute.Tensor,  # whole_block_boxes: the cache's K and V in whole-block boxes
        tma_VBlock: cute.Tensor,
        tma_atom_KBlock: cute.CopyAtom,
        tma_atom_VBlock: cute.CopyAtom,
    ):
        # Trace twins: when this CTA entered the kernel (TileTrace.begin).
        entry_ns = global_ns() if const_expr(self.trace) else None
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_Qc, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.kv_cache):
                for atom in (tma_atom_Qh4, tma_atom_Qh2, tma_atom_Qh1):
                    cpasync.prefetch_descriptor(atom)
            if const_expr(self.appends_from_new):
                for atom in (tma_atom_KNew, tma_atom_VNew):
                    cpasync.prefetch_descriptor(atom)
            if const_expr(self.whole_block_boxes):
                for atom in (tma_atom_KBlock, tma_atom_VBlock):
                    cpasync.prefetch_descriptor(atom)
        q_heads = ((mQh4, tma_atom_Qh4), (mQh2, tma_atom_Qh2), (mQh1, tma_atom_Qh1))

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        producer_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync lets one lane per consumer warp release a stage.
        consumer_warps = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_mma_threads // cute.arch.WARP_SIZE
        )
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1,
            producer_group=producer_thread, consumer_group=consumer_warps,
            tx_count=self.tx_bytes_Q, defer_sync=True,
        )
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(), num_stages=self.num_stages,
            producer_group=producer_thread, consumer_group=consumer_warps,
            tx_count=self.tx_bytes_K, defer_sync=True,
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(), num_stages=self.num_stages,
            producer_group=producer_thread, consumer_group=consumer_warps,
            tx_count=self.tx_bytes_V, defer_sync=True,
        )
        if const_expr(self.dynamic_schedule):
            if cute.arch.thread_idx()[0] == 0:
                handoff_init(storage.mbar_tile.data_ptr(), self.num_mma_threads)
        if const_expr(self.o_in_v):
            if cute.arch.thread_idx()[0] == 0:
                cute.arch.mbarrier_init(storage.mbar_O.data_ptr(), 1)  # the storing warp's lane 0
        if const_expr(self.is_varlen):
            rank_sequences(mCuSeqlensQ, storage.seq_lengths.get_tensor(cute.make_layout(SEQ_ORDER_IN_KERNEL)),
                           storage.seq_order.get_tensor(cute.make_layout(SEQ_ORDER_IN_KERNEL)),
                           cute.arch.thread_idx()[0], self.num_threads)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        setup_ns = global_ns() if const_expr(self.trace) else None
        if const_expr(self.pdl):
            # Launched with programmatic dependent launch: the setup above, and each role's set-up
            # and first tile's arithmetic up to wait_previous_grid, run while the previous kernel
            # in the stream is still finishing. The next kernel may launch now: its CTAs take
            # SMs as ours exit, and wait for our grid before they touch global memory.
            cute.arch.griddepcontrol_launch_dependents()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sAlibi = None
        if const_expr(self.alibi_by_mma):
            q_layout, k_layout = self.alibi_layouts()
            sAlibi = (storage.sAlibiQ.get_tensor(q_layout.outer, swizzle=q_layout.inner),
                      storage.sAlibiK.get_tensor(k_layout.outer, swizzle=k_layout.inner))
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # sO: the (tile_m, dv) tile the accumulators are written to; sO_parts: what one TMA store
        # reads, (64, dv, warpgroup) parts with a per-warpgroup epilogue, else the tile itself.
        if const_expr(self.o_in_v):
            sO = storage.sV.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
            sO_parts = sO
        elif const_expr(self.wg_epilogue):
            sO_parts = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
            tile_outer = cute.group_modes(cute.select(sO_layout.outer, mode=[0, 2, 1]), 0, 2)
            sO = storage.sO.get_tensor(tile_outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
            sO_parts = sO
        sLSE = storage.sLSE.get_tensor(cute.make_layout(self.tile_m)) if const_expr(self.lse_bulk_store) else None

        # block_rows is set per tile, from the tile's rows (BlockInfo.for_rows).
        block_info = BlockInfo(
            None, self.tile_n, self.is_causal, self.is_local,
            window_left if const_expr(self.is_local) else None,
            window_right if const_expr(self.is_local) else None,
        )
        seqlen_q = mQ.shape[0]
        # A KV cache's capacity is recomputed per tile where used (kv_bound_of_tile): held from
        # here across the role split, it spilled the 24-register producer.
        seqlen_k = mK.shape[0]
        # The schedule, built where this is called (consume rebuilds it per tile with
        # rebuild_schedule, passing an opaque zero).
        make_scheduler = lambda zero=None: self.scheduler(  # noqa: E731
            schedule, pack_gqa, mCuSeqlensQ, mSeqOrder, zero=zero,
            sSeqOrder=storage.seq_order.get_tensor(cute.make_layout(SEQ_ORDER_IN_KERNEL))
            if const_expr(self.is_varlen) else None)
        scheduler = make_scheduler()
        partials = SplitPartials(mSemaphores, mPartials, self.num_mma_threads, self.num_consumer_wg,
                                 partial_words_per_thread(self.head_dim_v), self.merge_helpers, self.merge_pairs)
        seqlens = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, has_seqused_k, seqlen_new)
        kv_cache = (mPageTable, page_size, mKCache, mVCache, mKNew, mVNew)
        sparse_tables = (mSparseCounts, mSparseBlocks, mSparseBits)
        tile_slots = storage.next_tile.get_tensor(
            cute.make_layout((HANDOFF_SLOTS, self.handoff_words), stride=(self.handoff_words, 1)))
        tile_mbar = storage.mbar_tile.data_ptr()
        o_free_mbar = storage.mbar_O.data_ptr()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS[self.num_consumer_wg])
            if warp_idx == 0:
                self.load(
                    mQ, mQc, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_Qc, q_heads, tma_atom_K, tma_atom_V,
                    pipeline_q, pipeline_k, pipeline_v, block_info, scheduler, seqlen_q, seqlen_k,
                    mSemaphores, tile_slots, tile_mbar, o_free_mbar, seqlens, pack_gqa, sparse_tables, kv_cache,
                    ((tma_atom_KNew, tma_KNew), (tma_atom_VNew, tma_VNew)),
                    ((tma_atom_KBlock, tma_KBlock), (tma_atom_VBlock, tma_VBlock)),
                )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS[self.num_consumer_wg])
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WG
            self.consume(
                mO, tma_O, mLSE, sQ, sK, sV, sO, sO_parts, sLSE, tma_atom_O,
                pipeline_q, pipeline_k, pipeline_v,
                tiled_mma_qk, tiled_mma_pv, tidx,
                scale_log2, score_scale, softcap, block_info,
                scheduler, seqlen_q, seqlen_k, tile_slots, tile_mbar, o_free_mbar, seqlens, pack_gqa,
                partials, make_scheduler, sparse_tables, mScoreParams, kv_cache, sAlibi, (entry_ns, setup_ns),
            )

    @cute.jit
    def load_q_across_heads(self, mQh: cute.Tensor, atom: cute.CopyAtom, r: int, sQ: cute.Tensor, rows: TileRows,
                            batch_idx: Int32, mbar: cute.Pointer):
        """A KV-cache tile's Q when each packed head has r < Q_PIECE_ROWS of its rows: per piece one
        (r, Q_PIECE_ROWS / r, dim) box of the (seqlen, head, dim, batch) TMA view ``mQh``, rows r apart per
        head as TileRows maps them (kv_cache.FEW_HEAD_ROWS). A loop, not unrolled: a decoding
        CTA runs one of these paths once, and their code is fetched through instruction-cache
        misses (docs/perf_notes.md, session 57)."""
        piece = Q_PIECE_ROWS
        heads = piece // r
        for c in cutlass.range(self.tile_m // piece, unroll=1):
            gQh = cute.local_tile(mQh[None, None, None, batch_idx], (r, heads, self.head_dim),
                                  (rows.row(c * piece) // r, rows.head(c * piece) // heads, 0))
            sQc = cute.local_tile(sQ, (piece, self.head_dim), (c, 0))
            sQh = cute.make_tensor(sQc.iterator, cute.composition(
                sQc.layout, cute.make_layout((r, heads, self.head_dim), stride=(1, r, piece))))
            tQsQh, tQgQh = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sQh, 0, 3),
                                                 cute.group_modes(gQh, 0, 3))
            cute.copy(atom, tQgQh, tQsQh, tma_bar_ptr=mbar)

    def alibi_layouts(self):
        """alibi_by_mma's operands in shared memory: (tile_m, 16) for A, (tile_n, 16) for B."""
        return (make_smem_layout(self.dtype, self.tile_m, ALIBI_MMA_COLS),
                make_smem_layout(self.dtype, self.tile_n, ALIBI_MMA_COLS))

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,
        mQc: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_Qc: cute.CopyAtom,
        q_heads,  # kv_cache: ((TMA view, atom) per FEW_HEAD_ROWS)
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        block_info: BlockInfo,
        scheduler: StaticPersistentScheduler,
        seqlen_q: Int32,
        seqlen_k: Int32,
        mSemaphores: cute.Tensor,
        tile_slots: cute.Tensor,
        tile_mbar: cute.Pointer,
        o_free_mbar: cute.Pointer,
        seqlens,
        pack_gqa: Int32,
        sparse_tables,
        kv_cache,
        new_boxes,  # appends_from_new: ((atom, TMA view) of k_new, of v_new)
        block_boxes,  # whole_block_boxes: ((atom, TMA view) of the cache's K, of its V), whole blocks
    ):
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        mPageTable, page_size, mKCache, mVCache, mKNew, mVNew = kv_cache
        seqlen_new = seqlens[4]
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        cursor = self.first_cursor(scheduler)
        handoffs = Int32(0)
        tiles_loaded = Int32(0)
        dealt = False
        if const_expr(self.trace and self.dynamic_schedule):
            dealt = deal_round_robin(mSemaphores)
        m_block, head_idx, batch_idx, kv_lo, kv_hi, valid = self.work(scheduler, cursor, sparse_tables)
        self.wait_previous_grid((m_block, head_idx, batch_idx, kv_lo, kv_hi))
        while valid:
            bound = self.kv_bound_of_tile(seqlen_k, kv_cache, m_block)
            seq = self.seqlen_info(batch_idx, seqlen_q, bound, *seqlens)
            head_idx_kv = head_idx * pack_gqa // qhead_per_kvhead
            rows, shift = self.tile_rows(pack_gqa, m_block, head_idx, seq.seqlen_q)
            gQ = cute.local_tile(cute.domain_offset((rows.first_row, 0), self.tile_view(mQ, head_idx, batch_idx, seq.offset_q)),
                                 (self.tile_m, self.head_dim), (0, 0))
            # TMA partitions: ((atom_v, rest_v)) for Q, ((atom_v, rest_v), n_blocks | stages) for K/V.
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            block_at, num_steps = self.visiting_order(block_info.for_rows(rows), seq, shift, m_block, head_idx,
                                                      batch_idx, kv_lo, kv_hi, sparse_tables, bound,
                                                      self.by_bound_blocks(scheduler))
            if const_expr(self.kv_cache):
                # K/V blocks by page boxes; a block's page table entries are prefetched into L1
                # before the wait for its K stage (ahead_of).
                paged = PagedKV(mPageTable, page_size, batch_idx, seq.seqlen_k, self.tile_n)
                ahead_of = paged.prefetch
                new_k = new_v = whole_k = whole_v = None
                if const_expr(self.appends_from_new):
                    new_k, new_v = [(atom, view, seqlen_new) for atom, view in new_boxes]
                if const_expr(self.whole_block_boxes):
                    whole_k, whole_v = block_boxes
                copy_k = lambda n_block, state: paged.load_block(  # noqa: E731
                    tma_atom_K, mK, head_idx_kv, sK[None, None, state.index], n_block, self.head_dim,
                    pipeline_k.producer_get_barrier(state), new_k, whole_k)
                copy_v = lambda n_block, state: paged.load_block(  # noqa: E731
                    tma_atom_V, mV, head_idx_kv, sV[None, None, state.index], n_block, self.head_dim_v,
                    pipeline_v.producer_get_barrier(state), new_v, whole_v)
                # The consumers' appended rows are in the cache (and fenced), unless the append
                # twin's consumers patch them into the first block's stages (kv_cache.py).
                if waits_for_append(seqlen_new, seq.seqlen_k, block_at(0), self.tile_n, self.patch_appends) != 0:
                    cute.arch.barrier(barrier_id=int(FwdBarrier.KV_APPEND),
                                      number_of_threads=self.num_mma_threads + cute.arch.WARP_SIZE)
            else:
                gK = cute.local_tile(self.tile_view(mK, head_idx_kv, batch_idx, seq.offset_k),
                                     (self.tile_n, self.head_dim), (None, 0))
                gV = cute.local_tile(self.tile_view(mV, head_idx_kv, batch_idx, seq.offset_k),
                                     (self.tile_n, self.head_dim_v), (None, 0))
                tKsK, tKgK = cpasync.tma_partition(
                    tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
                )
                tVsV, tVgV = cpasync.tma_partition(
                    tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
                )
                ahead_of = lambda n_block: None  # noqa: E731
                copy_k = lambda n_block, state: cute.copy(  # noqa: E731
                    tma_atom_K, tKgK[None, n_block], tKsK[None, state.index],
                    tma_bar_ptr=pipeline_k.producer_get_barrier(state))
                copy_v = lambda n_block, state: cute.copy(  # noqa: E731
                    tma_atom_V, tVgV[None, n_block], tVsV[None, state.index],
                    tma_bar_ptr=pipeline_v.producer_get_barrier(state))

            # The consumers release Q only after the previous tile's last Q @ K^T, and Q is read
            # once (never an L2 hit): fetch it into L2 now, about two K/V blocks ahead of that,
            # so the load that follows the release waits on L2 instead of HBM.
            if pack_gqa == 1:
                cute.prefetch(tma_atom_Q, tQgQ)
            # K of the last block first: the consumers start with Q @ K^T of that block.
            ahead_of(block_at(0))
            pipeline_k.producer_acquire(kv_state)
            copy_k(block_at(0), kv_state)
            pipeline_q.producer_acquire(q_state)
            if pack_gqa == 1:
                cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
            else:
                mbar_q = pipeline_q.producer_get_barrier(q_state)
                few_rows = False  # KV cache: each head has fewer rows of the tile than a piece
                if const_expr(self.kv_cache):
                    few_rows = rows.block_rows < Q_PIECE_ROWS
                if few_rows:
                    (mQh4, atom4), (mQh2, atom2), (mQh1, atom1) = q_heads
                    if rows.block_rows == FEW_HEAD_ROWS[0]:
                        self.load_q_across_heads(mQh4, atom4, FEW_HEAD_ROWS[0], sQ, rows, batch_idx, mbar_q)
                    elif rows.block_rows == FEW_HEAD_ROWS[1]:
                        self.load_q_across_heads(mQh2, atom2, FEW_HEAD_ROWS[1], sQ, rows, batch_idx, mbar_q)
                    else:
                        self.load_q_across_heads(mQh1, atom1, FEW_HEAD_ROWS[2], sQ, rows, batch_idx, mbar_q)
                else:
                    # One TMA load per piece of one head's rows (TileRows: which head and rows).
                    piece = Q_PIECE_ROWS
                    for c in cutlass.range_constexpr(self.tile_m // piece):
                        gQc = cute.local_tile(
                            self.tile_view(mQc, rows.head(c * piece), batch_idx, seq.offset_q),
                            (piece, self.head_dim), (rows.row(c * piece) // piece, 0),
                        )
                        sQc = cute.local_tile(sQ, (piece, self.head_dim), (c, 0))
                        tQsQc, tQgQc = cpasync.tma_partition(
                            tma_atom_Qc, 0, cute.make_layout(1), cute.group_modes(sQc, 0, 2),
                            cute.group_modes(gQc, 0, 2),
                        )
                        cute.copy(tma_atom_Qc, tQgQc, tQsQc, tma_bar_ptr=mbar_q)
            q_state.advance()
            # Steady state: K of block j-1 goes out before V of block j, matching the consumers'
            # issue order (Q @ K^T of j-1 together with P @ V of j).
            for i in cutlass.range(num_steps - 1, unroll=1):
                v_state = kv_state.clone()
                kv_state.advance()
                ahead_of(block_at(i + 1))
                pipeline_k.producer_acquire(kv_state)
                copy_k(block_at(i + 1), kv_state)
                self.wait_o_stored(o_free_mbar, i == 0, tiles_loaded)
                pipeline_v.producer_acquire(v_state)
                copy_v(block_at(i), v_state)
            self.wait_o_stored(o_free_mbar, num_steps - 1 <= 0, tiles_loaded)
            pipeline_v.producer_acquire(kv_state)
            copy_v(block_at(num_steps - 1), kv_state)
            kv_state.advance()
            if const_expr(self.o_in_v):
                tiles_loaded += 1
            if const_expr(self.dynamic_schedule):
                if const_expr(self.trace):
                    if dealt:
                        cursor = cursor + Int32(cute.arch.grid_dim()[0])
                    else:
                        cursor = claim_next_tile(mSemaphores.iterator)
                else:
                    cursor = claim_next_tile(mSemaphores.iterator)
                if const_expr(self.handoff_words == 1):
                    handoff_publish(tile_slots, tile_mbar, handoffs, (cursor,))
                    handoffs += 1
            else:
                cursor += 1
            m_block, head_idx, batch_idx, kv_lo, kv_hi, valid = self.work(scheduler, cursor, sparse_tables)
            if const_expr(self.dynamic_schedule and self.handoff_words > 1):
                handoff_publish(tile_slots, tile_mbar, handoffs,
                                (cursor, m_block, head_idx, batch_idx, cutlass.select_(valid, Int32(1), Int32(0))))
                handoffs += 1

    def wait_previous_grid(self, after):
        """FwdConfig.pdl: wait until the previous kernel in the stream has completed and its
        writes are visible. Each role calls it before its first global access (cache_seqlens
        and the cache itself may be what that kernel wrote), after its set-up and the first
        tile's schedule arithmetic, which read only the kernel's parameters: ``after``, that
        arithmetic's results, which the wait takes as inputs to keep it there (ptx.grid_wait_after,
        which skips the wait if one equals INT32_MIN: a valid work item's indices and block
        bounds are >= 0, and a role with no valid item reads no global memory after it)."""
        if const_expr(self.pdl):
            grid_wait_after(after)

    @cute.jit
    def wait_o_stored(self, o_free_mbar: cute.Pointer, first_v, tiles_loaded: Int32):
        """O in V's buffer: before a tile's first V load (``first_v``), wait until the previous
        tile's O store has read V's buffer (the consumers say so during this tile's first
        Q @ K^T). Only V's loads wait, not the tile's second K, which the consumers need first."""
        if const_expr(self.o_in_v):
            if first_v and tiles_loaded > 0:
                cute.arch.mbarrier_wait(o_free_mbar, (tiles_loaded - 1) % 2)

    @cute.jit
    def consume(
        self,
        mO: cute.Tensor,
        tma_O: cute.Tensor,
        mLSE: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        sO_parts: cute.Tensor,
        sLSE: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        scale_log2: Float32,
        score_scale: Float32,
        softcap: Float32,
        block_info: BlockInfo,
        scheduler: StaticPersistentScheduler,
        seqlen_q: Int32,
        seqlen_k: Int32,
        tile_slots: cute.Tensor,
        tile_mbar: cute.Pointer,
        o_free_mbar: cute.Pointer,
        seqlens,
        pack_gqa: Int32,
        partials: SplitPartials,
        make_scheduler,
        sparse_tables,
        mScoreParams: cute.Tensor,
        kv_cache,
        sAlibi,
        prologue_ns=None,
    ):
        """``prologue_ns``: trace twins' (kernel entry, set-up done) times of this CTA (TileTrace.begin)."""
        consume_ns = global_ns() if const_expr(self.trace) else None
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        # WGMMA operands in shared memory are described per warpgroup.
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * THREADS_PER_WG)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * THREADS_PER_WG)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        qk_more = None  # alibi_by_mma: Q @ K^T's extra K slice
        if const_expr(self.alibi_by_mma):
            sAlibiQ, sAlibiK = sAlibi
            qk_more = (wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sAlibiQ)),
                       wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sAlibiK)))
            self.fill_alibi_offsets(sAlibiK, tidx)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_smem_view(sV)))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_O = new_accumulator(wg_mma_pv, (self.tile_m, self.head_dim_v))

        softmax = OnlineSoftmax.create(scale_log2, cute.size(rows_cols_view(acc_O), mode=[0]), self.rescale_threshold,
                                       self.exp2_fma)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)

        # The first warpgroup gets a head start in the round-robin. Every warpgroup then does
        # the same number of waits and signals per tile, so the pending signal carries over.
        if wg_idx == 0:
            cute.arch.barrier_arrive(
                barrier_id=int(FwdBarrier.WG_SCHEDULER), number_of_threads=2 * THREADS_PER_WG
            )

        if const_expr(self.rebuild_schedule):
            # The schedule's tile-invariant values (the split tail's share, the decode's sizes:
            # ~8 registers) are rebuilt from schedule_plan's values at each use, a few multiplies
            # and FastDivmod divisions per tile, instead of held across the K/V loop
            # (FwdConfig.rebuild_schedule).
            schedule_at = lambda cursor: make_scheduler(loop_bound_zero(cursor))  # noqa: E731
        else:
            schedule_at = lambda cursor: scheduler  # noqa: E731
        stamps = Stamps.create(partials.partials, tidx, wg_idx) if const_expr(self.stamps) else None
        tracer = TileTrace(partials.semaphores, tidx) if const_expr(self.trace) else None
        tile_flags = Int32(0)
        if const_expr(self.trace and self.dynamic_schedule):
            tile_flags = Int32(FLAG_DYNAMIC)
            if deal_round_robin(partials.semaphores):
                tile_flags = Int32(FLAG_DYNAMIC | FLAG_DEALT)
        cursor = self.first_cursor(scheduler)
        handoffs = Int32(0)
        handoffs_o = Int32(0)
        distributed_launch = False
        if const_expr(self.distributed_merge):
            # The launch's choice (uniform: the counters take the flags' words), made once: its
            # inputs held across the tile loop spilled the schedule's values (hd128, 37 words).
            tail = scheduler.split
            distributed_launch = distributes(tail.ctas, tail.tail_tiles(),
                                             cutlass.min(seqlen_q, block_rows(self.tile_m, pack_gqa)) * pack_gqa,
                                             self.head_dim_v, tail.one_piece_per_cta())
        m_block, head_idx, batch_idx, kv_lo, kv_hi, valid = self.work(schedule_at(cursor), cursor, sparse_tables)
        prologue = None
        if const_expr(self.trace):
            prologue = (*prologue_ns, consume_ns, global_ns())
        self.wait_previous_grid((m_block, head_idx, batch_idx, kv_lo, kv_hi))
        while valid:
            trace_slot = Int32(-1)
            if const_expr(self.trace):
                trace_slot = tracer.begin(cursor, m_block, head_idx, batch_idx, tile_flags, prologue)
            bound = self.kv_bound_of_tile(seqlen_k, kv_cache, m_block)
            seq = self.seqlen_info(batch_idx, seqlen_q, bound, *seqlens)
            rows, shift = self.tile_rows(pack_gqa, m_block, head_idx, seq.seqlen_q)
            seqlen_q_tiled = seq.seqlen_q + shift  # what K/V block ranges see
            tile_blocks = block_info.for_rows(rows)
            mask = AttentionMask(self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k, rows.pack_log2,
                                 block_info.window_left, block_info.window_right)
            if const_expr(self.block_sparse):
                # Steps count in the dense loops' terms: step i of the tile's visiting order runs
                # as "block" n_block_max - 1 - i of a range [0, blocks visited), which is what
                # the first-P @ V and last-Q @ K^T tests below compare; the masks never read it.
                mCounts, mBlocks, mBits = sparse_tables
                sparse = SparseBlocks.of_tile(mCounts, mBlocks, batch_idx, head_idx, m_block)
                n_block_min, n_block_max = Int32(0), sparse.num_total
                # The first block's bits, loaded under the waits for Q and K.
                first_bits = mask.load_bits(mBits, sparse.first_slot, thr_mma_qk)
            else:
                n_block_min, n_block_max = self.block_range(tile_blocks, seqlen_q_tiled, seq.seqlen_k, m_block,
                                                            kv_lo, kv_hi, bound, self.by_bound_blocks(scheduler))
            if const_expr(self.trace):
                tracer.blocks(trace_slot, n_block_min, n_block_max)
            patched = Int32(0)  # the append twin: 1 where the appended rows go into the first block's stages
            if const_expr(self.kv_cache):
                mPageTable, page_size, mKCache, mVCache, mKNew, mVNew = kv_cache
                seqlen_new = seqlens[4]
                if seqlen_new > 0:
                    # The appended rows of this tile's K/V blocks into the cache; where the producer
                    # waits for them (KV_APPEND) before its loads, fenced first (kv_cache.py).
                    paged = PagedKV(mPageTable, page_size, batch_idx, seq.seqlen_k, self.tile_n)
                    head_kv = self.cache_head(head_idx, pack_gqa, mO, mKCache)
                    first_row, end_row = n_block_min * self.tile_n, n_block_max * self.tile_n
                    if const_expr(self.appends_from_new):
                        # Only the new rows of the block that straddles the cached and appended
                        # rows are read back from the cache (PagedKV.load_block).
                        straddled = cute.ceil_div(seq.seqlen_k - seqlen_new, self.tile_n) * self.tile_n
                        end_row = cutlass.min(end_row, straddled)
                    paged.append(mKNew, mKCache, head_kv, seqlen_new, first_row, end_row, self.head_dim, self.dtype,
                                 tidx, self.num_mma_threads)
                    paged.append(mVNew, mVCache, head_kv, seqlen_new, first_row, end_row, self.head_dim_v,
                                 self.dtype, tidx, self.num_mma_threads)
                    if waits_for_append(seqlen_new, seq.seqlen_k, n_block_max - 1, self.tile_n,
                                        self.patch_appends) != 0:
                        fence_proxy_async_global()
                        cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.KV_APPEND),
                                                 number_of_threads=self.num_mma_threads + cute.arch.WARP_SIZE)
                    elif const_expr(self.patch_appends):
                        if n_block_max * self.tile_n > seq.seqlen_k - seqlen_new:
                            patched = Int32(1)
                    if const_expr(self.appends_from_new):
                        # The cache's stores of the other appended rows, which no tile reads back:
                        # a share of them per query block, by the tiles of each K/V head's first
                        # query head (a split tile's pieces each store it: the same values).
                        lo, hi = self.append_share(m_block, head_idx, pack_gqa, seqlen_q, seq.seqlen_k, seqlen_new,
                                                   mO, mKCache)
                        paged.append(mKNew, mKCache, head_kv, seqlen_new, lo, hi, self.head_dim, self.dtype,
                                     tidx, self.num_mma_threads)
                        paged.append(mVNew, mVCache, head_kv, seqlen_new, lo, hi, self.head_dim_v,
                                     self.dtype, tidx, self.num_mma_threads)
            bias_at = None
            if const_expr(self.score_mod != "none"):
                # The score_mod's bias at step n_block (the pseudo-index above) of the visiting order:
                # (the K/V block's first key, read at the step's start), then (its loads, issued
                # under the score GEMM) -> the function adding it to the scores.
                bias = ScoreBias.create(self.score_mod, self.tile_m, self.tile_n, False, mScoreParams, head_idx,
                                        Float32(LOG2_E) / softmax.scale_log2, batch_idx, self.bias_uniform_tiles)
                n_blocks = cute.ceil_div(seq.seqlen_k, self.tile_n)
                if const_expr(self.alibi_by_mma):  # the columns' part by the GEMM, the rows' to the softmax
                    self.fill_alibi_slopes(sAlibi[0], bias.factor, tidx, wg_idx)
                    adder = lambda first_key, loaded: (  # noqa: E731
                        lambda acc: bias.alibi_row_offsets(thr_mma_qk, rows.first_row, first_key))
                elif const_expr(self.score_mod == "alibi"):  # its row part goes to the softmax
                    adder = lambda first_key, loaded: (  # noqa: E731
                        lambda acc: bias.apply_split(acc, thr_mma_qk, rows.first_row, first_key))
                elif const_expr(self.bias_waves > 0):
                    adder = lambda first_key, loaded: (  # noqa: E731
                        lambda acc: bias.add(acc, thr_mma_qk, rows.first_row, first_key, self.bias_waves))
                else:
                    adder = lambda first_key, loaded: (  # noqa: E731
                        lambda acc: bias.apply(acc, thr_mma_qk, rows.first_row, first_key, loaded, row_offsets=True))
                bias_at = (
                    lambda n_block: sparse.n_block(n_block_max - 1 - n_block, n_blocks) * self.tile_n,  # noqa: E731
                    lambda first_key: (  # noqa: E731
                        None if const_expr(self.bias_waves > 0) else bias.load(thr_mma_qk, rows.first_row, first_key)),
                    adder,
                    # A bias tensor's next block into L2 (ScoreBias.prefetch; nothing for the other kinds).
                    lambda first_key: bias.prefetch(rows.first_row, first_key, tidx, self.num_mma_threads),  # noqa: E731
                )
            skipped = Int32(0)
            if const_expr(self.skip_dead_blocks):
                skip_state = kv_state.clone()
                # On the diagonal a warpgroup's 64 rows see fewer blocks than the tile's last row
                # does: it sits out the tile's first (rightmost) blocks that hide all its keys
                # (hd64's 192-row tiles: 9 of 81 warpgroup-blocks at seqlen 1k). It still takes
                # its turns in the round-robin and releases their stages (see skip_blocks).
                skipped = n_block_max - self.warpgroup_n_block_max(tile_blocks, rows, wg_idx, seq, n_block_min,
                                                                   n_block_max)
                n_block_max -= skipped
                kv_state = self.skip_blocks(kv_state, skipped, pipeline_k)
                if const_expr(self.o_in_v):
                    # The producer loads this tile's first V (and every K after the second)
                    # only once the previous O store has read V's buffer: a warpgroup that
                    # starts on a later K says so first.
                    if skipped > 0 and handoffs_o > 0:
                        self.release_o_buffer(o_free_mbar)
            if const_expr(self.stamps):
                stamps.tile(q_state.count, 0)
            pipeline_q.consumer_wait(q_state)
            if const_expr(self.stamps):
                stamps.tile(q_state.count, 1)
            if const_expr(self.trace):
                tracer.mark(trace_slot, "q_ready_lo")

            # First block: Q @ K^T with no P @ V to pair it with, masked for the seqlen_k tail and
            # the causal/local edges. It still takes its turn in the ping-pong, so one
            # warpgroup's first softmax overlaps the other's first GEMM.
            first_key = None
            if const_expr(bias_at is not None):
                first_key = bias_at[0](n_block_max - 1)
            pipeline_k.consumer_wait(kv_state)
            if const_expr(self.trace):
                tracer.mark(trace_slot, "k_ready_lo")
            if const_expr(self.patch_appends):
                if patched != 0:  # the appended rows into the loaded K (kv_cache.patch_rows)
                    patch_rows(sK[None, None, kv_state.index], mKNew, self.cache_head(head_idx, pack_gqa, mO, mKCache),
                               batch_idx, seqlen_new, seq.seqlen_k, n_block_max - 1, self.tile_n, self.head_dim,
                               self.dtype, tidx, self.num_mma_threads)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=int(FwdBarrier.KV_STALE_ROWS), number_of_threads=THREADS_PER_WG)
            self.scheduler_wait()
            acc_S = new_accumulator(wg_mma_qk, (self.tile_m, self.tile_n))
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], False, -1, qk_more)
            self.scheduler_signal()
            bias_of = None
            if const_expr(bias_at is not None):
                bias_of = bias_at[2](first_key, bias_at[1](first_key))
                bias_at[3](bias_at[0](cutlass.max(n_block_max - 2, n_block_min)))
            if const_expr(self.o_in_v):
                # The previous tile's O store has read V's buffer by now, or soon: the storing
                # warp waits for that here, under this Q @ K^T, rather than right after issuing
                # the store (which held its warpgroup back at the tile boundary: measured 1%
                # slower at seqlen 1k for hd192/hd256).
                if handoffs_o > 0 and skipped == 0:
                    self.release_o_buffer(o_free_mbar)
                handoffs_o += 1
            warpgroup.wait_group(0)
            pipeline_k.consumer_release(kv_state)
            first_block = lambda mask_seqlen, bits=None: self.scores_to_probs(  # noqa: E731
                acc_S, tOrP, softmax, mask, thr_mma_qk, score_scale, softcap, rows.first_row, n_block_max - 1,
                mask_seqlen=mask_seqlen, mask_right=self.is_causal or self.is_local, mask_left=self.is_local,
                is_first=True, bits=bits, bias_of=bias_of,
            )
            # Only a block reaching past seqlen_k needs the seqlen mask: at lengths that are a
            # multiple of tile_n (and in split pieces that end early) the first block is full,
            # and its softmax, which nothing overlaps, skips ~100 compare/select instructions.
            # Not with causal/local masks, whose first block is mostly masked anyway (and whose
            # hd64 softcap consumers spill with a second copy of it).
            if const_expr(self.block_sparse):
                # The bits hold the seqlen_k tail too (a block reaching past it is partial).
                if sparse.num_partial > 0:
                    first_block(False, first_bits)
                else:
                    first_block(False)
            elif const_expr(self.is_causal or self.is_local):
                first_block(True)
            elif n_block_max * self.tile_n > seq.seqlen_k:
                first_block(True)
            else:
                first_block(False)
            if const_expr(self.skip_dead_blocks):
                # The skipped blocks' V stages, released once loaded (after this softmax they
                # have landed): an arrive before the stage's load could count towards the
                # previous phase of its "empty" barrier.
                for _ in cutlass.range(skipped, unroll=1):
                    pipeline_v.consumer_wait(skip_state)
                    pipeline_v.consumer_release(skip_state)
                    skip_state.advance()
            if const_expr(self.stamps):
                stamps.tile(q_state.count, 2)

            before_first_pv = None
            if const_expr(self.kv_cache):
                # The tile's first block (its last K/V block) may end inside a 16-row page box
                # whose rows past the sequence come from the cache as they are: zero them in V.
                first_block_index = n_block_max - 1
                patch_v = None
                if const_expr(self.patch_appends):
                    patch_v = (patched, mVNew, self.cache_head(head_idx, pack_gqa, mO, mKCache), batch_idx, seqlens[4])
                before_first_pv = lambda v_state: self.clear_stale_v_rows(  # noqa: E731
                    sV, v_state.index, seq.seqlen_k, first_block_index, tidx, wg_idx, patch_v)
            step = lambda kv_state, n_block, mask_right, mask_left, bits_of=None: self.overlapped_step(  # noqa: E731
                kv_state, n_block, n_block_max, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrP, tOrVt,
                acc_O, pipeline_k, pipeline_v, softmax, mask, thr_mma_qk, score_scale, softcap,
                rows.first_row, mask_right, mask_left, pipeline_q, q_state, n_block_min, stamps, bits_of,
                bias_at, before_first_pv, qk_more,
            )
            if const_expr(self.block_sparse):
                # The partial blocks after the first, each with its slot's bits, then the full ones.
                for i in cutlass.range(1, sparse.num_partial, unroll=1):
                    slot = sparse.first_slot + i
                    kv_state = step(kv_state, n_block_max - 1 - i, False, False,
                                    lambda: mask.load_bits(mBits, slot, thr_mma_qk))
                for i in cutlass.range(cutlass.max(sparse.num_partial, 1), sparse.num_total, unroll=1):
                    kv_state = step(kv_state, n_block_max - 1 - i, False, False)
            else:
                # Blocks on the causal/local diagonal (right edge) need the per-element mask ...
                n_block_max_unmasked = n_block_max - 1
                if const_expr(self.is_causal or self.is_local):
                    n_right = tile_blocks.n_block_min_right_mask(seqlen_q_tiled, seq.seqlen_k, m_block, n_block_min)
                    for i in cutlass.range(cutlass.max(n_block_max_unmasked - n_right, 0), unroll=1):
                        kv_state = step(kv_state, n_block_max_unmasked - 1 - i, True, False)
                    n_block_max_unmasked = cutlass.min(n_block_max_unmasked, n_right)
                # ... the interior does not ...
                n_left = tile_blocks.n_block_min_no_left_mask(seqlen_q_tiled, seq.seqlen_k, m_block, n_block_min)
                for i in cutlass.range(n_block_max_unmasked - n_left, unroll=1):
                    kv_state = step(kv_state, n_block_max_unmasked - 1 - i, False, False)
                # ... and a local window's left edge does again.
                if const_expr(self.is_local):
                    n_block_max_unmasked = cutlass.min(n_block_max_unmasked, n_left)
                    for i in cutlass.range(n_block_max_unmasked - n_block_min, unroll=1):
                        kv_state = step(kv_state, n_block_max_unmasked - 1 - i, False, True)

            # Every Q @ K^T of this tile has completed: the producer may load the next Q (with
            # early_q_release, the last K/V step has said so unless the tile has one block).
            if const_expr(self.early_q_release):
                if n_block_max - n_block_min <= 1:
                    pipeline_q.consumer_release(q_state)
            else:
                pipeline_q.consumer_release(q_state)
            if const_expr(self.stamps):
                stamps.tile(q_state.count, 3)
            # Last P @ V. The row sums' quad reduction (shuffles, independent of O) runs under it.
            pipeline_v.consumer_wait(kv_state)
            if const_expr(self.kv_cache):
                if n_block_max - n_block_min == 1:  # also the tile's first block
                    if const_expr(self.num_consumer_wg > 1):
                        # A turn of the round-robin, so the first warpgroup's zeroes are in
                        # before the others' P @ V (clear_stale_v_rows).
                        self.scheduler_wait()
                        before_first_pv(kv_state)
                        self.scheduler_signal()
                    else:
                        before_first_pv(kv_state)
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index],
                  n_block_max - n_block_min > 1, -1)
            totals = softmax.row_totals()
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(kv_state)
            kv_state.advance()
            if const_expr(self.stamps):
                stamps.tile(q_state.count, 4)
            if const_expr(self.trace):
                tracer.mark(trace_slot, "blocks_done_lo")
            tile_stamp = None
            if const_expr(self.stamps):
                count_q = q_state.count
                tile_stamp = lambda point: stamps.tile(count_q, point)  # noqa: E731

            end_flags = Int32(0)
            if const_expr(self.split_tail):
                # A piece of a split tile (static schedule's last round): writers leave their
                # partial state for the tile's merger; the merger folds every writer's in first.
                split = schedule_at(cursor).split
                role = split.role(kv_lo, cutlass.min(kv_hi, split.n_blocks))
                cta = split.cta
                sync_id = int(FwdBarrier.SPLIT_WG) + wg_idx
                if const_expr(self.trace):
                    if role == WRITER:
                        end_flags = Int32(FLAG_SPLIT_WRITER)
                    elif role == MERGER:
                        end_flags = Int32(FLAG_SPLIT_MERGER)
                distributed = False
                if const_expr(self.distributed_merge):
                    distributed = role != WHOLE and distributed_launch
                if distributed:
                    # Every piece stores its partial, waits for the others', then folds and stores
                    # its share of the tile.
                    merger_cta = cta if role == MERGER else split.first_piece_merger()
                    pieces = split.writers(merger_cta) + 1
                    live = self.rows_in_sequence(tiled_mma_pv, tidx, rows, seq)
                    partials.store(partials.piece_slot(merger_cta, cta - merger_cta), wg_idx, tidx, acc_O,
                                   softmax.row_max, softmax.row_sum, live, sync_id,
                                   arrivals=partials.tile_counter(merger_cta, 0))
                    departed = partials.wait_arrivals(merger_cta, pieces, tidx, sync_id)
                    if const_expr(self.trace):
                        tracer.mark(trace_slot, "partials_ready_lo")
                    self.merge_share(partials, merger_cta, pieces, cta - merger_cta, tidx, tiled_mma_pv, mO, mLSE,
                                     batch_idx, seq, rows, softmax.scale_log2)
                    if const_expr(self.trace):
                        tracer.mark(trace_slot, "merged_lo")
                    partials.reset_counters(merger_cta, pieces, tidx, departed)
                elif role == WRITER:
                    live = self.rows_in_sequence(tiled_mma_pv, tidx, rows, seq)
                    partials.store(cta, wg_idx, tidx, acc_O, softmax.row_max, softmax.row_sum, live, sync_id)
                else:
                    if role == MERGER:
                        writers = split.writers(cta)
                        partials.wait(cta + 1, writers, wg_idx, tidx, sync_id)
                        if const_expr(self.trace):
                            tracer.mark(trace_slot, "partials_ready_lo")
                        partials.merge(cta + 1, writers, tidx, acc_O, softmax.row_max, softmax.row_sum,
                                       lambda t: self.rows_in_sequence(tiled_mma_pv, t, rows, seq),
                                       softmax.scale_log2)
                        if const_expr(self.trace):
                            tracer.mark(trace_slot, "merged_lo")
                        merged = softmax.row_totals()
                        for r in cutlass.range_constexpr(cute.size(totals)):
                            totals[r] = merged[r]
                    self.finish_tile(acc_O, softmax, totals, mO, tma_O, mLSE, sO, sO_parts, sLSE, tma_atom_O,
                                     tiled_mma_pv, tidx, batch_idx, seq, rows, o_free_mbar, tile_stamp)
            else:
                self.finish_tile(acc_O, softmax, totals, mO, tma_O, mLSE, sO, sO_parts, sLSE, tma_atom_O, tiled_mma_pv,
                                 tidx, batch_idx, seq, rows, o_free_mbar, tile_stamp)
            if const_expr(self.stamps):
                stamps.tile(q_state.count, TILE_END)
            if const_expr(self.trace):
                tracer.end(trace_slot, end_flags)
            q_state.advance()
            if const_expr(self.dynamic_schedule and self.handoff_words > 1):
                cursor, m_block, head_idx, batch_idx, published = handoff_receive(tile_slots, tile_mbar, handoffs,
                                                                                  self.handoff_words)
                handoffs += 1
                kv_lo, kv_hi, valid = Int32(0), Int32(UNBOUNDED_BLOCKS), published != 0
            else:
                if const_expr(self.dynamic_schedule):
                    cursor = handoff_receive(tile_slots, tile_mbar, handoffs, 1)[0]
                    handoffs += 1
                else:
                    cursor += 1
                m_block, head_idx, batch_idx, kv_lo, kv_hi, valid = self.work(schedule_at(cursor), cursor,
                                                                              sparse_tables)

        # Shared memory must outlive the last TMA store's reads.
        if self.is_store_warp():
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def finish_tile(self, acc_O, softmax, totals, mO, tma_O, mLSE, sO, sO_parts, sLSE, tma_atom_O, tiled_mma_pv, tidx,
                    batch_idx, seq, rows, o_free_mbar, tile_stamp=None):
        """Normalise O by the row sums (``totals``: softmax.row_totals()) and store O and LSE."""
        row_scale = softmax.finalize(totals)
        softmax.rescale(acc_O, row_scale, always=True)
        if const_expr(self.stamps):
            tile_stamp(5)
        self.epilogue(acc_O, softmax.row_sum, mO, tma_O, mLSE, sO, sO_parts, sLSE, tma_atom_O, tiled_mma_pv, tidx,
                      batch_idx, seq, rows, o_free_mbar, tile_stamp)

    @cute.jit
    def merge_share(self, partials: SplitPartials, merger_cta: Int32, pieces: Int32, piece: Int32, tidx: Int32,
                    tiled_mma_pv: cute.TiledMma, mO: cute.Tensor, mLSE: cute.Tensor, batch_idx: Int32,
                    seq: SeqlenInfo, rows: TileRows, scale_log2: Float32):
        """Distributed merging: this piece's share of its split tile. Each of a thread's
        accumulator rows is cut into chunks (split_partials.CHUNK columns); chunk g of them all
        (g = row * chunks per row + chunk) goes to piece g mod pieces, whose thread tidx folds
        that chunk of thread tidx's partial in every piece and stores its columns, normalised as
        finish_tile does, and the row's LSE with the row's first chunk. A quad's four threads take
        the same chunk of one row: their row sums add up by shuffles. ``g`` is uniform across the
        CTA, so every lane reaches the shuffles.

        Lanes whose rows hold no query help a live lane of their warp (their owner) fold its
        chunks (split_partials.helper_lanes): a decoding tile of 16 packed heads has a quarter of
        its lanes live. A warp whose live lanes' OR is 31 (every lane live, say: no helpers) keeps
        the plain fold: its own code path, since the helpers' code beside it cost MQA's 64 live
        rows 0.5 us at 1 x 32k (H100, session 60)."""
        # The per-thread addresses below are the same for every tile: an opaque per-tile zero keeps
        # LLVM from computing them before the tile loop and holding them across it (spilled 37
        # words beside the merger's path, as in ``epilogue``).
        tidx = tidx + loop_bound_zero(rows.first_row)
        own_live = self.rows_in_sequence(tiled_mma_pv, tidx, rows, seq)
        any_live = own_live[0]
        for i in cutlass.range_constexpr(1, len(own_live)):
            any_live = any_live or own_live[i]
        lane = tidx % 32
        lanes = helper_lanes(any_live, lane)
        if lanes[0] == 31:
            self.merge_items(partials, merger_cta, pieces, piece, tidx, tidx, tiled_mma_pv, mO, mLSE, batch_idx, seq,
                             rows, scale_log2, None)
        else:
            self.merge_items(partials, merger_cta, pieces, piece, tidx, tidx - lane + (lane & lanes[0]), tiled_mma_pv,
                             mO, mLSE, batch_idx, seq, rows, scale_log2, lanes)

    @cute.jit
    def merge_items(self, partials: SplitPartials, merger_cta: Int32, pieces: Int32, piece: Int32, tidx: Int32,
                    owner: Int32, tiled_mma_pv: cute.TiledMma, mO: cute.Tensor, mLSE: cute.Tensor, batch_idx: Int32,
                    seq: SeqlenInfo, rows: TileRows, scale_log2: Float32, lanes):
        """merge_share's items for this thread: chunks of ``owner``'s partial words (``tidx``'s own
        without helpers, ``lanes`` None), folded with ``lanes``' helpers; owners store."""
        tOcO = self.o_coords(tiled_mma_pv, owner)
        live = self.rows_in_sequence(tiled_mma_pv, owner, rows, seq)
        n_rows, n_cols = cute.size(tOcO, mode=[0]), cute.size(tOcO, mode=[1])
        chunks_per_row = n_cols // CHUNK
        pair_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                        num_bits_per_copy=2 * self.dtype.width)
        # A run-time loop over the chunks: unrolled over every chunk of the thread's rows, the
        # kernel's code grew from 7.8k to 13-15k instructions (hd128), which a decoding call,
        # whose CTAs run the code once, pays in instruction fetches.
        for g in cutlass.range(piece, n_rows * chunks_per_row, pieces, unroll=1):
            r = g // chunks_per_row
            first_col = (g - r * chunks_per_row) * CHUNK
            row_live = live[0]
            for i in cutlass.range_constexpr(1, n_rows):
                row_live = live[i] if r == i else row_live
            row_max, row_sum, o = partials.fold_chunk(merger_cta, pieces, owner, r, r * n_cols + first_col, n_rows,
                                                      row_live, scale_log2, lanes)
            softmax = OnlineSoftmax(scale_log2, row_max, row_sum)
            row_scale = softmax.finalize(softmax.row_totals())
            tile_row = tOcO[r, 0][0]
            row = rows.row(tile_row)
            is_owner = True
            if const_expr(lanes is not None):
                is_owner = owner == tidx
            if row >= 0 and row < seq.seqlen_q and is_owner:
                scaled = cute.make_rmem_tensor((CHUNK,), Float32)
                for c in cutlass.range_constexpr(CHUNK):
                    scaled[c] = o[0, c] * row_scale[0]
                out = cute.make_rmem_tensor((CHUNK,), self.dtype)
                out.store(scaled.load().to(self.dtype))
                gRow = self.tile_view(mO, rows.head(tile_row), batch_idx, seq.offset_q)[row, None]
                for c in cutlass.range_constexpr(0, CHUNK, 2):
                    pair = cute.make_rmem_tensor((2,), self.dtype)
                    pair[0] = out[c]
                    pair[1] = out[c + 1]
                    cute.copy(pair_copy, pair, cute.local_tile(gRow, (2,), (tOcO[r, first_col + c][1] // 2,)))
                if first_col == 0 and tOcO[0][1] == 0:
                    self.store_lse_row(row_sum[0], tile_row, mLSE, batch_idx, seq, rows)

    def o_coords(self, tiled_mma_pv: cute.TiledMma, tidx: Int32) -> cute.Tensor:
        """The (tile row, column) of each of thread ``tidx``'s O accumulator values, as a
        (rows, cols) view like rows_cols_view(acc_O)."""
        return rows_cols_view(tiled_mma_pv.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.head_dim_v))))

    @cute.jit
    def rows_in_sequence(self, tiled_mma_pv: cute.TiledMma, tidx: Int32, rows: TileRows, seq: SeqlenInfo):
        """Per accumulator row of this thread: does it hold a query row of the sequence?"""
        tOcO = self.o_coords(tiled_mma_pv, tidx)
        return tuple(rows.row(tOcO[r, 0][0]) < seq.seqlen_q for r in range(cute.size(tOcO, mode=[0])))

    @cute.jit
    def first_cursor(self, scheduler: StaticPersistentScheduler) -> Int32:
        """Dynamic schedule: the first tile (the block index); static: item 0 of this CTA."""
        if const_expr(self.dynamic_schedule):
            return scheduler.first_tile()
        return Int32(0)

    @cute.jit
    def work(self, scheduler: StaticPersistentScheduler, cursor: Int32, sparse_tables):
        """(m_block, head, batch, first K/V block, end K/V block, valid) of the work ``cursor``
        names: a tile index (dynamic schedule) or this CTA's item count (static; the K/V bounds
        cut a split tail's pieces, see tile_scheduler.SplitTail). Block-sparse: the schedule's
        m_block is a position in its row's longest-first order (SparseBlocks.scheduled_tile)."""
        if const_expr(self.dynamic_schedule):
            m_block, head_idx, batch_idx, valid = scheduler.decode(cursor)
            if const_expr(self.block_sparse):
                mCounts = sparse_tables[0]
                if valid:
                    m_block = SparseBlocks.scheduled_tile(mCounts, batch_idx, head_idx, m_block,
                                                          cute.size(mCounts.shape[2]))
            return m_block, head_idx, batch_idx, Int32(0), Int32(UNBOUNDED_BLOCKS), valid
        tile, kv_lo, kv_hi, in_share = scheduler.static_work(cursor)
        m_block, head_idx, batch_idx, valid = scheduler.decode(tile)
        return m_block, head_idx, batch_idx, kv_lo, kv_hi, valid and in_share

    def visiting_order(self, block_info: BlockInfo, seq: SeqlenInfo, shift, m_block, head_idx, batch_idx, kv_lo,
                       kv_hi, sparse_tables, seqlen_k_bound, by_bound_blocks=None):
        """(block_at, num_steps): the i-th K/V block a tile visits, and how many it visits. Dense:
        its block range from the last block down (on the causal diagonal the masked block comes
        first, in the step nothing overlaps); block-sparse: its row of the tables (partial
        blocks first, block_info.SparseBlocks)."""
        if const_expr(self.block_sparse):
            mCounts, mBlocks, _ = sparse_tables
            sparse = SparseBlocks.of_tile(mCounts, mBlocks, batch_idx, head_idx, m_block)
            n_blocks = cute.ceil_div(seq.seqlen_k, self.tile_n)
            return (lambda i: sparse.n_block(i, n_blocks)), sparse.num_total
        n_block_min, n_block_max = self.block_range(block_info, seq.seqlen_q + shift, seq.seqlen_k, m_block,
                                                    kv_lo, kv_hi, seqlen_k_bound, by_bound_blocks)
        return (lambda i: n_block_max - 1 - i), n_block_max - n_block_min

    def block_range(self, block_info: BlockInfo, seqlen_q, seqlen_k, m_block, kv_lo, kv_hi, seqlen_k_bound,
                    by_bound_blocks=None):
        """The tile's K/V block range, cut to the piece [kv_lo, kv_hi) when the tail is split.
        ``seqlen_k_bound``: the keys the split's blocks were counted from (every tile's seqlen_k
        for dense calls; a KV cache's capacity, whose sequences may be shorter), and
        ``by_bound_blocks`` its blocks as a divisor (by_bound_blocks)."""
        n_block_min, n_block_max = block_info.n_block_range(seqlen_q, seqlen_k, m_block)
        if const_expr(self.split_tail):
            if const_expr(self.kv_cache):
                # Pieces of the capacity's blocks, scaled onto the blocks this tile sees of its
                # sequence (a window's start on): every CTA of the split gets its share of them.
                # A piece left empty visits one block past the sequence, all masked (zeros
                # loaded): a partial with no weight.
                n_seq = n_block_max
                kv_lo, kv_hi = scale_piece(kv_lo, kv_hi, n_block_max - n_block_min,
                                           cute.ceil_div(seqlen_k_bound, self.tile_n), by_bound_blocks)
                n_block_min, n_block_max = n_block_min + kv_lo, n_block_min + kv_hi
                empty = cutlass.min(cutlass.max(n_block_min - n_block_max + 1, 0), 1)
                n_block_min = n_block_min + empty * (n_seq - n_block_min)
                n_block_max = n_block_max + empty * (n_seq + 1 - n_block_max)
            else:
                n_block_min, n_block_max = cutlass.max(n_block_min, kv_lo), cutlass.min(n_block_max, kv_hi)
        return n_block_min, n_block_max

    @cute.jit
    def overlapped_step(
        self,
        kv_state,
        n_block: Int32,
        n_block_max: Int32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrP: cute.Tensor,
        tOrVt: cute.Tensor,
        acc_O: cute.Tensor,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        softmax: OnlineSoftmax,
        mask: AttentionMask,
        thr_mma_qk: cute.ThrMma,
        score_scale: Float32,
        softcap: Float32,
        first_row: Int32,
        mask_right: cutlass.Constexpr[bool],
        mask_left: cutlass.Constexpr[bool],
        pipeline_q: pipeline.PipelineAsync,
        q_state,
        n_block_min: Int32,
        stamps=None,
        bits_of=None,
        bias_at=None,
        before_first_pv=None,
        qk_more=None,
    ):
        """Q @ K^T of ``n_block`` overlapped with P @ V of the block after it. ``bits_of``
        (block-sparse partial blocks): loads the block's mask bits (AttentionMask.load_bits),
        here, ahead of the waits. ``bias_at``: a score_mod's (see consume), its block read here
        and its loads issued under the GEMMs. ``before_first_pv(v_state)``: run on the tile's
        first V stage before its P @ V (a KV cache's stale rows, clear_stale_v_rows)."""
        count = kv_state.count
        stamp = lambda point: stamps.step(count, point) if const_expr(self.stamps == "all") else None  # noqa: E731
        stamp(0)
        bits = bits_of() if const_expr(bits_of is not None) else None
        first_key = None
        if const_expr(bias_at is not None):
            first_key = bias_at[0](n_block)
        v_state = kv_state.clone()
        kv_state.advance()
        pipeline_k.consumer_wait(kv_state)
        stamp(1)
        self.scheduler_wait()
        stamp(2)
        acc_S = new_accumulator(thr_mma_qk, (self.tile_m, self.tile_n))
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], False, -1, qk_more)
        pipeline_v.consumer_wait(v_state)
        if const_expr(before_first_pv is not None):
            if n_block == n_block_max - 2:
                before_first_pv(v_state)
        # The first P @ V (that of block n_block_max - 1) initialises O.
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index],
              n_block != n_block_max - 2, -1)
        self.scheduler_signal()
        bias_of = None
        if const_expr(bias_at is not None):
            bias_of = bias_at[2](first_key, bias_at[1](first_key))
            bias_at[3](bias_at[0](cutlass.max(n_block - 1, n_block_min)))
        stamp(3)
        warpgroup.wait_group(1)
        stamp(4)
        if const_expr(self.early_q_release):
            # The tile's last Q @ K^T has completed: the producer may load the next tile's Q
            # now, under this softmax and the last P @ V, rather than after them. (A predicated
            # arrive; a branch here would split the pipeline state.)
            if pipeline_q.is_signaling_thread and n_block == n_block_min:
                pipeline_q.sync_object_empty.arrive(q_state.index, pipeline_q.consumer_mask)
        if const_expr(self.pv_wait == "row_max"):
            pipeline_k.consumer_release(kv_state)
        # Only unmasked steps guess: masked ones (a tile's diagonal or window-edge blocks, a
        # few per tile) keep the row max, as the mask's registers beside the kept scores spill.
        speculative = self.speculative_max and not (mask_right or mask_left or bits is not None)
        if const_expr(speculative):
            # Exponentials against the running max straight away (OnlineSoftmax.
            # speculative_step); the scores stay in acc_S for the rare redo below.
            offsets = self.prepare_scores(acc_S, mask, thr_mma_qk, score_scale, softcap, first_row, n_block,
                                          mask_seqlen=False, mask_right=mask_right, mask_left=mask_left,
                                          bias_of=bias_of)
            probs = cute.make_rmem_tensor_like(acc_S, Float32)
            block_sum = softmax.speculative_step(acc_S, probs, offsets)
        else:
            row_scale = self.scores_to_probs(
                acc_S, None, softmax, mask, thr_mma_qk, score_scale, softcap, first_row, n_block,
                mask_seqlen=False, mask_right=mask_right, mask_left=mask_left, is_first=False, bits=bits,
                bias_of=bias_of,
            )
            probs = acc_S
        if const_expr(self.pv_wait != "row_max"):
            # ptxas hoists the wait below as far up as it may, to just after the row max, so the
            # exponentials would run only once P @ V is done; it does keep the wait after the
            # mbarrier arrive that releases K. Releasing K under a predicate computed from some
            # exponentials (always true) therefore pins the wait behind them: the first few
            # of row 0 ("first_exps") or the row sums, i.e. all of them ("softmax").
            if const_expr(self.pv_wait == "softmax"):
                sums = block_sum if const_expr(speculative) else softmax.row_sum
                after = (sums[0], sums[1])
            else:
                probs_mn = rows_cols_view(probs)
                after = (probs_mn[0, PV_WAIT_AFTER_EXP - 1], probs_mn[0, PV_WAIT_AFTER_EXP])
            if pipeline_k.is_signaling_thread and always_one_after(*after) != 0:
                pipeline_k.sync_object_empty.arrive(kv_state.index, pipeline_k.consumer_mask)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        store_as_operand_a(probs, tOrP)
        if const_expr(speculative):
            # The branches update the running state through views of its registers: a tensor
            # stored to under staged control flow is rebound to the branch's result, which must
            # not reach the softmax object the K/V loop shares with the rest of the tile.
            local = softmax.local_view()
            if local.holds(block_sum):
                local.accept(block_sum)
            else:
                # Some row's max rose past the threshold (or the row had none yet): redo the
                # block from its scores, as without the guess, and rescale O.
                redo_scale = local.step(acc_S, False, offsets)
                store_as_operand_a(acc_S, tOrP)
                local.rescale(acc_O, redo_scale, always=True)
        else:
            softmax.rescale(acc_O, row_scale)
        stamp(5)
        return kv_state

    @cute.jit
    def scores_to_probs(
        self,
        acc_S: cute.Tensor,
        tOrP: Optional[cute.Tensor],
        softmax: OnlineSoftmax,
        mask: AttentionMask,
        thr_mma_qk: cute.ThrMma,
        score_scale: Float32,
        softcap: Float32,
        first_row: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_right: cutlass.Constexpr[bool],
        mask_left: cutlass.Constexpr[bool],
        is_first: cutlass.Constexpr[bool],
        bits: Optional[cute.Tensor] = None,
        bias_of=None,
    ):
        offsets = self.prepare_scores(acc_S, mask, thr_mma_qk, score_scale, softcap, first_row, n_block,
                                      mask_seqlen, mask_right, mask_left, bits, bias_of)
        row_scale = softmax.step(acc_S, is_first, offsets)
        if const_expr(tOrP is not None):
            store_as_operand_a(acc_S, tOrP)
        return row_scale

    @cute.jit
    def prepare_scores(
        self,
        acc_S: cute.Tensor,
        mask: AttentionMask,
        thr_mma_qk: cute.ThrMma,
        score_scale: Float32,
        softcap: Float32,
        first_row: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_right: cutlass.Constexpr[bool],
        mask_left: cutlass.Constexpr[bool],
        bits: Optional[cute.Tensor] = None,
        bias_of=None,
    ):
        """Soft-capping, a score_mod's bias (``bias_of(acc_S)``) and the masks, in place
        on the scores (``bits``: a block-sparse partial block's, AttentionMask.load_bits).
        Returns the bias's per-row part the scores lack (OnlineSoftmax.step's ``offsets``), or
        None."""
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * score_scale, fastmath=True) * softcap
        offsets = None
        if const_expr(bias_of is not None):
            offsets = bias_of(acc_S)
        if const_expr(mask_seqlen or mask_right or mask_left):
            mask.apply(acc_S, thr_mma_qk, first_row, n_block, mask_seqlen,
                       mask_right and self.is_causal, (mask_right or mask_left) and self.is_local)
        if const_expr(bits is not None):
            mask.apply_bits(acc_S, thr_mma_qk, bits)
        return offsets

    @cute.jit
    def warpgroup_n_block_max(self, block_info: BlockInfo, rows: TileRows, wg_idx: Int32, seq: SeqlenInfo,
                              n_block_min: Int32, n_block_max: Int32) -> Int32:
        """The tile's n_block_max for this warpgroup's rows (causal/local right edge)."""
        rows_end = Int32(ROWS_PER_WG) * (wg_idx + 1)
        if rows.pack_log2 != 0:
            # Packed tiles stack the heads' rows: every warpgroup may hold a head's last rows.
            rows_end = rows.block_rows
        return block_info.n_block_max_of_rows(rows.first_row + rows_end, seq.seqlen_q, seq.seqlen_k, n_block_min,
                                              n_block_max)

    def cache_head(self, head_idx: Int32, pack_gqa: Int32, mO: cute.Tensor, mKCache: cute.Tensor) -> Int32:
        """KV cache: the K/V head of a tile whose query heads start at head_idx * pack_gqa."""
        return head_idx * pack_gqa // (cute.size(mO.shape[2]) // cute.size(mKCache.shape[2]))

    @cute.jit
    def append_share(self, m_block: Int32, head_idx: Int32, pack_gqa: Int32, seqlen_q: Int32, seqlen_k: Int32,
                     seqlen_new: Int32, mO: cute.Tensor, mKCache: cute.Tensor):
        """appends_from_new: the appended rows (sequence rows [lo, hi)) whose cache stores this
        tile makes: the tiles of a K/V head's first (packed) query head split the appended rows
        evenly by query block; the other tiles store none."""
        tile_heads = cute.size(mO.shape[2]) // pack_gqa
        heads_per_kv = tile_heads // cute.size(mKCache.shape[2])
        m_blocks = cute.ceil_div(seqlen_q * pack_gqa, self.tile_m)
        share = cute.ceil_div(seqlen_new, m_blocks)
        lo = seqlen_k - seqlen_new + m_block * share
        hi = lo + share
        if head_idx % heads_per_kv != 0:
            hi = lo
        return lo, hi

    @cute.jit
    def clear_stale_v_rows(self, sV: cute.Tensor, stage: Int32, seqlen_k: Int32, n_block: Int32, tidx: Int32,
                           wg_idx: Int32, patch=None):
        """KV cache: zero the rows of V block n_block (in stage ``stage``) past the sequence's
        end inside its last 16-row page box, which the TMA loaded from the cache as they are
        (kv_cache.py: boxes wholly past the end arrive as zeros). Their probabilities are 0, but
        0 * inf or NaN in a stale slot would be NaN. The append twin's ``patch`` (patched,
        mVNew, head_kv, batch_idx, seqlen_new): where ``patched``, copy the appended rows of
        mVNew into the block first (kv_cache.patch_rows). Then fence the writes for the P @ V
        and sync the warpgroup.
        Called in the caller's turn of the round-robin where the tile has several consumer
        warpgroups: only the first writes (a barrier over all of them would deadlock the
        round-robin, and each writing the same zeroes would race), and the others' P @ V comes
        after its turn, whose signal (bar.arrive) orders its fenced writes before their reads."""
        if const_expr(self.num_consumer_wg == 1):
            self.zero_stale_v_rows(sV, stage, seqlen_k, n_block, tidx, patch)
        elif wg_idx == 0:
            self.zero_stale_v_rows(sV, stage, seqlen_k, n_block, tidx, patch)

    @cute.jit
    def zero_stale_v_rows(self, sV: cute.Tensor, stage: Int32, seqlen_k: Int32, n_block: Int32, tidx: Int32,
                          patch=None):
        """clear_stale_v_rows' work, by one warpgroup (threads ``tidx`` 0-127)."""
        first = seqlen_k - n_block * self.tile_n
        boxed = cute.ceil_div(seqlen_k, CHUNK_ROWS) * CHUNK_ROWS - n_block * self.tile_n
        rows = cutlass.max(cutlass.min(boxed, self.tile_n) - cutlass.max(first, 0), 0)
        sV_stage = sV[None, None, stage]
        if const_expr(patch is not None):
            patched, mVNew, head_kv, batch_idx, seqlen_new = patch
            if patched != 0:
                patch_rows(sV_stage, mVNew, head_kv, batch_idx, seqlen_new, seqlen_k, n_block, self.tile_n,
                           self.head_dim_v, self.dtype, tidx, self.num_mma_threads)
        for i in cutlass.range(tidx, rows * self.head_dim_v, THREADS_PER_WG, unroll=1):
            sV_stage[first + i // self.head_dim_v, i % self.head_dim_v] = self.dtype(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(FwdBarrier.KV_STALE_ROWS), number_of_threads=THREADS_PER_WG)

    @cute.jit
    def skip_blocks(self, kv_state, skipped: Int32, pipeline_k: pipeline.PipelineAsync):
        """Sit out ``skipped`` K/V blocks: wait for each K and release it (a release before the
        load could complete the previous phase of the stage's "empty" barrier), and take the
        turn in the round-robin without a GEMM, so every warpgroup waits and signals the same
        number of times per tile. Their V stages are released by the caller."""
        for _ in cutlass.range(skipped, unroll=1):
            pipeline_k.consumer_wait(kv_state)
            self.scheduler_wait()
            self.scheduler_signal()
            pipeline_k.consumer_release(kv_state)
            kv_state.advance()
        return kv_state

    @cute.jit
    def fill_alibi_offsets(self, sAlibiK: cute.Tensor, tidx: Int32):
        """alibi_by_mma's B operand, once per CTA: each key's offset in the block in the slope
        terms' columns, zeros elsewhere; fenced for the WGMMAs and synced over the consumers (the
        id of EPILOGUE_SMEM_FREE, before any epilogue)."""
        col = tidx % ALIBI_MMA_COLS
        for i in cutlass.range_constexpr(self.tile_n * ALIBI_MMA_COLS // self.num_mma_threads):
            row = tidx // ALIBI_MMA_COLS + i * (self.num_mma_threads // ALIBI_MMA_COLS)
            value = Float32(0.0)
            if col < ALIBI_SLOPE_TERMS:
                value = Float32(row)
            sAlibiK[row, col] = self.dtype(value)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(FwdBarrier.EPILOGUE_SMEM_FREE), number_of_threads=self.num_mma_threads)

    @cute.jit
    def fill_alibi_slopes(self, sAlibiQ: cute.Tensor, factor: Float32, tidx: Int32, wg_idx: Int32):
        """alibi_by_mma's A operand, per tile: this warpgroup's rows hold the tile's slope /
        softmax_scale as three 16-bit terms (each the rounding of what the ones before leave) in
        columns 0-2. The warpgroup's previous Q @ K^T has completed (its tile's last wait) and the
        other warpgroups read only their own rows: fenced and synced per warpgroup (the ids of
        EPILOGUE_WG_SMEM_FREE, outside the epilogue, as split_partials uses them)."""
        first = self.dtype(factor)
        rest = factor - Float32(first)
        second = self.dtype(rest)
        third = self.dtype(rest - Float32(second))
        lane = tidx % THREADS_PER_WG
        col = lane % ALIBI_MMA_COLS
        value = Float32(0.0)
        if col == 0:
            value = Float32(first)
        if col == 1:
            value = Float32(second)
        if col == 2:
            value = Float32(third)
        for i in cutlass.range_constexpr(ROWS_PER_WG * ALIBI_MMA_COLS // THREADS_PER_WG):
            row = wg_idx * ROWS_PER_WG + lane // ALIBI_MMA_COLS + i * (THREADS_PER_WG // ALIBI_MMA_COLS)
            sAlibiQ[row, col] = self.dtype(value)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(FwdBarrier.EPILOGUE_WG_SMEM_FREE) + wg_idx, number_of_threads=THREADS_PER_WG)

    @cute.jit
    def scheduler_wait(self):
        wg = cute.arch.make_warp_uniform((cute.arch.thread_idx()[0] // THREADS_PER_WG) - 1)
        cute.arch.barrier(
            barrier_id=int(FwdBarrier.WG_SCHEDULER) + wg, number_of_threads=2 * THREADS_PER_WG
        )

    @cute.jit
    def scheduler_signal(self):
        wg = cute.arch.make_warp_uniform((cute.arch.thread_idx()[0] // THREADS_PER_WG) - 1)
        nxt = wg + 1
        if nxt == self.num_consumer_wg:
            nxt = Int32(0)
        cute.arch.barrier_arrive(
            barrier_id=int(FwdBarrier.WG_SCHEDULER) + nxt, number_of_threads=2 * THREADS_PER_WG
        )

    @cute.jit
    def is_store_warp(self):
        """The warp that issues TMA stores of O: the first of each consumer warpgroup with a
        per-warpgroup epilogue, else the first consumer warp."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if const_expr(self.wg_epilogue):
            return warp % 4 == 0 and warp >= 4
        return warp == STORE_WARP

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        tma_O: cute.Tensor,
        mLSE: cute.Tensor,
        sO: cute.Tensor,
        sO_parts: cute.Tensor,
        sLSE: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        batch_idx: Int32,
        seq: SeqlenInfo,
        rows: TileRows,
        o_free_mbar: cute.Pointer,
        tile_stamp=None,
    ):
        stamp = lambda point: tile_stamp(point) if const_expr(self.stamps) else None  # noqa: E731
        if const_expr(self.epilogue_addresses_per_tile):
            # Every per-thread address below derives from tidx and is the same for every tile;
            # left alone, LLVM computes them once before the tile loop and holds them across the
            # K/V loop (heuristics.FwdConfig.epilogue_addresses_per_tile). An opaque per-tile
            # zero keeps them here.
            tidx = tidx + loop_bound_zero(rows.first_row)
        is_store_warp = self.is_store_warp()
        # Who synchronises and stores which rows: each warpgroup its own 64 rows (from its own
        # part of sO), or all consumers the whole tile.
        if const_expr(self.wg_epilogue):
            wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
            smem_free_id = int(FwdBarrier.EPILOGUE_WG_SMEM_FREE) + wg
            o_ready_id = int(FwdBarrier.EPILOGUE_WG_O_READY) + wg
            group_threads = THREADS_PER_WG
            first_row = wg * ROWS_PER_WG
            sO_store = sO_parts[None, None, wg]
        else:
            smem_free_id = int(FwdBarrier.EPILOGUE_SMEM_FREE)
            o_ready_id = int(FwdBarrier.EPILOGUE_O_READY)
            group_threads = self.num_mma_threads
            first_row = Int32(0)
            sO_store = sO_parts
        store_rows = cute.size(sO_store, mode=[0])
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        stamp(6)
        staged = True
        if const_expr(self.few_rows_from_registers):
            staged = not self.few_live_rows(rows, seq)
            if not staged:
                self.store_from_registers(rO, lse, tidx, tiled_mma_pv, mO, mLSE, batch_idx, seq, rows)
        if staged:
            # The previous TMA store from these rows of sO must have read them (the storing warp
            # waits for it), and when sO aliases sV every consumer must be past its last P @ V.
            if is_store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=smem_free_id, number_of_threads=group_threads)
            stamp(7)
            smem_copy_O = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
                tiled_mma_pv,
            ).get_slice(tidx)
            # sO's address math is the same for every tile; left alone, LLVM computes it once before
            # the tile loop and the ~16 swizzled stmatrix addresses stay live across the K/V loop
            # (spilled in the 240-register hd192/hd256 kernels). An opaque per-tile zero keeps it here.
            sO_here = cute.make_tensor(sO.iterator + cute.assume(loop_bound_zero(rows.first_row), divby=512), sO.layout)
            cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO_here))
            stamp(8)

            # One TMA store when the rows all belong to this tile's head and sequence; row by row
            # otherwise (pack-GQA, rows above a shifted sequence's start, or rows past a packed
            # sequence's end, where a TMA store would overwrite the next sequence's rows). Rows
            # entirely above the start are not stored at all.
            start = rows.row(first_row)  # sequence row of the first stored row
            whole = rows.pack_log2 == 0 and start >= 0
            if const_expr(self.is_varlen):
                whole = whole and start + store_rows <= seq.seqlen_q

            # LSE: the thread holding column 0 of a row stores it. These rows' values are contiguous
            # in mLSE: with lse_bulk_store, when the rows all lie in the sequence and start 16 bytes
            # aligned, those threads put them in sLSE and the storing warp copies them out in one
            # bulk copy beside O's store, instead of each thread storing its rows itself.
            tOcO = self.o_coords(tiled_mma_pv, tidx)
            if const_expr(self.lse_bulk_store):
                if const_expr(self.is_varlen):
                    lse_first = mLSE.iterator + cute.crd2idx((seq.offset_q + start, rows.head_idx, 0), mLSE.layout)
                else:
                    lse_first = mLSE.iterator + cute.crd2idx((start, rows.head_idx, batch_idx), mLSE.layout)
                lse_bulk = whole and start + store_rows <= seq.seqlen_q and (lse_first.toint() & 15) == 0
                if tOcO[0][1] == 0:
                    if lse_bulk:
                        for r in cutlass.range_constexpr(cute.size(lse)):
                            sLSE[tOcO[r, 0][0]] = lse[r]
                    else:
                        self.store_lse_rows(lse, tOcO, mLSE, batch_idx, seq, rows)
            else:
                if tOcO[0][1] == 0:
                    self.store_lse_rows(lse, tOcO, mLSE, batch_idx, seq, rows)
            stamp(9)

            if start + store_rows > 0:
                if whole:
                    # Make the stmatrix writes visible to the TMA engine, then one warp stores the rows;
                    # it waits for the store's reads only before they are next written (or at exit).
                    cute.arch.fence_view_async_shared()
                    ready = group_threads + cute.arch.WARP_SIZE
                    cute.arch.barrier_arrive(barrier_id=o_ready_id, number_of_threads=ready)
                    if is_store_warp:
                        cute.arch.barrier(barrier_id=o_ready_id, number_of_threads=ready)
                        gO = cute.local_tile(
                            cute.domain_offset((start, 0),
                                               self.tile_view(tma_O, rows.head_idx, batch_idx, seq.offset_q)),
                            (store_rows, self.head_dim_v), (0, 0),
                        )
                        tOsO, tOgO = cpasync.tma_partition(
                            tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO_store, 0, 2),
                            cute.group_modes(gO, 0, 2),
                        )
                        cute.copy(tma_atom_O, tOsO, tOgO)
                        if const_expr(self.lse_bulk_store):
                            if lse_bulk and cute.arch.lane_idx() == 0:
                                bulk_store_s2g(lse_first.toint(), (sLSE.iterator + first_row).toint(), store_rows * 4)
                        cute.arch.cp_async_bulk_commit_group()
                else:
                    cute.arch.barrier(barrier_id=o_ready_id, number_of_threads=group_threads)
                    self.store_rows(sO_store, first_row, group_threads, tidx % group_threads, mO, batch_idx, seq, rows)
            stamp(10)
            if const_expr(self.o_in_v):
                # V's buffer goes back to the producer (release_o_buffer, next tile) once O has been
                # read out of it: by the TMA store, whose issuing warp waits for its reads then, or
                # here by every thread's row copies. The proxy fence orders those generic accesses
                # before the producer's TMA writes.
                if not whole or start + store_rows <= 0:
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=o_ready_id, number_of_threads=group_threads)

    def few_live_rows(self, rows: TileRows, seq: SeqlenInfo):
        """Does at most half of each packed head's block of tile rows hold a query of the
        sequence (FwdConfig.few_rows_from_registers: a decoding step's tile holds one in 16)?"""
        block = rows.block_rows
        live = cutlass.min(rows.first_row + block, seq.seqlen_q) - cutlass.max(rows.first_row, 0)
        return live * 2 <= block

    @cute.jit
    def store_from_registers(self, rO: cute.Tensor, lse: cute.Tensor, tidx: Int32, tiled_mma_pv: cute.TiledMma,
                             mO: cute.Tensor, mLSE: cute.Tensor, batch_idx: Int32, seq: SeqlenInfo, rows: TileRows):
        """This thread's rows of O (and their LSE) that hold a query, straight from its
        accumulator fragment (``rO``, in the output dtype). A row's columns 2j and 2j + 1 sit
        side by side in the fragment and in memory: one 4-byte store each, a quad of lanes
        covering 16 contiguous bytes. No shared memory and no barrier: where a tile's rows are
        mostly padding (a decoding step), staging all of them cost two barriers and a full-tile
        round trip."""
        o = rows_cols_view(rO)
        tOcO = self.o_coords(tiled_mma_pv, tidx)
        if tOcO[0][1] == 0:
            self.store_lse_rows(lse, tOcO, mLSE, batch_idx, seq, rows)
        pair_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                        num_bits_per_copy=2 * self.dtype.width)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            tile_row = tOcO[r, 0][0]
            row = rows.row(tile_row)
            if row >= 0 and row < seq.seqlen_q:
                gRow = self.tile_view(mO, rows.head(tile_row), batch_idx, seq.offset_q)[row, None]
                for c in cutlass.range_constexpr(0, cute.size(o, mode=[1]), 2):
                    pair = cute.make_rmem_tensor((2,), self.dtype)
                    pair[0] = o[r, c]
                    pair[1] = o[r, c + 1]
                    cute.copy(pair_copy, pair, cute.local_tile(gRow, (2,), (tOcO[r, c][1] // 2,)))

    @cute.jit
    def store_lse_rows(self, lse: cute.Tensor, tOcO: cute.Tensor, mLSE: cute.Tensor, batch_idx: Int32,
                       seq: SeqlenInfo, rows: TileRows):
        """The calling thread's LSE values (its accumulator rows, ``tOcO``) to global memory, one
        store per row of the sequence."""
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = rows.row(tOcO[r, 0][0])
            if row >= 0 and row < seq.seqlen_q:
                self.store_lse_row(lse[r], tOcO[r, 0][0], mLSE, batch_idx, seq, rows)

    @cute.jit
    def store_lse_row(self, lse: Float32, tile_row: Int32, mLSE: cute.Tensor, batch_idx: Int32, seq: SeqlenInfo,
                      rows: TileRows):
        """The LSE of tile row ``tile_row`` (a row of the sequence: the caller checks)."""
        row = rows.row(tile_row)
        if const_expr(self.is_varlen):
            mLSE[seq.offset_q + row, rows.head(tile_row), 0] = lse
        else:
            mLSE[row, rows.head(tile_row), batch_idx] = lse

    @cute.jit
    def release_o_buffer(self, o_free_mbar: cute.Pointer):
        """O aliasing V: the storing warp lets the producer load V again once its last TMA store
        of O has read shared memory (row-copied tiles were read before the epilogue's barrier)."""
        if self.is_store_warp():
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive(o_free_mbar)

    @cute.jit
    def store_rows(self, sO_rows: cute.Tensor, first_row: Int32, num_threads: cutlass.Constexpr[int], tidx: Int32,
                   mO: cute.Tensor, batch_idx: Int32, seq: SeqlenInfo, rows: TileRows):
        """Row-predicated copy of rows first_row.. of the O tile (``sO_rows``, in shared memory)
        to global memory in 16-byte pieces, by ``num_threads`` threads.

        A row is head_dim_v / 8 pieces (12 for 96): the copy uses as many threads as fill a
        power-of-two number of rows (which divides the rows) and leaves the rest idle. Rows go
        where ``rows`` maps them; rows outside [0, seqlen_q) are skipped.
        """
        elems = 128 // self.dtype.width
        threads_per_row = self.head_dim_v // elems
        rows_per_pass = 1 << ((num_threads // threads_per_row).bit_length() - 1)
        num_rows = cute.size(sO_rows, mode=[0])
        copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_ordered_layout((rows_per_pass, threads_per_row), order=(1, 0)),
            cute.make_layout((1, elems)),
        )
        if tidx < rows_per_pass * threads_per_row:
            thr_copy = copy.get_slice(tidx)
            tOsO = thr_copy.partition_S(sO_rows)
            tOcO = thr_copy.partition_S(cute.make_identity_tensor((num_rows, self.head_dim_v)))
            tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
            cute.autovec_copy(tOsO, tOrO)
            for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
                local_row = tOcO[0, m, 0][0]
                row = rows.row(first_row + local_row)
                # A (num_rows, dv) window of the row's head placed so that this local row lands
                # on its sequence row (its start may lie outside the sequence: only that row is written).
                gO = cute.local_tile(
                    cute.domain_offset((row - local_row, 0),
                                       self.tile_view(mO, rows.head(first_row + local_row), batch_idx, seq.offset_q)),
                    (num_rows, self.head_dim_v), (0, 0),
                )
                tOgO = thr_copy.partition_D(gO)
                if row >= 0 and row < seq.seqlen_q:
                    cute.autovec_copy(tOrO[None, m, None], tOgO[None, m, None])
