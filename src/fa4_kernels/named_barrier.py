"""Named hardware barrier ids (``bar.sync id, count``) used by the forward kernels.

Id 0 is ``__syncthreads``; every other id a kernel uses is listed here so two roles never
share one by accident.
"""
import enum


class FwdBarrier(enum.IntEnum):
    # All consumer threads are done with the previous use of the O staging buffer (and, when it
    # aliases Q, with their last Q @ K^T) before anyone writes O into it.
    EPILOGUE_SMEM_FREE = 1
    # O is in shared memory (and fenced): the storing warp may issue the TMA store.
    EPILOGUE_O_READY = 2
    # Dynamic scheduling: the producer warp published the next tile index in shared memory /
    # the consumers have read it (producer warp + all consumer warpgroups).
    TILE_SLOT_FULL = 3
    TILE_SLOT_EMPTY = 4
    # Round-robin of the consumer warpgroups' GEMM issue (ping-pong for two): WG k waits on
    # WG_SCHEDULER + k before issuing its GEMMs; the warpgroup before it arrives on it after
    # issuing its own. Ids 5, 6 (and 7 with three consumer warpgroups).
    WG_SCHEDULER = 5
