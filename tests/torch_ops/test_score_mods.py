"""fa4.score_mods' in-kernel score_mods (alibi, relative_bias, bias) through fa4.flex_attention on
the CPU path (float64): the block-sparse operators with the bias as data (fa4::fwd_sparse's
score_mod / score_params), against torch's score_mod semantics as a dense formula: values, the
LSE, and the gradients of q, k, v and of the slopes, the table or the bias tensor (summed over the
dims it broadcasts); finite differences; a compiled graph; and the arguments refused."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import fa4
from fa4 import flex, masks, ops, score_mods

from .test_flex import inputs, naive_flex, no_fallback

HEADS = 4


def make_score_mod(kind, center=5, grad=True):
    """alibi with distinct slopes per head, or a relative-bias table whose distances clamp at
    ``center`` (shorter than the sequences: the end entries are shared)."""
    g = torch.Generator().manual_seed(7)
    if kind == "alibi":
        params = torch.linspace(-0.3, 0.9, HEADS, dtype=torch.float64)
        return score_mods.alibi(params.requires_grad_(grad)), params
    params = torch.randn(HEADS, 2 * center + 1, generator=g, dtype=torch.float64)
    return score_mods.relative_bias(params.requires_grad_(grad)), params


MASKS = {
    "no mask": None,
    "causal": masks.causal,
    "custom": lambda: (lambda b, h, q, kv: (q * 3 + kv) % 4 != 1),
}


def run_against_the_formula(score_mod, params, code, mask, lengths):
    """fa4.flex_attention with ``score_mod`` (parameters ``params``, op code ``code``) under MASKS[mask]
    against naive_flex: the plan is the block-sparse kernels', values, the LSE and the gradients
    of q, k, v and the parameters; returns the parameters' gradient."""
    sq, sk = lengths
    mask_mod = MASKS[mask]() if MASKS[mask] else None
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, sq, sk, device="cpu",
                                                                 BLOCK_SIZE=16)
    q, k, v = inputs(hq=HEADS, hkv=2, sq=sq, sk=sk, grad=True)
    plan = flex._sparse_plan("reason", score_mod, None, q, k, v)
    assert not isinstance(plan, str) and plan.sparse and plan.score[0] == code
    out, lse = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                      enable_gqa=True, return_lse=True))
    want, want_lse = naive_flex(q, k, v, score_mod, mask_mod, gqa=True)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    # fa4 keeps the LSE in fp32 and its backward reads it: with biases of tens (alibi's slopes
    # times distances) the probabilities it recomputes carry fp32 rounding of those.
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-6)
    dout = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v, params), dout)
    exp = torch.autograd.grad(want, (q, k, v, params), dout)
    for name, a, e in zip(("q", "k", "v", "params"), got, exp):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-5, msg=name)
    assert got[3].shape == params.shape
    return got[3]


@pytest.mark.parametrize("kind", ["alibi", "relbias"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("lengths", [(37, 37), (29, 45)])
def test_kernel_score_mods_match_the_dense_formula(kind, mask, lengths):
    score_mod, params = make_score_mod(kind)
    q, k, v = inputs(hq=HEADS, hkv=2, sq=lengths[0], sk=lengths[1])
    plan = flex._sparse_plan("reason", score_mod, None, q, k, v)
    torch.testing.assert_close(plan.score[1].reshape(-1), params.reshape(-1), atol=0, rtol=0)
    code = {"alibi": score_mods.ALIBI, "relbias": score_mods.RELATIVE_BIAS}[kind]
    assert run_against_the_formula(score_mod, params, code, mask, lengths).abs().sum() > 0


@pytest.mark.parametrize("kind", ["alibi", "relbias"])
def test_gradcheck_float64(kind):
    """Finite differences through q, k, v and the score_mod's parameters (the reference backward
    and its dS sums on the CPU)."""
    score_mod, params = make_score_mod(kind, center=3)
    block_mask = create_block_mask(masks.causal(), None, None, 11, 11, device="cpu", BLOCK_SIZE=16)
    q, k, v = inputs(b=1, hq=HEADS, hkv=2, sq=11, sk=11, d=8, dv=4, grad=True)

    def run(q, k, v, p):
        mod = score_mods.alibi(p) if kind == "alibi" else score_mods.relative_bias(p)
        return no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=mod, block_mask=block_mask,
                                                      enable_gqa=True))

    assert torch.autograd.gradcheck(run, (q, k, v, params), eps=1e-6, atol=1e-5)


def test_frozen_parameters_get_no_gradient_and_inference_runs_below_autograd():
    score_mod, params = make_score_mod("relbias", grad=False)
    q, k, v = inputs(hq=HEADS, sq=20, sk=20, grad=True)
    out = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mod))
    out.sum().backward()
    assert params.grad is None and q.grad is not None
    with torch.no_grad():
        again = fa4.flex_attention(q, k, v, score_mod=score_mod)
    assert again.grad_fn is None
    torch.testing.assert_close(again, out.detach(), atol=0, rtol=0)


def test_only_the_table_needs_a_gradient():
    """q, k, v frozen, the table learnable: the backward still runs (for the table alone)."""
    score_mod, params = make_score_mod("relbias")
    q, k, v = inputs(hq=HEADS, sq=20, sk=20)
    out = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mod))
    (grad,) = torch.autograd.grad(out.square().sum(), params)
    want, _ = naive_flex(q, k, v, score_mod)
    (expected,) = torch.autograd.grad(want.square().sum(), params)
    torch.testing.assert_close(grad, expected, atol=2e-5, rtol=1e-5)


def test_compiled_step_matches_eager():
    """torch.compile(fullgraph=True): one graph through fa4::fwd_sparse with the slopes as an
    input, its backward (AOTAutograd) giving the slopes' gradient as eager does."""
    score_mod, slopes = make_score_mod("alibi")
    block_mask = create_block_mask(masks.causal(), None, None, 37, 37, device="cpu", BLOCK_SIZE=16)
    q, k, v = inputs(hq=HEADS, sq=37, sk=37, grad=True)

    def forward(q, k, v, slopes):
        return fa4.flex_attention(q, k, v, score_mod=score_mods.alibi(slopes), block_mask=block_mask)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(forward, fullgraph=True, backend=backend)(q, k, v, slopes)
    assert len(graphs) == 1 and "fa4.fwd_sparse" in graphs[0] and "flex_attention" not in graphs[0]
    want = forward(q, k, v, slopes)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    for a, e in zip(torch.autograd.grad(got.square().sum(), (q, slopes)),
                    torch.autograd.grad(want.square().sum(), (q, slopes))):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


# Bias tensors for (batch 2, HEADS heads, seqlen_q, seqlen_k): every broadcast a model uses.
BIAS_SHAPES = {
    "full": lambda sq, sk: (2, HEADS, sq, sk),
    "2-D (queries, keys)": lambda sq, sk: (sq, sk),
    "per head": lambda sq, sk: (1, HEADS, sq, sk),
    "key padding per batch": lambda sq, sk: (2, 1, 1, sk),
    "constant along keys": lambda sq, sk: (2, HEADS, sq, 1),
}


def make_bias(shape, grad=True, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * 2).requires_grad_(grad)


@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("lengths", [(37, 37), (29, 45)])
def test_bias_tensor_matches_the_dense_formula(shape, mask, lengths):
    bias = make_bias(BIAS_SHAPES[shape](*lengths))
    grad = run_against_the_formula(score_mods.bias(bias), bias, score_mods.BIAS, mask, lengths)
    if shape != "constant along keys":  # that one's gradient is zero: each row's dS sums to 0
        assert grad.abs().sum() > 0


def test_bias_with_masked_keys_and_a_frozen_bf16_bias():
    """An additive mask (-inf at some keys, as key padding is often written) gives those keys no
    weight and no gradient; a bias in another dtype is read as float and gets its gradient in
    its own dtype."""
    q, k, v = inputs(hq=HEADS, sq=30, sk=30, grad=True)
    pad = torch.zeros(2, 1, 1, 30, dtype=torch.float64)
    pad[0, ..., 25:] = float("-inf")
    pad.requires_grad_(True)
    out = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mods.bias(pad)))
    want, _ = naive_flex(q, k, v, score_mods.bias(pad))
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    (grad,) = torch.autograd.grad(out.square().sum(), pad)
    assert torch.isfinite(grad).all() and (grad[0, ..., 25:] == 0).all()
    low = make_bias((30, 30)).detach().to(torch.bfloat16).requires_grad_(True)
    out = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mods.bias(low)))
    want, _ = naive_flex(q, k, v, score_mods.bias(low.double()))
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    (grad,) = torch.autograd.grad(out.sum(), low)
    assert grad.dtype == torch.bfloat16 and grad.shape == (30, 30)


def test_bias_in_the_inputs_dtype_is_read_as_such():
    """A bf16 bias beside bf16 inputs reaches the kernels as it is ("bias16"), not converted; its
    gradient comes back in bf16, in its shape."""
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in inputs(hq=HEADS, sq=33, sk=40))
    bias = make_bias((1, HEADS, 33, 40)).detach().to(torch.bfloat16).requires_grad_()
    plan = flex._sparse_plan("reason", score_mods.bias(bias), None, q, k, v)
    assert plan.score[1].dtype == torch.bfloat16 and score_mods.kernel_kind(*plan.score) == "bias16"
    out = no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mods.bias(bias)))
    want, _ = naive_flex(*(t.double() for t in (q, k, v)), score_mods.bias(bias.double()))
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    (grad,) = torch.autograd.grad(out.float().sum(), bias)
    (exact,) = torch.autograd.grad(want.sum(), bias)
    assert grad.dtype == torch.bfloat16 and grad.shape == bias.shape
    torch.testing.assert_close(grad.double(), exact.double(), atol=3e-2, rtol=3e-2)


def test_bias_gradcheck_float64():
    """Finite differences through q, k, v and a bias broadcast over the batch and the heads."""
    block_mask = create_block_mask(masks.causal(), None, None, 11, 11, device="cpu", BLOCK_SIZE=16)
    q, k, v = inputs(b=1, hq=HEADS, hkv=2, sq=11, sk=11, d=8, dv=4, grad=True)
    bias = make_bias((11, 11))

    def run(q, k, v, bias):
        return no_fallback(lambda: fa4.flex_attention(q, k, v, score_mod=score_mods.bias(bias), block_mask=block_mask,
                                                      enable_gqa=True))

    assert torch.autograd.gradcheck(run, (q, k, v, bias), eps=1e-6, atol=1e-5)


def test_bad_bias_shapes_are_refused():
    q, k, v = inputs(hq=HEADS, sq=9, sk=12)
    for shape in ((3, HEADS, 9, 12), (2, 2, 9, 12), (2, HEADS, 5, 12), (2, HEADS, 9, 7)):
        with pytest.raises(ValueError, match="bias must broadcast"):
            fa4.flex_attention(q, k, v, score_mod=score_mods.bias(torch.zeros(shape, dtype=torch.float64)))
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    tables = fa4.block_sparse.build_tables(flex._full_block_mask(9, 12, q.device), 2, HEADS, (128, 128))
    sparse = (tables.counts, tables.blocks, tables.bits, 128, 128, q.shape[-1] ** -0.5)
    with pytest.raises(ValueError, match="keys contiguous"):
        torch.ops.fa4.fwd_sparse(*args, *sparse, 0.0, None, None, None, 0, 0, score_mods.BIAS,
                                 torch.zeros(12, 9, dtype=torch.float64).t()[None, None])
    with pytest.raises(TypeError, match="4-D"):
        torch.ops.fa4.fwd_sparse(*args, *sparse, 0.0, None, None, None, 0, 0, score_mods.BIAS,
                                 torch.zeros(9, 12, dtype=torch.float64))


def test_bad_parameters_are_refused():
    q, k, v = inputs(hq=HEADS, sq=9, sk=9)
    with pytest.raises(ValueError, match="one entry per query head"):
        fa4.flex_attention(q, k, v, score_mod=score_mods.alibi(torch.ones(HEADS + 1, dtype=torch.float64)))
    with pytest.raises(ValueError, match="one row per query head"):
        fa4.flex_attention(q, k, v, score_mod=score_mods.relative_bias(torch.ones(2, 3, dtype=torch.float64)))
    with pytest.raises(ValueError, match="2 \\* max_distance"):
        score_mods.relative_bias(torch.ones(HEADS, 4))
    table = torch.ones(HEADS, 5)
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    tables = fa4.block_sparse.build_tables(flex._full_block_mask(9, 9, q.device), 2, HEADS, (128, 128))
    sparse = (tables.counts, tables.blocks, tables.bits, 128, 128, q.shape[-1] ** -0.5)
    with pytest.raises(ValueError, match="score_params for alibi must be"):
        torch.ops.fa4.fwd_sparse(*args, *sparse, 0.0, None, None, None, 0, 0, score_mods.ALIBI, table)
    with pytest.raises(ValueError, match="score_mod must be 0"):
        torch.ops.fa4.fwd_sparse(*args, *sparse, 0.0, None, None, None, 0, 0, 7, table)
    with pytest.raises(ValueError, match="softcap"):
        torch.ops.fa4.fwd_sparse(*args, *sparse, 2.0, None, None, None, 0, 0, score_mods.RELATIVE_BIAS, table)
    with pytest.raises(TypeError, match="float32"):
        torch.ops.fa4.fwd_sparse(*args, *sparse, 0.0, None, None, None, 0, 0, score_mods.RELATIVE_BIAS,
                                 table.int())
    assert ops  # the operators are registered by importing fa4.ops


def test_score_mod_codes_agree_with_the_native_library_and_the_catalog():
    """One numbering of the in-kernel score_mods: fa4.score_mods' op codes, the native library's
    enum fa4_score_mod (csrc_shims/fa4_shim.h, which the generated variant table uses: one
    FA4_SCORE_<NAME> per catalog name) and the catalog's names through score_mods.kernel_kind (a
    16-bit bias tensor runs the "bias16" variants under the op's bias code)."""
    import re
    from pathlib import Path

    from fa4_kernels import catalog

    header = (Path(__file__).resolve().parents[2] / "csrc_shims" / "fa4_shim.h").read_text()
    body = re.search(r"enum fa4_score_mod \{([^}]*)\}", header).group(1)
    enum = {name: int(value) for name, value in re.findall(r"FA4_SCORE_(\w+) = (\d+)", body)}
    assert enum == {"NONE": score_mods.NONE, "ALIBI": score_mods.ALIBI, "RELBIAS": score_mods.RELATIVE_BIAS,
                    "BIAS": score_mods.BIAS, "BIAS16": 4}
    assert {name.upper() for name in catalog.SCORE_MODS} | {"NONE"} == set(enum)
    f32, bf16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    kinds = {score_mods.kernel_kind(code, t) for code, t in (
        (score_mods.ALIBI, f32), (score_mods.RELATIVE_BIAS, f32), (score_mods.BIAS, f32), (score_mods.BIAS, bf16))}
    assert kinds == set(catalog.SCORE_MODS) and score_mods.kernel_kind(score_mods.NONE, None) == "none"
