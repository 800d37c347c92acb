// CPU code generation: kernel IR -> LLVM IR (llvm-16) -> machine code for the host CPU,
// compiled in-process with ORC LLJIT (LLVM's O3 pipeline, the host's features such as
// AVX-512 detected at run time through llvm::sys::getHostCPUFeatures).
//
// Each kernel becomes one function with the C ABI
//     void kernel(void* const* buffers, int64_t begin, int64_t end)
// that computes the domain points whose *parallel dimension* index lies in
// [begin, end) (see CpuKernel::parallel_dim); the runtime splits [0, parallel_extent)
// across threads with one parallel-for. buffers[i] is parameter i's; after them, a
// symbolic kernel (issue 32) takes a `const int64_t*` to the values of its symbols
// (CpuKernel::symbols, in that order), from which it computes its loop bounds and
// strides once per call, and a split reduction its scratch (never both). Inner loops are written so that LLVM's loop
// vectorizer turns them into SIMD code (unit-stride loads, broadcasts hoisted).
//
// Ahead of time: compile_cpu_object stops at a relocatable ELF object (host triple, CPU and
// features, PIC so that it links into PIE executables); load_cpu_object JIT-links such an
// object (compile_cpu is the two in a row), and `kiln compile` hands the same bytes to the
// system linker. The generated code calls `kiln_cpu_ipow` and libm (expf, erff, tanhf, ...).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
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
  Extent parallel_extent = 1;  ///< extent of that dim (an expression in a symbolic kernel)
  Extent work_per_index = 1;   ///< domain points per parallel index (for choosing chunk sizes)
  /// A symbolic kernel's symbols (Kernel::symbols): the values the executor passes after
  /// the buffers, in this order, and evaluates parallel_extent and work_per_index with.
  std::vector<std::string> symbols;
  /// > 0: a split column reduction in this many row partitions K (the parallel indices):
  /// after fn(b, begin, end) has run for every index of [0, K), the caller runs
  /// fn(b, K, K + 1) once, which combines the partial results. -1: a split column
  /// reduction whose row count is symbolic: K = launch_split_parts(*this, rows) with rows
  /// = split_rows at the run's symbol values, passed to fn after the symbols' values.
  int64_t split_parts = 0;
  /// A symbolic split reduction (split_parts -1): its flat reduced extent and its
  /// (static) flat kept extent, the shape ir::column_sum_partitions decides from.
  Extent split_rows = 0;
  int64_t split_cols = 0;
  /// Bytes of scratch the kernel needs (8-byte aligned), passed after the parameters'
  /// buffers (and after the symbols' values in a symbolic kernel); 0: none.
  int64_t scratch_bytes = 0;
};

/// Row partitions of split reduction `k` (CpuKernel::split_parts != 0) in a launch whose
/// flat reduced extent is `rows`: split_parts, or for a symbolic split
/// ir::column_sum_partitions(rows, split_cols), at least 1 (one partition sums in index
/// order, the unsplit order).
int64_t launch_split_parts(const CpuKernel& k, int64_t rows);

/// The schedule fields of `k` (name, parallel dim and extents, split parts, scratch,
/// symbols) as bytes, for the compile cache and the program file; decode_cpu_schedule
/// reads them back (false: malformed).
std::string encode_cpu_schedule(const CpuKernel& k);
bool decode_cpu_schedule(const std::string& bytes, CpuKernel& k);

/// The last call of a split reduction (CpuKernel::split_parts != 0): combines the
/// `parts` partitions' partial results (launch_split_parts; split_parts for a static
/// kernel), once fn(buffers, begin, end) has run for every parallel index; nothing for
/// other kernels. `buffers` as for fn (scratch included).
inline void combine_cpu_partitions(const CpuKernel& k, void* const* buffers, int64_t parts) {
  if (k.split_parts != 0) k.fn(buffers, parts, parts + 1);
}
inline void combine_cpu_partitions(const CpuKernel& k, void* const* buffers) {
  combine_cpu_partitions(k, buffers, k.split_parts);
}

/// Times of one compile, in seconds.
struct CpuCompileStats {
  double emit_s = 0;      ///< kernel IR -> LLVM IR
  double optimize_s = 0;  ///< O3 pipeline
  double codegen_s = 0;   ///< machine code (object emission) + JIT link (ORC)
  int num_kernels = 0;
  int num_unique = 0;  ///< distinct generated functions (structurally equal kernels share one)
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

/// Relocatable object code (ELF .o for the host triple/CPU/features) of a kernel module.
struct CpuObject {
  std::string object;                ///< the .o file's bytes
  std::string llvm_ir;               ///< LLVM IR after O3
  std::vector<CpuKernel> kernels;    ///< schedules in input order; fn == nullptr
  std::vector<std::string> symbols;  ///< per kernel: the defined function symbol (equal kernels share one)
  CpuCompileStats stats;             ///< emit_s, optimize_s, codegen_s (= object emission), counts
};

/// Options of compile_cpu_object.
struct CpuObjectOptions {
  std::string symbol_prefix =
      "kiln_k_";  ///< symbols are prefix + index + "_" + kernel name with chars outside [A-Za-z0-9_] replaced by '_'
};

/// Compiles `kernels` (verified first; structurally equal kernels share one function, named
/// after the first of them) through LLVM's O3 pipeline to an ELF object with PIC
/// relocations. Errors name the kernel (or the LLVM step that failed).
Expected<CpuObject> compile_cpu_object(const std::vector<Kernel>& kernels, const CpuObjectOptions& opts = {});

/// Loads an object from compile_cpu_object into a new LLJIT (resolves kiln_cpu_ipow and libm/process symbols); the
/// module's llvm_ir() is obj.llvm_ir, stats() adds the link time to codegen_s. Errors: a malformed object, an
/// unresolved symbol, or a kernel/symbol count mismatch.
Expected<std::unique_ptr<CpuModule>> load_cpu_object(const CpuObject& obj);

/// An object file holding read-only data for the ahead-of-time binary: each blob becomes a global
/// `const char SYMBOL[]` (bytes, plus one trailing NUL not counted) and `const int64_t SYMBOL_size`;
/// `table_symbol` becomes a global array `void* const table_symbol[]` of the addresses of the external functions
/// `fn_symbols` (in order, resolved by the system linker), plus `int64_t table_symbol_count`. All symbols have external
/// linkage, C names (no mangling). Errors: a symbol that is not a C identifier, or defined twice.
Expected<std::string> emit_aot_data_object(const std::vector<std::pair<std::string, std::string>>& blobs,
                                           const std::string& table_symbol, const std::vector<std::string>& fn_symbols);

/// Parses LLVM IR text and runs LLVM's verifier (for tests of dumped .ll files). Error: the parser or verifier message.
Status verify_llvm_ir_text(const std::string& text);

/// LLVM IR text of `kernels` before optimization (golden codegen tests; no JIT).
Expected<std::string> emit_llvm_ir(const std::vector<Kernel>& kernels);
/// Same, for target CPU `cpu` with `features` (LLVM's spelling: "skylake-avx512",
/// "+avx,+avx2,+avx512f,+fma") in place of the host's, which the emitter reads (function
/// attributes, row-loop vector widths): text that does not depend on the machine, for the
/// golden files of tests/codegen/golden_codegen_test.cpp. Triple and data layout stay the host's.
Expected<std::string> emit_llvm_ir(const std::vector<Kernel>& kernels, const std::string& cpu,
                                   const std::string& features);

/// Host CPU name and feature string as LLVM reports them (e.g. "skylake-avx512",
/// "+avx512f,+avx512bf16,..."); part of the compile-cache key of `kiln compile`.
std::string host_cpu_description();

}  // namespace kiln::codegen
