// Symbolic shapes (issue 32): the SymExpr polynomial algebra, symbolic dims through
// inference (shape subgraphs, broadcasting, Reshape), ir::bind_symbols, and the IR text
// round trip of expression dims. Expected values are worked by hand from the
// definitions (a polynomial in canonical form; ONNX's shape semantics), and evaluation
// is checked against direct int64 arithmetic over a grid of symbol values.
#include "ir/sym_expr.h"

#include <gtest/gtest.h>

#include "ir/graph.h"
#include "ir/op_table.h"
#include "ir/parser.h"
#include "ir/printer.h"

using namespace kiln;
using namespace kiln::ir;

namespace {

SymExpr S(const char* name) { return SymExpr::symbol(name); }
SymExpr C(int64_t c) { return SymExpr::constant(c); }

}  // namespace

TEST(SymExpr, CanonicalFormMakesEqualPolynomialsEqual) {
  EXPECT_EQ(S("batch") * S("seq"), S("seq") * S("batch"));
  EXPECT_EQ((S("seq") + C(1)) * C(2), C(2) + S("seq") * C(2));
  EXPECT_EQ(S("seq") - S("seq"), C(0));
  EXPECT_TRUE((S("seq") - S("seq")).is_constant());
  EXPECT_EQ((S("a") + S("b")) * (S("a") - S("b")), S("a") * S("a") - S("b") * S("b"));
  EXPECT_NE(S("seq") * C(2), S("seq") + C(2));
  // Printing: symbols sorted, coefficient first, constant term last, no spaces.
  EXPECT_EQ((S("seq") * S("batch")).to_string(), "batch*seq");
  EXPECT_EQ((C(2) * S("seq") + C(1)).to_string(), "2*seq+1");
  EXPECT_EQ((S("seq") * S("seq") - S("seq")).to_string(), "seq*seq-seq");
  EXPECT_EQ((C(0) - S("n") - C(3)).to_string(), "-n-3");
  EXPECT_EQ(C(-1).to_string(), "-1");
  EXPECT_EQ(SymExpr().to_string(), "0");
}

TEST(SymExpr, ExactDivisionOrNone) {
  const SymExpr bs64 = S("batch") * S("seq") * C(64);
  auto q = bs64.exact_div(S("seq") * C(64));
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(*q, S("batch"));
  q = (C(6) * S("seq") + C(4)).exact_div(C(2));
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(*q, C(3) * S("seq") + C(2));
  EXPECT_FALSE((C(8) * S("seq")).exact_div(C(3)).has_value());             // 8*seq/3: not integral in general
  EXPECT_FALSE((S("seq") + C(1)).exact_div(S("seq")).has_value());         // a remainder
  EXPECT_FALSE(S("batch").exact_div(S("seq")).has_value());                // another symbol
  EXPECT_FALSE((S("a") * S("b")).exact_div(S("a") + S("b")).has_value());  // not a monomial divisor
}

TEST(SymExpr, EvaluateMatchesInt64Arithmetic) {
  const SymExpr e = C(3) * S("b") * S("s") - C(2) * S("s") + C(7);
  for (int64_t b = 1; b <= 5; ++b)
    for (int64_t s = 0; s <= 9; ++s) {
      auto v = e.evaluate({{"b", b}, {"s", s}});
      ASSERT_TRUE(v.has_value());
      EXPECT_EQ(*v, 3 * b * s - 2 * s + 7) << b << " " << s;
    }
  EXPECT_FALSE(e.evaluate({{"b", 2}}).has_value());  // s unbound
  // Overflow: a product past int64 is no value, and an expression built past it is invalid.
  EXPECT_FALSE((S("x") * S("x")).evaluate({{"x", int64_t(1) << 40}}).has_value());
  EXPECT_FALSE((C(int64_t(1) << 62) * C(4)).valid());
}

TEST(SymExpr, SubstituteBindsSomeSymbols) {
  const SymExpr e = S("batch") * S("seq") + C(2) * S("batch");
  EXPECT_EQ(e.substitute({{"batch", 3}}), C(3) * S("seq") + C(6));
  EXPECT_EQ(e.substitute({{"batch", 3}, {"seq", 5}}), C(21));
  EXPECT_EQ(e.substitute({{"other", 3}}), e);
  EXPECT_EQ(e.symbols(), (std::set<std::string>{"batch", "seq"}));
}

TEST(SymExpr, ParsePrintRoundTrip) {
  for (const char* text : {"seq", "batch*seq", "2*seq+1", "seq*seq-seq", "-n-3", "0", "-1", "4*B*T"}) {
    auto e = SymExpr::parse(text);
    ASSERT_TRUE(e.has_value()) << text;
    EXPECT_EQ(e->to_string(), text);
  }
  auto e = SymExpr::parse("(seq + 1) * 2 - seq");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->to_string(), "seq+2");
  for (const char* bad : {"", "seq*", "(seq", "seq+)", "2 3", "seq/2"}) EXPECT_FALSE(SymExpr::parse(bad)) << bad;
  EXPECT_EQ(SymExpr::parse("seq")->as_symbol(), "seq");
  EXPECT_EQ(SymExpr::parse("2*seq")->as_symbol(), "");
}

TEST(SymbolicDims, DimArithmeticAndText) {
  const Dim b("batch"), s("seq");
  EXPECT_EQ((b * s).to_string(), "batch*seq");
  EXPECT_EQ((b * s).symbol(), "");
  EXPECT_EQ(s.symbol(), "seq");
  EXPECT_EQ(dim_exact_div(b * s * Dim(4), s * Dim(4)), b);
  EXPECT_TRUE(dim_exact_div(s, Dim(3)).is_unknown());
  EXPECT_TRUE((s * Dim()).is_unknown());
  EXPECT_EQ(Dim(SymExpr::constant(6)), Dim(6));  // a constant expression is a static dim
  EXPECT_EQ(Dim::from_text("2*seq+1").to_string(), "2*seq+1");
  EXPECT_EQ(Dim::from_text("?").to_string(), "?");
  EXPECT_EQ(Dim::from_text("12"), Dim(12));
}

TEST(SymbolicDims, BroadcastOfDifferentSymbolsIsAnError) {
  Graph g;
  Value* a = g.add_input("a", DType::f32, Shape({Dim("seq"), Dim(4)}));
  Value* b = g.add_input("b", DType::f32, Shape({Dim("len"), Dim(4)}));
  Value* c = g.add_input("c", DType::f32, Shape({Dim(1), Dim(4)}));
  Node* same = g.add_node("Add", "same", {a, a}, {"y0"});
  ASSERT_TRUE(infer_node(*same).is_ok());
  EXPECT_EQ(same->outputs[0]->shape.to_string(), "[seq, 4]");
  Node* one = g.add_node("Add", "one", {a, c}, {"y1"});
  ASSERT_TRUE(infer_node(*one).is_ok());
  EXPECT_EQ(one->outputs[0]->shape.to_string(), "[seq, 4]");
  Node* bad = g.add_node("Add", "bad", {a, b}, {"y2"});
  Status st = infer_node(*bad);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("seq"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("len"), std::string::npos) << st.message();
}

TEST(SymbolicDims, ShapeSubgraphGivesSymbolicReshape) {
  // x [batch, seq, 64] -> Reshape(x, Concat(Gather(Shape(x), 0), Gather(Shape(x), 1), [4, 16]))
  // is [batch, seq, 4, 16], as the attention heads of an exported GPT.
  Graph g;
  Value* x = g.add_input("x", DType::f32, Shape({Dim("batch"), Dim("seq"), Dim(64)}));
  Value* i0 = g.add_initializer("i0", Tensor::from_i64({0}));
  Value* i1 = g.add_initializer("i1", Tensor::from_i64({1}));
  Value* heads = g.add_initializer("heads", Tensor::from_i64({4, 16}));
  Node* sh = g.add_node("Shape", "shape", {x}, {"s"});
  Node* g0 = g.add_node("Gather", "g0", {sh->outputs[0], i0}, {"b"});
  Node* g1 = g.add_node("Gather", "g1", {sh->outputs[0], i1}, {"t"});
  Attributes ax;
  ax.set("axis", int64_t(0));
  Node* cat = g.add_node("Concat", "cat", {g0->outputs[0], g1->outputs[0], heads}, {"target"}, ax);
  Node* r = g.add_node("Reshape", "r", {x, cat->outputs[0]}, {"y"});
  ASSERT_TRUE(infer_graph(g).is_ok());
  EXPECT_EQ(r->outputs[0]->shape.to_string(), "[batch, seq, 4, 16]");
  ASSERT_TRUE(cat->outputs[0]->sym_data);
  EXPECT_EQ(cat->outputs[0]->sym_data->size(), 4u);
  // Binding seq re-infers every dim and leaves batch symbolic.
  ASSERT_TRUE(bind_symbols(g, {{"seq", 8}}).is_ok());
  EXPECT_EQ(x->shape.to_string(), "[batch, 8, 64]");
  EXPECT_EQ(r->outputs[0]->shape.to_string(), "[batch, 8, 4, 16]");
  // Binding the last symbol makes x static: its Shape subgraph is fold_constants' to
  // evaluate (inference computes shape contents only over symbolic inputs).
  ASSERT_TRUE(bind_symbols(g, {{"batch", 2}}).is_ok());
  EXPECT_EQ(x->shape.to_string(), "[2, 8, 64]");
  EXPECT_FALSE(cat->outputs[0]->sym_data);
}

namespace {

/// x [batch, seq, 8] -> Reshape(x, SymInts [batch*seq, 8]) -> y, inferred; `s`, `r` its nodes.
std::unique_ptr<Graph> sym_ints_reshape(Node*& s, Node*& r) {
  auto g = std::make_unique<Graph>();
  Value* x = g->add_input("x", DType::f32, Shape({Dim("batch"), Dim("seq"), Dim(8)}));
  Attributes a;
  a.set("values", std::vector<std::string>{"batch*seq", "8"});
  a.set("dims", std::vector<int64_t>{2});
  s = g->add_node("SymInts", "s", {}, {"target"}, a);
  r = g->add_node("Reshape", "r", {x, s->outputs[0]}, {"y"});
  EXPECT_TRUE(infer_graph(*g).is_ok());
  g->outputs = {r->outputs[0]};
  return g;
}

}  // namespace

TEST(SymbolicDims, SymIntsBindToConstants) {
  // A SymInts node (what fold_constants leaves of a shape subgraph) gives its readers
  // symbolic dims, and static ones once its symbols are bound.
  Node *s = nullptr, *r = nullptr;
  auto gp = sym_ints_reshape(s, r);
  Graph& g = *gp;
  EXPECT_EQ(r->outputs[0]->shape.to_string(), "[batch*seq, 8]");
  ASSERT_TRUE(bind_symbols(g, {{"batch", 3}, {"seq", 5}}).is_ok());
  EXPECT_EQ(s->attrs.get_strings("values"), (std::vector<std::string>{"15", "8"}));
  EXPECT_EQ(r->outputs[0]->shape.to_string(), "[15, 8]");
  // A bad expression is refused by inference, with the text in the message.
  Attributes bad;
  bad.set("values", std::vector<std::string>{"seq*"});
  bad.set("dims", std::vector<int64_t>{1});
  Node* b = g.add_node("SymInts", "bad", {}, {"t2"}, bad);
  Status st = infer_node(*b);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("seq*"), std::string::npos) << st.message();
}

TEST(SymbolicDims, ExpressionDimsRoundTripThroughIrText) {
  Node *s = nullptr, *r = nullptr;
  auto gp = sym_ints_reshape(s, r);
  Graph& g = *gp;
  const std::string text = graph_to_string(g);
  EXPECT_NE(text.find("[batch*seq, 8]"), std::string::npos) << text;
  auto back = parse_graph(text);
  ASSERT_TRUE(back) << back.message() << "\n" << text;
  EXPECT_EQ((*back)->outputs[0]->shape.to_string(), "[batch*seq, 8]");
  EXPECT_EQ(graph_to_string(**back), text);
}
