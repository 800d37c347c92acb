// Tests of the nn op-table entries and eager kernels (MatMul, Gemm, Conv, pools,
// BatchNormalization, LayerNormalization, Softmax, LogSoftmax) and their backward ops.
// Each op runs as a one-node graph (inferred, verified, run by the eager interpreter)
// and is compared with an independent float64 reference written here with naive
// loops (f32: 1e-5 relative, f64: 1e-10, bf16: 1e-2 relative), or with PyTorch 1.13
// values for the ceil_mode pools. Gradient rules and backward ops go through the
// float64 central-difference checker (tools/driver/gradcheck.h); the oneDNN f32/bf16
// backward convolutions are compared with the f64 loop kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "ir/op_table.h"
#include "runtime/interpreter.h"
#include "runtime/kernels/onednn.h"
#include "tests/runtime/op_test_util.h"

using namespace kiln;
using namespace kiln::ir;
using namespace kiln::testing;
using kiln::runtime::RunOptions;

namespace {

/// Tolerances per dtype: (atol, rtol).
std::pair<double, double> tol(DType dt) {
  if (dt == DType::f64) return {1e-10, 1e-10};
  if (dt == DType::bf16) return {2e-2, 1e-2};
  return {1e-5, 1e-5};
}

/// f64 gradient check of `op` (seed 2000 + op name length, step 1e-6), see check_op_grad.
void check_grad(const std::string& op, const std::vector<Tensor>& ins, Attributes attrs = {}, int n_out = 1,
                std::vector<int> wrt = {}, bool training = false, double tolerance = 1e-6) {
  check_op_grad(op, ins, attrs,
                {.seed_base = 2000, .n_out = n_out, .wrt = wrt, .training = training, .tolerance = tolerance});
}

// ---- references ----

/// Numpy matmul of A and B (double), output dims in `od`.
std::vector<double> ref_matmul(const Tensor& A, const Tensor& B, std::vector<int64_t>& od) {
  std::vector<int64_t> ad = A.dims(), bd = B.dims();
  bool a1 = ad.size() == 1, b1 = bd.size() == 1;
  if (a1) ad.insert(ad.begin(), 1);
  if (b1) bd.push_back(1);
  while (ad.size() < bd.size()) ad.insert(ad.begin(), 1);
  while (bd.size() < ad.size()) bd.insert(bd.begin(), 1);
  size_t r = ad.size();
  int64_t M = ad[r - 2], K = ad[r - 1], N = bd[r - 1];
  std::vector<int64_t> batch;
  for (size_t i = 0; i + 2 < r; ++i) batch.push_back(std::max(ad[i], bd[i]));
  int64_t nb = numel_of(batch);
  std::vector<double> out(static_cast<size_t>(nb * M * N));
  for (int64_t b = 0; b < nb; ++b) {
    int64_t ao = 0, bo = 0, rem = b, as = M * K, bs = K * N;
    for (int d = static_cast<int>(batch.size()) - 1; d >= 0; --d) {
      int64_t c = rem % batch[d];
      rem /= batch[d];
      ao += (ad[d] == 1 ? 0 : c) * as;
      bo += (bd[d] == 1 ? 0 : c) * bs;
      as *= ad[d];
      bs *= bd[d];
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += A.get_f64(ao + m * K + k) * B.get_f64(bo + k * N + n);
        out[(b * M + m) * N + n] = s;
      }
  }
  od = batch;
  if (!a1) od.push_back(M);
  if (!b1) od.push_back(N);
  return out;
}

struct Conv2dCfg {
  int64_t group = 1, sh = 1, sw = 1, dh = 1, dw = 1, pt = 0, pl = 0, pb = 0, pr = 0;
};

/// Naive 2-D grouped convolution: X (N, C, H, W), Wt (M, C/g, KH, KW), B (M) or undefined.
std::vector<double> ref_conv2d(const Tensor& X, const Tensor& Wt, const Tensor* B, const Conv2dCfg& c,
                               std::vector<int64_t>& od) {
  int64_t N = X.dim(0), C = X.dim(1), H = X.dim(2), W = X.dim(3), M = Wt.dim(0), KH = Wt.dim(2), KW = Wt.dim(3);
  int64_t Cg = C / c.group, Mg = M / c.group;
  int64_t OH = (H + c.pt + c.pb - ((KH - 1) * c.dh + 1)) / c.sh + 1;
  int64_t OW = (W + c.pl + c.pr - ((KW - 1) * c.dw + 1)) / c.sw + 1;
  od = {N, M, OH, OW};
  std::vector<double> y(static_cast<size_t>(N * M * OH * OW));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double s = B ? B->get_f64(m) : 0.0;
          int64_t g = m / Mg;
          for (int64_t ci = 0; ci < Cg; ++ci)
            for (int64_t kh = 0; kh < KH; ++kh)
              for (int64_t kw = 0; kw < KW; ++kw) {
                int64_t ih = oh * c.sh - c.pt + kh * c.dh, iw = ow * c.sw - c.pl + kw * c.dw;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                s += X.get_f64(((n * C + g * Cg + ci) * H + ih) * W + iw) *
                     Wt.get_f64(((m * Cg + ci) * KH + kh) * KW + kw);
              }
          y[((n * M + m) * OH + oh) * OW + ow] = s;
        }
  return y;
}

Attributes conv_attrs(const Conv2dCfg& c) {
  Attributes a;
  a.set("group", c.group);
  a.set("strides", std::vector<int64_t>{c.sh, c.sw});
  a.set("dilations", std::vector<int64_t>{c.dh, c.dw});
  a.set("pads", std::vector<int64_t>{c.pt, c.pl, c.pb, c.pr});
  return a;
}

}  // namespace

// ----------------------------------------------------------------------------- MatMul / Gemm

TEST(NnOps, MatMulShapesAndDtypes) {
  struct Case {
    std::vector<int64_t> a, b;
  };
  std::vector<Case> cases = {{{3, 4}, {4, 5}},       {{2, 3, 4}, {4, 5}},    {{2, 1, 3, 4}, {3, 4, 5}},
                             {{4}, {2, 4, 5}},       {{2, 3, 4}, {4}},       {{4}, {4}},
                             {{1, 3, 4}, {2, 4, 6}}, {{2, 3, 4}, {1, 4, 2}}, {{5, 7}, {7, 1}}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    uint64_t seed = 1;
    for (auto& c : cases) {
      Tensor A = rnd(dt, c.a, -1, 1, seed++), B = rnd(dt, c.b, -1, 1, seed++);
      std::vector<int64_t> od;
      auto ref = ref_matmul(A, B, od);
      auto y = run_op("MatMul", {A, B});
      ASSERT_EQ(y.size(), 1u);
      EXPECT_EQ(y[0].dims(), od);
      EXPECT_EQ(y[0].dtype(), dt);
      auto [at, rt] = tol(dt);
      expect_close(y[0], ref, at, rt,
                   std::string("MatMul ") + dtype_name(dt) + dims_to_string(c.a) + dims_to_string(c.b));
    }
  }
  EXPECT_NE(run_error("MatMul", {rnd(DType::f32, {3, 4}, 0, 1, 1), rnd(DType::f32, {5, 2}, 0, 1, 2)}), "");
  EXPECT_NE(run_error("MatMul", {rnd(DType::f32, {2, 3, 4}, 0, 1, 1), rnd(DType::f32, {3, 4, 2}, 0, 1, 2)}), "");
}

TEST(NnOps, MatMulLargerBf16UsesF32Accumulation) {
  // K = 512: bf16 accumulation would lose ~2 digits; f32 accumulation stays within bf16 output rounding.
  Tensor A = rnd(DType::bf16, {8, 512}, -1, 1, 5), B = rnd(DType::bf16, {512, 16}, -1, 1, 6);
  std::vector<int64_t> od;
  auto ref = ref_matmul(A, B, od);
  auto y = run_op("MatMul", {A, B});
  ASSERT_EQ(y.size(), 1u);
  expect_close(y[0], ref, 5e-2, 1e-2, "MatMul bf16 K=512");
}

TEST(NnOps, Gemm) {
  const int64_t M = 3, K = 5, N = 4;
  // alpha = beta = 1 with C is oneDNN's matmul with a bias (f32, bf16); other scalings
  // add C in a separate f64 pass.
  for (auto [alpha, beta] : {std::pair<double, double>{0.7, -1.3}, std::pair<double, double>{1.0, 1.0}})
    for (DType dt : {DType::f32, DType::f64, DType::bf16})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int cshape = 0; cshape < 5; ++cshape) {
            Tensor A = rnd(dt, ta ? std::vector<int64_t>{K, M} : std::vector<int64_t>{M, K}, -1, 1, 10 + ta);
            Tensor B = rnd(dt, tb ? std::vector<int64_t>{N, K} : std::vector<int64_t>{K, N}, -1, 1, 20 + tb);
            std::vector<std::vector<int64_t>> cs = {{}, {N}, {M, 1}, {M, N}, {1}};
            Tensor C;
            if (cshape > 0) C = rnd(dt, cs[cshape], -1, 1, 30 + cshape);
            Attributes a;
            a.set("transA", int64_t(ta));
            a.set("transB", int64_t(tb));
            a.set("alpha", alpha);
            a.set("beta", beta);
            std::vector<Tensor> ins = {A, B};
            if (cshape > 0) ins.push_back(C);
            auto y = run_op("Gemm", ins, a);
            ASSERT_EQ(y.size(), 1u);
            std::vector<double> ref(M * N);
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 0; n < N; ++n) {
                double s = 0;
                for (int64_t k = 0; k < K; ++k)
                  s += A.get_f64(ta ? k * M + m : m * K + k) * B.get_f64(tb ? n * K + k : k * N + n);
                double cv = 0;
                if (cshape == 1) cv = C.get_f64(n);
                if (cshape == 2) cv = C.get_f64(m);
                if (cshape == 3) cv = C.get_f64(m * N + n);
                if (cshape == 4) cv = C.get_f64(0);
                ref[m * N + n] = alpha * s + beta * cv;
              }
            auto [at, rt] = tol(dt);
            expect_close(y[0], ref, at, rt, std::string("Gemm ") + dtype_name(dt));
          }
}

/// Gemm with transA = 1 above the size where the oneDNN helper first copies the
/// transposed A row-major (M >= 512, N <= 384, M*K*N >= 2^24; runtime/kernels/onednn.cpp), twice
/// (the second call reuses the cached reorder and the scratch buffer), and a transposed A
/// just below the M cut-off, against a float64 product; f32 tolerance for K = 256 sums.
TEST(NnOps, GemmTransposedALargeMatchesFloat64) {
  for (int64_t M : {int64_t{512}, int64_t{384}}) {
    const int64_t K = 256, N = 160;
    Tensor A = rnd(DType::f32, {K, M}, -1, 1, 41), B = rnd(DType::f32, {K, N}, -1, 1, 42);
    Attributes a;
    a.set("transA", int64_t(1));
    std::vector<double> ref(static_cast<size_t>(M * N));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += A.get_f64(k * M + m) * B.get_f64(k * N + n);
        ref[static_cast<size_t>(m * N + n)] = s;
      }
    for (int rep = 0; rep < 2; ++rep) {
      auto y = run_op("Gemm", {A, B}, a);
      ASSERT_EQ(y.size(), 1u);
      expect_close(y[0], ref, 1e-4, 1e-5, "Gemm transA M=" + std::to_string(M) + " call " + std::to_string(rep));
    }
  }
}

// ----------------------------------------------------------------------------- Conv

TEST(NnOps, Conv2dVariants) {
  struct Case {
    std::vector<int64_t> x, w;
    Conv2dCfg cfg;
    bool bias;
  };
  std::vector<Case> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {}, false},
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {1, 1, 1, 1, 1, 1, 1, 1, 1}, true},
      {{1, 4, 9, 8}, {6, 2, 3, 2}, {2, 2, 1, 2, 1, 1, 0, 2, 1}, true},   // group 2, strides, asym pads, dilation
      {{2, 4, 6, 6}, {4, 1, 3, 3}, {4, 1, 2, 1, 1, 1, 1, 1, 1}, false},  // depthwise, stride 2 on H
      {{1, 2, 5, 5}, {3, 2, 1, 1}, {1, 2, 2, 1, 1, 0, 0, 0, 0}, true},   // 1x1 stride 2
  };
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    uint64_t seed = 100;
    for (auto& c : cases) {
      Tensor X = rnd(dt, c.x, -1, 1, seed++), W = rnd(dt, c.w, -1, 1, seed++);
      Tensor B = rnd(dt, {c.w[0]}, -1, 1, seed++);
      std::vector<int64_t> od;
      auto ref = ref_conv2d(X, W, c.bias ? &B : nullptr, c.cfg, od);
      std::vector<Tensor> ins = {X, W};
      if (c.bias) ins.push_back(B);
      auto y = run_op("Conv", ins, conv_attrs(c.cfg));
      ASSERT_EQ(y.size(), 1u);
      EXPECT_EQ(y[0].dims(), od);
      auto [at, rt] = tol(dt);
      expect_close(y[0], ref, dt == DType::bf16 ? 5e-2 : at, rt, std::string("Conv ") + dtype_name(dt));
    }
  }
}

TEST(NnOps, ConvAutoPadAnd1d) {
  // SAME_UPPER, input 7, kernel 3, stride 2 -> out 4, total pad 2 -> (1, 1); 6 -> out 3, total 1 -> (0, 1).
  Tensor X = rnd(DType::f32, {1, 2, 7, 6}, -1, 1, 1), W = rnd(DType::f32, {3, 2, 3, 3}, -1, 1, 2);
  Attributes a;
  a.set("auto_pad", std::string("SAME_UPPER"));
  a.set("strides", std::vector<int64_t>{2, 2});
  auto y = run_op("Conv", {X, W}, a);
  ASSERT_EQ(y.size(), 1u);
  Conv2dCfg c;
  c.sh = c.sw = 2;
  c.pt = 1;
  c.pb = 1;
  c.pl = 0;
  c.pr = 1;
  std::vector<int64_t> od;
  auto ref = ref_conv2d(X, W, nullptr, c, od);
  EXPECT_EQ(y[0].dims(), od);
  expect_close(y[0], ref, 1e-5, 1e-5, "Conv SAME_UPPER");
  // SAME_LOWER puts the odd pad first.
  a.set("auto_pad", std::string("SAME_LOWER"));
  y = run_op("Conv", {X, W}, a);
  c.pl = 1;
  c.pr = 0;
  ref = ref_conv2d(X, W, nullptr, c, od);
  expect_close(y[0], ref, 1e-5, 1e-5, "Conv SAME_LOWER");
  // 1-D conv equals 2-D conv with H = 1.
  Tensor X1 = rnd(DType::f64, {2, 3, 9}, -1, 1, 3), W1 = rnd(DType::f64, {4, 3, 3}, -1, 1, 4);
  Attributes a1;
  a1.set("pads", std::vector<int64_t>{2, 1});
  a1.set("dilations", std::vector<int64_t>{2});
  for (DType dt : {DType::f64, DType::f32}) {
    auto y1 = run_op("Conv", {X1.cast(dt), W1.cast(dt)}, a1);
    ASSERT_EQ(y1.size(), 1u);
    Conv2dCfg c1;
    c1.dw = 2;
    c1.pl = 2;
    c1.pr = 1;
    auto ref1 = ref_conv2d(X1.reshaped({2, 3, 1, 9}), W1.reshaped({4, 3, 1, 3}), nullptr, c1, od);
    EXPECT_EQ(y1[0].dims(), (std::vector<int64_t>{2, 4, 8}));  // (9 + 3 - 5) + 1
    expect_close(y1[0], ref1, 1e-5, 1e-5, "Conv 1-D");
  }
  // Channel mismatch is a clean error.
  EXPECT_NE(run_error("Conv", {rnd(DType::f32, {1, 3, 5, 5}, 0, 1, 1), rnd(DType::f32, {2, 2, 3, 3}, 0, 1, 2)}), "");
}

TEST(NnOps, ConvComputedInF32TakesMixedOperands) {
  // A convolution node marked kiln_compute_f32 (autocast rule (d)/(e)) computes in f32
  // on operands of either float dtype and stores bf16: forward with a bf16 X and an f32
  // W (a master weight), X f32 and W f32 (a graph input), ConvGradInput with dY bf16 and
  // W f32, ConvGradWeight with dY bf16 and X f32. Reference: the f64 loops on the same
  // (rounded) operand values, rounded once to bf16 (the f32 kernel's own rounding error is
  // far below bf16's: 1e-2 relative, as every bf16 result here).
  Conv2dCfg cfg{1, 2, 1, 1, 1, 1, 1, 1, 1};  // stride (2, 1), pads 1
  Attributes a = conv_attrs(cfg);
  a.set("kiln_compute_f32", 1e3);
  Tensor X = rnd(DType::f64, {2, 3, 9, 8}, -1, 1, 71), W = rnd(DType::f64, {5, 3, 3, 3}, -1, 1, 72);
  const Tensor Xb = X.cast(DType::bf16), Wf = W.cast(DType::f32);
  std::vector<int64_t> od;
  for (DType xdt : {DType::bf16, DType::f32}) {
    const Tensor Xin = xdt == DType::bf16 ? Xb : X.cast(DType::f32);
    auto y = run_op("Conv", {Xin, Wf}, a);
    ASSERT_EQ(y.size(), 1u);
    EXPECT_EQ(y[0].dtype(), DType::bf16);
    expect_close(y[0], ref_conv2d(Xin.cast(DType::f64), Wf.cast(DType::f64), nullptr, cfg, od), 2e-2, 1e-2,
                 std::string("Conv X ") + dtype_name(xdt) + ", W f32");
  }
  ref_conv2d(X, W, nullptr, cfg, od);
  const Tensor dYb = rnd(DType::f64, od, -1, 1, 73).cast(DType::bf16);
  Attributes ai = a, aw = a;
  ai.set("input_shape", X.dims());
  aw.set("kernel_shape", std::vector<int64_t>{3, 3});
  auto gi = run_op("ConvGradInput", {dYb, Wf}, ai);
  auto gw = run_op("ConvGradWeight", {dYb, X.cast(DType::f32)}, aw);
  Attributes ai64 = ai, aw64 = aw;
  ai64.erase("kiln_compute_f32");
  aw64.erase("kiln_compute_f32");
  auto ri = run_op("ConvGradInput", {dYb.cast(DType::f64), Wf.cast(DType::f64)}, ai64);
  auto rw = run_op("ConvGradWeight", {dYb.cast(DType::f64), X.cast(DType::f32).cast(DType::f64)}, aw64);
  ASSERT_EQ(gi.size(), 1u);
  ASSERT_EQ(gw.size(), 1u);
  EXPECT_EQ(gi[0].dtype(), DType::bf16);
  EXPECT_EQ(gw[0].dtype(), DType::bf16);
  std::vector<double> vi, vw;
  for (int64_t i = 0; i < ri[0].numel(); ++i) vi.push_back(ri[0].get_f64(i));
  for (int64_t i = 0; i < rw[0].numel(); ++i) vw.push_back(rw[0].get_f64(i));
  expect_close(gi[0], vi, 2e-2, 1e-2, "ConvGradInput dY bf16, W f32");
  expect_close(gw[0], vw, 2e-2, 1e-2, "ConvGradWeight dY bf16, X f32");
  // Without the mark, mixed operands are an error naming them.
  Attributes plain = conv_attrs(cfg);
  EXPECT_NE(run_error("Conv", {Xb, Wf}, plain), "");
}

TEST(NnOps, ConvBackwardOneDnnMatchesF64Loops) {
  // ConvGradInput / ConvGradWeight: f32 and bf16 go through oneDNN, f64 through loops.
  Conv2dCfg cfg{2, 2, 1, 1, 2, 1, 0, 1, 2};
  Attributes a = conv_attrs(cfg);
  Tensor X = rnd(DType::f64, {2, 4, 8, 7}, -1, 1, 7), W = rnd(DType::f64, {6, 2, 3, 2}, -1, 1, 8);
  std::vector<int64_t> od;
  ref_conv2d(X, W, nullptr, cfg, od);
  Tensor dY = rnd(DType::f64, od, -1, 1, 9);
  Attributes ai = a;
  ai.set("input_shape", X.dims());
  Attributes aw = a;
  aw.set("kernel_shape", std::vector<int64_t>{3, 2});
  auto gi64 = run_op("ConvGradInput", {dY, W}, ai);
  auto gw64 = run_op("ConvGradWeight", {dY, X}, aw);
  ASSERT_EQ(gi64.size(), 1u);
  ASSERT_EQ(gw64.size(), 1u);
  // f64 loops against the adjoint identity <conv(X, W), dY> = <X, dX> = <W, dW>.
  auto y = ref_conv2d(X, W, nullptr, cfg, od);
  double lhs = 0, rx = 0, rw = 0;
  for (size_t i = 0; i < y.size(); ++i) lhs += y[i] * dY.get_f64(i);
  for (int64_t i = 0; i < X.numel(); ++i) rx += X.get_f64(i) * gi64[0].get_f64(i);
  for (int64_t i = 0; i < W.numel(); ++i) rw += W.get_f64(i) * gw64[0].get_f64(i);
  EXPECT_NEAR(lhs, rx, 1e-9);
  EXPECT_NEAR(lhs, rw, 1e-9);
  for (DType dt : {DType::f32, DType::bf16}) {
    auto gi = run_op("ConvGradInput", {dY.cast(dt), W.cast(dt)}, ai);
    auto gw = run_op("ConvGradWeight", {dY.cast(dt), X.cast(dt)}, aw);
    ASSERT_EQ(gi.size(), 1u);
    ASSERT_EQ(gw.size(), 1u);
    std::vector<double> ri, rw2;
    for (int64_t i = 0; i < gi64[0].numel(); ++i) ri.push_back(gi64[0].get_f64(i));
    for (int64_t i = 0; i < gw64[0].numel(); ++i) rw2.push_back(gw64[0].get_f64(i));
    double at = dt == DType::bf16 ? 1e-1 : 1e-4, rt = dt == DType::bf16 ? 2e-2 : 1e-5;
    expect_close(gi[0], ri, at, rt, std::string("ConvGradInput ") + dtype_name(dt));
    expect_close(gw[0], rw2, at, rt, std::string("ConvGradWeight ") + dtype_name(dt));
  }
}

// ----------------------------------------------------------------------------- pools

namespace {
Tensor pool_input() {
  std::vector<double> v;
  for (int i = 0; i < 25; ++i) v.push_back(i * ((i % 2) ? -0.5 : 0.5) + i * 0.01);
  return make(DType::f64, {1, 1, 5, 5}, v);
}
}  // namespace

TEST(NnOps, PoolsMatchPyTorchCeilMode) {
  Tensor X = pool_input();
  Attributes avg;
  avg.set("kernel_shape", std::vector<int64_t>{3, 2});
  avg.set("strides", std::vector<int64_t>{2, 2});
  avg.set("pads", std::vector<int64_t>{1, 1, 1, 1});
  avg.set("ceil_mode", int64_t(1));
  avg.set("count_include_pad", int64_t(1));
  // torch.nn.functional.avg_pool2d(x, (3, 2), 2, 1, ceil_mode=True, count_include_pad=...)
  std::vector<double> inc = {-0.4083333338300387, 0.026666666381061077, 0.03999999879548947,
                             -0.7833333363135656, 0.031666665648420654, 0.05166666333874067,
                             0.4749999965230624,  0.12666666507720947,  0.1399999956289927};
  std::vector<double> exc = {-1.2250000014901161, 0.039999999571591616, 0.059999998193234205,
                             -1.5666666726271312, 0.031666665648420654, 0.05166666333874067,
                             1.4249999895691872,  0.1899999976158142,   0.20999999344348907};
  for (DType dt : {DType::f64, DType::f32}) {
    auto y = run_op("AveragePool", {X.cast(dt)}, avg);
    ASSERT_EQ(y.size(), 1u);
    EXPECT_EQ(y[0].dims(), (std::vector<int64_t>{1, 1, 3, 3}));
    expect_close(y[0], inc, 1e-6, 1e-6, "AveragePool count_include_pad=1");
  }
  avg.set("count_include_pad", int64_t(0));
  auto y = run_op("AveragePool", {X}, avg);
  ASSERT_EQ(y.size(), 1u);
  expect_close(y[0], exc, 1e-6, 1e-6, "AveragePool count_include_pad=0");

  // max_pool2d(x, 2, 2, padding=1, ceil_mode=True, return_indices=True): in 5 -> 3 (PyTorch drops
  // the window that would start in the right padding).
  Attributes mp;
  mp.set("kernel_shape", std::vector<int64_t>{2, 2});
  mp.set("strides", std::vector<int64_t>{2, 2});
  mp.set("pads", std::vector<int64_t>{1, 1, 1, 1});
  mp.set("ceil_mode", int64_t(1));
  auto m = run_op("MaxPool", {X}, mp, 2);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].dims(), (std::vector<int64_t>{1, 1, 3, 3}));
  expect_close(m[0], {0.0, 1.02, 2.04, 5.1, 6.12, 7.14, 10.2, 11.22, 12.24}, 1e-6, 1e-6, "MaxPool ceil");
  expect_close(m[1], {0, 2, 4, 10, 12, 14, 20, 22, 24}, 0, 0, "MaxPool Indices");
  // max_pool2d(x, 2, 2, ceil_mode=True) without padding: 5 -> 3
  Attributes mp2;
  mp2.set("kernel_shape", std::vector<int64_t>{2, 2});
  mp2.set("strides", std::vector<int64_t>{2, 2});
  mp2.set("ceil_mode", int64_t(1));
  auto m2 = run_op("MaxPool", {X.cast(DType::bf16)}, mp2);
  ASSERT_EQ(m2.size(), 1u);
  expect_close(m2[0], {3.06, 4.08, 2.04, 8.16, 9.18, 7.14, 10.2, 11.22, 12.24}, 1e-2, 1e-2, "MaxPool bf16");
}

TEST(NnOps, MaxPoolDilationsAndGlobalAverage) {
  Tensor X = rnd(DType::f64, {2, 3, 7, 8}, -1, 1, 50);
  Attributes a;
  a.set("kernel_shape", std::vector<int64_t>{2, 3});
  a.set("dilations", std::vector<int64_t>{2, 1});
  a.set("strides", std::vector<int64_t>{1, 2});
  a.set("pads", std::vector<int64_t>{0, 1, 1, 0});
  auto y = run_op("MaxPool", {X}, a);
  ASSERT_EQ(y.size(), 1u);
  int64_t OH = (7 + 1 - 3) / 1 + 1, OW = (8 + 1 - 3) / 2 + 1;
  ASSERT_EQ(y[0].dims(), (std::vector<int64_t>{2, 3, OH, OW}));
  std::vector<double> ref;
  for (int64_t nc = 0; nc < 6; ++nc)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double m = -INFINITY;
        for (int kh = 0; kh < 2; ++kh)
          for (int kw = 0; kw < 3; ++kw) {
            int64_t ih = oh + kh * 2, iw = ow * 2 - 1 + kw;
            if (ih < 0 || ih >= 7 || iw < 0 || iw >= 8) continue;
            m = std::max(m, X.get_f64((nc * 7 + ih) * 8 + iw));
          }
        ref.push_back(m);
      }
  expect_close(y[0], ref, 0, 0, "MaxPool dilations");
  auto g = run_op("GlobalAveragePool", {X});
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].dims(), (std::vector<int64_t>{2, 3, 1, 1}));
  std::vector<double> gref;
  for (int64_t nc = 0; nc < 6; ++nc) {
    double s = 0;
    for (int i = 0; i < 56; ++i) s += X.get_f64(nc * 56 + i);
    gref.push_back(s / 56);
  }
  expect_close(g[0], gref, 1e-12, 1e-12, "GlobalAveragePool");
  // Indices: row-major (storage_order 0) and column-major (1) flat positions of the
  // maxima, offset by nc * H * W (ONNX MaxPool; also checked by ONNX's backend test
  // test_maxpool_with_argmax_2d_precomputed_strides).
  const int64_t H = 4, W = 5;
  Tensor I = rnd(DType::f32, {2, 1, H, W}, 0, 1, 1);
  Attributes k2;
  k2.set("kernel_shape", std::vector<int64_t>{2, 2});
  k2.set("strides", std::vector<int64_t>{2, 2});
  for (int64_t order : {0, 1}) {
    Attributes so = k2;
    so.set("storage_order", order);
    auto r = run_op("MaxPool", {I}, so, 2);
    ASSERT_EQ(r.size(), 2u);
    ASSERT_EQ(r[1].dims(), (std::vector<int64_t>{2, 1, 2, 2}));
    std::vector<double> want;
    for (int64_t nc = 0; nc < 2; ++nc)
      for (int64_t oh = 0; oh < 2; ++oh)
        for (int64_t ow = 0; ow < 2; ++ow) {
          int64_t bh = 0, bw = 0;
          double best = -1;
          for (int64_t h = 2 * oh; h < 2 * oh + 2; ++h)
            for (int64_t w = 2 * ow; w < 2 * ow + 2; ++w)
              if (I.get_f64((nc * H + h) * W + w) > best) best = I.get_f64((nc * H + h) * W + w), bh = h, bw = w;
          want.push_back(static_cast<double>(nc * H * W + (order ? bh + bw * H : bh * W + bw)));
        }
    expect_close(r[1], want, 0, 0, order ? "MaxPool Indices column-major" : "MaxPool Indices row-major");
  }
}

// ----------------------------------------------------------------------------- normalization

TEST(NnOps, BatchNormalizationInferenceAndTraining) {
  const int64_t N = 3, C = 2, S = 5;
  for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
    Tensor X = rnd(dt, {N, C, S}, -2, 2, 60), scale = rnd(dt, {C}, 0.5, 1.5, 61), B = rnd(dt, {C}, -1, 1, 62);
    Tensor mean = rnd(dt, {C}, -0.5, 0.5, 63), var = rnd(dt, {C}, 0.5, 2, 64);
    Attributes a;
    a.set("epsilon", 1e-3);
    a.set("momentum", 0.8);
    auto [at, rt] = tol(dt);
    // inference
    auto y = run_op("BatchNormalization", {X, scale, B, mean, var}, a);
    ASSERT_EQ(y.size(), 1u);
    std::vector<double> ref(N * C * S);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t s = 0; s < S; ++s) {
          int64_t i = (n * C + c) * S + s;
          ref[i] =
              (X.get_f64(i) - mean.get_f64(c)) / std::sqrt(var.get_f64(c) + 1e-3) * scale.get_f64(c) + B.get_f64(c);
        }
    expect_close(y[0], ref, at, rt, "BN inference");
    // training (attribute), 3 outputs: batch statistics, running stats with unbiased variance
    Attributes at_ = a;
    at_.set("training_mode", int64_t(1));
    auto yt = run_op("BatchNormalization", {X, scale, B, mean, var}, at_, 3);
    ASSERT_EQ(yt.size(), 3u);
    std::vector<double> rm(C), rv(C);
    for (int64_t c = 0; c < C; ++c) {
      double s = 0, ss = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < S; ++k) s += X.get_f64((n * C + c) * S + k);
      double mu = s / (N * S);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < S; ++k) ss += std::pow(X.get_f64((n * C + c) * S + k) - mu, 2);
      double v = ss / (N * S);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < S; ++k) {
          int64_t i = (n * C + c) * S + k;
          ref[i] = (X.get_f64(i) - mu) / std::sqrt(v + 1e-3) * scale.get_f64(c) + B.get_f64(c);
        }
      rm[c] = mean.get_f64(c) * 0.8 + mu * 0.2;
      rv[c] = var.get_f64(c) * 0.8 + ss / (N * S - 1) * 0.2;
    }
    expect_close(yt[0], ref, at, rt, "BN training Y");
    expect_close(yt[1], rm, at, rt, "BN running_mean");
    expect_close(yt[2], rv, at, rt, "BN running_var (unbiased)");
    // training through the run option gives the same Y
    RunOptions ro;
    ro.training = true;
    auto yo = run_op("BatchNormalization", {X, scale, B, mean, var}, a, 1, ro);
    ASSERT_EQ(yo.size(), 1u);
    expect_close(yo[0], ref, at, rt, "BN training (run option)");
  }
}

TEST(NnOps, LayerNormalization) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16})
    for (int64_t axis : {-1, 1}) {
      Tensor X = rnd(dt, {2, 3, 4}, -2, 2, 70);
      int64_t D = axis == -1 ? 4 : 12, R = 24 / D;
      std::vector<int64_t> pd = axis == -1 ? std::vector<int64_t>{4} : std::vector<int64_t>{3, 4};
      Tensor scale = rnd(dt, pd, 0.5, 1.5, 71), B = rnd(dt, pd, -1, 1, 72);
      Attributes a;
      a.set("axis", axis);
      a.set("epsilon", 1e-4);
      auto y = run_op("LayerNormalization", {X, scale, B}, a, 3);
      ASSERT_EQ(y.size(), 3u);
      std::vector<double> ref(24), rmean, rinv;
      for (int64_t r = 0; r < R; ++r) {
        double s = 0, ss = 0;
        for (int64_t j = 0; j < D; ++j) s += X.get_f64(r * D + j);
        double mu = s / D;
        for (int64_t j = 0; j < D; ++j) ss += std::pow(X.get_f64(r * D + j) - mu, 2);
        double inv = 1 / std::sqrt(ss / D + 1e-4);
        for (int64_t j = 0; j < D; ++j)
          ref[r * D + j] = (X.get_f64(r * D + j) - mu) * inv * scale.get_f64(j) + B.get_f64(j);
        rmean.push_back(mu);
        rinv.push_back(inv);
      }
      auto [at, rt] = tol(dt);
      expect_close(y[0], ref, at, rt, "LayerNormalization Y");
      std::vector<int64_t> sd = axis == -1 ? std::vector<int64_t>{2, 3, 1} : std::vector<int64_t>{2, 1, 1};
      EXPECT_EQ(y[1].dims(), sd);
      EXPECT_EQ(y[1].dtype(), dt == DType::f64 ? DType::f64 : DType::f32);
      expect_close(y[1], rmean, 1e-5, 1e-5, "LayerNormalization Mean");
      expect_close(y[2], rinv, 1e-5, 1e-5, "LayerNormalization InvStdDev");
    }
}

TEST(NnOps, SoftmaxAndLogSoftmax) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16})
    for (int64_t axis : {-1, 1, 0}) {
      Tensor X = rnd(dt, {2, 3, 4}, -3, 3, 80);
      Attributes a;
      a.set("axis", axis);
      auto s = run_op("Softmax", {X}, a);
      auto l = run_op("LogSoftmax", {X}, a);
      ASSERT_EQ(s.size(), 1u);
      ASSERT_EQ(l.size(), 1u);
      int ax = axis < 0 ? 2 : static_cast<int>(axis);
      std::vector<int64_t> d = {2, 3, 4}, st = {12, 4, 1};
      std::vector<double> rs(24), rl(24);
      for (int64_t i = 0; i < 24; ++i) {
        int64_t coord = (i / st[ax]) % d[ax], base = i - coord * st[ax];
        double z = 0;
        for (int64_t k = 0; k < d[ax]; ++k) z += std::exp(X.get_f64(base + k * st[ax]));
        rs[i] = std::exp(X.get_f64(i)) / z;
        rl[i] = X.get_f64(i) - std::log(z);
      }
      auto [at, rt] = tol(dt);
      expect_close(s[0], rs, at, rt, "Softmax");
      expect_close(l[0], rl, dt == DType::bf16 ? 5e-2 : at, rt, "LogSoftmax");
    }
}

// ----------------------------------------------------------------------------- gradients

TEST(NnGrad, MatMulAndGemm) {
  check_grad("MatMul", {rnd(DType::f64, {2, 3, 4}, -1, 1, 1), rnd(DType::f64, {4, 5}, -1, 1, 2)});
  check_grad("MatMul", {rnd(DType::f64, {2, 1, 3, 4}, -1, 1, 3), rnd(DType::f64, {3, 4, 2}, -1, 1, 4)});
  check_grad("MatMul", {rnd(DType::f64, {4}, -1, 1, 5), rnd(DType::f64, {2, 4, 3}, -1, 1, 6)});
  check_grad("MatMul", {rnd(DType::f64, {2, 3, 4}, -1, 1, 7), rnd(DType::f64, {4}, -1, 1, 8)});
  check_grad("MatMul", {rnd(DType::f64, {4}, -1, 1, 9), rnd(DType::f64, {4}, -1, 1, 10)});
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      Attributes a;
      a.set("transA", int64_t(ta));
      a.set("transB", int64_t(tb));
      a.set("alpha", 0.5);
      a.set("beta", 2.0);
      Tensor A = rnd(DType::f64, ta ? std::vector<int64_t>{4, 3} : std::vector<int64_t>{3, 4}, -1, 1, 11);
      Tensor B = rnd(DType::f64, tb ? std::vector<int64_t>{5, 4} : std::vector<int64_t>{4, 5}, -1, 1, 12);
      check_grad("Gemm", {A, B, rnd(DType::f64, {5}, -1, 1, 13)}, a);
      check_grad("Gemm", {A, B, rnd(DType::f64, {3, 1}, -1, 1, 14)}, a);
      check_grad("Gemm", {A, B}, a);
    }
}

TEST(NnGrad, Conv) {
  Conv2dCfg cfg{2, 2, 1, 1, 2, 1, 0, 1, 2};
  check_grad("Conv",
             {rnd(DType::f64, {2, 4, 6, 5}, -1, 1, 20), rnd(DType::f64, {4, 2, 2, 2}, -1, 1, 21),
              rnd(DType::f64, {4}, -1, 1, 22)},
             conv_attrs(cfg));
  check_grad("Conv", {rnd(DType::f64, {1, 2, 5, 5}, -1, 1, 23), rnd(DType::f64, {3, 2, 3, 3}, -1, 1, 24)});
  Attributes same;
  same.set("auto_pad", std::string("SAME_UPPER"));
  same.set("strides", std::vector<int64_t>{2});
  check_grad("Conv", {rnd(DType::f64, {2, 2, 7}, -1, 1, 25), rnd(DType::f64, {3, 2, 3}, -1, 1, 26)}, same);
}

TEST(NnGrad, Pools) {
  Tensor X = rnd(DType::f64, {2, 2, 5, 6}, -1, 1, 30);  // distinct values: max is unique
  Attributes mp;
  mp.set("kernel_shape", std::vector<int64_t>{2, 3});
  mp.set("strides", std::vector<int64_t>{2, 2});
  mp.set("pads", std::vector<int64_t>{1, 0, 1, 1});
  mp.set("ceil_mode", int64_t(1));
  check_grad("MaxPool", {X}, mp);
  Attributes ap = mp;
  ap.set("count_include_pad", int64_t(1));
  check_grad("AveragePool", {X}, ap);
  ap.set("count_include_pad", int64_t(0));
  check_grad("AveragePool", {X}, ap);
  check_grad("GlobalAveragePool", {X});
}

TEST(NnGrad, Normalization) {
  Tensor X = rnd(DType::f64, {3, 2, 4}, -2, 2, 40);
  Tensor scale = rnd(DType::f64, {2}, 0.5, 1.5, 41), B = rnd(DType::f64, {2}, -1, 1, 42);
  Tensor mean = rnd(DType::f64, {2}, -0.5, 0.5, 43), var = rnd(DType::f64, {2}, 0.5, 2, 44);
  Attributes bn;
  bn.set("epsilon", 1e-3);
  check_grad("BatchNormalization", {X, scale, B, mean, var}, bn, 1, {0, 1, 2});        // inference
  check_grad("BatchNormalization", {X, scale, B, mean, var}, bn, 1, {0, 1, 2}, true);  // training run
  bn.set("training_mode", int64_t(1));
  check_grad("BatchNormalization", {X, scale, B, mean, var}, bn, 1, {0, 1, 2});  // training attribute
  Attributes ln;
  ln.set("axis", int64_t(1));
  ln.set("epsilon", 1e-3);
  check_grad("LayerNormalization", {X, rnd(DType::f64, {2, 4}, 0.5, 1.5, 45), rnd(DType::f64, {2, 4}, -1, 1, 46)}, ln);
  ln.set("axis", int64_t(-1));
  check_grad("LayerNormalization", {X, rnd(DType::f64, {4}, 0.5, 1.5, 47)}, ln);
  for (int64_t axis : {-1, 1}) {
    Attributes a;
    a.set("axis", axis);
    check_grad("Softmax", {X}, a);
    check_grad("LogSoftmax", {X}, a);
  }
}

TEST(NnOps, TableEntries) {
  auto& t = OpTable::get();
  for (const char* op : {"MatMul", "Gemm", "Conv"}) {
    ASSERT_NE(t.find(op), nullptr) << op;
    EXPECT_EQ(t.find(op)->precision, PrecisionPolicy::low_precision) << op;
    EXPECT_EQ(t.find(op)->fusion, FusionClass::library) << op;
  }
  for (const char* op : {"ConvGradInput", "ConvGradWeight", "MaxPoolGrad", "AveragePoolGrad", "BatchNormalizationGrad",
                         "LayerNormalizationGrad", "SoftmaxGrad", "LogSoftmaxGrad"}) {
    ASSERT_NE(t.find(op), nullptr) << op;
    EXPECT_FALSE(t.find(op)->onnx) << op;
    EXPECT_EQ(t.find(op)->diff, Differentiability::not_differentiable) << op;
  }
  // MatMul cost: 2 * M * N * K
  Graph g;
  Value* a = g.add_input("a", DType::f32, Shape::of({8, 16}));
  Value* b = g.add_input("b", DType::f32, Shape::of({16, 4}));
  Node* n = g.add_node("MatMul", "mm", {a, b}, {"y"});
  ASSERT_TRUE(infer_node(*n).is_ok());
  EXPECT_DOUBLE_EQ(node_cost(*n).flops, 2.0 * 8 * 4 * 16);
  // unknown attribute rejected by the verifier
  n->attrs.set("bogus", int64_t(1));
  EXPECT_FALSE(verify_graph(g).is_ok());
}

// MaxPool and MaxPoolGrad in f32 take a fast path (tap ranges computed once per call,
// float compares); other dtypes take the generic window walk. Both must pick the same first
// maximum, ties and NaNs included: f32 outputs equal the f64 path's exactly, f32 gradients
// equal the f64 path's rounded to f32 (both sum in double, in the same order). Inputs on a
// coarse grid (many ties) with one NaN; 1-D to 3-D, strides, dilations, asymmetric pads,
// ceil mode, and a non-square output (catches swapped window coordinates).
TEST(NnOps, MaxPoolF32PathEqualsGenericPath) {
  struct Case {
    std::vector<int64_t> dims, k, s, d, pads;
    int64_t ceil;
  };
  const std::vector<Case> cases = {
      {{2, 3, 16, 16}, {3, 3}, {2, 2}, {1, 1}, {1, 1, 1, 1}, 0},                  // a ResNet stem
      {{1, 2, 9, 14}, {2, 3}, {1, 2}, {2, 1}, {1, 0, 2, 1}, 0},                   // dilation, asymmetric pads
      {{2, 2, 13}, {3}, {2}, {1}, {1, 1}, 1},                                     // 1-D, ceil mode
      {{1, 2, 5, 6, 7}, {2, 2, 3}, {2, 1, 2}, {1, 1, 1}, {1, 0, 0, 0, 1, 1}, 1},  // 3-D
  };
  uint64_t seed = 90;
  for (const Case& c : cases) {
    SCOPED_TRACE("input " + ir::dims_to_string(c.dims));
    Tensor X = rnd(DType::f32, c.dims, -1, 1, seed++);
    for (int64_t i = 0; i < X.numel(); ++i) X.data<float>()[i] = std::round(X.data<float>()[i] * 4.f) / 4.f;
    X.data<float>()[X.numel() / 3] = NAN;
    Attributes a;
    a.set("kernel_shape", c.k);
    a.set("strides", c.s);
    a.set("dilations", c.d);
    a.set("pads", c.pads);
    a.set("ceil_mode", c.ceil);
    auto same = [](float got, double want) {
      const float w = static_cast<float>(want);
      return (got != got && w != w) || std::memcmp(&got, &w, 4) == 0;
    };
    auto y32 = run_op("MaxPool", {X}, a, 2);
    auto y64 = run_op("MaxPool", {X.cast(DType::f64)}, a, 2);
    ASSERT_EQ(y32[0].numel(), y64[0].numel());
    int64_t bad = 0;
    for (int64_t i = 0; i < y32[0].numel(); ++i) {
      if (!same(y32[0].data<float>()[i], y64[0].data<double>()[i]) && ++bad < 4)
        ADD_FAILURE() << "MaxPool output " << i << ": " << y32[0].data<float>()[i] << " vs "
                      << y64[0].data<double>()[i];
      if (y32[1].data<int64_t>()[i] != y64[1].data<int64_t>()[i] && ++bad < 4)
        ADD_FAILURE() << "MaxPool index " << i << ": " << y32[1].data<int64_t>()[i] << " vs "
                      << y64[1].data<int64_t>()[i];
    }
    Tensor dY = rnd(DType::f32, y32[0].dims(), -1, 1, seed++);
    auto g32 = run_op("MaxPoolGrad", {dY, X}, a);
    auto g64 = run_op("MaxPoolGrad", {dY.cast(DType::f64), X.cast(DType::f64)}, a);
    ASSERT_EQ(g32[0].numel(), X.numel());
    for (int64_t i = 0; i < X.numel(); ++i)
      if (!same(g32[0].data<float>()[i], g64[0].data<double>()[i]) && ++bad < 8)
        ADD_FAILURE() << "MaxPoolGrad element " << i << ": " << g32[0].data<float>()[i] << " vs "
                      << g64[0].data<double>()[i];
    // bf16 takes the same row routine, widening on load: the same inputs (quarters and a
    // NaN are exact in bf16) give the f64 generic path's maxima and indices exactly, and
    // the gradient of a bf16 dY is the f64 sum rounded as a bf16 store rounds it (to f32,
    // then to bf16).
    auto yb = run_op("MaxPool", {X.cast(DType::bf16)}, a, 2);
    ASSERT_EQ(yb[0].dtype(), DType::bf16);
    for (int64_t i = 0; i < yb[0].numel(); ++i) {
      if (!same(static_cast<float>(yb[0].get_f64(i)), y64[0].data<double>()[i]) && ++bad < 12)
        ADD_FAILURE() << "bf16 MaxPool output " << i << ": " << yb[0].get_f64(i) << " vs " << y64[0].data<double>()[i];
      if (yb[1].data<int64_t>()[i] != y64[1].data<int64_t>()[i] && ++bad < 12)
        ADD_FAILURE() << "bf16 MaxPool index " << i;
    }
    Tensor dYb = dY.cast(DType::bf16);
    auto gb = run_op("MaxPoolGrad", {dYb, X.cast(DType::bf16)}, a);
    auto gb64 = run_op("MaxPoolGrad", {dYb.cast(DType::f64), X.cast(DType::f64)}, a);
    ASSERT_EQ(gb[0].dtype(), DType::bf16);
    for (int64_t i = 0; i < X.numel(); ++i) {
      const float want = ir::bf16_to_f32(ir::f32_to_bf16(static_cast<float>(gb64[0].data<double>()[i])));
      if (!same(static_cast<float>(gb[0].get_f64(i)), want) && ++bad < 16)
        ADD_FAILURE() << "bf16 MaxPoolGrad element " << i << ": " << gb[0].get_f64(i) << " vs " << want;
    }
    EXPECT_EQ(bad, 0);
  }
}

namespace kiln::runtime {
namespace {

TEST(NnOps, ShapeGenericMatmulMatchesFloat64) {
  // onednn::matmul_any_shape (one primitive with run-time dims per dtype pair and
  // layout, what a symbolic program's product runs on a shape it has not seen) against
  // float64 loops: f32 within 1e-5 relative to the largest |C|, every layout (A and B
  // row-major or transposed), shapes with dims of 1 among them; bf16 operands within 1e-2.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  struct Case {
    int64_t M, K, N;
  };
  for (ir::DType dt : {ir::DType::f32, ir::DType::bf16})
    for (Case c : {Case{1, 1, 1}, Case{3, 5, 7}, Case{17, 64, 33}, Case{1, 64, 256}, Case{96, 1, 12}, Case{130, 70, 1}})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          std::vector<float> a(static_cast<size_t>(c.M * c.K)), b(static_cast<size_t>(c.K * c.N));
          for (float& x : a) x = u(rng);
          for (float& x : b) x = u(rng);
          // A (M, K) stored row-major or as its transpose (K, M); B likewise.
          auto at = [&](int64_t m, int64_t k) { return a[static_cast<size_t>(ta ? k * c.M + m : m * c.K + k)]; };
          auto bt = [&](int64_t k, int64_t n) { return b[static_cast<size_t>(tb ? n * c.K + k : k * c.N + n)]; };
          std::vector<uint16_t> a16(a.size()), b16(b.size());
          if (dt == ir::DType::bf16) {
            for (size_t i = 0; i < a.size(); ++i) a16[i] = ir::f32_to_bf16(a[i]), a[i] = ir::bf16_to_f32(a16[i]);
            for (size_t i = 0; i < b.size(); ++i) b16[i] = ir::f32_to_bf16(b[i]), b[i] = ir::bf16_to_f32(b16[i]);
          }
          const void* pa = dt == ir::DType::bf16 ? static_cast<const void*>(a16.data()) : a.data();
          const void* pb = dt == ir::DType::bf16 ? static_cast<const void*>(b16.data()) : b.data();
          const kernels::onednn::Operand A{pa, {c.M, c.K}, ta ? std::vector<int64_t>{1, c.M} : std::vector<int64_t>{}};
          const kernels::onednn::Operand B{pb, {c.K, c.N}, tb ? std::vector<int64_t>{1, c.K} : std::vector<int64_t>{}};
          std::vector<float> got(static_cast<size_t>(c.M * c.N), std::nanf(""));
          Status st = kernels::onednn::matmul_any_shape(A, B, got.data(), {c.M, c.N}, dt, ir::DType::f32);
          ASSERT_TRUE(st.is_ok()) << st.message();
          double scale = 0;
          std::vector<double> ref(got.size());
          for (int64_t m = 0; m < c.M; ++m)
            for (int64_t n = 0; n < c.N; ++n) {
              double s = 0;
              for (int64_t k = 0; k < c.K; ++k) s += static_cast<double>(at(m, k)) * bt(k, n);
              ref[static_cast<size_t>(m * c.N + n)] = s;
              scale = std::max(scale, std::fabs(s));
            }
          const double tol = (dt == ir::DType::bf16 ? 1e-2 : 1e-5) * std::max(1.0, scale);
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_NEAR(got[i], ref[i], tol) << c.M << "x" << c.K << "x" << c.N << " ta " << ta << " tb " << tb
                                             << " dtype " << ir::dtype_name(dt) << " element " << i;
        }
}

TEST(NnOps, ShapeGenericBatchedMatmulOfPermutedViewsMatchesFloat64) {
  // The batched form: A (2, 3, 5, 4) read as a permuted view of a (2, 5, 3, 4) buffer
  // (attention's q, format acbd) or row-major, B (2, 3, 4, 6) as a view of (2, 6, 3, 4)
  // (k transposed, adbc) or row-major; f32 within 1e-5 of float64 loops. A view in an
  // order oneDNN has no tag for is refused (the caller makes the shape's own primitive).
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int64_t Bt = 2, H = 3, S = 5, D = 4, T = 6;
  std::vector<float> a(static_cast<size_t>(Bt * H * S * D)), b(static_cast<size_t>(Bt * H * D * T));
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  for (int pa = 0; pa < 2; ++pa)
    for (int pb = 0; pb < 2; ++pb) {
      // Element strides of the (b, h, s, d) and (b, h, d, t) views.
      const std::vector<int64_t> as = pa ? std::vector<int64_t>{S * H * D, D, H * D, 1} : ir::strides_of({Bt, H, S, D});
      const std::vector<int64_t> bs = pb ? std::vector<int64_t>{T * H * D, D, 1, H * D} : ir::strides_of({Bt, H, D, T});
      std::vector<float> got(static_cast<size_t>(Bt * H * S * T), std::nanf(""));
      Status st = kernels::onednn::matmul_any_shape({a.data(), {Bt, H, S, D}, as}, {b.data(), {Bt, H, D, T}, bs},
                                                    got.data(), {Bt, H, S, T}, ir::DType::f32, ir::DType::f32);
      ASSERT_TRUE(st.is_ok()) << st.message();
      for (int64_t i = 0; i < Bt; ++i)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t s = 0; s < S; ++s)
            for (int64_t t = 0; t < T; ++t) {
              double ref = 0;
              for (int64_t d = 0; d < D; ++d)
                ref += static_cast<double>(a[static_cast<size_t>(i * as[0] + h * as[1] + s * as[2] + d * as[3])]) *
                       b[static_cast<size_t>(i * bs[0] + h * bs[1] + d * bs[2] + t * bs[3])];
              ASSERT_NEAR(got[static_cast<size_t>(((i * H + h) * S + s) * T + t)], ref,
                          1e-5 * std::max(1.0, std::fabs(ref)))
                  << "views " << pa << pb << " at " << i << "," << h << "," << s << "," << t;
            }
    }
  // (b, h, s, d) over a (s, b, h, d) buffer: an order without a oneDNN tag here.
  std::vector<float> got(static_cast<size_t>(Bt * H * S * T));
  Status st = kernels::onednn::matmul_any_shape({a.data(), {Bt, H, S, D}, {H * D, D, Bt * H * D, 1}},
                                                {b.data(), {Bt, H, D, T}, {}}, got.data(), {Bt, H, S, T},
                                                ir::DType::f32, ir::DType::f32);
  EXPECT_FALSE(st.is_ok());
}

}  // namespace
}  // namespace kiln::runtime
