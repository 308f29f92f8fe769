/* Shape of the generated variant table (one entry per exported kernel). */
#ifndef FA4_VARIANT_TABLE_H
#define FA4_VARIANT_TABLE_H
#include <cuda_runtime.h>
#include "fa4_shim.h"

#define FA4_MAX_VARIANTS 1024

typedef int32_t (*fa4_init_fn)(void);
typedef int32_t (*fa4_load_fn)(int32_t device);
typedef int32_t (*fa4_fwd_fn)(const fa4_tensor *q, const fa4_tensor *k, const fa4_tensor *v,
                              const fa4_tensor *o, const fa4_tensor *lse, const fa4_tensor *semaphores,
                              const fa4_tensor *partials, const fa4_tensor *cu_seqlens_q,
                              const fa4_tensor *cu_seqlens_k, const fa4_tensor *seqused_k,
                              const fa4_tensor *seq_order, const fa4_fwd_params *params,
                              cudaStream_t stream);

typedef struct {
  const char *name;
  int32_t cc_major, cc_minor;
  int32_t varlen; /* 1: q/k/v/out are (1, total, heads, dim), sequences given by cu_seqlens */
  int32_t tile_m; /* query rows per tile: pack-GQA needs tile_m / pack_gqa a multiple of 8 */
  int32_t split_tail; /* 1: static schedule whose last round may be split (params->tail_ctas) */
  fa4_init_fn init;  /* registers the embedded cubin with the runtime (once per process) */
  fa4_load_fn load;  /* prepares it on one device (once per device) */
  fa4_fwd_fn fwd;
} fa4_variant;

extern const fa4_variant fa4_variants[];
extern const int32_t fa4_variant_count;
#endif
