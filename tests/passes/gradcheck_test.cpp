// Every differentiable op of the op table passes a float64 central-difference
// gradient check on random inputs, relative error (L2 norm per input) < 1e-6
// (DESIGN.md convention 9). A differentiable op without a case here fails the suite.
#include "tools/driver/gradcheck.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "ir/op_table.h"
#include "passes/training_util.h"
#include "runtime/interpreter.h"

using namespace kiln;
using namespace kiln::ir;
using passes::make_attrs;

namespace {

constexpr uint64_t kSeed = 20261129;

Tensor rand_t(std::vector<int64_t> dims, double lo, double hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> U(lo, hi);
  Tensor t(DType::f64, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, U(rng));
  return t;
}
Tensor R(std::vector<int64_t> d, uint64_t s = 1) { return rand_t(std::move(d), -1, 1, kSeed + s); }
Tensor P(std::vector<int64_t> d, uint64_t s = 1) { return rand_t(std::move(d), 0.5, 2.0, kSeed + s); }
Tensor I(std::vector<int64_t> v) { return Tensor::from_i64(v); }

struct Case {
  std::string name;  // distinguishes several cases of one op
  std::string op;
  std::vector<Tensor> inputs;
  Attributes attrs;
  int num_outputs = 1;
  std::vector<int> wrt;
  bool training = false;
  double tol = 1e-6;
};

/// Readable test parameter in gtest/ctest output.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> cases() {
  std::vector<Case> c;
  auto un = [&](const std::string& op, Tensor x, Attributes a = {}) { c.push_back({op, op, {x}, a}); };
  auto bin = [&](const std::string& op, Tensor a, Tensor b) { c.push_back({op, op, {a, b}, {}}); };
  bin("Add", R({2, 3, 4}), R({3, 1}, 2));
  bin("Sub", R({2, 3}), R({3}, 2));
  bin("Mul", R({2, 3, 4}), R({1, 4}, 2));
  bin("Div", R({2, 3}), P({2, 1}, 2));
  bin("Pow", P({2, 3}), R({3}, 2));
  un("Neg", R({3, 4}));
  un("Abs", R({3, 4}));
  un("Sqrt", P({3, 4}));
  un("Reciprocal", P({3, 4}));
  un("Exp", R({3, 4}));
  un("Log", P({3, 4}));
  un("Tanh", R({3, 4}));
  un("Sigmoid", R({3, 4}));
  un("Relu", R({3, 4}));
  un("LeakyRelu", R({3, 4}), make_attrs({{"alpha", 0.1}}));
  un("Erf", R({3, 4}));
  un("Gelu", R({3, 4}));
  c.push_back({"Gelu_tanh", "Gelu", {R({3, 4})}, make_attrs({{"approximate", std::string("tanh")}})});
  un("Softplus", R({3, 4}));
  un("Sin", R({3, 4}));
  un("Cos", R({3, 4}));
  c.push_back({"Clip",
               "Clip",
               {R({3, 4}), Tensor::scalar_f32(-0.5).cast(DType::f64), Tensor::scalar_f32(0.5).cast(DType::f64)},
               {},
               1,
               {0}});
  bin("Max", R({3, 4}), R({4}, 2));
  bin("Min", R({3, 4}), R({4}, 2));
  {
    Tensor cond(DType::boolean, {3, 4});
    for (int64_t i = 0; i < cond.numel(); ++i) cond.set_f64(i, i % 3 == 0);
    c.push_back({"Where", "Where", {cond, R({3, 4}), R({4}, 2)}, {}, 1, {1, 2}});
  }
  c.push_back({"Cast", "Cast", {R({3, 4})}, make_attrs({{"to", int64_t(11)}})});
  c.push_back({"CastLike", "CastLike", {R({3, 4}), R({1}, 2)}, {}, 1, {0}});
  un("Identity", R({3, 4}));
  c.push_back({"Dropout", "Dropout", {R({4, 5}), Tensor::scalar_f32(0.3).cast(DType::f64)}, {}, 2, {0}, true});
  c.push_back({"Reshape", "Reshape", {R({2, 6}), I({3, -1})}, {}, 1, {0}});
  c.push_back({"Transpose", "Transpose", {R({2, 3, 4})}, make_attrs({{"perm", std::vector<int64_t>{2, 0, 1}}})});
  c.push_back({"Flatten", "Flatten", {R({2, 3, 4})}, make_attrs({{"axis", int64_t(2)}})});
  c.push_back({"Squeeze", "Squeeze", {R({2, 1, 4}), I({1})}, {}, 1, {0}});
  c.push_back({"Unsqueeze", "Unsqueeze", {R({2, 4}), I({0, 2})}, {}, 1, {0}});
  c.push_back({"Concat", "Concat", {R({2, 3}), R({2, 2}, 2)}, make_attrs({{"axis", int64_t(1)}})});
  c.push_back({"Split", "Split", {R({2, 5}), I({2, 3})}, make_attrs({{"axis", int64_t(1)}}), 2, {0}});
  c.push_back({"Slice", "Slice", {R({4, 6}), I({1, 0}), I({3, 6}), I({0, 1}), I({1, 2})}, {}, 1, {0}});
  c.push_back({"Gather", "Gather", {R({5, 3}), I({0, 2, 2, 4})}, make_attrs({{"axis", int64_t(0)}}), 1, {0}});
  c.push_back({"Expand", "Expand", {R({3, 1}), I({2, 3, 4})}, {}, 1, {0}});
  c.push_back({"Pad", "Pad", {R({2, 3}), I({0, 1, 1, 2})}, {}, 1, {0}});
  c.push_back({"Trilu", "Trilu", {R({4, 4})}, make_attrs({{"upper", int64_t(0)}})});
  bin("MatMul", R({2, 3, 4}), R({4, 5}, 2));
  c.push_back({"MatMul_1d", "MatMul", {R({4}), R({2, 4, 3}, 2)}, {}});
  c.push_back({"Gemm",
               "Gemm",
               {R({3, 4}), R({5, 4}, 2), R({5}, 3)},
               make_attrs({{"transB", int64_t(1)}, {"alpha", 0.7}, {"beta", 1.3}})});
  c.push_back({"Conv",
               "Conv",
               {R({2, 4, 5, 5}), R({6, 2, 3, 3}, 2), R({6}, 3)},
               make_attrs({{"group", int64_t(2)},
                           {"strides", std::vector<int64_t>{2, 1}},
                           {"pads", std::vector<int64_t>{1, 0, 1, 1}},
                           {"dilations", std::vector<int64_t>{1, 2}}})});
  c.push_back({"MaxPool",
               "MaxPool",
               {R({2, 2, 5, 5})},
               make_attrs({{"kernel_shape", std::vector<int64_t>{2, 2}}, {"strides", std::vector<int64_t>{2, 2}}})});
  c.push_back({"AveragePool",
               "AveragePool",
               {R({2, 2, 5, 5})},
               make_attrs({{"kernel_shape", std::vector<int64_t>{3, 3}},
                           {"pads", std::vector<int64_t>{1, 1, 1, 1}},
                           {"strides", std::vector<int64_t>{2, 2}}})});
  un("GlobalAveragePool", R({2, 3, 4, 4}));
  c.push_back({"BatchNormalization",
               "BatchNormalization",
               {R({4, 3, 2, 2}), P({3}, 2), R({3}, 3), R({3}, 4), P({3}, 5)},
               make_attrs({{"training_mode", int64_t(1)}}),
               1,
               {0, 1, 2}});  // running stats: not differentiable
  c.push_back({"LayerNormalization",
               "LayerNormalization",
               {R({2, 3, 8}), P({8}, 2), R({8}, 3)},
               make_attrs({{"axis", int64_t(-1)}}),
               1});
  c.push_back({"Softmax", "Softmax", {R({3, 5})}, make_attrs({{"axis", int64_t(-1)}})});
  c.push_back({"LogSoftmax", "LogSoftmax", {R({3, 5})}, make_attrs({{"axis", int64_t(1)}})});
  c.push_back({"ReduceSum", "ReduceSum", {R({2, 3, 4}), I({1})}, make_attrs({{"keepdims", int64_t(0)}}), 1, {0}});
  c.push_back({"ReduceMean",
               "ReduceMean",
               {R({2, 3, 4})},
               make_attrs({{"axes", std::vector<int64_t>{0, 2}}, {"keepdims", int64_t(1)}})});
  c.push_back({"ReduceMax", "ReduceMax", {R({2, 3, 4})}, make_attrs({{"axes", std::vector<int64_t>{2}}})});
  c.push_back({"SoftmaxCrossEntropyLoss",
               "SoftmaxCrossEntropyLoss",
               {R({4, 5}), I({1, -100, 4, 0})},
               make_attrs({{"ignore_index", int64_t(-100)}, {"reduction", std::string("mean")}}),
               1,
               {0}});
  c.push_back({"SoftmaxCrossEntropyLoss_3d",
               "SoftmaxCrossEntropyLoss",
               {R({2, 5, 3}), I({1, 2, 0, 4, 3, 3}).reshaped({2, 3})},
               make_attrs({{"reduction", std::string("sum")}}),
               1,
               {0}});
  c.push_back({"NegativeLogLikelihoodLoss",
               "NegativeLogLikelihoodLoss",
               {R({4, 5}), I({1, 3, 4, 0})},
               make_attrs({{"reduction", std::string("mean")}}),
               1,
               {0}});
  // Indexing ops (ir/ops/indexing.cpp): repeated indices check the scatter-add adjoints.
  c.push_back({"CumSum", "CumSum", {R({3, 4}), I({1})}, {}, 1, {0}});
  c.push_back({"CumSum_exclusive_reverse",
               "CumSum",
               {R({3, 4}), I({-2})},
               make_attrs({{"exclusive", int64_t(1)}, {"reverse", int64_t(1)}}),
               1,
               {0}});
  c.push_back({"GatherElements",
               "GatherElements",
               {R({3, 4}), I({0, 2, 1, 2, 1, 1, 0, -1}).reshaped({2, 4})},
               make_attrs({{"axis", int64_t(0)}}),
               1,
               {0}});
  c.push_back({"GatherND", "GatherND", {R({3, 4, 2}), I({0, 1, 2, 3, 0, 1}).reshaped({3, 2})}, {}, 1, {0}});
  c.push_back({"GatherND_batch_dims",
               "GatherND",
               {R({2, 3, 4}), I({1, 0, 2, 1}).reshaped({2, 2, 1})},
               make_attrs({{"batch_dims", int64_t(1)}}),
               1,
               {0}});
  c.push_back({"ScatterElements",
               "ScatterElements",
               {R({3, 4}), I({0, 2, 1, 2, 1, 0, 2, 0}).reshaped({2, 4}), R({2, 4}, 2)},
               make_attrs({{"axis", int64_t(0)}}),
               1,
               {0, 2}});
  c.push_back({"ScatterElements_add",
               "ScatterElements",
               {R({3, 4}), I({0, 2, 1, 2, 0, 2, 1, 2}).reshaped({2, 4}), R({2, 4}, 2)},
               make_attrs({{"axis", int64_t(0)}, {"reduction", std::string("add")}}),
               1,
               {0, 2}});
  c.push_back({"ScatterND", "ScatterND", {R({4, 3}), I({1, 3}).reshaped({2, 1}), R({2, 3}, 2)}, {}, 1, {0, 2}});
  c.push_back({"ScatterND_add",
               "ScatterND",
               {R({4, 3}), I({1, 1}).reshaped({2, 1}), R({2, 3}, 2)},
               make_attrs({{"reduction", std::string("add")}}),
               1,
               {0, 2}});
  // fmod / floor mod: d/da = 1, d/db = -trunc(a/b) or -floor(a/b) (random points lie far
  // from the jumps at integer a/b).
  c.push_back({"Mod_fmod", "Mod", {R({3, 4}), P({3, 4}, 2)}, make_attrs({{"fmod", int64_t(1)}}), 1, {0, 1}});
  c.push_back({"Mod_floor", "Mod", {R({3, 4}), P({4}, 2)}, {}, 1, {0, 1}});
  return c;
}

}  // namespace

class Gradcheck : public ::testing::TestWithParam<Case> {};

TEST_P(Gradcheck, CentralDifferencesFloat64) {
  const Case& k = GetParam();
  if (!OpTable::get().find(k.op)) FAIL() << "op " << k.op << " is not in the op table";
  auto r = driver::gradcheck_op(k.op, k.inputs, k.attrs, k.num_outputs, kSeed, k.wrt, 1e-6, k.training);
  ASSERT_TRUE(r) << r.message();
  EXPECT_GT(r->elements_checked, 0);
  EXPECT_LT(r->max_rel_error, k.tol) << k.name << ": worst input " << r->worst << ", seed " << r->seed;
}

INSTANTIATE_TEST_SUITE_P(Ops, Gradcheck, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(GradcheckCoverage, EveryDifferentiableOpHasACase) {
  runtime::register_eager_kernels();
  std::set<std::string> covered;
  for (auto& c : cases()) covered.insert(c.op);
  for (auto& [name, def] : OpTable::get().all())
    if (def.diff == Differentiability::differentiable)
      EXPECT_TRUE(covered.count(name)) << "differentiable op " << name << " has no gradient check case";
}
