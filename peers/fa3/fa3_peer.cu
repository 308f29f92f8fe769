// fa3_peer.cu -- torch-free C launcher for the FlashAttention-3 Hopper forward kernels
// (Dao-AILab/flash-attention hopper/), bf16, head dim 64/128/256 (qk == v), causal or not.
//
// Mirrors what hopper/flash_api.cpp::mha_fwd + set_params_fprop + run_mha_fwd do for the
// dense case: no varlen / paged KV / split-KV / softcap / pack-GQA / local / append-KV /
// rotary / qv / fp8, num_splits = 1, sm_margin = 0.
//
// Build: see Makefile / build.sh (sm_90a only, FLASHATTENTION_DISABLE_* feature macros).
// Every TU is compiled with "-include fa3_peer_check.h", which turns FA3's CHECK_CUDA /
// CHECK_CUTLASS (exit(1) upstream) into C++ exceptions that are caught here.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>

#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "flash.h"

#define FA3_PEER_API extern "C" __attribute__((visibility("default")))

namespace {

// Instantiations compiled into this library (hopper/instantiations/flash_fwd_hdim{64,128,256}_bf16_sm90.cu):
//   run_mha_fwd_<90, cutlass::bfloat16_t, D, D, /*Split=*/false, /*PagedKVNonTMA=*/false,
//                /*Has_softcap=*/false, /*PackGQA=*/false>
void dispatch(Flash_fwd_params &params, cudaStream_t stream) {
    if (params.d <= 64) {
        run_mha_fwd_<90, cutlass::bfloat16_t, 64, 64, false, false, false, false>(params, stream);
    } else if (params.d <= 128) {
        run_mha_fwd_<90, cutlass::bfloat16_t, 128, 128, false, false, false, false>(params, stream);
    } else {
        run_mha_fwd_<90, cutlass::bfloat16_t, 256, 256, false, false, false, false>(params, stream);
    }
}

int fail(const char *msg) {
    fprintf(stderr, "fa3_peer_fwd: %s\n", msg);
    return 1;
}

int fail_cuda(const char *what, cudaError_t e) {
    fprintf(stderr, "fa3_peer_fwd: %s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
    return 2;
}

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
// TMA needs every global stride to be a multiple of 16 bytes (8 bf16 elements) and > 0.
inline bool tma_stride_ok(long long s) { return s > 0 && (s % 8) == 0 && s < (1LL << 39); }

}  // namespace

// Bytes of extra device workspace the launcher needs beyond the caller's buffers: none.
FA3_PEER_API int fa3_peer_workspace_bytes(void) { return 0; }

// Bytes needed for the tile_count_semaphore argument (one int32). Only used when is_causal
// (and seqlen_q > 1): the causal path uses FA3's DynamicPersistentTileScheduler, which
// hands out tiles with atomicAdd on this counter. fa3_peer_fwd zeroes it itself with
// cudaMemsetAsync on `stream` before each launch (mha_fwd zeroes it with torch before each
// call too), so the caller only has to provide it; zeroing it as well is harmless.
// Do not share one buffer between calls that may run concurrently on different streams.
FA3_PEER_API int fa3_peer_semaphore_bytes(void) { return (int)sizeof(int); }

FA3_PEER_API int fa3_peer_fwd(void *q, void *k, void *v, void *o, void *softmax_lse,
                              int batch, int seqlen_q, int seqlen_k, int heads, int heads_k, int head_dim,
                              long long q_batch_stride, long long q_row_stride, long long q_head_stride,
                              long long k_batch_stride, long long k_row_stride, long long k_head_stride,
                              long long v_batch_stride, long long v_row_stride, long long v_head_stride,
                              long long o_batch_stride, long long o_row_stride, long long o_head_stride,
                              float softmax_scale, int is_causal, int num_sms, void *tile_count_semaphore,
                              void *stream_) {
    try {
        cudaStream_t stream = static_cast<cudaStream_t>(stream_);

        // ---------------- argument checks (as in mha_fwd, plus TMA alignment) ----------------
        if (!q || !k || !v || !o || !softmax_lse) return fail("null tensor pointer");
        if (batch <= 0 || seqlen_q <= 0 || heads <= 0 || heads_k <= 0)
            return fail("batch, seqlen_q, heads and heads_k must be > 0 (handle empty inputs in the caller)");
        if (seqlen_k <= 0)
            return fail("seqlen_k must be > 0 (mha_fwd returns out=0, lse=+inf in that case; do it in the caller)");
        if (heads % heads_k != 0) return fail("heads must be a multiple of heads_k");
        if (head_dim <= 0 || head_dim > 256 || head_dim % 8 != 0)
            return fail("head_dim must be a multiple of 8 in [8, 256] (kernels built: 64, 128, 256)");
        if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(o))
            return fail("q/k/v/o data pointers must be 16-byte aligned (TMA)");
        // A stride of a size-1 dimension is never used for addressing (index is always 0), but it
        // still goes into the TMA descriptor, so replace an unusable one by a harmless value.
        auto fix_unit = [](long long &s, int size) { if (size == 1 && !tma_stride_ok(s)) s = 8; };
        fix_unit(q_batch_stride, batch); fix_unit(k_batch_stride, batch);
        fix_unit(v_batch_stride, batch); fix_unit(o_batch_stride, batch);
        fix_unit(q_row_stride, seqlen_q); fix_unit(o_row_stride, seqlen_q);
        fix_unit(k_row_stride, seqlen_k); fix_unit(v_row_stride, seqlen_k);
        fix_unit(q_head_stride, heads); fix_unit(o_head_stride, heads);
        fix_unit(k_head_stride, heads_k); fix_unit(v_head_stride, heads_k);
        const long long strides[12] = {q_batch_stride, q_row_stride, q_head_stride,
                                       k_batch_stride, k_row_stride, k_head_stride,
                                       v_batch_stride, v_row_stride, v_head_stride,
                                       o_batch_stride, o_row_stride, o_head_stride};
        for (long long s : strides) {
            if (!tma_stride_ok(s))
                return fail("batch/row/head strides must be positive multiples of 8 elements (16 bytes, TMA); "
                            "last dim must be contiguous");
        }

        int device = 0;
        cudaError_t e = cudaGetDevice(&device);
        if (e != cudaSuccess) return fail_cuda("cudaGetDevice", e);
        int cc_major = 0, cc_minor = 0;
        e = cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device);
        if (e != cudaSuccess) return fail_cuda("cudaDeviceGetAttribute", e);
        e = cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device);
        if (e != cudaSuccess) return fail_cuda("cudaDeviceGetAttribute", e);
        if (cc_major != 9 || cc_minor != 0) {
            fprintf(stderr, "fa3_peer_fwd: device %d is sm_%d%d; this library only has sm_90a (H100/H200) code\n",
                    device, cc_major, cc_minor);
            return 1;
        }
        if (num_sms <= 0) {
            e = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
            if (e != cudaSuccess) return fail_cuda("cudaDeviceGetAttribute", e);
        }

        // ---------------- mha_fwd window / causal normalisation ----------------
        bool causal = is_causal != 0;
        int window_size_left = -1, window_size_right = -1;
        const int attention_chunk = 0;
        // mha_fwd: "causal=true is the same as causal=false" when seqlen_q == 1 (non-paged).
        if (seqlen_q == 1) causal = false;
        if (causal) window_size_right = 0;

        // ---------------- set_params_fprop ----------------
        Flash_fwd_params params;
        std::memset(&params, 0, sizeof(params));  // == `params = {}` in set_params_fprop
        params.is_bf16 = true;
        params.is_e4m3 = false;
        params.is_fp32 = false;

        params.q_ptr = q;
        params.k_ptr = k;
        params.v_ptr = v;
        params.o_ptr = o;
        // All strides in elements.
        params.q_row_stride = q_row_stride;
        params.k_row_stride = k_row_stride;
        params.v_row_stride = v_row_stride;
        params.q_head_stride = q_head_stride;
        params.k_head_stride = k_head_stride;
        params.v_head_stride = v_head_stride;
        params.v_dim_stride = 1;
        params.o_row_stride = o_row_stride;
        params.o_head_stride = o_head_stride;
        params.q_batch_stride = q_batch_stride;
        params.o_batch_stride = o_batch_stride;
        params.k_batch_stride = k_batch_stride;
        params.v_batch_stride = v_batch_stride;

        params.cu_seqlens_q = nullptr;
        params.cu_seqlens_k = nullptr;
        params.seqused_q = nullptr;
        params.seqused_k = nullptr;

        // LSE: float32 (batch, heads, seqlen_q) contiguous (the kernel hard-codes this layout).
        params.softmax_lse_ptr = softmax_lse;

        auto round_multiple = [](int x, int m) { return (x + m - 1) / m * m; };
        // round_up_headdim() with HDIM96/HDIM192 disabled.
        const int head_size_rounded = head_dim <= 64 ? 64 : (head_dim <= 128 ? 128 : 256);
        params.b = batch;
        params.h = heads;
        params.h_k = heads_k;
        params.seqlen_q = seqlen_q;
        params.seqlen_k = seqlen_k;
        params.seqlen_q_rounded = round_multiple(seqlen_q, 128);
        params.seqlen_k_rounded = round_multiple(seqlen_k, 128);
        params.d = head_dim;
        params.d_rounded = head_size_rounded;

        params.scale_softmax = softmax_scale;  // kernel derives the log2-domain scale itself
        params.softcap = 0.f;

        params.p_dropout = 1.f;  // 1 - p_dropout with p_dropout = 0
        params.p_dropout_in_uint8_t = uint8_t(255);
        params.rp_dropout = 1.f;

        params.is_causal = window_size_left < 0 && window_size_right == 0 && attention_chunk == 0;
        params.is_local = (window_size_left >= 0 || window_size_right >= 0 || attention_chunk >= 1) && !params.is_causal;
        if (params.is_local) return fail("internal: local attention not built");
        if (window_size_left < 0) { window_size_left = seqlen_k - 1; }
        if (window_size_right < 0) { window_size_right = seqlen_q - 1; }
        params.window_size_left = window_size_left;
        params.window_size_right = window_size_right;
        params.attention_chunk = attention_chunk;

        params.arch = cc_major * 10 + cc_minor;  // 90
        params.num_sm = num_sms;                  // sm_margin = 0

        // ---------------- rest of mha_fwd ----------------
        params.total_q = batch * seqlen_q;
        params.total_k = batch * seqlen_k;
        params.b_k = batch;
        params.dv = head_dim;
        params.dv_rounded = head_size_rounded;
        params.page_table = nullptr;
        params.page_size = 1;
        params.num_pages = 0;
        params.pagedkv_tma = false;
        params.knew_ptr = nullptr;
        params.vnew_ptr = nullptr;
        params.qv_ptr = nullptr;
        params.rotary_dim = 0;
        params.kv_batch_idx = nullptr;
        params.leftpad_k = nullptr;

        params.prepare_varlen_pdl = false;      // not varlen
        params.num_splits_dynamic_ptr = nullptr;
        params.num_splits = 1;                  // FLASHATTENTION_DISABLE_SPLIT
        params.pack_gqa = false;                // FLASHATTENTION_DISABLE_PACKGQA (GQA still works, unpacked)

        // Semaphore: sm90 + (causal || local) + num_splits == 1 -> DynamicPersistentTileScheduler.
        // Non-causal uses StaticPersistentTileScheduler (no semaphore). No varlen -> no
        // prepare_varlen_num_blocks / scheduler metadata kernel.
        const bool scheduler_needs_semaphore = params.is_causal || params.is_local;
        params.varlen_sort_batches = !params.is_local;
        params.head_swizzle = params.is_causal || params.is_local;
        params.skip_scheduler_metadata_computation = false;
        params.num_m_blocks_ptr = nullptr;
        params.varlen_batch_idx_ptr = nullptr;
        params.num_nheads_in_l2_ptr = nullptr;
        params.tile_count_semaphore = nullptr;
        params.tile_count_semaphore_offset = 0;
        if (scheduler_needs_semaphore) {
            if (!tile_count_semaphore)
                return fail("causal attention needs tile_count_semaphore (>= 4 bytes of device memory)");
            if ((reinterpret_cast<uintptr_t>(tile_count_semaphore) & 3u) != 0)
                return fail("tile_count_semaphore must be 4-byte aligned");
            params.tile_count_semaphore = static_cast<int *>(tile_count_semaphore);
            e = cudaMemsetAsync(tile_count_semaphore, 0, sizeof(int), stream);
            if (e != cudaSuccess) return fail_cuda("cudaMemsetAsync(tile_count_semaphore)", e);
        }

        dispatch(params, stream);

        e = cudaPeekAtLastError();
        if (e != cudaSuccess) return fail_cuda("kernel launch", e);
        return 0;
    } catch (const std::exception &ex) {
        fprintf(stderr, "fa3_peer_fwd: %s\n", ex.what());
        return 3;
    } catch (...) {
        fprintf(stderr, "fa3_peer_fwd: unknown C++ exception\n");
        return 3;
    }
}
