#include "ir/tensor.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#if defined(__linux__)
#include <sys/sysinfo.h>
#endif

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kiln::ir {

namespace {
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};

/// glibc's malloc gives blocks over its mmap threshold (128 KiB at first, raised
/// dynamically) their own mmap and trims the heap top past its trim threshold, so a
/// training step that frees and reallocates the same tensors every step page-faults its
/// memory in again each time (measured: ~1,300 faults per tiny-GPT step, ~2,300 per
/// gpt_4l256 step, 10-15% of the tiny GPT's step time). Tensor blocks up to 32 MiB (the
/// largest threshold mallopt accepts on 64-bit) therefore come from the heap, and up to
/// 1 GiB of freed heap top stays mapped for the next step (docs/architecture.md, decision
/// 25). Not applied when the user set malloc's thresholds (a glibc.malloc tunable in
/// GLIBC_TUNABLES, or the older MALLOC_*_ variables): the user's choice wins.
bool tune_host_allocator() {
#if defined(__GLIBC__)
  const char* t = std::getenv("GLIBC_TUNABLES");
  if (t && std::strstr(t, "glibc.malloc.")) return false;
  for (const char* v : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"})
    if (std::getenv(v)) return false;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return true;
#else
  return false;
#endif
}
}  // namespace

int64_t MemoryStats::current_bytes() { return g_current.load(); }
int64_t MemoryStats::peak_bytes() { return g_peak.load(); }
void MemoryStats::reset_peak() { g_peak.store(g_current.load()); }
int64_t MemoryStats::allocations() { return g_allocations.load(); }

namespace {
std::string gib(size_t n) {
  std::ostringstream o;
  o.precision(3);
  o << static_cast<double>(n) / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return o.str();
}
/// RAM plus swap (bytes), 0 when unknown.
size_t memory_limit() {
#if defined(__linux__)
  struct sysinfo si;
  if (sysinfo(&si) == 0) return (static_cast<size_t>(si.totalram) + si.totalswap) * si.mem_unit;
#endif
  return 0;
}
}  // namespace

OutOfMemory::OutOfMemory(size_t nbytes)
    : std::runtime_error("out of memory: cannot allocate " + std::to_string(nbytes) + " bytes (" + gib(nbytes) +
                         ") for tensor storage" +
                         (memory_limit() > 0 && nbytes > memory_limit()
                              ? ", more than this machine's RAM and swap (" + gib(memory_limit()) + ")"
                              : std::string(": the allocator failed (memory exhausted, or the process's limit)")) +
                         "; lower the batch size"),
      bytes_(nbytes) {}

OutOfMemory::OutOfMemory(const std::vector<int64_t>& dims)
    : std::runtime_error("out of memory: a tensor of dims " + dims_to_string(dims) +
                         " would hold more than 2^63 bytes (check the shapes the model computes)"),
      bytes_(SIZE_MAX) {}

namespace {
/// Bytes of a dims x dtype tensor; throws OutOfMemory where the count overflows.
size_t checked_bytes(const std::vector<int64_t>& dims, DType dtype) {
  int64_t n = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : dims)
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) throw OutOfMemory(dims);
  return static_cast<size_t>(n);
}
}  // namespace

Storage::Storage(size_t nbytes, bool zero) : nbytes_(nbytes) {
  static const bool tuned = tune_host_allocator();
  (void)tuned;
  static const size_t limit = memory_limit();
  if (nbytes > SIZE_MAX / 2 || (limit > 0 && nbytes > limit)) throw OutOfMemory(nbytes);
  size_t alloc = (nbytes + 63) / 64 * 64;
  if (alloc == 0) alloc = 64;
  data_ = std::aligned_alloc(64, alloc);
  if (!data_) throw OutOfMemory(nbytes);
  if (zero) std::memset(data_, 0, alloc);
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  int64_t cur = g_current.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
  int64_t peak = g_peak.load();
  while (cur > peak && !g_peak.compare_exchange_weak(peak, cur)) {
  }
}

Storage::Storage(void* data, size_t nbytes, std::shared_ptr<Storage> owner, int held_refs)
    : data_(data), nbytes_(nbytes), owner_(std::move(owner)), held_refs_(held_refs) {}

Storage::Storage(Device device, void* address, size_t nbytes, std::function<void(void*)> release)
    : data_(address), nbytes_(nbytes), device_(device), release_(std::move(release)) {}

Storage::~Storage() {
  if (release_) {  // another device's block: its backend frees it
    release_(data_);
    return;
  }
  if (owner_) return;  // a view: the owner's block is freed with the owner
  g_current.fetch_sub(static_cast<int64_t>(nbytes_));
  std::free(data_);
}

std::string Device::str() const { return kind == Kind::cpu ? std::string("cpu") : "cuda:" + std::to_string(ordinal); }

int64_t numel_of(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (auto d : dims) n *= d;
  return n;
}

std::vector<int64_t> strides_of(const std::vector<int64_t>& dims) {
  std::vector<int64_t> s(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * dims[i + 1];
  return s;
}

std::string dims_to_string(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

Tensor::Tensor(DType dtype, std::vector<int64_t> dims) : dtype_(dtype), dims_(std::move(dims)) {
  storage_ = std::make_shared<Storage>(checked_bytes(dims_, dtype_));
}

Tensor Tensor::uninitialized(DType dtype, std::vector<int64_t> dims) {
  Tensor t;
  t.dtype_ = dtype;
  t.dims_ = std::move(dims);
  t.storage_ = std::make_shared<Storage>(checked_bytes(t.dims_, dtype), false);
  return t;
}

Tensor Tensor::over(std::shared_ptr<Storage> storage, DType dtype, std::vector<int64_t> dims) {
  Tensor t;
  t.dtype_ = dtype;
  t.dims_ = std::move(dims);
  if (!storage || storage->nbytes() < static_cast<size_t>(numel_of(t.dims_)) * dtype_size(dtype)) std::abort();
  t.storage_ = std::move(storage);
  return t;
}

Tensor Tensor::scalar_f32(float v) {
  Tensor t(DType::f32, {});
  *t.data<float>() = v;
  return t;
}
Tensor Tensor::scalar_i64(int64_t v) {
  Tensor t(DType::i64, {});
  *t.data<int64_t>() = v;
  return t;
}
Tensor Tensor::from_i64(const std::vector<int64_t>& v) {
  Tensor t(DType::i64, {static_cast<int64_t>(v.size())});
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * 8);
  return t;
}
Tensor Tensor::from_f32(const std::vector<float>& v, std::vector<int64_t> dims) {
  Tensor t(DType::f32, std::move(dims));
  std::memcpy(t.raw(), v.data(), std::min(v.size() * 4, t.nbytes()));
  return t;
}

int64_t Tensor::numel() const { return numel_of(dims_); }

Tensor Tensor::clone() const {
  Tensor t(dtype_, dims_);
  if (nbytes()) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

Tensor Tensor::reshaped(std::vector<int64_t> dims) const {
  Tensor t = *this;
  if (numel_of(dims) != numel()) std::abort();
  t.dims_ = std::move(dims);
  return t;
}

double Tensor::get_f64(int64_t i) const {
  switch (dtype_) {
    case DType::f32:
      return data<float>()[i];
    case DType::f64:
      return data<double>()[i];
    case DType::bf16:
      return bf16_to_f32(data<uint16_t>()[i]);
    case DType::f16:
      return f16_to_f32(data<uint16_t>()[i]);
    case DType::i64:
      return static_cast<double>(data<int64_t>()[i]);
    case DType::i32:
      return data<int32_t>()[i];
    case DType::i8:
      return data<int8_t>()[i];
    case DType::u8:
      return data<uint8_t>()[i];
    case DType::boolean:
      return data<uint8_t>()[i] ? 1.0 : 0.0;
    default:
      return 0;
  }
}

void Tensor::set_f64(int64_t i, double v) {
  switch (dtype_) {
    case DType::f32:
      data<float>()[i] = static_cast<float>(v);
      break;
    case DType::f64:
      data<double>()[i] = v;
      break;
    case DType::bf16:
      data<uint16_t>()[i] = f32_to_bf16(static_cast<float>(v));
      break;
    case DType::f16:
      data<uint16_t>()[i] = f32_to_f16(static_cast<float>(v));
      break;
    case DType::i64:
      data<int64_t>()[i] = static_cast<int64_t>(v);
      break;
    case DType::i32:
      data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case DType::i8:
      data<int8_t>()[i] = static_cast<int8_t>(v);
      break;
    case DType::u8:
      data<uint8_t>()[i] = static_cast<uint8_t>(v);
      break;
    case DType::boolean:
      data<uint8_t>()[i] = v != 0.0;
      break;
    default:
      break;
  }
}

int64_t Tensor::get_i64(int64_t i) const {
  switch (dtype_) {
    case DType::i64:
      return data<int64_t>()[i];
    case DType::i32:
      return data<int32_t>()[i];
    case DType::i8:
      return data<int8_t>()[i];
    case DType::u8:
      return data<uint8_t>()[i];
    case DType::boolean:
      return data<uint8_t>()[i];
    default:
      return static_cast<int64_t>(get_f64(i));
  }
}

std::vector<int64_t> Tensor::to_i64_vector() const {
  std::vector<int64_t> v(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) v[i] = get_i64(i);
  return v;
}

Tensor Tensor::cast(DType to) const {
  Tensor t(to, dims_);
  int64_t n = numel();
  if (to == dtype_) {
    if (nbytes()) std::memcpy(t.raw(), raw(), nbytes());
    return t;
  }
  bool int_path = (is_integer(to) || to == DType::boolean) && !is_float(dtype_);
  for (int64_t i = 0; i < n; ++i) {
    if (int_path) {
      int64_t v = get_i64(i);
      if (to == DType::boolean) v = v != 0;
      switch (to) {
        case DType::i64:
          t.data<int64_t>()[i] = v;
          break;
        case DType::i32:
          t.data<int32_t>()[i] = static_cast<int32_t>(v);
          break;
        case DType::i8:
          t.data<int8_t>()[i] = static_cast<int8_t>(v);
          break;
        default:
          t.data<uint8_t>()[i] = static_cast<uint8_t>(v);
          break;
      }
    } else {
      double v = get_f64(i);
      if (to == DType::boolean) v = (v != 0.0 && !std::isnan(v)) ? 1.0 : (std::isnan(v) ? 1.0 : 0.0);
      t.set_f64(i, v);
    }
  }
  return t;
}

std::string Tensor::debug_string(int max) const {
  std::ostringstream os;
  os << dtype_name(dtype_) << dims_to_string(dims_) << " {";
  for (int64_t i = 0; i < numel() && i < max; ++i) os << (i ? ", " : "") << get_f64(i);
  if (numel() > max) os << ", ...";
  os << "}";
  return os.str();
}

}  // namespace kiln::ir
