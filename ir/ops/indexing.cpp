// Op table entries: indexing ops that current PyTorch exports emit (ONNX spec,
// onnx.ai/onnx/operators): GatherElements-13, GatherND-13, ScatterElements-18,
// ScatterND-18 (reduction none/add/mul/max/min) and CumSum-14, with gradient rules
// written as IR (DESIGN.md convention 3), plus the kiln-internal GatherNDGrad (the
// scatter-add adjoint of GatherND, batch_dims included) and the kiln-internal AsStrided
// and AsStridedScatter (PyTorch's as_strided / as_strided_scatter). Indices are i32 or i64;
// negative indices count from the end; an index out of range is a kernel error naming
// the node.
#include "ir/op_table.h"

namespace kiln::ir {

namespace {

const std::string kSpec = "ONNX spec (onnx.ai/onnx/operators): ";

bool is_index_dtype(DType t) { return t == DType::i64 || t == DType::i32; }

Status infer_gather_elements(InferContext& c) {
  const Shape& d = c.in[0].shape;
  const Shape& i = c.in[1].shape;
  if (!is_index_dtype(c.in[1].dtype)) return c.fail("indices must be i32 or i64");
  if (d.rank() != i.rank())
    return c.fail("data and indices ranks differ (" + d.to_string() + " vs " + i.to_string() + ")");
  auto ax = normalize_axis(c.attrs().get_int("axis", 0), d.rank());
  if (!ax) return c.fail(ax.message());
  c.out[0] = {c.in[0].dtype, i};
  return Status::ok();
}

Status infer_scatter_elements(InferContext& c) {
  const Shape& d = c.in[0].shape;
  if (!is_index_dtype(c.in[1].dtype)) return c.fail("indices must be i32 or i64");
  bool same = c.in[2].shape.rank() == c.in[1].shape.rank();
  for (int j = 0; same && j < c.in[1].shape.rank(); ++j) {
    const Dim &a = c.in[1].shape.dims[j], &b = c.in[2].shape.dims[j];
    same = !(a.is_static() && b.is_static() && a.value != b.value);
  }
  if (c.in[1].shape.rank() != d.rank() || !same)
    return c.fail("indices and updates must have data's rank and one shape (data " + d.to_string() + ", indices " +
                  c.in[1].shape.to_string() + ", updates " + c.in[2].shape.to_string() + ")");
  if (c.in[2].dtype != c.in[0].dtype) return c.fail("updates dtype differs from data");
  auto ax = normalize_axis(c.attrs().get_int("axis", 0), d.rank());
  if (!ax) return c.fail(ax.message());
  c.out[0] = c.in[0];
  return Status::ok();
}

/// GatherND's output shape: indices.shape[:-1] + data.shape[batch_dims + k:].
Status infer_gather_nd(InferContext& c) {
  const Shape& d = c.in[0].shape;
  const Shape& i = c.in[1].shape;
  if (!is_index_dtype(c.in[1].dtype)) return c.fail("indices must be i32 or i64");
  const int64_t b = c.attrs().get_int("batch_dims", 0);
  if (i.rank() < 1) return c.fail("indices must have rank >= 1");
  const Dim& kd = i.dims.back();
  if (!kd.is_static()) return c.fail("the last dim of indices must be static");
  const int64_t k = kd.value;
  if (b < 0 || b >= std::min(d.rank(), i.rank()) + 0 || b + k > d.rank())
    return c.fail("batch_dims " + std::to_string(b) + " and index length " + std::to_string(k) +
                  " do not fit data of rank " + std::to_string(d.rank()));
  Shape out;
  for (int j = 0; j + 1 < i.rank(); ++j) out.dims.push_back(i.dims[j]);
  for (int j = static_cast<int>(b + k); j < d.rank(); ++j) out.dims.push_back(d.dims[j]);
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

Status infer_scatter_nd(InferContext& c) {
  const Shape& d = c.in[0].shape;
  const Shape& i = c.in[1].shape;
  if (!is_index_dtype(c.in[1].dtype)) return c.fail("indices must be i32 or i64");
  if (c.in[2].dtype != c.in[0].dtype) return c.fail("updates dtype differs from data");
  if (i.rank() < 1 || !i.dims.back().is_static()) return c.fail("indices need rank >= 1 and a static last dim");
  const int64_t k = i.dims.back().value;
  if (k > d.rank())
    return c.fail("index length " + std::to_string(k) + " exceeds data rank " + std::to_string(d.rank()));
  const int want = i.rank() - 1 + d.rank() - static_cast<int>(k);
  if (c.in[2].shape.rank() != want)
    return c.fail("updates must have rank " + std::to_string(want) + " (indices.shape[:-1] + data.shape[k:]), got " +
                  c.in[2].shape.to_string());
  c.out[0] = c.in[0];
  return Status::ok();
}

Status check_reduction(InferContext& c) {
  const std::string r = c.attrs().get_string("reduction", "none");
  if (r != "none" && r != "add" && r != "mul" && r != "max" && r != "min")
    return c.fail("reduction must be none, add, mul, max or min (got '" + r + "')");
  return Status::ok();
}

/// Gradient of a scatter (ScatterElements / ScatterND, named by `gather` = its gather
/// op): data gets dy with the written positions zeroed (reduction none) or dy (add);
/// updates get gather(dy, indices). Other reductions have no gradient rule.
GradFn scatter_grad(const std::string& scatter, const std::string& gather) {
  return [scatter, gather](GradContext& g) -> Status {
    Value* dy = g.grad_output(0);
    if (!dy) return Status::ok();
    const Node& n = g.node();
    const std::string red = n.attrs.get_string("reduction", "none");
    if (red != "none" && red != "add")
      return Status::error("node '" + n.name + "' (" + n.op + "): gradient of reduction '" + red +
                           "' is not implemented (none and add are)");
    Attributes ga;
    if (n.attrs.has("axis")) ga.set("axis", n.attrs.get_int("axis", 0));
    if (g.needs_grad(0)) {
      if (red == "add") {
        g.set_grad_input(0, dy);
      } else {
        Attributes sa = ga;
        g.set_grad_input(0, g.emit1(scatter, {dy, g.input(1), zeros_like(g, g.input(2))}, sa));
      }
    }
    if (g.needs_grad(2)) g.set_grad_input(2, g.emit1(gather, {dy, g.input(1)}, ga));
    return Status::ok();
  };
}

/// Checks an AsStrided / AsStridedScatter view (attributes size, stride,
/// storage_offset) against input 0 (dense row-major): equal lengths, sizes >= 0, every
/// element it addresses inside the input (when its shape is static). Returns `size`.
Expected<Shape> check_strided(InferContext& c) {
  const auto size = c.attrs().get_ints("size"), stride = c.attrs().get_ints("stride");
  const int64_t off = c.attrs().get_int("storage_offset", 0);
  const int64_t numel = c.in[0].shape.is_static() ? c.in[0].shape.numel() : -1;
  if (size.size() != stride.size()) return c.fail("size and stride lengths differ");
  int64_t lo = off, hi = off, n = 1;
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] < 0) return c.fail("negative size");
    n *= size[d];
    if (size[d] > 1) (stride[d] < 0 ? lo : hi) += (size[d] - 1) * stride[d];
  }
  if (n > 0 && numel >= 0 && (lo < 0 || hi >= numel))
    return c.fail("the view addresses elements [" + std::to_string(lo) + ", " + std::to_string(hi) +
                  "] of a tensor of " + std::to_string(numel));
  return Shape::of(size);
}

}  // namespace

void register_indexing_ops(OpTable& t) {
  using P = PrecisionPolicy;
  using F = FusionClass;
  {
    OpDef d =
        make_op("GatherElements",
                kSpec + "GatherElements-13, out[i..] = data[i.. with index[i..] at axis], out shape = indices shape", 2,
                2, infer_gather_elements, P::follow_inputs, F::opaque);
    d.attrs = {{"axis", AttrKind::i}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      Attributes a;
      a.set("axis", g.node().attrs.get_int("axis", 0));
      a.set("reduction", std::string("add"));
      g.set_grad_input(0, g.emit1("ScatterElements", {zeros_like(g, g.input(0)), g.input(1), dy}, a));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op(
        "ScatterElements",
        kSpec +
            "ScatterElements-18, copy of data with updates written (or combined by reduction "
            "add|mul|max|min) at index positions along axis",
        3, 3,
        [](InferContext& c) -> Status {
          KILN_RETURN_IF_ERROR(check_reduction(c));
          return infer_scatter_elements(c);
        },
        P::follow_inputs, F::opaque);
    d.attrs = {{"axis", AttrKind::i}, {"reduction", AttrKind::s}};
    add_differentiable(t, d, scatter_grad("ScatterElements", "GatherElements"));
  }
  {
    OpDef d = make_op("GatherND",
                      kSpec +
                          "GatherND-13, slices of data at the index tuples in the last dim of indices, after "
                          "batch_dims shared leading dims",
                      2, 2, infer_gather_nd, P::follow_inputs, F::opaque);
    d.attrs = {{"batch_dims", AttrKind::i}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      Attributes a;
      a.set("batch_dims", g.node().attrs.get_int("batch_dims", 0));
      g.set_grad_input(0, g.emit1("GatherNDGrad", {g.input(1), dy, shape_of(g, g.input(0))}, a));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op(
        "GatherNDGrad",
        "kiln-internal: scatter-add of dy into zeros of shape `shape` at GatherND(batch_dims) "
        "positions (inputs indices, dy, shape as 1-D i64; adjoint of ONNX GatherND-13)",
        3, 3,
        [](InferContext& c) -> Status {
          auto s = c.shape_input(2);
          if (!s) return c.fail("shape input must be constant or symbolic");
          c.out[0] = {c.in[1].dtype, *s};
          return Status::ok();
        },
        P::follow_inputs, F::opaque);
    d.attrs = {{"batch_dims", AttrKind::i}};
    d.onnx = false;
    t.add(d);
  }
  {
    OpDef d = make_op(
        "ScatterND",
        kSpec +
            "ScatterND-18, copy of data with the slices of updates written (or combined by "
            "reduction add|mul|max|min) at the index tuples of indices",
        3, 3,
        [](InferContext& c) -> Status {
          KILN_RETURN_IF_ERROR(check_reduction(c));
          return infer_scatter_nd(c);
        },
        P::follow_inputs, F::opaque);
    d.attrs = {{"reduction", AttrKind::s}};
    add_differentiable(t, d, scatter_grad("ScatterND", "GatherND"));
  }
  {
    OpDef d = make_op(
        "CumSum",
        kSpec +
            "CumSum-14, running sum along the axis input (exclusive: without the element itself; "
            "reverse: from the end); floats accumulate in double",
        2, 2,
        [](InferContext& c) -> Status {
          if (!c.has_input(0) || !c.has_input(1)) return c.fail("missing input");
          if (c.in[1].shape.numel() != 1) return c.fail("axis must be a scalar or a 1-element tensor");
          if (!is_index_dtype(c.in[1].dtype)) return c.fail("axis must be i32 or i64");
          if (c.in[0].dtype == DType::boolean) return c.fail("bool is not a CumSum type");
          if (const Tensor* a = c.value(1)) {
            auto ax = normalize_axis(a->get_i64(0), c.in[0].shape.rank());
            if (!ax) return c.fail(ax.message());
          }
          c.out[0] = c.in[0];
          return Status::ok();
        },
        P::fp32, F::opaque);
    d.attrs = {{"exclusive", AttrKind::i}, {"reverse", AttrKind::i}};
    // The adjoint of a running sum is the running sum in the other direction.
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      Attributes a = g.node().attrs;
      a.set("reverse", int64_t(g.node().attrs.get_int("reverse", 0) ? 0 : 1));
      g.set_grad_input(0, g.emit1("CumSum", {dy, g.input(1)}, a));
      return Status::ok();
    });
  }

  // kiln-internal strided forms of indexing with constant indices (passes/decompose.cpp
  // rewrites a gather or scatter whose constant indices address the data affinely into
  // them, so code generation reads through strides instead of running an eager gather).
  const auto strided_op = [&](const char* name, const std::string& doc, int inputs, InferFn infer) {
    OpDef d = make_op(name, doc, inputs, inputs, std::move(infer), P::follow_inputs, F::view);
    d.attrs = {{"size", AttrKind::ints}, {"stride", AttrKind::ints}, {"storage_offset", AttrKind::i}};
    d.onnx = false;
    t.add(d);
  };
  strided_op("AsStrided",
             "kiln-internal, PyTorch's as_strided: out[i] = x[storage_offset + sum_d i_d * stride[d]] of x's dense "
             "row-major elements; out shape = size",
             1, [](InferContext& c) -> Status {
               KILN_ASSIGN_OR_RETURN(Shape size, check_strided(c));
               c.out[0] = {c.in[0].dtype, size};
               return Status::ok();
             });
  strided_op("AsStridedScatter",
             "kiln-internal, PyTorch's as_strided_scatter: out = data with out[storage_offset + sum_d i_d * "
             "stride[d]] = src[i] (src shape = size; each element written at most once)",
             2, [](InferContext& c) -> Status {
               KILN_ASSIGN_OR_RETURN(Shape size, check_strided(c));
               if (c.in[1].dtype != c.in[0].dtype) return c.fail("src dtype differs from data");
               if (c.in[1].shape.is_static() && !(c.in[1].shape == size))
                 return c.fail("src shape " + c.in[1].shape.to_string() + " is not size " + size.to_string());
               c.out[0] = c.in[0];
               return Status::ok();
             });

  // ONNX schema versions implemented (OpDef::onnx_since; tests/ir/op_table_test.cpp
  // compares them with ONNX's own history).
  set_onnx_since(t, "CumSum", {11, 14});
  set_onnx_since(t, "GatherElements", {13});
  set_onnx_since(t, "GatherND", {13});
  set_onnx_since(t, "ScatterElements", {13, 16, 18});
  set_onnx_since(t, "ScatterND", {13, 16, 18});
}

}  // namespace kiln::ir
