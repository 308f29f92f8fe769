"""fa4.trace on the CPU: the context manager's settings, and reading, summarising and rendering a
trace file (a generated one: the GPU test checks what the kernels write)."""
import json
import os

import pytest

import fa4
from fa4 import heuristics
from fa4 import trace as fa4_trace

FIELDS = ["sm", "cta", "cursor", "m_block", "head", "batch", "n_block_min", "n_block_max", "flags", "start_lo",
          "start_hi", "q_ready_lo", "blocks_done_lo", "partials_ready_lo", "merged_lo", "end_lo"]
FLAGS = {"dynamic": 1, "split_writer": 2, "split_merger": 4, "dealt": 8}


def record(sm, cta, cursor, start, q_ready, end, flags=0, m_block=0, head=0, batch=0, blocks=(0, 8), merge=(0, 0)):
    def signed(x):  # the file holds the int32 words as C prints them
        x &= 0xFFFFFFFF
        return x - (1 << 32) if x >= 1 << 31 else x
    blocks_done = end - 100  # the last P @ V 100 ns before the end
    return [sm, cta, cursor, m_block, head, batch, blocks[0], blocks[1], flags, signed(start), signed(start >> 32),
            signed(q_ready), signed(blocks_done), signed(merge[0]), signed(merge[1]), signed(end)]


def line(number, records, schedule="dynamic", grid=4, num_sms=4, **extra):
    call = {"fa4_trace": 1, "call": number, "op": "fwd", "variant": "fa4_fwd_sm_90a_bf16_d128x128_causal_trace",
            "device": 0, "device_name": "test", "num_sms": num_sms, "grid": grid, "tail_ctas": 0,
            "schedule": schedule, "pack_gqa": 1, "tile_m": 128, "tile_n": 128, "mask": "causal", "varlen": False,
            "batch": 1, "seqlen_q": 512, "seqlen_k": 512, "heads_q": 2, "heads_kv": 2, "head_dim": 128,
            "head_dim_v": 128, "cu_seqlens_q": [], "fields": FIELDS, "flags": FLAGS, "dropped": 0, "records": records}
    call.update(extra)
    return json.dumps(call) + "\n"


# A start just below a 2^32 ns boundary: Q and the end come after the low word wrapped.
T0 = (7 << 32) - 1500


@pytest.fixture
def trace_file(tmp_path):
    dyn = FLAGS["dynamic"]
    records = [
        record(0, 0, 0, T0, T0 + 200, T0 + 4000, dyn, m_block=3),
        record(1, 1, 1, T0 + 10, T0 + 300, T0 + 3000, dyn, m_block=2),
        record(2, 2, 2, T0 + 20, T0 + 250, T0 + 2000, dyn, m_block=1),
        record(3, 3, 3, T0 + 30, T0 + 90, T0 + 1000, dyn, m_block=0, head=1),
        # claimed by CTA 3 though the round-robin deal gives tile 5 to CTA 1: stolen
        record(3, 3, 5, T0 + 1000, T0 + 1100, T0 + 2500, dyn, m_block=1, head=1),
    ]
    path = tmp_path / "run.jsonl"
    path.write_text(line(0, records) + json.dumps(
        {"fa4_trace": 1, "call": 1, "op": "fwd", "variant": "fa4_fwd_sm_90a_fp16_d128x128_causal",
         "untraced": "no trace variant of this kernel is built"}) + "\n")
    return path


def test_records_decode_across_the_timer_words(trace_file):
    calls = fa4_trace.load(trace_file)
    assert [c["call"] for c in calls] == [0, 1] and "tiles" not in calls[1]
    tiles = calls[0]["tiles"]
    assert tiles[0].start == T0 and tiles[0].q_ready == T0 + 200 and tiles[0].end == T0 + 4000
    assert (tiles[0].start >> 32, tiles[0].end >> 32) == (6, 7)  # the end's low word wrapped
    assert tiles[0].flags == {"dynamic"} and tiles[3].head == 1 and tiles[0].n_block_max == 8


def test_summary_measures_the_tail_and_the_stolen_tiles(trace_file):
    call = fa4_trace.load(trace_file)[0]
    s = fa4_trace.summary(call)
    assert s["tiles"] == 5 and s["sms"] == 4
    assert s["makespan_us"] == pytest.approx(4.0)
    # busy: (4000 + 2990 + 1980 + 970 + 1500) ns over 4 SMs x 4000 ns
    assert s["busy"] == pytest.approx(11440 / 16000)
    # the first SM to finish (SM 2 at T0 + 2000) to the end (T0 + 4000)
    assert s["tail_us"] == pytest.approx(2.0)
    assert s["stolen"] == 1 and s["split_pieces"] == 0
    dealt = dict(call, tiles=[fa4_trace.Tile(**{**t.__dict__, "flags": t.flags | {"dealt"}}) for t in call["tiles"]])
    assert fa4_trace.summary(dealt)["stolen"] == 0  # round-robin: nothing is stolen


def test_the_cli_summarises_and_renders(trace_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert fa4_trace.main([str(trace_file), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "#0 fwd causal" in out and "tiles 5" in out and "stolen 1" in out
    assert "#1 fwd fa4_fwd_sm_90a_fp16_d128x128_causal: untraced (no trace variant" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_load_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"something": 1}\n')
    with pytest.raises(ValueError, match="not an fa4 trace line"):
        fa4_trace.load(bad)


def test_the_context_manager_sets_and_restores_the_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("FA4_TRACE", raising=False)
    monkeypatch.setenv("FA4_TRACE_SCHEDULE", "dynamic")
    path = tmp_path / "t.jsonl"
    assert callable(fa4.trace) and fa4.trace is fa4_trace  # the module is the context manager
    with fa4.trace(path, schedule="static") as where:
        assert where == os.fspath(path)
        assert heuristics.tuning()["trace_path"] == os.fspath(path)  # what the native operators read
        assert heuristics.tuning()["trace_schedule"] == "static"
    assert "FA4_TRACE" not in os.environ and os.environ["FA4_TRACE_SCHEDULE"] == "dynamic"
    with fa4.trace(path):
        assert "FA4_TRACE_SCHEDULE" not in os.environ
    assert os.environ["FA4_TRACE_SCHEDULE"] == "dynamic"
    with pytest.raises(ValueError, match="schedule must be one of"):
        with fa4.trace(path, schedule="round-robin"):
            pass


def test_split_pieces_report_their_merge(tmp_path):
    w, m = FLAGS["split_writer"], FLAGS["split_merger"]
    records = [
        record(0, 0, 0, T0, T0 + 100, T0 + 3000, m, blocks=(0, 4), merge=(T0 + 3200, T0 + 3700)),
        record(1, 1, 0, T0, T0 + 100, T0 + 3200, w, blocks=(4, 8)),
    ]
    # the merger ends after its merge (its last P @ V stays at T0 + 2900)
    records[0][FIELDS.index("end_lo")] = record(0, 0, 0, T0, 0, T0 + 3900)[FIELDS.index("end_lo")]
    path = tmp_path / "split.jsonl"
    path.write_text(line(0, records, schedule="static", tail_ctas=2))
    call = fa4_trace.load(path)[0]
    merger, writer = call["tiles"]
    assert merger.blocks_done == T0 + 2900 and merger.partials_ready == T0 + 3200 and merger.merged == T0 + 3700
    assert writer.partials_ready is None and writer.merged is None  # only the merger has these marks
    s = fa4_trace.summary(call)
    assert s["split_pieces"] == 2
    assert s["merge_wait_us_mean"] == pytest.approx(0.3) and s["merge_us_mean"] == pytest.approx(0.5)


def test_entries_decode_before_the_start_and_summarise_the_prologue(tmp_path):
    # CTA 0 entered 600 ns before its start, across the start's low-word boundary (t1's low word
    # is 400); CTA 1 entered 200 ns after CTA 0 and started its two tiles 700 and 3000 ns later.
    t1 = (9 << 32) + 400

    def low_word(t):  # as C prints an int32
        t &= 0xFFFFFFFF
        return t - (1 << 32) if t >= 1 << 31 else t
    # Their first K blocks landed 150, 200 and 100 ns after Q.
    records = [record(0, 0, 0, t1, t1 + 100, t1 + 2000) + [low_word(t1 - 600), low_word(t1 + 250)],
               record(1, 1, 1, t1 + 300, t1 + 400, t1 + 2500) + [low_word(t1 - 400), low_word(t1 + 600)],
               record(1, 1, 3, t1 + 2600, t1 + 2700, t1 + 3500) + [low_word(t1 - 400), low_word(t1 + 2800)]]
    path = tmp_path / "entries.jsonl"
    path.write_text(line(0, records, fields=FIELDS + ["entry_lo", "k_ready_lo"]))
    call = fa4_trace.load(path)[0]
    assert [t.entry for t in call["tiles"]] == [t1 - 600, t1 - 400, t1 - 400]
    s = fa4_trace.summary(call)
    assert s["prologue_us_mean"] == pytest.approx(0.65)  # each CTA's first tile: (600 + 700) / 2 ns
    assert s["entry_spread_us"] == pytest.approx(0.2) and s["entry_to_end_us"] == pytest.approx(4.1)
    assert s["k_wait_us_mean"] == pytest.approx((250 + 300 + 200) / 3 / 1e3)
    assert "setup_us_mean" not in s  # a file without the prologue's parts
    # A file written before these fields: its tiles have neither, nor has its summary.
    older = dict(call, tiles=[fa4_trace.Tile(**{**t.__dict__, "entry": None, "k_ready": None}) for t in call["tiles"]])
    assert not {"prologue_us_mean", "k_wait_us_mean"} & set(fa4_trace.summary(older))


def test_the_prologue_splits_into_its_parts(tmp_path):
    t1 = (5 << 32) + 100  # the start's low word: 100, so the parts' low words wrap

    def low_word(t):
        t &= 0xFFFFFFFF
        return t - (1 << 32) if t >= 1 << 31 else t
    fields = FIELDS + ["entry_lo", "k_ready_lo", "setup_lo", "consume_lo", "pre_wait_lo"]
    # entry -1000, set-up done -800, role entered -700, schedule done -300, start 0 (ns from t1)
    rec = record(0, 0, 0, t1, t1 + 100, t1 + 2000) + [low_word(t1 + d) for d in (-1000, 150, -800, -700, -300)]
    path = tmp_path / "parts.jsonl"
    path.write_text(line(0, [rec], fields=fields))
    tile = fa4_trace.load(path)[0]["tiles"][0]
    assert (tile.entry, tile.setup, tile.consume, tile.pre_wait) == (t1 - 1000, t1 - 800, t1 - 700, t1 - 300)
    s = fa4_trace.summary(fa4_trace.load(path)[0])
    assert s["prologue_us_mean"] == pytest.approx(1.0)
    assert [s[f"{p}_us_mean"] for p in ("setup", "role", "schedule", "grid_wait")] == pytest.approx(
        [0.2, 0.1, 0.4, 0.3])
