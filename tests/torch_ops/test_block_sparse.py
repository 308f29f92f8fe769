"""fa4.block_sparse on the CPU: a BlockMask's tables at kernel tiles of any shape describe
exactly FlexAttention's mask (full blocks visible, partial ones the mask_mod's, empty ones and
the sequences' tails not), whatever the BlockMask's block sizes; tiles that see nothing visit
the all-clear slot; the CPU operator computes attention over that mask."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from fa4 import block_sparse


def flex_semantics(block_mask, mod, batch, heads, sq, sk):
    """(batch, heads, sq, sk) bool: the keys FlexAttention lets each query see."""
    b, h, q, kv = [torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate((batch, heads, sq, sk))]
    bq, bk = block_mask.BLOCK_SIZE
    kind = block_sparse._block_kinds(block_mask)[:, :, q.view(sq, 1) // bq, kv.view(1, sk) // bk]
    return ((kind == 2) | ((kind == 1) & mod(b, h, q, kv))).expand(batch, heads, sq, sk)


def random_mod(sq, sk, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(sq // 8 + 1, sk // 8 + 1, generator=g) < 0.6
    return lambda b, h, q, kv: keep[q // 8, kv // 8] & ((q * 5 + kv * 3 + h) % 4 != 0)


@pytest.mark.parametrize("sq,sk,block,tile", [
    (100, 77, 16, (16, 32)), (77, 100, (16, 32), (32, 32)), (65, 130, 32, (64, 32)), (33, 200, (8, 16), (16, 64)),
    (128, 128, 64, (32, 32)),
])
def test_tables_describe_flex_semantics_at_any_tile(sq, sk, block, tile):
    mod = random_mod(sq, sk, sq * sk)
    block_mask = create_block_mask(mod, None, 2, sq, sk, device="cpu", BLOCK_SIZE=block)
    tables = block_sparse.build_tables(block_mask, 3, 2, tile)
    assert tables.counts.shape == (3, 2, -(-sq // tile[0]), block_sparse.COUNT_FIELDS)
    assert tables.counts.stride(0) == 0
    assert torch.equal(block_sparse.dense_mask(tables, sq, sk), flex_semantics(block_mask, mod, 3, 2, sq, sk))
    partial, total, first, order = tables.counts.unbind(-1)
    assert torch.all((1 <= total) & (partial <= total))
    # The schedule: each row's tiles, a permutation, the ones visiting more blocks first.
    assert torch.equal(order.sort(-1).values, torch.arange(order.shape[-1]).expand_as(order))
    scheduled = total.gather(-1, order.long())
    assert torch.all(scheduled[..., :-1] >= scheduled[..., 1:])
    slots = tables.bits.view(-1, tile[0], tile[1] // 32)
    assert torch.all(slots[0] == 0)  # the all-clear slot of tiles that see nothing
    # A tile that sees no key visits one block through slot 0; the others' slots follow in order.
    seen = block_sparse.dense_mask(tables, sq, sk).reshape(3, 2, -1).any(-1).any(-1)
    assert seen.all()
    assert int(first.max() + partial[first == first.max()].max()) <= slots.shape[0]


def test_rows_that_see_nothing_and_key_tails():
    """Keys past seqlen_k are never visible (a tile reaching past them is partial); a query tile
    whose rows see nothing lists one partial block of slot 0."""
    mod = lambda b, h, q, kv: q >= 32  # noqa: E731  rows 0-31 see nothing
    block_mask = create_block_mask(mod, None, None, 64, 40, device="cpu", BLOCK_SIZE=32)
    tables = block_sparse.build_tables(block_mask, 1, 1, (32, 32))
    assert tables.counts[0, 0, 0, :3].tolist() == [1, 1, 0]
    assert tables.counts[0, 0, 1, :2].tolist() == [1, 2]  # block 0 full, block 1 partial (keys 32-39 of 64)
    assert tables.counts[0, 0, :, 3].tolist() == [1, 0]  # the tile with two blocks first
    assert tables.blocks[0, 0, 1].tolist() == [1, 0]  # partial blocks first
    dense = block_sparse.dense_mask(tables, 64, 40)
    assert not dense[0, 0, :32].any() and dense[0, 0, 32:].all()


def test_cpu_operator_matches_a_dense_float64_formula():
    sq, sk = 70, 90
    mod = random_mod(sq, sk, 1)
    block_mask = create_block_mask(mod, None, 4, sq, sk, device="cpu", BLOCK_SIZE=16)
    tables = block_sparse.build_tables(block_mask, 2, 4, (32, 32))
    q = torch.randn(2, sq, 4, 16, dtype=torch.float64)
    k, v = (torch.randn(2, sk, 2, 16, dtype=torch.float64) for _ in range(2))
    out, lse = torch.ops.fa4.fwd_sparse(q, k, v, *tables[:3], 32, 32, 0.3, 5.0)
    visible = flex_semantics(block_mask, mod, 2, 4, sq, sk)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 0.3
    s = (5.0 * torch.tanh(s / 5.0)).masked_fill(~visible, float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    p = torch.exp(s - want_lse[..., None]).nan_to_num(0.0)
    want = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(2, 2))
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse.float().double(), atol=1e-6, rtol=1e-6)


def test_operator_names_the_table_it_rejects():
    q = torch.randn(1, 10, 2, 16)
    k = v = torch.randn(1, 10, 2, 16)
    counts, blocks = torch.zeros(1, 2, 1, 4, dtype=torch.int32), torch.zeros(1, 2, 1, 1, dtype=torch.int32)
    bits = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_counts must have shape"):
        torch.ops.fa4.fwd_sparse(q, k, v, counts[:, :1], blocks, bits, 32, 32, 1.0)
    with pytest.raises(TypeError, match="kv_blocks must be a 4-D torch.int32"):
        torch.ops.fa4.fwd_sparse(q, k, v, counts, blocks.long(), bits, 32, 32, 1.0)
    with pytest.raises(ValueError, match="whole slots"):
        torch.ops.fa4.fwd_sparse(q, k, v, counts, blocks, bits[:5], 32, 32, 1.0)


def test_block_sparse_tables_follow_the_batch_and_head_indices_the_mask_reads():
    """Tables are per batch row / head only along the dimensions a broadcasting BlockMask's
    mask_mod reads (traced), so its partial blocks see the call's indices, as in torch's kernels:
    FlexAttention's semantics, full blocks all visible, partial ones the mask_mod's."""
    keep = torch.tensor([[True, False], [True, True]])
    mods = {
        (False, False): lambda b, h, q, kv: keep[q // 16, kv // 16] & ((q + kv) % 3 != 0),
        (True, False): lambda b, h, q, kv: (kv <= q + b),
        (False, True): lambda b, h, q, kv: (q + kv + h) % 2 == 0,
    }
    for reads, mod in mods.items():
        assert block_sparse._reads_batch_and_head(mod, "cpu") == reads
        block_mask = create_block_mask(mod, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
        tables = block_sparse.build_tables(block_mask, 3, 2, (16, 32))
        dense = block_sparse.dense_mask(tables, 32, 32)
        b, h, q, kv = [torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate((3, 2, 32, 32))]
        kind = block_sparse._block_kinds(block_mask)[:, :, q.view(32, 1) // 16, kv.view(1, 32) // 16]
        want = (kind == 2) | ((kind == 1) & mod(b, h, q, kv))
        assert torch.equal(dense, want.expand(3, 2, 32, 32))


def test_eager_builds_trace_each_mask_mod_once(monkeypatch):
    """Eager builds ask _reads_batch_and_head once per mask_mod and device (its trace dominated a
    build); a function that is gone leaves the cache, and one that cannot be cached is traced."""
    import gc

    calls = []
    trace = block_sparse._reads_batch_and_head
    monkeypatch.setattr(block_sparse, "_reads_batch_and_head", lambda m, d: calls.append(d) or trace(m, d))

    def mod(b, h, q, kv):
        return (q + kv + h) % 2 == 0

    for _ in range(3):
        assert block_sparse._mask_reads(mod, "cpu") == (False, True)
    assert calls == ["cpu"] and mod in block_sparse._READS
    del mod
    gc.collect()
    assert not any(getattr(m, "__name__", "") == "mod" for m in block_sparse._READS)

    class Unhashable:
        __hash__ = None

        def __call__(self, b, h, q, kv):
            return kv <= q + b

    unhashable = Unhashable()
    assert [block_sparse._mask_reads(unhashable, "cpu") for _ in range(2)] == [(True, False)] * 2
    assert calls == ["cpu"] * 3


def test_table_layout_agrees_with_the_kernels_and_the_native_checks():
    """One layout of the counts table: the runtime's, the kernels' (fa4_kernels.block_info) and
    the native checks' (FA4_SPARSE_COUNT_FIELDS in csrc_shims/fa4_shim.h)."""
    import re
    from pathlib import Path

    from fa4_kernels import block_info

    header = (Path(__file__).resolve().parents[2] / "csrc_shims" / "fa4_shim.h").read_text()
    native = int(re.search(r"#define FA4_SPARSE_COUNT_FIELDS (\d+)", header).group(1))
    assert block_sparse.COUNT_FIELDS == block_info.SPARSE_COUNT_FIELDS == native
    assert block_info.SPARSE_ORDER == native - 1
    from fa4_kernels import mask

    assert block_sparse.BITS_PER_WORD == mask.BITS_PER_WORD  # the bitmask's packing


def test_fa4_masks_say_which_indices_they_read_as_a_trace_finds():
    """fa4.masks' mask_mods state which of the batch / head indices they read (no trace: under
    torch.compile on torch 2.11 they cannot be handed to it); the statement agrees with the trace."""
    from fa4 import masks

    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    cases = [masks.causal(), masks.sliding_window(3, 1), masks.prefix_lm(4), masks.prefix_lm(torch.tensor([2, 3])),
             masks.document(ids), masks.document(torch.stack([ids, ids.flip(0)]), causal=True),
             masks.and_masks(masks.causal(), masks.prefix_lm(torch.tensor([1, 5]))),
             masks.or_masks(masks.causal(), masks.sliding_window(0, 2))]
    for mod in cases:
        assert mod.reads_batch_and_head() == block_sparse._reads_batch_and_head(mod, "cpu"), mod
    custom = masks.and_masks(masks.causal(), lambda b, h, q, kv: q != kv)
    assert custom.reads_batch_and_head() == (True, True)  # functions of its own: assumed to read both


def test_full_blocks_crossing_the_last_key_become_partial():
    """A BlockMask's own full block may reach past seqlen_k (BlockMask.from_kv_blocks): its kernel
    tiles are partial, with the bits past the keys clear (a full tile would attend to the padding
    keys the kernel loads as zeros)."""
    from torch.nn.attention.flex_attention import BlockMask

    sq, sk = 200, 300
    full = torch.arange(3, dtype=torch.int32).expand(1, 1, 2, 3).contiguous()
    block_mask = BlockMask.from_kv_blocks(torch.zeros(1, 1, 2, dtype=torch.int32), torch.zeros_like(full),
                                          torch.full((1, 1, 2), 3, dtype=torch.int32), full, BLOCK_SIZE=128,
                                          seq_lengths=(sq, sk))
    for tile, transposed in (((128, 128), False), ((128, 64), False), ((64, 128), True)):
        tables = block_sparse.build_tables(block_mask, 1, 2, tile, transposed)
        padded = block_sparse.dense_mask(tables, sq, 384)
        assert padded[..., :sk].all() and not padded[..., sk:].any(), (tile, transposed)
