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

/// The input a node passes through unchanged, or nullptr.
ir::Value* passthrough(const ir::Node& n) {
  if (n.outputs.size() != 1 || n.inputs.empty() || !n.inputs[0]) return nullptr;
  const ir::Value* out = n.outputs[0];
  auto same_type = [&](const ir::Value* v) {
    return v && v->dtype == out->dtype && v->shape.is_static() && out->shape.is_static() && v->shape == out->shape;
  };
  if (n.op == "Identity" && n.inputs.size() == 1) return n.inputs[0];
  if ((n.op == "Reshape" || n.op == "Expand") && same_type(n.inputs[0])) return n.inputs[0];
  if (n.op == "Pad" && same_type(n.inputs[0]) && n.input(1) && n.input(1)->data) {
    for (int64_t p : n.input(1)->data->to_i64_vector())
      if (p != 0) return nullptr;
    return n.inputs[0];
  }
  if (n.op == "Where" && n.inputs.size() == 3 && n.inputs[0]->data) {
    const ir::Tensor& c = *n.inputs[0]->data;
    bool all = true, none = true;
    for (int64_t i = 0; i < c.numel(); ++i) (c.get_i64(i) ? none : all) = false;
    if (all && same_type(n.inputs[1])) return n.inputs[1];
    if (none && same_type(n.inputs[2])) return n.inputs[2];
  }
  return nullptr;
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
