"""Scheduler timelines: which SM ran which tile of a forward call, and when.

Record::

    with fa4.trace("run.jsonl"):             # or FA4_TRACE=run.jsonl in the environment
        fa4.attention(q, k, v, causal=True)
    with fa4.trace("static.jsonl", schedule="static"):
        fa4.attention(q, k, v, causal=True)  # the same tiles dealt round-robin

Render::

    python -m fa4.trace run.jsonl --png run.png

While ``FA4_TRACE`` names a file, each eager CUDA forward (dense, packed, KV cache) runs the trace
twin of its kernel, which writes one record per tile (or split-tail piece): the SM and CTA, the
tile's coordinates and K/V block range, and ``%globaltimer`` nanoseconds at its start, when its
Q and its first K block had landed and at its end, and when its CTA entered the kernel
(``src/fa4_kernels/trace.py``). The operator then waits for the kernel and appends one JSON line
per call to the file. Production kernels carry none of this.
The wheel ships trace twins for bf16 head_dim 64 and 128 without a mask or causal (every tile
family); other calls run untraced and say so in the file; a build with
``FA4_TRACE_VARIANTS=all`` traces every dense, packed and KV-cache forward. Calls captured into
a CUDA graph run untraced (reading the records back waits for the kernel).

``FA4_TRACE_SCHEDULE=static`` (``schedule="static"``) makes dynamically scheduled kernels
(causal, local, packed sequences) deal their tiles round-robin in the same order (CTA c takes
tiles c, c + grid, ...) instead of claiming the next one from a counter: the static schedule to
compare with. Kernels scheduled statically (no mask) split their last round as usual.

The environment variables are process-wide: ``fa4.trace`` sets them for its ``with`` block.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import types
from dataclasses import dataclass

_TRACE, _SCHEDULE = "FA4_TRACE", "FA4_TRACE_SCHEDULE"
SCHEDULES = ("static", "dynamic")


@contextlib.contextmanager
def recording(path: str | os.PathLike, schedule: str | None = None):
    """Trace the eager CUDA forwards of the ``with`` block into ``path`` (appended, one JSON line
    per call). ``schedule="static"``: dynamically scheduled kernels deal their tiles round-robin."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} or None; got {schedule!r}")
    saved = {name: os.environ.get(name) for name in (_TRACE, _SCHEDULE)}
    os.environ[_TRACE] = os.fspath(path)
    if schedule is None:
        os.environ.pop(_SCHEDULE, None)
    else:
        os.environ[_SCHEDULE] = schedule
    try:
        yield os.fspath(path)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Tile:
    """One record: a tile (or a split-tail piece) as one SM ran it; times in ns of the GPU's
    global timer."""
    sm: int
    cta: int
    cursor: int
    m_block: int
    head: int
    batch: int
    n_block_min: int
    n_block_max: int
    flags: frozenset
    start: int
    q_ready: int  # its Q had landed
    blocks_done: int  # its last P @ V had completed
    end: int
    partials_ready: int | None = None  # a split tile's merger: every writer's partial visible
    merged: int | None = None  # ... and folded in, before the epilogue
    entry: int | None = None  # its CTA entered the kernel (files from builds before this field: None)
    k_ready: int | None = None  # its first K block had landed, seen after Q (None likewise)
    # Its CTA's way to its first tile (None likewise): the shared-memory set-up done, the consumer
    # warpgroup in its role, the first tile's schedule arithmetic done (then the grid wait).
    setup: int | None = None
    consume: int | None = None
    pre_wait: int | None = None


def _after(start: int, low: int) -> int:
    """The time whose low 32 bits are ``low``, at or after ``start`` (less than 2^32 ns later)."""
    return start + ((low - start) & 0xFFFFFFFF)


def _before(start: int, low: int) -> int:
    """The time whose low 32 bits are ``low``, at or before ``start`` (less than 2^32 ns earlier)."""
    return start - ((start - low) & 0xFFFFFFFF)


def decode(call: dict) -> list[Tile]:
    """The records of one traced call (a line of the file) as Tiles."""
    index = {name: i for i, name in enumerate(call["fields"])}
    tiles = []
    for r in call["records"]:
        start = ((r[index["start_hi"]] & 0xFFFFFFFF) << 32) | (r[index["start_lo"]] & 0xFFFFFFFF)
        flags = frozenset(name for name, bit in call["flags"].items() if r[index["flags"]] & bit)
        at = lambda field: _after(start, r[index[field]])  # noqa: E731
        merger = "split_merger" in flags
        tiles.append(Tile(r[index["sm"]], r[index["cta"]], r[index["cursor"]], r[index["m_block"]], r[index["head"]],
                          r[index["batch"]], r[index["n_block_min"]], r[index["n_block_max"]], flags, start,
                          at("q_ready_lo"), at("blocks_done_lo"), at("end_lo"),
                          at("partials_ready_lo") if merger else None, at("merged_lo") if merger else None,
                          *(_before(start, r[index[f]]) if f in index else None for f in ("entry_lo",)),
                          at("k_ready_lo") if "k_ready_lo" in index else None,
                          *(_before(start, r[index[f]]) if f in index else None
                            for f in ("setup_lo", "consume_lo", "pre_wait_lo"))))
    return tiles


def load(path: str | os.PathLike) -> list[dict]:
    """Every call in a trace file, in order; traced ones carry their decoded ``tiles``."""
    calls = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            call = json.loads(line)
            if call.get("fa4_trace") != 1:
                raise ValueError(f"{path}:{number}: not an fa4 trace line")
            if "records" in call:
                call["tiles"] = decode(call)
            calls.append(call)
    return calls


def stolen(call: dict, tile: Tile) -> bool:
    """A dynamically claimed tile that the round-robin deal would have given another CTA."""
    return "dynamic" in tile.flags and "dealt" not in tile.flags and tile.cursor % call["grid"] != tile.cta


def summary(call: dict) -> dict:
    """Makespan, how busy the SMs were, the idle tail and per-SM extremes of one traced call (us)."""
    tiles = call["tiles"]
    if not tiles:
        return {"tiles": 0}
    t0, t1 = min(t.start for t in tiles), max(t.end for t in tiles)
    per_sm: dict[int, list[Tile]] = {}
    for t in tiles:
        per_sm.setdefault(t.sm, []).append(t)
    finish = sorted(max(t.end for t in ts) for ts in per_sm.values())
    busy = sum(t.end - t.start for t in tiles)
    span = max(t1 - t0, 1)
    return {
        "tiles": len(tiles),
        "sms": len(per_sm),
        "makespan_us": span / 1e3,
        # Time the SMs spent inside tiles over what all num_sms could have in the makespan.
        "busy": busy / (span * call["num_sms"]),
        # From the first SM to run out of work to the end: the schedule's tail.
        "tail_us": (t1 - finish[0]) / 1e3,
        "median_sm_finish_us": (finish[len(finish) // 2] - t0) / 1e3,
        "q_wait_us_mean": sum(t.q_ready - t.start for t in tiles) / len(tiles) / 1e3,
        **({"k_wait_us_mean": sum(t.k_ready - t.start for t in tiles) / len(tiles) / 1e3}
           if all(t.k_ready is not None for t in tiles) else {}),
        # From the last P @ V to the end: the epilogue, or a split piece's partial store or merge.
        "after_blocks_us_mean": sum(t.end - t.blocks_done for t in tiles) / len(tiles) / 1e3,
        "stolen": sum(stolen(call, t) for t in tiles),
        "split_pieces": sum(bool(t.flags & {"split_writer", "split_merger"}) for t in tiles),
        # Split tiles' mergers: waiting for the writers' partials, then folding them in.
        **_merges(tiles),
        **_entries(tiles),
        "dropped": call.get("dropped", 0),
    }


def _entries(tiles: list[Tile]) -> dict:
    """From the CTAs' kernel entry to their first tile's start (the shared-memory set-up, the wait
    for the previous grid, the first tile's schedule arithmetic), how far apart the CTAs entered,
    and from the first entry to the last tile's end."""
    first: dict[int, Tile] = {}
    for t in tiles:
        if t.entry is not None and (t.cta not in first or t.start < first[t.cta].start):
            first[t.cta] = t
    if not first:
        return {}
    entries = [t.entry for t in first.values()]
    out = {"prologue_us_mean": sum(t.start - t.entry for t in first.values()) / len(first) / 1e3,
           "entry_spread_us": (max(entries) - min(entries)) / 1e3,
           "entry_to_end_us": (max(t.end for t in tiles) - min(entries)) / 1e3}
    if all(t.pre_wait is not None for t in first.values()):
        # The prologue's parts: set-up, entering the role, the first tile's schedule, the grid wait.
        points = ("entry", "setup", "consume", "pre_wait", "start")
        for name, (a, b) in zip(("setup", "role", "schedule", "grid_wait"), zip(points, points[1:])):
            out[f"{name}_us_mean"] = sum(getattr(t, b) - getattr(t, a) for t in first.values()) / len(first) / 1e3
    return out


def _merges(tiles: list[Tile]) -> dict:
    mergers = [t for t in tiles if t.merged is not None]
    if not mergers:
        return {}
    return {"merge_wait_us_mean": sum(t.partials_ready - t.blocks_done for t in mergers) / len(mergers) / 1e3,
            "merge_us_mean": sum(t.merged - t.partials_ready for t in mergers) / len(mergers) / 1e3}


def describe(call: dict) -> str:
    shape = (f"batch {call['batch']} x {call['seqlen_q']}/{call['seqlen_k']} tokens, heads {call['heads_q']}/"
             f"{call['heads_kv']}, hd {call['head_dim']}")
    return f"#{call['call']} {call['op']} {call['mask']}, {shape}, {call['schedule']} schedule, grid {call['grid']}"


# -------------------------------------------------------------------------------- rendering
def render(calls: list[dict], png: str | os.PathLike, dpi: int = 110) -> None:
    """One per-SM timeline per traced call, stacked: a bar per tile from its start to its end,
    coloured by (batch, head); ticks where its Q had landed and where its last P @ V was done;
    hatched where the tile was stolen (dynamic claims that the round-robin deal would have given
    another CTA), edged for split pieces (dashed: a writer, solid: the merger, with a line from
    the writers' partials being ready to their being folded in)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(f"rendering needs matplotlib (pip install 'fa4[plot]'): {error}") from None
    traced = [c for c in calls if c.get("tiles")]
    if not traced:
        raise SystemExit("no traced call with records to render")
    height = 2.5 + 0.04 * max(c["num_sms"] for c in traced)  # per call: ~0.04 inch per SM row
    fig, axes = plt.subplots(len(traced), 1, figsize=(14, height * len(traced)), squeeze=False)
    palette = plt.get_cmap("tab20").colors
    for ax, call in zip(axes[:, 0], traced):
        tiles = call["tiles"]
        t0 = min(t.start for t in tiles)
        pairs = sorted({(t.batch, t.head) for t in tiles})
        colour = {pair: palette[i % len(palette)] for i, pair in enumerate(pairs)}
        for t in tiles:
            left, width = (t.start - t0) / 1e3, max(t.end - t.start, 1) / 1e3
            split = t.flags & {"split_writer", "split_merger"}
            ax.barh(t.sm, width, left=left, height=0.85, color=colour[(t.batch, t.head)],
                    hatch="///" if stolen(call, t) else None, edgecolor="black" if split else "none",
                    linestyle="--" if "split_writer" in t.flags else "-", linewidth=0.6 if split else 0)
            for mark in (t.q_ready, t.blocks_done):
                ax.plot([(mark - t0) / 1e3] * 2, [t.sm - 0.42, t.sm + 0.42], color="black", linewidth=0.4)
            if t.merged is not None:  # the merger folding the writers' partials in
                ax.plot([(t.partials_ready - t0) / 1e3, (t.merged - t0) / 1e3], [t.sm, t.sm], color="black",
                        linewidth=1.2)
        s = summary(call)
        ax.set_title(f"{describe(call)}\n{call['variant']}: {s['tiles']} tiles, makespan {s['makespan_us']:.1f} us, "
                     f"SMs busy {100 * s['busy']:.0f}%, tail {s['tail_us']:.1f} us, stolen {s['stolen']}, "
                     f"split pieces {s['split_pieces']}", fontsize=9)
        ax.set_xlabel("us since the first tile started")
        ax.set_ylabel("SM")
        ax.set_ylim(-1, call["num_sms"])
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4.trace", description="Summarise and render an fa4 trace file "
                                     "(FA4_TRACE / fa4.trace): per call, the SMs' timeline of tiles.")
    parser.add_argument("path", help="the trace file (JSON lines)")
    parser.add_argument("--png", help="write the timelines of the selected calls to this image")
    parser.add_argument("--calls", type=int, nargs="*", help="call numbers to render (default: every traced call)")
    parser.add_argument("--dpi", type=int, default=110, help="the image's resolution (default 110)")
    args = parser.parse_args(argv)
    calls = load(args.path)
    if args.calls:
        calls = [c for c in calls if c["call"] in args.calls]
    for call in calls:
        if "untraced" in call:
            print(f"#{call['call']} {call['op']} {call['variant']}: untraced ({call['untraced']})")
            continue
        s = summary(call)
        print(f"{describe(call)}: {call['variant']}")
        print("    " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()))
    if args.png:
        render(calls, args.png, args.dpi)
        print(f"wrote {args.png}")
    return 0


class _CallableModule(types.ModuleType):
    """``fa4.trace(path)`` is ``fa4.trace.recording(path)``: the module is also the context manager,
    so ``python -m fa4.trace`` and ``with fa4.trace(...)`` share one name."""

    def __call__(self, path, schedule=None):
        return recording(path, schedule)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
