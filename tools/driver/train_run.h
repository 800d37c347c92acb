// One training run as `kiln train` does it, shared by the kiln command line and the
// ahead-of-time binary of `kiln compile` (tools/aot/): load and check the data, build
// the training program, train (runtime::train), write model.onnx and
// model.safetensors to output_dir, print planned against measured peak memory.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"
#include "passes/memory_plan.h"
#include "passes/pass.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/train_config.h"
#include "runtime/trainer.h"
#include "tools/driver/driver.h"

namespace kiln::driver {

/// Data specs of a forward model before the training program exists: its inputs, and
/// the label input (class ids for cross_entropy with free dims, else the output's type).
std::vector<runtime::DataInputSpec> forward_specs(const ir::Graph& g, const runtime::TrainConfig& cfg);

/// Loader options (label input, loss, block size) for `cfg`.
runtime::DataOptions data_options(const runtime::TrainConfig& cfg);

/// The runtime's view of a built program.
runtime::TrainGraphs graphs_of(const TrainingProgram& p);

/// Specs of the data inputs `names` present in `g` (errors: an input's type is not static enough).
Expected<std::vector<runtime::DataInputSpec>> program_specs(const ir::Graph& g, const std::vector<std::string>& names);

/// Bytes of a graph's constant initializers: resident before a run, used by every step.
int64_t initializer_bytes(const ir::Graph& g);

/// The graph's memory plan with the eager interpreter's accounting (what MemoryStats
/// measures); nullopt, with a note on stderr, when the graph cannot be planned.
std::optional<passes::MemoryPlan> eager_plan(const ir::Graph& g);

/// The plan of what `p`'s executor runs: with a step arena (--backend compiled), the
/// arena's own plan (step_arena_plan_options); else eager_plan. nullopt (with a note on
/// stderr) when the graph cannot be planned.
std::optional<passes::MemoryPlan> executor_plan(const TrainingProgram& p);

/// Bytes resident for every step besides the graphs' constants and the trainer's state:
/// the train step arena's block (0 without one).
int64_t step_arena_bytes(const TrainingProgram& p);

/// "planned X (N B), measured Y (M B) (measured - planned: Z% of planned)".
std::string planned_vs_measured(int64_t planned, int64_t measured);

/// Optimizer steps per epoch of `cfg` on `train_raw`, checking the data against the
/// model first. Errors (one line, prefixed "--train_data"): the data does not fit the
/// model's inputs, or it has fewer rows than one optimizer step.
Expected<int64_t> steps_per_epoch(const runtime::TrainConfig& cfg, const runtime::RawData& train_raw);

/// Checks data values against the model (`forward`: the imported model) before training:
/// integer arrays fed straight into a Gather (embedding lookups) and the tokens of a
/// token file lie inside the looked-up table, and cross_entropy labels (the label input)
/// in [0, classes) (classes: the last dim of the model's first output, the logits the
/// loss reads) or equal ignore_index.
/// Error: one line "FLAG: NAME=FILE: label V at row R is outside [0, C) ..." (or index /
/// token) for the first value that is not.
Status check_data_values(const runtime::RawData& raw, const std::string& flag, const ir::Graph& forward,
                         const runtime::TrainConfig& cfg);

/// As above against a program's signature (model_signature of the forward model).
Status check_data_values(const runtime::RawData& raw, const std::string& flag, const runtime::ProgramSignature& sig,
                         const runtime::TrainConfig& cfg);

/// Every trainable float parameter of `g` is finite. Error (one line): "parameter 'W'
/// holds NaN (element 5 of f32[4, 3]); ...".
Status check_finite_parameters(const ir::Graph& g);

/// What a command creates in its output folder and caches, removed again when the command
/// fails (architecture decision 35): a refused run leaves no folder, lock file,
/// metrics.jsonl or cache entry it created, and a folder that existed before as it was.
/// Construct it before the output folder is created; call keep() once the command
/// succeeded. Destroyed without keep(), it removes the entries of the output folder that
/// were not there at construction, then the folders (and parents) it created, if empty,
/// then the cache entries and folders this process created since (compile and program
/// caches: codegen::cache_paths_created; never another process's); the held lock is
/// released last, so the lock file is unlinked while still locked. When the failed run
/// wrote a checkpoint-N (training progress to resume from), only the lock file it created
/// goes from the output folder; `progress_dir` (another command's output folder, such as
/// the run's whose TensorBoard files this guard covers) counts its checkpoints too.
class OutputGuard {
 public:
  explicit OutputGuard(std::string output_dir, std::string progress_dir = "");
  ~OutputGuard();
  OutputGuard(const OutputGuard&) = delete;
  OutputGuard& operator=(const OutputGuard&) = delete;
  /// Holds `lock` until after the cleanup.
  void hold(std::unique_ptr<runtime::OutputDirLock> lock) { lock_ = std::move(lock); }
  void keep() { keep_ = true; }

 private:
  std::string dir_;
  std::string progress_dir_;          ///< a folder whose checkpoint-N entries also count as progress
  std::vector<std::string> created_;  ///< folders missing at construction, deepest first
  std::vector<std::string> before_;   ///< names of dir_'s entries at construction (sorted)
  size_t cache_mark_ = 0;             ///< codegen::cache_paths_created().size() at construction
  std::unique_ptr<runtime::OutputDirLock> lock_;
  bool keep_ = false;
};

/// The programs of a run's batch shapes (runtime::ProgramProvider, issue 31): the epoch's
/// last partial batch (--dataloader_drop_last false) and each padded length of
/// variable-length data. A shape's program is the one `cfg` gives with
/// per_device_train_batch_size, gradient_accumulation_steps and the sequence symbols
/// (the dim 1 dim_params of the model's integer (batch, seq) inputs) bound to it: taken
/// from the program cache, else built from the model (imported once, when first needed)
/// and stored there. Each one is logged with its reason (KILN_LOGS=recompiles).
class ShapePrograms {
 public:
  /// `module`: the imported model (null: imported on the first build); `total_steps`:
  /// the run's, for the LR schedule's defaults.
  ShapePrograms(runtime::TrainConfig cfg, passes::PassContext* dbg, int64_t total_steps,
                std::unique_ptr<ir::Graph> module);
  /// The program of `shape` (built once; the graphs live as long as this object).
  /// Errors: the build's, or a --shape binding of a sequence dim (variable-length data
  /// binds it per batch).
  Expected<runtime::TrainGraphs> get(const runtime::StepShape& shape, const std::string& reason);
  /// The provider for runtime::TrainerOptions::programs (valid while this object lives).
  runtime::ProgramProvider provider();
  /// The longest row the data gives (tokens, runtime::Dataset::max_length): the bound a
  /// symbolic program is checked and planned at when --max_length is 0 (its default).
  void set_longest_row(int64_t tokens) {
    if (cfg_.max_length == 0) cfg_.max_length = tokens;
  }
  /// Programs built by the passes, and taken from the program cache.
  int64_t built() const { return built_; }
  int64_t cache_hits() const { return hits_; }
  /// Wall seconds spent getting programs (builds and cache loads).
  double seconds() const { return seconds_; }
  /// The largest planned peak of the programs (bytes; -1: none planned).
  int64_t max_planned_peak() const;
  /// Bytes of the programs' step arenas (each program has its own).
  int64_t arena_bytes() const;
  const std::map<runtime::StepShape, TrainingProgram>& programs() const { return programs_; }
  /// The imported model (imported now if it was not given). Errors: the import's.
  Expected<const ir::Graph*> module();

 private:
  runtime::TrainConfig cfg_;
  passes::PassContext* dbg_;
  int64_t total_steps_;
  std::unique_ptr<ir::Graph> module_;
  std::map<runtime::StepShape, TrainingProgram> programs_;
  int64_t built_ = 0, hits_ = 0;
  double seconds_ = 0;
};

/// The sequence symbols of `module`: dim_params of dim 1 of its integer rank-2 inputs.
std::vector<std::string> sequence_symbols(const ir::Graph& module);

/// Trains with `cfg` (train_data required; resume_from_checkpoint "latest"/"true"
/// resolved to the newest checkpoint in output_dir), then writes output_dir/model.onnx
/// and model.safetensors and prints "saved ...", the final eval metrics and the peak
/// memory line on `out`. `dbg` carries the pass-manager switches. Errors (one line):
/// unreadable data, data that does not fit the model, too few rows for one step, a
/// missing checkpoint, any build or run failure.
/// The program: `loaded` when given (DIR/train's own program file; moved from), else the
/// program cache's entry (tools/driver/program_cache.h: no import, no pass), else built
/// from the model imported once and stored in the cache.
Status run_training(runtime::TrainConfig cfg, passes::PassContext* dbg, std::ostream& out,
                    runtime::Program* loaded = nullptr);

}  // namespace kiln::driver
