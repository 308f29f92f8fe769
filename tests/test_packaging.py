"""The wheel: ``pip wheel .`` makes a platform wheel holding the kernels and native libraries,
which installed into a fresh virtual environment without the DSL (its imports blocked) and
without building anything runs fa4 (the CPU path here; the GPU machine runs the same files)."""
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BUILT = (ROOT / "torch_ops" / "fa4" / "_native" / "libfa4.so").exists()

RUN = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('cutlass', 'fa4_kernels'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import torch, fa4
from fa4.testing import naive_attention
assert fa4.__file__.startswith(sys.argv[1]), fa4.__file__
q, k, v = (torch.randn(1, 37, 4, 64, dtype=torch.float64) for _ in range(3))
out = fa4.attention(q, k, v, causal=True)
assert torch.allclose(out, naive_attention(q, k, v, causal=True)[0], atol=1e-10)
import fa4.info
print(fa4.info.report().splitlines()[1])
"""


@pytest.mark.skipif(not BUILT, reason="an unbuilt checkout (the wheel build reuses the build's cache)")
def test_wheel_installs_and_runs_without_the_dsl(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(wheels)], check=True,
                   capture_output=True)
    wheel = next(wheels.glob("fa4-*.whl"))
    # One wheel for every Python, tagged for the newest glibc its libraries need (setup.py).
    assert re.search(r"-py3-none-manylinux_2_\d+_x86_64\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    for lib in ("libfa4.so", "libfa4_ops.so", "libfa4_rules.so", "variants.json"):
        assert any(n.endswith(f"fa4/_native/{lib}") for n in names), lib
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    # torch from this environment (a plain path entry: its site-packages' .pth files, this
    # checkout's editable install among them, are not read)
    (site / "outer_torch.pth").write_text(str(Path(torch.__file__).resolve().parent.parent) + "\n")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", RUN, str(site)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "native operators:" in done.stdout
