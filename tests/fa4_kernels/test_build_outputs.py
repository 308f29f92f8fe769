"""Checks on the real build outputs (run after `pip install -e .` / the AOT build)."""
import concurrent.futures
import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fa4_kernels import catalog

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "torch_ops" / "fa4" / "_native"
built = pytest.mark.skipif(not (NATIVE / "libfa4.so").exists(), reason="native library not built")


@built
def test_manifest_matches_catalog_and_library():
    manifest = json.loads((NATIVE / "variants.json").read_text())
    names = [v["name"] for v in manifest["variants"]]
    # The build records the arch list and filter it was asked for; a full build has no filter.
    variants = catalog.all_variants(tuple(manifest["archs"]), manifest.get("trace_variants", "shipped"))
    expected = [v.name for v in catalog.select_variants(variants, manifest["filter"])]
    assert names == expected
    nm = subprocess.run(["nm", "-D", "--defined-only", str(NATIVE / "libfa4.so")], capture_output=True, text=True, check=True).stdout
    for sym in ("fa4_fwd", "fa4_bwd", "fa4_bwd_preprocess", "fa4_bwd_postprocess", "fa4_num_variants", "fa4_variant_name",
                "fa4_last_error"):
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
    manifest = json.loads((NATIVE / "variants.json").read_text())
    shipped = {v["name"] for v in manifest["variants"]}
    objects = [str(p) for p in sorted((ROOT / "build" / "aot").rglob("fa4_*_sm_90a_*.o")) if p.stem in shipped]
    # A library copied in without the build that made it has nothing here to check.
    assert objects, f"none of the library's {len(shipped)} variants has its object under {ROOT / 'build' / 'aot'}"
    # One report over every object, in parallel chunks (the tool disassembles serially).
    chunks = [objects[i::4] for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        reports = list(pool.map(lambda chunk: subprocess.run(
            [sys.executable, str(_sass_tool()), *chunk], capture_output=True, text=True, check=True).stdout, chunks))
    tables = [[line.split("\t") for line in report.strip().splitlines()] for report in reports]
    header = sorted({name for table in tables for name in table[0][2:]})
    rows = [[row[0]] + [dict(zip(table[0][2:], row[2:])).get(name, "0") for name in header]
            for table in tables for row in table[1:]]
    header = ["object"] + header
    # The forward and the backward's main kernel: warpgroup MMAs fed by TMA, register
    # reallocation between the roles.
    mma_rows = [row for row in rows if "_bwd_pre_" not in row[0] and "_bwd_post_" not in row[0]]
    assert mma_rows
    for counter in ("HGMMA", "UTMALDG", "SETMAXREG"):
        assert counter in header and all(int(row[header.index(counter)]) > 0 for row in mma_rows), counter
    # The backward's dQ reductions: TMA reduce-adds (BULKRED) in every main kernel.
    backward = [row for row in rows if "_bwd_sm_90a_" in row[0]]
    if backward:
        assert "BULKRED" in header
        without = [row[0] for row in backward if row[header.index("BULKRED")] == "0"]
        assert not without, without
    # No register spills in any image. The report grows an LDL/STL column only when some image
    # has them. The 160-register (hd64) and 240-register (hd192/hd256, the backward's) consumers
    # are close to spilling: small kernel changes can tip a variant over (docs/perf_notes.md).
    if "LDL/STL" in header:
        col = header.index("LDL/STL")
        spilling = {row[0]: int(row[col]) for row in rows if row[col] != "0"}
        assert not spilling, spilling


@built
@pytest.mark.skipif(_sass_tool() is None, reason="../shared/tools/sass_report.py not present")
def test_kv_cache_producer_waits_for_the_previous_grid_after_its_schedule_arithmetic(tmp_path):
    """KV-cache kernels launch with programmatic dependent launch: what runs before the wait for
    the previous grid (ACQBULK) overlaps that grid's end. The producer's first tile's schedule
    arithmetic must sit there, not between the wait and the cache_seqlens load (ptx.grid_wait_after:
    without it ptxas put ~146 instructions there in the bf16 hd128 kernel, with it 27)."""
    objects = sorted((ROOT / "build" / "aot").rglob("fa4_fwd_sm_90a_bf16_d128x128_none_kvcache.o"))
    if not objects:
        pytest.skip("the bf16 hd128 KV-cache kernel was not built")
    subprocess.run([sys.executable, str(_sass_tool()), "--dump", str(tmp_path), str(objects[0])], capture_output=True,
                   check=True)
    bundled = [sp / "nvidia" / "cu13" / "bin" / "nvdisasm" for sp in map(Path, sys.path)]
    nvdisasm = shutil.which("nvdisasm") or next((str(p) for p in bundled if p.exists()), None)
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed")
    cubin = next(tmp_path.glob("*.cubin"))
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    instructions = [line for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
    wait = next(i for i, line in enumerate(instructions) if "ACQBULK" in line)
    first_load = next(i for i, line in enumerate(instructions) if i > wait and "LDG" in line)
    assert first_load - wait < 60, (wait, first_load)
