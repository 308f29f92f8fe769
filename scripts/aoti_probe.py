"""Diagnostics: export + AOTInductor-compile a model calling fa4 on CUDA, step by step, printing
where it stops (tests/gpu/test_aoti_gpu.py is skipped while aoti_compile_and_package crashes).

    python3 -X faulthandler scripts/aoti_probe.py {dense,varlen,plain}

"plain" exports a model without fa4 (fa4 not even imported): whether AOTInductor itself runs here.
"""
import sys

import torch

kind = sys.argv[1] if len(sys.argv) > 1 else "dense"
if kind != "plain":
    import fa4


class Model(torch.nn.Module):
    def forward(self, q, k, v, cu):
        if kind == "plain":
            return torch.softmax(q[:, :, :2] @ k.transpose(2, 3), dim=-1) @ v
        if kind == "dense":
            return fa4.attention(q, k, v, causal=True)
        return fa4.attention_varlen(q[0], k[0], v[0], cu, cu, 200, 200, causal=True)


q = torch.randn(1, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
program = torch.export.export(Model(), (q, k, v, cu))
print("exported", flush=True)
path = torch._inductor.aoti_compile_and_package(program, package_path=f"/tmp/fa4_{kind}.pt2")
print("compiled", path, flush=True)
model = torch._inductor.aoti_load_package(path)
print("loaded", flush=True)
got, want = model(q, k, v, cu), Model()(q, k, v, cu)
# fa4's kernels give the eager bits; the plain model's generated kernels may round differently.
same = torch.equal(got, want) if kind != "plain" else torch.allclose(got, want, atol=2e-2, rtol=2e-2)
print("equal:", same, flush=True)
