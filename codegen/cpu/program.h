// A graph's generated CPU kernels: every FusedKernel node lowered to kernel IR
// (codegen/lower.h) and compiled into one LLVM ORC module (codegen/cpu/llvm_cpu.h).
// The executor (runtime/interpreter.cpp, RunOptions::program) runs each FusedKernel
// node through its kernel; the rest of the program runs as library steps.
//
// Compile cache (issue 8): the kernels' object code is cached in memory (process lifetime)
// and on disk (`<cache_dir>/<key>.kcache`), keyed by a SHA-256 over the cache format, kiln's
// and LLVM's versions, the GNU build ID of the kiln binary (a rebuilt code generator never
// loads an older one's code), the host CPU and features, the symbol prefix and the text of
// every lowered kernel. The folder keeps at most 512 MiB of entries: after each store the
// least recently used ones (oldest mtime; a hit touches its entry) are removed. A hit
// skips LLVM emission, O3 and code generation (lowering still runs).
// File layout (little-endian): "KILNCCH\0" magic, u32 format version, u64 payload length,
// 32-byte SHA-256 of the payload, then the payload (key, kernel schedules and symbols, LLVM
// IR, object bytes, stats). A truncated, corrupt or stale entry is never loaded: one warning
// line on stderr, then the entry is rebuilt and overwritten (written to a temp file, renamed).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/kernel_ir.h"
#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::codegen {

/// The compiled kernels of one graph, keyed by FusedKernel node name (names are unique
/// in a program, so a clone of the graph, as the trainer's eval copy, finds them too).
struct CpuProgram {
  std::shared_ptr<CpuModule> module;  ///< JIT-linked kernels (shared with the in-memory cache)
  std::vector<Kernel> kernels;        ///< kernel IR, in schedule order (before collapse_dims)
  std::unordered_map<std::string, const CpuKernel*> by_node;
  double lower_s = 0;  ///< seconds spent lowering to kernel IR
  /// The module's object code (always kept: `kiln compile` links it into the AOT binary);
  /// null when the graph has no fused node. On a disk hit its stats hold zero LLVM times.
  std::shared_ptr<const CpuObject> object;
  std::string cache_key;     ///< SHA-256 of the cache key material, 64 hex digits ("" if no fused node)
  std::string cache_status;  ///< "memory hit", "disk hit", "miss" or "off" (cache disabled or nothing to compile)
  /// Kernel for a FusedKernel node, or nullptr.
  const CpuKernel* find(const ir::Node* n) const {
    auto it = by_node.find(n->name);
    return it == by_node.end() ? nullptr : it->second;
  }
};

/// Options of compile_graph_cpu.
struct CpuCompileOptions {
  bool use_cache = true;  ///< in-memory and on-disk compile cache
  std::string cache_dir;  ///< "" = $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else $HOME/.cache/kiln
  std::string symbol_prefix = "kiln_k_";
  /// Log sink for KILN_LOGS topics: called with ("cache", line) for hit/miss/store lines and ("output_code", text) with
  /// every kernel's kernel-IR text and the module's LLVM IR; may be empty.
  std::function<void(const std::string& topic, const std::string& text)> log;
};

/// Lowers and compiles every FusedKernel node of `g` (loop bodies included), with the
/// default options (cache on). A graph with no fused node gives an empty program.
/// Errors name the node or kernel.
Expected<std::shared_ptr<CpuProgram>> compile_graph_cpu(const ir::Graph& g);

/// As above with explicit options. Cache problems never fail the compile: an unusable
/// entry or an unwritable cache dir prints one `kiln: warning: ...` line on stderr.
/// use_cache = false reads and writes no file.
Expected<std::shared_ptr<CpuProgram>> compile_graph_cpu(const ir::Graph& g, const CpuCompileOptions& opts);

/// Empties the in-memory compile cache (tests; modules already handed out stay valid).
void clear_cpu_memory_cache();

/// The cache directory used when CpuCompileOptions::cache_dir is empty: $KILN_CACHE_DIR,
/// else $XDG_CACHE_HOME/kiln, else $HOME/.cache/kiln (else ".kiln_cache" when HOME is unset).
std::string default_cache_dir();

/// The GNU build ID (hex) of the kiln binary holding the code generator ("" when it has
/// none): changes with every rebuild; part of the compile caches' keys.
std::string kiln_build_id();

/// Writes `bytes` to `path` atomically (a temp file in the same folder, then rename; the
/// folder is created): "" or the error. For cache entries (kernels, programs).
std::string write_cache_file(const std::string& path, const std::string& bytes);

/// The cache folders and entries this process created (write_cache_file and the compile
/// cache's stores; folders before the files in them, in creation order): a command that
/// fails removes the ones created since it began (driver::OutputGuard).
std::vector<std::string> cache_paths_created();

/// Removes the least recently used files of `dir` with extension `ext` (oldest
/// modification time first) until the rest hold at most `max_bytes`, never `keep`.
/// Returns how many were removed; errors (a file vanishing meanwhile) are ignored.
int prune_cache_files(const std::string& dir, const std::string& ext, int64_t max_bytes, const std::string& keep);

}  // namespace kiln::codegen
