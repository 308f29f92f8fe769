"""The backward preprocess's rows that see no key (its per-sequence zeroing of packed sequences'
dQ accumulator) against the native rule the dense path uses, fa4_keyless_rows."""
import pytest

pytest.importorskip("cutlass")

from fa4 import heuristics  # noqa: E402
from fa4_kernels.sm90.bwd_preprocess import rows_before_first_key  # noqa: E402


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (False, (-1, 7)),
                                           (False, (4, -1)), (False, (0, 0))])
def test_rows_before_first_key_is_the_native_rule(causal, window):
    mask = heuristics.resolve_mask(causal, *window)
    for sq in (1, 2, 63, 64, 70, 129, 300, 6339):
        for sk in (1, 3, 64, 70, 200, 6339, 1 << 29):
            got = rows_before_first_key(sq, sk, mask.window_right)
            assert got == heuristics.keyless_rows(sq, sk, mask), (sq, sk, mask)
