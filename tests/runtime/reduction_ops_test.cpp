// Tests of the reduction op-table entries and eager kernels (ReduceSum, ReduceMean,
// ReduceMax, ArgMax): one-node graphs run by the eager interpreter against a float64
// reference computed here by brute force over all index pairs (f32 1e-5, f64 1e-12,
// bf16 1e-2 relative); axes as attribute (opset <= 17) and as input (opset 18),
// keepdims, noop_with_empty_axes; gradient rules through the f64 central-difference
// checker (tools/driver/gradcheck.h).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ir/op_table.h"
#include "tests/runtime/op_test_util.h"

using namespace kiln;
using namespace kiln::ir;
using namespace kiln::testing;

namespace {

/// Runs `op` on x (a graph input) and, if defined, `axes_input` (an initializer input 1).
Expected<Tensor> run1(const std::string& op, const Tensor& x, const Tensor& axes_input, Attributes a) {
  std::vector<Tensor> ins = {x};
  if (axes_input.defined()) ins.push_back(axes_input);
  auto r = try_run_op(op, ins, std::move(a), 1, {}, Feed::first);
  if (!r) return r.status();
  return (*r)[0];
}

enum class K { sum, mean, max };

/// Brute-force reference: output dims and values.
std::vector<double> ref_reduce(const Tensor& x, std::vector<int> axes, bool keep, K k, std::vector<int64_t>& od) {
  int r = x.rank();
  if (axes.empty())
    for (int i = 0; i < r; ++i) axes.push_back(i);
  auto reduced = [&](int d) { return std::find(axes.begin(), axes.end(), d) != axes.end(); };
  std::vector<int64_t> kd;  // keepdims shape
  for (int d = 0; d < r; ++d) kd.push_back(reduced(d) ? 1 : x.dim(d));
  od.clear();
  for (int d = 0; d < r; ++d)
    if (!reduced(d))
      od.push_back(x.dim(d));
    else if (keep)
      od.push_back(1);
  int64_t no = numel_of(kd);
  std::vector<double> acc(no, k == K::max ? -INFINITY : 0.0);
  std::vector<int64_t> cnt(no, 0);
  std::vector<int64_t> st = strides_of(x.dims()), ks = strides_of(kd);
  for (int64_t i = 0; i < x.numel(); ++i) {
    int64_t o = 0;
    for (int d = 0; d < r; ++d) {
      int64_t c = (i / st[d]) % x.dim(d);
      if (!reduced(d)) o += c * ks[d];
    }
    double v = x.get_f64(i);
    acc[o] = k == K::max ? std::max(acc[o], v) : acc[o] + v;
    cnt[o]++;
  }
  if (k == K::mean)
    for (int64_t o = 0; o < no; ++o) acc[o] /= static_cast<double>(cnt[o]);
  return acc;
}

}  // namespace

TEST(ReductionOps, AxesKeepdimsDtypes) {
  std::vector<std::vector<int64_t>> axes_cases = {{}, {0}, {-1}, {1, 2}, {0, 2}, {2, 0, 1}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (auto& axes : axes_cases)
      for (int keep = 0; keep < 2; ++keep)
        for (auto [op, k] :
             {std::pair{"ReduceSum", K::sum}, std::pair{"ReduceMean", K::mean}, std::pair{"ReduceMax", K::max}}) {
          Tensor x = rnd(dt, {3, 4, 5}, -2, 2, 7 + keep);
          std::vector<int> ax;
          for (int64_t a : axes) ax.push_back(static_cast<int>(a < 0 ? a + 3 : a));
          std::vector<int64_t> od;
          auto ref = ref_reduce(x, ax, keep, k, od);
          Attributes attrs;
          attrs.set("keepdims", int64_t(keep));
          std::string what = std::string(op) + " " + dtype_name(dt) + " axes " + dims_to_string(axes) + " keep " +
                             std::to_string(keep);
          double at = dt == DType::bf16 ? 5e-2 : dt == DType::f32 ? 1e-5 : 1e-12;
          double rt = dt == DType::bf16 ? 1e-2 : at;
          // opset 18 style: axes input (ReduceSum-13 too)
          auto y = run1(op, x, axes.empty() ? Tensor() : Tensor::from_i64(axes), attrs);
          ASSERT_TRUE(y.has_value()) << what << ": " << y.message();
          EXPECT_EQ(y->dims(), od) << what;
          expect_close(*y, ref, at, rt, what);
          // opset <= 17 style: axes attribute
          if (!axes.empty()) {
            Attributes a2 = attrs;
            a2.set("axes", axes);
            auto y2 = run1(op, x, Tensor(), a2);
            ASSERT_TRUE(y2.has_value()) << what << ": " << y2.message();
            expect_close(*y2, ref, at, rt, what + " (attribute)");
          }
        }
}

TEST(ReductionOps, NoopIntegerAndErrors) {
  Tensor x = rnd(DType::f32, {2, 3}, -2, 2, 1);
  Attributes noop;
  noop.set("noop_with_empty_axes", int64_t(1));
  auto y = run1("ReduceSum", x, Tensor(), noop);
  ASSERT_TRUE(y.has_value()) << y.message();
  EXPECT_EQ(y->dims(), x.dims());
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(y->get_f64(i), x.get_f64(i));
  Tensor xi = rnd(DType::i64, {2, 3}, -5, 5, 2);
  auto yi = run1("ReduceSum", xi, Tensor::from_i64({1}), {});
  ASSERT_TRUE(yi.has_value()) << yi.message();
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(yi->get_i64(r), xi.get_i64(r * 3) + xi.get_i64(r * 3 + 1) + xi.get_i64(r * 3 + 2));
  EXPECT_FALSE(run1("ReduceSum", x, Tensor::from_i64({2}), {}).has_value());       // out of range
  EXPECT_FALSE(run1("ReduceMean", x, Tensor::from_i64({1, -1}), {}).has_value());  // repeated
  Attributes both;
  both.set("axes", std::vector<int64_t>{0});
  EXPECT_FALSE(run1("ReduceMax", x, Tensor::from_i64({0}), both).has_value());  // axes twice
}

TEST(ReductionOps, ArgMax) {
  // Ties: first index by default, last with select_last_index.
  Tensor x(DType::f32, {2, 4});
  std::vector<double> v = {1, 3, 3, 0, -1, -1, -2, -1};
  for (int i = 0; i < 8; ++i) x.set_f64(i, v[i]);
  Attributes a;
  a.set("axis", int64_t(1));
  auto y = run1("ArgMax", x, Tensor(), a);
  ASSERT_TRUE(y.has_value()) << y.message();
  EXPECT_EQ(y->dtype(), DType::i64);
  EXPECT_EQ(y->dims(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(y->get_i64(0), 1);
  EXPECT_EQ(y->get_i64(1), 0);
  a.set("select_last_index", int64_t(1));
  a.set("keepdims", int64_t(0));
  y = run1("ArgMax", x, Tensor(), a);
  ASSERT_TRUE(y.has_value()) << y.message();
  EXPECT_EQ(y->dims(), (std::vector<int64_t>{2}));
  EXPECT_EQ(y->get_i64(0), 2);
  EXPECT_EQ(y->get_i64(1), 3);
  // axis 0 of a 3-D tensor against brute force
  Tensor z = rnd(DType::f64, {3, 2, 5}, -1, 1, 9);
  Attributes a0;
  a0.set("axis", int64_t(0));
  auto yz = run1("ArgMax", z, Tensor(), a0);
  ASSERT_TRUE(yz.has_value()) << yz.message();
  for (int64_t i = 0; i < 10; ++i) {
    int64_t best = 0;
    for (int64_t k = 1; k < 3; ++k)
      if (z.get_f64(k * 10 + i) > z.get_f64(best * 10 + i)) best = k;
    EXPECT_EQ(yz->get_i64(i), best);
  }
}

namespace {
/// f64 gradient check of `op` w.r.t. input 0 (seed 3000 + op name length), see check_op_grad.
void check_grad_r(const std::string& op, const std::vector<Tensor>& ins, Attributes attrs = {}) {
  check_op_grad(op, ins, attrs, {.seed_base = 3000, .wrt = {0}});
}
}  // namespace

TEST(ReductionGrad, SumMeanMax) {
  Tensor x = rnd(DType::f64, {2, 3, 4}, -2, 2, 11);
  for (const char* op : {"ReduceSum", "ReduceMean", "ReduceMax"})
    for (int keep = 0; keep < 2; ++keep) {
      Attributes a;
      a.set("keepdims", int64_t(keep));
      check_grad_r(op, {x, Tensor::from_i64({0, 2})}, a);
      check_grad_r(op, {x}, a);  // all axes
      Attributes b = a;
      b.set("axes", std::vector<int64_t>{-1});
      check_grad_r(op, {x}, b);
    }
  Attributes noop;
  noop.set("noop_with_empty_axes", int64_t(1));
  check_grad_r("ReduceSum", {x}, noop);
}
