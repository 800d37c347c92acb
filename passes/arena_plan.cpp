// arena_plan: the last pass of the compiled pipeline (issue 30). It lays out the step
// arena of the compiled executor (runtime/arena.h) with the static memory planner and
// writes the plan into the IR: every value placed in the block gets its offset, its
// buffer's size and whether its node writes it there (Value::arena, printed as
// `@arena(OFFSET, BYTES[, home])`), and the graph its arena size and planned peak
// (Graph::arena_bytes, planned_peak_bytes). The runtime builds the arena from these
// (runtime::StepArena::of_graph) and never plans.
//
// The layout (plan_step_arena_layout): passes::plan_memory with the executor's own rules
// (kiln_inplace and Reshape views honoured, no other in-place reuse, an unread output
// dead at its node, kernel scratch counted); values that outlive an iteration of an
// accumulation loop (body inputs and outputs, loop outputs) stay on the heap.
#include <functional>
#include <unordered_set>

#include "ir/op_table.h"
#include "passes/memory_plan.h"
#include "passes/pass.h"

namespace kiln::passes {

using namespace kiln::ir;

Expected<MemoryPlan> plan_step_arena_layout(const Graph& g) {
  // Values that outlive an iteration stay on the heap: the carried values and scan
  // slices of accumulation loops (body inputs and outputs, loop outputs). Graph outputs
  // are planned in the arena (where the activations were when the optimizer runs); the
  // caller copies them out (RunOptions::results_in_arena).
  std::unordered_set<const Value*> heap;
  std::function<void(const Graph&)> visit = [&](const Graph& gr) {
    for (const auto& n : gr.nodes())
      if (has_trait(*n, OpTrait::loop)) {
        heap.insert(n->outputs.begin(), n->outputs.end());
        for (const auto& r : n->regions) {
          heap.insert(r->inputs.begin(), r->inputs.end());
          heap.insert(r->outputs.begin(), r->outputs.end());
          visit(*r);
        }
      }
  };
  visit(g);
  PlanOptions po;  // the interpreter's own in-place and view rules, nothing more
  po.in_place = false;
  po.eager_semantics = false;
  po.honor_inplace_attr = true;
  po.count_kernel_scratch = true;  // f64 products' scratch: on the heap, counted in the plan
  po.heap_values = &heap;
  KILN_ASSIGN_OR_RETURN(MemoryPlan plan, plan_memory(g, po));
  plan.options.heap_values = nullptr;  // `heap` dies here
  return plan;
}

namespace {

void clear_placements(Graph& g) {
  for (Value* in : g.inputs) in->arena = ArenaPlacement();
  for (const auto& n : g.nodes()) {
    for (Value* o : n->outputs) o->arena = ArenaPlacement();
    for (const auto& r : n->regions) clear_placements(*r);
  }
}

class ArenaPlanPass : public Pass {
 public:
  std::string name() const override { return "arena_plan"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    KILN_ASSIGN_OR_RETURN(MemoryPlan plan, plan_step_arena_layout(g));
    clear_placements(g);
    for (const ValuePlan& vp : plan.values) {
      if (vp.persistent || vp.buffer < 0 || vp.offset < 0 || !vp.value) continue;
      const BufferPlan& b = plan.buffers[static_cast<size_t>(vp.buffer)];
      ArenaPlacement& a = const_cast<Value*>(vp.value)->arena;  // a value of `g`
      a.offset = vp.offset;
      a.bytes = b.size;
      // The first value of its buffer, produced by a node: the others get there by the
      // interpreter's in-place and view rules.
      a.home = vp.def >= 0 && plan.values[b.values.front()].value == vp.value;
    }
    g.arena_bytes = plan.arena_bytes;
    g.planned_peak_bytes = plan.peak_bytes;
    return true;
  }
};

}  // namespace

std::unique_ptr<Pass> make_arena_plan_pass() { return std::make_unique<ArenaPlanPass>(); }

}  // namespace kiln::passes
