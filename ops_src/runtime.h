// redfuser-ops runtime glue: argument checks, device/stream/arch handling, lazy kernel init,
// CPU helpers and the build-info registry. Hand-written; LibTorch stable ABI only
// (built with -DTORCH_STABLE_ONLY -DTORCH_TARGET_VERSION=0x020A000000000000, i.e. torch >= 2.10).
//
// Every error thrown here is a std::runtime_error whose message starts with "redfuser::<op>: "
// and names the offending argument; torch turns it into a Python RuntimeError.
//
// This header does not include CUDA headers and compiles in CPU-only builds (REDFUSER_ARCHS
// empty). In such builds the CUDA functions exist but throw "built without CUDA".
//
// Conventions for generated code:
//   * define the schemas with STABLE_TORCH_LIBRARY_FRAGMENT(redfuser, m) (ops_src/registry.cpp
//     owns the one STABLE_TORCH_LIBRARY(redfuser, m)), kernels with
//     STABLE_TORCH_LIBRARY_IMPL(redfuser, CPU|CUDA, m);
//   * declare every variant for build info with a static redfuser::BuildInfoEntry;
//   * a CUDA variant is a static redfuser::CudaVariant; launch it through redfuser::launch().
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// Everything here is internal to _C.so (torch's stable types are hidden too).
#define REDFUSER_HIDDEN __attribute__((visibility("hidden")))

namespace redfuser REDFUSER_HIDDEN {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

// ============================================================================================
// Errors
// ============================================================================================

// Throws std::runtime_error("redfuser::<op>: <message>").
[[noreturn]] void fail(std::string_view op, std::string_view message);

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  ((os << parts), ...);
  return os.str();
}
}  // namespace detail

// fail() with the message built from `parts` by operator<<.
template <class... Parts>
[[noreturn]] void failf(std::string_view op, const Parts&... parts) {
  fail(op, detail::concat(parts...));
}

// Throws unless `cond`; the message is only built on failure.
template <class... Parts>
inline void check(bool cond, std::string_view op, const Parts&... parts) {
  if (!cond) failf(op, parts...);
}

// ============================================================================================
// Names used in messages
// ============================================================================================

// torch's Python spelling: "float16", "bfloat16", "float32", "float8_e4m3fn", "int32", ...
std::string dtype_name(ScalarType t);
// "cpu", "cuda:0", ...
std::string device_name(const Tensor& t);

// ============================================================================================
// Argument checks. `op` is the op name without namespace, `arg` the argument's name as in the
// schema (or an expression such as "block_table").
// ============================================================================================

// t must be defined (not an undefined tensor).
void check_defined(std::string_view op, std::string_view arg, const Tensor& t);
// dtype in an allowed set: "q must be float16 or bfloat16, got float32".
void check_dtype(std::string_view op, std::string_view arg, const Tensor& t,
                 std::initializer_list<ScalarType> allowed);
// same dtype as another argument: "k must have q's dtype bfloat16, got float16".
void check_same_dtype(std::string_view op, std::string_view arg, const Tensor& t,
                      std::string_view ref_arg, const Tensor& ref);
// number of dims; `layout` is printed when given: "q must be 4-D (B, Sq, H, D), got 3-D".
void check_ndim(std::string_view op, std::string_view arg, const Tensor& t, int64_t ndim,
                std::string_view layout = {});
// t.size(dim) == expected, where `expected_expr` names where the expected value comes from:
// "k.size(3) must equal q.size(3) (D): got 64, expected 128". dim may be negative.
void check_size(std::string_view op, std::string_view arg, const Tensor& t, int64_t dim,
                int64_t expected, std::string_view expected_expr);
// Two integer expressions must be equal: "H % Hk (= 3) must equal 0 (= 0)".
void check_equal(std::string_view op, std::string_view lhs_expr, int64_t lhs,
                 std::string_view rhs_expr, int64_t rhs);

enum class DeviceKind { CPU, CUDA, Other };
DeviceKind device_kind(const Tensor& t);
// t must be on a device of `kind`: "x must be a CUDA tensor, got cpu".
void check_device_kind(std::string_view op, std::string_view arg, const Tensor& t, DeviceKind kind);

// A named tensor argument; an undefined or absent optional tensor is skipped by the checks.
struct NamedTensor {
  std::string_view name;
  const Tensor* tensor;  // may be null (absent optional)
};
inline NamedTensor arg(std::string_view name, const Tensor& t) { return {name, &t}; }
inline NamedTensor arg(std::string_view name, const std::optional<Tensor>& t) {
  return {name, t.has_value() ? &*t : nullptr};
}
// All present tensors on the same device as the first one:
// "k is on cpu but q is on cuda:0 (all tensors must be on the same device)".
void check_same_device(std::string_view op, std::initializer_list<NamedTensor> args);

// stride(-1) == 1 (or size(-1) <= 1).
void check_last_dim_contiguous(std::string_view op, std::string_view arg, const Tensor& t);
void check_contiguous(std::string_view op, std::string_view arg, const Tensor& t);
// Every stride except the last, in bytes, is a multiple of `bytes` (vector loads, TMA rows).
void check_strides_aligned(std::string_view op, std::string_view arg, const Tensor& t,
                           int64_t bytes = 16);
// data_ptr % bytes == 0.
void check_aligned(std::string_view op, std::string_view arg, const Tensor& t, int64_t bytes = 16);
// A value that is passed to a kernel as int32: "q.size(1) = 3000000000 does not fit in int32".
int32_t to_int32(std::string_view op, std::string_view what, int64_t value);
// Every size and stride of t fits int32 (and numel, when `numel_too`).
void check_fits_int32(std::string_view op, std::string_view arg, const Tensor& t,
                      bool numel_too = false);

// ============================================================================================
// Value domains of index tensors (spec key `values`, e.g. block_table "[0, NB)")
// ============================================================================================

// Read access to an int32/int64 CPU tensor of up to 8 dims through its strides.
struct IndexView {
  const void* data = nullptr;
  bool is64 = false;
  int64_t ndim = 0;
  int64_t strides[8] = {};
  int64_t operator()(std::initializer_list<int64_t> idx) const {
    int64_t off = 0, d = 0;
    for (int64_t i : idx) off += i * strides[d++];
    return is64 ? static_cast<const int64_t*>(data)[off] : static_cast<const int32_t*>(data)[off];
  }
};
// t must be a CPU int32/int64 tensor of at most 8 dims.
IndexView index_view(std::string_view op, std::string_view arg, const Tensor& t);
// "block_table[1, 3] = 1000000 is outside its domain [0, NB) = [0, 10)"
[[noreturn]] void domain_error(std::string_view op, std::string_view arg, std::initializer_list<int64_t> idx,
                               int64_t value, std::string_view domain, int64_t lo, int64_t hi);
// A CPU copy of t (synchronous for a CUDA tensor: used only by the opt-in input checks).
Tensor host_copy(const Tensor& t);

// Whether the CPU-style value checks also run on CUDA (they read device memory: a host sync, and so
// not inside a CUDA graph capture). Off by default; the build setting REDFUSER_CHECK_INPUTS=ON
// turns it on by default, and redfuser_ops.set_check_inputs(bool) (op redfuser::_set_check_inputs)
// at run time. set_check_inputs returns the previous setting.
bool check_inputs_enabled();
bool set_check_inputs(bool on);

// ============================================================================================
// CUDA: stream, device, arch family, lazy per-(variant, device) init, launch.
// ============================================================================================

// True when the library was built with at least one CUDA arch family.
bool built_with_cuda();
// The families compiled into this library, in build order (e.g. {"sm80", "sm90a"}).
const std::vector<std::string>& built_families();

// The current torch CUDA stream of `device_index` (a cudaStream_t). Looks up
// aoti_torch_get_current_cuda_stream in the already loaded libtorch_cuda.so at run time
// (dlopen RTLD_NOLOAD + dlsym), so that this library also loads on CPU-only torch.
void* current_cuda_stream(std::string_view op, int32_t device_index);

// Number of streaming multiprocessors of a device, cached per device (schedules size their grids by it).
int32_t device_sm_count(std::string_view op, int32_t device_index);

// (major, minor) compute capability of a device, cached per device.
std::pair<int, int> device_capability(std::string_view op, int32_t device_index);

// Pure rule: the family to run on a device of capability major.minor, among `available`, or
// nullptr when none can run there. The rule and the table are generator/families.py's (the header
// redfuser_families.h is generated from it): 8.9 -> sm89 when built; 8.x -> sm80 (SASS); 9.0 -> sm90a,
// 10.0 -> sm100a when built; any other capability >= 8.0 -> sm80 (its compute_80 PTX); below 8.0 -> none.
const char* family_for_capability(int major, int minor, const std::vector<std::string>& available);

// The family to use for `op` on `device_index`, or throws
// "redfuser::<op>: this wheel was built for sm_80, sm_86, sm_89, sm_90a, sm_100a; this GPU is sm_75".
// `available` lists the families the op has kernels for (empty: built_families()).
const char* select_family(std::string_view op, int32_t device_index,
                          const std::vector<std::string>& available = {});

// select_family's rule and message for a given capability (no GPU needed; used by tests).
const char* select_family_for_capability(std::string_view op, int major, int minor,
                                         const std::vector<std::string>& available);

// "sm_80, sm_86, sm_89" for "sm80" (the archs a family's objects run on natively).
std::string family_arch_list(std::string_view family);

// One generated CUDA variant. Define it with static storage duration:
//   static redfuser::CudaVariant kV{"op", "op__bf16__sm90a", "sm90a", &sym_init, &sym_get_last_error};
// Every variant registers itself at load time, so that one call can initialise them all (warm_up).
struct CudaVariant {
  CudaVariant(const char* op_, const char* name_, const char* family_, int (*init_)(),
              const char* (*get_last_error_)());
  const char* op;
  const char* name;
  const char* family;
  int (*init)();
  const char* (*get_last_error)();
  mutable std::atomic<uint64_t> ready_mask{0};  // bit d: init() done on device d (d < 64)
};

// Init (module load, cudaFuncSetAttribute for the dynamic shared memory) must not run inside a
// CUDA-graph capture. It happens on a device's first launch of any op, for every variant of the
// family selected for that device (all ops at once), or earlier through warm_up.
// Runs v.init() once per device (thread-safe); the device must be current (see CudaContext).
void ensure_initialized(const CudaVariant& v, int32_t device_index);
// Initialises every registered variant that runs on `device_index` (the family the device selects);
// returns how many. The device becomes current for the call. Op redfuser::_warm_up(int device),
// Python redfuser_ops.warm_up(device): call it before capturing a CUDA graph.
int64_t warm_up(int32_t device_index);
// Turns a non-zero return code of <symbol>_call into an exception naming op and variant.
void check_launch(const CudaVariant& v, int32_t device_index, int rc);

// Makes `like`'s CUDA device current (torch's device guard and this library's own runtime),
// and holds the device index, its current stream and the selected family for the call.
class CudaContext {
 public:
  CudaContext(std::string_view op, const Tensor& like,
              const std::vector<std::string>& op_families = {});
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  int32_t device() const { return device_; }
  void* stream() const { return stream_; }
  const char* family() const { return family_; }
  std::string_view op() const { return op_; }

 private:
  std::string_view op_;
  int32_t device_;
  void* stream_ = nullptr;
  const char* family_ = nullptr;
  std::optional<torch::stable::accelerator::DeviceGuard> guard_;
  int previous_runtime_device_ = -1;
};

// ---- launch tiling over the batch. The generated kernels index with int32 (TileLang's dynamic
// dims are int32) and put the batch in a grid dimension (at most 65535): a launch covers a chunk of
// batches, and the host offsets each tensor's base pointer by b0 * batch_stride in 64-bit arithmetic.

// One tensor of a launch: its batch stride and the extent of one batch (largest in-batch element
// offset + 1), in elements.
struct BatchExtent {
  std::string_view name;
  int64_t batch_stride;
  int64_t extent;
};
// The extent of one batch of t (dims after the first): 1 + sum (size(d) - 1) * |stride(d)|; 0 if empty.
int64_t batch_extent(const Tensor& t);
// The most batches one launch may cover, so that every tensor's largest offset in the launch,
// (n - 1) * batch_stride + extent - 1, fits int32 and n <= max_grid. Throws, naming the tensor,
// when one batch alone does not fit ("q: one batch spans 4294967296 elements; the CUDA kernels
// index with int32 offsets, at most 2147483647"). batch may be 0 (returns 1).
int64_t batch_chunk(std::string_view op, int64_t batch, std::initializer_list<BatchExtent> tensors,
                    int64_t max_grid = 65535);
int64_t batch_chunk(std::string_view op, int64_t batch, const std::vector<BatchExtent>& tensors,
                    int64_t max_grid = 65535);
// &t[b0]: the base pointer of batch b0, offset in 64-bit arithmetic.
inline void* batch_ptr(const Tensor& t, int64_t b0) {
  const char* base = static_cast<const char*>(t.const_data_ptr());
  return const_cast<char*>(base + b0 * t.stride(0) * static_cast<int64_t>(t.element_size()));
}

// ensure_initialized + call + check_launch. `call` takes the stream (void*) and returns the
// launcher's int:  redfuser::launch(kV, ctx, [&](void* s) { return sym_call(..., s); });
template <class Call>
inline void launch(const CudaVariant& v, const CudaContext& ctx, Call&& call) {
  ensure_initialized(v, ctx.device());
  const int rc = call(ctx.stream());
  if (rc != 0) check_launch(v, ctx.device(), rc);
}

// ============================================================================================
// CPU helpers
// ============================================================================================

// Runs f(begin, end) over [0, n) split across torch's intra-op thread pool
// (torch::stable::parallel_for). An exception thrown by f is rethrown on the calling thread
// (the first one wins) instead of crossing the C ABI.
template <class F>
inline void parallel_rows(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (n <= grain) {
    f(int64_t{0}, n);
    return;
  }
  std::exception_ptr first;
  std::atomic<bool> failed{false};
  auto body = [&](int64_t begin, int64_t end) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      f(begin, end);
    } catch (...) {
      bool expected = false;
      if (failed.compare_exchange_strong(expected, true)) first = std::current_exception();
    }
  };
  torch::stable::parallel_for(0, n, grain, body);
  if (first) std::rethrow_exception(first);
}

// ---- fp16 / bf16 <-> float, bit-exact, round-to-nearest-even on store. Pure integer code,
// so -ffast-math on the kernel objects cannot change it. NaN stays NaN (quiet), inf stays inf.

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// (one select, no branch, so that loops over it vectorise)
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t quiet = (u >> 16) | 0x0040u;               // a NaN stays a (quiet) NaN
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // ties to even; overflow -> inf
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t out;
  if (exp == 0x1Fu) {
    out = sign | 0x7F800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    out = sign;  // +-0
  } else {
    // subnormal: value = man * 2^-24; normalise into a float
    int e = 113;  // exponent field of 2^-14
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --e;
    }
    out = sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3FFu) << 13);
  }
  return bits_float(out);
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 (and inf) -> inf
  if (a >= 0x38800000u) {  // normal half (>= 2^-14)
    uint32_t r = a - (112u << 23);
    r += 0x0FFFu + ((r >> 13) & 1u);  // ties to even; a carry into the exponent is right
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  // subnormal or zero: half = round(|f| / 2^-24)
  const uint32_t e = a >> 23;                       // biased float exponent, <= 112
  if (e < 102) return sign;                         // |f| < 2^-25: rounds to 0
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;  // 24-bit significand
  const uint32_t shift = 126u - e;                  // 14 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  q += (rem > halfway || (rem == halfway && (q & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | q);  // q may become 0x400: the smallest normal, correct
}

// Typed access for CPU kernels written once for fp32/fp16/bf16.
enum class CpuDtype { Float32, Float16, BFloat16 };

template <CpuDtype D>
struct CpuType;
template <>
struct CpuType<CpuDtype::Float32> {
  using storage = float;
  static constexpr ScalarType scalar_type = ScalarType::Float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
};
template <>
struct CpuType<CpuDtype::Float16> {
  using storage = uint16_t;
  static constexpr ScalarType scalar_type = ScalarType::Half;
  static inline float load(uint16_t v) { return half_to_float(v); }
  static inline uint16_t store(float v) { return float_to_half(v); }
};
template <>
struct CpuType<CpuDtype::BFloat16> {
  using storage = uint16_t;
  static constexpr ScalarType scalar_type = ScalarType::BFloat16;
  static inline float load(uint16_t v) { return bf16_to_float(v); }
  static inline uint16_t store(float v) { return float_to_bf16(v); }
};

// Calls f(std::integral_constant<CpuDtype, D>{}) for t's dtype (float32/float16/bfloat16), or
// throws naming op and argument.
template <class F>
inline decltype(auto) dispatch_cpu_float(std::string_view op, std::string_view arg, ScalarType t,
                                         F&& f) {
  switch (t) {
    case ScalarType::Float:
      return f(std::integral_constant<CpuDtype, CpuDtype::Float32>{});
    case ScalarType::Half:
      return f(std::integral_constant<CpuDtype, CpuDtype::Float16>{});
    case ScalarType::BFloat16:
      return f(std::integral_constant<CpuDtype, CpuDtype::BFloat16>{});
    default:
      failf(op, arg, " must be float32, float16 or bfloat16 on CPU, got ", dtype_name(t));
  }
}

// ============================================================================================
// Build info: what the library contains, reported by torch.ops.redfuser._build_info() (JSON)
// and the exported C function redfuser_build_info_json().
// ============================================================================================

struct VariantRecord {
  const char* name;    // "fused_attention__bf16_d128_causal__sm90a"
  const char* device;  // "cpu" or "cuda"
  const char* family;  // "" for cpu, else "sm80" / "sm89" / "sm90a" / "sm100a"
};

// A generated .cpp declares its op and variants at load time with a static object:
//   static const redfuser::BuildInfoEntry kInfo("moe_route", "moe_route(Tensor logits, ...) -> ...",
//       {{"moe_route__cpu", "cpu", ""}, {"moe_route__e256__sm90a", "cuda", "sm90a"}});
// Several entries may name the same op (their variants are merged).
class BuildInfoEntry {
 public:
  BuildInfoEntry(const char* op, const char* schema, std::initializer_list<VariantRecord> variants);
};

// The JSON document (sorted, deterministic).
std::string build_info_json();

}  // namespace redfuser

extern "C" __attribute__((visibility("default"))) const char* redfuser_build_info_json();
