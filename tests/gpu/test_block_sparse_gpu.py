"""fa4's block-sparse kernels (fa4::fwd_sparse / fa4::bwd_sparse through fa4.flex_attention) on
CUDA: random BlockMasks with empty, partial and full blocks, rows and keys that see nothing,
BlockMask block sizes that differ from the kernels' tiles, odd lengths, GQA, every head dim,
softcap; outputs and gradients within twice the error of the same math in the input dtype of a
float64 formula, with the variants named."""
import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import fa4
from fa4 import _native, block_sparse, score_mods

from ..conftest import requires_hopper
from .test_sdpa_gpu import kernel_names

pytestmark = [pytest.mark.gpu, requires_hopper]


def random_mask_mod(sq, sk, block, heads, seed, per_head):
    """Half of the (block x block) cells kept, half of those partial (a per-element pattern),
    and the first query block's rows seeing nothing at all."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    qb, kb = -(-sq // block[0]) + 1, -(-sk // block[1]) + 1
    keep = (torch.rand(qb, kb, generator=g) < 0.5).cuda()
    partial = (torch.rand(qb, kb, generator=g) < 0.5).cuda()
    keep[0] = False

    def mask_mod(b, h, q, kv):
        cell_q, cell_k = q // block[0], kv // block[1]
        pattern = (q * 7 + kv * 3 + (h if per_head else 0)) % 5 != 0
        return keep[cell_q, cell_k] & (~partial[cell_q, cell_k] | pattern)

    return mask_mod


def reference(q, k, v, visible, scale, softcap, dtype):
    """(out, lse) of masked attention computed in ``dtype`` ((b, h, s, d) layout, GQA repeated);
    rows that see no key give 0 and -inf. Differentiable."""
    hq = q.shape[1]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = (t.repeat_interleave(hq // t.shape[1], 1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)).to(acc) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (p.to(dtype) @ v).to(torch.float64), lse


CASES = [  # (head_dim, head_dim_v, dtype, sq, sk, BlockMask block, heads q/kv, softcap, per-head mask)
    (64, 64, torch.bfloat16, 1000, 1000, 128, (4, 4), 0.0, False),
    (96, 96, torch.float16, 777, 901, 64, (4, 2), 0.0, True),
    (128, 128, torch.bfloat16, 1023, 1537, (128, 64), (8, 2), 0.0, False),
    (128, 128, torch.bfloat16, 640, 333, 128, (2, 2), 30.0, True),
    (192, 128, torch.bfloat16, 555, 1111, 128, (4, 4), 0.0, False),
    (192, 192, torch.float16, 700, 700, 64, (2, 1), 20.0, False),
    (256, 256, torch.bfloat16, 513, 1025, 128, (4, 4), 0.0, True),
    (64, 64, torch.float16, 129, 4095, (64, 128), (2, 2), 15.0, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}x{c[1]}-{str(c[2])[6:]}-{c[3]}x{c[4]}-blk{c[5]}"
                                                       f"-h{c[6][0]}/{c[6][1]}-cap{c[7]}-{'head' if c[8] else 'bcast'}")
def test_block_sparse_forward_matches_float64(case):
    d, dv, dtype, sq, sk, block, (hq, hk), softcap, per_head = case
    batch = 2
    mask_mod = random_mask_mod(sq, sk, (block, block) if isinstance(block, int) else block, hq, sq + sk, per_head)
    block_mask = create_block_mask(mask_mod, None, hq if per_head else None, sq, sk, device="cuda",
                                   BLOCK_SIZE=block)
    q = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, hk, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, hk, sk, dv, device="cuda", dtype=dtype)
    # Non-contiguous views: the (B, H, S, D) inputs are slices of wider buffers.
    q = torch.cat([q, torch.randn_like(q)], -1)[..., :d].requires_grad_()
    k.requires_grad_(), v.requires_grad_()
    score_mod = score_mods.softcap(softcap) if softcap else None
    out, lse = fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                  return_lse=True)
    launch = _native.last_launch("fwd")
    assert launch is not None and "sparse" in launch["name"], launch
    dout = torch.randn_like(out)
    # The backward runs on autograd's device thread (the launch record is per thread): the
    # profiler names its kernel; no other fa4 kernel serves this mask (torch's would warn).
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    assert any("fa4_kernelssm90bwd" in n for n in names), names
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = create_mask(mask_mod, None, hq if per_head else None, sq, sk, device="cuda")
    scale = 1.0 / math.sqrt(d)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, want_lse = reference(*exact, visible, scale, softcap, torch.float64)
    want_grads = torch.autograd.grad(want, exact, dout.double())
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    same_math, _ = reference(*inputs, visible, scale, softcap, dtype)
    same_grads = torch.autograd.grad(same_math.to(dtype), inputs, dout)
    seen = visible.expand(batch, hq, sq, sk).any(-1)
    assert seen.any() and not seen.all()  # the mask has rows that see nothing
    err = (out.double() - want)[seen].abs().max().item()
    base = (same_math - want)[seen].abs().max().item()
    assert err <= 2 * base + 1e-3, (err, base)
    assert torch.all(out[~seen] == 0) and torch.all(torch.isneginf(lse[~seen]))
    assert (lse[seen].double() - want_lse[seen]).abs().max().item() <= 1e-3
    for name, got, ref, same in zip("qkv", grads, want_grads, same_grads):
        err = (got.double() - ref).abs().max().item()
        base = (same.double() - ref).abs().max().item()
        assert err <= 2 * base + 1e-3 * ref.abs().max().item(), (name, err, base)


def test_tables_reused_and_block_data_alone():
    """A BlockMask without a mask_mod (its blocks are the mask), through the same tables on a
    second call; the kernel agrees with torch's flex_attention on it."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    sq = sk = 1024
    g = torch.Generator(device="cpu").manual_seed(3)
    dense = (torch.rand(1, 1, 8, 8, generator=g) < 0.4).cuda()
    dense[..., 0] = True
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense.int(), dim=-1, descending=True, stable=True).to(torch.int32)
    block_mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(sq, sk))
    q, k, v = (torch.randn(1, 4, sq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = fa4.flex_attention(q, k, v, block_mask=block_mask)
    tile = block_sparse.kernel_tile(q.dtype, 128, 128, q.device)
    assert block_sparse.tables(block_mask, 1, 4, tile) is block_sparse.tables(block_mask, 1, 4, tile)
    again = fa4.flex_attention(q, k, v, block_mask=block_mask)
    assert torch.equal(first, again)
    want = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
    assert (first.float() - want.float()).abs().max() <= 2e-2


def test_keys_no_query_sees_get_zero_gradients():
    """K/V tiles that no row sees visit one query block through the all-clear slot: dK = dV = 0."""
    mask_mod = lambda b, h, q, kv: kv < 300  # noqa: E731  keys 300-999 seen by nobody
    block_mask = create_block_mask(mask_mod, None, None, 500, 1000, device="cuda")
    q, k, v = (torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n in (500, 1000, 1000))
    out = fa4.flex_attention(q, k, v, block_mask=block_mask)
    dk, dv = torch.autograd.grad(out, (k, v), torch.randn_like(out))
    assert "sparse" in _native.last_launch("fwd")["name"]
    assert torch.all(dk[:, :, 300:] == 0) and torch.all(dv[:, :, 300:] == 0)
    assert dk[:, :, :300].abs().sum() > 0 and dv[:, :, :300].abs().sum() > 0


def test_compiled_step_matches_eager():
    """torch.compile (Inductor, fullgraph) over a forward with a mask only the block-sparse
    kernels serve: the tables build inside the graph (a slot per entry, no host sync); the
    forward is bitwise eager's, the gradients (dQ added in any order) within bf16 rounding."""
    mask_mod = random_mask_mod(700, 900, (128, 128), 4, 7, False)
    block_mask = create_block_mask(mask_mod, None, None, 700, 900, device="cuda")
    q = torch.randn(2, 4, 700, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 900, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def forward(q, k, v):
        return fa4.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    compiled = torch.compile(forward, fullgraph=True)
    got, want = compiled(q, k, v), forward(q, k, v)
    assert torch.equal(got, want)
    dout = torch.randn_like(got)
    for a, e in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert (a.float() - e.float()).abs().max() <= 1e-2 * e.float().abs().max()


def test_deterministic_training_falls_back_to_torch(monkeypatch):
    """Under torch.use_deterministic_algorithms the block-sparse backward (dQ added in any
    order) is not used: torch's flex_attention trains instead, after the one-time warning."""
    from fa4 import flex

    monkeypatch.setattr(flex, "_WARNED", set())
    mask_mod = random_mask_mod(256, 256, (128, 128), 2, 3, False)
    block_mask = create_block_mask(mask_mod, None, None, 256, 256, device="cuda")
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.warns(UserWarning, match="use_deterministic_algorithms"):
            out = fa4.flex_attention(q, k, v, block_mask=block_mask)
    finally:
        torch.use_deterministic_algorithms(False)
    out.sum().backward()
    visible = create_mask(mask_mod, None, None, 256, 256, device="cuda")
    want, _ = reference(q.detach(), k.detach(), v.detach(), visible, 64 ** -0.5, 0.0, torch.float64)
    assert (out.double() - want).abs().max() <= 2e-2
    assert q.grad is not None and torch.isfinite(q.grad).all()
