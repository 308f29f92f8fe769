"""fa4.sdpa: the provider registers and unregisters without touching the default until asked
(the kernels themselves: tests/gpu/test_sdpa_gpu.py)."""
import pytest
import torch

import fa4.sdpa

attention = torch.nn.attention
needs_registry = pytest.mark.skipif(not hasattr(attention, "register_flash_attention_impl"),
                                    reason="torch < 2.10 has no flash-attention provider registry")


@needs_registry
def test_import_does_not_activate_and_deactivate_restores():
    assert attention.current_flash_attention_impl() != "fa4"
    fa4.sdpa.activate()
    try:
        assert attention.current_flash_attention_impl() == "fa4" and "fa4" in attention.list_flash_attention_impls()
    finally:
        fa4.sdpa.deactivate()
    assert attention.current_flash_attention_impl() is None
    fa4.sdpa.deactivate()  # a second call is a no-op
