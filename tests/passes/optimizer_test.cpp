// The optimizer pass against independent float64 re-implementations of
// torch.optim.AdamW / torch.optim.SGD, torch.nn.utils.clip_grad_norm_ and the
// Hugging Face schedules (transformers.get_scheduler), on a quadratic loss whose
// gradient is known in closed form: loss = sum(w * w * c), dloss/dw = 2 c w.
#include <gtest/gtest.h>

#include <cmath>

#include "ir/op_table.h"
#include "passes/passes.h"
#include "passes/training_util.h"
#include "runtime/interpreter.h"

using namespace kiln;
using namespace kiln::ir;
using passes::make_attrs;

namespace {

struct Setup {
  std::unique_ptr<Graph> g;
};

std::unique_ptr<Graph> quadratic(const std::vector<double>& w0, const std::vector<double>& b0) {
  auto g = std::make_unique<Graph>();
  Tensor w(DType::f64, {2, 2}), b(DType::f64, {2}), c(DType::f64, {2, 2});
  for (int i = 0; i < 4; ++i) w.set_f64(i, w0[i]), c.set_f64(i, 0.5 + i);
  for (int i = 0; i < 2; ++i) b.set_f64(i, b0[i]);
  Value* wv = g->add_input("w", DType::f64, Shape::of({2, 2}));
  Value* bv = g->add_input("b", DType::f64, Shape::of({2}));
  g->state.push_back({"parameter", wv, nullptr, std::make_shared<Tensor>(w)});
  g->state.push_back({"parameter", bv, nullptr, std::make_shared<Tensor>(b)});
  Value* cv = g->add_initializer("c", c);
  passes::Builder B(*g, "fwd");
  auto k0 = make_attrs({{"keepdims", int64_t(0)}});
  Value* l1 = B.op("ReduceSum", {B.op("Mul", {B.op("Mul", {wv, wv}), cv})}, k0);
  Value* l2 = B.op("ReduceSum", {B.op("Mul", {bv, bv})}, k0);
  Value* loss = B.op("Add", {l1, l2}, {}, "loss");
  EXPECT_TRUE(B.status()) << B.status().message();
  g->outputs = {loss};
  return g;
}

double hf_lr(const std::string& sched, double base, int64_t t, int64_t total, int64_t warm) {
  if (sched == "constant") return base;
  if (t < warm) return base * double(t) / double(std::max<int64_t>(1, warm));
  if (sched == "constant_with_warmup") return base;
  if (sched == "linear") return base * std::max(0.0, double(total - t) / double(std::max<int64_t>(1, total - warm)));
  double progress = double(t - warm) / double(std::max<int64_t>(1, total - warm));
  return base * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * 0.5 * 2.0 * progress)));
}

struct Run {
  std::vector<double> losses, lrs, norms;
  std::vector<double> w, b;
};

Run run_kiln(const passes::OptimizerOptions& opts, int steps) {
  auto g = quadratic({0.3, -0.7, 1.1, 0.2}, {0.5, -0.25});
  passes::PassContext ctx;
  ctx.options.optimizer = opts;
  ctx.verify_each = true;
  Status st = passes::run_pipeline(*g, {"autodiff", "optimizer", "canonicalize"}, ctx);
  EXPECT_TRUE(st) << st.message();
  std::map<std::string, Tensor> state;
  for (auto& sb : g->state) state[sb.input->name] = sb.initial->clone();
  Run r;
  for (int s = 0; s < steps; ++s) {
    auto out = runtime::run_graph(*g, state);
    EXPECT_TRUE(out) << out.message();
    if (!out) return r;
    r.losses.push_back((*out)["loss"].get_f64(0));
    r.lrs.push_back((*out)["learning_rate"].get_f64(0));
    // Without clipping there is no norm (as Hugging Face's Trainer): NaN, and the
    // reference's NaN (compare) then requires that it is absent.
    r.norms.push_back(out->count("grad_norm") ? out->at("grad_norm").get_f64(0) : std::nan(""));
    for (auto& sb : g->state) state[sb.input->name] = (*out)[sb.output->name];
  }
  for (int i = 0; i < 4; ++i) r.w.push_back(state["w"].get_f64(i));
  for (int i = 0; i < 2; ++i) r.b.push_back(state["b"].get_f64(i));
  return r;
}

/// Reference: PyTorch semantics written out in float64.
Run run_reference(const std::string& optim, const std::string& sched, double lr0, double wd, double max_norm,
                  double momentum, bool nesterov, int steps, int64_t total, int64_t warm) {
  std::vector<double> w = {0.3, -0.7, 1.1, 0.2}, b = {0.5, -0.25}, c = {0.5, 1.5, 2.5, 3.5};
  std::vector<double> mw(4, 0), vw(4, 0), mb(2, 0), vb(2, 0), bufw(4, 0), bufb(2, 0);
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  Run r;
  for (int t = 0; t < steps; ++t) {
    double loss = 0;
    std::vector<double> gw(4), gb(2);
    for (int i = 0; i < 4; ++i) loss += w[i] * w[i] * c[i], gw[i] = 2 * c[i] * w[i];
    for (int i = 0; i < 2; ++i) loss += b[i] * b[i], gb[i] = 2 * b[i];
    double norm = 0;
    for (double g : gw) norm += g * g;
    for (double g : gb) norm += g * g;
    norm = std::sqrt(norm);
    if (max_norm > 0) {
      double coef = std::min(1.0, max_norm / (norm + 1e-6));
      for (double& g : gw) g *= coef;
      for (double& g : gb) g *= coef;
    }
    double lr = hf_lr(sched, lr0, t, total, warm);
    r.losses.push_back(loss);
    r.lrs.push_back(lr);
    r.norms.push_back(max_norm > 0 ? norm : std::nan(""));  // no clipping: no norm reported
    auto update = [&](std::vector<double>& p, std::vector<double>& g, std::vector<double>& m, std::vector<double>& v,
                      std::vector<double>& buf, bool decay) {
      for (size_t i = 0; i < p.size(); ++i) {
        if (optim == "adamw_torch") {
          if (decay) p[i] -= lr * wd * p[i];
          m[i] = b1 * m[i] + (1 - b1) * g[i];
          v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
          double bc1 = 1 - std::pow(b1, t + 1), bc2 = 1 - std::pow(b2, t + 1);
          p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
        } else {
          double d = g[i] + (decay ? wd * p[i] : 0.0);
          if (momentum != 0) {
            buf[i] = t == 0 ? d : momentum * buf[i] + d;
            d = nesterov ? d + momentum * buf[i] : buf[i];
          }
          p[i] -= lr * d;
        }
      }
    };
    update(w, gw, mw, vw, bufw, true);
    update(b, gb, mb, vb, bufb, false);  // 1-D: no weight decay (HF grouping)
  }
  r.w = w;
  r.b = b;
  return r;
}

void compare(const Run& a, const Run& ref) {
  ASSERT_EQ(a.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], ref.losses[i], 1e-10 * std::max(1.0, std::abs(ref.losses[i]))) << "step " << i;
    EXPECT_NEAR(a.lrs[i], ref.lrs[i], 1e-12) << "lr at step " << i;
    if (std::isnan(ref.norms[i]))
      EXPECT_TRUE(std::isnan(a.norms[i])) << "grad_norm output without clipping at step " << i;
    else
      EXPECT_NEAR(a.norms[i], ref.norms[i], 1e-10) << "grad_norm at step " << i;
  }
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(a.w[i], ref.w[i], 1e-10);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(a.b[i], ref.b[i], 1e-10);
}

passes::OptimizerOptions opts(const std::string& optim, const std::string& sched, double lr, double wd, double max_norm,
                              int64_t total, int64_t warm, double momentum = 0, bool nesterov = false) {
  passes::OptimizerOptions o;
  o.optim = optim;
  o.lr_scheduler_type = sched;
  o.learning_rate = lr;
  o.weight_decay = wd;
  o.max_grad_norm = max_norm;
  o.total_steps = total;
  o.warmup_steps = warm;
  o.momentum = momentum;
  o.nesterov = nesterov;
  return o;
}

}  // namespace

TEST(Optimizer, AdamWLinearWarmupClipped) {
  compare(run_kiln(opts("adamw_torch", "linear", 0.05, 0.1, 1.0, 12, 3), 12),
          run_reference("adamw_torch", "linear", 0.05, 0.1, 1.0, 0, false, 12, 12, 3));
}
TEST(Optimizer, AdamWCosineNoClip) {
  compare(run_kiln(opts("adamw_torch", "cosine", 0.02, 0.0, 0.0, 10, 2), 10),
          run_reference("adamw_torch", "cosine", 0.02, 0.0, 0.0, 0, false, 10, 10, 2));
}
TEST(Optimizer, SgdMomentumConstantWithWarmup) {
  compare(run_kiln(opts("sgd", "constant_with_warmup", 0.05, 0.01, 0.5, 8, 2, 0.9), 8),
          run_reference("sgd", "constant_with_warmup", 0.05, 0.01, 0.5, 0.9, false, 8, 8, 2));
}
TEST(Optimizer, SgdNesterovConstant) {
  compare(run_kiln(opts("sgd", "constant", 0.03, 0.0, 0.0, 6, 0, 0.8, true), 6),
          run_reference("sgd", "constant", 0.03, 0.0, 0.0, 0.8, true, 6, 6, 0));
}
TEST(Optimizer, UnknownOptimizerIsAnError) {
  auto g = quadratic({1, 1, 1, 1}, {1, 1});
  passes::PassContext ctx;
  ctx.options.optimizer = opts("adafactor", "linear", 0.1, 0, 1, 1, 0);
  Status st = passes::run_pipeline(*g, {"autodiff", "optimizer"}, ctx);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("adafactor"), std::string::npos) << st.message();
}
