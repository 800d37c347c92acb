// Eager kernels: loss ops and their backward ops (see ir/ops/loss.cpp).
//
// Scores/input (N, C, d...) are viewed as (N, C, D) and labels as (N, D). Each
// position (n, d) has weight w[label] (1 without weights; 0 when label ==
// ignore_index). reduction=mean divides by the sum of those weights (NaN when every
// position is ignored, as PyTorch). Log-softmax is computed in double with the
// max subtracted. Labels outside [0, C) that are not ignore_index are an error
// naming the node.
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "runtime/kernels/kernels.h"
#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels {

using ir::DType;
using ir::KernelContext;
using ir::Tensor;

namespace {

template <typename T>
inline double ld(const T* p, int64_t i) {
  return static_cast<double>(load(p[i]));
}
template <typename T>
inline void st(T* p, int64_t i, double v) {
  p[i] = store<T>(static_cast<compute_t<T>>(v));
}

/// Labels, weights and reduction of a loss node, with inputs starting at `o`.
struct LossSetup {
  int64_t N = 0, C = 0, D = 1;
  std::vector<int64_t> labels;  // (N * D)
  std::vector<double> pos_w;    // (N * D): w[label], 0 for ignored
  double wsum = 0;
  std::string reduction;
};

/// Labels (any shape) against [0, C), ignore_index (attribute) exempt: the error names the
/// first bad label and its flat position, and its index in `fed_dims` when given (the
/// labels' dims before a flattening Reshape, CheckLabels' label_dims).
Status check_label_range(const KernelContext& ctx, const Tensor& L, int64_t C,
                         const std::vector<int64_t>& fed_dims = {}) {
  const bool has_ignore = ctx.attrs().has("ignore_index");
  const int64_t ignore = ctx.attrs().get_int("ignore_index", 0);
  for (int64_t i = 0; i < L.numel(); ++i) {
    const int64_t l = L.get_i64(i);
    if ((has_ignore && l == ignore) || (l >= 0 && l < C)) continue;
    std::string where = std::to_string(i);
    if (fed_dims.size() > 1 && ir::numel_of(fed_dims) == L.numel()) {
      std::vector<int64_t> at(fed_dims.size());
      for (int64_t d = static_cast<int64_t>(fed_dims.size()) - 1, r = i; d >= 0; --d) {
        at[static_cast<size_t>(d)] = r % fed_dims[static_cast<size_t>(d)];
        r /= fed_dims[static_cast<size_t>(d)];
      }
      where += " (index " + ir::dims_to_string(at) + " of the labels " + ir::dims_to_string(fed_dims) + ")";
    }
    return ctx.fail("label " + std::to_string(l) + " at position " + where + " is outside [0, " + std::to_string(C) +
                    ")");
  }
  return Status::ok();
}

Expected<LossSetup> setup(const KernelContext& ctx, int o) {
  const Tensor& S = ctx.in(o);
  const Tensor& L = ctx.in(o + 1);
  LossSetup s;
  s.reduction = ctx.attrs().get_string("reduction", "mean");
  s.N = S.dim(0);
  s.C = S.dim(1);
  s.D = (s.N * s.C) != 0 ? S.numel() / (s.N * s.C) : 0;
  if (L.numel() != s.N * s.D) return ctx.fail("labels " + ir::dims_to_string(L.dims()) + " do not match scores");
  const Tensor* W = ctx.has_input(o + 2) ? ctx.inputs[o + 2] : nullptr;
  if (W && W->numel() != s.C) return ctx.fail("weights must have C elements");
  KILN_RETURN_IF_ERROR(check_label_range(ctx, L, s.C));
  const bool has_ignore = ctx.attrs().has("ignore_index");
  const int64_t ignore = ctx.attrs().get_int("ignore_index", 0);
  s.labels = L.to_i64_vector();
  s.pos_w.assign(s.labels.size(), 0.0);
  for (size_t i = 0; i < s.labels.size(); ++i) {
    const int64_t l = s.labels[i];
    if (has_ignore && l == ignore) continue;
    s.pos_w[i] = W ? W->get_f64(l) : 1.0;
    s.wsum += s.pos_w[i];
  }
  return s;
}

/// Writes per-position losses `lp` (N * D) reduced into `out`.
void write_loss(const LossSetup& s, const std::vector<double>& lp, Tensor& out) {
  if (s.reduction == "none") {
    for (size_t i = 0; i < lp.size(); ++i) out.set_f64(static_cast<int64_t>(i), lp[i]);
    return;
  }
  double total = 0;
  for (double v : lp) total += v;
  out.set_f64(0, s.reduction == "sum" ? total : total / s.wsum);
}

/// Gradient factor of position i: w[label] * dLoss (/ wsum for mean).
double grad_coef(const LossSetup& s, const Tensor& dL, int64_t i) {
  if (s.pos_w[i] == 0.0) return 0.0;
  if (s.reduction == "none") return s.pos_w[i] * dL.get_f64(i);
  double g = dL.get_f64(0) * s.pos_w[i];
  return s.reduction == "mean" ? g / s.wsum : g;
}

/// Log-softmax over C of position (n, d) of scores viewed as (N, C, D), into lp (C).
template <typename T>
void log_softmax_at(const T* x, const LossSetup& s, int64_t n, int64_t d, double* lp) {
  const int64_t base = n * s.C * s.D + d;
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < s.C; ++c) m = std::max(m, ld(x, base + c * s.D));
  double sum = 0;
  for (int64_t c = 0; c < s.C; ++c) sum += std::exp(ld(x, base + c * s.D) - m);
  double ls = std::log(sum) + m;
  for (int64_t c = 0; c < s.C; ++c) lp[c] = ld(x, base + c * s.D) - ls;
}

Status sce_kernel(KernelContext& ctx) {
  auto s = setup(ctx, 0);
  if (!s) return s.status();
  const Tensor& X = ctx.in(0);
  Tensor* logp_out = ctx.outputs.size() > 1 && ctx.outputs[1].defined() ? &ctx.outputs[1] : nullptr;
  std::vector<double> lp(static_cast<size_t>(s->N * s->D), 0.0);
  Status st_ = dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    T* lpo = logp_out ? logp_out->data<T>() : nullptr;
#pragma omp parallel if (X.numel() > kParallelThreshold)
    {
      std::vector<double> row(static_cast<size_t>(s->C));  // one buffer per thread
#pragma omp for schedule(static)
      for (int64_t i = 0; i < s->N * s->D; ++i) {
        const int64_t n = i / s->D, d = i % s->D;
        log_softmax_at(x, *s, n, d, row.data());
        if (lpo)
          for (int64_t c = 0; c < s->C; ++c) st(lpo, n * s->C * s->D + c * s->D + d, row[c]);
        lp[i] = s->pos_w[i] == 0.0 ? 0.0 : -row[s->labels[i]] * s->pos_w[i];
      }
    }
  });
  KILN_RETURN_IF_ERROR(st_);
  write_loss(*s, lp, ctx.out(0));
  return Status::ok();
}

Status nll_kernel(KernelContext& ctx) {
  auto s = setup(ctx, 0);
  if (!s) return s.status();
  const Tensor& X = ctx.in(0);
  std::vector<double> lp(static_cast<size_t>(s->N * s->D), 0.0);
  for (int64_t i = 0; i < s->N * s->D; ++i) {
    if (s->pos_w[i] == 0.0) continue;
    const int64_t n = i / s->D, d = i % s->D;
    lp[i] = -X.get_f64(n * s->C * s->D + s->labels[i] * s->D + d) * s->pos_w[i];
  }
  write_loss(*s, lp, ctx.out(0));
  return Status::ok();
}

Status check_dloss(const KernelContext& ctx, const LossSetup& s) {
  const Tensor& dL = ctx.in(0);
  if (s.reduction == "none" ? dL.numel() != s.N * s.D : dL.numel() != 1)
    return ctx.fail("dLoss " + ir::dims_to_string(dL.dims()) + " does not match reduction '" + s.reduction + "'");
  return Status::ok();
}

Status sce_grad_kernel(KernelContext& ctx) {
  auto s = setup(ctx, 1);
  if (!s) return s.status();
  KILN_RETURN_IF_ERROR(check_dloss(ctx, *s));
  const Tensor& dL = ctx.in(0);
  const Tensor& X = ctx.in(1);
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    T* dx = ctx.out(0).data<T>();
#pragma omp parallel if (X.numel() > kParallelThreshold)
    {
      std::vector<double> e(static_cast<size_t>(s->C));  // exp(x - max) of one row, per thread
#pragma omp for schedule(static)
      for (int64_t i = 0; i < s->N * s->D; ++i) {
        const int64_t n = i / s->D, d = i % s->D;
        const int64_t base = n * s->C * s->D + d;
        const double coef = grad_coef(*s, dL, i);
        if (coef == 0.0) {
          for (int64_t c = 0; c < s->C; ++c) st(dx, base + c * s->D, 0.0);
          continue;
        }
        // softmax = exp(x - max) / sum, each exponential computed once.
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t c = 0; c < s->C; ++c) m = std::max(m, ld(x, base + c * s->D));
        double sum = 0;
        for (int64_t c = 0; c < s->C; ++c) {
          e[static_cast<size_t>(c)] = std::exp(ld(x, base + c * s->D) - m);
          sum += e[static_cast<size_t>(c)];
        }
        const double scale = coef / sum;
        for (int64_t c = 0; c < s->C; ++c)
          st(dx, base + c * s->D, scale * e[static_cast<size_t>(c)] - (c == s->labels[i] ? coef : 0.0));
      }
    }
  });
}

Status nll_grad_kernel(KernelContext& ctx) {
  auto s = setup(ctx, 1);
  if (!s) return s.status();
  KILN_RETURN_IF_ERROR(check_dloss(ctx, *s));
  const Tensor& dL = ctx.in(0);
  Tensor& dX = ctx.out(0);  // zero-initialised
  for (int64_t i = 0; i < s->N * s->D; ++i) {
    const double coef = grad_coef(*s, dL, i);
    if (coef == 0.0) continue;
    const int64_t n = i / s->D, d = i % s->D;
    dX.set_f64(n * s->C * s->D + s->labels[i] * s->D + d, -coef);
  }
  return Status::ok();
}

Status check_labels_kernel(KernelContext& ctx) {
  KILN_RETURN_IF_ERROR(
      check_label_range(ctx, ctx.in(0), ctx.attrs().get_int("num_classes", 0), ctx.attrs().get_ints("label_dims")));
  std::memcpy(ctx.out(0).raw(), ctx.in(0).raw(), ctx.in(0).nbytes());
  return Status::ok();
}

/// SoftmaxCrossEntropyRows: per row, minus the sum of the log-softmax (log_softmax_at,
/// as the SoftmaxCrossEntropyLoss kernel) over the classes c with classes[c] == label:
/// the one -log p[label] for classes = 0..C-1, as the generated row rule computes it.
Status sce_rows_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  LossSetup geo;  // the (N, C) geometry log_softmax_at reads (input 2 is no weight tensor)
  geo.N = X.dim(0);
  geo.C = X.dim(1);
  if (ctx.in(1).numel() != geo.N)
    return ctx.fail("labels " + ir::dims_to_string(ctx.in(1).dims()) + " do not match scores");
  if (ctx.in(2).numel() != geo.C)
    return ctx.fail("classes " + ir::dims_to_string(ctx.in(2).dims()) + " do not match scores");
  KILN_RETURN_IF_ERROR(check_label_range(ctx, ctx.in(1), geo.C));
  const bool has_ignore = ctx.attrs().has("ignore_index");
  const int64_t ignore = ctx.attrs().get_int("ignore_index", 0);
  const std::vector<int64_t> labels = ctx.in(1).to_i64_vector(), classes = ctx.in(2).to_i64_vector();
  const LossSetup* s = &geo;
  double* out = ctx.out(0).data<double>();
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
#pragma omp parallel if (X.numel() > kParallelThreshold)
    {
      std::vector<double> row(static_cast<size_t>(s->C));  // one buffer per thread
#pragma omp for schedule(static)
      for (int64_t n = 0; n < s->N; ++n) {
        const int64_t l = labels[static_cast<size_t>(n)];
        out[n] = 0.0;
        if (has_ignore && l == ignore) continue;
        log_softmax_at(x, *s, n, 0, row.data());
        for (int64_t c = 0; c < s->C; ++c)
          if (classes[static_cast<size_t>(c)] == l) out[n] -= row[static_cast<size_t>(c)];
      }
    }
  });
}

}  // namespace

void register_loss_kernels(ir::OpTable& t) {
  set_kernel(t, "SoftmaxCrossEntropyLoss", sce_kernel);
  set_kernel(t, "CheckLabels", check_labels_kernel);
  set_kernel(t, "SoftmaxCrossEntropyRows", sce_rows_kernel);
  set_kernel(t, "NegativeLogLikelihoodLoss", nll_kernel);
  set_kernel(t, "SoftmaxCrossEntropyLossGrad", sce_grad_kernel);
  set_kernel(t, "NegativeLogLikelihoodLossGrad", nll_grad_kernel);
}

}  // namespace kiln::runtime::kernels
