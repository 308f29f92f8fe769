"""Checks on the real build outputs (run after `pip install -e .` / the AOT build)."""
import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fa4_kernels import catalog

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "torch_ops" / "_native"
built = pytest.mark.skipif(not (NATIVE / "libfa4.so").exists(), reason="native library not built")


@built
def test_manifest_matches_catalog_and_library():
    manifest = json.loads((NATIVE / "variants.json").read_text())
    names = [v["name"] for v in manifest["variants"]]
    # The build records the arch list and filter it was asked for; a full build has no filter.
    expected = [v.name for v in catalog.select_variants(catalog.all_variants(tuple(manifest["archs"])),
                                                          manifest["filter"])]
    assert names == expected
    nm = subprocess.run(["nm", "-D", "--defined-only", str(NATIVE / "libfa4.so")], capture_output=True, text=True, check=True).stdout
    for sym in ("fa4_fwd", "fa4_num_variants", "fa4_variant_name", "fa4_last_error"):
        assert f" T {sym}\n" in nm
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(NATIVE / "libfa4.so")], capture_output=True, text=True, check=True).stdout
    # Our own forwards satisfy the objects' imports; nothing from the DSL wheel's archives.
    assert "_cudaLaunchKernelEx" not in undefined and "_cuKernelGetAttribute" not in undefined
    assert "cutlass" not in undefined.lower() and "cute_dsl" not in undefined.lower()


@built
def test_library_loads_and_lists_variants():
    cudart = [p for sp in map(Path, sys.path) for p in [sp / "nvidia" / "cu13" / "lib" / "libcudart.so.13"] if p.exists()]
    try:
        if cudart:
            ctypes.CDLL(str(cudart[0]), mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(str(NATIVE / "libfa4.so"))
    except OSError as e:
        pytest.skip(f"libcudart.so.13 not loadable here: {e}")
    lib.fa4_variant_name.restype = ctypes.c_char_p
    manifest = json.loads((NATIVE / "variants.json").read_text())
    assert lib.fa4_num_variants() == len(manifest["variants"])
    assert [lib.fa4_variant_name(i).decode() for i in range(lib.fa4_num_variants())] == [v["name"] for v in manifest["variants"]]


def _sass_tool():
    tool = ROOT.parent / "shared" / "tools" / "sass_report.py"
    return tool if tool.exists() else None


@built
@pytest.mark.skipif(_sass_tool() is None, reason="../shared/tools/sass_report.py not present")
def test_every_shipped_object_uses_hopper_instructions():
    if not (shutil.which("cuobjdump") or any((Path(sp) / "nvidia" / "cu13" / "bin" / "cuobjdump").exists() for sp in sys.path)):
        pytest.skip("cuobjdump/nvdisasm not installed")
    objects = sorted(str(p) for p in (ROOT / "build" / "aot").rglob("fa4_fwd_sm_90a_*.o"))
    manifest = json.loads((NATIVE / "variants.json").read_text())
    shipped = {v["name"] for v in manifest["variants"]}
    objects = [o for o in objects if Path(o).stem in shipped]
    assert objects
    proc = subprocess.run([sys.executable, str(_sass_tool()), "--require", "HGMMA,UTMALDG,SETMAXREG", *objects],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # No register spills in any image. The report grows an LDL/STL column only when some image
    # has them. The 160-register (hd64) and 240-register (hd192/hd256) consumers are close to
    # spilling: small kernel changes can tip a variant over (docs/perf_notes.md).
    lines = proc.stdout.strip().splitlines()
    header = lines[0].split("\t")
    if "LDL/STL" in header:
        col = header.index("LDL/STL")
        spilling = {row.split("\t")[0]: int(row.split("\t")[col]) for row in lines[1:] if row.split("\t")[col] != "0"}
        assert not spilling, spilling
