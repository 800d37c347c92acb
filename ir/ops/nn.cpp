// Op table entries: neural-network ops (ONNX opsets 13-18) and their kiln-internal
// backward ops.
//
//   MatMul, Gemm, Conv                       library ops (oneDNN in eager mode), low_precision
//   MaxPool, AveragePool, GlobalAveragePool  opaque, follow_inputs
//   BatchNormalization                       opaque, fp32; training mode = attribute
//                                            training_mode=1 or a training run
//   LayerNormalization, Softmax, LogSoftmax  reduction, fp32
//   ConvGradInput, ConvGradWeight, MaxPoolGrad, AveragePoolGrad, BatchNormalizationGrad,
//   LayerNormalizationGrad, LayerNormalizationInputGrad, SoftmaxGrad, LogSoftmaxGrad
//                                            kiln-internal (onnx = false), not differentiable
//
// Gradient rules are IR builders (DESIGN.md convention 3): MatMul and Gemm compose
// Transpose/MatMul/Gemm (+ unbroadcast of batch dims); the others emit the backward
// ops above, which recompute what they need (batch statistics, softmax) from saved
// forward inputs/outputs.
#include "ir/ops/nn.h"

#include <algorithm>
#include <cmath>

#include "ir/op_table.h"

namespace kiln::ir {

std::vector<int64_t> WindowGeometry::out_static() const {
  std::vector<int64_t> v;
  for (const Dim& d : out) v.push_back(d.value);
  return v;
}

Expected<WindowGeometry> window_geometry(const Attributes& a, const std::vector<Dim>& in,
                                         const std::vector<int64_t>& kernel) {
  const size_t n = in.size();
  WindowGeometry g;
  g.kernel = kernel;
  if (kernel.size() != n)
    return Status::error("kernel_shape has " + std::to_string(kernel.size()) + " dims, input has " + std::to_string(n) +
                         " spatial dims");
  g.strides = a.get_ints("strides", std::vector<int64_t>(n, 1));
  g.dilations = a.get_ints("dilations", std::vector<int64_t>(n, 1));
  std::vector<int64_t> pads = a.get_ints("pads", std::vector<int64_t>(2 * n, 0));
  if (g.strides.size() != n) return Status::error("strides must have " + std::to_string(n) + " values");
  if (g.dilations.size() != n) return Status::error("dilations must have " + std::to_string(n) + " values");
  if (pads.size() != 2 * n) return Status::error("pads must have " + std::to_string(2 * n) + " values");
  std::string auto_pad = a.get_string("auto_pad", "NOTSET");
  bool ceil_mode = a.get_int("ceil_mode", 0) != 0;
  g.pads_begin.assign(n, 0);
  g.pads_end.assign(n, 0);
  g.out.assign(n, Dim());
  for (size_t i = 0; i < n; ++i) {
    int64_t k = kernel[i], s = g.strides[i], d = g.dilations[i];
    if (k <= 0 || s <= 0 || d <= 0) return Status::error("kernel_shape, strides and dilations must be positive");
    if (pads[i] < 0 || pads[i + n] < 0) return Status::error("pads must be non-negative");
    int64_t eff = (k - 1) * d + 1;
    if (auto_pad == "NOTSET") {
      g.pads_begin[i] = pads[i];
      g.pads_end[i] = pads[i + n];
    } else if (auto_pad == "VALID") {
      // pads 0
    } else if (auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER") {
      if (!in[i].is_static()) continue;  // pads resolved at run time
      int64_t out = (in[i].value + s - 1) / s;
      int64_t total = std::max<int64_t>(0, (out - 1) * s + eff - in[i].value);
      int64_t small = total / 2, big = total - small;
      g.pads_begin[i] = auto_pad == "SAME_UPPER" ? small : big;
      g.pads_end[i] = total - g.pads_begin[i];
      g.out[i] = Dim(out);
      continue;
    } else {
      return Status::error("unknown auto_pad '" + auto_pad + "'");
    }
    if (!in[i].is_static()) continue;
    int64_t span = in[i].value + g.pads_begin[i] + g.pads_end[i] - eff;
    if (span < 0)
      return Status::error("window " + std::to_string(eff) + " is larger than the padded input " +
                           std::to_string(in[i].value + g.pads_begin[i] + g.pads_end[i]));
    int64_t out = ceil_mode ? (span + s - 1) / s + 1 : span / s + 1;
    if (ceil_mode && (out - 1) * s >= in[i].value + g.pads_begin[i]) --out;  // PyTorch rule
    g.out[i] = Dim(out);
  }
  return g;
}

namespace {

bool float_dtype(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }

Status need_float(const InferContext& c, int i, const char* what) {
  if (!c.has_input(i)) return c.fail(std::string("missing input ") + what);
  if (!float_dtype(c.in[i].dtype))
    return c.fail(std::string(what) + " must be a float tensor, got " + dtype_name(c.in[i].dtype));
  return Status::ok();
}

Status same_dtype(const InferContext& c, int i, int j) {
  if (c.has_input(i) && c.has_input(j) && c.in[i].dtype != c.in[j].dtype)
    return c.fail(std::string("inputs ") + std::to_string(i) + " and " + std::to_string(j) + " differ in dtype (" +
                  dtype_name(c.in[i].dtype) + " vs " + dtype_name(c.in[j].dtype) + ")");
  return Status::ok();
}

bool dims_conflict(const Dim& a, const Dim& b) { return a.is_static() && b.is_static() && a.value != b.value; }

double bytes_of(const Value* v) {
  if (!v || v->shape.numel() < 0) return 0;
  return static_cast<double>(v->shape.numel()) * static_cast<double>(dtype_size(v->dtype));
}
double io_bytes(const Node& n) {
  double b = 0;
  for (Value* v : n.inputs) b += bytes_of(v);
  for (Value* v : n.outputs) b += bytes_of(v);
  return b;
}

Attributes strip_kiln(const Attributes& a) {
  Attributes r;
  for (auto& [k, v] : a.all())
    if (k.rfind("kiln_", 0) != 0) r.set(k, v);
  return r;
}

std::vector<int64_t> swap_last_two(int rank) {
  std::vector<int64_t> p(rank);
  for (int i = 0; i < rank; ++i) p[i] = i;
  if (rank >= 2) std::swap(p[rank - 1], p[rank - 2]);
  return p;
}

Value* transpose_last_two(GradContext& c, Value* v) {
  Attributes a;
  a.set("perm", swap_last_two(v->shape.rank()));
  return c.emit1("Transpose", {v}, a);
}

/// Spatial dims of a (N, C, ...) shape.
std::vector<Dim> spatial_of(const Shape& s) { return std::vector<Dim>(s.dims.begin() + 2, s.dims.end()); }

/// Kernel extents of a pool node: attribute kernel_shape (required by the spec).
Expected<std::vector<int64_t>> pool_kernel(const InferContext& c) {
  if (!c.attrs().has("kernel_shape")) return c.fail("missing attribute kernel_shape");
  return c.attrs().get_ints("kernel_shape");
}

// ---- MatMul ----

/// Shape of MatMul operand `k` of node `n` as the product reads it: the input's shape,
/// permuted by `kiln_perm_a` / `kiln_perm_b` when the absorb_transpose pass set it
/// (operand k = Transpose(input k, perm)). Errors: a perm that is not a permutation of
/// the input's dims.
Expected<Shape> matmul_operand_shape(const Node& n, int k, const Shape& in) {
  const std::vector<int64_t> perm = n.attrs.get_ints(k == 0 ? "kiln_perm_a" : "kiln_perm_b");
  if (perm.empty()) return in;
  const int r = in.rank();
  std::vector<bool> seen(static_cast<size_t>(std::max(r, 0)), false);
  if (static_cast<int>(perm.size()) != r)
    return Status::error(std::string(k == 0 ? "kiln_perm_a" : "kiln_perm_b") + " has " + std::to_string(perm.size()) +
                         " entries for an operand of rank " + std::to_string(r));
  Shape out;
  for (int64_t p : perm) {
    if (p < 0 || p >= r || seen[static_cast<size_t>(p)])
      return Status::error(std::string(k == 0 ? "kiln_perm_a" : "kiln_perm_b") + " is not a permutation");
    seen[static_cast<size_t>(p)] = true;
    out.dims.push_back(in.dims[static_cast<size_t>(p)]);
  }
  return out;
}

Status infer_matmul(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "A"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "B"));
  KILN_RETURN_IF_ERROR(same_dtype(c, 0, 1));
  auto pa = matmul_operand_shape(c.node, 0, c.in[0].shape);
  if (!pa) return c.fail(pa.message());
  auto pb = matmul_operand_shape(c.node, 1, c.in[1].shape);
  if (!pb) return c.fail(pb.message());
  Shape a = *pa, b = *pb;
  int ra = a.rank(), rb = b.rank();
  if (ra == 0 || rb == 0) return c.fail("MatMul operands must have rank >= 1");
  if (ra == 1 && rb == 1) {
    if (dims_conflict(a.dims[0], b.dims[0]))
      return c.fail("inner dims differ: " + a.to_string() + " x " + b.to_string());
    c.out[0] = {c.in[0].dtype, Shape()};
    return Status::ok();
  }
  Shape a2 = ra == 1 ? Shape({Dim(1), a.dims[0]}) : a;
  Shape b2 = rb == 1 ? Shape({b.dims[0], Dim(1)}) : b;
  if (dims_conflict(a2.dims.back(), b2.dims[b2.rank() - 2]))
    return c.fail("inner dims differ: " + a.to_string() + " x " + b.to_string());
  Shape ba(std::vector<Dim>(a2.dims.begin(), a2.dims.end() - 2));
  Shape bb(std::vector<Dim>(b2.dims.begin(), b2.dims.end() - 2));
  auto batch = broadcast_shapes(ba, bb);
  if (!batch) return c.fail("batch dims: " + batch.message());
  Shape out = *batch;
  if (ra > 1) out.dims.push_back(a2.dims[a2.rank() - 2]);
  if (rb > 1) out.dims.push_back(b2.dims.back());
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

Cost cost_matmul(const Node& n) {
  Cost c;
  c.bytes = io_bytes(n);
  auto a = matmul_operand_shape(n, 0, n.input(0)->shape);
  int64_t k = a && a->rank() ? a->dims.back().value : -1;
  int64_t y = n.output(0)->shape.numel();
  if (k > 0 && y > 0) c.flops = 2.0 * static_cast<double>(y) * static_cast<double>(k);
  return c;
}

Status grad_matmul(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY) return Status::ok();
  if (c.node().attrs.has("kiln_perm_a") || c.node().attrs.has("kiln_perm_b"))
    return Status::error("MatMul '" + c.node().name +
                         "' reads a transposed operand (kiln_perm_a/b, set after autodiff by absorb_transpose): "
                         "no gradient rule");
  Value* A = c.input(0);
  Value* B = c.input(1);
  int ra = A->shape.rank(), rb = B->shape.rank();
  if (ra == 1 && rb == 1) {  // dot product: Y scalar
    if (c.needs_grad(0)) c.set_grad_input(0, c.emit1("Mul", {dY, B}));
    if (c.needs_grad(1)) c.set_grad_input(1, c.emit1("Mul", {dY, A}));
    return Status::ok();
  }
  if (ra >= 3 && rb == 2 && A->shape.dims.back().is_static() && B->shape.is_static() && A->shape.is_known() &&
      dY->shape.is_known()) {
    // A linear layer on batched activations, (..., M, K) x (K, N): both gradients as
    // one 2-D Gemm over the flattened rows, transposes folded into transA/transB. The
    // general rule below would copy B^T and A^T and form (..., K, N) per batch before
    // summing over the batch (the unbroadcast). The leading dims may be symbolic (the
    // rows are then an expression, A's shape a SymInts).
    const int64_t K = A->shape.dims.back().value, N = B->shape.dims.back().value;
    Value* g2 = c.emit1("Reshape", {dY, c.const_i64({-1, N})});  // (rows, N)
    if (c.needs_grad(0)) {
      Attributes a;
      a.set("transB", int64_t(1));
      Value* gA = c.emit1("Gemm", {g2, B}, a);  // (rows, K)
      c.set_grad_input(0, c.emit1("Reshape", {gA, shape_of(c, A)}));
    }
    if (c.needs_grad(1)) {
      Attributes a;
      a.set("transA", int64_t(1));
      Value* A2 = c.emit1("Reshape", {A, c.const_i64({-1, K})});  // (rows, K)
      c.set_grad_input(1, c.emit1("Gemm", {A2, g2}, a));          // (K, N)
    }
    return Status::ok();
  }
  Value* A2 = ra == 1 ? c.emit1("Unsqueeze", {A, c.const_i64({0})}) : A;  // (1, K)
  Value* B2 = rb == 1 ? c.emit1("Unsqueeze", {B, c.const_i64({1})}) : B;  // (K, 1)
  Value* g = dY;                                                          // (..., M, N)
  if (ra == 1) g = c.emit1("Unsqueeze", {g, c.const_i64({-2})});
  if (rb == 1) g = c.emit1("Unsqueeze", {g, c.const_i64({-1})});
  if (c.needs_grad(0)) {
    Value* gA = c.emit1("MatMul", {g, transpose_last_two(c, B2)});  // (..., M, K)
    gA = c.unbroadcast(gA, A2);
    if (ra == 1) gA = c.emit1("Reshape", {gA, c.const_i64({-1})});
    c.set_grad_input(0, gA);
  }
  if (c.needs_grad(1)) {
    Value* gB = c.emit1("MatMul", {transpose_last_two(c, A2), g});  // (..., K, N)
    gB = c.unbroadcast(gB, B2);
    if (rb == 1) gB = c.emit1("Reshape", {gB, c.const_i64({-1})});
    c.set_grad_input(1, gB);
  }
  return Status::ok();
}

// ---- Gemm ----

Status infer_gemm(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "A"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "B"));
  KILN_RETURN_IF_ERROR(same_dtype(c, 0, 1));
  const Shape &a = c.in[0].shape, &b = c.in[1].shape;
  if (a.rank() != 2 || b.rank() != 2)
    return c.fail("Gemm needs 2-D A and B, got " + a.to_string() + " and " + b.to_string());
  bool ta = c.attrs().get_int("transA", 0) != 0, tb = c.attrs().get_int("transB", 0) != 0;
  Dim m = ta ? a.dims[1] : a.dims[0], ka = ta ? a.dims[0] : a.dims[1];
  Dim kb = tb ? b.dims[1] : b.dims[0], n = tb ? b.dims[0] : b.dims[1];
  if (dims_conflict(ka, kb)) return c.fail("inner dims differ: " + a.to_string() + " x " + b.to_string());
  Shape out({m, n});
  if (c.has_input(2)) {
    KILN_RETURN_IF_ERROR(same_dtype(c, 0, 2));
    const Shape& cs = c.in[2].shape;
    if (cs.rank() > 2) return c.fail("C must have rank <= 2, got " + cs.to_string());
    auto bs = broadcast_shapes(out, cs);
    if (!bs || bs->rank() != 2 || dims_conflict(bs->dims[0], m) || dims_conflict(bs->dims[1], n))
      return c.fail("C " + cs.to_string() + " does not broadcast to " + out.to_string());
  }
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

Cost cost_gemm(const Node& n) {
  Cost c;
  c.bytes = io_bytes(n);
  const Shape& a = n.input(0)->shape;
  bool ta = n.attrs.get_int("transA", 0) != 0;
  int64_t k = a.rank() == 2 ? (ta ? a.dims[0].value : a.dims[1].value) : -1;
  int64_t y = n.output(0)->shape.numel();
  if (k > 0 && y > 0) c.flops = 2.0 * static_cast<double>(y) * static_cast<double>(k);
  return c;
}

Status grad_gemm(GradContext& c) {
  Value* dY = c.grad_output(0);  // (M, N)
  if (!dY) return Status::ok();
  const Node& n = c.node();
  int64_t ta = n.attrs.get_int("transA", 0) != 0, tb = n.attrs.get_int("transB", 0) != 0;
  double alpha = n.attrs.get_float("alpha", 1.0), beta = n.attrs.get_float("beta", 1.0);
  auto gemm = [&](Value* x, Value* y, int64_t tx, int64_t ty) {
    Attributes a;
    a.set("transA", tx);
    a.set("transB", ty);
    if (alpha != 1.0) a.set("alpha", alpha);
    return c.emit1("Gemm", {x, y}, a);
  };
  // A' = op(A) (M, K), B' = op(B) (K, N); dA' = alpha dY B'^T, dB' = alpha A'^T dY.
  if (c.needs_grad(0)) c.set_grad_input(0, ta ? gemm(c.input(1), dY, tb, 1) : gemm(dY, c.input(1), 0, !tb));
  if (c.needs_grad(1)) c.set_grad_input(1, tb ? gemm(dY, c.input(0), 1, ta) : gemm(c.input(0), dY, !ta, 0));
  if (c.input(2) && c.needs_grad(2)) {
    Value* g = dY;
    if (beta != 1.0) g = c.emit1("Mul", {g, c.const_f(beta, dY->dtype)});
    c.set_grad_input(2, c.unbroadcast(g, c.input(2)));
  }
  return Status::ok();
}

// ---- Conv and its backward ops ----

std::vector<AttrSpec> conv_attrs() {
  return {{"auto_pad", AttrKind::s},        {"dilations", AttrKind::ints}, {"group", AttrKind::i},
          {"kernel_shape", AttrKind::ints}, {"pads", AttrKind::ints},      {"strides", AttrKind::ints}};
}

/// Checks X (N, C, ...) against W (M, C/group, k...) and returns the output shape (N, M, out...).
Expected<Shape> conv_out_shape(const InferContext& c, const Shape& x, const Shape& w) {
  if (x.rank() < 3) return c.fail("X must be (N, C, spatial...), got " + x.to_string());
  if (w.rank() != x.rank())
    return c.fail("W rank " + std::to_string(w.rank()) + " != X rank " + std::to_string(x.rank()));
  int64_t group = c.attrs().get_int("group", 1);
  if (group <= 0) return c.fail("group must be positive");
  std::vector<int64_t> kernel;
  if (c.attrs().has("kernel_shape")) {
    kernel = c.attrs().get_ints("kernel_shape");
  } else {
    for (int i = 2; i < w.rank(); ++i) {
      if (!w.dims[i].is_static()) return c.fail("kernel extents must be static (set kernel_shape)");
      kernel.push_back(w.dims[i].value);
    }
  }
  for (int i = 2; i < w.rank() && static_cast<size_t>(i - 2) < kernel.size(); ++i)
    if (dims_conflict(w.dims[i], Dim(kernel[i - 2]))) return c.fail("kernel_shape disagrees with W " + w.to_string());
  if (x.dims[1].is_static() && w.dims[1].is_static() && x.dims[1].value != w.dims[1].value * group)
    return c.fail("X channels " + std::to_string(x.dims[1].value) + " != W channels " +
                  std::to_string(w.dims[1].value) + " x group " + std::to_string(group));
  if (w.dims[0].is_static() && w.dims[0].value % group != 0)
    return c.fail("W output channels " + std::to_string(w.dims[0].value) + " not divisible by group");
  auto geo = window_geometry(c.attrs(), spatial_of(x), kernel);
  if (!geo) return c.fail(geo.message());
  Shape out({x.dims[0], w.dims[0]});
  for (auto& d : geo->out) out.dims.push_back(d);
  return out;
}

/// Output dtype of a convolution node: its first input's, or bf16 for one that autocast
/// marked kiln_compute_f32 (rule (d), passes/autocast.cpp: it computes in f32 on f32 or
/// bf16 operands, e.g. an f32 master weight beside a bf16 activation, and stores bf16).
DType conv_storage_dtype(const InferContext& c) {
  return c.attrs().has("kiln_compute_f32") ? DType::bf16 : c.in[0].dtype;
}

Status infer_conv(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "X"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "W"));
  if (!c.attrs().has("kiln_compute_f32")) KILN_RETURN_IF_ERROR(same_dtype(c, 0, 1));
  auto out = conv_out_shape(c, c.in[0].shape, c.in[1].shape);
  if (!out) return out.status();
  if (c.has_input(2)) {
    if (c.in[2].shape.rank() != 1 || dims_conflict(c.in[2].shape.dims[0], c.in[1].shape.dims[0]))
      return c.fail("B must be (M), got " + c.in[2].shape.to_string());
  }
  c.out[0] = {conv_storage_dtype(c), *out};
  return Status::ok();
}

double conv_flops(const Node& n, const Shape& y, const Shape& w) {
  int64_t ny = y.numel(), nw = w.numel();
  if (ny <= 0 || nw <= 0 || !w.dims[0].is_static() || w.dims[0].value == 0) return 0;
  // each output element: (C/group) * prod(kernel) multiply-adds = numel(W) / M
  return 2.0 * static_cast<double>(ny) * static_cast<double>(nw / w.dims[0].value);
}

Cost cost_conv(const Node& n) { return {conv_flops(n, n.output(0)->shape, n.input(1)->shape), io_bytes(n)}; }

/// Shape of a value given either by a shape-donor input `i` or by the ints attribute `attr`.
Expected<Shape> shape_from_input_or_attr(const InferContext& c, int i, const char* attr) {
  if (c.has_input(i)) return c.in[i].shape;
  if (!c.attrs().has(attr)) return c.fail(std::string("needs attribute ") + attr + " or input " + std::to_string(i));
  return Shape::of(c.attrs().get_ints(attr));
}

// ConvGradInput(dY (N, M, o...), W (M, C/g, k...), X? (shape only)) -> dX (N, C, i...)
Status infer_conv_grad_input(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "W"));
  auto xs = shape_from_input_or_attr(c, 2, "input_shape");
  if (!xs) return xs.status();
  auto ys = conv_out_shape(c, *xs, c.in[1].shape);
  if (!ys) return ys.status();
  if (ys->rank() != c.in[0].shape.rank()) return c.fail("dY rank does not match");
  for (int i = 0; i < ys->rank(); ++i)
    if (dims_conflict(ys->dims[i], c.in[0].shape.dims[i]))
      return c.fail("dY " + c.in[0].shape.to_string() + " != conv output " + ys->to_string());
  c.out[0] = {conv_storage_dtype(c), *xs};
  return Status::ok();
}

// ConvGradWeight(dY (N, M, o...), X (N, C, i...), W? (shape only)) -> dW (M, C/g, k...)
Status infer_conv_grad_weight(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "X"));
  const Shape& x = c.in[1].shape;
  const Shape& dy = c.in[0].shape;
  if (x.rank() < 3 || dy.rank() != x.rank()) return c.fail("dY and X must be (N, C, spatial...) of equal rank");
  int64_t group = c.attrs().get_int("group", 1);
  if (group <= 0) return c.fail("group must be positive");
  Shape w;
  if (c.has_input(2)) {
    w = c.in[2].shape;
  } else {
    if (!c.attrs().has("kernel_shape")) return c.fail("needs attribute kernel_shape or input W");
    Dim cg = x.dims[1].is_static() ? Dim(x.dims[1].value / group) : Dim();
    w = Shape({dy.dims[1], cg});
    for (int64_t k : c.attrs().get_ints("kernel_shape")) w.dims.push_back(Dim(k));
  }
  auto ys = conv_out_shape(c, x, w);
  if (!ys) return ys.status();
  for (int i = 0; i < ys->rank(); ++i)
    if (dims_conflict(ys->dims[i], dy.dims[i]))
      return c.fail("dY " + dy.to_string() + " != conv output " + ys->to_string());
  c.out[0] = {conv_storage_dtype(c), w};
  return Status::ok();
}

Status grad_conv(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY) return Status::ok();
  Value* X = c.input(0);
  Value* W = c.input(1);
  Attributes base = strip_kiln(c.node().attrs);
  if (c.needs_grad(0)) {
    Attributes a = base;
    std::vector<Value*> ins = {dY, W};
    if (X->shape.is_static())
      a.set("input_shape", X->shape.to_vector());
    else
      ins.push_back(X);
    c.set_grad_input(0, c.emit1("ConvGradInput", ins, a));
  }
  if (c.needs_grad(1)) {
    Attributes a = base;
    std::vector<Value*> ins = {dY, X};
    if (W->shape.is_static()) {
      std::vector<int64_t> ws = W->shape.to_vector();
      a.set("kernel_shape", std::vector<int64_t>(ws.begin() + 2, ws.end()));
    } else {
      ins.push_back(W);
    }
    c.set_grad_input(1, c.emit1("ConvGradWeight", ins, a));
  }
  if (c.input(2) && c.needs_grad(2)) {
    std::vector<int64_t> axes = {0};
    for (int i = 2; i < dY->shape.rank(); ++i) axes.push_back(i);
    Attributes a;
    a.set("keepdims", int64_t(0));
    c.set_grad_input(2, c.emit1("ReduceSum", {dY, c.const_i64(axes)}, a));
  }
  return Status::ok();
}

// ---- Pools ----

std::vector<AttrSpec> maxpool_attrs() {
  return {{"auto_pad", AttrKind::s},     {"ceil_mode", AttrKind::i},
          {"dilations", AttrKind::ints}, {"kernel_shape", AttrKind::ints, true},
          {"pads", AttrKind::ints},      {"storage_order", AttrKind::i},
          {"strides", AttrKind::ints}};
}
std::vector<AttrSpec> avgpool_attrs() {
  // dilations: ONNX opset 19; accepted here as a superset.
  return {{"auto_pad", AttrKind::s},
          {"ceil_mode", AttrKind::i},
          {"count_include_pad", AttrKind::i},
          {"dilations", AttrKind::ints},
          {"kernel_shape", AttrKind::ints, true},
          {"pads", AttrKind::ints},
          {"strides", AttrKind::ints}};
}

Expected<Shape> pool_out_shape(const InferContext& c, const Shape& x) {
  if (x.rank() < 3) return c.fail("X must be (N, C, spatial...), got " + x.to_string());
  auto k = pool_kernel(c);
  if (!k) return k.status();
  auto geo = window_geometry(c.attrs(), spatial_of(x), *k);
  if (!geo) return c.fail(geo.message());
  Shape out({x.dims[0], x.dims[1]});
  for (auto& d : geo->out) out.dims.push_back(d);
  return out;
}

Status infer_maxpool(InferContext& c) {
  // ONNX MaxPool-12: float types, int8 and uint8.
  if (c.has_input(0) && (c.in[0].dtype == DType::i8 || c.in[0].dtype == DType::u8)) {
  } else {
    KILN_RETURN_IF_ERROR(need_float(c, 0, "X"));
  }
  auto out = pool_out_shape(c, c.in[0].shape);
  if (!out) return out.status();
  c.out[0] = {c.in[0].dtype, *out};
  if (c.out.size() > 1) c.out[1] = {DType::i64, *out};
  return Status::ok();
}

Status infer_avgpool(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "X"));
  auto out = pool_out_shape(c, c.in[0].shape);
  if (!out) return out.status();
  c.out[0] = {c.in[0].dtype, *out};
  return Status::ok();
}

// MaxPoolGrad(dY, X) -> dX
Status infer_maxpool_grad(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "X"));
  auto out = pool_out_shape(c, c.in[1].shape);
  if (!out) return out.status();
  if (out->rank() != c.in[0].shape.rank()) return c.fail("dY rank does not match the pool output");
  c.out[0] = {c.in[0].dtype, c.in[1].shape};
  return Status::ok();
}

// AveragePoolGrad(dY, X? (shape only)) -> dX
Status infer_avgpool_grad(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  auto xs = shape_from_input_or_attr(c, 1, "input_shape");
  if (!xs) return xs.status();
  auto out = pool_out_shape(c, *xs);
  if (!out) return out.status();
  for (int i = 0; i < out->rank() && i < c.in[0].shape.rank(); ++i)
    if (dims_conflict(out->dims[i], c.in[0].shape.dims[i]) || out->rank() != c.in[0].shape.rank())
      return c.fail("dY " + c.in[0].shape.to_string() + " != pool output " + out->to_string());
  c.out[0] = {c.in[0].dtype, *xs};
  return Status::ok();
}

Status infer_global_avgpool(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "X"));
  const Shape& x = c.in[0].shape;
  if (x.rank() < 3) return c.fail("X must be (N, C, spatial...), got " + x.to_string());
  Shape out({x.dims[0], x.dims[1]});
  for (int i = 2; i < x.rank(); ++i) out.dims.push_back(Dim(1));
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

Status grad_maxpool(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY || !c.needs_grad(0)) return Status::ok();
  Attributes a = strip_kiln(c.node().attrs);
  c.set_grad_input(0, c.emit1("MaxPoolGrad", {dY, c.input(0)}, a));
  return Status::ok();
}

Value* avgpool_grad(GradContext& c, Value* dY, Value* X, Attributes a) {
  std::vector<Value*> ins = {dY};
  if (X->shape.is_static())
    a.set("input_shape", X->shape.to_vector());
  else
    ins.push_back(X);
  return c.emit1("AveragePoolGrad", ins, a);
}

Status grad_avgpool(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY || !c.needs_grad(0)) return Status::ok();
  c.set_grad_input(0, avgpool_grad(c, dY, c.input(0), strip_kiln(c.node().attrs)));
  return Status::ok();
}

Status grad_global_avgpool(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY || !c.needs_grad(0)) return Status::ok();
  Value* X = c.input(0);
  std::vector<int64_t> k;
  for (int i = 2; i < X->shape.rank(); ++i) {
    if (!X->shape.dims[i].is_static())
      return Status::error("node '" + c.node().name + "' (GlobalAveragePool): gradient needs static spatial dims");
    k.push_back(X->shape.dims[i].value);
  }
  Attributes a;
  a.set("kernel_shape", k);
  c.set_grad_input(0, avgpool_grad(c, dY, X, a));
  return Status::ok();
}

// ---- BatchNormalization ----

Status infer_bn(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "X"));
  const Shape& x = c.in[0].shape;
  if (x.rank() < 2) return c.fail("X must be (N, C, ...), got " + x.to_string());
  for (int i = 1; i < 5; ++i) {
    KILN_RETURN_IF_ERROR(need_float(c, i, i == 1 ? "scale" : i == 2 ? "B" : i == 3 ? "input_mean" : "input_var"));
    if (c.in[i].shape.rank() != 1 || dims_conflict(c.in[i].shape.dims[0], x.dims[1]))
      return c.fail("input " + std::to_string(i) + " must be (C), got " + c.in[i].shape.to_string());
  }
  c.out[0] = {c.in[0].dtype, x};
  for (size_t i = 1; i < c.out.size(); ++i) c.out[i] = {c.in[3].dtype, Shape({x.dims[1]})};
  return Status::ok();
}

// BatchNormalizationGrad(dY, X, scale, mean, var) -> dX, dscale, dB
Status infer_bn_grad(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "X"));
  KILN_RETURN_IF_ERROR(need_float(c, 2, "scale"));
  const Shape& x = c.in[1].shape;
  if (x.rank() < 2) return c.fail("X must be (N, C, ...), got " + x.to_string());
  if (c.in[0].shape.rank() != x.rank()) return c.fail("dY and X differ in rank");
  c.out[0] = {c.in[0].dtype, x};
  for (size_t i = 1; i < c.out.size(); ++i) c.out[i] = {c.in[2].dtype, c.in[2].shape};
  return Status::ok();
}

Status grad_bn(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY) return Status::ok();
  const Node& n = c.node();
  Attributes a;
  a.set("epsilon", n.attrs.get_float("epsilon", 1e-5));
  if (n.attrs.has("training_mode")) a.set("training_mode", n.attrs.get_int("training_mode", 0));
  auto g = c.emit("BatchNormalizationGrad", {dY, c.input(0), c.input(1), c.input(3), c.input(4)}, 3, a);
  for (int i = 0; i < 3; ++i)
    if (c.needs_grad(i)) c.set_grad_input(i, g[i]);
  return Status::ok();
}

// ---- LayerNormalization ----

Status infer_ln(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "X"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "Scale"));
  const Shape& x = c.in[0].shape;
  auto ax = normalize_axis(c.attrs().get_int("axis", -1), x.rank());
  if (!ax) return c.fail(ax.message());
  int64_t st = c.attrs().get_int("stash_type", 1);
  if (st != 1 && st != 11) return c.fail("stash_type must be 1 (float) or 11 (double)");
  c.out[0] = {c.in[0].dtype, x};
  Shape stat = x;
  for (int i = *ax; i < x.rank(); ++i) stat.dims[i] = Dim(1);
  DType sd = c.in[0].dtype == DType::f64 ? DType::f64 : DType::f32;
  for (size_t i = 1; i < c.out.size(); ++i) c.out[i] = {sd, stat};
  return Status::ok();
}

// LayerNormalizationGrad(dY, X, Scale) -> dX, dScale, dB
Status infer_ln_grad(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "X"));
  KILN_RETURN_IF_ERROR(need_float(c, 2, "Scale"));
  auto ax = normalize_axis(c.attrs().get_int("axis", -1), c.in[1].shape.rank());
  if (!ax) return c.fail(ax.message());
  c.out[0] = {c.in[0].dtype, c.in[1].shape};
  for (size_t i = 1; i < c.out.size(); ++i) c.out[i] = {c.in[2].dtype, c.in[2].shape};
  return Status::ok();
}

// LayerNormalizationInputGrad(dY, X, Scale) -> dX, Mean?, InvStdDev? (f64 statistics of
// X, shape of X with dims [axis, rank) set to 1): the row part of LayerNormalizationGrad,
// which the decompose pass (passes/decompose.cpp) splits off for code generation; dScale
// and dB become column sums over the rows that read Mean and InvStdDev.
Status infer_ln_input_grad(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "X"));
  KILN_RETURN_IF_ERROR(need_float(c, 2, "Scale"));
  const Shape& x = c.in[1].shape;
  auto ax = normalize_axis(c.attrs().get_int("axis", -1), x.rank());
  if (!ax) return c.fail(ax.message());
  c.out[0] = {c.in[0].dtype, x};
  Shape stat = x;
  for (int i = *ax; i < x.rank(); ++i) stat.dims[i] = Dim(1);
  for (size_t i = 1; i < c.out.size(); ++i) c.out[i] = {DType::f64, stat};
  return Status::ok();
}

Status grad_ln(GradContext& c) {
  Value* dY = c.grad_output(0);
  if (!dY) return Status::ok();
  const Node& n = c.node();
  Attributes a;
  a.set("axis", n.attrs.get_int("axis", -1));
  a.set("epsilon", n.attrs.get_float("epsilon", 1e-5));
  auto g = c.emit("LayerNormalizationGrad", {dY, c.input(0), c.input(1)}, 3, a);
  for (int i = 0; i < 3; ++i)
    if (c.input(i) && c.needs_grad(i)) c.set_grad_input(i, g[i]);
  return Status::ok();
}

// ---- Softmax / LogSoftmax ----

Status infer_softmax(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "input"));
  auto ax = normalize_axis(c.attrs().get_int("axis", -1), c.in[0].shape.rank());
  if (!ax) return c.fail(ax.message());
  c.out[0] = c.in[0];
  return Status::ok();
}

// SoftmaxGrad / LogSoftmaxGrad (dY, Y) -> dX
Status infer_softmax_grad(InferContext& c) {
  KILN_RETURN_IF_ERROR(need_float(c, 0, "dY"));
  KILN_RETURN_IF_ERROR(need_float(c, 1, "Y"));
  if (!(c.in[0].shape.rank() == c.in[1].shape.rank())) return c.fail("dY and Y differ in rank");
  auto ax = normalize_axis(c.attrs().get_int("axis", -1), c.in[1].shape.rank());
  if (!ax) return c.fail(ax.message());
  c.out[0] = {c.in[0].dtype, c.in[1].shape};
  return Status::ok();
}

GradFn grad_softmax_like(const char* grad_op) {
  return [grad_op](GradContext& c) -> Status {
    Value* dY = c.grad_output(0);
    if (!dY || !c.needs_grad(0)) return Status::ok();
    Attributes a;
    a.set("axis", c.node().attrs.get_int("axis", -1));
    c.set_grad_input(0, c.emit1(grad_op, {dY, c.output(0)}, a));
    return Status::ok();
  };
}

// ---- Row rules (code generation of the Softmax family and LayerNormalization) ----
// The eager kernels compute in double. The rules do too, except for the Softmax family's
// exponential, which is f32 (f64 for f64 input) so that it vectorizes, and Softmax's
// normalization (an exact f32 x f64 product, mul_exact_f32): the differences to the
// eager kernels stay at the f32 rounding level (ops_compiled_test.cpp).

using Ref = ScalarBuilder::Ref;

DType row_compute_type(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

/// Input i widened to the compute type.
Ref row_in(ScalarBuilder& b, int i, DType ct) {
  Ref x = b.input(i);
  return b.dtype(x) == ct ? x : b.apply(ScalarOp::cast, {x}, ct);
}
/// A compute-type value narrowed to dtype t.
Ref row_out(ScalarBuilder& b, Ref v, DType t) { return b.dtype(v) == t ? v : b.apply(ScalarOp::cast, {v}, t); }

/// Softmax/LogSoftmax (ONNX-13): one axis.
Expected<std::vector<int>> softmax_row_dims(const Node& n) {
  const Value* x = n.input(0);
  if (!x) return Status::error("node '" + n.name + "' has no input");
  auto ax = normalize_axis(n.attrs.get_int("axis", -1), x->shape.rank());
  if (!ax) return ax.status();
  return std::vector<int>{*ax};
}

/// LayerNormalization(-Grad): dims [axis, rank) of X (input 0 of the forward, 1 of the gradient).
Expected<std::vector<int>> ln_row_dims(const Node& n, int x_input) {
  const Value* x = n.input(x_input);
  if (!x) return Status::error("node '" + n.name + "' has no X input");
  auto ax = normalize_axis(n.attrs.get_int("axis", -1), x->shape.rank());
  if (!ax) return ax.status();
  std::vector<int> d;
  for (int i = *ax; i < x->shape.rank(); ++i) d.push_back(i);
  return d;
}

/// e * r rounded once to f32 for an f32 e and a row-invariant f64 r, without converting
/// e: r split into f32 hi + lo (hi + lo = r within 2^-48 relative), then fma(e, hi, e * lo)
/// (the error of e * lo is below 2^-48 of the product). The result equals
/// f32(f64(e) * r) except where that product lies within about 2^-47 of a rounding
/// boundary; an f32 multiply by f32(r) instead would scale a whole row by r's rounding
/// error, which Adam turned into 3e-5 relative weight differences against the eager
/// kernel (CompiledVsEager tiny_gpt fp32 accum2).
Ref mul_exact_f32(ScalarBuilder& b, Ref e, Ref r) {
  const DType f32 = DType::f32, f64 = DType::f64;
  Ref hi = b.apply(ScalarOp::cast, {r}, f32);
  Ref lo = b.apply(ScalarOp::cast, {b.apply(ScalarOp::sub, {r, b.apply(ScalarOp::cast, {hi}, f64)}, f64)}, f32);
  return b.apply(ScalarOp::fma, {e, hi, b.apply(ScalarOp::mul, {e, lo}, f32)}, f32);
}

template <bool Log>
Status softmax_row(ScalarBuilder& b, std::vector<Ref>& outs) {
  const DType t = b.dtype(b.input(0)), ct = row_compute_type(t);
  Ref x = row_in(b, 0, ct);
  Ref m = b.reduce(ScalarOp::max, x);
  Ref z = b.apply(ScalarOp::sub, {x, m}, ct);
  Ref e = b.apply(ScalarOp::exp, {z}, ct);
  // exp in f32 (the vectorized part), the sum in f64 as the eager kernel: a sum rounded
  // to f32 would scale a whole row by its rounding error (in bf16 that moved single
  // Adam steps of a zero-initialized bias by half their size).
  const DType wt = DType::f64;
  auto wide = [&](Ref v) { return ct == wt ? v : b.apply(ScalarOp::cast, {v}, wt); };
  Ref s = b.reduce(ScalarOp::add, wide(e));
  Ref y;
  if (Log) {
    y = b.apply(ScalarOp::sub, {wide(z), b.apply(ScalarOp::log, {s}, wt)}, wt);
  } else {
    // One division per row, then a multiply per element (a division per element cost a
    // fifth of the generated kernel): for f32 the exact f32 x f64 product of
    // mul_exact_f32, so that e stays f32 (the f64 product and its conversions back cost
    // 7 of the kernel's 58 vector uops per 16 elements).
    Ref inv = b.apply(ScalarOp::div, {b.constant(1.0, wt), s}, wt);
    y = ct == wt ? b.apply(ScalarOp::mul, {e, inv}, wt) : mul_exact_f32(b, e, inv);
  }
  outs = {row_out(b, y, t)};
  return Status::ok();
}

/// Row statistics of LayerNormalization(-Grad) in f64 as the eager kernels: two passes
/// (mean, then the mean of squared deviations), InvStdDev = 1/sqrt(var + eps). `x_input`
/// is X's input index (0 forward, 1 gradient).
struct LnStats {
  Ref x, mean, d, inv, count;  ///< X (f64), its row mean, X - mean, 1/std, the row length
};
Expected<LnStats> ln_row_stats(ScalarBuilder& b, int x_input) {
  const Node& n = b.node();
  const DType ct = DType::f64;
  auto dims = ln_row_dims(n, x_input);
  if (!dims) return dims.status();
  double count = 1;
  bool symbolic = false;  // a symbolic row length: counted by the kernel (a sum of ones, exact in f64)
  for (int d : *dims) {
    const Dim& e = n.input(x_input)->shape.dims[d];
    symbolic |= !e.is_static();
    count *= static_cast<double>(e.value);
  }
  LnStats s;
  s.x = row_in(b, x_input, ct);
  s.count = symbolic ? b.reduce(ScalarOp::add, b.constant(1, ct)) : b.constant(count, ct);
  s.mean = b.apply(ScalarOp::div, {b.reduce(ScalarOp::add, s.x), s.count}, ct);
  s.d = b.apply(ScalarOp::sub, {s.x, s.mean}, ct);
  Ref var = b.apply(ScalarOp::div, {b.reduce(ScalarOp::add, b.apply(ScalarOp::mul, {s.d, s.d}, ct)), s.count}, ct);
  Ref eps = b.constant(n.attrs.get_float("epsilon", 1e-5), ct);
  s.inv = b.apply(ScalarOp::div,
                  {b.constant(1, ct), b.apply(ScalarOp::sqrt, {b.apply(ScalarOp::add, {var, eps}, ct)}, ct)}, ct);
  return s;
}

// LayerNormalizationInputGrad (dY, X, Scale) -> dX, Mean?, InvStdDev?, in f64 operation
// for operation as the eager LayerNormalizationGrad kernel: statistics recomputed from X,
// dX = inv * (g - mean(g) - xhat * mean(g * xhat)) with g = dY * Scale, xhat = (X - mean) * inv.
Status ln_input_grad_row(ScalarBuilder& b, std::vector<Ref>& outs) {
  const Node& n = b.node();
  const DType t = b.dtype(b.input(0)), ct = DType::f64;
  KILN_ASSIGN_OR_RETURN(LnStats st, ln_row_stats(b, 1));
  const Ref mean = st.mean, d = st.d, inv = st.inv, cnt = st.count;
  Ref g = b.apply(ScalarOp::mul, {row_in(b, 0, ct), row_in(b, 2, ct)}, ct);
  Ref xh = b.apply(ScalarOp::mul, {d, inv}, ct);
  Ref mg = b.apply(ScalarOp::div, {b.reduce(ScalarOp::add, g), cnt}, ct);
  Ref mgx = b.apply(ScalarOp::div, {b.reduce(ScalarOp::add, b.apply(ScalarOp::mul, {g, xh}, ct)), cnt}, ct);
  Ref inner = b.apply(ScalarOp::sub, {b.apply(ScalarOp::sub, {g, mg}, ct), b.apply(ScalarOp::mul, {xh, mgx}, ct)}, ct);
  outs = {row_out(b, b.apply(ScalarOp::mul, {inv, inner}, ct), t)};
  if (n.num_outputs() > 1) outs.push_back(row_out(b, mean, n.outputs[1]->dtype));
  if (n.num_outputs() > 2) outs.push_back(row_out(b, inv, n.outputs[2]->dtype));
  return Status::ok();
}

// SoftmaxGrad(dY, Y): dX = Y * (dY - sum(dY * Y)); LogSoftmaxGrad: dX = dY - exp(Y) * sum(dY).
// In f64 like the eager kernel: dY - sum cancels (the rows of dX sum to zero), and an f32
// sum rounded before the subtraction loses the small differences that the bias
// gradients of the attention projections are made of.
template <bool Log>
Status softmax_grad_row(ScalarBuilder& b, std::vector<Ref>& outs) {
  const DType t = b.dtype(b.input(0)), ct = DType::f64;
  Ref dy = row_in(b, 0, ct), y = row_in(b, 1, ct);
  Ref dx;
  if (Log) {
    Ref s = b.reduce(ScalarOp::add, dy);
    dx = b.apply(ScalarOp::sub, {dy, b.apply(ScalarOp::mul, {b.apply(ScalarOp::exp, {y}, ct), s}, ct)}, ct);
  } else {
    Ref s = b.reduce(ScalarOp::add, b.apply(ScalarOp::mul, {dy, y}, ct));
    dx = b.apply(ScalarOp::mul, {y, b.apply(ScalarOp::sub, {dy, s}, ct)}, ct);
  }
  outs = {row_out(b, dx, t)};
  return Status::ok();
}

// LayerNormalization(X, Scale, B?) -> Y, Mean?, InvStdDev?: two-pass statistics as the
// eager kernel (mean, then the mean of squared deviations), InvStdDev = 1/sqrt(var + eps).
Status ln_row(ScalarBuilder& b, std::vector<Ref>& outs) {
  const Node& n = b.node();
  const DType t = b.dtype(b.input(0)), ct = DType::f64;  // as the eager kernel (a few ops per element)
  KILN_ASSIGN_OR_RETURN(LnStats st, ln_row_stats(b, 0));
  const Ref mean = st.mean, d = st.d, inv = st.inv;
  Ref y = b.apply(ScalarOp::mul, {b.apply(ScalarOp::mul, {d, inv}, ct), row_in(b, 1, ct)}, ct);
  if (b.has_input(2)) y = b.apply(ScalarOp::add, {y, row_in(b, 2, ct)}, ct);
  outs = {row_out(b, y, t)};
  const DType sd = n.num_outputs() > 1 ? n.outputs[1]->dtype : ct;
  if (n.num_outputs() > 1) outs.push_back(row_out(b, mean, sd));
  if (n.num_outputs() > 2) outs.push_back(row_out(b, inv, n.outputs[2]->dtype));
  return Status::ok();
}

OpDef make(const char* name, const char* doc, int min_in, int max_in, int min_out, int max_out,
           std::vector<AttrSpec> attrs, InferFn infer, PrecisionPolicy prec, FusionClass fusion) {
  OpDef d;
  d.name = name;
  d.doc = doc;
  d.min_inputs = min_in;
  d.max_inputs = max_in;
  d.min_outputs = min_out;
  d.max_outputs = max_out;
  d.attrs = std::move(attrs);
  d.infer = std::move(infer);
  d.precision = prec;
  d.fusion = fusion;
  return d;
}

OpDef with_grad(OpDef d, GradFn g) {
  d.diff = Differentiability::differentiable;
  d.grad = std::move(g);
  return d;
}

OpDef internal(OpDef d) {
  d.onnx = false;
  d.diff = Differentiability::not_differentiable;
  return d;
}

}  // namespace

void register_nn_ops(OpTable& t) {
  using P = PrecisionPolicy;
  using F = FusionClass;
  {
    OpDef d = with_grad(
        make("MatMul", "Numpy-style batched matrix product (ONNX MatMul-13); 1-D operands promoted and squeezed", 2, 2,
             1, 1, {}, infer_matmul, P::low_precision, F::library),
        grad_matmul);
    d.cost = cost_matmul;
    t.add(std::move(d));
  }
  {
    OpDef d = with_grad(
        make("Gemm", "Y = alpha * op(A) op(B) + beta * C (ONNX Gemm-13), C unidirectionally broadcast", 2, 3, 1, 1,
             {{"alpha", AttrKind::f}, {"beta", AttrKind::f}, {"transA", AttrKind::i}, {"transB", AttrKind::i}},
             infer_gemm, P::low_precision, F::library),
        grad_gemm);
    d.cost = cost_gemm;
    t.add(std::move(d));
  }
  {
    OpDef d = with_grad(make("Conv", "N-D grouped, strided, dilated, padded cross-correlation (ONNX Conv-11)", 2, 3, 1,
                             1, conv_attrs(), infer_conv, P::low_precision, F::library),
                        grad_conv);
    d.cost = cost_conv;
    t.add(std::move(d));
  }
  {
    auto attrs = conv_attrs();
    attrs.push_back({"input_shape", AttrKind::ints});
    OpDef d = internal(make("ConvGradInput",
                            "kiln: dX of Conv from (dY, W, X? shape donor) with Conv's attributes (+ input_shape)", 2,
                            3, 1, 1, attrs, infer_conv_grad_input, P::low_precision, F::library));
    d.cost = [](const Node& n) { return Cost{conv_flops(n, n.input(0)->shape, n.input(1)->shape), io_bytes(n)}; };
    t.add(std::move(d));
  }
  {
    OpDef d = internal(
        make("ConvGradWeight",
             "kiln: dW of Conv from (dY, X, W? shape donor) with Conv's attributes (kernel_shape needed without W)", 2,
             3, 1, 1, conv_attrs(), infer_conv_grad_weight, P::low_precision, F::library));
    d.cost = [](const Node& n) { return Cost{conv_flops(n, n.input(0)->shape, n.output(0)->shape), io_bytes(n)}; };
    t.add(std::move(d));
  }
  t.add(with_grad(make("MaxPool",
                       "N-D max pooling (ONNX MaxPool-12; float, int8, uint8) with ceil_mode, dilations and optional "
                       "flat Indices (row- or column-major)",
                       1, 1, 1, 2, maxpool_attrs(), infer_maxpool, P::follow_inputs, F::opaque),
                  grad_maxpool));
  t.add(internal(make("MaxPoolGrad", "kiln: dX of MaxPool from (dY, X): dY routed to the first maximum of each window",
                      2, 2, 1, 1, maxpool_attrs(), infer_maxpool_grad, P::follow_inputs, F::opaque)));
  t.add(with_grad(make("AveragePool", "N-D average pooling (ONNX AveragePool-11) with ceil_mode and count_include_pad",
                       1, 1, 1, 1, avgpool_attrs(), infer_avgpool, P::follow_inputs, F::opaque),
                  grad_avgpool));
  {
    auto attrs = avgpool_attrs();
    attrs.push_back({"input_shape", AttrKind::ints});
    t.add(internal(make("AveragePoolGrad", "kiln: dX of AveragePool from (dY, X? shape donor) (+ input_shape)", 1, 2, 1,
                        1, attrs, infer_avgpool_grad, P::follow_inputs, F::opaque)));
  }
  t.add(with_grad(make("GlobalAveragePool", "Mean over all spatial dims, kept as 1 (ONNX GlobalAveragePool-1)", 1, 1, 1,
                       1, {}, infer_global_avgpool, P::follow_inputs, F::opaque),
                  grad_global_avgpool));
  t.add(with_grad(
      make("BatchNormalization",
           "Batch normalization (ONNX BatchNormalization-15); training mode (training_mode=1 or a training run) "
           "normalizes with batch statistics and outputs running stats updated with momentum, the running "
           "variance using the unbiased batch variance as PyTorch does",
           5, 5, 1, 5, {{"epsilon", AttrKind::f}, {"momentum", AttrKind::f}, {"training_mode", AttrKind::i}}, infer_bn,
           P::fp32, F::opaque),
      grad_bn));
  t.add(internal(make("BatchNormalizationGrad",
                      "kiln: (dX, dscale, dB) of BatchNormalization from (dY, X, scale, mean, var); batch statistics "
                      "recomputed from X in training mode",
                      5, 5, 1, 3, {{"epsilon", AttrKind::f}, {"training_mode", AttrKind::i}}, infer_bn_grad, P::fp32,
                      F::opaque)));
  OpDef& ln = t.add(
      with_grad(make("LayerNormalization",
                     "Layer normalization over dims [axis, rank) (ONNX LayerNormalization-17); Mean/InvStdDev are f32 "
                     "(f64 for f64 X)",
                     2, 3, 1, 3, {{"axis", AttrKind::i}, {"epsilon", AttrKind::f}, {"stash_type", AttrKind::i}},
                     infer_ln, P::fp32, F::reduction),
                grad_ln));
  t.add(
      internal(make("LayerNormalizationGrad",
                    "kiln: (dX, dScale, dB) of LayerNormalization from (dY, X, Scale); statistics recomputed from X", 3,
                    3, 1, 3, {{"axis", AttrKind::i}, {"epsilon", AttrKind::f}}, infer_ln_grad, P::fp32, F::reduction)));
  OpDef& lnig = t.add(internal(
      make("LayerNormalizationInputGrad",
           "kiln: (dX, Mean?, InvStdDev?) of LayerNormalization from (dY, X, Scale): the row part of "
           "LayerNormalizationGrad (statistics recomputed from X, f64)",
           3, 3, 1, 3, {{"axis", AttrKind::i}, {"epsilon", AttrKind::f}}, infer_ln_input_grad, P::fp32, F::reduction)));
  OpDef& sm = t.add(with_grad(make("Softmax", "exp(x) / sum(exp(x)) along one axis (ONNX Softmax-13)", 1, 1, 1, 1,
                                   {{"axis", AttrKind::i}}, infer_softmax, P::fp32, F::reduction),
                              grad_softmax_like("SoftmaxGrad")));
  OpDef& lsm = t.add(with_grad(make("LogSoftmax", "x - log(sum(exp(x))) along one axis (ONNX LogSoftmax-13)", 1, 1, 1,
                                    1, {{"axis", AttrKind::i}}, infer_softmax, P::fp32, F::reduction),
                               grad_softmax_like("LogSoftmaxGrad")));
  OpDef& smg = t.add(internal(make("SoftmaxGrad", "kiln: dX = Y * (dY - sum(dY * Y, axis)) from (dY, Y)", 2, 2, 1, 1,
                                   {{"axis", AttrKind::i}}, infer_softmax_grad, P::fp32, F::reduction)));
  OpDef& lsmg = t.add(internal(make("LogSoftmaxGrad", "kiln: dX = dY - exp(Y) * sum(dY, axis) from (dY, Y)", 2, 2, 1, 1,
                                    {{"axis", AttrKind::i}}, infer_softmax_grad, P::fp32, F::reduction)));
  ln.row = ln_row;
  ln.row_dims = [](const Node& n) { return ln_row_dims(n, 0); };
  lnig.row = ln_input_grad_row;
  lnig.row_dims = [](const Node& n) { return ln_row_dims(n, 1); };
  sm.row = softmax_row<false>;
  lsm.row = softmax_row<true>;
  smg.row = softmax_grad_row<false>;
  lsmg.row = softmax_grad_row<true>;
  for (OpDef* d : {&sm, &lsm, &smg, &lsmg}) d->row_dims = softmax_row_dims;

  // ONNX schema versions implemented (OpDef::onnx_since; tests/ir/op_table_test.cpp
  // compares them with ONNX's own history).
  set_onnx_since(t, "AveragePool", {11, 19, 22});
  set_onnx_since(t, "BatchNormalization", {9, 14, 15});
  set_onnx_since(t, "Conv", {11, 22});
  set_onnx_since(t, "Gemm", {13});
  set_onnx_since(t, "GlobalAveragePool", {1, 22});
  set_onnx_since(t, "LayerNormalization", {17});
  set_onnx_since(t, "LogSoftmax", {13});
  set_onnx_since(t, "MatMul", {13});
  set_onnx_since(t, "MaxPool", {12, 22});
  set_onnx_since(t, "Softmax", {13});
}

}  // namespace kiln::ir
