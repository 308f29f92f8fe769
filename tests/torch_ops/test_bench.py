"""`python -m fa4.bench` argument parsing (the timing itself needs a GPU and lives in the CLI)."""
import argparse

import pytest

from fa4.bench import head_dim_label, head_dim_pair


def test_head_dims_are_d_or_d_by_dv():
    assert head_dim_pair("128") == (128, 128)
    assert head_dim_pair("192x128") == (192, 128)
    assert head_dim_label(64, 64) == "64" and head_dim_label(192, 128) == "192x128"
    for bad in ("0", "192x128x64", "x", "128x0"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            head_dim_pair(bad)


def test_attention_flops_count_both_gemms_and_halve_for_causal():
    from fa4.bench import attention_flops
    assert attention_flops(2, 3, 5, 64, 64, causal=False) == 4 * 2 * 3 * 5 * 5 * 64  # FA's 4*b*h*s^2*d
    assert attention_flops(1, 1, 4, 192, 128, causal=False) == 2 * 16 * (192 + 128)
    assert attention_flops(1, 1, 4, 192, 128, causal=True) == 16 * (192 + 128)
