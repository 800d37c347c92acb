// CUDA emitter: renders kernel IR (codegen/kernel_ir.h) as one CUDA C++ translation
// unit, one `extern "C" __global__` function per Kernel, plus the launch geometry each
// needs (chosen from the static shapes). The source is compiled with NVRTC
// (codegen/cuda/nvrtc.h) and launched through the driver API (runtime/cuda/cuda_device.h).
//
// Schedules (after collapse_dims):
//   pointwise   grid-stride loop over the flattened domain, one thread per point.
//   row_warp    reduced dims are the innermost ones: one warp per output row, lanes stride
//               the row, warp-shuffle tree (__shfl_xor_sync) combines the lanes.
//   row_block   same, one 256-thread block per row (long rows, few rows): warp shuffles,
//               then the 8 warp results through shared memory.
//   column      any other reduction (reduced outer or middle dims): one thread per output
//               element, looping over the reduced points; coalesced when the kept dims are
//               innermost.
//   column_atomic  the column schedule with the reduced range split across gridDim.y:
//               each thread's partial result is combined with atomicAdd (sum) or an
//               integer-ordered atomic max (max) into an output that the launcher first
//               fills with 0 / -inf (CudaKernelInfo::inits). Only for f32 sum/max and
//               f64 sum outputs whose written elements form one dense range; bf16/f16/int
//               outputs use the plain column schedule so each element is rounded once.
//
// Row programs (Kernel::is_row_program: reduce expressions such as Softmax's max and sum,
// point stores along the reduced dims, row stores) run the passes of evaluate_reference
// over each row: pass p loops over the row, accumulating the level-p reduce expressions
// (and the reduction stores of level p - 1) and writing the point stores of level p - 1;
// the accumulators are combined across the row's threads, every thread keeps the result
// (rounded to the expression's dtype) for the later passes, and the row's first thread
// writes the reduction and row stores once their level is known. Schedules: row_warp or
// row_block (chosen as for plain reductions: reduced dims innermost, R >= 32; row_block
// for R >= 4096 and fewer than 2048 rows), else `column`: one thread per row, sequential
// passes (correct for reduced outer dims, not fast). Never atomic.
//
// Semantics follow kernel_ir.h exactly: bf16/f16 values live in f32 registers and every
// bf16/f16 expression result is rounded to nearest even (__float2bfloat16_rn /
// __float2half_rn); f64 computes in double; integers compute in their own width (results
// wrap); bool is one byte (0/1) in memory and `bool` in registers. Float max/min
// propagate NaN as the reference does (kiln_maxf/kiln_minf). Reductions accumulate in f32 for
// f32/bf16/f16, double for f64, int64 for integers; sums start at 0, max at -inf (the
// lowest integer for integer dtypes). Reduce expressions (kernel_ir.h) accumulate the same
// way, so their f32 sums are f32 sums (the reference sums in double: the two agree to the f32
// rounding error of a lane-strided tree sum, far below 1e-5 relative for positive terms), then are
// rounded to their dtype (bf16/f16) before use. Reduction order differs from the reference
// evaluator (tree/atomic order), so reduced results match it to rounding, not bitwise. The source
// should be compiled with --fmad=false (nvrtc.h's default) so pointwise f32 arithmetic is
// bit-identical to the CPU reference; transcendental functions are CUDA's (erff, expf, ...
// within a few ulp of glibc's).
//
// Loads of inputs go through `const T* __restrict__`: an output buffer must not alias an
// input buffer except where both are indexed identically (in-place pointwise update).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"
#include "ir/status.h"

namespace kiln::codegen {

/// A fill of part of an output buffer that must happen before the kernel's launch.
struct CudaBufferInit {
  int param = -1;           ///< index into Kernel::params (the launch's buffer list)
  int64_t byte_offset = 0;  ///< from the buffer's base pointer
  int64_t bytes = 0;        ///< length of the filled range (a multiple of 4 when fill32 != 0)
  uint32_t fill32 = 0;      ///< 32-bit pattern: 0 (zero) or 0xff800000 (f32 -inf)
};

/// How to launch one emitted kernel: `name<<<grid, block, shared_bytes>>>(p0, p1, ...)`
/// with one device pointer per Kernel::params entry, in order.
struct CudaKernelInfo {
  std::string name;
  std::string schedule;  ///< pointwise | row_warp | row_block | column | column_atomic
  unsigned grid[3] = {1, 1, 1};
  unsigned block[3] = {1, 1, 1};
  unsigned shared_bytes = 0;  ///< dynamic shared memory (static shared is in the code)
  int num_params = 0;
  /// Params whose written range must be zeroed before the launch (atomic sums).
  std::vector<int> zero_init_params;
  /// Every pre-launch fill (the zero ranges above and -inf ranges of atomic max).
  std::vector<CudaBufferInit> inits;
  /// Minimal size in bytes of each param's buffer: (largest element index + 1) * dtype size.
  std::vector<int64_t> param_bytes;
};

/// One CUDA C++ translation unit and the launches of its kernels (same order as the input).
struct CudaModuleSource {
  std::string source;
  std::vector<CudaKernelInfo> kernels;
};

/// Renders `kernels` as one CUDA C++ translation unit. Each kernel is verified
/// (Kernel::verify) and dims are collapsed (collapse_dims) first. Errors: a kernel that
/// fails verification, duplicate or non-identifier names, an unsupported dtype (the
/// error names the kernel and expression).
Expected<CudaModuleSource> emit_cuda(const std::vector<Kernel>& kernels);

}  // namespace kiln::codegen
