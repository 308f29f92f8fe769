"""Traced forwards (fa4.trace, FA4_TRACE): the trace twins compute what the production kernels do,
bit for bit, and record every tile (or split piece) exactly once with sane coordinates, SMs and
times; calls that cannot be traced run untraced and say why."""
import math

import pytest
import torch

import fa4
from fa4 import _native
from fa4 import trace as fa4_trace

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]


def require_trace_twins():
    try:
        names = {v["name"] for v in _native.manifest()["variants"]}
    except Exception:  # noqa: BLE001
        names = set()
    if "fa4_fwd_sm_90a_bf16_d128x128_causal_trace" not in names:
        pytest.skip("this build has no trace twins")


def traced(tmp_path, fn, schedule=None):
    """fn() run untraced and traced: (untraced result, traced result, the calls the file got)."""
    require_trace_twins()
    plain = fn()
    path = tmp_path / "trace.jsonl"
    with fa4.trace(path, schedule=schedule):
        result = fn()
    return plain, result, fa4_trace.load(path)


def check_records(call):
    tiles = call["tiles"]
    assert tiles and call["dropped"] == 0
    for t in tiles:
        assert 0 <= t.sm < call["num_sms"] and 0 <= t.cta < call["grid"]
        assert t.start <= t.q_ready <= t.end and t.end - t.start < 10**9  # under a second
        assert 0 <= t.n_block_min < t.n_block_max
    s = fa4_trace.summary(call)
    assert 0 < s["busy"] <= 1 and s["makespan_us"] > 0
    return tiles


def qkv(b, s, h, d, dtype=torch.bfloat16, hkv=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, s, h if i == 0 else (hkv or h), d, device="cuda", dtype=dtype, generator=gen)
            for i in range(3))


@pytest.mark.parametrize("schedule", [None, "static"])
def test_causal_tiles_each_recorded_once(tmp_path, schedule):
    b, s, h, d = 2, 1000, 4, 128
    q, k, v = qkv(b, s, h, d)
    plain, out, calls = traced(tmp_path, lambda: fa4.attention(q, k, v, causal=True), schedule)
    assert torch.equal(plain, out)  # the same kernel; dealing tiles differently changes no tile's math
    assert len(calls) == 1
    call = calls[0]
    assert call["variant"].endswith("_trace") and call["op"] == "fwd" and call["mask"] == "causal"
    assert call["schedule"] == ("dealt" if schedule == "static" else "dynamic")
    tiles = check_records(call)
    m_blocks = math.ceil(s / call["tile_m"])
    assert sorted((t.batch, t.head, t.m_block) for t in tiles) == [
        (bi, hi, m) for bi in range(b) for hi in range(h) for m in range(m_blocks)]
    for t in tiles:
        assert "dynamic" in t.flags and ("dealt" in t.flags) == (schedule == "static")
        # causal: a tile sees the K/V blocks up to its last row's diagonal
        last_row = min((t.m_block + 1) * call["tile_m"], s)
        assert (t.n_block_min, t.n_block_max) == (0, math.ceil(last_row / call["tile_n"]))
        if schedule == "static":
            assert t.cursor % call["grid"] == t.cta  # dealt round-robin
    firsts = {}
    for t in sorted(tiles, key=lambda t: t.start):
        firsts.setdefault(t.cta, t)
    assert all(t.cursor == cta for cta, t in firsts.items())  # every CTA starts on its own block index


def test_split_tail_pieces_cover_each_tile(tmp_path):
    b, s, h, d = 1, 1000, 4, 128  # 32 equal tiles on 132 SMs: the whole round is split
    q, k, v = qkv(b, s, h, d, seed=1)
    plain, out, calls = traced(tmp_path, lambda: fa4.attention(q, k, v))
    assert torch.equal(plain, out)
    call = calls[0]
    assert call["schedule"] == "static" and call["tail_ctas"] > 0
    tiles = check_records(call)
    n_blocks = math.ceil(s / call["tile_n"])
    pieces = {}
    for t in tiles:
        pieces.setdefault((t.batch, t.head, t.m_block), []).append(t)
    assert len(pieces) == b * h * math.ceil(s / call["tile_m"])
    for parts in pieces.values():
        ranges = sorted((p.n_block_min, p.n_block_max) for p in parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == n_blocks
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))  # no gap, no overlap
        if len(parts) > 1:
            assert sum("split_merger" in p.flags for p in parts) == 1
            assert sum("split_writer" in p.flags for p in parts) == len(parts) - 1
            merger = next(p for p in parts if "split_merger" in p.flags)
            assert merger.end >= max(p.end for p in parts if p is not merger)  # it waited for the writers
    assert fa4_trace.summary(call)["split_pieces"] > 0


def test_packed_sequences_carry_their_offsets(tmp_path):
    lengths = [3000, 100, 200, 57]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    total, h, d = sum(lengths), 4, 128
    q, k, v = (x[0] for x in qkv(1, total, h, d, seed=2))
    run = lambda: fa4.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)  # noqa: E731
    plain, out, calls = traced(tmp_path, run)
    assert torch.equal(plain, out)
    call = calls[0]
    assert call["op"] == "fwd_varlen" and call["cu_seqlens_q"] == cu.tolist() and call["batch"] == len(lengths)
    tiles = check_records(call)
    want = sorted((i, hi, m) for i, n in enumerate(lengths) for hi in range(h)
                  for m in range(math.ceil(n / call["tile_m"])))
    assert sorted((t.batch, t.head, t.m_block) for t in tiles) == want


def test_decoding_pieces_are_recorded(tmp_path):
    b, capacity, hq, hkv, d = 1, 4096, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (torch.randn(b, capacity, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                        for _ in range(2))
    lengths = torch.full((b,), capacity, device="cuda", dtype=torch.int32)
    plain, out, calls = traced(tmp_path, lambda: fa4.attention_with_kvcache(q, k_cache, v_cache, lengths))
    assert torch.equal(plain, out)
    call = calls[0]
    assert call["op"] == "fwd_kvcache" and call["pack_gqa"] == hq // hkv
    tiles = check_records(call)
    assert {t.head for t in tiles} == set(range(hkv))  # one packed tile per K/V head, split into pieces
    assert len(tiles) > hkv and fa4_trace.summary(call)["split_pieces"] == len(tiles)


def test_untraceable_calls_run_and_say_why(tmp_path):
    require_trace_twins()
    q, k, v = qkv(1, 300, 2, 128, dtype=torch.float16, seed=4)  # no fp16 twin in the shipped set
    path = tmp_path / "t.jsonl"
    plain = fa4.attention(q, k, v)
    with fa4.trace(path):
        assert torch.equal(fa4.attention(q, k, v), plain)
        assert not _native.last_launch()["name"].endswith("_trace")
        # captured into a CUDA graph: untraced (the trace waits for the kernel)
        qb, kb, vb = qkv(1, 300, 2, 128, seed=5)
        fa4.attention(qb, kb, vb, causal=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fa4.attention(qb, kb, vb, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fa4.attention(qb, kb, vb, causal=True))
    calls = fa4_trace.load(path)
    assert "no trace variant" in calls[0]["untraced"] and calls[0]["variant"].endswith("fp16_d128x128_none")
    assert "tiles" in calls[1]
    assert "CUDA graph" in calls[2]["untraced"]


def test_production_kernels_run_when_tracing_is_off(monkeypatch):
    require_trace_twins()
    monkeypatch.delenv("FA4_TRACE", raising=False)
    q, k, v = qkv(1, 256, 2, 128, seed=6)
    fa4.attention(q, k, v, causal=True)
    assert _native.last_launch()["name"] == "fa4_fwd_sm_90a_bf16_d128x128_causal"
