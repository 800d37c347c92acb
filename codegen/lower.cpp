// Lowering of FusedKernel nodes to kernel IR; see lower.h.
#include "codegen/lower.h"

#include <unordered_map>

#include "ir/op_table.h"
#include "ir/ops/nn.h"

namespace kiln::codegen {

using namespace kiln::ir;

namespace {

/// Builds a Kernel's expression DAG from the members' scalar rules.
class KernelBuilder : public ScalarBuilder {
 public:
  KernelBuilder(Kernel& k, std::unordered_map<const Value*, Ref>& env) : k_(k), env_(env) {}
  void set_node(const Node* n) { n_ = n; }
  const Node& node() const override { return *n_; }
  bool has_input(int i) const override { return i < n_->num_inputs() && n_->inputs[i]; }
  Ref input(int i) override {
    const Value* v = n_->inputs[i];
    auto it = env_.find(v);
    if (it != env_.end()) return it->second;
    error_ = "value '" + v->name + "' has no expression";
    return constant(0, v->dtype);
  }
  Ref constant(double v, DType dt) override { return k_.add_constant(v, dt); }
  Ref apply(ScalarOp op, std::vector<Ref> args, DType dt) override { return k_.add_op(op, std::move(args), dt); }
  DType dtype(Ref r) const override { return k_.exprs[r].dtype; }
  Ref load(int param) { return k_.add_load(param); }
  const std::string& error() const { return error_; }

 private:
  Kernel& k_;
  std::unordered_map<const Value*, Ref>& env_;
  const Node* n_ = nullptr;
  std::string error_;
};

/// Numpy broadcast strides of `shape` against `domain` (right-aligned; size-1 dims 0).
std::vector<int64_t> broadcast_strides(const std::vector<int64_t>& shape, const std::vector<int64_t>& domain) {
  std::vector<int64_t> st(domain.size(), 0);
  int64_t stride = 1;
  const int off = static_cast<int>(domain.size()) - static_cast<int>(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    st[d + off] = shape[d] == 1 ? 0 : stride;
    stride *= shape[d];
  }
  return st;
}

void collect_fused(const Graph& g, std::vector<const Node*>& out) {
  for (auto& n : g.nodes()) {
    if (n->op == "FusedKernel") {
      out.push_back(n.get());
      continue;
    }
    for (auto& r : n->regions) collect_fused(*r, out);
  }
}

}  // namespace

std::vector<const Node*> fused_nodes(const Graph& g) {
  std::vector<const Node*> out;
  collect_fused(g, out);
  return out;
}

Expected<Kernel> lower_fused(const Node& fused) {
  auto fail = [&](const std::string& m) { return Status::error("fused node '" + fused.name + "': " + m); };
  if (fused.op != "FusedKernel" || fused.regions.size() != 1) return fail("not a FusedKernel with a body");
  const std::string kind = fused.attrs.get_string("kind", "");
  if (kind != "pointwise" && kind != "reduction") return fail("kind '" + kind + "' is not supported");
  const bool reduction = kind == "reduction";
  const Graph& body = *fused.regions[0];
  if (body.outputs.empty() || body.nodes().empty()) return fail("empty body");
  const Node& last = *body.nodes().back();
  if (reduction && (body.outputs.size() != 1 || body.outputs[0] != last.outputs[0] || !last.input(0)))
    return fail("a reduction kernel's only output must be its last node's");
  // Pointwise: the members' common shape. Reduction: the reduced input's shape.
  const Shape& dom_shape = reduction ? last.input(0)->shape : body.outputs[0]->shape;
  if (!dom_shape.is_static()) return fail("domain shape " + dom_shape.to_string() + " is not static");
  Kernel k;
  k.name = fused.name;
  for (char& c : k.name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  k.domain = dom_shape.to_vector();
  std::unordered_map<const Value*, ScalarBuilder::Ref> env;
  KernelBuilder b(k, env);
  for (const Value* in : body.inputs) {
    if (!in->shape.is_static()) return fail("input '" + in->name + "' shape is not static");
    if (in->shape.rank() > dom_shape.rank()) return fail("input '" + in->name + "' has a higher rank than the domain");
    env[in] = b.load(k.add_param(in->name, in->dtype, broadcast_strides(in->shape.to_vector(), k.domain)));
  }
  for (const Value* c : body.initializers)
    if (c->data->numel() == 1) env[c] = b.constant(c->data->get_f64(0), c->dtype);  // else: reduction axes
  for (auto& n : body.nodes()) {
    if (reduction && n.get() == &last) break;
    const OpDef* def = OpTable::get().find(n->op);
    if (!def || !def->scalar) return fail("op '" + n->op + "' (node '" + n->name + "') has no scalar rule");
    if (n->num_outputs() != 1) return fail("node '" + n->name + "' has several outputs");
    b.set_node(n.get());
    std::vector<ScalarBuilder::Ref> outs;
    KILN_RETURN_IF_ERROR(def->scalar(b, outs).with_context("fused node '" + fused.name + "', node '" + n->name + "'"));
    if (!b.error().empty()) return fail(b.error());
    if (outs.size() != 1 || k.exprs[outs[0]].dtype != n->outputs[0]->dtype)
      return fail("node '" + n->name + "': scalar rule result does not match the output dtype");
    if (!(n->outputs[0]->shape == dom_shape))
      return fail("node '" + n->name + "' output shape " + n->outputs[0]->shape.to_string() +
                  " differs from the domain " + dom_shape.to_string());
    env[n->outputs[0]] = outs[0];
    k.fused_nodes.push_back(n->name);
  }
  if (reduction) {
    const OpDef* def = OpTable::get().find(last.op);
    if (!def || !def->reduce_combine) return fail("op '" + last.op + "' is not a generated reduction");
    const Value* ax = last.input(1);
    auto spec = reduce_spec(last.attrs, ax != nullptr, ax && ax->data ? ax->data.get() : nullptr, dom_shape.rank());
    if (!spec) return fail("node '" + last.name + "': " + spec.message());
    if (spec->noop || spec->axes.empty()) return fail("node '" + last.name + "' reduces nothing");
    auto it = env.find(last.input(0));
    if (it == env.end()) return fail("reduced value '" + last.input(0)->name + "' has no expression");
    // The output in the domain's rank with 1 on reduced dims (its keepdims layout is the
    // same memory order either way): broadcast strides give 0 along reduced dims.
    k.reduced.assign(k.domain.size(), false);
    std::vector<int64_t> kept = k.domain;
    for (int a : spec->axes) {
      k.reduced[a] = true;
      kept[a] = 1;
    }
    const Value* o = body.outputs[0];
    const int p = k.add_param(o->name, o->dtype, broadcast_strides(kept, k.domain), /*is_output=*/true);
    k.add_store(p, it->second, *def->reduce_combine == ScalarOp::max ? ReduceKind::max : ReduceKind::sum);
    k.fused_nodes.push_back(last.name);
    return k;
  }
  const std::vector<int64_t> contiguous = broadcast_strides(k.domain, k.domain);
  for (const Value* o : body.outputs) {
    auto it = env.find(o);
    if (it == env.end()) return fail("output '" + o->name + "' is not computed by the body");
    k.add_store(k.add_param(o->name, o->dtype, contiguous, /*is_output=*/true), it->second);
  }
  return k;
}

}  // namespace kiln::codegen
