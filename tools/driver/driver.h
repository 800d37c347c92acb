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
#include "runtime/comm.h"
#include "runtime/program.h"
#include "runtime/train_config.h"

namespace kiln::driver {

/// True when the host CPU has native bf16 dot products (x86 AVX512_BF16), where oneDNN's
/// bf16 GEMMs are fast; otherwise the compiled backend widens bf16 GEMMs to f32
/// (passes/gemm_widening.cpp).
bool host_has_native_bf16();

/// The FLOPs (forward, one node) below which a GEMM or convolution is faster left in f32
/// than cast to `low` (bf16 or f16) on this CPU: passes::AutocastOptions::min_flops for
/// `--autocast_min_flops -1` (the default). A model of what was measured on the
/// development machine (docs/performance.md, issue 37): below it the casts and
/// low-precision pointwise kernels around a small product cost more than it saves.
/// f16: +infinity (no product pays: oneDNN 2.6 has no CPU f16 kernels, so f16 GEMMs run
/// widened to f32 and f16 convolutions on a scalar loop, 27x fp32's time on cnn_bn).
/// `convolution`: the break-even of a convolution instead of a GEMM or MatMul.
double autocast_break_even_flops(ir::DType low, bool convolution = false);

/// The threshold a training config gives passes::AutocastOptions::min_flops:
/// --autocast_min_flops, or for -1 the break-even of its low-precision dtype.
/// `convolution`: for a convolution (--autocast_min_flops applies to both kinds).
double autocast_min_flops(const runtime::TrainConfig& cfg, bool convolution = false);

/// The passes `--backend compiled` runs after the training passes, in order (the stage
/// "lowering" of tools/driver/pipeline.h: gemm_widening ... multi_tensor); the eager
/// backend runs none of them.
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

/// The model of `path` imported once for a run: parsed, checked and type-inferred, its
/// symbolic dims unbound (the module the train and eval programs are specialised from).
/// Import notes are printed as load_model prints them. Every call counts one import
/// (model_imports()).
Expected<std::unique_ptr<ir::Graph>> import_model(const std::string& path, bool untie_initializers = false);

/// A copy of `module` with `shape`'s dims bound, constants folded and canonicalized (and
/// every float made f64 with `to_f64`): what load_model returns, without importing again.
/// Errors: a --shape name no input uses (one line naming the dims the model has).
Expected<std::unique_ptr<ir::Graph>> specialize_model(const ir::Graph& module, const std::string& path,
                                                      const std::map<std::string, int64_t>& shape, bool to_f64 = false,
                                                      passes::PassContext* dbg = nullptr);

/// Prints `g`'s import notes (ir::Graph::import_notes) on stderr, each once per process:
/// import_model does; a run whose program came from the program cache does it with the
/// loaded train graph's (the notes travel with the program).
void print_import_notes(const ir::Graph& g);

/// Model imports (import_model calls) since the process started: a run of kiln train
/// imports its model once (tests count them).
int64_t model_imports();

/// load_model followed by the eval_mode pass (BatchNormalization on running statistics,
/// Dropout off), as model.eval() in PyTorch: what `kiln run` executes.
Expected<std::unique_ptr<ir::Graph>> load_inference_model(const std::string& path,
                                                          const std::map<std::string, int64_t>& shape,
                                                          passes::PassContext* dbg = nullptr,
                                                          bool untie_initializers = false);

/// A training program built by the passes (runtime/program.h): the post-pass graphs,
/// their kernels and arenas, and the signature the runtime reads.
using TrainingProgram = runtime::Program;

/// The step arena of `g` for the compiled executor (runtime/arena.h): passes::plan_memory
/// with the interpreter's own rules (kiln_inplace and Reshape views honoured, no other
/// in-place reuse, an unread output dead at its node; plan_step_arena_layout); homes for
/// the first value of each arena buffer, when a node produces it.
/// Errors: those of plan_memory (a value without a static shape).
Expected<std::shared_ptr<runtime::StepArena>> plan_step_arena(const ir::Graph& g);

/// The step arena of a plan from plan_step_arena_layout.
std::shared_ptr<runtime::StepArena> arena_of_plan(const passes::MemoryPlan& plan);

/// The memory plan plan_step_arena lays `g`'s step arena out from (its heap values: the
/// body inputs, body outputs and outputs of AccumulationLoop nodes).
Expected<passes::MemoryPlan> plan_step_arena_layout(const ir::Graph& g);

/// The bound of each symbol left in `g`'s inputs (--shape_mode symbolic): a batch dim
/// (dim 0) at `batch` (the program's batch size), every other at cfg.max_length. Empty
/// when no input dim is symbolic. What a symbolic program is checked, planned and
/// autocast at.
std::map<std::string, int64_t> symbolic_bounds(const ir::Graph& g, const runtime::TrainConfig& cfg, int64_t batch);
/// The values of the symbols left in `g`'s inputs for a batch of `batch` rows of
/// `length` tokens (the model's input length): a batch dim (dim 0) at `batch`, every
/// other at `length`.
std::map<std::string, int64_t> symbol_values(const ir::Graph& g, int64_t batch, int64_t length);

/// `cfg`'s --train_data bound to the inputs of its model (--model, --shape) as the
/// trainer binds it (data_options). Errors: the data's or the model's, naming the flag.
Expected<runtime::Dataset> bind_train_data(const runtime::TrainConfig& cfg);

/// The shape of each training batch of epoch 0 of `data` (cfg's --train_data as
/// bind_train_data binds it: variable-length rows, in the training order of --seed and
/// --group_by_length; the last partial batch unless --dataloader_drop_last): (rows,
/// length), the length the batch's longest row gives the model (at most --max_length).
std::vector<std::pair<int64_t, int64_t>> epoch_batch_shapes(const runtime::Dataset& data,
                                                            const runtime::TrainConfig& cfg);

/// Builds the training program for `cfg` (loss, autodiff, optimizer, schedule): runs the
/// stages of training_pipeline(pipeline_options(cfg, total_steps, to_f64))
/// (tools/driver/pipeline.h), and records in the signature the batch shapes the trainer
/// reads (microbatch rows, accumulation steps, eval rows).
/// `dbg` carries --print-ir-after / --dump-ir-dir / --verify-each / --time-passes.
/// `total_steps` (optimizer steps of the whole run, for the LR schedule) defaults to cfg.max_steps.
/// `module` (optional): the model as import_model returned it, so that a run imports its
/// model once; null: imported here.
Expected<TrainingProgram> build_training_program(const runtime::TrainConfig& cfg, passes::PassContext* dbg = nullptr,
                                                 bool want_grads = false, bool to_f64 = false, int64_t total_steps = -1,
                                                 const ir::Graph* module = nullptr);

/// The model `module` (import_model's) specialised for `cfg`'s training step: its batch
/// dim bound to per_device_train_batch_size and the other dims as kiln train binds them,
/// constants folded; what the training passes start from (build_training_program's
/// "specialize" stage). Errors: those of the bindings (a dim bound by nothing, a fixed
/// batch dim that differs) and of specialize_model.
Expected<std::unique_ptr<ir::Graph>> specialize_train_step(const runtime::TrainConfig& cfg, const ir::Graph& module);

/// Runs the passes `pipeline` on `g` with `options`, quietly (no debugging switches).
/// Errors: an unknown pass name (before anything runs), the first pass that fails.
Status run_pass_list(ir::Graph& g, const std::vector<std::string>& pipeline, const passes::PassOptions& options);

/// The signature facts of the forward model `forward` (the model with --shape bound) for
/// `cfg`: its data specs (runtime/program.h ProgramSignature), the Gather tables data
/// inputs index and the classes of cross_entropy labels.
runtime::ProgramSignature model_signature(const ir::Graph& forward, const runtime::TrainConfig& cfg);

/// What one rank of a data-parallel job does per optimizer step, from its training program
/// (issue 35): the collectives it launches (ir::OpDef::comm_bytes), the bytes it sends
/// (the count runtime/comm.h keeps), and its optimizer state in bytes (a shard under ZeRO-1).
/// Joins the data-parallel job this process was launched in, if any (runtime/comm.h
/// init_world with cfg.ddp_timeout), and sets cfg.world_size to its ranks. Returns the
/// job's communicator, null for one process. Errors: init_world's.
Expected<runtime::comm::Communicator*> join_job(runtime::TrainConfig& cfg);

struct DataParallelPlan {
  int64_t collectives = 0;
  int64_t bytes_sent = 0;
  int64_t optimizer_state_bytes = 0;
};
DataParallelPlan data_parallel_plan(const ir::Graph& train_step, int64_t world_size);

}  // namespace kiln::driver
