// Static memory planner: liveness, arena offsets and peak bytes by category of a
// Graph run in its node order (the eager schedule), AccumulationLoop bodies included
// (one representative iteration between the loop's inputs and its outputs). See memory_plan.cpp for the
// algorithm (TFLite's arena planner / XLA's heap simulator, greedy by size, best fit).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::passes {

/// What a buffer holds, derived from the graph only (state kinds, node-name scopes
/// "<node>/grad/..." and "optimizer/...", the op table), never from op-name lists.
enum class MemoryCategory {
  parameters,             ///< state of kind "parameter": the step's inputs and updated outputs
  low_precision_weights,  ///< narrowed (bf16 or fp16) copies of parameters made in the forward pass
  gradients,              ///< parameter gradients: backward values the optimizer reads, and their
                          ///< contributions / dtype-or-layout copies
  optimizer_state,        ///< state of kind "optimizer_state" (inputs and updated outputs)
  saved_activations,      ///< values made by a forward node and read by a backward node
  temporaries,            ///< everything else made by a node
  data_and_buffers,       ///< data inputs, BatchNorm buffers, the step counter, constant initializers
};
inline constexpr int kNumMemoryCategories = 7;
/// Row label of a category ("parameters", "low-precision weight copies", ...).
const char* memory_category_name(MemoryCategory c);

/// Planner switches.
struct PlanOptions {
  /// Let a pointwise op (op table fusion class pointwise) write its output into the
  /// buffer of an input that dies at that op and has the same byte size.
  bool in_place = true;
  /// Model the eager interpreter exactly (runtime/interpreter.cpp): no pointwise in-place
  /// reuse (only kiln_inplace, see honor_inplace_attr), and an output that nothing reads
  /// stays allocated until the end of the step (of the iteration, in a loop body).
  bool eager_semantics = false;
  /// Honour the `kiln_inplace = k` node attribute as runtime/interpreter.cpp does
  /// (output 0 takes input k's buffer when input k dies at that node, is not pinned,
  /// its storage is unique and dtype and dims match), in both modes.
  bool honor_inplace_attr = true;
  /// Honour `kiln_donate` (passes/fused_inplace.cpp) as the Trainer runs a step
  /// (RunOptions::donate_state): a donated state output lives in its state input's
  /// resident buffer and takes no bytes of its own.
  bool donate_state = true;
  /// Graph inputs read only as scan inputs of an AccumulationLoop are streamed one
  /// microbatch at a time (RunOptions::microbatch, as the trainer runs them): they take
  /// no memory of their own; each iteration's slice is a body input. False: all N·b
  /// rows are fed and resident for the whole step.
  bool streamed_microbatches = true;
  /// Arena offsets and buffer sizes are rounded up to this (bytes; Storage aligns to 64).
  int64_t alignment = 64;
  /// Count the tensor scratch of eager kernels (eager_kernel_scratch_bytes) at their node
  /// even without eager_semantics: the step arena's executor runs those kernels too.
  bool count_kernel_scratch = false;
  /// Values the executor keeps on the heap (runtime/arena.h: graph outputs, carried
  /// loop values): a buffer whose first value is one of them gets no arena offset
  /// (offset -1, BufferPlan::in_arena false); its bytes still count in the peak.
  /// Null: every buffer is placed.
  const std::unordered_set<const ir::Value*>* heap_values = nullptr;

  /// The options that predict what the eager interpreter's MemoryStats will measure.
  static PlanOptions eager() {
    PlanOptions o;
    o.in_place = false;
    o.eager_semantics = true;
    return o;
  }
};

/// The plan of one value.
struct ValuePlan {
  const ir::Value* value = nullptr;
  int64_t bytes = 0;  ///< numel * dtype size (what MemoryStats counts)
  MemoryCategory category = MemoryCategory::temporaries;
  bool persistent = false;            ///< graph input or initializer: resident for the whole step, not in the arena
  int def = -1;                       ///< index of the producing node (-1: persistent)
  int end = -1;                       ///< last node index at which the value is live (inclusive)
  int buffer = -1;                    ///< arena buffer id (-1: persistent or empty)
  int64_t offset = -1;                ///< byte offset of its buffer in the arena (-1: not in the arena)
  const ir::Value* reuses = nullptr;  ///< in-place: the input whose buffer this value takes over
};

/// One arena buffer: one value, or a chain of values reusing it in place.
struct BufferPlan {
  int64_t size = 0;         ///< bytes, rounded up to the alignment
  int64_t offset = 0;       ///< bytes from the arena start
  int first = 0, last = 0;  ///< live from node `first` to node `last`, inclusive
  std::vector<int> values;  ///< indices into MemoryPlan::values, in definition order
  bool in_arena = true;     ///< false: kept on the heap (PlanOptions::heap_values), offset -1
};

/// Bytes per category.
using CategoryBytes = std::array<int64_t, kNumMemoryCategories>;

/// Optimizer state of one group of parameters (8-bit blockwise, or everything else).
struct OptimizerGroup {
  int tensors = 0;             ///< parameters in the group
  int64_t param_elements = 0;  ///< their elements
  int64_t state_bytes = 0;     ///< bytes of their optimizer_state inputs
  /// state_bytes / param_elements (0 when empty).
  double bytes_per_param() const { return param_elements ? double(state_bytes) / double(param_elements) : 0.0; }
};

/// The static memory plan of a graph over its schedule: its nodes in order, where an
/// AccumulationLoop contributes its body's nodes (one iteration; every iteration has
/// the same live set) followed by the loop node itself (its outputs appear, its
/// inputs and captured values are released).
struct MemoryPlan {
  std::vector<ValuePlan> values;    ///< every graph input, initializer and node output with bytes
  std::vector<BufferPlan> buffers;  ///< arena buffers with their offsets
  int num_nodes = 0;                ///< schedule positions (loop body nodes included, once)
  int accumulation_loops = 0;       ///< AccumulationLoop nodes planned
  int64_t trip_count = 1;           ///< largest trip_count among them (1: none)
  bool peak_in_loop_body = false;   ///< peak_node is a loop body node
  int64_t peak_bytes = 0;           ///< max over nodes of the bytes live (persistent + arena values)
  int peak_node = -1;               ///< schedule position where peak_bytes is reached (-1: no nodes)
  CategoryBytes at_peak{};          ///< bytes per category live at peak_node
  CategoryBytes max_by_category{};  ///< max over nodes of each category's live bytes
  /// Per schedule position (num_nodes entries): the bytes live there by category, as the
  /// accounting counts them (peak_bytes is the largest sum; kernel scratch included).
  std::vector<CategoryBytes> live;
  /// First schedule position of the backward and optimizer phases (-1: no such phase).
  int backward_start = -1, optimizer_start = -1;
  int64_t persistent_bytes = 0;  ///< graph inputs + initializers
  int64_t arena_bytes = 0;       ///< arena size from the offsets (alignment and fragmentation included)
  int in_place_reuses = 0;       ///< outputs that took over an input's buffer
  /// State outputs written into their state input's buffer (kiln_donate): no bytes of their own.
  int donated_outputs = 0;
  int64_t donated_bytes = 0;           ///< their bytes (what a step without donation holds in addition)
  int64_t saved_activation_bytes = 0;  ///< total bytes of every saved activation
  /// Eager semantics or count_kernel_scratch only: the largest tensor scratch an eager kernel allocates besides
  /// its outputs while its node runs (counted in the peak as temporaries at that node;
  /// see eager_kernel_scratch_bytes). 0 without eager_semantics.
  int64_t kernel_scratch_bytes = 0;
  int64_t parameter_elements = 0;     ///< elements of the parameter state inputs
  int64_t optimizer_state_bytes = 0;  ///< bytes of the optimizer_state state inputs
  /// optimizer_state_bytes / parameter_elements (0 without parameters): AdamW fp32 = 8.
  double optimizer_state_bytes_per_param_element() const {
    return parameter_elements ? double(optimizer_state_bytes) / double(parameter_elements) : 0.0;
  }
  OptimizerGroup optim_8bit;   ///< parameters whose state has 8-bit (u8/i8) codes
  OptimizerGroup optim_other;  ///< parameters with other (fp32) optimizer state
  PlanOptions options;
  std::string peak_node_name;  ///< name (op) of the node at the peak
};

/// Bytes of tensors (counted by MemoryStats) that the eager kernel of `n` allocates
/// besides its outputs while it runs, from the node's static shapes: runtime/kernels/nn.cpp's
/// Gemm outside oneDNN's dtypes (f32, bf16), i.e. f16 or f64, with K > 0 computes its
/// product in an f64 [M, N] tensor (M * N * 8 bytes). 0 for every other node.
int64_t eager_kernel_scratch_bytes(const ir::Node& n);

/// Plans `g` (nodes in order; graph inputs and initializers live for the whole step,
/// each node output from its node to its last use, graph outputs to the end).
/// AccumulationLoop (ir/ops/control.cpp) is planned as runtime/interpreter.cpp runs it:
/// values the body captures stay live to the loop's end; carried inputs move into the
/// body when the loop is their last use; scan slices (new tensors) and carried values
/// are body inputs live from the body's start; body outputs stay to the iteration's end
/// and become the loop outputs. The planned iteration is a steady one (t >= 1), where
/// carried values are uniquely owned, so kiln_inplace accumulator updates are in place.
/// Accumulators count as gradients (the loss accumulator as a temporary).
/// Errors: a value with a non-static shape that needs memory, or a node with a region
/// other than an AccumulationLoop body; the message names the value or node.
Expected<MemoryPlan> plan_memory(const ir::Graph& g, const PlanOptions& opts = {});

/// The memory plan of the compiled executor's step arena for `g` (passes/arena_plan.cpp,
/// the pass that writes it into the IR): plan_memory with the interpreter's own rules
/// (kiln_inplace and Reshape views honoured, no other in-place reuse, an unread output
/// dead at its node, kernel scratch counted); accumulation loops' carried values, scan
/// slices and outputs on the heap. Errors: those of plan_memory.
Expected<MemoryPlan> plan_step_arena_layout(const ir::Graph& g);

/// "1.50 MiB" style (B, KiB, MiB, GiB; binary units).
std::string human_bytes(int64_t bytes);

/// The arena layout of `p`, one line per buffer in offset order: byte offset, size
/// (bytes, aligned), the schedule positions it is live over, and the values that
/// occupy it in turn (in-place chains and moves); heap buffers (offset -1) last, donated
/// state outputs (kiln_donate) listed after them. For reading a plan's decisions
/// (DESIGN.md invariant 2: buffer offsets are visible); kiln compile writes it into
/// DIR/memory_plan.txt.
std::string format_buffer_offsets(const MemoryPlan& p);

/// Report: one row per category (bytes at the peak and max over the step, human units and
/// exact bytes, and the bytes at the peak per parameter element), the total,
/// saved-activation bytes, an "optimizer state per parameter" line (overall, 8-bit and
/// 32-bit groups), arena size and in-place reuses.
std::string format_memory_plan(const MemoryPlan& p);

}  // namespace kiln::passes
