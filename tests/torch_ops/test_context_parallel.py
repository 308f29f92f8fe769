"""fa4's SDPA provider inside torch.distributed's ring attention, on the CPU with gloo.

The ring (torch.distributed.tensor.experimental's ``_templated_ring_attention`` and its backward)
calls the flash op once per ring step and merges the partial outputs by their LSEs; under
``context_parallel`` with ``fa4.sdpa.activate()`` that op is fa4's provider (fa4.sdpa). Here the
ring calls the provider's functions directly on CPU tensors (fa4's reference path): two gloo
processes, causal with torch's head-tail load balancing (every ring step kind: the causal first
step, whole key shards, half key shards, half query shards) and not causal, GQA, against one
float64 attention over the whole sequence. That checks what the ring relies on: the LSE's layout
and base, the steps' strided views, the backward taking the merged output and LSE. The kernels
inside the same ring on two GPUs: tests/gpu/test_context_parallel_gpu.py.
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
        # fp32 inputs, the merge in fp32: errors at fp32 rounding (a wrong step, shard or LSE is O(1)).
        assert all(e < 1e-5 for e in errors.values()), (rank, errors)
