// to_float64: rewrites a graph to compute in float64 (for reference checks
// against float64 PyTorch fixtures and central differences): every f32/bf16/f16
// initializer, graph input and state initial value becomes f64; Cast/ConstantOfShape
// targets of float type become f64; then types are re-inferred.
#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {
class ToFloat64 : public Pass {
 public:
  std::string name() const override { return "to_float64"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    auto conv = [](Value* v) {
      if (!is_float(v->dtype) || v->dtype == DType::f64) return;
      v->dtype = DType::f64;
      if (v->data) v->data = std::make_shared<Tensor>(v->data->cast(DType::f64));
    };
    for (Value* v : g.inputs) conv(v);
    for (Value* v : g.initializers) conv(v);
    for (auto& sb : g.state)
      if (sb.initial && is_float(sb.initial->dtype()))
        sb.initial = std::make_shared<Tensor>(sb.initial->cast(DType::f64));
    const int f64 = dtype_to_onnx(DType::f64);
    for (auto& n : g.nodes()) {
      if (!has_trait(*n, OpTrait::dtype_from_attr)) continue;
      if (n->attrs.has("to")) {
        auto to = dtype_from_onnx(static_cast<int>(n->attrs.get_int("to", 1)));
        if (to && is_float(*to)) n->attrs.set("to", int64_t(f64));
      }
      if (const Tensor* t = n->attrs.get_tensor("value"); t && is_float(t->dtype()))
        n->attrs.set("value", t->cast(DType::f64));
    }
    KILN_RETURN_IF_ERROR(infer_graph(g));
    return true;
  }
};
}  // namespace

std::unique_ptr<Pass> make_to_float64_pass() { return std::make_unique<ToFloat64>(); }

}  // namespace kiln::passes
