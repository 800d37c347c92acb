// Symbolic shape values (issue 32, OpDef::sym_values): what the shape subgraphs of an
// exported model compute when the model's input has symbolic dims. PyTorch's exporters
// read a length with Shape + Gather, build a target with Unsqueeze + Concat, and feed it
// to Reshape, Expand, Range or ConstantOfShape; with `seq` unbound these values are not
// constants, but they are expressions of the input's dims (ir/sym_expr.h). The rules here
// compute them, so that inference gives the consumers symbolic dims
// ([batch, seq, 4, 16] instead of [?, ?, ?, ?]) and fold_constants can replace the whole
// subgraph by one SymInts node, which the executor evaluates from the symbol values of
// the run (as torch.fx's SymInt nodes, or Relax's shape expressions).
//
// SymInts {values=[EXPR, ...], dims=[...]} -> i64 tensor: the kiln-internal op holding
// shape expressions; its eager kernel (runtime/kernels/shape.cpp) evaluates them with
// the symbol values the executor bound from the graph inputs' dims.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "ir/op_table.h"
#include "ir/ops/nn.h"

namespace kiln::ir {

namespace {

using Out = std::vector<std::optional<SymValues>>;

/// One output: `v`, or nothing when the output would be longer than kMaxSymValues.
Out one(std::optional<SymValues> v) {
  if (v && static_cast<int64_t>(v->size()) > kMaxSymValues) v.reset();
  return {std::move(v)};
}

/// Output 0 is input 0's contents unchanged (Unsqueeze, Squeeze, Reshape, Flatten,
/// Identity, Cast to an integer dtype).
Out same_contents(const InferContext& c) { return one(c.int_values(0)); }

/// Elementwise integer arithmetic with numpy broadcasting of 1-element operands.
template <typename F>
Out elementwise(const InferContext& c, F f) {
  auto a = c.int_values(0), b = c.int_values(1);
  if (!a || !b) return {std::nullopt};
  if (a->size() != b->size() && a->size() != 1 && b->size() != 1) return {std::nullopt};
  const size_t n = std::max(a->size(), b->size());
  SymValues r;
  for (size_t i = 0; i < n; ++i) {
    std::optional<SymExpr> e = f((*a)[a->size() == 1 ? 0 : i], (*b)[b->size() == 1 ? 0 : i]);
    if (!e) return {std::nullopt};
    r.push_back(*e);
  }
  return one(std::move(r));
}

/// Shape of a tensor (with ONNX start / end): its dims as expressions.
Out shape_rule(const InferContext& c) {
  const Shape& s = c.in[0].shape;
  const auto [b, e] = shape_op_range(c.attrs(), s.rank());
  SymValues v;
  for (int64_t i = b; i < e; ++i) {
    auto x = s.dims[static_cast<size_t>(i)].as_expr();
    if (!x) return {std::nullopt};
    v.push_back(*x);
  }
  return one(std::move(v));
}

/// Gather along axis 0 of a 0-D or 1-D integer tensor at constant indices.
Out gather_rule(const InferContext& c) {
  if (c.in[0].shape.rank() != 1 || c.attrs().get_int("axis", 0) != 0) return {std::nullopt};
  auto data = c.int_values(0);
  const Tensor* idx = c.value(1);
  if (!data || !idx || idx->numel() > kMaxSymValues) return {std::nullopt};
  SymValues v;
  const int64_t n = static_cast<int64_t>(data->size());
  for (int64_t k = 0; k < idx->numel(); ++k) {
    int64_t i = idx->get_i64(k);
    if (i < 0) i += n;
    if (i < 0 || i >= n) return {std::nullopt};
    v.push_back((*data)[static_cast<size_t>(i)]);
  }
  return one(std::move(v));
}

/// Concat of 1-D inputs (axis 0).
Out concat_rule(const InferContext& c) {
  SymValues v;
  for (int i = 0; i < c.num_inputs(); ++i) {
    if (c.in[i].shape.rank() != 1) return {std::nullopt};
    auto x = c.int_values(i);
    if (!x) return {std::nullopt};
    v.insert(v.end(), x->begin(), x->end());
  }
  return one(std::move(v));
}

/// Slice of a 1-D input with constant starts, ends and steps.
Out slice_rule(const InferContext& c) {
  if (c.in[0].shape.rank() != 1 || !c.has_input(1) || !c.has_input(2)) return {std::nullopt};
  auto data = c.int_values(0);
  const Tensor *st = c.value(1), *en = c.value(2);
  const Tensor* sp = c.has_input(4) ? c.value(4) : nullptr;
  if (!data || !st || !en || st->numel() != 1 || en->numel() != 1 || (c.has_input(4) && !sp)) return {std::nullopt};
  if (c.has_input(3) && (!c.value(3) || c.value(3)->get_i64(0) != 0)) return {std::nullopt};
  const SliceDim s =
      normalize_slice(static_cast<int64_t>(data->size()), st->get_i64(0), en->get_i64(0), sp ? sp->get_i64(0) : 1);
  SymValues v;
  for (int64_t k = 0; k < s.len; ++k) v.push_back((*data)[static_cast<size_t>(s.start + k * s.step)]);
  return one(std::move(v));
}

/// ir::bind_symbols' substitution in `g` and its regions (the caller re-infers).
void bind_in(Graph& g, const std::map<std::string, int64_t>& values) {
  auto bind = [&](Value* v) { v->shape = v->shape.bound(values); };
  for (Value* v : g.inputs) bind(v);
  for (Value* v : g.outputs) bind(v);
  for (auto& n : g.nodes()) {
    for (Value* v : n->outputs) bind(v);
    if (n->op == "SymInts") {
      std::vector<std::string> exprs = n->attrs.get_strings("values");
      for (std::string& s : exprs)
        if (auto e = SymExpr::parse(s)) s = e->substitute(values).to_string();
      n->attrs.set("values", exprs);
    }
    for (auto& r : n->regions) bind_in(*r, values);
  }
}

}  // namespace

Status bind_symbols(Graph& g, const std::map<std::string, int64_t>& values) {
  if (values.empty()) return Status::ok();
  bind_in(g, values);
  return infer_graph(g);
}

void register_sym_values(OpTable& t) {
  auto set = [&](const char* op, std::function<Out(const InferContext&)> f) {
    OpDef* d = t.find_mutable(op);
    if (!d) {  // a programming error: the op must be registered
      std::fprintf(stderr, "kiln: internal error: sym_values rule for unregistered op %s\n", op);
      std::abort();
    }
    d->sym_values = std::move(f);
  };
  set("Shape", shape_rule);
  set("Gather", gather_rule);
  set("Concat", concat_rule);
  set("Slice", slice_rule);
  for (const char* op : {"Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Cast"}) set(op, same_contents);
  set("Add", [](const InferContext& c) {
    return elementwise(c, [](const SymExpr& a, const SymExpr& b) -> std::optional<SymExpr> { return a + b; });
  });
  set("Sub", [](const InferContext& c) {
    return elementwise(c, [](const SymExpr& a, const SymExpr& b) -> std::optional<SymExpr> { return a - b; });
  });
  set("Mul", [](const InferContext& c) {
    return elementwise(c, [](const SymExpr& a, const SymExpr& b) -> std::optional<SymExpr> { return a * b; });
  });
  // ONNX integer Div truncates; an exact quotient is the same whatever the rounding.
  set("Div", [](const InferContext& c) {
    return elementwise(c, [](const SymExpr& a, const SymExpr& b) -> std::optional<SymExpr> {
      if (b.is_constant() && b.constant_value() == 0) return std::nullopt;
      return a.exact_div(b);
    });
  });

  OpDef d = make_op(
      "SymInts",
      "kiln: integer tensor of shape `dims` whose elements are the shape expressions `values` (ir/sym_expr.h), "
      "evaluated with the run's symbol values (what fold_constants leaves of a symbolic shape subgraph)",
      0, 0,
      [](InferContext& c) -> Status {
        const std::vector<std::string> values = c.attrs().get_strings("values");
        const std::vector<int64_t> dims = c.attrs().get_ints("dims");
        int64_t n = 1;
        for (int64_t x : dims) {
          if (x < 0 || x > kMaxSymValues) return c.fail("bad dims");
          n *= x;
        }
        if (n != static_cast<int64_t>(values.size()))
          return c.fail(std::to_string(values.size()) + " values for dims " + Shape::of(dims).to_string());
        for (const std::string& v : values)
          if (!SymExpr::parse(v)) return c.fail("'" + v + "' is not a shape expression");
        c.out[0] = {DType::i64, Shape::of(dims)};
        return Status::ok();
      },
      PrecisionPolicy::not_float, FusionClass::opaque);
  d.attrs = {{"values", AttrKind::strings}, {"dims", AttrKind::ints}};
  d.onnx = false;
  d.sym_values = [](const InferContext& c) -> Out {
    SymValues v;
    for (const std::string& s : c.attrs().get_strings("values")) {
      auto e = SymExpr::parse(s);
      if (!e) return {std::nullopt};
      v.push_back(*e);
    }
    return {std::move(v)};
  };
  t.add(d);
}

}  // namespace kiln::ir
