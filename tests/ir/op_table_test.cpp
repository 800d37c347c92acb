// Walks the op table and fails when an entry lacks a field (DESIGN.md convention 1).
#include "ir/op_table.h"

#include <gtest/gtest.h>

#include "runtime/interpreter.h"

using namespace kiln::ir;

TEST(OpTable, EveryEntryIsComplete) {
  kiln::runtime::register_eager_kernels();
  const auto& all = OpTable::get().all();
  ASSERT_FALSE(all.empty());
  for (const auto& [name, def] : all) {
    SCOPED_TRACE(name);
    EXPECT_EQ(def.name, name);
    EXPECT_FALSE(def.doc.empty()) << "missing doc";
    EXPECT_TRUE(static_cast<bool>(def.infer)) << "missing type/shape inference";
    EXPECT_TRUE(static_cast<bool>(def.kernel)) << "missing eager kernel";
    EXPECT_LE(def.min_inputs, def.max_inputs);
    EXPECT_LE(def.min_outputs, def.max_outputs);
    if (def.diff == Differentiability::differentiable)
      EXPECT_TRUE(static_cast<bool>(def.grad)) << "marked differentiable without a gradient rule";
    else
      EXPECT_FALSE(static_cast<bool>(def.grad)) << "gradient rule on an op marked not differentiable";
  }
}

TEST(OpTable, BroadcastShapes) {
  auto s = broadcast_shapes(Shape::of({2, 1, 4}), Shape::of({3, 1}));
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->to_vector(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_FALSE(broadcast_shapes(Shape::of({2, 3}), Shape::of({4})).has_value());
}
