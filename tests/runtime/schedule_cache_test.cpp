// runtime::ScheduleCache (RunOptions::schedule): per-graph executor facts (each node's
// op entry, output types and the values released after it) computed on a graph's first
// run and reused. Reuse must give the eager results of the same graph run without it,
// and a graph whose node list changed since must get fresh facts, not stale ones. A
// node's kernel cache slot (KernelContext::cache: a Conv's oneDNN primitive) must not
// serve inputs of other dims.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ir/graph.h"
#include "ir/op_table.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;
using ir::Tensor;

namespace {

Tensor ramp(int64_t n, double start) {
  Tensor t(DType::f32, {n});
  for (int64_t i = 0; i < n; ++i) t.set_f64(i, start + 0.5 * static_cast<double>(i));
  return t;
}

}  // namespace

TEST(ScheduleCache, ReusedFactsGiveTheSameResultsAndFollowGraphChanges) {
  runtime::register_eager_kernels();
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({8}));
  ir::Value* r = g.add_node("Relu", "relu", {x}, {"r"})->outputs[0];
  g.outputs.push_back(g.add_node("Neg", "neg", {r}, {"y"})->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());

  runtime::ScheduleCache cache;
  runtime::RunOptions cached;
  cached.schedule = &cache;
  for (double start : {-2.0, -1.0, 1.0}) {  // the second and third runs reuse the facts
    std::map<std::string, Tensor> feeds{{"x", ramp(8, start)}};
    auto a = runtime::run_graph(g, feeds);
    auto b = runtime::run_graph(g, feeds, cached);
    ASSERT_TRUE(a && b) << a.message() << b.message();
    for (int64_t i = 0; i < 8; ++i) {
      const double want = -std::max(0.0, start + 0.5 * static_cast<double>(i));  // float64 reference
      EXPECT_EQ(a->at("y").get_f64(i), want) << i;
      EXPECT_EQ(b->at("y").get_f64(i), want) << i;
    }
  }

  // A node appended after the cached runs: its facts must be computed, so z = exp(y) is
  // produced (stale facts would have no entry for it and index past their node list).
  ir::Value* z = g.add_node("Exp", "exp", {g.outputs[0]}, {"z"})->outputs[0];
  g.outputs.push_back(z);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::map<std::string, Tensor> feeds{{"x", ramp(8, -1.0)}};
  auto c = runtime::run_graph(g, feeds, cached);
  ASSERT_TRUE(c) << c.message();
  ASSERT_TRUE(c->count("z"));
  for (int64_t i = 0; i < 8; ++i) {
    const double y = -std::max(0.0, -1.0 + 0.5 * static_cast<double>(i));
    EXPECT_NEAR(c->at("z").get_f64(i), std::exp(y), 1e-6 * std::exp(y)) << i;  // f32 exp: 1e-6 relative
  }
}

TEST(ScheduleCache, ReplacedNodeIsSeen) {
  // Same node count and first node, a different second node: the facts must follow.
  runtime::register_eager_kernels();
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({4}));
  ir::Value* r = g.add_node("Relu", "relu", {x}, {"r"})->outputs[0];
  ir::Node* neg = g.add_node("Neg", "neg", {r}, {"y"});
  g.outputs.push_back(neg->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  runtime::ScheduleCache cache;
  runtime::RunOptions ro;
  ro.schedule = &cache;
  std::map<std::string, Tensor> feeds{{"x", ramp(4, 0.5)}};
  ASSERT_TRUE(runtime::run_graph(g, feeds, ro));
  g.outputs.clear();
  g.remove_node(neg);
  g.outputs.push_back(g.add_node("Exp", "exp", {r}, {"z"})->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  auto out = runtime::run_graph(g, feeds, ro);
  ASSERT_TRUE(out) << out.message();
  ASSERT_TRUE(out->count("z"));
  for (int64_t i = 0; i < 4; ++i) {
    const double want = std::exp(0.5 + 0.5 * static_cast<double>(i));
    EXPECT_NEAR(out->at("z").get_f64(i), want, 1e-6 * want) << i;  // f32 exp: 1e-6 relative
  }
}

TEST(ScheduleCache, GraphWithoutInferredTypesStillInfersPerRun) {
  // Values of a graph never passed through infer_graph have undefined dtypes: the
  // executor must size outputs by the op's inference on the actual inputs.
  runtime::register_eager_kernels();
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({6}));
  g.outputs.push_back(
      g.add_node("Neg", "neg", {g.add_node("Relu", "relu", {x}, {"r"})->outputs[0]}, {"y"})->outputs[0]);
  runtime::ScheduleCache cache;
  runtime::RunOptions ro;
  ro.schedule = &cache;
  std::map<std::string, Tensor> feeds{{"x", ramp(6, -1.0)}};
  const runtime::RunOptions plain;
  for (const runtime::RunOptions* o : std::vector<const runtime::RunOptions*>{&plain, &ro, &ro}) {
    auto out = runtime::run_graph(g, feeds, *o);
    ASSERT_TRUE(out) << out.message();
    const Tensor& y = out->at("y");
    ASSERT_EQ(y.dtype(), DType::f32);
    ASSERT_EQ(y.dims(), std::vector<int64_t>{6});
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(y.get_f64(i), -std::max(0.0, -1.0 + 0.5 * static_cast<double>(i))) << i;
  }
}

TEST(ScheduleCache, ConvPrimitiveKeptPerNodeFollowsTheBatch) {
  // A Conv with a symbolic batch run with one cache at batch 2, 3 and 2 again: each run
  // must equal a float64 direct convolution of its own inputs (a primitive kept from the
  // batch-2 run would read and write the wrong extents at batch 3).
  runtime::register_eager_kernels();
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape({ir::Dim(std::string("n")), 2, 5, 5}));
  ir::Value* w = g.add_input("w", DType::f32, ir::Shape::of({3, 2, 3, 3}));
  ir::Attributes a;
  a.set("pads", std::vector<int64_t>{1, 1, 1, 1});
  ir::Node* conv = g.add_node("Conv", "conv", {x, w}, {"y"});
  conv->attrs = a;
  g.outputs.push_back(conv->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  runtime::ScheduleCache cache;
  runtime::RunOptions ro;
  ro.schedule = &cache;
  Tensor wt(DType::f32, {3, 2, 3, 3});
  for (int64_t i = 0; i < wt.numel(); ++i) wt.set_f64(i, 0.25 * static_cast<double>(i % 7) - 0.5);
  for (int64_t n : {2, 3, 2}) {
    Tensor xt(DType::f32, {n, 2, 5, 5});
    for (int64_t i = 0; i < xt.numel(); ++i) xt.set_f64(i, 0.125 * static_cast<double>((i * 5 + n) % 11) - 0.6);
    auto out = runtime::run_graph(g, {{"x", xt}, {"w", wt}}, ro);
    ASSERT_TRUE(out) << out.message();
    const Tensor& y = out->at("y");
    ASSERT_EQ(y.dims(), (std::vector<int64_t>{n, 3, 5, 5}));
    for (int64_t b = 0; b < n; ++b)
      for (int64_t m = 0; m < 3; ++m)
        for (int64_t i = 0; i < 5; ++i)
          for (int64_t j = 0; j < 5; ++j) {
            double ref = 0;
            for (int64_t c = 0; c < 2; ++c)
              for (int64_t ki = 0; ki < 3; ++ki)
                for (int64_t kj = 0; kj < 3; ++kj) {
                  const int64_t ii = i + ki - 1, jj = j + kj - 1;
                  if (ii < 0 || ii >= 5 || jj < 0 || jj >= 5) continue;
                  ref += xt.get_f64(((b * 2 + c) * 5 + ii) * 5 + jj) * wt.get_f64(((m * 2 + c) * 3 + ki) * 3 + kj);
                }
            // f32 products and sums of 18 terms below 1: 1e-5 absolute.
            EXPECT_NEAR(y.get_f64(((b * 3 + m) * 5 + i) * 5 + j), ref, 1e-5) << "batch " << n;
          }
  }
}

TEST(ScheduleCache, MatMulAndGemmProductsKeptPerNodeFollowTheRows) {
  // MatMul (N, 5) x (5, 3) and Gemm (N, 5) x (5, 3) + C (3) with a symbolic N, run with
  // one cache at N = 2, 4 and 2 again: each run must equal a float64 product of its own
  // inputs (a oneDNN product kept from the N = 2 run would read and write 2 rows at N = 4).
  runtime::register_eager_kernels();
  ir::Graph g;
  ir::Value* a = g.add_input("a", DType::f32, ir::Shape({ir::Dim(std::string("n")), 5}));
  ir::Value* b = g.add_input("b", DType::f32, ir::Shape::of({5, 3}));
  ir::Value* c = g.add_input("c", DType::f32, ir::Shape::of({3}));
  g.outputs.push_back(g.add_node("MatMul", "mm", {a, b}, {"y"})->outputs[0]);
  g.outputs.push_back(g.add_node("Gemm", "gemm", {a, b, c}, {"z"})->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  runtime::ScheduleCache cache;
  runtime::RunOptions ro;
  ro.schedule = &cache;
  Tensor bt(DType::f32, {5, 3}), ct(DType::f32, {3});
  for (int64_t i = 0; i < bt.numel(); ++i) bt.set_f64(i, 0.25 * static_cast<double>(i % 7) - 0.75);
  for (int64_t i = 0; i < ct.numel(); ++i) ct.set_f64(i, 0.5 * static_cast<double>(i) - 0.25);
  for (int64_t n : {2, 4, 2}) {
    Tensor at(DType::f32, {n, 5});
    for (int64_t i = 0; i < at.numel(); ++i) at.set_f64(i, 0.125 * static_cast<double>((i * 3 + n) % 9) - 0.5);
    auto out = runtime::run_graph(g, {{"a", at}, {"b", bt}, {"c", ct}}, ro);
    ASSERT_TRUE(out) << out.message();
    ASSERT_EQ(out->at("y").dims(), (std::vector<int64_t>{n, 3}));
    ASSERT_EQ(out->at("z").dims(), (std::vector<int64_t>{n, 3}));
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < 3; ++j) {
        double ref = 0;
        for (int64_t k = 0; k < 5; ++k) ref += at.get_f64(r * 5 + k) * bt.get_f64(k * 3 + j);
        // f32 products and sums of 5 terms below 1: 1e-6 absolute.
        EXPECT_NEAR(out->at("y").get_f64(r * 3 + j), ref, 1e-6) << "MatMul, rows " << n;
        EXPECT_NEAR(out->at("z").get_f64(r * 3 + j), ref + ct.get_f64(j), 1e-6) << "Gemm, rows " << n;
      }
  }
}
