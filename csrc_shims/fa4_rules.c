/* The run-time rules (fa4_rules.h): pure functions of shapes and options, each with the
 * measurement that justifies it. fa4.heuristics calls them through libfa4_rules.so; the native
 * ops link them in. */
#include "fa4_rules.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static __thread char rules_error[512];

static int32_t refuse(const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(rules_error, sizeof(rules_error), fmt, args);
  va_end(args);
  return 1;
}

const char *fa4_rules_error(void) { return rules_error; }

/* Constants the Python side names too (fa4.heuristics; test_heuristics compares them). */
const int32_t fa4_rule_unbounded = FA4_UNBOUNDED;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ----------------------------------------------------------------------------- masks */
int32_t fa4_resolve_mask(int32_t causal, int64_t window_left, int64_t window_right, fa4_mask *out) {
  if (window_left < -1)
    return refuse("window_left must be >= 0, or -1 for unbounded; got %lld", (long long)window_left);
  if (window_right < -1)
    return refuse("window_right must be >= 0, or -1 for unbounded; got %lld", (long long)window_right);
  if (causal) {
    if (window_right != -1 && window_right != 0)
      return refuse("causal=True already fixes window_right to 0; got window_right=%lld. Pass causal=False with "
                    "window=(left, right) for a window reaching past the diagonal.",
                    (long long)window_right);
    window_right = 0;
  }
  if (window_left < 0 && window_right < 0) {
    *out = (fa4_mask){FA4_MASK_NONE, FA4_UNBOUNDED, FA4_UNBOUNDED};
  } else if (window_left < 0 && window_right == 0) {
    *out = (fa4_mask){FA4_MASK_CAUSAL, FA4_UNBOUNDED, 0};
  } else {
    /* Sides beyond FA4_UNBOUNDED bound nothing in any sequence the kernels take. */
    out->kind = FA4_MASK_LOCAL;
    out->window_left = window_left < 0 ? FA4_UNBOUNDED : (int32_t)min64(window_left, FA4_UNBOUNDED);
    out->window_right = window_right < 0 ? FA4_UNBOUNDED : (int32_t)min64(window_right, FA4_UNBOUNDED);
  }
  return 0;
}

/* Row i sees keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right (bottom-right
 * aligned), so nothing is hidden when left >= seqlen_k - 1 and right >= seqlen_q - 1. Causal
 * decoding (one query row) is the common case: it then runs the unmasked kernel, whose static
 * schedule can split the few long tiles of a decoding step over all SMs. */
fa4_mask fa4_effective_mask(fa4_mask mask, int64_t seqlen_q, int64_t seqlen_k) {
  if (mask.kind != FA4_MASK_NONE && mask.window_left >= seqlen_k - 1 && mask.window_right >= seqlen_q - 1)
    return (fa4_mask){FA4_MASK_NONE, FA4_UNBOUNDED, FA4_UNBOUNDED};
  return mask;
}

/* ----------------------------------------------------------------------- tile families */
double fa4_tile_fill(int64_t rows, int64_t tile_m) {
  rows = max64(rows, 1);
  return (double)rows / (double)(ceil_div(rows, tile_m) * tile_m);
}

/* Where the extra tile families pay (fa4_kernels.heuristics.fwd_config has the measurements):
 * hd64's 256-row "short" tiles up to 1024 query rows, hd128's three-warpgroup "long" tiles from
 * 2048 keys on (H200, bf16 16k tokens, TFLOP/s, regular -> family, same run):
 *   hd64  no mask: seqlen 197 154 -> 220, 512 403 -> 443, 577 320 -> 320, 700 408 -> 430,
 *         768 487 -> 478, 1000 440 -> 475, 1536 552 -> 527;
 *         causal: 197 85 -> 119, 512 270 -> 291, 700 314 -> 321, 768 345 -> 353, 1000 352 -> 366,
 *         1024 372 -> 391, 1536 443 -> 439 (and 2048 474 -> 460-463 in another run);
 *   hd128 no mask, both guessing the row max (seventeenth session, two rounds): seqlen 1k 662 ->
 *         616-617, 2k 734-735 -> 744-745, 4k 778-779 -> 794-795, 8k 793 -> 836-837; 16k
 *         723-738 -> 785-793 (other calls). The long tiles pad 3% at 2k and 4k (11 and 22 tiles
 *         of 192 rows) and still win; at 1k they pad 11%.
 *   hd64 again (session 39, one H200, forward TFLOP/s, FA4_TILES=regular -> short, two
 *         alternations in one call): causal 1024 378-379 -> 426, 1536 455-456 -> 480-483, 2048
 *         491-494 -> 516-517, 3072 543 -> 556-560, 4096 567 -> 574-578, 8192 608-611 -> 616-620,
 *         16k 623 -> 630, 32k 602 -> 602; no mask 1024 511-512 -> 555-561, 1536 611-612 -> 590-593,
 *         2048 616 -> 611-612, 4096 647-649 -> 635-638, 8192 654-660 -> 628-641, 16k 639-644 ->
 *         607-613 (the kernels changed since the eleventh session's 1536/2048 causal losses).
 * So, automatically and never for packed GQA (decoding: the regular tiles stream the cache well):
 * - "short": causal at any length (its warpgroups skip 64-key diagonal blocks: +1% to +40% up
 *   to 16k, even at 32k); without a mask for queries up to SHORT_SEQ_MAX rows where the regular
 *   tiles pad and its tiles pad no more (at equal padding its tiles won: 700 rows +5%; without
 *   padding they lost: 768 -2%, 1536 -3%);
 * - "long" for keys from LONG_SEQ_MIN_K on whose query its taller tiles fill at least
 *   LONG_MIN_FILL as well (2048 and 4096 rows: 97%; not one decoding row: 1/192 against 1/128).
 * An override (FA4_TILES) is taken wherever that family is built. */
#define SHORT_SEQ_MAX 1024
#define LONG_SEQ_MIN_K 2048
#define LONG_MIN_FILL 0.96

int32_t fa4_tile_family(int64_t seqlen_q, int64_t seqlen_k, int32_t packed, int32_t tile_m, int32_t short_tile_m,
                        int32_t long_tile_m, int32_t override, int32_t mask_kind) {
  if (override != FA4_AUTO) {
    int32_t built = override == FA4_TILES_SHORT ? short_tile_m : override == FA4_TILES_LONG ? long_tile_m : 1;
    return built ? override : FA4_TILES_REGULAR;
  }
  if (packed > 1) return FA4_TILES_REGULAR;
  double fill = fa4_tile_fill(seqlen_q, tile_m);
  if (short_tile_m) {
    if (mask_kind == FA4_MASK_CAUSAL) return FA4_TILES_SHORT;
    if (seqlen_q <= SHORT_SEQ_MAX && fill < 1.0 && fa4_tile_fill(seqlen_q, short_tile_m) >= fill)
      return FA4_TILES_SHORT;
  }
  if (long_tile_m && seqlen_k >= LONG_SEQ_MIN_K && fa4_tile_fill(seqlen_q, long_tile_m) >= LONG_MIN_FILL * fill)
    return FA4_TILES_LONG;
  return FA4_TILES_REGULAR;
}

/* ------------------------------------------------------------------------- pack-GQA */
int32_t fa4_packable_group(int64_t group) { return group == 2 || group == 4 || group == 8 || group == 16; }

/* A packed head's share of a tile is a multiple of head_rows rows: 8 where Q is loaded in 8-row
 * pieces of one head each, fewer in the KV-cache kernels, whose pieces may span heads
 * (fa4_kv_cache_head_rows, from kv_cache.FEW_HEAD_ROWS). */
static int32_t stacks(int64_t group, int32_t tile_m, int32_t head_rows) {
  return tile_m % group == 0 && (tile_m / group) % head_rows == 0;
}

int32_t fa4_q_piece_rows(void) { return FA4_Q_PIECE_ROWS; }

#define MAX_PACK 64 /* the most heads a tile stacks: a 64-row KV-cache tile of one-row heads */

/* The largest power-of-two part of the group that stacks in tile_m rows (1: none). A part that
 * stacks halves to one that stacks, so the search stops at the first that does not divide the
 * group. */
static int32_t stacked_part(int64_t group, int32_t tile_m, int32_t head_rows) {
  int32_t part = 1;
  for (int32_t p = 2; p <= MAX_PACK && group % p == 0; p *= 2)
    if (stacks(p, tile_m, head_rows)) part = p;
  return part;
}

/* Pack-GQA puts query heads that share a K/V head into the rows of one tile (tile_m / factor rows
 * of each), so a short query (decoding: 1 row) still fills the tile and K/V are read
 * group / factor times instead of group times. Automatic choice, as FlashAttention-3: pack when
 * the unpacked tiles would be under 90% as full as the packed ones (short or ragged seqlen_q).
 * A head needs a multiple of head_rows rows of the tile (stacks), so the dense kernels' tiles
 * stack at most tile_m / 8 heads and the KV cache's 64-row ones 64. The automatic choice packs
 * the largest power-of-two part of the group that stacks, so a larger group (16:1 or MQA on the
 * dense 128-row tiles: 16) reads K/V group / part times: one K/V head's tiles then differ only in
 * their query heads. Measured (H100, bf16 hd128 KV cache, one token, 1 x 32k, CUDA-graph us):
 * 32 / 2 heads 101.3-102.6 unpacked, 19.9-20.0 by 8 of 16 (8-row heads), 16.6 by all 16 (4-row
 * heads); 64 / 1 194.3, 31.7 (8 of 64) and 17.5 (all 64). pack_gqa=True asks for the whole group in one tile: groups of 2, 4, 8 or 16 heads, where
 * the tile stacks them (else it refuses, naming the most it stacks). */
int32_t fa4_pack_gqa_factor(int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int32_t tile_m, int32_t head_rows,
                            int32_t override, int32_t *factor) {
  int64_t group = heads_q / max64(heads_kv, 1);
  int32_t divides = heads_q == group * heads_kv;
  int32_t part = divides ? stacked_part(group, tile_m, head_rows) : 1;
  *factor = 1;
  if (override == 1 && divides && fa4_packable_group(group)) {
    if (!stacks(group, tile_m, head_rows))
      return refuse("pack_gqa=True: this head_dim's %d-row tiles stack at most %d heads (in %d-row pieces), not "
                    "%lld; use pack_gqa=None or False",
                    tile_m, (int)stacked_part(16, tile_m, head_rows), head_rows, (long long)group);
    *factor = (int32_t)group;
    return 0;
  }
  if (override != FA4_AUTO || part == 1) return 0;
  seqlen_q = max64(seqlen_q, 1);
  if (fa4_tile_fill(seqlen_q, tile_m) < 0.9 * fa4_tile_fill(seqlen_q * part, tile_m)) *factor = part;
  return 0;
}

/* The tile family a packed call runs in. Forced pack_gqa=True: the regular tiles where they stack
 * the group, else a built family whose taller tiles do (hd64's 192-row tiles stack at most 8
 * heads in 8-row pieces, its 256-row "short" tiles 16), else the regular ones (whose refusal,
 * from fa4_pack_gqa_factor, then names the rule). Automatic: the family whose tiles pack the most
 * heads for this seqlen_q (hd64's 256-row tiles read K/V once for 16 decoding heads where its
 * 192-row tiles read them twice), the regular tiles on a tie. Tile sizes as in fa4_tile_family
 * (0: not built). */
int32_t fa4_packing_family(int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int32_t tile_m, int32_t short_tile_m,
                           int32_t long_tile_m, int32_t head_rows, int32_t override) {
  int64_t group = heads_q / max64(heads_kv, 1);
  if (override == 0) return FA4_TILES_REGULAR;
  if (override == 1) {
    if (!fa4_packable_group(group) || stacks(group, tile_m, head_rows)) return FA4_TILES_REGULAR;
    if (short_tile_m && stacks(group, short_tile_m, head_rows)) return FA4_TILES_SHORT;
    if (long_tile_m && stacks(group, long_tile_m, head_rows)) return FA4_TILES_LONG;
    return FA4_TILES_REGULAR;
  }
  const int32_t tiles[3] = {tile_m, short_tile_m, long_tile_m};
  const int32_t families[3] = {FA4_TILES_REGULAR, FA4_TILES_SHORT, FA4_TILES_LONG};
  int32_t best = FA4_TILES_REGULAR, most = 1;
  for (int i = 0; i < 3; ++i) {
    int32_t factor = 1;
    if (tiles[i] && fa4_pack_gqa_factor(heads_q, heads_kv, seqlen_q, tiles[i], head_rows, FA4_AUTO, &factor) == 0 &&
        factor > most)
      best = families[i], most = factor;
  }
  return best;
}

/* The KV cache's tile family (its "long" tiles: catalog.KV_CACHE_TILE_FAMILIES): the taller
 * tiles of two or three consumer warpgroups where they hold a call's rows at least
 * KV_LONG_MIN_FILL as fully as the 64-row ones, each family with its own pack-GQA factor
 * (fa4_pack_gqa_factor, pack_override as there), and keys from LONG_SEQ_MIN_K on, as for dense
 * calls (seqlen_k: the cache's capacity). A row costs the 64-row tiles' one warpgroup about 1.8x
 * what it costs the dense kernel's tiles on chunked prefill (session 64, H100, bf16 hd128, 32/8
 * heads, 2048 queries against a 32k cache, causal: 356 TFLOP/s against 651 for the dense forward
 * on the same tensors), so the taller tiles pay down to about 1 / 1.8 of the fill; the threshold
 * keeps a margin and stays above the 1/2 of every call with up to 64 rows per K/V head (decoding,
 * speculative verification), which the 64-row tiles were built for (heuristics.
 * kv_cache_fwd_config). Not measured at partial fills (docs/perf_notes.md, session 71). override
 * (FA4_TILES) as in fa4_tile_family. */
#define KV_LONG_MIN_FILL 0.75

int32_t fa4_kv_cache_tile_family(int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_k,
                                 int32_t tile_m, int32_t long_tile_m, int32_t head_rows, int32_t pack_override,
                                 int32_t override) {
  if (override != FA4_AUTO) return override == FA4_TILES_LONG && long_tile_m ? FA4_TILES_LONG : FA4_TILES_REGULAR;
  int32_t packed = 1, packed_long = 1;
  if (!long_tile_m || seqlen_k < LONG_SEQ_MIN_K ||
      fa4_pack_gqa_factor(heads_q, heads_kv, seqlen_q, tile_m, head_rows, pack_override, &packed) ||
      fa4_pack_gqa_factor(heads_q, heads_kv, seqlen_q, long_tile_m, head_rows, pack_override, &packed_long))
    return FA4_TILES_REGULAR;  /* (a refused pack_gqa=True is the caller's to report) */
  seqlen_q = max64(seqlen_q, 1);
  double fill = fa4_tile_fill(seqlen_q * packed, tile_m);
  return fa4_tile_fill(seqlen_q * packed_long, long_tile_m) >= KV_LONG_MIN_FILL * fill ? FA4_TILES_LONG
                                                                                        : FA4_TILES_REGULAR;
}

/* ------------------------------------------------------------------- tile order, grid */
/* Bytes of K/V one swizzle group of the tile order may hold in L2.
 * No mask (static schedule, equal tiles), measured on an H200 (60 MB L2), hd128 bf16, 16k
 * tokens, two repeats per budget (scripts/tune_schedule.sh), TFLOP/s:
 *   2 / 4 / 7.5 / 16 / 32 MB: 1k 553 / 550 / 525 / 485 / 516, 4k 631 / 612 / 624 / 611 / 589
 * the CTAs of one head streaming the same K/V block together wins (an L2/24 group holds one
 * hd128 head at 4k).
 * Causal/local (dynamic longest-first schedule): half the L2, in a power-of-two number of pairs
 * (fa4_heads_per_group). Measured on an H200 with groups of 16 / 32 / 64 MB of K/V (causal,
 * bf16, 16k tokens, TFLOP/s; tenth session, docs/perf_notes.md): hd128 1k 514 / 507 / 431, 4k
 * 694 / 695 / 666; hd256 1k 518 / 518 / 474, 4k 745 / 744 / 728; 44-48 MB groups lost 1-11%
 * against 16-32 MB ones. */
int64_t fa4_l2_swizzle_budget(int64_t l2_bytes, int32_t mask_kind) {
  return mask_kind == FA4_MASK_NONE ? l2_bytes / 24 : l2_bytes / 2;
}

/* Fewest (head, batch) pairs per group for the dynamic longest-first schedule to end evenly.
 * A causal group's tiles run from num_m_blocks K/V blocks long down to 1, and its longest tiles
 * start when the group does; the last group's longest tiles must be short next to its work per
 * SM, or they run on alone after the other SMs ran dry. Simulated (tests/fa4_kernels/
 * test_tile_scheduler.py, tiles as K/V blocks plus the boundary cost): at least
 * num_sms / (num_m_blocks + 1) pairs (half a longest tile of work per SM in the last group)
 * keeps the busiest SM within 1.5% of the average wherever there are 16+ tiles per SM. In the
 * benchmark shapes the L2 groups are at least this large but for hd256 at 8k and 16k (2 and 1
 * pairs fit L2/2; 3 and 2 wanted). */
int64_t fa4_balance_heads(int64_t num_m_blocks, int32_t num_sms) {
  return max64(1, ceil_div(num_sms, num_m_blocks + 1));
}

static int64_t floor_pow2(int64_t x) {
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

static int64_t ceil_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

/* How many (head, batch) pairs one L2-swizzle group of the tile order holds (>= 1): the
 * budget's worth of K/V; with a mask (dynamic schedule, tiles of unequal length) a power of two
 * of them (as FlashAttention-3; groups that divide the pairs evenly balance better), and at
 * least fa4_balance_heads rounded up to a power of two. An explicit budget (FA4_L2_SWIZZLE_MB)
 * is taken as it is. The kernel's last group also takes the pairs left over. */
int32_t fa4_heads_per_group(int64_t l2_bytes, int64_t seqlen_k, int32_t head_dim, int32_t head_dim_v,
                            int32_t elem_bytes, int64_t num_heads_batches, int64_t budget_bytes, int32_t mask_kind,
                            int64_t num_m_blocks, int32_t num_sms) {
  int64_t kv_bytes_per_head = max64(1, seqlen_k * (head_dim + head_dim_v) * elem_bytes);
  int64_t budget = budget_bytes < 0 ? fa4_l2_swizzle_budget(l2_bytes, mask_kind) : budget_bytes;
  int64_t heads = max64(1, budget / kv_bytes_per_head);
  if (budget_bytes < 0 && mask_kind != FA4_MASK_NONE) {
    heads = floor_pow2(heads);
    if (num_m_blocks > 0 && num_sms > 0) heads = max64(heads, ceil_pow2(fa4_balance_heads(num_m_blocks, num_sms)));
  }
  return (int32_t)max64(1, min64(num_heads_batches, heads));
}

/* CTAs to launch at most: num_sms makes the kernel persistent (each CTA loops over tiles; the
 * next tile's loads overlap the current epilogue), a huge value one CTA per tile. Persistent in
 * all cases: without a mask tiles are equal and the static order is balanced (hd128, H200: 528
 * vs 474 TFLOP/s at 1k, 585-605 vs 550 at 4k); with causal/local masks the kernel claims tiles
 * dynamically from a global counter, so long and short tiles balance. */
int32_t fa4_grid_size(int32_t num_sms, int32_t mask_kind, int32_t persistent_override) {
  (void)mask_kind;
  return persistent_override == 0 ? 0x7fffffff : num_sms;
}

/* ------------------------------------------------------------------------- KV cache */
/* Rows per page of a KV cache (kv_cache.py). The kernel loads 16-row TMA boxes, each inside one
 * page, and finds a row's page by a shift: a page holds a power-of-two multiple of 16 rows, or
 * any multiple of 16 when each sequence has one page (a contiguous cache: its seqlen, padded).
 * Run-time divisions by the page size spilled the 24-register producer of the hd192/hd256
 * variants (integer, unsigned or fp32 reciprocal alike), so other page sizes go through
 * fa4_kv_kernel_page_rows. Returns 0, or 1 with fa4_rules_error() naming the argument. */
#define KV_BOX_ROWS 16
int32_t fa4_kv_page_size(int64_t page_size, int64_t pages_per_sequence) {
  if (page_size < KV_BOX_ROWS || page_size % KV_BOX_ROWS != 0) {
    if (pages_per_sequence < 0)
      return refuse("a contiguous cache's seqlen (k_cache.shape[1] = %lld) must be a multiple of %d: pad the cache",
                    (long long)page_size, KV_BOX_ROWS);
    return refuse("a paged cache's page_size (k_cache.shape[1] = %lld) must be a multiple of %d",
                  (long long)page_size, KV_BOX_ROWS);
  }
  if (pages_per_sequence > 1 && (page_size & (page_size - 1)))
    return refuse("fa4::fwd_kvcache reads pages of a power-of-two size (k_cache.shape[1] = %lld): call "
                  "fa4.attention_with_kvcache, which reads other multiples of %d as %d-row pages",
                  (long long)page_size, KV_BOX_ROWS, KV_BOX_ROWS);
  return 0;
}

/* The page size the kernel reads a paged cache of page_size rows with (a multiple of 16): the
 * page itself when a power of two, else its 16-row boxes as pages of their own (the caller
 * views the cache as (num_pages * page_size / 16, 16, ...) and expands each page id p of the
 * table into p * page_size / 16 + 0 .. page_size / 16 - 1; a small elementwise op per call). */
int64_t fa4_kv_kernel_page_rows(int64_t page_size) {
  return (page_size & (page_size - 1)) ? KV_BOX_ROWS : page_size;
}

/* ------------------------------------------------------------------------- split tail */
/* Pieces of a split tile are at least MIN_PIECE_BLOCKS K/V blocks long, or one block where the
 * tile holds at most FEW_LIVE_ROWS query rows, whose partials (rows x head_dim_v fp32) cost the
 * merge little. H100, scripts/decode_splits.py (CUDA-graph us a call, bf16 hd128, two rounds
 * within 0.1 us, session 65), two-block pieces -> one-block ones: 4 live rows (32 / 8 heads) at
 * 1 x 2k, 64 -> 128 CTAs, 9.40-9.56 -> 8.40-8.47; 16 rows (32 / 2) at 1 x 4k, 32 -> 64 CTAs,
 * 9.18-9.20 -> 8.09-8.14, at 1 x 8k, 64 -> 128, 9.55 -> 9.16; but 64 rows (64 / 1) at 1 x 8k,
 * 32 -> 64 CTAs, 10.55 -> 11.48. */
#define MIN_PIECE_BLOCKS 2
#define FEW_LIVE_ROWS 16
/* and a tile has at most MAX_PIECES_PER_TILE of them: the merge folds every piece's partial rows,
 * so its cost grows with the pieces of a tile while their K/V shares shrink. Measured on an H100
 * (`python -m fa4.bench --sweep --sweep-only decode`, CUDA-graph time, bf16 hd128 KV cache, one
 * token; session 58), one or two tiles over the whole grid against 64 pieces a tile: 64 / 1 heads
 * (one tile, 64 live rows) at 1 x 32k 10.9% and at 1 x 128k 9.3% slower with 128-132 pieces;
 * 32 / 2 (two tiles) with 66 pieces each 2.3% and 1.4% slower than with 64. Every row with more
 * tiles (16 pieces a tile or fewer) was fastest at the rule's count. */
#define MAX_PIECES_PER_TILE 64

/* K/V blocks' worth of time a piece of a split tile costs beyond its own blocks: it loads its
 * own Q, its first Q @ K^T and last P @ V have no partner GEMM to overlap, and its partial
 * result (tile_m x head_dim_v fp32) goes to L2 and back while the merger waits. Measured on an
 * H200 (bf16, 16k tokens, split on vs off, same runs): with 2 blocks assumed, hd128 at 1k (8
 * blocks a tile, 5 a piece) lost 1% and hd256 at 1k (13 a tile, 10 a piece) 1-3%, while the
 * 4k/16k splits gained 1-3%; so 3 blocks, and 5 for the wide partials of head_dim_v > 128. */
int32_t fa4_split_overhead_blocks(int32_t head_dim_v) { return head_dim_v <= 128 ? 3 : 5; }

/* Where the grid holds two pieces or more per tile, a multiple of the tiles, unless that makes a
 * piece more than 5% (and more than one block) longer: CTAs take equal shares of the round's
 * blocks, so any other count leaves shares straddling two tiles, which cost more than the few
 * SMs the rounding leaves idle. H100, three runs of `python -m fa4.bench --sweep` (CUDA-graph
 * time, decoding hd128 32/8, 132 -> 128 CTAs): 8 x 4k (pieces of 16 blocks either way) 3.4-4.4%
 * faster, 1 x 32k (16 either way) 1.1-2.5%, 8 x 32k (125 -> 128 blocks) 1.6-2.0%. Longer pieces
 * than that are not measured: there the share decides. */
static int32_t whole_pieces(int64_t ctas, int64_t tail, int64_t n_blocks) {
  if (ctas < 2 * tail || ctas % tail == 0) return (int32_t)ctas;
  int64_t aligned = ctas - ctas % tail;
  int64_t straddling_share = ceil_div(tail * n_blocks, ctas), aligned_share = ceil_div(n_blocks, aligned / tail);
  int close = aligned_share <= straddling_share + 1 || aligned_share * 20 <= straddling_share * 21;
  return (int32_t)(close ? aligned : ctas);
}

/* CTAs to split the static schedule's last round of tiles over (0: no split). Equal tiles on a
 * persistent grid take ceil(num_tiles / num_sms) rounds, the last one only partly filled (hd128
 * in the FlashAttention benchmark setup: 2048 tiles on 132 SMs leave 68 tiles for round 16,
 * while 64 SMs idle). Cutting those tiles into pieces of K/V blocks dealt out over all SMs
 * shortens that round from n_blocks to about tail * n_blocks / num_sms blocks plus
 * fa4_split_overhead_blocks. With fewer tiles than SMs (small batches, decoding) every tile is
 * split this way. override 0 never splits, 1 splits whenever pieces can outnumber the tiles. */
int32_t fa4_split_tail_ctas(int64_t num_tiles, int32_t num_sms, int64_t n_blocks, int32_t head_dim_v,
                            int32_t live_rows, int32_t override) {
  int64_t tail = num_tiles % num_sms; /* all of them when there are fewer tiles than SMs */
  int64_t min_piece = live_rows <= FEW_LIVE_ROWS ? 1 : MIN_PIECE_BLOCKS;
  if (override == 0 || tail == 0 || n_blocks < min_piece) return 0;
  int64_t units = tail * n_blocks;
  int64_t ctas = min64(min64(num_sms, units / min_piece), tail * MAX_PIECES_PER_TILE);
  if (ctas <= tail) return 0; /* no more pieces than tiles: nothing to gain */
  if (override == FA4_AUTO && ceil_div(units, ctas) + fa4_split_overhead_blocks(head_dim_v) >= n_blocks) return 0;
  return whole_pieces(ctas, tail, n_blocks);
}

/* CTAs to split the last round over when the caller asks for num_splits pieces per tile
 * (attention_with_kvcache's num_splits; 0 leaves it to fa4_split_tail_ctas): each of the round's
 * tiles cut into num_splits pieces of about n_blocks / num_splits blocks, one CTA a piece, as far
 * as the persistent grid (num_sms CTAs) and one block a piece go, in whole pieces per tile where
 * the grid caps them (whole_pieces); 1 never splits. The CTAs take equal shares of the round's
 * blocks, so a tile's pieces are num_splits, or num_splits + 1 where a share straddles two tiles. */
int32_t fa4_split_ctas_for(int64_t num_tiles, int32_t num_sms, int64_t n_blocks, int64_t num_splits) {
  int64_t tail = num_tiles % num_sms;
  if (num_splits <= 1 || tail == 0) return 0;
  int64_t ctas = min64(min64(num_sms, tail * num_splits), tail * n_blocks);
  return ctas > tail ? whole_pieces(ctas, tail, n_blocks) : 0;
}

/* --------------------------------------------------------------------------- backward */
/* sum of i + c for x <= i <= y */
static int64_t linear_sum(int64_t x, int64_t y, int64_t c) {
  return y >= x ? (y - x + 1) * (x + y) / 2 + c * (y - x + 1) : 0;
}

/* Keys a query row sees on average under a bottom-right aligned mask, in closed form: row i sees
 * keys max(0, i + b) .. min(seqlen_k - 1, i + a), a = offset + right, b = offset - left; rows
 * with i + a < 0 see none, every other row one at least. */
double fa4_mean_visible_keys(int64_t seqlen_q, int64_t seqlen_k, fa4_mask mask) {
  if (mask.kind == FA4_MASK_NONE || seqlen_q <= 0) return (double)seqlen_k;
  int64_t offset = seqlen_k - seqlen_q;
  int64_t a = offset + mask.window_right, b = offset - mask.window_left;
  int64_t lo = max64(0, -a), hi = seqlen_q - 1;
  if (lo > hi) return 0.0;
  int64_t last = min64(hi, seqlen_k - 1 - a); /* rows up to here end at i + a, later ones at the last key */
  int64_t ends = linear_sum(lo, last, a) + (seqlen_k - 1) * max64(0, hi - max64(lo, last + 1) + 1);
  int64_t starts = linear_sum(max64(lo, -b), hi, b); /* rows from -b on start at i + b, earlier at key 0 */
  return (double)(ends - starts + hi - lo + 1) / (double)seqlen_q;
}

/* The backward's first-store claims count in a counter's high 16 bits (sm90/bwd.py, DQ_CLAIM). */
#define MAX_FIRST_STORE_BLOCKS (1 << 15)
const int32_t fa4_rule_max_first_store_blocks = MAX_FIRST_STORE_BLOCKS;
/* K/V blocks per query block (mean visible keys / tile_n) up to which the first store pays. */
#define STORE_FIRST_MAX_BLOCKS 48

/* Whether the backward's first K/V block to reach a query block stores its dQ into the fp32
 * accumulator instead of adding to zeros (sm90/bwd.py): the preprocess then zeroes only the rows
 * that see no key (fa4_keyless_rows), not the whole accumulator (4 bytes per dQ element: 45 us
 * of 16k tokens of hidden 2048 on an H100). It costs each K/V block's visit to a query block a
 * claim (an atomic issued a block ahead), so it pays where a query block has few K/V blocks.
 * Measured (H100, bf16 16k tokens, fwd+bwd, 4 rotated rounds, on/off; K/V blocks per query
 * block in brackets): hd128 1k +2.0% (8), causal +9.5% (4), 4k +0.7% (32), causal +2.7% (16),
 * 16k -2.9% (128), causal -1.0% (64), a 1024-key window at 16k +3.8% (9); hd64 1k +3.4%,
 * causal +6.0%, 4k +1.1%, causal +1.9%, 16k -2.6% (128); hd256 (64-key blocks) 1k +3.9% (16),
 * causal +10.3% (8), 4k +0.3% (64), causal +1.0% (32), 16k -1.7% (256), causal -1.5% (128).
 * Packed sequences too (their blocks per query block estimated from the longest sequence; the
 * preprocess zeroes what the first stores leave: each sequence's keyless rows and partial last
 * query block, the rows outside every sequence). 8 random causal documents in 16k tokens, hd128,
 * H100, fwd+bwd per step: the memsets of the accumulator, dK and dV were 4.6% of it, and dense
 * causal 2k (the documents' scale) gains 4.6% from the first stores (1k 8.8%, 4k 2.4%).
 * override 0 never, 1 wherever it can run. */
int32_t fa4_bwd_store_first(int64_t num_n_blocks, double blocks_per_query_block, int32_t override) {
  if (override == 0 || num_n_blocks >= MAX_FIRST_STORE_BLOCKS) return 0;
  return override == 1 || blocks_per_query_block <= STORE_FIRST_MAX_BLOCKS;
}

/* The backward's rotation (sm90/bwd.py, dq_order.py): 0 for none, else its period, the K/V blocks
 * of a chunk starting on query blocks of their own (no mask). Default mode: with store_first the
 * blocks of a head would otherwise reach each query block together and wait for its first store
 * (H100, bf16 16k tokens, fwd+bwd, store_first without -> with rotation: hd128 1k +2.1%, 4k
 * +2.9%, 16k +2.7%; hd256 1k +4%, 4k +2.4%). On its own it measured -1.3% to +1.4% (hd128 1k
 * -1.3%, 16k -1.8%; hd256 +1.1-1.4%), so it goes with store_first; one chunk of all the blocks.
 * Deterministic mode: the turns follow the rotation's arrival order instead of the K/V-block
 * order, where block n waits n turns before its first addition. A CTA may then wait for a later
 * CTA of its chunk, so a chunk must fit the GPU at once (at most num_sms blocks: one resident CTA
 * per SM is the least any backward variant gets). Measured (H200, bf16 16k tokens, fwd+bwd
 * TFLOP/s without a mask, ascending -> rotated turns, same run): tile_m = tile_n kernels gain
 * where a head's blocks fit the GPU: hd64 (128 x 128) 1k 383 -> 437, 4k 469 -> 535, 16k 544 ->
 * 553; hd256 (64 x 64) 1k 320 -> 375, 4k 392 -> 422; hd192 1k 292 -> 345, 4k 351 -> 394. hd128's
 * 64 x 128 blocks lose (1k 468 -> 465, 4k 573 -> 561, 16k 613 -> 573; not understood: twice the
 * query blocks per K/V block, so the arrivals at a query block are two steps apart), and chunks
 * of a head too long for the GPU lose (16k: hd256 452 -> 431, hd192 405 -> 403): a chunk's first
 * CTAs to launch wait for ones still queued behind the previous head. override 0 never, 1 in
 * every unmasked call (chunks of num_sms).
 * spacing (deterministic, FA4_BWD_TURN_SPACING): the chunk cut into this many chunks, which
 * fa4_bwd_launch_group then launches chunk by chunk over several pairs. A chunk of size blocks
 * starts them m_blocks / size query blocks apart, so a query block's visitors come `spacing`
 * steps apart instead of one: session 49's bound on rotated turns (a hand-over per step, ~1.35
 * steps long at hd192) becomes a hand-over per `spacing` steps (fa4_bwd_turn_spacing: with two dQ
 * writers; alone, one writer per CTA still took a block per hand-over, and 2 chunks measured slower,
 * session 53: H100 hd192 4k 0.796 -> 0.781 of the default mode, hd256 1k 0.885 -> 0.815).
 * spacing: FA4_AUTO (1) or the chunks. */
int32_t fa4_bwd_rotate(int32_t mask_kind, int32_t deterministic, int32_t store_first, int64_t num_n_blocks,
                       int32_t num_sms, int32_t tile_m, int32_t tile_n, int32_t override, int32_t spacing) {
  if (mask_kind != FA4_MASK_NONE || override == 0 || num_n_blocks <= 0) return 0;
  if (deterministic) {
    if (num_sms <= 0) return 0;
    int64_t chunk = 0;
    if (override == 1) chunk = min64(num_n_blocks, num_sms);
    else if (num_n_blocks <= num_sms && tile_m == tile_n) chunk = num_n_blocks;
    int64_t parts = spacing == FA4_AUTO ? 1 : max64(1, spacing);
    return (int32_t)ceil_div(chunk, parts);
  }
  return (override == 1 || store_first) ? (int32_t)num_n_blocks : 0;
}

/* The causal backward's launch order (sm90/bwd.py; its window kernel serves causal calls): K/V
 * block n visits the query blocks from n on, so the low blocks are the long CTAs, and in the grid's
 * order (each (batch, head) pair's blocks, longest first, one pair after another) the last pairs'
 * longest blocks start in the last wave. In groups of this many pairs block n of every pair of a
 * group goes before block n + 1. Measured (H100, bf16 16k tokens, fa4.bench --backward, causal,
 * fwd+bwd TFLOP/s, two rounds, grid's order -> groups of 4 / 8 / 16): GQA 32/8 heads at 4 x 4k
 * 519-525 -> 563-570 / 540-541 / 525 (MHA 32/32 at equal FLOPs 549-560 -> 562-564 / 541-558 /
 * 559); hd128 1k 374-376 -> 376 / 375-376 / 374, 4k 558 -> 567-576 / 576-580 / 569, 16k 611-615
 * -> 607-609 / 609-615 / 595; hd256 4k 454-455 -> 459-461 / 450-451 / 424, 16k 507 -> 506-511 /
 * 496-500 / 494; hd64 within 2% either way. Every pair at once (no groups): hd128 4k 336 (the
 * CTAs then share no Q/dO in L2). Packed sequences keep the grid's order: their pairs differ in
 * length (groups of 8: 8 documents -1 to -2%); so do windows (their blocks' visits are about
 * equal) and deterministic causal calls (their dQ turns follow the grid's order). override:
 * FA4_AUTO, else the group size (0: the grid's order) for every causal call of a dense batch.
 * Unmasked deterministic calls of a dense batch whose rotation (rotate: its period) cuts a head's
 * num_n_blocks blocks into several chunks (fa4_bwd_rotate's spacing) launch in groups too, so
 * that chunk 0 of every pair of a group runs before chunk 1: as many pairs as keep a chunk of each
 * within the SMs at once (num_sms / rotate, at most override), since a turn may wait for a later
 * CTA of its chunk (dq_order.py), and none where fewer than 2 fit. The last group also takes the
 * pairs left over (tile_scheduler.py: up to 2 * group - 1 of the call's `pairs`, batch * K/V
 * heads), and must fit as well: a chunk spread over more CTAs than the SMs can deadlock
 * (tests/fa4_kernels/test_dq_order.py). */
#define BWD_CAUSAL_LAUNCH_GROUP 4

int32_t fa4_bwd_launch_group(int32_t mask_kind, int32_t varlen, int32_t deterministic, int32_t rotate,
                             int64_t num_n_blocks, int64_t pairs, int32_t num_sms, int32_t override) {
  if (varlen) return 0;
  if (mask_kind == FA4_MASK_NONE && deterministic) {
    if (rotate <= 0 || rotate >= num_n_blocks || num_sms <= 0 || pairs <= 0) return 0;
    int64_t group = num_sms / rotate;
    if (override != FA4_AUTO) group = min64(override, group);
    while (group >= 2 && pairs > group && (group + pairs % group) * rotate > num_sms) group--;
    return group >= 2 ? (int32_t)group : 0;
  }
  if (mask_kind != FA4_MASK_CAUSAL || deterministic) return 0;
  return override == FA4_AUTO ? BWD_CAUSAL_LAUNCH_GROUP : override;
}

/* The backward kernel's deterministic argument: 0 (dQ added in any order), 1 (deterministic turns,
 * one dQ writer warp) or 2 (the same with two writer warps taking a CTA's query blocks
 * alternately, sm90/bwd.py write_dq's pair: one block's reduce-adds land, and its turn passes,
 * while the other warp waits for the next block's turn and issues its adds). "keys_roles"
 * variants of dense batches only (roles: hd192x128, hd192, hd256); the "keys" kernels and packed
 * sequences (whose writer spilled with two) take 2 as 1.
 * Measured (session 54, one H100, bf16 16k tokens of hidden 2048, scripts/bwd_ab.py, fwd+bwd,
 * deterministic / default, one writer -> two):
 *  - rotated turns (no mask, a head's blocks within num_sms), with the rotation cut into 2 chunks
 *    (fa4_bwd_turn_spacing): hd192 1k 0.842 -> 0.952, 4k 0.781 -> 0.976; hd256 1k 0.885 -> 0.897,
 *    2k 0.871 -> 0.952, 4k 0.831 -> 0.912, 8k 0.844 -> 0.918. Two writers without the chunks gain
 *    little (hd192 4k 0.831, hd256 4k 0.830), and the chunks with one writer lost (session 53):
 *    a turn's hand-over then has two steps, and each writer two steps per block;
 *  - turns in launch order, a head's blocks between num_sms and twice that (16k): hd192 0.804 ->
 *    0.950, causal 0.803 -> 0.948, hd256 causal 0.765 -> 0.799, but hd256 without a mask 0.903
 *    -> 0.809 (its dQ goes out through the Q/dO stage, which two writers hand back before the
 *    landing: session 47 measured that hand-back 4% slower at hd256);
 *  - lost elsewhere: causal 1k-4k (hd192 0.869 -> 0.802 at 1k, 0.921 -> 0.860 at 4k; hd256 0.922
 *    -> 0.879, 0.872 -> 0.817), hd256 causal 8k 0.843 -> 0.804, 32k (hd192 0.817 -> 0.727; hd256
 *    0.884 -> 0.563), where the second writer gives up the next turn's early look (write_dq).
 * override: FA4_AUTO or the writers (FA4_BWD_DQ_WRITERS). */
int32_t fa4_bwd_dq_writers(int32_t deterministic, int32_t varlen, int32_t mask_kind, int32_t head_dim,
                           int64_t num_n_blocks, int32_t num_sms, int32_t override) {
  if (!deterministic) return 0;
  if (override != FA4_AUTO) return override;
  /* The "keys_roles" layout is the one of head dims above 128 (fa4_kernels.heuristics). */
  const int32_t roles = head_dim > 128;
  if (!roles || varlen || num_sms <= 0) return 1;
  if (mask_kind == FA4_MASK_NONE && num_n_blocks <= num_sms) return 2;
  int32_t long_chain = num_n_blocks > num_sms && num_n_blocks <= 2 * (int64_t)num_sms;
  if (long_chain && (mask_kind == FA4_MASK_CAUSAL || (mask_kind == FA4_MASK_NONE && head_dim <= 192))) return 2;
  return 1;
}

/* The chunks a deterministic call's rotation is cut into (fa4_bwd_rotate's spacing): 2 where two dQ
 * writers take the turns (fa4_bwd_dq_writers: each writer then has two steps per block, as each
 * hand-over does), else 1; override: FA4_AUTO or the chunks (FA4_BWD_TURN_SPACING). */
int32_t fa4_bwd_turn_spacing(int32_t writers, int32_t override) {
  if (override != FA4_AUTO) return override;
  return writers == 2 ? 2 : 1;
}

/* The backward's "long" family (hd256: 2-CTA clusters sharing each Q/dO tile,
 * fa4_kernels.heuristics.BwdConfig.cluster_n; built as the window kernel, which serves causal
 * calls): only where FA4_BWD_CLUSTERS=1 forces it; never with deterministic turns (the pair walks
 * one query order) nor for packed sequences. Session 39 picked it for causal calls from 8192 keys
 * on after measuring an H200 (bf16 16k tokens, hidden 2048, fwd+bwd TFLOP/s, scripts/bwd_ab.py,
 * 1 CTA -> clusters: causal 4k 0.95-0.96, 8k 1.00-1.01, 16k 1.03, 32k 1.03-1.04). Session 52, the
 * same command and build on both kinds: H200 causal 8k 516 -> 518 (1.00), 16k 527 -> 549 (1.04),
 * 32k 527 -> 534 (1.01); H100 causal 16k 526 -> 455 (0.87, and 469 against 1-CTA rows of 516-518
 * in the sessions before clusters). A 13% loss on the more common part against a
 * 1-4% gain on the other: off by default until the H100's loss is understood. override: FA4_AUTO
 * (never), 0 (never) or 1 (wherever built, windows too). A rule by mask or length, should one come
 * back, takes those as parameters again (session 39's took both). */
int32_t fa4_bwd_tile_family(int32_t varlen, int32_t deterministic, int32_t long_built, int32_t override) {
  return long_built && !varlen && !deterministic && override == 1 ? FA4_TILES_LONG : FA4_TILES_REGULAR;
}

/* Whether a clustered launch is worth making where the device holds active_clusters clusters of
 * cluster_size CTAs at once (cudaOccupancyMaxActiveClusters for the launch's configuration; the
 * clustered kernels run one CTA per SM): not where none fits (another context holds SMs, or a
 * GPC's SMs are partly taken), nor where the clusters would leave more than
 * CLUSTER_IDLE_SMS_PERCENT of the SMs idle, which costs about what the clusters gain
 * (fa4_bwd_tile_family's H200 measurements: 0-6%). An idle H200 holds 66 of the hd256 kernel's
 * clusters of 2: all 132 SMs. */
#define CLUSTER_IDLE_SMS_PERCENT 4
int32_t fa4_clusters_fit(int32_t active_clusters, int32_t cluster_size, int32_t num_sms) {
  if (active_clusters <= 0 || cluster_size <= 0 || num_sms <= 0) return 0;
  return (int64_t)active_clusters * cluster_size * 100 >= (int64_t)num_sms * (100 - CLUSTER_IDLE_SMS_PERCENT);
}

/* Query rows, from row 0, that see no key: with the bottom-right alignment row i's last key is
 * i + seqlen_k - seqlen_q + window_right, so the first seqlen_q - seqlen_k - window_right rows
 * see none (none without a right bound: unmasked and local windows reaching past it). */
int64_t fa4_keyless_rows(int64_t seqlen_q, int64_t seqlen_k, fa4_mask mask) {
  return min64(seqlen_q, max64(0, seqlen_q - seqlen_k - mask.window_right));
}

int64_t fa4_stats_rows(int64_t total_q, int32_t block, int64_t num_seqs) {
  int64_t blocks = ceil_div(total_q, block);
  return (num_seqs < 0 ? blocks : blocks + num_seqs + 1) * block;
}

/* --------------------------------------------------------------------------- settings */
extern char **environ;

/* The value of FA4_<suffix> in one scan of the environment (the operators read the tuning
 * settings on every call: one pass over environ instead of a getenv per setting). */
typedef struct {
  const char *l2_swizzle_mb, *persistent, *tiles, *split_tail, *bwd_store_first, *bwd_rotate, *bwd_launch_group,
      *bwd_clusters, *bwd_turn_spacing, *bwd_dq_writers, *trace, *trace_schedule;
} tuning_text;

static void scan_environment(tuning_text *out) {
  memset(out, 0, sizeof(*out));
  static const struct {
    const char *name;
    size_t offset;
  } names[] = {
      {"L2_SWIZZLE_MB=", offsetof(tuning_text, l2_swizzle_mb)}, {"PERSISTENT=", offsetof(tuning_text, persistent)},
      {"TILES=", offsetof(tuning_text, tiles)}, {"SPLIT_TAIL=", offsetof(tuning_text, split_tail)},
      {"BWD_STORE_FIRST=", offsetof(tuning_text, bwd_store_first)},
      {"BWD_ROTATE=", offsetof(tuning_text, bwd_rotate)},
      {"BWD_LAUNCH_GROUP=", offsetof(tuning_text, bwd_launch_group)},
      {"BWD_CLUSTERS=", offsetof(tuning_text, bwd_clusters)},
      {"BWD_TURN_SPACING=", offsetof(tuning_text, bwd_turn_spacing)},
      {"BWD_DQ_WRITERS=", offsetof(tuning_text, bwd_dq_writers)}, {"TRACE=", offsetof(tuning_text, trace)},
      {"TRACE_SCHEDULE=", offsetof(tuning_text, trace_schedule)},
  };
  for (char **entry = environ; entry && *entry; entry++) {
    const char *e = *entry;
    if (e[0] != 'F' || e[1] != 'A' || e[2] != '4' || e[3] != '_') continue;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
      size_t n = strlen(names[i].name);
      if (strncmp(e + 4, names[i].name, n) == 0) *(const char **)((char *)out + names[i].offset) = e + 4 + n;
    }
  }
}

static int32_t read_switch(const char *value) {
  return (value == NULL || value[0] == '\0') ? FA4_AUTO : strcmp(value, "1") == 0;
}

/* A whole number of `unit` in [lo, hi] into *out (FA4_AUTO when unset or empty); 1 (fa4_rules_error())
 * for anything else. */
static int32_t read_count(const char *value, const char *name, const char *unit, long lo, long hi, int32_t *out) {
  *out = FA4_AUTO;
  if (value == NULL || value[0] == '\0') return 0;
  char *end;
  long parsed = strtol(value, &end, 10);
  if (*end != '\0' || parsed < lo || parsed > hi)
    return refuse("%s must be a number of %s from %ld to %ld; got '%s'", name, unit, lo, hi, value);
  *out = (int32_t)parsed;
  return 0;
}

int32_t fa4_read_tuning(fa4_tuning *out) {
  tuning_text text;
  scan_environment(&text);
  const char *mb = text.l2_swizzle_mb;
  out->l2_swizzle_bytes = -1;
  if (mb != NULL && mb[0] != '\0') {
    char *end;
    double value = strtod(mb, &end);
    if (*end != '\0' || value < 0) return refuse("FA4_L2_SWIZZLE_MB must be a number of MB >= 0; got '%s'", mb);
    out->l2_swizzle_bytes = (int64_t)(value * (double)(1 << 20));
  }
  out->persistent = read_switch(text.persistent);
  out->split_tail = read_switch(text.split_tail);
  out->bwd_store_first = read_switch(text.bwd_store_first);
  out->bwd_rotate = read_switch(text.bwd_rotate);
  out->bwd_clusters = read_switch(text.bwd_clusters);
  if (read_count(text.bwd_launch_group, "FA4_BWD_LAUNCH_GROUP", "(batch, head) pairs", 0, 1024,
                 &out->bwd_launch_group) ||
      read_count(text.bwd_turn_spacing, "FA4_BWD_TURN_SPACING", "chunks", 1, 16, &out->bwd_turn_spacing) ||
      read_count(text.bwd_dq_writers, "FA4_BWD_DQ_WRITERS", "warps", 1, 2, &out->bwd_dq_writers))
    return 1;
  const char *tiles = text.tiles;
  out->tiles = FA4_AUTO;
  if (tiles != NULL && tiles[0] != '\0') {
    static const char *families[] = {"regular", "short", "long"};
    for (int32_t i = 0; i < 3; i++)
      if (strcmp(tiles, families[i]) == 0) out->tiles = i;
    if (out->tiles == FA4_AUTO) return refuse("FA4_TILES must be one of regular, short, long; got '%s'", tiles);
  }
  out->trace_path = (text.trace != NULL && text.trace[0] != '\0') ? text.trace : NULL;
  const char *schedule = text.trace_schedule;
  out->trace_schedule = FA4_AUTO;
  if (schedule != NULL && schedule[0] != '\0') {
    if (strcmp(schedule, "static") == 0) out->trace_schedule = 1;
    else if (strcmp(schedule, "dynamic") == 0) out->trace_schedule = 0;
    else return refuse("FA4_TRACE_SCHEDULE must be static or dynamic; got '%s'", schedule);
  }
  return 0;
}
