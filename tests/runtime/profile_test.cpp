// The op-level profiler (runtime/profile.h, RunOptions::profile): exact call counts per
// key on hand-built graphs (MatMul + Relu + ReduceSum; the same inside an
// AccumulationLoop, whose body nodes are keys and the loop itself is not; a fused
// pointwise group run eagerly and through its generated kernel), positive times whose
// sum is at most the wall time of the runs, results unchanged by profiling (checked
// against a float64 reference), and the table's sorting, collapsed rows and totals.
#include "runtime/profile.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "codegen/cpu/program.h"
#include "ir/op_table.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;
using ir::Tensor;

namespace {

constexpr int64_t M = 8, K = 16, N = 32;

float x_at(int64_t i) { return static_cast<float>(std::sin(0.37 * static_cast<double>(i))); }
float w_at(int64_t i) { return static_cast<float>(std::cos(0.11 * static_cast<double>(i)) * 0.5); }

Tensor x_tensor(int64_t rows) {
  Tensor x(DType::f32, {rows, K});
  for (int64_t i = 0; i < rows * K; ++i) x.data<float>()[i] = x_at(i);
  return x;
}

Tensor w_tensor() {
  Tensor w(DType::f32, {K, N});
  for (int64_t i = 0; i < K * N; ++i) w.data<float>()[i] = w_at(i);
  return w;
}

/// float64 reference of sum over rows of relu(x @ W): (N,).
std::vector<double> reference(int64_t rows) {
  std::vector<double> y(N, 0.0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double h = 0;
      for (int64_t k = 0; k < K; ++k) h += static_cast<double>(x_at(m * K + k)) * static_cast<double>(w_at(k * N + n));
      y[n] += std::max(h, 0.0);
    }
  return y;
}

void expect_matches_reference(const Tensor& y, int64_t rows) {
  ASSERT_EQ(y.dims(), (std::vector<int64_t>{N}));
  const auto ref = reference(rows);
  for (int64_t n = 0; n < N; ++n)  // float32 sums of <= 16 rows of 16 products: 1e-4 relative
    EXPECT_NEAR(y.get_f64(n), ref[n], 1e-4 * std::max(1.0, std::fabs(ref[n]))) << "element " << n;
}

/// y = ReduceSum(Relu(MatMul(x, W)), axes 0, keepdims 0): x (M, 16) f32, y (32,) f32.
void build_mlp(ir::Graph& g) {
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({M, K}));
  ir::Value* w = g.add_initializer("W", w_tensor());
  ir::Value* axes = g.add_initializer("axes", Tensor::from_i64({0}));
  ir::Value* h = g.add_node("MatMul", "mm", {x, w}, {"h"})->outputs[0];
  ir::Value* r = g.add_node("Relu", "relu", {h}, {"r"})->outputs[0];
  ir::Attributes a;
  a.set("keepdims", int64_t(0));
  g.outputs.push_back(g.add_node("ReduceSum", "sum", {r, axes}, {"y"}, a)->outputs[0]);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST(Profile, CountsEveryNodeOfARun) {
  runtime::register_eager_kernels();
  ir::Graph g;
  build_mlp(g);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  ASSERT_TRUE(ir::verify_graph(g).is_ok());
  std::map<std::string, Tensor> feeds{{"x", x_tensor(M)}};

  auto plain = runtime::run_graph(g, feeds);  // profile off
  ASSERT_TRUE(plain) << plain.message();
  expect_matches_reference(plain->at("y"), M);

  runtime::OpProfile prof;
  runtime::RunOptions ro;
  ro.profile = &prof;
  constexpr int kRuns = 3;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kRuns; ++i) {
    auto got = runtime::run_graph(g, feeds, ro);
    ASSERT_TRUE(got) << got.message();
    // Profiling changes no result: bitwise equal to the unprofiled run.
    for (int64_t n = 0; n < N; ++n) ASSERT_EQ(got->at("y").get_f64(n), plain->at("y").get_f64(n));
  }
  const double wall = seconds_since(t0);

  const auto es = prof.entries();
  ASSERT_EQ(es.size(), 3u) << prof.table();
  for (const char* key : {"MatMul", "Relu", "ReduceSum"}) {
    EXPECT_EQ(prof.calls(key), kRuns) << key << "\n" << prof.table();
    EXPECT_GT(prof.seconds(key), 0.0) << key;
  }
  for (size_t i = 1; i < es.size(); ++i) EXPECT_GE(es[i - 1].seconds, es[i].seconds);  // sorted by total time
  EXPECT_GT(prof.total_seconds(), 0.0);
  EXPECT_LE(prof.total_seconds(), wall);

  // A null profile after a profiled run adds nothing.
  auto again = runtime::run_graph(g, feeds);
  ASSERT_TRUE(again) << again.message();
  EXPECT_EQ(prof.calls("MatMul"), kRuns);
}

/// The same computation split over 2 microbatches in an AccumulationLoop (carried
/// accumulator; W and axes captured from the outer graph): body nodes count once per
/// trip, the loop node is no key, and the outer Identity counts once.
TEST(Profile, AccumulationLoopBodyIsProfiled) {
  runtime::register_eager_kernels();
  constexpr int64_t kTrips = 2, kRows = M * kTrips;
  ir::Graph g;
  ir::Value* acc0 = g.add_input("acc0", DType::f32, ir::Shape::of({N}));
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({kRows, K}));
  ir::Value* w = g.add_initializer("W", w_tensor());
  ir::Value* axes = g.add_initializer("axes", Tensor::from_i64({0}));
  auto body = std::make_unique<ir::Graph>();
  body->name = "body";
  ir::Value* acc_in = body->add_input("acc_in", DType::f32, ir::Shape::of({N}));
  ir::Value* xs = body->add_input("xs", DType::f32, ir::Shape::of({M, K}));
  ir::Value* h = body->add_node("MatMul", "mm", {xs, w}, {"h"})->outputs[0];
  ir::Value* r = body->add_node("Relu", "relu", {h}, {"r"})->outputs[0];
  ir::Attributes ra;
  ra.set("keepdims", int64_t(0));
  ir::Value* s = body->add_node("ReduceSum", "sum", {r, axes}, {"s"}, ra)->outputs[0];
  body->outputs.push_back(body->add_node("Add", "acc", {acc_in, s}, {"acc_out"})->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(*body).is_ok());
  ir::Attributes la;
  la.set("trip_count", kTrips);
  la.set("num_carried", int64_t(1));
  ir::Node* loop = g.add_node("AccumulationLoop", "loop", {acc0, x}, {"acc"}, la);
  loop->regions.push_back(std::move(body));
  g.outputs.push_back(g.add_node("Identity", "out", {loop->outputs[0]}, {"y"})->outputs[0]);
  auto st = ir::infer_graph(g);
  ASSERT_TRUE(st.is_ok()) << st.message();

  runtime::OpProfile prof;
  runtime::RunOptions ro;
  ro.profile = &prof;
  Tensor zeros(DType::f32, {N});
  for (int64_t n = 0; n < N; ++n) zeros.data<float>()[n] = 0.0f;
  const auto t0 = std::chrono::steady_clock::now();
  auto got = runtime::run_graph(g, {{"acc0", zeros}, {"x", x_tensor(kRows)}}, ro);
  const double wall = seconds_since(t0);
  ASSERT_TRUE(got) << got.message();
  expect_matches_reference(got->at("y"), kRows);

  EXPECT_EQ(prof.entries().size(), 5u) << prof.table();
  for (const char* key : {"MatMul", "Relu", "ReduceSum", "Add"}) EXPECT_EQ(prof.calls(key), kTrips) << key;
  EXPECT_EQ(prof.calls("Identity"), 1);
  EXPECT_EQ(prof.calls("AccumulationLoop"), 0);  // not double counted
  for (auto& e : prof.entries()) EXPECT_GT(e.seconds, 0.0) << e.key;
  EXPECT_LE(prof.total_seconds(), wall);
}

/// A pointwise chain grouped by the fusion pass: one FusedKernel key, "(eager)" when its
/// body runs op by op and "(generated)" through codegen::compile_graph_cpu's program;
/// the body's ops are never keys of their own.
TEST(Profile, FusedKernelGeneratedVsEager) {
  runtime::register_eager_kernels();
  ir::Graph g;
  build_mlp(g);
  // y2 = Relu(y * y + y): a pointwise group after the reduction.
  ir::Value* y = g.outputs[0];
  ir::Value* sq = g.add_node("Mul", "sq", {y, y}, {"sq"})->outputs[0];
  ir::Value* ad = g.add_node("Add", "ad", {sq, y}, {"ad"})->outputs[0];
  g.outputs.push_back(g.add_node("Relu", "relu2", {ad}, {"y2"})->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::map<std::string, Tensor> feeds{{"x", x_tensor(M)}};
  auto ref = runtime::run_graph(g, feeds);
  ASSERT_TRUE(ref) << ref.message();

  auto fused = g.clone();
  passes::PassContext ctx;
  ctx.verify_each = true;
  auto st = passes::run_pipeline(*fused, {"fusion"}, ctx);
  ASSERT_TRUE(st.is_ok()) << st.message();
  // FusedKernel nodes by kind (the pass may form a pointwise and a reduction group).
  std::map<std::string, int64_t> by_kind;
  int64_t fused_nodes = 0, fused_relus = 0;
  for (auto& n : fused->nodes()) {
    if (n->op == "FusedKernel") {
      ++fused_nodes;
      ++by_kind[n->attrs.get_string("kind", "")];
    }
    if (n->op == "Relu") ++fused_relus;
  }
  ASSERT_GE(fused_nodes, 1) << "the fusion pass formed no FusedKernel";
  auto key = [](const std::string& kind, bool generated) {
    return "FusedKernel[" + kind + "]" + (generated ? " (generated)" : " (eager)");
  };

  auto check_values = [&](const std::map<std::string, Tensor>& got) {
    for (const char* o : {"y", "y2"})
      for (int64_t n = 0; n < N; ++n)  // same op order in f32: generated within 1e-6 relative of eager
        EXPECT_NEAR(got.at(o).get_f64(n), ref->at(o).get_f64(n), 1e-6 * std::max(1.0, std::fabs(ref->at(o).get_f64(n))))
            << o << "[" << n << "]";
  };

  {  // eager: the FusedKernel's body runs op by op
    runtime::OpProfile prof;
    runtime::RunOptions ro;
    ro.profile = &prof;
    auto got = runtime::run_graph(*fused, feeds, ro);
    ASSERT_TRUE(got) << got.message();
    check_values(*got);
    for (auto& [kind, count] : by_kind) {
      EXPECT_FALSE(kind.empty());
      EXPECT_EQ(prof.calls(key(kind, false)), count) << prof.table();
      EXPECT_EQ(prof.calls(key(kind, true)), 0);
      EXPECT_GT(prof.seconds(key(kind, false)), 0.0);
    }
    EXPECT_EQ(prof.calls("Mul"), 0) << "body ops counted besides their FusedKernel\n" << prof.table();
    EXPECT_EQ(prof.calls("Relu"), fused_relus);
  }
  {  // compiled
    auto prog = codegen::compile_graph_cpu(*fused);
    ASSERT_TRUE(prog) << prog.message();
    ASSERT_EQ(static_cast<int64_t>((*prog)->kernels.size()), fused_nodes);
    runtime::OpProfile prof;
    runtime::RunOptions ro;
    ro.profile = &prof;
    ro.program = prog->get();
    const auto t0 = std::chrono::steady_clock::now();
    auto got = runtime::run_graph(*fused, feeds, ro);
    const double wall = seconds_since(t0);
    ASSERT_TRUE(got) << got.message();
    check_values(*got);
    for (auto& [kind, count] : by_kind) {
      EXPECT_EQ(prof.calls(key(kind, true)), count) << prof.table();
      EXPECT_EQ(prof.calls(key(kind, false)), 0);
      EXPECT_GT(prof.seconds(key(kind, true)), 0.0);
    }
    EXPECT_EQ(prof.calls("Mul"), 0);
    EXPECT_EQ(prof.calls("MatMul"), 1);
    EXPECT_LE(prof.total_seconds(), wall);

    // Grouped by node: one key per node, generated kernels named with what they fuse.
    runtime::OpProfile by_node;
    by_node.set_group(runtime::ProfileGroup::node);
    ro.profile = &by_node;
    ASSERT_TRUE(runtime::run_graph(*fused, feeds, ro));
    int64_t keys_seen = 0;
    for (auto& n : fused->nodes()) {
      std::string want = n->name + " " + n->op;
      if (n->op == "FusedKernel") {
        want = n->name + " " + key(n->attrs.get_string("kind", ""), true) + ": " + n->regions[0]->nodes()[0]->name;
        const size_t members = n->regions[0]->nodes().size();
        for (size_t i = 1; i < members && i < 3; ++i) want += ", " + n->regions[0]->nodes()[i]->name;
        if (members > 3) want += ", +" + std::to_string(members - 3);
      }
      EXPECT_EQ(by_node.calls(want), 1) << want << "\n" << by_node.table();
      ++keys_seen;
    }
    EXPECT_EQ(static_cast<int64_t>(by_node.entries().size()), keys_seen) << by_node.table();
  }
}

TEST(Profile, TableCutsKeysLongerThan120Characters) {
  runtime::OpProfile p;
  const std::string long_key = "fused_9 FusedKernel[row] (generated): " + std::string(150, 'n');
  p.add(long_key, 0.002);
  p.add("MatMul", 0.001);
  std::istringstream is(p.table());
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(is, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), 5u) << p.table();
  EXPECT_EQ(lines[2].rfind(long_key.substr(0, 117) + "...  ", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3].rfind("MatMul ", 0), 0u);
  EXPECT_EQ(lines[2].size(), lines[3].size()) << "columns not aligned\n" << p.table();
  EXPECT_EQ(p.calls(long_key), 1);  // the key itself is kept whole
}

TEST(Profile, TableSortsCollapsesAndTotals) {
  runtime::OpProfile p;
  p.add("Relu", 0.001);
  p.add("MatMul", 0.004);
  p.add("MatMul", 0.002);  // 2 calls, 6 ms, mean 3000 us
  p.add("Softmax", 0.0005);
  p.add("Dropout", 0.0025);
  EXPECT_EQ(p.calls("MatMul"), 2);
  EXPECT_DOUBLE_EQ(p.seconds("MatMul"), 0.006);
  EXPECT_DOUBLE_EQ(p.total_seconds(), 0.010);

  const std::string full = p.table();
  std::istringstream is(full);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(is, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u + 4u + 1u) << full;  // header, rule, 4 keys, total
  EXPECT_NE(lines[0].find("calls"), std::string::npos);
  EXPECT_NE(lines[0].find("total ms"), std::string::npos);
  EXPECT_NE(lines[0].find("mean us"), std::string::npos);
  EXPECT_EQ(lines[2].rfind("MatMul ", 0), 0u) << full;
  EXPECT_EQ(lines[3].rfind("Dropout ", 0), 0u) << full;
  EXPECT_EQ(lines[4].rfind("Relu ", 0), 0u) << full;
  EXPECT_EQ(lines[5].rfind("Softmax ", 0), 0u) << full;
  // MatMul: 2 calls, 6.000 ms, 3000.00 us mean, 60.00 %.
  long long calls = 0;
  double ms = 0, us = 0, pct = 0;
  ASSERT_EQ(std::sscanf(lines[2].c_str() + 7, "%lld %lf %lf %lf", &calls, &ms, &us, &pct), 4) << lines[2];
  EXPECT_EQ(calls, 2);
  EXPECT_NEAR(ms, 6.0, 1e-9);
  EXPECT_NEAR(us, 3000.0, 1e-9);
  EXPECT_NEAR(pct, 60.0, 1e-9);
  EXPECT_EQ(lines[6].rfind("total ", 0), 0u) << full;

  // Top 2, then "(2 other keys)": Relu + Softmax = 2 calls, 1.5 ms, 15 %.
  const std::string top = p.table(2);
  EXPECT_EQ(top.find("Relu"), std::string::npos) << top;
  const size_t at = top.find("(2 other keys)");
  ASSERT_NE(at, std::string::npos) << top;
  ASSERT_EQ(std::sscanf(top.c_str() + at + 14, "%lld %lf %lf %lf", &calls, &ms, &us, &pct), 4) << top;
  EXPECT_EQ(calls, 2);
  EXPECT_NEAR(ms, 1.5, 1e-9);
  EXPECT_NEAR(pct, 15.0, 1e-9);
}
