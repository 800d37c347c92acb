// canonicalize: re-infers every node's types, forwards nodes that compute their input
// unchanged to that input, and removes dead code. Forwarded (unless the node feeds a
// graph output directly, whose name must stay):
//  - Identity;
//  - Reshape / Expand whose static output shape equals the input's (what import-time
//    lowerings leave once shapes are folded: a grouped-query repeat by 1);
//  - Pad with constant all-zero pads;
//  - Where with a constant condition that is all true (all false), when the chosen
//    input already has the output's shape (attention masks that mask nothing).
#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

namespace {

/// The input a node passes through unchanged (OpDef::passthrough), or nullptr.
ir::Value* passthrough(const ir::Node& n) {
  if (n.outputs.size() != 1 || n.inputs.empty() || !n.inputs[0]) return nullptr;
  const ir::OpDef* def = ir::OpTable::get().find(n.op);
  return def && def->passthrough ? def->passthrough(n) : nullptr;
}

class Canonicalize : public Pass {
 public:
  std::string name() const override { return "canonicalize"; }
  Expected<bool> run(ir::Graph& g, PassContext&) override {
    bool changed = false;
    KILN_RETURN_IF_ERROR(ir::infer_graph(g));
    std::vector<ir::Node*> order;
    for (auto& n : g.nodes()) order.push_back(n.get());
    for (ir::Node* n : order) {  // in order, so a chain of pass-through nodes collapses
      ir::Value* in = passthrough(*n);
      if (!in || g.is_graph_output(n->outputs[0])) continue;
      g.replace_all_uses(n->outputs[0], in);
      g.remove_node(n);
      changed = true;
    }
    if (g.dead_code_elimination() > 0) changed = true;
    KILN_RETURN_IF_ERROR(ir::infer_graph(g));
    return changed;
  }
};
}  // namespace

std::unique_ptr<Pass> make_canonicalize_pass() { return std::make_unique<Canonicalize>(); }

}  // namespace kiln::passes
