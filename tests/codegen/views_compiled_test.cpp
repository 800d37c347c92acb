// Views in generated kernels (passes/fusion.cpp view_fusable, codegen/lower.cpp): an
// Expand, a Slice (positive steps, constant operands) or a Reshape (its one reader)
// feeding pointwise ops is read in place through broadcast / stepped / reshaped strides
// with an element offset, fused with its consumers, never copied by its own kernel; a
// Concat, a constant Pad or a unit-step SliceGrad (guarded views) reads each data input
// inside its box of the output (a guarded parameter) and its fill outside. Each graph runs eagerly (the Expand and
// Slice kernels copy) and compiled; the results must be bit-identical (data movement and
// one multiply-add in the same f32 arithmetic), and after fusion no Expand or Slice may
// be left outside a FusedKernel body.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "codegen/cpu/program.h"
#include "compiled_run.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "random_tensors.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;

namespace {

using kiln::testing::random_f32;
using kiln::testing::run_compiled;

/// Runs `g` eagerly and after fusion with generated kernels; expects equal bytes for
/// every output and `views` view nodes inside FusedKernel bodies, none outside.
void expect_views_fused(ir::Graph& g, const std::map<std::string, ir::Tensor>& feeds, int views) {
  auto inferred = ir::infer_graph(g);
  ASSERT_TRUE(inferred.is_ok()) << inferred.message();
  runtime::register_eager_kernels();
  auto ref = runtime::run_graph(g, feeds);
  ASSERT_TRUE(ref) << ref.message();
  auto fused = g.clone();
  passes::PassContext ctx;
  ctx.verify_each = true;
  auto st = passes::run_pipeline(*fused, {"fusion"}, ctx);
  ASSERT_TRUE(st.is_ok()) << st.message();
  int inside = 0;
  auto is_view = [](const std::string& op) {
    return op == "Expand" || op == "Slice" || op == "Reshape" || op == "Concat" || op == "Pad" || op == "SliceGrad";
  };
  for (auto& n : fused->nodes()) {
    EXPECT_FALSE(is_view(n->op)) << n->name << " was left to its eager kernel";
    if (n->op == "FusedKernel")
      for (auto& m : n->regions[0]->nodes()) inside += is_view(m->op);
  }
  EXPECT_EQ(inside, views);
  auto got = run_compiled(*fused, feeds);
  ASSERT_TRUE(got) << got.message();
  for (auto& [name, t] : *ref) {
    ASSERT_TRUE(got->count(name)) << name;
    const ir::Tensor& u = got->at(name);
    ASSERT_EQ(u.dims(), t.dims()) << name;
    EXPECT_EQ(std::memcmp(u.raw(), t.raw(), t.nbytes()), 0) << name << " differs from the eager result";
  }
}

TEST(ViewsCompiled, SliceWithOffsetAndStepsIsAStridedLoad) {
  // y = Slice(x, starts [1, 2, -7], ends [4, 100, -1], axes [0, 1, 2], steps [1, 2, 3]) * 3 + b
  // over x (5, 9, 10): y is (3, 4, 2), offset 1*90 + 2*10 + 3, strides (90, 20, 3); b dense.
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({5, 9, 10}));
  ir::Value* b = g.add_input("b", DType::f32, ir::Shape::of({3, 4, 2}));
  ir::Value* s = g.add_node("Slice", "slice",
                            {x, g.add_initializer("starts", ir::Tensor::from_i64({1, 2, -7})),
                             g.add_initializer("ends", ir::Tensor::from_i64({4, 100, -1})),
                             g.add_initializer("axes", ir::Tensor::from_i64({0, 1, 2})),
                             g.add_initializer("steps", ir::Tensor::from_i64({1, 2, 3}))},
                            {"s"})
                     ->outputs[0];
  ir::Value* three = g.add_initializer("three", ir::Tensor::scalar_f32(3.f));
  ir::Value* m = g.add_node("Mul", "mul", {s, three}, {"m"})->outputs[0];
  g.outputs = {g.add_node("Add", "add", {m, b}, {"y"})->outputs[0]};
  expect_views_fused(g, {{"x", random_f32({5, 9, 10}, 1)}, {"b", random_f32({3, 4, 2}, 2)}}, 1);
}

TEST(ViewsCompiled, ExpandIsABroadcastLoad) {
  // y = Expand(x (3, 1, 5), [2, 3, 4, 5]) + z (2, 3, 4, 5); and a Slice without axes/steps.
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({3, 1, 5}));
  ir::Value* z = g.add_input("z", DType::f32, ir::Shape::of({2, 3, 4, 5}));
  ir::Value* e =
      g.add_node("Expand", "expand", {x, g.add_initializer("shape", ir::Tensor::from_i64({2, 3, 4, 5}))}, {"e"})
          ->outputs[0];
  ir::Value* y = g.add_node("Add", "add", {e, z}, {"y"})->outputs[0];
  ir::Value* w = g.add_input("w", DType::f32, ir::Shape::of({6, 7}));
  ir::Value* ws = g.add_node("Slice", "slice",
                             {w, g.add_initializer("s0", ir::Tensor::from_i64({2, 1})),
                              g.add_initializer("e0", ir::Tensor::from_i64({5, 7}))},
                             {"ws"})
                      ->outputs[0];
  ir::Value* v = g.add_node("Neg", "neg", {ws}, {"v"})->outputs[0];
  g.outputs = {y, v};
  expect_views_fused(
      g, {{"x", random_f32({3, 1, 5}, 3)}, {"z", random_f32({2, 3, 4, 5}, 4)}, {"w", random_f32({6, 7}, 5)}}, 2);
}

TEST(ViewsCompiled, ReshapeForItsOneReaderIsADenseLoad) {
  // y = Reshape(x (4, 6), [2, 3, 4]) * x2 (2, 3, 4) + c (4): the kernel reads x with the
  // dense strides of (2, 3, 4).
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({4, 6}));
  ir::Value* x2 = g.add_input("x2", DType::f32, ir::Shape::of({2, 3, 4}));
  ir::Value* c = g.add_input("c", DType::f32, ir::Shape::of({4}));
  ir::Value* r =
      g.add_node("Reshape", "reshape", {x, g.add_initializer("shape", ir::Tensor::from_i64({2, 3, 4}))}, {"r"})
          ->outputs[0];
  ir::Value* m = g.add_node("Mul", "mul", {r, x2}, {"m"})->outputs[0];
  g.outputs = {g.add_node("Add", "add", {m, c}, {"y"})->outputs[0]};
  expect_views_fused(g, {{"x", random_f32({4, 6}, 7)}, {"x2", random_f32({2, 3, 4}, 8)}, {"c", random_f32({4}, 9)}}, 1);
}

TEST(ViewsCompiled, ReshapeWithTwoReadersOrAloneStaysAnEagerView) {
  // Read by two kernels, or by a library call only, the Reshape stays the interpreter's
  // storage-sharing view: fusing it would make some kernel write a copy of it.
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({4, 6}));
  ir::Value* w = g.add_input("w", DType::f32, ir::Shape::of({4, 5}));
  ir::Value* r = g.add_node("Reshape", "reshape", {x, g.add_initializer("shape", ir::Tensor::from_i64({6, 4}))}, {"r"})
                     ->outputs[0];
  ir::Value* a = g.add_node("Neg", "neg", {r}, {"a"})->outputs[0];
  ir::Value* b = g.add_node("MatMul", "mm", {r, w}, {"b"})->outputs[0];
  ir::Value* r2 =
      g.add_node("Reshape", "reshape2", {w, g.add_initializer("shape2", ir::Tensor::from_i64({20}))}, {"r2"})
          ->outputs[0];
  g.outputs = {a, b,
               g.add_node("MatMul", "mm2", {r2, g.add_input("v", DType::f32, ir::Shape::of({20}))}, {"d"})->outputs[0]};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(g, {"fusion"}, ctx).is_ok());
  int top = 0;
  for (auto& n : g.nodes()) top += n->op == "Reshape";
  EXPECT_EQ(top, 2) << "a Reshape was fused although another reader or only a library call reads it";
}

TEST(ViewsCompiled, ConcatReadsEachInputInsideItsBox) {
  // A rotary embedding's tail: y = Concat(a * c - b * s, a * s + b * c, axis -1) * 2 over
  // (2, 3, 4) halves, and a Concat of three unequal inputs along axis 1 (2, 1|3|2, 4).
  ir::Graph g;
  ir::Value* a = g.add_input("a", DType::f32, ir::Shape::of({2, 3, 4}));
  ir::Value* b = g.add_input("b", DType::f32, ir::Shape::of({2, 3, 4}));
  ir::Value* c = g.add_input("c", DType::f32, ir::Shape::of({3, 4}));
  ir::Value* s = g.add_input("s", DType::f32, ir::Shape::of({3, 4}));
  auto op = [&](const char* o, ir::Value* x, ir::Value* y, const char* n) {
    return g.add_node(o, n, {x, y}, {std::string(n) + "_out"})->outputs[0];
  };
  ir::Value* re = op("Sub", op("Mul", a, c, "ac"), op("Mul", b, s, "bs"), "re");
  ir::Value* im = op("Add", op("Mul", a, s, "as"), op("Mul", b, c, "bc"), "im");
  ir::Attributes last;
  last.set("axis", int64_t(-1));
  ir::Value* cat = g.add_node("Concat", "cat", {re, im}, {"cat"}, last)->outputs[0];
  ir::Value* y = op("Mul", cat, g.add_initializer("two", ir::Tensor::scalar_f32(2.f)), "y");
  ir::Value* p = g.add_input("p", DType::f32, ir::Shape::of({2, 1, 4}));
  ir::Value* q = g.add_input("q", DType::f32, ir::Shape::of({2, 3, 4}));
  ir::Value* r = g.add_input("r", DType::f32, ir::Shape::of({2, 2, 4}));
  ir::Attributes one;
  one.set("axis", int64_t(1));
  ir::Value* cat3 = g.add_node("Concat", "cat3", {p, q, r}, {"cat3"}, one)->outputs[0];
  g.outputs = {y, g.add_node("Neg", "neg", {cat3}, {"z"})->outputs[0]};
  expect_views_fused(g,
                     {{"a", random_f32({2, 3, 4}, 11)},
                      {"b", random_f32({2, 3, 4}, 12)},
                      {"c", random_f32({3, 4}, 13)},
                      {"s", random_f32({3, 4}, 14)},
                      {"p", random_f32({2, 1, 4}, 15)},
                      {"q", random_f32({2, 3, 4}, 16)},
                      {"r", random_f32({2, 2, 4}, 17)}},
                     2);
}

TEST(ViewsCompiled, PadAndSliceGradFillOutsideTheirBox) {
  // y = Pad(x (3, 5), pads [1, 0, 2, 3], value -1.5) + 1 (6, 8); z = SliceGrad(dy (2, 3)
  // into (4, 6) at rows 1..3, columns 2..5) * 3; a negative pad (a crop) on w (4, 6).
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({3, 5}));
  ir::Value* pad = g.add_node("Pad", "pad",
                              {x, g.add_initializer("pads", ir::Tensor::from_i64({1, 0, 2, 3})),
                               g.add_initializer("cv", ir::Tensor::scalar_f32(-1.5f))},
                              {"padded"})
                       ->outputs[0];
  ir::Value* one = g.add_initializer("one", ir::Tensor::scalar_f32(1.f));
  ir::Value* y = g.add_node("Add", "add", {pad, one}, {"y"})->outputs[0];
  ir::Value* dy = g.add_input("dy", DType::f32, ir::Shape::of({2, 3}));
  ir::Value* sg = g.add_node("SliceGrad", "sg",
                             {dy, g.add_initializer("shape", ir::Tensor::from_i64({4, 6})),
                              g.add_initializer("starts", ir::Tensor::from_i64({1, 2})),
                              g.add_initializer("ends", ir::Tensor::from_i64({3, 5}))},
                             {"sg"})
                      ->outputs[0];
  ir::Value* z =
      g.add_node("Mul", "mul", {sg, g.add_initializer("three", ir::Tensor::scalar_f32(3.f))}, {"z"})->outputs[0];
  ir::Value* w = g.add_input("w", DType::f32, ir::Shape::of({4, 6}));
  ir::Value* crop =
      g.add_node("Pad", "crop", {w, g.add_initializer("cpads", ir::Tensor::from_i64({-1, 2, 0, -3}))}, {"crop"})
          ->outputs[0];
  g.outputs = {y, z, g.add_node("Neg", "neg", {crop}, {"v"})->outputs[0]};
  expect_views_fused(g, {{"x", random_f32({3, 5}, 21)}, {"dy", random_f32({2, 3}, 22)}, {"w", random_f32({4, 6}, 23)}},
                     3);
}

TEST(ViewsCompiled, NegativeStepSliceStaysEager) {
  // Negative steps are not absorbed (the kernel IR's strides stay non-negative): the
  // Slice runs as its eager kernel and the result is still right.
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({8}));
  ir::Value* s =
      g.add_node(
           "Slice", "slice",
           {x, g.add_initializer("st", ir::Tensor::from_i64({6})), g.add_initializer("en", ir::Tensor::from_i64({0})),
            g.add_initializer("ax", ir::Tensor::from_i64({0})), g.add_initializer("sp", ir::Tensor::from_i64({-2}))},
           {"s"})
          ->outputs[0];
  g.outputs = {g.add_node("Neg", "neg", {s}, {"y"})->outputs[0]};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  auto fused = g.clone();
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(*fused, {"fusion"}, ctx).is_ok());
  int eager_slices = 0;
  for (auto& n : fused->nodes()) eager_slices += n->op == "Slice";
  EXPECT_EQ(eager_slices, 1);
  ir::Tensor xv = random_f32({8}, 6);
  auto got = run_compiled(*fused, {{"x", xv}});
  ASSERT_TRUE(got) << got.message();
  const ir::Tensor& y = got->at("y");
  ASSERT_EQ(y.numel(), 3);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(y.get_f64(i), -xv.get_f64(6 - 2 * i)) << i;
}

}  // namespace
