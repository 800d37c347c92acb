// IR core: printer output (hand-written golden text), verifier errors, clone,
// topological sort, dead-code elimination, symbolic dims, bf16/f16 conversions.
#include "ir/graph.h"

#include <gtest/gtest.h>

#include <cmath>

#include "ir/op_table.h"
#include "ir/printer.h"
#include "ir/verifier.h"

using namespace kiln;
using namespace kiln::ir;

namespace {

std::unique_ptr<Graph> small() {
  auto g = std::make_unique<Graph>();
  Value* x = g->add_input("x", DType::f32, Shape({Dim(std::string("batch")), Dim(4)}));
  Value* w = g->add_initializer("w", Tensor(DType::f32, {4, 3}));
  Attributes a;
  a.set("alpha", 0.5);
  Node* mm = g->add_node("MatMul", "/mm", {x, w}, {"y"});
  Node* r = g->add_node("LeakyRelu", "/act", {mm->outputs[0]}, {"z"}, a);
  EXPECT_TRUE(infer_graph(*g));
  g->outputs = {r->outputs[0]};
  return g;
}

}  // namespace

TEST(Printer, GoldenText) {
  auto g = small();
  const std::string want =
      "graph main(%x: f32[batch, 4]) {\n"
      "  init %w: f32[4, 3]\n"
      "  %y = MatMul(%x, %w) : f32[batch, 3]  # /mm\n"
      "  %z = LeakyRelu(%y) {alpha=0.5} : f32[batch, 3]  # /act\n"
      "  return %z\n"
      "}\n";
  EXPECT_EQ(graph_to_string(*g), want);
  EXPECT_EQ(graph_to_string(*g->clone()), want) << "clone must print identically";
}

TEST(Verifier, AcceptsAValidGraph) { EXPECT_TRUE(verify_graph(*small())); }

TEST(Verifier, RejectsUnknownOp) {
  auto g = small();
  g->add_node("NoSuchOp", "/bad", {g->outputs[0]}, {"q"});
  Status st = verify_graph(*g);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("NoSuchOp"), std::string::npos) << st.message();
}

TEST(Verifier, RejectsUseBeforeDefinition) {
  auto g = small();
  // Move the last node to the front: its input is then used before it is defined.
  auto& nodes = g->mutable_nodes();
  std::rotate(nodes.begin(), nodes.end() - 1, nodes.end());
  Status st = verify_graph(*g);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("before it is defined"), std::string::npos) << st.message();
  EXPECT_TRUE(g->topo_sort());
  EXPECT_TRUE(verify_graph(*g)) << "topo_sort restores a valid order";
}

TEST(Verifier, RejectsWrongArityAndUnknownAttribute) {
  auto g = small();
  g->mutable_nodes()[0]->inputs.push_back(g->inputs[0]);
  EXPECT_FALSE(verify_graph(*g));
  auto h = small();
  h->mutable_nodes()[1]->attrs.set("bogus", int64_t(1));
  Status st = verify_graph(*h);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("bogus"), std::string::npos) << st.message();
}

TEST(Graph, DeadCodeElimination) {
  auto g = small();
  g->add_node("Relu", "/unused", {g->inputs[0]}, {"dead"});
  EXPECT_EQ(g->dead_code_elimination(), 1);
  EXPECT_EQ(g->nodes().size(), 2u);
  EXPECT_EQ(g->find_value("dead"), nullptr);
}

TEST(Graph, UniqueNames) {
  Graph g;
  Value* a = g.new_value("v");
  Value* b = g.new_value("v");
  EXPECT_NE(a->name, b->name);
}

TEST(DType, Bfloat16RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between two bf16 values: ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3 * 2^-8 is halfway too: rounds up to the even neighbour 1 + 2^-6.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  for (float v : {0.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f}) EXPECT_EQ(f16_to_f32(f32_to_f16(v)), v) << v;
}

TEST(Parameters, OneElementModuleParametersAreCandidates) {
  // The rule of ir::is_parameter_candidate (docs/architecture.md, decision 10). The bias
  // of Linear(h, 1) ("head.bias", one element) was taken for a constant: never trained,
  // missing from model.safetensors.
  Graph g;
  const Value* w = g.add_initializer("head.weight", Tensor(DType::f32, {16, 1}));
  const Value* b = g.add_initializer("head.bias", Tensor(DType::f32, {1}));
  const Value* temp = g.add_initializer("temperature.weight", Tensor(DType::f32, {}));
  const Value* c = g.add_initializer("c_float", Tensor(DType::f32, {}));
  const Value* exported = g.add_initializer("/attn/Constant_output_0", Tensor(DType::f32, {1}));
  const Value* gen = g.add_initializer("onnx::Mul_12", Tensor(DType::f32, {1}));
  const Value* ints = g.add_initializer("idx.bias", Tensor(DType::i64, {1}));
  EXPECT_TRUE(is_parameter_candidate(*w));
  EXPECT_TRUE(is_parameter_candidate(*b));
  EXPECT_TRUE(is_parameter_candidate(*temp));
  EXPECT_FALSE(is_parameter_candidate(*c));
  EXPECT_FALSE(is_parameter_candidate(*exported));
  EXPECT_FALSE(is_parameter_candidate(*gen));
  EXPECT_FALSE(is_parameter_candidate(*ints));
}
