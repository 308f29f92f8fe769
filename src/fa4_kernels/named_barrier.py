"""Named hardware barrier ids (``bar.sync id, count``) used by the forward kernels.

Id 0 is ``__syncthreads``; every other id a kernel uses is listed here so two roles never
share one by accident.
"""
import enum


class FwdBarrier(enum.IntEnum):
    # Consumer threads finished writing O to shared memory (and the TMA-store warp may go).
    EPILOGUE = 1
    # Ping-pong between the two consumer warpgroups: WG k waits on WG_SCHEDULER + k - 1
    # before issuing its GEMMs; the other warpgroup arrives on it after issuing its own.
    WG_SCHEDULER = 2  # 2 and 3
