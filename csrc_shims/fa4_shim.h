/* The C interface of libfa4 (loaded with ctypes; no libtorch, no CPython ABI). */
#ifndef FA4_SHIM_H
#define FA4_SHIM_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FA4_MAX_RANK 4
/* Fields per row of a block-sparse call's counts table (fa4_kernels.block_info.SPARSE_COUNT_FIELDS):
 * partial blocks, all blocks, first bitmask slot, and the tile that runs at this position. */
#define FA4_SPARSE_COUNT_FIELDS 4

/* Built-in score_mods (fa4_kernels.catalog.SCORE_MODS; src/fa4_kernels/score_mod.py), block-sparse
 * variants only: an additive bias on each score from score_params (heads_q, width) fp32, already
 * divided by the softmax scale. ALIBI: width 1, bias = slope[h] * (key - query). RELBIAS: width
 * 2c + 1, bias = table[h, clamp(query - key, -c, c) + c]. BIAS: score_params (batch, heads_q,
 * seqlen_q, seqlen_k) fp32, keys contiguous, stride 0 where it broadcasts, bias = score_params[b,
 * h, query, key]; BIAS16: the same in the inputs' 16-bit dtype (fa4::fwd_sparse takes both as
 * score_mod 3 and picks the variant by the tensor's dtype). The backward adds the gradient of the
 * scaled scores' bias into score_grad (the parameters' shape and, for BIAS/BIAS16, their zero
 * strides) fp32, zero at launch, or skips it when score_grad has 0 rows. */
enum fa4_score_mod {
  FA4_SCORE_NONE = 0,
  FA4_SCORE_ALIBI = 1,
  FA4_SCORE_RELBIAS = 2,
  FA4_SCORE_BIAS = 3,
  FA4_SCORE_BIAS16 = 4
};

/* A strided view of device memory; sizes and strides in elements. */
typedef struct {
  void *data;
  int32_t rank;
  int64_t shape[FA4_MAX_RANK];
  int64_t stride[FA4_MAX_RANK];
} fa4_tensor;

typedef struct {
  float softmax_scale;
  float softcap;       /* used by softcap variants */
  int32_t window_left; /* used by local variants, >= 0 */
  int32_t window_right;
  int32_t heads_per_group; /* tile-order L2 swizzle (src/fa4_kernels/tile_scheduler.py), >= 1 */
  int32_t num_sms;         /* persistent grid size: the device's multiprocessor count */
  int32_t max_seqlen_q;    /* varlen: longest query sequence (>= 1) */
  int32_t has_seqused_k;   /* varlen: 1 when seqused_k holds per-sequence key counts */
  int32_t pack_gqa;        /* q heads stacked in one tile: 1, or heads_q / heads_kv in {2,4,8,16} */
  int32_t tail_ctas;       /* split-tail variants: CTAs sharing the last round's tiles, 0..num_sms
                              (0: no split; see src/fa4_kernels/tile_scheduler.py, SplitTail) */
  int32_t page_size;       /* kv_cache variants: rows per page of k/v (= k->shape[1]) */
  int32_t seqlen_new;      /* kv_cache variants: rows of k_new/v_new appended per sequence (0: none) */
} fa4_fwd_params;

typedef struct {
  float softmax_scale;
  float softcap;       /* used by softcap variants */
  int32_t window_left; /* used by local variants, >= 0 */
  int32_t window_right;
  int32_t num_n_blocks;  /* K/V blocks of tile_n keys of the longest sequence: the grid's x */
  int32_t has_seqused_k; /* varlen: 1 when seqused_k holds per-sequence key counts */
  int32_t deterministic; /* 1, 2: add into each query block's dQ rows in K/V-block order (dq_semaphore),
                            with 1 or 2 dQ writer warps (fa4_bwd_dq_writers) */
  int32_t rotate;        /* > 0: no mask, the rotation's period: each K/V block starts at a query block of its own
                            (fa4_bwd_rotate, src/fa4_kernels/dq_order.py) */
  int32_t store_first;   /* 1: dq_accum not zeroed: a query block's first K/V block stores (packed sequences: whole
                            query blocks only, fa4_bwd_preprocess zeroing the rest) */
  int32_t launch_group;  /* > 0: the CTAs launch in groups of this many (batch, head) pairs (fa4_bwd_launch_group:
                            dense batches' local variants, not deterministic, and unmasked ones with rotated
                            deterministic turns); 0: the grid's order */
} fa4_bwd_params;

typedef struct {
  int32_t has_dlse;      /* 1: dlse holds the gradient flowing into the returned LSE */
  int32_t zero_rows;     /* dense: zero dq_accum's rows below this one in each batch */
  int32_t num_m_blocks;  /* the grid's x: dense, query blocks of tile_m rows per batch; packed, the statistics'
                            blocks (lse_log2's padded rows / tile_m: every block of every sequence) */
  int32_t varlen;        /* 1: packed sequences delimited by cu_seqlens_q/k (batch dim 1); 0: dense */
  int32_t store_first;   /* varlen: the fa4_bwd call's store_first (which dq_accum rows need zeros) */
  int32_t window_right;  /* varlen: the mask's right side (FA4_UNBOUNDED: none), for the rows that see no key */
  int32_t has_seqused_k; /* varlen: 1 when seqused_k holds per-sequence key counts */
} fa4_bwd_pre_params;

typedef struct {
  int32_t first_row;  /* the query row dq_accum's first element belongs to (fa4_bwd_postprocess sets it per
                         launch: callers leave it 0) */
  int32_t row_words;  /* elements per query row: hq * d */
  int32_t batch_rows; /* dense: rows per batch (sq); packed: the rows in all */
  int32_t expected;   /* seq_done's count for a finished sequence: the fa4_bwd call's num_n_blocks * hk */
  int32_t varlen;     /* 1: sequences delimited by cu_seqlens_q */
} fa4_bwd_post_params;

enum fa4_status {
  FA4_OK = 0,
  FA4_ERR_BAD_VARIANT = 1,  /* no such variant index */
  FA4_ERR_WRONG_ARCH = 2,   /* variant compiled for another compute capability */
  FA4_ERR_BAD_TENSOR = 3,   /* rank / alignment / stride / size rule broken */
  FA4_ERR_MODULE_LOAD = 4,  /* loading the embedded cubin failed */
  FA4_ERR_LAUNCH = 5,       /* the launch returned a CUDA error */
  FA4_ERR_CUDA = 6,         /* another CUDA runtime call failed */
  FA4_ERR_WRONG_KIND = 7,   /* a forward variant passed to fa4_bwd or the reverse */
};

int32_t fa4_num_variants(void);
const char *fa4_variant_name(int32_t index);
/* Message describing the last failure on this thread. */
const char *fa4_last_error(void);

/* Workspace sizes (in 4-byte words) a launch of `variant` with this head_dim_v and params->num_sms
 * needs when params->tail_ctas > 0 (else 1 semaphore word and any partials vector). Returns 0,
 * or FA4_ERR_BAD_VARIANT. */
int32_t fa4_split_workspace(int32_t variant, int32_t head_dim_v, int32_t num_sms, int64_t *semaphore_words,
                            int64_t *partial_words);

/* q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv), o (b, sq, hq, dv), lse (b, hq, sq) fp32.
 * semaphores: int32 vector, zero at launch: word 0 counts claimed tiles (dynamic scheduling);
 * with a split tail (params->tail_ctas > 0) words from 32 on are per-CTA flags, which the kernel
 * leaves zero again. partials: fp32 scratch vector for split tiles (any contents).
 * Sizes: fa4_split_workspace. Varlen variants: b = 1 and sq/sk are the packed totals; cu_seqlens_q/k
 * (n + 1,) int32 offsets, seqused_k (n,) int32 (read when params->has_seqused_k), seq_order
 * (n,) int32: a permutation of the sequences, the order in which their tiles are scheduled
 * (longest first, say), read only for n > fa4_seq_order_in_kernel (fewer: the kernel orders them
 * longest first itself, and seq_order may be any int32 vector). Dense variants ignore those four
 * (any int32 vectors).
 * Block-sparse variants (mask FA4_MASK_SPARSE) read three int32 tables, which the others ignore
 * (NULL there): sparse_counts (b, hq, m_blocks, FA4_SPARSE_COUNT_FIELDS) and sparse_blocks (b, hq,
 * m_blocks, width), m_blocks = ceil(sq / tile_m), any leading strides (0 where broadcast), last dim
 * contiguous: per query tile its partial blocks, all its blocks, its first partial block's bitmask
 * slot and the tile of its row scheduled at its position, then its K/V blocks of tile_n keys,
 * partial ones first; sparse_bits (slots * tile_m * tile_n / 32,)
 * contiguous, 16-byte aligned: per slot and tile row tile_n / 32 words, key j in bit j % 32 of
 * word j // 32. Partial block i of a tile reads slot first_slot + i; a tile with no block must list
 * one partial block whose slot is all zeros (fa4.block_sparse writes them this way). Launches on
 * `stream` (a cudaStream_t) on the current device. */
/* KV-cache variants (kv_cache = 1; src/fa4_kernels/kv_cache.py): k and v are (num_pages, page_size,
 * heads_kv, dim) caches, page_table (batch, max_pages) int32 with rows contiguous names each
 * sequence's pages (a contiguous cache: one page per sequence), seqused_k (batch,) holds
 * cache_seqlens, and k_new/v_new (batch, seqlen_new, heads_kv, dim) are appended at cache_seqlens
 * (seqlen_new 0: nothing). page_size is a multiple of 16, a power of two when max_pages > 1.
 * Other variants ignore page_table, k_new and v_new (NULL allowed). */
int32_t fa4_fwd(int32_t variant, const fa4_tensor *q, const fa4_tensor *k, const fa4_tensor *v,
                const fa4_tensor *o, const fa4_tensor *lse, const fa4_tensor *semaphores,
                const fa4_tensor *partials, const fa4_tensor *cu_seqlens_q, const fa4_tensor *cu_seqlens_k,
                const fa4_tensor *seqused_k, const fa4_tensor *seq_order, const fa4_tensor *sparse_counts,
                const fa4_tensor *sparse_blocks, const fa4_tensor *sparse_bits, const fa4_tensor *score_params,
                const fa4_tensor *page_table, const fa4_tensor *k_new, const fa4_tensor *v_new,
                const fa4_fwd_params *params,
                void *stream);

/* The backward's main kernel: dq_accum (b, sq, hq, d) fp32, zero at launch, receives dQ (scaled);
 * dk (b, sk, hkv, d), dv (b, sk, hkv, dv) are written for every key a sequence uses. dout (b, sq, hq, dv).
 * lse_log2 and dpsum (b, hq, rows) fp32: LSE * log2(e) (+inf for rows that see no key and for the
 * padding) and rowsum(dout * out) - dLSE, rows padded as the variant's tile_m requires: dense
 * rows >= ceil(sq / tile_m) * tile_m; varlen (b = 1) sequence i at row (cu_seqlens_q[i] + i * tile_m)
 * rounded down to a multiple of tile_m, rows >= (ceil(total_q / tile_m) + n + 1) * tile_m.
 * dq_semaphore (sequences, hq, m_blocks) int32, zero at launch, read when params->deterministic or
 * params->store_first: one counter per query block of tile_m rows (blocks past m_blocks are added
 * unordered); sequences is b, or n for varlen. Otherwise any int32 tensor of rank 3. With
 * params->store_first (dense only, m_blocks = ceil(sq / tile_m)) dq_accum need not be zero: each
 * query block's first K/V block stores, but rows no K/V block reaches (those that see no key)
 * must be zero. Block-sparse variants (FA4_MASK_SPARSE; dq_accum zero at launch, not deterministic,
 * no store_first or rotate) read the tables of fa4_fwd transposed (NULL for the others):
 * sparse_counts (b, hq, n_blocks, 4) and sparse_blocks (b, hq, n_blocks, width), per K/V block of
 * tile_n keys and query head its query blocks of tile_m rows, partial ones first; sparse_bits
 * (slots * tile_n * tile_m / 32,): per slot and key tile_m / 32 words, query i in bit i % 32 of
 * word i // 32. A K/V block no query sees lists one partial block of an all-zero slot. */
int32_t fa4_bwd(int32_t variant, const fa4_tensor *q, const fa4_tensor *k, const fa4_tensor *v,
                const fa4_tensor *dout, const fa4_tensor *lse_log2, const fa4_tensor *dpsum,
                const fa4_tensor *dq_accum, const fa4_tensor *dk, const fa4_tensor *dv,
                const fa4_tensor *cu_seqlens_q, const fa4_tensor *cu_seqlens_k, const fa4_tensor *seqused_k,
                const fa4_tensor *dq_semaphore, const fa4_tensor *seq_done, const fa4_tensor *sparse_counts,
                const fa4_tensor *sparse_blocks, const fa4_tensor *sparse_bits, const fa4_tensor *score_params,
                const fa4_tensor *score_grad, const fa4_bwd_params *params, void *stream);

/* The backward's preprocess, for the fa4_bwd variant of the same (dtype, head dims):
 * out, dout (b, sq, hq, dv); lse, dlse (b, hq, sq) fp32 (dlse read when params->has_dlse);
 * writes lse_log2 and dpsum as fa4_bwd reads them, every statistics block of every sequence's
 * first max(ceil(seqlen / tile_m), 1) blocks (so num_m_blocks must cover them: dense, a batch's query
 * blocks; packed, every statistics block),
 * and zeroes what the fa4_bwd call with the same store_first leaves unwritten: dense batches,
 * dq_accum (b, sq, hq, d) fp32 on each batch's rows below params->zero_rows; packed sequences,
 * dq_accum's rows of each sequence (every one without store_first; with it, those that see no
 * key and a partial last query block's), dk (b, sk, hk, d) and dv (b, sk, hk, dv) on the keys
 * past seqused_k, and all three outside every sequence (src/fa4_kernels/sm90/bwd_preprocess.py);
 * and seq_done (sequences,) int32, the fa4_bwd call's per-sequence counts. cu_seqlens_k and
 * seqused_k are read with packed sequences only. */
int32_t fa4_bwd_preprocess(int32_t variant, const fa4_tensor *out, const fa4_tensor *dout, const fa4_tensor *lse,
                           const fa4_tensor *dlse, const fa4_tensor *lse_log2, const fa4_tensor *dpsum,
                           const fa4_tensor *dq_accum, const fa4_tensor *dk, const fa4_tensor *dv,
                           const fa4_tensor *cu_seqlens_q, const fa4_tensor *cu_seqlens_k,
                           const fa4_tensor *seqused_k, const fa4_tensor *seq_done, const fa4_bwd_pre_params *params,
                           void *stream);

/* The backward's postprocess: dq = dq_accum converted to the variant's dtype (its bwd_post variant),
 * both rank 1, contiguous, 16-byte aligned, of the same length, a multiple of params->row_words
 * (hq * d, a multiple of 8). Launched right behind fa4_bwd (programmatic dependent launch), it
 * converts each sequence's rows once seq_done (sequences,) int32 (fa4_bwd's counts, zeroed by
 * fa4_bwd_preprocess) reaches params->expected for it (dense: batch = row / batch_rows; packed:
 * the sequences of cu_seqlens_q (sequences + 1,)). Any length: ranges of at most 2^30 elements,
 * each starting on a row, are launched one after another. */
int32_t fa4_bwd_postprocess(int32_t variant, const fa4_tensor *dq_accum, const fa4_tensor *dq,
                            const fa4_tensor *seq_done, const fa4_tensor *cu_seqlens_q,
                            const fa4_bwd_post_params *params, void *stream);

/* What the last forward or backward launch on this thread ran (for tests and diagnostics):
 * its variant index and the decisions the caller made for it. */
typedef struct {
  int32_t variant;
  int32_t pack_gqa;        /* forward */
  int32_t tail_ctas;       /* forward */
  int32_t heads_per_group; /* forward */
  int32_t grid;            /* forward: params->num_sms */
  int32_t store_first;     /* backward */
  int32_t rotate;          /* backward */
  int32_t deterministic;   /* backward */
  int32_t launch_group;    /* backward */
  void *semaphores;        /* forward: semaphores; backward: dq_semaphore */
  int64_t semaphore_words; /* its first dimension */
  /* backward: the clusters the device held at once when a clustered variant was asked for (its
     1-CTA twin ran instead where they did not fit: variant); -1: no clustered variant asked for */
  int32_t active_clusters;
} fa4_launch;

/* kind: FA4_KERNEL_FWD (0) or FA4_KERNEL_BWD (1); variant -1 before any launch. */
int32_t fa4_last_launch(int32_t kind, fa4_launch *out);
/* The same for the last launch made on any thread (autograd's backward runs on its own). */
int32_t fa4_last_launch_any_thread(int32_t kind, fa4_launch *out);

/* Tests: clustered launches take this many clusters as what the device holds at once instead of
 * asking it (forcing the 1-CTA fallback with 0); -1 asks the device again. */
void fa4_test_pretend_active_clusters(int32_t clusters);

#ifdef __cplusplus
}
#endif
#endif
