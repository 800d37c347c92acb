// Minimal CUDA device layer over the driver API. libcuda.so.1 is opened with dlopen at
// run time (never linked), so binaries start on machines without a GPU driver; there,
// CudaDevice::open returns one error "no CUDA device: <reason>" and nothing crashes.
// Covers what generated kernels need: the primary context of one device, allocations,
// host<->device copies, fills, loading cubin/PTX images (codegen/cuda/nvrtc.h) and
// launching a kernel with its CudaKernelInfo (codegen/cuda/cuda_emitter.h). All calls are
// synchronous with respect to the host except launch (then call synchronize()).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cuda/cuda_emitter.h"
#include "ir/status.h"

namespace kiln::runtime {

/// A device address (CUdeviceptr).
using CudaDevicePtr = uint64_t;

/// A loaded module (cubin or PTX) and its kernels; owned by the CudaDevice that loaded it.
struct CudaModule {
  void* handle = nullptr;                  ///< CUmodule
  std::map<std::string, void*> functions;  ///< name -> CUfunction, filled on first use
};

/// One GPU with its primary context, made current on the calling thread by open().
class CudaDevice {
 public:
  /// Opens device `ordinal`: dlopen("libcuda.so.1"), cuInit, cuDeviceGet, primary context.
  /// Error "no CUDA device: <reason>" when the driver library, a device or the context is missing.
  static Expected<std::unique_ptr<CudaDevice>> open(int ordinal = 0);
  /// Frees allocations and modules made through this object and releases the context.
  ~CudaDevice();
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  const std::string& name() const { return name_; }
  /// Compute capability as major*10+minor (90 for an H100/H200).
  int compute_capability() const { return cc_; }
  /// NVRTC architecture of this device, e.g. "sm_90".
  std::string arch() const { return "sm_" + std::to_string(cc_); }
  int multiprocessors() const { return sms_; }
  /// Driver's CUDA version as 1000*major + 10*minor (cuDriverGetVersion).
  int driver_version() const { return driver_version_; }

  /// Device memory of `bytes` bytes (uninitialised; at least 1 byte is allocated).
  Expected<CudaDevicePtr> alloc(size_t bytes);
  Status free(CudaDevicePtr p);
  Status copy_to_device(CudaDevicePtr dst, const void* src, size_t bytes);
  Status copy_to_host(void* dst, CudaDevicePtr src, size_t bytes);
  /// Copies `bytes` bytes between two allocations of this device.
  Status copy_on_device(CudaDevicePtr dst, CudaDevicePtr src, size_t bytes);
  /// Fills `bytes` bytes with `value`.
  Status memset8(CudaDevicePtr dst, uint8_t value, size_t bytes);
  /// Fills `count` 32-bit words (dst 4-byte aligned) with `value`.
  Status memset32(CudaDevicePtr dst, uint32_t value, size_t count);

  /// Loads a cubin or NUL-terminated PTX image; the module lives as long as the device.
  Expected<CudaModule*> load_module(const std::vector<char>& image);
  /// Runs `info`'s pre-launch fills, then launches info.name from `module` with one device
  /// pointer per kernel parameter. Buffers allocated by this device are checked against
  /// info.param_bytes. Asynchronous: call synchronize() before reading results.
  Status launch(CudaModule* module, const codegen::CudaKernelInfo& info, const std::vector<CudaDevicePtr>& buffers);
  /// Waits for the device (cuCtxSynchronize); reports errors of earlier launches.
  Status synchronize();

 private:
  CudaDevice() = default;
  Status check(int result, const char* call) const;

  int ordinal_ = 0;
  int device_ = 0;
  void* ctx_ = nullptr;
  std::string name_;
  int cc_ = 0, sms_ = 0, driver_version_ = 0;
  std::map<CudaDevicePtr, size_t> allocs_;
  std::vector<std::unique_ptr<CudaModule>> modules_;
};

}  // namespace kiln::runtime
