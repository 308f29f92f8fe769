/* Shape of the generated variant table (one entry per exported kernel). */
#ifndef FA4_VARIANT_TABLE_H
#define FA4_VARIANT_TABLE_H
#include <cuda_runtime.h>
#include "fa4_shim.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FA4_MAX_VARIANTS 1024

/* The generated per-variant functions (aot.generate_stub), each in its own object: the table
   declares them through these function types, with hidden visibility. */
#define FA4_HIDDEN __attribute__((visibility("hidden")))

typedef int32_t fa4_init_launch(void);
typedef int32_t fa4_load_launch(int32_t device);
typedef int32_t fa4_fwd_launch(const fa4_tensor *q, const fa4_tensor *k, const fa4_tensor *v,
                               const fa4_tensor *o, const fa4_tensor *lse, const fa4_tensor *semaphores,
                               const fa4_tensor *partials, const fa4_tensor *cu_seqlens_q,
                               const fa4_tensor *cu_seqlens_k, const fa4_tensor *seqused_k,
                               const fa4_tensor *seq_order, const fa4_tensor *sparse_counts,
                               const fa4_tensor *sparse_blocks, const fa4_tensor *sparse_bits,
                               const fa4_tensor *score_params, const fa4_tensor *page_table,
                               const fa4_tensor *k_new, const fa4_tensor *v_new, const fa4_fwd_params *params,
                               cudaStream_t stream);

typedef int32_t fa4_bwd_launch(const fa4_tensor *q, const fa4_tensor *k, const fa4_tensor *v,
                               const fa4_tensor *dout, const fa4_tensor *lse_log2, const fa4_tensor *dpsum,
                               const fa4_tensor *dq_accum, const fa4_tensor *dk, const fa4_tensor *dv,
                               const fa4_tensor *cu_seqlens_q, const fa4_tensor *cu_seqlens_k,
                               const fa4_tensor *seqused_k, const fa4_tensor *dq_semaphore,
                               const fa4_tensor *seq_done, const fa4_tensor *sparse_counts,
                               const fa4_tensor *sparse_blocks,
                               const fa4_tensor *sparse_bits, const fa4_tensor *score_params,
                               const fa4_tensor *score_grad, const fa4_bwd_params *params, cudaStream_t stream);

typedef int32_t fa4_bwd_pre_launch(const fa4_tensor *out, const fa4_tensor *dout, const fa4_tensor *lse,
                                   const fa4_tensor *dlse, const fa4_tensor *lse_log2, const fa4_tensor *dpsum,
                                   const fa4_tensor *dq_accum, const fa4_tensor *dk, const fa4_tensor *dv,
                                   const fa4_tensor *cu_seqlens_q, const fa4_tensor *cu_seqlens_k,
                                   const fa4_tensor *seqused_k, const fa4_tensor *seq_done,
                                   const fa4_bwd_pre_params *params, cudaStream_t stream);

typedef int32_t fa4_bwd_post_launch(const fa4_tensor *dq_accum, const fa4_tensor *dq, const fa4_tensor *seq_done,
                                    const fa4_tensor *cu_seqlens_q, const fa4_bwd_post_params *params,
                                    cudaStream_t stream);

typedef fa4_init_launch *fa4_init_fn;
typedef fa4_load_launch *fa4_load_fn;
typedef fa4_fwd_launch *fa4_fwd_fn;
typedef fa4_bwd_launch *fa4_bwd_fn;
typedef fa4_bwd_pre_launch *fa4_bwd_pre_fn;
typedef fa4_bwd_post_launch *fa4_bwd_post_fn;

enum fa4_kernel_kind { FA4_KERNEL_FWD = 0, FA4_KERNEL_BWD = 1, FA4_KERNEL_BWD_PRE = 2, FA4_KERNEL_BWD_POST = 3 };
enum fa4_dtype { FA4_DTYPE_BF16 = 0, FA4_DTYPE_FP16 = 1 };

/* fa4_variant.split_tail of variants whose split tiles' pieces all fold a share of the tile
   (src/fa4_kernels/split_partials.py, "distributed"). */
#define FA4_SPLIT_DISTRIBUTED 2

/* fa4_variant.kv_cache: a dense forward, a KV-cache forward, or a KV-cache forward's append twin
   (src/fa4_kernels/kv_cache.py: appended rows copied into the first K/V block's loaded stages;
   catalog.VariantKey.kv_append), which calls with rows to append run where built. */
typedef enum { FA4_KV_CACHE_NONE = 0, FA4_KV_CACHE_PLAIN = 1, FA4_KV_CACHE_APPEND = 2 } fa4_kv_cache_kind;

typedef struct {
  const char *name;
  int32_t kind; /* fa4_kernel_kind: which of fwd / bwd / bwd_pre / bwd_post below is set */
  int32_t cc_major, cc_minor;
  /* The call key it serves (catalog.VariantKey): dtype, head dims, mask (fa4_mask_kind in
     fa4_rules.h), softcap, score_mod, varlen, and its tile family (fa4_tile_family). */
  int32_t dtype; /* fa4_dtype */
  int32_t head_dim, head_dim_v; /* 0, 0 for the postprocess (one per dtype) */
  int32_t mask;
  int32_t softcap;
  int32_t score_mod; /* fa4_score_mod (fa4_shim.h) */
  int32_t tiles;
  int32_t varlen; /* 1: q/k/v/out are (1, total, heads, dim), sequences given by cu_seqlens */
  int32_t kv_cache; /* fa4_kv_cache_kind: k/v are a paged KV cache read through page_table (fa4_fwd) */
  int32_t trace;    /* 1: also records a per-tile timeline (src/fa4_kernels/trace.py; fa4_ops.cpp trace_call) */
  int32_t tile_m; /* query rows per tile (fwd: pack-GQA needs tile_m / pack_gqa a multiple of 8;
                     bwd: the padding unit of the LSE/dPsum rows) */
  int32_t tile_n; /* keys per K/V block (bwd: the grid's x covers ceil(seqlen_k / tile_n)) */
  int32_t split_tail; /* static schedule whose last round may be split (params->tail_ctas): 1, a merger
                         folds each split tile; FA4_SPLIT_DISTRIBUTED, every piece folds a share
                         (fa4_split_workspace) */
  int32_t cluster;    /* CTAs per cluster: 1, or 2 for the backward's "long" family */
  /* A clustered variant's 1-CTA twin (its key with regular tiles; results do not depend on which
     runs: the clusters share read-only multicast loads only), launched instead where the device
     does not fit the clusters (fa4_clusters_fit, cuda_forwards.c); -1: none. */
  int32_t fallback;
  fa4_init_fn init;  /* registers the embedded cubin with the runtime (once per process) */
  fa4_load_fn load;  /* prepares it on one device (once per device) */
  fa4_fwd_fn fwd;
  fa4_bwd_fn bwd;
  fa4_bwd_pre_fn bwd_pre;
  fa4_bwd_post_fn bwd_post;
} fa4_variant;

/* cuda_forwards.c's answer to a clustered launch (a cluster dimension above 1) that the device does
   not fit (fa4_clusters_fit over cudaOccupancyMaxActiveClusters for the launch's configuration):
   nothing was enqueued, and the shim launches the variant's fallback. Not a CUDA error code. */
#define FA4_CLUSTERS_DO_NOT_FIT ((cudaError_t)0x7fa4)
/* The clusters the device held at once in the last clustered launch's check on this thread (-1:
   none checked yet). */
FA4_HIDDEN int32_t fa4_last_active_clusters(void);
/* Tests: >= 0 makes the check take this many clusters instead of asking the device; -1 asks. */
FA4_HIDDEN void fa4_pretend_active_clusters(int32_t clusters);

extern const fa4_variant fa4_variants[];
extern const int32_t fa4_variant_count;
/* The backward statistics' padding unit in rows (fa4_kernels.heuristics.STATS_BLOCK_ROWS). */
extern const int32_t fa4_stats_block_rows;
/* Packed forwards order up to this many sequences themselves (fa4_kernels.tile_scheduler.
   SEQ_ORDER_IN_KERNEL); the host sorts more of them. */
extern const int32_t fa4_seq_order_in_kernel;
/* The one mask kind of the KV-cache forwards (fa4_kernels.catalog.KV_CACHE_MASKS): every KV-cache
   call runs it, its own mask given as a window. */
extern const int32_t fa4_kv_cache_mask;
/* The masks with a KV-cache twin beside the window kernel (fa4_kernels.catalog.KV_CACHE_TWIN_MASKS,
   no softcap), as bits 1 << kind: a call left with such a mask runs its twin where built. */
extern const int32_t fa4_kv_cache_twin_masks;
/* The fewest rows a packed query head may take of a KV-cache tile (min of fa4_kernels.kv_cache.
   FEW_HEAD_ROWS: their Q pieces span heads); the other kernels' packed heads take multiples of 8. */
extern const int32_t fa4_kv_cache_head_rows;
/* The mask kind of the backward kernels that serve causal calls (fa4_kernels.catalog.BWD_MASKS): the
   window's, the call's window given as it is. */
extern const int32_t fa4_bwd_causal_mask;
/* The trace records' layout (fa4_kernels.trace): the semaphores words of the record counter, the
   first record's word, the capacity in records and the round-robin switch; the words per record,
   their names and the flag bits ("name=bit,..."). */
extern const int32_t fa4_trace_header[4];
extern const int32_t fa4_trace_record_words;
extern const char *const fa4_trace_fields;
extern const char *const fa4_trace_flags;

#ifdef __cplusplus
}
#endif
#endif
