// The compiled training program (issue 30): the output of compilation and the only thing
// the runtime runs. It holds the post-pass train and eval graphs (every node a generated
// kernel, a library call, a view or an accumulation loop with its trip count), their
// generated CPU kernels (relocatable object code and the schedule of each kernel), their
// step arenas (the memory plan's offset of every planned value), and a typed signature
// (data inputs, the label input, the logits output, the trainable parameters, what the
// data is checked against before training). It is saved to a versioned file and loaded
// without the frontend or any pass: `kiln compile`'s DIR/program.kiln, which DIR/train
// runs, and the whole-program cache of `kiln train` (tools/driver/program_cache.h).
//
// File layout (little-endian; docs/architecture.md "The program file"):
//   "KILNPRG\0" magic, u32 format version (kProgramFormatVersion), u64 payload length,
//   32-byte SHA-256 of the payload, then the payload:
//     str   meta JSON {kiln_version, cpu, config, signature, planned_peak_bytes, ...}
//     str   the model file's bytes (ONNX, external data inlined): the template the
//           trained weights are written into (model.onnx); never imported at load
//     tensor pool, then the train graph, then u8 has_eval and the eval graph (ir/serialize.h)
//     per graph (train, eval): u8 has_kernels, kernel table and object (as the compile
//           cache's .kcache payload: per kernel node name, schedule, symbol; LLVM IR; object
//           bytes), u8 has_arena, i64 block bytes, u64 n, n x (i64 value id, i64 offset,
//           i64 bytes, u8 home)
// A file of another format version, truncated or corrupted is refused with one line.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/cpu/program.h"
#include "ir/graph.h"
#include "ir/status.h"
#include "runtime/arena.h"
#include "runtime/data.h"

namespace kiln::runtime {

/// Version of the program file layout; a file of another version is refused.
inline constexpr uint32_t kProgramFormatVersion =
    4;  // 2: state bindings carry full_dims (ZeRO-1); 3: symbolic kernels; 4: symbolic split reductions

/// What training needs to know of the model without importing it: recorded when the
/// program is built (tools/driver/driver.cpp), read from the program file.
struct ProgramSignature {
  /// The forward model's data specs (its inputs, then the label input with free dims):
  /// what training data is checked against before the first step.
  std::vector<DataInputSpec> forward_specs;
  /// Data inputs that a Gather reads straight as indices: input -> the looked-up table's
  /// extent (every index must lie in [-extent, extent)).
  std::map<std::string, int64_t> index_extents;
  /// cross_entropy: the logits' last dim (labels lie in [0, classes)); -1 otherwise.
  int64_t classes = -1;
  /// Peak bytes of one training step as the executor's memory plan predicts (-1: none).
  int64_t planned_peak_bytes = -1;
  /// Rows of one microbatch: the batch dim the training step's data inputs were bound
  /// to (0: not recorded, a file written before these fields; the trainer then reads the
  /// config).
  int64_t microbatch_rows = 0;
  /// Microbatches per optimizer step: the AccumulationLoop's trip count (1 without a loop;
  /// 0: not recorded).
  int64_t gradient_accumulation_steps = 0;
  /// Rows one optimizer step reads: microbatch_rows * gradient_accumulation_steps (0: not
  /// recorded).
  int64_t rows_per_step = 0;
  /// Ranks of the data-parallel job the program was built for (passes/data_parallel.cpp:
  /// its collectives and loss normalization); 1 for one process (and files that predate it).
  int64_t world_size = 1;
  /// Rows of one eval batch: the batch dim the eval program was bound to (0: not recorded).
  int64_t eval_rows = 0;
};

/// A training program: the post-pass graphs, their kernels and arenas, the signature.
///
/// train_step: inputs are the data inputs (model inputs + label input) and the state
///   inputs (g.state[i].input: parameters named by their ONNX initializer, optimizer
///   state, BatchNorm buffers, the step counter "step"), plus inputs with defaults
///   (Graph::input_defaults: the LR schedule's step counts). Outputs: "loss" (f32
///   scalar), "grad_norm" (pre-clip global L2 norm; only with max_grad_norm > 0), "learning_rate",
///   every state output.
/// eval: inputs are the data inputs and the parameters/buffers (same names as the
///   state inputs); outputs "loss" and, for cross_entropy, "logits" (the model output).
/// grads (only when requested; never saved): like train_step up to the gradients;
///   outputs "loss" and "<param>.grad" for every trainable parameter.
struct Program {
  std::unique_ptr<ir::Graph> train_step;
  std::unique_ptr<ir::Graph> eval;
  std::unique_ptr<ir::Graph> grads;
  std::vector<std::string> data_inputs;  ///< model inputs then the label input (if any)
  std::string label_input;               ///< empty for --loss model
  std::string logits_output;             ///< model output the loss reads
  std::vector<std::string> parameters;   ///< trainable parameter names, in initializer order
  ProgramSignature signature;
  /// --backend compiled: the generated kernels of train_step and eval; null for eager.
  std::shared_ptr<codegen::CpuProgram> train_kernels, eval_kernels;
  /// --backend compiled: the step arenas of train_step and eval; null for eager.
  std::shared_ptr<StepArena> train_arena, eval_arena;
  /// Wall seconds of the training step's build phases (the eval program's are not counted):
  /// ONNX import and type inference; the training passes (loss, autodiff, casts, remat,
  /// optimizer, accumulation); the compiled pipeline (gemm_widening ... fusion,
  /// fused_inplace; 0 for eager); kernel generation (lowering, LLVM, JIT: also in
  /// train_kernels' stats); the step arena's memory plan. All 0 for a loaded program.
  struct BuildTimes {
    double import_s = 0, passes_s = 0, fusion_s = 0, kernels_s = 0, arena_s = 0;
  } train_times;
  /// Set when the program was loaded from a file (load_program): where from.
  std::string loaded_from;
};

/// What a program file says besides the program.
struct ProgramFileInfo {
  uint32_t format = 0;
  std::string kiln_version;
  /// Host CPU and LLVM feature string the kernels were compiled for (codegen::host_cpu_description).
  std::string cpu;
  /// The TrainConfig the program was built with (config_to_json).
  std::string config_json;
  /// The model file's bytes (external data inlined), for writing the trained model.
  std::string model_bytes;
  /// SHA-256 of the payload, 64 hex digits (DIR/train checks it is its own program).
  std::string payload_sha256;
};

/// Turns the kernel section of one graph ("train" or "eval") into kernels the executor
/// calls: kiln JIT-links the object (codegen::load_cpu_object); the AOT binary looks the
/// symbols up in the function table it was linked with.
using KernelBinder =
    std::function<Expected<std::shared_ptr<codegen::CpuProgram>>(const std::string& which, codegen::CpuObject obj)>;

/// The file bytes of `p` (grads is not saved). `info`: kiln_version, cpu, config_json and
/// model_bytes are written (format and payload_sha256 are set by this function).
/// Errors: a compiled graph without its object code.
Expected<std::string> serialize_program(const Program& p, ProgramFileInfo& info);

/// Checks a program file's header, version, length and SHA-256 and returns its info
/// (model bytes included) without reading the graphs. `origin` names the file in errors:
/// "ORIGIN: program file format 2, this kiln reads format 1", "ORIGIN: truncated ...",
/// "ORIGIN: corrupt (payload SHA-256 mismatch)", "ORIGIN: not a kiln program file".
Expected<ProgramFileInfo> read_program_info(const std::string& bytes, const std::string& origin);

/// Loads a program from file bytes: graphs, signature, arenas, and kernels through
/// `bind` (which may be empty for a program without kernels). Runs no pass and imports
/// nothing. Errors as read_program_info, plus a malformed section (one line).
Expected<Program> deserialize_program(const std::string& bytes, const std::string& origin, const KernelBinder& bind,
                                      ProgramFileInfo* info = nullptr);

/// Reads a whole file (error: "PATH: cannot read ...").
Expected<std::string> read_file_bytes(const std::string& path);

/// Checks that this CPU has the instruction-set extensions of `features` (an LLVM feature
/// string, "+avx2,+avx512f,..."), those the compiler can test at run time (SSE4.2, AVX,
/// AVX2, FMA, AVX-512 F/BW/DQ/VL/BF16). Error: one line naming the missing ones.
Status check_host_cpu(const std::string& features);

/// SHA-256 of `bytes` as 64 hex digits (OpenSSL).
std::string sha256_hex(const std::string& bytes);

}  // namespace kiln::runtime
