// The step arena of the compiled executor (issue 7, DESIGN.md invariant 5): one block,
// laid out once by the static memory planner (passes/memory_plan.h, TFLite's arena
// planner / XLA's heap simulator), in which each planned value of a training or eval
// step is written at its planned offset, so a step allocates no tensor storage for
// them. The layout is computed by the driver (which links the passes) and handed to
// the interpreter through RunOptions::arena.
//
// The interpreter stays the executor; the arena only decides where outputs go. Rules
// that keep a planned value from outliving its planned lifetime:
//  - only the first value of each planned buffer is written into the arena by its
//    node (its "home"); the values that share the buffer (kiln_inplace updates,
//    Reshape views of a dying input) get there by the interpreter's own in-place and
//    view rules, which the planner models exactly;
//  - graph outputs, kept values and AccumulationLoop carried values have no home
//    (they outlive the step or an iteration); a graph output that lies in the block is
//    copied out before run_graph returns;
//  - an output that lies in the block anywhere but at its planned place (a kernel that
//    returned one of its inputs) is moved to its home or copied to the heap;
//  - a donated state output (kiln_donate, RunOptions::donate_state) is written into its
//    state input's resident buffer: it has no home and takes no block bytes.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "ir/graph.h"
#include "ir/tensor.h"

namespace kiln::runtime {

/// Where one value lives in the arena.
struct ArenaSlot {
  int64_t offset = 0;  ///< bytes from the block start (the value's planned buffer)
  int64_t bytes = 0;   ///< the buffer's size in bytes (>= the value's numel * dtype size)
  bool home = false;   ///< the value's node writes it here (first value of its buffer)
};

/// One pre-planned block and the planned place of each value (see the file comment).
/// Not thread-safe: one step runs on it at a time.
class StepArena {
 public:
  /// `slots`: value -> planned place; `block_bytes`: the block size (the plan's arena
  /// size). The block is allocated here, uninitialized, and counted in ir::MemoryStats.
  StepArena(std::unordered_map<const ir::Value*, ArenaSlot> slots, int64_t block_bytes);

  /// The arena the arena planning pass wrote into `g` (ir::Value::arena of every node
  /// output, regions included; ir::Graph::arena_bytes); null when `g` was not planned.
  static std::shared_ptr<StepArena> of_graph(const ir::Graph& g);

  /// Output tensor of `v` at its home (zero-filled when `zero`); an undefined Tensor when
  /// `v` has no home or its slot is smaller than numel(dims) * dtype size.
  ir::Tensor output(const ir::Value* v, ir::DType dtype, const std::vector<int64_t>& dims, bool zero) const;
  /// True when `p` points into the block.
  bool contains(const void* p) const;
  /// True when `p` is the address of `v`'s planned buffer.
  bool at_planned_place(const ir::Value* v, const void* p) const;

  int64_t block_bytes() const { return block_bytes_; }
  /// Every value's planned place (the constructor's `slots`), in no particular order.
  std::vector<std::pair<const ir::Value*, ArenaSlot>> slots() const;
  int64_t num_homes() const { return homes_; }
  /// Outputs written at their home / moved out of a wrong place, since construction.
  int64_t placed() const { return placed_.load(); }
  int64_t relocated() const { return relocated_.load(); }
  /// Counts one relocation (the interpreter moved a misplaced output).
  void count_relocation() const { relocated_.fetch_add(1); }

 private:
  struct Entry {
    ArenaSlot slot;
    std::shared_ptr<ir::Storage> storage;  ///< view of the slot (homes only), reused every step
  };
  std::shared_ptr<ir::Storage> block_;
  int64_t block_bytes_ = 0;
  int64_t homes_ = 0;
  std::unordered_map<const ir::Value*, Entry> slots_;
  mutable std::atomic<int64_t> placed_{0}, relocated_{0};
};

}  // namespace kiln::runtime
