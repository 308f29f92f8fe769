"""The ``fa4`` logger (Python logging), its level from FA4_LOG (fa4.settings.log_level).

At debug level every eager CUDA call through the public functions logs what the native operator
launched (fa4._native.last_launch): the variant (its name holds the tile family), the pack-GQA
factor, the tile order's group, the split tail's CTAs; the backward its first-store, rotation
and determinism decisions. Compiled graphs call the operators directly and log nothing per call.
"""
from __future__ import annotations

import logging

from fa4 import settings

logger = logging.getLogger("fa4")


def configure() -> None:
    level = settings.log_level()
    if level is None:
        return
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def debug_enabled() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


def launched(kind: str, shapes: str) -> None:
    """Log the last ``kind`` ("fwd" or "bwd") launch on this thread, for a call on ``shapes``."""
    from fa4 import _native

    record = _native.last_launch(kind)
    if record is None:
        return
    if kind == "fwd":
        logger.debug("fwd %s: %s, pack_gqa %d, heads per L2 group %d, grid %d, split tail %d CTAs", shapes,
                     record["name"], record["pack_gqa"], record["heads_per_group"], record["grid"],
                     record["tail_ctas"])
    else:
        logger.debug("bwd %s: %s, first store %d, rotate %d, deterministic %d", shapes, record["name"],
                     record["store_first"], record["rotate"], record["deterministic"])
