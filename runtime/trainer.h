// The trainer: runs a compiled training step in a loop with data, logging,
// evaluation, checkpoints and exact resume (Hugging Face Trainer semantics).
//
// State: every Graph::state binding of the train_step graph (parameters, optimizer
// state, BatchNorm buffers, the "step" counter) lives in a map keyed by the binding's
// input name, initialised from StateBinding::initial (cloned). Step k (0-based):
// feed the batch (epoch k / spe, index k % spe) and the state, run train_step with
// RunOptions{training=true, seed, step=k}, and take the state outputs as the next
// state. The data order and dropout depend only on (seed, k), so a run resumed from
// checkpoint-k computes the same losses as an uninterrupted one.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kiln::codegen {
struct CpuProgram;
}

#include "ir/graph.h"
#include "ir/status.h"
#include "ir/tensor.h"
#include "runtime/arena.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/metrics.h"
#include "runtime/profile.h"
#include "runtime/shapes.h"
#include "runtime/train_config.h"

namespace kiln::runtime {

class ProgressBar;

class Backend;
class Executable;

/// The graphs the trainer runs (filled by the CLI from driver::TrainingProgram, so
/// the runtime does not depend on tools/).
struct TrainGraphs {
  const ir::Graph* train_step = nullptr;  ///< outputs "loss", "grad_norm", "learning_rate" + state outputs
  const ir::Graph* eval = nullptr;        ///< optional; outputs "loss" (+ logits); parameters as inputs
  std::vector<std::string> data_inputs;   ///< model inputs then the label input
  std::string label_input;                ///< "" for --loss model
  std::string logits_output;              ///< eval output holding logits (falls back to "logits")
  /// --backend compiled: generated kernels of train_step's / eval's FusedKernel nodes (null: eager).
  const codegen::CpuProgram* train_program = nullptr;
  const codegen::CpuProgram* eval_program = nullptr;
  /// --backend compiled: step arenas of train_step / eval (runtime/arena.h; null: allocate per result).
  const StepArena* train_arena = nullptr;
  const StepArena* eval_arena = nullptr;
  /// The batch shapes the program was built for (runtime/program.h ProgramSignature):
  /// rows of one microbatch, microbatches per step (the accumulation loop's trip count),
  /// rows of one eval batch. 0: not known (graphs built without a program), and the
  /// trainer reads per_device_train_batch_size, gradient_accumulation_steps and
  /// per_device_eval_batch_size from the config.
  int64_t microbatch_rows = 0;
  int64_t accumulation_steps = 0;
  int64_t eval_rows = 0;
  /// The backend that runs the graphs (runtime/backend.h make_backend: "compiled",
  /// "eager", "cuda"); empty: "compiled" when kernels or an arena are given, else "eager".
  std::string backend;
};

/// The batch shape one program runs (issue 31): rows of a microbatch, microbatches per
/// optimizer step, and the padded length of variable-length data (0: fixed-size data).
/// Every program of a run has the same state (parameters, optimizer state, buffers).
struct StepShape {
  int64_t micro_rows = 0, trips = 0, length = 0;
  auto operator<=>(const StepShape&) const = default;
};

/// Builds, or loads from the program cache, the program of a batch shape the run has not
/// loaded yet; `reason` says why it is needed (the caller logs it: KILN_LOGS=recompiles).
/// The graphs must stay alive as long as the provider. Errors: the build's.
using ProgramProvider = std::function<Expected<TrainGraphs>(const StepShape& shape, const std::string& reason)>;

/// Console and behaviour switches of a run (not part of the HF config).
struct TrainerOptions {
  std::ostream* out = &std::cout;  ///< log lines and the progress bar
  /// progress bar: 1 on, 0 off, -1 when stdout is a terminal (and --disable_tqdm not given)
  int progress = -1;
  bool write_files = true;  ///< metrics.jsonl and checkpoints under output_dir
  /// The training step's planned peak (the memory plan; < 0: unknown), added to the final
  /// metrics line as planned_peak_bytes.
  int64_t planned_peak_bytes = -1;
  /// ir::MemoryStats bytes resident before the run that are not step memory (< 0: no
  /// measurement): the final metrics line's measured_peak_bytes is the run's peak less these.
  int64_t memory_base_bytes = -1;
  /// Op-level profile of the train steps (RunOptions::profile; null: off). kiln bench
  /// --profile sets it after the warm-up steps with Trainer::set_profile.
  OpProfile* profile = nullptr;
  /// Programs of other batch shapes: the epoch's last partial batch (--dataloader_drop_last
  /// false) and variable-length data (--shape_mode). Null: the run has one program, and a
  /// step that needs another shape is an error. With a provider, Trainer::create may be
  /// given no train_step graph: it asks for the program of the first step's shape.
  ProgramProvider programs;
  /// Notes may suggest flags that build other programs (--dataloader_drop_last false);
  /// false in a `kiln compile` binary, whose programs are fixed when it is compiled.
  bool suggest_program_flags = true;
};

/// Result of one optimizer step.
struct StepResult {
  double loss = 0, grad_norm = 0, learning_rate = 0;
  double seconds = 0;
  /// --fp16 (passes/grad_scaler.cpp): the optimizer step was skipped on non-finite
  /// gradients; the loss scale used by this step and the one for the next (NaN without --fp16).
  bool skipped = false;
  double loss_scale = std::nan(""), loss_scale_next = std::nan("");
};

/// What a run produced.
struct TrainResult {
  int64_t global_step = 0;
  double epoch = 0;
  int64_t total_steps = 0;
  double train_loss = 0;                       ///< mean loss over the steps of this process
  std::vector<double> step_losses;             ///< loss of each step run by this process, in order
  std::map<std::string, double> eval_metrics;  ///< final eval_loss / eval_accuracy (when eval data given)
  std::map<std::string, ir::Tensor> weights;   ///< final parameters and buffers by initializer name
  /// SIGINT/SIGTERM stopped the run after step global_step (StopOnSignal; 0: it ran to
  /// its end). A checkpoint of that step was saved when --save_steps is set; no final
  /// evaluation, no summary line in metrics.jsonl.
  int stopped_by_signal = 0;
};

/// Data-input specs (name, dtype, shape) of `names` in graph `g`. Error for a missing name.
Expected<std::vector<DataInputSpec>> data_input_specs(const ir::Graph& g, const std::vector<std::string>& names);

/// A training session over one TrainGraphs.
class Trainer {
 public:
  /// Checks the graphs (every train_step input is data or state; state has initial
  /// values; the "loss" output exists) and initialises the state. `eval_data` may be null.
  static Expected<Trainer> create(const TrainConfig& cfg, const TrainGraphs& graphs, const Dataset* train_data,
                                  const Dataset* eval_data, TrainerOptions opts = {});

  /// Rows per optimizer step: microbatch rows * microbatches per step, as the program
  /// records them (TrainGraphs; the config's when it does not).
  int64_t rows_per_step() const { return rows_per_step_; }
  /// Rows of one microbatch and microbatches per step (TrainGraphs).
  int64_t microbatch_rows() const { return micro_rows_; }
  int64_t accumulation_steps() const { return trips_; }
  /// Rows of one eval batch (TrainGraphs).
  int64_t eval_rows() const { return eval_rows_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t total_steps() const { return total_steps_; }
  int64_t global_step() const { return global_step_; }

  /// --shape_mode buckets: builds the program of every remaining step and every eval
  /// batch now, so that nothing compiles during training (run() calls it before step 1);
  /// other modes: nothing. Errors: the builds'.
  Status prepare_programs();
  /// Profiles the following train steps into `p` (null: stop profiling).
  void set_profile(OpProfile* p) { opts_.profile = p; }
  /// Restores state and position from a checkpoint directory. Errors name the tensor at
  /// fault and the flags whose change caused it (another --optim, --freeze, --fp16; a
  /// batch size that changes the data order). Accepted changes (hyperparameters, the
  /// seed, --bf16) leave one warning line for take_resume_warning().
  Status restore(const std::string& checkpoint_dir);
  /// The warning line of the last restore() ("" when nothing changed), then cleared.
  std::string take_resume_warning() { return std::exchange(resume_warning_, std::string()); }
  /// One optimizer step on the next batch (or on `batch` when given); advances global_step.
  Expected<StepResult> step(const Batch* batch = nullptr);
  /// Evaluates on the eval data: {"eval_loss", "eval_accuracy" (class-id labels)}.
  /// `bar` (optional) is started for the eval batches and updated after each.
  Expected<std::map<std::string, double>> evaluate(ProgressBar* bar = nullptr);
  /// Writes output_dir/checkpoint-<global_step>, then applies save_total_limit. In a
  /// data-parallel job every rank calls it (ZeRO-1 shards are gathered) and rank 0 writes.
  Status save();
  /// The whole loop: steps, logging, eval, checkpoints; returns the final metrics.
  Expected<TrainResult> run();

  /// The batch shape of optimizer step `step` (0-based): its rows (the last partial batch's
  /// split into microbatches of at most microbatch_rows) and, for variable-length data,
  /// the length its longest row pads to under --shape_mode.
  StepShape step_shape(int64_t step) const;
  /// The programs loaded so far, by shape (for kiln bench and tests).
  std::vector<StepShape> loaded_shapes() const;
  /// Variable-length data: the padded lengths per --shape_mode (null for fixed-size data).
  const ShapeChooser* shape_chooser() const { return chooser_ ? &*chooser_ : nullptr; }

  /// Current state by input name (parameters, optimizer state, buffers, counters).
  const std::map<std::string, ir::Tensor>& state() const { return state_; }
  /// Parameters and buffers only (what model.safetensors / model.onnx hold).
  std::map<std::string, ir::Tensor> weights() const;

 private:
  Trainer() = default;
  /// Feeds of `g` by position (g.inputs order, for Backend::run_positional): data inputs
  /// from `batch`, state inputs from the state; undefined for an input left at its default
  /// and, with `data_optional`, for data inputs missing from `batch` (streamed).
  Expected<std::vector<ir::Tensor>> feeds_for(const ir::Graph& g, const Batch& batch,
                                              const std::vector<DataInputSpec>& specs,
                                              bool data_optional = false) const;
  double epoch_now() const;
  /// One program of the run: its graphs and what the trainer derived from them.
  struct Variant {
    TrainGraphs g;
    std::vector<DataInputSpec> train_specs, eval_specs;
    std::shared_ptr<Executable> train_exec, eval_exec;
    /// Eval graph whose parameters are initializers (not inputs): a clone whose
    /// initializer data the trainer points at the current state before each eval.
    std::shared_ptr<ir::Graph> eval_clone;
    /// The train step's outputs by name -> position (filled by the first step).
    std::map<std::string, size_t> output_index;
  };
  /// Loads `graphs` as the program of `shape` (state checked against the trainer's).
  Expected<Variant*> add_variant(const StepShape& shape, const TrainGraphs& graphs);
  /// The key of the program that runs a batch of `shape`: the shape itself, or with
  /// length 0 under --shape_mode symbolic (one program serves every length), and rows 0
  /// when that program's batch dim is symbolic too.
  StepShape program_key(StepShape shape) const;
  bool symbolic_rows_ = false;  ///< the first program's batch dim is symbolic
  /// The eval program's batch dim is symbolic too: evaluation runs the eval data's last
  /// partial batch on it (its loss weighted by its rows, as Hugging Face's Trainer).
  bool eval_partial_ = false;
  /// step_shape without the padded length: rows and microbatches of step `step`.
  StepShape step_rows(int64_t step) const;
  /// The program of `shape`: loaded, or asked of TrainerOptions::programs with `reason`.
  Expected<Variant*> variant_for(const StepShape& shape, const std::string& reason);
  /// Why a program of `shape` is needed, for the recompiles log.
  std::string rebuild_reason(const StepShape& shape, const std::string& what) const;
  /// Variable-length data: the padded length for a batch needing `need` tokens, recording
  /// the specialize limit's warning.
  int64_t padded_length(int64_t need);

  TrainConfig cfg_;
  TrainGraphs g_;  ///< the first program's graphs (state, names)
  const Dataset* train_ = nullptr;
  const Dataset* eval_ = nullptr;
  TrainerOptions opts_;
  std::map<StepShape, Variant> variants_;
  Variant* first_ = nullptr;  ///< the program create() loaded (given batches run on it)
  StepShape first_shape_;     ///< the shape of first_
  StepShape last_shape_;      ///< the shape of the last step run
  std::optional<ShapeChooser> chooser_;
  bool limit_warned_ = false;
  std::map<std::string, ir::Tensor> state_;
  std::map<std::string, std::string> state_kind_;    ///< input name -> kind
  std::map<std::string, std::string> state_output_;  ///< input name -> output name
  int64_t rows_per_step_ = 0, steps_per_epoch_ = 0, total_steps_ = 0, global_step_ = 0;
  /// A data-parallel job (runtime/comm.h): ranks, this rank, and rows of one global batch
  /// (world_ x rows_per_step_), the unit of the data order, checkpoints and throughput.
  int world_ = 1, rank_ = 0;
  int64_t job_rows_ = 0;
  /// Whether the job writes output_dir (TrainerOptions::write_files as given: rank 0 writes,
  /// every rank takes part in a save that gathers ZeRO-1 shards).
  bool job_writes_ = true;
  /// ZeRO-1 state (ir::StateBinding::full_dims): input name -> dims of the whole tensor.
  std::map<std::string, std::vector<int64_t>> state_full_;
  /// The state as checkpoints hold it: ZeRO-1 shards gathered from every rank (a
  /// collective: every rank calls it), the rest as is.
  Expected<std::map<std::string, ir::Tensor>> whole_state() const;
  /// Feeds of the train step's LR-schedule inputs (ir::kScheduleTotalInput ...) for this run.
  std::map<std::string, ir::Tensor> schedule_feeds_;
  int64_t eval_rows_ = 0;
  int64_t micro_rows_ = 0, trips_ = 0;  ///< rows of one microbatch, microbatches per step
  /// The backend running the programs (each variant's train graph loaded with it, its
  /// eval graph on the first evaluation). shared_ptr: the types are complete only in trainer.cpp.
  std::shared_ptr<Backend> backend_;
  TrainerState acc_;  ///< logging accumulators (persisted in checkpoints)
  bool resumed_ = false;
  std::string resumed_from_;    ///< the checkpoint folder restore() read
  std::string resume_warning_;  ///< see take_resume_warning()
};

/// Refuses an --output_dir that is, or lies inside, the checkpoint being resumed from
/// (saving there overwrote the checkpoint's own files with later steps). Error naming both.
/// A caller that writes files calls it before it creates or locks output_dir (train()
/// does not repeat it).
Status guard_output_outside_checkpoint(const TrainConfig& cfg);

/// Checks output_dir before a run that will write a checkpoint (a multiple of
/// cfg.save_steps in (start_step, total_steps]): first removes interrupted saves
/// (remove_interrupted_saves, one stderr line each; the caller holds OutputDirLock);
/// then a checkpoint-N there with
/// N > start_step (the restored global step; 0 for a fresh run), or any checkpoint when
/// the run resumes from a checkpoint in another folder, belongs to another run. Saving
/// would overwrite it, and rotation (--save_total_limit keeps the highest steps) would
/// delete it or this run's new checkpoints. Error naming them, unless
/// cfg.overwrite_output_dir, which deletes them (one line on stderr). Errors: a
/// checkpoint that cannot be deleted.
Status guard_later_checkpoints(const TrainConfig& cfg, int64_t start_step, int64_t total_steps);

/// The program name the Trainer's warnings and notes on stderr start with ("kiln: warning:
/// ..."); a compiled training binary sets "train", as its errors say "train: error:".
void set_message_prefix(const std::string& name);
const std::string& message_prefix();

/// Convenience: Trainer::create + optional restore(cfg.resume_from_checkpoint) +
/// guard_later_checkpoints (when opts.write_files; the caller has prepared and locked
/// output_dir after guard_output_outside_checkpoint) + the resume warning + run.
/// After a restore, ir::MemoryStats' peak restarts at the current bytes, so a measured
/// step peak does not count the checkpoint's load (old and new state held together).
/// SIGINT/SIGTERM handlers (StopOnSignal) are installed while it runs: the run stops
/// after the current step (TrainResult::stopped_by_signal; stop_signal() stays set). A
/// signal that comes during the last step or the final evaluation is forgotten: the run
/// is complete.
Expected<TrainResult> train(const TrainConfig& cfg, const TrainGraphs& graphs, const Dataset& train_data,
                            const Dataset* eval_data, TrainerOptions opts = {});

}  // namespace kiln::runtime
