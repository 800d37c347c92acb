#include "tools/driver/gradcheck.h"

#include <cmath>
#include <limits>
#include <map>
#include <random>

#include "ir/op_table.h"
#include "passes/passes.h"
#include "passes/training_util.h"
#include "runtime/interpreter.h"

namespace kiln::driver {

using namespace kiln::ir;

static double rel_error(const Tensor& a, const Tensor& n) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double d = a.get_f64(i) - n.get_f64(i);
    diff += d * d;
    ref += n.get_f64(i) * n.get_f64(i);
  }
  return std::sqrt(diff) / std::max(std::sqrt(ref), 1e-12);
}

Expected<GradcheckResult> gradcheck_op(const std::string& op, const std::vector<Tensor>& inputs,
                                       const Attributes& attrs, int num_outputs, uint64_t seed, std::vector<int> wrt,
                                       double eps, bool training) {
  runtime::register_eager_kernels();
  Graph g;
  std::vector<Value*> ins;
  std::map<std::string, Tensor> feeds;
  if (wrt.empty())
    for (size_t i = 0; i < inputs.size(); ++i)
      if (is_float(inputs[i].dtype())) wrt.push_back(static_cast<int>(i));
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor t = is_float(inputs[i].dtype()) ? inputs[i].cast(DType::f64) : inputs[i];
    std::string name = "x" + std::to_string(i);
    bool diff = std::find(wrt.begin(), wrt.end(), static_cast<int>(i)) != wrt.end();
    if (diff) {
      Value* v = g.add_input(name, t.dtype(), Shape::of(t.dims()));
      g.state.push_back({"parameter", v, nullptr, std::make_shared<Tensor>(t)});
      feeds[name] = t;
      ins.push_back(v);
    } else {
      ins.push_back(g.add_initializer(name, t));
    }
  }
  std::vector<std::string> outs;
  for (int k = 0; k < num_outputs; ++k) outs.push_back("y" + std::to_string(k));
  Node* n = g.add_node(op, op + "_0", ins, outs, attrs);
  KILN_RETURN_IF_ERROR(infer_node(*n));
  passes::Builder b(g, "check");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> U(-1, 1);
  Value* loss = nullptr;
  for (Value* o : n->outputs) {
    if (!is_float(o->dtype) || !o->shape.is_static()) continue;
    Tensor w(o->dtype, o->shape.to_vector());
    for (int64_t i = 0; i < w.numel(); ++i) w.set_f64(i, U(rng));
    Value* wv = g.add_initializer(o->name + ".w", w);
    Value* s = b.op("ReduceSum", {b.op("Mul", {o, wv})}, passes::make_attrs({{"keepdims", int64_t(0)}}));
    loss = loss ? b.op("Add", {loss, s}) : s;
  }
  if (!loss) return Status::error(op + ": no float output to check");
  loss = b.op("Identity", {loss}, {}, "loss");
  if (!b.status()) return b.status();
  g.outputs = {loss};
  Graph* fwd_only = &g;
  auto fwd = g.clone();
  (void)fwd_only;
  passes::PassContext ctx;
  auto ad = passes::make_autodiff_pass()->run(g, ctx);
  if (!ad) return ad.status();
  runtime::RunOptions ro;
  ro.training = training;
  ro.seed = seed;
  auto analytic = runtime::run_graph(g, feeds, ro);
  if (!analytic) return analytic.status();
  if (analytic->count("loss") && !std::isfinite((*analytic)["loss"].get_f64(0)))
    return Status::error("gradcheck: the loss of this batch is not finite (" +
                         std::to_string((*analytic)["loss"].get_f64(0)) +
                         "); central differences need a finite loss (are all its labels ignore_index?)");
  GradcheckResult res;
  res.seed = seed;
  for (auto& sb : g.state) {
    const std::string& pname = sb.input->name;
    Tensor a = (*analytic)[pname + ".grad"];
    Tensor num(DType::f64, a.dims());
    Tensor x = feeds[pname].clone();
    for (int64_t i = 0; i < x.numel(); ++i) {
      double x0 = x.get_f64(i);
      auto f = [&](double v) -> Expected<double> {
        x.set_f64(i, v);
        auto fe = feeds;
        fe[pname] = x;
        auto r = runtime::run_graph(*fwd, fe, ro);
        if (!r) return r.status();
        return (*r)["loss"].get_f64(0);
      };
      auto lp = f(x0 + eps);
      if (!lp) return lp.status();
      auto lm = f(x0 - eps);
      if (!lm) return lm.status();
      x.set_f64(i, x0);
      num.set_f64(i, (*lp - *lm) / (2 * eps));
      ++res.elements_checked;
    }
    double e = rel_error(a, num);
    if (e >= res.max_rel_error) {
      res.max_rel_error = e;
      res.worst = pname;
    }
  }
  return res;
}

Expected<GradcheckResult> gradcheck_graph(const Graph& gp, std::map<std::string, Tensor> feeds, int per_param,
                                          uint64_t seed, double eps) {
  runtime::RunOptions ro;
  ro.training = true;
  ro.seed = seed;
  auto analytic = runtime::run_graph(gp, feeds, ro);
  if (!analytic) return analytic.status();
  if (analytic->count("loss") && !std::isfinite((*analytic)["loss"].get_f64(0)))
    return Status::error("gradcheck: the loss of this batch is not finite (" +
                         std::to_string((*analytic)["loss"].get_f64(0)) +
                         "); central differences need a finite loss (are all its labels ignore_index?)");
  GradcheckResult res;
  res.seed = seed;
  std::mt19937_64 rng(seed);
  std::vector<std::pair<std::string, std::pair<std::vector<double>, std::vector<double>>>> per;
  double global = 0;
  for (auto& sb : gp.state) {
    if (sb.kind != "parameter") continue;
    const std::string& pname = sb.input->name;
    const Tensor& a = (*analytic)[pname + ".grad"];
    Tensor x = feeds[pname].clone();
    int64_t n = x.numel();
    int count = static_cast<int>(std::min<int64_t>(n, per_param));
    std::vector<double> an, nu;
    for (int k = 0; k < count; ++k) {
      int64_t i = count == n ? k : static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
      double x0 = x.get_f64(i);
      double l[2];
      for (int s = 0; s < 2; ++s) {
        x.set_f64(i, x0 + (s == 0 ? eps : -eps));
        auto fe = feeds;
        fe[pname] = x;
        auto r = runtime::run_graph(gp, fe, ro);
        if (!r) return r.status();
        l[s] = (*r)["loss"].get_f64(0);
      }
      x.set_f64(i, x0);
      an.push_back(a.get_f64(i));
      nu.push_back((l[0] - l[1]) / (2 * eps));
      global += nu.back() * nu.back();
      ++res.elements_checked;
    }
    per.push_back({pname, {an, nu}});
  }
  // Per parameter: ||analytic - numeric|| / max(||numeric||, 1e-3 * ||all numeric||), so
  // that gradients that are analytically zero (a conv bias before BatchNorm) or tiny
  // compare against the model's gradient scale, not against rounding noise.
  global = std::sqrt(global);
  for (auto& [pname, v] : per) {
    double diff = 0, ref = 0;
    for (size_t k = 0; k < v.first.size(); ++k) {
      diff += (v.first[k] - v.second[k]) * (v.first[k] - v.second[k]);
      ref += v.second[k] * v.second[k];
    }
    double e = std::sqrt(diff) / std::max({std::sqrt(ref), 1e-3 * global, 1e-300});
    if (!std::isfinite(e)) e = std::numeric_limits<double>::infinity();  // a NaN never passes
    if (e >= res.max_rel_error) {
      res.max_rel_error = e;
      res.worst = pname;
    }
  }
  return res;
}

}  // namespace kiln::driver
