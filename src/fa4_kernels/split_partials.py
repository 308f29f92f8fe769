"""Partial results of split tiles (tile_scheduler.SplitTail) in global memory.

A piece of a tile that misses the tile's block 0 ("writer") stores, per consumer thread, its
unnormalised O accumulator, row maxima and thread-local row sums, then raises its warpgroup's
flag. The piece holding block 0 ("merger") waits for the writers' flags and folds each partial
into its own state exactly as the online softmax folds a K/V block in: rescale both sides to
the larger row max and add (the lanes of a warp whose rows hold no query may help, see ``merge``).
The merged state then goes through the usual finalize/epilogue. Rows that hold no query (most
of a decoding tile) are neither stored nor loaded.

Distributed merging (FwdConfig.distributed_merge: KV-cache variants, where speculative
verification splits each of a few tiles of many rows into many pieces; ``distributes`` picks the
launches) has no single merger. Every piece stores its partial and counts itself in at the
tile's arrival counter; once all have, each piece folds every partial's words of its own share
of the tile's (row, chunk) items and stores those outputs itself, the lanes whose rows hold no
query helping the live ones (``helper_lanes``). One merger folding an 8-token
verification tile's 15 partials (32 rows each, 246 KB) took 4 us of a 15 us call: about one
SM's share of the L2's bandwidth.

Workspace layout (the ABI with csrc_shims/fa4_shim.c, fa4_split_workspace):
  semaphores (int32): word 0 the dynamic scheduler's tile counter; from FLAGS_BASE one flag per
      (CTA slot, consumer warpgroup), zero at launch and zero again when the kernel ends (each
      merger resets the flags it consumed, so a workspace can be reused without a memset).
  partials (fp32): one slot per CTA of the grid (num_sms of them), each holding every consumer
      thread's WORDS words: its O accumulator (rows-major), its row maxima, then its row sums.
      They go in 16-byte chunks of CHUNK words, the threads' chunks interleaved: word w of thread
      t is word w % CHUNK of chunk (w // CHUNK) * threads + t. A thread stores and loads its words
      by 128-bit accesses, and a warp's access to one chunk index covers 512 contiguous bytes
      (a decoding tile's live quad, lanes 0-3: 64 contiguous bytes).
  distributed: the flags' words hold two counters per split tile instead, arrivals and
      departures, at FLAGS_BASE + 2 * (the CTA holding the tile's block 0), zero at launch and
      reset by the tile's last piece to depart; and two partial slots per CTA, 2 * cta for its
      first piece (one that misses block 0) and 2 * cta + 1 for its last (the one holding
      block 0): a CTA whose share straddles two tiles has a piece of each.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_kernels.hopper_mma import rows_cols_view
from fa4_kernels.ptx import SPIN_LIMIT, nanosleep, trap

FLAGS_BASE = 32  # semaphore words before the flags (word 0: the tile counter)
# Words per 16-byte chunk of a thread's partial. With one word per access (threads' words
# interleaved one by one), a decoding tile's merger issued 68 loads per lane, each touching 8
# slots' sectors, and folding 15 partials took 2.5 us at 1 x 4k and 3.5 us at 1 x 32k of a
# 9.6 / 38.7 us kernel (H200, trace twin, session 46).
CHUNK = 4
# The merger's back-off between polls of a writer's flag (ns). The merger has nothing else to do
# while it waits, and the wait sits on a split tile's critical path: a 256 ns sleep added up to
# that much to a decoding step's ~12 us.
MERGER_POLL_NS = 32
MERGER_SPIN_LIMIT = SPIN_LIMIT * 256 // MERGER_POLL_NS  # the same time as other waits before the trap
# distributed: pieces whose chunks a thread loads before folding any (fold_chunk); 6 registers each.
# One H100, the hybrid rule below, CUDA-graph us per call, 8 in flight / 16 (one round trip for a
# 16-way split), same call: 8 tokens at 1 x 4k 11.0 / 11.6-11.9, 1 x 32k 52.3 / 52.7-53.0; one
# token 12.0 / 11.1-11.9 (the merger's path, within its noise): 8, the fewer registers.
PIECES_IN_FLIGHT = 8
# distributed merging pays where one merger's fold would read at least this many bytes of
# partials (``distributes``). Measured (H100, bf16 hd128 KV-cache, 32/8 heads, CUDA-graph us per
# call, one merger -> every piece folding in every launch, session 51): one query token at
# 1 x 4k (15 partials of 4 rows: 31 KB) 11.3 -> 12.7, 4 tokens (123 KB) 12.1 -> 12.5, 8 tokens
# (246 KB) 15.3 -> 12.9; at 1 x 32k 52.6 -> 53.4, 53.5 -> 53.9, 55.7 -> 54.8; 8 x 32k (one
# partial of 4-32 rows a tile) 354.5 -> 362.9-374.8. Every piece waits for the slowest and pays
# its round trips, where a writer of the merger's scheme stores and leaves. With this rule (the
# run-time item loop, session 52, one H100, same call, base -> rule): 8 tokens at 1 x 4k 14.1 ->
# 11.0-11.9 (one token 11.2-11.8), 1 x 32k 55.6-56.3 -> 52.3-53.0; one and 4 tokens, 8 x 32k within
# the runs' spread (+-0.8 us at 1 x 4k). Lowered from 192 KB so that 4-token verification (16 live
# rows, 120 KB at hd128) distributes too (session 57, one H100, bf16 hd128 32/8 heads, CUDA-graph us
# per call, two alternations, 192 -> 96 KB): 4 tokens at 1 x 4k 11.21 / 11.25 -> 9.54 / 9.65 (the
# one-token call 9.72-9.76 beside it), at 1 x 32k 51.42 / 51.70 -> 49.77 / 49.84; one token over
# 16 packed heads (32/2 heads: 16 rows, now distributed too) 18.44-18.53 -> 18.40-18.44 at 1 x 4k,
# 101.3-103.1 -> 101.5 at 1 x 32k; 8 tokens (distributed before) 9.88-9.93 -> 9.75-9.76.
DISTRIBUTED_MIN_BYTES = 96 * 1024


def distributes(ctas, tail_tiles, live_rows, head_dim_v, one_piece_per_cta=1):
    """Does a launch merge its split tiles distributed? ``ctas`` share the ``tail_tiles`` split
    tiles, each of ``live_rows`` rows that hold a query: the launch's choice is the same for every
    tile (the counters take the flags' words). Python ints (CPU tests) or the kernel's Int32.

    Only where no CTA holds two pieces (``one_piece_per_cta``: SplitTail.one_piece_per_cta). A
    distributed piece waits for every piece of its tile, and a CTA whose share straddles two tiles
    reaches its second piece (the next tile's block 0) only after its first piece's wait, which
    needs the previous CTA's second piece: one chain through all the split tiles. Measured (H100,
    64-row tiles forced, bf16 hd128 32/8 heads, session 71): 1 x 300 causal queries against 32k
    keys (160 tiles: one round, 28 tiles split over 132 CTAs) 1818 us, where the rounds predict
    about 550; 4 x 129 against 8k, 424 us against 239 on the long tiles. The single merger's
    writers never wait, so it has no chain."""
    return (ctas // tail_tiles - 1) * live_rows * head_dim_v * 4 * one_piece_per_cta >= DISTRIBUTED_MIN_BYTES


def partial_words_per_thread(head_dim_v: int) -> int:
    """O accumulator (64 rows x dv over 128 threads: dv / 2) + 2 row maxima + 2 row sums."""
    return head_dim_v // 2 + 4


def chunk_index(slot, first_word: int, tidx, words: int, threads: int):
    """The chunk (counted in CHUNK words from the partials' start) holding words first_word ..
    first_word + CHUNK - 1 of thread ``tidx``'s partial in ``slot``, ``words`` per thread and
    ``threads`` consumer threads (the layout above: slots, then a thread's chunks, then the
    threads). Python ints or the kernel's Int32 values alike."""
    return (slot * (words // CHUNK) + first_word // CHUNK) * threads + tidx


# The lanes whose index has bit b set, per b (as int32 bit patterns): a ballot & one of these says
# whether a live lane has that bit.
_LANES_WITH_BIT = tuple(m - (1 << 32) if m >= 1 << 31 else m
                        for m in (0xAAAAAAAA, 0xCCCCCCCC, 0xF0F0F0F0, 0xFF00FF00, 0xFFFF0000))


@cute.jit
def helper_lanes(any_live, lane: Int32):
    """The warp's lanes as owners and helpers for a fold of partials (``fold_chunk``, and the
    single merger's ``merge_with_helpers``): returns (mask, group, log2 of groups). mask is the OR
    of the indices of the lanes whose rows hold a query (``any_live``); lanes that agree on the
    bits outside mask form one group, which folds for the owner ``lane & mask`` (every live lane
    is its own owner, at group 0), ``group`` being this lane's index among the ``groups`` lanes
    that share its owner, each of which folds every groups-th piece. A decoding tile's live lanes
    (one quad per packed head, e.g. lanes 0-3 and 16-19 for 16 heads a tile, or lanes 0-15 for
    4) get the other lanes as helpers; an owner whose rows hold no query (live lanes 0-11: mask
    15, owners 12-15 idle) folds nothing, nor do its helpers. mask 31 (e.g. every lane live):
    groups of one, the plain fold. Warp-uniform but for ``group``."""
    live_lanes = cute.arch.vote_ballot_sync(any_live)
    mask = Int32(0)
    for b in cutlass.range_constexpr(5):
        if (live_lanes & Int32(_LANES_WITH_BIT[b])) != 0:
            mask = mask | Int32(1 << b)
    group, groups_log2 = Int32(0), Int32(0)
    for b in cutlass.range_constexpr(5):
        if ((mask >> b) & 1) == 0:
            group = group | (((lane >> b) & 1) << groups_log2)
            groups_log2 = groups_log2 + 1
    return mask, group, groups_log2


@cute.jit
def combine_helpers(o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, mask: Int32,
                    scale_log2: Float32, rows_live=None):
    """After a fold with ``helper_lanes``' helpers: fold the states of each owner's group
    together by butterfly shuffles over the lane bits outside ``mask``, so every lane of the group
    holds the owner's merged state (up to rounding: the pair's two lanes add the same terms, maybe
    contracted differently; the owner's is the one used). ``rows_live[r]``: is row r of the
    lane's owner live (rows no lane's owner holds skip their shuffles; the branch is on the
    warp's vote, so every lane reaches them); None: every row combines (``fold_chunk``'s one row,
    the same for the whole CTA). mask is warp-uniform: so is each step's branch."""
    # A run-time loop over the bits: unrolled, the single merger's (2 rows x 64 columns at hd128)
    # grew the decoding kernel by 1k instructions, which its CTAs, running the code once, fetch.
    for b in cutlass.range(5, unroll=1):
        if ((mask >> b) & 1) == 0:
            offset = Int32(1) << b
            for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
                # Each column is shuffled where the fold reads it, before it is updated (a row's
                # columns staged in registers first spilled hd256's KV-cache tiles).
                if const_expr(rows_live is None) or cute.arch.vote_any_sync(rows_live[r]):
                    fold_row(o, row_max, row_sum, r, scale_log2,
                             cute.arch.shuffle_sync_bfly(row_max[r], offset=offset),
                             cute.arch.shuffle_sync_bfly(row_sum[r], offset=offset),
                             lambda c, r=r: cute.arch.shuffle_sync_bfly(o[r, c], offset=offset))


@dataclass(frozen=True)
class SplitPartials:
    semaphores: cute.Tensor  # int32
    partials: cute.Tensor  # fp32
    num_threads: cutlass.Constexpr[int]  # consumer threads of a CTA
    num_wg: cutlass.Constexpr[int]  # consumer warpgroups (one flag each per slot)
    words: cutlass.Constexpr[int]  # partial_words_per_thread
    # merge folds with the warps' idle lanes (FwdConfig.merge_helpers), and, with pairs, loads two
    # partials' rows before folding either (FwdConfig.merge_pairs).
    helpers: cutlass.Constexpr[bool] = False
    pairs: cutlass.Constexpr[bool] = False

    def chunk(self, slot: Int32, first_word: int, tidx: Int32) -> cute.Tensor:
        """The CHUNK words of thread ``tidx``'s partial in ``slot`` from word ``first_word`` (a
        multiple of CHUNK) on, as a 16-byte aligned global tensor."""
        index = chunk_index(slot, first_word, tidx, self.words, self.num_threads)
        return cute.local_tile(self.partials, (CHUNK,), (index,))

    def load_words(self, slot: Int32, first_word: int, count: int, tidx: Int32) -> cute.Tensor:
        """Words first_word .. first_word + count - 1 of thread ``tidx``'s partial in ``slot``
        (registers; loaded a chunk at a time)."""
        words = cute.make_rmem_tensor((count,), Float32)
        for k in range(count // CHUNK):
            cute.autovec_copy(self.chunk(slot, first_word + k * CHUNK, tidx),
                              cute.local_tile(words, (CHUNK,), (k,)))
        return words

    def store_words(self, slot: Int32, first_word: int, values, tidx: Int32):
        """Store ``values`` (a list of Float32, a multiple of CHUNK long) as thread ``tidx``'s
        words from ``first_word`` on."""
        for k in range(len(values) // CHUNK):
            chunk = cute.make_rmem_tensor((CHUNK,), Float32)
            for j in range(CHUNK):
                chunk[j] = values[k * CHUNK + j]
            cute.autovec_copy(chunk, self.chunk(slot, first_word + k * CHUNK, tidx))

    @staticmethod
    def check_shape(rows: int, cols: int):
        assert cols % CHUNK == 0 and (2 * rows) % CHUNK == 0, "a row's O and the statistics fill whole chunks"

    def flag_ptr(self, slot: Int32, wg: Int32):
        return self.semaphores.iterator + (FLAGS_BASE + slot * self.num_wg + wg)

    @staticmethod
    def piece_slot(merger_cta, piece):
        """distributed: the slot of a split tile's ``piece``-th piece (0: the one holding block 0,
        the last piece of CTA ``merger_cta``; piece i > 0: the first piece of CTA merger_cta + i)."""
        return 2 * (merger_cta + piece) + 1 - cutlass.min(piece, 1)

    def tile_counter(self, merger_cta: Int32, departures: int):
        """distributed: the arrival (0) or departure (1) counter of the split tile whose block 0
        CTA ``merger_cta`` holds."""
        return self.semaphores.iterator + (FLAGS_BASE + 2 * merger_cta + departures)

    @cute.jit
    def store(self, slot: Int32, wg: Int32, tidx: Int32, acc_O: cute.Tensor, row_max: cute.Tensor,
              row_sum: cute.Tensor, live: tuple, barrier_id: Int32, arrivals=None):
        """Writer: store this thread's state in ``slot`` (rows whose ``live`` flag is false hold
        no query and are skipped: most of a decoding tile's rows), then, once the whole warpgroup
        has, raise the warpgroup's flag with release semantics (distributed: add one to the
        tile's ``arrivals`` counter instead)."""
        o = rows_cols_view(acc_O)
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        self.check_shape(rows, cols)
        any_live = live[0]
        for r in cutlass.range_constexpr(1, rows):
            any_live = any_live or live[r]
        for r in cutlass.range_constexpr(rows):
            if live[r]:
                self.store_words(slot, r * cols, [o[r, c] for c in range(cols)], tidx)
        if any_live:  # every row's maximum and sum share the statistics' chunks
            self.store_words(slot, rows * cols, [row_max[r] for r in range(rows)] + [row_sum[r] for r in range(rows)],
                             tidx)
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        if tidx % 128 == 0:
            # The barrier orders the warpgroup's stores before this thread's fence; the fence
            # makes them visible at GPU scope before the flag (cumulativity).
            cute.arch.fence_acq_rel_gpu()
            if const_expr(arrivals is not None):
                cute.arch.atomic_add(arrivals, Int32(1), sem="relaxed", scope="gpu")
            else:
                cute.arch.store(self.flag_ptr(slot, wg), Int32(1), sem="relaxed", scope="gpu")

    @cute.jit
    def wait_arrivals(self, merger_cta: Int32, pieces: Int32, tidx: Int32, barrier_id: Int32) -> Int32:
        """distributed: wait until all ``pieces`` pieces of the tile have stored their partials,
        and count this one out at the departure counter; the last to leave resets both counters
        for the next launch (every piece has seen the arrivals complete by then). Returns, on
        the warpgroup's first thread, the departures before this one, for ``reset_counters``
        (issued here, read after the merge: the atomic's round trip stays off the way)."""
        departed = Int32(0)
        if tidx % 128 == 0:
            arrivals = self.tile_counter(merger_cta, 0)
            polls = Int32(0)
            while cute.arch.load(arrivals, Int32, sem="acquire", scope="gpu") < pieces:
                nanosleep(MERGER_POLL_NS)
                polls += 1
                if polls == MERGER_SPIN_LIMIT:
                    trap()
            departed = cute.arch.atomic_add(self.tile_counter(merger_cta, 1), Int32(1), sem="relaxed", scope="gpu")
        # The acquire, then the barrier: every partial's words are visible to all threads.
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        return departed

    @cute.jit
    def reset_counters(self, merger_cta: Int32, pieces: Int32, tidx: Int32, departed: Int32):
        """distributed: the tile's last piece to depart (``wait_arrivals``' count) zeroes its
        counters."""
        if tidx % 128 == 0:
            if departed == pieces - 1:
                cute.arch.store(self.tile_counter(merger_cta, 0), Int32(0), sem="relaxed", scope="gpu")
                cute.arch.store(self.tile_counter(merger_cta, 1), Int32(0), sem="relaxed", scope="gpu")

    @cute.jit
    def fold_chunk(self, merger_cta: Int32, pieces: Int32, tidx: Int32, r: Int32, first_word: Int32,
                   rows: cutlass.Constexpr[int], live, scale_log2: Float32, lanes=None):
        """distributed: fold words first_word .. first_word + CHUNK - 1 (a chunk of accumulator
        row ``r`` of ``rows``) of thread ``tidx``'s partial in every piece of the tile, as
        ``merge`` folds whole states. Returns (row max, the thread's row sum, the CHUNK O words)
        as a (1,) / (1,) / (1, CHUNK) state; a row that holds no query (``live`` false) loads
        nothing and returns the empty state. The pieces go in groups of PIECES_IN_FLIGHT whose loads
        are all issued before the first fold (past the last piece, the last one again, folded with
        weight 0): a loop that could exit between pieces issued each piece's loads only after the
        previous fold, one round trip to L2 per piece.

        ``lanes``: ``helper_lanes``' (mask, group, log2 of groups), with ``tidx`` the owner's: this
        lane folds every groups-th piece from its group's on, and the owner's helpers then combine
        their states by butterfly shuffles over the lane bits outside mask, so every lane of the
        group returns the owner's state (up to rounding: the pair's two lanes add the same terms,
        maybe contracted differently; the owner's is the one stored). A 64-way split of a 16-head
        decoding tile (a quarter of its lanes live) then takes 2 rounds of loads instead of 8."""
        row_max = cute.make_rmem_tensor((1,), Float32)
        row_sum = cute.make_rmem_tensor((1,), Float32)
        o = cute.make_rmem_tensor((1, CHUNK), Float32)
        row_max[0] = -Float32.inf
        row_sum[0] = Float32(0.0)
        for c in cutlass.range_constexpr(CHUNK):
            o[0, c] = Float32(0.0)
        group, groups_log2 = Int32(0), Int32(0)
        if const_expr(lanes is not None):
            group, groups_log2 = lanes[1], lanes[2]
        groups = Int32(1) << groups_log2
        # This lane's pieces: group, group + groups, ..., the j-th of them piece group + j * groups.
        mine = (cutlass.max(pieces - group, 0) + groups - 1) >> groups_log2
        count = mine if live else Int32(0)
        for first in cutlass.range(0, count, PIECES_IN_FLIGHT, unroll=1):
            stats, words = [], []
            for k in cutlass.range_constexpr(PIECES_IN_FLIGHT):
                slot = self.piece_slot(merger_cta, group + cutlass.min(first + k, count - 1) * groups)
                stats.append(self.load_words(slot, self.words - 2 * rows, 2 * rows, tidx))
                words.append(self.load_words(slot, first_word, CHUNK, tidx))
            for k in cutlass.range_constexpr(PIECES_IN_FLIGHT):
                # Row r's statistics (r is a run-time value: selected, not indexed).
                their_max, their_sum = stats[k][0], stats[k][rows]
                for i in cutlass.range_constexpr(1, rows):
                    their_max = stats[k][i] if r == i else their_max
                    their_sum = stats[k][rows + i] if r == i else their_sum
                their_max = their_max if first + k < count else -Float32.inf
                fold_row(o, row_max, row_sum, 0, scale_log2, their_max, their_sum, lambda c, k=k: words[k][c])
        if const_expr(lanes is not None):
            combine_helpers(o, row_max, row_sum, lanes[0], scale_log2)
        return row_max, row_sum, o

    @cute.jit
    def wait(self, first_slot: Int32, count: Int32, wg: Int32, tidx: Int32, barrier_id: Int32):
        """Merger: wait until slots first_slot .. first_slot + count - 1 hold this warpgroup's
        partials (a tile split many ways, as in decoding, has many: the warpgroup's threads poll
        them in parallel, one each), and reset their flags for the next launch."""
        i = tidx % 128
        while i < count:
            flag = self.flag_ptr(first_slot + i, wg)
            polls = Int32(0)
            while cute.arch.load(flag, Int32, sem="acquire", scope="gpu") == 0:
                nanosleep(MERGER_POLL_NS)
                polls += 1
                if polls == MERGER_SPIN_LIMIT:
                    trap()
            cute.arch.store(flag, Int32(0), sem="relaxed", scope="gpu")
            i += 128
        # Each flag's acquire, then the barrier: every partial's words are visible to all threads.
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)

    @cute.jit
    def merge(self, first_slot: Int32, count: Int32, tidx: Int32, acc_O: cute.Tensor, row_max: cute.Tensor,
              row_sum: cute.Tensor, live_rows, scale_log2: Float32):
        """Merger, after ``wait``: fold the partials in slots first_slot .. first_slot + count - 1
        into this warpgroup's (acc_O, row_max, row_sum). ``live_rows(t)``: thread t's ``live``
        flags (its rows that hold a query).

        With ``helpers``, a warp's lanes with live rows fold with the help of its idle lanes. In a
        decoding tile only the first quad of each warp holds a query (pack-GQA puts each head's one
        row at a warp's top), and folding the 15 partials of a 16-way split one after another took
        40% of the kernel at 1 x 4k (docs/perf_notes.md). So the lanes are grouped by
        ``helper_lanes`` (one group per live owner lane and the idle lanes that share its bits of
        the live lanes' OR), each lane folds every groups-th partial for its owner (helpers from
        an empty state, owners from their own), and ``combine_helpers`` folds each group's states
        together by shuffles. With every lane live (most split tiles outside decoding) the groups
        are single lanes: the serial fold."""
        o = rows_cols_view(acc_O)
        self.check_shape(cute.size(o, mode=[0]), cute.size(o, mode=[1]))
        if const_expr(not self.helpers):
            live = live_rows(tidx)
            for i in cutlass.range(count, unroll=1):
                for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
                    if live[r]:
                        self.fold_partial(first_slot + i, r, tidx, o, row_max, row_sum, scale_log2)
        else:
            self.merge_with_helpers(first_slot, count, tidx, o, row_max, row_sum, live_rows, scale_log2)

    @cute.jit
    def merge_with_helpers(self, first_slot: Int32, count: Int32, tidx: Int32, o: cute.Tensor,
                           row_max: cute.Tensor, row_sum: cute.Tensor, live_rows, scale_log2: Float32):
        """``merge`` with the warp's idle lanes helping (see there); ``o``: acc_O's (row, column) view."""
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        lane = tidx % 32
        live = live_rows(tidx)
        any_live = live[0]
        for r in cutlass.range_constexpr(1, len(live)):
            any_live = any_live or live[r]
        # A warp with no live lane keeps its state (it is not stored).
        if cute.arch.vote_any_sync(any_live):
            mask, group, groups_log2 = helper_lanes(any_live, lane)
            owner = tidx - lane + (lane & mask)
            owner_live = live_rows(owner)
            if group != 0:  # a helper: its own rows hold no query; it starts empty
                for r in cutlass.range_constexpr(rows):
                    row_max[r] = -Float32.inf
                    row_sum[r] = Float32(0.0)
                    for c in cutlass.range_constexpr(cols):
                        o[r, c] = Float32(0.0)
            groups = Int32(1) << groups_log2
            step = groups * (2 if const_expr(self.pairs) else 1)
            i = group
            while i < count:
                slot = first_slot + i
                # With pairs, the partial ``groups`` further on, folded in the same step; past the
                # last one, this step's first slot again with weight 0 (a -inf max: its values are
                # finite, so they add nothing).
                if const_expr(self.pairs):
                    second_valid = i + groups < count
                    second = first_slot + (i + groups if second_valid else i)
                for r in cutlass.range_constexpr(rows):
                    if owner_live[r]:
                        if const_expr(self.pairs):
                            first_max, first_sum, first_o = self.load_row(slot, r, owner, rows, cols)
                            second_max, second_sum, second_o = self.load_row(second, r, owner, rows, cols)
                            fold_row(o, row_max, row_sum, r, scale_log2, first_max, first_sum,
                                     lambda c, first_o=first_o: first_o[c])
                            fold_row(o, row_max, row_sum, r, scale_log2,
                                     second_max if second_valid else -Float32.inf, second_sum,
                                     lambda c, second_o=second_o: second_o[c])
                        else:
                            self.fold_partial(slot, r, owner, o, row_max, row_sum, scale_log2)
                i += step
            combine_helpers(o, row_max, row_sum, mask, scale_log2, owner_live)

    def fold_partial(self, slot: Int32, r: int, owner: Int32, o: cute.Tensor,
                     row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32):
        """Fold row ``r`` of thread ``owner``'s partial in ``slot`` into (o, row_max, row_sum),
        each chunk of its O loaded where the fold reads it (few registers: the serial fold of
        head_dim_v > 128)."""
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        stats = self.load_words(slot, rows * cols, 2 * rows, owner)
        loaded = {}

        def column(c):
            if c % CHUNK == 0:
                loaded["chunk"] = self.load_words(slot, r * cols + c, CHUNK, owner)
            return loaded["chunk"][c % CHUNK]

        fold_row(o, row_max, row_sum, r, scale_log2, stats[r], stats[rows + r], column)

    def load_row(self, slot: Int32, r: int, owner: Int32, rows: int, cols: int):
        """Row ``r`` of thread ``owner``'s partial in ``slot``: (max, thread-local sum, O columns)."""
        stats = self.load_words(slot, rows * cols, 2 * rows, owner)
        return stats[r], stats[rows + r], self.load_words(slot, r * cols, cols, owner)


@cute.jit
def fold_row(o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, r: cutlass.Constexpr[int],
             scale_log2: Float32, other_max: Float32, other_sum: Float32, other_o):
    """Fold another state's row ``r`` (its max, thread-local sum and O columns ``other_o(c)``)
    into (o, row_max, row_sum) as the online softmax folds a K/V block in: rescale both sides
    to the larger row max and add."""
    new_max = cutlass.max(row_max[r], other_max)
    # Both -inf (a row that saw no key in either state): scale both by exp2(-inf) = 0.
    safe_max = Float32(0.0) if new_max == -Float32.inf else new_max
    mine = cute.math.exp2((row_max[r] - safe_max) * scale_log2, fastmath=True)
    theirs = cute.math.exp2((other_max - safe_max) * scale_log2, fastmath=True)
    row_max[r] = new_max
    row_sum[r] = row_sum[r] * mine + other_sum * theirs
    for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
        o[r, c] = o[r, c] * mine + other_o(c) * theirs
