// Tests of the LLVM CPU code generator: hand-made kernels compiled with compile_cpu and run
// in several [begin, end) chunks (in reverse order) are compared with evaluate_reference
// (itself checked against float64 math in kernel_ir_test.cpp). Tolerances: exact (bit
// equality, NaN == NaN) for the same arithmetic; 1e-6 relative for f32 transcendentals
// (both sides call libm, so in practice exact), 1e-12 for f64; reductions 1e-5 relative
// for f32 row sums (vectorized, reassociated), exact for column sums and maxima.
#include "codegen/cpu/llvm_cpu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>

#include "codegen/kernel_ir.h"
#include "ir/ops/nn.h"
#include "kernel_builder.h"

namespace kiln::codegen {
namespace {

using ir::DType;
using ir::ScalarOp;

using testing::KB;
using testing::row_layernorm_kernel;
using testing::row_softmax_kernel;

/// Elements param p's buffer holds (a static kernel): its guard box or the domain.
int64_t buffer_elems(const KernelParam& p, const std::vector<Extent>& dom) {
  int64_t n = p.offset + 1;
  for (size_t d = 0; d < dom.size(); ++d) {
    const int64_t hi = p.guarded() ? p.guard_hi[d] : static_extent(dom[d]);  // a guarded param: its box
    if (hi > 0) n += (hi - 1) * static_extent(p.strides[d]);
  }
  return n;
}

uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

double read(DType t, const void* b, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(b)[i];
    case DType::f64:
      return static_cast<const double*>(b)[i];
    case DType::bf16:
      return ir::bf16_to_f32(static_cast<const uint16_t*>(b)[i]);
    case DType::f16:
      return ir::f16_to_f32(static_cast<const uint16_t*>(b)[i]);
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(b)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(b)[i];
    case DType::i8:
      return static_cast<const int8_t*>(b)[i];
    default:
      return static_cast<const uint8_t*>(b)[i];
  }
}

/// Deterministic input value i of a buffer: floats in [-2.5, 2.5] (with NaN, +-inf, +-0 when
/// `specials`), integers in [-10, 10] (u8: 0..255), bool 0/1.
void fill(DType t, void* b, int64_t n, uint32_t seed, bool specials) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = hash32(static_cast<uint32_t>(i) * 2654435761u + seed);
    double v = (h % 100001) / 20000.0 - 2.5;
    if (specials) {
      if (i % 97 == 3)
        v = NAN;
      else if (i % 89 == 5)
        v = INFINITY;
      else if (i % 83 == 7)
        v = -INFINITY;
      else if (i % 79 == 11)
        v = -0.0;
      else if (i % 73 == 13)
        v = 0.0;
    }
    const int64_t iv = static_cast<int64_t>(h % 21) - 10;
    switch (t) {
      case DType::f32:
        static_cast<float*>(b)[i] = static_cast<float>(v);
        break;
      case DType::f64:
        static_cast<double*>(b)[i] = v + 1e-9 * (h % 7);
        break;
      case DType::bf16:
        static_cast<uint16_t*>(b)[i] = ir::f32_to_bf16(static_cast<float>(v));
        break;
      case DType::f16:
        static_cast<uint16_t*>(b)[i] = ir::f32_to_f16(static_cast<float>(v));
        break;
      case DType::i64:
        static_cast<int64_t*>(b)[i] = iv;
        break;
      case DType::i32:
        static_cast<int32_t*>(b)[i] = static_cast<int32_t>(iv);
        break;
      case DType::i8:
        static_cast<int8_t*>(b)[i] = static_cast<int8_t>(iv);
        break;
      case DType::u8:
        static_cast<uint8_t*>(b)[i] = static_cast<uint8_t>(h >> 8);
        break;
      default:
        static_cast<uint8_t*>(b)[i] = static_cast<uint8_t>(h & 1);
        break;
    }
  }
}

/// Runs a compiled kernel over its parallel extent in `pieces` chunks, last chunk first
/// (then a split reduction's combine call, with its scratch after the buffers).
void run_chunked(const CpuKernel& ck, const std::vector<void*>& buffers, int pieces) {
  std::vector<void*> ptrs = buffers;
  std::vector<double> scratch(static_cast<size_t>(ck.scratch_bytes / 8 + 1), std::nan(""));
  if (ck.scratch_bytes > 0) ptrs.push_back(scratch.data());
  if (ck.parallel_dim < 0) {
    ck.fn(ptrs.data(), 0, 1);
    return;
  }
  const int64_t e = static_extent(ck.parallel_extent);
  std::vector<int64_t> cut;
  for (int i = 0; i <= pieces; ++i) cut.push_back(e * i / pieces);
  for (int i = pieces - 1; i >= 0; --i)
    if (cut[i] < cut[i + 1]) ck.fn(ptrs.data(), cut[i], cut[i + 1]);
  combine_cpu_partitions(ck, ptrs.data());
}

/// Tolerance per output param (by param index); missing: exact.
using Tols = std::map<int, double>;

/// Compiles `kernels` together, runs each one in 1 and `pieces` chunks, compares with the reference.
void check(const std::vector<Kernel>& kernels, const std::vector<Tols>& tols = {}, int pieces = 3,
           bool specials = true) {
  auto mod = compile_cpu(kernels);
  ASSERT_TRUE(mod.has_value()) << mod.message();
  ASSERT_EQ((*mod)->kernels().size(), kernels.size());
  for (size_t ki = 0; ki < kernels.size(); ++ki) {
    const Kernel& k = kernels[ki];
    const CpuKernel& ck = (*mod)->kernels()[ki];
    ASSERT_NE(ck.fn, nullptr);
    EXPECT_EQ(ck.name, k.name);
    std::vector<std::vector<uint8_t>> ref(k.params.size());
    for (size_t p = 0; p < k.params.size(); ++p) {
      const int64_t n = buffer_elems(k.params[p], k.domain);
      ref[p].assign(static_cast<size_t>(n * ir::dtype_size(k.params[p].dtype)), 0xAB);
      if (!k.params[p].is_output) fill(k.params[p].dtype, ref[p].data(), n, 1234u + 77u * p, specials);
    }
    const auto init = ref;
    for (int np : {1, pieces}) {
      auto got = init;
      std::vector<void*> rp, gp;
      for (size_t p = 0; p < k.params.size(); ++p) {
        rp.push_back(ref[p].data());
        gp.push_back(got[p].data());
      }
      if (np == 1) {
        ASSERT_TRUE(evaluate_reference(k, rp).is_ok());
      }
      run_chunked(ck, gp, np);
      for (size_t p = 0; p < k.params.size(); ++p) {
        if (!k.params[p].is_output) continue;
        const DType t = k.params[p].dtype;
        const double tol =
            tols.size() > ki && tols[ki].count(static_cast<int>(p)) ? tols[ki].at(static_cast<int>(p)) : 0;
        const int64_t n = buffer_elems(k.params[p], k.domain);
        int bad = 0;
        for (int64_t i = 0; i < n && bad < 5; ++i) {
          const double a = read(t, got[p].data(), i), b = read(t, ref[p].data(), i);
          bool ok;
          if (std::isnan(a) || std::isnan(b))
            ok = std::isnan(a) && std::isnan(b);
          else if (tol == 0)
            ok = a == b && std::signbit(a) == std::signbit(b);
          else
            ok = a == b || std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b));
          if (!ok) {
            ++bad;
            ADD_FAILURE() << k.name << " output %" << k.params[p].name << "[" << i << "]: got " << a << " want " << b
                          << " (chunks " << np << ", tol " << tol << ")";
          }
        }
      }
    }
  }
}

const std::vector<ScalarOp> kBinary = {ScalarOp::add, ScalarOp::sub, ScalarOp::mul, ScalarOp::div,
                                       ScalarOp::pow, ScalarOp::max, ScalarOp::min, ScalarOp::fmod};
const std::vector<ScalarOp> kUnaryFloat = {ScalarOp::neg,  ScalarOp::abs,   ScalarOp::exp,  ScalarOp::log,
                                           ScalarOp::sqrt, ScalarOp::erf,   ScalarOp::tanh, ScalarOp::sin,
                                           ScalarOp::cos,  ScalarOp::floor, ScalarOp::ceil, ScalarOp::round};

bool transcendental(ScalarOp op) {
  switch (op) {
    case ScalarOp::pow:
    case ScalarOp::exp:
    case ScalarOp::log:
    case ScalarOp::erf:
    case ScalarOp::tanh:
    case ScalarOp::sin:
    case ScalarOp::cos:
      return true;
    default:
      return false;
  }
}

/// One kernel applying every float op to x (and y) over `n` elements, one output per op.
Kernel all_float_ops(const std::string& name, DType t, int64_t n, Tols& tols, double ttol) {
  KB b(name, {n});
  int x = b.load(b.param("x", t, {1}));
  int y = b.load(b.param("y", t, {1}));
  for (ScalarOp op : kBinary) {
    int p = b.out(std::string("o_") + ir::scalar_op_name(op), b.op(op, {x, y}, t), {1});
    if (transcendental(op)) tols[p] = ttol;
  }
  for (ScalarOp op : kUnaryFloat) {
    int p = b.out(std::string("o_") + ir::scalar_op_name(op), b.op(op, {x}, t), {1});
    if (transcendental(op)) tols[p] = ttol;
  }
  // fma is correctly rounded in the emitter (llvm.fma) and the reference (std::fma):
  // compared exactly.
  b.out("o_fma", b.op(ScalarOp::fma, {x, y, b.op(ScalarOp::neg, {x}, t)}, t), {1});
  return b.k;
}

TEST(LlvmCpu, FmaRoundsOnce) {
  // a = 1 + 2^-12: a * a = 1 + 2^-11 + 2^-24 exactly, a tie in f32 that rounds to
  // 1 + 2^-11; fma(a, a, -(1 + 2^-11)) keeps the 2^-24 that a multiply then an add lose.
  // f64 alike with a = 1 + 2^-27 (a * a = 1 + 2^-26 + 2^-54).
  for (DType t : {DType::f32, DType::f64}) {
    const double eps = t == DType::f32 ? std::ldexp(1.0, -12) : std::ldexp(1.0, -27);
    KB b(t == DType::f32 ? "fma_f32" : "fma_f64", {1});
    const int a = b.load(b.param("a", t, {1}));
    b.out("y", b.op(ScalarOp::fma, {a, a, b.cst(-(1 + 2 * eps), t)}, t), {1});
    auto mod = compile_cpu({b.k});
    ASSERT_TRUE(mod.has_value()) << mod.message();
    float af = static_cast<float>(1 + eps), yf = -1;
    double ad = 1 + eps, yd = -1;
    void* ptrs[2] = {t == DType::f32 ? static_cast<void*>(&af) : &ad, t == DType::f32 ? static_cast<void*>(&yf) : &yd};
    (*mod)->kernels()[0].fn(ptrs, 0, 1);
    EXPECT_EQ(t == DType::f32 ? static_cast<double>(yf) : yd, eps * eps) << ir::dtype_name(t);
  }
}

TEST(LlvmCpu, F32TimesF64ScalarBySplitAndFmaIsRoundedOnce) {
  // Softmax's normalization (mul_exact_f32 in ir/ops/nn.cpp): e (f32) times a
  // row-invariant r (f64) as fma(e, hi, e * lo) with hi = f32(r), lo = f32(r - hi). The
  // result must be f32(e * r) computed in double (the product of a 24-bit and a 53-bit
  // significand, rounded once to f64 and then to f32), except where e * r lies within
  // about 2^-47 of an f32 rounding boundary; never more than 1 ulp away. An f32 multiply
  // by f32(r) instead differs in about a quarter of the elements (checked below, so that
  // the test can tell the two apart).
  const int64_t n = 1 << 17;
  KB b("mul_exact", {n});
  const int e = b.load(b.param("e", DType::f32, {1}));
  const int r = b.load(b.param("r", DType::f64, {1}));
  const int hi = b.op(ScalarOp::cast, {r}, DType::f32);
  const int lo =
      b.op(ScalarOp::cast, {b.op(ScalarOp::sub, {r, b.op(ScalarOp::cast, {hi}, DType::f64)}, DType::f64)}, DType::f32);
  b.out("y", b.op(ScalarOp::fma, {e, hi, b.op(ScalarOp::mul, {e, lo}, DType::f32)}, DType::f32), {1});
  b.out("y_naive", b.op(ScalarOp::mul, {e, hi}, DType::f32), {1});
  auto mod = compile_cpu({b.k});
  ASSERT_TRUE(mod.has_value()) << mod.message();
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<float> ev(n), y(n), yn(n);
  std::vector<double> rv(n);
  for (int64_t i = 0; i < n; ++i) {
    ev[static_cast<size_t>(i)] = static_cast<float>(std::exp(-20 * u(rng)));  // softmax numerators
    rv[static_cast<size_t>(i)] = 1 / (1 + 200 * u(rng));                      // 1 / row sums
  }
  void* ptrs[4] = {ev.data(), rv.data(), y.data(), yn.data()};
  (*mod)->kernels()[0].fn(ptrs, 0, n);
  int64_t differ = 0, naive_differ = 0;
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
    const float want = static_cast<float>(static_cast<double>(ev[i]) * rv[i]);
    differ += y[i] != want;
    naive_differ += yn[i] != want;
    EXPECT_LE(std::fabs(static_cast<double>(y[i]) - want), std::fabs(std::nextafter(want, 2.f * want + 1) - want))
        << ev[i] << " * " << rv[i];
  }
  std::cout << "[ INFO ] split + fma: " << differ << " of " << n
            << " products differ from f32(f64(e) * r); f32 multiply by f32(r): " << naive_differ << "\n";
  EXPECT_LE(differ, 2) << "of " << n;
  EXPECT_GT(naive_differ, n / 10) << "the naive product should differ visibly";
}

TEST(LlvmCpu, EveryFloatOpF32F64Bf16F16) {
  std::vector<Tols> tols(4);
  std::vector<Kernel> ks = {all_float_ops("ops_f32", DType::f32, 1000, tols[0], 1e-6),
                            all_float_ops("ops_f64", DType::f64, 1000, tols[1], 1e-12),
                            all_float_ops("ops_bf16", DType::bf16, 1000, tols[2], 1e-2),
                            all_float_ops("ops_f16", DType::f16, 1000, tols[3], 1e-3)};
  check(ks, tols);
}

TEST(LlvmCpu, FloatArithmeticMatchesFloat64Math) {
  // Independent of the reference: z = x * y + 1 over 7 elements in f32.
  KB b("fma_like", {7});
  int x = b.param("x", DType::f32, {1}), y = b.param("y", DType::f32, {1});
  b.out(
      "z",
      b.op(ScalarOp::add, {b.op(ScalarOp::mul, {b.load(x), b.load(y)}, DType::f32), b.cst(1, DType::f32)}, DType::f32),
      {1});
  auto mod = compile_cpu({b.k});
  ASSERT_TRUE(mod.has_value()) << mod.message();
  float xv[7] = {1, 2, 3, -4, 0.5f, 1e-3f, 7}, yv[7] = {2, 0.25f, -1, 3, 8, 1e3f, 0}, zv[7];
  void* ptrs[3] = {xv, yv, zv};
  (*mod)->kernels()[0].fn(ptrs, 0, 7);
  for (int i = 0; i < 7; ++i) EXPECT_NEAR(zv[i], double(xv[i]) * yv[i] + 1, 1e-6 * (1 + std::fabs(zv[i])));
}

TEST(LlvmCpu, F64ExpIsWithinTwoUlpOfLongDouble) {
  // The generated f64 exp is inline polynomial code (exp_poly_f64), not libm: checked
  // here against expl (long double, an independent implementation) over the whole
  // range, the subnormal tail, overflow, and NaN.
  std::vector<double> xs;
  for (int i = 0; i <= 20000; ++i) xs.push_back(-745.5 + (710.5 + 745.5) * i / 20000.0);
  for (double v : {0.0, -0.0, 1e-300, -1e-20, 0.5, -0.3465735902799726, 0.34657359027997264, 1.0, 88.0, -88.0, 709.78,
                   709.79, -708.3, -744.0, -745.2, 1e308, -1e308})
    xs.push_back(v);
  xs.push_back(std::numeric_limits<double>::infinity());
  xs.push_back(-std::numeric_limits<double>::infinity());
  xs.push_back(std::numeric_limits<double>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(xs.size());
  KB b("exp_f64", {n});
  b.out("y", b.op(ScalarOp::exp, {b.load(b.param("x", DType::f64, {1}))}, DType::f64), {1});
  auto mod = compile_cpu({b.k});
  ASSERT_TRUE(mod.has_value()) << mod.message();
  std::vector<double> ys(xs.size());
  void* ptrs[2] = {xs.data(), ys.data()};
  (*mod)->kernels()[0].fn(ptrs, 0, n);
  for (size_t i = 0; i < xs.size(); ++i) {
    const long double ref = std::exp(static_cast<long double>(xs[i]));
    if (std::isnan(xs[i])) {
      EXPECT_TRUE(std::isnan(ys[i]));
      continue;
    }
    if (ref > std::numeric_limits<double>::max()) {
      EXPECT_EQ(ys[i], std::numeric_limits<double>::infinity()) << xs[i];
      continue;
    }
    // Normal results: 2 ulp relative; subnormal results: 2 subnormal spacings (absolute).
    const double tol = ref >= std::numeric_limits<double>::min()
                           ? 2 * std::numeric_limits<double>::epsilon() * static_cast<double>(ref)
                           : 2 * std::numeric_limits<double>::denorm_min();
    EXPECT_NEAR(ys[i], static_cast<double>(ref), tol) << "exp(" << xs[i] << ")";
  }
}

/// Distance in units in the last place between two finite floats of the same sign (or
/// zero): the difference of their ordered bit patterns.
int64_t ulp_distance(float a, float b) {
  auto ordered = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i < 0 ? static_cast<int64_t>(INT32_MIN) - i : static_cast<int64_t>(i);
  };
  return std::llabs(ordered(a) - ordered(b));
}

TEST(LlvmCpu, F32ExpIsWithinTwoUlpOfLongDouble) {
  // The generated f32 exp is inline polynomial code (expf_poly: Cephes' polynomial, FMA
  // range reduction), not libm: checked against expl (long double) rounded to f32 on
  // every 257th f32 bit pattern from 0 to 89 and to -104 (about 8.3 million points,
  // every binade, the subnormal results below -87.3), the cuts, +-inf and NaN.
  std::vector<float> xs;
  for (uint32_t bits = 0; bits <= 0x42B20000u; bits += 257) {  // +0 .. 89
    float f;
    std::memcpy(&f, &bits, 4);
    xs.push_back(f);
  }
  for (uint32_t bits = 0x80000000u; bits <= 0xC2D00000u; bits += 257) {  // -0 .. -104
    float f;
    std::memcpy(&f, &bits, 4);
    xs.push_back(f);
  }
  for (float v : {88.72283935546875f, 88.7228394f, 88.72f, 89.0f, 100.f, -87.33f, -103.97f, -103.972076f, -103.98f,
                  -104.0f, -150.f, 0.34657359f, -0.34657359f})
    xs.push_back(v);
  xs.push_back(std::numeric_limits<float>::infinity());
  xs.push_back(-std::numeric_limits<float>::infinity());
  xs.push_back(std::numeric_limits<float>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(xs.size());
  KB b("exp_f32", {n});
  b.out("y", b.op(ScalarOp::exp, {b.load(b.param("x", DType::f32, {1}))}, DType::f32), {1});
  auto mod = compile_cpu({b.k});
  ASSERT_TRUE(mod.has_value()) << mod.message();
  std::vector<float> ys(xs.size());
  void* ptrs[2] = {xs.data(), ys.data()};
  (*mod)->kernels()[0].fn(ptrs, 0, n);
  int64_t worst = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (std::isnan(xs[i])) {
      EXPECT_TRUE(std::isnan(ys[i]));
      continue;
    }
    const float ref = static_cast<float>(std::exp(static_cast<long double>(xs[i])));
    const int64_t d = ulp_distance(ys[i], ref);
    worst = std::max(worst, d);
    if (d > 2) {
      ADD_FAILURE() << "exp(" << xs[i] << ") = " << ys[i] << ", want " << ref << " (" << d << " ulp)";
      break;
    }
  }
  std::cout << "[ INFO ] f32 exp: max " << worst << " ulp over " << n << " points\n";
}

TEST(LlvmCpu, F32ErfAndTanhAreWithinFourUlpOfLongDouble) {
  // The generated f32 erf and tanh are inline polynomial code (erff_poly, tanhf_poly),
  // not libm: checked against erfl/tanhl (long double) rounded to f32 on every 1021st
  // f32 bit pattern in [-5, 5] (about 2.1 million points, from the subnormals up, so
  // every binade and range cut is covered), the range cuts, +-0, +-inf and NaN.
  // Bound: 4 ulp (measured: erf 3, from one polynomial whose argument t = 2x^2/3.92^2 - 1
  // is rounded near -1 for small x; tanh 1, plus expf_poly's error beyond its cut).
  std::vector<float> xs;
  for (uint32_t bits = 0; bits <= 0x40A00000u; bits += 1021) {  // +0 .. 5.0, positive floats
    float f;
    std::memcpy(&f, &bits, 4);
    xs.push_back(f);
    xs.push_back(-f);
  }
  for (float v : {0.0f, -0.0f, 1e-30f, 1e-10f, 3.9192f, 3.92f, 0.55f, 9.01f, 9.1f, 20.f, 1e30f})
    for (float s : {1.f, -1.f}) xs.push_back(s * v);
  xs.push_back(std::numeric_limits<float>::infinity());
  xs.push_back(-std::numeric_limits<float>::infinity());
  xs.push_back(std::numeric_limits<float>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(xs.size());
  KB b("erf_tanh_f32", {n});
  int x = b.load(b.param("x", DType::f32, {1}));
  b.out("erf", b.op(ScalarOp::erf, {x}, DType::f32), {1});
  b.out("tanh", b.op(ScalarOp::tanh, {x}, DType::f32), {1});
  auto mod = compile_cpu({b.k});
  ASSERT_TRUE(mod.has_value()) << mod.message();
  std::vector<float> ye(xs.size()), yt(xs.size());
  void* ptrs[3] = {xs.data(), ye.data(), yt.data()};
  (*mod)->kernels()[0].fn(ptrs, 0, n);
  int64_t worst_erf = 0, worst_tanh = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (std::isnan(xs[i])) {
      EXPECT_TRUE(std::isnan(ye[i]) && std::isnan(yt[i]));
      continue;
    }
    const float re = static_cast<float>(std::erf(static_cast<long double>(xs[i])));
    const float rt = static_cast<float>(std::tanh(static_cast<long double>(xs[i])));
    EXPECT_EQ(std::signbit(ye[i]), std::signbit(re)) << "erf(" << xs[i] << ")";
    EXPECT_EQ(std::signbit(yt[i]), std::signbit(rt)) << "tanh(" << xs[i] << ")";
    const int64_t de = ulp_distance(ye[i], re), dt = ulp_distance(yt[i], rt);
    worst_erf = std::max(worst_erf, de);
    worst_tanh = std::max(worst_tanh, dt);
    if (de > 4) ADD_FAILURE() << "erf(" << xs[i] << ") = " << ye[i] << ", want " << re << " (" << de << " ulp)";
    if (dt > 4) ADD_FAILURE() << "tanh(" << xs[i] << ") = " << yt[i] << ", want " << rt << " (" << dt << " ulp)";
    if (de > 4 || dt > 4) break;
  }
  std::cout << "[ INFO ] f32 erf: max " << worst_erf << " ulp, tanh: max " << worst_tanh << " ulp over " << n
            << " points\n";
}

TEST(LlvmCpu, GuardedLoadsReadOnlyInsideTheirBox) {
  // A Concat along the last dim of (5, 3) and (5, 4) inputs into a (5, 7) domain (the
  // second input read at offset -3 inside columns 3..6, the first as its fallback), times
  // 2; and a row sum of a (3, 9) domain over a Pad-like input (6 x 4 box at rows 0..2,
  // columns 2..5, -1 outside): guards that cut a reduced dim. Each buffer holds only its
  // box, so a load outside the box would read past it (and differ from the reference).
  std::vector<Kernel> ks;
  for (DType t : {DType::f32, DType::bf16, DType::f64}) {
    {
      KB b(std::string("concat_") + ir::dtype_name(t), {5, 7});
      const int p0 = b.param("a", t, {3, 1});
      b.k.params[p0].guard_lo = {0, 0};
      b.k.params[p0].guard_hi = {5, 3};
      const int p1 = b.param("b", t, {4, 1}, false, 0);
      b.k.params[p1].offset = -3;
      b.k.params[p1].guard_lo = {0, 3};
      b.k.params[p1].guard_hi = {5, 7};
      const int e = b.k.add_load(p1, b.load(p0));
      b.out("y", b.op(ScalarOp::mul, {e, b.cst(2, t)}, t), {7, 1});
      ks.push_back(b.k);
    }
    {
      KB b(std::string("padsum_") + ir::dtype_name(t), {3, 9});
      b.k.reduced = {false, true};
      const int p = b.param("x", t, {4, 1});
      b.k.params[p].offset = -2;
      b.k.params[p].guard_lo = {0, 2};
      b.k.params[p].guard_hi = {3, 6};
      const int e = b.k.add_load(p, b.cst(-1, t));
      b.out("s", e, {1, 0}, ReduceKind::sum);
      ks.push_back(b.k);
    }
  }
  check(ks);
}

TEST(LlvmCpu, IntegerOps) {
  std::vector<Kernel> ks;
  for (DType t : {DType::i64, DType::i32, DType::i8, DType::u8}) {
    KB b(std::string("int_") + ir::dtype_name(t), {1001});
    int x = b.load(b.param("x", t, {1}));
    int y = b.load(b.param("y", t, {1}));
    for (ScalarOp op : kBinary) b.out(std::string("o_") + ir::scalar_op_name(op), b.op(op, {x, y}, t), {1});
    b.out("o_neg", b.op(ScalarOp::neg, {x}, t), {1});
    b.out("o_abs", b.op(ScalarOp::abs, {x}, t), {1});
    for (ScalarOp op : {ScalarOp::lt, ScalarOp::le, ScalarOp::gt, ScalarOp::ge, ScalarOp::eq})
      b.out(std::string("c_") + ir::scalar_op_name(op), b.op(op, {x, y}, DType::boolean), {1});
    b.out("to_f32", b.op(ScalarOp::cast, {x}, DType::f32), {1});
    b.out("to_f64", b.op(ScalarOp::cast, {x}, DType::f64), {1});
    b.out("to_bf16", b.op(ScalarOp::cast, {x}, DType::bf16), {1});
    b.out("to_bool", b.op(ScalarOp::cast, {x}, DType::boolean), {1});
    b.out("to_i64", b.op(ScalarOp::cast, {x}, DType::i64), {1});
    b.out("to_u8", b.op(ScalarOp::cast, {x}, DType::u8), {1});
    ks.push_back(b.k);
  }
  check(ks);
}

TEST(LlvmCpu, ComparisonsLogicSelectCasts) {
  KB b("logic", {997});
  const DType f = DType::f32;
  int x = b.load(b.param("x", f, {1}));
  int y = b.load(b.param("y", f, {1}));
  int m = b.load(b.param("m", DType::boolean, {1}));
  int lt = b.op(ScalarOp::lt, {x, y}, DType::boolean);
  for (ScalarOp op : {ScalarOp::lt, ScalarOp::le, ScalarOp::gt, ScalarOp::ge, ScalarOp::eq})
    b.out(std::string("c_") + ir::scalar_op_name(op), b.op(op, {x, y}, DType::boolean), {1});
  b.out("and", b.op(ScalarOp::logical_and, {lt, m}, DType::boolean), {1});
  b.out("or", b.op(ScalarOp::logical_or, {lt, m}, DType::boolean), {1});
  b.out("xor", b.op(ScalarOp::logical_xor, {lt, m}, DType::boolean), {1});
  b.out("not", b.op(ScalarOp::logical_not, {m}, DType::boolean), {1});
  b.out("sel", b.op(ScalarOp::select, {m, x, y}, f), {1});
  b.out("bool_to_f32", b.op(ScalarOp::cast, {m}, f), {1});
  b.out("bool_to_i64", b.op(ScalarOp::cast, {m}, DType::i64), {1});
  b.out("f32_to_bool", b.op(ScalarOp::cast, {x}, DType::boolean), {1});
  // Scale x so that float -> int casts see large values, NaN and inf (truncate, saturate, NaN -> 0).
  int big = b.op(ScalarOp::mul, {x, b.cst(3e9, f)}, f);
  b.out("f32_to_i64", b.op(ScalarOp::cast, {x}, DType::i64), {1});
  b.out("big_to_i64", b.op(ScalarOp::cast, {big}, DType::i64), {1});
  b.out("big_to_i32", b.op(ScalarOp::cast, {big}, DType::i32), {1});
  b.out("f32_to_u8", b.op(ScalarOp::cast, {b.op(ScalarOp::mul, {x, b.cst(100, f)}, f)}, DType::u8), {1});
  b.out("f32_to_i8", b.op(ScalarOp::cast, {b.op(ScalarOp::mul, {x, b.cst(100, f)}, f)}, DType::i8), {1});
  int bf = b.op(ScalarOp::cast, {x}, DType::bf16);
  b.out("f32_to_bf16", bf, {1});
  b.out("bf16_to_f32", b.op(ScalarOp::cast, {bf}, f), {1});
  b.out("bf16_to_i64",
        b.op(ScalarOp::cast, {b.op(ScalarOp::mul, {bf, b.cst(7, DType::bf16)}, DType::bf16)}, DType::i64), {1});
  b.out("f32_to_f16", b.op(ScalarOp::cast, {x}, DType::f16), {1});
  int d = b.op(ScalarOp::cast, {x}, DType::f64);
  b.out("f32_to_f64", b.op(ScalarOp::mul, {d, b.cst(1.0 / 3.0, DType::f64)}, DType::f64), {1});
  b.out("f64_to_bf16",
        b.op(ScalarOp::cast, {b.op(ScalarOp::mul, {d, b.cst(1.0 / 3.0, DType::f64)}, DType::f64)}, DType::bf16), {1});
  check({b.k});
}

TEST(LlvmCpu, BroadcastTransposeOffsetsRankZeroOddSizes) {
  std::vector<Kernel> ks;
  {  // z[i, j] = x^T[i, j] * row[j] + col[i], x stored (53, 37), x offset 5
    KB b("bcast", {37, 53});
    int x = b.load(b.param("x", DType::f32, {1, 37}, false, 5));
    int r = b.load(b.param("row", DType::f32, {0, 1}));
    int c = b.load(b.param("col", DType::f32, {1, 0}));
    b.out("z", b.op(ScalarOp::add, {b.op(ScalarOp::mul, {x, r}, DType::f32), c}, DType::f32), {53, 1});
    // transposed output too
    b.out("zt", b.op(ScalarOp::sub, {x, c}, DType::f32), {1, 37});
    ks.push_back(b.k);
  }
  {  // rank 0
    KB b("scalar", {});
    int x = b.load(b.param("x", DType::f32, {}));
    b.out("z", b.op(ScalarOp::mul, {x, b.cst(2.5, DType::f32)}, DType::f32), {});
    ks.push_back(b.k);
  }
  for (int64_t n : {1, 7, 1000003}) {  // 1-D odd sizes
    KB b("odd_" + std::to_string(n), {n});
    int x = b.load(b.param("x", DType::f32, {1}));
    int s = b.load(b.param("s", DType::f32, {0}));  // scalar broadcast
    b.out("z", b.op(ScalarOp::sub, {b.op(ScalarOp::mul, {x, s}, DType::f32), x}, DType::f32), {1});
    ks.push_back(b.k);
  }
  {  // 3-D with a broadcast middle dim: collapse keeps 2 dims
    KB b("bcast3", {5, 9, 11});
    int x = b.load(b.param("x", DType::bf16, {11, 0, 1}));
    int y = b.load(b.param("y", DType::bf16, {99, 11, 1}));
    b.out("z", b.op(ScalarOp::div, {y, x}, DType::bf16), {99, 11, 1});
    ks.push_back(b.k);
  }
  check(ks, {}, 4, false);
}

TEST(LlvmCpu, Reductions) {
  std::vector<Kernel> ks;
  std::vector<Tols> tols;
  // One input `x` reduced to its sum and its max (`sum_tol` 0: compared exactly).
  auto sum_and_max = [&](const char* name, std::vector<int64_t> domain, std::vector<bool> reduced, DType dt,
                         std::vector<int64_t> in, std::vector<int64_t> out, double sum_tol) {
    KB b(name, std::move(domain), std::move(reduced));
    int x = b.load(b.param("x", dt, std::move(in)));
    int s = b.out("sum", x, out, ReduceKind::sum);
    b.out("max", x, out, ReduceKind::max);
    ks.push_back(b.k);
    tols.push_back(sum_tol > 0 ? Tols{{s, sum_tol}} : Tols{});
  };
  {  // row sum + row max of exp(x - 1) over (33, 1001): multiple reduction outputs
    KB b("row", {33, 1001}, {false, true});
    int x = b.load(b.param("x", DType::f32, {1001, 1}));
    int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {x, b.cst(1, DType::f32)}, DType::f32)}, DType::f32);
    int s = b.out("sum", e, {1, 0}, ReduceKind::sum);
    b.out("max", x, {1, 0}, ReduceKind::max);
    ks.push_back(b.k);
    tols.push_back({{s, 1e-5}});
  }
  {  // column sum (bias gradient) over rows of (1001, 300): wider than one tile
    sum_and_max("col", {1001, 300}, {true, false}, DType::f32, {300, 1}, {0, 1}, 0);
  }
  {  // middle reduction (4, 50, 30) over dim 1, and (6, 5, 40) over dims 0 and 2
    KB b("mid", {4, 50, 30}, {false, true, false});
    int x = b.load(b.param("x", DType::f64, {1500, 30, 1}));
    b.out("sum", x, {30, 0, 1}, ReduceKind::sum);
    ks.push_back(b.k);
    tols.push_back({});
    sum_and_max("outer_inner", {6, 5, 40}, {true, false, true}, DType::f32, {200, 40, 1}, {0, 1, 0}, 1e-5);
  }
  {  // full reduction to a scalar, bf16 input with f32 accumulation, integer sum/max
    sum_and_max("full", {12345}, {true}, DType::bf16, {1}, {0}, 1e-2);
    sum_and_max("int_red", {17, 101}, {false, true}, DType::i64, {101, 1}, {1, 0}, 0);
  }
  {  // split column reductions (rows cut into partitions, combined in order): a bf16
     // input with f32 accumulators, integer sums and maxes, 16 partitions of an uneven
     // row count, and two reduced dims outside the kept one
    sum_and_max("split_bf16", {2000, 37}, {true, false}, DType::bf16, {37, 1}, {0, 1}, 1e-2);
    sum_and_max("split_int", {4100, 9}, {true, false}, DType::i64, {9, 1}, {0, 1}, 0);
    KB d("split_two_reduced", {700, 3, 41}, {true, true, false});
    int z = d.load(d.param("z", DType::f32, {41, 700 * 41, 1}));
    d.out("sum", z, {0, 0, 1}, ReduceKind::sum);
    ks.push_back(d.k);
    tols.push_back({});
  }
  {  // empty reduced dim: sum 0, max -inf
    sum_and_max("empty", {5, 0}, {false, true}, DType::f32, {0, 1}, {1, 0}, 0);
  }
  check(ks, tols, 3, false);
  check({ks[0], ks[1]}, {tols[0], tols[1]}, 5, true);  // NaN/inf inputs
}

TEST(LlvmCpu, ScheduleAndVectorization) {
  KB a("vec_add", {4096});
  a.out("z",
        a.op(ScalarOp::add, {a.load(a.param("x", DType::f32, {1})), a.load(a.param("y", DType::f32, {1}))}, DType::f32),
        {1});
  // f32 sums accumulate in double in index order (bit-equal to eager); an f64 row sum
  // may reassociate, so it vectorizes.
  KB r("row_sum", {64, 512}, {false, true});
  r.out("s", r.load(r.param("x", DType::f64, {512, 1})), {1, 0}, ReduceKind::sum);
  KB c("col_sum", {64, 512}, {true, false});
  c.out("s", c.load(c.param("x", DType::f32, {512, 1})), {0, 1}, ReduceKind::sum);
  auto mod = compile_cpu({a.k, r.k, c.k});
  ASSERT_TRUE(mod.has_value()) << mod.message();
  const auto& ks = (*mod)->kernels();
  EXPECT_EQ(ks[0].parallel_dim, 0);
  EXPECT_EQ(ks[0].parallel_extent, 4096);
  EXPECT_EQ(ks[1].parallel_extent, 64);
  EXPECT_EQ(ks[1].work_per_index, 512);
  EXPECT_EQ(ks[2].parallel_dim, 1);
  EXPECT_EQ(ks[2].parallel_extent, 512);
  EXPECT_EQ(ks[2].split_parts, 0);  // 64 rows: too few to split
  EXPECT_EQ(ks[2].scratch_bytes, 0);
  EXPECT_EQ((*mod)->stats().num_kernels, 3);
  {  // A column sum over many rows splits its rows into partitions (f64 partial rows).
    KB t("tall_col_sum", {8192, 256}, {true, false});
    t.out("s", t.load(t.param("x", DType::f32, {256, 1})), {0, 1}, ReduceKind::sum);
    t.out("m", t.load(t.param("y", DType::f32, {256, 1})), {0, 1}, ReduceKind::max);
    auto tall = compile_cpu({t.k});
    ASSERT_TRUE(tall.has_value()) << tall.message();
    const CpuKernel& tk = (*tall)->kernels()[0];
    EXPECT_EQ(tk.parallel_dim, 0);
    EXPECT_EQ(tk.split_parts, 16);
    EXPECT_EQ(tk.parallel_extent, 16);
    EXPECT_EQ(tk.scratch_bytes, 16 * 256 * (8 + 4));  // f64 sum, f32 max accumulators
    EXPECT_EQ(tk.work_per_index, 8192 * 256 / 16);
  }
  const std::string& ir = (*mod)->llvm_ir();
  // Each kernel's optimized body holds vector code (SSE at least: <4 x float>, <2 x double>).
  for (const char* name : {"vec_add", "row_sum", "col_sum"}) {
    const size_t at = ir.find(std::string("define void @") + name + "(");
    ASSERT_NE(at, std::string::npos) << name;
    const std::string body = ir.substr(at, ir.find("\n}\n", at) - at);
    const char* vec = std::string(name) == "row_sum" ? " x double>" : " x float>";
    EXPECT_NE(body.find(vec), std::string::npos) << name << " not vectorized:\n" << body;
  }
  EXPECT_NE(ir.find("fadd reassoc <"), std::string::npos) << "row sum not vectorized";
}

TEST(LlvmCpu, EmitLlvmIrHasOneFunctionPerKernel) {
  KB a("k_one", {10});
  a.out("z", a.op(ScalarOp::neg, {a.load(a.param("x", DType::f32, {1}))}, DType::f32), {1});
  KB b("k_two", {3, 4}, {false, true});
  b.out("s", b.load(b.param("x", DType::f64, {4, 1})), {1, 0}, ReduceKind::sum);
  auto ir = emit_llvm_ir({a.k, b.k});
  ASSERT_TRUE(ir.has_value()) << ir.message();
  EXPECT_NE(ir->find("define void @k_one(ptr"), std::string::npos) << *ir;
  EXPECT_NE(ir->find("define void @k_two(ptr"), std::string::npos) << *ir;
  EXPECT_FALSE(host_cpu_description().empty());
}

TEST(LlvmCpu, ErrorsNameTheKernel) {
  KB a("broken_kernel", {10});
  int x = a.param("x", DType::f32, {1});
  a.out("z", a.load(x), {1});
  a.k.stores[0].param = x;  // store into an input
  auto mod = compile_cpu({a.k});
  ASSERT_FALSE(mod.has_value());
  EXPECT_NE(mod.message().find("broken_kernel"), std::string::npos) << mod.message();
  KB b("dup", {2});
  b.out("z", b.load(b.param("x", DType::f32, {1})), {1});
  auto dup = compile_cpu({b.k, b.k});
  ASSERT_FALSE(dup.has_value());
  EXPECT_NE(dup.message().find("dup"), std::string::npos);
}

// ---- Row programs (reduce expressions, kernel_ir.h): JIT against the reference, and
// the reference against float64 math in kernel_ir_test.cpp.

TEST(LlvmCpuRow, SoftmaxAndLayerNormMatchReference) {
  std::vector<Kernel> ks = {
      row_softmax_kernel("softmax_f32", 37, 129, DType::f32), row_softmax_kernel("softmax_bf16", 5, 64, DType::bf16),
      row_softmax_kernel("softmax_f64", 4, 33, DType::f64), row_layernorm_kernel("layernorm", 9, 256)};
  // exp through libm on both sides; sums reassociated (vectorized) in double.
  std::vector<Tols> tols = {{{1, 1e-6}}, {{1, 1e-2}}, {{1, 1e-12}}, {{3, 1e-5}, {4, 1e-6}, {5, 1e-5}}};
  check(ks, tols, 3, /*specials=*/false);
}

TEST(LlvmCpuRow, NonFiniteRowsMatchReference) {
  // NaN and +-inf inputs: rows with NaN are NaN, rows with +inf give NaN (inf - inf), as
  // in the reference and the eager Softmax.
  check({row_softmax_kernel("softmax_specials", 40, 50, DType::f32)}, {{{1, 1e-6}}}, 3, /*specials=*/true);
}

TEST(LlvmCpuRow, ReducedOuterDimAndMixedStores) {
  // Softmax along dim 0 of [cols, rows] (reduced dim outside the kept one), plus a
  // reduction store (the row sum of y*dy, SoftmaxGrad's inner sum) and a point store
  // using it: dx = y * (dy - sum(dy * y)).
  const DType f = DType::f32;
  KB b("softmax_grad_outer", {24, 10}, {true, false});
  int y = b.load(b.param("y", f, {10, 1}));
  int dy = b.load(b.param("dy", f, {10, 1}));
  int s = b.k.add_reduce(ReduceKind::sum, b.op(ScalarOp::mul, {dy, y}, f));
  b.out("dx", b.op(ScalarOp::mul, {y, b.op(ScalarOp::sub, {dy, s}, f)}, f), {10, 1});
  b.out("rowsum", b.op(ScalarOp::mul, {dy, y}, f), {0, 1}, ReduceKind::sum);
  b.out("rowmax", b.k.add_reduce(ReduceKind::max, dy), {0, 1});
  ASSERT_TRUE(b.k.verify().is_ok()) << b.k.verify().message();
  check({b.k}, {{{2, 1e-5}, {3, 1e-5}}}, 3, /*specials=*/false);
}

TEST(LlvmCpuRow, CompilingPrintsNothing) {
  // A 10-wide softmax row (mlp_digits' classes): LLVM treats loops of under 16 known
  // iterations as size-optimized and, when a loop carries vectorization hints, reports
  // "loop not vectorized" on stderr. kiln neither hints such loops nor lets LLVM print.
  // The kernel is mlp_digits' cross-entropy gradient after the decompose pass: an f64
  // softmax over 10 classes with a one-hot epilogue (Equal(iota, label)) and a per-row
  // coefficient, whose loops need runtime alias checks.
  KB b("sce_grad_10", {8, 10}, {false, true});
  int iota = b.load(b.param("iota", DType::i64, {0, 1}));
  int label = b.load(b.param("label", DType::i64, {1, 0}));
  int x = b.op(ScalarOp::cast, {b.load(b.param("logits", DType::f32, {10, 1}))}, DType::f64);
  int coef = b.load(b.param("coef", DType::f64, {1, 0}));
  int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {x, b.k.add_reduce(ReduceKind::max, x)}, DType::f64)}, DType::f64);
  int inv = b.op(ScalarOp::div, {b.cst(1, DType::f64), b.k.add_reduce(ReduceKind::sum, e)}, DType::f64);
  int g = b.op(ScalarOp::sub,
               {b.op(ScalarOp::mul, {b.op(ScalarOp::mul, {e, inv}, DType::f64), coef}, DType::f64),
                b.op(ScalarOp::select, {b.op(ScalarOp::eq, {iota, label}, DType::boolean), coef, b.cst(0, DType::f64)},
                     DType::f64)},
               DType::f64);
  b.out("dlogits", b.op(ScalarOp::cast, {g}, DType::f32), {10, 1});
  ASSERT_TRUE(b.k.verify().is_ok()) << b.k.verify().message();
  ::testing::internal::CaptureStderr();
  auto mod = compile_cpu({b.k, row_softmax_kernel("softmax_10", 32, 10, DType::f32),
                          row_softmax_kernel("softmax_300", 4, 300, DType::f32)});
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(mod.has_value()) << mod.message();
  EXPECT_EQ(err, "");
}

TEST(LlvmCpuRow, RowScratchReloadsMatchReference) {
  // exp(x - max) is needed in passes 2, 3 and 4 (the sum, y = e / sum with the sum of
  // e * y, then z = e * that sum): the emitter keeps it in a row scratch array (two
  // reduced dims, so the row position spans both) and reloads it; a 40000-element row
  // (160 KB of f32, over the 128 KB scratch limit) recomputes it instead.
  const DType f = DType::f32;
  KB b("scratch_two_reduced", {5, 6, 40}, {false, true, true});
  int x = b.load(b.param("x", f, {240, 1, 6}));  // transposed in the row: dims 1, 2 stay apart
  int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {x, b.k.add_reduce(ReduceKind::max, x)}, f)}, f);
  int y = b.op(ScalarOp::div, {e, b.k.add_reduce(ReduceKind::sum, e)}, f);
  int q = b.k.add_reduce(ReduceKind::sum, b.op(ScalarOp::mul, {e, y}, f));
  b.out("y", y, {240, 40, 1});
  b.out("z", b.op(ScalarOp::mul, {e, q}, f), {240, 40, 1});
  b.out("q", q, {1, 0, 0});
  ASSERT_TRUE(b.k.verify().is_ok()) << b.k.verify().message();
  ASSERT_EQ(b.k.row_passes(), 4);
  Kernel long_row = row_softmax_kernel("scratch_long_row", 2, 40000, f);
  check({b.k, long_row}, {{{1, 1e-6}, {2, 1e-5}, {3, 1e-5}}, {{1, 1e-6}}}, 2, /*specials=*/false);
  // The kept row: one 240-element f32 stack array in the first kernel, none in the second.
  auto ir = emit_llvm_ir({b.k, long_row});
  ASSERT_TRUE(ir.has_value()) << ir.message();
  const size_t k2 = ir->find("define void @scratch_long_row(");
  ASSERT_NE(k2, std::string::npos);
  EXPECT_NE(ir->substr(0, k2).find("alloca float, i64 240"), std::string::npos) << ir->substr(0, k2);
  EXPECT_EQ(ir->substr(k2).find("alloca float, i64 40000"), std::string::npos);
}

TEST(LlvmCpuRow, LongMaskedRowsKeepTheExpFirst) {
  // The causal attention softmax (bench/codegen_bench.cpp): the masked, scaled scores
  // Where(mask, -inf, x * 0.125) (3 vector ops) and their exp are both worth a row
  // scratch array. Rows of 256 keep both; rows of 20000 f32 have room for one (80 KB
  // each, 128 KB in all), which must be the exp's: the exp is then computed in one pass
  // only, as for short rows, and the scores are recomputed from x and the mask.
  auto kernel = [](const std::string& name, int64_t seq) {
    const DType f = DType::f32;
    KB b(name, {2, seq}, {false, true});
    int x = b.load(b.param("x", f, {seq, 1}));
    int mask = b.load(b.param("mask", DType::boolean, {0, 1}));
    int s = b.op(ScalarOp::select, {mask, b.cst(-INFINITY, f), b.op(ScalarOp::mul, {x, b.cst(0.125, f)}, f)}, f);
    int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {s, b.k.add_reduce(ReduceKind::max, s)}, f)}, f);
    int inv = b.op(ScalarOp::div, {b.cst(1, f), b.k.add_reduce(ReduceKind::sum, e)}, f);
    b.out("y", b.op(ScalarOp::mul, {e, inv}, f), {seq, 1});
    return b.k;
  };
  auto ir = emit_llvm_ir({kernel("masked_short", 256), kernel("masked_long", 20000)});
  ASSERT_TRUE(ir.has_value()) << ir.message();
  const size_t k2 = ir->find("define void @masked_long(");
  ASSERT_NE(k2, std::string::npos);
  const std::string shorter = ir->substr(0, k2), longer = ir->substr(k2);
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count(shorter, "alloca float, i64 256"), 2u) << shorter;
  EXPECT_EQ(count(longer, "alloca float, i64 20000"), 1u) << longer;
  // expf_poly's rounding constant 1.5 * 2^23 appears once per place the exp is computed.
  const std::string magic = "0x4168000000000000";
  ASSERT_GT(count(shorter, magic), 0u);
  EXPECT_EQ(count(longer, magic), count(shorter, magic)) << "the long rows recompute the exp";
}

}  // namespace
}  // namespace kiln::codegen

namespace kiln::codegen {
namespace {

/// A softmax over rows of symbolic length `n` (the row_softmax_kernel with its row extent
/// and row stride replaced by the symbol), `rows` rows.
Kernel symbolic_softmax(int64_t rows, bool versions) {
  Kernel k = testing::row_softmax_kernel("sym_softmax", rows, 1, DType::f32);
  const Extent n = ir::SymExpr::symbol("n");
  k.domain[1] = n;
  for (KernelParam& p : k.params) p.strides[0] = n;
  k.versions = versions;
  return k;
}

TEST(LlvmCpu, SymbolicRowProgramTakesItsRowLengthAtLaunch) {
  // One compiled softmax whose row length is the symbol n, run at rows whose scratch
  // arrays fit kRowScratchBytes and longer ones (which recompute the exp), at multiples
  // of the vector width (the whole-vectors version) and others, and with
  // --symbolic_versions off (generic only), each against the reference evaluator at the
  // same n: within 2e-6 relative (f32 exp).
  for (bool versions : {true, false}) {
    const Kernel k = symbolic_softmax(3, versions);
    ASSERT_TRUE(k.verify().is_ok()) << k.verify().message();
    ASSERT_TRUE(k.is_symbolic());
    EXPECT_EQ(k.symbols(), std::vector<std::string>{"n"});
    auto mod = compile_cpu({k});
    ASSERT_TRUE(mod) << mod.message();
    const CpuKernel& ck = (*mod)->kernels()[0];
    EXPECT_EQ(ck.symbols, std::vector<std::string>{"n"});
    // (The softmax keeps its f32 exp: rows up to 32768 fit 128 KiB; 40000 recomputes.)
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(16), int64_t(64), int64_t(300), int64_t(4096), int64_t(5000),
                      int64_t(32768), int64_t(40000)}) {
      std::vector<float> x(static_cast<size_t>(3 * n)), got(x.size(), -1.f), ref(x.size(), -2.f);
      fill(DType::f32, x.data(), static_cast<int64_t>(x.size()), 77u + static_cast<uint32_t>(n), false);
      ASSERT_TRUE(evaluate_reference(k, {x.data(), ref.data()}, {{"n", n}}).is_ok());
      int64_t values[] = {n};
      std::vector<void*> bufs = {x.data(), got.data(), values};
      const int64_t extent = *ck.parallel_extent.evaluate(std::map<std::string, int64_t>{{"n", n}});
      ck.fn(bufs.data(), 0, extent);
      for (size_t i = 0; i < x.size(); ++i)
        ASSERT_NEAR(got[i], ref[i], 2e-6 * std::max(1.f, std::fabs(ref[i])))
            << "n " << n << " versions " << versions << " element " << i;
    }
  }
}

TEST(LlvmCpu, SymbolicKernelIsGeneratedOnceForEveryLength) {
  // The kernel text of a symbolic kernel names its symbols, not a length: the versions
  // flag is part of it (printed "generic"), the length is not.
  const Kernel a = symbolic_softmax(3, true), b = symbolic_softmax(3, false);
  EXPECT_NE(a.to_string().find("domain [3, n]"), std::string::npos) << a.to_string();
  EXPECT_EQ(a.to_string().find("generic"), std::string::npos);
  EXPECT_NE(b.to_string().find("generic"), std::string::npos) << b.to_string();
  EXPECT_NE(structure_key(a), structure_key(b));
  const Kernel bound = a.bind({{"n", 12}});
  EXPECT_FALSE(bound.is_symbolic());
  EXPECT_NE(bound.to_string().find("domain [3, 12]"), std::string::npos) << bound.to_string();
}

TEST(LlvmCpu, SymbolicColumnSumSplitsItsRowsAtLaunch) {
  // A column sum over n rows of 48 columns (a bias gradient over batch*seq rows) with
  // n symbolic: the kernel splits its rows into the partitions ir::column_sum_partitions
  // gives n (1, unsplit, below 512 rows), the executor passing their count after the
  // symbols. Each run, its threads' pieces in any order, equals the reference evaluator
  // of the bound kernel exactly (the same partitioned double sums, the eager
  // ReduceSum's order), as a max does.
  KB c("sym_col_sum", {1, 48}, {true, false});  // params x, s, y, m
  c.out("s", c.load(c.param("x", DType::f32, {48, 1})), {0, 1}, ReduceKind::sum);
  c.out("m", c.load(c.param("y", DType::f32, {48, 1})), {0, 1}, ReduceKind::max);
  c.k.domain[0] = ir::SymExpr::symbol("n");
  ASSERT_TRUE(c.k.verify().is_ok()) << c.k.verify().message();
  auto mod = compile_cpu({c.k});
  ASSERT_TRUE(mod) << mod.message();
  const CpuKernel& ck = (*mod)->kernels()[0];
  EXPECT_EQ(ck.split_parts, -1);
  EXPECT_EQ(ck.split_cols, 48);
  EXPECT_EQ(ck.split_rows.to_string(), "n");
  EXPECT_EQ(ck.scratch_bytes, ir::kMaxColumnSumPartitions * 48 * (8 + 4));
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(300), int64_t(511), int64_t(512), int64_t(1000), int64_t(5000)}) {
    const int64_t parts = launch_split_parts(ck, n);
    EXPECT_EQ(parts, std::max<int64_t>(1, ir::column_sum_partitions(n, 48))) << n;
    std::vector<float> x(static_cast<size_t>(n * 48)), y(x.size());
    fill(DType::f32, x.data(), n * 48, 5u + static_cast<uint32_t>(n), false);
    fill(DType::f32, y.data(), n * 48, 9u + static_cast<uint32_t>(n), false);
    std::vector<float> s(48, -1.f), m(48, -1.f), rs(48, -2.f), rm(48, -2.f);
    ASSERT_TRUE(evaluate_reference(c.k, {x.data(), rs.data(), y.data(), rm.data()}, {{"n", n}}).is_ok());
    std::vector<double> scratch(static_cast<size_t>(ck.scratch_bytes / 8), std::nan(""));
    int64_t values[] = {n, parts};
    std::vector<void*> bufs = {x.data(), s.data(), y.data(), m.data(), values, scratch.data()};
    for (int64_t p = parts; p-- > 0;) ck.fn(bufs.data(), p, p + 1);  // pieces last first
    combine_cpu_partitions(ck, bufs.data(), parts);
    for (size_t i = 0; i < 48; ++i) {
      ASSERT_EQ(s[i], rs[i]) << "n " << n << " column " << i;
      ASSERT_EQ(m[i], rm[i]) << "n " << n << " column " << i;
    }
  }
}

}  // namespace
}  // namespace kiln::codegen
