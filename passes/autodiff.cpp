// autodiff: reverse-mode differentiation over the op table.
//
// Algorithm (the classic tape-free reverse sweep of ONNX Runtime's gradient
// builder and Glow's differentiate()): (1) mark every value that depends on a
// trainable parameter (state bindings of kind "parameter"), propagating through
// differentiable ops and float outputs only, so integer tensors and frozen
// parameters never receive a gradient; (2) seed d(loss)/d(loss) = 1; (3) visit the
// forward nodes in reverse order; for each node with a gradient flowing into an
// output, call the op's gradient rule from the op table, which emits ordinary IR
// ops; (4) a value with several users collects its gradient contributions, and
// they are summed in exactly one place (sum_contributions) the first time the
// value's gradient is read. Generated node names are "<node>/grad/<op>_<k>" and
// each parameter's gradient is named "<param>.grad" and appended to the graph
// outputs after the loss.
//
// Options: "loss_output" (default "loss").
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "passes/passes.h"
#include "passes/training_util.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

class AutodiffState;

class GradCtx : public GradContext {
 public:
  GradCtx(AutodiffState& st, Node& n, Builder& b) : st_(st), n_(n), b_(b) {}
  const Node& node() const override { return n_; }
  Value* grad_output(int i) override;
  bool needs_grad(int i) const override;
  void set_grad_input(int i, Value* g) override;
  std::vector<Value*> emit(const std::string& op, std::vector<Value*> inputs, int num_outputs,
                           Attributes attrs) override {
    auto r = b_.emit(op, std::move(inputs), num_outputs, std::move(attrs));
    if (!r) {
      if (status.is_ok()) status = r.status();
      return std::vector<Value*>(num_outputs, nullptr);
    }
    return *r;
  }
  Value* const_f(double v, DType dtype) override { return b_.scalar(v, dtype); }
  Value* const_i64(const std::vector<int64_t>& v) override { return b_.ints(v); }
  Value* dims(const std::vector<Dim>& d) override { return b_.dims(d); }
  Value* unbroadcast(Value* g, const Value* target) override;
  Status status;

 private:
  AutodiffState& st_;
  Node& n_;
  Builder& b_;
};

class AutodiffState {
 public:
  explicit AutodiffState(Graph& g) : g(g) {}
  Graph& g;
  std::unordered_set<const Value*> requires_grad;
  std::unordered_map<const Value*, std::vector<Value*>> contributions;
  std::unordered_map<const Value*, Value*> summed;

  /// Sums the gradient contributions of `v` (once); nullptr when none.
  Value* sum_contributions(const Value* v, Builder& b) {
    auto s = summed.find(v);
    if (s != summed.end()) return s->second;
    auto it = contributions.find(v);
    if (it == contributions.end() || it->second.empty()) return nullptr;
    Value* acc = it->second[0];
    if (it->second.size() > 1) {
      b.set_prefix(v->name + "/grad/sum");
      for (size_t i = 1; i < it->second.size(); ++i) acc = b.op("Add", {acc, it->second[i]});
    }
    summed[v] = acc;
    return acc;
  }
};

Value* GradCtx::grad_output(int i) {
  if (i >= n_.num_outputs()) return nullptr;
  return st_.summed.count(n_.outputs[i]) ? st_.summed[n_.outputs[i]] : nullptr;
}

bool GradCtx::needs_grad(int i) const {
  Value* v = n_.input(i);
  return v && is_float(v->dtype) && st_.requires_grad.count(v);
}

void GradCtx::set_grad_input(int i, Value* g) {
  Value* v = n_.input(i);
  if (!v || !g || !needs_grad(i)) return;
  // Dims agree when equal (static values or symbolic expressions), or when one is unknown
  // and neither static.
  bool same = g->shape.rank() == v->shape.rank();
  for (int k = 0; same && k < v->shape.rank(); ++k) {
    const Dim &a = g->shape.dims[k], &e = v->shape.dims[k];
    same = a == e || ((a.is_unknown() || e.is_unknown()) && !a.is_static() && !e.is_static());
  }
  if (!same) {
    if (status.is_ok())
      status =
          Status::error("gradient rule of node '" + n_.name + "' (" + n_.op + ") produced shape " +
                        g->shape.to_string() + " for input " + std::to_string(i) + " of shape " + v->shape.to_string());
    return;
  }
  if (g->dtype != v->dtype) g = b_.op("Cast", {g}, make_attrs({{"to", int64_t(dtype_to_onnx(v->dtype))}}));
  st_.contributions[v].push_back(g);
}

Value* GradCtx::unbroadcast(Value* g, const Value* target) {
  if (!g) return nullptr;
  // Dims compare as expressions: a symbolic dim broadcasts only against 1 or itself
  // (ir::broadcast_shapes), so a target dim of 1 against anything else is a sum.
  const std::vector<Dim>& gs = g->shape.dims;
  const std::vector<Dim>& ts = target->shape.dims;
  if (gs == ts) return g;
  int gr = static_cast<int>(gs.size()), tr = static_cast<int>(ts.size());
  std::vector<int64_t> axes;
  for (int i = 0; i < gr; ++i) {
    int ti = i - (gr - tr);
    if (ti < 0 || (ts[ti] == Dim(1) && gs[i] != Dim(1))) axes.push_back(i);
  }
  Value* r = g;
  if (!axes.empty()) r = b_.op("ReduceSum", {g, b_.ints(axes)}, make_attrs({{"keepdims", int64_t(1)}}));
  if (r && r->shape.dims != ts) r = b_.op("Reshape", {r, b_.dims(ts)});
  if (!r && status.is_ok()) status = b_.status();
  return r;
}

class Autodiff : public Pass {
 public:
  std::string name() const override { return "autodiff"; }
  std::string describe_options(const PassOptions& o) const override {
    return OptionText().add("loss_output", o.autodiff.loss_output).str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const std::string& loss_name = ctx.options.autodiff.loss_output;
    Value* loss = g.find_value(loss_name);
    if (!loss) return Status::error("no value named '" + loss_name + "' to differentiate");
    if (loss->shape.rank() != 0 && loss->shape.numel() != 1)
      return Status::error("loss '" + loss_name + "' must be a scalar, has shape " + loss->shape.to_string());
    std::vector<Value*> params;
    for (auto& sb : g.state)
      if (sb.kind == "parameter") params.push_back(sb.input);
    if (params.empty()) return Status::error("no trainable parameters (check --freeze / --trainable)");

    AutodiffState st(g);
    for (Value* p : params) st.requires_grad.insert(p);
    std::vector<Node*> forward;
    for (auto& n : g.nodes()) forward.push_back(n.get());
    const auto& table = OpTable::get();
    for (Node* n : forward) {
      const OpDef* def = table.find(n->op);
      if (!def || def->diff != Differentiability::differentiable) continue;
      bool any = false;
      for (Value* in : n->inputs)
        if (in && st.requires_grad.count(in)) any = true;
      if (!any) continue;
      for (Value* o : n->outputs)
        if (is_float(o->dtype)) st.requires_grad.insert(o);
    }
    if (!st.requires_grad.count(loss))
      return Status::error("loss '" + loss_name + "' does not depend on any trainable parameter");

    Builder b(g, "loss/grad");
    Value* seed = b.scalar(1.0, loss->dtype);
    if (loss->shape.rank() != 0) seed = b.op("Reshape", {seed, b.dims(loss->shape.dims)});
    st.contributions[loss].push_back(seed);

    for (auto it = forward.rbegin(); it != forward.rend(); ++it) {
      Node* n = *it;
      bool has_grad = false;
      for (Value* o : n->outputs)
        if (st.requires_grad.count(o) && st.sum_contributions(o, b)) has_grad = true;
      if (!has_grad) continue;
      const OpDef* def = table.find(n->op);
      bool any_input = false;
      for (Value* in : n->inputs)
        if (in && is_float(in->dtype) && st.requires_grad.count(in)) any_input = true;
      if (!any_input || !def || def->diff != Differentiability::differentiable) continue;
      b.set_prefix(n->name + "/grad");
      GradCtx gctx(st, *n, b);
      Status rs = def->grad(gctx);
      if (!rs) return rs.with_context("gradient of node '" + n->name + "' (" + n->op + ")");
      if (!gctx.status) return gctx.status;
      if (!b.status()) return b.status().with_context("gradient of node '" + n->name + "' (" + n->op + ")");
    }
    for (Value* p : params) {
      b.set_prefix(p->name + "/grad");
      Value* gsum = st.sum_contributions(p, b);
      b.set_prefix(p->name + "/grad");
      Value* out;
      if (!gsum) {
        // Parameter does not reach the loss: zero gradient (PyTorch leaves .grad None;
        // the optimizer then skips it, which a zero gradient with no decay matches).
        Value* z = b.scalar(0.0, p->dtype);
        out = b.op("Expand", {z, b.dims(p->shape.dims)}, {}, p->name + ".grad");
      } else {
        out = b.op("Identity", {gsum}, {}, p->name + ".grad");
      }
      if (!out) return b.status();
      g.outputs.push_back(out);
    }
    if (!b.status()) return b.status();
    return true;
  }
};

}  // namespace

std::unique_ptr<Pass> make_autodiff_pass() { return std::make_unique<Autodiff>(); }

}  // namespace kiln::passes
