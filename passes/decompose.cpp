// decompose: rewrites the nodes whose op declares a decomposition (OpDef::decomposable
// and OpDef::decompose, ir/ops/decompose.cpp: LayerNormalizationGrad, the softmax cross
// entropy and its gradient, ReduceMean, Split, Gather and Scatter with constant affine
// indices) into parts the fusion pass can generate, in the manner of PyTorch's
// decompositions (torch._decomp) that Inductor applies before lowering. Runs in the
// compiled pipeline before fusion (tools/driver/driver.cpp); the eager backend keeps the
// undecomposed ops.
//
// The new nodes take the place of the original node in the schedule (same position).
// Recurses into loop bodies (every region but a generated kernel's body).
#include <algorithm>

#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// The op-table entry of `n` when it declares a decomposition that applies to it, else nullptr.
const OpDef* decomposition_of(const Graph& g, const Node& n) {
  const OpDef* def = OpTable::get().find(n.op);
  return def && def->decomposable && def->decompose && def->decomposable(g, n) ? def : nullptr;
}

/// Decomposes the eligible nodes of `g` and of its loop bodies; constants go to `root`.
int decompose_graph(Graph& g, Graph& root, Status& st) {
  int count = 0;
  for (auto& n : g.nodes())
    if (!has_trait(*n, OpTrait::fused_kernel))
      for (auto& r : n->regions) count += decompose_graph(*r, root, st);
  std::vector<Node*> targets;
  for (auto& n : g.nodes())
    if (decomposition_of(g, *n)) targets.push_back(n.get());
  for (Node* n : targets) {
    if (!st.is_ok()) return count;
    const auto pos = static_cast<std::ptrdiff_t>(g.index_of(n));
    const auto appended_from = static_cast<std::ptrdiff_t>(g.nodes().size()) - 1;  // n is removed
    st = OpTable::get().find(n->op)->decompose(g, root, n);
    if (!st.is_ok()) return count;
    // The appended nodes (everything after the original last node) go to its position.
    auto& nodes = g.mutable_nodes();
    std::rotate(nodes.begin() + pos, nodes.begin() + appended_from, nodes.end());
    ++count;
  }
  return count;
}

class Decompose : public Pass {
 public:
  std::string name() const override { return "decompose"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    Status st;
    const int n = decompose_graph(g, g, st);
    if (!st.is_ok()) return st;
    return n > 0;
  }
};

}  // namespace

std::unique_ptr<Pass> make_decompose_pass() { return std::make_unique<Decompose>(); }

}  // namespace kiln::passes
