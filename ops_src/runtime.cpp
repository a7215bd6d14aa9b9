// redfuser-ops runtime glue (see runtime.h).
#include "runtime.h"
#include "redfuser_families.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <set>

#ifdef REDFUSER_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef REDFUSER_FAMILIES
#define REDFUSER_FAMILIES ""
#endif

namespace redfuser REDFUSER_HIDDEN {

// ---------------------------------------------------------------------------------------------
// errors and names
// ---------------------------------------------------------------------------------------------

void fail(std::string_view op, std::string_view message) {
  std::string msg;
  msg.reserve(op.size() + message.size() + 12);
  msg.append("redfuser::").append(op).append(": ").append(message);
  throw std::runtime_error(msg);
}

std::string dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Double: return "float64";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    case ScalarType::Float8_e5m2: return "float8_e5m2";
    case ScalarType::Float8_e4m3fnuz: return "float8_e4m3fnuz";
    case ScalarType::Float8_e5m2fnuz: return "float8_e5m2fnuz";
    case ScalarType::Long: return "int64";
    case ScalarType::Int: return "int32";
    case ScalarType::Short: return "int16";
    case ScalarType::Char: return "int8";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Bool: return "bool";
    default: return torch::headeronly::toString(t);
  }
}

DeviceKind device_kind(const Tensor& t) {
  if (t.is_cuda()) return DeviceKind::CUDA;
  if (t.is_cpu()) return DeviceKind::CPU;
  return DeviceKind::Other;
}

std::string device_name(const Tensor& t) {
  switch (device_kind(t)) {
    case DeviceKind::CPU: return "cpu";
    case DeviceKind::CUDA: return "cuda:" + std::to_string(t.get_device_index());
    default: return "a non-CPU, non-CUDA device";
  }
}

static const char* kind_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::CPU: return "CPU";
    case DeviceKind::CUDA: return "CUDA";
    default: return "other";
  }
}

// ---------------------------------------------------------------------------------------------
// checks
// ---------------------------------------------------------------------------------------------

void check_defined(std::string_view op, std::string_view arg, const Tensor& t) {
  check(t.defined(), op, arg, " is an undefined tensor");
}

void check_dtype(std::string_view op, std::string_view arg, const Tensor& t,
                 std::initializer_list<ScalarType> allowed) {
  const ScalarType st = t.scalar_type();
  for (ScalarType a : allowed)
    if (a == st) return;
  std::string list;
  size_t i = 0;
  for (ScalarType a : allowed) {
    if (i > 0) list += (i + 1 == allowed.size()) ? " or " : ", ";
    list += dtype_name(a);
    ++i;
  }
  failf(op, arg, " must be ", list, ", got ", dtype_name(st));
}

void check_same_dtype(std::string_view op, std::string_view arg, const Tensor& t,
                      std::string_view ref_arg, const Tensor& ref) {
  check(t.scalar_type() == ref.scalar_type(), op, arg, " must have the dtype of ", ref_arg, " (",
        dtype_name(ref.scalar_type()), "), got ", dtype_name(t.scalar_type()));
}

void check_ndim(std::string_view op, std::string_view arg, const Tensor& t, int64_t ndim,
                std::string_view layout) {
  if (t.dim() == ndim) return;
  if (layout.empty())
    failf(op, arg, " must be ", ndim, "-D, got a ", t.dim(), "-D tensor");
  failf(op, arg, " must be ", ndim, "-D ", layout, ", got a ", t.dim(), "-D tensor");
}

void check_size(std::string_view op, std::string_view arg, const Tensor& t, int64_t dim,
                int64_t expected, std::string_view expected_expr) {
  const int64_t nd = t.dim();
  const int64_t d = dim < 0 ? dim + nd : dim;
  check(d >= 0 && d < nd, op, arg, " has ", nd, " dims, no dim ", dim);
  const int64_t got = t.size(d);
  if (got == expected) return;
  failf(op, arg, ".size(", d, ") must equal ", expected_expr, ": got ", got, ", expected ", expected);
}

void check_equal(std::string_view op, std::string_view lhs_expr, int64_t lhs,
                 std::string_view rhs_expr, int64_t rhs) {
  check(lhs == rhs, op, lhs_expr, " (= ", lhs, ") must equal ", rhs_expr, " (= ", rhs, ")");
}

void check_device_kind(std::string_view op, std::string_view arg, const Tensor& t, DeviceKind kind) {
  check(device_kind(t) == kind, op, arg, " must be a ", kind_name(kind), " tensor, got one on ",
        device_name(t));
}

void check_same_device(std::string_view op, std::initializer_list<NamedTensor> args) {
  const NamedTensor* ref = nullptr;
  for (const NamedTensor& a : args) {
    if (a.tensor == nullptr || !a.tensor->defined()) continue;
    if (ref == nullptr) {
      ref = &a;
      continue;
    }
    const Tensor& r = *ref->tensor;
    const Tensor& t = *a.tensor;
    const DeviceKind rk = device_kind(r), tk = device_kind(t);
    const bool same = rk == tk && (rk != DeviceKind::CUDA || r.get_device_index() == t.get_device_index());
    if (!same)
      failf(op, a.name, " is on ", device_name(t), " but ", ref->name, " is on ", device_name(r),
            " (all tensors must be on the same device)");
  }
}

void check_last_dim_contiguous(std::string_view op, std::string_view arg, const Tensor& t) {
  if (t.dim() == 0) return;
  const int64_t last = t.dim() - 1;
  check(t.size(last) <= 1 || t.stride(last) == 1, op, arg,
        " must be contiguous in its last dimension (stride(-1) == 1), got stride ", t.stride(last));
}

void check_contiguous(std::string_view op, std::string_view arg, const Tensor& t) {
  check(t.is_contiguous(), op, arg, " must be contiguous");
}

void check_strides_aligned(std::string_view op, std::string_view arg, const Tensor& t, int64_t bytes) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;
    const int64_t sb = t.stride(d) * es;
    check(sb % bytes == 0, op, arg, ".stride(", d, ") is ", t.stride(d), " elements = ", sb,
          " bytes; it must be a multiple of ", bytes, " bytes");
  }
}

void check_aligned(std::string_view op, std::string_view arg, const Tensor& t, int64_t bytes) {
  if (t.numel() == 0) return;
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  check(addr % static_cast<uintptr_t>(bytes) == 0, op, arg, "'s data must be ", bytes,
        "-byte aligned (address % ", bytes, " = ", addr % static_cast<uintptr_t>(bytes),
        "); a view starting inside its storage can cause this, .clone() it");
}

int32_t to_int32(std::string_view op, std::string_view what, int64_t value) {
  check(value >= std::numeric_limits<int32_t>::min() && value <= std::numeric_limits<int32_t>::max(),
        op, what, " = ", value, " does not fit in int32");
  return static_cast<int32_t>(value);
}

void check_fits_int32(std::string_view op, std::string_view arg, const Tensor& t, bool numel_too) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (int64_t d = 0; d < t.dim(); ++d) {
    check(t.size(d) <= kMax, op, arg, ".size(", d, ") = ", t.size(d), " does not fit in int32");
    check(t.stride(d) <= kMax && t.stride(d) >= -kMax, op, arg, ".stride(", d, ") = ", t.stride(d),
          " does not fit in int32");
  }
  if (numel_too)
    check(t.numel() <= kMax, op, arg, ".numel() = ", t.numel(), " does not fit in int32");
}

// ---------------------------------------------------------------------------------------------
// value domains
// ---------------------------------------------------------------------------------------------

IndexView index_view(std::string_view op, std::string_view arg, const Tensor& t) {
  check(t.is_cpu(), op, "internal error: ", arg, " must be on the CPU to check its values");
  const ScalarType st = t.scalar_type();
  check(st == ScalarType::Int || st == ScalarType::Long, op, arg, " must be int32 or int64 to check its values, got ",
        dtype_name(st));
  check(t.dim() <= 8, op, arg, " has more than 8 dims");
  IndexView v;
  v.data = t.numel() > 0 ? t.const_data_ptr() : nullptr;
  v.is64 = st == ScalarType::Long;
  v.ndim = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) v.strides[d] = t.stride(d);
  return v;
}

void domain_error(std::string_view op, std::string_view arg, std::initializer_list<int64_t> idx, int64_t value,
                  std::string_view domain, int64_t lo, int64_t hi) {
  std::string at;
  for (int64_t i : idx) at += (at.empty() ? "" : ", ") + std::to_string(i);
  const char close = domain.empty() ? ')' : domain.back();
  failf(op, arg, "[", at, "] = ", value, " is outside its domain ", domain, " = [", lo, ", ", hi, close);
}

Tensor host_copy(const Tensor& t) {
  if (t.is_cpu()) return t;
  return torch::stable::to(t, torch::stable::Device(torch::headeronly::DeviceType::CPU));
}

#ifndef REDFUSER_CHECK_INPUTS
#define REDFUSER_CHECK_INPUTS 0
#endif

static std::atomic<bool>& check_inputs_flag() {
  static std::atomic<bool> flag{REDFUSER_CHECK_INPUTS != 0};
  return flag;
}

bool check_inputs_enabled() { return check_inputs_flag().load(std::memory_order_relaxed); }

bool set_check_inputs(bool on) { return check_inputs_flag().exchange(on); }

// ---------------------------------------------------------------------------------------------
// families
// ---------------------------------------------------------------------------------------------

static std::vector<std::string> split_families(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = s; *p; ++p) {
    if (*p == ';' || *p == ',' || *p == ' ') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(*p);
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

const std::vector<std::string>& built_families() {
  static const std::vector<std::string> fams = split_families(REDFUSER_FAMILIES);
  return fams;
}

bool built_with_cuda() {
#ifdef REDFUSER_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// The family table is generated from generator/families.py (the one table of arch families).
std::string family_arch_list(std::string_view family) {
  for (const families::Row& r : families::kTable)
    if (family == r.name) return r.archs;
  return std::string(family);
}

static bool has(const std::vector<std::string>& v, std::string_view x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

const char* family_for_capability(int major, int minor, const std::vector<std::string>& available) {
  // Among the built families whose SASS runs here (sm_XY on X.Z with Z >= Y; arch-specific sm_90a only on
  // exactly 9.0), the one lowered for the highest arch; else one whose PTX the driver can JIT for this
  // capability (the sm80 family's compute_80 for everything newer); else none (below 8.0).
  const int cap = 10 * major + minor;
  const families::Row* native = nullptr;
  const families::Row* jit = nullptr;
  for (const families::Row& r : families::kTable) {
    if (!has(available, r.name)) continue;
    bool runs = false;
    for (int i = 0; i < r.n_sass; ++i) {
      const families::Sass& a = r.sass[i];
      runs = runs || (a.exact ? (major == a.major && minor == a.minor) : (major == a.major && minor >= a.minor));
    }
    if (runs && (native == nullptr || r.lowered_for > native->lowered_for)) native = &r;
    if (r.ptx != 0 && r.ptx <= cap && (jit == nullptr || r.lowered_for > jit->lowered_for)) jit = &r;
  }
  if (native != nullptr) return native->name;
  return jit != nullptr ? jit->name : nullptr;
}

static std::string archs_of(const std::vector<std::string>& fams) {
  std::string s;
  for (const std::string& f : fams) {
    if (!s.empty()) s += ", ";
    s += family_arch_list(f);
  }
  return s.empty() ? std::string("no CUDA arch") : s;
}

#ifdef REDFUSER_WITH_CUDA
static void cuda_check(std::string_view op, cudaError_t e, const char* what) {
  if (e != cudaSuccess) failf(op, what, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}
#endif

std::pair<int, int> device_capability(std::string_view op, int32_t device_index) {
#ifdef REDFUSER_WITH_CUDA
  static std::mutex mu;
  static std::vector<std::pair<int, int>> cache;  // (-1, -1) = unknown
  check(device_index >= 0, op, "invalid CUDA device index ", device_index);
  {
    std::lock_guard<std::mutex> lk(mu);
    if (static_cast<size_t>(device_index) < cache.size() && cache[device_index].first >= 0)
      return cache[device_index];
  }
  int major = 0, minor = 0;
  cuda_check(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index),
             "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
  cuda_check(op, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index),
             "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
  std::lock_guard<std::mutex> lk(mu);
  if (cache.size() <= static_cast<size_t>(device_index)) cache.resize(device_index + 1, {-1, -1});
  cache[device_index] = {major, minor};
  return {major, minor};
#else
  (void)device_index;
  fail(op, "this build of redfuser-ops has no CUDA kernels (built with REDFUSER_ARCHS empty)");
#endif
}

int32_t device_sm_count(std::string_view op, int32_t device_index) {
#ifdef REDFUSER_WITH_CUDA
  static std::mutex mu;
  static std::vector<int32_t> cache;  // 0 = unknown
  check(device_index >= 0, op, "invalid CUDA device index ", device_index);
  {
    std::lock_guard<std::mutex> lk(mu);
    if (static_cast<size_t>(device_index) < cache.size() && cache[device_index] > 0) return cache[device_index];
  }
  int n = 0;
  cuda_check(op, cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device_index),
             "cudaDeviceGetAttribute(MultiProcessorCount)");
  std::lock_guard<std::mutex> lk(mu);
  if (cache.size() <= static_cast<size_t>(device_index)) cache.resize(device_index + 1, 0);
  cache[device_index] = n;
  return n;
#else
  (void)device_index;
  fail(op, "this build of redfuser-ops has no CUDA kernels (built with REDFUSER_ARCHS empty)");
#endif
}

const char* select_family(std::string_view op, int32_t device_index,
                          const std::vector<std::string>& available) {
  const std::vector<std::string>& fams = available.empty() ? built_families() : available;
  if (fams.empty())
    fail(op, "this wheel was built without CUDA kernels (REDFUSER_ARCHS was empty); use CPU tensors");
  const auto cap = device_capability(op, device_index);
  return select_family_for_capability(op, cap.first, cap.second, fams);
}

const char* select_family_for_capability(std::string_view op, int major, int minor,
                                         const std::vector<std::string>& available) {
  const char* f = family_for_capability(major, minor, available);
  if (f == nullptr)
    failf(op, "this wheel was built for ", archs_of(available), "; this GPU is sm_", major, minor);
  return f;
}

// ---------------------------------------------------------------------------------------------
// stream
// ---------------------------------------------------------------------------------------------

using GetStreamFn = int32_t (*)(int32_t, void**);

static GetStreamFn lookup_get_stream(std::string* why) {
  // libtorch_cuda.so is loaded by `import torch` on CUDA builds; never load it ourselves.
  void* h = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) {
    *why = "libtorch_cuda.so is not loaded (is this a CPU-only build of torch?)";
    return nullptr;
  }
  void* sym = dlsym(h, "aoti_torch_get_current_cuda_stream");
  // keep the handle: the library stays loaded for the life of the process anyway
  if (sym == nullptr) {
    *why = "libtorch_cuda.so has no aoti_torch_get_current_cuda_stream (torch too old?)";
    return nullptr;
  }
  return reinterpret_cast<GetStreamFn>(sym);
}

void* current_cuda_stream(std::string_view op, int32_t device_index) {
  static std::string why;
  static const GetStreamFn fn = lookup_get_stream(&why);
  if (fn == nullptr) failf(op, "cannot get torch's current CUDA stream: ", why);
  void* stream = nullptr;
  const int32_t rc = fn(device_index, &stream);
  check(rc == 0, op, "aoti_torch_get_current_cuda_stream(", device_index, ") failed (error ", rc, ")");
  return stream;
}

// ---------------------------------------------------------------------------------------------
// lazy init and launch errors
// ---------------------------------------------------------------------------------------------

[[maybe_unused]] static std::mutex& init_mutex() {
  static std::mutex mu;
  return mu;
}

static std::vector<const CudaVariant*>& variant_registry() {
  static std::vector<const CudaVariant*> all;  // filled by static constructors, read after load
  return all;
}

CudaVariant::CudaVariant(const char* op_, const char* name_, const char* family_, int (*init_)(),
                         const char* (*get_last_error_)())
    : op(op_), name(name_), family(family_), init(init_), get_last_error(get_last_error_) {
  variant_registry().push_back(this);
}

static bool is_ready(const CudaVariant& v, int32_t device_index) {
  return device_index >= 0 && device_index < 64 &&
         ((v.ready_mask.load(std::memory_order_acquire) >> device_index) & 1u);
}

#ifdef REDFUSER_WITH_CUDA
// Under init_mutex(), with the device current: v.init() once.
static void init_locked(const CudaVariant& v, int32_t device_index) {
  static std::set<std::pair<const CudaVariant*, int32_t>> high_devices;  // devices >= 64
  if (device_index < 64) {
    if (is_ready(v, device_index)) return;
  } else if (high_devices.count({&v, device_index})) {
    return;
  }
  const int rc = v.init();
  if (rc != 0) {
    const char* msg = v.get_last_error ? v.get_last_error() : "";
    failf(v.op, "initialising kernel ", v.name, " on cuda:", device_index, " failed: ", msg);
  }
  if (device_index < 64)
    v.ready_mask.fetch_or(uint64_t{1} << device_index, std::memory_order_release);
  else
    high_devices.insert({&v, device_index});
}
#endif

void ensure_initialized(const CudaVariant& v, int32_t device_index) {
  if (is_ready(v, device_index)) return;
#ifdef REDFUSER_WITH_CUDA
  std::lock_guard<std::mutex> lk(init_mutex());
  int current = -1;
  cuda_check(v.op, cudaGetDevice(&current), "cudaGetDevice");
  check(current == device_index, v.op, "internal error: initialising ", v.name, " for cuda:",
        device_index, " while cuda:", current, " is current");
  // the first launch on a device initialises every variant of its family (of all ops), so that a
  // graph captured after one eager call of any op never runs init inside the capture
  for (const CudaVariant* w : variant_registry())
    if (std::string_view(w->family) == v.family) init_locked(*w, device_index);
  init_locked(v, device_index);
#else
  failf(v.op, "kernel ", v.name, ": this build of redfuser-ops has no CUDA support");
#endif
}

int64_t warm_up(int32_t device_index) {
#ifdef REDFUSER_WITH_CUDA
  constexpr std::string_view op = "warm_up";
  check(device_index >= 0, op, "invalid CUDA device index ", device_index);
  if (built_families().empty()) return 0;
  (void)select_family(op, device_index);  // the clear error when no family runs on this GPU
  const auto cap = device_capability(op, device_index);
  int prev = -1;
  cuda_check(op, cudaGetDevice(&prev), "cudaGetDevice");
  if (prev != device_index) cuda_check(op, cudaSetDevice(device_index), "cudaSetDevice");
  int64_t n = 0;
  try {
    std::lock_guard<std::mutex> lk(init_mutex());
    for (const CudaVariant* w : variant_registry()) {
      // an op's variant runs on this device when the op's own families select its family here
      std::vector<std::string> op_fams;
      for (const CudaVariant* x : variant_registry())
        if (std::string_view(x->op) == w->op && !has(op_fams, x->family)) op_fams.emplace_back(x->family);
      const char* want = family_for_capability(cap.first, cap.second, op_fams);
      if (want == nullptr || std::string_view(want) != w->family) continue;
      init_locked(*w, device_index);
      ++n;
    }
  } catch (...) {
    if (prev != device_index) (void)cudaSetDevice(prev);
    throw;
  }
  if (prev != device_index) (void)cudaSetDevice(prev);
  return n;
#else
  (void)device_index;
  return 0;
#endif
}

void check_launch(const CudaVariant& v, int32_t device_index, int rc) {
  if (rc == 0) return;
  const char* msg = v.get_last_error ? v.get_last_error() : "";
  failf(v.op, "kernel ", v.name, " failed on cuda:", device_index, ": ", msg);
}

// ---------------------------------------------------------------------------------------------
// launch tiling
// ---------------------------------------------------------------------------------------------

int64_t batch_extent(const Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t e = 1;
  for (int64_t d = 1; d < t.dim(); ++d) {
    const int64_t s = t.stride(d) < 0 ? -t.stride(d) : t.stride(d);
    e += (t.size(d) - 1) * s;
  }
  return e;
}

int64_t batch_chunk(std::string_view op, int64_t batch, const std::vector<BatchExtent>& tensors,
                    int64_t max_grid) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  int64_t n = std::max<int64_t>(1, std::min(batch, max_grid));
  for (const BatchExtent& t : tensors) {
    // the largest offset of a launch of n batches is (n - 1) * sb + extent - 1 <= kMax
    check(t.extent - 1 <= kMax, op, t.name, ": one batch spans ", t.extent,
          " elements; the CUDA kernels index with int32 offsets, at most ", kMax);
    const int64_t sb = t.batch_stride < 0 ? -t.batch_stride : t.batch_stride;
    if (sb > 0 && t.extent > 0) n = std::min(n, (kMax + 1 - t.extent) / sb + 1);
  }
  return std::max<int64_t>(1, n);
}

int64_t batch_chunk(std::string_view op, int64_t batch, std::initializer_list<BatchExtent> tensors,
                    int64_t max_grid) {
  return batch_chunk(op, batch, std::vector<BatchExtent>(tensors), max_grid);
}

// ---------------------------------------------------------------------------------------------
// CudaContext
// ---------------------------------------------------------------------------------------------

CudaContext::CudaContext(std::string_view op, const Tensor& like,
                         const std::vector<std::string>& op_families)
    : op_(op), device_(-1) {
  check(like.defined() && like.is_cuda(), op, "internal error: CudaContext needs a CUDA tensor");
  device_ = like.get_device_index();
#ifdef REDFUSER_WITH_CUDA
  guard_.emplace(device_);
  // This library carries its own (static) CUDA runtime: make the device current there too.
  int prev = -1;
  cuda_check(op, cudaGetDevice(&prev), "cudaGetDevice");
  if (prev != device_) {
    cuda_check(op, cudaSetDevice(device_), "cudaSetDevice");
    previous_runtime_device_ = prev;
  }
  family_ = select_family(op, device_, op_families);
  stream_ = current_cuda_stream(op, device_);
#else
  (void)op_families;
  fail(op, "got CUDA tensors, but this build of redfuser-ops has no CUDA kernels "
           "(built with REDFUSER_ARCHS empty)");
#endif
}

CudaContext::~CudaContext() {
#ifdef REDFUSER_WITH_CUDA
  if (previous_runtime_device_ >= 0) (void)cudaSetDevice(previous_runtime_device_);
#endif
}

}  // namespace redfuser
