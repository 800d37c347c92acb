// Tests of ONNX export (frontend/onnx_export.cpp): import -> export -> re-import gives an
// equal graph (printed IR + initializer bytes), the file passes libonnx's checker when
// checked independently from disk, symbolic dims become dim_param, kiln_* attributes are
// dropped, kiln-internal ops are refused.
#include <gtest/gtest.h>
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include <fstream>

#include "frontend/onnx_import.h"
#include "frontend_test_util.h"
#include "ir/op_table.h"

using kiln::ir::DType;
using kiln::ir::Graph;
using kiln::test::fixture;
using kiln::test::scratch;

namespace {

onnx::ModelProto read_model(const std::string& path) {
  onnx::ModelProto m;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(m.ParseFromIstream(&in)) << path;
  return m;
}

void round_trip(const std::string& name, kiln::frontend::ImportOptions opts = {}) {
  SCOPED_TRACE(name);
  auto g = kiln::frontend::import_onnx(fixture(name), opts);
  ASSERT_TRUE(g) << g.message();
  // One file per test: ctest may run the tests of this binary in parallel.
  std::string out =
      scratch(std::string("export_") + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" + name);
  kiln::Status s = kiln::frontend::export_onnx(**g, out);
  ASSERT_TRUE(s.is_ok()) << s.message();
  if ((*g)->opset <= 17) {
    // Independent check of the written file (export_onnx checks the in-memory proto).
    EXPECT_NO_THROW(onnx::checker::check_model(out));
  }
  auto g2 = kiln::frontend::import_onnx(out, opts);
  ASSERT_TRUE(g2) << g2.message();
  EXPECT_EQ((*g2)->opset, (*g)->opset);
  EXPECT_TRUE(kiln::test::graphs_equal(**g, **g2));
  onnx::ModelProto m = read_model(out);
  EXPECT_EQ(m.ir_version(), 8);
  ASSERT_EQ(m.opset_import_size(), 1);
  EXPECT_EQ(m.opset_import(0).version(), (*g)->opset);
  for (const auto& t : m.graph().initializer()) EXPECT_TRUE(t.has_raw_data()) << t.name();
}

}  // namespace

TEST(OnnxExport, RoundTripMlpSymbolic) { round_trip("good_mlp.onnx"); }

TEST(OnnxExport, RoundTripMlpBound) {
  kiln::frontend::ImportOptions o;
  o.bind_dims = {{"batch", 3}};
  round_trip("good_mlp.onnx", o);
}

TEST(OnnxExport, RoundTripOpset18) { round_trip("good_mlp_opset18.onnx"); }
TEST(OnnxExport, RoundTripAllDtypes) { round_trip("good_dtypes.onnx"); }
TEST(OnnxExport, RoundTripConstants) { round_trip("good_constants.onnx"); }
TEST(OnnxExport, RoundTripExternalDataBecomesRaw) { round_trip("good_external.onnx"); }
TEST(OnnxExport, RoundTripShapeSubgraph) { round_trip("good_shape_fold.onnx"); }
TEST(OnnxExport, RoundTripPyTorchExport) { round_trip("good_torch_tiny.onnx"); }

TEST(OnnxExport, SymbolicDimsAsDimParam) {
  auto g = kiln::frontend::import_onnx(fixture("good_mlp.onnx"));
  ASSERT_TRUE(g) << g.message();
  std::string out = scratch("export_dim_param.onnx");
  ASSERT_TRUE(kiln::frontend::export_onnx(**g, out).is_ok());
  onnx::ModelProto m = read_model(out);
  ASSERT_EQ(m.graph().input_size(), 1);
  const auto& shp = m.graph().input(0).type().tensor_type().shape();
  ASSERT_EQ(shp.dim_size(), 2);
  EXPECT_EQ(shp.dim(0).dim_param(), "batch");
  EXPECT_EQ(shp.dim(1).dim_value(), 4);
  EXPECT_EQ(m.graph().output(0).type().tensor_type().shape().dim(0).dim_param(), "batch");
}

TEST(OnnxExport, DropsKilnAttributesAndOmittedInputs) {
  Graph g;
  auto* x = g.add_input("x", DType::f32, kiln::ir::Shape::of({2, 3}));
  kiln::ir::Attributes a;
  a.set("kiln_rng_id", int64_t{3});
  a.set("alpha", 0.5);
  auto* n = g.add_node("LeakyRelu", "/act", {x}, {"y"}, a);
  ASSERT_TRUE(kiln::ir::infer_node(*n).is_ok());
  g.outputs.push_back(n->outputs[0]);
  std::string out = scratch("export_kiln_attrs.onnx");
  kiln::Status s = kiln::frontend::export_onnx(g, out);
  ASSERT_TRUE(s.is_ok()) << s.message();
  onnx::ModelProto m = read_model(out);
  ASSERT_EQ(m.graph().node_size(), 1);
  const auto& np = m.graph().node(0);
  ASSERT_EQ(np.attribute_size(), 1);
  EXPECT_EQ(np.attribute(0).name(), "alpha");
  EXPECT_FLOAT_EQ(np.attribute(0).f(), 0.5f);
}

TEST(OnnxExport, KilnInternalOpIsAnError) {
  const kiln::ir::OpDef* internal = nullptr;
  for (const auto& [name, def] : kiln::ir::OpTable::get().all())
    if (!def.onnx) {
      internal = &def;
      break;
    }
  ASSERT_NE(internal, nullptr) << "the op table has no kiln-internal op to test with";
  Graph g;
  auto* x = g.add_input("x", DType::f32, kiln::ir::Shape::of({2}));
  auto* n = g.add_node(internal->name, "/internal_node", {x}, {"y"});
  n->outputs[0]->dtype = DType::f32;
  n->outputs[0]->shape = kiln::ir::Shape::of({2});
  g.outputs.push_back(n->outputs[0]);
  kiln::Status s = kiln::frontend::export_onnx(g, scratch("export_internal.onnx"));
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("'" + internal->name + "'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("/internal_node"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("kiln-internal"), std::string::npos) << s.message();
}

TEST(OnnxExport, UnwritablePathIsAnError) {
  auto g = kiln::frontend::import_onnx(fixture("good_mlp.onnx"));
  ASSERT_TRUE(g) << g.message();
  kiln::Status s = kiln::frontend::export_onnx(**g, "/nonexistent_dir_kiln/x.onnx");
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("/nonexistent_dir_kiln/x.onnx"), std::string::npos) << s.message();
}
