// fusion pass (passes/fusion.cpp):
//  - keeps the function: one training step of every example, fp32 and bf16, run by the
//    eager interpreter before and after fusion (fused bodies run op by op), gives
//    bit-identical loss and state outputs;
//  - structure: every body node is a pointwise op with a scalar rule and the body's
//    domain shape; the tiny GPT's fused program has far fewer top-level nodes; the
//    dump shows the FusedKernel nodes and their bodies; the graph still verifies;
//  - every pointwise op of the table has a scalar rule, or is listed here with why not.
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "ir/op_table.h"
#include "ir/ops/nn.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"
#include "runtime/io.h"
#include "tools/driver/driver.h"

using namespace kiln;

namespace {

std::string example(const std::string& m, const std::string& f) {
  return std::string(KILN_SOURCE_DIR) + "/examples/" + m + "/" + f;
}

int count_top(const ir::Graph& g, const std::string& op) {
  int n = 0;
  for (auto& nd : g.nodes()) n += nd->op == op;
  return n;
}

struct P {
  std::string model;
  bool bf16;
};
/// gtest prints parameters with this (stable ctest names and readable failures).
void PrintTo(const P& p, std::ostream* os) { *os << p.model << (p.bf16 ? "_bf16" : "_fp32"); }

class FusionKeepsFunction : public ::testing::TestWithParam<P> {};

TEST_P(FusionKeepsFunction, OneStepBitIdentical) {
  const P& p = GetParam();
  runtime::TrainConfig cfg;
  cfg.model = example(p.model, "model.onnx");
  cfg.per_device_train_batch_size = 4;
  cfg.loss = "cross_entropy";
  cfg.bf16 = p.bf16;
  cfg.max_steps = 1;
  auto prog = driver::build_training_program(cfg, nullptr, false, false, 1);
  ASSERT_TRUE(prog) << prog.message();
  auto fused = prog->train_step->clone();
  passes::PassContext ctx;
  ctx.verify_each = true;
  auto st = passes::run_pipeline(*fused, {"fusion"}, ctx);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_TRUE(ir::verify_graph(*fused).is_ok());
  const int n_fused = count_top(*fused, "FusedKernel");
  EXPECT_GT(n_fused, 0);
  EXPECT_LT(fused->nodes().size(), prog->train_step->nodes().size());
  // Structure of every body.
  for (auto& n : fused->nodes()) {
    if (n->op != "FusedKernel") continue;
    ASSERT_EQ(n->regions.size(), 1u);
    const ir::Graph& body = *n->regions[0];
    const bool reduction = n->attrs.get_string("kind", "") == "reduction";
    const bool row = n->attrs.get_string("kind", "") == "row";
    const ir::Node* row_op = nullptr;
    for (auto& bn : body.nodes())
      if (ir::OpTable::get().find(bn->op)->row) {
        EXPECT_EQ(row_op, nullptr) << "two row ops in " << n->name;
        row_op = bn.get();
      }
    EXPECT_EQ(row, row_op != nullptr) << n->name;
    const ir::Shape dom = row_op      ? row_op->inputs[0]->shape
                          : reduction ? body.nodes().back()->inputs[0]->shape
                                      : body.outputs[0]->shape;
    for (auto& bn : body.nodes()) {
      const ir::OpDef* d = ir::OpTable::get().find(bn->op);
      ASSERT_NE(d, nullptr);
      if (bn.get() == row_op) continue;
      if (bn->op == "Transpose" || bn->op == "Expand" || bn->op == "Slice" || ir::is_view_op(bn->op)) {
        // A view: its input is a kernel input read only through it.
        EXPECT_TRUE(bn->inputs[0]->producer == nullptr) << bn->name << " reads a value computed in the kernel";
        EXPECT_EQ(bn->outputs[0]->shape, dom) << bn->name;
        continue;
      }
      if (bn->op == "Concat" || bn->op == "Pad" || bn->op == "SliceGrad") {
        // A guarded view: its data inputs are kernel inputs read through guard boxes.
        for (int k : ir::guarded_view_inputs(*bn))
          EXPECT_TRUE(bn->inputs[k]->producer == nullptr) << bn->name << " reads a value computed in the kernel";
        EXPECT_EQ(bn->outputs[0]->shape, dom) << bn->name;
        continue;
      }
      if (reduction && bn == body.nodes().back()) {
        EXPECT_TRUE(d->reduce_combine.has_value()) << bn->name;
        EXPECT_EQ(body.outputs.size(), 1u);
        EXPECT_EQ(body.outputs[0], bn->outputs[0]) << "a reduction kernel's output is its reduction";
        continue;
      }
      EXPECT_EQ(d->fusion, ir::FusionClass::pointwise) << bn->name;
      EXPECT_TRUE(static_cast<bool>(d->scalar)) << bn->name;
      EXPECT_EQ(bn->outputs[0]->shape, dom) << bn->name;
    }
  }
  // One step, both graphs, same feeds.
  auto x = runtime::io::load_npy(example(p.model, "fixtures/batch_input.npy"));
  auto y = runtime::io::load_npy(example(p.model, "fixtures/batch_labels.npy"));
  ASSERT_TRUE(x && y);
  std::map<std::string, ir::Tensor> feeds;
  for (auto& sb : prog->train_step->state) feeds[sb.input->name] = sb.initial->clone();
  std::vector<int64_t> xd = x->dims(), yd = y->dims();
  xd[0] = yd[0] = 4;
  feeds[prog->data_inputs[0]] = ir::Tensor(x->dtype(), xd);
  std::memcpy(feeds[prog->data_inputs[0]].raw(), x->raw(), feeds[prog->data_inputs[0]].nbytes());
  feeds[prog->label_input] = ir::Tensor(y->dtype(), yd);
  std::memcpy(feeds[prog->label_input].raw(), y->raw(), feeds[prog->label_input].nbytes());
  runtime::RunOptions ro;
  ro.training = true;
  auto a = runtime::run_graph(*prog->train_step, feeds, ro);
  auto b = runtime::run_graph(*fused, feeds, ro);
  ASSERT_TRUE(a) << a.message();
  ASSERT_TRUE(b) << b.message();
  ASSERT_EQ(a->size(), b->size());
  for (auto& [name, t] : *a) {
    ASSERT_TRUE(b->count(name)) << name;
    const ir::Tensor& u = b->at(name);
    ASSERT_EQ(u.dims(), t.dims()) << name;
    ASSERT_EQ(u.dtype(), t.dtype()) << name;
    EXPECT_EQ(std::memcmp(u.raw(), t.raw(), t.nbytes()), 0) << name << " differs after fusion";
  }
}

INSTANTIATE_TEST_SUITE_P(Examples, FusionKeepsFunction,
                         ::testing::Values(P{"mlp_digits", false}, P{"cnn_bn", false}, P{"tiny_gpt", false},
                                           P{"tiny_gpt", true}, P{"resnet18", true}),
                         [](const ::testing::TestParamInfo<P>& i) {
                           return i.param.model + (i.param.bf16 ? "_bf16" : "_fp32");
                         });

TEST(Fusion, GptDumpShowsFusedKernelsAndFewerNodes) {
  runtime::TrainConfig cfg;
  cfg.model = example("tiny_gpt", "model.onnx");
  cfg.per_device_train_batch_size = 2;
  cfg.loss = "cross_entropy";
  cfg.max_steps = 1;
  auto prog = driver::build_training_program(cfg, nullptr, false, false, 1);
  ASSERT_TRUE(prog) << prog.message();
  const size_t before = prog->train_step->nodes().size();
  passes::PassContext ctx;
  auto st = passes::run_pipeline(*prog->train_step, {"fusion"}, ctx);
  ASSERT_TRUE(st.is_ok()) << st.message();
  const size_t after = prog->train_step->nodes().size();
  std::map<std::string, int> left;
  for (auto& n : prog->train_step->nodes()) left[n->op]++;
  for (auto& [op, c] : left) std::cout << "  " << op << " " << c << "\n";
  if (getenv("KILN_DEBUG_FUSION"))
    for (auto& n : prog->train_step->nodes())
      if (n->op == "FusedKernel") {
        std::cout << n->name << " " << n->outputs[0]->shape.to_string() << ":";
        for (auto& b : n->regions[0]->nodes()) std::cout << " " << b->op << "(" << b->name << ")";
        std::cout << "\n";
      }
  // The AdamW update alone is ~14 pointwise nodes per parameter: fusion must remove
  // most top-level nodes.
  EXPECT_LT(after * 2, before) << before << " -> " << after;
  std::ostringstream os;
  ir::print_graph(*prog->train_step, os);
  const std::string dump = os.str();
  EXPECT_NE(dump.find("FusedKernel"), std::string::npos);
  EXPECT_NE(dump.find("kind="), std::string::npos) << dump.substr(0, 2000);
}

TEST(Fusion, GptSoftmaxAndLayerNormAreRowKernelsWithTheirCasts) {
  // tiny GPT in bf16: every Softmax, SoftmaxGrad and LayerNormalization is in a "row"
  // kernel, none runs alone, and the autocast's casts around them fused in.
  runtime::TrainConfig cfg;
  cfg.model = example("tiny_gpt", "model.onnx");
  cfg.per_device_train_batch_size = 2;
  cfg.loss = "cross_entropy";
  cfg.bf16 = true;
  cfg.max_steps = 1;
  auto prog = driver::build_training_program(cfg, nullptr, false, false, 1);
  ASSERT_TRUE(prog) << prog.message();
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(*prog->train_step, {"fusion"}, ctx).is_ok());
  std::map<std::string, int> in_row, top;
  int casts_in_row = 0, row_kernels = 0;
  for (auto& n : prog->train_step->nodes()) {
    top[n->op]++;
    if (n->op != "FusedKernel" || n->attrs.get_string("kind", "") != "row") continue;
    ++row_kernels;
    for (auto& b : n->regions[0]->nodes()) {
      in_row[b->op]++;
      casts_in_row += b->op == "Cast";
    }
  }
  for (const char* op : {"Softmax", "SoftmaxGrad", "LayerNormalization"}) {
    EXPECT_GT(in_row[op], 0) << op << " is in no row kernel";
    EXPECT_EQ(top[op], 0) << op << " still runs alone";
  }
  EXPECT_EQ(row_kernels, in_row["Softmax"] + in_row["SoftmaxGrad"] + in_row["LayerNormalization"] +
                             in_row["LogSoftmax"] + in_row["LogSoftmaxGrad"]);
  EXPECT_GT(casts_in_row, 0) << "bf16 casts around the row ops were not fused";
}

TEST(Fusion, EveryPointwiseOpHasAScalarRule) {
  // Pointwise ops that deliberately run as their own eager step.
  const std::map<std::string, std::string> exempt = {
      {"Softplus", "eager uses log1p, which has no scalar primitive yet"},
      {"BlockwiseDequantize8bit", "looks codes up in a table (a gather), not an element rule"},
  };
  for (auto& [name, d] : ir::OpTable::get().all()) {
    if (d.fusion != ir::FusionClass::pointwise) continue;
    if (exempt.count(name)) {
      EXPECT_FALSE(static_cast<bool>(d.scalar)) << name << " has a rule now: remove it from the exemptions";
      continue;
    }
    EXPECT_TRUE(static_cast<bool>(d.scalar)) << name << " is pointwise but has no scalar rule";
  }
}

}  // namespace
