// Shared scaffolding for the per-op runtime tests (tests/runtime/*_ops_test.cpp):
// tensors from literal or seeded-random values, running one op as a one-node graph
// (inferred, verified, run by the eager interpreter, with the eager output dims and
// dtype checked against graph-level inference), comparison with a float64 reference
// under stated absolute/relative tolerances, and the f64 central-difference gradient
// check (tools/driver/gradcheck.h). References and tolerances stay in each test file.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/op_table.h"
#include "ir/status.h"
#include "ir/tensor.h"
#include "ir/verifier.h"
#include "runtime/interpreter.h"
#include "tools/driver/gradcheck.h"

namespace kiln::testing {

/// Tensor of dtype `dt` and `dims` holding `v` in row-major order (each value
/// converted through Tensor::set_f64, so rounded to `dt`); `v` must have numel entries.
inline ir::Tensor make(ir::DType dt, std::vector<int64_t> dims, const std::vector<double>& v) {
  ir::Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, v[static_cast<size_t>(i)]);
  return t;
}

/// Seeded random tensor: one draw per element (row-major) from a uniform [lo, hi)
/// distribution over std::mt19937_64(seed), rounded to `dt`; non-float dtypes get
/// floor(draw). Same seed, dtype and dims give the same tensor on every platform.
inline ir::Tensor rnd(ir::DType dt, std::vector<int64_t> dims, double lo, double hi, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  ir::Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, ir::is_float(dt) ? u(g) : std::floor(u(g)));
  return t;
}

/// Elements of `t` as doubles (row-major).
inline std::vector<double> values(const ir::Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.get_f64(i);
  return v;
}

/// Which inputs of a one-node test graph are graph inputs fed at run time; the
/// others become initializers (constants visible to shape inference).
enum class Feed {
  floats,  ///< float-dtype inputs are fed, others (shapes, indices, labels) are initializers
  all,     ///< every input is fed
  first,   ///< input 0 is fed, the rest are initializers
  none,    ///< every input is an initializer
};

namespace detail {

/// A graph holding the single node `op` with inputs "x<i>" and outputs "y<k>".
struct OneNodeGraph {
  ir::Graph graph;
  ir::Node* node = nullptr;
  std::map<std::string, ir::Tensor> feeds;  ///< graph input name -> tensor
};

/// Builds the one-node graph; undefined tensors in `ins` are omitted optional inputs.
inline std::unique_ptr<OneNodeGraph> build_one_node(const std::string& op, const std::vector<ir::Tensor>& ins,
                                                    ir::Attributes attrs, int n_out, Feed feed) {
  auto one = std::make_unique<OneNodeGraph>();
  std::vector<ir::Value*> vs;
  for (size_t i = 0; i < ins.size(); ++i) {
    std::string name = "x" + std::to_string(i);
    bool fed = feed == Feed::all || (feed == Feed::first && i == 0) ||
               (feed == Feed::floats && ins[i].defined() && ir::is_float(ins[i].dtype()));
    if (!ins[i].defined()) {
      vs.push_back(nullptr);
    } else if (fed) {
      vs.push_back(one->graph.add_input(name, ins[i].dtype(), ir::Shape::of(ins[i].dims())));
      one->feeds[name] = ins[i];
    } else {
      vs.push_back(one->graph.add_initializer(name, ins[i]));
    }
  }
  std::vector<std::string> outs;
  for (int k = 0; k < n_out; ++k) outs.push_back("y" + std::to_string(k));
  one->node = one->graph.add_node(op, op + "_0", vs, outs, std::move(attrs));
  one->graph.outputs = one->node->outputs;
  return one;
}

}  // namespace detail

/// Runs `op` as a one-node graph: builds it (see Feed; undefined inputs are omitted
/// optional inputs), runs infer_graph and verify_graph, executes it with the eager
/// interpreter and checks that each of the `n_out` outputs has the dims and dtype
/// graph-level inference gave. Errors: the first failing step's message.
inline Expected<std::vector<ir::Tensor>> try_run_op(const std::string& op, const std::vector<ir::Tensor>& ins,
                                                    ir::Attributes attrs = {}, int n_out = 1,
                                                    const runtime::RunOptions& opts = {}, Feed feed = Feed::floats) {
  auto one = detail::build_one_node(op, ins, std::move(attrs), n_out, feed);
  KILN_RETURN_IF_ERROR(ir::infer_graph(one->graph));
  KILN_RETURN_IF_ERROR(ir::verify_graph(one->graph));
  auto r = runtime::run_graph(one->graph, one->feeds, opts);
  if (!r) return r.status();
  std::vector<ir::Tensor> res;
  for (int k = 0; k < n_out; ++k) {
    ir::Tensor t = r->at("y" + std::to_string(k));
    const ir::Value* v = one->node->outputs[static_cast<size_t>(k)];
    if (ir::Shape::of(t.dims()) != v->shape)
      return Status::error(op + " output " + std::to_string(k) + ": eager dims " + ir::dims_to_string(t.dims()) +
                           " differ from inferred shape " + v->shape.to_string());
    if (t.dtype() != v->dtype)
      return Status::error(op + " output " + std::to_string(k) + ": eager dtype " + ir::dtype_name(t.dtype()) +
                           " differs from inferred dtype " + ir::dtype_name(v->dtype));
    res.push_back(t);
  }
  return res;
}

/// try_run_op that records a gtest failure on error and then returns `n_out`
/// undefined tensors (which expect_close / expect_eq report as failures).
inline std::vector<ir::Tensor> run_op(const std::string& op, const std::vector<ir::Tensor>& ins,
                                      ir::Attributes attrs = {}, int n_out = 1, const runtime::RunOptions& opts = {},
                                      Feed feed = Feed::floats) {
  auto r = try_run_op(op, ins, std::move(attrs), n_out, opts, feed);
  EXPECT_TRUE(r.has_value()) << op << ": " << (r ? "" : r.message());
  if (!r) return std::vector<ir::Tensor>(static_cast<size_t>(n_out));
  return *r;
}

/// Error message of inferring and running `op` with every input an initializer
/// (no verify_graph step); "" when it succeeds. Must fail cleanly, without crashing.
inline std::string run_error(const std::string& op, const std::vector<ir::Tensor>& ins, ir::Attributes attrs = {},
                             int n_out = 1) {
  auto one = detail::build_one_node(op, ins, std::move(attrs), n_out, Feed::none);
  Status st = ir::infer_graph(one->graph);
  if (!st.is_ok()) return st.message();
  auto r = runtime::run_graph(one->graph, {});
  return r ? "" : r.message();
}

/// Expects `t` to match the float64 reference `ref` element-wise:
/// |t[i] - ref[i]| <= atol + rtol * |ref[i]|, and NaN exactly where ref is NaN.
/// One failure names the count of bad elements and the first one.
inline void expect_close(const ir::Tensor& t, const std::vector<double>& ref, double atol, double rtol,
                         const std::string& what) {
  if (!t.defined()) {
    ADD_FAILURE() << what << ": no output tensor";
    return;
  }
  ASSERT_EQ(t.numel(), static_cast<int64_t>(ref.size())) << what;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    double a = t.get_f64(i), b = ref[static_cast<size_t>(i)];
    bool ok = std::isnan(b) ? std::isnan(a) : std::abs(a - b) <= atol + rtol * std::abs(b);
    if (!ok && bad++ == 0) first = i;
  }
  if (bad > 0)
    ADD_FAILURE() << what << ": " << bad << " of " << t.numel() << " elements outside atol " << atol << " rtol " << rtol
                  << "; first [" << first << "] got " << t.get_f64(first) << " want "
                  << ref[static_cast<size_t>(first)];
}

/// Expects `t` to equal `ref` exactly, element by element (for data movement and integers).
inline void expect_eq(const ir::Tensor& t, const std::vector<double>& ref, const std::string& what) {
  if (!t.defined()) {
    ADD_FAILURE() << what << ": no output tensor";
    return;
  }
  ASSERT_EQ(t.numel(), static_cast<int64_t>(ref.size())) << what;
  for (int64_t i = 0; i < t.numel(); ++i)
    EXPECT_EQ(t.get_f64(i), ref[static_cast<size_t>(i)]) << what << " [" << i << "]";
}

/// Settings of check_op_grad; the seed is seed_base + op name length.
struct GradCheckOptions {
  uint64_t seed_base = 0;
  int n_out = 1;            ///< outputs entering the random linear loss
  std::vector<int> wrt;     ///< inputs differentiated (all float inputs when empty)
  bool training = false;    ///< Dropout/BatchNorm training behaviour
  double tolerance = 1e-6;  ///< bound on GradcheckResult::max_rel_error
  double eps = 1e-6;        ///< central-difference step
};

/// Checks the gradient rule of `op` in float64 by central differences
/// (driver::gradcheck_op) and expects max_rel_error < tolerance over > 0 elements.
inline void check_op_grad(const std::string& op, const std::vector<ir::Tensor>& ins, const ir::Attributes& attrs,
                          const GradCheckOptions& o) {
  uint64_t seed = o.seed_base + op.size();
  auto r = driver::gradcheck_op(op, ins, attrs, o.n_out, seed, o.wrt, o.eps, o.training);
  ASSERT_TRUE(r.has_value()) << op << ": " << r.message();
  EXPECT_LT(r->max_rel_error, o.tolerance) << op << " worst " << r->worst << " seed " << r->seed;
  EXPECT_GT(r->elements_checked, 0) << op;
}

}  // namespace kiln::testing
