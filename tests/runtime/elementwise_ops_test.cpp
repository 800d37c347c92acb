// Tests of the elementwise op-table entries and eager kernels: each op runs as a
// one-node graph (inferred, verified, run by the eager interpreter) and is compared
// with a float64 reference computed here with plain loops and <cmath>, including
// broadcasting, f64, bf16 and integer cases; Philox is checked against the
// Random123 known-answer vectors; gradient rules go through the f64 central-
// difference checker (tools/driver/gradcheck.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>

#include "ir/op_table.h"
#include "runtime/interpreter.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/util.h"
#include "tests/runtime/op_test_util.h"

using namespace kiln;
using namespace kiln::ir;
using namespace kiln::testing;
using kiln::runtime::RunOptions;

namespace {

/// Independent broadcast reference: out[idx] = f(a[bcast idx], b[bcast idx]).
std::vector<double> bcast_ref(const Tensor& a, const Tensor& b, const std::vector<int64_t>& od,
                              const std::function<double(double, double)>& f) {
  std::vector<double> out(static_cast<size_t>(numel_of(od)));
  int r = static_cast<int>(od.size());
  auto at = [&](const Tensor& t, const std::vector<int64_t>& coord) {
    int64_t off = 0, stride = 1;
    for (int d = t.rank() - 1; d >= 0; --d) {
      int64_t c = coord[r - t.rank() + d];
      if (t.dims()[d] == 1) c = 0;
      off += c * stride;
      stride *= t.dims()[d];
    }
    return t.get_f64(off);
  };
  std::vector<int64_t> coord(r, 0);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = f(at(a, coord), at(b, coord));
    for (int d = r - 1; d >= 0; --d) {
      if (++coord[d] < od[d]) break;
      coord[d] = 0;
    }
  }
  return out;
}

double tol_for(DType dt) { return dt == DType::bf16 ? 1e-2 : dt == DType::f32 ? 2e-6 : 1e-13; }

}  // namespace

// ----------------------------------------------------------------------------- binary

TEST(ElementwiseOps, BinaryArithmeticBroadcastAllFloatTypes) {
  std::vector<std::pair<std::string, std::function<double(double, double)>>> ops = {
      {"Add", [](double x, double y) { return x + y; }},
      {"Sub", [](double x, double y) { return x - y; }},
      {"Mul", [](double x, double y) { return x * y; }},
      {"Div", [](double x, double y) { return x / y; }},
      {"Pow", [](double x, double y) { return std::pow(x, y); }}};
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> shapes = {
      {{2, 3, 4}, {3, 1}}, {{2, 3, 4}, {}}, {{1, 4}, {3, 1}}, {{5}, {5}}, {{2, 1, 3}, {2, 4, 1}}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    for (auto& [op, f] : ops) {
      for (auto& [sa, sb] : shapes) {
        Tensor a = rnd(dt, sa, 0.5, 2.0, 1);
        Tensor b = rnd(dt, sb, 0.5, 2.0, 2);
        auto out = run_op(op, {a, b});
        ASSERT_EQ(out.size(), 1u);
        auto od = broadcast_shapes(Shape::of(sa), Shape::of(sb))->to_vector();
        expect_close(out[0], bcast_ref(a, b, od, f), tol_for(dt), tol_for(dt),
                     op + " " + dtype_name(dt) + " " + dims_to_string(sa) + "x" + dims_to_string(sb));
      }
    }
  }
}

TEST(ElementwiseOps, IntegerArithmetic) {
  Tensor a = make(DType::i64, {2, 3}, {-7, 7, 9, -9, 100, 5});
  Tensor b = make(DType::i64, {3}, {2, -2, 4});
  expect_close(run_op("Add", {a, b})[0], {-5, 5, 13, -7, 98, 9}, 0, 0, "Add i64");
  expect_close(run_op("Sub", {a, b})[0], {-9, 9, 5, -11, 102, 1}, 0, 0, "Sub i64");
  expect_close(run_op("Mul", {a, b})[0], {-14, -14, 36, -18, -200, 20}, 0, 0, "Mul i64");
  // Integer division truncates toward zero (C++ / numpy-on-int cast semantics of the ONNX reference).
  expect_close(run_op("Div", {a, b})[0], {-3, -3, 2, -4, -50, 1}, 0, 0, "Div i64");
  Tensor c = make(DType::i32, {4}, {2, 3, -2, 5});
  Tensor e = make(DType::i32, {4}, {10, 3, 3, 0});
  expect_close(run_op("Pow", {c, e})[0], {1024, 27, -8, 1}, 0, 0, "Pow i32");
  // Mixed: float base, integer exponent; integer base, float exponent.
  Tensor fb = make(DType::f32, {3}, {1.5, 2.0, -3.0});
  Tensor ie = make(DType::i64, {3}, {2, -1, 3});
  expect_close(run_op("Pow", {fb, ie})[0], {2.25, 0.5, -27}, 1e-6, 1e-6, "Pow f32^i64");
  Tensor ib = make(DType::i64, {2}, {4, 9});
  Tensor fe = make(DType::f32, {2}, {0.5, 2.0});
  expect_close(run_op("Pow", {ib, fe})[0], {2, 81}, 0, 0, "Pow i64^f32");
  // Division by zero on integers does not trap.
  expect_close(run_op("Div", {make(DType::i32, {1}, {5}), make(DType::i32, {1}, {0})})[0], {0}, 0, 0, "Div by 0");
}

TEST(ElementwiseOps, MismatchedDtypesAndShapesAreErrors) {
  EXPECT_NE(run_error("Add", {make(DType::f32, {2}, {1, 2}), make(DType::f64, {2}, {1, 2})}), "");
  EXPECT_NE(run_error("Add", {make(DType::f32, {2}, {1, 2}), make(DType::f32, {3}, {1, 2, 3})}), "");
  EXPECT_NE(run_error("Sqrt", {make(DType::i64, {2}, {1, 2})}), "");
}

// ----------------------------------------------------------------------------- unary

TEST(ElementwiseOps, UnaryFloatOps) {
  struct U {
    std::string op;
    std::function<double(double)> f;
    double lo, hi;
    Attributes attrs;
  };
  Attributes leaky, tanh_approx;
  leaky.set("alpha", 0.2);
  tanh_approx.set("approximate", std::string("tanh"));
  const double k = std::sqrt(2.0 / M_PI);
  std::vector<U> ops = {
      {"Neg", [](double x) { return -x; }, -3, 3, {}},
      {"Abs", [](double x) { return std::abs(x); }, -3, 3, {}},
      {"Sqrt", [](double x) { return std::sqrt(x); }, 0.1, 4, {}},
      {"Reciprocal", [](double x) { return 1 / x; }, 0.5, 4, {}},
      {"Exp", [](double x) { return std::exp(x); }, -3, 3, {}},
      {"Log", [](double x) { return std::log(x); }, 0.1, 4, {}},
      {"Tanh", [](double x) { return std::tanh(x); }, -3, 3, {}},
      {"Sigmoid", [](double x) { return 1 / (1 + std::exp(-x)); }, -8, 8, {}},
      {"Relu", [](double x) { return x > 0 ? x : 0; }, -3, 3, {}},
      {"LeakyRelu", [](double x) { return x >= 0 ? x : 0.2 * x; }, -3, 3, leaky},
      {"Erf", [](double x) { return std::erf(x); }, -3, 3, {}},
      {"Gelu", [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }, -4, 4, {}},
      {"Gelu", [k](double x) { return 0.5 * x * (1 + std::tanh(k * (x + 0.044715 * x * x * x))); }, -4, 4, tanh_approx},
      {"Softplus", [](double x) { return std::log(std::exp(x) + 1); }, -10, 10, {}},
      {"Sin", [](double x) { return std::sin(x); }, -4, 4, {}},
      {"Cos", [](double x) { return std::cos(x); }, -4, 4, {}},
  };
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    for (auto& u : ops) {
      Tensor x = rnd(dt, {3, 17}, u.lo, u.hi, 7);
      auto out = run_op(u.op, {x}, u.attrs);
      ASSERT_EQ(out.size(), 1u) << u.op;
      std::vector<double> ref;
      for (double v : values(x)) ref.push_back(u.f(v));
      double tol = dt == DType::bf16 ? 8e-3 : dt == DType::f32 ? 4e-6 : 1e-12;
      expect_close(out[0], ref, tol, tol, u.op + " " + dtype_name(dt));
    }
  }
}

TEST(ElementwiseOps, UnaryIntegerOps) {
  for (DType dt : {DType::i64, DType::i32, DType::i8}) {
    Tensor x = make(dt, {5}, {-3, -1, 0, 2, 7});
    expect_close(run_op("Neg", {x})[0], {3, 1, 0, -2, -7}, 0, 0, "Neg");
    expect_close(run_op("Abs", {x})[0], {3, 1, 0, 2, 7}, 0, 0, "Abs");
    expect_close(run_op("Relu", {x})[0], {0, 0, 0, 2, 7}, 0, 0, "Relu");
  }
}

TEST(ElementwiseOps, SpecialValues) {
  Tensor x = make(DType::f32, {4}, {-100, 100, 0, NAN});
  expect_close(run_op("Sigmoid", {x})[0], {0, 1, 0.5, NAN}, 1e-7, 0, "Sigmoid extremes");
  expect_close(run_op("Softplus", {x})[0], {0, 100, std::log(2.0), NAN}, 1e-6, 1e-7, "Softplus extremes");
  expect_close(run_op("Relu", {x})[0], {0, 100, 0, NAN}, 0, 0, "Relu NaN");
}

// ----------------------------------------------------------------------------- Clip, Max, Min, Where

TEST(ElementwiseOps, Clip) {
  Tensor x = make(DType::f32, {6}, {-5, -1, 0, 0.5, 3, 10});
  Tensor lo = make(DType::f32, {}, {-1.5});
  Tensor hi = make(DType::f32, {}, {2});
  expect_close(run_op("Clip", {x, lo, hi})[0], {-1.5, -1, 0, 0.5, 2, 2}, 0, 0, "Clip min max");
  expect_close(run_op("Clip", {x, Tensor(), hi})[0], {-5, -1, 0, 0.5, 2, 2}, 0, 0, "Clip max only");
  expect_close(run_op("Clip", {x, lo})[0], {-1.5, -1, 0, 0.5, 3, 10}, 0, 0, "Clip min only");
  expect_close(run_op("Clip", {x})[0], values(x), 0, 0, "Clip none");
  // min > max gives max (ONNX reference: min(max(x, min), max)).
  expect_close(run_op("Clip", {x, make(DType::f32, {}, {3}), make(DType::f32, {}, {1})})[0], {1, 1, 1, 1, 1, 1}, 0, 0,
               "Clip min>max");
  Tensor xi = make(DType::i64, {4}, {-9, 0, 4, 12});
  expect_close(run_op("Clip", {xi, make(DType::i64, {}, {-2}), make(DType::i64, {}, {5})})[0], {-2, 0, 4, 5}, 0, 0,
               "Clip i64");
  Tensor xb = make(DType::bf16, {3}, {-3, 0.25, 3});
  expect_close(run_op("Clip", {xb, make(DType::bf16, {}, {-1}), make(DType::bf16, {}, {1})})[0], {-1, 0.25, 1}, 0, 0,
               "Clip bf16");
}

TEST(ElementwiseOps, MaxMinVariadicBroadcast) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i64}) {
    Tensor a = rnd(dt, {2, 3}, -5, 5, 11);
    Tensor b = rnd(dt, {3}, -5, 5, 12);
    Tensor c = rnd(dt, {2, 1}, -5, 5, 13);
    auto mx = run_op("Max", {a, b, c});
    auto mn = run_op("Min", {a, b, c});
    auto ab = bcast_ref(a, b, {2, 3}, [](double x, double y) { return std::max(x, y); });
    Tensor abt = make(DType::f64, {2, 3}, ab);
    auto ref = bcast_ref(abt, c, {2, 3}, [](double x, double y) { return std::max(x, y); });
    expect_close(mx[0], ref, 0, 0, std::string("Max ") + dtype_name(dt));
    auto ab2 = bcast_ref(a, b, {2, 3}, [](double x, double y) { return std::min(x, y); });
    auto ref2 = bcast_ref(make(DType::f64, {2, 3}, ab2), c, {2, 3}, [](double x, double y) { return std::min(x, y); });
    expect_close(mn[0], ref2, 0, 0, std::string("Min ") + dtype_name(dt));
  }
  Tensor one = make(DType::f32, {2}, {1, -1});
  expect_close(run_op("Max", {one})[0], {1, -1}, 0, 0, "Max single input");
  expect_close(run_op("Max", {make(DType::f32, {2}, {NAN, 1}), make(DType::f32, {2}, {0, NAN})})[0], {NAN, NAN}, 0, 0,
               "Max NaN propagates");
}

TEST(ElementwiseOps, WhereBroadcast) {
  Tensor cond = make(DType::boolean, {2, 1}, {1, 0});
  for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::boolean}) {
    Tensor x = rnd(dt == DType::boolean ? DType::i64 : dt, {3}, 0, 2, 3).cast(dt);
    Tensor y = rnd(dt == DType::boolean ? DType::i64 : dt, {2, 3}, 0, 2, 4).cast(dt);
    auto out = run_op("Where", {cond, x, y});
    std::vector<double> ref;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) ref.push_back(i == 0 ? x.get_f64(j) : y.get_f64(i * 3 + j));
    expect_close(out[0], ref, 0, 0, std::string("Where ") + dtype_name(dt));
  }
}

// ----------------------------------------------------------------------------- comparisons and logic

TEST(ElementwiseOps, ComparisonsBroadcast) {
  std::vector<std::pair<std::string, std::function<double(double, double)>>> ops = {
      {"Equal", [](double x, double y) { return x == y; }},
      {"Less", [](double x, double y) { return x < y; }},
      {"LessOrEqual", [](double x, double y) { return x <= y; }},
      {"Greater", [](double x, double y) { return x > y; }},
      {"GreaterOrEqual", [](double x, double y) { return x >= y; }}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i64, DType::i32}) {
    Tensor a = rnd(dt, {2, 4}, -2, 2, 21);
    Tensor b = rnd(dt, {4}, -2, 2, 22);
    b.set_f64(0, a.get_f64(0));  // a tie
    for (auto& [op, f] : ops) {
      auto out = run_op(op, {a, b});
      ASSERT_EQ(out[0].dtype(), DType::boolean);
      expect_close(out[0], bcast_ref(a, b, {2, 4}, f), 0, 0, op + " " + dtype_name(dt));
    }
  }
  Tensor p = make(DType::boolean, {4}, {0, 0, 1, 1}), q = make(DType::boolean, {4}, {0, 1, 0, 1});
  expect_close(run_op("Equal", {p, q})[0], {1, 0, 0, 1}, 0, 0, "Equal bool");
  Tensor n = make(DType::f32, {1}, {NAN});
  expect_close(run_op("Equal", {n, n})[0], {0}, 0, 0, "NaN != NaN");
}

TEST(ElementwiseOps, Logic) {
  Tensor p = make(DType::boolean, {4}, {0, 0, 1, 1}), q = make(DType::boolean, {4}, {0, 1, 0, 1});
  expect_close(run_op("And", {p, q})[0], {0, 0, 0, 1}, 0, 0, "And");
  expect_close(run_op("Or", {p, q})[0], {0, 1, 1, 1}, 0, 0, "Or");
  expect_close(run_op("Xor", {p, q})[0], {0, 1, 1, 0}, 0, 0, "Xor");
  expect_close(run_op("Not", {p})[0], {1, 1, 0, 0}, 0, 0, "Not");
  Tensor col = make(DType::boolean, {2, 1}, {1, 0});
  expect_close(run_op("And", {col, q})[0], {0, 1, 0, 1, 0, 0, 0, 0}, 0, 0, "And broadcast");
}

// ----------------------------------------------------------------------------- Cast, CastLike, Identity

TEST(ElementwiseOps, Cast) {
  auto cast = [](const Tensor& x, DType to) {
    Attributes a;
    a.set("to", static_cast<int64_t>(dtype_to_onnx(to)));
    return run_op("Cast", {x}, a)[0];
  };
  Tensor f = make(DType::f32, {6}, {-1.7, -0.5, 0, 0.5, 2.9, 300});
  expect_close(cast(f, DType::i64), {-1, 0, 0, 0, 2, 300}, 0, 0, "f32->i64 truncates");
  expect_close(cast(f, DType::i32), {-1, 0, 0, 0, 2, 300}, 0, 0, "f32->i32");
  expect_close(cast(f, DType::boolean), {1, 1, 0, 1, 1, 1}, 0, 0, "f32->bool");
  expect_close(cast(f, DType::f64), values(f), 0, 0, "f32->f64");
  // bf16 rounding to nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1; 1 + 3*2^-8 -> 1 + 2^-6.
  Tensor t = make(DType::f32, {3}, {1.0 + 1.0 / 256, 1.0 + 3.0 / 256, -2.5});
  expect_close(cast(t, DType::bf16), {1.0, 1.0 + 4.0 / 256, -2.5}, 0, 0, "f32->bf16 RNE");
  Tensor i = make(DType::i64, {3}, {-3, 0, 1 << 20});
  expect_close(cast(i, DType::f32), {-3, 0, 1 << 20}, 0, 0, "i64->f32");
  expect_close(cast(i, DType::boolean), {1, 0, 1}, 0, 0, "i64->bool");
  Tensor b = make(DType::boolean, {2}, {1, 0});
  expect_close(cast(b, DType::f64), {1, 0}, 0, 0, "bool->f64");
  Tensor bf = make(DType::bf16, {2}, {1.5, -7});
  expect_close(cast(bf, DType::i32), {1, -7}, 0, 0, "bf16->i32");
  // CastLike takes the dtype of its second input.
  auto cl = run_op("CastLike", {f, make(DType::i64, {1}, {0})});
  EXPECT_EQ(cl[0].dtype(), DType::i64);
  expect_close(cl[0], {-1, 0, 0, 0, 2, 300}, 0, 0, "CastLike");
  expect_close(run_op("Identity", {f})[0], values(f), 0, 0, "Identity");
}

// ----------------------------------------------------------------------------- Dropout and Philox

/// The lane-parallel Philox (what Dropout runs) gives the one-block reference's bits,
/// including blocks whose counter crosses 2^32 and 64-bit seeds.
TEST(ElementwiseOps, PhiloxLanesEqualOneBlock) {
  using namespace kiln::runtime::kernels;
  for (uint64_t first : {uint64_t(0), uint64_t(12345), (uint64_t(1) << 32) - 3, uint64_t(0xfedcba9876543210ull)}) {
    uint32_t lanes[4][kPhiloxLanes];
    philox_blocks(0x0123456789abcdefull, 77, 5, first, lanes);
    for (int l = 0; l < kPhiloxLanes; ++l) {
      auto ref = philox_block(0x0123456789abcdefull, 77, 5, first + l);
      for (int w = 0; w < 4; ++w) EXPECT_EQ(lanes[w][l], ref[w]) << "block " << first + l << " word " << w;
    }
  }
}

TEST(ElementwiseOps, PhiloxKnownAnswers) {
  using kiln::runtime::kernels::philox4x32_10;
  // Random123 kat_vectors, philox4x32 10 rounds.
  auto a = philox4x32_10({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(a, (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  auto b = philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(b, (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  auto c = philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(c, (std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
  // philox_uniform is a pure function in [0, 1) with roughly uniform mean.
  double sum = 0;
  for (uint64_t i = 0; i < 4000; ++i) {
    float u = kiln::runtime::kernels::philox_uniform(42, 7, 3, i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
    EXPECT_EQ(u, kiln::runtime::kernels::philox_uniform(42, 7, 3, i));
  }
  EXPECT_NEAR(sum / 4000, 0.5, 0.02);
}

TEST(ElementwiseOps, DropoutInferenceIsIdentityWithOnesMask) {
  Tensor x = rnd(DType::f32, {4, 5}, -1, 1, 5);
  auto out = run_op("Dropout", {x, make(DType::f32, {}, {0.3})}, {}, 2);
  expect_close(out[0], values(x), 0, 0, "Dropout output");
  EXPECT_EQ(out[1].dtype(), DType::boolean);
  expect_close(out[1], std::vector<double>(20, 1.0), 0, 0, "Dropout mask");
  // training_mode = false input overrides a training run.
  RunOptions tr;
  tr.training = true;
  auto out2 = run_op("Dropout", {x, make(DType::f32, {}, {0.3}), make(DType::boolean, {}, {0})}, {}, 2, tr);
  expect_close(out2[0], values(x), 0, 0, "Dropout training_mode=false");
}

TEST(ElementwiseOps, DropoutTrainingMaskScaleAndDeterminism) {
  const double ratio = 0.25;
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    Tensor x = rnd(dt, {64, 65}, 0.5, 1.5, 9);
    RunOptions tr;
    tr.training = true;
    tr.seed = 1234;
    tr.step = 5;
    auto o1 = run_op("Dropout", {x, make(DType::f32, {}, {ratio})}, {}, 2, tr);
    auto o2 = run_op("Dropout", {x, make(DType::f32, {}, {ratio})}, {}, 2, tr);
    ASSERT_EQ(o1.size(), 2u);
    int64_t kept = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      bool keep = o1[1].get_i64(i) != 0;
      kept += keep;
      double want = keep ? x.get_f64(i) / (1 - ratio) : 0.0;
      EXPECT_NEAR(o1[0].get_f64(i), want, tol_for(dt) * 2 * std::abs(want)) << i;
      // The mask is the Philox stream keyed by (seed, op id 0, step).
      bool ref_keep = kiln::runtime::kernels::philox_uniform(1234, 0, 5, static_cast<uint64_t>(i)) >= ratio;
      ASSERT_EQ(keep, ref_keep) << i;
    }
    double frac = static_cast<double>(kept) / x.numel();
    EXPECT_NEAR(frac, 1 - ratio, 0.03);
    expect_close(o2[1], values(o1[1]), 0, 0, "same seed/step, same mask");
    tr.step = 6;
    auto o3 = run_op("Dropout", {x, make(DType::f32, {}, {ratio})}, {}, 2, tr);
    int64_t diff = 0;
    for (int64_t i = 0; i < x.numel(); ++i) diff += o3[1].get_i64(i) != o1[1].get_i64(i);
    EXPECT_GT(diff, x.numel() / 10) << "a new step draws a new mask";
  }
  // kiln_rng_id selects the stream; training_mode=true input activates dropout without RunOptions.training.
  Tensor x = rnd(DType::f32, {100}, 0.5, 1.5, 3);
  Attributes a;
  a.set("kiln_rng_id", int64_t(77));
  auto o = run_op("Dropout", {x, make(DType::f32, {}, {0.5}), make(DType::boolean, {}, {1})}, a, 2);
  for (int64_t i = 0; i < 100; ++i)
    ASSERT_EQ(o[1].get_i64(i) != 0, kiln::runtime::kernels::philox_uniform(0, 77, 0, static_cast<uint64_t>(i)) >= 0.5f);
  // Default ratio 0.5 and single-output form.
  RunOptions tr;
  tr.training = true;
  auto single = run_op("Dropout", {x}, {}, 1, tr);
  for (int64_t i = 0; i < 100; ++i) {
    double v = single[0].get_f64(i);
    EXPECT_TRUE(v == 0.0 || std::abs(v - 2 * x.get_f64(i)) < 1e-6);
  }
}

TEST(ElementwiseOps, DropoutF32AndBf16AreBitExactAgainstPhiloxReference) {
  // f32 and bf16 Dropout run an AVX2 path on CPUs that have it (128-element groups,
  // several threads for large tensors) and the portable path for the tail: every element
  // must be keep ? round(x * float(1 / (1 - ratio))) : +0 (f32 arithmetic; bf16: x widened,
  // the product rounded to nearest even as ir::f32_to_bf16), with keep from philox_uniform,
  // bit for bit, also for inf and NaN inputs (dropped ones give +0) and across the group
  // seams. Ratio 1/3 makes the scale exactly 1.5, so that many bf16 products lie exactly
  // halfway between two bf16 values (the round-to-even ties).
  // Each path in turn (AVX-512, AVX2, portable; dropout_testing caps it): all give these bits.
  namespace dt_hooks = kiln::runtime::kernels::dropout_testing;
  const int best = dt_hooks::active_isa();
  std::cout << "[ INFO ] Dropout paths checked: " << (best >= 2 ? "AVX-512, " : "") << (best >= 1 ? "AVX2, " : "")
            << "portable" << (best < 2 ? " (this CPU lacks AVX-512: that path is not run)" : "") << "\n";
  struct Restore {
    int level;
    ~Restore() { kiln::runtime::kernels::dropout_testing::set_max_isa(level); }
  } restore{dt_hooks::set_max_isa(2)};
  for (int isa = best; isa >= 0; --isa)
    for (DType dt : {DType::f32, DType::bf16})
      for (const float ratio : {0.3f, 1.0f / 3.0f})
        for (int64_t n : {int64_t(128 * 5 + 37), int64_t(1) << 18}) {
          dt_hooks::set_max_isa(isa);
          ASSERT_EQ(dt_hooks::active_isa(), isa);
          SCOPED_TRACE(std::string(dtype_name(dt)) + " ratio " + std::to_string(ratio) + " path " +
                       std::to_string(isa));
          Tensor x = rnd(dt, {n}, -3, 3, 21);
          x.set_f64(3, std::numeric_limits<double>::infinity());
          x.set_f64(200, -std::numeric_limits<double>::infinity());
          x.set_f64(641, std::numeric_limits<double>::quiet_NaN());
          RunOptions tr;
          tr.training = true;
          tr.seed = 0x0123456789abcdefull;
          tr.step = 9;
          Attributes a;
          a.set("kiln_rng_id", int64_t(5));
          auto o = run_op("Dropout", {x, make(DType::f32, {}, {ratio})}, a, 2, tr);
          const float scale = static_cast<float>(1.0 / (1.0 - static_cast<double>(ratio)));
          for (int64_t i = 0; i < n; ++i) {
            const bool keep = kiln::runtime::kernels::philox_uniform(tr.seed, 5, 9, static_cast<uint64_t>(i)) >= ratio;
            ASSERT_EQ(o[1].get_i64(i) != 0, keep) << "mask element " << i << " of " << n;
            if (dt == DType::f32) {
              const float want = keep ? x.data<float>()[i] * scale : 0.0f;
              const float got = o[0].data<float>()[i];
              ASSERT_EQ(std::memcmp(&got, &want, 4), 0)
                  << "element " << i << " of " << n << ": " << got << " vs " << want;
            } else {
              const uint16_t* xb = static_cast<const uint16_t*>(x.raw());
              const uint16_t want = keep ? ir::f32_to_bf16(ir::bf16_to_f32(xb[i]) * scale) : uint16_t(0);
              const uint16_t got = static_cast<const uint16_t*>(o[0].raw())[i];
              ASSERT_EQ(got, want) << "bf16 element " << i << " of " << n << ": bits " << got << " vs " << want;
            }
          }
        }
}

TEST(ElementwiseOps, GeluGradMatchesFiniteDifferences) {
  for (std::string approx : {"none", "tanh"}) {
    Tensor x = rnd(DType::f64, {40}, -4, 4, 17);
    Tensor dy = rnd(DType::f64, {40}, -1, 1, 18);
    Attributes a;
    a.set("approximate", approx);
    auto g = run_op("GeluGrad", {dy, x}, a)[0];
    const double k = std::sqrt(2.0 / M_PI);
    auto gelu = [&](double v) {
      return approx == "tanh" ? 0.5 * v * (1 + std::tanh(k * (v + 0.044715 * v * v * v)))
                              : 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    };
    std::vector<double> ref;
    for (int i = 0; i < 40; ++i) {
      double v = x.get_f64(i), h = 1e-6;
      ref.push_back(dy.get_f64(i) * (gelu(v + h) - gelu(v - h)) / (2 * h));
    }
    expect_close(g, ref, 1e-8, 1e-7, "GeluGrad " + approx);
  }
}

// ----------------------------------------------------------------------------- gradient rules

namespace {
/// f64 gradient check of `op` (seed 1000 + op name length), see check_op_grad.
void check_grad(const std::string& op, const std::vector<Tensor>& ins, Attributes attrs = {}, int n_out = 1,
                std::vector<int> wrt = {}, bool training = false, double tol = 1e-6, double eps = 1e-6) {
  check_op_grad(op, ins, attrs,
                {.seed_base = 1000, .n_out = n_out, .wrt = wrt, .training = training, .tolerance = tol, .eps = eps});
}
}  // namespace

TEST(ElementwiseGrad, BinaryWithBroadcast) {
  Tensor a = rnd(DType::f64, {2, 3, 4}, 0.5, 2, 31);
  Tensor b = rnd(DType::f64, {3, 1}, 0.5, 2, 32);
  for (const char* op : {"Add", "Sub", "Mul", "Div", "Pow"}) check_grad(op, {a, b});
  check_grad("Pow", {a, make(DType::i64, {}, {3})});
  check_grad("Max", {a, b});
  check_grad("Min", {a, b});
  check_grad("Max", {a, b, rnd(DType::f64, {4}, 0.5, 2, 33)});
  check_grad("Where", {rnd(DType::i64, {3, 4}, 0, 2, 3).cast(DType::boolean), a, b});
}

TEST(ElementwiseGrad, Unary) {
  Tensor x = rnd(DType::f64, {3, 5}, -2, 2, 41);
  Tensor pos = rnd(DType::f64, {3, 5}, 0.3, 2, 42);
  for (const char* op :
       {"Neg", "Abs", "Exp", "Tanh", "Sigmoid", "Relu", "Erf", "Gelu", "Softplus", "Sin", "Cos", "Identity"})
    check_grad(op, {x});
  for (const char* op : {"Sqrt", "Reciprocal", "Log"}) check_grad(op, {pos});
  Attributes leaky;
  leaky.set("alpha", 0.1);
  check_grad("LeakyRelu", {x}, leaky);
  Attributes tanh_approx;
  tanh_approx.set("approximate", std::string("tanh"));
  check_grad("Gelu", {x}, tanh_approx);
  check_grad("Clip", {x, make(DType::f64, {}, {-1.1}), make(DType::f64, {}, {0.9})}, {}, 1, {0});
}

TEST(ElementwiseGrad, CastAndDropout) {
  Tensor x = rnd(DType::f64, {3, 5}, -2, 2, 51);
  Attributes a;
  a.set("to", static_cast<int64_t>(dtype_to_onnx(DType::f32)));
  // f64 -> f32 -> loss: the loss is linear in x, so a large step avoids f32 rounding noise.
  check_grad("Cast", {x}, a, 1, {}, false, 1e-4, 1e-2);
  // Training-mode dropout: same Philox mask in every evaluation, gradient = dy * mask / (1 - ratio).
  check_grad("Dropout", {x, make(DType::f64, {}, {0.3})}, {}, 2, {0}, true);
}

TEST(Bf16Conversion, BulkRoutinesEqualTheScalarOnes) {
  // runtime::kernels::narrow_to_bf16 / widen_bf16 (AVX-512BW, AVX2 or scalar, by CPU) against
  // ir::f32_to_bf16 / bf16_to_f32 bit for bit: ties to even both ways, the largest finite
  // values (rounding up to infinity), infinities, quiet and signalling NaNs with payloads,
  // denormals, signed zeros, and random patterns; lengths that leave 16- and 8-lane tails.
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x7f7fffffu,
                                0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00001u, 0x7f800001u, 0xffbfffffu,
                                0x00000001u, 0x807fffffu, 0x00408000u, 0x00418000u, 0x3f7fffffu, 0x7f7f8000u};
  std::mt19937 rng(7);
  while (bits.size() < 16 * 9 + 7) bits.push_back(rng());
  for (size_t n : {bits.size(), size_t{23}, size_t{8}, size_t{3}}) {
    std::vector<float> in(n);
    std::memcpy(in.data(), bits.data(), n * 4);
    std::vector<uint16_t> out(n);
    runtime::kernels::narrow_to_bf16(in.data(), out.data(), static_cast<int64_t>(n));
    std::vector<float> back(n);
    runtime::kernels::widen_bf16(out.data(), back.data(), static_cast<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(out[i], ir::f32_to_bf16(in[i])) << "narrow " << std::hex << bits[i];
      const float want = ir::bf16_to_f32(out[i]);
      EXPECT_EQ(std::memcmp(&back[i], &want, 4), 0) << "widen " << std::hex << out[i];
    }
  }
}
