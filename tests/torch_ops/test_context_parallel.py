"""fa4's SDPA provider inside torch.distributed's ring attention, on the CPU with gloo.

The ring (torch.distributed.tensor.experimental's ``_templated_ring_attention`` and its backward)
calls the flash op once per ring step and merges the partial outputs by their LSEs; under
``context_parallel`` with ``fa4.sdpa.activate()`` that op is fa4's provider (fa4.sdpa). Here the
ring calls the provider's functions directly on CPU tensors (fa4's reference path): two gloo
processes, causal with torch's head-tail load balancing (every ring step kind: the causal first
step, whole key shards, half key shards, half query shards) and not causal, GQA, against one
float64 attention over the whole sequence. That checks what the ring relies on: the LSE's layout
and base, the steps' strided views, the backward taking the merged output and LSE.

The flex path too: torch's flex context-parallel style (K/V all-gathered, the shard's BlockMask
from ``_context_parallel_shard`` with head-tail load balancing, dK/dV reduce-scattered) around
fa4.flex_attention, a causal document mask and a causal window, forward and backward. The kernels
inside both on two GPUs: tests/gpu/test_context_parallel_gpu.py.
"""
import pytest
import torch
import torch.distributed as dist

import fa4.sdpa
from fa4.testing import naive_attention, rel_error, run_in_process_group

cp = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention",
                         reason="this torch has no context-parallel ring attention")

WORLD = 2
BATCH, HEADS_Q, HEADS_KV, SEQLEN, HEAD_DIM = 2, 4, 2, 88, 32  # SEQLEN: a multiple of 2 * WORLD, of no tile


def _inputs():
    g = torch.Generator().manual_seed(11)
    shape = lambda heads: (BATCH, heads, SEQLEN, HEAD_DIM)  # noqa: E731  (B, H, S, D), as SDPA
    return [torch.randn(shape(h), generator=g) for h in (HEADS_Q, HEADS_KV, HEADS_KV, HEADS_Q)]


def _ring_worker(rank, world, causal):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    group = dist.group.WORLD
    q, k, v, dout = _inputs()
    # Causal: torch's head-tail load balancing, as context_parallel shards (chunks i and 2w-1-i).
    order = (_HeadTailLoadBalancer(SEQLEN, world, "cpu")._generate_indices()[0] if causal
             else torch.arange(SEQLEN))
    mine = order.view(world, -1)[rank]
    local = [t[:, :, mine] for t in (q, k, v, dout)]
    saved = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = causal
    try:
        out, lse, *rest = cp._templated_ring_attention(group, 2, fa4.sdpa._sdpa_forward, *local[:3],
                                                       is_causal=causal, dropout_p=0.0, scale=None)
        _, _, max_q, max_k, seed, offset, _ = rest  # cum_seq_q, cum_seq_k, ..., debug_mask
        dq, dk, dv, *_ = cp._templated_ring_attention_backward(
            group, 2, fa4.sdpa._sdpa_backward, grad_out=local[3], grad_out_name="grad_out", query=local[0],
            key=local[1], value=local[2], out=out, logsumexp=lse, is_causal=causal, cum_seq_q=None,
            cum_seq_k=None, max_q=max_q, max_k=max_k, dropout_p=0.0, philox_seed=seed, philox_offset=offset,
            scale=None)
    finally:
        cp._cp_options.enable_load_balance = saved
    # One float64 attention over the whole sequence, its rows and gradients at this rank's tokens.
    q64, k64, v64 = (t.double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = naive_attention(q64, k64, v64, causal=causal)
    ref_out.backward(dout.double().transpose(1, 2))
    t = lambda x: x.transpose(1, 2)[:, :, mine]  # noqa: E731
    errors = {"out": rel_error(out, t(ref_out)), "lse": (lse.double() - ref_lse[:, :, mine]).abs().max().item(),
              "dq": rel_error(dq, t(q64.grad)), "dk": rel_error(dk, t(k64.grad)), "dv": rel_error(dv, t(v64.grad))}
    return errors


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_through_fa4_provider(causal):
    for rank, errors in enumerate(run_in_process_group(_ring_worker, WORLD, "gloo", causal)):
        # fp32 inputs, the merge in fp32: errors at fp32 rounding, ~5e-7 (a wrong step, shard or LSE
        # is O(1)). The 1-4e-5 that one run in a few used to show was MKL's first-call exp in a
        # fresh process (fa4.testing.settle_cpu_math_kernels), which the process group now settles.
        assert all(e < 1e-5 for e in errors.values()), (rank, errors)


def _flex_worker(rank, world, mask_name):
    """torch's flex context-parallel style around fa4.flex_attention on the CPU (fa4's block-sparse
    path on its reference: torch's rewritten mask_mod is no fa4.masks constructor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    import fa4
    import fa4.flex
    from fa4 import masks

    seqlen = 512  # torch's flex path: a multiple of world x 128
    doc_ids = torch.tensor([0] * 150 + [1] * 200 + [2] * 5 + [3] * 157)
    mask_mod = masks.document(doc_ids, causal=True) if mask_name == "document" else masks.sliding_window(100, 0)
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, HEADS_Q, seqlen, HEAD_DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(1, HEADS_KV, seqlen, HEAD_DIM, generator=g) for _ in range(2))
    block_mask = create_block_mask(mask_mod, 1, 1, seqlen, seqlen, device="cpu")

    class FlexAttention(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return fa4.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    mesh = init_device_mesh("cpu", (world,))
    module = parallelize_module(FlexAttention(), mesh,
                                cp._ContextParallel(seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX))
    balancer = _HeadTailLoadBalancer(seqlen, world, "cpu")
    # The shard's BlockMask without torch.compile (torch compiles create_block_mask for it; eager
    # gives the same mask and keeps a C++ compile out of this CPU test).
    cp._compiled_create_block_mask = create_block_mask
    shards = cp._context_parallel_shard(mesh, [q, k, v, dout, block_mask], [2] * 5, load_balancer=balancer)
    sq, sk, sv, sdout, shard_mask = shards
    for t in (sq, sk, sv):
        t.requires_grad_()
    fa4.flex._WARNED.clear()
    out = module(sq, sk, sv, block_mask=shard_mask)
    out.backward(sdout)
    got = cp.context_parallel_unshard(mesh, [out.detach(), sq.grad, sk.grad, sv.grad], [2] * 4,
                                      load_balancer=balancer)
    # float64 over the whole sequence with the mask's dense form.
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    dense = create_mask(mask_mod, 1, 1, seqlen, seqlen, device="cpu")
    group = HEADS_Q // HEADS_KV
    scores = q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2) * HEAD_DIM ** -0.5
    ref = torch.softmax(scores.masked_fill(~dense, float("-inf")), -1) @ v64.repeat_interleave(group, 1)
    ref.backward(dout.double())
    errors = {name: rel_error(x, r) for name, x, r in zip(("out", "dq", "dk", "dv"), got,
                                                        (ref, q64.grad, k64.grad, v64.grad))}
    errors["fallbacks"] = len(fa4.flex._WARNED)
    return errors


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
@pytest.mark.parametrize("mask_name", ["document", "window"])
def test_flex_context_parallel_through_fa4(mask_name):
    for rank, errors in enumerate(run_in_process_group(_flex_worker, WORLD, "gloo", mask_name)):
        assert errors.pop("fallbacks") == 0, rank  # fa4's kernels (here their reference), not torch's flex
        assert all(e < 1e-5 for e in errors.values()), (rank, errors)
