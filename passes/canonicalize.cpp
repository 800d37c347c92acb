// canonicalize: re-infers every node's types, forwards Identity nodes to their
// input (unless the Identity feeds a graph output directly) and removes dead code.
#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

namespace {
class Canonicalize : public Pass {
 public:
  std::string name() const override { return "canonicalize"; }
  Expected<bool> run(ir::Graph& g, PassContext&) override {
    bool changed = false;
    std::vector<ir::Node*> ids;
    for (auto& n : g.nodes())
      if (n->op == "Identity" && n->inputs.size() == 1 && n->inputs[0] && !g.is_graph_output(n->outputs[0]))
        ids.push_back(n.get());
    for (ir::Node* n : ids) {
      g.replace_all_uses(n->outputs[0], n->inputs[0]);
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
