// The pipeline driver: import -> passes -> executable program, assembled in one
// place (DESIGN.md). The CLI, the ahead-of-time builder and tests call it; the
// runtime receives the resulting graphs and never reaches back.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cpu/program.h"
#include "ir/graph.h"
#include "ir/status.h"
#include "passes/memory_plan.h"
#include "passes/pass.h"
#include "runtime/arena.h"
#include "runtime/train_config.h"

namespace kiln::driver {

/// True when the host CPU has native bf16 dot products (x86 AVX512_BF16), where oneDNN's
/// bf16 GEMMs are fast; otherwise the compiled backend widens bf16 GEMMs to f32
/// (passes/gemm_widening.cpp).
bool host_has_native_bf16();

/// The passes `--backend compiled` runs after the training passes, in order
/// (gemm_widening, decompose, fusion); the eager backend runs none of them.
const std::vector<std::string>& compiled_pipeline();


/// Imports an ONNX model, binds dim_params (`shape`), folds shape computations
/// and canonicalizes. With `to_f64`, every float initializer and input becomes f64
/// (for float64 reference checks). Errors name the file and node at fault.
/// `untie_initializers`: frontend::ImportOptions::untie_initializers (--untie_initializers).
/// The importer's notes (ir::Graph::import_notes: restored ties and parameters) are
/// printed to stderr, each once per process.
Expected<std::unique_ptr<ir::Graph>> load_model(const std::string& path, const std::map<std::string, int64_t>& shape,
                                                bool to_f64 = false, passes::PassContext* dbg = nullptr,
                                                bool untie_initializers = false);

/// load_model followed by the eval_mode pass (BatchNormalization on running statistics,
/// Dropout off), as model.eval() in PyTorch: what `kiln run` executes.
Expected<std::unique_ptr<ir::Graph>> load_inference_model(const std::string& path,
                                                          const std::map<std::string, int64_t>& shape,
                                                          passes::PassContext* dbg = nullptr,
                                                          bool untie_initializers = false);

/// A training program built by the passes.
///
/// train_step: inputs are the data inputs (model inputs + label input) and the state
///   inputs (g.state[i].input: parameters named by their ONNX initializer, optimizer
///   state, BatchNorm buffers, the step counter "step"). Outputs: "loss" (f32 scalar),
///   "grad_norm" (pre-clip global L2 norm), "learning_rate", and every state output.
/// eval: inputs are the data inputs and the parameters/buffers (same names as the
///   state inputs); outputs "loss" and, for cross_entropy, "logits" (the model output).
/// grads (only when requested): like train_step up to the gradients; outputs "loss"
///   and "<param>.grad" for every trainable parameter.
struct TrainingProgram {
  std::unique_ptr<ir::Graph> train_step;
  std::unique_ptr<ir::Graph> eval;
  std::unique_ptr<ir::Graph> grads;
  std::vector<std::string> data_inputs;   ///< model inputs then the label input (if any)
  std::string label_input;                ///< empty for --loss model
  std::string logits_output;              ///< model output the loss reads
  std::vector<std::string> parameters;    ///< trainable parameter names, in initializer order
  /// --backend compiled: the fusion pass ran on train_step and eval, and these hold their
  /// generated kernels (codegen/cpu/program.h); null for --backend eager.
  std::shared_ptr<codegen::CpuProgram> train_kernels, eval_kernels;
  /// --backend compiled: the step arenas of train_step and eval (plan_step_arena); null for eager.
  std::shared_ptr<runtime::StepArena> train_arena, eval_arena;
  /// Wall seconds of the training step's build phases (the eval program's are not counted):
  /// ONNX import and type inference; the training passes (loss, autodiff, casts, remat,
  /// optimizer, accumulation); the compiled pipeline (gemm_widening ... fusion,
  /// fused_inplace; 0 for eager); kernel generation (lowering, LLVM, JIT: also in
  /// train_kernels' stats); the step arena's memory plan.
  struct BuildTimes {
    double import_s = 0, passes_s = 0, fusion_s = 0, kernels_s = 0, arena_s = 0;
  } train_times;
};

/// The step arena of `g` for the compiled executor (runtime/arena.h): passes::plan_memory
/// with the interpreter's own rules (kiln_inplace and Reshape views honoured, no other
/// in-place reuse, an unread output dead at its node; plan_step_arena_layout); homes for
/// the first value of each arena buffer, when a node produces it.
/// Errors: those of plan_memory (a value without a static shape).
Expected<std::shared_ptr<runtime::StepArena>> plan_step_arena(const ir::Graph& g);

/// The memory plan plan_step_arena lays `g`'s step arena out from (its heap values: the
/// body inputs, body outputs and outputs of AccumulationLoop nodes).
Expected<passes::MemoryPlan> plan_step_arena_layout(const ir::Graph& g);

/// Builds the training program for `cfg` (loss, autodiff, optimizer, schedule).
/// `dbg` carries --print-ir-after / --dump-ir-dir / --verify-each / --time-passes.
/// `total_steps` (optimizer steps of the whole run, for the LR schedule) defaults to cfg.max_steps.
Expected<TrainingProgram> build_training_program(const runtime::TrainConfig& cfg, passes::PassContext* dbg = nullptr,
                                                 bool want_grads = false, bool to_f64 = false,
                                                 int64_t total_steps = -1);

/// Binds symbolic dims of every value of `g` (ONNX dim_params) to static sizes and
/// re-infers types. Symbols not in `dims` stay symbolic.
Status bind_dims(ir::Graph& g, const std::map<std::string, int64_t>& dims);

/// Pass options (PassContext::options) derived from a TrainConfig.
std::map<std::string, std::string> pass_options(const runtime::TrainConfig& cfg, int64_t total_steps);

}  // namespace kiln::driver
