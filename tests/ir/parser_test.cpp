// The IR text parser (ir/parser.h) against the printer: printing a parsed graph gives
// back the printed text exactly, for whole training programs of the example models
// (fp32 and bf16, gradient accumulation loop, fused kernels with regions, state
// bindings), and malformed text gives one error naming the line.
#include "ir/parser.h"

#include <gtest/gtest.h>

#include "ir/printer.h"
#include "tools/driver/driver.h"

using namespace kiln;

namespace {

runtime::TrainConfig program_config(const std::string& model, bool bf16, int64_t accum, bool compiled) {
  runtime::TrainConfig cfg;
  cfg.model = std::string(KILN_SOURCE_DIR) + "/examples/" + model + "/model.onnx";
  cfg.per_device_train_batch_size = 4;
  cfg.per_device_eval_batch_size = 4;
  cfg.bf16 = bf16;
  cfg.gradient_accumulation_steps = accum;
  cfg.backend = compiled ? "compiled" : "eager";
  cfg.no_cache = true;
  return cfg;
}

void expect_round_trip(const ir::Graph& g, const std::string& what) {
  const std::string text = ir::graph_to_string(g);
  auto parsed = ir::parse_graph(text);
  ASSERT_TRUE(parsed) << what << ": " << parsed.message();
  EXPECT_EQ(ir::graph_to_string(**parsed), text) << what;
  EXPECT_EQ((*parsed)->nodes().size(), g.nodes().size()) << what;
  EXPECT_EQ((*parsed)->state.size(), g.state.size()) << what;
}

}  // namespace

TEST(IrParser, TrainingProgramsRoundTrip) {
  struct Case {
    const char* model;
    bool bf16;
    int64_t accum;
    bool compiled;
  };
  for (const Case& c : {Case{"tiny_gpt", false, 1, false}, Case{"tiny_gpt", true, 2, true},
                        Case{"mlp_digits", false, 2, true}, Case{"cnn_bn", false, 1, true}}) {
    const std::string what = std::string(c.model) + (c.bf16 ? " bf16" : "") + " accum " + std::to_string(c.accum) +
                             (c.compiled ? " compiled" : " eager");
    auto prog = driver::build_training_program(program_config(c.model, c.bf16, c.accum, c.compiled));
    ASSERT_TRUE(prog) << what << ": " << prog.message();
    expect_round_trip(*prog->train_step, what + " train_step");
    expect_round_trip(*prog->eval, what + " eval");
  }
}

TEST(IrParser, SmallValuesAndAttributesComeBack) {
  const std::string text =
      "graph g(%x: f32[batch, 3], %n: i64[]) {\n"
      "  init %c: f32[2] = {0.5, -2}\n"
      "  %y = Mul(%x, %c) {alpha=0.25, axes=[0, -1], mode=\"a, b\", names=[\"p\", \"q\"], "
      "value=tensor<f32[2]>{1, 2}} : f32[batch, 3]  # mul/0\n"
      "  return %y\n"
      "}\n";
  auto g = ir::parse_graph(text);
  ASSERT_TRUE(g) << g.message();
  EXPECT_EQ(ir::graph_to_string(**g), text);
  const ir::Node& n = *(*g)->nodes()[0];
  EXPECT_EQ(n.attrs.get_ints("axes"), (std::vector<int64_t>{0, -1}));
  EXPECT_DOUBLE_EQ(n.attrs.get_float("alpha", 0), 0.25);
  EXPECT_EQ(n.attrs.get_string("mode", ""), "a, b");
  EXPECT_EQ((*g)->initializers[0]->data->get_f64(1), -2.0);
  EXPECT_FALSE((*g)->inputs[0]->shape.dims[0].is_static());
  EXPECT_EQ((*g)->inputs[0]->shape.dims[0].symbol(), "batch");
}

TEST(IrParser, MalformedTextNamesTheLine) {
  auto bad_type = ir::parse_graph("graph g(%x: f32[2]) {\n  %y = Relu(%x) : q99[2]\n  return %y\n}\n");
  ASSERT_FALSE(bad_type);
  EXPECT_NE(bad_type.message().find("line 2"), std::string::npos) << bad_type.message();
  auto undefined = ir::parse_graph("graph g(%x: f32[2]) {\n  %y = Relu(%z) : f32[2]\n  return %y\n}\n");
  ASSERT_FALSE(undefined);
  EXPECT_NE(undefined.message().find("line 2"), std::string::npos) << undefined.message();
  auto unclosed = ir::parse_graph("graph g(%x: f32[2]) {\n  return %x\n");
  ASSERT_FALSE(unclosed);
  EXPECT_NE(unclosed.message().find("'}'"), std::string::npos) << unclosed.message();
}
