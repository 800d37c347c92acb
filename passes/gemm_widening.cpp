// gemm_widening: bf16 matrix products as f32 products of widened operands, for CPUs
// without native bf16 dot products (no AVX512_BF16 / AMX), where oneDNN emulates bf16
// GEMMs several times slower than its f32 ones (docs/performance.md: 8.5x on AVX2); and
// f16 products the same way on every CPU (option widen_f16_gemm): oneDNN 2.6 has no CPU
// f16 matmul, so kiln's eager f16 MatMul/Gemm is a plain f64 loop (about 50x slower
// than f32 for the tiny GPT's step) with an f64 M x N scratch tensor. f16 values and
// their products are exact in f32 too (11-bit significands), and PyTorch accumulates
// f16 GEMMs in f32 as well.
//
// A MatMul or Gemm with bf16 operands and a bf16 result becomes
//     Cast(A, f32), Cast(B, f32) [, Cast(C, f32)] -> MatMul/Gemm in f32 -> Cast(result, bf16)
// which computes the same function: bf16 values are exact in f32, their products are
// exact in f32, oneDNN accumulates bf16 GEMMs in f32 too, and the final rounding to bf16
// is the same; only the summation order may differ. The casts are pointwise, so the
// fusion pass folds them into their producers and consumers (a weight's bf16 cast and
// its widening become one generated kernel). The product node keeps its op and
// attributes plus `kiln_widened = "bf16"`, named "<node>/f32"; the original node becomes
// the narrowing Cast and keeps its output value (names seen outside stay the same).
//
// Runs in the compiled pipeline before fusion when the driver sets the option
// `widen_bf16_gemm` = 1 (the host CPU lacks native bf16 dot products) or
// `widen_f16_gemm` = 1 (--fp16); recurses into loop bodies (AccumulationLoop).
#include "ir/dtype.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// A MatMul or Gemm whose operands and result all have dtype `low` (bf16 or f16).
bool widenable(const Node& n, DType low) {
  if (!has_trait(n, OpTrait::matmul) || n.num_outputs() != 1 || !n.outputs[0]) return false;
  if (n.outputs[0]->dtype != low || n.attrs.has("kiln_widened")) return false;
  for (const Value* in : n.inputs)
    if (in && in->dtype != low) return false;
  return true;
}

/// Widens every `low` product of `g` and its loop bodies; returns how many.
int widen_graph(Graph& g, DType low) {
  int count = 0;
  for (auto& n : g.nodes())
    if (!has_trait(*n, OpTrait::fused_kernel))
      for (auto& r : n->regions) count += widen_graph(*r, low);
  std::vector<Node*> targets;
  for (auto& n : g.nodes())
    if (widenable(*n, low)) targets.push_back(n.get());
  for (Node* n : targets) {
    size_t pos = static_cast<size_t>(g.index_of(n));
    std::vector<Value*> ins;
    for (size_t k = 0; k < n->inputs.size(); ++k) {
      Value* in = n->inputs[k];
      if (!in) {
        ins.push_back(nullptr);
        continue;
      }
      bool reused = false;  // the same operand twice (Gemm(X, X)): one cast
      for (size_t j = 0; j < k; ++j)
        if (n->inputs[j] == in) {
          ins.push_back(ins[j]);
          reused = true;
          break;
        }
      if (reused) continue;
      Attributes a;
      a.set("to", static_cast<int64_t>(dtype_to_onnx(DType::f32)));
      const std::string nm = n->name + "/widen_" + std::to_string(k);
      Node* c = g.insert_node(pos++, "Cast", nm, {in}, {nm + "_output"}, a);
      c->outputs[0]->dtype = DType::f32;
      c->outputs[0]->shape = in->shape;
      ins.push_back(c->outputs[0]);
    }
    Attributes ma = n->attrs;
    ma.set("kiln_widened", std::string(dtype_name(low)));
    Node* m = g.insert_node(pos, n->op, n->name + "/f32", ins, {n->outputs[0]->name + ".f32"}, ma);
    m->outputs[0]->dtype = DType::f32;
    m->outputs[0]->shape = n->outputs[0]->shape;
    // The original node narrows the f32 product and keeps its output value.
    n->op = "Cast";
    n->name += "/narrow";
    n->inputs = {m->outputs[0]};
    Attributes ca;
    ca.set("to", static_cast<int64_t>(dtype_to_onnx(low)));
    n->attrs = ca;
    ++count;
  }
  return count;
}

class GemmWidening : public Pass {
 public:
  std::string name() const override { return "gemm_widening"; }
  std::string describe_options(const PassOptions& o) const override {
    return OptionText()
        .add("widen_bf16_gemm", o.lowering.widen_bf16_gemm)
        .add("widen_f16_gemm", o.lowering.widen_f16_gemm)
        .str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    int n = 0;
    if (ctx.options.lowering.widen_bf16_gemm) n += widen_graph(g, DType::bf16);
    if (ctx.options.lowering.widen_f16_gemm) n += widen_graph(g, DType::f16);
    return n > 0;
  }
};

}  // namespace

std::unique_ptr<Pass> make_gemm_widening_pass() { return std::make_unique<GemmWidening>(); }

}  // namespace kiln::passes
