"""fa4's in-kernel score_mods (fa4.score_mods.alibi / relative_bias) through fa4.flex_attention on
CUDA: the block-sparse kernels with the bias computed inside them, forward and backward, with
the slopes' or the table's gradient; every head dim (both backward layouts), bf16 and fp16, GQA,
odd lengths, causal / random / no mask, tables shorter than the sequences (clamped distances);
outputs and gradients within twice the error of the same math in the input dtype of a float64
formula, the variants named."""
import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import fa4
from fa4 import _native, score_mods

from ..conftest import requires_hopper
from .test_block_sparse_gpu import random_mask_mod
from .test_sdpa_gpu import kernel_names

pytestmark = [pytest.mark.gpu, requires_hopper]


def bias_of(kind, params, sq, sk):
    """(heads, sq, sk) bias on the scaled scores, differentiable in params."""
    rows = torch.arange(sq, device=params.device)[:, None]
    cols = torch.arange(sk, device=params.device)[None, :]
    if kind == "alibi":
        return params[:, None, None] * (cols - rows).to(params.dtype)
    center = params.shape[1] // 2
    return params[:, (rows - cols).clamp(-center, center) + center]


def reference(q, k, v, bias, visible, scale, dtype):
    """Masked attention with an additive bias in ``dtype`` (scores accumulated in fp32 at least);
    (out in float64, lse). Rows that see no key give 0 and -inf."""
    hq = q.shape[1]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = (t.repeat_interleave(hq // t.shape[1], 1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)).to(acc) * scale + bias.to(acc)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (p.to(dtype) @ v).to(torch.float64), lse


def flash_style_grad(bias_full, params, exact, visible, scale, dout, out):
    """The bias parameters' gradient in float64 from dS = P (dP - rowsum(dO out)) with ``out`` the
    call's stored (rounded) output, as a flash-style backward forms it: the bias function's
    vector-Jacobian product with dS (``bias_full(params)``: the bias on the scaled scores,
    broadcastable to (batch, heads, sq, sk))."""
    q, k, v = (t.detach() for t in exact[:3])
    hq = q.shape[1]
    k, v = (t.repeat_interleave(hq // t.shape[1], 1) for t in (k, v))
    p64 = params.detach().double().requires_grad_()
    s = (q @ k.transpose(-1, -2)) * scale + bias_full(p64.detach())
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    (grad,) = torch.autograd.grad((bias_full(p64).expand_as(ds) * ds).sum(), p64)
    return grad


def check_call(score_mod, params, learnable, bias_full, suffix, d, dv, dtype, sq, sk, hq, hk, mask, batch=2,
               visible_too=None):
    """fa4.flex_attention with ``score_mod`` (its parameters ``params``; ``bias_full(params)`` the
    bias on the scaled scores, broadcastable to (batch, hq, sq, sk)) on odd-shaped inputs (q not
    contiguous) under ``mask``: the variant ``..._sparse_<suffix>`` runs forward and fa4's
    backward kernel after it; outputs and the LSE against float64 within twice the error of the
    same math in ``dtype``; the gradients of q, k, v (and of the parameters when ``learnable``,
    against the flash-style formula: flash_style_grad) within twice that math's error.
    ``visible_too``: a further (batch, hq, sq, sk)-broadcastable mask (a bias's -inf)."""
    mask_mod = {"causal": fa4.masks.causal(), "none": None,
                "random": random_mask_mod(sq, sk, (128, 128), hq, sq, False)}[mask]
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, sq, sk, device="cuda")
    q = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, hk, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, hk, sk, dv, device="cuda", dtype=dtype)
    q = torch.cat([q, torch.randn_like(q)], -1)[..., :d].requires_grad_()  # non-contiguous
    k.requires_grad_(), v.requires_grad_()
    out, lse = fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                  return_lse=True)
    launch = _native.last_launch("fwd")
    assert launch is not None and launch["name"].endswith(f"sparse_{suffix}"), launch
    dout = torch.randn_like(out)
    wrt = (q, k, v, params) if learnable else (q, k, v)
    names = kernel_names(lambda: torch.autograd.grad(out, wrt, dout, retain_graph=True))
    assert any("fa4_kernelssm90bwd" in n for n in names), names
    grads = torch.autograd.grad(out, wrt, dout)
    visible = (torch.ones(1, 1, sq, sk, dtype=torch.bool, device="cuda") if mask_mod is None
               else create_mask(mask_mod, None, None, sq, sk, device="cuda"))
    if visible_too is not None:
        visible = visible & visible_too
    scale = 1.0 / math.sqrt(d)
    exact = [t.detach().double().requires_grad_() for t in wrt]
    want, want_lse = reference(*exact[:3], bias_full(exact[3] if learnable else params.double()), visible, scale,
                               torch.float64)
    want_grads = torch.autograd.grad(want, exact, dout.double())
    inputs = [t.detach().requires_grad_() for t in wrt]
    same, _ = reference(*inputs[:3], bias_full(inputs[3] if learnable else params.float()), visible, scale, dtype)
    same_grads = torch.autograd.grad(same.to(dtype), inputs, dout)
    seen = visible.expand(batch, hq, sq, sk).any(-1)
    err = (out.double() - want)[seen].abs().max().item()
    base = (same - want)[seen].abs().max().item()
    assert err <= 2 * base + 1e-3, (err, base)
    assert torch.all(out[~seen] == 0)
    assert (lse[seen].double() - want_lse[seen]).abs().max().item() <= 2e-3
    if learnable:
        # The parameters' gradient sums dS over ~10^6 pairs (alibi's weighted by distances up to the
        # sequence length), and dS = P (dP - rowsum(dO O)) holds O as stored, in the input dtype (as
        # every flash-style backward, torch's flex_attention too): its rounding, not the same math's,
        # sets the error there.
        same_grads = same_grads[:3] + (flash_style_grad(bias_full, params, exact, visible, scale, dout.double(),
                                                        out.detach().double()),)
        assert grads[3].shape == params.shape and grads[3].dtype == params.dtype
    for name, got, ref, same_grad in zip(("q", "k", "v", "params"), grads, want_grads, same_grads):
        err = (got.double() - ref).abs().max().item()
        base = (same_grad.double() - ref).abs().max().item()
        assert err <= 2 * base + 1e-3 * ref.abs().max().item(), (name, err, base)


CASES = [  # (kind, head_dim, head_dim_v, dtype, sq, sk, heads q/kv, mask, table center, learnable)
    ("alibi", 128, 128, torch.bfloat16, 1000, 1000, (4, 2), "causal", 0, True),
    ("alibi", 64, 64, torch.float16, 777, 901, (4, 4), "random", 0, False),
    ("alibi", 192, 128, torch.bfloat16, 555, 1111, (4, 4), "none", 0, True),
    ("relbias", 128, 128, torch.bfloat16, 1023, 1537, (8, 2), "random", 64, True),
    ("relbias", 96, 96, torch.float16, 700, 700, (2, 1), "causal", 1000, True),
    ("relbias", 256, 256, torch.bfloat16, 513, 1025, (4, 4), "none", 100, True),
    ("relbias", 192, 192, torch.float16, 640, 333, (2, 2), "random", 7, False),
    ("alibi", 256, 256, torch.float16, 129, 4095, (2, 2), "causal", 0, True),
    # Tables short against the sequences: most tiles clamp whole to one end (one entry, the
    # gradient's sums carried over a head's query blocks), the rest reduce their diagonals in the
    # backward's shared windows per warp; GQA groups flush per query head.
    ("relbias", 64, 64, torch.bfloat16, 901, 901, (4, 2), "causal", 40, True),
    ("relbias", 192, 128, torch.float16, 333, 1000, (4, 2), "none", 50, True),
    ("relbias", 128, 128, torch.float16, 1500, 700, (4, 4), "none", 16, False),
    ("alibi", 96, 96, torch.bfloat16, 600, 1300, (4, 1), "random", 0, True),
]


def case_id(c):
    return (f"{c[0]}-d{c[1]}x{c[2]}-{str(c[3])[6:]}-{c[4]}x{c[5]}-h{c[6][0]}/{c[6][1]}-{c[7]}-c{c[8]}-"
            f"{'learn' if c[9] else 'fixed'}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_score_mod_forward_and_backward_match_float64(case):
    kind, d, dv, dtype, sq, sk, (hq, hk), mask, center, learnable = case
    g = torch.Generator(device="cpu").manual_seed(sq + sk)
    if kind == "alibi":
        params = torch.exp2(-8.0 * torch.arange(1, hq + 1) / hq).cuda()
    else:
        params = (0.5 * torch.randn(hq, 2 * center + 1, generator=g)).cuda()
    params.requires_grad_(learnable)
    score_mod = score_mods.alibi(params) if kind == "alibi" else score_mods.relative_bias(params)
    check_call(score_mod, params, learnable, lambda p: bias_of(kind, p, sq, sk), kind, d, dv, dtype, sq, sk, hq, hk,
               mask)


def test_repeated_runs_agree_within_reduction_order():
    """The parameters' gradient is a sum of fp32 reductions in any order: runs agree to rounding,
    and dQ/dK/dV as the block-sparse backward's do."""
    hq, s, d = 4, 1024, 128
    table = (0.5 * torch.randn(hq, 2 * 300 + 1, device="cuda")).requires_grad_()
    q, k, v = (torch.randn(1, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    block_mask = create_block_mask(fa4.masks.causal(), None, None, s, s, device="cuda")
    runs = []
    for _ in range(3):
        out = fa4.flex_attention(q, k, v, score_mod=score_mods.relative_bias(table), block_mask=block_mask)
        runs.append(torch.autograd.grad(out.float().square().sum(), table)[0])
    for other in runs[1:]:
        torch.testing.assert_close(other, runs[0], atol=1e-3 * runs[0].abs().max().item(), rtol=1e-4)


def test_compiled_step_matches_eager():
    hq, s, d = 4, 700, 64
    slopes = torch.linspace(0.05, 0.5, hq, device="cuda").requires_grad_()
    q, k, v = (torch.randn(2, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    block_mask = create_block_mask(fa4.masks.causal(), None, None, s, s, device="cuda")

    def forward(q, k, v, slopes):
        return fa4.flex_attention(q, k, v, score_mod=score_mods.alibi(slopes), block_mask=block_mask)

    torch._dynamo.reset()
    got = torch.compile(forward, fullgraph=True)(q, k, v, slopes)
    want = forward(q, k, v, slopes)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    for a, e in zip(torch.autograd.grad(got.float().square().sum(), (q, slopes)),
                    torch.autograd.grad(want.float().square().sum(), (q, slopes))):
        torch.testing.assert_close(a.float(), e.float(), atol=2e-2 * e.abs().max().item(), rtol=2e-2)


BIAS_CASES = [  # (head_dim, head_dim_v, dtype, sq, sk, heads q/kv, mask, bias shape, learnable)
    (128, 128, torch.bfloat16, 1000, 1000, (4, 2), "causal", "full", True),
    (64, 64, torch.float16, 777, 901, (4, 4), "random", "queries x keys", True),
    (96, 96, torch.bfloat16, 700, 513, (2, 1), "none", "key padding", True),
    (192, 128, torch.bfloat16, 555, 1111, (4, 4), "none", "per head", True),
    (192, 192, torch.float16, 640, 333, (2, 2), "random", "full", False),
    (256, 256, torch.bfloat16, 513, 1025, (4, 4), "causal", "queries x keys", True),
    (128, 128, torch.float16, 129, 4095, (8, 2), "random", "key padding", False),
    (64, 64, torch.bfloat16, 1537, 1023, (2, 2), "none", "constant along keys", True),
]


def bias_shape(kind, batch, heads, sq, sk):
    return {"full": (batch, heads, sq, sk), "queries x keys": (sq, sk), "per head": (1, heads, sq, sk),
            "key padding": (batch, 1, 1, sk), "constant along keys": (batch, heads, sq, 1)}[kind]


def bias_case_id(c):
    learn = "learn" if c[8] else "fixed"
    return f"d{c[0]}x{c[1]}-{str(c[2])[6:]}-{c[3]}x{c[4]}-h{c[5][0]}/{c[5][1]}-{c[6]}-{c[7]}-{learn}"


@pytest.mark.parametrize("case", BIAS_CASES, ids=bias_case_id)
def test_bias_tensor_forward_and_backward_match_float64(case):
    """fa4.score_mods.bias(tensor): the kernels read the (broadcast) tensor at every score, edge
    tiles included, and add dS into its gradient summed over the broadcast dims."""
    d, dv, dtype, sq, sk, (hq, hk), mask, shape_kind, learnable = case
    batch = 2
    g = torch.Generator(device="cpu").manual_seed(sq * 7 + sk)
    bias = (2 * torch.randn(bias_shape(shape_kind, batch, hq, sq, sk), generator=g)).cuda()
    if shape_kind == "key padding":  # an additive mask: the last keys of batch 0 get no weight
        bias[0, ..., sk - 37:] = float("-inf")
    # Per-head and key-padding biases in the inputs' dtype (the "bias16" variants read them as such),
    # the others in fp32.
    in_dtype = shape_kind in ("per head", "key padding")
    bias = bias.to(dtype if in_dtype else torch.float32).requires_grad_(learnable)
    full = lambda b: b.expand(batch, hq, sq, sk).nan_to_num(neginf=0.0)  # noqa: E731 (masked where -inf)
    check_call(score_mods.bias(bias), bias, learnable, full, "bias16" if in_dtype else "bias", d, dv, dtype, sq, sk,
               hq, hk, mask, batch, torch.isfinite(bias.detach()).expand(batch, hq, sq, sk))
