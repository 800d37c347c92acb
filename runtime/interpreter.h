// The eager interpreter: runs a Graph op by op with the op table's eager kernels,
// one allocation per result, each buffer freed after its last use (as PyTorch
// eager runs ATen ops). It is the oracle for every compiled result (DESIGN.md
// convention 8) and the baseline of every reported speed-up.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cpu/program.h"
#include "ir/graph.h"
#include "ir/op_table.h"
#include "ir/status.h"
#include "ir/tensor.h"
#include "runtime/arena.h"
#include "runtime/profile.h"

namespace kiln::runtime {

using ir::Tensor;

/// Fills the eager-kernel field of every op-table entry (idempotent).
void register_eager_kernels();

/// Per-graph facts the executor otherwise recomputes on every run: each node's op-table
/// entry, generated kernel and static output types, the values released after it (last
/// reads, captures of its regions). A caller that runs the same graphs many times (the
/// trainer, once per step) keeps one and passes it in RunOptions::schedule. The graphs
/// run with a cache must not change in place while it lives: facts are recomputed when the
/// node list changes (Graph::structure_id), not when a node's attributes or value types
/// are edited. Not thread-safe.
class ScheduleCache {
 public:
  ScheduleCache();
  ~ScheduleCache();
  ScheduleCache(ScheduleCache&&) noexcept;
  ScheduleCache& operator=(ScheduleCache&&) noexcept;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// Options of one eager run.
struct RunOptions {
  bool training = false;  ///< Dropout active, BatchNormalization uses batch statistics
  uint64_t seed = 0;      ///< Philox seed
  uint64_t step = 0;      ///< Philox offset base
  /// Names of values to keep and return besides the graph outputs (e.g. for debugging).
  std::vector<std::string> keep;
  /// Compiled backend: generated kernels of the graph's FusedKernel nodes (built by
  /// codegen::compile_graph_cpu on this same graph). Without it, fused nodes run their
  /// bodies op by op (eager).
  const codegen::CpuProgram* program = nullptr;
  /// Gradient accumulation: returns microbatch `t` (of `trips`) of an AccumulationLoop's
  /// scan input `input` (its leading dim / trips rows) when that input was not fed, so
  /// the caller streams microbatches into the loop instead of holding all N·b rows (the
  /// trainer does; Hugging Face's Trainer feeds one microbatch per forward the same way).
  /// Without it, every scan input must be fed whole.
  std::function<Expected<Tensor>(const ir::Value& input, int64_t t, int64_t trips)> microbatch;
  /// Op-level profile (runtime/profile.h): when set, every node's wall time is added
  /// under profile_key(node) (AccumulationLoop nodes are not keys: their body nodes
  /// are timed one by one; a FusedKernel run eagerly is one key, its body ops are not).
  /// Null: off.
  OpProfile* profile = nullptr;
  /// Compiled backend: the step arena of this graph (runtime/arena.h; planned by the
  /// driver for this same graph): planned values are written at their planned offsets
  /// instead of being allocated. Null: one allocation per result. Nested bodies of
  /// AccumulationLoop nodes use it too; FusedKernel bodies run eagerly do not.
  const StepArena* arena = nullptr;
  /// With an arena: run_graph may return results that lie in the arena (no copy); they
  /// stay valid until the next run on the same arena, so the caller copies what it keeps
  /// (the trainer copies the new state into its own buffers). False: such results are
  /// cloned to the heap before run_graph returns.
  bool results_in_arena = false;
  /// The caller owns the buffers of the graph's state inputs (StateBinding inputs) and
  /// gives them up: kernels marked kiln_donate (passes/fused_inplace.cpp) write the new
  /// state into them, and the returned state outputs share those buffers (the Trainer,
  /// which clones its state once). False: such kernels write into a copy.
  bool donate_state = false;
  /// Per-graph executor facts reused across runs (see ScheduleCache); null: computed for
  /// this run only. Results are the same either way.
  ScheduleCache* schedule = nullptr;
  /// Values of the shape symbols (KernelContext::symbols). Callers leave it null:
  /// run_graph binds a symbolic graph's symbols from the fed inputs' dims.
  const std::map<std::string, int64_t>* symbols = nullptr;
};

/// run_graph with feeds and results by position, no names looked up: feeds[i] is
/// g.inputs[i]'s tensor (an undefined one: the input's default, or an input streamed by
/// RunOptions::microbatch; fewer feeds than inputs: the rest undefined); the result holds
/// g.outputs' tensors in order. RunOptions::keep must be empty (kept values have names
/// only). Errors: as run_graph's.
Expected<std::vector<Tensor>> run_graph_positional(const ir::Graph& g, const std::vector<Tensor>& feeds,
                                                   const RunOptions& opts = {});

/// Runs `g` on `feeds` (graph input name -> tensor). Returns every graph output
/// and every kept value by name. Errors name the node and op at fault, or the
/// input whose dtype/shape does not match the graph.
Expected<std::map<std::string, Tensor>> run_graph(const ir::Graph& g, const std::map<std::string, Tensor>& feeds,
                                                  const RunOptions& opts = {});

/// Runs one node's eager kernel on concrete inputs (nullptr = omitted optional
/// input): output shapes come from the op's inference on the actual inputs.
Expected<std::vector<Tensor>> run_node(const ir::Node& n, const std::vector<const Tensor*>& inputs,
                                       const RunOptions& opts = {}, uint64_t op_id = 0);

/// Runs the eager kernel of `kc.node` into `kc.outputs` (allocated by the caller): the
/// evaluator of constant nodes that the driver gives constant folding
/// (passes::PassContext::evaluator). Errors: unknown op, no eager kernel, kernel errors.
kiln::Status evaluate_node(ir::KernelContext& kc);

/// Eager kernel of AccumulationLoop for run_node (a body without captured outer
/// values); run_graph runs the loop itself so that carried buffers move, not copy.
kiln::Status accumulation_loop_kernel(ir::KernelContext& ctx);

/// Eager kernel of FusedKernel: runs the body op by op (the oracle of the generated kernel).
kiln::Status fused_kernel_eager(ir::KernelContext& ctx);

/// Checks a fed tensor against a graph input's device (host memory), dtype and static dims.
kiln::Status check_feed(const ir::Value& input, const Tensor& t);

}  // namespace kiln::runtime
