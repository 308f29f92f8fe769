// Traced forward launches (FA4_TRACE; src/fa4_kernels/trace.py): where a trace variant's records
// go in its semaphores vector, and how one launch's records are appended to the trace file that
// `python -m fa4.trace` reads (one JSON object per line).
#ifndef FA4_TRACE_H
#define FA4_TRACE_H

#include <cstdint>
#include <string>
#include <vector>

// What the renderer needs to know about one traced launch besides its records.
struct TraceCall {
  std::string op, variant, mask, device_name;
  int device = 0, num_sms = 0, grid = 0, tail_ctas = 0, pack_gqa = 1, tile_m = 0, tile_n = 0;
  bool dynamic = false, dealt = false, varlen = false;
  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  std::vector<int32_t> cu_seqlens_q;  // packed calls: the sequences' offsets
};

// The layout of a traced launch's semaphores vector: the scheduler's `scheduler_words`, then
// `capacity` records from the returned base word. `words` receives the vector's length.
int64_t trace_record_base(int64_t scheduler_words, int64_t capacity, int64_t *words);

// The header words to write at the start of the zeroed vector (index -> value pairs).
std::vector<std::pair<int32_t, int32_t>> trace_header(int64_t base, int64_t capacity, bool deal_round_robin);

// How many records the launch claimed (word fa4_trace_header[0] of `head`, the vector's first words).
int64_t trace_claimed(const int32_t *head);

// Append one launch to `path`: `records` holds min(claimed, capacity) records. Returns "" or
// what went wrong.
std::string trace_append(const char *path, const TraceCall &call, const int32_t *records, int64_t claimed,
                         int64_t capacity);

// A line saying that a call ran untraced, and why.
std::string trace_note_untraced(const char *path, const std::string &op, const std::string &variant,
                                const std::string &reason);

#endif
