"""An AOTInductor package of a model that calls fa4 (dense and packed sequences): it gives the
eager results, and its fa4 calls reach the native operators without running Python (a Python
profiler sees neither fa4's functions nor torch.library's Python autograd during the call)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fa4

from ..conftest import requires_hopper

pytestmark = [pytest.mark.gpu, requires_hopper]


class Model(torch.nn.Module):
    def forward(self, q, k, v, cu_seqlens):
        dense = fa4.attention(q, k, v, causal=True)
        packed = fa4.attention_varlen(q[0], k[0], v[0], cu_seqlens, cu_seqlens, 200, 200, causal=True)
        return dense, packed


def aoti_failure_without_fa4() -> str | None:
    """None when AOTInductor compiles, loads and runs a model without fa4 in a fresh process here;
    otherwise what failed. On the GPU machine (torch 2.11 cu130) loading any package crashed in
    AOTInductorModel's constructor (std::regex in parse_device_str), fa4 imported or not."""
    probe = Path(__file__).resolve().parents[2] / "scripts" / "aoti_probe.py"
    proc = subprocess.run([sys.executable, str(probe), "plain"], capture_output=True, text=True, timeout=900)
    if proc.returncode == 0 and "equal: True" in proc.stdout:
        return None
    steps = " -> ".join(line.split()[0] for line in proc.stdout.splitlines() if line.strip())
    return f"AOTInductor fails here without fa4 (scripts/aoti_probe.py plain: exit {proc.returncode} after {steps or 'start'})"


def test_aoti_package_calls_the_native_operators(tmp_path):
    failure = aoti_failure_without_fa4()
    if failure:
        pytest.skip(failure)
    q = torch.randn(1, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    program = torch.export.export(Model(), (q, k, v, cu))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    model = torch._inductor.aoti_load_package(path)
    want = Model()(q, k, v, cu)
    model(q, k, v, cu)  # warm-up
    package = os.path.dirname(fa4.__file__)
    python_autograd = os.path.join("torch", "_library")
    seen = []

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and (name.startswith(package) or python_autograd in name):
            seen.append(f"{name}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        got = model(q, k, v, cu)
    finally:
        sys.setprofile(None)
    assert seen == []
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
