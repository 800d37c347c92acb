// attach_loss: every --loss kind against an independent float64 formula of PyTorch's
// definition (torch.nn.functional.cross_entropy with ignore_index and label_smoothing,
// mse_loss, l1_loss, binary_cross_entropy_with_logits, all with reduction "mean"),
// parameter selection with --freeze / --trainable, and tied weights getting one
// summed gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ir/op_table.h"
#include "ir/printer.h"
#include "passes/passes.h"
#include "passes/training_util.h"
#include "runtime/interpreter.h"

using namespace kiln;
using namespace kiln::ir;

namespace {

Tensor rnd(std::vector<int64_t> d, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::uniform_real_distribution<double> U(-1.5, 1.5);
  Tensor t(DType::f64, std::move(d));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, U(r));
  return t;
}

/// x (4, 3) -> MatMul W (3, 5) -> Add b (5) -> "logits" (4, 5).
std::unique_ptr<Graph> linear() {
  auto g = std::make_unique<Graph>();
  Value* x = g->add_input("x", DType::f64, Shape::of({4, 3}));
  Value* w = g->add_initializer("W", rnd({3, 5}, 1));
  Value* b = g->add_initializer("b", rnd({5}, 2));
  Node* mm = g->add_node("MatMul", "mm", {x, w}, {"xw"});
  Node* add = g->add_node("Add", "add", {mm->outputs[0], b}, {"logits"});
  EXPECT_TRUE(infer_graph(*g));
  g->outputs = {add->outputs[0]};
  return g;
}

/// The loss `loss` (label smoothing `eps`) of linear() on x and labels.
double run_loss(const std::string& loss, const Tensor& x, const Tensor& labels, double eps = 0.0) {
  auto g = linear();
  Tensor W = g->find_value("W")->data->clone(), b = g->find_value("b")->data->clone();
  passes::PassContext ctx;
  ctx.options.loss.loss = loss;
  ctx.options.loss.label_smoothing = eps;
  ctx.verify_each = true;
  Status st = passes::run_pipeline(*g, {"attach_loss"}, ctx);
  EXPECT_TRUE(st) << st.message();
  auto out = runtime::run_graph(*g, {{"x", x}, {"labels", labels}, {"W", W}, {"b", b}});
  EXPECT_TRUE(out) << out.message();
  return out ? (*out)["loss"].get_f64(0) : NAN;
}

/// Reference logits in float64.
std::vector<std::vector<double>> ref_logits(const Tensor& x) {
  auto g = linear();
  const Tensor& W = *g->find_value("W")->data;
  const Tensor& b = *g->find_value("b")->data;
  std::vector<std::vector<double>> z(4, std::vector<double>(5));
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j) {
      double s = b.get_f64(j);
      for (int k = 0; k < 3; ++k) s += x.get_f64(i * 3 + k) * W.get_f64(k * 5 + j);
      z[i][j] = s;
    }
  return z;
}

}  // namespace

TEST(AttachLoss, CrossEntropyWithIgnoreIndexAndLabelSmoothing) {
  Tensor x = rnd({4, 3}, 3);
  Tensor y = Tensor::from_i64({2, -100, 4, 0});
  auto z = ref_logits(x);
  for (double eps : {0.0, 0.1}) {
    double total = 0;
    int n = 0;
    for (int i = 0; i < 4; ++i) {
      int64_t t = y.get_i64(i);
      if (t == -100) continue;
      double m = *std::max_element(z[i].begin(), z[i].end()), s = 0;
      for (double v : z[i]) s += std::exp(v - m);
      double lse = m + std::log(s);
      double nll = lse - z[i][t], smooth = 0;
      for (double v : z[i]) smooth += (lse - v) / 5.0;
      total += (1 - eps) * nll + eps * smooth;
      ++n;
    }
    double want = total / n;
    double got = run_loss("cross_entropy", x, y, eps);
    EXPECT_NEAR(got, want, 1e-12) << "label_smoothing " << eps;
  }
}

TEST(AttachLoss, RegressionLosses) {
  Tensor x = rnd({4, 3}, 4), t = rnd({4, 5}, 5);
  auto z = ref_logits(x);
  double mse = 0, l1 = 0, bce = 0;
  Tensor tb(DType::f64, {4, 5});
  for (int i = 0; i < 20; ++i) tb.set_f64(i, i % 3 == 0 ? 1.0 : 0.0);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j) {
      double d = z[i][j] - t.get_f64(i * 5 + j);
      mse += d * d / 20;
      l1 += std::abs(d) / 20;
      double v = z[i][j], yy = tb.get_f64(i * 5 + j);
      bce += -(yy * std::log(1 / (1 + std::exp(-v))) + (1 - yy) * std::log(1 - 1 / (1 + std::exp(-v)))) / 20;
    }
  EXPECT_NEAR(run_loss("mse", x, t), mse, 1e-12);
  EXPECT_NEAR(run_loss("l1", x, t), l1, 1e-12);
  EXPECT_NEAR(run_loss("bce_with_logits", x, tb), bce, 1e-12);
}

TEST(AttachLoss, UnknownLossIsAnError) {
  auto g = linear();
  passes::PassContext ctx;
  ctx.options.loss.loss = "hinge";
  Status st = passes::run_pipeline(*g, {"attach_loss"}, ctx);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("hinge"), std::string::npos) << st.message();
}

TEST(AttachLoss, FreezeAndTrainableSelectParameters) {
  for (auto [opt, re, want] : std::vector<std::tuple<std::string, std::string, std::vector<std::string>>>{
           {"freeze", "^b$", {"W"}}, {"trainable", "^b$", {"b"}}, {"freeze", "", {"W", "b"}}}) {
    auto g = linear();
    passes::PassContext ctx;
    ctx.options.loss.loss = "cross_entropy";
    (opt == "freeze" ? ctx.options.loss.freeze : ctx.options.loss.trainable) = re;
    ASSERT_TRUE(passes::run_pipeline(*g, {"attach_loss"}, ctx));
    std::vector<std::string> got;
    for (auto& sb : g->state)
      if (sb.kind == "parameter") got.push_back(sb.input->name);
    EXPECT_EQ(got, want) << opt << "=" << re;
    // Frozen parameters stay initializers (constants of the program).
    for (const char* n : {"W", "b"})
      if (std::find(want.begin(), want.end(), n) == want.end()) {
        EXPECT_TRUE(g->find_value(n)->is_initializer()) << n;
      }
  }
}

TEST(Autodiff, TiedWeightGetsOneSummedGradient) {
  // loss = sum(W * x1) + sum(W * x2) : dL/dW = x1 + x2, with W used by two nodes.
  Graph g;
  Tensor w0 = rnd({2, 3}, 6), x1 = rnd({2, 3}, 7), x2 = rnd({2, 3}, 8);
  Value* w = g.add_input("W", DType::f64, Shape::of({2, 3}));
  g.state.push_back({"parameter", w, nullptr, std::make_shared<Tensor>(w0)});
  Value* a = g.add_initializer("x1", x1);
  Value* b = g.add_initializer("x2", x2);
  passes::Builder B(g, "f");
  auto k0 = passes::make_attrs({{"keepdims", int64_t(0)}});
  Value* l = B.op("Add", {B.op("ReduceSum", {B.op("Mul", {w, a})}, k0), B.op("ReduceSum", {B.op("Mul", {w, b})}, k0)},
                  {}, "loss");
  ASSERT_TRUE(B.status());
  g.outputs = {l};
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(g, {"autodiff"}, ctx));
  int adds = 0;
  for (auto& n : g.nodes())
    if (n->name.rfind("W/grad/sum", 0) == 0) ++adds;
  EXPECT_EQ(adds, 1) << "the two contributions must be summed in exactly one place\n" << graph_to_string(g);
  auto out = runtime::run_graph(g, {{"W", w0}});
  ASSERT_TRUE(out) << out.message();
  for (int i = 0; i < 6; ++i) EXPECT_NEAR((*out)["W.grad"].get_f64(i), x1.get_f64(i) + x2.get_f64(i), 1e-14);
}
