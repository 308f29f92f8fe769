"""ptxas's performance advisories (C75xx: WGMMA serialised, waits injected) for catalog variants.

The DSL compiles PTX to SASS internally and shows none of ptxas's messages. This script compiles
each selected variant with the PTX kept, assembles that PTX again with the CUDA toolkit's ptxas
(`-v`; the toolkit's ptxas accepts PTX ISA 9.0, the DSL writes 9.4: the version line is lowered,
no 9.4 feature is used) and prints every advisory, plus the registers and spills ptxas reports.

    CUTE_DSL_ARCH=sm_90a python scripts/ptxas_advisories.py --filter "bwd,bf16" [--jobs 2] [--ptxas PATH]

Run from the repository root on the CPU machine (the DSL and the toolkit are there).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fa4_kernels import catalog  # noqa: E402


def audit(name: str, ptxas: str) -> tuple[str, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=tmp)
        run = subprocess.run([sys.executable, "-m", "fa4_kernels.aot", "--compile-one", name, "--obj-dir",
                              os.path.join(tmp, "obj")], cwd=ROOT / "src", env=env, capture_output=True, text=True)
        ptx = sorted(Path(tmp).glob("*.ptx"))
        if run.returncode != 0 or not ptx:
            return name, [f"compile failed: {run.stderr.strip().splitlines()[-1:] or run.returncode}"]
        text = re.sub(r"^\.version 9\.\d+", ".version 9.0", ptx[0].read_text(), count=1, flags=re.M)
        src = Path(tmp) / "kernel.ptx"
        src.write_text(text)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", str(src), "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
        lines = (out.stdout + out.stderr).splitlines()
        notes = [re.sub(r" in (the )?function '.*", "", ln.split("ptxas info    : ", 1)[-1]) for ln in lines
                 if re.search(r"\(C75\d\d\)|error", ln)]
        notes += [ln.strip() for ln in lines if "spill" in ln or "Used" in ln]
        return name, notes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--filter", required=True, help="catalog.select_variants pattern")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ptxas", default="/usr/local/cuda/bin/ptxas")
    args = ap.parse_args()
    arch = os.environ.get("CUTE_DSL_ARCH", "sm_90a")
    names = [k.name for k in catalog.select_variants(catalog.all_variants(), args.filter) if k.arch == arch]
    flagged = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for name, notes in pool.map(lambda n: audit(n, args.ptxas), names):
            advisories = [n for n in notes if "C75" in n or "failed" in n or "error" in n]
            flagged += bool(advisories)
            print(f"{name}: " + ("; ".join(advisories) if advisories else "no advisory")
                  + " | " + " | ".join(n for n in notes if n not in advisories), flush=True)
    print(f"{flagged} of {len(names)} variants with advisories")


if __name__ == "__main__":
    main()
