// absorb_transpose pass (passes/absorb_transpose.cpp) and the strided MatMul operands it
// produces (kiln_perm_a / kiln_perm_b, ir/ops/nn.cpp, runtime/kernels/nn.cpp):
// - structure: Transposes feeding MatMul/Gemm are absorbed (perms composed along a
//   chain, Gemm's transA/transB toggled), a Transpose another node still reads stays,
//   and dead ones are removed;
// - function: the eager interpreter's outputs after the pass match a float64 product
//   computed here from the un-transposed inputs (f64 graphs: 1e-12 relative; f32: 2e-6
//   relative to the row's magnitude), for 2-D weights, 4-D attention-style perms,
//   broadcast batch dims, and a oneDNN (f32) and a plain-loop (f64) kernel path.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ir/verifier.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;

namespace {

ir::Tensor random(DType dt, std::vector<int64_t> dims, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  ir::Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, u(g));
  return t;
}

ir::Value* transpose(ir::Graph& g, ir::Value* x, std::vector<int64_t> perm, const std::string& name) {
  ir::Attributes a;
  a.set("perm", perm);
  return g.add_node("Transpose", name, {x}, {name + "_out"}, a)->outputs[0];
}

/// Element of a row-major tensor `t` at multi-index `idx`.
double at(const ir::Tensor& t, const std::vector<int64_t>& idx) {
  int64_t off = 0;
  for (size_t d = 0; d < idx.size(); ++d) off = off * t.dims()[d] + idx[d];
  return t.get_f64(off);
}

/// float64 reference of y[b0,b1,m,n] = sum_k A'[b0,b1,m,k] B'[b0,b1,k,n], with A' and B'
/// given as element functions.
template <typename FA, typename FB>
std::vector<double> ref4(int64_t B0, int64_t B1, int64_t M, int64_t K, int64_t N, FA a, FB b) {
  std::vector<double> y;
  for (int64_t i = 0; i < B0; ++i)
    for (int64_t j = 0; j < B1; ++j)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k) s += a(i, j, m, k) * b(i, j, k, n);
          y.push_back(s);
        }
  return y;
}

void expect_near_all(const ir::Tensor& got, const std::vector<double>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  int bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::fabs(got.get_f64(i) - want[static_cast<size_t>(i)]) > rel * std::max(1.0, scale) && ++bad < 4)
      ADD_FAILURE() << what << " element " << i << ": " << got.get_f64(i) << " want " << want[static_cast<size_t>(i)];
  EXPECT_EQ(bad, 0) << what;
}

int count_op(const ir::Graph& g, const std::string& op) {
  int c = 0;
  for (auto& n : g.nodes()) c += n->op == op;
  return c;
}

TEST(AbsorbTranspose, AttentionAndLinearTransposesBecomeStridedOperands) {
  runtime::register_eager_kernels();
  for (DType dt : {DType::f32, DType::f64}) {
    SCOPED_TRACE(ir::dtype_name(dt));
    const int64_t B = 2, T = 5, H = 3, D = 4, C = H * D, O = 6;
    ir::Graph g;
    ir::Value* q = g.add_input("q", dt, ir::Shape::of({B, T, H, D}));  // (B, T, H, D) as a reshaped projection
    ir::Value* k = g.add_input("k", dt, ir::Shape::of({B, T, H, D}));
    ir::Value* x = g.add_input("x", dt, ir::Shape::of({B, T, C}));
    ir::Value* w = g.add_input("w", dt, ir::Shape::of({O, C}));  // Linear weight (out, in)
    // scores = (q^(0,2,1,3)) x (k^(0,2,3,1)); k's perm as a chain of two Transposes.
    ir::Value* qh = transpose(g, q, {0, 2, 1, 3}, "tq");
    ir::Value* kh = transpose(g, transpose(g, k, {0, 2, 1, 3}, "tk1"), {0, 1, 3, 2}, "tk2");
    ir::Value* s = g.add_node("MatMul", "scores", {qh, kh}, {"s"})->outputs[0];
    // y = x W^T (batched x 2-D, broadcast), and the transposed weight also read by a Relu.
    ir::Value* wt = transpose(g, w, {1, 0}, "tw");
    ir::Value* y = g.add_node("MatMul", "linear", {x, wt}, {"y"})->outputs[0];
    ir::Value* r = g.add_node("Relu", "relu", {wt}, {"r"})->outputs[0];
    // z = Gemm(Transpose(w), w2): transA toggled.
    ir::Value* w2 = g.add_input("w2", dt, ir::Shape::of({O, 7}));
    ir::Value* z = g.add_node("Gemm", "gemm", {transpose(g, w, {1, 0}, "tw2"), w2}, {"z"})->outputs[0];
    g.outputs = {s, y, r, z};
    ASSERT_TRUE(ir::infer_graph(g).is_ok());
    std::map<std::string, ir::Tensor> feeds = {{"q", random(dt, {B, T, H, D}, 1)},
                                               {"k", random(dt, {B, T, H, D}, 2)},
                                               {"x", random(dt, {B, T, C}, 3)},
                                               {"w", random(dt, {O, C}, 4)},
                                               {"w2", random(dt, {O, 7}, 5)}};
    passes::PassContext ctx;
    ctx.verify_each = true;
    ASSERT_TRUE(passes::run_pipeline(g, {"absorb_transpose"}, ctx).is_ok());
    ASSERT_TRUE(ir::verify_graph(g).is_ok());
    // Only the Transpose the Relu reads is left.
    EXPECT_EQ(count_op(g, "Transpose"), 1);
    for (auto& n : g.nodes()) {
      if (n->name == "scores") {
        EXPECT_EQ(n->inputs[0]->name, "q");
        EXPECT_EQ(n->inputs[1]->name, "k");
        EXPECT_EQ(n->attrs.get_ints("kiln_perm_a"), (std::vector<int64_t>{0, 2, 1, 3}));
        EXPECT_EQ(n->attrs.get_ints("kiln_perm_b"), (std::vector<int64_t>{0, 2, 3, 1}));  // composed
      }
      if (n->name == "linear") {
        EXPECT_EQ(n->inputs[1]->name, "w");
        EXPECT_EQ(n->attrs.get_ints("kiln_perm_b"), (std::vector<int64_t>{1, 0}));
      }
      if (n->name == "gemm") {
        EXPECT_EQ(n->inputs[0]->name, "w");
        EXPECT_EQ(n->attrs.get_int("transA", 0), 1);
      }
    }
    auto out = runtime::run_graph(g, feeds);
    ASSERT_TRUE(out) << out.message();
    const double rel = dt == DType::f64 ? 1e-12 : 2e-6;
    const ir::Tensor &fq = feeds["q"], &fk = feeds["k"], &fx = feeds["x"], &fw = feeds["w"], &fw2 = feeds["w2"];
    expect_near_all(out->at("s"),
                    ref4(
                        B, H, T, D, T,
                        [&](int64_t b, int64_t h, int64_t t, int64_t d) {
                          return at(fq, {b, t, h, d});
                        },
                        [&](int64_t b, int64_t h, int64_t d, int64_t t) {
                          return at(fk, {b, t, h, d});
                        }),
                    rel, "scores");
    expect_near_all(out->at("y"),
                    ref4(
                        1, B, T, C, O,
                        [&](int64_t, int64_t b, int64_t t, int64_t c) {
                          return at(fx, {b, t, c});
                        },
                        [&](int64_t, int64_t, int64_t c, int64_t o) {
                          return at(fw, {o, c});
                        }),
                    rel, "linear");
    expect_near_all(out->at("z"),
                    ref4(
                        1, 1, C, O, 7,
                        [&](int64_t, int64_t, int64_t c, int64_t o) {
                          return at(fw, {o, c});
                        },
                        [&](int64_t, int64_t, int64_t o, int64_t j) {
                          return at(fw2, {o, j});
                        }),
                    rel, "gemm");
    std::vector<double> relu;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t o = 0; o < O; ++o) relu.push_back(std::max(0.0, at(fw, {o, c})));
    expect_near_all(out->at("r"), relu, 0, "relu of the kept transpose");
  }
}

TEST(AbsorbTranspose, BadPermIsAnInferenceError) {
  ir::Graph g;
  ir::Value* a = g.add_input("a", DType::f32, ir::Shape::of({2, 3}));
  ir::Value* b = g.add_input("b", DType::f32, ir::Shape::of({2, 4}));
  ir::Attributes at;
  at.set("kiln_perm_a", std::vector<int64_t>{1, 1});
  g.outputs = {g.add_node("MatMul", "mm", {a, b}, {"y"}, at)->outputs[0]};
  Status st = ir::infer_graph(g);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("kiln_perm_a is not a permutation"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("mm"), std::string::npos) << st.message();
}

}  // namespace
