"""Ahead-of-time build: variant catalog -> cute.compile on fake tensors -> export_to_c -> libfa4.

    python -m fa4_kernels.aot --out build/aot --lib torch_ops/fa4/_native [--jobs N] [--filter FRAG,..]

Variants compile in long-lived worker processes, one per job, each importing the DSL once
(CUTE_DSL_ARCH is read once per process, so a worker serves one arch). Objects are cached under
``--out`` by a content hash of the kernel sources, the variant key, its tile configuration and the
DSL version, so an unchanged rebuild only relinks. The native library is then linked from the
objects, a generated C stub per variant (compiled in batches, cached too), the generated variant
table and ``csrc_shims/`` with the host C compiler; it links libcudart and nothing from the DSL
wheel.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.metadata
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

from fa4_kernels import catalog, heuristics

KERNEL_DIR = Path(__file__).resolve().parent
REPO_ROOT = KERNEL_DIR.parent.parent
SHIM_DIR = REPO_ROOT / "csrc_shims"
LIB_NAME = "libfa4.so"
OPS_LIB_NAME = "libfa4_ops.so"
RULES_LIB_NAME = "libfa4_rules.so"
MANIFEST_NAME = "variants.json"


# ----------------------------------------------------------------------------- settings
def env_settings() -> dict:
    """The FA4_* build variables (documented in the README), read in this one place."""
    archs = tuple(a.strip() for a in os.environ.get("FA4_ARCHS", "sm_90a").split(",") if a.strip())
    return {
        "archs": archs,
        "filter": os.environ.get("FA4_VARIANTS", ""),
        "jobs": int(os.environ.get("FA4_BUILD_JOBS", "0")) or os.cpu_count() or 1,
        # Diagnostic kernels that write clock stamps (fa4_kernels/stamps.py); never for a release.
        # "1": every K/V step and tile; "tiles": tile points only (the K/V loop unperturbed).
        "diag_stamps": {"1": "all", "tiles": "tiles"}.get(os.environ.get("FA4_DIAG_STAMPS", "0"), ""),
        # Diagnostic operators that time their host phases (csrc_shims/fa4_ops.cpp); never for a release.
        "diag_host_timing": os.environ.get("FA4_DIAG_HOST_TIMING", "0") == "1",
        # Forward kernels computing this many of every 8 probabilities on the FMA pipe instead of
        # the heuristics' share (heuristics.FwdConfig.exp2_fma); None: the heuristics'.
        "exp2_fma": int(os.environ["FA4_EXP2_FMA"]) if os.environ.get("FA4_EXP2_FMA", "") else None,
        # Which forwards get a trace twin (catalog.all_variants): the shipped set, or "all".
        "trace_variants": _trace_choice(os.environ.get("FA4_TRACE_VARIANTS", "") or "shipped"),
    }


def _trace_choice(value: str) -> str:
    if value not in catalog.TRACE_CHOICES:
        raise ValueError(f"FA4_TRACE_VARIANTS={value!r}: one of {', '.join(catalog.TRACE_CHOICES)}")
    return value


def build_config(key: catalog.VariantKey):
    """The variant's config as this build compiles it: the heuristics' (kernel_config), with the
    build-time overrides of env_settings applied."""
    cfg = heuristics.kernel_config(key)
    settings = env_settings()
    share = settings["exp2_fma"]
    if key.kernel == "fwd" and share is not None:
        if not 0 <= share <= 8:
            raise ValueError(f"FA4_EXP2_FMA={share}: the probabilities per 8 on the FMA pipe, 0 to 8")
        cfg = replace(cfg, exp2_fma=share)
    return cfg


def dsl_version() -> str:
    return importlib.metadata.version("nvidia-cutlass-dsl")


# Kernel files only some kinds of kernel import: an edit to one leaves the other kinds' objects
# cached. The preprocess imports the statistics layout (stats_offset) from the backward's file.
KERNEL_ONLY_SOURCES = {"sm90/fwd.py": ("fwd",), "kv_cache.py": ("fwd",), "trace.py": ("fwd",),
                       "split_partials.py": ("fwd",),
                       "sm90/bwd.py": ("bwd", "bwd_pre"), "dq_order.py": ("bwd", "bwd_pre"),
                       "sm90/bwd_preprocess.py": ("bwd_pre",), "sm90/bwd_postprocess.py": ("bwd_post",),
                       "packed_sequences.py": ("bwd_pre", "bwd_post")}


def source_digest(kernel: str) -> str:
    """Hash of the sources a ``kernel`` kind's objects are built from: every module of the
    kernel package but the build driver, the catalog and the heuristics (they shape code only
    through the key and config, hashed per variant) and other kinds' own kernel files."""
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.rglob("*.py")):
        rel = path.relative_to(KERNEL_DIR).as_posix()
        if path.name in ("aot.py", "catalog.py", "heuristics.py"):
            continue
        if kernel not in KERNEL_ONLY_SOURCES.get(rel, (kernel,)):
            continue
        h.update(rel.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def variant_digest(key: catalog.VariantKey, sources: str, version: str) -> str:
    cfg = build_config(key)
    mode = env_settings()["diag_stamps"]
    diag = ["diag_stamps"] + ([] if mode == "all" else [mode]) if mode else []
    fields = key.as_dict()
    for later in ("trace", "kv_append"):  # keys from before these fields existed hash as they did
        if not fields.get(later):
            fields.pop(later, None)
    blob = json.dumps([fields, asdict(cfg), sources, version] + diag, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------ compile
def compile_variant(name: str, out_dir: Path) -> None:
    """Compile one variant in this process (CUTE_DSL_ARCH must already match its arch)."""
    key = next(v for v in catalog.all_variants((os.environ["CUTE_DSL_ARCH"],), trace="all") if v.name == name)
    compiled = {"fwd": _compile_fwd, "bwd": _compile_bwd, "bwd_pre": _compile_bwd_pre,
                "bwd_post": _compile_bwd_post}[key.kernel](key)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        compiled.export_to_c(tmp, name, function_prefix=name)
        for ext in (".h", ".o"):
            os.replace(Path(tmp) / f"{name}{ext}", out_dir / f"{name}{ext}")


def _fake_inputs(key: catalog.VariantKey):
    """Fake-tensor constructors for cute.compile: (dtype, bshd, vector, stats)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_tensor

    dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[key.dtype]

    def bshd(dim, element=dtype):
        # (batch, seqlen, heads, dim): every size dynamic but dim; strides dynamic, 16-byte
        # multiples (a TMA rule the runtime checks), last dim contiguous.
        per_16_bytes = 128 // element.width
        stride = tuple(cute.sym_int64(divisibility=per_16_bytes) for _ in range(3)) + (1,)
        shape = tuple(cute.sym_int() for _ in range(3)) + (dim,)
        return make_fake_tensor(element, shape, stride=stride, assumed_align=16)

    def vector(element=cutlass.Int32, align=4):
        return make_fake_tensor(element, (cute.sym_int(),), stride=(1,), assumed_align=align)

    def stats(divisibility=1, align=4, element=Float32):
        # (batch, heads, rows) fp32 (or int32 counters), rows contiguous.
        return make_fake_tensor(
            element, tuple(cute.sym_int() for _ in range(3)),
            stride=(cute.sym_int64(divisibility=divisibility), cute.sym_int64(divisibility=divisibility), 1),
            assumed_align=align,
        )

    return dtype, bshd, vector, stats


def _compile_fwd(key: catalog.VariantKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor
    from cutlass import Float32, Int32
    from cutlass.runtime import make_fake_stream

    from fa4_kernels.sm90.fwd import FlashAttentionForwardSm90

    cfg = build_config(key)
    dtype, bshd, vector, stats = _fake_inputs(key)
    kernel = FlashAttentionForwardSm90(
        dtype, key.head_dim, key.head_dim_v,
        is_causal=key.mask == "causal", is_local=key.mask == "local", has_softcap=key.softcap,
        tile_m=cfg.tile_m, tile_n=cfg.tile_n, num_stages=cfg.num_stages, is_varlen=key.varlen,
        pv_wait=cfg.pv_wait, rescale_threshold=cfg.rescale_threshold,
        o_in_v=cfg.o_in_v, split_tail=cfg.split_tail, merge_helpers=cfg.merge_helpers, merge_pairs=cfg.merge_pairs,
        distributed_merge=cfg.distributed_merge,
        pdl=cfg.pdl, few_rows_from_registers=cfg.few_rows_from_registers, appends_from_new=cfg.appends_from_new,
        whole_block_boxes=cfg.whole_block_boxes,
        skip_dead_blocks=cfg.skip_dead_blocks,
        early_q_release=cfg.early_q_release, lse_bulk_store=cfg.lse_bulk_store,
        speculative_max=cfg.speculative_max, rebuild_schedule=cfg.rebuild_schedule,
        epilogue_addresses_per_tile=cfg.epilogue_addresses_per_tile, bias_waves=cfg.bias_waves,
        bias_uniform_tiles=cfg.bias_uniform_tiles,
        block_sparse=key.mask == catalog.SPARSE_MASK, score_mod=key.score_mod, kv_cache=key.kv_cache,
        patch_appends=key.kv_append,
        exp2_fma=cfg.exp2_fma, stamps=env_settings()["diag_stamps"], trace=key.trace,
        alibi_by_mma=cfg.alibi_by_mma,
    )
    semaphores, partials = vector(align=16), vector(Float32, 16)
    # KV cache (placeholders elsewhere): the page table (batch, max_pages) int32, rows contiguous,
    # and the rows to append, (batch, seqlen_new, heads_kv, dim) like k and v.
    page_table = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                                  assumed_align=4)
    return cute.compile(
        kernel, bshd(key.head_dim), bshd(key.head_dim), bshd(key.head_dim_v), bshd(key.head_dim_v), stats(),
        semaphores, partials, vector(), vector(), vector(), vector(), *_sparse_tables(),
        _score_params(key.score_mod, dtype if key.score_mod == "bias16" else None),
        page_table, bshd(key.head_dim), bshd(key.head_dim_v),
        Float32(1.0), Float32(0.0), Int32(0), Int32(0), Int32(1), Int32(132), Int32(1), Int32(0), Int32(1),
        Int32(0), Int32(1), Int32(0), make_fake_stream(),
    )


def _sparse_tables():
    """Fake block-sparse tables (block_info.SparseBlocks, mask.AttentionMask.load_bits): counts
    (batch, heads, m_blocks, SPARSE_COUNT_FIELDS) and blocks (batch, heads, m_blocks, width) int32 with any
    leading strides (0 where broadcast), the bitmask a flat int32 vector."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from fa4_kernels.block_info import SPARSE_COUNT_FIELDS

    def table(last):
        return make_fake_tensor(cutlass.Int32, tuple(cute.sym_int() for _ in range(3)) + (last,),
                                stride=tuple(cute.sym_int64() for _ in range(3)) + (1,), assumed_align=4)

    bits = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=16)
    return table(SPARSE_COUNT_FIELDS), table(cute.sym_int()), bits


def _score_params(score_mod: str, element=None):
    """A score_mod's parameters (or their gradient): (heads, width) fp32, rows contiguous; for a
    bias tensor ("bias", "bias16") the (batch, heads, seqlen_q, seqlen_k) tensor of ``element``
    (default fp32), keys contiguous, any other strides (0 where it broadcasts)
    (score_mod.ScoreBias)."""
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_tensor

    if score_mod in catalog.TENSOR_SCORE_MODS:
        element = element or Float32
        return make_fake_tensor(element, tuple(cute.sym_int() for _ in range(4)),
                                stride=tuple(cute.sym_int64() for _ in range(3)) + (1,),
                                assumed_align=element.width // 8)
    return make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                            assumed_align=4)


def _compile_bwd(key: catalog.VariantKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.runtime import make_fake_stream

    from fa4_kernels.sm90.bwd import FlashAttentionBackwardSm90

    cfg = build_config(key)
    dtype, bshd, vector, stats = _fake_inputs(key)
    kernel = FlashAttentionBackwardSm90(
        dtype, key.head_dim, key.head_dim_v,
        is_local=key.mask == "local", has_softcap=key.softcap,
        tile_m=cfg.tile_m, tile_n=cfg.tile_n, num_stages=cfg.num_stages, dq_split=cfg.dq_split,
        stats_block=heuristics.STATS_BLOCK_ROWS, is_varlen=key.varlen, layout=cfg.layout, dq_store=cfg.dq_store,
        block_sparse=key.mask == catalog.SPARSE_MASK, score_mod=key.score_mod,
        grad_address_per_tile=cfg.grad_address_per_tile, grad_window=cfg.grad_window, bias_waves=cfg.bias_waves,
        dq_stage_exchange=cfg.dq_stage_exchange, k_in_registers=cfg.k_in_registers, cluster_n=cfg.cluster_n,
        dq_transposed=cfg.dq_transposed,
    )
    # LSE and dPsum rows are bulk-copied: 16-byte aligned rows (the runtime pads them).
    lse, dpsum = stats(divisibility=4, align=16), stats(divisibility=4, align=16)
    dq_semaphore = stats(element=cutlass.Int32)
    return cute.compile(
        kernel, bshd(key.head_dim), bshd(key.head_dim), bshd(key.head_dim_v), bshd(key.head_dim_v), lse, dpsum,
        bshd(key.head_dim, Float32), bshd(key.head_dim), bshd(key.head_dim_v), vector(), vector(), vector(),
        dq_semaphore, vector(), *_sparse_tables(),
        _score_params(key.score_mod, dtype if key.score_mod == "bias16" else None), _score_params(key.score_mod),
        Float32(1.0), Float32(0.0), Int32(0),
        Int32(0), Int32(1), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), make_fake_stream(),
    )


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:60]:<60}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def build_objects(variants, out_root: Path, jobs: int) -> dict:
    """Compile what is not cached; return {variant name: object dir}."""
    sources, version = {kind: source_digest(kind) for kind in catalog.KERNELS}, dsl_version()
    plan, results = [], {}
    for key in variants:
        obj_dir = out_root / key.arch / f"{key.name}-{variant_digest(key, sources[key.kernel], version)}"
        results[key.name] = obj_dir
        for stale in obj_dir.parent.glob(f"{key.name}-*"):  # older builds of this variant
            if stale != obj_dir:
                shutil.rmtree(stale, ignore_errors=True)
        if not (obj_dir / "COMPLETE").exists():
            plan.append((key, obj_dir))
    print(f"fa4 aot: {len(variants)} variants, {len(variants) - len(plan)} cached, "
          f"{len(plan)} to compile on {jobs} processes", file=sys.stderr)

    _compile_plan(plan, jobs)
    return results


# Kinds in the order their variants are handed out, the slowest first (in a worker, on the
# 2-core CPU machine: forwards 5-7 s on average and up to 15, backwards ~4 s, the preprocess
# ~2 s, the postprocess 0.2 s), so the last variant to finish is a short one.
_COMPILE_ORDER = ("fwd", "bwd", "bwd_pre", "bwd_post")


def _compile_plan(plan, jobs: int) -> None:
    """Compile ``plan`` ([(key, obj dir)]) on ``jobs`` worker processes, marking each object dir
    COMPLETE with its compile time."""
    items = queue.SimpleQueue()
    for item in sorted(plan, key=lambda it: (it[0].arch, _COMPILE_ORDER.index(it[0].kernel), -it[0].head_dim)):
        items.put(item)
    lock, failed, done = threading.Lock(), threading.Event(), [0]

    def drain():
        worker = None
        try:
            while not failed.is_set():
                try:
                    key, obj_dir = items.get_nowait()
                except queue.Empty:
                    return
                if worker is None or worker.arch != key.arch:
                    if worker is not None:
                        worker.close()
                    worker = CompileWorker(key.arch)
                try:
                    seconds = worker.compile(key.name, obj_dir)
                except BaseException:
                    failed.set()
                    raise
                (obj_dir / "COMPLETE").write_text(json.dumps({"seconds": seconds}))
                with lock:
                    done[0] += 1
                    _progress(done[0], len(plan), key.name)
        finally:
            if worker is not None:
                worker.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(drain) for _ in range(min(jobs, len(plan)))]:
            future.result()


class CompileWorker:
    """A ``--worker`` process for one arch that compiles the variants it is sent, one at a time.
    Importing and initialising the DSL is ~2 s of a variant's 3-9 s, so a process per variant
    spent about a third of the build on it."""

    def __init__(self, arch: str):
        self.arch = arch
        env = dict(os.environ, CUTE_DSL_ARCH=arch, PYTHONPATH=os.pathsep.join(
            [str(KERNEL_DIR.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        # The worker's own output (the DSL's warnings) goes to a file: a pipe nobody reads could fill.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "fa4_kernels.aot", "--worker"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def compile(self, name: str, obj_dir: Path) -> float:
        """Compile one variant into ``obj_dir``; its compile time in seconds."""
        try:
            self.proc.stdin.write(json.dumps([name, str(obj_dir)]) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"compiling {name}: the worker exited with {self.proc.wait()}:\n"
                               f"{self.log.read()[-8000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"compiling {name} failed:\n{reply['error']}")
        return reply["seconds"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait()
        self.log.close()


def serve_compiles() -> None:
    """The ``--worker`` loop: for each line ``[name, obj_dir]`` on stdin, compile that variant and
    answer one line on stdout, ``{"seconds": s}`` or ``{"error": traceback}``."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the DSL or MLIR prints must not land among the replies
    for line in sys.stdin:
        name, obj_dir = json.loads(line)
        t0 = time.time()
        try:
            compile_variant(name, Path(obj_dir))
            reply = {"seconds": round(time.time() - t0, 2)}
        except Exception:
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")


# --------------------------------------------------------------------------------- link
_STRUCT_RE = re.compile(
    r"typedef struct \{\s*void \*data;\s*(?:int32_t dynamic_shapes\[(\d+)\];\s*)?"
    r"(?:int64_t dynamic_strides\[(\d+)\];\s*)?\}\s*(\w+)_Tensor_(\w+)_t;"
)


def _compile_bwd_pre(key: catalog.VariantKey):
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.runtime import make_fake_stream

    from fa4_kernels.sm90.bwd_preprocess import BackwardPreprocessSm90

    cfg = heuristics.bwd_pre_config(key)
    dtype, bshd, vector, stats = _fake_inputs(key)
    kernel = BackwardPreprocessSm90(dtype, key.head_dim, key.head_dim_v, cfg.tile_m)
    return cute.compile(
        kernel, bshd(key.head_dim_v), bshd(key.head_dim_v), stats(), stats(),
        stats(divisibility=4, align=16), stats(divisibility=4, align=16), bshd(key.head_dim, Float32),
        bshd(key.head_dim), bshd(key.head_dim_v), vector(), vector(), vector(), vector(),
        Int32(0), Int32(0), Int32(1), Int32(0), Int32(0), Int32(0), Int32(0), make_fake_stream(),
    )


def _compile_bwd_post(key: catalog.VariantKey):
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_tensor
    from cutlass.runtime import make_fake_stream

    from fa4_kernels.sm90.bwd_postprocess import VECTOR, BackwardPostprocessSm90

    dtype, _, vector, _ = _fake_inputs(key)

    def flat(element):  # (n,) contiguous, n a multiple of VECTOR, 16-byte aligned
        return make_fake_tensor(element, (cute.sym_int(divisibility=VECTOR),), stride=(1,), assumed_align=16)

    return cute.compile(BackwardPostprocessSm90(dtype), flat(Float32), flat(dtype), vector(), vector(), Int32(0),
                        Int32(8), Int32(1), Int32(1), Int32(0), make_fake_stream())


# The kernels' tensor parameters -> the C wrapper's fa4_tensor arguments, per kernel kind.
TENSOR_ARGS = {
    "fwd": {"mQ": "q", "mK": "k", "mV": "v", "mO": "o", "mLSE": "lse", "mSemaphores": "semaphores",
            "mPartials": "partials", "mCuSeqlensQ": "cu_seqlens_q", "mCuSeqlensK": "cu_seqlens_k",
            "mSeqUsedK": "seqused_k", "mSeqOrder": "seq_order", "mSparseCounts": "sparse_counts",
            "mSparseBlocks": "sparse_blocks", "mSparseBits": "sparse_bits", "mScoreParams": "score_params",
            "mPageTable": "page_table", "mKNew": "k_new", "mVNew": "v_new"},
    "bwd": {"mQ": "q", "mK": "k", "mV": "v", "mdO": "dout", "mLSE": "lse_log2", "mdPsum": "dpsum",
            "mdQaccum": "dq_accum", "mdK": "dk", "mdV": "dv", "mCuSeqlensQ": "cu_seqlens_q",
            "mCuSeqlensK": "cu_seqlens_k", "mSeqUsedK": "seqused_k", "mdQsemaphore": "dq_semaphore",
            "mSeqDone": "seq_done", "mSparseCounts": "sparse_counts", "mSparseBlocks": "sparse_blocks",
            "mSparseBits": "sparse_bits", "mScoreParams": "score_params", "mScoreGrad": "score_grad"},
    "bwd_pre": {"mO": "out", "mdO": "dout", "mLSE": "lse", "mdLSE": "dlse", "mLSE2": "lse_log2",
                "mdPsum": "dpsum", "mdQaccum": "dq_accum", "mdK": "dk", "mdV": "dv", "mCuSeqlensQ": "cu_seqlens_q",
                "mCuSeqlensK": "cu_seqlens_k", "mSeqUsedK": "seqused_k", "mSeqDone": "seq_done"},
    "bwd_post": {"mAccum": "dq_accum", "mOut": "dq", "mSeqDone": "seq_done", "mCuSeqlensQ": "cu_seqlens_q"},
}


def _tensor_fill(name: str, header: str, args: dict) -> str:
    """C that converts our fa4_tensor arguments into the variant's generated structs.

    The fake tensors make the leading sizes and strides dynamic and the trailing ones static,
    so the generated struct holds exactly the leading n sizes and m strides.
    """
    lines = []
    found = {m.group(4): (int(m.group(1) or 0), int(m.group(2) or 0)) for m in _STRUCT_RE.finditer(header)}
    if set(found) != set(args):
        raise RuntimeError(f"{name}: unexpected tensor arguments in the generated header: {sorted(found)}")
    for field, (n_shape, n_stride) in found.items():
        src = args[field]
        lines.append(f"  {name}_Tensor_{field}_t t_{src};")
        lines.append(f"  t_{src}.data = {src}->data;")
        lines += [f"  t_{src}.dynamic_shapes[{i}] = (int32_t){src}->shape[{i}];" for i in range(n_shape)]
        lines += [f"  t_{src}.dynamic_strides[{i}] = {src}->stride[{i}];" for i in range(n_stride)]
    return "\n".join(lines)


def launch_params(kind: str) -> str:
    """The parameter list of fa4_variant_table.h's ``fa4_<kind>_launch`` function type, with which
    the stubs define their launch functions (the header is the one place it is written)."""
    text = (SHIM_DIR / "fa4_variant_table.h").read_text()
    found = re.search(rf"typedef int32_t fa4_{kind}_launch\((.*?)\);", text, re.S)
    if found is None:
        raise RuntimeError(f"fa4_variant_table.h declares no fa4_{kind}_launch")
    return " ".join(found.group(1).split())


# The generated wrapper's arguments after its tensors, by kernel kind: fields of the launch
# function's ``params`` (fa4_shim.h), then the stream.
WRAPPER_SCALARS = {
    "fwd": ("softmax_scale", "softcap", "window_left", "window_right", "heads_per_group", "num_sms",
            "max_seqlen_q", "has_seqused_k", "pack_gqa", "tail_ctas", "page_size", "seqlen_new"),
    "bwd": ("softmax_scale", "softcap", "window_left", "window_right", "num_n_blocks", "has_seqused_k",
            "deterministic", "rotate", "store_first", "launch_group"),
    "bwd_pre": ("has_dlse", "zero_rows", "num_m_blocks", "varlen", "store_first", "window_right", "has_seqused_k"),
    "bwd_post": ("first_row", "row_words", "batch_rows", "expected", "varlen"),
}


def _launch_fn(key: catalog.VariantKey, header: str) -> str:
    """C of the variant's launch function: its tensors converted to the generated structs, then
    the generated wrapper called with them and the scalars (signature: fa4_variant_table.h)."""
    n, kind = key.name, key.kernel
    args = [f"&t_{t}" for t in TENSOR_ARGS[kind].values()] + [f"params->{f}" for f in WRAPPER_SCALARS[kind]]
    return f"""
FA4_HIDDEN fa4_{kind}_launch {n}_{kind};
FA4_HIDDEN int32_t {n}_{kind}({launch_params(kind)}) {{
{_tensor_fill(n, header, TENSOR_ARGS[kind])}
  return cute_dsl_{n}_wrapper(&{n}_module, {", ".join(args)}, stream);
}}"""


def generate_stub(key: catalog.VariantKey, header_path: Path) -> str:
    """C source of one variant's functions (init, load, launch), compiled into its own object:
    hidden symbols the table (generate_table) declares through fa4_variant_table.h's types."""
    n = key.name
    return f"""/* Generated by fa4_kernels.aot: do not edit. */
#include "fa4_variant_table.h"
#include "{header_path.name}"

static {n}_Kernel_Module_t {n}_module;
FA4_HIDDEN fa4_init_launch {n}_init;
FA4_HIDDEN fa4_load_launch {n}_load;
FA4_HIDDEN int32_t {n}_init(void) {{
  cudaLibrary_t *library = &{n}_module.module;
  cudaError_t ret = cudaSuccess;
  struct {{ cudaLibrary_t **library; cudaError_t *ret; }} args = {{&library, &ret}};
  _mlir_{n}_cuda_init((void **)&args);
  return (int32_t)ret;
}}
FA4_HIDDEN int32_t {n}_load(int32_t device) {{
  cudaLibrary_t *library = &{n}_module.module;
  cudaError_t ret = cudaSuccess;
  struct {{ cudaLibrary_t **library; int32_t *device; cudaError_t *ret; }} args = {{&library, &device, &ret}};
  _mlir_{n}_cuda_load_to_device((void **)&args);
  return (int32_t)ret;
}}
{_launch_fn(key, header_path.read_text())}
"""


# The catalog's mask kinds as the native library's (fa4_rules.h).
MASK_CODES = {"none": "FA4_MASK_NONE", "causal": "FA4_MASK_CAUSAL", "local": "FA4_MASK_LOCAL",
              "sparse": "FA4_MASK_SPARSE"}


def generate_table(keys) -> str:
    """C source of the variant table: one row per key, pointing at its stub's functions."""
    out = ['/* Generated by fa4_kernels.aot: do not edit. */', '#include "fa4_variant_table.h"',
           '#include "fa4_rules.h"']
    rows = []
    index = {key.name: i for i, key in enumerate(keys)}
    for key in keys:
        n = key.name
        major, minor = key.compute_capability
        out.append(f"FA4_HIDDEN fa4_init_launch {n}_init;\nFA4_HIDDEN fa4_load_launch {n}_load;\n"
                   f"FA4_HIDDEN fa4_{key.kernel}_launch {n}_{key.kernel};")
        cfg = heuristics.kernel_config(key)
        # fa4_variant.split_tail: 0, 1 (a merger per split tile) or FA4_SPLIT_DISTRIBUTED (2).
        split_tail = 0 if not getattr(cfg, "split_tail", False) else 2 if cfg.distributed_merge else 1
        # The row's launchers, in fa4_variant's order (fwd, bwd, bwd_pre, bwd_post): this kind's set.
        launch = ", ".join(f"{n}_{kind}" if kind == key.kernel else "NULL" for kind in catalog.KERNELS)
        kind = {"fwd": "FA4_KERNEL_FWD", "bwd": "FA4_KERNEL_BWD", "bwd_pre": "FA4_KERNEL_BWD_PRE",
                "bwd_post": "FA4_KERNEL_BWD_POST"}[key.kernel]
        dtype = {"bf16": "FA4_DTYPE_BF16", "fp16": "FA4_DTYPE_FP16"}[key.dtype]
        mask = MASK_CODES[key.mask]
        tiles = {"regular": "FA4_TILES_REGULAR", "short": "FA4_TILES_SHORT", "long": "FA4_TILES_LONG"}[key.tiles]
        score = {"none": "FA4_SCORE_NONE", "alibi": "FA4_SCORE_ALIBI", "relbias": "FA4_SCORE_RELBIAS",
                 "bias": "FA4_SCORE_BIAS", "bias16": "FA4_SCORE_BIAS16"}[key.score_mod]
        cluster = getattr(cfg, "cluster_n", 1)
        # A clustered variant falls back to its 1-CTA twin, which the catalog builds beside it (a
        # library of a subset without it: -1, and the shim refuses where the clusters do not fit).
        fallback = index.get(replace(key, tiles="regular").name, -1) if cluster > 1 else -1
        cache = ("FA4_KV_CACHE_APPEND" if key.kv_append else "FA4_KV_CACHE_PLAIN" if key.kv_cache
                 else "FA4_KV_CACHE_NONE")
        rows.append(f'  {{"{n}", {kind}, {major}, {minor}, {dtype}, {key.head_dim}, {key.head_dim_v}, {mask}, '
                    f'{int(key.softcap)}, {score}, {tiles}, {int(key.varlen)}, {cache}, {int(key.trace)}, '
                    f'{cfg.tile_m}, {getattr(cfg, "tile_n", 0)}, {split_tail}, {cluster}, {fallback}, {n}_init, '
                    f'{n}_load, {launch}}},')
    out.append("const fa4_variant fa4_variants[] = {")
    out += rows
    out.append("};")
    out.append(f"const int32_t fa4_variant_count = {len(rows)};")
    out.append(f"const int32_t fa4_stats_block_rows = {heuristics.STATS_BLOCK_ROWS};")
    from fa4_kernels.tile_scheduler import SEQ_ORDER_IN_KERNEL  # the DSL's module: imported when used
    out.append(f"const int32_t fa4_seq_order_in_kernel = {SEQ_ORDER_IN_KERNEL};")
    (kv_mask,) = catalog.KV_CACHE_MASKS
    out.append(f"const int32_t fa4_kv_cache_mask = {MASK_CODES[kv_mask]};")
    twins = " | ".join(f"(1 << {MASK_CODES[mask]})" for mask in catalog.KV_CACHE_TWIN_MASKS) or "0"
    out.append(f"const int32_t fa4_kv_cache_twin_masks = {twins};")
    from fa4_kernels.kv_cache import FEW_HEAD_ROWS  # the DSL's module: imported when used
    out.append(f"const int32_t fa4_kv_cache_head_rows = {min(FEW_HEAD_ROWS)};")
    from fa4_kernels.block_info import Q_PIECE_ROWS  # the DSL's module: imported when used
    out.append(f"_Static_assert(FA4_Q_PIECE_ROWS == {Q_PIECE_ROWS}, \"fa4_rules.h's FA4_Q_PIECE_ROWS is not "
               f"the kernels' block_info.Q_PIECE_ROWS\");")
    bwd_causal = "causal" if "causal" in catalog.BWD_MASKS else "local"
    out.append(f"const int32_t fa4_bwd_causal_mask = {MASK_CODES[bwd_causal]};")
    out += trace_layout_c()
    out.append(f"_Static_assert({len(rows)} <= FA4_MAX_VARIANTS, \"raise FA4_MAX_VARIANTS\");")
    return "\n".join(out) + "\n"


def trace_layout_c() -> list[str]:
    """The trace records' layout (trace.py) as the native library's constants (fa4_variant_table.h)."""
    from fa4_kernels import trace

    return [f"const int32_t fa4_trace_header[4] = {{{trace.COUNTER_WORD}, {trace.BASE_WORD}, "
            f"{trace.CAPACITY_WORD}, {trace.DEAL_WORD}}};",
            f"const int32_t fa4_trace_record_words = {trace.RECORD_WORDS};",
            f'const char *const fa4_trace_fields = "{",".join(trace.FIELDS)}";',
            f'const char *const fa4_trace_flags = "{",".join(f"{k}={v}" for k, v in trace.FLAGS.items())}";']


def find_cuda() -> tuple[Path, Path]:
    """(include dir with cuda_runtime.h, lib dir with libcudart.so.*): the toolkit or the wheel."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for sp in map(Path, sys.path):
        candidates += [sp / "nvidia" / "cu13", sp / "nvidia" / "cuda_runtime"]
    for root in candidates:
        inc = root / "include"
        for lib in (root / "lib64", root / "lib"):
            if (inc / "cuda_runtime.h").exists() and list(lib.glob("libcudart.so*")):
                return inc, lib
    raise RuntimeError("CUDA runtime headers and libcudart not found: install the CUDA toolkit or "
                       "`pip install nvidia-cuda-runtime` (or set CUDA_HOME)")


# Flags of every C object in libfa4.so: the stubs, the table and the shims.
C_FLAGS = ["-fPIC", "-O2", "-std=c11", "-Wall", "-Wno-unused-function"]
# The stubs are straight-line argument packing (a struct per tensor, one call), compiled in
# batches of STUB_BATCH variants per translation unit at -O0: on the 2-core CPU machine all 464
# took 43 s of CPU one per compile at -O2 (0.09 s each, most of it the compiler's start and the
# CUDA headers), 0.36 s per batch of 32 at -O0 (-O1: 29 s for all of them in one unit).
STUB_OPT = "-O0"
STUB_BATCH = 32


def link(entries, lib_dir: Path, work_dir: Path, archs=(), pattern="", jobs: int = 1) -> Path:
    """Link libfa4.so from the variants' objects, their stubs and the shims, then the rules and
    operator libraries beside it. The C compiles run on ``jobs`` processes; stubs are cached."""
    inc, cudart_dir = find_cuda()
    work_dir.mkdir(parents=True, exist_ok=True)
    cudart = sorted(cudart_dir.glob("libcudart.so.*"), key=lambda p: len(p.name))[0].name
    cc = os.environ.get("CC", "cc")
    # Diagnostics builds time the launches too (cuda_forwards.c).
    diag = ["-DFA4_DIAG_HOST_TIMING"] if env_settings()["diag_host_timing"] else []
    c_cmd = [cc, *C_FLAGS, *diag, "-I", str(inc), "-I", str(SHIM_DIR)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        ops_objects = [pool.submit(_compile_source, cmd, source, work_dir / f"{source.stem}.o")
                       for cmd, source in _ops_sources(inc)]
        stub_cmd = [opt if opt != "-O2" else STUB_OPT for opt in c_cmd]
        batches = [entries[i:i + STUB_BATCH] for i in range(0, len(entries), STUB_BATCH)]
        stubs = [pool.submit(_stub_object, batch, stub_cmd, work_dir / "stubs") for batch in batches]
        table_c = work_dir / "fa4_variant_table.c"
        table_c.write_text(generate_table([key for key, _ in entries]))
        stub_objects = [f.result() for f in stubs]
        for stale in [*(work_dir / "stubs").glob("*.o"), *(work_dir / "stubs").glob("stubs-*.c")]:
            if stale.with_suffix(".o") not in stub_objects:  # batches (or per-variant stubs) of earlier builds
                stale.unlink(missing_ok=True)
        objects = stub_objects + [h.with_suffix(".o") for _, h in entries]
        lib_dir.mkdir(parents=True, exist_ok=True)
        tmp_out = lib_dir / f".{LIB_NAME}.tmp"
        cmd = [*c_cmd, "-shared", "-Wl,-z,defs", "-Wl,--exclude-libs,ALL",
               str(SHIM_DIR / "fa4_shim.c"), str(SHIM_DIR / "cuda_forwards.c"), str(SHIM_DIR / "fa4_rules.c"),
               str(SHIM_DIR / "fa4_schemas.c"), str(table_c), *map(str, objects),
               "-L", str(cudart_dir), f"-l:{cudart}", "-lpthread", "-o", str(tmp_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"linking {LIB_NAME} failed:\n{' '.join(cmd)}\n{proc.stderr}")
        out = lib_dir / LIB_NAME
        os.replace(tmp_out, out)
        build_rules(lib_dir)
        link_ops(lib_dir, [f.result() for f in ops_objects], cudart_dir, cudart)
    manifest = {
        "dsl_version": dsl_version(),
        "archs": list(archs),
        "filter": pattern,
        "trace_variants": env_settings()["trace_variants"],
        "variants": [dict(key.as_dict(), name=key.name, **asdict(build_config(key)))
                     for key, _ in entries],
    }
    tmp_manifest = lib_dir / f".{MANIFEST_NAME}.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp_manifest, lib_dir / MANIFEST_NAME)
    return out


def _compile_source(cmd: list[str], source: Path, obj: Path) -> Path:
    """``cmd -c source`` into ``obj`` (written whole or not at all)."""
    tmp = obj.with_name(f".{obj.name}.tmp")
    full = [*cmd, "-c", str(source), "-o", str(tmp)]
    proc = subprocess.run(full, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {source.name} failed:\n{' '.join(full)}\n{proc.stderr}")
    os.replace(tmp, obj)
    return obj


def _stub_object(batch, c_cmd: list[str], stub_dir: Path) -> Path:
    """The stubs (generate_stub) of ``batch`` ([(key, header)]) compiled as one object, cached
    under ``stub_dir`` by a hash of their sources, the headers they include and the command (a
    rebuild recompiles only the batches whose variants or generator changed; objects of batches
    no longer built are removed by ``link``). One table of all the stubs at -O2 took 55 s on one
    core; see STUB_OPT for why batches."""
    stub_dir.mkdir(parents=True, exist_ok=True)
    cmd = list(c_cmd)
    sources = []
    for key, header in batch:
        cmd += ["-I", str(header.parent)]
        sources.append(generate_stub(key, header))
    h = hashlib.sha256(json.dumps([sources, [header.read_text() for _, header in batch], cmd]).encode())
    for shim_header in sorted(SHIM_DIR.glob("*.h")):
        h.update(shim_header.read_bytes())
    obj = stub_dir / f"stubs-{h.hexdigest()[:20]}.o"
    if obj.exists():
        return obj
    # Each stub keeps its own file (readable on its own) and the batch's unit includes them.
    for (key, _), source in zip(batch, sources):
        (stub_dir / f"{key.name}.c").write_text(source)
    unit = stub_dir / f"stubs-{h.hexdigest()[:20]}.c"
    unit.write_text("".join(f'#include "{key.name}.c"\n' for key, _ in batch))
    return _compile_source(cmd, unit, obj)


def build_rules(lib_dir: Path) -> Path:
    """libfa4_rules.so: the run-time rules and the operators' schemas (csrc_shims/fa4_rules.c,
    fa4_schemas.c; plain C, no CUDA), which fa4 loads on every machine, CPU-only ones and
    kernel-less builds included."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    tmp_out = lib_dir / f".{RULES_LIB_NAME}.tmp"
    cmd = [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-Wl,-z,defs",
           "-I", str(SHIM_DIR), str(SHIM_DIR / "fa4_rules.c"), str(SHIM_DIR / "fa4_schemas.c"),
           "-o", str(tmp_out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {RULES_LIB_NAME} failed:\n{' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp_out, lib_dir / RULES_LIB_NAME)
    return lib_dir / RULES_LIB_NAME


def find_torch() -> Path | None:
    """torch's install folder, for its stable-ABI headers and libtorch_cpu: importable here, or
    (inside pip's isolated build environment, which hides the target environment's packages)
    the one the same interpreter imports outside it."""
    try:
        import torch

        return Path(torch.__file__).resolve().parent
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    proc = subprocess.run([sys.executable, "-c", "import torch, os; print(os.path.dirname(torch.__file__))"],
                          capture_output=True, text=True, env=env)
    return Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else None


# The oldest torch whose stable ABI the op library targets (TORCH_TARGET_VERSION: major, minor
# in the top two bytes); the library then loads under every later torch.
TORCH_TARGET_VERSION = "0x020A000000000000"


def _ops_sources(cuda_inc: Path) -> list[tuple[list[str], Path]]:
    """(compile command, source) of libfa4_ops.so's objects: csrc_shims/fa4_ops.cpp and
    fa4_trace.cpp against torch's stable-ABI headers."""
    torch_dir = find_torch()
    if torch_dir is None or not (torch_dir / "include" / "torch" / "csrc" / "stable" / "library.h").exists():
        raise RuntimeError("building fa4's operators needs torch >= 2.10 (its stable-ABI headers) in the "
                           "environment pip installs into; install torch first")
    defines = []  # diagnostics builds'
    if env_settings()["diag_stamps"]:  # the stamps' buffer (scripts/stamps_report.py)
        from fa4_kernels import stamps as stamp_layout

        defines = [f"-DFA4_DIAG_STAMP_WORDS={max(stamp_layout.buffer_words(), 1 << 16)}"]
    if env_settings()["diag_host_timing"]:
        defines.append("-DFA4_DIAG_HOST_TIMING")
    cmd = [os.environ.get("CXX", "c++"), "-fPIC", "-O2", "-std=c++17", "-Wall",
           f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}", "-DUSE_CUDA", *defines,
           "-I", str(torch_dir / "include"), "-I", str(cuda_inc), "-I", str(SHIM_DIR)]
    return [(cmd, SHIM_DIR / "fa4_ops.cpp"), (cmd, SHIM_DIR / "fa4_trace.cpp")]


def link_ops(lib_dir: Path, objects: list[Path], cudart_dir: Path, cudart: str) -> Path:
    """libfa4_ops.so: the CUDA implementations of the torch.ops.fa4 operators (``objects``, from
    _ops_sources) on torch's stable ABI, linked against libfa4.so beside it. libtorch_cpu is a
    DT_NEEDED entry (the stable C functions live there; its soname binds to whichever torch is
    loaded), and the CUDA stream getter is looked up at run time."""
    torch_dir = find_torch()
    tmp_out = lib_dir / f".{OPS_LIB_NAME}.tmp"
    cmd = [os.environ.get("CXX", "c++"), "-shared", "-Wl,-z,defs", *map(str, objects),
           "-L", str(lib_dir), f"-l:{LIB_NAME}", "-Wl,-rpath,$ORIGIN",
           "-L", str(torch_dir / "lib"), "-Wl,--no-as-needed", "-ltorch_cpu", "-Wl,--as-needed",
           "-L", str(cudart_dir), f"-l:{cudart}", "-ldl", "-o", str(tmp_out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"linking {OPS_LIB_NAME} failed:\n{' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp_out, lib_dir / OPS_LIB_NAME)
    return lib_dir / OPS_LIB_NAME


def build(out_root: Path, lib_dir: Path, archs=None, pattern=None, jobs=None) -> Path:
    settings = env_settings()
    archs = archs or settings["archs"]
    pattern = settings["filter"] if pattern is None else pattern
    jobs = jobs or settings["jobs"]
    variants = catalog.select_variants(catalog.all_variants(archs, settings["trace_variants"]), pattern)
    if not variants:
        raise RuntimeError(f"no variant matches FA4_VARIANTS={pattern!r}")
    t0 = time.time()
    obj_dirs = build_objects(variants, out_root, jobs)
    entries = [(key, obj_dirs[key.name] / f"{key.name}.h") for key in variants]
    lib = link(entries, lib_dir, out_root / "link", archs, pattern, jobs)
    print(f"fa4 aot: linked {lib} ({len(entries)} variants) in {time.time() - t0:.1f}s", file=sys.stderr)
    return lib


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "aot")
    parser.add_argument("--lib", type=Path, default=REPO_ROOT / "torch_ops" / "fa4" / "_native")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--filter", default=None, help="comma-separated name fragments (default $FA4_VARIANTS)")
    parser.add_argument("--compile-one", help=argparse.SUPPRESS)
    parser.add_argument("--obj-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        serve_compiles()
        return
    if args.compile_one:
        compile_variant(args.compile_one, args.obj_dir)
        return
    build(args.out, args.lib, pattern=args.filter, jobs=args.jobs)


if __name__ == "__main__":
    main()
