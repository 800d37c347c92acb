// Traits (OpDef::traits) and the small per-op hooks that passes, code generation and
// the runtime read instead of comparing op names (DESIGN.md invariant 1): canonical
// pass-throughs, shape-only evaluation, eager kernel scratch memory and the strided
// reads of view ops. Filled after every op group is registered (register_op_traits).
#include <algorithm>

#include "ir/op_table.h"
#include "ir/ops/nn.h"

namespace kiln::ir {

std::optional<std::vector<SymExpr>> broadcast_strides(const Shape& shape, int domain_rank) {
  const int off = domain_rank - shape.rank();
  if (off < 0) return std::nullopt;
  std::vector<SymExpr> st(static_cast<size_t>(domain_rank), 0);
  SymExpr stride = 1;
  for (int d = shape.rank() - 1; d >= 0; --d) {
    auto e = shape.dims[d].as_expr();
    if (!e) return std::nullopt;
    st[d + off] = shape.dims[d] == Dim(1) ? SymExpr(0) : stride;
    stride = stride * *e;
  }
  return st;
}

namespace {

constexpr OpTraits bits(OpTrait t) { return static_cast<OpTraits>(t); }

/// `v` has `out`'s dtype and the same static shape.
bool same_type(const Value* v, const Value* out) {
  return v && v->dtype == out->dtype && v->shape.is_static() && out->shape.is_static() && v->shape == out->shape;
}

// ---- canonical pass-throughs (canonicalize). The caller checks: one output, input 0 present.

Value* identity_passthrough(const Node& n) { return n.inputs.size() == 1 ? n.inputs[0] : nullptr; }

Value* same_type_passthrough(const Node& n) { return same_type(n.inputs[0], n.outputs[0]) ? n.inputs[0] : nullptr; }

Value* pad_passthrough(const Node& n) {
  if (!same_type(n.inputs[0], n.outputs[0]) || !n.input(1) || !n.input(1)->data) return nullptr;
  for (int64_t p : n.input(1)->data->to_i64_vector())
    if (p != 0) return nullptr;
  return n.inputs[0];
}

Value* where_passthrough(const Node& n) {
  if (n.inputs.size() != 3 || !n.inputs[0]->data) return nullptr;
  const Tensor& c = *n.inputs[0]->data;
  bool all = true, none = true;
  for (int64_t i = 0; i < c.numel(); ++i) (c.get_i64(i) ? none : all) = false;
  if (all && same_type(n.inputs[1], n.outputs[0])) return n.inputs[1];
  if (none && same_type(n.inputs[2], n.outputs[0])) return n.inputs[2];
  return nullptr;
}

// ---- Shape-15 from static dims (constant folding without the data).

std::optional<std::vector<Tensor>> static_dims_of_input(const Node& n, std::vector<int64_t>& dims) {
  const Value* x = n.input(0);
  if (!x || !x->shape.is_static() || n.num_outputs() != 1) return std::nullopt;
  dims = x->shape.to_vector();
  return std::vector<Tensor>{};
}

std::optional<std::vector<Tensor>> shape_from_shapes(const Node& n) {
  std::vector<int64_t> dims;
  auto out = static_dims_of_input(n, dims);
  if (!out) return std::nullopt;
  const int64_t r = static_cast<int64_t>(dims.size());
  const auto [start, end] = shape_op_range(n.attrs, r);
  std::vector<int64_t> v;
  for (int64_t i = start; i < end; ++i) v.push_back(dims[i]);
  out->push_back(Tensor::from_i64(v));
  return out;
}

// ---- eager kernel scratch

/// Gemm: mirrors runtime/kernels/nn.cpp gemm_kernel: use_onednn(f32, bf16) computes into
/// a std::vector (not counted); other dtypes go through `Tensor tmp(DType::f64, {M, N})`.
int64_t gemm_scratch_bytes(const Node& n) {
  if (n.inputs.size() < 2 || !n.inputs[0] || n.outputs.empty() || !n.outputs[0]) return 0;
  const Value& a = *n.inputs[0];
  if (a.dtype == DType::f32 || a.dtype == DType::bf16 || a.shape.rank() != 2) return 0;
  const Dim& k = a.shape.dims[n.attrs.get_int("transA", 0) != 0 ? 0 : 1];
  const int64_t mn = n.outputs[0]->shape.numel();
  if (!k.is_static() || k.value <= 0 || mn <= 0) return 0;
  return mn * static_cast<int64_t>(dtype_size(DType::f64));
}

// ---- strided views (passes/fusion.cpp absorbs them, codegen/lower.cpp reads through them)

Status view_fail(const Node& n, const std::string& m) { return Status::error(n.op + " '" + n.name + "' " + m); }

/// The element count of `s` as an expression (static or symbolic); nullopt when a dim is
/// unknown or the product overflows.
std::optional<SymExpr> element_count(const Shape& s) {
  SymExpr n = 1;
  for (const Dim& d : s.dims) {
    auto e = d.as_expr();
    if (!e) return std::nullopt;
    n = n * *e;
  }
  return n.valid() ? std::optional<SymExpr>(n) : std::nullopt;
}

/// Reshape family: the same elements in order, read with the dense strides of the output dims.
bool reshape_view_fusable(const Node& n) {
  const Value* x = n.input(0);
  const Value* y = n.outputs[0];
  if (x->dtype != y->dtype) return false;
  const auto a = element_count(x->shape), b = element_count(y->shape);  // the same expression
  return a && b && *a == *b;
}
Expected<StridedRead> reshape_strided_read(const Node& n) {
  const Shape& out = n.outputs[0]->shape;
  auto st = broadcast_strides(out, out.rank());
  if (!st) return view_fail(n, "has an unknown output dim");
  return StridedRead{*st, 0};
}

/// Transpose: the input permuted.
bool transpose_view_fusable(const Node& n) {
  const Value* x = n.input(0);
  const Value* y = n.outputs[0];
  return x->shape.rank() == y->shape.rank() && (!x->shape.is_static() || x->shape.numel() > 1);
}
Expected<StridedRead> transpose_strided_read(const Node& n) {
  const Shape& in = n.input(0)->shape;
  const int r = in.rank();
  auto contiguous = broadcast_strides(in, r);
  if (!contiguous) return view_fail(n, "has an unknown input dim");
  std::vector<int64_t> perm = n.attrs.get_ints("perm");
  if (perm.empty())
    for (int i = r - 1; i >= 0; --i) perm.push_back(i);
  if (static_cast<int>(perm.size()) != r) return view_fail(n, "perm does not match its input");
  StridedRead s;
  s.strides.assign(r, 0);
  for (int d = 0; d < r; ++d) s.strides[d] = (*contiguous)[perm[d]];
  return s;
}

/// Expand: the input broadcast (stride 0 along expanded dims).
bool expand_view_fusable(const Node& n) {
  return n.num_inputs() == 2 && n.input(0)->shape.rank() <= n.outputs[0]->shape.rank();
}
Expected<StridedRead> expand_strided_read(const Node& n) {
  auto st = broadcast_strides(n.input(0)->shape, n.outputs[0]->shape.rank());
  if (!st) return view_fail(n, "has an unknown input dim");
  return StridedRead{*st, 0};
}

/// AsStrided: its own non-negative element strides and offset into the dense input.
bool as_strided_view_fusable(const Node& n) {
  for (int64_t st : n.attrs.get_ints("stride"))
    if (st < 0) return false;
  return n.input(0)->dtype == n.outputs[0]->dtype && n.outputs[0]->shape.is_static();
}
Expected<StridedRead> as_strided_strided_read(const Node& n) {
  if (!n.outputs[0]->shape.is_static()) return view_fail(n, "has a symbolic output shape");
  const std::vector<int64_t> dom = n.outputs[0]->shape.to_vector();
  StridedRead s;
  const std::vector<int64_t> stride = n.attrs.get_ints("stride");
  s.strides.assign(stride.begin(), stride.end());
  s.offset = n.attrs.get_int("storage_offset", 0);
  if (s.strides.size() != dom.size()) return view_fail(n, "does not span the domain");
  for (size_t d = 0; d < s.strides.size(); ++d)
    if (dom[d] == 1) s.strides[d] = 0;
  return s;
}

/// Slice's strided read. Static input: slice_view. Symbolic input: each sliced axis must
/// be static (its start, step and length from slice_view of that axis alone) and the
/// offset, sum start * dense stride, a constant (a slice at a non-zero start of an axis
/// whose stride is symbolic is not a view here).
Expected<StridedRead> slice_strided_read_of(const Node& n) {
  auto ints = [&](int i) {
    const Value* v = n.input(i);
    return v && v->data ? v->data->to_i64_vector() : std::vector<int64_t>{};
  };
  if (!n.input(1) || !n.input(1)->data || !n.input(2) || !n.input(2)->data)
    return view_fail(n, "has no constant starts and ends");
  const Shape& in = n.input(0)->shape;
  const Shape& out = n.outputs[0]->shape;
  if (in.is_static() && out.is_static()) {
    const std::vector<int64_t> in_dims = in.to_vector();
    const std::vector<int64_t> dom = out.to_vector();
    auto view = slice_view(in_dims, ints(1), ints(2), ints(3), ints(4));
    if (!view) return Status::error(n.op + " '" + n.name + "': " + view.message());
    if (view->dims != dom) return view_fail(n, "does not span the domain " + out.to_string());
    StridedRead s;
    s.strides.assign(view->strides.begin(), view->strides.end());
    s.offset = view->offset;
    for (size_t d = 0; d < in_dims.size(); ++d)
      if (dom[d] == 1) s.strides[d] = 0;  // one index: its stride never counts
    return s;
  }
  auto dense = broadcast_strides(in, in.rank());
  if (!dense || out.rank() != in.rank()) return view_fail(n, "has an unknown dim");
  const std::vector<int64_t> starts = ints(1), ends = ints(2), steps = ints(4);
  std::vector<int64_t> axes = ints(3);
  if (axes.empty())
    for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
  if (ends.size() != starts.size() || axes.size() != starts.size() || (!steps.empty() && steps.size() != starts.size()))
    return view_fail(n, "has starts, ends, axes and steps of different lengths");
  StridedRead s;
  s.strides = *dense;
  SymExpr offset = 0;
  for (size_t i = 0; i < axes.size(); ++i) {
    const int64_t a = axes[i] < 0 ? axes[i] + in.rank() : axes[i];
    if (a < 0 || a >= in.rank()) return view_fail(n, "has an axis out of range");
    if (!in.dims[a].is_static()) return view_fail(n, "slices symbolic dim " + std::to_string(a));
    auto one = slice_view({in.dims[a].value}, {starts[i]}, {ends[i]}, {0}, {steps.empty() ? 1 : steps[i]});
    if (!one) return Status::error(n.op + " '" + n.name + "': " + one.message());
    if (!(Dim(one->dims[0]) == out.dims[a])) return view_fail(n, "does not span the domain " + out.to_string());
    offset = offset + (*dense)[a] * one->offset;
    s.strides[a] = (*dense)[a] * one->strides[0];
  }
  if (!offset.is_constant()) return view_fail(n, "starts at a symbolic offset " + offset.to_string());
  s.offset = offset.constant_value();
  for (int d = 0; d < out.rank(); ++d)
    if (out.dims[d] == Dim(1)) s.strides[d] = 0;
  return s;
}

/// Slice-13 input form with positive steps, rank kept: stepped and offset strides.
bool slice_view_fusable(const Node& n) {
  const Value* x = n.input(0);
  const Value* y = n.outputs[0];
  if (n.num_inputs() < 3 || !n.inputs[1] || !n.inputs[2] || x->shape.rank() != y->shape.rank()) return false;
  if (n.num_inputs() > 4)
    for (int64_t st : n.inputs[4]->data->to_i64_vector())
      if (st <= 0) return false;
  if (!x->shape.is_static()) return static_cast<bool>(slice_strided_read_of(n));  // symbolic: only what reads as a view
  return true;
}
void set_strided(OpTable& t, const char* name, std::function<bool(const Node&)> fusable,
                 std::function<Expected<StridedRead>(const Node&)> read) {
  OpDef* d = t.find_mutable(name);
  d->view_fusable = std::move(fusable);
  d->strided_read = std::move(read);
}

}  // namespace

void register_op_traits(OpTable& t) {
  using T = OpTrait;
  for (const char* op : {"Reshape", "Flatten", "Squeeze", "Unsqueeze"}) {
    add_traits(t, op, bits(T::view));
    set_strided(t, op, reshape_view_fusable, reshape_strided_read);
  }
  for (const char* op : {"Transpose", "Expand", "Slice", "AsStrided"}) add_traits(t, op, bits(T::strided_view));
  set_strided(t, "Transpose", transpose_view_fusable, transpose_strided_read);
  set_strided(t, "Expand", expand_view_fusable, expand_strided_read);
  set_strided(t, "Slice", slice_view_fusable, slice_strided_read_of);
  set_strided(t, "AsStrided", as_strided_view_fusable, as_strided_strided_read);
  for (const char* op : {"Concat", "Pad", "SliceGrad", "AsStridedScatter"}) add_traits(t, op, bits(T::guarded_view));

  add_traits(t, "FusedKernel", bits(T::fused_kernel));
  add_traits(t, "AccumulationLoop", bits(T::loop));
  add_traits(t, "Dropout", T::random | T::dropout | T::omittable_inputs);
  add_traits(t, "Clip", bits(T::omittable_inputs));
  add_traits(t, "BatchNormalization", bits(T::running_stats));
  add_traits(t, "Identity", bits(T::identity));
  add_traits(t, "Cast", T::cast | T::dtype_from_attr);
  add_traits(t, "ConstantOfShape", bits(T::dtype_from_attr));
  add_traits(t, "MatMul", T::matmul | T::operand_perms);
  add_traits(t, "Gemm", T::matmul | T::operand_trans_flags);
  add_traits(t, "Transpose", bits(T::transpose));
  add_traits(t, "Gather", bits(T::gather));

  t.find_mutable("Identity")->passthrough = identity_passthrough;
  t.find_mutable("Reshape")->passthrough = same_type_passthrough;
  t.find_mutable("Expand")->passthrough = same_type_passthrough;
  t.find_mutable("Pad")->passthrough = pad_passthrough;
  t.find_mutable("Where")->passthrough = where_passthrough;

  t.find_mutable("Shape")->eval_from_shapes = shape_from_shapes;

  t.find_mutable("Gemm")->kernel_scratch_bytes = gemm_scratch_bytes;
}

}  // namespace kiln::ir
