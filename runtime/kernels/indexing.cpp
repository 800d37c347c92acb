// Eager kernels: indexing ops (ir/ops/indexing.cpp; ONNX GatherElements-13, GatherND-13,
// ScatterElements-18, ScatterND-18, CumSum-14) and the kiln-internal GatherNDGrad,
// AsStrided and AsStridedScatter.
// Gathers move elements as 1/2/4/8-byte words (any dtype); scatters with a reduction
// and CumSum compute in the element's compute type (floats: CumSum sums in double, as
// PyTorch's CPU cumsum accumulates float in double). Every index is checked: an index
// outside [-n, n) is an error naming the node, the index and the dim.
#include <algorithm>
#include <cstring>

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

/// Index j of an i32/i64 tensor, negative values counted from n; false when outside [-n, n).
bool index_at(const Tensor& idx, int64_t j, int64_t n, int64_t& v) {
  v = idx.dtype() == DType::i32 ? idx.data<int32_t>()[j] : idx.data<int64_t>()[j];
  if (v < -n || v >= n) return false;
  if (v < 0) v += n;
  return true;
}

Status bad_index(KernelContext& c, const Tensor& idx, int64_t j, int64_t n) {
  return c.fail("index " + std::to_string(idx.get_i64(j)) + " out of range for a dim of " + std::to_string(n));
}

/// For every element of a tensor of dims `dims` (row-major) the offset into a tensor of
/// `other` strides with the axis coordinate replaced: base offsets that skip `axis`.
std::vector<int64_t> offsets_without_axis(const std::vector<int64_t>& dims, const std::vector<int64_t>& strides,
                                          int axis) {
  const int64_t n = ir::numel_of(dims);
  std::vector<int64_t> off(static_cast<size_t>(n));
  std::vector<int64_t> coord(dims.size(), 0);
  for (int64_t e = 0; e < n; ++e) {
    int64_t o = 0;
    for (size_t d = 0; d < dims.size(); ++d)
      if (static_cast<int>(d) != axis) o += coord[d] * strides[d];
    off[static_cast<size_t>(e)] = o;
    for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
      if (++coord[d] < dims[d]) break;
      coord[d] = 0;
    }
  }
  return off;
}

/// Combines `u` into `dst` by `red` (none, add, mul, max, min) in the compute type.
template <typename T>
void combine(T& dst, const T& u, const std::string& red) {
  using C = compute_t<T>;
  if (red == "none") {
    dst = u;
    return;
  }
  C a = load(dst), b = load(u);
  C r = red == "add"   ? static_cast<C>(a + b)
        : red == "mul" ? static_cast<C>(a * b)
        : red == "max" ? std::max(a, b)
                       : std::min(a, b);
  dst = store<T>(r);
}

Status gather_elements_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  const Tensor& idx = c.in(1);
  Tensor& y = c.out(0);
  const int axis = static_cast<int>(*ir::normalize_axis(c.attrs().get_int("axis", 0), x.rank()));
  const std::vector<int64_t> xs = ir::strides_of(x.dims());
  const std::vector<int64_t> base = offsets_without_axis(idx.dims(), xs, axis);
  const int64_t n = x.dims()[axis];
  for (int64_t e = 0; e < idx.numel(); ++e) {
    int64_t v;
    if (!index_at(idx, e, n, v)) return bad_index(c, idx, e, n);
  }
  with_word(ir::dtype_size(x.dtype()), [&](auto w) {
    using W = decltype(w);
    const W* px = x.data<W>();
    W* py = y.data<W>();
    for (int64_t e = 0; e < idx.numel(); ++e) {
      int64_t v;
      index_at(idx, e, n, v);
      py[e] = px[base[static_cast<size_t>(e)] + v * xs[axis]];
    }
  });
  return Status::ok();
}

Status scatter_elements_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  const Tensor& idx = c.in(1);
  const Tensor& upd = c.in(2);
  Tensor& y = c.out(0);
  const int axis = static_cast<int>(*ir::normalize_axis(c.attrs().get_int("axis", 0), x.rank()));
  const std::string red = c.attrs().get_string("reduction", "none");
  for (int d = 0; d < x.rank(); ++d)
    if (d != axis && idx.dims()[d] > x.dims()[d])
      return c.fail("indices dim " + std::to_string(d) + " (" + std::to_string(idx.dims()[d]) + ") exceeds data's (" +
                    std::to_string(x.dims()[d]) + ")");
  const std::vector<int64_t> xs = ir::strides_of(x.dims());
  const std::vector<int64_t> base = offsets_without_axis(idx.dims(), xs, axis);
  const int64_t n = x.dims()[axis];
  for (int64_t e = 0; e < idx.numel(); ++e) {
    int64_t v;
    if (!index_at(idx, e, n, v)) return bad_index(c, idx, e, n);
  }
  if (x.nbytes()) std::memcpy(y.raw(), x.raw(), x.nbytes());
  return dispatch_all(c, x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* py = y.data<T>();
    const T* pu = upd.data<T>();
    for (int64_t e = 0; e < idx.numel(); ++e) {
      int64_t v;
      index_at(idx, e, n, v);
      combine(py[base[static_cast<size_t>(e)] + v * xs[axis]], pu[e], red);
    }
  });
}

/// The geometry shared by GatherND, its gradient and ScatterND: `tuples` index tuples of
/// length k (the last dim of indices), grouped into `batches` of `per_batch`; each names
/// a slice of `slice` elements of a data tensor of dims `dims`.
struct NdGeometry {
  int64_t k = 0, batches = 1, per_batch = 1, slice = 1, batch_stride = 0;
  std::vector<int64_t> dims, strides;
};

Expected<NdGeometry> nd_geometry(KernelContext& c, const std::vector<int64_t>& data_dims, const Tensor& idx,
                                 int64_t batch_dims) {
  NdGeometry g;
  g.dims = data_dims;
  g.strides = ir::strides_of(data_dims);
  g.k = idx.dims().back();
  const int q = idx.rank();
  for (int64_t j = 0; j < batch_dims; ++j) {
    if (idx.dims()[j] != data_dims[j])
      return c.fail("batch dim " + std::to_string(j) + " of indices (" + std::to_string(idx.dims()[j]) +
                    ") differs from data's (" + std::to_string(data_dims[j]) + ")");
    g.batches *= data_dims[j];
  }
  for (int j = static_cast<int>(batch_dims); j < q - 1; ++j) g.per_batch *= idx.dims()[j];
  for (size_t j = batch_dims + g.k; j < data_dims.size(); ++j) g.slice *= data_dims[j];
  g.batch_stride = 1;
  for (size_t j = batch_dims; j < data_dims.size(); ++j) g.batch_stride *= data_dims[j];
  return g;
}

/// Element offsets of the slices named by every index tuple (batch offset included).
Expected<std::vector<int64_t>> nd_offsets(KernelContext& c, const NdGeometry& g, const Tensor& idx,
                                          int64_t batch_dims) {
  std::vector<int64_t> off(static_cast<size_t>(g.batches * g.per_batch));
  for (int64_t b = 0; b < g.batches; ++b)
    for (int64_t t = 0; t < g.per_batch; ++t) {
      const int64_t tuple = b * g.per_batch + t;
      int64_t o = b * g.batch_stride;
      for (int64_t j = 0; j < g.k; ++j) {
        const int64_t n = g.dims[batch_dims + j];
        int64_t v;
        if (!index_at(idx, tuple * g.k + j, n, v)) return bad_index(c, idx, tuple * g.k + j, n);
        o += v * g.strides[batch_dims + j];
      }
      off[static_cast<size_t>(tuple)] = o;
    }
  return off;
}

Status gather_nd_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  const Tensor& idx = c.in(1);
  Tensor& y = c.out(0);
  const int64_t bd = c.attrs().get_int("batch_dims", 0);
  KILN_ASSIGN_OR_RETURN(NdGeometry g, nd_geometry(c, x.dims(), idx, bd));
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> off, nd_offsets(c, g, idx, bd));
  const size_t es = ir::dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw());
  char* py = static_cast<char*>(y.raw());
  for (size_t t = 0; t < off.size(); ++t)
    std::memcpy(py + t * g.slice * es, px + off[t] * es, static_cast<size_t>(g.slice) * es);
  return Status::ok();
}

Status gather_nd_grad_kernel(KernelContext& c) {
  const Tensor& idx = c.in(0);
  const Tensor& dy = c.in(1);
  Tensor& out = c.out(0);  // zero-initialised
  const int64_t bd = c.attrs().get_int("batch_dims", 0);
  KILN_ASSIGN_OR_RETURN(NdGeometry g, nd_geometry(c, out.dims(), idx, bd));
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> off, nd_offsets(c, g, idx, bd));
  if (dy.numel() != static_cast<int64_t>(off.size()) * g.slice)
    return c.fail("dy shape " + ir::dims_to_string(dy.dims()) + " does not match the gathered slices");
  return dispatch_numeric(c, dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* po = out.data<T>();
    const T* pd = dy.data<T>();
    for (size_t t = 0; t < off.size(); ++t)
      for (int64_t e = 0; e < g.slice; ++e) combine(po[off[t] + e], pd[t * g.slice + e], "add");
  });
}

Status scatter_nd_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  const Tensor& idx = c.in(1);
  const Tensor& upd = c.in(2);
  Tensor& y = c.out(0);
  const std::string red = c.attrs().get_string("reduction", "none");
  KILN_ASSIGN_OR_RETURN(NdGeometry g, nd_geometry(c, x.dims(), idx, 0));
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> off, nd_offsets(c, g, idx, 0));
  if (upd.numel() != static_cast<int64_t>(off.size()) * g.slice)
    return c.fail("updates shape " + ir::dims_to_string(upd.dims()) + " does not match indices and data");
  if (x.nbytes()) std::memcpy(y.raw(), x.raw(), x.nbytes());
  return dispatch_all(c, x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* py = y.data<T>();
    const T* pu = upd.data<T>();
    for (size_t t = 0; t < off.size(); ++t)
      for (int64_t e = 0; e < g.slice; ++e) combine(py[off[t] + e], pu[t * g.slice + e], red);
  });
}

Status cumsum_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  auto ax = ir::normalize_axis(c.in(1).get_i64(0), x.rank());
  if (!ax) return c.fail(ax.message());
  const bool exclusive = c.attrs().get_int("exclusive", 0) != 0, reverse = c.attrs().get_int("reverse", 0) != 0;
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < *ax; ++d) outer *= x.dims()[d];
  for (int d = *ax + 1; d < x.rank(); ++d) inner *= x.dims()[d];
  const int64_t n = x.rank() ? x.dims()[*ax] : 1;
  return dispatch_numeric(c, x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    using A = std::conditional_t<std::is_floating_point_v<C>, double, C>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static) if (x.numel() >= kParallelThreshold)
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) {
        A acc = 0;
        for (int64_t s = 0; s < n; ++s) {
          const int64_t j = reverse ? n - 1 - s : s;
          const int64_t e = (o * n + j) * inner + i;
          const A v = static_cast<A>(load(px[e]));
          if (!exclusive) acc = static_cast<A>(acc + v);
          py[e] = store<T>(static_cast<C>(acc));
          if (exclusive) acc = static_cast<A>(acc + v);
        }
      }
  });
}

/// Element offsets of an AsStrided view (size, stride, storage_offset), in row-major
/// order of `size` (inference checked that they lie inside the tensor).
std::vector<int64_t> strided_offsets(const ir::Node& n) {
  const auto size = n.attrs.get_ints("size"), stride = n.attrs.get_ints("stride");
  const int64_t total = ir::numel_of(size);
  std::vector<int64_t> off(static_cast<size_t>(std::max<int64_t>(total, 0)));
  std::vector<int64_t> coord(size.size(), 0);
  int64_t o = n.attrs.get_int("storage_offset", 0);
  for (int64_t e = 0; e < total; ++e) {
    off[static_cast<size_t>(e)] = o;
    for (int d = static_cast<int>(size.size()) - 1; d >= 0; --d) {
      o += stride[d];
      if (++coord[d] < size[d]) break;
      o -= coord[d] * stride[d];
      coord[d] = 0;
    }
  }
  return off;
}

Status as_strided_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  const auto off = strided_offsets(c.node);
  with_word(ir::dtype_size(x.dtype()), [&](auto w) {
    using W = decltype(w);
    const W* px = static_cast<const W*>(x.raw());
    W* py = static_cast<W*>(y.raw());
    for (size_t e = 0; e < off.size(); ++e) py[e] = px[off[e]];
  });
  return Status::ok();
}

Status as_strided_scatter_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  const Tensor& src = c.in(1);
  Tensor& y = c.out(0);
  std::memcpy(y.raw(), x.raw(), x.nbytes());
  const auto off = strided_offsets(c.node);
  with_word(ir::dtype_size(x.dtype()), [&](auto w) {
    using W = decltype(w);
    const W* ps = static_cast<const W*>(src.raw());
    W* py = static_cast<W*>(y.raw());
    for (size_t e = 0; e < off.size(); ++e) py[off[e]] = ps[e];
  });
  return Status::ok();
}

}  // namespace

void register_indexing_kernels(ir::OpTable& t) {
  set_kernel_writing_all_outputs(t, "AsStrided", as_strided_kernel);
  set_kernel_writing_all_outputs(t, "AsStridedScatter", as_strided_scatter_kernel);
  set_kernel_writing_all_outputs(t, "GatherElements", gather_elements_kernel);
  set_kernel_writing_all_outputs(t, "ScatterElements", scatter_elements_kernel);
  set_kernel_writing_all_outputs(t, "GatherND", gather_nd_kernel);
  set_kernel(t, "GatherNDGrad", gather_nd_grad_kernel);
  set_kernel_writing_all_outputs(t, "ScatterND", scatter_nd_kernel);
  set_kernel_writing_all_outputs(t, "CumSum", cumsum_kernel);
}

}  // namespace kiln::runtime::kernels
