import pytest
import torch

from fa4.testing import settle_cpu_math_kernels

settle_cpu_math_kernels()  # before any test's first exp/log: pytorch/pytorch#188792 (fa4.testing)


def has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_hopper = pytest.mark.skipif(not has_hopper(), reason="needs a Hopper (sm_90) GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
