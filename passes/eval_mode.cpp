// eval_mode: puts a graph exported in training mode into inference mode, as
// model.eval() does in PyTorch: BatchNormalization gets training_mode=0 and uses
// its running statistics (its unused running-stat outputs are dropped), and
// Dropout loses its training_mode input so that only the run's training flag
// (off for inference) could enable it.
#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {
class EvalMode : public Pass {
 public:
  std::string name() const override { return "eval_mode"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    bool changed = false;
    for (auto& np : g.nodes()) {
      Node* n = np.get();
      if (has_trait(*n, OpTrait::running_stats)) {
        if (n->attrs.get_int("training_mode", 0) != 0) changed = true;
        n->attrs.set("training_mode", int64_t(0));
        while (n->num_outputs() > 1 && g.uses(n->outputs.back()).empty() && !g.is_graph_output(n->outputs.back())) {
          n->outputs.pop_back();
          changed = true;
        }
        KILN_RETURN_IF_ERROR(infer_node(*n));
      } else if (has_trait(*n, OpTrait::dropout) && n->num_inputs() > 2) {
        n->inputs.resize(2);
        changed = true;
      }
    }
    return changed;
  }
};
}  // namespace

std::unique_ptr<Pass> make_eval_mode_pass() { return std::make_unique<EvalMode>(); }

}  // namespace kiln::passes
