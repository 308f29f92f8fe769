"""The ``fa4`` logger (Python logging), its level from FA4_LOG (fa4.settings.log_level).

At debug level every eager CUDA call through the public functions logs what the native operator
launched (fa4._native.last_launch): the variant (its name holds the tile family), the pack-GQA
factor, the tile order's group, the split tail's CTAs; the backward its first-store, rotation
and determinism decisions; where FA4_TILES forced a tile family the call has no variant of, also
why another family ran. Compiled graphs call the operators directly and log nothing per call.
"""
from __future__ import annotations

import logging
import re

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
        why = forced_family_not_run(record["name"])
        if why:
            logger.debug("fwd %s: %s", shapes, why)
    else:
        logger.debug("bwd %s: %s, first store %d, rotate %d, deterministic %d, launch group %d", shapes,
                     record["name"], record["store_first"], record["rotate"], record["deterministic"],
                     record["launch_group"])
        why = clusters_not_run(record)
        if why:
            logger.debug("bwd %s: %s", shapes, why)


def tile_family_of(variant_name: str) -> str:
    """The tile family in a variant's name (fa4_kernels.catalog names the extra families
    ``_<family>seq``, the backward's 2-CTA clusters "long"; the regular one has no suffix)."""
    found = re.search(r"_([a-z]+)seq(?:_|$)", variant_name)
    return found.group(1) if found else "regular"


def clusters_not_run(record: dict) -> str | None:
    """Why a backward launch ran without 2-CTA clusters where they were asked for, or None: the
    device did not hold enough of them at once (the 1-CTA twin ran: fa4.heuristics.clusters_fit), or
    FA4_BWD_CLUSTERS=1 forced them on a call no cluster kernel serves (head_dim 256, dense, no
    softcap, causal or a window, not deterministic; or this build left it out)."""
    from fa4 import heuristics

    if tile_family_of(record["name"]) == "long":
        return None
    if record["active_clusters"] >= 0:
        return (f"the device holds {record['active_clusters']} of the cluster kernel's clusters at once, too few: "
                f"{record['name']} (one CTA per block) ran")
    if heuristics.tuning()["bwd_clusters"]:
        return f"FA4_BWD_CLUSTERS=1: no cluster kernel for this call, so {record['name']} ran"
    return None


def forced_family_not_run(variant_name: str) -> str | None:
    """Why a forward launch ran another tile family than FA4_TILES asks for, or None: the family
    is not built for that call (the short tiles exist for hd64, the long ones for hd128, dense
    and without a window) or this build left it out (FA4_VARIANTS)."""
    from fa4 import heuristics

    forced = heuristics.tuning()["tiles"]
    ran = tile_family_of(variant_name)
    if forced is None or forced == ran:
        return None
    return f"FA4_TILES={forced}: no such variant for this call, so {variant_name} ({ran} tiles) ran"
