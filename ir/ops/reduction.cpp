// Op table entries: reduction ops (ONNX opsets 13-18).
//
//   ReduceSum   axes as an optional input (opset 13), keepdims, noop_with_empty_axes      fp32
//   ReduceMean  axes attribute (<= 17) or input (18)                                       fp32
//   ReduceMax   axes attribute (<= 17) or input (18); ties share the gradient equally      follow_inputs
//   ArgMax      axis, keepdims, select_last_index; i64 output, not differentiable          not_float
//
// Gradient rules compose forward ops: Unsqueeze the output gradient back to rank,
// Expand it to the input shape (ReduceMean also scales by 1/count); ReduceMax routes
// it through Equal(X, max) normalised by the number of ties (PyTorch amax semantics).
#include <algorithm>
#include <set>

#include "ir/op_table.h"
#include "ir/ops/nn.h"

namespace kiln::ir {

int64_t column_sum_partitions(int64_t rows, int64_t cols) {
  if (cols > 2048 || cols < 1) return 0;
  const int64_t k = std::min<int64_t>(kMaxColumnSumPartitions, rows / 256);
  return k >= 2 ? k : 0;
}

Expected<ReduceSpec> reduce_spec(const Attributes& a, bool axes_given, const Tensor* axes_input, int rank) {
  ReduceSpec s;
  s.keepdims = a.get_int("keepdims", 1) != 0;
  std::vector<int64_t> raw;
  if (axes_given) {
    if (!axes_input) return Status::error("axes input must be a constant");
    if (is_float(axes_input->dtype())) return Status::error("axes input must be an integer tensor");
    raw = axes_input->to_i64_vector();
  } else {
    raw = a.get_ints("axes");
  }
  if (raw.empty()) {
    if (a.get_int("noop_with_empty_axes", 0) != 0) {
      s.noop = true;
      return s;
    }
    for (int i = 0; i < rank; ++i) s.axes.push_back(i);
    return s;
  }
  std::set<int> seen;
  for (int64_t x : raw) {
    if (x < -rank || x >= rank)
      return Status::error("axis " + std::to_string(x) + " out of range for rank " + std::to_string(rank));
    int ax = static_cast<int>(x < 0 ? x + rank : x);
    if (!seen.insert(ax).second) return Status::error("axis " + std::to_string(x) + " repeated");
  }
  s.axes.assign(seen.begin(), seen.end());
  return s;
}

namespace {

Expected<ReduceSpec> spec_of(const InferContext& c) {
  auto s = reduce_spec(c.attrs(), c.has_input(1), c.value(1), c.in[0].shape.rank());
  if (!s) return c.fail(s.message());
  return s;
}

Shape reduced_shape(const Shape& x, const ReduceSpec& s) {
  if (s.noop) return x;
  Shape out;
  for (int i = 0; i < x.rank(); ++i) {
    bool r = std::binary_search(s.axes.begin(), s.axes.end(), i);
    if (!r)
      out.dims.push_back(x.dims[i]);
    else if (s.keepdims)
      out.dims.push_back(Dim(1));
  }
  return out;
}

InferFn infer_reduce(bool float_only) {
  return [float_only](InferContext& c) -> Status {
    if (!c.has_input(0)) return c.fail("missing input data");
    DType t = c.in[0].dtype;
    const bool bool_max = t == DType::boolean && c.node.op == "ReduceMax";  // ReduceMax-20: any()
    if (!bool_max && (float_only ? !is_float(t) : !(is_float(t) || is_integer(t))))
      return c.fail(std::string("dtype ") + dtype_name(t) + " is not supported");
    if (c.has_input(1) && c.attrs().has("axes")) return c.fail("axes given both as attribute and input");
    auto s = spec_of(c);
    if (!s) return s.status();
    c.out[0] = {t, reduced_shape(c.in[0].shape, *s)};
    return Status::ok();
  };
}

Status infer_argmax(InferContext& c) {
  if (!c.has_input(0)) return c.fail("missing input data");
  const Shape& x = c.in[0].shape;
  auto ax = normalize_axis(c.attrs().get_int("axis", 0), x.rank());
  if (!ax) return c.fail(ax.message());
  bool keep = c.attrs().get_int("keepdims", 1) != 0;
  Shape out;
  for (int i = 0; i < x.rank(); ++i) {
    if (i != *ax)
      out.dims.push_back(x.dims[i]);
    else if (keep)
      out.dims.push_back(Dim(1));
  }
  c.out[0] = {DType::i64, out};
  return Status::ok();
}

/// Reduce spec of the forward node of a gradient rule (axes input must be an initializer).
Expected<ReduceSpec> grad_spec(GradContext& c) {
  const Node& n = c.node();
  Value* ax = n.input(1);
  auto s = reduce_spec(n.attrs, ax != nullptr, ax && ax->data ? ax->data.get() : nullptr, n.input(0)->shape.rank());
  if (!s) return Status::error("node '" + n.name + "' (" + n.op + "): gradient: " + s.message());
  return s;
}

/// g (reduced shape) -> rank of X with reduced dims of extent 1.
Value* keep_rank(GradContext& c, Value* g, const ReduceSpec& s) {
  if (s.keepdims || s.axes.empty()) return g;
  return c.emit1("Unsqueeze", {g, c.const_i64(std::vector<int64_t>(s.axes.begin(), s.axes.end()))});
}

GradFn grad_sum_or_mean(bool mean) {
  return [mean](GradContext& c) -> Status {
    Value* dY = c.grad_output(0);
    if (!dY || !c.needs_grad(0)) return Status::ok();
    auto s = grad_spec(c);
    if (!s) return s.status();
    if (s->noop) {
      c.set_grad_input(0, dY);
      return Status::ok();
    }
    Value* X = c.input(0);
    Value* g = c.emit1("Expand", {keep_rank(c, dY, *s), shape_of(c, X)});
    if (mean) {
      int64_t count = 1;
      for (int a : s->axes) {
        if (!X->shape.dims[a].is_static())
          return Status::error("node '" + c.node().name + "' (ReduceMean): gradient needs static reduced dims");
        count *= X->shape.dims[a].value;
      }
      g = c.emit1("Mul", {g, c.const_f(count ? 1.0 / static_cast<double>(count) : 0.0, dY->dtype)});
    }
    c.set_grad_input(0, g);
    return Status::ok();
  };
}

Status grad_max(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY || !c.needs_grad(0)) return Status::ok();
  auto s = grad_spec(c);
  if (!s) return s.status();
  if (s->noop) {
    c.set_grad_input(0, dY);
    return Status::ok();
  }
  Value* X = c.input(0);
  Value* yk = keep_rank(c, c.output(0), *s);
  Value* gk = keep_rank(c, dY, *s);
  Attributes cast;
  cast.set("to", static_cast<int64_t>(dtype_to_onnx(X->dtype)));
  Value* mask = c.emit1("Cast", {c.emit1("Equal", {X, yk})}, cast);
  Attributes keep;
  keep.set("keepdims", int64_t(1));
  Value* cnt = c.emit1("ReduceSum", {mask, c.const_i64(std::vector<int64_t>(s->axes.begin(), s->axes.end()))}, keep);
  c.set_grad_input(0, c.emit1("Mul", {c.emit1("Div", {mask, cnt}), gk}));
  return Status::ok();
}

OpDef reduce_def(const char* name, const char* doc, bool float_only, PrecisionPolicy p, GradFn g) {
  OpDef d;
  d.name = name;
  d.doc = doc;
  d.min_inputs = 1;
  d.max_inputs = 2;
  d.attrs = {{"axes", AttrKind::ints}, {"keepdims", AttrKind::i}, {"noop_with_empty_axes", AttrKind::i}};
  d.infer = infer_reduce(float_only);
  d.precision = p;
  d.fusion = FusionClass::reduction;
  d.diff = Differentiability::differentiable;
  d.grad = std::move(g);
  return d;
}

}  // namespace

void register_reduction_ops(OpTable& t) {
  // ReduceSum-13 takes axes only as an input; the attribute is accepted too (ReduceSum-11 models).
  t.add(reduce_def("ReduceSum", "Sum over axes (ONNX ReduceSum-13: axes input, keepdims, noop_with_empty_axes)", false,
                   PrecisionPolicy::fp32, grad_sum_or_mean(false)));
  t.find_mutable("ReduceSum")->reduce_combine = ScalarOp::add;
  t.add(reduce_def("ReduceMean", "Mean over axes (ONNX ReduceMean-13 axes attribute / -18 axes input)", false,
                   PrecisionPolicy::fp32, grad_sum_or_mean(true)));
  t.add(reduce_def("ReduceMax", "Max over axes (ONNX ReduceMax-13 axes attribute / -18 axes input / -20 bool: any)",
                   false, PrecisionPolicy::follow_inputs, grad_max));
  t.find_mutable("ReduceMax")->reduce_combine = ScalarOp::max;  // NaN propagates, as the eager kernel
  OpDef a;
  a.name = "ArgMax";
  a.doc = "Index of the maximum along one axis (ONNX ArgMax-13: axis, keepdims, select_last_index), i64";
  a.min_inputs = a.max_inputs = 1;
  a.attrs = {{"axis", AttrKind::i}, {"keepdims", AttrKind::i}, {"select_last_index", AttrKind::i}};
  a.infer = infer_argmax;
  a.precision = PrecisionPolicy::not_float;
  a.fusion = FusionClass::reduction;
  t.add(std::move(a));

  // ONNX schema versions implemented (OpDef::onnx_since; tests/ir/op_table_test.cpp
  // compares them with ONNX's own history).
  set_onnx_since(t, "ArgMax", {13});
  set_onnx_since(t, "ReduceMax", {13, 18, 20});
  set_onnx_since(t, "ReduceMean", {13, 18});
  set_onnx_since(t, "ReduceSum", {13});
}

}  // namespace kiln::ir
