// The CUDA backend (runtime/backend.h) over the device layer (cuda_device.h): buffers are
// device allocations (ir::Tensor storage on ir::Device::cuda), a loaded graph's fused
// kernels are lowered (codegen/lower.h), emitted as CUDA C++ (codegen/cuda/cuda_emitter.h)
// and compiled by NVRTC for the device once, at load; a run launches them in schedule
// order. Scope today: graphs whose nodes are FusedKernel nodes and views (the
// reshape family: the same buffer with new dims); any other node (a matmul, a loop, a
// library call) is refused at load naming it, until its CUDA lowering exists (cuBLASLt,
// cuDNN). Built only with the CUDA toolkit (KILN_HAVE_CUDA); libcuda is opened at run time.
#pragma once
#include <memory>

#include "runtime/backend.h"
#include "runtime/cuda/cuda_device.h"

namespace kiln::runtime {

/// Opens device `ordinal` and returns its backend. Errors: "no CUDA device: <reason>".
/// A program linked with both kiln_runtime and this library makes it reachable by name
/// with register_backend("cuda", [] { return open_cuda_backend(0); }) (this library does
/// not depend on kiln_runtime, so that tests/gpu's binary stays free of LLVM and oneDNN).
Expected<std::unique_ptr<Backend>> open_cuda_backend(int ordinal = 0);

}  // namespace kiln::runtime
