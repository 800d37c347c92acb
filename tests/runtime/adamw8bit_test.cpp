// Tests of the 8-bit block-wise optimizer ops (ir/ops/optim8bit.cpp, runtime/kernels/optim8bit.cpp):
// - the dynamic maps against an independent float64 reimplementation of bitsandbytes'
//   create_dynamic_map written here, and against the torch-f32 maps of the real
//   bitsandbytes code (tests/data/optim8bit/*.npy, tools/make_optim8bit_fixtures.py);
// - quantize/dequantize round trips (property test) on random and adversarial blocks:
//   error <= half the largest gap of the map times the block's absmax, and the code is
//   the nearest map entry;
// - one fused AdamW8bitUpdate step against a float64 reference (dequantize -> AdamW ->
//   requantize written independently below);
// - error values for bad inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ir/op_table.h"
#include "ir/ops/optim8bit.h"
#include "runtime/interpreter.h"
#include "runtime/io.h"
#include "runtime/kernels/kernels.h"

using namespace kiln;
using ir::DType;
using ir::Tensor;

namespace {

// ---------------------------------------------------------------- references

/// bitsandbytes.functional.create_dynamic_map in float64 (written from the paper's
/// description and bnb's source; independent of ir/ops/optim8bit.cpp): for exponent
/// i = 0..6 the midpoints of linspace(0.1, 1, K_i + 1) scaled by 10^(i - 6), K_i = 2^i
/// (signed, mirrored to negative) or 2^(i+1) (unsigned); plus 0 and 1; sorted.
std::vector<double> ref_dynamic_map(bool is_signed) {
  std::vector<double> d;
  for (int e = 0; e < 7; ++e) {
    const int k = is_signed ? (1 << e) : (1 << (e + 1));
    std::vector<double> lin(k + 1);
    for (int j = 0; j <= k; ++j) lin[j] = 0.1 + (1.0 - 0.1) * j / k;
    for (int j = 0; j < k; ++j) {
      double mean = 0.5 * (lin[j] + lin[j + 1]);
      d.push_back(std::pow(10.0, e - 6) * mean);
      if (is_signed) d.push_back(-std::pow(10.0, e - 6) * mean);
    }
  }
  d.push_back(0.0);
  d.push_back(1.0);
  std::sort(d.begin(), d.end());
  return d;
}

/// Nearest map index to x by linear scan (ties: lower index).
int ref_nearest(const std::vector<double>& qmap, double x) {
  int best = 0;
  for (int i = 1; i < static_cast<int>(qmap.size()); ++i)
    if (std::fabs(qmap[i] - x) < std::fabs(qmap[best] - x)) best = i;
  return best;
}

double largest_gap(const std::vector<double>& q) {
  double g = 0;
  for (size_t i = 1; i < q.size(); ++i) g = std::max(g, q[i] - q[i - 1]);
  return g;
}

std::vector<double> as_f64(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.get_f64(i);
  return v;
}

Tensor qmap_tensor(bool is_signed) { return Tensor::from_f32(ir::create_dynamic_map(is_signed), {256}); }

// ---------------------------------------------------------------- running the ops

/// Runs one op eagerly (run_node) with the given inputs (nullptr: omitted) and attributes.
Expected<std::vector<Tensor>> run_op(const std::string& op, const std::vector<const Tensor*>& ins, int nout,
                                     ir::Attributes attrs = {}) {
  runtime::register_eager_kernels();
  ir::Node n;
  n.op = op;
  n.name = "test_" + op;
  n.attrs = std::move(attrs);
  n.outputs.assign(static_cast<size_t>(nout), nullptr);
  return runtime::run_node(n, ins);
}

struct Quantized {
  Tensor codes, absmax;
};

Quantized quantize(const Tensor& x, const Tensor& qmap) {
  auto r = run_op("BlockwiseQuantize8bit", {&x, &qmap}, 2);
  EXPECT_TRUE(r) << r.message();
  if (!r) return {};
  return {(*r)[0], (*r)[1]};
}

Tensor dequantize(const Quantized& q, const Tensor& qmap) {
  auto r = run_op("BlockwiseDequantize8bit", {&q.codes, &q.absmax, &qmap}, 1);
  EXPECT_TRUE(r) << r.message();
  return r ? (*r)[0] : Tensor();
}

/// Round-trip property on one tensor x: per block, absmax equals max |x|; each code is the
/// nearest entry of the map to x/absmax (up to 2 ulp of slack at near-ties); and
/// |x - dequant(x)| <= bound = 0.5 * largest_gap * absmax + 4 ulp(absmax) (the ulp term
/// only matters for denormal absmax, where products round to multiples of denorm_min).
/// Returns the largest ratio error / bound seen.
double check_round_trip(const std::vector<float>& xs, bool is_signed, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = Tensor::from_f32(xs, {n});
  Tensor qm = qmap_tensor(is_signed);
  const std::vector<double> map = as_f64(qm);
  const double half_gap = 0.5 * largest_gap(map);
  Quantized q = quantize(x, qm);
  Tensor y = dequantize(q, qm);
  if (!y.defined() || y.numel() != n) {
    ADD_FAILURE() << "no dequantized result";
    return INFINITY;
  }
  EXPECT_EQ(q.absmax.numel(), (n + 255) / 256);
  double worst = 0;
  for (int64_t b = 0; b < q.absmax.numel(); ++b) {
    const int64_t lo = b * 256, hi = std::min(n, lo + 256);
    double amax = 0;
    for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(static_cast<double>(xs[i])));
    const double a = q.absmax.get_f64(b);
    EXPECT_EQ(a, amax) << "block " << b;
    const double ulp = std::nextafter(static_cast<float>(a), INFINITY) - static_cast<float>(a);
    for (int64_t i = lo; i < hi; ++i) {
      const double err = std::fabs(static_cast<double>(xs[i]) - y.get_f64(i));
      const double bound = half_gap * a + 4 * ulp;
      EXPECT_LE(err, bound) << "element " << i << " x=" << xs[i] << " y=" << y.get_f64(i) << " absmax=" << a;
      if (a > 0)
        worst = std::max(worst, err / bound);
      else
        EXPECT_EQ(y.get_f64(i), 0.0) << "zero block must dequantize to 0";
      if (a > 0) {
        // nearest code: no map entry is closer than the chosen one (beyond rounding slack)
        const double t = static_cast<double>(xs[i]) / a;
        const int c = static_cast<int>(q.codes.get_i64(i));
        const int r = ref_nearest(map, t);
        EXPECT_LE(std::fabs(map[c] - t), std::fabs(map[r] - t) + 2e-7)
            << "element " << i << ": code " << c << " (" << map[c] << "), nearest " << r << " (" << map[r] << ") for "
            << t;
      }
    }
  }
  return worst;
}

// ---------------------------------------------------------------- map tests

TEST(Optim8bit, DynamicMapsMatchFloat64Reference) {
  for (bool s : {true, false}) {
    SCOPED_TRACE(s ? "signed" : "unsigned");
    std::vector<float> got = ir::create_dynamic_map(s);
    std::vector<double> ref = ref_dynamic_map(s);
    ASSERT_EQ(got.size(), 256u);
    ASSERT_EQ(ref.size(), 256u);
    for (int i = 0; i < 256; ++i) {
      EXPECT_NEAR(got[i], ref[i], 1e-7 * std::fabs(ref[i]) + 1e-12) << "entry " << i;  // f32 rounding only
      if (i > 0) {
        EXPECT_LE(got[i - 1], got[i]) << "not sorted at " << i;
      }
    }
    EXPECT_EQ(got.back(), 1.0f);
    EXPECT_EQ(std::count(got.begin(), got.end(), 0.0f), 1);
    if (s) {
      EXPECT_EQ(got.front(), -got[got.size() - 2]);  // symmetric except the extra +1
      EXPECT_LT(got.front(), -0.99f);
    } else {
      EXPECT_EQ(got.front(), 0.0f);
    }
  }
}

TEST(Optim8bit, DynamicMapsMatchBitsandbytesTorchFixture) {
  // Fixture: the real bitsandbytes create_dynamic_map run with torch 1.13 (f32 linspace).
  for (bool s : {true, false}) {
    std::string path =
        std::string(KILN_SOURCE_DIR) + "/tests/data/optim8bit/bnb_dynamic_map_" + (s ? "signed" : "unsigned") + ".npy";
    auto fx = runtime::io::load_npy(path);
    ASSERT_TRUE(fx) << fx.message() << " (regenerate with /usr/bin/python3 tools/make_optim8bit_fixtures.py)";
    ASSERT_EQ(fx->numel(), 256);
    std::vector<float> got = ir::create_dynamic_map(s);
    for (int i = 0; i < 256; ++i) {
      const double want = fx->get_f64(i);
      // torch computes linspace and the midpoints in f32: at most 2 ulp apart.
      EXPECT_NEAR(got[i], want, 2.5e-7 * std::fabs(want) + 1e-12) << (s ? "signed" : "unsigned") << " entry " << i;
    }
  }
}

// ---------------------------------------------------------------- round-trip property

TEST(Optim8bit, RoundTripRandomBlocks) {
  std::mt19937_64 rng(20211006);
  double worst = 0;
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t n = 256 * (1 + trial % 5) + (trial % 3 == 0 ? 77 : 0);  // some partial last blocks
    std::vector<float> xs(static_cast<size_t>(n));
    const double scale = std::pow(10.0, static_cast<int>(rng() % 13) - 9);  // 1e-9 .. 1e3
    std::normal_distribution<double> nd(0.0, scale);
    for (auto& v : xs) v = static_cast<float>(nd(rng));
    worst = std::max(worst, check_round_trip(xs, true, "signed normal trial " + std::to_string(trial)));
    for (auto& v : xs) v = v * v;  // second-moment-like: non-negative, heavy-tailed
    worst = std::max(worst, check_round_trip(xs, false, "unsigned trial " + std::to_string(trial)));
  }
  std::cout << "random blocks: max error / bound = " << worst << "\n";
  EXPECT_LE(worst, 1.0 + 1e-5);
}

TEST(Optim8bit, RoundTripAdversarialBlocks) {
  double worst = 0;
  auto check = [&](std::vector<float> xs, bool s, const std::string& what) {
    worst = std::max(worst, check_round_trip(xs, s, what));
  };
  check(std::vector<float>(512, 0.0f), true, "all zeros (signed)");
  check(std::vector<float>(300, 0.0f), false, "all zeros, partial block (unsigned)");
  {
    std::vector<float> xs(256, 1e-3f);
    xs[17] = 3e6f;  // one huge outlier: the rest collapse towards 0 but stay within the bound
    check(xs, true, "one outlier");
    check(xs, false, "one outlier (unsigned)");
  }
  {
    const float dmin = std::numeric_limits<float>::denorm_min();
    std::vector<float> xs(256);
    for (int i = 0; i < 256; ++i) xs[i] = dmin * static_cast<float>(i % 37) * (i % 2 ? -1.f : 1.f);
    check(xs, true, "denormals");
    for (auto& v : xs) v = std::fabs(v);
    check(xs, false, "denormals (unsigned)");
  }
  {
    std::vector<float> xs(256 + 5);
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = -0.5f - 0.01f * static_cast<float>(i % 50);
    check(xs, true, "negative only, partial last block");
  }
  {
    std::vector<float> xs = {3.0f};  // one element: x/absmax = 1 exactly
    check(xs, true, "single element");
    std::vector<float> ys = {-3.0f};  // -1 is not in the signed map: nearest is -0.99297
    check(ys, true, "single negative element");
  }
  {
    // values exactly at map entries and midpoints between neighbours
    std::vector<float> m = ir::create_dynamic_map(true);
    std::vector<float> xs;
    for (int i = 0; i < 256; ++i) {
      xs.push_back(m[i]);
      if (i > 0) xs.push_back(0.5f * (m[i - 1] + m[i]));
    }
    check(xs, true, "map entries and midpoints");
  }
  {
    std::vector<float> xs(256, std::numeric_limits<float>::max());
    xs[3] = -std::numeric_limits<float>::max();
    check(xs, true, "float max");
  }
  std::cout << "adversarial blocks: max error / bound = " << worst << "\n";
}

TEST(Optim8bit, NonFiniteStateStaysNonFinite) {
  std::vector<float> xs(256, 1.0f);
  xs[5] = std::nanf("");
  Tensor x = Tensor::from_f32(xs, {256});
  Tensor qm = qmap_tensor(true);
  Quantized q = quantize(x, qm);
  Tensor y = dequantize(q, qm);
  ASSERT_TRUE(y.defined());
  EXPECT_TRUE(std::isnan(q.absmax.get_f64(0)));
  EXPECT_TRUE(std::isnan(y.get_f64(0)));
}

// ---------------------------------------------------------------- fused update

struct AdamHyper {
  double lr = 3e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1, coef = 0.75;
  int64_t t = 5;  // this step's 1-based index
};

/// float64 reference of one 8-bit AdamW step (bitsandbytes blockwise Adam with torch AdamW
/// semantics): dequantize, g *= coef, p -= lr*wd*p, moments, bias-corrected update,
/// requantize with the block's new absmax and the nearest map entry.
void ref_step(std::vector<double>& p, const std::vector<double>& g, std::vector<int>& q1, std::vector<double>& a1,
              std::vector<int>& q2, std::vector<double>& a2, const std::vector<double>& ms,
              const std::vector<double>& mu, const AdamHyper& h) {
  const size_t n = p.size();
  std::vector<double> m(n), v(n);
  const double bc1 = 1 - std::pow(h.b1, static_cast<double>(h.t));
  const double bc2 = 1 - std::pow(h.b2, static_cast<double>(h.t));
  for (size_t i = 0; i < n; ++i) {
    const double gi = g[i] * h.coef;
    m[i] = h.b1 * ms[q1[i]] * a1[i / 256] + (1 - h.b1) * gi;
    v[i] = h.b2 * mu[q2[i]] * a2[i / 256] + (1 - h.b2) * gi * gi;
    p[i] -= h.lr * h.wd * p[i];
    p[i] -= (h.lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps);
  }
  for (size_t b = 0; b < a1.size(); ++b) {
    const size_t lo = b * 256, hi = std::min(n, lo + 256);
    double x1 = 0, x2 = 0;
    for (size_t i = lo; i < hi; ++i) x1 = std::max(x1, std::fabs(m[i])), x2 = std::max(x2, std::fabs(v[i]));
    a1[b] = x1;
    a2[b] = x2;
    for (size_t i = lo; i < hi; ++i) {
      q1[i] = x1 > 0 ? ref_nearest(ms, m[i] / x1) : ref_nearest(ms, 0.0);
      q2[i] = x2 > 0 ? ref_nearest(mu, v[i] / x2) : ref_nearest(mu, 0.0);
    }
  }
}

TEST(Optim8bit, FusedUpdateMatchesFloat64Reference) {
  const int64_t rows = 33, cols = 100, n = rows * cols;  // 3300 = 12 full blocks + a partial one
  const int64_t nb = (n + 255) / 256;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd(0.0, 1.0);
  AdamHyper h;
  Tensor qs = qmap_tensor(true), qu = qmap_tensor(false);
  const std::vector<double> ms = as_f64(qs), mu = as_f64(qu);
  Tensor p(DType::f32, {rows, cols}), g(DType::f32, {rows, cols});
  for (int64_t i = 0; i < n; ++i) p.set_f64(i, 0.1 * nd(rng)), g.set_f64(i, 1e-2 * nd(rng));
  // A previous state: quantize realistic moments with the op (itself checked above).
  std::vector<float> m0(n), v0(n);
  for (int64_t i = 0; i < n; ++i) {
    m0[i] = static_cast<float>(1e-3 * nd(rng));
    v0[i] = static_cast<float>(1e-6 * std::pow(nd(rng), 2));
  }
  for (int64_t i = 256; i < 512; ++i) m0[i] = v0[i] = 0;  // one block of zero state
  Quantized s1 = quantize(Tensor::from_f32(m0, {n}), qs), s2 = quantize(Tensor::from_f32(v0, {n}), qu);
  // Scalars exactly as passes/optimizer.cpp computes them in f32.
  const float lr = static_cast<float>(h.lr);
  const float bc1 = 1.0f - std::pow(static_cast<float>(h.b1), static_cast<float>(h.t));
  const float sbc2 = std::sqrt(1.0f - std::pow(static_cast<float>(h.b2), static_cast<float>(h.t)));
  Tensor t_lr = Tensor::scalar_f32(lr), t_ss = Tensor::scalar_f32(lr / bc1), t_sb = Tensor::scalar_f32(sbc2);
  Tensor t_coef = Tensor::scalar_f32(static_cast<float>(h.coef));
  ir::Attributes at;
  at.set("beta1", h.b1);
  at.set("beta2", h.b2);
  at.set("eps", h.eps);
  at.set("weight_decay", h.wd);
  auto r =
      run_op("AdamW8bitUpdate",
             {&p, &g, &s1.codes, &s1.absmax, &s2.codes, &s2.absmax, &qs, &qu, &t_lr, &t_ss, &t_sb, &t_coef}, 5, at);
  ASSERT_TRUE(r) << r.message();
  const Tensor &p1 = (*r)[0], &q1 = (*r)[1], &a1 = (*r)[2], &q2 = (*r)[3], &a2 = (*r)[4];
  EXPECT_EQ(p1.dims(), p.dims());
  EXPECT_EQ(q1.dtype(), DType::u8);
  EXPECT_EQ(a1.numel(), nb);

  std::vector<double> rp = as_f64(p), rg = as_f64(g), ra1 = as_f64(s1.absmax), ra2 = as_f64(s2.absmax);
  std::vector<int> rq1(n), rq2(n);
  for (int64_t i = 0; i < n; ++i)
    rq1[i] = static_cast<int>(s1.codes.get_i64(i)), rq2[i] = static_cast<int>(s2.codes.get_i64(i));
  const std::vector<double> p_before = rp;
  ref_step(rp, rg, rq1, ra1, rq2, ra2, ms, mu, h);

  // Parameters: f32 arithmetic vs f64, relative to the step size (tolerance 1e-4 of the
  // update, plus 2 ulp of p): the step is ~lr, p ~0.1.
  double worst_p = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double upd = std::fabs(rp[i] - p_before[i]);
    const double tol = 1e-4 * upd + 2.5e-7 * std::fabs(rp[i]);
    worst_p = std::max(worst_p, std::fabs(p1.get_f64(i) - rp[i]) / std::max(upd, 1e-30));
    EXPECT_NEAR(p1.get_f64(i), rp[i], tol) << "param " << i;
  }
  // absmax: relative 1e-6. Codes: identical except at near-ties of the f64 value (counted).
  for (int64_t b = 0; b < nb; ++b) {
    EXPECT_NEAR(a1.get_f64(b), ra1[b], 1e-6 * ra1[b]) << "exp_avg absmax block " << b;
    EXPECT_NEAR(a2.get_f64(b), ra2[b], 1e-6 * ra2[b]) << "exp_avg_sq absmax block " << b;
  }
  int diff1 = 0, diff2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int c1 = static_cast<int>(q1.get_i64(i)), c2 = static_cast<int>(q2.get_i64(i));
    if (c1 != rq1[i]) {
      ++diff1;
      EXPECT_LE(std::abs(c1 - rq1[i]), 1) << "exp_avg code " << i;
    }
    if (c2 != rq2[i]) {
      ++diff2;
      EXPECT_LE(std::abs(c2 - rq2[i]), 1) << "exp_avg_sq code " << i;
    }
  }
  std::cout << "fused step vs f64: max |dp|/|update| = " << worst_p << ", codes differing (near-ties): " << diff1
            << " + " << diff2 << " of " << 2 * n << "\n";
  EXPECT_LE(diff1 + diff2, n / 500);  // a near-tie only; typically 0
  // Zero-state block after the step: codes describe the new moments, not garbage.
  EXPECT_GT(a1.get_f64(1), 0.0);
}

TEST(Optim8bit, FusedUpdateFromZeroStateEqualsFp32AdamWBitwise) {
  // From zero state (exactly representable), the parameter update must equal the fp32
  // adamw_torch arithmetic of passes/optimizer.cpp evaluated op by op in f32.
  const int64_t n = 4096;
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd(0.0, 1.0);
  Tensor p(DType::f32, {64, 64}), g(DType::f32, {64, 64});
  for (int64_t i = 0; i < n; ++i) p.set_f64(i, 0.2 * nd(rng)), g.set_f64(i, 1e-3 * nd(rng));
  Tensor qs = qmap_tensor(true), qu = qmap_tensor(false);
  Tensor z8(DType::u8, {n}), za(DType::f32, {n / 256});
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  const float lr = 1e-3f, bc1 = 1.0f - std::pow(0.9f, 1.0f), sbc2 = std::sqrt(1.0f - std::pow(0.999f, 1.0f));
  Tensor t_lr = Tensor::scalar_f32(lr), t_ss = Tensor::scalar_f32(lr / bc1), t_sb = Tensor::scalar_f32(sbc2);
  ir::Attributes at;
  at.set("beta1", b1);
  at.set("beta2", b2);
  at.set("eps", eps);
  at.set("weight_decay", wd);
  auto r = run_op("AdamW8bitUpdate", {&p, &g, &z8, &za, &z8, &za, &qs, &qu, &t_lr, &t_ss, &t_sb, nullptr}, 5, at);
  ASSERT_TRUE(r) << r.message();
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p.data<float>()[i], gi = g.data<float>()[i];
    const float m = 0.0f * static_cast<float>(b1) + gi * static_cast<float>(1 - b1);
    const float v = 0.0f * static_cast<float>(b2) + (gi * gi) * static_cast<float>(1 - b2);
    const float pd = pi - pi * (lr * static_cast<float>(wd));
    const float want = pd - (lr / bc1) * (m / (std::sqrt(v) / sbc2 + static_cast<float>(eps)));
    ASSERT_EQ((*r)[0].data<float>()[i], want) << "element " << i;
  }
}

TEST(Optim8bit, BadInputsAreErrors) {
  Tensor qs = qmap_tensor(true);
  Tensor x = Tensor::from_f32({1, 2, 3}, {3});
  // wrong dtype of x
  Tensor xi = Tensor::from_i64({1, 2, 3});
  auto r1 = run_op("BlockwiseQuantize8bit", {&xi, &qs}, 2);
  ASSERT_FALSE(r1);
  EXPECT_NE(r1.message().find("BlockwiseQuantize8bit"), std::string::npos) << r1.message();
  // map of the wrong size
  Tensor small = Tensor::from_f32({0, 1}, {2});
  EXPECT_FALSE(run_op("BlockwiseQuantize8bit", {&x, &small}, 2));
  // unsorted map
  std::vector<float> bad = ir::create_dynamic_map(true);
  std::swap(bad[3], bad[200]);
  Tensor tb = Tensor::from_f32(bad, {256});
  auto r2 = run_op("BlockwiseQuantize8bit", {&x, &tb}, 2);
  ASSERT_FALSE(r2);
  EXPECT_NE(r2.message().find("sorted"), std::string::npos) << r2.message();
  // absmax of the wrong length for the codes
  Tensor codes(DType::u8, {600}), absmax(DType::f32, {2});
  auto r3 = run_op("BlockwiseDequantize8bit", {&codes, &absmax, &qs}, 1);
  ASSERT_FALSE(r3);
  EXPECT_NE(r3.message().find("absmax"), std::string::npos) << r3.message();
  // AdamW8bitUpdate: grad shape differs from param
  Tensor p(DType::f32, {300}), g(DType::f32, {299}), q(DType::u8, {300}), a(DType::f32, {2});
  Tensor s = Tensor::scalar_f32(1.f);
  ir::Attributes at;
  at.set("beta1", 0.9);
  at.set("beta2", 0.999);
  at.set("eps", 1e-8);
  auto r4 = run_op("AdamW8bitUpdate", {&p, &g, &q, &a, &q, &a, &qs, &qs, &s, &s, &s}, 5, at);
  ASSERT_FALSE(r4);
  EXPECT_NE(r4.message().find("grad shape"), std::string::npos) << r4.message();
}

}  // namespace

/// The quantize kernel's table-driven code search must pick exactly the code of the
/// reference binary search (ir::nearest_code): checked at every map entry, every midpoint
/// between neighbours and 1-2 ulp around both, and on random values, for both dynamic
/// maps and for a map whose entries cluster in [0.5, 0.5026] (many thresholds inside one
/// table bucket: the kernels' general multi-step search, not the one-compare fast path).
static void check_codes_equal_binary_search() {
  std::mt19937_64 rng(7);
  std::vector<float> clustered = {-1.f, 0.f};
  for (int i = 0; i < 254; ++i) clustered.push_back(0.5f + 1e-5f * static_cast<float>(i));
  for (int which = 0; which < 3; ++which) {
    const bool is_signed = which != 1;
    Tensor qmap = which == 2 ? Tensor::from_f32(clustered, {256}) : qmap_tensor(is_signed);
    const float* q = qmap.data<float>();
    std::vector<float> xs = {1.0f};  // absmax 1: the kernel then quantizes x / 1 = x
    auto around = [&](float v) {
      float a = v, b = v;
      for (int k = 0; k < 3; ++k) {
        xs.push_back(a);
        xs.push_back(b);
        a = std::nextafter(a, -2.f);
        b = std::nextafter(b, 2.f);
      }
    };
    for (int i = 0; i < 256; ++i) {
      around(q[i]);
      if (i + 1 < 256) around(0.5f * (q[i] + q[i + 1]));
    }
    std::uniform_real_distribution<float> ud(is_signed ? -1.f : 0.f, 1.f);
    for (int i = 0; i < 20000; ++i) xs.push_back(ud(rng));
    for (int e = -40; e <= 0; ++e) xs.push_back(std::ldexp(1.f, e)), xs.push_back(-std::ldexp(0.75f, e));
    for (auto& v : xs) v = std::clamp(v, -1.f, 1.f);
    // One block per value pair keeps absmax at 1: prefix every block with 1.0.
    std::vector<float> blocks;
    for (size_t i = 0; i < xs.size(); ++i) {
      if (blocks.size() % 256 == 0) blocks.push_back(1.0f);
      blocks.push_back(xs[i]);
    }
    Tensor x = Tensor::from_f32(blocks, {static_cast<int64_t>(blocks.size())});
    Quantized r = quantize(x, qmap);
    ASSERT_EQ(r.codes.numel(), x.numel());
    int64_t diffs = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      ASSERT_EQ(r.absmax.data<float>()[i / 256], 1.0f);
      uint8_t want = ir::nearest_code(q, blocks[static_cast<size_t>(i)]);
      if (r.codes.data<uint8_t>()[i] != want && ++diffs < 5)
        ADD_FAILURE() << (which == 2  ? "clustered"
                          : is_signed ? "signed"
                                      : "unsigned")
                      << " x=" << blocks[static_cast<size_t>(i)] << " kernel code " << int(r.codes.data<uint8_t>()[i])
                      << " reference " << int(want);
    }
    EXPECT_EQ(diffs, 0);
    // The second moment's path (non-negative values only, unsigned and clustered maps).
    if (is_signed && which != 2) continue;
    std::vector<float> nonneg;
    for (float v : blocks)
      if (!std::signbit(v)) {
        if (nonneg.size() % 256 == 0) nonneg.push_back(1.0f);
        nonneg.push_back(v);
      }
    std::vector<uint8_t> codes(nonneg.size());
    std::vector<float> absmax((nonneg.size() + 255) / 256);
    if (!runtime::kernels::optim8bit_testing::quantize_nonneg(nonneg.data(), static_cast<int64_t>(nonneg.size()), q,
                                                              codes.data(), absmax.data()))
      continue;  // below the AVX-512 path (for_each_isa says which paths run)
    int64_t nn_diffs = 0;
    for (size_t i = 0; i < nonneg.size(); ++i) {
      ASSERT_EQ(absmax[i / 256], 1.0f);
      const uint8_t want = ir::nearest_code(q, nonneg[i]);
      if (codes[i] != want && ++nn_diffs < 5)
        ADD_FAILURE() << "non-negative path x=" << nonneg[i] << " kernel code " << int(codes[i]) << " reference "
                      << int(want);
    }
    EXPECT_EQ(nn_diffs, 0);
  }
}

/// The fused update, bit for bit, against a scalar f32 reference written here from the
/// kernel's documented formulas (the f32 ops of adamw_torch in its order, absmax = max |x|,
/// codes by ir::nearest_code's binary search): every parameter, absmax and code, on
/// non-zero state, for sizes that leave 0, 1 and 7 elements after the last 8-wide group,
/// with blocks whose new moments hold a NaN, an inf, only zeros or a denormal absmax.
/// Run at every kernel path the CPU has (for_each_isa).
static void check_fused_update_bitwise() {
  Tensor qs = qmap_tensor(true), qu = qmap_tensor(false);
  const float* ms = qs.data<float>();
  const float* mu = qu.data<float>();
  const float b1 = 0.9f, omb1 = static_cast<float>(1.0 - 0.9), b2 = 0.999f, omb2 = static_cast<float>(1.0 - 0.999);
  const float eps = 1e-8f, lr = 1e-3f, wd = 0.01f, ss = 1e-3f / 0.271f, sbc2 = 0.0447f, coef = 0.75f;
  std::mt19937_64 rng(23);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> code(0, 255);
  for (int64_t n : {int64_t{4096}, int64_t{70000} /* 2 threads */, int64_t{1281}, int64_t{2311}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const int64_t nb = (n + 255) / 256;
    Tensor p(DType::f32, {n}), g(DType::f32, {n}), q1(DType::u8, {n}), q2(DType::u8, {n});
    Tensor a1(DType::f32, {nb}), a2(DType::f32, {nb});
    for (int64_t i = 0; i < n; ++i) {
      p.data<float>()[i] = 0.1f * nd(rng);
      g.data<float>()[i] = 1e-2f * nd(rng);
      q1.data<uint8_t>()[i] = static_cast<uint8_t>(code(rng));
      q2.data<uint8_t>()[i] = static_cast<uint8_t>(code(rng));
    }
    for (int64_t b = 0; b < nb; ++b) a1.data<float>()[b] = 1e-3f * (1 + b % 3), a2.data<float>()[b] = 1e-5f;
    // Block 1: a NaN gradient; block 2: an inf gradient; block 3: zero gradient and state;
    // block 4: tiny gradients and state (denormal new moments).
    g.data<float>()[256 + 17] = NAN;
    g.data<float>()[512 + 200] = INFINITY;
    for (int64_t i = 768; i < 1024 && i < n; ++i) {
      g.data<float>()[i] = 0.f;
      q1.data<uint8_t>()[i] = ir::nearest_code(ms, 0.f);
      q2.data<uint8_t>()[i] = ir::nearest_code(mu, 0.f);
    }
    for (int64_t i = 1024; i < 1280 && i < n; ++i) g.data<float>()[i] = 1e-39f * nd(rng);
    if (nb > 4) a1.data<float>()[4] = 1e-40f, a2.data<float>()[4] = 1e-42f;
    Tensor t_lr = Tensor::scalar_f32(lr), t_ss = Tensor::scalar_f32(ss), t_sb = Tensor::scalar_f32(sbc2);
    Tensor t_coef = Tensor::scalar_f32(coef);
    ir::Attributes at;
    at.set("beta1", 0.9);
    at.set("beta2", 0.999);
    at.set("eps", 1e-8);
    at.set("weight_decay", 0.01);
    auto r = run_op("AdamW8bitUpdate", {&p, &g, &q1, &a1, &q2, &a2, &qs, &qu, &t_lr, &t_ss, &t_sb, &t_coef}, 5, at);
    ASSERT_TRUE(r) << r.message();
    int64_t bad = 0;
    auto same = [](float x, float y) { return (x != x && y != y) || std::memcmp(&x, &y, 4) == 0; };
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t lo = b * 256, hi = std::min(n, lo + 256);
      std::vector<float> m, v;
      for (int64_t i = lo; i < hi; ++i) {
        const float gr = g.data<float>()[i] * coef;
        const float mo = ms[q1.data<uint8_t>()[i]] * a1.data<float>()[b];
        const float vo = mu[q2.data<uint8_t>()[i]] * a2.data<float>()[b];
        const float pi = p.data<float>()[i], pd = pi - pi * (lr * wd);
        const float mn = mo * b1 + gr * omb1, vn = vo * b2 + (gr * gr) * omb2;
        const float want = pd - ss * (mn / (std::sqrt(vn) / sbc2 + eps));
        if (!same((*r)[0].data<float>()[i], want) && ++bad < 5)
          ADD_FAILURE() << "param " << i << ": " << (*r)[0].data<float>()[i] << " want " << want;
        m.push_back(mn);
        v.push_back(vn);
      }
      for (int k = 0; k < 2; ++k) {
        const std::vector<float>& x = k == 0 ? m : v;
        const float* map = k == 0 ? ms : mu;
        float mx = 0.f;
        bool nan = false;
        for (float e : x) nan = nan || e != e, mx = std::max(mx, std::fabs(e));
        const float got_a = (*r)[2 + 2 * k].data<float>()[b];
        if (nan)
          EXPECT_TRUE(got_a != got_a) << "block " << b << " moment " << k << ": absmax must be NaN";
        else
          EXPECT_TRUE(same(got_a, mx)) << "block " << b << " moment " << k << ": absmax " << got_a << " want " << mx;
        const bool coded = !nan && mx > 0.f && std::isfinite(mx);
        for (size_t j = 0; j < x.size(); ++j) {
          const uint8_t want = coded ? ir::nearest_code(map, x[j] / mx) : ir::nearest_code(map, 0.f);
          const uint8_t got = (*r)[1 + 2 * k].data<uint8_t>()[lo + static_cast<int64_t>(j)];
          if (got != want && ++bad < 5)
            ADD_FAILURE() << "block " << b << " moment " << k << " element " << j << ": code " << int(got) << " want "
                          << int(want);
        }
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

namespace {

/// Runs `check` with the 8-bit kernels capped at each path (portable, AVX2 + FMA,
/// AVX-512), saying which ones this CPU cannot run; restores the cap after.
void for_each_isa(void (*check)()) {
  namespace t = runtime::kernels::optim8bit_testing;
  const char* names[] = {"portable", "AVX2+FMA", "AVX-512"};
  const int saved = t::set_max_isa(2);
  for (int level = 0; level <= 2; ++level) {
    t::set_max_isa(level);
    if (t::active_isa() != level) {
      std::cout << "[ NOTE     ] the " << names[level] << " path is not checked: this CPU lacks it\n";
      continue;
    }
    SCOPED_TRACE(std::string("kernel path ") + names[level]);
    check();
  }
  t::set_max_isa(saved);
}

}  // namespace

TEST(Optim8bit, KernelCodesEqualBinarySearchAtTiesAndRandomValues) { for_each_isa(check_codes_equal_binary_search); }

TEST(Optim8bit, FusedUpdateEqualsScalarF32ReferenceBitwise) { for_each_isa(check_fused_update_bitwise); }

/// The vector paths divide by absmax (and sqrt_bc2) as a multiply by the rounded
/// reciprocal plus one FMA correction (Markstein); it must equal the f32 division bit for
/// bit: for every mantissa of b in [1, 2) (16 random quotients in [2^-40, 1] each, both
/// signs, and a = b), and for b at random exponents in [2^-60, 2^60]; at each vector path.
static void check_reciprocal_division() {
  namespace t = runtime::kernels::optim8bit_testing;
  std::mt19937 rng(11);
  std::vector<float> a(16), out(16);
  if (!t::divide_by_reciprocal(a.data(), 1.f, out.data(), 0)) {
    std::cout << "[ NOTE     ] the portable path divides: nothing to check\n";
    return;
  }
  int64_t bad = 0, checked = 0;
  auto check_b = [&](float b) {
    for (int k = 0; k < 16; ++k) {
      const uint32_t r = rng();
      const float frac = static_cast<float>(r >> 8) * (1.f / 16777216.f);
      a[k] = (r & 0x40 ? -1.f : 1.f) * b * std::ldexp(frac, -static_cast<int>((r & 0x3f) % 41));
    }
    a[0] = b;
    t::divide_by_reciprocal(a.data(), b, out.data(), 16);
    for (int k = 0; k < 16; ++k) {
      const float want = a[k] / b;
      ++checked;
      // Zero quotients may lose their sign (documented; codes of +0 and -0 are equal).
      if (std::memcmp(&want, &out[k], 4) != 0 && !(want == 0.f && out[k] == 0.f) && ++bad < 5)
        ADD_FAILURE() << std::hexfloat << a[k] << " / " << b << ": " << out[k] << " want " << want;
    }
  };
  for (uint32_t m = 0; m < (1u << 23); m += 2) {
    const uint32_t bits = (127u << 23) | m | (rng() & 1u);  // every other mantissa, the other at random
    float b;
    std::memcpy(&b, &bits, 4);
    check_b(b);
  }
  std::uniform_int_distribution<int> ex(-60, 59);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = (static_cast<uint32_t>(127 + ex(rng)) << 23) | (rng() & 0x7fffffu);
    float b;
    std::memcpy(&b, &bits, 4);
    check_b(b);
  }
  EXPECT_EQ(bad, 0) << "of " << checked << " quotients";
}

TEST(Optim8bit, ReciprocalDivisionEqualsF32Division) { for_each_isa(check_reciprocal_division); }
