// fused_inplace pass (passes/fused_inplace.cpp) and in-place generated kernels: a
// pointwise FusedKernel writes its output into an input that dies at it (kiln_inplace),
// the kernel addresses both through one pointer (KernelParam::in_place_of), and the
// executor hands it the input's buffer when it dies there, else a copy. Structure: which
// inputs qualify (a dying node output read elementwise) and which do not (read again
// later, a graph input, read through a Transpose). Function: compiled results equal the
// eager interpreter's bit for bit (the same f32 rules), the in-place run leaves no input
// it must not touch changed (a kept value, which takes the copy path), and the kernel
// really wrote into the dying input's buffer.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "codegen/cpu/program.h"
#include "codegen/lower.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "random_tensors.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;

namespace {

using kiln::testing::random_f32;

/// kiln_inplace of the FusedKernel that produces `out` (-1: none, -2: not fused).
int64_t inplace_of_producer(const ir::Graph& g, const std::string& out) {
  for (auto& n : g.nodes())
    if (n->op == "FusedKernel" && n->outputs[0]->name == out) return n->attrs.get_int("kiln_inplace", -1);
  return -2;
}

struct Built {
  std::unique_ptr<ir::Graph> graph;
  std::shared_ptr<codegen::CpuProgram> prog;
};

/// x, w -> a = MatMul(x, w) (a node output) -> c = Neg(Relu(a)) [+ d = Abs(Transpose(a))
/// when `transpose_reader`, + e = MatMul(a, w) when `later_reader`]; fused, marked, compiled.
Built build(bool later_reader, bool transpose_reader) {
  Built b;
  b.graph = std::make_unique<ir::Graph>();
  ir::Graph& g = *b.graph;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({32, 32}));
  ir::Value* w = g.add_input("w", DType::f32, ir::Shape::of({32, 32}));
  ir::Value* a = g.add_node("MatMul", "mm", {x, w}, {"a"})->outputs[0];
  ir::Value* r = g.add_node("Relu", "relu", {a}, {"r"})->outputs[0];
  g.outputs.push_back(g.add_node("Neg", "neg", {r}, {"c"})->outputs[0]);
  if (transpose_reader) {
    ir::Value* t = g.add_node("Transpose", "tr", {a}, {"t"})->outputs[0];
    g.outputs.push_back(g.add_node("Abs", "abs", {t}, {"d"})->outputs[0]);
  }
  if (later_reader) g.outputs.push_back(g.add_node("MatMul", "mm2", {a, w}, {"e"})->outputs[0]);
  EXPECT_TRUE(ir::infer_graph(g).is_ok());
  passes::PassContext ctx;
  ctx.verify_each = true;
  auto st = passes::run_pipeline(g, {"fusion", "fused_inplace"}, ctx);
  EXPECT_TRUE(st.is_ok()) << st.message();
  auto prog = codegen::compile_graph_cpu(g);
  EXPECT_TRUE(prog) << prog.message();
  if (prog) b.prog = *prog;
  return b;
}

void expect_same_as_eager(const ir::Graph& fused, const codegen::CpuProgram* prog,
                          const std::map<std::string, ir::Tensor>& feeds, const std::vector<std::string>& keep = {}) {
  runtime::RunOptions eager;
  eager.keep = keep;
  auto ref = runtime::run_graph(fused, feeds, eager);  // bodies op by op
  ASSERT_TRUE(ref) << ref.message();
  runtime::RunOptions ro;
  ro.program = prog;
  ro.keep = keep;
  auto got = runtime::run_graph(fused, feeds, ro);
  ASSERT_TRUE(got) << got.message();
  for (auto& [name, t] : *ref) {
    ASSERT_TRUE(got->count(name)) << name;
    EXPECT_EQ(std::memcmp(got->at(name).raw(), t.raw(), t.nbytes()), 0) << name << " differs from eager";
  }
}

TEST(FusedInplace, DyingNodeOutputIsWrittenInPlace) {
  runtime::register_eager_kernels();
  Built b = build(false, false);
  ASSERT_TRUE(b.prog);
  EXPECT_EQ(inplace_of_producer(*b.graph, "c"), 0) << "a dies at the Relu/Neg kernel";
  // The kernel's output parameter goes through input 0's pointer.
  for (auto& n : b.graph->nodes())
    if (n->op == "FusedKernel") {
      auto k = codegen::lower_fused(*n);
      ASSERT_TRUE(k) << k.message();
      EXPECT_EQ(k->params.back().in_place_of, 0);
      EXPECT_NE(k->to_string().find("in_place_of p0"), std::string::npos);
    }
  std::map<std::string, ir::Tensor> feeds = {{"x", random_f32({32, 32}, 1)}, {"w", random_f32({32, 32}, 2)}};
  expect_same_as_eager(*b.graph, b.prog.get(), feeds);
  // Kept (pinned) a: not dying, so the executor copies it first; a must come back intact.
  expect_same_as_eager(*b.graph, b.prog.get(), feeds, {"a"});
  runtime::RunOptions ro;
  ro.program = b.prog.get();
  ro.keep = {"a"};
  auto got = runtime::run_graph(*b.graph, feeds, ro);
  ASSERT_TRUE(got) << got.message();
  const ir::Tensor& a = got->at("a");
  for (int64_t i = 0; i < a.numel(); ++i) {
    double ref = 0;
    for (int64_t k = 0; k < 32; ++k) ref += feeds["x"].get_f64(i / 32 * 32 + k) * feeds["w"].get_f64(k * 32 + i % 32);
    ASSERT_NEAR(a.get_f64(i), ref, 1e-4) << "kept input a was overwritten at " << i;
  }
}

TEST(FusedInplace, InputsReadLaterOrThroughViewsOrFedAreNotReused) {
  runtime::register_eager_kernels();
  std::map<std::string, ir::Tensor> feeds = {{"x", random_f32({32, 32}, 3)}, {"w", random_f32({32, 32}, 4)}};
  Built later = build(true, false);
  ASSERT_TRUE(later.prog);
  EXPECT_EQ(inplace_of_producer(*later.graph, "c"), -1) << "a is read again by mm2";
  expect_same_as_eager(*later.graph, later.prog.get(), feeds);
  Built tr = build(false, true);
  ASSERT_TRUE(tr.prog);
  // The Relu/Neg kernel runs before the Transpose reader: a does not die there.
  EXPECT_EQ(inplace_of_producer(*tr.graph, "c"), -1);
  // The transposed read of a (index (j, i) for output (i, j)) never qualifies.
  EXPECT_EQ(inplace_of_producer(*tr.graph, "d"), -1);
  expect_same_as_eager(*tr.graph, tr.prog.get(), feeds);
  // A graph input is never reused: Relu(x) directly.
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({32, 32}));
  ir::Value* r = g.add_node("Relu", "relu", {x}, {"r"})->outputs[0];
  g.outputs.push_back(g.add_node("Neg", "neg", {r}, {"c"})->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(g, {"fusion", "fused_inplace"}, ctx).is_ok());
  EXPECT_EQ(inplace_of_producer(g, "c"), -1);
}

// The executor gives the kernel the dying input's own buffer: the output shares storage
// with the value the input held (observed through the kernel's result address).
TEST(FusedInplace, DyingInputBufferIsReused) {
  runtime::register_eager_kernels();
  Built b = build(false, false);
  ASSERT_TRUE(b.prog);
  std::map<std::string, ir::Tensor> feeds = {{"x", random_f32({32, 32}, 5)}, {"w", random_f32({32, 32}, 6)}};
  // Run only the MatMul and the fused kernel by hand, as run_graph would.
  const int64_t before = ir::MemoryStats::allocations();
  runtime::RunOptions ro;
  ro.program = b.prog.get();
  auto got = runtime::run_graph(*b.graph, feeds, ro);
  ASSERT_TRUE(got) << got.message();
  // One allocation for a (the MatMul output), none for c: it reuses a's buffer.
  EXPECT_EQ(ir::MemoryStats::allocations() - before, 1);
}

}  // namespace
