// CPU code generation: kernel IR -> LLVM IR (llvm-16) -> machine code for the host CPU,
// compiled in-process with ORC LLJIT (LLVM's O3 pipeline, the host's features such as
// AVX-512 detected at run time through llvm::sys::getHostCPUFeatures).
//
// Each kernel becomes one function with the C ABI
//     void kernel(void* const* buffers, int64_t begin, int64_t end)
// that computes the domain points whose *parallel dimension* index lies in
// [begin, end) (see CpuKernel::parallel_dim); the runtime splits [0, parallel_extent)
// across threads with one parallel-for. Inner loops are written so that LLVM's loop
// vectorizer turns them into SIMD code (unit-stride loads, broadcasts hoisted).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"
#include "ir/status.h"

namespace kiln::codegen {

/// Signature of a generated CPU kernel.
using CpuKernelFn = void (*)(void* const* buffers, int64_t begin, int64_t end);

/// One compiled kernel.
struct CpuKernel {
  std::string name;
  CpuKernelFn fn = nullptr;
  int parallel_dim = -1;       ///< domain dim split across threads (-1: run as fn(b, 0, 1))
  int64_t parallel_extent = 1; ///< extent of that dim
  int64_t work_per_index = 1;  ///< domain points per parallel index (for choosing chunk sizes)
};

/// Times of one compile, in seconds.
struct CpuCompileStats {
  double emit_s = 0;      ///< kernel IR -> LLVM IR
  double optimize_s = 0;  ///< O3 pipeline
  double codegen_s = 0;   ///< machine code + JIT link (ORC)
  int num_kernels = 0;
  int num_unique = 0;     ///< distinct generated functions (structurally equal kernels share one)
};

/// A JIT-compiled module of kernels; owns the code (kernels stay valid while it lives).
class CpuModule {
 public:
  virtual ~CpuModule() = default;
  /// Compiled kernels, in the order given to compile_cpu.
  virtual const std::vector<CpuKernel>& kernels() const = 0;
  /// The module's LLVM IR after optimization (for dumps and golden tests).
  virtual const std::string& llvm_ir() const = 0;
  virtual const CpuCompileStats& stats() const = 0;
};

/// Compiles `kernels` (verified first) into one module. Errors name the kernel.
Expected<std::unique_ptr<CpuModule>> compile_cpu(const std::vector<Kernel>& kernels);

/// LLVM IR text of `kernels` before optimization (golden codegen tests; no JIT).
Expected<std::string> emit_llvm_ir(const std::vector<Kernel>& kernels);

/// Host CPU name and feature string as LLVM reports them (e.g. "skylake-avx512",
/// "+avx512f,+avx512bf16,..."); part of the compile-cache key of `kiln compile`.
std::string host_cpu_description();

}  // namespace kiln::codegen
