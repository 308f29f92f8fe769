"""fa4 in transformers on CUDA (bf16, hd64): logits, gradients and generate() against "sdpa"
within bf16 tolerance. Skips where transformers is not installed (the GPU machine has no
network: carry its wheels)."""
import pytest
import torch

from ..conftest import requires_hopper
from ..torch_ops.integrations.test_transformers import grads, models

pytestmark = [pytest.mark.gpu, requires_hopper]
pytest.importorskip("transformers")


def test_llama_on_cuda_matches_sdpa():
    model, ref = models("cuda", torch.bfloat16, head_dim=64)
    x = torch.randint(0, 128, (2, 300), device="cuda")
    mask = torch.ones_like(x)
    mask[0, :50] = 0
    a, b = model(x, attention_mask=mask).logits.float(), ref(x, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (a[real] - b[real]).abs().max() <= 0.05 * b[real].abs().max()
    for ga, gb in zip(grads(model, a[real].square().mean()), grads(ref, b[real].square().mean())):
        assert (ga.float() - gb.float()).abs().max() <= 0.05 * gb.float().abs().max() + 1e-6
    out = model.generate(x[:, :20], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 28)
