// Tests of the fold_constants pass (passes/fold_constants.cpp) on imported models: the
// PyTorch-style shape subgraph folds away once dims are bound (values checked against
// hand-computed ones, and the folded graph computes the same function as the unfolded
// one and as an independent float64 reference); unbound dims, trainable parameters,
// random ops, oversized results and ops without kernels are left alone.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "frontend/onnx_import.h"
#include "frontend/tensor_proto.h"
#include "frontend_test_util.h"
#include "ir/op_table.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"

using kiln::ir::DType;
using kiln::ir::Graph;
using kiln::ir::Tensor;
using kiln::test::fixture;

namespace {

kiln::Expected<bool> fold(Graph& g) {
  kiln::runtime::register_eager_kernels();
  auto p = kiln::passes::make_pass("fold_constants");
  if (!p) return kiln::Status::error("fold_constants pass is not registered");
  kiln::passes::PassContext ctx;
  ctx.evaluator = kiln::runtime::evaluate_node;
  return p->run(g, ctx);
}

std::multiset<std::string> ops_of(const Graph& g) {
  std::multiset<std::string> s;
  for (auto& n : g.nodes()) s.insert(n->op);
  return s;
}

const kiln::ir::Value* find_init(const Graph& g, const std::string& name) {
  for (auto* v : g.initializers)
    if (v->name == name) return v;
  return nullptr;
}

/// good_shape_fold.onnx computes z = reshape(x, [batch, 8*seq]) * (batch * seq): `folded`
/// on a random x [batch, seq, 8] (seed `seed`) gives `unfolded`'s z exactly and the float64
/// reference within one f32 rounding of the product.
void expect_shape_fold_function(const Graph& folded, const Graph& unfolded, int64_t batch, int64_t seq, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-2, 2);
  Tensor x(DType::f32, {batch, seq, 8});
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = U(rng);
  auto r1 = kiln::runtime::run_graph(folded, {{"x", x}});
  ASSERT_TRUE(r1) << r1.message();
  auto r0 = kiln::runtime::run_graph(unfolded, {{"x", x}});
  ASSERT_TRUE(r0) << r0.message();
  const Tensor& z1 = r1->at("z");
  ASSERT_EQ(z1.dims(), (std::vector<int64_t>{batch, 8 * seq}));
  EXPECT_TRUE(kiln::test::tensors_equal(z1, r0->at("z")));
  const double k = static_cast<double>(batch * seq);
  for (int64_t i = 0; i < x.numel(); ++i)  // tolerance: one f32 rounding of the product
    EXPECT_NEAR(z1.get_f64(i), static_cast<double>(x.data<float>()[i]) * k, 1e-6 * 2 * k) << i;
}

}  // namespace

TEST(FoldConstants, PyTorchShapeSubgraphFoldsOnceDimsAreBound) {
  kiln::frontend::ImportOptions o;
  o.bind_dims = {{"batch", 2}, {"seq", 3}};
  auto g = kiln::frontend::import_onnx(fixture("good_shape_fold.onnx"), o);
  ASSERT_TRUE(g) << g.message();
  Graph& G = **g;
  auto unfolded = G.clone();
  ASSERT_EQ(G.nodes().size(), 9u);
  auto changed = fold(G);
  ASSERT_TRUE(changed) << changed.message();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(ops_of(G), (std::multiset<std::string>{"Reshape", "Mul"})) << kiln::ir::graph_to_string(G);
  // Concat(Unsqueeze(Gather(Shape(x), 0)), [-1]) = [batch, -1]; Cast(batch * seq) = 6.0
  const auto* shp = find_init(G, "shp");
  ASSERT_TRUE(shp);
  EXPECT_TRUE(kiln::test::tensors_equal(*shp->data, Tensor::from_i64({2, -1})));
  const auto* n = find_init(G, "n");
  ASSERT_TRUE(n);
  EXPECT_TRUE(kiln::test::tensors_equal(*n->data, Tensor::scalar_f32(6.0f)));
  // The constants that only fed folded nodes are gone.
  for (const char* dead : {"zero", "one", "axes0", "minus1", "s", "B", "T", "BT", "B1"})
    EXPECT_EQ(find_init(G, dead), nullptr) << dead;
  // Downstream shapes are static now.
  EXPECT_EQ(G.outputs[0]->shape.to_string(), "[2, 24]");
  EXPECT_TRUE(kiln::ir::verify_graph(G).is_ok()) << kiln::ir::verify_graph(G).message();

  // Same function as before folding, and as z = reshape(x, [2, 24]) * (2 * 3) in float64.
  expect_shape_fold_function(G, *unfolded, 2, 3, 7);
}

TEST(FoldConstants, UnboundDimsFoldToSymInts) {
  auto g = kiln::frontend::import_onnx(fixture("good_shape_fold.onnx"));
  ASSERT_TRUE(g) << g.message();
  auto unfolded = (*g)->clone();
  auto changed = fold(**g);
  ASSERT_TRUE(changed) << changed.message();
  Graph& G = **g;
  // Shape(x) is [batch, seq, 8]: the integer subgraph becomes SymInts nodes holding
  // expressions of the input's dims, and nothing reads x's shape any more.
  EXPECT_TRUE(*changed);
  EXPECT_EQ(G.inputs[0]->shape.to_string(), "[batch, seq, 8]");
  const std::multiset<std::string> ops = ops_of(G);
  EXPECT_EQ(ops.count("Shape"), 0u) << kiln::ir::graph_to_string(G);
  EXPECT_EQ(ops.count("Gather"), 0u) << kiln::ir::graph_to_string(G);
  EXPECT_GE(ops.count("SymInts"), 1u) << kiln::ir::graph_to_string(G);
  // Reshape(x, [batch, -1]) is [batch, 8*seq] symbolically.
  EXPECT_EQ(G.outputs[0]->shape.to_string(), "[batch, 8*seq]");
  EXPECT_TRUE(kiln::ir::verify_graph(G).is_ok()) << kiln::ir::verify_graph(G).message();
  // One folded graph serves every shape: equal to the unfolded graph and to the float64
  // reference, at two shapes.
  expect_shape_fold_function(G, *unfolded, 2, 3, 11);
  expect_shape_fold_function(G, *unfolded, 3, 5, 12);
}

TEST(FoldConstants, ImportedConstantsFoldThroughElementwiseKernels) {
  auto g = kiln::frontend::import_onnx(fixture("good_constants.onnx"));
  ASSERT_TRUE(g) << g.message();
  auto changed = fold(**g);
  ASSERT_TRUE(changed) << changed.message();
  EXPECT_TRUE(*changed);
  // z = c_ints + c_int = [8, 9, 10] folds; y = (x + c_tensor) + c_float stays (x is an input);
  // w = Identity(c_floats) stays: c_floats is a float initializer of 2 elements whose name does
  // not start with '/', i.e. a trainable parameter for attach_loss.
  const auto* z = find_init(**g, "z");
  ASSERT_TRUE(z);
  EXPECT_TRUE(kiln::test::tensors_equal(*z->data, Tensor::from_i64({8, 9, 10})));
  EXPECT_EQ((*g)->outputs[1], z);
  EXPECT_EQ(find_init(**g, "w"), nullptr);
  EXPECT_EQ(ops_of(**g), (std::multiset<std::string>{"Add", "Add", "Identity"}));
  // The folded constants' inputs are gone, the parameter-like c_floats is kept.
  EXPECT_EQ(find_init(**g, "c_ints"), nullptr);
  EXPECT_EQ(find_init(**g, "c_int"), nullptr);
  EXPECT_NE(find_init(**g, "c_floats"), nullptr);
}

TEST(FoldConstants, GuardsParametersRandomOpsLargeResultsAndMissingKernels) {
  kiln::runtime::register_eager_kernels();
  Graph g;
  auto* x = g.add_input("x", DType::f32, kiln::ir::Shape::of({3}));
  auto* a = g.add_initializer("/a", Tensor::from_i64({1, 2, 3}));
  auto* b = g.add_initializer("/b", Tensor::scalar_i64(2));
  auto* W = g.add_initializer("W", Tensor::from_f32({1, 2, 3, 4}, {2, 2}));     // a parameter
  auto* Wc = g.add_initializer("/Wc", Tensor::from_f32({1, 2, 3, 4}, {2, 2}));  // a constant
  auto* d = g.add_initializer("/d", Tensor::from_f32({1, 2, 3, 4}, {4}));
  auto* big = g.add_initializer("/big", Tensor(DType::f32, {(1 << 20) + 1}));
  auto* e = g.add_initializer("/e", Tensor::from_f32({-1, 2}, {2}));
  auto* m = g.add_node("Mul", "/Mul", {a, b}, {"m"})->outputs[0];
  kiln::ir::Attributes to_f32;
  to_f32.set("to", int64_t{1});
  auto* c = g.add_node("Cast", "/Cast", {m}, {"c"}, to_f32)->outputs[0];
  auto* y = g.add_node("Add", "/Add", {x, c}, {"y"})->outputs[0];
  auto* wn = g.add_node("Neg", "/NegW", {W}, {"wn"})->outputs[0];
  auto* wcn = g.add_node("Neg", "/NegWc", {Wc}, {"wcn"})->outputs[0];
  auto* dr = g.add_node("Dropout", "/Dropout", {d}, {"dr"})->outputs[0];
  auto* bn = g.add_node("Neg", "/NegBig", {big}, {"bn"})->outputs[0];
  auto* ea = g.add_node("Abs", "/Abs", {e}, {"ea"})->outputs[0];
  g.outputs = {y, wn, wcn, dr, bn, ea};
  ASSERT_TRUE(kiln::ir::infer_graph(g).is_ok()) << kiln::ir::infer_graph(g).message();

  // An op whose kernel is missing is left alone: take Abs's kernel away for this run.
  auto* abs_def = kiln::ir::OpTable::get().find_mutable("Abs");
  ASSERT_TRUE(abs_def && abs_def->kernel) << "Abs has no eager kernel yet";
  auto saved = abs_def->kernel;
  abs_def->kernel = nullptr;
  auto changed = fold(g);
  abs_def->kernel = saved;
  ASSERT_TRUE(changed) << changed.message();
  EXPECT_TRUE(*changed);

  // Folded: Mul, Cast (c = [2, 4, 6] f32) and Neg of the constant /Wc.
  const auto* cv = find_init(g, "c");
  ASSERT_TRUE(cv);
  EXPECT_TRUE(kiln::test::tensors_equal(*cv->data, Tensor::from_f32({2, 4, 6}, {3})));
  const auto* wcv = find_init(g, "wcn");
  ASSERT_TRUE(wcv);
  EXPECT_TRUE(kiln::test::tensors_equal(*wcv->data, Tensor::from_f32({-1, -2, -3, -4}, {2, 2})));
  EXPECT_EQ(find_init(g, "m"), nullptr);   // only fed the folded Cast
  EXPECT_EQ(find_init(g, "/a"), nullptr);  // only fed the folded Mul
  ASSERT_NE(find_init(g, "W"), nullptr);   // parameter kept
  // Not folded: Add (x is an input), Neg(W) (parameter), Dropout (random), Neg(/big) (> 2^20
  // elements), Abs (no kernel).
  std::multiset<std::string> left;
  for (auto& n : g.nodes()) left.insert(n->name);
  EXPECT_EQ(left, (std::multiset<std::string>{"/Add", "/NegW", "/Dropout", "/NegBig", "/Abs"}));
  EXPECT_TRUE(kiln::ir::verify_graph(g).is_ok()) << kiln::ir::verify_graph(g).message();
}

// A real PyTorch 1.13 export (tools/make_bad_models.py, torch_fixture): after binding
// batch=2, seq=5 and folding, no shape computation is left, the positional-embedding Gather
// on the parameter pos.weight is kept, and the eager run matches PyTorch's output.
TEST(FoldConstants, PyTorchExportFoldsAndMatchesPyTorch) {
  kiln::frontend::ImportOptions o;
  o.bind_dims = {{"batch", 2}, {"seq", 5}};
  auto g = kiln::frontend::import_onnx(fixture("good_torch_tiny.onnx"), o);
  ASSERT_TRUE(g) << g.message();
  Graph& G = **g;
  auto unfolded = G.clone();
  auto changed = fold(G);
  ASSERT_TRUE(changed) << changed.message();
  EXPECT_TRUE(*changed);
  for (auto& n : G.nodes())
    for (const char* shape_op : {"Shape", "Unsqueeze", "Concat", "Range", "ConstantOfShape", "Trilu", "Equal", "Cast"})
      EXPECT_NE(n->op, shape_op) << "not folded: " << n->name;
  for (auto& n : G.nodes())
    for (auto* out : n->outputs) EXPECT_TRUE(out->shape.is_static()) << out->name << " " << out->shape.to_string();
  EXPECT_NE(find_init(G, "pos.weight"), nullptr);
  EXPECT_TRUE(kiln::ir::verify_graph(G).is_ok()) << kiln::ir::verify_graph(G).message();
  EXPECT_EQ(G.outputs[0]->shape.to_string(), "[10, 4]");

  auto idx = kiln::frontend::load_tensor_pb(fixture("torch_tiny_input_0.pb"));
  ASSERT_TRUE(idx) << idx.message();
  auto ref = kiln::frontend::load_tensor_pb(fixture("torch_tiny_output_0.pb"));
  ASSERT_TRUE(ref) << ref.message();
  auto r1 = kiln::runtime::run_graph(G, {{"idx", *idx}});
  ASSERT_TRUE(r1) << r1.message();
  auto r0 = kiln::runtime::run_graph(*unfolded, {{"idx", *idx}});
  ASSERT_TRUE(r0) << r0.message();
  const Tensor& y1 = r1->at("y");
  const Tensor& y0 = r0->at("y");
  ASSERT_EQ(y1.dims(), ref->dims());
  EXPECT_TRUE(kiln::test::tensors_equal(y1, y0));  // folding keeps the function bit-exactly
  for (int64_t i = 0; i < ref->numel(); ++i)       // f32 attention vs PyTorch's f32: 1e-5
    EXPECT_NEAR(y1.get_f64(i), ref->get_f64(i), 1e-5 + 1e-5 * std::abs(ref->get_f64(i))) << i;
}
