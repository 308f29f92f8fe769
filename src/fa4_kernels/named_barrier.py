"""Named hardware barrier ids (``bar.sync id, count``) used by the forward kernels.

Id 0 is ``__syncthreads``; every other id a kernel uses is listed here so two roles never
share one by accident. The hardware has 16 (0-15); four consumer warpgroups use 1-14.
"""
import enum


class FwdBarrier(enum.IntEnum):
    # Whole-tile epilogue (O aliasing V): all consumer threads are done with the previous use of
    # the O staging buffer and with their last P @ V before anyone writes O into it.
    EPILOGUE_SMEM_FREE = 1
    # O is in shared memory (and fenced): the storing warp may issue the TMA store.
    EPILOGUE_O_READY = 2
    # Round-robin of the consumer warpgroups' GEMM issue (ping-pong for two): WG k waits on
    # WG_SCHEDULER + k before issuing its GEMMs; the warpgroup before it arrives on it after
    # issuing its own. Ids 3, 4 (, 5, 6 with three or four consumer warpgroups).
    WG_SCHEDULER = 3
    # Per-warpgroup epilogue (O in its own buffer): as EPILOGUE_SMEM_FREE / EPILOGUE_O_READY for the
    # 64 rows of one warpgroup; ids 7-10 and 11-14.
    EPILOGUE_WG_SMEM_FREE = 7
    EPILOGUE_WG_O_READY = 11
    # Split tiles (split_partials): a warpgroup's partial stores before its flag, its flag wait
    # before its partial loads. The ids of EPILOGUE_WG_SMEM_FREE again (7-10; 128 threads): a
    # warpgroup uses them for partials only outside its epilogue, with the same thread count.
    SPLIT_WG = 7
    # KV cache (kv_cache.PagedKV.append): the consumers have written a tile's appended rows into
    # the cache and fenced them; the producer loads the tile's K/V blocks after it.
    KV_APPEND = 15
    # KV cache: the first consumer warpgroup's stale V rows zeroed and fenced before its first P @ V
    # (sm90/fwd.py clear_stale_v_rows; 128 threads). EPILOGUE_WG_SMEM_FREE's id for that warpgroup,
    # which it uses only after the loop.
    KV_STALE_ROWS = 7


MAX_CONSUMER_WG = 4
assert FwdBarrier.WG_SCHEDULER + MAX_CONSUMER_WG <= FwdBarrier.EPILOGUE_WG_SMEM_FREE
assert FwdBarrier.EPILOGUE_WG_SMEM_FREE + MAX_CONSUMER_WG <= FwdBarrier.EPILOGUE_WG_O_READY
assert FwdBarrier.EPILOGUE_WG_O_READY + MAX_CONSUMER_WG <= 16


class BwdBarrier(enum.IntEnum):
    """The backward kernel's (sm90/bwd.py) barrier ids."""
    # Both consumer warpgroups have written their dS^T rows to shared memory (and fenced):
    # every dQ GEMM reads all of them.
    DS_READY = 1
    # Per dQ part (ids 2, 3): the consumer warpgroup has staged its dQ part for the dQ writer.
    # "keys_roles": per part and Q/dO stage (ids 2-5), so that consecutive query blocks meet
    # different barriers: with "stage" a warpgroup may stage the next block's part before the
    # writer has taken this one, and with two dQ writers (deterministic turns) each writer
    # waits on its own blocks' ids.
    DQ_FULL = 2
    # Per dQ part (ids 8, 9; "tma"): the dQ writer's last reduce-add has read the part's buffer.
    DQ_EMPTY = 8
    # Two dQ writers (deterministic turns, "keys_roles"): the second one's additions have all
    # landed; the first one counts the CTA done after it (64 threads).
    DQ_WRITERS = 10
    # K's and V's buffers are free for dK and dV (every dQ GEMM has read K), then filled.
    EPILOGUE = 6
    # "keys_roles": warpgroup 1 has written a query block's P^T (times the softcap derivative)
    # to shared memory; warpgroup 2 forms dS^T from it. Both roles sync (unaligned) on it, on
    # DS_READY and on EPILOGUE.
    P_READY = 7
