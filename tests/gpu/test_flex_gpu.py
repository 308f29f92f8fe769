"""fa4.flex_attention on CUDA: the masks and score_mods fa4 reads as data run fa4's kernels
(forward and backward, the profiler's kernel names say so) with results within bf16 error of a
float64 formula; the others run torch's flex_attention, compiled as torch runs it."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import fa4
from fa4 import masks, score_mods

from ..conftest import requires_hopper
from .test_sdpa_gpu import kernel_names

pytestmark = [pytest.mark.gpu, requires_hopper]

CASES = {
    "causal": (masks.causal(), None, (1000, 1000)),
    "window, softcap": (masks.and_masks(masks.causal(), masks.sliding_window(200, 0)), score_mods.softcap(8.0),
                        (1000, 1000)),
    "causal, more queries": (masks.causal(), None, (777, 555)),
    "prefix lm, softcap": (masks.prefix_lm(130), score_mods.softcap(8.0), (1000, 1000)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fa4_kernels_run_and_match_float64(case):
    mask_mod, score_mod, (sq, sk) = CASES[case]
    q = torch.randn(2, 8, sq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, sk, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    block_mask = create_block_mask(mask_mod, None, None, sq, sk, device="cuda")
    dout = torch.randn(2, 8, sq, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        out = fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    check_fa4_step(step, (q, k, v), dout, score_mod, mask_mod)


def check_fa4_step(step, inputs, dout, score_mod, mask_mod):
    """``step`` (a forward and its gradients) runs fa4's forward and backward kernels and lands
    within bf16 error of the float64 formula."""
    names = kernel_names(step)
    assert any("fa4_kernelssm90fwd" in n for n in names) and any("fa4_kernelssm90bwd" in n for n in names), names
    out, grads = step()
    exact = [t.detach().double().requires_grad_() for t in inputs]
    want, _ = _naive_cuda(*exact, score_mod, mask_mod)
    want_grads = torch.autograd.grad(want, exact, dout.double())
    assert (out.double() - want).abs().max() <= 2e-2 * want.abs().max()
    for got, ref in zip(grads, want_grads):
        assert (got.double() - ref).abs().max() <= 3e-2 * ref.abs().max()


def _naive_cuda(q, k, v, score_mod, mask_mod):
    """softmax(score_mod(q k^T * scale)) v over the keys mask_mod keeps (GQA heads repeated), on
    the inputs' device; rows that keep no key give 0."""
    hq = q.shape[1]
    k, v = (t.repeat_interleave(hq // t.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    idx = [torch.arange(n, device=q.device).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate(s.shape)]
    if score_mod is not None:
        s = score_mod(s, *idx)
    s = s.masked_fill(~mask_mod(*idx).expand_as(s), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v, lse


@pytest.mark.parametrize("causal", [False, True])
def test_documents_run_fa4_packed_kernels(causal):
    lengths = [700, 1, 333, 1000, 15]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask_mod = masks.and_masks(masks.document(ids, causal=causal, device="cuda"), masks.sliding_window(300, -1))
    n = sum(lengths)
    q = torch.randn(1, 4, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 4, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    dout = torch.randn_like(q)

    def step():
        out = fa4.flex_attention(q, k, v, block_mask=block_mask)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    check_fa4_step(step, (q, k, v), dout, None, mask_mod)


def test_a_split_document_mask_falls_back_to_torch():
    doc_ids = torch.arange(300, device="cuda") % 3  # every document in 100 runs: not packed sequences
    mask_mod = masks.document(doc_ids, causal=True)
    q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.float32) for _ in range(3))
    block_mask = create_block_mask(mask_mod, None, None, 300, 300, device="cuda")
    with pytest.warns(UserWarning, match="Document mask whose documents are not contiguous runs"):
        out = fa4.flex_attention(q, k, v, block_mask=block_mask)
    want, _ = _naive_cuda(q.double(), k.double(), v.double(), None, mask_mod)
    assert (out.double() - want).abs().max() <= 1e-3


def test_compiled_step_matches_eager():
    """torch.compile (Inductor, fullgraph) over a step with a document mask and a sliding window:
    no graph break, the eager results."""
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([200, 57, 300]))
    block_mask = create_block_mask(masks.and_masks(masks.document(ids, causal=True, device="cuda"),
                                                   masks.sliding_window(64, 0)), None, None, 557, 557, device="cuda")
    q, k, v = (torch.randn(2, 4, 557, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def forward(q, k, v):
        return fa4.flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mods.softcap(20.0))

    compiled = torch.compile(forward, fullgraph=True)  # its backward compiled by AOTAutograd
    got, want = compiled(q, k, v), forward(q, k, v)
    assert torch.equal(got, want)
    for a, e in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert (a - e).abs().max() <= 1e-2 * e.abs().max()  # dQ additions may land in another order
