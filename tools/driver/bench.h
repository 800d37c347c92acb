// `kiln bench`: times training steps of one or more program variants (backend x remat
// policy x optimizer) from the model's initial weights, their steps interleaved so that
// the machine's load falls on each alike; prints compile times, step times, measured
// and planned peak memory, tensor allocations and, optionally, per-op profiles.
#pragma once
#include <functional>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "ir/status.h"
#include "passes/memory_plan.h"
#include "passes/pass.h"
#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/profile.h"
#include "runtime/train_config.h"
#include "runtime/trainer.h"
#include "tools/driver/driver.h"

namespace kiln::driver {

/// What run_bench times and how.
struct BenchOptions {
  /// The validated training configuration; its backend, remat_policy and optim may be
  /// comma lists: one program per combination (a variant). With train_data empty the
  /// steps run on a synthetic batch (normal floats, random class ids) from `seed`.
  runtime::TrainConfig config;
  int warmup = 3;                 ///< untimed warm-up steps (>= 0; raised to 1 with several variants)
  int steps = 10;                 ///< timed steps (>= 1)
  bool profile = false;           ///< print a profile table per variant of the timed steps
  std::string profile_by = "op";  ///< profile rows per "op" or per "node"
  int profile_row_limit = 25;     ///< profile rows before the rest is summed (0: every row)
  /// --compare_static: with a symbolic shape mode, also time the static program of
  /// exactly each shape the symbolic program runs (variable-length data: the program of
  /// each batch length, specialize without a recompile limit, compared per length seen;
  /// a synthetic batch: the static variant of the --shape length is added).
  bool compare_static = false;
  /// Makes the pass context of the builds (--print-ir-after, --dump-ir-dir: one subfolder
  /// per variant when there are several, ...); called once, before the first build (the
  /// command line parses its pass flags there, after the warm-up note). Empty: defaults.
  std::function<passes::PassContext()> pass_context;
  /// Called once all programs are built, before any step, with the pass context the
  /// builds used (the command line reports a --print-ir-after pass that did not run).
  std::function<void(const passes::PassContext&)> after_build;
};

/// One measured program (a kiln bench variant, a kiln fit candidate): its program,
/// trainer and measurements.
struct BenchRun {
  std::string backend;  ///< the variant's label
  TrainingProgram prog;
  std::optional<runtime::Trainer> tr;
  std::optional<passes::MemoryPlan> plan;  ///< executor_plan of the program
  /// Planned step peak (bytes): the plan's, else the program's own (a symbolic program's
  /// step arena planned at its bound); -1: none.
  int64_t planned_peak = -1;
  int64_t resident = 0;        ///< the step's own resident bytes: constants and state
  int64_t peak = 0;            ///< measured step peak (bytes)
  std::vector<double> times;   ///< seconds of each timed step
  int64_t allocations = 0;     ///< tensor storage allocations (ir::MemoryStats) in the timed steps
  double compile_s = 0;        ///< seconds to build the program
  runtime::OpProfile profile;  ///< --profile: the timed steps only
  /// A data-parallel job (runtime/comm.h): what the communication layer counted in the
  /// timed steps (their sums) for this variant.
  runtime::comm::CommStats comm;
};

/// Builds `c`'s training program (for `total_steps` optimizer steps) and a trainer that
/// writes no files on `ds`: the first call makes `ds` from c.train_data (checked as kiln
/// train checks it) or, without data, a synthetic batch of c's rows per step (normal
/// floats, random class ids, seeded by c.seed); later calls reuse it. Errors: the build's,
/// the data's (prefixed --train_data).
/// `length` > 0: the program is symbolic (--shape_mode symbolic on a synthetic batch) and
/// its synthetic batch has this sequence length (its batch dim: the rows).
Status prepare_bench_run(BenchRun& run, const runtime::TrainConfig& c, passes::PassContext& dbg, int64_t total_steps,
                         std::optional<runtime::Dataset>& ds, int64_t length = 0);
/// Records the resident bytes before the timed steps (after the warm-up steps).
void start_timing(BenchRun& r);
/// One timed step: appends its seconds and raises the measured peak (MemoryStats peak
/// during the step less what was resident before it, plus BenchRun::resident).
Status timed_bench_step(BenchRun& r);

/// Table helpers of the bench outputs: printf of one number; `s` padded with spaces to
/// `width` characters (left-aligned when `left`); the median of `t` (0 when empty).
std::string bench_fmt(const char* f, double v);
std::string bench_pad(const std::string& s, size_t width, bool left = false);
double bench_median(std::vector<double> t);

/// Builds every variant's program, runs the warm-up and timed steps and writes the
/// results to `out` (one summary for one variant, else a table relative to the first);
/// notes go to `err`. Errors: a program that does not build, data that does not bind,
/// a step that fails (each naming the file, flag or input at fault).
Status run_bench(const BenchOptions& opts, std::ostream& out, std::ostream& err = std::cerr);

/// kiln bench on variable-length data (--train_data ROWS.jsonl or PREFIX.idx; issue 31):
/// each --shape_mode of the comma list (pad, specialize, buckets) trains the same
/// length-grouped batches from the same weights, steps alternating; prints per mode the
/// programs built, compile seconds cold (a fresh cache) and warm (the program cache),
/// programs built after step 1, the padding fraction, real (non-pad) tokens per second
/// (compile time excluded), planned and measured peak, and the step time per padded
/// length. run_bench calls it for such data. Errors: a list in --backend, --optim or
/// --remat_policy; those of the data, the builds and the steps.
Status run_shape_bench(const BenchOptions& opts, std::ostream& out, std::ostream& err = std::cerr);

}  // namespace kiln::driver
