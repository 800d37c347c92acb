// `kiln fit` and `kiln train --auto_fit` (issue 33): the training recipe that fits a memory
// budget, planned instead of tried. The recipes the user left free (per-device batch x
// gradient accumulation with a fixed product, fp32 or bf16, the remat policy, AdamW's
// 32-bit or 8-bit state) are each planned exactly by the passes and the memory planner
// without generating kernels (recipes that share a pass prefix share its work: a trie
// keyed by each pass and the options it reads); the fitting ones are ranked by a cost
// model (cost_model.h) and the best few measured with real steps. Hugging Face's answer
// to the same problem, auto_find_batch_size, halves the batch after each out-of-memory.
#pragma once
#include <cstdint>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "ir/status.h"
#include "runtime/train_config.h"
#include "tools/driver/cost_model.h"

namespace kiln::driver {

/// What kiln fit searches and how.
struct FitOptions {
  /// The validated configuration: its model, data and every flag the search leaves alone;
  /// the searched fields take the values of fixed dims from here.
  runtime::TrainConfig config;
  int64_t memory_budget = 0;         ///< bytes a training step's planned peak may reach (> 0)
  int64_t effective_batch_size = 0;  ///< per_device_train_batch_size x gradient_accumulation_steps (> 0)
  // Dims the user fixed (given on the command line or in --config): searched otherwise.
  bool fix_batch = false;         ///< per_device_train_batch_size
  bool fix_accumulation = false;  ///< gradient_accumulation_steps
  bool fix_precision = false;     ///< --bf16 / --fp16
  bool fix_remat = false;         ///< --remat_policy / --gradient_checkpointing
  bool fix_optim = false;         ///< --optim
  int measure_top = 3;            ///< fitting recipes measured with real steps, best estimates first (0: none)
  int measure_steps = 2;          ///< timed steps of each (after one warm-up step), interleaved
  /// Threads planning the recipes (one batch size's trie each; results do not depend on
  /// it); 0: OpenMP's thread count (OMP_NUM_THREADS, else the cores).
  int plan_threads = 0;
};

/// One recipe and what the search learned of it.
struct FitCandidate {
  int64_t batch = 0, accumulation = 0;  ///< per_device_train_batch_size, gradient_accumulation_steps
  std::string precision;                ///< fp32, bf16 or fp16
  std::string remat;                    ///< none, blocks, sqrt, min-cut, budget
  std::string optim;                    ///< adamw_torch, adamw_8bit, ...
  std::string error;                    ///< why it has no plan ("": planned)
  int same_as = -1;                     ///< index of an identical recipe (budget that recomputes nothing), or -1
  int64_t planned_peak = -1;            ///< bytes, the executor's plan of the step
  double estimated_s = 0;               ///< cost model, seconds per optimizer step
  double modelled_launches = 0;         ///< kernels per step the cost model does not time (generated ones)
  double measured_s = -1;               ///< median seconds per optimizer step (-1: not measured)
  int64_t measured_peak = -1;           ///< bytes (-1: not measured)
  int recomputed_nodes = 0;             ///< forward nodes the remat pass recomputes
  double recompute_flops = 0;           ///< FLOPs recomputed per microbatch
  bool planned() const { return error.empty() && planned_peak >= 0; }
  /// The search's label: "4x8 bf16 sqrt adamw_8bit".
  std::string label() const;
  /// The recipe `c` trains with (its batch, accumulation, precision, remat policy, optimizer).
  static FitCandidate of(const runtime::TrainConfig& c);
  /// `base` with this recipe's fields set (memory_budget kept only for remat budget).
  runtime::TrainConfig config(const runtime::TrainConfig& base, int64_t memory_budget) const;
};

/// The search's outcome.
struct FitResult {
  std::vector<FitCandidate> candidates;  ///< every recipe, in search order
  int chosen = -1;                       ///< index of the chosen recipe (-1: nothing fits)
  int smallest = -1;                     ///< index of the planned recipe of least peak (-1: none planned)
  MachineRates rates;
  double plan_s = 0, measure_s = 0, total_s = 0;  ///< wall seconds
  int passes_run = 0;                             ///< pass runs of the trie (shared prefixes once)
  int timed_kernels = 0;                          ///< distinct eager kernels the estimates read (OpTimes)
  int kernels_measured = 0;                       ///< of which timed by this search (the rest were cached)
  double kernel_timing_s = 0;                     ///< seconds spent timing them (included in plan_s)
  int passes_unshared = 0;                        ///< pass runs the recipes would take one by one
  /// The fitting recipes, unique, fastest estimate first (indexes into candidates).
  std::vector<int> fitting;
};

/// The budget --memory_budget names in bytes: a size (parse_byte_size), or "auto": the
/// memory available (/proc/meminfo MemAvailable, or the cgroup's memory.max less its
/// memory.current when that is smaller) less a 10% margin. `how` (optional) gets a short
/// note saying where an auto budget came from. Errors: a malformed size, no reading.
Expected<int64_t> resolve_memory_budget(const std::string& text, std::string* how = nullptr);

/// FitOptions for `cfg` (a configuration with --auto_fit, --auto_find_batch_size, or kiln
/// fit's flags) where `given(name)` says whether the user set flag `name` (on the command
/// line or in --config): the effective batch is --effective_batch_size, else
/// per_device_train_batch_size x gradient_accumulation_steps; with --effective_batch_size
/// given, a given batch size or accumulation stays fixed (without it, they only define the
/// product and the split is searched); --bf16/--fp16, --remat_policy/--gradient_checkpointing
/// and --optim given stay fixed; the budget is --memory_budget (auto when empty with
/// --auto_find_batch_size). Errors: those of resolve_memory_budget; no budget; no split of
/// the effective batch that the fixed batch flags allow.
Expected<FitOptions> fit_options(const runtime::TrainConfig& cfg, const std::function<bool(const std::string&)>& given,
                                 std::string* budget_note = nullptr);

/// For a resumed --auto_fit run: sets `cfg`'s recipe fields (batch size, accumulation,
/// bf16/fp16, remat policy and its budget, optimizer) to those the checkpoint named by
/// --resume_from_checkpoint (a folder, or "latest"/"true": the newest in --output_dir)
/// was trained with, so a resume continues the same recipe instead of searching again
/// (measurements differ from run to run). Returns the checkpoint folder; "" when there is
/// no readable one (the run's own resume then reports it). Errors: none.
std::string apply_checkpoint_recipe(runtime::TrainConfig& cfg);

/// The training data of `o.config` (when given) loaded and checked against the model as
/// kiln train checks it (labels and token ids in range), before a search that would
/// otherwise fail only when it measures. Errors: one line prefixed "--train_data".
Status check_fit_data(const FitOptions& o);

/// Plans every free recipe, ranks the fitting ones, measures the best few and picks the
/// fastest measured one whose measured peak is within the budget. Notes (calibration,
/// progress) go to `err`. Errors: the model does not import, a recipe's pass fails for a
/// reason other than the budget, a measured step fails. Nothing fitting is not an error:
/// FitResult::chosen is -1 and `smallest` names the least peak reached.
Expected<FitResult> run_fit(const FitOptions& o, std::ostream& err = std::cerr);

/// The result table: the Pareto front of planned peak against estimated time per
/// optimizer step (no other recipe plans less and is estimated faster) and every measured
/// recipe, by planned peak, with whether it fits, estimated and measured time, samples
/// per second and what was recomputed; then the chosen recipe.
std::string format_fit(const FitResult& r, const FitOptions& o);

/// The chosen recipe as `kiln train` flags ("--per_device_train_batch_size 4 ...").
std::string fit_flags(const FitCandidate& c, int64_t memory_budget);

/// The chosen recipe as a --config JSON object (the recipe's keys only).
std::string fit_config_json(const FitCandidate& c, int64_t memory_budget);

/// Every recipe as JSON (for tools/fit_grid.py): the search's settings, then per recipe
/// its flags, planned peak, estimate, measurement, recomputation, error and whether it
/// fits and was chosen.
std::string fit_report_json(const FitResult& r, const FitOptions& o);

/// One line for nothing fitting: the budget, the smallest reachable peak and its recipe
/// (or, when recipes planned within the budget all measured over it, the smallest
/// measured peak and its recipe).
std::string fit_nothing_fits(const FitResult& r, const FitOptions& o);

/// SVG: planned peak (x, MiB) against time per optimizer step (y; measured where
/// measured, else estimated) of every planned recipe, the budget as a vertical line, the
/// chosen recipe marked.
std::string fit_svg(const FitResult& r, const FitOptions& o);

}  // namespace kiln::driver
