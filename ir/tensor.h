// Host tensors: dtype, dims and shared, reference-counted storage. Used for
// initializers and constants in the IR and as eager runtime values. All byte
// allocations go through one counter so the runtime can report current and peak
// bytes (like torch.cuda.max_memory_allocated).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ir/dtype.h"

namespace kiln::ir {

/// Global byte counters of live tensor storage (bytes).
struct MemoryStats {
  static int64_t current_bytes();
  static int64_t peak_bytes();
  /// Resets the peak to the current value.
  static void reset_peak();
  /// Storage blocks allocated since the process started (a count, not bytes; views of an
  /// arena block are not allocations).
  static int64_t allocations();
};

/// Thrown by Storage when a block cannot be allocated (the allocator returned null, or
/// the request exceeds this machine's RAM plus swap, which Linux's overcommit would grant
/// and then kill the process for). what(): one line with the byte count. The CLI and
/// the compiled training binaries report it as an error (exit 1), not as a crash.
class OutOfMemory : public std::runtime_error {
 public:
  explicit OutOfMemory(size_t nbytes);
  /// A tensor of `dims` whose byte count does not fit in 64 bits.
  explicit OutOfMemory(const std::vector<int64_t>& dims);
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
};

/// Where a buffer's bytes live. Host memory ("cpu") is what kiln's generated CPU kernels,
/// oneDNN and the eager interpreter read; a buffer of another device (a CUDA allocation)
/// is allocated, filled and read back only by that device's backend (runtime/backend.h),
/// and its address must never be dereferenced on the host.
struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int ordinal = 0;  ///< which device of its kind (0 for the host)
  static Device cpu() { return {}; }
  static Device cuda(int ordinal) { return {Kind::cuda, ordinal}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  /// "cpu", "cuda:0" (PyTorch's spelling).
  std::string str() const;
  bool operator==(const Device& o) const { return kind == o.kind && ordinal == o.ordinal; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

/// Contiguous byte buffer, 64-byte aligned, zero-initialised unless `zero` is false (for
/// outputs a kernel overwrites entirely). Counted in MemoryStats.
class Storage {
 public:
  explicit Storage(size_t nbytes, bool zero = true);
  /// A view of `nbytes` at `data` inside `owner`'s block (a pre-planned arena slot): not
  /// allocated, not counted, not freed; keeps `owner` alive. `held_refs`: references to
  /// this Storage held by its owner's bookkeeping, not by tensors (Tensor::storage_unique
  /// discounts them).
  Storage(void* data, size_t nbytes, std::shared_ptr<Storage> owner, int held_refs = 0);
  /// A block of another device's memory at `address` (e.g. a CUdeviceptr), owned by this
  /// Storage: `release(address)` is called once when it dies. Not counted in MemoryStats
  /// (host bytes); never dereferenced on the host.
  Storage(Device device, void* address, size_t nbytes, std::function<void(void*)> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() { return data_; }
  const void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  /// References held by bookkeeping (see the view constructor); 0 for owned blocks.
  int held_refs() const { return held_refs_; }
  /// The device the bytes live on (cpu for every block but a backend's device memory).
  const Device& device() const { return device_; }

 private:
  void* data_ = nullptr;
  Device device_;
  std::function<void(void*)> release_;  ///< device memory: frees data_
  size_t nbytes_ = 0;
  std::shared_ptr<Storage> owner_;  ///< set for views: the block they lie in
  int held_refs_ = 0;
};

/// Dense row-major tensor. Copying a Tensor shares its storage (like torch.Tensor);
/// use clone() for a deep copy.
class Tensor {
 public:
  Tensor() = default;
  /// Allocates a zero-filled tensor of the given dtype and dims.
  Tensor(DType dtype, std::vector<int64_t> dims);
  /// Allocates without filling: for outputs that a kernel writes in full.
  static Tensor uninitialized(DType dtype, std::vector<int64_t> dims);
  static Tensor scalar_f32(float v);
  static Tensor scalar_i64(int64_t v);
  /// 1-D i64 tensor with the given values.
  static Tensor from_i64(const std::vector<int64_t>& v);
  static Tensor from_f32(const std::vector<float>& v, std::vector<int64_t> dims);
  /// A tensor over existing storage (an arena slot): no allocation. storage->nbytes()
  /// must cover numel * dtype size (aborts otherwise: the caller checks).
  static Tensor over(std::shared_ptr<Storage> storage, DType dtype, std::vector<int64_t> dims);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& dims() const { return dims_; }
  int rank() const { return static_cast<int>(dims_.size()); }
  int64_t dim(int i) const { return dims_[i < 0 ? i + rank() : i]; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool defined() const { return storage_ != nullptr || dtype_ != DType::undefined; }
  /// Where the storage lives (cpu for a tensor without storage). Only cpu tensors may be
  /// read through raw()/data() on the host; clone, cast and the element accessors
  /// require cpu.
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }

  void* raw() { return storage_ ? storage_->data() : nullptr; }
  const void* raw() const { return storage_ ? storage_->data() : nullptr; }
  template <typename T>
  T* data() {
    return static_cast<T*>(raw());
  }
  template <typename T>
  const T* data() const {
    return static_cast<const T*>(raw());
  }

  /// True when no other Tensor shares this one's storage (an in-place write is invisible to others).
  bool storage_unique() const { return storage_ && storage_.use_count() == 1 + storage_->held_refs(); }
  /// Deep copy with fresh storage.
  Tensor clone() const;
  /// Same storage, new dims (numel must match). Aborts on mismatch (caller checks).
  Tensor reshaped(std::vector<int64_t> dims) const;
  /// Converts to another dtype (float<->int casts truncate toward zero like ONNX Cast).
  Tensor cast(DType to) const;
  /// Element i read as double / written from double, whatever the dtype.
  double get_f64(int64_t i) const;
  void set_f64(int64_t i, double v);
  /// Element i read as int64 (floats truncated).
  int64_t get_i64(int64_t i) const;
  /// All elements as int64 (for shape tensors).
  std::vector<int64_t> to_i64_vector() const;
  /// Debug string: dtype, dims and up to `max` values.
  std::string debug_string(int max = 8) const;

 private:
  DType dtype_ = DType::undefined;
  std::vector<int64_t> dims_;
  std::shared_ptr<Storage> storage_;
};

/// Product of dims (1 for rank 0).
int64_t numel_of(const std::vector<int64_t>& dims);
/// Row-major strides in elements.
std::vector<int64_t> strides_of(const std::vector<int64_t>& dims);
/// "[2, 3, 4]"
std::string dims_to_string(const std::vector<int64_t>& dims);

}  // namespace kiln::ir
