// Traced forward launches: layout of the records and the trace file's lines (fa4_trace.h).
#include "fa4_trace.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <sstream>

#include "fa4_variant_table.h"

namespace {

std::string quoted(const std::string &s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if ((unsigned char)c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// "a,b,c" -> ["a", "b", "c"]
std::string name_list(const char *csv) {
  std::string out = "[", item;
  std::istringstream in(csv);
  while (std::getline(in, item, ',')) out += (out.size() > 1 ? ", " : "") + quoted(item);
  return out + "]";
}

// "a=1,b=2" -> {"a": 1, "b": 2}
std::string flag_map(const char *csv) {
  std::string out = "{", item;
  std::istringstream in(csv);
  while (std::getline(in, item, ',')) {
    size_t eq = item.find('=');
    out += (out.size() > 1 ? ", " : "") + quoted(item.substr(0, eq)) + ": " + item.substr(eq + 1);
  }
  return out + "}";
}

std::atomic<int64_t> call_count{0};

std::string append_line(const char *path, const std::string &line) {
  static std::mutex lock;  // lines from several threads stay whole
  std::lock_guard<std::mutex> guard(lock);
  FILE *f = std::fopen(path, "a");
  if (f == nullptr) return std::string("cannot open FA4_TRACE file '") + path + "' for appending";
  bool ok = std::fwrite(line.data(), 1, line.size(), f) == line.size();
  ok = (std::fclose(f) == 0) && ok;
  return ok ? "" : std::string("writing FA4_TRACE file '") + path + "' failed";
}

}  // namespace

int64_t trace_record_base(int64_t scheduler_words, int64_t capacity, int64_t *words) {
  int64_t base = (scheduler_words + 15) / 16 * 16;
  *words = base + capacity * fa4_trace_record_words;
  return base;
}

std::vector<std::pair<int32_t, int32_t>> trace_header(int64_t base, int64_t capacity, bool deal_round_robin) {
  return {{fa4_trace_header[1], (int32_t)base}, {fa4_trace_header[2], (int32_t)capacity},
          {fa4_trace_header[3], deal_round_robin ? 1 : 0}};
}

int64_t trace_claimed(const int32_t *head) { return head[fa4_trace_header[0]]; }

std::string trace_append(const char *path, const TraceCall &call, const int32_t *records, int64_t claimed,
                         int64_t capacity) {
  int64_t kept = claimed < capacity ? claimed : capacity;
  std::ostringstream o;
  o << "{\"fa4_trace\": 1, \"call\": " << call_count++ << ", \"op\": " << quoted(call.op)
    << ", \"variant\": " << quoted(call.variant) << ", \"device\": " << call.device
    << ", \"device_name\": " << quoted(call.device_name) << ", \"num_sms\": " << call.num_sms
    << ", \"grid\": " << call.grid << ", \"tail_ctas\": " << call.tail_ctas
    << ", \"schedule\": " << quoted(call.dynamic ? (call.dealt ? "dealt" : "dynamic") : "static")
    << ", \"pack_gqa\": " << call.pack_gqa << ", \"tile_m\": " << call.tile_m << ", \"tile_n\": " << call.tile_n
    << ", \"mask\": " << quoted(call.mask) << ", \"varlen\": " << (call.varlen ? "true" : "false")
    << ", \"batch\": " << call.batch << ", \"seqlen_q\": " << call.seqlen_q << ", \"seqlen_k\": " << call.seqlen_k
    << ", \"heads_q\": " << call.heads_q << ", \"heads_kv\": " << call.heads_kv << ", \"head_dim\": " << call.head_dim
    << ", \"head_dim_v\": " << call.head_dim_v << ", \"cu_seqlens_q\": [";
  for (size_t i = 0; i < call.cu_seqlens_q.size(); i++) o << (i ? ", " : "") << call.cu_seqlens_q[i];
  o << "], \"fields\": " << name_list(fa4_trace_fields) << ", \"flags\": " << flag_map(fa4_trace_flags)
    << ", \"dropped\": " << (claimed - kept) << ", \"records\": [";
  for (int64_t r = 0; r < kept; r++) {
    o << (r ? ", [" : "[");
    for (int32_t w = 0; w < fa4_trace_record_words; w++)
      o << (w ? ", " : "") << records[r * fa4_trace_record_words + w];
    o << "]";
  }
  o << "]}\n";
  return append_line(path, o.str());
}

std::string trace_note_untraced(const char *path, const std::string &op, const std::string &variant,
                                const std::string &reason) {
  return append_line(path, "{\"fa4_trace\": 1, \"call\": " + std::to_string(call_count++) + ", \"op\": " +
                               quoted(op) + ", \"variant\": " + quoted(variant) + ", \"untraced\": " +
                               quoted(reason) + "}\n");
}
