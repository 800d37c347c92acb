// Lowering of FusedKernel nodes to kernel IR; see lower.h.
#include "codegen/lower.h"

#include <map>
#include <unordered_map>

#include "ir/op_table.h"
#include "ir/ops/nn.h"
#include "ir/tensor.h"

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
  Ref reduce(ScalarOp combine, Ref x) override {
    if (!allow_reduce_) {
      error_ = "node '" + n_->name + "': a reduction outside a row rule";
      return x;
    }
    return k_.add_reduce(combine == ScalarOp::max ? ReduceKind::max : ReduceKind::sum, x);
  }
  void allow_reduce(bool a) { allow_reduce_ = a; }
  Ref load(int param) { return k_.add_load(param); }
  const std::string& error() const { return error_; }

 private:
  Kernel& k_;
  std::unordered_map<const Value*, Ref>& env_;
  const Node* n_ = nullptr;
  std::string error_;
  bool allow_reduce_ = false;
};

void collect_fused(const Graph& g, std::vector<const Node*>& out) {
  for (auto& n : g.nodes()) {
    if (ir::has_trait(*n, ir::OpTrait::fused_kernel)) {
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
  if (!ir::has_trait(fused, ir::OpTrait::fused_kernel) || fused.regions.size() != 1)
    return fail("not a FusedKernel with a body");
  const std::string kind = fused.attrs.get_string("kind", "");
  if (kind != "pointwise" && kind != "reduction" && kind != "row") return fail("kind '" + kind + "' is not supported");
  const bool reduction = kind == "reduction";
  const Graph& body = *fused.regions[0];
  if (body.outputs.empty() || body.nodes().empty()) return fail("empty body");
  const Node& last = *body.nodes().back();
  if (reduction && (body.outputs.size() != 1 || body.outputs[0] != last.outputs[0] || !last.input(0)))
    return fail("a reduction kernel's only output must be its last node's");
  // Row: the one member with a row rule (OpDef::row); its input 0 spans the domain.
  const Node* row_node = nullptr;
  if (kind == "row") {
    for (auto& n : body.nodes()) {
      const OpDef* def = OpTable::get().find(n->op);
      if (def && def->row) {
        if (row_node) return fail("two row ops ('" + row_node->name + "', '" + n->name + "') in one kernel");
        row_node = n.get();
      }
    }
    if (!row_node || !row_node->input(0)) return fail("a row kernel without a row op");
  }
  // Pointwise: the members' common shape. Reduction: the reduced input's shape. Row: the
  // row op's input 0.
  const Shape& dom_shape = row_node    ? row_node->input(0)->shape
                           : reduction ? last.input(0)->shape
                                       : body.outputs[0]->shape;
  Kernel k;
  k.name = fused.name;
  k.versions = fused.attrs.get_int("kiln_symbolic_versions", 1) != 0;
  for (char& c : k.name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  // Static extents, or expressions over the program's shape symbols (a symbolic kernel).
  for (const Dim& d : dom_shape.dims) {
    auto e = d.as_expr();
    if (!e) return fail("domain shape " + dom_shape.to_string() + " has an unknown dim");
    k.domain.push_back(*e);
  }
  const int rank = dom_shape.rank();
  // Dense strides of `s` read at the domain's points (numpy broadcasting).
  auto strides_for = [&](const Shape& s) -> Expected<std::vector<Extent>> {
    auto st = ir::broadcast_strides(s, rank);
    if (!st) return fail("shape " + s.to_string() + " does not broadcast to the domain " + dom_shape.to_string());
    return *st;
  };
  std::unordered_map<const Value*, ScalarBuilder::Ref> env;
  KernelBuilder b(k, env);
  // A body input read by a view member (Transpose, Expand, Slice, AsStrided, the Reshape
  // family; passes/fusion.cpp) is a parameter with the view's strides: the Transpose's output
  // element at domain index i is input element i permuted; Expand's is the input element
  // broadcast to it (stride 0 along expanded dims); Slice's is at offset + i * step-scaled
  // strides; a Reshape's is the input read with the dense strides of its output dims. The
  // view costs no copy. The fusion pass makes such an input reach the body only there.
  std::unordered_map<const Value*, const Node*> viewed_by;
  for (auto& n : body.nodes())
    if (ir::is_strided_view_op(n->op) && n->input(0)) viewed_by[n->input(0)] = n.get();
  // A body input read by a guarded view (Concat, constant Pad, SliceGrad) is a guarded
  // parameter: read inside the box where it lands in the view's output, the view's fill
  // outside (ir::guarded_read). The view's expression is built once all its inputs are.
  std::unordered_map<const Value*, std::pair<const Node*, int>> guarded_by;
  std::unordered_map<const Node*, std::map<int, int>> guarded_params;  // view -> input k -> param
  for (auto& n : body.nodes())
    if (ir::is_guarded_view_op(n->op))
      for (int kk : ir::guarded_view_inputs(*n))
        if (n->input(kk)) guarded_by[n->input(kk)] = {n.get(), kk};
  for (const Value* in : body.inputs) {
    if (auto gt = guarded_by.find(in); gt != guarded_by.end()) {
      const Node& t = *gt->second.first;
      if (!in->shape.is_static() || !dom_shape.is_static())
        return fail(t.op + " '" + t.name + "' reads with a guard, which a symbolic kernel does not take");
      if (!(t.outputs[0]->shape == dom_shape))
        return fail(t.op + " '" + t.name + "' does not span the domain " + dom_shape.to_string());
      auto gr = ir::guarded_read(t, gt->second.second);
      if (!gr) return fail(gr.message());
      const int p = k.add_param(in->name, in->dtype, {gr->strides.begin(), gr->strides.end()}, false, gr->offset);
      k.params[p].guard_lo = gr->lo;
      k.params[p].guard_hi = gr->hi;
      guarded_params[&t][gt->second.second] = p;
      continue;
    }
    auto vt = viewed_by.find(in);
    if (vt != viewed_by.end()) {
      const Node& t = *vt->second;
      if (!(t.outputs[0]->shape == dom_shape))
        return fail(t.op + " '" + t.name + "' does not span the domain " + dom_shape.to_string());
      // The op's own strides (OpDef::strided_read): Transpose permuted, Expand broadcast,
      // Slice stepped and offset, AsStrided its own, the Reshape family dense.
      const OpDef* vdef = OpTable::get().find(t.op);
      if (!vdef || !vdef->strided_read) return fail(t.op + " '" + t.name + "' has no strided read");
      auto sr = vdef->strided_read(t);
      if (!sr) return fail(sr.message());
      env[t.outputs[0]] = b.load(k.add_param(in->name, in->dtype, sr->strides, false, sr->offset));
      continue;
    }
    if (in->shape.rank() > dom_shape.rank()) return fail("input '" + in->name + "' has a higher rank than the domain");
    KILN_ASSIGN_OR_RETURN(auto st, strides_for(in->shape));
    env[in] = b.load(k.add_param(in->name, in->dtype, std::move(st)));
  }
  for (const Value* c : body.initializers)
    if (c->data->numel() == 1) env[c] = b.constant(c->data->get_f64(0), c->dtype);  // else: reduction axes
  // Guarded views: Pad and SliceGrad load their input inside its box and the fill (the
  // pad value, zeros) outside; a Concat loads input k inside its box and, outside, the
  // inputs before it (every point lies in exactly one box).
  for (auto& [t, params] : guarded_params) {
    if (params.size() != ir::guarded_view_inputs(*t).size())
      return fail(t->op + " '" + t->name + "' reads a value computed in the kernel");
    ScalarBuilder::Ref e = -1;
    for (auto& [kk, p] : params) {
      int fallback = e;
      if (fallback < 0) {
        auto gr = ir::guarded_read(*t, kk);
        if (!gr) return fail(gr.message());
        if (gr->fill_operand) fallback = b.constant(gr->fill, t->outputs[0]->dtype);
      }
      e = k.add_load(p, fallback);
    }
    env[t->outputs[0]] = e;
  }
  if (row_node) {
    const OpDef* def = OpTable::get().find(row_node->op);
    auto dims = def->row_dims(*row_node);
    if (!dims) return fail("node '" + row_node->name + "': " + dims.message());
    k.reduced.assign(k.domain.size(), false);
    for (int d : *dims) {
      if (d < 0 || d >= static_cast<int>(k.domain.size())) return fail("row dim out of range");
      k.reduced[d] = true;
    }
  }
  for (auto& n : body.nodes()) {
    if (reduction && n.get() == &last) break;
    if (ir::is_strided_view_op(n->op) || ir::is_guarded_view_op(n->op)) {
      // A view of a one-element body constant is that constant at every point (the zero
      // gradient Expand(0, shape) of a parameter that does not reach the loss).
      const Value* src = n->num_inputs() > 0 ? n->inputs[0] : nullptr;
      if (!env.count(n->outputs[0]) && src && env.count(src) && src->data && src->data->numel() == 1 &&
          n->outputs[0]->dtype == src->dtype)
        env[n->outputs[0]] = env.at(src);
      if (!env.count(n->outputs[0])) return fail(n->op + " '" + n->name + "' reads a value computed in the kernel");
      k.fused_nodes.push_back(n->name);
      continue;
    }
    const OpDef* def = OpTable::get().find(n->op);
    const bool is_row = n.get() == row_node;
    if (!def || !(is_row ? def->row : def->scalar))
      return fail("op '" + n->op + "' (node '" + n->name + "') has no " + (is_row ? "row" : "scalar") + " rule");
    if (n->num_outputs() != 1 && !is_row) return fail("node '" + n->name + "' has several outputs");
    b.set_node(n.get());
    b.allow_reduce(is_row);
    std::vector<ScalarBuilder::Ref> outs;
    KILN_RETURN_IF_ERROR((is_row ? def->row : def->scalar)(b, outs).with_context("fused node '" + fused.name +
                                                                                 "', node '" + n->name + "'"));
    if (!b.error().empty()) return fail(b.error());
    if (outs.size() != static_cast<size_t>(n->num_outputs()))
      return fail("node '" + n->name + "': the rule gives " + std::to_string(outs.size()) + " results for " +
                  std::to_string(n->num_outputs()) + " outputs");
    for (size_t o = 0; o < outs.size(); ++o) {
      if (k.exprs[outs[o]].dtype != n->outputs[o]->dtype)
        return fail("node '" + n->name + "': rule result " + std::to_string(o) + " does not match the output dtype");
      if (!(n->outputs[o]->shape == dom_shape) && !is_row)
        return fail("node '" + n->name + "' output shape " + n->outputs[o]->shape.to_string() +
                    " differs from the domain " + dom_shape.to_string());
      env[n->outputs[o]] = outs[o];
    }
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
    Shape kept = dom_shape;
    for (int a : spec->axes) {
      k.reduced[a] = true;
      kept.dims[a] = 1;
    }
    const Value* o = body.outputs[0];
    KILN_ASSIGN_OR_RETURN(auto st, strides_for(kept));
    const int p = k.add_param(o->name, o->dtype, std::move(st), /*is_output=*/true);
    k.add_store(p, it->second, *def->reduce_combine == ScalarOp::max ? ReduceKind::max : ReduceKind::sum);
    k.fused_nodes.push_back(last.name);
    return k;
  }
  // Outputs in the domain's shape are point stores; a row op's statistics (1 along the
  // row dims) are row stores with broadcast strides (0 along the row dims).
  for (const Value* o : body.outputs) {
    auto it = env.find(o);
    if (it == env.end()) return fail("output '" + o->name + "' is not computed by the body");
    if (o->shape.rank() > dom_shape.rank())
      return fail("output '" + o->name + "' shape " + o->shape.to_string() + " does not fit the domain");
    KILN_ASSIGN_OR_RETURN(auto st, strides_for(o->shape));
    k.add_store(k.add_param(o->name, o->dtype, std::move(st), /*is_output=*/true), it->second);
  }
  // kiln_inplace = i (passes/fused_inplace.cpp): output 0 is written where input i is read.
  if (const int64_t ip = fused.attrs.get_int("kiln_inplace", -1); ip >= 0) {
    const size_t out0 = body.inputs.size();
    if (ip >= static_cast<int64_t>(body.inputs.size()) || out0 >= k.params.size())
      return fail("kiln_inplace = " + std::to_string(ip) + " names no input");
    k.params[out0].in_place_of = static_cast<int>(ip);
  }
  // kiln_donate (passes/fused_inplace.cpp): output j is written where input d[j] is read.
  if (const std::vector<int64_t> d = fused.attrs.get_ints("kiln_donate"); !d.empty()) {
    const size_t out0 = body.inputs.size();
    for (size_t j = 0; j < d.size(); ++j) {
      if (d[j] < 0) continue;
      if (d[j] >= static_cast<int64_t>(body.inputs.size()) || out0 + j >= k.params.size())
        return fail("kiln_donate: output " + std::to_string(j) + " names no input");
      k.params[out0 + j].in_place_of = static_cast<int>(d[j]);
    }
  }
  KILN_RETURN_IF_ERROR(k.verify().with_context("fused node '" + fused.name + "'"));
  return k;
}

}  // namespace kiln::codegen
