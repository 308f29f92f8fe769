/* The torch.ops.fa4 schemas (fa4_schemas.h). `deterministic` on the forward ops is a backward
 * option they carry for autograd. */
#include "fa4_schemas.h"

#define MASK_ARGS "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0"

static const char *const schemas[] = {
    "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, " MASK_ARGS ", bool? pack_gqa=None, "
    "bool deterministic=False) -> (Tensor out, Tensor lse)",
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float softmax_scale, "
    MASK_ARGS ", bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)",
    "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, "
    "int max_seqlen_q, int max_seqlen_k, float softmax_scale, " MASK_ARGS ", bool? pack_gqa=None, "
    "bool deterministic=False) -> (Tensor out, Tensor lse)",
    "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, "
    "float softmax_scale, " MASK_ARGS ", bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)",
    /* Block-sparse (FlexAttention BlockMask) attention: the tables of fa4.block_sparse at the kernels'
       tiles; the forward carries the backward's (transposed) tables for autograd. score_mod: 0 none,
       1 ALiBi (score_params: slopes (heads_q, 1)), 2 relative bias (a table (heads_q, 2c + 1) read at
       clamp(q - k, -c, c) + c), fp32, added to the scaled scores; the backward returns their
       gradient (fp32) with score_grad=True, else dscore has no rows. */
    "fwd_sparse(Tensor q, Tensor k, Tensor v, Tensor kv_counts, Tensor kv_blocks, Tensor kv_bits, int tile_m, "
    "int tile_n, float softmax_scale, float softcap=0.0, Tensor? q_counts=None, Tensor? q_blocks=None, "
    "Tensor? q_bits=None, int bwd_tile_m=0, int bwd_tile_n=0, int score_mod=0, Tensor? score_params=None) "
    "-> (Tensor out, Tensor lse)",
    "bwd_sparse(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor q_counts, "
    "Tensor q_blocks, Tensor q_bits, int tile_m, int tile_n, float softmax_scale, float softcap=0.0, "
    "int score_mod=0, Tensor? score_params=None, bool score_grad=False) "
    "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dscore)",
    /* Attention against a KV cache (fa4.attention_with_kvcache): k_new/v_new are written into the
       cache at cache_seqlens by the kernel, then attended to. Paged caches take page_table
       (batch, max_pages), contiguous ones cache_batch_idx (batch,): one of the two. num_splits:
       pieces of each sequence's K/V range (0: fa4 chooses, 1: none). */
    "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k_new=None, "
    "Tensor? v_new=None, Tensor? page_table=None, Tensor? cache_batch_idx=None, float softmax_scale=1.0, "
    MASK_ARGS ", bool? pack_gqa=None, int num_splits=0) -> (Tensor out, Tensor lse)",
};

int32_t fa4_schema_count(void) { return (int32_t)(sizeof(schemas) / sizeof(schemas[0])); }

const char *fa4_schema(int32_t index) {
  return index >= 0 && index < fa4_schema_count() ? schemas[index] : (const char *)0;
}
