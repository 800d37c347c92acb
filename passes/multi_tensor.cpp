// multi_tensor: consecutive generated kernels that only compute the step's results (the
// optimizer's per-parameter updates: new parameter and moments, the SGD or AdamW update
// with clipping and the LR schedule folded in) and read nothing another of them writes
// (and the eager 8-bit AdamW updates, whose kernel also comes in pieces: OpDef::multi_tensor)
// become one multi-tensor launch, as PyTorch's foreach / multi_tensor_apply optimizers
// launch one kernel over a list of tensors: every member gets kiln_multi_tensor_group = G
// (the run's index) and kiln_multi_tensor_size = its length, printed in the IR dump. The
// executor (runtime/interpreter.cpp) runs a group's kernels in one parallel region, their
// work split into pieces over all threads, instead of one parallel region per parameter
// (and the many small bias and LayerNorm updates, each below one thread's minimum work,
// no longer run on one thread while the others wait). Members run concurrently, so the
// memory planner (PlanOptions::honor_groups) keeps every buffer a member reads or writes
// live over the whole group. The small scalar kernels of the LR schedule and weight decay
// that the scheduler leaves between updates move before them, and nodes reading an update's
// result after them (gather_window), so the updates become consecutive. Runs after
// fused_inplace in the compiled pipeline; top level only (the update follows the
// accumulation loop); a group of one kernel is left alone.
#include <unordered_set>

#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// Every output of `n` is a graph output (a step result).
bool only_results(const Node& n, const std::unordered_set<const Value*>& outputs) {
  for (const Value* o : n.outputs)
    if (!o || !outputs.count(o)) return false;
  return n.num_outputs() > 0;
}

/// A member of a launch: a generated pointwise kernel, or an op whose eager kernel also
/// comes in pieces (OpDef::multi_tensor: the 8-bit AdamW update), making only step
/// results of static shapes.
bool member_candidate(const Node& n, const std::unordered_set<const Value*>& outputs) {
  const bool generated = has_trait(n, OpTrait::fused_kernel) && n.attrs.get_string("kind", "") == "pointwise";
  if (!generated) {
    const OpDef* def = OpTable::get().find(n.op);
    if (!def || !def->multi_tensor || !n.regions.empty()) return false;
  }
  if (!only_results(n, outputs)) return false;
  for (const Value* o : n.outputs)
    if (!o->shape.is_static()) return false;
  return true;
}

/// Every output holds one element (the step counter, the logged learning rate).
bool scalar_outputs(const Node& n) {
  for (const Value* o : n.outputs)
    if (!o || !o->shape.is_static() || o->shape.numel() > 1) return false;
  return true;
}

/// Outputs of at most kSmallBytes each (the per-parameter scalars of the LR schedule and
/// weight decay that sit between update kernels).
constexpr int64_t kSmallBytes = 4096;
bool small_outputs(const Node& n) {
  for (const Value* o : n.outputs)
    if (!o || !o->shape.is_static() || o->shape.numel() * static_cast<int64_t>(dtype_size(o->dtype)) > kSmallBytes)
      return false;
  return true;
}

/// From the update kernel at position `i`: the nodes up to the first barrier (a loop, or
/// a node with large outputs that reads no member result and makes more than step
/// results) are reordered as [small nodes reading no member result] [members: generated
/// kernels making only step results, not all scalars] [nodes reading a member result,
/// directly or through another such node, and the other nodes making only step results],
/// which keeps the order topological. Returns the number of
/// members, now consecutive from position i + (small nodes moved).
size_t gather_window(Graph& g, size_t i, const std::unordered_set<const Value*>& outputs, size_t* first_member) {
  auto& nodes = g.mutable_nodes();
  std::unordered_set<const Value*> tainted;  // member results and what is computed from them
  std::unordered_set<const Value*> member_reads;
  std::vector<size_t> movable, members, after;
  size_t j = i;
  for (; j < nodes.size(); ++j) {
    const Node& n = *nodes[j];
    bool reads_tainted = false;
    for (const Value* v : n.inputs) reads_tainted = reads_tainted || (v && tainted.count(v));
    if (!n.regions.empty() && !has_trait(n, OpTrait::fused_kernel)) break;  // a loop: barrier
    // A kernel writing into its input k (kiln_inplace, fused_inplace.cpp: its last reader)
    // may join only if no earlier member reads that input: members run at the same time.
    // The same for the state inputs it writes into (kiln_donate).
    const int64_t ip = n.attrs.get_int("kiln_inplace", -1);
    bool inplace_ok = ip < 0 || ip >= n.num_inputs() || !member_reads.count(n.inputs[ip]);
    for (int64_t k : n.attrs.get_ints("kiln_donate"))
      if (k >= 0 && k < n.num_inputs() && member_reads.count(n.inputs[k])) inplace_ok = false;
    if (!reads_tainted && inplace_ok && member_candidate(n, outputs) && !scalar_outputs(n)) {
      members.push_back(j);
      for (const Value* v : n.inputs) member_reads.insert(v);
    } else if (reads_tainted || only_results(n, outputs)) {
      after.push_back(j);  // reads a member's result, or makes only step results
    } else if (small_outputs(n)) {
      movable.push_back(j);  // the LR schedule's and weight decay's scalars
      continue;
    } else {
      break;  // independent work with large results stays where the scheduler put it
    }
    for (const Value* o : n.outputs) tainted.insert(o);
  }
  *first_member = i + movable.size();
  if (members.size() < 2) return members.size();
  std::vector<std::unique_ptr<Node>> order;
  for (auto* list : {&movable, &members, &after})
    for (size_t k : *list) order.push_back(std::move(nodes[k]));
  for (size_t k = 0; k < order.size(); ++k) nodes[i + k] = std::move(order[k]);
  return members.size();
}

int mark_groups(Graph& g) {
  const std::unordered_set<const Value*> outputs(g.outputs.begin(), g.outputs.end());
  int groups = 0;
  size_t i = 0;
  while (i < g.nodes().size()) {
    if (!member_candidate(*g.nodes()[i], outputs)) {
      ++i;
      continue;
    }
    size_t first = i;
    const size_t count = gather_window(g, i, outputs, &first);
    if (count >= 2) {
      for (size_t k = first; k < first + count; ++k) {
        g.nodes()[k]->attrs.set("kiln_multi_tensor_group", static_cast<int64_t>(groups));
        g.nodes()[k]->attrs.set("kiln_multi_tensor_size", static_cast<int64_t>(count));
      }
      ++groups;
      i = first + count;
    } else {
      ++i;
    }
  }
  return groups;
}

class MultiTensor : public Pass {
 public:
  std::string name() const override { return "multi_tensor"; }
  std::string describe_options(const PassOptions& o) const override {
    return OptionText().add("multi_tensor", o.lowering.multi_tensor).str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    if (!ctx.options.lowering.multi_tensor) return false;
    return mark_groups(g) > 0;
  }
};

}  // namespace

std::unique_ptr<Pass> make_multi_tensor_pass() { return std::make_unique<MultiTensor>(); }

}  // namespace kiln::passes
