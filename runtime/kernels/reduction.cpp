// Eager kernels: reduction ops (ReduceSum, ReduceMean, ReduceMax, ArgMax).
//
// Each output element (OpenMP over outputs) walks the reduced sub-space of its input
// with an odometer over the reduced dims' strides. Floats accumulate in double and
// are stored in their dtype (bf16 rounded to nearest even); integers in int64. Float
// sums over leading axes follow ir::column_sum_partitions' order.
// Empty reductions give 0 (sum), NaN (mean) and the lowest value (max, -inf for
// floats), as ONNX-18 specifies. ReduceMax propagates NaN like torch.amax.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "ir/ops/nn.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels {

using ir::KernelContext;
using ir::Tensor;

namespace {

enum class RKind { sum, mean, max };

/// Kept dims/strides (output order) and reduced dims/strides of an input.
struct ReducePlan {
  std::vector<int64_t> kept_dims, kept_strides, red_dims, red_strides;
  int64_t red_count = 1;
};

ReducePlan plan(const std::vector<int64_t>& dims, const std::vector<int>& axes) {
  ReducePlan p;
  std::vector<int64_t> str = ir::strides_of(dims);
  for (int i = 0; i < static_cast<int>(dims.size()); ++i) {
    if (std::binary_search(axes.begin(), axes.end(), i)) {
      p.red_dims.push_back(dims[i]);
      p.red_strides.push_back(str[i]);
      p.red_count *= dims[i];
    } else {
      p.kept_dims.push_back(dims[i]);
      p.kept_strides.push_back(str[i]);
    }
  }
  return p;
}

template <RKind K>
Status reduce_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  Tensor& Y = ctx.out(0);
  auto spec = ir::reduce_spec(ctx.attrs(), ctx.has_input(1), ctx.has_input(1) ? ctx.inputs[1] : nullptr, X.rank());
  if (!spec) return ctx.fail(spec.message());
  if (spec->noop) {
    if (Y.nbytes() != X.nbytes()) return ctx.fail("output size mismatch");
    if (X.nbytes()) std::memcpy(Y.raw(), X.raw(), X.nbytes());
    return Status::ok();
  }
  ReducePlan p = plan(X.dims(), spec->axes);
  if (ir::numel_of(p.kept_dims) != Y.numel()) return ctx.fail("output size mismatch");
  if constexpr (K == RKind::max) {
    if (X.dtype() == ir::DType::boolean) {  // ReduceMax-20 on bool: any(), false over an empty set
      const auto* x = X.data<bool_t>();
      auto* y = Y.data<bool_t>();
      for (int64_t o = 0; o < Y.numel(); ++o) {
        int64_t base = 0, rem = o;
        for (int d = static_cast<int>(p.kept_dims.size()) - 1; d >= 0; --d) {
          base += (rem % p.kept_dims[d]) * p.kept_strides[d];
          rem /= p.kept_dims[d];
        }
        bool any = false;
        std::vector<int64_t> idx(p.red_dims.size(), 0);
        for (int64_t r = 0; r < p.red_count && !any; ++r) {
          int64_t off = base;
          for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * p.red_strides[d];
          any = x[off].v != 0;
          for (int d = static_cast<int>(idx.size()) - 1; d >= 0; --d) {
            if (++idx[d] < p.red_dims[d]) break;
            idx[d] = 0;
          }
        }
        y[o] = bool_t{uint8_t(any ? 1 : 0)};
      }
      return Status::ok();
    }
  }
  return dispatch_numeric(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using Acc = std::conditional_t<is_float_v<T>, double, int64_t>;
    const T* x = X.data<T>();
    T* y = Y.data<T>();
    const int64_t nout = Y.numel(), nred = p.red_count;
    const int rk = static_cast<int>(p.red_dims.size()), kk = static_cast<int>(p.kept_dims.size());
    // kiln's order for a float sum over leading axes (ir::column_sum_partitions, as the
    // generated kernels sum): partitions of contiguous rows, each in index order, the
    // partial sums then added in partition order.
    // Leading: every reduced dim of extent > 1 before every kept one (size-1 dims do not
    // count, as Kernel::column_split_parts decides for the generated kernel).
    bool leading = kk > 0 && rk > 0, seen_kept = false;
    for (int d = 0; d < X.rank() && leading; ++d) {
      if (X.dims()[static_cast<size_t>(d)] == 1) continue;
      const bool red = std::binary_search(spec->axes.begin(), spec->axes.end(), d);
      if (red && seen_kept) leading = false;
      seen_kept = seen_kept || !red;
    }
    leading = leading && seen_kept;
    const int64_t parts = K != RKind::max && is_float_v<T> && leading ? ir::column_sum_partitions(nred, nout) : 0;
    if (parts > 0) {
#pragma omp parallel for schedule(static) if (X.numel() > kParallelThreshold && nout > 1)
      for (int64_t o = 0; o < nout; ++o) {
        double acc = 0;
        for (int64_t q = 0; q < parts; ++q) {
          double part = 0;
          for (int64_t r = q * nred / parts, end = (q + 1) * nred / parts; r < end; ++r)
            part += static_cast<double>(load(x[r * nout + o]));
          acc = q == 0 ? part : acc + part;
        }
        if constexpr (K == RKind::mean) acc /= static_cast<double>(nred);
        y[o] = store<T>(static_cast<compute_t<T>>(acc));
      }
      return;
    }
#pragma omp parallel for schedule(static) if (X.numel() > kParallelThreshold && nout > 1)
    for (int64_t o = 0; o < nout; ++o) {
      int64_t base = 0, rem = o;
      for (int d = kk - 1; d >= 0; --d) {
        base += (rem % p.kept_dims[d]) * p.kept_strides[d];
        rem /= p.kept_dims[d];
      }
      Acc acc = K == RKind::max ? (std::numeric_limits<Acc>::has_infinity ? -std::numeric_limits<Acc>::infinity()
                                                                          : std::numeric_limits<Acc>::lowest())
                                : Acc(0);
      std::vector<int64_t> idx(rk, 0);
      int64_t off = base;
      for (int64_t r = 0; r < nred; ++r) {
        Acc v = static_cast<Acc>(load(x[off]));
        if constexpr (K == RKind::max) {
          if constexpr (is_float_v<T>) {
            if (std::isnan(v) || std::isnan(acc))
              acc = std::numeric_limits<double>::quiet_NaN();
            else if (v > acc)
              acc = v;
          } else {
            if (v > acc) acc = v;
          }
        } else {
          acc += v;
        }
        for (int d = rk - 1; d >= 0; --d) {  // odometer over reduced dims
          off += p.red_strides[d];
          if (++idx[d] < p.red_dims[d]) break;
          off -= idx[d] * p.red_strides[d];
          idx[d] = 0;
        }
      }
      if constexpr (K == RKind::mean) {
        if constexpr (is_float_v<T>)
          acc = nred ? acc / static_cast<double>(nred) : std::numeric_limits<double>::quiet_NaN();
        else
          acc = nred ? acc / nred : 0;
      }
      y[o] = store<T>(static_cast<compute_t<T>>(acc));
    }
  });
}

Status argmax_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  Tensor& Y = ctx.out(0);
  auto ax = ir::normalize_axis(ctx.attrs().get_int("axis", 0), X.rank());
  if (!ax) return ctx.fail(ax.message());
  const bool last = ctx.attrs().get_int("select_last_index", 0) != 0;
  int64_t outer = 1, A = X.rank() ? X.dim(*ax) : 1, inner = 1;
  for (int i = 0; i < X.rank(); ++i) {
    if (i < *ax)
      outer *= X.dim(i);
    else if (i > *ax)
      inner *= X.dim(i);
  }
  if (A == 0 && outer * inner > 0) return ctx.fail("ArgMax over an empty axis");
  return dispatch_numeric(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    int64_t* y = Y.data<int64_t>();
#pragma omp parallel for schedule(static) if (X.numel() > kParallelThreshold)
    for (int64_t oi = 0; oi < outer * inner; ++oi) {
      const int64_t o = oi / inner, i = oi % inner, base = o * A * inner + i;
      auto best = load(x[base]);
      int64_t arg = 0;
      for (int64_t a = 1; a < A; ++a) {
        auto v = load(x[base + a * inner]);
        if (last ? v >= best : v > best) {
          best = v;
          arg = a;
        }
      }
      y[oi] = arg;
    }
  });
}

}  // namespace

void register_reduction_kernels(ir::OpTable& t) {
  set_kernel(t, "ReduceSum", reduce_kernel<RKind::sum>);
  set_kernel(t, "ReduceMean", reduce_kernel<RKind::mean>);
  set_kernel(t, "ReduceMax", reduce_kernel<RKind::max>);
  set_kernel(t, "ArgMax", argmax_kernel);
}

}  // namespace kiln::runtime::kernels
