"""`python -m fa4.bench` argument parsing (the timing itself needs a GPU and lives in the CLI)."""
import argparse

import pytest
import torch

from fa4 import bench
from fa4.bench import head_dim_label, head_dim_pair, positive_int


def test_head_dims_are_d_or_d_by_dv():
    assert head_dim_pair("128") == (128, 128)
    assert head_dim_pair("192x128") == (192, 128)
    assert head_dim_label(64, 64) == "64" and head_dim_label(192, 128) == "192x128"
    for bad in ("0", "192x128x64", "x", "128x0"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            head_dim_pair(bad)


def test_round_spread_needs_two_timed_rounds():
    from fa4.bench import round_spread
    assert round_spread([501.2, 507.9, 503.0]) == "  (fa4 rounds 501-508)"
    assert round_spread([501.2]) == "" and round_spread([]) == ""  # one round, or fa4 failed


def test_rounds_and_iters_are_positive():
    assert positive_int("3") == 3
    for bad in ("0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def test_attention_flops_count_both_gemms_and_halve_for_causal():
    from fa4.bench import attention_flops
    assert attention_flops(2, 3, 5, 64, 64, causal=False) == 4 * 2 * 3 * 5 * 5 * 64  # FA's 4*b*h*s^2*d
    assert attention_flops(1, 1, 4, 192, 128, causal=False) == 2 * 16 * (192 + 128)
    assert attention_flops(1, 1, 4, 192, 128, causal=True) == 16 * (192 + 128)


def test_providers_rotate_between_rounds_and_failures_are_reported(monkeypatch, capsys):
    """Each round starts one provider later, so no provider always follows the same one; a
    provider that raises is reported once and gives NaN, the others are still timed."""
    import math
    import types

    import fa4.bench as bench

    calls = []

    def fake_sample_ms(fn, warmup, iters, calls_per_sample=5):
        fn(0)
        return [1.0 + len(calls) % 2] * iters

    def provider(name, fail=False):
        def fn(*inputs):
            calls.append(name)
            if fail:
                raise RuntimeError("unsupported shape")
        return fn

    monkeypatch.setattr(bench, "sample_ms", fake_sample_ms)
    args = types.SimpleNamespace(rounds=3, iters=4, warmup=1, calls_per_sample=5)
    fns = {"fa4": provider("fa4"), "cuDNN": provider("cuDNN"), "FA2": provider("FA2", fail=True)}
    result = bench.time_providers(fns, lambda: [()], flops=2e12, args=args, where="case")
    assert calls == ["fa4", "cuDNN", "FA2", "cuDNN", "fa4", "fa4", "cuDNN"]
    assert len(result["fa4"][1]) == 3 and math.isnan(result["FA2"][0])
    assert capsys.readouterr().out.count("FA2 failed at case") == 1


def test_visible_pairs_counts_the_window_brute_force():
    from fa4.bench import visible_pairs
    for sq, sk, left, right in [(7, 7, -1, 0), (5, 9, 2, 1), (9, 5, -1, -1), (16, 16, 3, 0), (4, 10, 0, 0)]:
        want = sum(1 for i in range(sq) for j in range(sk)
                   if (right < 0 or j <= i + sk - sq + right) and (left < 0 or j >= i + sk - sq - left))
        assert visible_pairs(sq, sk, left, right) == want


def test_host_first_call_script_times_the_import_and_first_call_only():
    from fa4 import bench_host

    code = compile(bench_host.FIRST_CALL_SCRIPT, "<first_call>", "exec")
    assert code is not None
    lines = [line.strip() for line in bench_host.FIRST_CALL_SCRIPT.strip().splitlines()]
    # CUDA is initialised (inputs made, synchronised) before the clock starts; fa4 is imported,
    # called and synchronised inside the timed region.
    start = lines.index("start = time.perf_counter()")
    assert any("torch.randn" in line for line in lines[:start])
    assert lines[start + 1:start + 4] == ["import fa4", "fa4.attention(q, k, v, causal=True)",
                                          "torch.cuda.synchronize()"]


def test_host_mode_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--host"])


def test_plot_writes_a_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from fa4.bench_plot import plot_rows

    rows = [("128", 1024, False, {"fa4": 650.0, "cuDNN": 600.0}), ("128", 4096, True, {"fa4": 700.0, "cuDNN": 560.0})]
    path = tmp_path / "bench.png"
    plot_rows(rows, ["fa4", "cuDNN"], str(path))
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_context_parallel_report_ratios_and_efficiency(capsys):
    from fa4 import bench_cp

    # 32k causal: fa4 100 ms on one GPU, 60 ms in the ring of two; cuDNN 120 / 75; cuDNN's ring failed at 64k.
    bench_cp._report([(32768, True, {"fa4 1 GPU": 100.0, "fa4 ring": 60.0, "cuDNN 1 GPU": 120.0, "cuDNN ring": 75.0}),
                      (65536, False, {"fa4 1 GPU": 400.0, "fa4 ring": 210.0, "cuDNN 1 GPU": 480.0,
                                      "cuDNN ring": None})], world=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 32k") or
             line.startswith("| 64k")]
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[2].startswith("328 ") and cells[4].startswith("546 ")  # 32768 tokens / 0.1 s, / 0.06 s
    assert cells[6:] == ["1.25", "83.3%", "80.0%"]  # 75 / 60; 100 / (2 * 60); 120 / (2 * 75)
    cells = [c.strip() for c in lines[1].strip("|").split("|")]
    assert cells[5:] == ["n/a", "n/a", "95.2%", "n/a"]


def test_sweep_regret_is_automatic_over_best_and_reported_per_shape():
    from fa4 import bench_sweep

    rows = [("a", 1.0, 1.0, "x", "x"), ("b", 1.21, 1.0, "y", "z")]
    geo, worst = bench_sweep.regret_summary(rows)
    assert abs(geo - 1.1) < 1e-12 and worst == 1.21
    text = bench_sweep.markdown(rows, "GPU")
    assert "Geometric-mean regret 1.100, worst 1.210" in text
    assert "| b | y | 1.210 | z | 1.000 | 1.210 |" in text


def test_sweep_covers_at_least_forty_shapes_of_every_kind():
    from fa4 import bench_sweep

    assert len(bench_sweep.shapes()) >= 40
    labels = [c[0] for c in bench_sweep._fwd_candidates(gqa=True)]
    assert len(labels) == len(set(labels)) == 24 and any("pack_gqa=1" in x for x in labels)
    assert len(bench_sweep._bwd_candidates(causal=False, hd=128)) == 4
    causal = bench_sweep._bwd_candidates(causal=True, hd=128)  # and launch groups of 0, 4 and 8 pairs
    assert len(causal) == len({c[0] for c in causal}) == 12
    assert {env["FA4_BWD_LAUNCH_GROUP"] for _, env, _ in causal} == {"0", "4", "8"}
    clustered = bench_sweep._bwd_candidates(causal=True, hd=256)  # and clusters on and off
    assert len(clustered) == len({c[0] for c in clustered}) == 24
    assert {env["FA4_BWD_CLUSTERS"] for _, env, _ in clustered} == {"0", "1"}
