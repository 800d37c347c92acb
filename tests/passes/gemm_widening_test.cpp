// gemm_widening pass (passes/gemm_widening.cpp): structure (widening casts, an f32
// product marked kiln_widened, the original node narrowing and keeping its output value)
// and function: the eager interpreter gives the same result before and after, within one
// bf16 ulp (2^-8 relative: bf16 products are exact in f32 and both forms accumulate in
// f32, only the summation order may differ), against a float64 product of the same
// bf16 inputs as the independent reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ir/verifier.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;

namespace {

ir::Tensor random_bf16(std::vector<int64_t> dims, uint64_t seed, DType dt = DType::bf16) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  ir::Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, u(g));
  return t;
}

TEST(GemmWidening, Bf16MatMulAndGemmBecomeF32ProductsWithTheSameResult) {
  runtime::register_eager_kernels();
  ir::Graph g;
  ir::Value* a = g.add_input("a", DType::bf16, ir::Shape::of({2, 5, 16}));
  ir::Value* w = g.add_input("w", DType::bf16, ir::Shape::of({16, 8}));
  ir::Value* x = g.add_input("x", DType::bf16, ir::Shape::of({10, 16}));
  ir::Value* y = g.add_node("MatMul", "mm", {a, w}, {"y"})->outputs[0];
  ir::Attributes ga;
  ga.set("transB", int64_t(1));
  ir::Value* z = g.add_node("Gemm", "gemm", {x, x}, {"z"}, ga)->outputs[0];
  g.outputs = {y, z};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::map<std::string, ir::Tensor> feeds = {
      {"a", random_bf16({2, 5, 16}, 1)}, {"w", random_bf16({16, 8}, 2)}, {"x", random_bf16({10, 16}, 3)}};
  auto before = runtime::run_graph(g, feeds);
  ASSERT_TRUE(before) << before.message();

  auto widened = g.clone();
  passes::PassContext off;
  ASSERT_TRUE(passes::run_pipeline(*widened, {"gemm_widening"}, off).is_ok());
  for (auto& n : widened->nodes()) EXPECT_NE(n->op, "Cast") << "the pass ran without widen_bf16_gemm";
  passes::PassContext ctx;
  ctx.verify_each = true;
  ctx.options.lowering.widen_bf16_gemm = true;
  ASSERT_TRUE(passes::run_pipeline(*widened, {"gemm_widening"}, ctx).is_ok());
  ASSERT_TRUE(ir::verify_graph(*widened).is_ok());
  int widened_products = 0, casts = 0;
  for (auto& n : widened->nodes()) {
    if (n->op == "Cast") ++casts;
    if (n->op == "MatMul" || n->op == "Gemm") {
      EXPECT_EQ(n->attrs.get_string("kiln_widened", ""), "bf16") << n->name;
      EXPECT_EQ(n->outputs[0]->dtype, DType::f32) << n->name;
      for (auto* in : n->inputs) EXPECT_EQ(in->dtype, DType::f32) << n->name;
      ++widened_products;
    }
  }
  EXPECT_EQ(widened_products, 2);
  EXPECT_EQ(casts, 3 + 2);  // a, w, x, x widened; y, z narrowed
  ASSERT_EQ(widened->outputs.size(), 2u);
  EXPECT_EQ(widened->outputs[0]->name, "y");
  EXPECT_EQ(widened->outputs[0]->dtype, DType::bf16);

  auto after = runtime::run_graph(*widened, feeds);
  ASSERT_TRUE(after) << after.message();
  // float64 reference of y = a @ w on the bf16 inputs.
  const ir::Tensor &A = feeds["a"], &W = feeds["w"];
  const ir::Tensor& yb = before->at("y");
  const ir::Tensor& ya = after->at("y");
  for (int64_t r = 0; r < 10; ++r)
    for (int64_t c = 0; c < 8; ++c) {
      double ref = 0;
      for (int64_t k = 0; k < 16; ++k) ref += A.get_f64(r * 16 + k) * W.get_f64(k * 8 + c);
      const double tol = std::ldexp(1.0, -8) * std::max(1.0, std::fabs(ref));
      EXPECT_NEAR(ya.get_f64(r * 8 + c), ref, tol) << r << "," << c;
      EXPECT_NEAR(ya.get_f64(r * 8 + c), yb.get_f64(r * 8 + c), tol) << r << "," << c;
    }
  const ir::Tensor& zb = before->at("z");
  const ir::Tensor& za = after->at("z");
  for (int64_t i = 0; i < zb.numel(); ++i)
    EXPECT_NEAR(za.get_f64(i), zb.get_f64(i), std::ldexp(1.0, -8) * std::max(1.0, std::fabs(zb.get_f64(i))));
}

// --fp16: f16 products widened the same way (option widen_f16_gemm; the eager f16
// product is an f64 loop). f16 values and products are exact in f32, so the widened
// product rounded to f16 is within one f16 ulp (2^-10 relative) of the float64 product
// of the same f16 inputs, and of the unwidened graph's result; bf16 nodes are left
// alone by this option.
TEST(GemmWidening, F16ProductsWidenWithTheirOwnOption) {
  runtime::register_eager_kernels();
  ir::Graph g;
  ir::Value* a = g.add_input("a", DType::f16, ir::Shape::of({3, 7, 32}));
  ir::Value* w = g.add_input("w", DType::f16, ir::Shape::of({32, 12}));
  ir::Value* b = g.add_input("b", DType::bf16, ir::Shape::of({4, 8}));
  ir::Value* y = g.add_node("MatMul", "mm", {a, w}, {"y"})->outputs[0];
  ir::Value* z =
      g.add_node("MatMul", "mm_bf16", {b, g.add_input("c", DType::bf16, ir::Shape::of({8, 4}))}, {"z"})->outputs[0];
  g.outputs = {y, z};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::map<std::string, ir::Tensor> feeds = {{"a", random_bf16({3, 7, 32}, 4, DType::f16)},
                                             {"w", random_bf16({32, 12}, 5, DType::f16)},
                                             {"b", random_bf16({4, 8}, 6)},
                                             {"c", random_bf16({8, 4}, 7)}};
  auto before = runtime::run_graph(g, feeds);
  ASSERT_TRUE(before) << before.message();
  auto widened = g.clone();
  passes::PassContext ctx;
  ctx.verify_each = true;
  ctx.options.lowering.widen_f16_gemm = true;
  ASSERT_TRUE(passes::run_pipeline(*widened, {"gemm_widening"}, ctx).is_ok());
  int f16_products = 0, untouched = 0;
  for (auto& n : widened->nodes())
    if (n->op == "MatMul") {
      if (n->attrs.get_string("kiln_widened", "") == "f16") {
        EXPECT_EQ(n->outputs[0]->dtype, DType::f32);
        ++f16_products;
      } else {
        EXPECT_EQ(n->outputs[0]->dtype, DType::bf16) << "a bf16 product was widened by widen_f16_gemm";
        ++untouched;
      }
    }
  EXPECT_EQ(f16_products, 1);
  EXPECT_EQ(untouched, 1);
  EXPECT_EQ(widened->outputs[0]->dtype, DType::f16);
  auto after = runtime::run_graph(*widened, feeds);
  ASSERT_TRUE(after) << after.message();
  const ir::Tensor &A = feeds["a"], &W = feeds["w"];
  const ir::Tensor& ya = after->at("y");
  const ir::Tensor& yb = before->at("y");
  for (int64_t r = 0; r < 21; ++r)
    for (int64_t c = 0; c < 12; ++c) {
      double ref = 0;
      for (int64_t k = 0; k < 32; ++k) ref += A.get_f64(r * 32 + k) * W.get_f64(k * 12 + c);
      const double tol = std::ldexp(1.0, -10) * std::max(1.0, std::fabs(ref));
      EXPECT_NEAR(ya.get_f64(r * 12 + c), ref, tol) << r << "," << c;
      EXPECT_NEAR(ya.get_f64(r * 12 + c), yb.get_f64(r * 12 + c), tol) << r << "," << c;
    }
}

}  // namespace
