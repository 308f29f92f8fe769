"""The run-time FA4_* environment variables Python reads (see the README).

The tuning and trace settings the native operators apply per call (FA4_L2_SWIZZLE_MB,
FA4_PERSISTENT, FA4_TILES, FA4_SPLIT_TAIL, FA4_BWD_STORE_FIRST, FA4_BWD_ROTATE, FA4_BWD_LAUNCH_GROUP,
FA4_BWD_CLUSTERS, FA4_BWD_TURN_SPACING, FA4_BWD_DQ_WRITERS, FA4_TRACE, FA4_TRACE_SCHEDULE) are read in
one C function, ``fa4_read_tuning`` (csrc_shims/fa4_rules.c). Build-time variables (FA4_ARCHS, FA4_VARIANTS,
FA4_BUILD_JOBS, FA4_TRACE_VARIANTS, ...) belong to the build driver, ``fa4_kernels.aot.env_settings``.
"""
import os


def native_disabled() -> bool:
    """FA4_DISABLE_NATIVE=1 (read when fa4 is imported): never call the compiled kernels (CUDA
    inputs raise instead)."""
    return os.environ.get("FA4_DISABLE_NATIVE", "") == "1"


def reference_chunk_bytes() -> int:
    """FA4_REF_CHUNK_MB: working-set budget of the chunked torch reference/backward (default 256)."""
    return int(float(os.environ.get("FA4_REF_CHUNK_MB", "256")) * 2**20)


LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level() -> str | None:
    """FA4_LOG=debug/info/warning/error (read when fa4 is imported): the level of the ``fa4``
    logger (fa4.log); at debug every eager CUDA call logs the variant, tile family, pack-GQA
    factor and split decision it launched with. Unset: the logger is left as Python's logging
    configures it."""
    value = os.environ.get("FA4_LOG", "").strip().lower()
    if value and value not in LOG_LEVELS:
        raise ValueError(f"FA4_LOG must be one of {', '.join(LOG_LEVELS)}; got {value!r}")
    return value or None
