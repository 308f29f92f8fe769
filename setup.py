"""Build: the usual setuptools packaging plus the AOT kernel build (fa4_kernels.aot).

Package map: ``torch_ops/fa4/`` is the runtime package ``fa4``; ``src/fa4_kernels`` holds the CuTe DSL
kernels and the build driver (shipped as sources for JIT use, never imported at run time).
The native library and its variant manifest land in ``fa4/_native/``.
"""
import os
import re
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def run_aot_build(lib_dir: Path, kernels: bool = True) -> None:
    """The kernels and the native libraries; without ``kernels`` (FA4_SKIP_AOT=1) only the
    run-time rules' library, plain C, which fa4.heuristics loads even on CPU-only installs."""
    sys.path.insert(0, str(ROOT / "src"))  # build-time only: the driver lives in the source tree
    from fa4_kernels import aot

    if kernels:
        aot.build(ROOT / "build" / "aot", lib_dir)
    else:
        aot.build_rules(lib_dir)


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        kernels = os.environ.get("FA4_SKIP_AOT") != "1"
        if getattr(self, "editable_mode", False):
            run_aot_build(ROOT / "torch_ops" / "fa4" / "_native", kernels)
        else:
            run_aot_build(Path(self.build_lib) / "fa4" / "_native", kernels)


def glibc_needed(root: Path) -> tuple[int, int] | None:
    """The newest glibc symbol version the native libraries under ``root`` reference (their
    GLIBC_x.y version strings), or None if there are none."""
    versions = [(int(major), int(minor)) for lib in root.rglob("*.so")
                for major, minor in re.findall(rb"GLIBC_(\d+)\.(\d+)", lib.read_bytes())]
    return max(versions) if versions else None


class PlatformWheel(bdist_wheel):
    """The wheel holds native libraries (no CPython extension): py3-none-<platform>, the platform
    a manylinux tag for the newest glibc they need (the operators' library, built on glibc 2.34+,
    needs 2.34: dlopen moved into libc there; its libstdc++ needs (GLIBCXX_3.4.29) are within that
    policy), so installers on older systems refuse it instead of failing at import."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        needed = glibc_needed(Path(self.bdist_dir))
        if needed and plat.startswith("linux_"):
            plat = f"manylinux_{needed[0]}_{needed[1]}_{plat.removeprefix('linux_')}"
        return "py3", "none", plat


setup(
    packages=["fa4", "fa4_kernels", "fa4_kernels.sm90"],
    package_dir={"fa4": "torch_ops/fa4", "fa4_kernels": "src/fa4_kernels"},
    package_data={"fa4": ["_native/*.so", "_native/*.json"]},
    cmdclass={"build_py": BuildWithKernels, "bdist_wheel": PlatformWheel},
)
