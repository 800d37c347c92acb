// Op table entries: shape ops (ONNX opsets 13-18 semantics; older-opset attribute
// forms such as Squeeze/Unsqueeze/Split `axes`/`split` attributes are accepted too)
// plus the kiln-internal SliceGrad and GatherGrad used by gradient rules.
//
// Inference computes exact static shapes when the shape-carrying inputs are
// constant (initializers, or every input in eager mode); otherwise it derives the
// rank with unknown dims, or fails when even the rank is unknown. Symbolic dims
// are carried through untouched dims and cancelled in Reshape's -1 when possible.
// Spec: https://onnx.ai/onnx/operators/
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "ir/op_table.h"
#include "ir/ops/nn.h"

namespace kiln::ir {

namespace {

constexpr int kVariadic = 1 << 20;
const std::string kSpec = "ONNX spec (onnx.ai/onnx/operators): ";

/// Constant integer contents of input i, if known: an initializer's, or shape contents
/// that inference knows to be constant (a SymInts whose symbols were bound).
std::optional<std::vector<int64_t>> const_ints(const InferContext& c, int i) {
  if (!c.has_input(i)) return std::nullopt;
  if (const Tensor* t = c.value(i)) return t->to_i64_vector();
  auto v = c.int_values(i);
  if (!v) return std::nullopt;
  std::vector<int64_t> r;
  for (const SymExpr& e : *v) {
    if (!e.is_constant()) return std::nullopt;
    r.push_back(e.constant_value());
  }
  return r;
}

/// Length of a 1-D input whose contents are unknown (static first dim), or -1.
int64_t length_of_1d(const InferContext& c, int i) {
  if (!c.has_input(i) || c.in[i].shape.rank() != 1 || !c.in[i].shape.dims[0].is_static()) return -1;
  return c.in[i].shape.dims[0].value;
}

/// Product of dims [b, e) (Dim arithmetic: static, a symbolic expression such as
/// batch*seq, or unknown when a dim is unknown or the product overflows).
Dim dim_product(const Shape& s, int b, int e) {
  Dim p(1);
  for (int i = b; i < e; ++i) p = p * s.dims[static_cast<size_t>(i)];
  return p;
}

Status infer_passthrough_same(InferContext& c) {
  if (!c.has_input(0)) return c.fail("missing input 0");
  c.out[0] = c.in[0];
  return Status::ok();
}

// ------------------------------------------------------------------ Reshape

/// Output 0 of dtype `dt` shaped by 1-D input i (ConstantOfShape, SliceGrad,
/// GatherGrad): the shape it holds when known (InferContext::shape_input), else as many
/// unknown dims as its length. Error: neither is known.
Status shape_from_input(InferContext& c, int i, DType dt) {
  if (auto s = c.shape_input(i)) {
    c.out[0] = {dt, *s};
    return Status::ok();
  }
  int64_t n = length_of_1d(c, i);
  if (n < 0) return c.fail("shape input is not constant and its length is unknown");
  c.out[0] = {dt, Shape(std::vector<Dim>(static_cast<size_t>(n), Dim()))};
  return Status::ok();
}

/// Text of a Reshape target ("[2, -1]", "[batch, seq*4]") for error messages.
std::string values_to_string(const SymValues& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i].to_string();
  return s + "]";
}

/// Reshape to a target whose entries are known as expressions (constants, or symbolic
/// ones from a shape subgraph). Element counts are products of dims (Dim operator*): a
/// -1 becomes the exact quotient of the input's count by the rest of the target's
/// ((batch*seq*64) / (seq*64) = batch; unknown when the quotient is not a polynomial),
/// and a count mismatch is an error where both counts are static. 0 copies the input's
/// dim unless allowzero.
Status reshape_to(InferContext& c, const SymValues& tv, bool allowzero) {
  const Shape& in = c.in[0].shape;
  Shape out;
  int minus = -1;
  for (size_t i = 0; i < tv.size(); ++i) {
    const SymExpr& e = tv[i];
    if (!e.is_constant()) {
      out.dims.push_back(Dim(e));
      continue;
    }
    const int64_t v = e.constant_value();
    if (v == 0 && !allowzero) {
      if (static_cast<int>(i) >= in.rank())
        return c.fail("shape[" + std::to_string(i) + "] = 0 copies a missing input dim");
      out.dims.push_back(in.dims[i]);
    } else if (v == -1) {
      if (minus >= 0) return c.fail("more than one -1 in shape");
      minus = static_cast<int>(i);
      out.dims.push_back(Dim());
    } else if (v < 0) {
      return c.fail("invalid shape value " + std::to_string(v));
    } else {
      out.dims.push_back(Dim(v));
    }
  }
  // A product of static dims that comes out unknown overflowed int64 (fuzz/ onnx:
  // shape values near 2^62).
  bool overflow = false;
  auto count = [&](const std::vector<Dim>& dims, int skip) {
    Dim p(1);
    bool all_static = true;
    for (int i = 0; i < static_cast<int>(dims.size()); ++i)
      if (i != skip) {
        p = p * dims[static_cast<size_t>(i)];
        all_static &= dims[static_cast<size_t>(i)].is_static();
      }
    overflow |= all_static && !p.is_static();
    return p;
  };
  const Dim p_in = count(in.dims, -1), p_out = count(out.dims, minus);
  if (overflow)
    return c.fail("cannot reshape " + in.to_string() + " into " + values_to_string(tv) +
                  ": the element count overflows int64");
  if (minus >= 0) {
    if (p_in.is_static() && p_out.is_static() && (p_out.value == 0 || p_in.value % p_out.value != 0))
      return c.fail("cannot reshape " + in.to_string() + " into " + values_to_string(tv));
    out.dims[static_cast<size_t>(minus)] = dim_exact_div(p_in, p_out);
  } else if (p_in.is_static() && p_out.is_static() && p_in.value != p_out.value) {
    return c.fail("cannot reshape " + in.to_string() + " (" + p_in.to_string() + " elements) into " +
                  values_to_string(tv));
  }
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

Status infer_reshape(InferContext& c) {
  const bool allowzero = c.attrs().get_int("allowzero", 0) != 0;
  std::optional<SymValues> tv = c.int_values(1);
  if (!tv && !c.has_input(1) && c.attrs().has("shape")) {  // Reshape-1 attribute form
    tv.emplace();
    for (int64_t x : c.attrs().get_ints("shape")) tv->push_back(SymExpr::constant(x));
  }
  if (!tv) {
    int64_t n = length_of_1d(c, 1);
    if (n < 0) return c.fail("shape input is not constant and its length is unknown");
    c.out[0] = {c.in[0].dtype, Shape(std::vector<Dim>(static_cast<size_t>(n), Dim()))};
    return Status::ok();
  }
  return reshape_to(c, *tv, allowzero);
}

// ------------------------------------------------------------------ Squeeze / Unsqueeze

/// Axes from input 1 (opset >= 13) or the `axes` attribute (older opsets).
/// Returns false in `known` when input 1 is present but not constant.
std::vector<int64_t> axes_of(const InferContext& c, int input, bool& known, bool& given) {
  known = true;
  given = false;
  if (c.has_input(input)) {
    given = true;
    auto v = const_ints(c, input);
    if (!v) {
      known = false;
      return {};
    }
    return *v;
  }
  if (c.attrs().has("axes")) {
    given = true;
    return c.attrs().get_ints("axes");
  }
  return {};
}

Status infer_squeeze(InferContext& c) {
  const Shape& in = c.in[0].shape;
  bool known, given;
  auto axes = axes_of(c, 1, known, given);
  if (!known) {
    // Rank is derivable from the number of axes; the kept dims are not known.
    int64_t n = length_of_1d(c, 1);
    if (n < 0 || n > in.rank()) return c.fail("axes input is not constant and its length is unknown");
    c.out[0] = {c.in[0].dtype, Shape(std::vector<Dim>(static_cast<size_t>(in.rank() - n), Dim()))};
    return Status::ok();
  }
  std::vector<bool> drop(in.rank(), false);
  if (!given) {
    for (int i = 0; i < in.rank(); ++i) drop[i] = in.dims[i].is_static() && in.dims[i].value == 1;
  } else {
    for (int64_t a : axes) {
      auto ax = normalize_axis(a, in.rank());
      if (!ax) return c.fail(ax.message());
      const Dim& d = in.dims[*ax];
      if (d.is_static() && d.value != 1)
        return c.fail("cannot squeeze axis " + std::to_string(a) + " of size " + std::to_string(d.value));
      drop[*ax] = true;
    }
  }
  Shape out;
  for (int i = 0; i < in.rank(); ++i)
    if (!drop[i]) out.dims.push_back(in.dims[i]);
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

Status infer_unsqueeze(InferContext& c) {
  const Shape& in = c.in[0].shape;
  bool known, given;
  auto axes = axes_of(c, 1, known, given);
  if (!known) {
    int64_t n = length_of_1d(c, 1);
    if (n < 0) return c.fail("axes input is not constant and its length is unknown");
    c.out[0] = {c.in[0].dtype, Shape(std::vector<Dim>(static_cast<size_t>(in.rank() + n), Dim()))};
    return Status::ok();
  }
  if (!given) return c.fail("missing axes");
  int r = in.rank() + static_cast<int>(axes.size());
  std::vector<bool> ins(r, false);
  for (int64_t a : axes) {
    auto ax = normalize_axis(a, r);
    if (!ax) return c.fail(ax.message());
    if (ins[*ax]) return c.fail("duplicate axis " + std::to_string(a));
    ins[*ax] = true;
  }
  Shape out;
  int k = 0;
  for (int i = 0; i < r; ++i) out.dims.push_back(ins[i] ? Dim(1) : in.dims[k++]);
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

// ------------------------------------------------------------------ Slice

}  // namespace

std::pair<int64_t, int64_t> shape_op_range(const Attributes& attrs, int64_t rank) {
  int64_t s = attrs.get_int("start", 0), e = attrs.get_int("end", rank);
  if (s < 0) s += rank;
  if (e < 0) e += rank;
  return {std::clamp<int64_t>(s, 0, rank), std::clamp<int64_t>(e, 0, rank)};
}

SliceDim normalize_slice(int64_t dim, int64_t start, int64_t end, int64_t step) {
  SliceDim s;
  s.step = step;
  if (start < 0) start += dim;
  if (end < 0) end += dim;
  if (dim == 0) {
    s.len = 0;
  } else if (step > 0) {
    start = std::clamp<int64_t>(start, 0, dim);
    end = std::clamp<int64_t>(end, 0, dim);
    s.len = end > start ? (end - start + step - 1) / step : 0;
  } else {
    start = std::clamp<int64_t>(start, 0, dim - 1);
    end = std::clamp<int64_t>(end, -1, dim - 1);
    s.len = start > end ? (start - end + (-step) - 1) / (-step) : 0;
  }
  s.start = start;
  return s;
}

Expected<SliceView> slice_view(const std::vector<int64_t>& dims, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& ends, std::vector<int64_t> axes,
                               std::vector<int64_t> steps) {
  const int r = static_cast<int>(dims.size());
  const size_t n = starts.size();
  if (axes.empty())
    for (size_t i = 0; i < n; ++i) axes.push_back(static_cast<int64_t>(i));
  if (steps.empty()) steps.assign(n, 1);
  if (ends.size() != n || axes.size() != n || steps.size() != n)
    return Status::error("starts, ends, axes and steps lengths differ");
  const std::vector<int64_t> own = strides_of(dims);
  SliceView v;
  v.strides = own;
  v.dims = dims;
  for (size_t i = 0; i < n; ++i) {
    const int64_t a = axes[i] < 0 ? axes[i] + r : axes[i];
    if (a < 0 || a >= r) return Status::error("axis " + std::to_string(axes[i]) + " out of range");
    if (steps[i] == 0) return Status::error("step must not be 0");
    const SliceDim s = normalize_slice(dims[a], starts[i], ends[i], steps[i]);
    v.dims[a] = s.len;
    v.strides[a] = own[a] * s.step;
    if (s.len > 0) v.offset += s.start * own[a];
  }
  return v;
}

std::vector<int> guarded_view_inputs(const Node& n) {
  if (n.op == "Concat") {
    std::vector<int> all;
    for (int k = 0; k < n.num_inputs(); ++k) all.push_back(k);
    return all;
  }
  if (n.op == "Pad" || n.op == "SliceGrad") return {0};
  if (n.op == "AsStridedScatter") return {0, 1};
  return {};
}

namespace {

/// AsStridedScatter's reads: data (input 0) everywhere (a box of the whole output, the
/// fallback of src's load), src (input 1) inside the box its elements are written to,
/// which exists when every size > 1 dim of src steps along its own axis of the data with
/// that axis's dense stride (a box, possibly transposed against src's order).
Expected<GuardedRead> as_strided_scatter_read(const Node& n, int k, const std::vector<int64_t>& out) {
  auto fail = [&](const std::string& m) { return Status::error("node '" + n.name + "' (" + n.op + "): " + m); };
  const int r = static_cast<int>(out.size());
  const std::vector<int64_t> dense = strides_of(out);
  GuardedRead g;
  if (k == 0) {
    g.lo.assign(r, 0);
    g.hi = out;
    g.strides = dense;
    for (int64_t d : out)
      if (d <= 0) return fail("empty data");
    return g;
  }
  const auto size = n.attrs.get_ints("size"), stride = n.attrs.get_ints("stride");
  const int64_t off = n.attrs.get_int("storage_offset", 0);
  const int64_t numel = numel_of(out);
  if (size.size() != stride.size() || off < 0 || off >= numel) return fail("size, stride or offset out of range");
  const std::vector<int64_t> src_dense = strides_of(size);
  std::vector<int64_t> start(r), ext(r, 1);
  g.strides.assign(r, 0);
  for (int a = 0; a < r; ++a) start[a] = (off / dense[a]) % out[a];
  std::vector<bool> taken(r, false);
  for (size_t q = 0; q < size.size(); ++q) {
    if (size[q] <= 0) return fail("empty src");
    if (size[q] == 1) continue;
    int axis = -1;
    for (int a = 0; a < r; ++a)
      if (out[a] > 1 && dense[a] == stride[q]) axis = a;
    if (axis < 0 || taken[axis])
      return fail("src dim " + std::to_string(q) + " does not step along an axis of its own");
    taken[axis] = true;
    ext[axis] = size[q];
    g.strides[axis] = src_dense[q];
  }
  g.lo.resize(r);
  g.hi.resize(r);
  for (int a = 0; a < r; ++a) {
    if (start[a] + ext[a] > out[a]) return fail("the written elements wrap around axis " + std::to_string(a));
    g.lo[a] = start[a];
    g.hi[a] = start[a] + ext[a];
    g.offset -= start[a] * g.strides[a];
  }
  return g;
}

}  // namespace

Expected<GuardedRead> guarded_read(const Node& n, int k) {
  auto fail = [&](const std::string& m) { return Status::error("node '" + n.name + "' (" + n.op + "): " + m); };
  if (!is_guarded_view_op(n.op) || n.num_outputs() != 1) return fail("not a guarded view");
  const Value* x = n.input(k);
  const Value* y = n.outputs[0];
  if (!x || !x->shape.is_static() || !y->shape.is_static()) return fail("shapes are not static");
  const std::vector<int64_t> in = x->shape.to_vector(), out = y->shape.to_vector();
  if (n.op == "AsStridedScatter") return as_strided_scatter_read(n, k, out);
  if (in.size() != out.size()) return fail("input and output ranks differ");
  const int r = static_cast<int>(out.size());
  auto ints = [&](int i) -> std::optional<std::vector<int64_t>> {
    const Value* v = n.input(i);
    if (!v) return std::vector<int64_t>{};
    if (!v->data) return std::nullopt;
    return v->data->to_i64_vector();
  };
  GuardedRead g;
  g.strides = strides_of(in);
  std::vector<int64_t> begin(static_cast<size_t>(r), 0);  // input index 0 sits at output index begin[d]
  if (n.op == "Concat") {
    auto ax = normalize_axis(n.attrs.get_int("axis", 0), r);
    if (!ax) return fail(ax.message());
    for (int j = 0; j < k; ++j) {
      const Value* v = n.input(j);
      if (!v || !v->shape.is_static()) return fail("shapes are not static");
      begin[*ax] += v->shape.dims[*ax].value;
    }
  } else if (n.op == "Pad") {
    if (n.attrs.get_string("mode", "constant") != "constant") return fail("only constant mode reads through a guard");
    auto pads = n.input(1) ? ints(1) : std::optional<std::vector<int64_t>>(n.attrs.get_ints("pads"));
    auto axes = ints(3);
    if (!pads || !axes) return fail("pads and axes must be constant");
    std::vector<int64_t> ax = *axes;
    if (ax.empty())
      for (int d = 0; d < r; ++d) ax.push_back(d);
    if (pads->size() != 2 * ax.size()) return fail("pads length mismatch");
    for (size_t i = 0; i < ax.size(); ++i) {
      auto a = normalize_axis(ax[i], r);
      if (!a) return fail(a.message());
      begin[*a] = (*pads)[i];
    }
    g.fill_operand = true;
    if (n.input(2)) {
      if (!n.input(2)->data || n.input(2)->data->numel() != 1) return fail("constant_value must be a constant scalar");
      g.fill = n.input(2)->data->get_f64(0);
    } else {
      g.fill = n.attrs.get_float("value", 0.0);
    }
  } else {  // SliceGrad(dy, shape, starts, ends, axes?, steps?): dy at the slice's positions
    auto starts = ints(2), ends = ints(3), axes = ints(4), steps = ints(5);
    if (!starts || !ends || !axes || !steps || !n.input(1) || !n.input(1)->data)
      return fail("shape, starts, ends, axes and steps must be constant");
    std::vector<int64_t> ax = *axes;
    if (ax.empty())
      for (size_t i = 0; i < starts->size(); ++i) ax.push_back(static_cast<int64_t>(i));
    if (ends->size() != starts->size() || ax.size() != starts->size() ||
        (!steps->empty() && steps->size() != starts->size()))
      return fail("starts, ends, axes and steps lengths differ");
    for (size_t i = 0; i < ax.size(); ++i) {
      if (!steps->empty() && (*steps)[i] != 1) return fail("a step other than 1 does not read through a guard");
      auto a = normalize_axis(ax[i], r);
      if (!a) return fail(a.message());
      const SliceDim s = normalize_slice(out[*a], (*starts)[i], (*ends)[i], 1);
      if (s.len != in[*a]) return fail("dy does not match the slice");
      begin[*a] = s.start;
    }
  }
  g.lo.resize(r);
  g.hi.resize(r);
  for (int d = 0; d < r; ++d) {
    g.lo[d] = std::max<int64_t>(0, begin[d]);
    g.hi[d] = std::min<int64_t>(out[d], begin[d] + in[d]);
    if (g.lo[d] >= g.hi[d]) return fail("the input is outside the output on dim " + std::to_string(d));
    g.offset -= begin[d] * g.strides[d];
  }
  return g;
}

namespace {

/// Length of a step-1 slice [s, e) of a symbolic dim d with constant bounds, assuming
/// the bounds lie within d (no clamping, as infer_slice assumes for symbolic ends): x[:, 2:]
/// is d-2, x[:, -1:] is 1, x[:, :3] is 3, x[:, :-1] is d-1. Unknown for other steps, for
/// an unknown d, or when the length would be negative.
Dim slice_of_symbolic(const Dim& d, int64_t s, int64_t e, int64_t step) {
  if (step != 1 || !d.is_symbolic()) return Dim();
  const bool to_end = e >= std::numeric_limits<int32_t>::max();
  if (s >= 0 && to_end) return s == 0 ? d : d - Dim(s);
  if (s < 0 && to_end) return Dim(-s);
  if (s >= 0 && e >= 0) return e >= s ? Dim(e - s) : Dim();
  if (s >= 0 && e < 0) return d - Dim(s - e);
  if (s < 0 && e < 0) return e >= s ? Dim(e - s) : Dim();
  return Dim();  // s < 0 <= e: depends on d
}

Status infer_slice(InferContext& c) {
  const Shape& in = c.in[0].shape;
  const int r = in.rank();
  // starts and ends as expressions: constants, or symbolic (x[:, 0:seq] of a position
  // table, issue 32); axes and steps constant.
  std::optional<SymValues> starts, ends;
  std::optional<std::vector<int64_t>> axes, steps;
  auto constants = [](const std::vector<int64_t>& v) {
    SymValues e;
    for (int64_t x : v) e.push_back(SymExpr::constant(x));
    return e;
  };
  bool attr_form = !c.has_input(1) && c.attrs().has("starts");
  if (attr_form) {  // Slice-1
    starts = constants(c.attrs().get_ints("starts"));
    ends = constants(c.attrs().get_ints("ends"));
    if (c.attrs().has("axes")) axes = c.attrs().get_ints("axes");
  } else {
    for (int k : {1, 2}) {  // long constant lists are past int_values' limit
      std::optional<SymValues>& v = k == 1 ? starts : ends;
      v = c.int_values(k);
      if (!v)
        if (auto x = const_ints(c, k)) v = constants(*x);
    }
    if (c.has_input(3)) axes = const_ints(c, 3);
    if (c.has_input(4)) steps = const_ints(c, 4);
  }
  bool axes_known = attr_form || !c.has_input(3) || axes.has_value();
  bool steps_known = attr_form || !c.has_input(4) || steps.has_value();
  Shape out = in;
  if (!starts || !ends || !axes_known || !steps_known) {
    // Rank is kept; sliced dims become unknown.
    if (axes_known && axes) {
      for (int64_t a : *axes) {
        auto ax = normalize_axis(a, r);
        if (!ax) return c.fail(ax.message());
        out.dims[*ax] = Dim();
      }
    } else {
      for (auto& d : out.dims) d = Dim();
    }
    c.out[0] = {c.in[0].dtype, out};
    return Status::ok();
  }
  size_t n = starts->size();
  if (ends->size() != n) return c.fail("starts and ends have different lengths");
  if (!axes) {
    axes = std::vector<int64_t>(n);
    for (size_t i = 0; i < n; ++i) (*axes)[i] = static_cast<int64_t>(i);
  }
  if (!steps) steps = std::vector<int64_t>(n, 1);
  if (axes->size() != n || steps->size() != n) return c.fail("starts, ends, axes and steps lengths differ");
  std::vector<bool> seen(r, false);
  for (size_t i = 0; i < n; ++i) {
    auto ax = normalize_axis((*axes)[i], r);
    if (!ax) return c.fail(ax.message());
    if (seen[*ax]) return c.fail("axis " + std::to_string((*axes)[i]) + " repeated");
    seen[*ax] = true;
    int64_t st = (*steps)[i];
    if (st == 0) return c.fail("step must not be 0");
    const Dim& d = in.dims[*ax];
    const SymExpr &b = (*starts)[i], &e = (*ends)[i];
    if (!b.is_constant() || !e.is_constant()) {
      // A symbolic end e with step 1 and a constant start b >= 0 gives e - b. ONNX clamps
      // e to the dim; the expression assumes e fits (the table is at least as long as any
      // sequence the program runs, which --max_length bounds), as torch.export's range
      // guards do. Anything else is unknown.
      const bool plain = st == 1 && b.is_constant() && b.constant_value() >= 0 && !e.is_constant();
      out.dims[*ax] = plain ? Dim(e - b) : Dim();
    } else if (!d.is_static()) {
      out.dims[*ax] = slice_of_symbolic(d, b.constant_value(), e.constant_value(), st);
    } else {
      out.dims[*ax] = Dim(normalize_slice(d.value, b.constant_value(), e.constant_value(), st).len);
    }
  }
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

// ------------------------------------------------------------------ Split

Status infer_split(InferContext& c) {
  const Shape& in = c.in[0].shape;
  auto ax = normalize_axis(c.attrs().get_int("axis", 0), in.rank());
  if (!ax) return c.fail(ax.message());
  const int n = static_cast<int>(c.out.size());
  const Dim& d = in.dims[*ax];
  std::optional<std::vector<int64_t>> split;
  if (c.has_input(1))
    split = const_ints(c, 1);
  else if (c.attrs().has("split"))
    split = c.attrs().get_ints("split");
  if (c.attrs().has("num_outputs") && c.attrs().get_int("num_outputs", 0) != n)
    return c.fail("num_outputs = " + std::to_string(c.attrs().get_int("num_outputs", 0)) + " but the node has " +
                  std::to_string(n) + " outputs");
  std::vector<Dim> sizes(n, Dim());
  if (split) {
    if (static_cast<int>(split->size()) != n)
      return c.fail("split has " + std::to_string(split->size()) + " entries for " + std::to_string(n) + " outputs");
    int64_t sum = 0;
    for (int i = 0; i < n; ++i) {
      if ((*split)[i] < 0) return c.fail("negative split size");
      sizes[i] = Dim((*split)[i]);
      if (__builtin_add_overflow(sum, (*split)[i], &sum)) return c.fail("split sizes sum past int64");
    }
    if (d.is_static() && sum != d.value)
      return c.fail("split sizes sum to " + std::to_string(sum) + ", dim is " + std::to_string(d.value));
  } else if (!c.has_input(1) && d.is_static()) {
    // Equal split; with num_outputs (Split-18) the last chunk may be smaller.
    int64_t chunk = (d.value + n - 1) / n;
    int64_t last = d.value - chunk * (n - 1);
    if (last < 0 || (!c.attrs().has("num_outputs") && d.value % n != 0))
      return c.fail("dim " + std::to_string(d.value) + " cannot be split into " + std::to_string(n) + " outputs");
    for (int i = 0; i < n; ++i) sizes[i] = Dim(i == n - 1 ? last : chunk);
  }
  for (int i = 0; i < n; ++i) {
    Shape s = in;
    s.dims[*ax] = sizes[i];
    c.out[i] = {c.in[0].dtype, s};
  }
  return Status::ok();
}

// ------------------------------------------------------------------ Pad

Status infer_pad(InferContext& c) {
  const Shape& in = c.in[0].shape;
  const int r = in.rank();
  std::string mode = c.attrs().get_string("mode", "constant");
  if (mode != "constant" && mode != "reflect" && mode != "edge" && mode != "wrap")
    return c.fail("unknown mode '" + mode + "'");
  std::optional<std::vector<int64_t>> pads;
  if (c.has_input(1))
    pads = const_ints(c, 1);
  else if (c.attrs().has("pads"))
    pads = c.attrs().get_ints("pads");  // Pad-2
  else
    return c.fail("missing pads");
  std::optional<std::vector<int64_t>> axes;
  bool axes_known = true;
  if (c.has_input(3)) {
    axes = const_ints(c, 3);
    axes_known = axes.has_value();
  }
  Shape out = in;
  if (!pads || !axes_known) {
    if (axes) {
      for (int64_t a : *axes) {
        auto ax = normalize_axis(a, r);
        if (!ax) return c.fail(ax.message());
        out.dims[*ax] = Dim();
      }
    } else {
      for (auto& d : out.dims) d = Dim();
    }
    c.out[0] = {c.in[0].dtype, out};
    return Status::ok();
  }
  std::vector<int64_t> ax;
  if (axes)
    ax = *axes;
  else
    for (int i = 0; i < r; ++i) ax.push_back(i);
  size_t na = ax.size();
  if (pads->size() != 2 * na)
    return c.fail("pads has " + std::to_string(pads->size()) + " values, expected " + std::to_string(2 * na));
  for (size_t i = 0; i < na; ++i) {
    auto a = normalize_axis(ax[i], r);
    if (!a) return c.fail(a.message());
    const Dim& d = in.dims[*a];
    int64_t b = (*pads)[i], e = (*pads)[i + na];
    if (!d.is_static()) {
      if (b != 0 || e != 0) out.dims[*a] = Dim();
      continue;
    }
    int64_t v = 0;
    if (__builtin_add_overflow(d.value, b, &v) || __builtin_add_overflow(v, e, &v))
      return c.fail("pads " + std::to_string(b) + ", " + std::to_string(e) + " overflow the dim");
    if (v < 0) return c.fail("negative output dim after padding");
    if ((mode == "reflect") && (b > 0 || e > 0) && (b >= d.value || e >= d.value) && d.value > 0)
      return c.fail("reflect pads must be smaller than the dim");
    out.dims[*a] = Dim(v);
  }
  c.out[0] = {c.in[0].dtype, out};
  return Status::ok();
}

// ------------------------------------------------------------------ gradient helpers

GradFn reshape_back() {
  return [](GradContext& g) -> Status {
    Value* dy = g.grad_output(0);
    if (!dy || !g.needs_grad(0)) return Status::ok();
    g.set_grad_input(0, g.emit1("Reshape", {dy, shape_of(g, g.input(0))}));
    return Status::ok();
  };
}

}  // namespace

void register_shape_ops(OpTable& t) {
  using P = PrecisionPolicy;
  using F = FusionClass;

  {
    OpDef d = make_op("Reshape",
                      kSpec + "Reshape-14, data reshaped to `shape` (0 copies a dim unless allowzero, -1 inferred)", 1,
                      2, infer_reshape, P::follow_inputs, F::view);
    d.attrs = {{"allowzero", AttrKind::i}, {"shape", AttrKind::ints}};
    add_differentiable(t, d, reshape_back());
  }
  {
    OpDef d = make_op(
        "Transpose", kSpec + "Transpose-13, permutes axes by `perm` (default: reversed)", 1, 1,
        [](InferContext& c) -> Status {
          const Shape& in = c.in[0].shape;
          int r = in.rank();
          std::vector<int64_t> perm = c.attrs().get_ints("perm");
          if (perm.empty())
            for (int i = r - 1; i >= 0; --i) perm.push_back(i);
          if (static_cast<int>(perm.size()) != r) return c.fail("perm length differs from rank");
          std::vector<bool> seen(r, false);
          Shape out;
          for (int64_t p : perm) {
            if (p < 0 || p >= r || seen[p]) return c.fail("perm is not a permutation");
            seen[p] = true;
            out.dims.push_back(in.dims[p]);
          }
          c.out[0] = {c.in[0].dtype, out};
          return Status::ok();
        },
        P::follow_inputs, F::view);
    d.attrs = {{"perm", AttrKind::ints}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      int r = g.input(0)->shape.rank();
      std::vector<int64_t> perm = g.node().attrs.get_ints("perm");
      if (perm.empty())
        for (int i = r - 1; i >= 0; --i) perm.push_back(i);
      std::vector<int64_t> inv(perm.size());
      for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
      Attributes a;
      a.set("perm", inv);
      g.set_grad_input(0, g.emit1("Transpose", {dy}, a));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op(
        "Flatten", kSpec + "Flatten-13, 2-D [prod(dims[:axis]), prod(dims[axis:])], axis default 1", 1, 1,
        [](InferContext& c) -> Status {
          const Shape& in = c.in[0].shape;
          int r = in.rank();
          int64_t axis = c.attrs().get_int("axis", 1);
          if (axis < -r || axis > r) return c.fail("axis " + std::to_string(axis) + " out of range");
          if (axis < 0) axis += r;
          c.out[0] = {c.in[0].dtype,
                      Shape({dim_product(in, 0, static_cast<int>(axis)), dim_product(in, static_cast<int>(axis), r)})};
          return Status::ok();
        },
        P::follow_inputs, F::view);
    d.attrs = {{"axis", AttrKind::i}};
    add_differentiable(t, d, reshape_back());
  }
  {
    OpDef d = make_op("Squeeze", kSpec + "Squeeze-13, removes size-1 dims listed in the axes input (all if omitted)", 1,
                      2, infer_squeeze, P::follow_inputs, F::view);
    d.attrs = {{"axes", AttrKind::ints}};
    add_differentiable(t, d, reshape_back());
  }
  {
    OpDef d = make_op("Unsqueeze", kSpec + "Unsqueeze-13, inserts size-1 dims at the axes input (of the output rank)",
                      1, 2, infer_unsqueeze, P::follow_inputs, F::view);
    d.attrs = {{"axes", AttrKind::ints}};
    add_differentiable(t, d, reshape_back());
  }
  {
    OpDef d = make_op(
        "Concat", kSpec + "Concat-13, joins inputs along `axis` (negative allowed)", 1, kVariadic,
        [](InferContext& c) -> Status {
          int r = c.in[0].shape.rank();
          // normalize_axis takes axis 0 of a scalar; Concat has no axis to join scalars on
          // (indexing the empty dims crashed: found by fuzz/ onnx).
          if (r < 1) return c.fail("inputs are scalars (rank 0); Concat needs inputs of rank >= 1");
          auto ax = normalize_axis(c.attrs().get_int("axis", 0), r);
          if (!ax) return c.fail(ax.message());
          Shape out = c.in[0].shape;
          Dim sum = 0;  // static, or an expression of symbolic lengths (seq + 1), or unknown
          for (int i = 0; i < c.num_inputs(); ++i) {
            if (!c.has_input(i)) return c.fail("missing input " + std::to_string(i));
            const Shape& s = c.in[i].shape;
            if (c.in[i].dtype != c.in[0].dtype) return c.fail("inputs have different dtypes");
            if (s.rank() != r) return c.fail("inputs have different ranks");
            for (int k = 0; k < r; ++k) {
              if (k == *ax) continue;
              const Dim& a = out.dims[k];
              const Dim& b = s.dims[k];
              if (a.is_static() && b.is_static() && a.value != b.value)
                return c.fail("input " + std::to_string(i) + " shape " + s.to_string() + " differs from " +
                              c.in[0].shape.to_string() + " outside the axis");
              if (!a.is_static() && b.is_static()) out.dims[k] = b;
            }
            sum = sum + s.dims[*ax];
          }
          out.dims[*ax] = c.num_inputs() == 1 ? c.in[0].shape.dims[*ax] : sum;
          c.out[0] = {c.in[0].dtype, out};
          return Status::ok();
        },
        P::follow_inputs, F::opaque);
    d.attrs = {{"axis", AttrKind::i, true}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy) return Status::ok();
      const Node& n = g.node();
      int r = dy->shape.rank();
      int64_t axis = n.attrs.get_int("axis", 0);
      if (axis < 0) axis += r;
      int k = n.num_inputs();
      bool all_static = true;
      std::vector<int64_t> sizes;
      for (int i = 0; i < k; ++i) {
        const Dim& d = g.input(i)->shape.dims[axis];
        all_static = all_static && d.is_static();
        sizes.push_back(d.value);
      }
      if (all_static) {
        Attributes a;
        a.set("axis", axis);
        auto parts = g.emit("Split", {dy, g.const_i64(sizes)}, k, a);
        for (int i = 0; i < k; ++i)
          if (g.needs_grad(i)) g.set_grad_input(i, parts[i]);
        return Status::ok();
      }
      // Symbolic sizes: Slice each input's range, offsets summed in-graph from Shape.
      Value* off = g.const_i64({0});
      Value* axes = g.const_i64({axis});
      for (int i = 0; i < k; ++i) {
        Attributes sa;
        sa.set("start", axis);
        sa.set("end", axis + 1);
        Value* len = g.emit1("Shape", {g.input(i)}, sa);
        Value* end = g.emit1("Add", {off, len});
        if (g.needs_grad(i)) g.set_grad_input(i, g.emit1("Slice", {dy, off, end, axes}));
        off = end;
      }
      return Status::ok();
    });
  }
  {
    OpDef d = make_op("Split",
                      kSpec +
                          "Split-18, splits along `axis` by the split input, or into num_outputs equal chunks "
                          "(last one smaller)",
                      1, 2, infer_split, P::follow_inputs, F::opaque);
    d.max_outputs = kVariadic;
    d.attrs = {{"axis", AttrKind::i}, {"num_outputs", AttrKind::i}, {"split", AttrKind::ints}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      if (!g.needs_grad(0)) return Status::ok();
      const Node& n = g.node();
      std::vector<Value*> parts;
      bool any = false;
      for (int i = 0; i < n.num_outputs(); ++i) {
        Value* gi = g.grad_output(i);
        any = any || gi;
        parts.push_back(gi ? gi : zeros_like(g, g.output(i)));
      }
      if (!any) return Status::ok();
      Attributes a;
      a.set("axis", n.attrs.get_int("axis", 0));
      g.set_grad_input(0, g.emit1("Concat", parts, a));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op("Slice",
                      kSpec + "Slice-13, inputs (data, starts, ends, axes?, steps?), negative steps, indices clamped",
                      1, 5, infer_slice, P::follow_inputs, F::view);
    d.attrs = {{"starts", AttrKind::ints}, {"ends", AttrKind::ints}, {"axes", AttrKind::ints}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      const Node& n = g.node();
      std::vector<Value*> ins = {dy, shape_of(g, g.input(0))};
      if (n.input(1)) {
        for (int i = 1; i < n.num_inputs(); ++i) ins.push_back(n.input(i));
      } else {  // Slice-1 attribute form
        ins.push_back(g.const_i64(n.attrs.get_ints("starts")));
        ins.push_back(g.const_i64(n.attrs.get_ints("ends")));
        if (n.attrs.has("axes")) ins.push_back(g.const_i64(n.attrs.get_ints("axes")));
      }
      g.set_grad_input(0, g.emit1("SliceGrad", ins));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op(
        "SliceGrad",
        "kiln-internal: zeros of shape `shape` with dy written at Slice(starts, ends, axes?, steps?) "
        "positions (inputs dy, shape, starts, ends, axes?, steps?; ONNX Slice-13 clamping)",
        4, 6, [](InferContext& c) -> Status { return shape_from_input(c, 1, c.in[0].dtype); }, P::follow_inputs,
        F::opaque);
    d.onnx = false;
    t.add(d);
  }
  {
    OpDef d = make_op(
        "Gather",
        kSpec + "Gather-13, out = data.shape[:axis] + indices.shape + data.shape[axis+1:], negative indices wrap", 2, 2,
        [](InferContext& c) -> Status {
          const Shape& s = c.in[0].shape;
          auto ax = normalize_axis(c.attrs().get_int("axis", 0), s.rank());
          if (!ax) return c.fail(ax.message());
          if (c.in[1].dtype != DType::i64 && c.in[1].dtype != DType::i32) return c.fail("indices must be i32 or i64");
          Shape out;
          for (int i = 0; i < *ax; ++i) out.dims.push_back(s.dims[i]);
          for (auto& d : c.in[1].shape.dims) out.dims.push_back(d);
          for (int i = *ax + 1; i < s.rank(); ++i) out.dims.push_back(s.dims[i]);
          c.out[0] = {c.in[0].dtype, out};
          return Status::ok();
        },
        P::follow_inputs, F::opaque);
    d.attrs = {{"axis", AttrKind::i}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      Attributes a;
      a.set("axis", g.node().attrs.get_int("axis", 0));
      g.set_grad_input(0, g.emit1("GatherGrad", {g.input(1), dy, shape_of(g, g.input(0))}, a));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op(
        "GatherGrad",
        "kiln-internal: scatter-add of dy into zeros of shape `shape` at Gather(axis) positions "
        "(inputs indices, dy, shape as 1-D i64; adjoint of ONNX Gather-13)",
        3, 3, [](InferContext& c) -> Status { return shape_from_input(c, 2, c.in[1].dtype); }, P::follow_inputs,
        F::opaque);
    d.attrs = {{"axis", AttrKind::i}};
    d.onnx = false;
    t.add(d);
  }
  {
    OpDef d = make_op(
        "Expand", kSpec + "Expand-13, broadcasts data to `shape` (bidirectional numpy rules)", 2, 2,
        [](InferContext& c) -> Status {
          auto s = c.shape_input(1);
          if (!s) {
            int64_t n = length_of_1d(c, 1);
            if (n < 0) return c.fail("shape input is not constant and its length is unknown");
            int r = std::max<int>(c.in[0].shape.rank(), static_cast<int>(n));
            c.out[0] = {c.in[0].dtype, Shape(std::vector<Dim>(static_cast<size_t>(r), Dim()))};
            return Status::ok();
          }
          auto b = broadcast_shapes(c.in[0].shape, *s);
          if (!b) return c.fail(b.message());
          c.out[0] = {c.in[0].dtype, *b};
          return Status::ok();
        },
        P::follow_inputs, F::view);
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      g.set_grad_input(0, g.unbroadcast(dy, g.input(0)));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op(
        "Shape", kSpec + "Shape-15, 1-D i64 dims of the input, sliced by start/end (clamped)", 1, 1,
        [](InferContext& c) -> Status {
          const auto [s, e] = shape_op_range(c.attrs(), c.in[0].shape.rank());
          c.out[0] = {DType::i64, Shape({Dim(std::max<int64_t>(0, e - s))})};
          return Status::ok();
        },
        P::not_float, F::opaque);
    d.attrs = {{"start", AttrKind::i}, {"end", AttrKind::i}};
    t.add(d);
  }
  {
    OpDef d = make_op(
        "ConstantOfShape",
        kSpec + "ConstantOfShape-9, tensor of shape `input` filled with `value` (1-element tensor, default f32 0)", 1,
        1,
        [](InferContext& c) -> Status {
          DType dt = DType::f32;
          if (const Tensor* v = c.attrs().get_tensor("value")) {
            if (v->numel() != 1) return c.fail("value must have one element");
            dt = v->dtype();
          }
          if (auto s = const_ints(c, 0))
            for (int64_t d : *s)
              if (d < 0) return c.fail("negative dim in shape");
          return shape_from_input(c, 0, dt);
        },
        P::not_float, F::opaque);
    d.attrs = {{"value", AttrKind::tensor}};
    t.add(d);
  }
  {
    OpDef d = make_op(
        "Constant",
        kSpec + "Constant-13, one of value / value_float(s) / value_int(s) (string and sparse forms unsupported)", 0, 0,
        [](InferContext& c) -> Status {
          const Attributes& a = c.attrs();
          if (const Tensor* v = a.get_tensor("value"))
            c.out[0] = {v->dtype(), Shape::of(v->dims())};
          else if (a.has("value_float"))
            c.out[0] = {DType::f32, Shape()};
          else if (a.has("value_int"))
            c.out[0] = {DType::i64, Shape()};
          else if (a.has("value_floats"))
            c.out[0] = {DType::f32, Shape::of({static_cast<int64_t>(a.get_floats("value_floats").size())})};
          else if (a.has("value_ints"))
            c.out[0] = {DType::i64, Shape::of({static_cast<int64_t>(a.get_ints("value_ints").size())})};
          else
            return c.fail("no supported value attribute (string and sparse constants are unsupported)");
          return Status::ok();
        },
        P::not_float, F::opaque);
    d.attrs = {{"value", AttrKind::tensor},          {"value_float", AttrKind::f},
               {"value_floats", AttrKind::floats},   {"value_int", AttrKind::i},
               {"value_ints", AttrKind::ints},       {"value_string", AttrKind::s},
               {"value_strings", AttrKind::strings}, {"sparse_value", AttrKind::tensor}};
    t.add(d);
  }
  {
    OpDef d = make_op(
        "Range",
        kSpec +
            "Range-27, [start, limit) by delta; n = max(ceil((limit-start)/delta), 0); "
            "out[i] = start + i * delta, for bf16/f16 computed in f32 (stash_type 1, the default)",
        3, 3,
        [](InferContext& c) -> Status {
          DType dt = c.in[0].dtype;
          if (c.in[1].dtype != dt || c.in[2].dtype != dt) return c.fail("inputs have different dtypes");
          if ((dt == DType::bf16 || dt == DType::f16) && c.attrs().get_int("stash_type", 1) != 1)
            return c.fail("stash_type " + std::to_string(c.attrs().get_int("stash_type", 1)) +
                          " is not supported (kiln computes bf16/f16 ranges in float: stash_type 1)");
          const Tensor *s = c.value(0), *l = c.value(1), *d = c.value(2);
          if (s && l && d && s->numel() == 1 && l->numel() == 1 && d->numel() == 1) {
            int64_t n;
            if (is_float(dt)) {
              double dv = d->get_f64(0);
              if (dv == 0) return c.fail("delta is 0");
              n = static_cast<int64_t>(std::ceil((l->get_f64(0) - s->get_f64(0)) / dv));
            } else {
              int64_t dv = d->get_i64(0), diff = l->get_i64(0) - s->get_i64(0);
              if (dv == 0) return c.fail("delta is 0");
              n = diff / dv + ((diff % dv != 0 && ((diff < 0) == (dv < 0))) ? 1 : 0);
            }
            c.out[0] = {dt, Shape::of({std::max<int64_t>(n, 0)})};
          } else if (auto sv = [&]() -> std::optional<SymExpr> {
                       // Integer ranges over symbolic bounds: n = (limit - start) / delta when exact
                       // (arange(seq): n = seq).
                       auto a = c.int_values(0), b = c.int_values(1), st = c.int_values(2);
                       if (!a || !b || !st || a->size() != 1 || b->size() != 1 || st->size() != 1) return std::nullopt;
                       if (!(*st)[0].is_constant() || (*st)[0].constant_value() <= 0) return std::nullopt;
                       return ((*b)[0] - (*a)[0]).exact_div((*st)[0]);
                     }()) {
            c.out[0] = {dt, Shape({Dim(*sv)})};
          } else {
            c.out[0] = {dt, Shape({Dim()})};
          }
          return Status::ok();
        },
        P::not_float, F::opaque);
    d.attrs = {{"stash_type", AttrKind::i}};
    t.add(d);
  }
  {
    OpDef d = make_op(
        "Trilu",
        kSpec +
            "Trilu-14, keeps the upper (upper=1, default) or lower triangle of the last two dims, "
            "diagonal offset k input",
        1, 2,
        [](InferContext& c) -> Status {
          KILN_RETURN_IF_ERROR(infer_passthrough_same(c));
          if (c.in[0].shape.rank() < 2) return c.fail("input rank must be >= 2");
          return Status::ok();
        },
        P::follow_inputs, F::opaque);
    d.attrs = {{"upper", AttrKind::i}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      std::vector<Value*> ins = {dy};
      if (g.input(1)) ins.push_back(g.input(1));
      g.set_grad_input(0, g.emit1("Trilu", ins, g.node().attrs));
      return Status::ok();
    });
  }
  {
    OpDef d =
        make_op("Pad", kSpec + "Pad-18, inputs (data, pads, constant_value?, axes?), mode constant|reflect|edge|wrap",
                1, 4, infer_pad, P::follow_inputs, F::opaque);
    d.attrs = {{"mode", AttrKind::s}, {"pads", AttrKind::ints}, {"value", AttrKind::f}};
    // Gradient (constant mode only): slice dy back to the input's region. Pads must be >= 0.
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      const Node& n = g.node();
      std::string mode = n.attrs.get_string("mode", "constant");
      if (mode != "constant")
        return Status::error("node '" + n.name + "' (Pad): gradient of mode '" + mode + "' is not implemented");
      Value* x = g.input(0);
      int r = x->shape.rank();
      Value* pads = n.input(1);
      Value* axes = n.input(3);
      std::optional<std::vector<int64_t>> pv;
      if (pads && pads->data)
        pv = pads->data->to_i64_vector();
      else if (!pads)
        pv = n.attrs.get_ints("pads");
      std::optional<std::vector<int64_t>> av;
      if (!axes) {
        av = std::vector<int64_t>();
        for (int i = 0; i < r; ++i) av->push_back(i);
      } else if (axes->data) {
        av = axes->data->to_i64_vector();
      }
      if (pv && av && x->shape.is_static()) {
        size_t na = av->size();
        if (pv->size() != 2 * na) return Status::error("node '" + n.name + "' (Pad): pads length mismatch");
        std::vector<int64_t> starts, ends, ax;
        for (size_t i = 0; i < na; ++i) {
          int64_t a = (*av)[i] < 0 ? (*av)[i] + r : (*av)[i];
          if ((*pv)[i] < 0 || (*pv)[i + na] < 0)
            return Status::error("node '" + n.name + "' (Pad): gradient with negative pads is not implemented");
          starts.push_back((*pv)[i]);
          ends.push_back((*pv)[i] + x->shape.dims[a].value);
          ax.push_back(a);
        }
        g.set_grad_input(0, g.emit1("Slice", {dy, g.const_i64(starts), g.const_i64(ends), g.const_i64(ax)}));
        return Status::ok();
      }
      if (!pads) return Status::error("node '" + n.name + "' (Pad): missing pads");
      // Dynamic form: starts = pads[:na], ends = starts + dims (of the padded axes).
      Value* dims = g.emit1("Shape", {x});
      Value* axes_v = axes ? axes : g.const_i64(*av);
      if (axes) dims = g.emit1("Gather", {dims, axes});
      Attributes sa;
      sa.set("start", int64_t(0));
      Value* na = g.emit1("Shape", {axes_v}, sa);
      Value* starts = g.emit1("Slice", {pads, g.const_i64({0}), na});
      Value* ends = g.emit1("Add", {starts, dims});
      g.set_grad_input(0, g.emit1("Slice", {dy, starts, ends, axes_v}));
      return Status::ok();
    });
  }

  // ONNX schema versions implemented (OpDef::onnx_since; tests/ir/op_table_test.cpp
  // compares them with ONNX's own history).
  set_onnx_since(t, "Concat", {13});
  set_onnx_since(t, "Constant", {13, 19, 21, 23, 24, 25});
  set_onnx_since(t, "ConstantOfShape", {9, 20, 21, 23, 24, 25});
  set_onnx_since(t, "Expand", {13});
  set_onnx_since(t, "Flatten", {13, 21, 23, 24, 25});
  set_onnx_since(t, "Gather", {13});
  set_onnx_since(t, "Pad", {13, 18, 19, 21, 23, 24, 25});
  set_onnx_since(t, "Range", {11, 27});
  set_onnx_since(t, "Reshape", {13, 14, 19, 21, 23, 24, 25});
  set_onnx_since(t, "Shape", {13, 15, 19, 21, 23, 24, 25});
  set_onnx_since(t, "Slice", {13});
  set_onnx_since(t, "Split", {13, 18});
  set_onnx_since(t, "Squeeze", {13, 21, 23, 24, 25});
  set_onnx_since(t, "Transpose", {13, 21, 23, 24, 25});
  set_onnx_since(t, "Trilu", {14});
  set_onnx_since(t, "Unsqueeze", {13, 21, 23, 24, 25});
}

}  // namespace kiln::ir
