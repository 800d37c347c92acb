// Tests of the loss op-table entries and eager kernels (SoftmaxCrossEntropyLoss,
// NegativeLogLikelihoodLoss) and their backward ops: one-node graphs run by the
// eager interpreter against a float64 reference written here (log-softmax by
// definition, ONNX/PyTorch weighting and ignore_index rules), for (N, C) and
// (N, C, d1, d2) scores, i64/i32 labels, every reduction, with and without weights;
// tolerances f64 1e-12, f32 1e-5, bf16 2e-2. Gradients through the f64
// central-difference checker (tools/driver/gradcheck.h).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ir/op_table.h"
#include "tests/runtime/op_test_util.h"

using namespace kiln;
using namespace kiln::ir;
using namespace kiln::testing;

namespace {

Tensor labels_of(DType dt, std::vector<int64_t> dims, int64_t C, int64_t ignore, uint64_t seed) {
  std::mt19937_64 g(seed);
  Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, (i % 4 == 3) ? ignore : static_cast<double>(g() % C));
  return t;
}

/// Runs `op` as a one-node graph with every input (labels too) fed at run time.
Expected<std::vector<Tensor>> run_loss(const std::string& op, const std::vector<Tensor>& ins, Attributes a, int n_out) {
  return try_run_op(op, ins, std::move(a), n_out, {}, Feed::all);
}

struct Ref {
  std::vector<double> loss;  // reduced (1 value) or per position
  std::vector<double> log_prob;
};

/// Reference of both losses: `nll` uses the scores directly as log-probabilities.
Ref ref_loss(const Tensor& s, const Tensor& lab, const Tensor* w, const std::string& red, bool has_ignore,
             int64_t ignore, bool nll) {
  int64_t N = s.dim(0), C = s.dim(1), D = s.numel() / (N * C);
  Ref r;
  r.log_prob.assign(s.numel(), 0);
  std::vector<double> per(N * D);
  double tot = 0, wsum = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) {
      double z = 0;
      for (int64_t c = 0; c < C; ++c) z += std::exp(s.get_f64((n * C + c) * D + d));
      for (int64_t c = 0; c < C; ++c)
        r.log_prob[(n * C + c) * D + d] =
            nll ? s.get_f64((n * C + c) * D + d) : s.get_f64((n * C + c) * D + d) - std::log(z);
      int64_t l = lab.get_i64(n * D + d);
      if (has_ignore && l == ignore) {
        per[n * D + d] = 0;
        continue;
      }
      double wt = w ? w->get_f64(l) : 1.0;
      per[n * D + d] = -r.log_prob[(n * C + l) * D + d] * wt;
      tot += per[n * D + d];
      wsum += wt;
    }
  if (red == "none")
    r.loss = per;
  else if (red == "sum")
    r.loss = {tot};
  else
    r.loss = {tot / wsum};
  return r;
}

}  // namespace

TEST(LossOps, SoftmaxCrossEntropyAndNll) {
  const int64_t C = 5, ignore = -100;
  for (DType dt : {DType::f64, DType::f32, DType::bf16})
    for (auto sdims : {std::vector<int64_t>{6, C}, std::vector<int64_t>{2, C, 3, 2}})
      for (DType ldt : {DType::i64, DType::i32})
        for (const char* red : {"none", "sum", "mean"})
          for (int weighted = 0; weighted < 2; ++weighted)
            for (int use_ignore = 0; use_ignore < 2; ++use_ignore) {
              Tensor s = rnd(dt, sdims, -3, 3, 5);
              std::vector<int64_t> ld = {sdims[0]};
              for (size_t i = 2; i < sdims.size(); ++i) ld.push_back(sdims[i]);
              Tensor lab = labels_of(ldt, ld, C, use_ignore ? ignore : 1, 6);
              Tensor w = rnd(dt, {C}, 0.2, 2, 7);
              Attributes a;
              a.set("reduction", std::string(red));
              if (use_ignore) a.set("ignore_index", ignore);
              std::vector<Tensor> ins = {s, lab};
              if (weighted) ins.push_back(w);
              std::string what = std::string(dtype_name(dt)) + " " + dims_to_string(sdims) + " " + red + " w" +
                                 std::to_string(weighted) + " ig" + std::to_string(use_ignore);
              double at = dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-5 : 2e-2;
              auto y = run_loss("SoftmaxCrossEntropyLoss", ins, a, 2);
              ASSERT_TRUE(y.has_value()) << what << ": " << y.message();
              Ref r = ref_loss(s, lab, weighted ? &w : nullptr, red, use_ignore, ignore, false);
              expect_close((*y)[0], r.loss, at, at, "SCE loss " + what);
              expect_close((*y)[1], r.log_prob, at, at, "SCE log_prob " + what);
              EXPECT_EQ((*y)[0].rank(), std::string(red) == "none" ? static_cast<int>(ld.size()) : 0);
              auto yn = run_loss("NegativeLogLikelihoodLoss", ins, a, 1);
              ASSERT_TRUE(yn.has_value()) << what << ": " << yn.message();
              Ref rn = ref_loss(s, lab, weighted ? &w : nullptr, red, use_ignore, ignore, true);
              expect_close((*yn)[0], rn.loss, at, at, "NLL " + what);
            }
}

TEST(LossOps, Errors) {
  Tensor s = rnd(DType::f32, {3, 4}, -1, 1, 1);
  Tensor bad = Tensor::from_i64({0, 4, 1});
  auto y = run_loss("SoftmaxCrossEntropyLoss", {s, bad}, {}, 1);
  ASSERT_FALSE(y.has_value());
  EXPECT_NE(y.message().find("label 4"), std::string::npos) << y.message();
  Attributes r;
  r.set("reduction", std::string("avg"));
  EXPECT_FALSE(run_loss("NegativeLogLikelihoodLoss", {s, Tensor::from_i64({0, 1, 2})}, r, 1).has_value());
  EXPECT_FALSE(run_loss("NegativeLogLikelihoodLoss", {s, Tensor::from_i64({0, 1})}, {}, 1).has_value());
}

namespace {
/// f64 gradient check of `op` w.r.t. the scores (seed 4000 + op name length), see check_op_grad.
void check_grad_l(const std::string& op, const std::vector<Tensor>& ins, Attributes a, int n_out) {
  check_op_grad(op, ins, a, {.seed_base = 4000, .n_out = n_out, .wrt = {0}});
}
}  // namespace

TEST(LossGrad, SoftmaxCrossEntropyAndNll) {
  const int64_t C = 4;
  for (auto sdims : {std::vector<int64_t>{5, C}, std::vector<int64_t>{2, C, 3}})
    for (const char* red : {"none", "sum", "mean"})
      for (int weighted = 0; weighted < 2; ++weighted) {
        Tensor s = rnd(DType::f64, sdims, -2, 2, 8);
        std::vector<int64_t> ld = {sdims[0]};
        for (size_t i = 2; i < sdims.size(); ++i) ld.push_back(sdims[i]);
        Tensor lab = labels_of(DType::i64, ld, C, -1, 9);
        Attributes a;
        a.set("reduction", std::string(red));
        a.set("ignore_index", int64_t(-1));
        std::vector<Tensor> ins = {s, lab};
        if (weighted) ins.push_back(rnd(DType::f64, {C}, 0.2, 2, 10));
        check_grad_l("SoftmaxCrossEntropyLoss", ins, a, 1);
        check_grad_l("SoftmaxCrossEntropyLoss", ins, a, 2);  // gradient through log_prob as well
        check_grad_l("NegativeLogLikelihoodLoss", ins, a, 1);
      }
}
