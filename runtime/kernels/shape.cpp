// Eager kernels: shape ops (ONNX semantics, see ir/ops/shape.cpp) and the
// kiln-internal SliceGrad / GatherGrad. Data movement is dtype-agnostic: kernels
// copy elements as 1/2/4/8-byte words (strided_copy in util.h), so every dtype
// (bf16, f64, integers, bool) is supported. Output shapes come from inference.
#include <algorithm>
#include <cstring>

#include "ir/ops/nn.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels {

using ir::DType;
using ir::KernelContext;
using ir::Tensor;

namespace {

/// Calls f(W{}) with an unsigned word type of `esize` bytes.
template <typename F>
void with_word(size_t esize, F&& f) {
  switch (esize) {
    case 1:
      f(uint8_t{});
      break;
    case 2:
      f(uint16_t{});
      break;
    case 4:
      f(uint32_t{});
      break;
    default:
      f(uint64_t{});
      break;
  }
}

Status copy_same_numel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  if (x.numel() != y.numel())
    return c.fail("input has " + std::to_string(x.numel()) + " elements, output " + std::to_string(y.numel()));
  if (x.nbytes()) std::memcpy(y.raw(), x.raw(), x.nbytes());
  return Status::ok();
}

Status transpose_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  int r = x.rank();
  std::vector<int64_t> perm = c.attrs().get_ints("perm");
  if (perm.empty())
    for (int i = r - 1; i >= 0; --i) perm.push_back(i);
  std::vector<int64_t> st = ir::strides_of(x.dims()), src(r);
  for (int i = 0; i < r; ++i) src[i] = st[perm[i]];
  strided_copy(y.raw(), x.raw(), ir::dtype_size(x.dtype()), y.dims(), src, 0);
  return Status::ok();
}

/// (outer, axis, inner) split of `dims` around axis.
void split_dims(const std::vector<int64_t>& dims, int axis, int64_t& outer, int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int i = 0; i < axis; ++i) outer *= dims[i];
  for (size_t i = axis + 1; i < dims.size(); ++i) inner *= dims[i];
}

Status concat_kernel(KernelContext& c) {
  Tensor& y = c.out(0);
  int r = y.rank();
  int64_t axis = c.attrs().get_int("axis", 0);
  if (axis < 0) axis += r;
  const size_t es = ir::dtype_size(y.dtype());
  int64_t outer, inner;
  split_dims(y.dims(), static_cast<int>(axis), outer, inner);
  const int64_t out_row = y.dims()[axis] * inner * es;
  int64_t off = 0;
  char* po = static_cast<char*>(y.raw());
  for (size_t k = 0; k < c.inputs.size(); ++k) {
    const Tensor& x = c.in(static_cast<int>(k));
    if (x.dtype() != y.dtype()) return c.fail("inputs have different dtypes");
    const int64_t row = x.dims()[axis] * inner * es;
    const char* px = static_cast<const char*>(x.raw());
    if (row > 0)
      for (int64_t o = 0; o < outer; ++o) std::memcpy(po + o * out_row + off, px + o * row, static_cast<size_t>(row));
    off += row;
  }
  return Status::ok();
}

Status split_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  int r = x.rank();
  int64_t axis = c.attrs().get_int("axis", 0);
  if (axis < 0) axis += r;
  const size_t es = ir::dtype_size(x.dtype());
  int64_t outer, inner;
  split_dims(x.dims(), static_cast<int>(axis), outer, inner);
  const int64_t in_row = x.dims()[axis] * inner * es;
  int64_t off = 0;
  const char* px = static_cast<const char*>(x.raw());
  for (size_t k = 0; k < c.outputs.size(); ++k) {
    Tensor& y = c.out(static_cast<int>(k));
    const int64_t row = y.dims()[axis] * inner * es;
    char* py = static_cast<char*>(y.raw());
    if (off + row > in_row) return c.fail("split sizes exceed the input dim");
    if (row > 0)
      for (int64_t o = 0; o < outer; ++o) std::memcpy(py + o * row, px + o * in_row + off, static_cast<size_t>(row));
    off += row;
  }
  return Status::ok();
}

/// Element offset and per-dim strides (elements) of a Slice view of a tensor with
/// `dims` (ir::slice_view, the normalisation the Slice inference uses); errors name the node.
Status slice_view(const KernelContext& c, const std::vector<int64_t>& dims, const std::vector<int64_t>& starts,
                  const std::vector<int64_t>& ends, std::vector<int64_t> axes, std::vector<int64_t> steps,
                  int64_t& offset, std::vector<int64_t>& strides, std::vector<int64_t>& out_dims) {
  auto v = ir::slice_view(dims, starts, ends, std::move(axes), std::move(steps));
  if (!v) return c.fail(v.message());
  offset = v->offset;
  strides = std::move(v->strides);
  out_dims = std::move(v->dims);
  return Status::ok();
}

std::vector<int64_t> ints_of(const KernelContext& c, int i) {
  return c.has_input(i) ? c.in(i).to_i64_vector() : std::vector<int64_t>{};
}

Status slice_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  std::vector<int64_t> starts, ends, axes, steps;
  if (!c.has_input(1) && c.attrs().has("starts")) {
    starts = c.attrs().get_ints("starts");
    ends = c.attrs().get_ints("ends");
    axes = c.attrs().get_ints("axes");
  } else {
    starts = ints_of(c, 1);
    ends = ints_of(c, 2);
    axes = ints_of(c, 3);
    steps = ints_of(c, 4);
  }
  int64_t offset;
  std::vector<int64_t> strides, od;
  KILN_RETURN_IF_ERROR(slice_view(c, x.dims(), starts, ends, axes, steps, offset, strides, od));
  if (od != y.dims())
    return c.fail("slice shape " + ir::dims_to_string(od) + " differs from inferred " + ir::dims_to_string(y.dims()));
  strided_copy(y.raw(), x.raw(), ir::dtype_size(x.dtype()), od, strides, offset);
  return Status::ok();
}

Status slice_grad_kernel(KernelContext& c) {
  const Tensor& dy = c.in(0);
  Tensor& out = c.out(0);  // zero-initialised
  int64_t offset;
  std::vector<int64_t> strides, od;
  KILN_RETURN_IF_ERROR(
      slice_view(c, out.dims(), ints_of(c, 2), ints_of(c, 3), ints_of(c, 4), ints_of(c, 5), offset, strides, od));
  if (od != dy.dims())
    return c.fail("dy shape " + ir::dims_to_string(dy.dims()) + " differs from the slice " + ir::dims_to_string(od));
  with_word(ir::dtype_size(dy.dtype()), [&](auto w) {
    using W = decltype(w);
    const W* pd = dy.data<W>();
    W* po = out.data<W>() + offset;
    // Slice positions are distinct, so the scatter is race-free.
    for_each_strided<1>(od, {strides}, [&](int64_t o, const std::array<int64_t, 1>& off) { po[off[0]] = pd[o]; });
  });
  return Status::ok();
}

/// Reads index j of an i32/i64 tensor, wrapping negatives; error when out of [-n, n).
bool read_index(const Tensor& idx, int64_t j, int64_t n, int64_t& v) {
  v = idx.dtype() == DType::i32 ? idx.data<int32_t>()[j] : idx.data<int64_t>()[j];
  if (v < -n || v >= n) return false;
  if (v < 0) v += n;
  return true;
}

Status gather_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  const Tensor& idx = c.in(1);
  Tensor& y = c.out(0);
  int r = x.rank();
  int64_t axis = c.attrs().get_int("axis", 0);
  if (axis < 0) axis += r;
  if (idx.dtype() != DType::i32 && idx.dtype() != DType::i64) return c.fail("indices must be i32 or i64");
  int64_t outer, inner;
  split_dims(x.dims(), static_cast<int>(axis), outer, inner);
  const int64_t n = x.dims()[axis], ni = idx.numel();
  const size_t es = ir::dtype_size(x.dtype());
  std::vector<int64_t> ids(ni);
  for (int64_t j = 0; j < ni; ++j)
    if (!read_index(idx, j, n, ids[j]))
      return c.fail("index " + std::to_string(idx.get_i64(j)) + " out of range for dim " + std::to_string(n));
  const char* px = static_cast<const char*>(x.raw());
  char* py = static_cast<char*>(y.raw());
  const size_t row = static_cast<size_t>(inner) * es;
#pragma omp parallel for schedule(static) if (outer * ni * inner >= kParallelThreshold)
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < ni; ++j) std::memcpy(py + (o * ni + j) * row, px + (o * n + ids[j]) * row, row);
  return Status::ok();
}

Status gather_grad_kernel(KernelContext& c) {
  const Tensor& idx = c.in(0);
  const Tensor& dy = c.in(1);
  Tensor& out = c.out(0);  // zero-initialised
  int r = out.rank();
  int64_t axis = c.attrs().get_int("axis", 0);
  if (axis < 0) axis += r;
  if (axis < 0 || axis >= r) return c.fail("axis out of range");
  if (idx.dtype() != DType::i32 && idx.dtype() != DType::i64) return c.fail("indices must be i32 or i64");
  int64_t outer, inner;
  split_dims(out.dims(), static_cast<int>(axis), outer, inner);
  const int64_t n = out.dims()[axis], ni = idx.numel();
  if (dy.numel() != outer * ni * inner) return c.fail("dy shape " + ir::dims_to_string(dy.dims()) + " does not match");
  std::vector<int64_t> ids(ni);
  for (int64_t j = 0; j < ni; ++j)
    if (!read_index(idx, j, n, ids[j]))
      return c.fail("index " + std::to_string(idx.get_i64(j)) + " out of range for dim " + std::to_string(n));
  return dispatch_numeric(c, dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* pd = dy.data<T>();
    T* po = out.data<T>();
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_integral_v<T>) {
      // Parallel over outer slices: each owns disjoint output rows, so repeated indices never race.
#pragma omp parallel for schedule(static) if (outer * ni * inner >= kParallelThreshold && outer > 1)
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t j = 0; j < ni; ++j) {
          T* dst = po + (o * n + ids[j]) * inner;
          const T* src = pd + (o * ni + j) * inner;
          for (int64_t k = 0; k < inner; ++k) dst[k] += src[k];
        }
    } else {
      // bf16/f16: accumulate in f32, round once at the end.
      std::vector<float> acc(static_cast<size_t>(out.numel()), 0.0f);
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t j = 0; j < ni; ++j) {
          float* dst = acc.data() + (o * n + ids[j]) * inner;
          const T* src = pd + (o * ni + j) * inner;
          for (int64_t k = 0; k < inner; ++k) dst[k] += load(src[k]);
        }
      for (int64_t i = 0; i < out.numel(); ++i) po[i] = store<T>(static_cast<C>(acc[i]));
    }
  });
}

Status expand_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  strided_copy(y.raw(), x.raw(), ir::dtype_size(x.dtype()), y.dims(), broadcast_strides(x.dims(), y.dims()), 0);
  return Status::ok();
}

Status shape_kernel(KernelContext& c) {
  const auto& d = c.in(0).dims();
  const auto [s, e] = ir::shape_op_range(c.attrs(), static_cast<int64_t>(d.size()));
  int64_t* p = c.out(0).data<int64_t>();
  for (int64_t i = s; i < e; ++i) p[i - s] = d[i];
  return Status::ok();
}

/// A SymInts node's expressions, parsed once per node (KernelContext::cache) from its
/// `values` text.
struct SymIntsCache {
  std::vector<std::string> text;
  std::vector<ir::SymExpr> exprs;
};

/// SymInts: each shape expression evaluated with the run's symbol values.
Status sym_ints_kernel(KernelContext& c) {
  const auto* attr = c.attrs().find("values");
  const auto* values = attr ? std::get_if<std::vector<std::string>>(attr) : nullptr;
  if (!values) return c.fail("no values");
  auto cached = c.cache ? std::static_pointer_cast<SymIntsCache>(*c.cache) : nullptr;
  if (!cached || cached->text != *values) {
    cached = std::make_shared<SymIntsCache>();
    cached->text = *values;
    for (const std::string& v : *values) {
      auto e = ir::SymExpr::parse(v);
      if (!e) return c.fail("'" + v + "' is not a shape expression");
      cached->exprs.push_back(*e);
    }
    if (c.cache) *c.cache = cached;
  }
  int64_t* p = c.out(0).data<int64_t>();
  for (size_t i = 0; i < cached->exprs.size(); ++i) {
    const ir::SymExpr& e = cached->exprs[i];
    auto v = c.symbols ? e.evaluate(*c.symbols) : std::nullopt;
    if (!v) {
      std::string names;
      for (const std::string& s : e.symbols()) names += (names.empty() ? "" : ", ") + s;
      return c.fail("shape expression " + (*values)[i] + ": symbol " + names +
                    " has no value in this run (symbols take their values from the graph inputs' dims)");
    }
    p[i] = *v;
  }
  return Status::ok();
}

/// Fills `y` with copies of the single element of `v` (same dtype).
void fill_with(Tensor& y, const Tensor& v) {
  with_word(ir::dtype_size(y.dtype()), [&](auto w) {
    using W = decltype(w);
    W val = *v.data<W>();
    W* p = y.data<W>();
    for (int64_t i = 0; i < y.numel(); ++i) p[i] = val;
  });
}

Status constant_of_shape_kernel(KernelContext& c) {
  Tensor& y = c.out(0);
  if (const Tensor* v = c.attrs().get_tensor("value")) {
    if (v->dtype() != y.dtype() || v->numel() != 1) return c.fail("value must be a 1-element tensor");
    fill_with(y, *v);
  }
  return Status::ok();  // default value 0: storage is zero-initialised
}

Status constant_kernel(KernelContext& c) {
  Tensor& y = c.out(0);
  const ir::Attributes& a = c.attrs();
  if (const Tensor* v = a.get_tensor("value")) {
    if (v->nbytes() != y.nbytes()) return c.fail("value size mismatch");
    if (v->nbytes()) std::memcpy(y.raw(), v->raw(), v->nbytes());
  } else if (a.has("value_float")) {
    *y.data<float>() = static_cast<float>(a.get_float("value_float", 0));
  } else if (a.has("value_int")) {
    *y.data<int64_t>() = a.get_int("value_int", 0);
  } else if (a.has("value_floats")) {
    auto v = a.get_floats("value_floats");
    for (size_t i = 0; i < v.size(); ++i) y.data<float>()[i] = static_cast<float>(v[i]);
  } else if (a.has("value_ints")) {
    auto v = a.get_ints("value_ints");
    for (size_t i = 0; i < v.size(); ++i) y.data<int64_t>()[i] = v[i];
  } else {
    return c.fail("no supported value attribute");
  }
  return Status::ok();
}

Status range_kernel(KernelContext& c) {
  Tensor& y = c.out(0);
  return dispatch_numeric(c, y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    C start = load(c.in(0).data<T>()[0]), delta = load(c.in(2).data<T>()[0]);
    T* p = y.data<T>();
    for (int64_t i = 0; i < y.numel(); ++i) p[i] = store<T>(static_cast<C>(start + static_cast<C>(i) * delta));
  });
}

Status trilu_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  bool upper = c.attrs().get_int("upper", 1) != 0;
  int64_t k = c.has_input(1) && c.in(1).numel() > 0 ? c.in(1).get_i64(0) : 0;
  const int64_t rows = x.dim(-2), cols = x.dim(-1);
  const int64_t mats = rows * cols == 0 ? 0 : x.numel() / (rows * cols);
  with_word(ir::dtype_size(x.dtype()), [&](auto w) {
    using W = decltype(w);
    const W* px = x.data<W>();
    W* py = y.data<W>();
#pragma omp parallel for schedule(static) if (x.numel() >= kParallelThreshold)
    for (int64_t m = 0; m < mats; ++m)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          int64_t o = (m * rows + i) * cols + j;
          bool keep = upper ? (j - i >= k) : (j - i <= k);
          py[o] = keep ? px[o] : W(0);
        }
  });
  return Status::ok();
}

Status pad_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  const int r = x.rank();
  std::string mode = c.attrs().get_string("mode", "constant");
  std::vector<int64_t> pads = c.has_input(1) ? c.in(1).to_i64_vector() : c.attrs().get_ints("pads");
  std::vector<int64_t> axes = ints_of(c, 3);
  if (axes.empty())
    for (int i = 0; i < r; ++i) axes.push_back(i);
  const size_t na = axes.size();
  if (pads.size() != 2 * na) return c.fail("pads length mismatch");
  std::vector<int64_t> begin(r, 0);
  for (size_t i = 0; i < na; ++i) begin[axes[i] < 0 ? axes[i] + r : axes[i]] = pads[i];
  // Per-dim map from output coordinate to input coordinate (-1: constant fill).
  std::vector<std::vector<int64_t>> map(r);
  for (int d = 0; d < r; ++d) {
    const int64_t in_d = x.dims()[d], out_d = y.dims()[d];
    map[d].resize(out_d);
    for (int64_t o = 0; o < out_d; ++o) {
      int64_t s = o - begin[d];
      if (s < 0 || s >= in_d) {
        if (mode == "constant" || in_d == 0)
          s = -1;
        else if (mode == "edge")
          s = std::clamp<int64_t>(s, 0, in_d - 1);
        else if (mode == "wrap")
          s = ((s % in_d) + in_d) % in_d;
        else {  // reflect (mirror without repeating the edge)
          int64_t period = 2 * (in_d - 1);
          if (period == 0)
            s = 0;
          else {
            s = ((s % period) + period) % period;
            if (s >= in_d) s = period - s;
          }
        }
      }
      map[d][o] = s;
    }
  }
  Tensor cval(x.dtype(), {1});
  if (c.has_input(2) && c.in(2).numel() > 0) {
    if (c.in(2).dtype() != x.dtype()) return c.fail("constant_value dtype differs from data");
    std::memcpy(cval.raw(), c.in(2).raw(), ir::dtype_size(x.dtype()));
  } else if (c.attrs().has("value")) {
    cval.set_f64(0, c.attrs().get_float("value", 0));
  }
  if (y.numel() == 0) return Status::ok();
  const std::vector<int64_t> xs = ir::strides_of(x.dims());
  with_word(ir::dtype_size(x.dtype()), [&](auto w) {
    using W = decltype(w);
    const W* px = x.data<W>();
    W* py = y.data<W>();
    const W fill = *cval.data<W>();
    if (r == 0) {
      py[0] = px[0];
      return;
    }
    const int64_t inner = y.dims()[r - 1];
    const int64_t rows = y.numel() / inner;
#pragma omp parallel for schedule(static) if (y.numel() >= kParallelThreshold)
    for (int64_t row = 0; row < rows; ++row) {
      int64_t rem = row, base = 0;
      bool outside = false;
      for (int d = r - 2; d >= 0; --d) {
        int64_t co = rem % y.dims()[d];
        rem /= y.dims()[d];
        int64_t s = map[d][co];
        if (s < 0)
          outside = true;
        else
          base += s * xs[d];
      }
      W* dst = py + row * inner;
      for (int64_t j = 0; j < inner; ++j) {
        int64_t s = map[r - 1][j];
        dst[j] = (outside || s < 0) ? fill : px[base + s];
      }
    }
  });
  return Status::ok();
}

}  // namespace

void register_shape_kernels(ir::OpTable& t) {
  set_kernel(t, "Reshape", copy_same_numel);
  set_kernel(t, "Flatten", copy_same_numel);
  set_kernel(t, "Squeeze", copy_same_numel);
  set_kernel(t, "Unsqueeze", copy_same_numel);
  set_kernel(t, "Transpose", transpose_kernel);
  set_kernel_writing_all_outputs(t, "Concat", concat_kernel);
  set_kernel_writing_all_outputs(t, "Split", split_kernel);
  set_kernel(t, "Slice", slice_kernel);
  set_kernel(t, "SliceGrad", slice_grad_kernel);
  set_kernel(t, "Gather", gather_kernel);
  set_kernel(t, "GatherGrad", gather_grad_kernel);
  set_kernel(t, "Expand", expand_kernel);
  set_kernel(t, "Shape", shape_kernel);
  set_kernel(t, "SymInts", sym_ints_kernel);
  set_kernel(t, "ConstantOfShape", constant_of_shape_kernel);
  set_kernel(t, "Constant", constant_kernel);
  set_kernel(t, "Range", range_kernel);
  set_kernel(t, "Trilu", trilu_kernel);
  set_kernel(t, "Pad", pad_kernel);
}

}  // namespace kiln::runtime::kernels
