"""FlashAttention backward for Hopper (sm_90a), warp-specialised, TMA + WGMMA.

One CTA per (K/V block, K/V head, batch): it holds a tile_n-row block of K and V in shared
memory, walks the query blocks that see any of its keys (for every query head of its GQA group,
so dK/dV of a K/V head are summed in registers and stored once, by one CTA) and accumulates
dK and dV in registers. dQ is accumulated in fp32 in global memory by TMA reduce-adds: of a
shared-memory staging buffer (``dq_store`` "tma") or of the Q/dO stage that the query block is
done with ("stage": hd256, where a staging buffer does not fit beside the rings).

Roles (1 + 2 warpgroups: 384 threads):
  * warpgroup 0, warp 0: producer. Loads K and V once, then for each query block a Q tile with
    its row statistics (LSE in log2 units) and a dO tile with its row sums dPsum = rowsum(dO * O),
    into ``num_stages``-deep rings (one mbarrier pipeline for Q + LSE, one for dO + dPsum).
  * warpgroup 0, warp 1: dQ writer. For each query block, once the consumers have put their
    dQ parts in shared memory, adds them into the fp32 dQ accumulator with one TMA reduce-add
    each, and hands the buffer back ("tma") or the stage to the producer ("stage") when the
    copy has read it. With deterministic turns in the "keys_roles" kernels of dense batches,
    warp 2 may write too: the two take the blocks alternately (write_dq's ``pair``).
  * warpgroups 1, 2: consumers. Keys are the MMA rows: S^T = K @ Q^T and dP^T = V @ dO^T, so
    P^T and dS^T come out of the accumulators already laid out as the A operands of
    dV += P^T @ dO and dK += dS^T @ Q (from registers: 64 FLOP per shared-memory byte); dS^T
    goes to shared memory (transposed, as dS) for dQ = dS @ K. Two ways to share the work, by
    head dim:
    "keys" (hd <= 128: dK/dV of 64 keys fit one warpgroup's registers): each warpgroup owns 64
      keys and computes all of the above for them; where registers allow (``k_in_registers``)
      its K rows are S^T's A operand from registers, so that GEMM reads only Q^T from shared
      memory.
    "keys_roles" (hd192, hd256: dK and dV of 64 keys would take 192-256 registers): both own
      the same 64 keys, one per side of the chain rule. Warpgroup 1 computes S^T, P^T and dV
      (dV's registers), warpgroup 2 dP^T, dS^T (P^T read back, fp32, from shared memory) and dK
      (dK's); each half of dQ's head dims.
    Both: P = exp2(S * scale_log2 - LSE_log2), dS = P * (dP - dPsum) (times the tanh
    derivative with softcap); the dQ GEMM split between the warpgroups by ``dq_split``, or
    transposed (``dq_transposed``: dQ^T = K^T @ dS^T, each warpgroup half of the head dims, the
    queries as the GEMM's N), which lets a query block be 80 rows (hd128's dense batches). After
    the last query block dK (scaled) and dV go out through shared memory by TMA stores (row by
    row where a packed sequence ends inside the block).

The accumulator is not zeroed beforehand (``store_first``): the first K/V block to reach a query
block stores its dQ parts there (TMA store), and the others add theirs once that store has landed.
With packed sequences a sequence's last query block, when partial, is only added into (its rows
zeroed by the preprocess): a store of the whole block would overwrite the next sequence's rows.
In deterministic mode the first is the block whose turn is 0; otherwise the writers claim the
block in its counter (``mdQsemaphore``: claims in the high 16 bits, landed first stores in the low
ones), and a writer that is not first waits for the first one's store.
Without a mask every K/V block visits every query block, and with ``rotate`` (a period, 0: none)
CTA n starts at query block n * blocks / n_blocks and wraps around (dq_order: in chunks of
``rotate`` blocks): the K/V blocks of a head then work on different query blocks at any time
(rather than all on the same one, one after the other), so a block's first store has long
landed when the next K/V block arrives.

Deterministic mode (a run-time flag): the additions into a query block's dQ rows happen in
K/V-block order. Each (batch, head, query block) has a counter in ``mdQsemaphore`` (zero at
launch); the CTA of K/V block n (its dQ writer) waits until the counter reaches its turn
(dq_turn), adds, waits for its addition to land, and increments it. Without a mask and with
``rotate``, the turns are each query block's arrival order under the rotation (dq_order: no
block waits for one behind it; the host keeps a rotation chunk no larger than the GPU holds,
so the later blocks a CTA may wait for are resident). Otherwise the turns follow the launch
order (the grid's x), so a CTA never waits for one launched after it and the chain cannot
deadlock: ascending
without a mask (every block's range starts at query block 0), descending with a causal or
local mask, whose blocks then launch from the last one down (a block's first query block then
has no earlier turn: ascending, each CTA would sit idle until its lower neighbours reached
its first query block). dK and dV are always deterministic.

Every CTA ends by counting itself in its sequence's (dense: batch's) ``mSeqDone`` (count_done:
after its dQ additions have landed, with a release), whether it had keys or not; the dQ
conversion (sm90/bwd_postprocess.py) waits per sequence for num_n_blocks * heads_kv counts
instead of for the whole grid, so it converts the sequences that finished on the SMs the grid's
ragged end leaves idle.

Block-sparse (a FlexAttention BlockMask, ``block_sparse``): per query head, a K/V block visits
the query blocks its row of the host's tables lists (block_info.SparseBlocks: partial ones
first, each masked by its bitmask slot, transposed: per key, bits over queries; then full ones),
dQ is zeroed beforehand and added into (no first stores, no rotation, no deterministic turns).

Masking: a query block crossing the causal diagonal or a local window's edge is masked per
element; with packed sequences also every query block of a K/V block reaching past the
sequence's keys (the next sequence's keys are real data). The next sequence's rows in a partial
last query block need no mask: their statistics are the sequence's padding (LSE = +inf), so
their probabilities are 0. Dense rows past seqlen_q / keys past seqlen_k need no mask: TMA loads them as zeros and
the preprocess pads the statistics with LSE = +inf, so their probabilities are 0 (rows) or they
meet zero operands (keys), and TMA stores clip them.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4_kernels.block_info import BlockInfo, SparseBlocks
from fa4_kernels.dq_order import rotated_turn, rotation_start
from fa4_kernels.hopper_mma import new_accumulator, rows_cols_view, store_as_operand_a, transpose_smem_view, wgmma
from fa4_kernels.mask import AttentionMask
from fa4_kernels.named_barrier import BwdBarrier
from fa4_kernels.ptx import (SPIN_LIMIT, barrier_sync_unaligned, ctaid_z_here, fence_proxy_async_global,
                             loop_bound_zero, nanosleep, select_f32, trap)
from fa4_kernels.score_mod import ScoreBias
from fa4_kernels.seqlen_info import SeqlenInfo
from fa4_kernels.sm90.common import LOG2_E, ROWS_PER_WG, THREADS_PER_WG, make_smem_layout
from fa4_kernels.tile_scheduler import StaticPersistentScheduler

NUM_CONSUMER_WG = 2
PRODUCER_REGS = 24
CONSUMER_REGS = 240
DQ_WRITER_WARP = 1
STORE_WARP = 4  # first consumer warp: issues the TMA stores of dK and dV
LAYOUTS = ("keys", "keys_roles")
# How the consumer warpgroups share the dQ = dS @ K GEMM of a (tile_m, head_dim) block:
# "rows" 64 rows each (tile_m 128), "cols" half the head dims each, "single" warpgroup 0 alone.
DQ_SPLITS = ("rows", "cols", "single")
DQ_STORES = ("tma", "stage")
# A writer's claim on a query block's dQ (store_first): added to its counter, whose low half
# counts the first stores that have landed (one per block).
DQ_CLAIM = 1 << 16
# Deterministic turns: the dQ writer's back-off (ns) between polls of its turn's counter, by turn
# order: launch order, rotated. Measured (H100, fwd+bwd, session 50, docs/perf_notes.md): launch-
# order chains 256 -> 1024 ns hd192 16k +5.5%, causal 4k-16k +1.7% (512 ns: no gain; 32 ns: 1-7%
# slower); rotated turns, one hand-over per step on the critical path, lost 3-9% with 1024.
TURN_POLL_NS = {False: 1024, True: 256}


def stats_offset(seq: SeqlenInfo, batch_idx, stats_block: int, is_varlen: bool):
    """The statistics layout's sequence start (preprocess and main kernel): see
    FlashAttentionBackwardSm90.stats_offset."""
    if const_expr(is_varlen):
        return (seq.offset_q + batch_idx * stats_block) // stats_block * stats_block
    return Int32(0)


class FlashAttentionBackwardSm90:
    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: int,
        is_local: bool,
        has_softcap: bool,
        tile_m: int,
        tile_n: int,
        num_stages: int,
        dq_split: str,
        stats_block: int,
        is_varlen: bool = False,
        layout: str = "keys",
        dq_store: str = "tma",
        block_sparse: bool = False,
        score_mod: str = "none",
        grad_address_per_tile: bool = False,
        grad_window: int = 0,
        bias_waves: int = 4,
        dq_stage_exchange: bool = False,
        k_in_registers: bool = False,
        cluster_n: int = 1,
        dq_transposed: bool = False,
    ):
        # Causal calls run the window kernel (is_local): their window's left side is unbounded
        # (catalog.BWD_MASKS).
        assert not (block_sparse and (is_local or is_varlen)), "block-sparse tables carry the mask"
        assert layout in LAYOUTS and dq_split in DQ_SPLITS and dq_store in DQ_STORES
        if layout == "keys":
            assert tile_n == ROWS_PER_WG * NUM_CONSUMER_WG, "each consumer warpgroup owns 64 keys"
            assert (tile_m == 128) == (dq_split == "rows") and (tile_m in (64, 128) or dq_transposed)
        else:
            # 64 keys, both warpgroups; dQ by halves of the head dims, one per warpgroup, which
            # balances the two roles (and their barriers: see consume_roles).
            assert tile_n == ROWS_PER_WG and tile_m == ROWS_PER_WG and dq_split == "cols"
            assert head_dim % 64 == 0, "dQ halves: multiples of K's 32-column swizzle atom"
        assert dq_store == "tma" or dq_split != "rows"
        # "stage": each warpgroup's dQ part (64 x head_dim / 2, fp32) goes out through the Q/dO
        # stage it has finished with, which must hold it (hd256: 32 KB each).
        # Its DQ_FULL ids are per part and stage: two stages (named_barrier.BwdBarrier).
        assert dq_store != "stage" or (layout == "keys_roles" and dq_split == "cols" and num_stages == 2
                                       and min(head_dim, head_dim_v) * 2 >= head_dim // 2 * 4)
        assert head_dim % 16 == 0 and head_dim_v % 16 == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.is_local = is_local
        self.has_softcap = has_softcap
        self.is_varlen = is_varlen
        self.block_sparse = block_sparse
        # A built-in score_mod's bias, and its parameters' gradient (score_mod.ScoreBias).
        self.score_mod = score_mod
        assert score_mod == "none" or (block_sparse and not has_softcap), "score_mods: block-sparse, no softcap"
        self.grad_address_per_tile = grad_address_per_tile  # heuristics.BwdConfig
        self.grad_window = grad_window  # heuristics.BwdConfig: floats per consumer warp
        assert (grad_window > 0) == (score_mod == "relbias"), "relbias's gradient sums in shared windows"
        self.bias_waves = bias_waves  # heuristics.BwdConfig
        assert not dq_stage_exchange or dq_store == "tma"
        self.dq_stage_exchange = dq_stage_exchange  # heuristics.BwdConfig
        # S^T = K @ Q^T with K's A operand in registers, loaded once per CTA (heuristics.BwdConfig).
        assert not k_in_registers or layout == "keys"
        self.k_in_registers = k_in_registers
        # CTAs per cluster along the K/V blocks (heuristics.BwdConfig.cluster_n), sharing each
        # Q/dO tile and its statistics by TMA multicast: the cluster's CTAs walk the same query
        # blocks in step (no rotation, no launch groups, no deterministic turns: the host never
        # asks for those, and the kernel ignores rotate and launch_group). Dense batches only.
        assert cluster_n in (1, 2)
        assert cluster_n == 1 or not (is_varlen or block_sparse)
        self.cluster_n = cluster_n
        # dQ^T = K^T @ dS^T, each warpgroup half of the head dims (heuristics.BwdConfig): the
        # queries are the GEMM's N, so a query block need not be a multiple of 64 rows. Its parts
        # are (tile_m, dq_cols) tiles, stored transposed from the accumulator.
        assert not dq_transposed or (layout == "keys" and dq_split == "cols" and dq_store == "tma"
                                     and not dq_stage_exchange and tile_m % 16 == 0 and cluster_n == 1)
        self.dq_transposed = dq_transposed
        self.dq_rows = tile_m if dq_transposed else ROWS_PER_WG
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.dq_split = dq_split
        self.layout = layout
        self.dq_store = dq_store
        # The statistics' padding unit (heuristics.STATS_BLOCK_ROWS), a multiple of tile_m where
        # packed sequences start on it (stats_offset). Dense statistics need not be: TMA fills the
        # rows of a query block past the padded rows with zeros, and those rows' Q and dO are zeros
        # too (past seqlen_q), so their P * dO and dS are 0.
        assert stats_block % tile_m == 0 or not is_varlen
        # Floats per stage of the statistics' buffers: each stage is a TMA destination (128-byte
        # aligned).
        self.stats_stage = -(-tile_m // 32) * 32
        self.stats_block = stats_block
        self.num_mma_threads = THREADS_PER_WG * NUM_CONSUMER_WG
        self.num_threads = THREADS_PER_WG + self.num_mma_threads
        # dQ parts: one per warpgroup that computes dQ, each (dq_rows, dq_cols).
        self.dq_parts = 1 if dq_split == "single" else 2
        self.dq_cols = head_dim // 2 if dq_split == "cols" else head_dim
        # The query coordinate of the (keys, queries) score tile: its row statistics' index.
        self.query_mode = 1
        # dS tiles in shared memory: one per Q stage, but "keys_roles" needs one: its dS of a
        # query block is written after the P_READY barrier, which warpgroup 1 reaches only once
        # both dQ GEMMs of the block before (the readers) have completed.
        self.ds_stages = 1 if layout == "keys_roles" else num_stages

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        """The five GEMMs' tiled MMAs: (S^T, dP^T), dK, dV, dQ. S^T = K @ Q^T and dP^T = V @ dO^T,
        dV = P^T @ dO and dK = dS^T @ Q (A from registers, B the MN-major views of dO and Q):
        keys split over the warpgroups ("keys") or one warpgroup's ("keys_roles"). dQ = dS @ K
        split by dq_split."""
        if const_expr(self.layout == "keys_roles"):
            # One warpgroup's tiled MMAs: each role runs its own GEMMs on the same 64 keys.
            sdp = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS_PER_WG, self.tile_m),
            )
            dk, dv = [
                sm90_utils.make_trivial_tiled_mma(
                    self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                    atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS_PER_WG, dim), a_source=warpgroup.OperandSource.RMEM,
                )
                for dim in (self.head_dim, self.head_dim_v)
            ]
        else:
            sdp = self.score_mma(warpgroup.OperandSource.SMEM)
            dk, dv = [
                sm90_utils.make_trivial_tiled_mma(
                    self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                    atom_layout_mnk=(NUM_CONSUMER_WG, 1, 1), tiler_mn=(ROWS_PER_WG, dim),
                    a_source=warpgroup.OperandSource.RMEM,
                )
                for dim in (self.head_dim, self.head_dim_v)
            ]
        if const_expr(self.dq_transposed):
            # dQ^T = K^T @ dS^T: A the MN-major view of K (64 head dims per warpgroup), B = dS.
            return sdp, dk, dv, sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K, Float32,
                atom_layout_mnk=(NUM_CONSUMER_WG, 1, 1), tiler_mn=(ROWS_PER_WG, self.tile_m),
            )
        dq_atoms = {"rows": (2, 1, 1), "cols": (1, 2, 1), "single": (1, 1, 1)}[self.dq_split]
        dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=dq_atoms, tiler_mn=(ROWS_PER_WG, self.dq_cols),
        )
        return sdp, dk, dv, dq

    def score_mma(self, a_source) -> cute.TiledMma:
        """"keys": the S^T / dP^T tiled MMA (K or V @ Q^T or dO^T, 64 keys per warpgroup), its A
        operand from shared memory or (k_in_registers) registers."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(NUM_CONSUMER_WG, 1, 1), tiler_mn=(ROWS_PER_WG, self.tile_m), a_source=a_source,
        )

    def p_buffer_elems(self) -> int:
        """16-bit elements of the P buffer: "keys_roles"' fp32 P^T tile; a token one for "keys"."""
        return 2 * self.tile_m * self.tile_n if self.layout == "keys_roles" else 64

    def p_exchange_layout(self) -> cute.Layout:
        """"keys_roles"' P^T tile, fp32, as (thread of a warpgroup, its accumulator element):
        element pairs adjacent (8-byte accesses), consecutive threads' pairs adjacent, so a warp
        stores and loads 256 contiguous bytes at a time (no bank conflicts)."""
        elems = self.tile_m * self.tile_n // THREADS_PER_WG
        return cute.make_layout((THREADS_PER_WG, (2, elems // 2)), stride=(2, (1, 2 * THREADS_PER_WG)))

    def dq_buffer_elems(self, sdQ_layout) -> int:
        """Elements of the dQ staging buffer: the parts for "tma"; a token one for "stage"."""
        return cute.cosize(sdQ_layout) if self.dq_store == "tma" else 64

    def dq_tile_layout(self, parts_layout):
        """The (tile_m, head_dim) view of the dQ parts buffer (dq_rows, dq_cols, parts)."""
        if const_expr(self.dq_split == "rows"):
            return cute.group_modes(cute.select(parts_layout, mode=[0, 2, 1]), 0, 2)
        if const_expr(self.dq_split == "cols"):
            return cute.group_modes(parts_layout, 1, 3)
        return cute.select(parts_layout, mode=[0, 1])

    def tile_view(self, t: cute.Tensor, head, batch_idx, offset):
        """(seqlen, dim) slice of a (seqlen, dim, head, batch) tensor for one sequence."""
        if const_expr(self.is_varlen):
            return cute.domain_offset((offset, 0), t[None, None, head, 0])
        return t[None, None, head, batch_idx]

    def stats_lines(self, t: cute.Tensor) -> cute.Tensor:
        """An S^T-shaped accumulator (or its coordinates) as (elements, lines), each line the
        elements of one query (one LSE, one dPsum): the columns of S^T."""
        return rows_cols_view(t)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim_v)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim_v)
        mLSE: cute.Tensor,  # (batch, heads_q, padded rows) fp32: LSE * log2(e), +inf past the rows
        mdPsum: cute.Tensor,  # (batch, heads_q, padded rows) fp32: rowsum(dO * O) - dLSE
        mdQaccum: cute.Tensor,  # (batch, seqlen_q, heads_q, head_dim) fp32, zero at launch
        mdK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mdV: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim_v)
        mCuSeqlensQ: cute.Tensor,  # varlen: (batch + 1,) int32
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: cute.Tensor,  # varlen: (batch,) keys used per sequence when has_seqused_k
        # (batch, heads_q, query blocks) int32, zero at launch: deterministic turns, store_first's claims
        mdQsemaphore: cute.Tensor,
        # (batch,) int32, zero at launch (the preprocess zeroes it): K/V blocks done per sequence
        # (count_done), which the dQ conversion waits for (sm90/bwd_postprocess.py)
        mSeqDone: cute.Tensor,
        mSparseCounts: cute.Tensor,  # block-sparse: (batch, heads_q, n_blocks, 4) int32 (block_info.SparseBlocks)
        mSparseBlocks: cute.Tensor,  # block-sparse: (batch, heads_q, n_blocks, width) int32 query blocks
        mSparseBits: cute.Tensor,  # block-sparse: flat int32 transposed bitmask slots (AttentionMask.load_bits)
        mScoreParams: cute.Tensor,  # score_mod variants: (heads_q, width) fp32, or "bias"'s 4-D tensor (score_mod.py)
        mScoreGrad: cute.Tensor,  # their gradient, fp32, zero at launch: params' shape, or 0 rows for none
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        num_n_blocks: Int32,  # K/V blocks of the longest sequence (the grid's x)
        has_seqused_k: Int32,
        # 0: dQ added in any order; 1: in deterministic turns; 2: the same, "keys_roles" variants
        # with two dQ writer warps (write_dq's pair; the others take 2 as 1)
        deterministic: Int32,
        rotate: Int32,  # >0: without a mask, the rotation's period (dq_order; 0: none; see module doc)
        store_first: Int32,  # 1: mdQaccum is not zeroed; the first K/V block stores (module doc)
        # > 0: windows of dense batches, not deterministic: the CTAs launch in groups of this many
        # (batch, head) pairs (see kernel; fa4_bwd_launch_group in csrc_shims/fa4_rules.c)
        launch_group: Int32,
        stream: cuda.CUstream,
    ):
        # Sequence-major views: (seqlen, dim, head, batch).
        mQ, mK, mV, mdO, mdQaccum, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mdO, mdQaccum, mdK, mdV)
        ]
        mLSE, mdPsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mLSE, mdPsum)]

        tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq = self._tiled_mmas()
        sQ_layout = make_smem_layout(self.dtype, self.tile_m, self.head_dim, self.num_stages)
        sdO_layout = make_smem_layout(self.dtype, self.tile_m, self.head_dim_v, self.num_stages)
        # dQ's halves of K's head dims (the B operand of dS @ K) start on K's swizzle atoms.
        sK_layout = make_smem_layout(self.dtype, self.tile_n, self.head_dim, atom_cols=self.dq_cols)
        sV_layout = make_smem_layout(self.dtype, self.tile_n, self.head_dim_v)
        sdS_layout = make_smem_layout(self.dtype, self.tile_m, self.tile_n, self.ds_stages)
        sdQ_layout = make_smem_layout(Float32, self.dq_rows, self.dq_cols, self.dq_parts)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        q_load = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_n > 1) else tma_load
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            q_load, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, self.head_dim), self.cluster_n)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            q_load, mdO, cute.select(sdO_layout, mode=[0, 1]), (self.tile_m, self.head_dim_v), self.cluster_n)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, mK, sK_layout, (self.tile_n, self.head_dim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, mV, sV_layout, (self.tile_n, self.head_dim_v))
        tma_store = cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(tma_store, mdK, sK_layout, (self.tile_n, self.head_dim))
        tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(tma_store, mdV, sV_layout, (self.tile_n, self.head_dim_v))
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum, cute.select(sdQ_layout, mode=[0, 1]),
            (self.dq_rows, self.dq_cols))
        # The first store into a query block's rows (store_first): the same tiles, overwritten.
        tma_atom_dQ_store, _ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdQaccum, cute.select(sdQ_layout, mode=[0, 1]),
            (self.dq_rows, self.dq_cols))
        # The row statistics: one tile_m-row box per query block (the rows are padded, see
        # stats_offset, so boxes never cross a sequence's padding into another's rows).
        stats_box = cute.make_layout(self.tile_m)
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(q_load, mLSE, stats_box, (self.tile_m,), self.cluster_n)
        tma_atom_dPsum, tma_dPsum = cpasync.make_tiled_tma_atom(q_load, mdPsum, stats_box, (self.tile_m,),
                                                                self.cluster_n)
        self.tx_bytes_Q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1])) + self.tile_m * 4
        self.tx_bytes_dO = cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1])) + self.tile_m * 4
        self.tx_bytes_KV = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)
        p_elems = self.p_buffer_elems()
        dq_elems = self.dq_buffer_elems(sdQ_layout)
        grad_window_elems = max(1, self.num_mma_threads // cute.arch.WARP_SIZE * self.grad_window)

        @cute.struct
        class SharedStorage:
            mbar_KV: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_Q: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_dO: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.stats_stage * self.num_stages], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, self.stats_stage * self.num_stages], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, dq_elems], 1024]
            # After the swizzled buffers: "keys"' token P buffer takes no 1024-byte alignment gap
            # (heuristics.BwdConfig.smem_bytes).
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 128]
            sGradWindows: cute.struct.Align[cute.struct.MemRange[Float32, grad_window_elems], 16]

        if const_expr(self.has_softcap):
            # Scores s become softcap * tanh(s * scale / softcap); the exponent then needs only
            # the change of base, as in the forward.
            score_scale = softmax_scale / softcap
            scale_log2 = Float32(LOG2_E)
        else:
            score_scale = Float32(1.0)
            scale_log2 = softmax_scale * LOG2_E

        batches = cute.size(mQ.shape[3])
        if const_expr(self.is_varlen):
            batches = cute.size(mCuSeqlensQ.shape[0]) - 1
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_dPsum, tma_dQ, mdQaccum, mdK, mdV, tma_dK, tma_dV,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, has_seqused_k, mdQsemaphore, mSeqDone, num_n_blocks, deterministic,
            rotate, store_first, launch_group, mSparseCounts, mSparseBlocks, mSparseBits, mScoreParams, mScoreGrad,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum, tma_atom_dQ,
            tma_atom_dQ_store, tma_atom_dK, tma_atom_dV,
            scale_log2, score_scale, softcap, softmax_scale, window_left, window_right,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout,
            tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, SharedStorage,
        ).launch(
            grid=((num_n_blocks + self.cluster_n - 1) // self.cluster_n * self.cluster_n, cute.size(mK.shape[2]),
                  batches),
            block=[self.num_threads, 1, 1],
            cluster=[self.cluster_n, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=True,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQ: cute.Tensor,  # TMA view of the fp32 accumulator
        mdQaccum: cute.Tensor,  # the accumulator itself
        mdK: cute.Tensor,  # plain tensors: row-by-row stores
        mdV: cute.Tensor,
        tma_dK: cute.Tensor,  # their TMA views: whole-block stores
        tma_dV: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        has_seqused_k: Int32,
        mdQsemaphore: cute.Tensor,
        mSeqDone: cute.Tensor,
        num_n_blocks: Int32,
        deterministic: Int32,
        rotate: Int32,
        store_first: Int32,
        launch_group: Int32,
        mSparseCounts: cute.Tensor,
        mSparseBlocks: cute.Tensor,
        mSparseBits: cute.Tensor,
        mScoreParams: cute.Tensor,
        mScoreGrad: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_dO: cute.CopyAtom,
        tma_atom_LSE: cute.CopyAtom,
        tma_atom_dPsum: cute.CopyAtom,
        tma_atom_dQ: cute.CopyAtom,
        tma_atom_dQ_store: cute.CopyAtom,
        tma_atom_dK: cute.CopyAtom,
        tma_atom_dV: cute.CopyAtom,
        scale_log2: Float32,
        score_scale: Float32,
        softcap: Float32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        # Programmatic dependent launch (as the preprocess and the postprocess): the CTAs take SMs
        # as the preprocess's CTAs exit and wait here for its end; nothing is read before. The
        # postprocess may then launch as ours exit. With the postprocess's reversed order, H200,
        # bf16 hd128 16 heads, 8 causal documents in 16k tokens, fwd+bwd 567.5-572.7 ->
        # 575.4-576.2 TFLOP/s; dense 4k / 16k within the noise (docs/perf_notes.md, session 43).
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head_kv, batch_idx = cute.arch.block_idx()
        if const_expr(self.cluster_n > 1):
            # The cluster's CTAs walk one query order (the host never asks for these with
            # clusters: fa4_shim.c refuses deterministic turns; rotate and launch groups it sets
            # for the 1-CTA twin, the fallback, are ignored here).
            rotate, deterministic, launch_group = Int32(0), Int32(0), Int32(0)
        if const_expr(self.is_local and not self.is_varlen):
            # Causal: K/V block n visits the query blocks from n on, so the low blocks are the
            # long CTAs. The grid launches each (batch, head) pair's blocks longest first, one pair
            # after another, so the last pairs' longest blocks would start in the last wave. In
            # groups of launch_group pairs, block n of every pair of a group goes before block
            # n + 1 (the forward's tile order; its groups also keep the Q/dO the running CTAs
            # read within L2). Deterministic turns follow the grid's order: they keep it (the
            # host never asks for both; the check keeps a bad launch from deadlocking).
            if launch_group > 0 and deterministic == 0:
                n_block, head_kv, batch_idx = self.launch_order(n_block, head_kv, batch_idx, launch_group)
        if const_expr(not (self.is_local or self.is_varlen or self.block_sparse) and self.cluster_n == 1):
            # Unmasked, deterministic, rotated in several chunks (dq_order: turns chunk by chunk,
            # one query block per step; fa4_bwd_launch_group): the same groups put chunk 0 of
            # every pair of a group before its chunk 1, so the GPU runs the first chunks of
            # launch_group pairs side by side instead of a whole head, and a query block's
            # visitors come one per `chunks` steps: each turn's hand-over has that long.
            if launch_group > 0:
                n_block, head_kv, batch_idx = self.launch_order(n_block, head_kv, batch_idx, launch_group)
        seq = SeqlenInfo.create(batch_idx, mQ.shape[0], mK.shape[0], self.is_varlen, mCuSeqlensQ, mCuSeqlensK,
                                mSeqUsedK, has_seqused_k)
        if const_expr(self.is_local):
            if deterministic != 0:
                # Masked, deterministic: the K/V blocks launch from the last one down, and add
                # into each query block in that order (dq_turn): the later a block's query
                # range starts, the earlier it launches and the sooner it can add; the blocks a
                # CTA waits for launched before it (no deadlock).
                n_block = cute.ceil_div(seq.seqlen_k, self.tile_n) - 1 - n_block
        if const_expr(self.block_sparse):
            # K/V blocks launch longest first (the host orders each table row by query blocks
            # visited; a group's first query head orders the CTA's): fewer short ones at the end.
            n_block = SparseBlocks.scheduled_tile(mSparseCounts, batch_idx, head_kv * (mQ.shape[2] // mK.shape[2]),
                                                  n_block, cute.size(mSparseCounts.shape[2]))
        # Packed sequences: the grid covers the longest one; blocks past this one's keys idle.
        # Clusters: the cluster's first block decides for all (a last block past the keys
        # computes on zeros, stores nothing, and takes its part in the multicasts).
        first_of_cluster = n_block
        if const_expr(self.cluster_n > 1):
            first_of_cluster = n_block - Int32(cute.arch.block_idx_in_cluster())
        if n_block >= 0 and first_of_cluster * self.tile_n < seq.seqlen_k:
            if warp_idx == 0:
                for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum,
                             tma_atom_dQ, tma_atom_dQ_store, tma_atom_dK, tma_atom_dV):
                    cpasync.prefetch_descriptor(atom)

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            producer_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
            consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // cute.arch.WARP_SIZE)
            # "stage": a Q/dO stage goes back to the producer when the dQ writer's reduce-adds
            # have read the dQ parts staged in it (after every consumer's GEMMs read Q and dO).
            stage_consumers = consumer_warps
            if const_expr(self.dq_store == "stage"):
                stage_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
            stage_release = {}
            if const_expr(self.cluster_n > 1 and self.dq_store == "stage"):
                # The dQ writers release the stages: lanes 0..cluster_n-1 of each CTA's writer warp
                # arrive on CTA 0..cluster_n-1's barrier (one arrive per writer per CTA).
                stage_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_n)
                stage_release = dict(cta_layout_vmnk=cute.make_layout((1, self.cluster_n, 1, 1)),
                                     mcast_mode_mn=(0, 1))
            elif const_expr(self.cluster_n > 1):
                # A Q/dO stage goes back to every CTA's producer: each writes a slice of it.
                stage_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads)
                stage_release = dict(cta_layout_vmnk=cute.make_layout((1, self.cluster_n, 1, 1)),
                                     mcast_mode_mn=(0, 1), enable_multicast_signaling=True)
            pipeline_kv = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_KV.data_ptr(), num_stages=1, producer_group=producer_thread,
                consumer_group=consumer_warps, tx_count=self.tx_bytes_KV, defer_sync=True,
            )
            pipeline_q = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_Q.data_ptr(), num_stages=self.num_stages, producer_group=producer_thread,
                consumer_group=stage_consumers, tx_count=self.tx_bytes_Q, defer_sync=True, **stage_release,
            )
            pipeline_do = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_dO.data_ptr(), num_stages=self.num_stages, producer_group=producer_thread,
                consumer_group=stage_consumers, tx_count=self.tx_bytes_dO, defer_sync=True, **stage_release,
            )
            cute.arch.mbarrier_init_fence()
            if const_expr(self.cluster_n > 1):
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()
            else:
                cute.arch.sync_threads()

            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
            if const_expr(self.layout == "keys_roles"):
                sP = cute.make_tensor(cute.recast_ptr(storage.sP.data_ptr(), dtype=Float32),
                                      self.p_exchange_layout())
            else:
                sP = None  # P^T stays in registers
            sdQ_parts = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
            sdQ = storage.sdQ.get_tensor(self.dq_tile_layout(sdQ_layout.outer), swizzle=sdQ_layout.inner)
            if const_expr(self.dq_store == "stage"):
                # The dQ parts' home: the finished stages, see staged_dq_part.
                sdQ_parts = (storage.sQ.data_ptr(), storage.sdO.data_ptr(), sdQ_layout)
                sdQ = sdQ_parts
            stats_layout = cute.make_layout((self.tile_m, self.num_stages), stride=(1, self.stats_stage))
            sLSE = storage.sLSE.get_tensor(stats_layout)
            sdPsum = storage.sdPsum.get_tensor(stats_layout)

            block_info = BlockInfo(
                self.tile_m, self.tile_n, False, self.is_local,
                window_left if const_expr(self.is_local) else None,
                window_right if const_expr(self.is_local) else None,
            )
            m_block_min, m_block_max = block_info.m_block_range(seq.seqlen_q, seq.seqlen_k, n_block)
            if const_expr(self.cluster_n > 1 and self.is_local):
                # The cluster's CTAs walk the same query blocks: the union of their ranges (a
                # block outside a CTA's own range is fully masked: zeros into dK, dV and dQ).
                m_block_min = block_info.m_block_range(seq.seqlen_q, seq.seqlen_k, first_of_cluster)[0]
                m_block_max = block_info.m_block_range(seq.seqlen_q, seq.seqlen_k,
                                                       first_of_cluster + self.cluster_n - 1)[1]
            start = self.first_query_block(seq, n_block, m_block_min, m_block_max, rotate)
            group = mQ.shape[2] // mK.shape[2]
            sparse_tables = (mSparseCounts, mSparseBlocks, mSparseBits)

            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    self.load(mQ, mK, mV, mdO, mLSE, mdPsum, sQ, sK, sV, sdO, sLSE, sdPsum,
                              tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum,
                              pipeline_kv, pipeline_q, pipeline_do,
                              seq, n_block, head_kv, batch_idx, group, m_block_min, m_block_max, start,
                              sparse_tables)
                # Deterministic turns with two dQ writers (deterministic == 2, "keys_roles" of dense
                # batches; see write_dq): warp DQ_WRITER_WARP + 1, idle otherwise, takes every other
                # block. Packed sequences take 2 as 1: the rotated turns' arithmetic beside theirs
                # spilled the 24-register writer (8-10 words, unmasked hd192 / hd256 images).
                pairs = const_expr(self.layout == "keys_roles" and not (self.block_sparse or self.is_varlen))
                writer = warp_idx - DQ_WRITER_WARP
                second = False
                if const_expr(pairs):
                    second = writer == 1 and deterministic == 2
                if warp_idx == DQ_WRITER_WARP or second:
                    write_dq = lambda rotated, pair: self.write_dq(  # noqa: E731
                        mdQ, sdQ_parts, tma_atom_dQ, tma_atom_dQ_store, mdQsemaphore, deterministic, store_first,
                        rotate, block_info, seq, n_block, head_kv, batch_idx, group, m_block_min, m_block_max, start,
                        pipeline_q, pipeline_do, sparse_tables, rotated, writer, pair)
                    if const_expr(self.block_sparse):
                        write_dq(False, False)
                    elif const_expr(self.is_local):
                        self.write_dq_by_writers(write_dq, False, pairs, deterministic)
                    else:
                        if deterministic != 0 and rotate != 0:
                            self.write_dq_by_writers(write_dq, True, pairs, deterministic)
                        else:
                            self.write_dq_by_writers(write_dq, False, pairs, deterministic)
                    if const_expr(pairs):
                        if deterministic == 2:
                            self.join_dq_writers(writer)
                    if writer == 0:
                        self.count_done(mSeqDone, batch_idx, num_n_blocks, True)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                tidx = cute.arch.thread_idx()[0] - THREADS_PER_WG
                grad_window = self.consumer_grad_window(storage, tidx)
                consume = self.consume_roles if const_expr(self.layout == "keys_roles") else self.consume
                consume(
                    mdK, mdV, tma_dK, tma_dV, tma_atom_dK, tma_atom_dV,
                    sQ, sK, sV, sdO, sdS, sP, sdQ, sLSE, sdPsum,
                    pipeline_kv, pipeline_q, pipeline_do, tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq,
                    tidx, scale_log2, score_scale, softcap, softmax_scale, block_info, seq, n_block, head_kv,
                    batch_idx, group, m_block_min, m_block_max, start, sparse_tables,
                    (mScoreParams, mScoreGrad, grad_window),
                )
        else:
            # No keys in this block: counted all the same.
            if warp_idx == DQ_WRITER_WARP:
                self.count_done(mSeqDone, batch_idx, num_n_blocks, False)
        if const_expr(self.cluster_n > 1):
            # No CTA leaves while its peer may still release a stage to it.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def launch_order(self, n_block: Int32, head_kv: Int32, batch_idx: Int32, launch_group: Int32):
        """The CTA's (K/V block, head, batch) in groups of launch_group (batch, head) pairs: block
        n of every pair of a group launches before block n + 1 (the forward's tile order)."""
        blocks, heads, batches = (Int32(d) for d in cute.arch.grid_dim())
        order = StaticPersistentScheduler(blocks, heads, batches, launch_group, False, Int32(0))
        return order.coordinates(n_block + blocks * (head_kv + heads * batch_idx))

    @cute.jit
    def write_dq_by_writers(self, write_dq, rotated: cutlass.Constexpr, pairs: cutlass.Constexpr,
                            deterministic: Int32):
        """write_dq's two-writer instance where two writers run (deterministic == 2, kernels whose
        producer warpgroup has the pair: ``pairs``), its one-writer instance otherwise."""
        if const_expr(pairs) and deterministic == 2:
            write_dq(rotated, True)
        else:
            write_dq(rotated, False)

    @cute.jit
    def join_dq_writers(self, writer: Int32):
        """Two dQ writers: writer 1's additions have landed (and are ordered, gpu scope, before
        what writer 0 does next) before writer 0 counts the CTA done (count_done)."""
        sync = 2 * cute.arch.WARP_SIZE
        if writer == 1:
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            cute.arch.sync_warp()
            if cute.arch.lane_idx() == 0:
                fence_proxy_async_global()
                cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_warp()
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_WRITERS), number_of_threads=sync)
        else:
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_WRITERS), number_of_threads=sync)

    @cute.jit
    def count_done(self, mSeqDone: cute.Tensor, batch_idx: Int32, num_n_blocks: Int32,
                   wrote_dq: cutlass.Constexpr[bool]):
        """The dQ writer warp, last thing in the CTA: once its dQ additions have landed (not just
        read shared memory), count the K/V block done in its sequence's mSeqDone (release), on
        which the dQ conversion of the sequence's rows waits. The conversion then runs on the SMs
        that finished sequences leave idle while the grid's last CTAs run (packed documents: their
        long K/V blocks; dense batches: the last batch's). One count per K/V block and K/V head (the
        grid's x before any reordering), so the conversion expects num_n_blocks * heads_kv per
        sequence; a cluster's padding CTAs past num_n_blocks do not count."""
        if const_expr(wrote_dq):
            # Every lane waits for its own bulk groups (the elected one issued the copies).
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            cute.arch.sync_warp()
        # The sequence: the grid's z, read again here where no launch group reorders it (keeping
        # batch_idx, or a read the compiler merges with the kernel's first one, live to here cost
        # the writer's loop a register: its counter spilled, packed sequences without a mask).
        # Dense batches may be reordered (launch_order: causal, and unmasked deterministic turns
        # in several chunks): their batch_idx, which the writer's loop holds anyway.
        seq = batch_idx
        if const_expr(self.is_varlen or self.block_sparse):
            seq = ctaid_z_here()
        counted = cute.arch.block_idx()[0] < num_n_blocks
        if cute.arch.lane_idx() == 0 and counted:
            if const_expr(wrote_dq):
                fence_proxy_async_global()
                cute.arch.fence_acq_rel_gpu()
            # A CTA without keys wrote nothing: no fence (packed sequences launch many such CTAs,
            # the box of the longest sequence's blocks; with a fence each, 32 random documents in
            # 16k tokens ran 8% longer).
            cute.arch.red(mSeqDone.iterator + seq, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")

    @cute.jit
    def stats_offset(self, seq: SeqlenInfo, batch_idx: Int32):
        """First row of a sequence in the padded LSE/dPsum rows (the preprocess's layout): 0
        when dense; packed sequences start at (offset_q + batch_idx * stats_block) rounded down
        to a multiple of stats_block, which keeps every sequence's blocks apart."""
        return stats_offset(seq, batch_idx, self.stats_block, self.is_varlen)

    @cute.jit
    def first_query_block(self, seq: SeqlenInfo, n_block: Int32, m_block_min: Int32, m_block_max: Int32,
                          rotate: Int32):
        """How far into its query range [m_block_min, m_block_max) this CTA starts (``rotate``,
        no mask: K/V block n of a chunk of N at n / N of the way round; see dq_order)."""
        start = Int32(0)
        if const_expr(not (self.is_local or self.block_sparse)):
            if rotate != 0:
                start = rotation_start(n_block, cute.ceil_div(seq.seqlen_k, self.tile_n), m_block_max - m_block_min,
                                       rotate)
        return start

    @cute.jit
    def query_block(self, i: Int32, start: Int32, m_block_min: Int32, m_block_max: Int32):
        """The query block of a CTA's visit ``i`` (m_block_min <= i < m_block_max): from
        m_block_min + start on, wrapping round at m_block_max. The producer, the dQ writer and
        the consumers walk the same order."""
        m_block = i
        if const_expr(not (self.is_local)):
            m_block = i + start
            if m_block >= m_block_max:
                m_block = m_block - (m_block_max - m_block_min)
        return m_block

    def head_visits(self, sparse_tables, batch_idx, head, n_block, m_block_min, m_block_max):
        """[first, end) of a query head's visit indices, and its row of the block-sparse tables
        (block_info.SparseBlocks; None when dense: the query range itself)."""
        if const_expr(self.block_sparse):
            mCounts, mBlocks, _ = sparse_tables
            sparse = SparseBlocks.of_tile(mCounts, mBlocks, batch_idx, head, n_block)
            return Int32(0), sparse.num_total, sparse
        return m_block_min, m_block_max, None

    def visited_block(self, i, start, m_block_min, m_block_max, sparse, seq: SeqlenInfo):
        """The query block of visit ``i`` (head_visits): the table's, or query_block's."""
        if const_expr(self.block_sparse):
            return sparse.n_block(i, cute.ceil_div(seq.seqlen_q, self.tile_m))
        return self.query_block(i, start, m_block_min, m_block_max)

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sdO: cute.Tensor,
        sLSE: cute.Tensor,
        sdPsum: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_dO: cute.CopyAtom,
        tma_atom_LSE: cute.CopyAtom,
        tma_atom_dPsum: cute.CopyAtom,
        pipeline_kv: pipeline.PipelineAsync,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_do: pipeline.PipelineAsync,
        seq: SeqlenInfo,
        n_block: Int32,
        head_kv: Int32,
        batch_idx: Int32,
        group: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        start: Int32,
        sparse_tables,
    ):
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        gK = cute.local_tile(self.tile_view(mK, head_kv, batch_idx, seq.offset_k), (self.tile_n, self.head_dim),
                             (n_block, 0))
        gV = cute.local_tile(self.tile_view(mV, head_kv, batch_idx, seq.offset_k), (self.tile_n, self.head_dim_v),
                             (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        pipeline_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        stats_block0 = self.stats_offset(seq, batch_idx) // self.tile_m
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gQ = cute.local_tile(self.tile_view(mQ, head, batch_idx, seq.offset_q), (self.tile_m, self.head_dim),
                                 (None, 0))
            gdO = cute.local_tile(self.tile_view(mdO, head, batch_idx, seq.offset_q),
                                  (self.tile_m, self.head_dim_v), (None, 0))
            clustered = const_expr(self.cluster_n > 1)
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) if clustered else Int32(0)
            mcast = dict(mcast_mask=cutlass.Int16((1 << self.cluster_n) - 1)) if clustered else {}
            ranks = cute.make_layout(self.cluster_n)
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, rank, ranks, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, rank, ranks, cute.group_modes(sdO, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
            stats_batch = 0 if const_expr(self.is_varlen) else batch_idx  # packed: one batch row
            gLSE = cute.local_tile(mLSE[None, head, stats_batch], (self.tile_m,), (None,))
            gdPsum = cute.local_tile(mdPsum[None, head, stats_batch], (self.tile_m,), (None,))
            tLsL, tLgL = cpasync.tma_partition(tma_atom_LSE, rank, ranks, cute.group_modes(sLSE, 0, 1),
                                               cute.group_modes(gLSE, 0, 1))
            tPsP, tPgP = cpasync.tma_partition(tma_atom_dPsum, rank, ranks,
                                               cute.group_modes(sdPsum, 0, 1), cute.group_modes(gdPsum, 0, 1))
            first, end, sparse = self.head_visits(sparse_tables, batch_idx, head, n_block, m_block_min, m_block_max)
            for i in cutlass.range(first, end, unroll=1):
                m_block = self.visited_block(i, start, m_block_min, m_block_max, sparse, seq)
                pipeline_q.producer_acquire(state)
                bar_q = pipeline_q.producer_get_barrier(state)
                cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar_q, **mcast)
                cute.copy(tma_atom_LSE, tLgL[None, stats_block0 + m_block], tLsL[None, state.index], tma_bar_ptr=bar_q,
                          **mcast)
                pipeline_do.producer_acquire(state)
                bar_do = pipeline_do.producer_get_barrier(state)
                cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=bar_do, **mcast)
                cute.copy(tma_atom_dPsum, tPgP[None, stats_block0 + m_block], tPsP[None, state.index],
                          tma_bar_ptr=bar_do, **mcast)
                state.advance()

    # ---------------------------------------------------------- deterministic dQ order
    @cute.jit
    def dq_turn(self, mdQsemaphore: cute.Tensor, block_info: BlockInfo, seq: SeqlenInfo, n_block: Int32,
                head: Int32, batch_idx: Int32, m_block: Int32, rotation=None):
        """(counter address, this K/V block's turn) of a query block's deterministic dQ order,
        or a turn of -1 where the counters do not reach (a query block past the host's
        max_seqlen_q: unordered then, never out of bounds). The K/V blocks holding the query
        block take turns in their launch order: ascending without a mask, descending with one
        (see kernel); with ``rotation`` (rotate, m_block_min, m_block_max; no mask), in their
        arrival order (dq_order)."""
        turn = Int32(-1)
        index = cutlass.Int64(0)
        if m_block < mdQsemaphore.shape[2]:
            if const_expr(self.is_local):
                turn = block_info.last_n_block_of(seq.seqlen_q, seq.seqlen_k, m_block) - n_block
            elif const_expr(rotation is None):
                turn = n_block - block_info.first_n_block_of(seq.seqlen_q, seq.seqlen_k, m_block)
            else:
                rotate, m_block_min, m_block_max = rotation
                turn = rotated_turn(n_block, m_block - m_block_min, cute.ceil_div(seq.seqlen_k, self.tile_n),
                                    m_block_max - m_block_min, rotate)
            index = cutlass.Int64(cute.crd2idx((batch_idx, head, m_block), mdQsemaphore.layout))
        return mdQsemaphore.iterator + index, turn

    @cute.jit
    def wait_dq_turn(self, counter, turn: Int32, back_off_ns: cutlass.Constexpr[int]):
        """Poll (acquire) until the counter reaches ``turn``, ``back_off_ns`` between polls
        (TURN_POLL_NS); trap rather than hang."""
        if turn >= 0:
            polls = Int32(0)
            while cute.arch.load(counter, Int32, sem="acquire", scope="gpu") != turn:
                nanosleep(back_off_ns)
                polls += 1
                if polls == SPIN_LIMIT:
                    trap()
        fence_proxy_async_global()

    @cute.jit
    def next_visit(self, i: Int32, g: Int32, m_block_min: Int32, m_block_max: Int32):
        """The dQ writer's visit after visit ``i`` of query head ``g`` of the group: the next
        query block of the head, or the next head's first (g == group: none left)."""
        next_i, next_g = i + 1, g
        if next_i == m_block_max:
            next_i, next_g = m_block_min, g + 1
        return next_i, next_g

    @cute.jit
    def dq_turn_came(self, counter, turn: Int32) -> Int32:
        """1 if the counter has reached ``turn`` (one acquire load, as wait_dq_turn's), else 0."""
        came = Int32(1)
        if turn >= 0:
            if cute.arch.load(counter, Int32, sem="acquire", scope="gpu") != turn:
                came = Int32(0)
        if came != 0:
            fence_proxy_async_global()
        return came

    @cute.jit
    def pass_dq_turn(self, counter, turn: Int32):
        """After this thread's (or, behind a barrier, its group's) dQ additions have landed:
        count them in the query block's counter, which hands the block to the next K/V block
        (deterministic turns) or, for a first store, lets the other K/V blocks add."""
        if turn >= 0:
            fence_proxy_async_global()
            cute.arch.fence_acq_rel_gpu()
            cute.arch.red(counter, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")

    @cute.jit
    def claim_dq_block(self, mdQsemaphore: cute.Tensor, block_info: BlockInfo, seq: SeqlenInfo, n_block: Int32,
                       head: Int32, batch_idx: Int32, m_block: Int32, lane: Int32) -> Int32:
        """store_first, not deterministic: claim a query block's first store in its counter
        (lane 0; the others return 0). The writer claims each block one block ahead of storing
        or adding it, so the atomic's round trip never holds it up (at hd256 a stage waits for
        the writer: claiming at the block itself measured 5-7% slower); first_dq_store reads
        the claim."""
        claim = Int32(0)
        counter, turn = self.dq_turn(mdQsemaphore, block_info, seq, n_block, head, batch_idx, m_block)
        if lane == 0 and turn >= 0 and self.whole_query_block(seq, m_block):  # turn -1: no counter
            claim = cute.arch.atomic_add(counter, Int32(DQ_CLAIM))
        return claim

    def whole_query_block(self, seq: SeqlenInfo, m_block: Int32):
        """Whether a first store may write query block m_block's rows whole: always in dense batches
        (TMA stores clip at each batch's end), and in a packed sequence unless the block reaches
        past the sequence's end into the next one's rows (those blocks are added into)."""
        if const_expr(self.is_varlen):
            return m_block < seq.seqlen_q // self.tile_m
        return True

    @cute.jit
    def first_dq_store(self, claim: Int32, counter, lane: Int32) -> Int32:
        """1 when this CTA's claim (claim_dq_block: the counter before it) was the query block's
        first: it stores its dQ parts, then counts the store in the counter's low half; else 0
        once the first one's store has landed (this CTA then adds). The first claimer runs and
        waits on nothing but its own consumers, so the wait ends."""
        first = Int32(0)
        if lane == 0:
            if claim < DQ_CLAIM:
                first = Int32(1)
            else:
                polls = Int32(0)
                while cute.arch.load(counter, Int32, sem="acquire", scope="gpu") & (DQ_CLAIM - 1) == 0:
                    nanosleep()
                    polls += 1
                    if polls == SPIN_LIMIT:
                        trap()
                fence_proxy_async_global()
        return cute.arch.shuffle_sync(first, 0)

    @cute.jit
    def write_dq(
        self,
        mdQ: cute.Tensor,
        sdQ_parts: cute.Tensor,
        tma_atom_dQ: cute.CopyAtom,
        tma_atom_dQ_store: cute.CopyAtom,
        mdQsemaphore: cute.Tensor,
        deterministic: Int32,
        store_first: Int32,
        rotate: Int32,
        block_info: BlockInfo,
        seq: SeqlenInfo,
        n_block: Int32,
        head_kv: Int32,
        batch_idx: Int32,
        group: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        start: Int32,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_do: pipeline.PipelineAsync,
        sparse_tables,
        rotated: cutlass.Constexpr[bool],
        writer: Int32,
        pair: cutlass.Constexpr[bool],
    ):
        """Adds each query block's dQ parts into the fp32 accumulator (TMA reduce-add), or with
        store_first stores them where this CTA is the block's first (claim_dq_block, or turn 0);
        in deterministic mode in its K/V-block turn, each addition complete before the next turn.
        "tma": from the staging buffer, handed back per part (DQ_EMPTY); "stage": from the
        block's Q/dO stage, handed back to the producer once the reduce-adds have read it.
        ``rotated``: deterministic turns in the rotation's arrival order (dq_order); the kernel
        picks an instance per call, since the rotated turns' arithmetic beside the default mode's
        claims spilled the 24-register writer.
        ``pair`` (deterministic turns, "keys_roles"): two writer warps, ``writer`` 0 and 1, take
        the CTA's query blocks alternately. Each hands its block's buffer back as soon as the
        reduce-adds have read it, then waits for them to land and passes the turn, while the
        other one already waits for its next block's turn and adds: a CTA's additions are no
        longer one landing after another."""
        sync = THREADS_PER_WG + cute.arch.WARP_SIZE
        lane = cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        claims = store_first != 0 and deterministic == 0
        if const_expr(self.block_sparse or rotated or pair):
            claims = False  # zero-and-add only; deterministic
        claim = Int32(0)  # the claim on the block the loop is at (claim_dq_block)
        waited = Int32(0)  # 1: the turn of the block the loop is at came while the previous block's landed
        visit = Int32(0)  # pair: the CTA's visits so far (writer = visit parity)
        if claims:
            claim = self.claim_dq_block(mdQsemaphore, block_info, seq, n_block, head_kv * group, batch_idx,
                                        self.query_block(m_block_min, start, m_block_min, m_block_max), lane)
        if const_expr(pair and self.dq_store == "tma"):
            if writer == 0 and m_block_min < m_block_max:
                # The buffer is free for the first block; each later block's is handed back by
                # the writer of the block before it.
                for p in cutlass.range_constexpr(self.dq_parts):
                    cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY) + p, number_of_threads=sync)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gdQ = cute.local_tile(self.tile_view(mdQ, head, batch_idx, seq.offset_q), (self.dq_rows, self.dq_cols),
                                  (None, None))
            first_visit, end, sparse = self.head_visits(sparse_tables, batch_idx, head, n_block, m_block_min,
                                                        m_block_max)
            for i in cutlass.range(first_visit, end, unroll=1):
                mine = True
                if const_expr(pair):
                    mine = (visit & 1) == writer
                    visit += 1
                if mine:
                    m_block = self.visited_block(i, start, m_block_min, m_block_max, sparse, seq)
                    if const_expr(self.dq_store == "tma" and not pair):
                        for p in cutlass.range_constexpr(self.dq_parts):
                            # The previous block's reduce-add of this part has read shared memory.
                            cute.arch.cp_async_bulk_wait_group(self.dq_parts - 1 - p, read=True)
                            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY) + p,
                                                     number_of_threads=sync)
                    counter, turn = self.dq_turn(mdQsemaphore, block_info, seq, n_block, head, batch_idx, m_block,
                                                 (rotate, m_block_min, m_block_max) if const_expr(rotated) else None)
                    first = Int32(0)  # 1: store the parts (the accumulator's first write), not add them
                    if deterministic != 0:
                        if lane == 0 and waited == 0:
                            self.wait_dq_turn(counter, turn, TURN_POLL_NS[rotated])
                        waited = Int32(0)
                        # The TMA copies below elect a lane among those active: all wait for lane 0.
                        cute.arch.sync_warp()
                        if store_first != 0 and turn == 0 and self.whole_query_block(seq, m_block):
                            first = Int32(1)
                    elif store_first != 0:
                        if self.whole_query_block(seq, m_block):
                            first = self.first_dq_store(claim, counter, lane)
                        cute.arch.sync_warp()
                        if const_expr(self.cluster_n > 1):
                            if turn < 0:  # a cluster's block outside this CTA's range: zeros, added
                                first = Int32(0)
                    for p in cutlass.range_constexpr(self.dq_parts):
                        full_id = int(BwdBarrier.DQ_FULL) + p
                        if const_expr(self.layout == "keys_roles"):
                            full_id = full_id + 2 * state.index
                        cute.arch.barrier(barrier_id=full_id, number_of_threads=sync)
                        row_block = m_block * (self.tile_m // self.dq_rows) + (
                            p if const_expr(self.dq_split == "rows") else 0)
                        col_block = p if const_expr(self.dq_split == "cols") else 0
                        if const_expr(self.dq_store == "stage"):
                            src = self.staged_dq_part(sdQ_parts, p, state.index)
                        else:
                            src = sdQ_parts[None, None, p]
                        tsdQ, tgdQ = cpasync.tma_partition(
                            tma_atom_dQ, 0, cute.make_layout(1), cute.group_modes(src, 0, 2),
                            cute.group_modes(gdQ[None, None, row_block, col_block], 0, 2),
                        )
                        if first != 0:
                            cute.copy(tma_atom_dQ_store, tsdQ, tgdQ)
                        else:
                            cute.copy(tma_atom_dQ, tsdQ, tgdQ)
                        cute.arch.cp_async_bulk_commit_group()
                    if const_expr(pair):
                        # The block's buffer (or Q/dO stage) back as soon as the reduce-adds have
                        # read it, before they land: the consumers stage the next block for the
                        # other writer meanwhile. Every lane waits for its own bulk groups.
                        if const_expr(self.dq_store == "tma"):
                            for p in cutlass.range_constexpr(self.dq_parts):
                                cute.arch.cp_async_bulk_wait_group(self.dq_parts - 1 - p, read=True)
                                if i != end - 1 or g != group - 1:  # none after the CTA's last block
                                    cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY) + p,
                                                             number_of_threads=sync)
                        else:
                            self.release_stage(pipeline_q, pipeline_do, state)
                    if claims:
                        # The next block's claim (in this head, or the next head's first block).
                        next_i, next_g = self.next_visit(i, g, m_block_min, m_block_max)
                        if next_g < group:
                            claim = self.claim_dq_block(mdQsemaphore, block_info, seq, n_block,
                                                        head_kv * group + next_g, batch_idx,
                                                        self.query_block(next_i, start, m_block_min, m_block_max),
                                                        lane)
                    if deterministic != 0 or first != 0:
                        # Not with rotated turns (their arithmetic spilled the 24-register writer
                        # before) nor with a window over packed sequences (the next turn's window
                        # arithmetic spilled it: fp16 hd256), nor with two writers (the other
                        # writer's block is next).
                        if const_expr(not (rotated or pair or self.block_sparse or (self.is_local and self.is_varlen))):
                            if deterministic != 0:
                                # The next block's turn, read once while this block's additions are
                                # on their way: where it has come (a long sequence's steady state),
                                # the writer skips the poll's round trip after passing this turn.
                                # Only a look, never a wait: holding this block's turn until the
                                # next one comes delays the blocks behind (1k-4k 7-17% slower).
                                next_i, next_g = self.next_visit(i, g, m_block_min, m_block_max)
                                if next_g < group:
                                    next_counter, next_turn = self.dq_turn(
                                        mdQsemaphore, block_info, seq, n_block, head_kv * group + next_g, batch_idx,
                                        self.query_block(next_i, start, m_block_min, m_block_max))
                                    if lane == 0:
                                        waited = self.dq_turn_came(next_counter, next_turn)
                        # The block's additions (the next turn), or its first store (the others add
                        # after it), have landed: count them. Every lane waits for its own bulk
                        # groups (the elected one issued the copies).
                        cute.arch.cp_async_bulk_wait_group(0, read=False)
                        cute.arch.sync_warp()
                        if lane == 0:
                            self.pass_dq_turn(counter, turn)
                    if const_expr(self.dq_store == "stage" and not pair):
                        self.release_stage(pipeline_q, pipeline_do, state)
                if const_expr(self.layout == "keys_roles"):
                    state.advance()  # the Q/dO stage of the next block: its DQ_FULL ids and its stage
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def release_stage(self, pipeline_q, pipeline_do, state):
        """"stage": the block's Q/dO stage back to the producer once the writer's reduce-adds have
        read the dQ parts staged in it. Every lane waits for its own bulk groups (the elected one
        issued the copies)."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()
        pipeline_q.consumer_release(state)
        pipeline_do.consumer_release(state)

    @cute.jit
    def staged_dq_part(self, sdQ_parts, part: int, stage: Int32) -> cute.Tensor:
        """"stage": dQ part ``part`` (64 x dq_cols fp32, the staging buffer's swizzled layout)
        in the Q/dO stage whose last reader computed it: part 0 (warpgroup 1, after dV, dO's
        last GEMM) in dO's, part 1 (warpgroup 2, after dK, Q's last GEMM) in Q's."""
        q_ptr, do_ptr, sdQ_layout = sdQ_parts
        if const_expr(part == 0):
            base = do_ptr + stage * (self.tile_m * self.head_dim_v)
        else:
            base = q_ptr + stage * (self.tile_m * self.head_dim)
        part_layout = cute.select(sdQ_layout, mode=[0, 1])
        # Stages start 1024-byte aligned (the swizzle's period), as the buffers do.
        base = cute.make_ptr(Float32, base.toint(), cute.AddressSpace.smem, assumed_align=1024)
        return cute.make_tensor(cute.recast_ptr(base, swizzle_=part_layout.inner), part_layout.outer)

    # ----------------------------------------------------------------------- consumers
    @cute.jit
    def consume(
        self,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        tma_dK: cute.Tensor,
        tma_dV: cute.Tensor,
        tma_atom_dK: cute.CopyAtom,
        tma_atom_dV: cute.CopyAtom,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sdO: cute.Tensor,
        sdS: cute.Tensor,
        sP: cute.Tensor,
        sdQ: cute.Tensor,
        sLSE: cute.Tensor,
        sdPsum: cute.Tensor,
        pipeline_kv: pipeline.PipelineAsync,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_do: pipeline.PipelineAsync,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tidx: Int32,
        scale_log2: Float32,
        score_scale: Float32,
        softcap: Float32,
        softmax_scale: Float32,
        block_info: BlockInfo,
        seq: SeqlenInfo,
        n_block: Int32,
        head_kv: Int32,
        batch_idx: Int32,
        group: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        start: Int32,
        sparse_tables,
        score_tensors,
    ):
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        thr_mma_sdp = tiled_mma_sdp.get_slice(tidx)
        wg_mma_sdp = tiled_mma_sdp.get_slice(wg_idx * THREADS_PER_WG)
        wg_mma_dk = tiled_mma_dk.get_slice(wg_idx * THREADS_PER_WG)
        wg_mma_dv = tiled_mma_dv.get_slice(wg_idx * THREADS_PER_WG)
        score_shape = (self.tile_n, self.tile_m)
        # S^T = K @ Q^T, dP^T = V @ dO^T: both operands K-major in shared memory, or K's from
        # registers (k_in_registers: the same tiling with A from registers, filled by ldmatrix).
        tiled_mma_s = tiled_mma_sdp
        tSrA = wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sK))
        if const_expr(self.k_in_registers):
            tiled_mma_s = self.score_mma(warpgroup.OperandSource.RMEM)
            wg_mma_s = tiled_mma_s.get_slice(wg_idx * THREADS_PER_WG)
            tSrA = wg_mma_s.make_fragment_A(wg_mma_s.partition_shape_A((self.tile_n, self.head_dim)))
        tSrB = wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sQ))
        tdPrA = wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sV))
        tdPrB = wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sdO))
        # dV += P^T @ dO, dK += dS^T @ Q: A from registers, B the MN-major views of dO and Q.
        tdVrA = wg_mma_dv.make_fragment_A(wg_mma_dv.partition_shape_A(score_shape))
        tdVrB = wg_mma_dv.make_fragment_B(wg_mma_dv.partition_B(transpose_smem_view(sdO)))
        tdKrA = wg_mma_dk.make_fragment_A(wg_mma_dk.partition_shape_A(score_shape))
        tdKrB = wg_mma_dk.make_fragment_B(wg_mma_dk.partition_B(transpose_smem_view(sQ)))
        acc_dK = new_accumulator(wg_mma_dk, (self.tile_n, self.head_dim))
        acc_dV = new_accumulator(wg_mma_dv, (self.tile_n, self.head_dim_v))
        # dS^T goes to shared memory transposed (stmatrix.trans), as the (tile_m, tile_n) dS.
        smem_copy_scores = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
            tiled_mma_sdp,
        ).get_slice(tidx)
        tdSsdS = smem_copy_scores.partition_D(transpose_smem_view(sdS))
        # dQ = dS @ K: A = dS, B = the MN-major view of K; transposed, dQ^T = K^T @ dS^T (dq_gemm).
        dq_part = wg_idx if const_expr(self.dq_split != "single") else Int32(0)
        wg_mma_dq = tiled_mma_dq.get_slice(dq_part * THREADS_PER_WG)
        if const_expr(self.dq_transposed):
            tdQrdS = wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(sdS))
            tdQrKt = wg_mma_dq.make_fragment_A(wg_mma_dq.partition_A(transpose_smem_view(sK)))
        else:
            tdQrdS = wg_mma_dq.make_fragment_A(wg_mma_dq.partition_A(sdS))
            tdQrKt = wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(transpose_smem_view(sK)))
        # Query index of each line of the score tile, for its row statistics.
        tScS = self.stats_lines(thr_mma_sdp.partition_C(cute.make_identity_tensor(score_shape)))

        mask = AttentionMask(self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k, Int32(0),
                             block_info.window_left, block_info.window_right)
        m_masked_end, m_left_start = self.masked_query_blocks(block_info, seq, n_block, m_block_min, m_block_max)

        pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        if const_expr(self.k_in_registers):
            k_copy = cute.make_tiled_copy_A(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
                tiled_mma_s).get_slice(tidx)
            cute.copy(k_copy, k_copy.partition_S(sK), k_copy.retile(tSrA))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        accumulate = Int32(0)  # 0 on the CTA's first query block: dK/dV start from it
        for g in cutlass.range(group, unroll=1):
            first, end, sparse = self.head_visits(sparse_tables, batch_idx, head_kv * group + g, n_block,
                                                  m_block_min, m_block_max)
            bias = self.score_bias(score_tensors, head_kv * group + g, softmax_scale, batch_idx)
            ends = self.grad_ends(bias)
            for i in cutlass.range(first, end, unroll=1):
                m_block = self.visited_block(i, start, m_block_min, m_block_max, sparse, seq)
                stage = state.index
                bits = self.sparse_bits(mask, sparse_tables, sparse, i, thr_mma_sdp)
                # (1) the scores and their gradients' dot products, transposed: S^T and dP^T.
                pipeline_q.consumer_wait(state)
                acc_S = self.score_gemm(tiled_mma_s, wg_mma_sdp, score_shape, tSrA, tSrB, stage)
                pipeline_do.consumer_wait(state)
                acc_dP = self.score_gemm(tiled_mma_sdp, wg_mma_sdp, score_shape, tdPrA, tdPrB, stage)
                # A score_mod's loads are made in waves where they are added (ScoreBias.add): held
                # all at once beside both accumulators, they spilled hd64's 128-query blocks. Only
                # a relative bias's one-entry tiles are read here, under the GEMMs.
                uniform = None
                if const_expr(bias is not None):
                    uniform = bias.load_uniform(thr_mma_sdp, n_block * self.tile_n, m_block * self.tile_m)
                # (2) P = exp2(S * scale_log2 - LSE_log2), masked, (3) dS = P * (dP - dPsum).
                # Without softcap the probabilities are computed while dP's GEMM runs.
                warpgroup.wait_group(0 if const_expr(self.has_softcap) else 1)
                loaded = None
                if const_expr(self.has_softcap):
                    self.probs_and_grads_softcap(acc_S, acc_dP, mask, thr_mma_sdp, tScS, sLSE, sdPsum, stage,
                                                 m_block, n_block, m_masked_end, m_left_start, score_scale,
                                                 softcap, bits)
                else:
                    self.probabilities(acc_S, mask, thr_mma_sdp, tScS, sLSE, stage, m_block, n_block, m_masked_end,
                                       m_left_start, scale_log2, bits, bias, loaded, uniform)
                    acc_S_l = self.stats_lines(acc_S)
                    warpgroup.wait_group(0)
                    acc_dP_l = self.stats_lines(acc_dP)
                    for c in cutlass.range_constexpr(cute.size(acc_dP_l, mode=[1])):
                        dpsum = sdPsum[tScS[0, c][self.query_mode], stage]
                        for r in cutlass.range_constexpr(cute.size(acc_dP_l, mode=[0])):
                            acc_dP_l[r, c] = acc_S_l[r, c] * (acc_dP_l[r, c] - dpsum)
                # dS into the score_mod parameters' gradient once P is in its GEMM operand's
                # registers (bf16), not beside it in fp32: spills otherwise (hd128).
                after_p = None
                if const_expr(bias is not None):
                    after_p = lambda: self.score_grad(bias, acc_dP, thr_mma_sdp, n_block, m_block,  # noqa: E731
                                                      score_tensors, ends)
                self.dk_dv_keys(acc_S, acc_dP, acc_dK, acc_dV, tdVrA, tdVrB, tdKrA, tdKrB, smem_copy_scores,
                                tdSsdS, tdQrdS, tdQrKt, wg_mma_dq, tiled_mma_dq, tiled_mma_dk, tiled_mma_dv,
                                wg_idx, dq_part, stage, accumulate, pipeline_do, state, softmax_scale, sdQ,
                                tidx, after_p)
                pipeline_q.consumer_release(state)
                state.advance()
                accumulate = Int32(1)
            self.flush_score_grad(bias, ends, score_tensors)
        if const_expr(self.dq_transposed):
            # The epilogue's thread coordinates derived after the loop, not held across it (two
            # words spilled).
            tidx = tidx + loop_bound_zero(accumulate)
        self.epilogue_dkv(acc_dK, acc_dV, mdK, mdV, tma_dK, tma_dV, tma_atom_dK, tma_atom_dV, sK, sV,
                          tiled_mma_dk, tiled_mma_dv, tidx, softmax_scale, seq, n_block, head_kv, batch_idx)

    @cute.jit
    def consume_roles(
        self, mdK, mdV, tma_dK, tma_dV, tma_atom_dK, tma_atom_dV,
        sQ, sK, sV, sdO, sdS, sP, sdQ, sLSE, sdPsum, pipeline_kv, pipeline_q, pipeline_do,
        tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, tidx, scale_log2, score_scale, softcap,
        softmax_scale, block_info, seq, n_block, head_kv, batch_idx, group, m_block_min, m_block_max, start,
        sparse_tables, score_tensors,
    ):
        """"keys_roles": warpgroup 1 the probabilities' side (S^T, P^T, dV), warpgroup 2 the
        gradients' side (dP^T, dS^T, dK); each computes half of dQ's head dims. Per query block:
          wg 1: S^T = K @ Q^T; P^T (masked) -> registers and, fp32, to shared memory; P_READY;
                dV += P^T @ dO; DS_READY; dQ[:, :d/2] = dS @ K[:, :d/2].
          wg 2: dP^T = V @ dO^T; P_READY; dS^T = P^T * (dP^T - dPsum) -> registers and
                (transposed) shared memory; DS_READY; dK += dS^T @ Q; dQ[:, d/2:].
        Both roles sync on both barriers (from their own code, hence unaligned barriers), which
        orders the buffers' reuse: warpgroup 1 writes the next P^T after DS_READY (warpgroup 2
        has read this one), warpgroup 2 the next dS after the next P_READY (warpgroup 1's dQ
        GEMM of this block has completed). The roles meet the same barriers the same number of
        times (their dQ halves too); compute-sanitizer's racecheck reported the P^T exchange
        as a race while only warpgroup 1 synced with the dQ writer."""
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        wg_tidx = tidx % THREADS_PER_WG
        thr_mma_sdp = tiled_mma_sdp.get_slice(wg_tidx)
        wg_mma_sdp = tiled_mma_sdp.get_slice(0)
        score_shape = (self.tile_n, self.tile_m)
        tScS = self.stats_lines(thr_mma_sdp.partition_C(cute.make_identity_tensor(score_shape)))
        # This thread's P^T elements in its accumulator's order (the same in both roles).
        sP_thr = sP[wg_tidx, None]
        sP_thr = cute.make_tensor(sP_thr.iterator, cute.composition(
            sP_thr.layout, cute.make_layout(thr_mma_sdp.partition_shape_C(score_shape))))
        wg_mma_dq = tiled_mma_dq.get_slice(wg_idx * THREADS_PER_WG)
        tdQrdS = wg_mma_dq.make_fragment_A(wg_mma_dq.partition_A(sdS))
        tdQrKt = wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(transpose_smem_view(sK)))
        pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        if wg_idx == 0:
            acc_dV = self.probs_role(
                sQ, sK, sdO, sP_thr, sLSE, pipeline_q, pipeline_do, tiled_mma_sdp, wg_mma_sdp, thr_mma_sdp,
                tiled_mma_dv, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, tScS, score_shape, scale_log2, score_scale,
                softcap, softmax_scale, sdQ, block_info, seq, n_block, group, m_block_min, m_block_max, start, tidx,
                sparse_tables, head_kv, batch_idx, score_tensors)
            self.epilogue_dkv(None, acc_dV, mdK, mdV, tma_dK, tma_dV, tma_atom_dK, tma_atom_dV, sK, sV,
                              tiled_mma_dk, tiled_mma_dv, wg_tidx, softmax_scale, seq, n_block, head_kv, batch_idx)
        else:
            acc_dK = self.grads_role(
                sQ, sV, sdO, sdS, sP_thr, sdPsum, pipeline_q, pipeline_do, tiled_mma_sdp, wg_mma_sdp, thr_mma_sdp,
                tiled_mma_dk, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, tScS, score_shape, softmax_scale, sdQ,
                group, m_block_min, m_block_max, tidx, sparse_tables, n_block, head_kv, batch_idx, score_tensors, seq,
                start)
            self.epilogue_dkv(acc_dK, None, mdK, mdV, tma_dK, tma_dV, tma_atom_dK, tma_atom_dV, sK, sV,
                              tiled_mma_dk, tiled_mma_dv, wg_tidx, softmax_scale, seq, n_block, head_kv, batch_idx)

    @cute.jit
    def probs_role(self, sQ, sK, sdO, sP_thr, sLSE, pipeline_q, pipeline_do, tiled_mma_sdp, wg_mma_sdp,
                   thr_mma_sdp, tiled_mma_dv, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, tScS, score_shape,
                   scale_log2, score_scale, softcap, softmax_scale, sdQ, block_info, seq, n_block, group,
                   m_block_min, m_block_max, start, tidx, sparse_tables, head_kv, batch_idx, score_tensors):
        """"keys_roles", warpgroup 1 (see consume_roles); returns dV."""
        wg_mma_dv = tiled_mma_dv.get_slice(0)
        tSrK = wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sK))
        tSrQ = wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sQ))
        tdVrP = wg_mma_dv.make_fragment_A(wg_mma_dv.partition_shape_A(score_shape))
        tdVrdOt = wg_mma_dv.make_fragment_B(wg_mma_dv.partition_B(transpose_smem_view(sdO)))
        acc_dV = new_accumulator(wg_mma_dv, (self.tile_n, self.head_dim_v))
        mask = AttentionMask(self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k, Int32(0),
                             block_info.window_left, block_info.window_right)
        m_masked_end, m_left_start = self.masked_query_blocks(block_info, seq, n_block, m_block_min, m_block_max)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        accumulate = Int32(0)
        for g in cutlass.range(group, unroll=1):
            first, end, sparse = self.head_visits(sparse_tables, batch_idx, head_kv * group + g, n_block,
                                                  m_block_min, m_block_max)
            bias = self.score_bias(score_tensors, head_kv * group + g, softmax_scale, batch_idx)
            for i in cutlass.range(first, end, unroll=1):
                m_block = self.visited_block(i, start, m_block_min, m_block_max, sparse, seq)
                stage = state.index
                bits = self.sparse_bits(mask, sparse_tables, sparse, i, thr_mma_sdp)
                pipeline_q.consumer_wait(state)
                acc_S = self.score_gemm(tiled_mma_sdp, wg_mma_sdp, score_shape, tSrK, tSrQ, stage)
                loaded = self.score_loads(bias, thr_mma_sdp, n_block, m_block)
                warpgroup.wait_group(0)
                if const_expr(self.has_softcap):
                    # P, and for the gradients' side P times the cap's derivative 1 - tanh^2.
                    for e in cutlass.range_constexpr(cute.size(acc_S)):
                        acc_S[e] = cute.math.tanh(acc_S[e] * score_scale, fastmath=True) * softcap
                    self.apply_mask(acc_S, mask, thr_mma_sdp, m_block, n_block, m_masked_end, m_left_start, bits)
                    inv_softcap = 1.0 / softcap
                    acc_S_l = self.stats_lines(acc_S)
                    sP_l = self.stats_lines(sP_thr)
                    for c in cutlass.range_constexpr(cute.size(acc_S_l, mode=[1])):
                        lse = sLSE[tScS[0, c][self.query_mode], stage]
                        for r in cutlass.range_constexpr(cute.size(acc_S_l, mode=[0])):
                            capped = acc_S_l[r, c]
                            p = cute.math.exp2(capped * LOG2_E - lse, fastmath=True)
                            t = capped * inv_softcap
                            acc_S_l[r, c] = p
                            # Masked scores are -inf: their factor is clamped to 0, not -inf.
                            sP_l[r, c] = p * cutlass.max(1.0 - t * t, 0.0)
                else:
                    self.probabilities(acc_S, mask, thr_mma_sdp, tScS, sLSE, stage, m_block, n_block, m_masked_end,
                                       m_left_start, scale_log2, bits, bias, loaded)
                    sP_thr.store(acc_S.load())
                if const_expr(self.dq_store != "stage"):
                    pipeline_q.consumer_release(state)  # Q (S^T) and its LSE read
                barrier_sync_unaligned(int(BwdBarrier.P_READY), self.num_mma_threads)
                store_as_operand_a(acc_S, tdVrP)
                pipeline_do.consumer_wait(state)
                wgmma(tiled_mma_dv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], accumulate != 0, -1)
                barrier_sync_unaligned(int(BwdBarrier.DS_READY), self.num_mma_threads)
                self.dq_half(0, pipeline_do, state, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, softmax_scale, sdQ,
                             tidx)
                state.advance()
                accumulate = Int32(1)
        return acc_dV

    @cute.jit
    def grads_role(self, sQ, sV, sdO, sdS, sP_thr, sdPsum, pipeline_q, pipeline_do, tiled_mma_sdp, wg_mma_sdp,
                   thr_mma_sdp, tiled_mma_dk, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, tScS, score_shape,
                   softmax_scale, sdQ, group, m_block_min, m_block_max, tidx, sparse_tables, n_block, head_kv,
                   batch_idx, score_tensors, seq, start):
        """"keys_roles", warpgroup 2 (see consume_roles); returns dK (unscaled)."""
        wg_tidx = tidx % THREADS_PER_WG
        wg_mma_dk = tiled_mma_dk.get_slice(0)
        tdPrV = wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sV))
        tdPrdO = wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sdO))
        tdKrdS = wg_mma_dk.make_fragment_A(wg_mma_dk.partition_shape_A(score_shape))
        tdKrQt = wg_mma_dk.make_fragment_B(wg_mma_dk.partition_B(transpose_smem_view(sQ)))
        acc_dK = new_accumulator(wg_mma_dk, (self.tile_n, self.head_dim))
        # dS^T to shared memory transposed (stmatrix.trans): the (tile_m, tile_n) dS of dQ's GEMMs.
        smem_copy_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
            tiled_mma_sdp,
        ).get_slice(wg_tidx)
        tdSsdS = smem_copy_dS.partition_D(transpose_smem_view(sdS))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        accumulate = Int32(0)
        for g in cutlass.range(group, unroll=1):
            first, end, sparse = self.head_visits(sparse_tables, batch_idx, head_kv * group + g, n_block,
                                                  m_block_min, m_block_max)
            bias = self.score_bias(score_tensors, head_kv * group + g, softmax_scale, batch_idx)
            ends = self.grad_ends(bias)
            for i in cutlass.range(first, end, unroll=1):
                stage = state.index
                pipeline_do.consumer_wait(state)
                acc_dP = self.score_gemm(tiled_mma_sdp, wg_mma_sdp, score_shape, tdPrV, tdPrdO, stage)
                warpgroup.wait_group(0)
                barrier_sync_unaligned(int(BwdBarrier.P_READY), self.num_mma_threads)
                rP = cute.make_rmem_tensor_like(acc_dP)
                rP.store(sP_thr.load())
                acc_dP_l, rP_l = self.stats_lines(acc_dP), self.stats_lines(rP)
                for c in cutlass.range_constexpr(cute.size(acc_dP_l, mode=[1])):
                    dpsum = sdPsum[tScS[0, c][self.query_mode], stage]
                    for r in cutlass.range_constexpr(cute.size(acc_dP_l, mode=[0])):
                        acc_dP_l[r, c] = rP_l[r, c] * (acc_dP_l[r, c] - dpsum)
                m_block = self.visited_block(i, start, m_block_min, m_block_max, sparse, seq)
                self.score_grad(bias, acc_dP, thr_mma_sdp, n_block, m_block, score_tensors, ends)
                if const_expr(self.dq_store != "stage"):
                    pipeline_do.consumer_release(state)  # dO (dP^T) and its dPsum read
                store_as_operand_a(acc_dP, tdKrdS)
                rdS = cute.make_tensor(tdKrdS.iterator, cute.make_layout(acc_dP.shape))
                cute.copy(smem_copy_dS, smem_copy_dS.retile(rdS), tdSsdS[None, None, None, 0])
                cute.arch.fence_view_async_shared()
                barrier_sync_unaligned(int(BwdBarrier.DS_READY), self.num_mma_threads)
                pipeline_q.consumer_wait(state)
                wgmma(tiled_mma_dk, acc_dK, tdKrdS, tdKrQt[None, None, None, stage], accumulate != 0, -1)
                self.dq_half(1, pipeline_q, state, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, softmax_scale, sdQ,
                             tidx)
                state.advance()
                accumulate = Int32(1)
            self.flush_score_grad(bias, ends, score_tensors)
        return acc_dK

    @cute.jit
    def dq_half(self, part: int, pipeline_last, state, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, softmax_scale, sdQ,
                tidx):
        """"keys_roles": a role's dQ half (part 0: warpgroup 1) behind its running dV or dK GEMM,
        the last reader of the block's dO or Q stage (``pipeline_last``), which goes back to the
        producer once that GEMM completes, or with the dQ writer's copy ("stage"); then the half
        goes to the dQ writer."""
        acc_dQ = self.dq_gemm(tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, 0)
        if const_expr(self.dq_store != "stage"):
            warpgroup.wait_group(1)
            pipeline_last.consumer_release(state)
        warpgroup.wait_group(0)
        self.store_dq(acc_dQ, tiled_mma_dq, part, softmax_scale, sdQ, tidx, state.index)

    @cute.jit
    def masked_query_blocks(self, block_info: BlockInfo, seq: SeqlenInfo, n_block, m_block_min, m_block_max):
        """The query blocks that the causal diagonal (right edge of the window) or the local
        left edge crosses: [m_block_min, m_masked_end) and [m_left_start, m_block_max)."""
        m_masked_end = m_block_min
        m_left_start = m_block_max
        if const_expr(self.is_local):
            m_masked_end = block_info.m_block_min_no_right_mask(seq.seqlen_q, seq.seqlen_k, n_block, m_block_max)
        if const_expr(self.is_local):
            m_left_start = block_info.m_block_max_no_left_mask(seq.seqlen_q, seq.seqlen_k, n_block, m_block_min)
        if const_expr(self.is_varlen):
            # A K/V block reaching past the sequence's keys holds the next sequence's: all its query
            # blocks take the mask (with the seqlen bounds; apply_mask).
            if (n_block + 1) * self.tile_n > seq.seqlen_k:
                m_masked_end = m_block_max
        return m_masked_end, m_left_start

    @cute.jit
    def probabilities(self, acc_S, mask, thr_mma_sdp, tScS, sLSE, stage, m_block, n_block, m_masked_end,
                      m_left_start, scale_log2, bits=None, bias=None, loaded=None, uniform=None):
        """P = exp2(S * scale_log2 - LSE_log2) in place, masked (no softcap), the score_mod's
        ``bias`` (score_mod.ScoreBias; ``loaded``: its score_loads, or in the "keys" layout
        ``uniform``: its load_uniform) added first."""
        if const_expr(bias is not None):
            if const_expr(loaded is None and self.layout == "keys"):
                bias.add(acc_S, thr_mma_sdp, n_block * self.tile_n, m_block * self.tile_m, self.bias_waves, uniform)
            else:
                bias.apply(acc_S, thr_mma_sdp, n_block * self.tile_n, m_block * self.tile_m, loaded)
        self.apply_mask(acc_S, mask, thr_mma_sdp, m_block, n_block, m_masked_end, m_left_start, bits)
        acc_S_l = self.stats_lines(acc_S)
        for c in cutlass.range_constexpr(cute.size(acc_S_l, mode=[1])):
            lse = sLSE[tScS[0, c][self.query_mode], stage]
            for r in cutlass.range_constexpr(cute.size(acc_S_l, mode=[0])):
                acc_S_l[r, c] = cute.math.exp2(acc_S_l[r, c] * scale_log2 - lse, fastmath=True)

    @cute.jit
    def score_gemm(self, tiled_mma_sdp, wg_mma_sdp, score_shape, tA, tB, stage):
        """Issue S^T (or dP^T) of one query block, left running: K (or V) @ the staged Q^T (dO^T)."""
        acc = new_accumulator(wg_mma_sdp, score_shape)
        wgmma(tiled_mma_sdp, acc, tA, tB[None, None, None, stage], False, -1)
        return acc

    @cute.jit
    def dk_dv_keys(self, acc_S, acc_dP, acc_dK, acc_dV, tdVrP, tdVrdOt, tdKrdS, tdKrQt, smem_copy_dS, tdSsdS,
                   tdQrdS, tdQrKt, wg_mma_dq, tiled_mma_dq, tiled_mma_dk, tiled_mma_dv, wg_idx, dq_part, stage,
                   accumulate, pipeline_do, state, softmax_scale, sdQ, tidx, after_p=None):
        """"keys": (4) dV += P^T @ dO from registers, (5) dS^T to shared memory (every
        consumer's part is needed by every dQ GEMM), (6) dQ = dS @ K, (7) dK += dS^T @ Q.
        ``after_p``: runs once P is in its operand registers, dS still in fp32."""
        store_as_operand_a(acc_S, tdVrP)
        if const_expr(after_p is not None):
            after_p()
        store_as_operand_a(acc_dP, tdKrdS)
        wgmma(tiled_mma_dv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], accumulate != 0, -1)
        # tdKrdS holds the (64, tile_m) accumulator's values in its own order (one accumulator
        # atom per warpgroup: the same order), viewed as the accumulator.
        rdS = cute.make_tensor(tdKrdS.iterator, cute.make_layout(acc_dP.shape))
        cute.copy(smem_copy_dS, smem_copy_dS.retile(rdS), tdSsdS[None, None, None, stage])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY), number_of_threads=self.num_mma_threads)
        self.dq_and_dk(acc_dK, tdKrdS, tdKrQt, tdQrdS, tdQrKt, wg_mma_dq, tiled_mma_dq, tiled_mma_dk, wg_idx,
                       dq_part, stage, accumulate, pipeline_do, state, softmax_scale, sdQ, tidx)

    @cute.jit
    def dq_and_dk(self, acc_dK, tdKrA, tdKrB, tdQrdS, tdQrKt, wg_mma_dq, tiled_mma_dq, tiled_mma_dk, wg_idx,
                  dq_part, stage, accumulate, pipeline_do, state, softmax_scale, sdQ, tidx):
        """Behind dV's running GEMM: dQ = dS @ K (the warpgroups dq_split gives a part) and dK's
        GEMM; dO's stage goes back once dV's GEMM has completed, then the scaled dQ part goes
        to its accumulator (store_dq)."""
        if const_expr(self.dq_split == "single"):
            if wg_idx == 0:
                self.dq_and_dk_part(True, acc_dK, tdKrA, tdKrB, tdQrdS, tdQrKt, wg_mma_dq, tiled_mma_dq,
                                    tiled_mma_dk, dq_part, stage, accumulate, pipeline_do, state, softmax_scale, sdQ,
                                    tidx)
            else:
                self.dq_and_dk_part(False, acc_dK, tdKrA, tdKrB, tdQrdS, tdQrKt, wg_mma_dq, tiled_mma_dq,
                                    tiled_mma_dk, dq_part, stage, accumulate, pipeline_do, state, softmax_scale, sdQ,
                                    tidx)
        else:
            self.dq_and_dk_part(True, acc_dK, tdKrA, tdKrB, tdQrdS, tdQrKt, wg_mma_dq, tiled_mma_dq, tiled_mma_dk,
                                dq_part, stage, accumulate, pipeline_do, state, softmax_scale, sdQ, tidx)
        warpgroup.wait_group(0)

    @cute.jit
    def dq_and_dk_part(self, with_dq: cutlass.Constexpr[bool], acc_dK, tdKrA, tdKrB, tdQrdS, tdQrKt, wg_mma_dq,
                       tiled_mma_dq, tiled_mma_dk, dq_part, stage, accumulate, pipeline_do, state, softmax_scale,
                       sdQ, tidx):
        if const_expr(self.dq_transposed):
            # dV's GEMM completes first: its P operand's registers are free before dQ^T's 40
            # accumulators are taken (with both, ptxas serialised every WGMMA of the kernel: C7512).
            warpgroup.wait_group(0)
            pipeline_do.consumer_release(state)
        if const_expr(with_dq):
            acc_dQ = self.dq_gemm(tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, stage)
        # dK += dS^T @ Q, dS^T from registers.
        wgmma(tiled_mma_dk, acc_dK, tdKrA, tdKrB[None, None, None, stage], accumulate != 0, -1)
        warpgroup.wait_group(1)
        if const_expr(not self.dq_transposed):
            pipeline_do.consumer_release(state)
        if const_expr(with_dq):
            if const_expr(self.dq_transposed):
                # Its store addresses derived afresh at each block: held across the loop, they
                # were registers the score phase spilled (ptx.loop_bound_zero).
                tidx = tidx + loop_bound_zero(stage)
            self.store_dq(acc_dQ, tiled_mma_dq, dq_part, softmax_scale, sdQ, tidx)

    @cute.jit
    def dq_gemm(self, tiled_mma_dq, wg_mma_dq, tdQrdS, tdQrKt, stage):
        """Issue this warpgroup's dQ part of the block in ``stage``, left running: dS @ K, or
        (dq_transposed) K^T @ dS^T, whose accumulator holds dQ^T."""
        if const_expr(self.dq_transposed):
            acc_dQ = new_accumulator(wg_mma_dq, (self.head_dim, self.tile_m))
            wgmma(tiled_mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, stage], False, -1)
        else:
            acc_dQ = new_accumulator(wg_mma_dq, (self.tile_m, self.head_dim))
            wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, stage], tdQrKt, False, -1)
        return acc_dQ

    @cute.jit
    def apply_mask(self, acc_S, mask: AttentionMask, thr_mma_sdp, m_block, n_block, m_masked_end, m_left_start,
                   bits=None):
        """The mask on S^T where this query block needs it (see consume); block-sparse: the bits
        of a partial block (``bits``: (words, partial), sparse_bits)."""
        if const_expr(self.block_sparse):
            words, partial = bits
            if partial:
                mask.apply_bits(acc_S, thr_mma_sdp, words, transposed=True)
        elif const_expr(self.is_local or self.is_varlen):
            if m_block < m_masked_end or m_block >= m_left_start:
                self.mask_block(acc_S, mask, thr_mma_sdp, m_block, n_block, self.is_varlen)

    def score_bias(self, score_tensors, head, softmax_scale, batch):
        """The score_mod's bias on a query head's S^T tiles (score_mod.ScoreBias), or None."""
        if const_expr(self.score_mod == "none"):
            return None
        return ScoreBias.create(self.score_mod, self.tile_n, self.tile_m, True, score_tensors[0], head,
                                1.0 / softmax_scale, batch)

    @cute.jit
    def score_loads(self, bias, thr_mma_sdp, n_block, m_block):
        """The bias's loads for a tile (ScoreBias.load), issued under its score GEMMs; None without."""
        if const_expr(bias is None):
            return None
        return bias.load(thr_mma_sdp, n_block * self.tile_n, m_block * self.tile_m)

    @cute.jit
    def score_grad(self, bias, acc_dS, thr_mma_sdp, n_block, m_block, score_tensors, ends):
        """dS of a tile into the score_mod parameters' gradient, where the host asks for it (a
        gradient tensor with rows; (0, width) otherwise); ``ends``: grad_ends'."""
        if const_expr(bias is not None):
            bias.accumulate_grad(acc_dS, thr_mma_sdp, n_block * self.tile_n, m_block * self.tile_m, score_tensors[1],
                                 self.grad_enabled(score_tensors), self.grad_address_per_tile, ends, score_tensors[2])

    @cute.jit
    def consumer_grad_window(self, storage, tidx: Int32):
        """This consumer warp's shared window for a relative bias's gradient (grad_window floats,
        zeroed here; score_mod.ScoreBias._diagonal_grad), or None."""
        if const_expr(self.grad_window == 0):
            return None
        windows = storage.sGradWindows.get_tensor(
            cute.make_layout((self.grad_window, self.num_mma_threads // cute.arch.WARP_SIZE)))
        window = windows[None, tidx // cute.arch.WARP_SIZE]
        for j in cutlass.range_constexpr(self.grad_window // cute.arch.WARP_SIZE):
            window[cute.arch.lane_idx() + j * cute.arch.WARP_SIZE] = Float32(0.0)
        cute.arch.sync_warp()
        return window

    def grad_ends(self, bias):
        """The sums a score_mod's gradient carries over a head's query blocks (ScoreBias.grad_ends),
        or None."""
        return None if const_expr(bias is None) else bias.grad_ends()

    @cute.jit
    def flush_score_grad(self, bias, ends, score_tensors):
        """After a head's query blocks: grad_ends' sums into the parameters' gradient."""
        if const_expr(bias is not None):
            bias.flush_grad(ends, score_tensors[1], self.grad_enabled(score_tensors))

    @cute.jit
    def grad_enabled(self, score_tensors) -> Int32:
        """1 where the host asks for the score_mod parameters' gradient (a gradient tensor with
        rows; (0, width) otherwise)."""
        enabled = Int32(0)
        if cute.size(score_tensors[1].shape[0]) > 0:
            enabled = Int32(1)
        return enabled

    @cute.jit
    def sparse_bits(self, mask: AttentionMask, sparse_tables, sparse, i, thr_mma_sdp):
        """Block-sparse: (this thread's bits of visit i's slot, whether visit i is a partial
        block), loaded ahead of the score GEMMs (full blocks load a clamped slot they ignore);
        None when dense."""
        if const_expr(not self.block_sparse):
            return None
        words = mask.load_bits(sparse_tables[2], sparse.first_slot + i, thr_mma_sdp, transposed=True)
        return words, i < sparse.num_partial

    @cute.jit
    def mask_block(self, acc_S, mask: AttentionMask, thr_mma_sdp, m_block, n_block, mask_seqlen: cutlass.Constexpr):
        mask.apply_transposed(acc_S, thr_mma_sdp, m_block, n_block, mask_seqlen, self.is_local)

    @cute.jit
    def probs_and_grads_softcap(self, acc_S, acc_dP, mask, thr_mma_sdp, tScS, sLSE, sdPsum, stage, m_block,
                                n_block, m_masked_end, m_left_start, score_scale, softcap, bits=None):
        """Softcap: scores s' = softcap * tanh(s * scale / softcap), P = exp2(s' * log2(e) -
        LSE_log2), dS = P * (dP - dPsum) * (1 - tanh^2), the derivative of the cap (the scale
        is applied to dK and dQ at the end). One pass after both GEMMs, which recomputes
        tanh = s' / softcap instead of keeping it: 32 more live registers spilled hd128."""
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[i] = cute.math.tanh(acc_S[i] * score_scale, fastmath=True) * softcap
        self.apply_mask(acc_S, mask, thr_mma_sdp, m_block, n_block, m_masked_end, m_left_start, bits)
        inv_softcap = 1.0 / softcap
        acc_S_l, acc_dP_l = self.stats_lines(acc_S), self.stats_lines(acc_dP)
        for c in cutlass.range_constexpr(cute.size(acc_S_l, mode=[1])):
            lse = sLSE[tScS[0, c][self.query_mode], stage]
            dpsum = sdPsum[tScS[0, c][self.query_mode], stage]
            for r in cutlass.range_constexpr(cute.size(acc_S_l, mode=[0])):
                capped = acc_S_l[r, c]
                p = cute.math.exp2(capped * LOG2_E - lse, fastmath=True)
                t = capped * inv_softcap
                # Masked scores are -inf: their derivative factor is clamped to 0, not -inf.
                dtanh = cutlass.max(1.0 - t * t, 0.0)
                acc_dP_l[r, c] = p * (acc_dP_l[r, c] - dpsum) * dtanh
                acc_S_l[r, c] = p

    @cute.jit
    def store_dq(self, acc_dQ: cute.Tensor, tiled_mma_dq, part, softmax_scale: Float32, sdQ, tidx, stage=None):
        """This warpgroup's completed dQ part, scaled, to the dQ writer, which adds it into the
        fp32 accumulator: through its shared-memory buffer ("tma") or the finished Q/dO
        ``stage`` ("stage")."""
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            acc_dQ[i] = acc_dQ[i] * softmax_scale
        # "keys_roles" (the callers pass the stage): the part's DQ_FULL id per Q/dO stage.
        full_id = int(BwdBarrier.DQ_FULL) + part
        if const_expr(stage is not None):
            full_id = full_id + 2 * stage
        if const_expr(self.dq_store == "stage"):
            # One warpgroup's (64, dq_cols) part: the copy partitioned over its own threads.
            part_mma = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS_PER_WG, self.dq_cols),
            )
            smem_copy_dQ = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64), part_mma,
            ).get_slice(tidx % THREADS_PER_WG)
            dst = self.staged_dq_part(sdQ, part, stage)
            cute.copy(smem_copy_dQ, smem_copy_dQ.retile(acc_dQ), smem_copy_dQ.partition_D(dst))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=full_id, number_of_threads=THREADS_PER_WG + cute.arch.WARP_SIZE)
        else:
            # dQ^T's element pairs are two rows of the staged dQ: 4-byte stores (a warp's 32 land
            # on 4 rows of 8 columns, on distinct banks under the 128-byte swizzle).
            smem_copy_dQ = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                    num_bits_per_copy=32 if const_expr(self.dq_transposed) else 64), tiled_mma_dq,
            ).get_slice(tidx)
            sync = THREADS_PER_WG + cute.arch.WARP_SIZE
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY) + part, number_of_threads=sync)
            if const_expr(self.dq_transposed):
                # The (head_dim, tile_m) view of the (tile_m, head_dim) parts.
                sdQt = cute.composition(sdQ, cute.make_layout((self.head_dim, self.tile_m), stride=(self.tile_m, 1)))
                cute.copy(smem_copy_dQ, smem_copy_dQ.retile(acc_dQ), smem_copy_dQ.partition_D(sdQt))
            elif const_expr(self.dq_stage_exchange):
                self.stage_dq_pairs(smem_copy_dQ, smem_copy_dQ.retile(acc_dQ), smem_copy_dQ.partition_D(sdQ), tidx)
            else:
                cute.copy(smem_copy_dQ, smem_copy_dQ.retile(acc_dQ), smem_copy_dQ.partition_D(sdQ))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=full_id, number_of_threads=sync)

    @cute.jit
    def stage_dq_pairs(self, smem_copy_dQ, src: cute.Tensor, dst: cute.Tensor, tidx: Int32):
        """A dQ part's 8-byte (two-column) pairs into its 128-byte-swizzled staging buffer, with
        the lanes of odd accumulator rows storing, at each store, the pair two 8-column groups
        away (pair k ^ 4: the same row, the other half of the 32-column swizzle atom). A 64-bit
        store is served per half-warp (4 rows of the accumulator, 32 bytes each), and the swizzle
        puts rows q and q ^ 1 of the same 8-column group on the same banks: 4 wavefronts per
        store instead of 2 (ncu, hd128 4k), 9% of the kernel's shared-memory wavefronts, in the
        resource the backward is bound by. With the exchange every half-warp covers 128 distinct
        bytes. Each thread still stores each of its pairs once; the data moves by SEL, the
        address by a run-time pair index."""
        # (2 columns, pairs), both in the same pair order.
        src_pairs = cute.make_tensor(src.iterator, cute.get(src.layout, mode=[0]))
        dst_pairs = cute.make_tensor(dst.iterator, cute.get(dst.layout, mode=[0]))
        pairs = cute.size(src_pairs, mode=[1])
        assert cute.size(src_pairs, mode=[0]) == 2 and pairs % 8 == 0
        odd = (tidx >> 2) & 1  # this lane's accumulator rows (q and q + 8 of quad q) are odd
        for k in cutlass.range_constexpr(pairs):
            pair = cute.make_rmem_tensor((2,), Float32)
            for e in cutlass.range_constexpr(2):
                pair[e] = select_f32(odd, src_pairs[e, k ^ 4], src_pairs[e, k])
            cute.copy(smem_copy_dQ, pair, dst_pairs[None, k ^ (odd << 2)])

    @cute.jit
    def epilogue_barrier(self):
        """Both consumer warpgroups at the epilogue (from two code paths in "keys_roles")."""
        if const_expr(self.layout == "keys_roles"):
            barrier_sync_unaligned(int(BwdBarrier.EPILOGUE), self.num_mma_threads)
        else:
            cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)

    @cute.jit
    def epilogue_dkv(self, acc_dK, acc_dV, mdK, mdV, tma_dK, tma_dV, tma_atom_dK, tma_atom_dV, sK, sV,
                     tiled_mma_dk, tiled_mma_dv, mma_tidx, softmax_scale, seq: SeqlenInfo, n_block, head_kv,
                     batch_idx):
        """dK * scale and dV through K's and V's buffers (free once every consumer's last GEMM
        has read K and V) to global memory: one TMA store each, or row-predicated stores where
        a packed sequence ends inside the block (a TMA store would write the next one's rows).
        "keys_roles": each warpgroup holds one of them (the other passed as None); mma_tidx is
        the thread's index in the tiled MMAs."""
        parts = [(acc, sX, mX, tiled_mma, dim)
                 for acc, sX, mX, tiled_mma, dim in ((acc_dK, sK, mdK, tiled_mma_dk, self.head_dim),
                                                     (acc_dV, sV, mdV, tiled_mma_dv, self.head_dim_v))
                 if acc is not None]
        if const_expr(acc_dK is not None):
            for i in cutlass.range_constexpr(cute.size(acc_dK)):
                acc_dK[i] = acc_dK[i] * softmax_scale
        whole = True
        if const_expr(self.is_varlen):
            whole = (n_block + 1) * self.tile_n <= seq.seqlen_k
        if whole:
            self.epilogue_barrier()
            for acc, sX, _, tiled_mma, _ in parts:
                rX = cute.make_rmem_tensor_like(acc, self.dtype)
                rX.store(acc.load().to(self.dtype))
                smem_copy = cute.make_tiled_copy_C(
                    cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                        self.dtype),
                    tiled_mma,
                ).get_slice(mma_tidx)
                cute.copy(smem_copy, smem_copy.retile(rX), smem_copy.partition_D(sX))
            cute.arch.fence_view_async_shared()
            self.epilogue_barrier()
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
                for tma, atom, sX, dim in ((tma_dK, tma_atom_dK, sK, self.head_dim),
                                           (tma_dV, tma_atom_dV, sV, self.head_dim_v)):
                    gX = cute.local_tile(self.tile_view(tma, head_kv, batch_idx, seq.offset_k), (self.tile_n, dim),
                                         (n_block, 0))
                    tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                                       cute.group_modes(gX, 0, 2))
                    cute.copy(atom, tXsX, tXgX)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            for acc, _, mX, tiled_mma, dim in parts:
                thr_mma = tiled_mma.get_slice(mma_tidx)
                gX = cute.local_tile(self.tile_view(mX, head_kv, batch_idx, seq.offset_k), (self.tile_n, dim),
                                     (n_block, 0))
                tXgX = thr_mma.partition_C(gX)
                tXcX = thr_mma.partition_C(cute.make_identity_tensor((self.tile_n, dim)))
                limit = seq.seqlen_k - n_block * self.tile_n
                for i in cutlass.range_constexpr(cute.size(acc)):
                    if tXcX[i][0] < limit:
                        tXgX[i] = acc[i].to(self.dtype)
