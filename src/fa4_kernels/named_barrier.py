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
    # Ping-pong between the two consumer warpgroups: WG k waits on WG_SCHEDULER + k before
    # issuing its GEMMs; the other warpgroup arrives on it after issuing its own.
    WG_SCHEDULER = 3  # 3 and 4
    # Dynamic scheduling: the producer warp published the next tile index in shared memory /
    # the consumers have read it (producer warp + both consumer warpgroups).
    TILE_SLOT_FULL = 5
    TILE_SLOT_EMPTY = 6
