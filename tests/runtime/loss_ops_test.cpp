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
#include "ir/verifier.h"
#include "runtime/interpreter.h"
#include "tools/driver/gradcheck.h"

using namespace kiln;
using namespace kiln::ir;

namespace {

Tensor rnd_l(DType dt, std::vector<int64_t> dims, double lo, double hi, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, u(g));
  return t;
}

Tensor labels_of(DType dt, std::vector<int64_t> dims, int64_t C, int64_t ignore, uint64_t seed) {
  std::mt19937_64 g(seed);
  Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, (i % 4 == 3) ? ignore : static_cast<double>(g() % C));
  return t;
}

Expected<std::vector<Tensor>> run_loss(const std::string& op, const std::vector<Tensor>& ins, Attributes a, int n_out) {
  Graph g;
  std::map<std::string, Tensor> feeds;
  std::vector<Value*> vs;
  for (size_t i = 0; i < ins.size(); ++i) {
    std::string name = "x" + std::to_string(i);
    vs.push_back(g.add_input(name, ins[i].dtype(), Shape::of(ins[i].dims())));
    feeds[name] = ins[i];
  }
  std::vector<std::string> outs;
  for (int k = 0; k < n_out; ++k) outs.push_back("y" + std::to_string(k));
  Node* n = g.add_node(op, op + "_0", vs, outs, std::move(a));
  g.outputs = n->outputs;
  KILN_RETURN_IF_ERROR(infer_graph(g));
  KILN_RETURN_IF_ERROR(verify_graph(g));
  auto r = runtime::run_graph(g, feeds);
  if (!r) return r.status();
  std::vector<Tensor> res;
  for (int k = 0; k < n_out; ++k) {
    res.push_back(r->at("y" + std::to_string(k)));
    if (Shape::of(res.back().dims()) != n->outputs[k]->shape) return Status::error("eager dims differ from inference");
  }
  return res;
}

struct Ref {
  std::vector<double> loss;     // reduced (1 value) or per position
  std::vector<double> log_prob;
};

/// Reference of both losses: `nll` uses the scores directly as log-probabilities.
Ref ref_loss(const Tensor& s, const Tensor& lab, const Tensor* w, const std::string& red, bool has_ignore, int64_t ignore,
             bool nll) {
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
        r.log_prob[(n * C + c) * D + d] = nll ? s.get_f64((n * C + c) * D + d) : s.get_f64((n * C + c) * D + d) - std::log(z);
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
  if (red == "none") r.loss = per;
  else if (red == "sum") r.loss = {tot};
  else r.loss = {tot / wsum};
  return r;
}

void expect_close(const Tensor& t, const std::vector<double>& ref, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(ref.size())) << what;
  for (int64_t i = 0; i < t.numel(); ++i)
    ASSERT_LE(std::abs(t.get_f64(i) - ref[i]), atol + rtol * std::abs(ref[i])) << what << " [" << i << "]";
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
              Tensor s = rnd_l(dt, sdims, -3, 3, 5);
              std::vector<int64_t> ld = {sdims[0]};
              for (size_t i = 2; i < sdims.size(); ++i) ld.push_back(sdims[i]);
              Tensor lab = labels_of(ldt, ld, C, use_ignore ? ignore : 1, 6);
              Tensor w = rnd_l(dt, {C}, 0.2, 2, 7);
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
  Tensor s = rnd_l(DType::f32, {3, 4}, -1, 1, 1);
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
void check_grad_l(const std::string& op, const std::vector<Tensor>& ins, Attributes a, int n_out) {
  auto r = kiln::driver::gradcheck_op(op, ins, a, n_out, 4000 + op.size(), {0});
  ASSERT_TRUE(r.has_value()) << op << ": " << r.message();
  EXPECT_LT(r->max_rel_error, 1e-6) << op << " worst " << r->worst << " seed " << r->seed;
  EXPECT_GT(r->elements_checked, 0);
}
}  // namespace

TEST(LossGrad, SoftmaxCrossEntropyAndNll) {
  const int64_t C = 4;
  for (auto sdims : {std::vector<int64_t>{5, C}, std::vector<int64_t>{2, C, 3}})
    for (const char* red : {"none", "sum", "mean"})
      for (int weighted = 0; weighted < 2; ++weighted) {
        Tensor s = rnd_l(DType::f64, sdims, -2, 2, 8);
        std::vector<int64_t> ld = {sdims[0]};
        for (size_t i = 2; i < sdims.size(); ++i) ld.push_back(sdims[i]);
        Tensor lab = labels_of(DType::i64, ld, C, -1, 9);
        Attributes a;
        a.set("reduction", std::string(red));
        a.set("ignore_index", int64_t(-1));
        std::vector<Tensor> ins = {s, lab};
        if (weighted) ins.push_back(rnd_l(DType::f64, {C}, 0.2, 2, 10));
        check_grad_l("SoftmaxCrossEntropyLoss", ins, a, 1);
        check_grad_l("SoftmaxCrossEntropyLoss", ins, a, 2);  // gradient through log_prob as well
        check_grad_l("NegativeLogLikelihoodLoss", ins, a, 1);
      }
}
