// The CUDA implementations of the torch.ops.fa4 operators, on torch's stable C ABI
// (torch/csrc/stable, built with TORCH_TARGET_VERSION = the oldest torch fa4 supports): one
// binary for every torch from that version on and every Python. Per call: check the arguments,
// pick the variant and the launch parameters (fa4_rules.h), allocate, launch through libfa4
// (fa4_shim.h). Loading the library defines the operators (fa4_schemas.c); Python adds the fake
// impls, autograd and the CPU reference (torch_ops/fa4/ops.py); no per-call work goes back into
// Python.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

extern "C" {
#include "fa4_rules.h"
#include "fa4_schemas.h"
#include "fa4_shim.h"
#include "fa4_variant_table.h"
}
#include "fa4_trace.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// Errors carry the Python exception type they stand for ("[fa4 ValueError] ..."): the public
// functions (torch_ops/validation.py, native_error) raise that type, as the CPU path does.
template <typename... Args>
[[noreturn]] void raise(const char *kind, const Args &...args) {
  std::ostringstream message;
  message << "[fa4 " << kind << "] ";
  ((message << args), ...);
  throw std::runtime_error(message.str());
}

#define FA4_REQUIRE(cond, kind, ...) \
  do {                               \
    if (!(cond)) raise(kind, __VA_ARGS__); \
  } while (0)
#define FA4_CHECK(cond, ...) FA4_REQUIRE(cond, "RuntimeError", __VA_ARGS__)
#define FA4_VALUE(cond, ...) FA4_REQUIRE(cond, "ValueError", __VA_ARGS__)
#define FA4_TYPE(cond, ...) FA4_REQUIRE(cond, "TypeError", __VA_ARGS__)

// ------------------------------------------------------------------------- host timing
// Where an operator's host time goes, phase by phase: recorded only in a diagnostics build
// (FA4_DIAG_HOST_TIMING=1, never a wheel; scripts/host_breakdown.py prints fa4_diag_host_phases),
// otherwise empty inline calls the compiler drops.
#ifdef FA4_DIAG_HOST_TIMING
std::map<std::string, std::pair<int64_t, double>> &phase_totals() {
  static auto *totals = new std::map<std::string, std::pair<int64_t, double>>();  // never freed
  return *totals;
}

class Phases {
 public:
  explicit Phases(const char *op) : op_(op), last_(now()) {}
  void mark(const char *phase) {
    double t = now();
    auto &entry = phase_totals()[std::string(op_) + " " + phase];
    entry.first += 1;
    entry.second += t - last_;
    last_ = now();  // the bookkeeping above is not charged to the next phase
  }

 private:
  static double now() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  const char *op_;
  double last_;
};
#else
class Phases {
 public:
  explicit Phases(const char *) {}
  void mark(const char *) {}
};
#endif

// ------------------------------------------------------------------------------ device facts
struct DeviceFacts {
  int cc_major = 0, cc_minor = 0, num_sms = 0;
  int64_t l2_bytes = 0;
};

constexpr int kMaxDevices = 64;

const DeviceFacts &device_facts(int device) {
  static DeviceFacts facts[kMaxDevices];
  static bool known[kMaxDevices];
  FA4_CHECK(device >= 0 && device < kMaxDevices, "fa4: CUDA device index ", device, " out of range");
  if (!known[device]) {
    DeviceFacts f;
    int l2 = 0;
    cudaError_t err = cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&f.cc_minor, cudaDevAttrComputeCapabilityMinor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    FA4_CHECK(err == cudaSuccess, "fa4: querying CUDA device ", device, " failed: ", cudaGetErrorString(err));
    f.l2_bytes = l2;
    facts[device] = f;
    known[device] = true;
  }
  return facts[device];
}

// The current torch stream of a device. aoti_torch_get_current_cuda_stream lives in
// libtorch_cuda.so, which a CPU build of torch lacks, so it is looked up at first use.
using CurrentStreamFn = AOTITorchError (*)(int32_t, void **);

void *current_stream(int device) {
  static CurrentStreamFn fn = [] {
    void *lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return lib ? reinterpret_cast<CurrentStreamFn>(dlsym(lib, "aoti_torch_get_current_cuda_stream")) : nullptr;
  }();
  FA4_CHECK(fn != nullptr, "fa4: this torch has no CUDA support (libtorch_cuda.so is not loaded)");
  void *stream = nullptr;
  FA4_CHECK(fn(device, &stream) == AOTI_TORCH_SUCCESS, "fa4: reading the current CUDA stream failed");
  return stream;
}

bool capturing(void *stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing((cudaStream_t)stream, &capture);
  return capture != cudaStreamCaptureStatusNone;
}

// Launches go to the current CUDA device: the tensors' device for the length of a call.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

// ----------------------------------------------------------------------------- allocation
Tensor empty(std::vector<int64_t> sizes, int32_t dtype, int device) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= sizes[i] > 0 ? sizes[i] : 1;
  }
  AtenTensorHandle handle = nullptr;
  FA4_CHECK(aoti_torch_empty_strided((int64_t)sizes.size(), sizes.data(), strides.data(), dtype,
                                     aoti_torch_device_type_cuda(), device, &handle) == AOTI_TORCH_SUCCESS,
            "fa4: allocating a CUDA tensor failed");
  return Tensor(handle);
}

int64_t numel(const std::vector<int64_t> &sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

Tensor zeros(std::vector<int64_t> sizes, int32_t dtype, int device, size_t elem_bytes, void *stream) {
  Tensor t = empty(sizes, dtype, device);
  int64_t n = numel(sizes);
  if (n > 0) {
    cudaError_t err = cudaMemsetAsync(t.mutable_data_ptr(), 0, (size_t)n * elem_bytes, (cudaStream_t)stream);
    FA4_CHECK(err == cudaSuccess, "fa4: cudaMemsetAsync failed: ", cudaGetErrorString(err));
  }
  return t;
}

std::vector<int64_t> shape_of(const Tensor &t) {
  auto sizes = t.sizes();
  return std::vector<int64_t>(sizes.begin(), sizes.end());
}

int32_t dtype_code(ScalarType t) {
  switch (t) {
    case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
    case ScalarType::Half: return aoti_torch_dtype_float16();
    default: return aoti_torch_dtype_float32();
  }
}

// An int32 vector of zeros per device for the kernel arguments a variant ignores (never written;
// a one-sequence launch reads its word 0 as the sequence order). Made once with a synchronous
// memset; a process whose first fa4 call is captured into a CUDA graph (where that memset is not
// allowed) gets fresh zeros from a captured memset for that call instead.
Tensor unused_vector(int device) {
  static std::mutex lock;
  static auto *vectors = new std::map<int, Tensor>();  // never freed: lives until exit
  std::lock_guard<std::mutex> guard(lock);
  auto found = vectors->find(device);
  if (found != vectors->end()) return found->second;
  void *stream = current_stream(device);
  if (capturing(stream)) return zeros({2}, aoti_torch_dtype_int32(), device, 4, stream);
  Tensor t = empty({2}, aoti_torch_dtype_int32(), device);
  cudaError_t err = cudaMemset(t.mutable_data_ptr(), 0, 2 * sizeof(int32_t));
  FA4_CHECK(err == cudaSuccess, "fa4: cudaMemset failed: ", cudaGetErrorString(err));
  return vectors->emplace(device, t).first->second;
}

#ifdef FA4_DIAG_STAMP_WORDS
// Clock-stamped builds (FA4_DIAG_STAMPS, diagnostics only, never a wheel): the kernels write their
// stamps into the partials argument of unsplit launches, this per-device buffer, which
// scripts/stamps_report.py finds through fa4_diag_stamps.
const Tensor &stamps_buffer(int device) {
  static auto *buffers = new std::map<int, Tensor>();  // never freed
  auto found = buffers->find(device);
  if (found == buffers->end()) {
    Tensor t = empty({FA4_DIAG_STAMP_WORDS}, aoti_torch_dtype_int32(), device);
    cudaMemset(t.mutable_data_ptr(), 0, FA4_DIAG_STAMP_WORDS * sizeof(int32_t));
    found = buffers->emplace(device, t).first;
  }
  return found->second;
}
#endif

// ------------------------------------------------------------------------ native views
fa4_tensor view_of(const Tensor &t, int lead_ones = 0) {
  fa4_tensor out{};
  out.data = t.mutable_data_ptr();
  int64_t rank = t.dim();
  out.rank = (int32_t)(rank + lead_ones);
  FA4_CHECK(out.rank <= FA4_MAX_RANK, "fa4: rank ", out.rank, " too large");
  auto sizes = t.sizes();
  auto strides = t.strides();
  int64_t outer = rank ? sizes[0] * strides[0] : 1;
  for (int i = 0; i < lead_ones; i++) {
    out.shape[i] = 1;
    out.stride[i] = outer;
  }
  for (int64_t i = 0; i < rank; i++) {
    out.shape[i + lead_ones] = sizes[i];
    out.stride[i + lead_ones] = strides[i];
  }
  return out;
}

// A contiguous (row-major) view of `shape` at `data`.
fa4_tensor dense_view(void *data, const std::vector<int64_t> &shape) {
  fa4_tensor out{};
  out.data = data;
  out.rank = (int32_t)shape.size();
  FA4_CHECK(out.rank <= FA4_MAX_RANK, "fa4: rank ", out.rank, " too large");
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    out.shape[i] = shape[i];
    out.stride[i] = stride;
    stride *= shape[i] > 0 ? shape[i] : 1;
  }
  return out;
}

// The unused int32 vector as a rank-3 tensor (the backward's semaphore argument when no counter
// is needed).
fa4_tensor unused_rank3(int device) {
  fa4_tensor out = view_of(unused_vector(device));
  out.rank = 3;
  out.shape[0] = out.shape[1] = 1;
  out.shape[2] = 2;
  out.stride[0] = out.stride[1] = 2;
  out.stride[2] = 1;
  return out;
}

// TMA needs a 16-byte aligned base and 16-byte multiple strides; the rare view that breaks this
// is copied (any stride with a contiguous last dim is otherwise used in place).
Tensor tma_ready(const Tensor &t) {
  size_t elem = t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  auto strides = t.strides();
  for (int64_t i = 0; ok && i + 1 < t.dim(); i++) ok = strides[i] > 0 && (strides[i] * (int64_t)elem) % 16 == 0;
  if (ok) return t;
  Tensor copy = empty(shape_of(t), dtype_code(t.scalar_type()), t.get_device_index());
  torch::stable::copy_(copy, t);
  return copy;
}

// ----------------------------------------------------------------------------- checks
const char *dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    default: return "an unsupported dtype";
  }
}

// A tuple of ints as Python prints it.
std::string tuple_text(const std::vector<int64_t> &values) {
  std::string s = "(";
  for (size_t i = 0; i < values.size(); i++) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + (values.size() == 1 ? ",)" : ")");
}

std::string shape_text(const Tensor &t) { return tuple_text(shape_of(t)); }

// A float as Python's repr prints it (shortest round-trip digits, "-1.0" not "-1"): the CPU path's
// messages (fa4.validation) and these match word for word (tests/gpu/test_errors_gpu.py).
std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto result = std::to_chars(buf, buf + sizeof(buf), x);
  std::string s(buf, result.ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// The rules of fa4.validation.check_qkv for CUDA tensors (rank given: 4 dense, 3 packed).
// same_batch: k and v have q's batch (not a KV cache, whose first dim counts pages or cache rows).
void check_qkv(const Tensor &q, const Tensor &k, const Tensor &v, int64_t rank, bool same_batch = true) {
  const char *names[3] = {"q", "k", "v"};
  const Tensor *ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; i++)
    FA4_VALUE(ts[i]->dim() == rank, names[i],
              rank == 4 ? " must be 4-D (batch, seqlen, heads, head_dim); got shape "
                        : " must be a 3-D tensor (total_tokens, heads, head_dim) for attention_varlen; got ",
              shape_text(*ts[i]), rank == 4 ? ". For packed variable-length batches use fa4.attention_varlen." : "");
  FA4_TYPE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
            "q, k and v must share one dtype; got ", dtype_name(q.scalar_type()), ", ", dtype_name(k.scalar_type()),
            ", ", dtype_name(v.scalar_type()));
  FA4_VALUE(k.is_cuda() && v.is_cuda() && k.get_device_index() == q.get_device_index() &&
                v.get_device_index() == q.get_device_index(),
            "q, k and v must be on one device");
  FA4_TYPE(q.scalar_type() == ScalarType::BFloat16 || q.scalar_type() == ScalarType::Half, "q dtype ",
            dtype_name(q.scalar_type()), " is not supported on cuda; use one of (torch.float16, torch.bfloat16)");
  int o = rank == 4 ? 1 : 0;  // dims: [batch], seqlen, heads, head_dim
  if (rank == 4 && same_batch)
    FA4_VALUE(q.size(0) == k.size(0) && k.size(0) == v.size(0), "batch sizes differ: q ", q.size(0), ", k ", k.size(0),
              ", v ", v.size(0));
  FA4_VALUE(k.size(o) == v.size(o), "k and v must have the same seqlen_k; got ", k.size(o), " and ", v.size(o));
  FA4_VALUE(k.size(o + 1) == v.size(o + 1), "k and v must have the same number of heads; got ", k.size(o + 1),
            " and ", v.size(o + 1));
  FA4_VALUE(q.size(o + 2) == k.size(o + 2), "q and k head_dim differ: ", q.size(o + 2), " vs ", k.size(o + 2));
  FA4_VALUE(q.size(o + 2) > 0 && v.size(o + 2) > 0, "head_dim must be positive");
  FA4_VALUE(!(k.size(o + 1) == 0 && q.size(o + 1) != 0), "k and v have 0 heads but q has some");
  FA4_VALUE(k.size(o + 1) == 0 || q.size(o + 1) % k.size(o + 1) == 0, "heads of q (", q.size(o + 1),
            ") must be a multiple of heads of k/v (", k.size(o + 1), ") (GQA/MQA)");
  for (int i = 0; i < 3; i++) {
    auto strides = ts[i]->strides();
    FA4_VALUE(ts[i]->numel() == 0 || ts[i]->stride(rank - 1) == 1, names[i],
              " must be contiguous in its last dimension (stride(-1) == 1); got strides ",
              tuple_text(std::vector<int64_t>(strides.begin(), strides.end())), ". Call .contiguous() on it first.");
  }
}

void check_scalars(double scale, double softcap) {
  FA4_VALUE(std::isfinite(scale), "scale must be finite; got ", py_float(scale));
  FA4_VALUE(softcap >= 0.0, "softcap must be >= 0 (0 disables it); got ", py_float(softcap));
}

void check_pack_gqa(std::optional<bool> pack_gqa, int64_t heads_q, int64_t heads_kv) {
  if (!pack_gqa.value_or(false)) return;
  FA4_VALUE(fa4_packable_group(heads_q / (heads_kv > 0 ? heads_kv : 1)),
            "pack_gqa=True needs heads_q / heads_kv in (2, 4, 8, 16); got ", heads_q, " / ", heads_kv,
            ". Use pack_gqa=None (automatic) or False.");
}

void check_offsets(const Tensor &t, const char *name, const Tensor &q) {
  FA4_TYPE(t.dim() == 1 && t.scalar_type() == ScalarType::Int, name, " must be a 1-D torch.int32 tensor");
  FA4_VALUE(t.is_cuda() && t.get_device_index() == q.get_device_index(), name, " must be on q's device");
}

fa4_mask resolve_mask(bool causal, int64_t window_left, int64_t window_right) {
  fa4_mask mask;
  FA4_VALUE(fa4_resolve_mask(causal, window_left, window_right, &mask) == 0, fa4_rules_error());
  return mask;
}

fa4_tuning tuning() {
  fa4_tuning t;
  FA4_VALUE(fa4_read_tuning(&t) == 0, fa4_rules_error());
  return t;
}

void check_status(int32_t status, const char *what) {
  FA4_CHECK(status == FA4_OK, "fa4 ", what, ": ", fa4_last_error());
}

// ---------------------------------------------------------------------- variant lookup
// The variants a call can use: one per tile family (-1 where not built).
struct Candidates {
  int32_t family[3] = {-1, -1, -1};
};

int32_t dtype_id(ScalarType t) { return t == ScalarType::BFloat16 ? FA4_DTYPE_BF16 : FA4_DTYPE_FP16; }

Candidates find_variants(const DeviceFacts &dev, ScalarType dtype, int64_t d, int64_t dv, int32_t mask_kind,
                         bool softcap, bool varlen, int32_t kind, int32_t score_mod = FA4_SCORE_NONE,
                         int32_t kv_cache = FA4_KV_CACHE_NONE, bool trace = false) {
  // The last few keys this thread looked up (a scan of the table is ~1 us of a call's host time).
  uint64_t key = ((uint64_t)(dev.cc_major * 10 + dev.cc_minor) << 48) | ((uint64_t)dtype_id(dtype) << 44) |
                 ((uint64_t)(d & 0xfff) << 32) | ((uint64_t)(dv & 0xfff) << 20) | ((uint64_t)mask_kind << 16) |
                 ((uint64_t)softcap << 12) | ((uint64_t)varlen << 8) | ((uint64_t)score_mod << 4) |
                 ((uint64_t)kv_cache << 13) | ((uint64_t)trace << 9) | (uint64_t)(kind + 1);
  static thread_local std::array<std::pair<uint64_t, Candidates>, 8> recent{};
  static thread_local size_t next_slot = 0;
  for (auto &entry : recent)
    if (entry.first == key) return entry.second;
  Candidates c;
  for (int32_t i = 0; i < fa4_variant_count; i++) {
    const fa4_variant &x = fa4_variants[i];
    if (x.kind == kind && x.cc_major == dev.cc_major && x.cc_minor == dev.cc_minor && x.dtype == dtype_id(dtype) &&
        x.head_dim == d && x.head_dim_v == dv && x.mask == mask_kind && x.softcap == (int32_t)softcap &&
        x.varlen == (int32_t)varlen && x.score_mod == score_mod && x.kv_cache == kv_cache &&
        x.trace == (int32_t)trace)
      c.family[x.tiles] = i;
  }
  recent[next_slot++ % recent.size()] = {key, c};
  return c;
}

std::string built_head_dims(const DeviceFacts &dev, int32_t kind) {
  std::map<std::pair<int, int>, bool> dims;
  for (int32_t i = 0; i < fa4_variant_count; i++) {
    const fa4_variant &x = fa4_variants[i];
    if (x.kind == kind && x.cc_major == dev.cc_major && x.cc_minor == dev.cc_minor)
      dims[{x.head_dim, x.head_dim_v}] = true;
  }
  std::string s = "[";
  for (auto &entry : dims)
    s += (s.size() > 1 ? ", (" : "(") + std::to_string(entry.first.first) + ", " +
         std::to_string(entry.first.second) + ")";
  return s + "]";
}

const char *mask_name(int32_t kind) {
  return kind == FA4_MASK_NONE ? "none" : kind == FA4_MASK_CAUSAL ? "causal" : kind == FA4_MASK_LOCAL ? "local"
                                                                                                  : "block-sparse";
}

// The error for a call no compiled variant serves: what there is, and what to use.
[[noreturn]] void unsupported(const DeviceFacts &dev, const Tensor &q, int64_t d, int64_t dv, int32_t mask_kind,
                              bool softcap, int32_t kind) {
  bool backward = kind != FA4_KERNEL_FWD;
  if (!(dev.cc_major == 9 && dev.cc_minor == 0))
    raise("NotImplementedError", "fa4 ships CUDA kernels for Hopper (sm_90: H100/H200) only; cuda:" +
                             std::to_string(q.get_device_index()) + " is sm_" + std::to_string(dev.cc_major) +
                             std::to_string(dev.cc_minor) +
                             ". Use torch.nn.functional.scaled_dot_product_attention, or CPU tensors for fa4's "
                             "reference implementation.");
  std::string dims = built_head_dims(dev, backward ? FA4_KERNEL_BWD : FA4_KERNEL_FWD);
  std::string pair = "(" + std::to_string(d) + ", " + std::to_string(dv) + ")";
  if (dims.find(pair) == std::string::npos)
    raise("NotImplementedError",
        std::string(backward ? "fa4 has no backward kernel for " : "") + "head_dim=" + std::to_string(d) +
        ", head_dim_v=" + std::to_string(dv) + " is not compiled into this build of fa4 (available (head_dim, " +
        "head_dim_v): " + dims + "). Pad the head dimension or use torch.nn.functional.scaled_dot_product_attention" +
        (backward ? " (its cuDNN or flash backend) for training" : "") + ".");
  raise("NotImplementedError", std::string("no compiled fa4 ") + (backward ? "backward " : "") + "kernel for dtype=" +
                           dtype_name(q.scalar_type()) + ", mask=" + mask_name(mask_kind) +
                           ", softcap=" + (softcap ? "True" : "False") +
                           " on sm_90a; this build was filtered (FA4_VARIANTS) or lacks that combination. Use "
                           "torch.nn.functional.scaled_dot_product_attention instead.");
}

// ---------------------------------------------------------------------------- forward
// Split-tail flags under CUDA-graph capture: a buffer of the captured call's own, allocated and
// zeroed now, outside the graph (relaxed capture mode; a private stream), and never freed. The
// kernels leave the flags zero, so every replay finds them zero with no memset node in the graph:
// a node cost each replay of a small decoding call ~2 us (the memset and its launch gap; H100,
// 1 x 4k at hd128 ran 19 us). A graph is captured once and replayed many times; each captured
// call keeps its ~1 KB for the life of the process.
fa4_tensor captured_zeros(int device, int64_t words) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  int current = -1;
  cudaGetDevice(&current);
  void *buffer = nullptr;
  cudaStream_t side = nullptr;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaMalloc(&buffer, (size_t)words * 4);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(buffer, 0, (size_t)words * 4, side);
  if (err == cudaSuccess) err = cudaStreamSynchronize(side);
  if (side != nullptr) cudaStreamDestroy(side);
  if (current >= 0) cudaSetDevice(current);
  cudaThreadExchangeStreamCaptureMode(&mode);
  FA4_CHECK(err == cudaSuccess, "fa4: allocating split-tail flags while capturing a CUDA graph failed: ",
            cudaGetErrorString(err));
  return dense_view(static_cast<int32_t *>(buffer), {words});
}

// The split tail's workspace per (device, stream). The flags are zero when created and every
// kernel leaves them zero (each merger resets the flags it consumed), so calls on one stream reuse
// them without a memset. The partial results need no initial value (a writer stores its slot
// before the merger reads it, and no slot is read that the launch did not write), so they are
// reused as they are: one allocation fewer per split call (~2 us of host time: H100, a decoding
// call's workspace phase was 3.2 us of ~28 in the operator, session 56). One pair per stream:
// kernels on different streams may run at the same time. Under CUDA-graph capture the flags come
// from captured_zeros and the partials from the graph's pool. ``keep_*`` hold the buffers for the
// call (a grown buffer's old memory goes back to the caching allocator, stream-ordered).
void split_workspace(int device, void *stream, int64_t semaphore_words, int64_t partial_words, Tensor *keep_semaphores,
                     Tensor *keep_partials, fa4_tensor *semaphores, fa4_tensor *partials) {
  if (capturing(stream)) {
    *semaphores = captured_zeros(device, semaphore_words);
    *keep_partials = empty({partial_words}, aoti_torch_dtype_float32(), device);
    *partials = view_of(*keep_partials);
    return;
  }
  struct Workspace {
    Tensor semaphores, partials;
  };
  static std::mutex lock;
  static auto *buffers = new std::map<std::pair<int, void *>, Workspace>();  // never freed
  std::lock_guard<std::mutex> guard(lock);
  auto found = buffers->find({device, stream});
  if (found == buffers->end() || found->second.semaphores.numel() < semaphore_words ||
      found->second.partials.numel() < partial_words) {
    Workspace grown;
    bool had = found != buffers->end();
    grown.semaphores = had && found->second.semaphores.numel() >= semaphore_words
                           ? found->second.semaphores
                           : zeros({semaphore_words}, aoti_torch_dtype_int32(), device, 4, stream);
    grown.partials = had && found->second.partials.numel() >= partial_words
                         ? found->second.partials
                         : empty({partial_words}, aoti_torch_dtype_float32(), device);
    (*buffers)[{device, stream}] = grown;
    found = buffers->find({device, stream});
  }
  *keep_semaphores = found->second.semaphores;
  *keep_partials = found->second.partials;
  *semaphores = view_of(*keep_semaphores);
  *partials = view_of(*keep_partials);
}

// Zeroed int32 counters the kernels count in (the forward's tile counter, the backward's
// per-query-block counters): each call takes the next `words` of a per-(device, stream) arena,
// and when the arena runs out one memset on the stream zeroes it again, ordered after every
// kernel that counted in it. A call then costs neither an allocation nor a memset launch of its
// own. Under CUDA-graph capture a call gets fresh zeros instead (their memset is replayed with
// the graph, while the arena's would not be).
fa4_tensor zeroed_counters(int device, void *stream, std::vector<int64_t> shape, Tensor *keep) {
  int64_t words = numel(shape);
  words = (words + 31) / 32 * 32;  // each call's counters 128-byte aligned (the launches need 16)
  int64_t offset = 0;
  void *base = nullptr;
  if (capturing(stream)) {
    *keep = zeros({words}, aoti_torch_dtype_int32(), device, 4, stream);
    base = keep->mutable_data_ptr();
  } else {
    struct Arena {
      Tensor buffer;
      int64_t next;
    };
    static std::mutex lock;
    static auto *arenas = new std::map<std::pair<int, void *>, Arena>();  // never freed
    std::lock_guard<std::mutex> guard(lock);
    auto found = arenas->find({device, stream});
    if (found == arenas->end() || found->second.next + words > found->second.buffer.numel()) {
      // Zero it again (grown if this call would not fit even an empty one).
      int64_t size = std::max<int64_t>(1 << 16, 2 * words);
      bool reuse = found != arenas->end() && found->second.buffer.numel() >= words;
      Tensor buffer = reuse ? found->second.buffer : empty({size}, aoti_torch_dtype_int32(), device);
      size = buffer.numel();
      cudaError_t err = cudaMemsetAsync(buffer.mutable_data_ptr(), 0, (size_t)size * 4, (cudaStream_t)stream);
      FA4_CHECK(err == cudaSuccess, "fa4: cudaMemsetAsync failed: ", cudaGetErrorString(err));
      (*arenas)[{device, stream}] = Arena{buffer, 0};
      found = arenas->find({device, stream});
    }
    offset = found->second.next;
    found->second.next += words;
    *keep = found->second.buffer;
    base = keep->mutable_data_ptr();
  }
  return dense_view(static_cast<int32_t *>(base) + offset, shape);
}

// Packed sequences: their indices by decreasing query length (on the GPU, no host sync); the
// kernel schedules the tiles of long sequences first so short ones fill the tail. Only for more
// than fa4_seq_order_in_kernel sequences: fewer, the kernel ranks them itself
// (tile_scheduler.rank_sequences), which saves the sort's small kernels before each call.
Tensor longest_first(Tensor cu_seqlens_q) {
  int64_t n = cu_seqlens_q.size(0) - 1;
  if (n <= 1) {
    Tensor unused = unused_vector(cu_seqlens_q.get_device_index());
    return torch::stable::narrow(unused, 0, 0, n);
  }
  using torch::stable::detail::from;
  std::array<StableIValue, 5> diff{from(cu_seqlens_q), from((int64_t)1), from((int64_t)0), from(std::nullopt),
                                   from(std::nullopt)};
  FA4_CHECK(torch_call_dispatcher("aten::diff", "", diff.data(), TORCH_ABI_VERSION) == AOTI_TORCH_SUCCESS,
            "fa4: diff failed");
  Tensor lengths = torch::stable::detail::to<Tensor>(diff[0]);  // owns the handle diff returned
  // Each from(Tensor) is a new reference, which the dispatcher takes over.
  std::array<StableIValue, 4> sort{from(lengths), from(true), from((int64_t)0), from(true)};
  FA4_CHECK(torch_call_dispatcher("aten::argsort", "stable", sort.data(), TORCH_ABI_VERSION) == AOTI_TORCH_SUCCESS,
            "fa4: argsort failed");
  Tensor order = torch::stable::detail::to<Tensor>(sort[0]);
  return torch::stable::to(order, ScalarType::Int);
}

struct Varlen {
  Tensor cu_q, cu_k;
  std::optional<Tensor> used_k;
  int64_t max_seqlen_q, max_seqlen_k;
};

// A block-sparse backward's tables (fa4.block_sparse, transposed: per K/V block its query blocks)
// and the tile shape they were built for.
struct SparseTables {
  Tensor counts, blocks, bits;
  int64_t tile_m, tile_n;
};

// A built-in score_mod's kind and parameters (fa4_score_mod in fa4_shim.h): (heads_q, width)
// fp32 slopes or relative-bias table, in the units of the scaled score; or a bias tensor
// (batch or 1, heads_q or 1, seqlen_q or 1, seqlen_k) fp32, keys contiguous.
struct ScoreMod {
  int32_t kind = FA4_SCORE_NONE;
  Tensor params;
};

// A KV-cache call (fa4_fwd's kv_cache variants): the cache as pages, cache_seqlens, the rows to
// append (k/v themselves as placeholders when there are none).
struct KvCache {
  Tensor page_table;     // (batch, max_pages) int32, rows contiguous; a contiguous cache's (batch,) rows
  int64_t max_pages = 0;  // page_table's columns (1: a contiguous cache, its rows read as (batch, 1))
  Tensor cache_seqlens;  // (batch,) int32
  Tensor k_new, v_new;   // (batch, seqlen_new, heads_kv, dim)
  int64_t seqlen_new = 0, page_size = 0, capacity = 0;
  int64_t num_splits = 0;  // pieces per tile asked for (0: fa4_split_tail_ctas decides)
};

const char *score_mod_name(int32_t kind) {
  return kind == FA4_SCORE_ALIBI                               ? "alibi"
         : kind == FA4_SCORE_RELBIAS                           ? "relative_bias"
         : kind == FA4_SCORE_BIAS || kind == FA4_SCORE_BIAS16 ? "bias"
                                                               : "none";
}

// A bias tensor (FA4_SCORE_BIAS; BIAS16 in q's dtype): each of its first three dims the call's
// (batch, heads_q, seqlen_q) or 1 (broadcast), its last seqlen_k and contiguous.
void check_bias_tensor(const Tensor &p, const Tensor &q, int64_t seqlen_k) {
  FA4_TYPE((p.scalar_type() == ScalarType::Float || p.scalar_type() == q.scalar_type()) && p.dim() == 4,
           "score_params for bias must be a 4-D torch.float32 tensor or one of q's dtype (batch, heads_q, seqlen_q, "
           "seqlen_k); got ", p.dim(), "-D ", dtype_name(p.scalar_type()));
  const int64_t full[4] = {q.size(0), q.size(2), q.size(1), seqlen_k};
  bool ok = p.size(3) == seqlen_k && p.stride(3) == 1;
  for (int i = 0; i < 3; i++) ok = ok && (p.size(i) == full[i] || p.size(i) == 1);
  FA4_VALUE(ok, "score_params for bias must be (batch or 1, heads_q or 1, seqlen_q or 1, seqlen_k) = (",
            full[0], " or 1, ", full[1], " or 1, ", full[2], " or 1, ", full[3], ") with keys contiguous; got ",
            shape_text(p), " strides ", tuple_text({p.stride(0), p.stride(1), p.stride(2), p.stride(3)}));
}

// score_mod (0 none, 1 ALiBi slopes (heads_q, 1), 2 relative-bias table (heads_q, 2c + 1), 3 bias
// tensor) and its fp32 parameters on q's device; score_mods have kernels without softcap only.
ScoreMod check_score_mod(int64_t score_mod, const std::optional<Tensor> &params, const Tensor &q, double softcap,
                         int64_t seqlen_k) {
  FA4_VALUE(score_mod >= FA4_SCORE_NONE && score_mod <= FA4_SCORE_BIAS,
            "score_mod must be 0 (none), 1 (alibi), 2 (relative_bias) or 3 (bias); got ", score_mod);
  ScoreMod s;
  s.kind = (int32_t)score_mod;
  if (s.kind == FA4_SCORE_NONE) return s;
  FA4_VALUE(params.has_value(), "score_params is required with score_mod=", score_mod_name(s.kind));
  const Tensor &p = *params;
  FA4_VALUE(p.is_cuda() && p.get_device_index() == q.get_device_index(), "score_params must be on q's device");
  FA4_VALUE(softcap == 0.0, "score_mod=", score_mod_name(s.kind), " with softcap: fa4 has no such kernel; use "
            "torch.nn.attention.flex_attention with both in one score_mod");
  if (s.kind == FA4_SCORE_BIAS) {
    check_bias_tensor(p, q, seqlen_k);
    s.params = p;  // any strides: the kernel reads them (a copy could be as large as the scores)
    if (p.scalar_type() != ScalarType::Float) s.kind = FA4_SCORE_BIAS16;  // read in q's dtype
    return s;
  }
  FA4_TYPE(p.scalar_type() == ScalarType::Float && p.dim() == 2, "score_params must be a 2-D torch.float32 tensor; got ",
           p.dim(), "-D ", dtype_name(p.scalar_type()));
  FA4_VALUE(p.size(0) == q.size(2) && p.size(1) >= 1, "score_params must be (heads_q = ", q.size(2),
            ", width); got ", shape_text(p));
  FA4_VALUE(s.kind != FA4_SCORE_ALIBI || p.size(1) == 1, "alibi takes one slope per query head: score_params (",
            q.size(2), ", 1); got ", shape_text(p));
  FA4_VALUE(s.kind != FA4_SCORE_RELBIAS || p.size(1) % 2 == 1,
            "a relative_bias table is (heads_q, 2 * max_distance + 1); got ", shape_text(p));
  s.params = p.is_contiguous() ? p : torch::stable::contiguous(p);  // a few floats per head
  return s;
}

// The kernels' view of a score_mod's parameters (or of their gradient, `like` them): a bias
// tensor's broadcast dims take the call's sizes with stride 0 (score_mod.ScoreBias).
fa4_tensor score_view(const ScoreMod &s, const Tensor &t, const Tensor &q) {
  fa4_tensor out = view_of(t);
  if (s.kind != FA4_SCORE_BIAS && s.kind != FA4_SCORE_BIAS16) return out;
  const int64_t full[3] = {q.size(0), q.size(2), q.size(1)};
  for (int i = 0; i < 3; i++)
    if (out.shape[i] == 1) out.shape[i] = full[i], out.stride[i] = 0;
  return out;
}

// A traced launch's records (``semaphores``: trace_record_base's layout) appended to ``path``, with
// the call's description; waits for the kernel.
void trace_launch(const char *path, TraceCall &call, const Tensor &semaphores, int64_t base, int64_t capacity,
                  const Tensor *cu_seqlens_q, void *stream) {
  cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
  FA4_CHECK(err == cudaSuccess, "fa4: the traced forward failed: ", cudaGetErrorString(err));
  const int32_t *words = static_cast<const int32_t *>(semaphores.data_ptr());
  int32_t head[16];
  err = cudaMemcpy(head, words, sizeof(head), cudaMemcpyDeviceToHost);
  int64_t claimed = err == cudaSuccess ? trace_claimed(head) : 0;
  std::vector<int32_t> records((size_t)(std::min(claimed, capacity) * fa4_trace_record_words));
  if (err == cudaSuccess && !records.empty())
    err = cudaMemcpy(records.data(), words + base, records.size() * 4, cudaMemcpyDeviceToHost);
  if (err == cudaSuccess && cu_seqlens_q != nullptr) {
    call.cu_seqlens_q.resize((size_t)cu_seqlens_q->numel());
    err = cudaMemcpy(call.cu_seqlens_q.data(), cu_seqlens_q->data_ptr(), call.cu_seqlens_q.size() * 4,
                     cudaMemcpyDeviceToHost);
  }
  cudaDeviceProp prop;
  if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, call.device);
  FA4_CHECK(err == cudaSuccess, "fa4: reading the trace back failed: ", cudaGetErrorString(err));
  call.device_name = prop.name;
  std::string problem = trace_append(path, call, records.data(), claimed, capacity);
  FA4_VALUE(problem.empty(), "fa4: ", problem);
}

// Launch the compiled forward. q/k/v/out (batch, seqlen, heads, dim) and lse (batch, heads,
// seqlen), or packed: (total, heads, dim) and (heads, total) with `varlen`.
void run_forward(Tensor q, Tensor k, Tensor v, const Tensor &out, const Tensor &lse, fa4_mask mask, double scale,
                 double softcap, std::optional<bool> pack_gqa, const Varlen *varlen, Phases &phases,
                 const KvCache *cache = nullptr) {
  int device = q.get_device_index();
  const DeviceFacts &dev = device_facts(device);
  int lead = varlen ? 1 : 0;  // packed tensors run as batch 1
  fa4_tensor nq = view_of(q, lead);
  const int64_t b = nq.shape[0], sq = nq.shape[1], hq = nq.shape[2], d = nq.shape[3];
  // A KV cache's sequences are at most its capacity long (each its own length on the device).
  const int64_t sk = cache ? cache->capacity : k.size(lead ? 0 : 1), hkv = k.size(lead ? 1 : 2),
                dv = v.size(lead ? 2 : 3);
  if (!varlen) mask = fa4_effective_mask(mask, sq, sk);
  fa4_tuning tune = tuning();
  void *stream = current_stream(device);
  // FA4_TRACE: the variant's trace twin, whose tiles' records trace_launch appends to the file.
  // Not while capturing a CUDA graph: reading the records back waits for the kernel.
  std::string untraced;
  bool traced = tune.trace_path != nullptr;
  if (traced && capturing(stream)) traced = false, untraced = "captured into a CUDA graph (tracing waits for the kernel)";
  // A KV cache's kernel for every call is the window's (fa4_kv_cache_mask): no mask and causal
  // reach it as windows with unbounded sides. A call left by fa4_effective_mask with a mask that
  // has a twin (fa4_kv_cache_twin_masks: no mask, i.e. its query rows see every key of their
  // sequence, as one decoding token does, causal or not, without a left window) runs the twin
  // where one is built for its dtype, head dims and softcap: ~1.6k fewer instructions (hd128),
  // which a decoding CTA runs once, through instruction-cache misses (H100, 1 x 4k: 0.6 us less a
  // call under CUDA graphs). With rows to append it runs the twin's append twin where built
  // (FA4_KV_CACHE_APPEND; traced calls keep the twin, which has a trace twin). The heuristics below
  // see the call's kind.
  int32_t variant_mask = cache ? fa4_kv_cache_mask : mask.kind;
  int32_t cache_kind = cache ? FA4_KV_CACHE_PLAIN : FA4_KV_CACHE_NONE;
  auto candidates = [&](bool trace) {
    return find_variants(dev, q.scalar_type(), d, dv, variant_mask, softcap > 0.0, varlen != nullptr, FA4_KERNEL_FWD,
                         FA4_SCORE_NONE, cache_kind, trace);
  };
  if (cache && ((fa4_kv_cache_twin_masks >> mask.kind) & 1)) {
    variant_mask = mask.kind;
    if (candidates(traced).family[FA4_TILES_REGULAR] < 0 && candidates(false).family[FA4_TILES_REGULAR] < 0) {
      variant_mask = fa4_kv_cache_mask;  // no twin of these head dims (softcap, a partial build)
    } else if (cache->seqlen_new > 0 && !traced) {
      cache_kind = FA4_KV_CACHE_APPEND;
      if (candidates(false).family[FA4_TILES_REGULAR] < 0) cache_kind = FA4_KV_CACHE_PLAIN;  // not built
    }
  }
  Candidates c = candidates(traced);
  if (traced && c.family[FA4_TILES_REGULAR] < 0) {
    traced = false, c = candidates(false);
    untraced = "no trace variant of this kernel is built (the wheel ships bf16 head_dim 64 and 128 without a mask "
               "or causal; a build with FA4_TRACE_VARIANTS=all has one for every dense, packed and KV-cache forward)";
  }
  if (c.family[FA4_TILES_REGULAR] < 0) unsupported(dev, q, d, dv, variant_mask, softcap > 0.0, FA4_KERNEL_FWD);
  phases.mark("select");
  q = tma_ready(q), k = tma_ready(k), v = tma_ready(v);
  phases.mark("tma_ready");
  const int64_t longest_q = varlen ? varlen->max_seqlen_q : sq;
  int32_t override = pack_gqa.has_value() ? (int32_t)*pack_gqa : FA4_AUTO;
  auto tile_m_of = [&](int f) { return c.family[f] >= 0 ? fa4_variants[c.family[f]].tile_m : 0; };
  // Forced packing runs in the family whose tiles stack the group; the automatic choice in the
  // one whose tiles pack the most heads.
  const int32_t head_rows = cache ? fa4_kv_cache_head_rows : FA4_Q_PIECE_ROWS;
  // A KV cache's long tiles (chunked prefill) are chosen with each family's own packing.
  int32_t index = c.family[cache ? fa4_kv_cache_tile_family(hq, hkv, longest_q, sk, tile_m_of(FA4_TILES_REGULAR),
                                                            tile_m_of(FA4_TILES_LONG), head_rows, override, tune.tiles)
                                 : fa4_packing_family(hq, hkv, longest_q, tile_m_of(FA4_TILES_REGULAR),
                                                      tile_m_of(FA4_TILES_SHORT), tile_m_of(FA4_TILES_LONG), head_rows,
                                                      override)];
  int32_t packed = 1;
  FA4_VALUE(fa4_pack_gqa_factor(hq, hkv, longest_q, fa4_variants[index].tile_m, head_rows, override, &packed) == 0,
            fa4_rules_error());
  if (!cache && index == c.family[FA4_TILES_REGULAR] &&
      (c.family[FA4_TILES_SHORT] >= 0 || c.family[FA4_TILES_LONG] >= 0)) {
    int32_t tiles = fa4_tile_family(longest_q, sk, packed, fa4_variants[index].tile_m, tile_m_of(FA4_TILES_SHORT),
                                    tile_m_of(FA4_TILES_LONG), tune.tiles, mask.kind);
    if (tiles != FA4_TILES_REGULAR) {
      index = c.family[tiles];
      FA4_VALUE(fa4_pack_gqa_factor(hq, hkv, longest_q, fa4_variants[index].tile_m, head_rows, override, &packed) == 0,
                fa4_rules_error());
    }
  }
  const fa4_variant &variant = fa4_variants[index];
  const int64_t block_rows = variant.tile_m / packed;  // query rows of one head per tile
  const Tensor &unused = unused_vector(device);
  phases.mark("plan");
  fa4_tensor cu_q = view_of(unused), cu_k = cu_q, used_k = cu_q, order = cu_q;
  int64_t pairs, tile_rows = 1, seqlen_k = sk;
  Tensor order_tensor = unused;
  if (!varlen) {
    pairs = b * hq / packed;
  } else {
    int64_t num_seqs = varlen->cu_q.size(0) - 1;
    if (num_seqs > fa4_seq_order_in_kernel) {  // fewer: each CTA orders them itself
      order_tensor = longest_first(varlen->cu_q);
      order = view_of(order_tensor);
    }
    cu_q = view_of(varlen->cu_q), cu_k = view_of(varlen->cu_k);
    used_k = varlen->used_k ? view_of(*varlen->used_k) : cu_q;
    pairs = num_seqs * hq / packed;
    seqlen_k = std::max<int64_t>(1, sk / std::max<int64_t>(num_seqs, 1));
    // The kernel sizes its tile range as ceil(rows / block_rows) blocks per sequence; this many
    // rows covers any split of the packed queries without reading cu_seqlens on the host.
    int64_t blocks = (sq + block_rows - 1) / block_rows + num_seqs;
    tile_rows = block_rows * std::max<int64_t>(1, (blocks + num_seqs - 1) / std::max<int64_t>(num_seqs, 1));
  }
  int32_t group = fa4_heads_per_group(dev.l2_bytes, seqlen_k, (int32_t)d, (int32_t)dv, (int32_t)q.element_size(),
                                      pairs, tune.l2_swizzle_bytes, mask.kind,
                                      varlen ? 0 : (sq + block_rows - 1) / block_rows, dev.num_sms);
  int32_t grid = fa4_grid_size(dev.num_sms, mask.kind, tune.persistent);
  int32_t tail_ctas = 0;
  if (variant.split_tail && grid == dev.num_sms) {
    // Static schedule: as many tiles as the kernel counts, each seeing every K/V block.
    int64_t num_tiles = b * (hq / packed) * ((sq + block_rows - 1) / block_rows);
    int64_t n_blocks = (sk + variant.tile_n - 1) / variant.tile_n;
    tail_ctas = cache && cache->num_splits > 0
                    ? fa4_split_ctas_for(num_tiles, dev.num_sms, n_blocks, cache->num_splits)
                    : fa4_split_tail_ctas(num_tiles, dev.num_sms, n_blocks, (int32_t)dv,
                                          (int32_t)(std::min<int64_t>(sq, block_rows) * packed), tune.split_tail);
  }
  phases.mark("schedule");
  Tensor semaphores = unused, partials = unused;
  fa4_tensor ns = view_of(unused);
#ifdef FA4_DIAG_STAMP_WORDS
  fa4_tensor partials_view = view_of(stamps_buffer(device));
#else
  fa4_tensor partials_view = view_of(unused);
#endif
  if (tail_ctas) {
    int64_t sem_words = 0, partial_words = 0;
    check_status(fa4_split_workspace(index, (int32_t)dv, dev.num_sms, &sem_words, &partial_words), "forward");
    split_workspace(device, stream, sem_words, partial_words, &semaphores, &partials, &ns, &partials_view);
  } else if (!variant.split_tail) {  // a dynamic schedule: the kernel claims tiles from a counter
    ns = zeroed_counters(device, stream, {1}, &semaphores);
  }
  TraceCall trace_call;
  int64_t trace_base = 0, trace_capacity = 0;
  if (traced) {
    // The records go past the scheduler's words, in a zeroed vector of the call's own.
    int64_t scheduler_words = 1, partial_words = 0, words = 0;
    if (tail_ctas) check_status(fa4_split_workspace(index, (int32_t)dv, dev.num_sms, &scheduler_words, &partial_words),
                                "forward");
    int64_t tiles = varlen ? pairs * ((tile_rows + block_rows - 1) / block_rows)
                           : b * (hq / packed) * ((sq + block_rows - 1) / block_rows);
    trace_capacity = tiles + 2 * (int64_t)grid + 64;  // a split tail's pieces: at most one per CTA
    trace_base = trace_record_base(scheduler_words, trace_capacity, &words);
    semaphores = zeros({words}, aoti_torch_dtype_int32(), device, 4, stream);
    int32_t head[16] = {0};
    bool deal = !variant.split_tail && tune.trace_schedule == 1;
    for (auto &entry : trace_header(trace_base, trace_capacity, deal)) head[entry.first] = entry.second;
    cudaError_t err = cudaMemcpyAsync(semaphores.mutable_data_ptr(), head, sizeof(head), cudaMemcpyHostToDevice,
                                      (cudaStream_t)stream);
    FA4_CHECK(err == cudaSuccess, "fa4: writing the trace header failed: ", cudaGetErrorString(err));
    ns = view_of(semaphores);
    trace_call.op = cache ? "fwd_kvcache" : varlen ? "fwd_varlen" : "fwd";
    trace_call.dynamic = !variant.split_tail, trace_call.dealt = deal, trace_call.varlen = varlen != nullptr;
    trace_call.device = device, trace_call.num_sms = dev.num_sms, trace_call.grid = grid;
    trace_call.tail_ctas = tail_ctas, trace_call.pack_gqa = packed;
    trace_call.tile_m = variant.tile_m, trace_call.tile_n = variant.tile_n, trace_call.mask = mask_name(mask.kind);
    trace_call.batch = varlen ? varlen->cu_q.size(0) - 1 : b, trace_call.seqlen_q = sq, trace_call.seqlen_k = sk;
    trace_call.heads_q = hq, trace_call.heads_kv = hkv, trace_call.head_dim = d, trace_call.head_dim_v = dv;
  } else if (!untraced.empty()) {
    std::string err = trace_note_untraced(tune.trace_path, cache ? "fwd_kvcache" : varlen ? "fwd_varlen" : "fwd",
                                          variant.name, untraced);
    FA4_VALUE(err.empty(), "fa4: ", err);
  }
  fa4_fwd_params params{(float)scale, (float)softcap, mask.window_left, mask.window_right, group, grid,
                        (int32_t)tile_rows, (varlen && varlen->used_k) || cache ? 1 : 0, packed, tail_ctas,
                        cache ? (int32_t)cache->page_size : 0, cache ? (int32_t)cache->seqlen_new : 0};
  fa4_tensor nk = view_of(k, lead), nv = view_of(v, lead), no = view_of(out, lead), nl = view_of(lse, lead);
  nq = view_of(q, lead);
  fa4_tensor pages = nq, k_new = nk, v_new = nv;
  if (cache) {
    used_k = view_of(cache->cache_seqlens);
    pages = view_of(cache->page_table);
    if (pages.rank == 1) pages.rank = 2, pages.shape[1] = 1, pages.stride[1] = 1;  // (batch,) as (batch, 1)
    k_new = view_of(cache->k_new), v_new = view_of(cache->v_new);
  }
  phases.mark("workspace");
  DeviceGuard guard(device);
  check_status(fa4_fwd(index, &nq, &nk, &nv, &no, &nl, &ns, &partials_view, &cu_q, &cu_k, &used_k, &order, nullptr,
                       nullptr, nullptr, nullptr, cache ? &pages : nullptr, cache ? &k_new : nullptr,
                       cache ? &v_new : nullptr, &params, stream),
               "forward kernel");
  phases.mark("launch");
  if (traced) {
    trace_call.variant = variant.name;
    trace_launch(tune.trace_path, trace_call, semaphores, trace_base, trace_capacity, varlen ? &varlen->cu_q : nullptr,
                 stream);
  }
}

std::tuple<Tensor, Tensor> fwd(Tensor q, Tensor k, Tensor v, double softmax_scale, bool causal, int64_t window_left,
                               int64_t window_right, double softcap, std::optional<bool> pack_gqa, bool deterministic) {
  (void)deterministic;  // a backward option the forward op carries for autograd
  Phases phases("fwd");
  check_qkv(q, k, v, 4);
  check_scalars(softmax_scale, softcap);
  check_pack_gqa(pack_gqa, q.size(2), k.size(2));
  fa4_mask mask = resolve_mask(causal, window_left, window_right);
  phases.mark("checks");
  int device = q.get_device_index();
  const int64_t b = q.size(0), sq = q.size(1), hq = q.size(2);
  Tensor out = empty({b, sq, hq, v.size(3)}, dtype_code(q.scalar_type()), device);
  Tensor lse = empty({b, hq, sq}, aoti_torch_dtype_float32(), device);
  phases.mark("outputs");
  if (b == 0 || sq == 0 || hq == 0) return {out, lse};
  if (k.size(1) == 0) {  // nothing to attend to: the empty-row convention
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
    return {out, lse};
  }
  run_forward(q, k, v, out, lse, mask, softmax_scale, softcap, pack_gqa, nullptr, phases);
  return {out, lse};
}

// ------------------------------------------------------------------- block-sparse forward
// A FlexAttention BlockMask as tables at the variant's tile shape (fa4.block_sparse builds them;
// their layout: fa4_fwd in fa4_shim.h). One head's rows per tile (no pack-GQA: the tables are per
// query head). The tables' values are not read on the host (that would sync): the kernel clamps
// counts, blocks and slots into the tensors.
void check_sparse_table(const Tensor &t, const std::string &name, const Tensor &q, int64_t rank) {
  FA4_TYPE(t.scalar_type() == ScalarType::Int && t.dim() == rank, name, " must be a ", rank,
           "-D torch.int32 tensor; got ", t.dim(), "-D ", dtype_name(t.scalar_type()));
  FA4_VALUE(t.is_cuda() && t.get_device_index() == q.get_device_index(), name, " must be on q's device");
  FA4_VALUE(t.numel() == 0 || t.stride(rank - 1) == 1, name, " must be contiguous in its last dimension");
}

// The common checks of a block-sparse op: q/k/v, the scalars and the three tables' types
// (``side``: "kv" for the forward's, "q" for the backward's).
void check_sparse_call(const Tensor &q, const Tensor &k, const Tensor &v, double scale, double softcap,
                       const Tensor &counts, const Tensor &blocks, const Tensor &bits, const std::string &side) {
  check_qkv(q, k, v, 4);
  check_scalars(scale, softcap);
  check_sparse_table(counts, side + "_counts", q, 4);
  check_sparse_table(blocks, side + "_blocks", q, 4);
  check_sparse_table(bits, side + "_bits", q, 1);
}

std::tuple<Tensor, Tensor> fwd_sparse(Tensor q, Tensor k, Tensor v, Tensor counts, Tensor blocks, Tensor bits,
                                      int64_t tile_m, int64_t tile_n, double softmax_scale, double softcap,
                                      std::optional<Tensor> q_counts, std::optional<Tensor> q_blocks,
                                      std::optional<Tensor> q_bits, int64_t bwd_tile_m, int64_t bwd_tile_n,
                                      int64_t score_mod, std::optional<Tensor> score_params) {
  (void)q_counts, (void)q_blocks, (void)q_bits, (void)bwd_tile_m, (void)bwd_tile_n;  // for autograd
  Phases phases("fwd_sparse");
  check_sparse_call(q, k, v, softmax_scale, softcap, counts, blocks, bits, "kv");
  ScoreMod score = check_score_mod(score_mod, score_params, q, softcap, k.size(1));
  int device = q.get_device_index();
  const DeviceFacts &dev = device_facts(device);
  const int64_t b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3), sk = k.size(1), dv = v.size(3);
  Candidates c = find_variants(dev, q.scalar_type(), d, dv, FA4_MASK_SPARSE, softcap > 0.0, false, FA4_KERNEL_FWD,
                               score.kind);
  if (c.family[FA4_TILES_REGULAR] < 0) unsupported(dev, q, d, dv, FA4_MASK_SPARSE, softcap > 0.0, FA4_KERNEL_FWD);
  int32_t index = c.family[FA4_TILES_REGULAR];
  const fa4_variant &variant = fa4_variants[index];
  const int64_t m_blocks = (sq + variant.tile_m - 1) / variant.tile_m;
  const int64_t slot_words = (int64_t)variant.tile_m * (variant.tile_n / 32);
  const std::string tile = "(" + std::to_string(variant.tile_m) + ", " + std::to_string(variant.tile_n) + ")";
  FA4_VALUE(tile_m == variant.tile_m && tile_n == variant.tile_n, "the tables were built for (tile_m, tile_n) = (",
            tile_m, ", ", tile_n, "); this kernel's tiles are ", tile, " (fa4.block_sparse.kernel_tile)");
  FA4_VALUE(counts.size(0) == b && counts.size(1) == hq && counts.size(2) == m_blocks &&
                counts.size(3) == FA4_SPARSE_COUNT_FIELDS,
            "kv_counts must have shape (batch, heads_q, ceil(seqlen_q / ", variant.tile_m, "), ",
            FA4_SPARSE_COUNT_FIELDS, ") = ", tuple_text({b, hq, m_blocks, FA4_SPARSE_COUNT_FIELDS}),
            " for this kernel's ", tile, " tiles; got ", shape_text(counts),
            ". Build the tables with fa4.block_sparse.tables.");
  FA4_VALUE(blocks.size(0) == b && blocks.size(1) == hq && blocks.size(2) == m_blocks && blocks.size(3) >= 1,
            "kv_blocks must have shape (batch, heads_q, ", m_blocks, ", width >= 1); got ", shape_text(blocks));
  FA4_VALUE(bits.numel() >= slot_words && bits.numel() % slot_words == 0,
            "kv_bits must hold whole slots of ", slot_words, " words (", tile, " tiles); got ", bits.numel());
  phases.mark("checks");
  Tensor out = empty({b, sq, hq, dv}, dtype_code(q.scalar_type()), device);
  Tensor lse = empty({b, hq, sq}, aoti_torch_dtype_float32(), device);
  if (b == 0 || sq == 0 || hq == 0) return {out, lse};
  if (sk == 0) {
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
    return {out, lse};
  }
  q = tma_ready(q), k = tma_ready(k), v = tma_ready(v);
  fa4_tuning tune = tuning();
  void *stream = current_stream(device);
  Tensor semaphores;
  fa4_tensor ns = zeroed_counters(device, stream, {1}, &semaphores);  // the dynamic schedule's tile counter
  int32_t group = fa4_heads_per_group(dev.l2_bytes, sk, (int32_t)d, (int32_t)dv, (int32_t)q.element_size(), b * hq,
                                      tune.l2_swizzle_bytes, FA4_MASK_SPARSE, m_blocks, dev.num_sms);
  int32_t grid = fa4_grid_size(dev.num_sms, FA4_MASK_SPARSE, tune.persistent);
  fa4_fwd_params params{(float)softmax_scale, (float)softcap, 0, 0, group, grid, 1, 0, 1, 0};
  const Tensor &unused = unused_vector(device);
  fa4_tensor nu = view_of(unused);
  fa4_tensor nq = view_of(q), nk = view_of(k), nv = view_of(v), no = view_of(out), nl = view_of(lse);
  fa4_tensor nc = view_of(counts), nb = view_of(blocks), nbits = view_of(bits);
  fa4_tensor nscore = score.kind != FA4_SCORE_NONE ? score_view(score, score.params, q) : nu;
  phases.mark("workspace");
  DeviceGuard guard(device);
  check_status(fa4_fwd(index, &nq, &nk, &nv, &no, &nl, &ns, &nu, &nu, &nu, &nu, &nu, &nc, &nb, &nbits,
                       score.kind != FA4_SCORE_NONE ? &nscore : nullptr, nullptr, nullptr, nullptr, &params, stream),
               "block-sparse forward kernel");
  phases.mark("launch");
  return {out, lse};
}

// ------------------------------------------------------------------------------ KV cache
// Attention of q against a KV cache, appending k_new/v_new at cache_seqlens first (the kernel
// writes them: the schema marks k_cache and v_cache mutated). Paged: k_cache (num_pages, page_size,
// heads_kv, d) with page_table (batch, max_pages); contiguous: (batch_cache, seqlen_cache, heads_kv, d)
// with cache_batch_idx (batch,) naming each sequence's row. The device reads cache_seqlens and the
// tables; what needs their values (lengths within the capacity, pages in range) is not checked
// here (a sync), and the kernel clamps them so a bad value gives wrong rows, never accesses outside.
std::tuple<Tensor, Tensor> fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens,
                                       std::optional<Tensor> k_new, std::optional<Tensor> v_new,
                                       std::optional<Tensor> page_table, std::optional<Tensor> cache_batch_idx,
                                       double softmax_scale, bool causal, int64_t window_left,
                                       int64_t window_right, double softcap, std::optional<bool> pack_gqa,
                                       int64_t num_splits) {
  Phases phases("fwd_kvcache");
  check_qkv(q, k_cache, v_cache, 4, false);
  check_scalars(softmax_scale, softcap);
  check_pack_gqa(pack_gqa, q.size(2), k_cache.size(2));
  FA4_VALUE(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1),
            "k_cache and v_cache must have the same (pages or batch, rows) shape; got ", shape_text(k_cache), " and ",
            shape_text(v_cache));
  const int64_t b = q.size(0), sq = q.size(1), hq = q.size(2);
  check_offsets(cache_seqlens, "cache_seqlens", q);
  FA4_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == b, "cache_seqlens must hold one length per batch "
            "row (", b, "); got ", shape_text(cache_seqlens));
  FA4_VALUE(k_new.has_value() == v_new.has_value(), "k_new and v_new must be given together");
  FA4_VALUE(num_splits >= 0, "num_splits must be >= 0 (0: fa4 chooses, 1: no split); got ", num_splits);
  KvCache cache;
  cache.num_splits = num_splits;
  if (k_new) {
    const Tensor &kn = *k_new, &vn = *v_new;
    FA4_VALUE(kn.dim() == 4 && vn.dim() == 4 && kn.size(0) == b && vn.size(0) == b && kn.size(1) == vn.size(1) &&
              kn.size(2) == k_cache.size(2) && vn.size(2) == k_cache.size(2) && kn.size(3) == k_cache.size(3) &&
              vn.size(3) == v_cache.size(3),
              "k_new/v_new must be (batch = ", b, ", seqlen_new, heads_kv = ", k_cache.size(2), ", head_dim); got ",
              shape_text(kn), " and ", shape_text(vn));
    FA4_TYPE(kn.scalar_type() == q.scalar_type() && vn.scalar_type() == q.scalar_type(),
             "k_new and v_new must have q's dtype");
    FA4_VALUE(kn.is_cuda() && vn.is_cuda() && kn.get_device_index() == q.get_device_index() &&
              vn.get_device_index() == q.get_device_index(), "k_new and v_new must be on q's device");
    cache.seqlen_new = kn.size(1);
    if (cache.seqlen_new > 0) cache.k_new = tma_ready(kn), cache.v_new = tma_ready(vn);
  }
  if (cache.seqlen_new == 0) cache.k_new = k_cache, cache.v_new = v_cache;  // placeholders, never read
  cache.page_size = k_cache.size(1);
  if (page_table) {
    FA4_VALUE(!cache_batch_idx, "cache_batch_idx is for contiguous caches; a paged cache names each sequence's "
              "pages in page_table");
    const Tensor &t = *page_table;
    FA4_TYPE(t.scalar_type() == ScalarType::Int && t.dim() == 2, "page_table must be a 2-D torch.int32 tensor; got ",
             t.dim(), "-D ", dtype_name(t.scalar_type()));
    FA4_VALUE(t.is_cuda() && t.get_device_index() == q.get_device_index(), "page_table must be on q's device");
    FA4_VALUE(t.size(0) == b && t.size(1) >= 1, "page_table must be (batch = ", b, ", max_pages >= 1); got ",
              shape_text(t));
    FA4_VALUE(fa4_kv_page_size(cache.page_size, t.size(1)) == 0, fa4_rules_error());
    cache.page_table = t.is_contiguous() ? t : torch::stable::contiguous(t);
    cache.max_pages = t.size(1);
  } else {
    FA4_VALUE(cache_batch_idx.has_value(), "give cache_batch_idx (contiguous cache) or page_table (paged cache)");
    const Tensor &t = *cache_batch_idx;
    check_offsets(t, "cache_batch_idx", q);
    FA4_VALUE(t.dim() == 1 && t.size(0) == b, "cache_batch_idx must hold one cache row per batch row (", b,
              "); got ", shape_text(t));
    FA4_VALUE(fa4_kv_page_size(cache.page_size, -1) == 0, fa4_rules_error());
    // One page per sequence; read as (batch, 1) at the launch (a view here cost a dispatcher call).
    cache.page_table = t.is_contiguous() ? t : torch::stable::contiguous(t);
    cache.max_pages = 1;
  }
  cache.capacity = cache.max_pages * cache.page_size;
  cache.cache_seqlens = cache_seqlens.is_contiguous() ? cache_seqlens : torch::stable::contiguous(cache_seqlens);
  fa4_mask mask = resolve_mask(causal, window_left, window_right);
  phases.mark("checks");
  int device = q.get_device_index();
  Tensor out = empty({b, sq, hq, v_cache.size(3)}, dtype_code(q.scalar_type()), device);
  Tensor lse = empty({b, hq, sq}, aoti_torch_dtype_float32(), device);
  phases.mark("outputs");
  if (b == 0 || sq == 0 || hq == 0) return {out, lse};
  run_forward(q, k_cache, v_cache, out, lse, mask, softmax_scale, softcap, pack_gqa, nullptr, phases, &cache);
  return {out, lse};
}

void check_varlen(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q, const Tensor &cu_k,
                  const std::optional<Tensor> &used_k, int64_t max_q, int64_t max_k) {
  check_qkv(q, k, v, 3);
  check_offsets(cu_q, "cu_seqlens_q", q);
  check_offsets(cu_k, "cu_seqlens_k", q);
  if (used_k) check_offsets(*used_k, "seqused_k", q);
  FA4_VALUE(cu_q.size(0) >= 2 && cu_q.size(0) == cu_k.size(0),
            "cu_seqlens_q and cu_seqlens_k must both hold num_sequences + 1 >= 2 offsets; got ", cu_q.size(0), " and ",
            cu_k.size(0));
  FA4_VALUE(!used_k || used_k->size(0) == cu_q.size(0) - 1, "seqused_k must hold one count per sequence (",
            cu_q.size(0) - 1, "); got ", used_k ? used_k->size(0) : 0);
  FA4_VALUE(max_q >= 0 && max_k >= 0, "max_seqlen_q and max_seqlen_k must be >= 0");
}

std::tuple<Tensor, Tensor> fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k,
                                      std::optional<Tensor> used_k, int64_t max_q, int64_t max_k,
                                      double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                                      double softcap, std::optional<bool> pack_gqa, bool deterministic) {
  (void)deterministic;
  check_varlen(q, k, v, cu_q, cu_k, used_k, max_q, max_k);
  check_scalars(softmax_scale, softcap);
  check_pack_gqa(pack_gqa, q.size(1), k.size(1));
  fa4_mask mask = resolve_mask(causal, window_left, window_right);
  int device = q.get_device_index();
  Tensor out = empty({q.size(0), q.size(1), v.size(2)}, dtype_code(q.scalar_type()), device);
  Tensor lse = empty({q.size(1), q.size(0)}, aoti_torch_dtype_float32(), device);
  if (q.size(0) == 0 || q.size(1) == 0) return {out, lse};
  if (k.size(0) == 0) {
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
    return {out, lse};
  }
  Varlen varlen{cu_q, cu_k, used_k, max_q, max_k};
  Phases phases("fwd_varlen");
  run_forward(q, k, v, out, lse, mask, softmax_scale, softcap, pack_gqa, &varlen, phases);
  return {out, lse};
}

// --------------------------------------------------------------------------- backward
// The CUDA backward: three compiled kernels.
// preprocess  (src/fa4_kernels/sm90/bwd_preprocess.py) the row statistics the main kernel reads,
//             in its padded layout: LSE * log2(e) (+inf where a row sees no key and in the
//             padding, so those rows' probabilities are 0) and dPsum = rowsum(dO * O) - dLSE (the
//             gradient through the returned LSE folds in here: d LSE / d s = p, so
//             dS = p * (dP - dPsum + dLSE)); it also zeroes what the main kernel leaves
//             unwritten: with first stores (fa4_bwd_store_first) only dQ accumulator rows that see
//             no key (and packed sequences' partial last query blocks), and with packed sequences
//             dK/dV past seqused_k and every row outside all sequences;
// main        (sm90/bwd.py) dQ accumulated in fp32 (scaled) by TMA reduce-adds, the first K/V
//             block to reach a query block storing instead (whole blocks), staged in the finished
//             Q/dO stage at hd256; dK and dV written once per K/V block (GQA groups summed inside
//             the kernel); one int32 counter per (sequence, head, query block), zero at launch,
//             holds the first-store claims and, when deterministic, orders each query block's dQ
//             additions by K/V block;
// postprocess (sm90/bwd_postprocess.py) dQ to the input dtype, a flat pass over the accumulator.
// dQ's accumulator and the statistics share one fp32 workspace.
// No step reads a device value on the host: varlen offsets stay on the GPU; the grids cover
// max_seqlen_q / max_seqlen_k (FlashAttention's contract: they bound every sequence). The
// buffers' contracts: fa4_shim.h.
std::tuple<Tensor, Tensor, Tensor> run_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                const Tensor &lse, std::optional<Tensor> dlse, fa4_mask mask,
                                                double scale, double softcap, bool deterministic,
                                                const Varlen *varlen, Phases &phases,
                                                const SparseTables *sparse = nullptr,
                                                const ScoreMod *score = nullptr, Tensor *score_grad = nullptr) {
  const int32_t score_kind = score ? score->kind : FA4_SCORE_NONE;
  int device = q.get_device_index();
  const DeviceFacts &dev = device_facts(device);
  int lead = varlen ? 1 : 0;
  const int64_t b = varlen ? 1 : q.size(0), sq = q.size(lead ? 0 : 1), hq = q.size(lead ? 1 : 2);
  const int64_t d = q.size(lead ? 2 : 3), sk = k.size(lead ? 0 : 1), dv = v.size(lead ? 2 : 3);
  if (sparse) mask = fa4_mask{FA4_MASK_SPARSE, 0, 0};
  else if (!varlen) mask = fa4_effective_mask(mask, sq, sk);  // as the forward ran
  // Causal calls run the window kernel (fa4_bwd_causal_mask) with their window (unbounded left side,
  // fa4_resolve_mask); the rules below still see the call's kind.
  const int32_t variant_mask = mask.kind == FA4_MASK_CAUSAL ? fa4_bwd_causal_mask : mask.kind;
  Candidates main_c =
      find_variants(dev, q.scalar_type(), d, dv, variant_mask, softcap > 0.0, varlen, FA4_KERNEL_BWD, score_kind);
  // One preprocess serves dense and packed sequences (fa4_bwd_pre_params.varlen).
  Candidates pre_c = find_variants(dev, q.scalar_type(), d, dv, FA4_MASK_NONE, false, false, FA4_KERNEL_BWD_PRE);
  Candidates post_c = find_variants(dev, q.scalar_type(), 0, 0, FA4_MASK_NONE, false, false, FA4_KERNEL_BWD_POST);
  if (main_c.family[0] < 0 || pre_c.family[0] < 0 || post_c.family[0] < 0)
    unsupported(dev, q, d, dv, variant_mask, softcap > 0.0, FA4_KERNEL_BWD);
  fa4_tuning tune = tuning();
  // The tile family: 2-CTA clusters ("long") where built and measured faster; the shim runs the
  // regular twin instead where the device does not fit them (fa4_variant.fallback).
  const int32_t main_index = main_c.family[fa4_bwd_tile_family(varlen != nullptr, deterministic,
                                                               main_c.family[FA4_TILES_LONG] >= 0,
                                                               tune.bwd_clusters)];
  const fa4_variant &main_v = fa4_variants[main_index], &pre_v = fa4_variants[pre_c.family[0]];
  if (sparse)
    FA4_VALUE(sparse->tile_m == main_v.tile_m && sparse->tile_n == main_v.tile_n,
              "the backward tables were built for (tile_m, tile_n) = (", sparse->tile_m, ", ", sparse->tile_n,
              "); this kernel's tiles are (", main_v.tile_m, ", ", main_v.tile_n, ") (fa4.block_sparse.kernel_tile)");
  void *stream = current_stream(device);
  phases.mark("select");
  q = tma_ready(q), k = tma_ready(k), v = tma_ready(v), dout = tma_ready(dout), out = tma_ready(out);
  phases.mark("tma_ready");
  // The preprocess works on (and pads the statistics in) blocks of its tile_m rows.
  const int64_t stats_block = pre_v.tile_m, tile_n = main_v.tile_n;
  int64_t num_m_blocks, num_n_blocks, zero_rows;  // num_m_blocks: the preprocess's grid x
  int32_t store_first;
  Tensor dk, dv_out;
  std::vector<int64_t> q_shape = shape_of(q), k_shape = shape_of(k), v_shape = shape_of(v);
  int32_t f32 = aoti_torch_dtype_float32(), io = dtype_code(q.scalar_type());
  int64_t sequences = varlen ? varlen->cu_q.size(0) - 1 : b;
  // One fp32 workspace: dQ's accumulator (q's shape), then LSE * log2(e) and dPsum, (b, hq, rows)
  // each, then the main kernel's int32 count of K/V blocks done per sequence (the preprocess
  // zeroes it; the dQ conversion waits on it). The accumulator's size is a multiple of head_dim
  // (>= 32 floats): the statistics start 128-byte aligned, and the counts 16-byte aligned. One
  // allocation instead of several: each costs ~2.5 us of host time.
  const int64_t acc_words = numel(q_shape);
  const int64_t rows = fa4_stats_rows(sq, (int32_t)stats_block, varlen ? sequences : -1);
  Tensor workspace = empty({acc_words + 2 * b * hq * rows + sequences}, f32, device);
  float *acc_data = static_cast<float *>(workspace.mutable_data_ptr());
  fa4_tensor n_seq_done = dense_view(acc_data + acc_words + 2 * b * hq * rows, {sequences});
  if (!varlen) {
    num_m_blocks = (sq + stats_block - 1) / stats_block;
    num_n_blocks = (sk + tile_n - 1) / tile_n;
    double blocks = fa4_mean_visible_keys(sq, sk, mask) / (double)tile_n;  // per query block
    // Block-sparse: zero-and-add (which K/V block reaches a query block first is the tables').
    store_first = sparse ? 0 : fa4_bwd_store_first(num_n_blocks, blocks, tune.bwd_store_first);
    // The preprocess zeroes dQ's accumulator (with store_first only the rows no K/V block
    // reaches); every key row is in a visited K/V block.
    zero_rows = store_first ? fa4_keyless_rows(sq, sk, mask) : sq;
    dk = empty(k_shape, io, device);
    dv_out = empty(v_shape, io, device);
  } else {
    const int64_t max_q = std::min(varlen->max_seqlen_q, sq), max_k = std::min(varlen->max_seqlen_k, sk);
    num_m_blocks = rows / stats_block;  // the preprocess's flat grid over every statistics block
    num_n_blocks = std::max<int64_t>(1, (max_k + tile_n - 1) / tile_n);
    // K/V blocks per query block of the longest sequences (the host sees no other lengths).
    double blocks = fa4_mean_visible_keys(max_q, max_k, mask) / (double)tile_n;
    store_first = fa4_bwd_store_first(num_n_blocks, blocks, tune.bwd_store_first);
    // Rows outside every sequence and keys past seqused_k get no gradient: the preprocess zeroes
    // them, and the accumulator's rows no first store writes (fa4_bwd_pre_params).
    zero_rows = 0;
    dk = empty(k_shape, io, device);
    dv_out = empty(v_shape, io, device);
  }
  phases.mark("gradients");
  // Deterministic turns' dQ writer warps (0: not deterministic), and the chunks of their rotation.
  const int32_t dq_writers = fa4_bwd_dq_writers(deterministic, varlen != nullptr, mask.kind, (int32_t)d,
                                                num_n_blocks, dev.num_sms, tune.bwd_dq_writers);
  int32_t rotate = fa4_bwd_rotate(mask.kind, deterministic, store_first, num_n_blocks, dev.num_sms, main_v.tile_m,
                                  main_v.tile_n, tune.bwd_rotate,
                                  fa4_bwd_turn_spacing(dq_writers, tune.bwd_turn_spacing));
  int64_t counted_rows = varlen ? std::min(varlen->max_seqlen_q, sq) : sq;
  Tensor semaphores = unused_vector(device);
  fa4_tensor n_sem = unused_rank3(device);
  if (deterministic || store_first) {
    int64_t blocks = std::max<int64_t>(1, (counted_rows + main_v.tile_m - 1) / main_v.tile_m);
    n_sem = zeroed_counters(device, stream, {sequences, hq, blocks}, &semaphores);
  }
  fa4_tensor n_lse2 = dense_view(acc_data + acc_words, {b, hq, rows});
  fa4_tensor n_dpsum = dense_view(acc_data + acc_words + b * hq * rows, {b, hq, rows});
  // dLSE from autograd may be any view (an expanded ones tensor for lse.sum()): rows contiguous.
  if (dlse && !dlse->is_contiguous()) dlse = torch::stable::contiguous(*dlse);
  const Tensor &unused = unused_vector(device);
  fa4_tensor cu_q = view_of(unused), cu_k = cu_q, used_k = cu_q;
  if (varlen) {
    cu_q = view_of(varlen->cu_q), cu_k = view_of(varlen->cu_k);
    used_k = varlen->used_k ? view_of(*varlen->used_k) : cu_q;
  }
  fa4_tensor n_out = view_of(out, lead), n_dout = view_of(dout, lead), n_lse = view_of(lse, lead);
  fa4_tensor n_dlse = dlse ? view_of(*dlse, lead) : n_lse;
  fa4_tensor n_acc = dense_view(acc_data, {b, sq, hq, d});  // packed sequences: batch 1
  fa4_tensor n_q = view_of(q, lead), n_k = view_of(k, lead), n_v = view_of(v, lead);
  fa4_tensor n_dk = view_of(dk, lead), n_dv = view_of(dv_out, lead);
  fa4_tensor n_counts{}, n_blocks{}, n_bits{};
  if (sparse) n_counts = view_of(sparse->counts), n_blocks = view_of(sparse->blocks), n_bits = view_of(sparse->bits);
  // A score_mod's parameters, and their gradient when asked for (fp32, zeroed: the kernel adds
  // into it; 0 rows: none).
  fa4_tensor n_score{}, n_score_grad{};
  if (score_kind != FA4_SCORE_NONE) {
    n_score = score_view(*score, score->params, q);
    if (score_grad) {
      *score_grad = zeros(shape_of(score->params), f32, device, 4, stream);
      n_score_grad = score_view(*score, *score_grad, q);
    } else {
      n_score_grad = n_score;
      n_score_grad.shape[0] = 0;
    }
  }
  fa4_bwd_pre_params pre_params{dlse ? 1 : 0, (int32_t)zero_rows, (int32_t)num_m_blocks, varlen ? 1 : 0,
                                store_first, mask.window_right, varlen && varlen->used_k ? 1 : 0};
  fa4_bwd_params params{(float)scale, (float)softcap, mask.window_left, mask.window_right, (int32_t)num_n_blocks,
                        varlen && varlen->used_k ? 1 : 0, dq_writers, rotate, store_first,
                        fa4_bwd_launch_group(mask.kind, varlen != nullptr, deterministic, rotate, num_n_blocks,
                                             b * k.size(lead ? 1 : 2), dev.num_sms, tune.bwd_launch_group)};
  phases.mark("workspace");
  {
    DeviceGuard guard(device);
    check_status(fa4_bwd_preprocess(pre_c.family[0], &n_out, &n_dout, &n_lse, &n_dlse, &n_lse2, &n_dpsum, &n_acc,
                                    &n_dk, &n_dv, &cu_q, &cu_k, &used_k, &n_seq_done, &pre_params, stream),
                 "backward preprocess");
    phases.mark("launch preprocess");
    check_status(fa4_bwd(main_index, &n_q, &n_k, &n_v, &n_dout, &n_lse2, &n_dpsum, &n_acc, &n_dk, &n_dv, &cu_q,
                         &cu_k, &used_k, &n_sem, &n_seq_done, sparse ? &n_counts : nullptr,
                         sparse ? &n_blocks : nullptr, sparse ? &n_bits : nullptr, score_kind ? &n_score : nullptr,
                         score_kind ? &n_score_grad : nullptr, &params, stream),
                 "backward kernel");
    phases.mark("launch main");
    // dQ in the input dtype: the postprocess kernel (a torch copy cost ~10-12 us of host time).
    Tensor dq = empty(q_shape, io, device);
    fa4_tensor flat_acc = dense_view(acc_data, {acc_words}), flat_dq = dense_view(dq.mutable_data_ptr(), {acc_words});
    // Each sequence's rows once its K/V blocks (num_n_blocks per K/V head) are all counted done.
    fa4_bwd_post_params post_params{0, (int32_t)(hq * d), (int32_t)sq, (int32_t)(num_n_blocks * k.size(lead ? 1 : 2)),
                                    varlen ? 1 : 0};
    check_status(fa4_bwd_postprocess(post_c.family[0], &flat_acc, &flat_dq, &n_seq_done, &cu_q, &post_params, stream),
                 "backward postprocess");
    phases.mark("convert dq");
    return {dq, dk, dv_out};
  }
}

std::tuple<Tensor, Tensor, Tensor> zero_grads(const Tensor &q, const Tensor &k, const Tensor &v) {
  int device = q.get_device_index();
  void *stream = current_stream(device);
  size_t elem = q.element_size();
  int32_t io = dtype_code(q.scalar_type());
  return {zeros(shape_of(q), io, device, elem, stream), zeros(shape_of(k), io, device, elem, stream),
          zeros(shape_of(v), io, device, elem, stream)};
}

std::tuple<Tensor, Tensor, Tensor> bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                       std::optional<Tensor> dlse, double softmax_scale, bool causal,
                                       int64_t window_left, int64_t window_right, double softcap, bool deterministic) {
  Phases phases("bwd");
  check_qkv(q, k, v, 4);
  check_scalars(softmax_scale, softcap);
  fa4_mask mask = resolve_mask(causal, window_left, window_right);
  phases.mark("checks");
  if (q.size(0) == 0 || q.size(1) == 0 || q.size(2) == 0 || k.size(1) == 0) return zero_grads(q, k, v);
  return run_backward(dout, q, k, v, out, lse, dlse, mask, softmax_scale, softcap, deterministic, nullptr, phases);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_sparse(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                      Tensor lse, std::optional<Tensor> dlse, Tensor counts,
                                                      Tensor blocks, Tensor bits, int64_t tile_m, int64_t tile_n,
                                                      double softmax_scale, double softcap, int64_t score_mod,
                                                      std::optional<Tensor> score_params, bool score_grad) {
  Phases phases("bwd_sparse");
  check_sparse_call(q, k, v, softmax_scale, softcap, counts, blocks, bits, "q");
  ScoreMod score = check_score_mod(score_mod, score_params, q, softcap, k.size(1));
  int device = q.get_device_index();
  const int64_t n_blocks = tile_n > 0 ? (k.size(1) + tile_n - 1) / tile_n : -1;
  FA4_VALUE(tile_m > 0 && tile_m % 32 == 0 && tile_n > 0, "tile_m must be a positive multiple of 32 and tile_n > 0");
  FA4_VALUE(counts.size(0) == q.size(0) && counts.size(1) == q.size(2) && counts.size(2) == n_blocks &&
                counts.size(3) == FA4_SPARSE_COUNT_FIELDS,
            "q_counts must have shape (batch, heads_q, ceil(seqlen_k / ", tile_n, "), ", FA4_SPARSE_COUNT_FIELDS,
            ") = ", tuple_text({q.size(0), q.size(2), n_blocks, FA4_SPARSE_COUNT_FIELDS}), "; got ",
            shape_text(counts),
            ". Build the tables with fa4.block_sparse.tables(..., transposed=True).");
  FA4_VALUE(blocks.size(0) == q.size(0) && blocks.size(1) == q.size(2) && blocks.size(2) == n_blocks &&
                blocks.size(3) >= 1,
            "q_blocks must have shape (batch, heads_q, ", n_blocks, ", width >= 1); got ", shape_text(blocks));
  FA4_VALUE(bits.numel() >= tile_n * tile_m / 32 && bits.numel() % (tile_n * tile_m / 32) == 0,
            "q_bits must hold whole slots of ", tile_n * tile_m / 32, " words; got ", bits.numel());
  phases.mark("checks");
  // The parameters' gradient: their shape, fp32, when asked for (run_backward zeroes it for the
  // kernel to add into), else that shape with 0 rows ((0, 0) without a score_mod).
  const bool with_grad = score_grad && score.kind != FA4_SCORE_NONE;
  std::vector<int64_t> score_shape = score.kind != FA4_SCORE_NONE ? shape_of(score.params) : std::vector<int64_t>{0, 0};
  Tensor dscore;
  if (!with_grad) {
    std::vector<int64_t> none = score_shape;
    none[0] = 0;
    dscore = empty(none, aoti_torch_dtype_float32(), device);
  }
  if (q.size(0) == 0 || q.size(1) == 0 || q.size(2) == 0 || k.size(1) == 0) {
    if (with_grad) dscore = zeros(score_shape, aoti_torch_dtype_float32(), device, 4, current_stream(device));
    auto [dq, dk, dv] = zero_grads(q, k, v);
    return {dq, dk, dv, dscore};
  }
  if (!bits.is_contiguous()) bits = torch::stable::contiguous(bits);
  SparseTables sparse{counts, blocks, bits, tile_m, tile_n};
  auto [dq, dk, dv] = run_backward(dout, q, k, v, out, lse, dlse, fa4_mask{FA4_MASK_SPARSE, 0, 0}, softmax_scale,
                                   softcap, false, nullptr, phases, &sparse, &score, with_grad ? &dscore : nullptr);
  return {dq, dk, dv, dscore};
}

std::tuple<Tensor, Tensor, Tensor> bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                              std::optional<Tensor> dlse, Tensor cu_q, Tensor cu_k,
                                              std::optional<Tensor> used_k, int64_t max_q, int64_t max_k,
                                              double softmax_scale, bool causal, int64_t window_left,
                                              int64_t window_right, double softcap, bool deterministic) {
  check_varlen(q, k, v, cu_q, cu_k, used_k, max_q, max_k);
  check_scalars(softmax_scale, softcap);
  fa4_mask mask = resolve_mask(causal, window_left, window_right);
  if (q.size(0) == 0 || q.size(1) == 0 || k.size(0) == 0) return zero_grads(q, k, v);
  Varlen varlen{cu_q, cu_k, used_k, max_q, max_k};
  Phases phases("bwd_varlen");
  return run_backward(dout, q, k, v, out, lse, dlse, mask, softmax_scale, softcap, deterministic, &varlen, phases);
}

}  // namespace

// The oldest torch whose stable ABI this library was built for (TORCH_TARGET_VERSION: major and
// minor in the top two bytes); fa4.info reports it.
extern "C" __attribute__((visibility("default"))) uint64_t fa4_torch_target_version(void) {
  return TORCH_TARGET_VERSION;
}

#ifdef FA4_DIAG_HOST_TIMING
// "op phase calls total_us" lines into buf (truncated to size); resets the totals.
extern "C" __attribute__((visibility("default"))) int32_t fa4_diag_host_phases(char *buf, int64_t size) {
  std::string text;
  for (auto &entry : phase_totals())
    text += entry.first + " " + std::to_string(entry.second.first) + " " + std::to_string(entry.second.second) + "\n";
  phase_totals().clear();
  snprintf(buf, (size_t)size, "%s", text.c_str());
  return 0;
}
#endif

#ifdef FA4_DIAG_STAMP_WORDS
extern "C" __attribute__((visibility("default"))) int32_t fa4_diag_stamps(int32_t device, void **data,
                                                                         int64_t *words) {
  *data = stamps_buffer(device).mutable_data_ptr();
  *words = FA4_DIAG_STAMP_WORDS;
  return 0;
}
#endif

// The operators (fa4_schemas.c): loading this library defines them, so a process without Python
// (an AOTInductor model) has them too; fa4 (Python) adds the fake, CPU and autograd kernels.
STABLE_TORCH_LIBRARY(fa4, m) {
  for (int32_t i = 0; i < fa4_schema_count(); i++) m.def(fa4_schema(i));
}

STABLE_TORCH_LIBRARY_IMPL(fa4, CUDA, m) {
  m.impl("fwd", TORCH_BOX(&fwd));
  m.impl("bwd", TORCH_BOX(&bwd));
  m.impl("fwd_varlen", TORCH_BOX(&fwd_varlen));
  m.impl("bwd_varlen", TORCH_BOX(&bwd_varlen));
  m.impl("fwd_sparse", TORCH_BOX(&fwd_sparse));
  m.impl("bwd_sparse", TORCH_BOX(&bwd_sparse));
  m.impl("fwd_kvcache", TORCH_BOX(&fwd_kvcache));
}
