// NVRTC front end: compiles CUDA C++ (from codegen/cuda/cuda_emitter.h) to a cubin or
// PTX for one architecture, and reports ptxas resource usage (registers, stack frame,
// spill stores/loads, local memory) per kernel from ptxas' verbose log
// (--ptxas-options=-v), so tests can assert that generated kernels never spill.
// Needs no GPU: runs wherever libnvrtc and the CUDA headers (cuda_bf16.h, cuda_fp16.h)
// are installed.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::codegen {

/// Options of one NVRTC compile.
struct NvrtcOptions {
  std::string arch = "sm_90";  ///< "sm_80", "sm_90", ... (the GPU's compute capability)
  bool cubin = true;           ///< true: SASS for `arch` (nvrtcGetCUBIN); false: PTX for compute_XX
  bool ptxas_verbose = false;  ///< --ptxas-options=-v (resource usage in the log; cubin only)
  /// --fmad=false keeps f32 a*b+c unfused so pointwise results equal the CPU reference
  /// bit for bit; true lets ptxas contract to FMA (faster, differs in the last ulp).
  bool fmad = false;
  std::vector<std::string> include_dirs;   ///< empty: cuda_include_dir() when found
  std::vector<std::string> extra_options;  ///< passed through verbatim
};

/// A compiled module image.
struct NvrtcOutput {
  std::string arch;
  bool is_cubin = true;
  std::vector<char> image;  ///< cubin bytes, or PTX text with its terminating NUL
  std::string log;          ///< NVRTC's program log (warnings, ptxas -v output)
};

/// Compiles `source` (named `program_name` in diagnostics, e.g. the kernel or module name).
/// Error: one line "nvrtc: <program_name> for <arch>: <result>: <first log lines>".
Expected<NvrtcOutput> nvrtc_compile(const std::string& source, const std::string& program_name,
                                    const NvrtcOptions& options);

/// Directory holding cuda_bf16.h for NVRTC's include path, searched in order: $KILN_CUDA_INCLUDE,
/// $CUDA_HOME/include, $CUDA_PATH/include, /usr/local/cuda/include, /usr/local/cuda-*/include,
/// pip's nvidia/{cu13,cuda_runtime}/include under common Python prefixes. "" when none.
std::string cuda_include_dir();

/// NVRTC's version, e.g. "13.0".
std::string nvrtc_version();

/// ptxas resource usage of one entry function.
struct PtxasKernelInfo {
  std::string kernel;
  std::string arch;
  int registers = -1;
  int64_t stack_frame_bytes = 0;
  int64_t spill_store_bytes = 0;
  int64_t spill_load_bytes = 0;
  int64_t local_memory_bytes = 0;   ///< "N bytes lmem" (0 when ptxas does not print it)
  int64_t shared_memory_bytes = 0;  ///< static "N bytes smem"
};

/// Parses ptxas' verbose output ("Compiling entry function 'k' for 'sm_90'", "... bytes stack
/// frame, ... bytes spill stores, ... bytes spill loads", "Used N registers, ..."). One entry
/// per entry function, in log order.
std::vector<PtxasKernelInfo> parse_ptxas_log(const std::string& log);

/// Compiles `source` to a cubin for `arch` with --ptxas-options=-v and returns the usage of
/// every entry function. Errors as nvrtc_compile, or when the log holds no ptxas report.
Expected<std::vector<PtxasKernelInfo>> ptxas_info(const std::string& source, const std::string& program_name,
                                                  const std::string& arch);

}  // namespace kiln::codegen
