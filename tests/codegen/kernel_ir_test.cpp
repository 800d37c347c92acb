// Tests of the kernel IR utilities: printer, verifier, collapse_dims, and the reference
// evaluator checked against hand-computed float64 math (so the emitter oracle is independent).
#include "codegen/kernel_ir.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernel_builder.h"

namespace kiln::codegen {
namespace {

using ir::DType;
using ir::ScalarOp;

using testing::KB;

Kernel small_add() {
  KB b("fused_3", {512, 64}, {false, false});
  int x = b.param("x", DType::f32, {64, 1});
  int y = b.param("y", DType::f32, {0, 1});
  int o = b.param("z", DType::f32, {64, 1}, true);
  int e0 = b.load(x), e1 = b.load(y);
  b.store(o, b.op(ScalarOp::add, {e0, e1}, DType::f32));
  return b.k;
}

TEST(KernelIr, ToString) {
  Kernel k = small_add();
  EXPECT_EQ(k.to_string(),
            "kernel fused_3 domain [512, 64] reduced [-, -]\n"
            "  param 0 %x f32 strides [64, 1] in\n"
            "  param 1 %y f32 strides [0, 1] in\n"
            "  param 2 %z f32 strides [64, 1] out\n"
            "  %e0 = load p0 : f32\n"
            "  %e1 = load p1 : f32\n"
            "  %e2 = add %e0, %e1 : f32\n"
            "  store p2 <- %e2\n");
  EXPECT_EQ(k.domain_size(), 512 * 64);
  EXPECT_FALSE(k.has_reduction());
  EXPECT_TRUE(k.verify().is_ok()) << k.verify().message();
}

TEST(KernelIr, VerifyRejectsBadKernels) {
  {
    Kernel k = small_add();
    k.exprs[2].args = {0};  // add with one arg
    Status s = k.verify();
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("fused_3"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("takes 2 args"), std::string::npos) << s.message();
  }
  {
    Kernel k = small_add();
    k.params[1].strides = {1};
    Status s = k.verify();
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("strides"), std::string::npos) << s.message();
  }
  {
    Kernel k = small_add();
    k.stores[0].param = 0;  // store to an input
    Status s = k.verify();
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("input param"), std::string::npos) << s.message();
  }
  {
    Kernel k = small_add();
    k.exprs[2].dtype = DType::f64;  // operand dtype mismatch
    EXPECT_FALSE(k.verify().is_ok());
  }
  {
    Kernel k = small_add();
    k.exprs[2].args = {0, 2};  // forward reference
    EXPECT_FALSE(k.verify().is_ok());
  }
  {
    Kernel k = small_add();
    k.reduced = {false, true};  // reduced dim without reduction store
    EXPECT_FALSE(k.verify().is_ok());
    k.stores[0].reduce = ReduceKind::sum;  // output stride along reduced dim is 1, not 0
    EXPECT_FALSE(k.verify().is_ok());
    k.params[2].strides = {1, 0};
    EXPECT_TRUE(k.verify().is_ok()) << k.verify().message();
  }
  {
    Kernel k = small_add();
    k.name = "bad name";
    EXPECT_FALSE(k.verify().is_ok());
  }
}

TEST(KernelIr, CollapseDims) {
  {
    KB b("c", {4, 5, 6});
    int x = b.param("x", DType::f32, {30, 6, 1});
    int o = b.param("o", DType::f32, {30, 6, 1}, true);
    b.store(o, b.load(x));
    Kernel c = collapse_dims(b.k);
    EXPECT_EQ(c.domain, (std::vector<Extent>{120}));
    EXPECT_EQ(c.params[0].strides, (std::vector<Extent>{1}));
    EXPECT_TRUE(c.verify().is_ok());
  }
  {  // broadcast of the inner dims blocks the merge with the outer dim only
    KB b("c", {4, 5, 6});
    int x = b.param("x", DType::f32, {0, 6, 1});
    int o = b.param("o", DType::f32, {30, 6, 1}, true);
    b.store(o, b.load(x));
    Kernel c = collapse_dims(b.k);
    EXPECT_EQ(c.domain, (std::vector<Extent>{4, 30}));
    EXPECT_EQ(c.params[0].strides, (std::vector<Extent>{0, 1}));
  }
  {  // reduction: kept/reduced blocks merge separately; extent-1 dims vanish
    KB b("c", {4, 1, 5, 6}, {false, false, true, true});
    int x = b.param("x", DType::f32, {30, 7, 6, 1});
    int o = b.param("o", DType::f32, {1, 3, 0, 0}, true);
    b.store(o, b.load(x), ReduceKind::sum);
    Kernel c = collapse_dims(b.k);
    EXPECT_EQ(c.domain, (std::vector<Extent>{4, 30}));
    EXPECT_EQ(c.reduced, (std::vector<bool>{false, true}));
    EXPECT_EQ(c.params[0].strides, (std::vector<Extent>{30, 1}));
    EXPECT_EQ(c.params[1].strides, (std::vector<Extent>{1, 0}));
    EXPECT_TRUE(c.verify().is_ok()) << c.verify().message();
  }
  {  // a reduction over an extent-1 dim keeps that dim
    KB b("c", {3, 1}, {false, true});
    int x = b.param("x", DType::f32, {1, 0});
    int o = b.param("o", DType::f32, {1, 0}, true);
    b.store(o, b.load(x), ReduceKind::sum);
    Kernel c = collapse_dims(b.k);
    EXPECT_EQ(c.domain, (std::vector<Extent>{3, 1}));
    EXPECT_TRUE(c.verify().is_ok()) << c.verify().message();
  }
}

TEST(KernelIr, ReferenceMatchesFloat64Math) {
  // z[i, j] = exp(x[i, j]) * y[j] - 0.5 over (3, 4), y broadcast along rows, x transposed.
  KB b("k", {3, 4});
  int x = b.param("x", DType::f32, {1, 3});  // x stored as (4, 3)
  int y = b.param("y", DType::f32, {0, 1});
  int z = b.param("z", DType::f32, {4, 1}, true);
  int e = b.op(ScalarOp::exp, {b.load(x)}, DType::f32);
  int m = b.op(ScalarOp::mul, {e, b.load(y)}, DType::f32);
  b.store(z, b.op(ScalarOp::sub, {m, b.cst(0.5, DType::f32)}, DType::f32));
  std::vector<float> xv(12), yv = {1.f, -2.f, 0.25f, 3.f}, zv(12, -1.f);
  for (int i = 0; i < 12; ++i) xv[i] = 0.1f * i - 0.4f;
  ASSERT_TRUE(evaluate_reference(b.k, {xv.data(), yv.data(), zv.data()}).is_ok());
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) {
      double want = std::exp(double(xv[j * 3 + i])) * yv[j] - 0.5;
      EXPECT_NEAR(zv[i * 4 + j], want, 1e-6 * (1 + std::fabs(want))) << i << "," << j;
    }
}

TEST(KernelIr, ReferenceReductionsMatchFloat64Math) {
  const int R = 7, C = 5;
  std::vector<float> x(R * C);
  for (int i = 0; i < R * C; ++i) x[i] = std::sin(0.37 * i) * 3;
  {  // row sum: (R, C) -> (R)
    KB b("rs", {R, C}, {false, true});
    int p = b.param("x", DType::f32, {C, 1});
    int o = b.param("o", DType::f32, {1, 0}, true);
    b.store(o, b.load(p), ReduceKind::sum);
    std::vector<float> out(R, 99.f);
    ASSERT_TRUE(evaluate_reference(b.k, {x.data(), out.data()}).is_ok());
    for (int r = 0; r < R; ++r) {
      double s = 0;
      for (int c = 0; c < C; ++c) s += x[r * C + c];
      EXPECT_NEAR(out[r], s, 1e-5);
    }
  }
  {  // column max: (R, C) -> (C), domain (R, C) reduced over rows
    KB b("cm", {R, C}, {true, false});
    int p = b.param("x", DType::f32, {C, 1});
    int o = b.param("o", DType::f32, {0, 1}, true);
    b.store(o, b.load(p), ReduceKind::max);
    std::vector<float> out(C, 99.f);
    ASSERT_TRUE(evaluate_reference(b.k, {x.data(), out.data()}).is_ok());
    for (int c = 0; c < C; ++c) {
      double m = -INFINITY;
      for (int r = 0; r < R; ++r) m = std::max(m, double(x[r * C + c]));
      EXPECT_EQ(out[c], m);
    }
  }
  {  // empty reduced dim: sum 0, max -inf
    KB b("e", {3, 0}, {false, true});
    int p = b.param("x", DType::f32, {0, 1});
    int o1 = b.param("s", DType::f32, {1, 0}, true);
    int o2 = b.param("m", DType::f32, {1, 0}, true);
    int l = b.load(p);
    b.store(o1, l, ReduceKind::sum);
    b.store(o2, l, ReduceKind::max);
    std::vector<float> s(3, 5.f), m(3, 5.f);
    float dummy = 0;
    ASSERT_TRUE(evaluate_reference(b.k, {&dummy, s.data(), m.data()}).is_ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(s[i], 0.f);
      EXPECT_EQ(m[i], -INFINITY);
    }
  }
}

TEST(KernelIr, ReferenceRoundingAndCasts) {
  // bf16: 1 + 2^-8 ties to even (1.0); 1 + 3*2^-8 ties to 1 + 2^-6.
  KB b("r", {2});
  int x = b.param("x", DType::bf16, {1});
  int y = b.param("y", DType::bf16, {1});
  int z = b.param("z", DType::bf16, {1}, true);
  b.store(z, b.op(ScalarOp::add, {b.load(x), b.load(y)}, DType::bf16));
  uint16_t xv[2] = {ir::f32_to_bf16(1.f), ir::f32_to_bf16(1.f)};
  uint16_t yv[2] = {ir::f32_to_bf16(std::ldexp(1.f, -8)), ir::f32_to_bf16(3 * std::ldexp(1.f, -8))};
  uint16_t zv[2] = {0, 0};
  ASSERT_TRUE(evaluate_reference(b.k, {xv, yv, zv}).is_ok());
  EXPECT_EQ(ir::bf16_to_f32(zv[0]), 1.0f);
  EXPECT_EQ(ir::bf16_to_f32(zv[1]), 1.0f + std::ldexp(1.f, -6));

  // f32 -> i64 truncates toward zero, NaN -> 0, saturates; i64 div truncates, /0 -> 0.
  KB c("c", {6});
  int f = c.param("f", DType::f32, {1});
  int d = c.param("d", DType::i64, {1});
  int o = c.param("o", DType::i64, {1}, true);
  int q = c.param("q", DType::i64, {1}, true);
  int ci = c.op(ScalarOp::cast, {c.load(f)}, DType::i64);
  c.store(o, ci);
  c.store(q, c.op(ScalarOp::div, {ci, c.load(d)}, DType::i64));
  float fv[6] = {2.7f, -2.7f, NAN, 1e30f, -1e30f, -7.f};
  int64_t dv[6] = {2, 2, 1, 0, 1, 2};
  int64_t ov[6], qv[6];
  ASSERT_TRUE(evaluate_reference(c.k, {fv, dv, ov, qv}).is_ok());
  EXPECT_EQ(ov[0], 2);
  EXPECT_EQ(ov[1], -2);
  EXPECT_EQ(ov[2], 0);
  EXPECT_EQ(ov[3], std::numeric_limits<int64_t>::max());
  EXPECT_EQ(ov[4], std::numeric_limits<int64_t>::min());
  EXPECT_EQ(qv[0], 1);
  EXPECT_EQ(qv[1], -1);
  EXPECT_EQ(qv[3], 0);
  EXPECT_EQ(qv[5], -3);
}

TEST(KernelIr, ReferenceRejectsWrongBufferCount) {
  Kernel k = small_add();
  std::vector<float> a(10);
  Status s = evaluate_reference(k, {a.data()});
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("fused_3"), std::string::npos);
}

TEST(KernelIr, ReferenceRowProgramMatchesFloat64Math) {
  // Softmax over rows of [3, 5] with reduce expressions, against double math (tolerance
  // 1e-6 relative: f32 exp and division).
  KB b("softmax", {3, 5}, {false, true});
  const DType f = DType::f32;
  int x = b.load(b.param("x", f, {5, 1}));
  int m = b.k.add_reduce(ReduceKind::max, x);
  int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {x, m}, f)}, f);
  int s = b.k.add_reduce(ReduceKind::sum, e);
  b.out("y", b.op(ScalarOp::div, {e, s}, f), {5, 1});
  b.out("lse", b.op(ScalarOp::add, {m, b.op(ScalarOp::log, {s}, f)}, f), {1, 0});
  ASSERT_TRUE(b.k.verify().is_ok()) << b.k.verify().message();
  EXPECT_NE(b.k.to_string().find("reduce_max %e0"), std::string::npos) << b.k.to_string();
  EXPECT_TRUE(b.k.is_row_program());
  EXPECT_EQ(b.k.expr_levels()[s], 2);
  std::vector<float> xv(15), y(15, -1), lse(3, -1);
  for (int i = 0; i < 15; ++i) xv[i] = static_cast<float>(std::sin(i * 1.7) * 3);
  ASSERT_TRUE(evaluate_reference(b.k, {xv.data(), y.data(), lse.data()}).is_ok());
  for (int r = 0; r < 3; ++r) {
    double mx = -1e300, sum = 0;
    for (int c = 0; c < 5; ++c) mx = std::max(mx, static_cast<double>(xv[r * 5 + c]));
    for (int c = 0; c < 5; ++c) sum += std::exp(xv[r * 5 + c] - mx);
    for (int c = 0; c < 5; ++c)
      EXPECT_NEAR(y[r * 5 + c], std::exp(xv[r * 5 + c] - mx) / sum, 1e-6 * std::exp(xv[r * 5 + c] - mx) / sum + 1e-9);
    EXPECT_NEAR(lse[r], mx + std::log(sum), 1e-6 * std::fabs(mx + std::log(sum)));
  }
}

TEST(KernelIr, VerifyRowProgramRules) {
  const DType f = DType::f32;
  {
    // A row store (stride 0 along the reduced dim) of a value that varies along it.
    KB b("bad_row_store", {3, 5}, {false, true});
    int x = b.load(b.param("x", f, {5, 1}));
    b.out("s", b.k.add_reduce(ReduceKind::sum, x), {1, 0});
    b.out("bad", x, {1, 0});
    Status s = b.k.verify();
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("varies along them"), std::string::npos) << s.message();
  }
  {
    // A reduce expression in a kernel without reduced dims.
    KB b("bad_reduce", {3, 5});
    int x = b.load(b.param("x", f, {5, 1}));
    b.out("y", b.k.add_reduce(ReduceKind::sum, x), {5, 1});
    Status s = b.k.verify();
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("without reduced dims"), std::string::npos) << s.message();
  }
}
}  // namespace
}  // namespace kiln::codegen
