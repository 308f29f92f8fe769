/* The run-time rules, in one place: how a call's mask options map to a compiled mask kind and
 * which tile family, pack-GQA factor, tile order, grid and split a launch uses. Pure C (no
 * CUDA, no torch): compiled into the native op library, which applies them per call, and into
 * libfa4_rules.so, through which fa4.heuristics (Python) exposes them to the CPU path and to
 * the CPU unit tests. Each rule's measurements are in its comment in fa4_rules.c. */
#ifndef FA4_RULES_H
#define FA4_RULES_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* "Unbounded" window side as passed to the kernel: far beyond any sequence length, yet small
 * enough that adding a row index and a sequence length cannot overflow int32. */
#define FA4_UNBOUNDED (1 << 30)

/* FA4_MASK_SPARSE: block-sparse forwards, whose tables (fa4.block_sparse) carry the mask. */
enum fa4_mask_kind { FA4_MASK_NONE = 0, FA4_MASK_CAUSAL = 1, FA4_MASK_LOCAL = 2, FA4_MASK_SPARSE = 3 };
enum fa4_tile_family { FA4_TILES_REGULAR = 0, FA4_TILES_SHORT = 1, FA4_TILES_LONG = 2 };
/* A tri-state option: FA4_AUTO lets the rule decide. */
#define FA4_AUTO (-1)

typedef struct {
  int32_t kind; /* fa4_mask_kind */
  int32_t window_left;  /* >= 0, FA4_UNBOUNDED for no limit */
  int32_t window_right;
} fa4_mask;

/* Message of the last rule that refused its input (this thread). */
const char *fa4_rules_error(void);

/* FlashAttention's normalisation: -1 unbounded, causal = window (-1, 0), a window bounding
 * nothing is no mask. Returns 0, or 1 with fa4_rules_error() naming the argument. */
int32_t fa4_resolve_mask(int32_t causal, int64_t window_left, int64_t window_right, fa4_mask *out);
/* The mask a dense call needs: none where the window hides no key from any row. */
fa4_mask fa4_effective_mask(fa4_mask mask, int64_t seqlen_q, int64_t seqlen_k);

double fa4_tile_fill(int64_t rows, int64_t tile_m);
/* short_tile_m / long_tile_m: that family's tile_m where the call's key has it built, else 0;
 * override: a fa4_tile_family or FA4_AUTO. */
int32_t fa4_tile_family(int64_t seqlen_q, int64_t seqlen_k, int32_t packed, int32_t tile_m, int32_t short_tile_m,
                        int32_t long_tile_m, int32_t override, int32_t mask_kind);
/* The rows a packed query head's share of a tile is a multiple of in the kernels that load Q in
 * pieces of one head each (src/fa4_kernels/sm90/fwd.py); the KV-cache kernels' pieces span heads
 * (fa4_kv_cache_head_rows). The kernels' fa4_kernels.block_info.Q_PIECE_ROWS: the generated
 * variant table asserts that the two agree. */
#define FA4_Q_PIECE_ROWS 8
int32_t fa4_q_piece_rows(void); /* FA4_Q_PIECE_ROWS, for fa4.heuristics */
/* Query heads stacked in one tile (1: none) into *factor; head_rows: the rows a packed head's
 * share must be a multiple of (8; the KV-cache kernels: fa4_kv_cache_head_rows); override
 * FA4_AUTO, 0 or 1. Returns 1 (fa4_rules_error()) when pack_gqa=True cannot stack this group in
 * tile_m rows. */
int32_t fa4_pack_gqa_factor(int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int32_t tile_m, int32_t head_rows,
                            int32_t override, int32_t *factor);
/* The tile family that runs a packed call, forced (override 1) or automatic (FA4_AUTO): a
 * fa4_tile_family (fa4_rules.c). */
int32_t fa4_packing_family(int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int32_t tile_m, int32_t short_tile_m,
                           int32_t long_tile_m, int32_t head_rows, int32_t override);
/* A KV-cache call's tile family: FA4_TILES_LONG (chunked prefill) or regular; tile_m /
 * long_tile_m as in fa4_tile_family, head_rows and pack_override as in fa4_pack_gqa_factor,
 * override a fa4_tile_family or FA4_AUTO (fa4_rules.c). */
int32_t fa4_kv_cache_tile_family(int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_k,
                                 int32_t tile_m, int32_t long_tile_m, int32_t head_rows, int32_t pack_override,
                                 int32_t override);
/* Groups pack-GQA can stack at all (2, 4, 8, 16). */
int32_t fa4_packable_group(int64_t group);

int64_t fa4_l2_swizzle_budget(int64_t l2_bytes, int32_t mask_kind);
int64_t fa4_balance_heads(int64_t num_m_blocks, int32_t num_sms);
/* budget_bytes < 0: the rule's budget; num_m_blocks / num_sms <= 0: not given. */
int32_t fa4_heads_per_group(int64_t l2_bytes, int64_t seqlen_k, int32_t head_dim, int32_t head_dim_v,
                            int32_t elem_bytes, int64_t num_heads_batches, int64_t budget_bytes, int32_t mask_kind,
                            int64_t num_m_blocks, int32_t num_sms);
int32_t fa4_grid_size(int32_t num_sms, int32_t mask_kind, int32_t persistent_override);
int32_t fa4_split_overhead_blocks(int32_t head_dim_v);
/* Rows per page of a KV cache (pages_per_sequence -1: a contiguous cache): 0, or 1
 * (fa4_rules_error()) where the kernels cannot read it. */
int32_t fa4_kv_page_size(int64_t page_size, int64_t pages_per_sequence);
/* The page size the kernel reads a paged cache of page_size rows with. */
int64_t fa4_kv_kernel_page_rows(int64_t page_size);
int32_t fa4_split_tail_ctas(int64_t num_tiles, int32_t num_sms, int64_t n_blocks, int32_t head_dim_v,
                            int32_t live_rows, int32_t override);
int32_t fa4_split_ctas_for(int64_t num_tiles, int32_t num_sms, int64_t n_blocks, int64_t num_splits);

double fa4_mean_visible_keys(int64_t seqlen_q, int64_t seqlen_k, fa4_mask mask);
int32_t fa4_bwd_store_first(int64_t num_n_blocks, double blocks_per_query_block, int32_t override);
/* The rotation's period (0: none); override FA4_AUTO, 0 or 1 (FA4_BWD_ROTATE); spacing FA4_AUTO or
 * the chunks a deterministic call's chunk is cut into (FA4_BWD_TURN_SPACING). */
int32_t fa4_bwd_rotate(int32_t mask_kind, int32_t deterministic, int32_t store_first, int64_t num_n_blocks,
                       int32_t num_sms, int32_t tile_m, int32_t tile_n, int32_t override, int32_t spacing);
/* The backward's CTAs launch in groups of this many (batch, head) pairs (0: the grid's order):
 * causal calls, and deterministic unmasked ones rotated in several chunks (rotate: the period;
 * pairs: batch * K/V heads); override FA4_AUTO or a group size (FA4_BWD_LAUNCH_GROUP). */
int32_t fa4_bwd_launch_group(int32_t mask_kind, int32_t varlen, int32_t deterministic, int32_t rotate,
                             int64_t num_n_blocks, int64_t pairs, int32_t num_sms, int32_t override);
/* The backward's tile family (fa4_tile_family): FA4_TILES_LONG (2-CTA clusters) or regular;
 * long_built: the family is built for the call's key; override FA4_AUTO, 0 or 1 (FA4_BWD_CLUSTERS). */
int32_t fa4_bwd_tile_family(int32_t varlen, int32_t deterministic, int32_t long_built, int32_t override);
/* The backward kernel's deterministic argument: 0, or the dQ writer warps of deterministic turns
 * (1 or 2); override FA4_AUTO or the writers (FA4_BWD_DQ_WRITERS). */
int32_t fa4_bwd_dq_writers(int32_t deterministic, int32_t varlen, int32_t mask_kind, int32_t head_dim,
                           int64_t num_n_blocks, int32_t num_sms, int32_t override);
/* The chunks a deterministic rotation is cut into, given the dQ writers; override FA4_AUTO or the
 * chunks (FA4_BWD_TURN_SPACING). */
int32_t fa4_bwd_turn_spacing(int32_t writers, int32_t override);
/* 1 where a clustered launch should run given the clusters the device holds at once, else 0 (its
 * 1-CTA twin runs instead: fa4_variant.fallback). */
int32_t fa4_clusters_fit(int32_t active_clusters, int32_t cluster_size, int32_t num_sms);
int64_t fa4_keyless_rows(int64_t seqlen_q, int64_t seqlen_k, fa4_mask mask);
/* Rows of the backward's padded statistics: dense (num_seqs < 0) ceil(total_q / block) blocks,
 * packed sequences num_seqs + 1 blocks more (each sequence starts on a block). */
int64_t fa4_stats_rows(int64_t total_q, int32_t block, int64_t num_seqs);

/* The run-time tuning settings (README, "Environment variables"), read from the environment
 * here and nowhere else; each call reads them afresh (a few getenv calls), so a process may
 * change them between calls. Unset: FA4_AUTO (budget: -1). */
typedef struct {
  int64_t l2_swizzle_bytes;  /* FA4_L2_SWIZZLE_MB */
  int32_t persistent;        /* FA4_PERSISTENT */
  int32_t tiles;             /* FA4_TILES: a fa4_tile_family */
  int32_t split_tail;        /* FA4_SPLIT_TAIL */
  int32_t bwd_store_first;   /* FA4_BWD_STORE_FIRST */
  int32_t bwd_rotate;        /* FA4_BWD_ROTATE */
  int32_t bwd_launch_group;  /* FA4_BWD_LAUNCH_GROUP: pairs per group, >= 0 */
  int32_t bwd_clusters;      /* FA4_BWD_CLUSTERS */
  int32_t bwd_turn_spacing;  /* FA4_BWD_TURN_SPACING: 1..16 */
  int32_t bwd_dq_writers;    /* FA4_BWD_DQ_WRITERS: 1..2 */
  /* FA4_TRACE_SCHEDULE: traced calls of dynamically scheduled variants deal their tiles
     round-robin ("static": 1) or claim them as usual ("dynamic": 0). */
  int32_t trace_schedule;
  const char *trace_path;    /* FA4_TRACE: the file traced forwards append to; NULL when unset or empty */
} fa4_tuning;

/* Returns 0, or 1 (fa4_rules_error()) for a value the variable does not take. */
int32_t fa4_read_tuning(fa4_tuning *out);

#ifdef __cplusplus
}
#endif
#endif
