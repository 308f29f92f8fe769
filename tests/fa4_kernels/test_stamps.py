"""The clock-stamp diagnostic (fa4_kernels/stamps.py): its build switch and its reader."""
import importlib.util
from pathlib import Path

import pytest

from fa4_kernels import aot, catalog

REPO = Path(__file__).resolve().parents[2]


def _load_report():
    spec = importlib.util.spec_from_file_location("stamps_report", REPO / "scripts" / "stamps_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_reads_the_layout_the_kernel_writes():
    pytest.importorskip("cutlass")
    from fa4_kernels import stamps

    report = _load_report()
    for name in ("CTAS", "STEPS", "TILES", "STEP_POINTS", "TILE_POINTS", "MAX_WG"):
        assert getattr(report.st, name) == getattr(stamps, name), name
    assert report.st.buffer_words() == stamps.buffer_words()
    # One record per (cta, warpgroup, step): a stamp written where the kernel puts it is found.
    words = [0.0] * stamps.buffer_words()
    cta, wg, step = 1, 2, 5
    words[((cta * stamps.MAX_WG + wg) * stamps.STEPS + step) * stamps.STEP_POINTS + 3] = 42.0
    recs = report.step_records(words, cta, wg)
    assert [i for i, r in enumerate(recs) if r is not None] == [step] and recs[step][3] == 42.0
    assert all(r is None for r in report.step_records(words, cta, wg - 1))


def test_stamped_builds_never_share_the_release_cache(monkeypatch):
    key = catalog.all_variants()[0]
    monkeypatch.delenv("FA4_DIAG_STAMPS", raising=False)
    plain = aot.variant_digest(key, "src", "v")
    monkeypatch.setenv("FA4_DIAG_STAMPS", "1")
    assert aot.env_settings()["diag_stamps"]
    assert aot.variant_digest(key, "src", "v") != plain
    stamped = aot.variant_digest(key, "src", "v")
    monkeypatch.setenv("FA4_DIAG_STAMPS", "tiles")
    assert aot.env_settings()["diag_stamps"] == "tiles"
    assert aot.variant_digest(key, "src", "v") not in (plain, stamped)
    monkeypatch.setenv("FA4_DIAG_STAMPS", "0")
    assert aot.variant_digest(key, "src", "v") == plain
