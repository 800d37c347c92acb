// CUDA driver API through dlopen("libcuda.so.1"): device, memory, modules, launches
// (see cuda_device.h). The driver's types are declared here as plain integers/pointers so
// nothing links against libcuda.
#include "runtime/cuda/cuda_device.h"

#include <dlfcn.h>

#include <mutex>

namespace kiln::runtime {
namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;
using CUdeviceptr = unsigned long long;

constexpr int kAttrMultiprocessorCount = 16;  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
constexpr int kAttrCcMajor = 75;              // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrCcMinor = 76;              // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR

/// The driver entry points kiln uses (versioned symbol names as cuda.h maps them).
struct Driver {
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleUnload)(CUmodule) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t) = nullptr;
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t) = nullptr;
  CUresult (*cuMemsetD32)(CUdeviceptr, unsigned int, size_t) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                             void**, void**) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  std::string error;  ///< why the driver is unusable ("" when loaded)
};

template <typename F>
bool bind(void* lib, F& fn, const char* sym, std::string& err) {
  fn = reinterpret_cast<F>(::dlsym(lib, sym));
  if (!fn && err.empty()) err = std::string("libcuda.so.1 lacks ") + sym;
  return fn != nullptr;
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = ::dlerror();
      d.error = std::string("cannot load libcuda.so.1 (") + (e ? e : "dlopen failed") + ")";
      return;
    }
    std::string& err = d.error;
    bind(lib, d.cuInit, "cuInit", err);
    bind(lib, d.cuDriverGetVersion, "cuDriverGetVersion", err);
    bind(lib, d.cuDeviceGetCount, "cuDeviceGetCount", err);
    bind(lib, d.cuDeviceGet, "cuDeviceGet", err);
    bind(lib, d.cuDeviceGetName, "cuDeviceGetName", err);
    bind(lib, d.cuDeviceGetAttribute, "cuDeviceGetAttribute", err);
    bind(lib, d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", err);
    bind(lib, d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", err);
    bind(lib, d.cuCtxSetCurrent, "cuCtxSetCurrent", err);
    bind(lib, d.cuCtxSynchronize, "cuCtxSynchronize", err);
    bind(lib, d.cuModuleLoadData, "cuModuleLoadData", err);
    bind(lib, d.cuModuleUnload, "cuModuleUnload", err);
    bind(lib, d.cuModuleGetFunction, "cuModuleGetFunction", err);
    bind(lib, d.cuMemAlloc, "cuMemAlloc_v2", err);
    bind(lib, d.cuMemFree, "cuMemFree_v2", err);
    bind(lib, d.cuMemcpyHtoD, "cuMemcpyHtoD_v2", err);
    bind(lib, d.cuMemcpyDtoH, "cuMemcpyDtoH_v2", err);
    bind(lib, d.cuMemcpyDtoD, "cuMemcpyDtoD_v2", err);
    bind(lib, d.cuMemsetD8, "cuMemsetD8_v2", err);
    bind(lib, d.cuMemsetD32, "cuMemsetD32_v2", err);
    bind(lib, d.cuLaunchKernel, "cuLaunchKernel", err);
    bind(lib, d.cuGetErrorName, "cuGetErrorName", err);
    bind(lib, d.cuGetErrorString, "cuGetErrorString", err);
  });
  return d;
}

std::string result_text(CUresult r) {
  const Driver& d = driver();
  const char* name = nullptr;
  const char* str = nullptr;
  if (d.cuGetErrorName) d.cuGetErrorName(r, &name);
  if (d.cuGetErrorString) d.cuGetErrorString(r, &str);
  std::string s = name ? name : "CUDA error " + std::to_string(r);
  if (str) s += std::string(" (") + str + ")";
  return s;
}

}  // namespace

Status CudaDevice::check(int r, const char* call) const {
  if (r == 0) return Status::ok();
  return Status::error(std::string("cuda: ") + call + " on device " + std::to_string(ordinal_) +
                       " failed: " + result_text(r));
}

Expected<std::unique_ptr<CudaDevice>> CudaDevice::open(int ordinal) {
  const Driver& d = driver();
  auto nodev = [](const std::string& why) { return Status::error("no CUDA device: " + why); };
  if (!d.error.empty()) return nodev(d.error);
  CUresult r = d.cuInit(0);
  if (r != 0) return nodev("cuInit failed: " + result_text(r));
  int count = 0;
  r = d.cuDeviceGetCount(&count);
  if (r != 0) return nodev("cuDeviceGetCount failed: " + result_text(r));
  if (count == 0) return nodev("the driver reports 0 devices");
  if (ordinal < 0 || ordinal >= count)
    return nodev("device " + std::to_string(ordinal) + " requested, " + std::to_string(count) + " present");
  std::unique_ptr<CudaDevice> dev(new CudaDevice());
  dev->ordinal_ = ordinal;
  r = d.cuDeviceGet(&dev->device_, ordinal);
  if (r != 0) return nodev("cuDeviceGet failed: " + result_text(r));
  char name[256] = {0};
  if (d.cuDeviceGetName(name, sizeof name - 1, dev->device_) == 0) dev->name_ = name;
  int major = 0, minor = 0;
  d.cuDeviceGetAttribute(&major, kAttrCcMajor, dev->device_);
  d.cuDeviceGetAttribute(&minor, kAttrCcMinor, dev->device_);
  d.cuDeviceGetAttribute(&dev->sms_, kAttrMultiprocessorCount, dev->device_);
  d.cuDriverGetVersion(&dev->driver_version_);
  dev->cc_ = major * 10 + minor;
  CUcontext ctx = nullptr;
  r = d.cuDevicePrimaryCtxRetain(&ctx, dev->device_);
  if (r != 0) return nodev("cuDevicePrimaryCtxRetain failed: " + result_text(r));
  dev->ctx_ = ctx;
  r = d.cuCtxSetCurrent(ctx);
  if (r != 0) return nodev("cuCtxSetCurrent failed: " + result_text(r));
  return dev;
}

CudaDevice::~CudaDevice() {
  const Driver& d = driver();
  if (!ctx_) return;
  d.cuCtxSetCurrent(ctx_);
  d.cuCtxSynchronize();
  for (auto& m : modules_)
    if (m->handle) d.cuModuleUnload(m->handle);
  for (auto& [p, n] : allocs_) d.cuMemFree(p);
  d.cuDevicePrimaryCtxRelease(device_);
}

Expected<CudaDevicePtr> CudaDevice::alloc(size_t bytes) {
  CUdeviceptr p = 0;
  KILN_RETURN_IF_ERROR(check(driver().cuMemAlloc(&p, bytes ? bytes : 1), "cuMemAlloc"));
  allocs_[p] = bytes;
  return static_cast<CudaDevicePtr>(p);
}

Status CudaDevice::free(CudaDevicePtr p) {
  auto it = allocs_.find(p);
  if (it == allocs_.end()) return Status::error("cuda: free of a pointer not allocated by this device");
  allocs_.erase(it);
  return check(driver().cuMemFree(p), "cuMemFree");
}

Status CudaDevice::copy_to_device(CudaDevicePtr dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::ok();
  return check(driver().cuMemcpyHtoD(dst, src, bytes), "cuMemcpyHtoD");
}

Status CudaDevice::copy_to_host(void* dst, CudaDevicePtr src, size_t bytes) {
  if (bytes == 0) return Status::ok();
  return check(driver().cuMemcpyDtoH(dst, src, bytes), "cuMemcpyDtoH");
}

Status CudaDevice::copy_on_device(CudaDevicePtr dst, CudaDevicePtr src, size_t bytes) {
  if (bytes == 0) return Status::ok();
  return check(driver().cuMemcpyDtoD(dst, src, bytes), "cuMemcpyDtoD");
}

Status CudaDevice::memset8(CudaDevicePtr dst, uint8_t value, size_t bytes) {
  if (bytes == 0) return Status::ok();
  return check(driver().cuMemsetD8(dst, value, bytes), "cuMemsetD8");
}

Status CudaDevice::memset32(CudaDevicePtr dst, uint32_t value, size_t count) {
  if (count == 0) return Status::ok();
  if (dst % 4 != 0) return Status::error("cuda: cuMemsetD32 destination is not 4-byte aligned");
  return check(driver().cuMemsetD32(dst, value, count), "cuMemsetD32");
}

Expected<CudaModule*> CudaDevice::load_module(const std::vector<char>& image) {
  if (image.empty()) return Status::error("cuda: cuModuleLoadData: empty module image");
  auto m = std::make_unique<CudaModule>();
  CUmodule h = nullptr;
  KILN_RETURN_IF_ERROR(check(driver().cuModuleLoadData(&h, image.data()), "cuModuleLoadData"));
  m->handle = h;
  modules_.push_back(std::move(m));
  return modules_.back().get();
}

Status CudaDevice::launch(CudaModule* module, const codegen::CudaKernelInfo& info,
                          const std::vector<CudaDevicePtr>& buffers) {
  const Driver& d = driver();
  const std::string where = "cuda: launch of " + info.name;
  if (!module) return Status::error(where + ": no module");
  if (static_cast<int>(buffers.size()) != info.num_params)
    return Status::error(where + ": " + std::to_string(buffers.size()) + " buffers for " +
                         std::to_string(info.num_params) + " parameters");
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto it = allocs_.find(buffers[i]);
    if (it != allocs_.end() && i < info.param_bytes.size() && static_cast<int64_t>(it->second) < info.param_bytes[i])
      return Status::error(where + ": buffer " + std::to_string(i) + " holds " + std::to_string(it->second) +
                           " bytes, the kernel reaches " + std::to_string(info.param_bytes[i]));
  }
  void* fn = nullptr;
  auto it = module->functions.find(info.name);
  if (it != module->functions.end()) {
    fn = it->second;
  } else {
    KILN_RETURN_IF_ERROR(check(d.cuModuleGetFunction(&fn, module->handle, info.name.c_str()), "cuModuleGetFunction")
                             .with_context(where));
    module->functions[info.name] = fn;
  }
  for (const codegen::CudaBufferInit& init : info.inits) {
    if (init.param < 0 || init.param >= static_cast<int>(buffers.size()))
      return Status::error(where + ": init of a parameter out of range");
    const CudaDevicePtr p = buffers[init.param] + static_cast<CudaDevicePtr>(init.byte_offset);
    if (init.fill32 == 0)
      KILN_RETURN_IF_ERROR(memset8(p, 0, static_cast<size_t>(init.bytes)).with_context(where));
    else
      KILN_RETURN_IF_ERROR(memset32(p, init.fill32, static_cast<size_t>(init.bytes / 4)).with_context(where));
  }
  std::vector<CUdeviceptr> vals(buffers.begin(), buffers.end());
  std::vector<void*> args;
  for (auto& v : vals) args.push_back(&v);
  return check(
             d.cuLaunchKernel(fn, info.grid[0], info.grid[1], info.grid[2], info.block[0], info.block[1], info.block[2],
                              info.shared_bytes, nullptr, args.empty() ? nullptr : args.data(), nullptr),
             "cuLaunchKernel")
      .with_context(info.name);
}

Status CudaDevice::synchronize() { return check(driver().cuCtxSynchronize(), "cuCtxSynchronize"); }

}  // namespace kiln::runtime
