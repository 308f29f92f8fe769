"""``python -m fa4.bench --context-parallel``: attention forward + backward sharded over the
sequence on every visible GPU by torch.distributed's ring attention (``context_parallel``), fa4
(``fa4.sdpa.activate()``, SDPA's flash backend) against cuDNN (SDPA's cuDNN backend) in the same
ring, and each on one GPU over the whole sequence.

bf16, batch 1, head_dim 128, 32 query heads on 8 K/V heads (``enable_gqa``), causal (torch's
head-tail load balancing) and not, at --cp-seqlens tokens (default 32k, 64k, 128k). One process
per GPU (NCCL), spawned here. A step is one forward and one backward; its time is the slowest
rank's, the median of --cp-iters steps run back to back (eager, as a training loop calls it: the
host's time is inside when the host is the slower). Reported: tokens per second, TFLOP/s per GPU
(forward + backward = 3.5 x the forward's FLOPs, of the visible pairs), the ring's fa4 / cuDNN
ratio, and each ring's scaling efficiency: ring tokens/s / (GPUs x one-GPU tokens/s).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
PROVIDERS = (("fa4", "FLASH_ATTENTION"), ("cuDNN", "CUDNN_ATTENTION"))


def run(args) -> None:
    from fa4.testing import run_in_process_group

    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("--context-parallel needs at least two GPUs")
    rows = run_in_process_group(_worker, world, "nccl", list(args.cp_seqlens), args.causal, args.cp_iters)[0]
    _report(rows, world)


def _report(rows, world) -> None:
    from fa4.bench import attention_flops

    print(f"\ncontext parallel over {world} GPUs: bf16, batch 1, hd{HEAD_DIM}, {HEADS_Q}/{HEADS_KV} heads; "
          f"k tokens/s (TFLOP/s per GPU), forward + backward")
    header = ("| seqlen | causal | fa4 1 GPU | cuDNN 1 GPU | fa4 ring | cuDNN ring | ring fa4/cuDNN | "
              "efficiency fa4 | efficiency cuDNN |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for seqlen, causal, ms in rows:
        flops = 3.5 * attention_flops(1, HEADS_Q, seqlen, HEAD_DIM, HEAD_DIM, causal)

        def cell(name, gpus):
            if ms.get(name) is None:
                return "n/a"
            return f"{seqlen / ms[name]:.0f} ({flops / gpus / ms[name] / 1e9:.0f})"

        ratio = f"{ms['cuDNN ring'] / ms['fa4 ring']:.2f}" if ms.get("cuDNN ring") and ms.get("fa4 ring") else "n/a"
        eff = {p: f"{ms[f'{p} 1 GPU'] / (world * ms[f'{p} ring']):.1%}"
               if ms.get(f"{p} 1 GPU") and ms.get(f"{p} ring") else "n/a" for p, _ in PROVIDERS}
        print(f"| {seqlen // 1024}k | {'yes' if causal else 'no'} | {cell('fa4 1 GPU', 1)} | "
              f"{cell('cuDNN 1 GPU', 1)} | {cell('fa4 ring', world)} | {cell('cuDNN ring', world)} | "
              f"{ratio} | {eff['fa4']} | {eff['cuDNN']} |", flush=True)


def _step_ms(step, iters: int) -> float:
    """Median ms of ``iters`` back-to-back steps (after one), the slowest rank's."""
    step()
    torch.cuda.synchronize()
    dist.barrier()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    median = torch.tensor(statistics.median(s.elapsed_time(e) for s, e in events), device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def _worker(rank, world, seqlens, causal_choice, iters):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa4.sdpa

    fa4.sdpa.activate()
    mesh = init_device_mesh("cuda", (world,))
    causals = {"both": [False, True], "yes": [True], "no": [False]}[causal_choice]
    rows = []
    for seqlen in seqlens:
        for causal in causals:
            g = torch.Generator(device="cuda").manual_seed(seqlen)
            make = lambda heads: torch.randn(1, heads, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16,  # noqa
                                             generator=g)
            full = [make(HEADS_Q), make(HEADS_KV), make(HEADS_KV), make(HEADS_Q)]
            ms = {}
            for name, backend in PROVIDERS:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    ms[f"{name} 1 GPU"] = _timed(_step(full, causal), iters, name, rank)
                    _cp_options.enable_load_balance = causal  # torch's ring balances causal work only
                    shards = [t.detach().clone() for t in full]
                    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4,
                                          no_restore_buffers=set(shards)):
                        ms[f"{name} ring"] = _timed(_step(shards, causal), iters, name, rank)
                    del shards
                torch.cuda.empty_cache()
            rows.append((seqlen, causal, ms))  # the same on every rank (the slowest rank's times)
            del full
            torch.cuda.empty_cache()
    return rows


def _step(tensors, causal):
    """One forward + backward through F.scaled_dot_product_attention, looked up at each call as a
    model does (inside ``context_parallel`` it is torch's ring-attention wrapper)."""
    q, k, v, dout = tensors
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        for t in (q, k, v):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(dout)
    return step


def _timed(step, iters, name, rank):
    """The step's time, or None (and why, from rank 0) where the backend cannot run it."""
    try:
        return _step_ms(step, iters)
    except RuntimeError as error:
        if rank == 0:
            print(f"{name}: {str(error).splitlines()[0]}", flush=True)
        return None
