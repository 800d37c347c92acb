// The whole-program cache of `kiln train` (issue 30) and the kernel binder of programs
// loaded in kiln itself. A cached program (runtime/program.h) is keyed by SHA-256 over:
// the program file format, kiln's version and build ID, the host CPU and its features,
// the model's bytes (and the size and modification time of each external-data file it
// names), and every TrainConfig field that can change the program (all but the per-run
// fields: data paths, step and epoch counts, output and logging settings, seed; the LR
// schedule reads its step counts at run time), plus whether the training data is a token
// file, whether eval data is given, and the dims past the rows of each .npy data file
// (they bind the model's symbolic dims). A hit skips import, passes and code generation.
// Entries live in <cache_dir>/programs/<key>.kiln (cache_dir as for the kernel cache,
// codegen::default_cache_dir); at most kProgramCacheBytes are kept, least recently used
// first out; a program larger than a quarter of that is not stored. An unusable entry
// gives one warning line and is rebuilt.
#pragma once
#include <optional>
#include <string>

#include "ir/status.h"
#include "passes/pass.h"
#include "runtime/program.h"
#include "runtime/train_config.h"

namespace kiln::driver {

/// Bytes of programs the cache folder keeps (least recently used removed first).
inline constexpr int64_t kProgramCacheBytes = int64_t(2) << 30;

/// The kernel binder of kiln (JIT-links the program's object code with LLVM ORC).
runtime::KernelBinder jit_kernel_binder();

/// The cache key of `cfg`'s program (64 hex digits). Errors: the model cannot be read.
Expected<std::string> program_cache_key(const runtime::TrainConfig& cfg);

/// Path of the cache entry for `key` under cfg's cache folder.
std::string program_cache_path(const runtime::TrainConfig& cfg, const std::string& key);

/// The cached program of `cfg`, or nullopt (a miss, the cache off by --no_cache, IR dumps
/// or --stop-after asked for in `dbg`, or an unusable entry: one warning line). Logs
/// "cache" lines.
std::optional<runtime::Program> load_cached_program(const runtime::TrainConfig& cfg, const passes::PassContext* dbg);

/// Stores `p` (built for `cfg`) in the cache; never fails the run (one warning line).
/// Nothing is stored for a pipeline cut short by --stop-after in `dbg` (its program is not
/// the one the key names).
void store_cached_program(const runtime::TrainConfig& cfg, const runtime::Program& p,
                          const passes::PassContext* dbg = nullptr);

/// kiln's version string (KILN_VERSION).
const char* kiln_version();

}  // namespace kiln::driver
