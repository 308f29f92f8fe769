import fa4
from fa4 import info


def test_report_names_versions_kernels_and_devices():
    text = info.report()
    assert text.startswith(f"fa4 {fa4.__version__}, torch ")
    assert "native operators:" in text and "settings:" in text
    if fa4._native.manifest()["variants"]:
        assert "(head_dim, head_dim_v): [(64, 64)" in text and "built for torch >= 2.10" in text
    assert "CUDA: not available" in text or "cuda:0" in text
