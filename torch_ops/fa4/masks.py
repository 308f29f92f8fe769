"""Mask constructors for ``fa4.flex_attention`` that are also ordinary FlexAttention mask_mods.

Each constructor returns a callable ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` with the
semantics of torch's FlexAttention (indices from the top-left corner: query ``q_idx`` against key
``kv_idx``), usable with ``torch.nn.attention.flex_attention.create_block_mask`` like any other.
fa4 also reads them as data: ``causal()``, ``sliding_window(...)`` and their ``and_masks``
intersections run fa4's compiled causal / local kernels (forward and backward) whenever the
window fits the kernels' bottom-right-aligned window; ``document(...)`` of contiguous runs runs
its packed-sequence kernels and ``prefix_lm(n)`` two calls merged by their LSEs; the others
(unions, split documents, per-row prefixes, any other mask_mod) run torch's flex_attention for
now, with a one-time warning that says why (``fa4.flex``).

    from fa4 import masks
    block_mask = create_block_mask(masks.and_masks(masks.causal(), masks.sliding_window(1024, 0)),
                                   None, None, L, L)
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch

UNBOUNDED = -1  # a window side without limit (fa4.attention's convention)


class MaskMod:
    # Which of its batch / head indices the mask reads (fa4.block_sparse builds per-index tables
    # there): none, unless a subclass says otherwise. Read from the structure, not traced: under
    # torch.compile on torch 2.11 a frozen dataclass cannot be handed to the traced check.
    def reads_batch_and_head(self) -> tuple[bool, bool]:
        return False, False

    """A FlexAttention mask_mod fa4 can inspect: subclasses hold the mask's parameters."""

    def __call__(self, b, h, q_idx, kv_idx):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __repr__(self) -> str:
        # Plain text (no dataclass repr, whose recursion guard torch.compile cannot trace: torch's
        # vmap prints the mask_mod / score_mod it wraps while create_block_mask or flex traces it).
        return f"fa4.{type(self).__module__.rsplit('.', 1)[-1]}.{type(self).__name__}"


@dataclass(frozen=True, repr=False)
class Causal(MaskMod):
    """Query i sees keys 0..i (top-left aligned, as torch's causal mask_mod)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx


@dataclass(frozen=True, repr=False)
class SlidingWindow(MaskMod):
    """Query i sees keys i - left .. i + right (a side of -1: unbounded)."""

    left: int
    right: int

    def __call__(self, b, h, q_idx, kv_idx):
        seen = torch.ones_like(q_idx >= kv_idx)
        if self.left != UNBOUNDED:
            seen = seen & (kv_idx >= q_idx - self.left)
        if self.right != UNBOUNDED:
            seen = seen & (kv_idx <= q_idx + self.right)
        return seen


@dataclass(frozen=True)
class Packing:
    """A document mask as packed sequences: each document one contiguous run of tokens.
    row_offsets: int32 offsets of the runs of one batch row on the mask_mod's device ((runs + 1,),
    from 0 to seqlen), shared by every row (1-D ids), or of all rows of the batch laid end to
    end ((batch, seqlen) ids: from 0 to batch * seqlen); longest: the longest run."""

    row_offsets: torch.Tensor
    batch_rows: int | None  # rows the offsets cover ((batch, seqlen) ids), None: one row, shared
    longest: int
    # longest rounded up to a power of two: what compiled graphs pass as max_seqlen, so they are
    # specialised on a handful of values rather than on every batch's longest document
    longest_bucket: int
    # Eager calls' offsets for shared ids per (batch, seqlen): made once (three small launches)
    tiled: dict = field(default_factory=dict, compare=False, repr=False)

    def offsets(self, batch: int, seqlen: int) -> torch.Tensor:
        """cu_seqlens of ``batch`` rows of ``seqlen`` tokens packed end to end (no host sync)."""
        if self.batch_rows is not None or batch == 1:
            return self.row_offsets
        compiling = torch.compiler.is_compiling()
        if not compiling and (batch, seqlen) in self.tiled:
            return self.tiled[batch, seqlen]
        starts = self.row_offsets[:-1].unsqueeze(0) + seqlen * torch.arange(
            batch, device=self.row_offsets.device, dtype=torch.int32).unsqueeze(1)
        end = torch.full((1,), batch * seqlen, device=self.row_offsets.device, dtype=torch.int32)
        offsets = torch.cat([starts.reshape(-1), end])
        if not compiling:
            self.tiled[batch, seqlen] = offsets
        return offsets


@dataclass(frozen=True, eq=False, repr=False)
class Document(MaskMod):
    """Query i sees key j of the same document: q_doc_ids[i] == kv_doc_ids[j] (and j <= i with
    causal). Ids are per token (1-D, shared by the batch) or per batch row (2-D). ``packing`` /
    ``kv_packing``: the documents as contiguous runs (fa4's packed-sequence kernels run the mask),
    or None where they are not (a document split into several runs, or query and key runs that
    do not pair up)."""

    q_doc_ids: torch.Tensor
    kv_doc_ids: torch.Tensor
    causal: bool = False
    packing: Packing | None = None  # the queries' runs
    kv_packing: Packing | None = None  # the keys' runs (the same object when the ids are)

    def reads_batch_and_head(self) -> tuple[bool, bool]:
        return self.q_doc_ids.dim() > 1 or self.kv_doc_ids.dim() > 1, False

    def __call__(self, b, h, q_idx, kv_idx):
        q_doc = self.q_doc_ids[q_idx] if self.q_doc_ids.dim() == 1 else self.q_doc_ids[b, q_idx]
        kv_doc = self.kv_doc_ids[kv_idx] if self.kv_doc_ids.dim() == 1 else self.kv_doc_ids[b, kv_idx]
        same = q_doc == kv_doc
        return same & (q_idx >= kv_idx) if self.causal else same


@dataclass(frozen=True, eq=False, repr=False)
class PrefixLM(MaskMod):
    """Keys before prefix_len are seen by every query, the rest causally (prefix_len an int or a
    (batch,) tensor)."""

    prefix_len: int | torch.Tensor

    def reads_batch_and_head(self) -> tuple[bool, bool]:
        return isinstance(self.prefix_len, torch.Tensor), False

    def __call__(self, b, h, q_idx, kv_idx):
        prefix = self.prefix_len[b] if isinstance(self.prefix_len, torch.Tensor) else self.prefix_len
        return (kv_idx < prefix) | (q_idx >= kv_idx)


@dataclass(frozen=True, repr=False)
class And(MaskMod):
    """Keys every part sees."""

    parts: tuple

    def reads_batch_and_head(self) -> tuple[bool, bool]:
        reads = [_reads(part) for part in self.parts]
        return any(r[0] for r in reads), any(r[1] for r in reads)

    def __call__(self, b, h, q_idx, kv_idx):
        return functools.reduce(operator.and_, (part(b, h, q_idx, kv_idx) for part in self.parts))


@dataclass(frozen=True, repr=False)
class Or(MaskMod):
    """Keys any part sees."""

    parts: tuple

    def reads_batch_and_head(self) -> tuple[bool, bool]:
        reads = [_reads(part) for part in self.parts]
        return any(r[0] for r in reads), any(r[1] for r in reads)

    def __call__(self, b, h, q_idx, kv_idx):
        return functools.reduce(operator.or_, (part(b, h, q_idx, kv_idx) for part in self.parts))


def _reads(mask_mod) -> tuple[bool, bool]:
    """reads_batch_and_head of a part: fa4's masks say; any other function is assumed to read both."""
    return mask_mod.reads_batch_and_head() if isinstance(mask_mod, MaskMod) else (True, True)


def causal() -> Causal:
    return Causal()


def sliding_window(left: int, right: int = 0) -> SlidingWindow:
    """Keys from ``left`` before to ``right`` after the query's own index (-1: unbounded)."""
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < UNBOUNDED:
            raise ValueError(f"sliding_window {name} must be an int >= 0, or -1 for unbounded; got {value!r}")
    return SlidingWindow(left, right)


def document(doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor | None = None, *, causal: bool = False,
             device: torch.device | str | None = None) -> Document:
    """Attention within documents given a document id per token, (seqlen,) shared by every batch
    row or (batch, seqlen) (``kv_doc_ids`` for the keys when they differ from the queries');
    ``causal`` also masks later keys. ``device``: where the mask_mod reads the ids (default: where
    they are).

    Where every document is one contiguous run of tokens (the packed-sequence layout), fa4's
    packed-sequence kernels run the mask: the runs are found here, once, reading the ids on the
    host (ids given on the CPU, with ``device="cuda"`` for the mask_mod, cost no device sync).
    With separate key ids, the queries' and the keys' runs must hold the same documents in the
    same order (packed encoder-decoder batches), without ``causal``."""
    same = kv_doc_ids is None or kv_doc_ids is doc_ids
    kv_doc_ids = doc_ids if same else kv_doc_ids
    for name, ids in (("doc_ids", doc_ids), ("kv_doc_ids", kv_doc_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or ids.is_floating_point():
            raise ValueError(f"{name} must be an integer tensor of shape (seqlen,) or (batch, seqlen)")
    target = device or doc_ids.device
    # Finding the runs reads the ids on the host: not inside a compiled graph (a mask made there
    # runs torch's flex_attention instead of a graph break).
    compiling = torch.compiler.is_compiling()
    q_runs = None if compiling else _runs(doc_ids)
    kv_runs = q_runs if same or compiling else _runs(kv_doc_ids)
    packing = kv_packing = None
    paired = q_runs is not None and kv_runs is not None and (same or (
        doc_ids.dim() == kv_doc_ids.dim() and not causal
        and [ids for ids, _ in q_runs] == [ids for ids, _ in kv_runs]))  # the same documents, in order
    if paired:
        packing = _packing(q_runs, doc_ids, target)
        kv_packing = packing if same else _packing(kv_runs, kv_doc_ids, target)
    if device is not None:
        doc_ids = doc_ids.to(device)
        kv_doc_ids = doc_ids if same else kv_doc_ids.to(device)
    return Document(doc_ids, kv_doc_ids, bool(causal), packing, kv_packing)


def _runs(doc_ids: torch.Tensor) -> list[tuple[list[int], list[int]]] | None:
    """Per batch row, the (ids, lengths) of its runs of equal ids; None where a document id
    appears in more than one run of a row."""
    rows = doc_ids.detach().to("cpu", torch.int64)
    runs = []
    for row in rows.unsqueeze(0) if rows.dim() == 1 else rows:
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        if ids.numel() != torch.unique(ids).numel():
            return None  # a document split into several runs
        runs.append((ids.tolist(), counts.tolist()))
    return runs


def _packing(runs, doc_ids: torch.Tensor, device) -> Packing:
    """The Packing of a row's (or every row's) runs, rows laid end to end."""
    offsets, longest = [0], 0
    for _, counts in runs:
        for count in counts:  # a row's runs add up to seqlen: the next row starts at (r + 1) * seqlen
            offsets.append(offsets[-1] + count)
        longest = max([longest] + counts)
    return Packing(torch.tensor(offsets, dtype=torch.int32, device=device),
                   len(runs) if doc_ids.dim() == 2 else None, longest, 1 << max(longest - 1, 0).bit_length())


def prefix_lm(prefix_len: int | torch.Tensor) -> PrefixLM:
    return PrefixLM(prefix_len)


def and_masks(*mask_mods) -> MaskMod:
    """The intersection, as torch's ``and_masks`` (any mask_mods; fa4's stay inspectable)."""
    return _combine(And, mask_mods)


def or_masks(*mask_mods) -> MaskMod:
    """The union, as torch's ``or_masks``."""
    return _combine(Or, mask_mods)


def _combine(kind, mask_mods) -> MaskMod:
    """One ``kind`` (And or Or) of the mask_mods, nested ones of the same kind flattened."""
    _check_callables(mask_mods)
    parts = tuple(p for m in mask_mods for p in (m.parts if isinstance(m, kind) else (m,)))
    return parts[0] if len(parts) == 1 else kind(parts)


def _check_callables(mask_mods) -> None:
    if not mask_mods or not all(callable(m) for m in mask_mods):
        raise ValueError(f"expected one or more callable mask_mods; got {mask_mods!r}")


def split_document(mask) -> tuple[Document | None, MaskMod | None]:
    """(the Document part, the rest) of a mask that is a Document or an intersection holding
    one; (None, mask) otherwise."""
    if isinstance(mask, Document):
        return mask, None
    if isinstance(mask, And):
        docs = [p for p in mask.parts if isinstance(p, Document)]
        if len(docs) == 1:
            rest = tuple(p for p in mask.parts if p is not docs[0])
            return docs[0], (rest[0] if len(rest) == 1 else And(rest))
    return None, mask


def top_left_window(mask) -> tuple[int, int] | None:
    """The (left, right) sliding window (top-left aligned, -1 unbounded) a mask is, when it is
    one: no mask, causal(), sliding_window() and intersections of them; None otherwise."""
    if mask is None:
        return UNBOUNDED, UNBOUNDED
    if isinstance(mask, Causal):
        return UNBOUNDED, 0
    if isinstance(mask, SlidingWindow):
        return mask.left, mask.right
    if isinstance(mask, And):
        left, right = UNBOUNDED, UNBOUNDED
        for part in mask.parts:
            window = top_left_window(part)
            if window is None:
                return None
            left = window[0] if left == UNBOUNDED else (left if window[0] == UNBOUNDED else min(left, window[0]))
            right = window[1] if right == UNBOUNDED else (right if window[1] == UNBOUNDED else min(right, window[1]))
        return left, right
    return None
