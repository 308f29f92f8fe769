"""Shared test oracles: a naive float64 attention with fa4's mask semantics, and error metrics."""
from __future__ import annotations

import math

import torch


def visible_keys(sq: int, sk: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    """(sq, sk) bool: which keys each query row sees, bottom-right aligned (causal is window
    (-1, 0); -1 leaves a side unbounded)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= j >= diag - left
    return visible


def naive_attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0):
    """float64 (out (b, sq, hq, dv), lse (b, hq, sq)) computed the obvious way, for checking."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vd = v.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = qd @ kd.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible_keys(sq, sk, causal, window, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = (p @ vd).transpose(1, 2)
    return out, lse


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are 0); NaN anywhere gives inf."""
    x, ref = x.double(), ref.double()
    if torch.isnan(x).any():
        return float("inf")
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error over finite entries; inf if the -inf pattern differs or NaN appears."""
    lse, ref = lse.double(), ref.double()
    if torch.isnan(lse).any() or not torch.equal(torch.isinf(lse), torch.isinf(ref)):
        return float("inf")
    finite = ~torch.isinf(ref)
    return (lse[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0


def rising_scores(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int,
                  head_dim_v: int, *, device="cuda", generator=None):
    """fp32 q, k, v whose scores rise by ~1.6 powers of two per key towards key 0 (at the default
    scale): key 0 is where a forward kernel's last K/V block lies, so every block it visits after
    a tile's first raises each row's max by ~200 powers of two, past the exp2 range of an
    exponential taken against the previous max (the speculative row max then has to redo)."""
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device=device, generator=generator)
    q[..., 0] = 5.0
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device=device, generator=generator)
    ramp = torch.arange(seqlen_k, 0, -1, device=device, dtype=torch.float32)
    k[..., 0] = 2.5 * (head_dim / 128) ** 0.5 * ramp[None, :, None]
    v = torch.randn(batch, seqlen_k, heads_k, head_dim_v, device=device, generator=generator)
    return q, k, v


def settle_cpu_math_kernels() -> None:
    """Call each of torch's CPU float unary math ops once, on one thread, so that no later call is
    a process's first.

    torch hands contiguous fp32/fp64 unary ops (exp, log, tanh, ...) to MKL VML, which picks each
    function's kernel on its first call; when that first call runs on several intra-op threads at
    once, one thread can get a low-accuracy kernel for its chunk of that one call
    (pytorch/pytorch#188792). Here that was 1.5e-4 relative error on ~45% of the first
    ``torch.exp`` in about one spawned process in 25: a CPU-reference attention 60x off its usual
    fp32 error, one run in a few. A 64-element call stays on one thread."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((64,), 0.5, dtype=dtype)
        for op in (torch.exp, torch.expm1, torch.log, torch.log1p, torch.tanh, torch.sigmoid, torch.sqrt,
                   torch.rsqrt, torch.erf):
            op(x)


def run_in_process_group(worker, world_size: int, backend: str, *args) -> list:
    """``[worker(rank, world_size, *args) for each rank]``, each call in a fresh process joined in
    one default process group of ``backend`` ("nccl": rank r uses GPU r; "gloo": CPU). ``worker``
    must be a module-level function returning something picklable (the processes are spawned, not
    forked: CUDA needs that). A worker that raises fails the call with its traceback."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as rendezvous, mp.get_context("spawn").Manager() as manager:
        returned = manager.dict()
        mp.spawn(_group_main, args=(world_size, backend, f"{rendezvous}/store", worker, args, returned),
                 nprocs=world_size, join=True)
        return [returned[rank] for rank in range(world_size)]


def _group_main(rank, world_size, backend, store_file, worker, args, returned):
    import torch.distributed as dist

    settle_cpu_math_kernels()
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)
    try:
        returned[rank] = worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
