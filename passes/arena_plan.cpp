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
#include <unordered_map>
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

/// Every value of `g` in one fixed order (inputs, initializers, then per node its regions'
/// values and its outputs): a clone of `g` lists its copies at the same positions.
void list_values(const Graph& g, std::vector<const Value*>& out) {
  out.insert(out.end(), g.inputs.begin(), g.inputs.end());
  out.insert(out.end(), g.initializers.begin(), g.initializers.end());
  for (const auto& n : g.nodes()) {
    for (const auto& r : n->regions) list_values(*r, out);
    out.insert(out.end(), n->outputs.begin(), n->outputs.end());
  }
}

/// The first value of `g` with a dim that is not static, or nullptr.
const Value* first_symbolic(const Graph& g) {
  std::vector<const Value*> vs;
  list_values(g, vs);
  for (const Value* v : vs)
    for (const Dim& d : v ? v->shape.dims : std::vector<Dim>{})
      if (!d.is_static()) return v;
  return nullptr;
}

class ArenaPlanPass : public Pass {
 public:
  std::string name() const override { return "arena_plan"; }
  std::string describe_options(const PassOptions& o) const override {
    std::string b;
    for (const auto& [s, v] : o.symbol_bounds) b += (b.empty() ? "" : ",") + s + "=" + std::to_string(v);
    return b.empty() ? std::string() : OptionText().add("symbol_bounds", b).str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    // A symbolic program (--shape_mode symbolic) is laid out at its bounds
    // (PassOptions::symbol_bounds): a copy with every symbol bound to its largest value is
    // planned, and each value of `g` takes its copy's place. Lifetimes do not depend on
    // the symbols and no buffer is smaller than its value at the bound, so the offsets
    // hold for every smaller value of the symbols.
    std::unique_ptr<Graph> bound;
    const Graph* planned = &g;
    if (first_symbolic(g)) {
      if (ctx.options.symbol_bounds.empty())
        return Status::error("arena_plan: the program has symbolic dims and no bounds for them (--max_length)");
      bound = g.clone();
      KILN_RETURN_IF_ERROR(bind_symbols(*bound, ctx.options.symbol_bounds).with_context("arena_plan at the bound"));
      if (const Value* v = first_symbolic(*bound))
        return Status::error("arena_plan: value '" + v->name + "' has shape " + v->shape.to_string() +
                             " at the bounds (a dim the bounds do not fix)");
      planned = bound.get();
    }
    KILN_ASSIGN_OR_RETURN(MemoryPlan plan, plan_step_arena_layout(*planned));
    // The value of `g` each planned value stands for.
    std::unordered_map<const Value*, Value*> of_g;
    if (bound) {
      std::vector<const Value*> mine, theirs;
      list_values(g, mine);
      list_values(*bound, theirs);
      if (mine.size() != theirs.size())
        return Status::error("arena_plan: the bound copy differs from the program " + std::to_string(mine.size()) +
                             " " + std::to_string(theirs.size()));
      for (size_t i = 0; i < mine.size(); ++i)
        if (theirs[i]) of_g[theirs[i]] = const_cast<Value*>(mine[i]);
    }
    clear_placements(g);
    for (const ValuePlan& vp : plan.values) {
      if (vp.persistent || vp.buffer < 0 || vp.offset < 0 || !vp.value) continue;
      const BufferPlan& b = plan.buffers[static_cast<size_t>(vp.buffer)];
      Value* v = bound ? of_g.at(vp.value) : const_cast<Value*>(vp.value);  // a value of `g`
      ArenaPlacement& a = v->arena;
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
