"""fa4.rotary and flash_attn_with_kvcache's rotary_cos / rotary_sin on the CPU: the rotation against
complex multiplication in float64 (both pair layouts, partial rotary dims), the cache receiving
rotated keys and the output attending rotated q at FlashAttention's positions, the argument rules
and torch.compile without a graph break."""
import pytest
import torch

import fa4
from fa4 import rotary
from fa4.testing import naive_attention

F64 = torch.float64


def rotated_by_complex(x, cos, sin, pos, interleaved):
    """x (b, s, h, d) with each feature pair taken as a complex number and multiplied by
    cos + i sin at the token's position (pos (b, s))."""
    half = cos.shape[1]
    part = x[..., :2 * half]
    if interleaved:
        pairs = part.unflatten(-1, (half, 2))
        z = torch.complex(pairs[..., 0], pairs[..., 1])
    else:
        z = torch.complex(part[..., :half], part[..., half:])
    z = z * torch.complex(cos[pos], sin[pos])[:, :, None]
    out = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((out, x[..., 2 * half:]), -1)


def tables(seqlen_ro, half, seed):
    gen = torch.Generator().manual_seed(seed)
    # Not unit-norm on purpose: the rotation is linear in the tables, so any values check it.
    return torch.randn(seqlen_ro, half, dtype=F64, generator=gen), torch.randn(seqlen_ro, half, dtype=F64,
                                                                               generator=gen)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 6])
def test_apply_rotary_matches_complex_rotation(interleaved, rotary_dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, dtype=F64, generator=gen)
    cos, sin = tables(40, rotary_dim // 2, 1)
    pos = torch.randint(0, 40, (2, 3), generator=gen)
    got = rotary.apply_rotary(x, cos[pos].float(), sin[pos].float(), interleaved)
    expect = rotated_by_complex(x, cos, sin, pos, interleaved)
    # apply_rotary computes in float32 (as FlashAttention's kernel does) and returns x's dtype.
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_positions_clamped_into_the_tables():
    lengths = torch.tensor([0, 5, 99], dtype=torch.int32)
    pos = rotary.positions(lengths, 3, 4, True, 64, "cpu")
    assert pos.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8], [63, 63, 63, 63]]
    assert rotary.positions(7, 2, 3, False, 64, "cpu").tolist() == [[7, 7, 7], [7, 7, 7]]


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("sq,causal,window", [(3, True, (-1, -1)), (1, True, (-1, -1)), (3, False, (-1, -1)),
                                              (3, False, (4, 0)), (2, False, (-1, -1))])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_rotary_matches_rotated_inputs(page_size, sq, causal, window, interleaved):
    b, hq, hkv, d, capacity, seqlen_new = 3, 4, 2, 16, 64, 3
    gen = torch.Generator().manual_seed(2)
    if page_size is None:
        k_cache = torch.randn(b, capacity, hkv, d, dtype=F64, generator=gen)
        table = None
    else:
        k_cache = torch.randn(b * capacity // page_size, page_size, hkv, d, dtype=F64, generator=gen)
        table = torch.randperm(k_cache.shape[0], generator=gen).reshape(b, -1).to(torch.int32)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, sq, hq, d, dtype=F64, generator=gen)
    k_new = torch.randn(b, seqlen_new, hkv, d, dtype=F64, generator=gen)
    v_new = torch.randn(b, seqlen_new, hkv, d, dtype=F64, generator=gen)
    cos, sin = tables(capacity + 8, 4, 3)  # rotary_dim 8 of 16
    lengths = torch.tensor([0, 5, 40], dtype=torch.int32)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=lengths, block_table=table, causal=causal, window_size=window,
                                      rotary_interleaved=interleaved)
    new_pos = lengths.long()[:, None] + torch.arange(seqlen_new)
    # FlashAttention's positions for q: per token under a causal mask or a bounding window side,
    # else every token at cache_seqlens.
    per_token = causal or window != (-1, -1)
    q_pos = lengths.long()[:, None] + (torch.arange(sq) if per_token else torch.zeros(sq, dtype=torch.long))
    k_rot = rotated_by_complex(k_new, cos, sin, new_pos, interleaved)
    q_rot = rotated_by_complex(q, cos, sin, q_pos, interleaved)
    for i in range(b):
        n = int(lengths[i]) + seqlen_new
        rows = torch.arange(n)
        if table is None:
            keys, values, before = k_cache[i, :n], v_cache[i, :n], k_before[i, :n]
        else:
            at = table[i].long()[rows // page_size], rows % page_size
            keys, values, before = k_cache[at], v_cache[at], k_before[at]
        torch.testing.assert_close(keys[n - seqlen_new:], k_rot[i], atol=1e-5, rtol=1e-5)  # rotated keys stored
        assert torch.equal(keys[:n - seqlen_new], before[:n - seqlen_new])
        assert torch.equal(values[n - seqlen_new:], v_new[i])  # values are not rotated
        ref, _ = naive_attention(q_rot[i:i + 1], keys[None], values[None], causal=causal, window=window)
        torch.testing.assert_close(out[i:i + 1], ref.nan_to_num(0.0), atol=1e-5, rtol=1e-5)
    assert int((v_cache != v_before).any(-1).any(-1).sum()) == b * seqlen_new


def test_rotary_argument_rules():
    k_cache = torch.randn(2, 32, 2, 16, dtype=F64)
    q = torch.randn(2, 1, 4, 16, dtype=F64)
    new = torch.randn(2, 1, 2, 16, dtype=F64)
    lengths = torch.tensor([3, 4], dtype=torch.int32)
    cos, sin = tables(32, 8, 0)

    def call(**kwargs):
        args = dict(k=new, v=new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths) | kwargs
        return fa4.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), **args)
    with pytest.raises(ValueError, match="given together"):
        call(rotary_sin=None)
    with pytest.raises(ValueError, match="pass the new tokens' k and v"):
        call(k=None, v=None)
    with pytest.raises(ValueError, match="rotary_dim .* head_dim = 16"):
        call(rotary_cos=torch.randn(32, 9, dtype=F64), rotary_sin=torch.randn(32, 9, dtype=F64))
    with pytest.raises(ValueError, match="fewer than the cache's 32 rows"):
        call(rotary_cos=cos[:31], rotary_sin=sin[:31])
    with pytest.raises(ValueError, match="same shape"):
        call(rotary_sin=sin[:, :4])
    with pytest.raises(ValueError, match="floating-point"):
        call(rotary_cos=cos[:, 0])
    with pytest.raises(ValueError, match="agree in batch and head_dim"):
        call(k=new[:1], v=new[:1])
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        call(cache_leftpad=torch.zeros(2, dtype=torch.int32))


def test_compile_rotary_without_graph_break():
    k_cache = torch.randn(2, 32, 2, 16, dtype=F64)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, 1, 4, 16, dtype=F64)
    new = torch.randn(2, 1, 2, 16, dtype=F64)
    lengths = torch.tensor([3, 20], dtype=torch.int32)
    cos, sin = tables(32, 8, 0)

    def step(q, k_cache, v_cache, lengths, new):
        return fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lengths, causal=True)

    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    expect = step(q, k_eager, v_eager, lengths, new)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, lengths, new)
    torch.testing.assert_close(got, expect)
    # Eager mode fuses each product pair into addcmul (one rounding fewer): close, not equal.
    torch.testing.assert_close(k_cache, k_eager)
    assert torch.equal(v_cache, v_eager)
