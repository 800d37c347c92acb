// absorb_transpose: a Transpose that feeds an operand of a library matrix product becomes
// a strided read of that operand inside the library call, so the transposed copy is never
// made (issue 7: "absorbing Transpose ... as index arithmetic, no copies"; the library
// side of what fusion does for generated kernels). oneDNN's matmul takes any element
// strides for its source and weights (runtime/kernels/onednn.cpp falls back to a dense
// copy where oneDNN would pick its reference implementation).
//
//   MatMul(Transpose(X, perm), B)  ->  MatMul(X, B) {kiln_perm_a = perm}
//   MatMul(A, Transpose(X, perm))  ->  MatMul(A, X) {kiln_perm_b = perm}
//   Gemm(Transpose(X), B, C) with a 2-D X -> Gemm(X, B, C) {transA = 1 - transA} (ONNX's own flag)
//
// kiln_perm_a/b mean "operand k is Transpose(input k, perm)": MatMul's inference and eager
// kernel read it so (ir/ops/nn.cpp, runtime/kernels/nn.cpp). A chain of Transposes
// composes into one perm. The Transpose node stays while other nodes read it (fusion then
// folds it into their kernels) and is removed when none do. Runs in the compiled pipeline
// after autodiff (MatMul's gradient rule does not take the attributes) and before fusion;
// recurses into AccumulationLoop bodies, absorbing Transposes of the same graph only.
#include <string>
#include <vector>

#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// The Transpose node producing `v` in graph `g`, or nullptr.
Node* transpose_in(Graph& g, Value* v) {
  if (!v || !v->producer || !has_trait(*v->producer, OpTrait::transpose) || g.index_of(v->producer) < 0) return nullptr;
  Node* t = v->producer;
  if (!t->inputs[0] || !t->inputs[0]->shape.is_known() || !v->shape.is_known()) return nullptr;  // static or symbolic
  return t;
}

/// The perm of Transpose node `t` (ONNX default: reversed dims).
std::vector<int64_t> perm_of(const Node& t) {
  const int r = t.inputs[0]->shape.rank();
  std::vector<int64_t> p = t.attrs.get_ints("perm");
  if (p.empty())
    for (int i = r - 1; i >= 0; --i) p.push_back(i);
  return p;
}

int absorb_graph(Graph& g) {
  int count = 0;
  for (auto& n : g.nodes())
    if (has_trait(*n, OpTrait::loop))
      for (auto& r : n->regions) count += absorb_graph(*r);
  for (auto& np : g.nodes()) {
    Node& n = *np;
    if (has_trait(n, OpTrait::operand_perms)) {
      for (int k = 0; k < 2; ++k) {
        const std::string key = k == 0 ? "kiln_perm_a" : "kiln_perm_b";
        // view = Transpose(input, q); input = Transpose(X, p)  =>  view = Transpose(X, p o q).
        while (Node* t = transpose_in(g, n.inputs[k])) {
          if (t->inputs[0]->shape.rank() < 2) break;
          const std::vector<int64_t> p = perm_of(*t);
          std::vector<int64_t> q = n.attrs.get_ints(key), r;
          if (q.empty())
            r = p;
          else
            for (int64_t i : q) r.push_back(p[static_cast<size_t>(i)]);
          n.attrs.set(key, r);
          n.inputs[k] = t->inputs[0];
          ++count;
        }
      }
    } else if (has_trait(n, OpTrait::operand_trans_flags)) {
      for (int k = 0; k < 2; ++k) {
        const std::string key = k == 0 ? "transA" : "transB";
        while (Node* t = transpose_in(g, n.inputs[k])) {
          if (t->inputs[0]->shape.rank() != 2 || perm_of(*t) != std::vector<int64_t>{1, 0}) break;
          n.attrs.set(key, int64_t(1 - n.attrs.get_int(key, 0)));
          n.inputs[k] = t->inputs[0];
          ++count;
        }
      }
    }
  }
  if (count > 0) g.dead_code_elimination();
  return count;
}

class AbsorbTranspose : public Pass {
 public:
  std::string name() const override { return "absorb_transpose"; }
  Expected<bool> run(Graph& g, PassContext&) override { return absorb_graph(g) > 0; }
};

}  // namespace

std::unique_ptr<Pass> make_absorb_transpose_pass() { return std::make_unique<AbsorbTranspose>(); }

}  // namespace kiln::passes
