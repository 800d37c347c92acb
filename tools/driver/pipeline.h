// The pass pipelines of a training run as data (issue 30): which passes each program
// (train step, gradient program, eval) runs, in which stage, under which options. One
// declarative table (pipeline.cpp) lists every pass with the programs it belongs to and
// the condition it runs under (in the spirit of Glow's CompilationMode); training_pipeline
// resolves it for one set of typed options. build_training_program runs exactly what it
// returns, and `kiln inspect MODEL --pipeline` prints it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "passes/options.h"
#include "runtime/train_config.h"

namespace kiln::driver {

/// Everything that decides a training run's pipelines: the typed pass options (mode
/// left at train; training_pipeline sets it per program) and the switches that add or
/// remove passes.
struct PipelineOptions {
  passes::PassOptions passes;
  bool bf16 = false;      ///< --bf16: autocast to bf16 around autodiff
  bool fp16 = false;      ///< --fp16: autocast to f16 plus GradScaler loss scaling
  bool compiled = false;  ///< --backend compiled: the lowering passes, then generated kernels
  bool to_f64 = false;    ///< every float made f64 after import (float64 reference checks)
};

/// The typed options of `cfg` for a run of `total_steps` optimizer steps (the LR
/// schedule's defaults): every TrainConfig field a pass reads, plus the GEMM widening of
/// the compiled backend (bf16 on CPUs without native bf16, f16 always).
PipelineOptions pipeline_options(const runtime::TrainConfig& cfg, int64_t total_steps, bool to_f64 = false);

/// One run of the pass manager: the passes run back to back, with the debugging switches
/// (--print-ir-after, --stop-after, ...) where `debug` is set; the driver does its own
/// work between stages (the gradient program is cloned before the train stage "update").
struct PipelineStage {
  std::string name;
  std::vector<std::string> passes;
  bool debug = true;  ///< runs with the caller's debugging context (else a quiet one)
};

/// The stages of one program and the options its passes read.
struct ProgramPipeline {
  std::string program;          ///< "train", "grads" or "eval"
  passes::PassOptions options;  ///< what every pass of this program reads
  std::vector<PipelineStage> stages;
  /// The stage (if any) this program starts from a copy of `from_program` after.
  std::string from_program, after_stage;
  /// The passes of stage `name` (empty when there is no such stage).
  const std::vector<std::string>& stage(const std::string& name) const;
};

/// The pipelines of a training run: the training step, the gradient program (kiln grad
/// and gradcheck) and the evaluation program. The "specialize" stage of train and eval
/// is what specialize_model runs after binding the batch dims.
struct Pipeline {
  ProgramPipeline train, grads, eval;
};

/// Resolves the pipeline table for `o`.
Pipeline training_pipeline(const PipelineOptions& o);

/// The passes specialize_model runs on an imported model: constant folding,
/// canonicalize, and to_float64 with `to_f64`.
std::vector<std::string> specialize_pipeline(bool to_f64);

/// One line per pass, in order: "PROGRAM  STAGE  PASS  name=value ..." (the options the
/// pass reads, Pass::describe_options), for the train and eval programs (and the
/// gradient program with `with_grads`).
std::string format_pipeline(const Pipeline& p, bool with_grads = false);

}  // namespace kiln::driver
