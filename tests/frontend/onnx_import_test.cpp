// Tests of ONNX import (frontend/onnx_import.cpp, frontend/tensor_proto.cpp) on the
// fixtures of tools/make_bad_models.py: good models (structure, dtypes, values against
// the formulas/numbers the script used), and every bad input (one-line error with the
// expected key words).
#include "frontend/onnx_import.h"

#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <random>

#include "frontend/model_bytes.h"
#include "frontend/tensor_proto.h"
#include "frontend_test_util.h"
#include "ir/op_table.h"

using kiln::ir::DType;
using kiln::ir::Graph;
using kiln::ir::Tensor;
using kiln::test::fixture;

namespace {

std::unique_ptr<Graph> import_ok(const std::string& name, kiln::frontend::ImportOptions opts = {}) {
  auto g = kiln::frontend::import_onnx(fixture(name), opts);
  EXPECT_TRUE(g.has_value()) << (g ? "" : g.message());
  return g ? std::move(*g) : nullptr;
}

// Imports a bad fixture and returns the error line (checks: error, one line, starts with the path).
std::string import_error(const std::string& name) {
  std::string path = fixture(name);
  auto g = kiln::frontend::import_onnx(path);
  EXPECT_FALSE(g.has_value()) << name << " imported but should fail";
  if (g) return "";
  const std::string& m = g.message();
  EXPECT_EQ(m.find('\n'), std::string::npos) << "multi-line error: " << m;
  EXPECT_EQ(m.rfind(path + ": ", 0), 0u) << "error does not start with the file path: " << m;
  return m;
}

#define EXPECT_HAS(msg, word) EXPECT_NE((msg).find(word), std::string::npos) << "'" << (word) << "' not in: " << (msg)

const kiln::ir::Value* find_init(const Graph& g, const std::string& name) {
  for (auto* v : g.initializers)
    if (v->name == name) return v;
  return nullptr;
}

}  // namespace

// ---------------------------------------------------------------- good models

TEST(OnnxImport, MlpStructureAndSymbolicDims) {
  auto g = import_ok("good_mlp.onnx");
  ASSERT_TRUE(g);
  EXPECT_EQ(g->opset, 17);
  // b is listed as a graph input too (older exporters): it is an initializer, not an input.
  ASSERT_EQ(g->inputs.size(), 1u);
  EXPECT_EQ(g->inputs[0]->name, "x");
  EXPECT_EQ(g->inputs[0]->shape.to_string(), "[batch, 4]");
  EXPECT_FALSE(g->inputs[0]->shape.dims[0].is_static());
  EXPECT_EQ(g->inputs[0]->shape.dims[0].symbol(), "batch");
  ASSERT_EQ(g->initializers.size(), 2u);
  ASSERT_EQ(g->nodes().size(), 3u);
  EXPECT_EQ(g->nodes()[0]->op, "MatMul");
  EXPECT_EQ(g->nodes()[0]->name, "/fc/MatMul");
  EXPECT_EQ(g->nodes()[2]->op, "Relu");
  ASSERT_EQ(g->outputs.size(), 1u);
  EXPECT_EQ(g->outputs[0]->dtype, DType::f32);
  EXPECT_EQ(g->outputs[0]->shape.to_string(), "[batch, 3]");
  // b came from float_data: [0.5, -1, 2]
  const auto* b = find_init(*g, "b");
  ASSERT_TRUE(b);
  ASSERT_EQ(b->data->dims(), std::vector<int64_t>{3});
  EXPECT_EQ(b->data->data<float>()[0], 0.5f);
  EXPECT_EQ(b->data->data<float>()[1], -1.0f);
  EXPECT_EQ(b->data->data<float>()[2], 2.0f);
  // W (raw_data) equals the standalone TensorProto the script wrote from the same numpy array.
  auto w_ref = kiln::frontend::load_tensor_pb(fixture("good_mlp_W.pb"));
  ASSERT_TRUE(w_ref) << w_ref.message();
  const auto* w = find_init(*g, "W");
  ASSERT_TRUE(w);
  EXPECT_TRUE(kiln::test::tensors_equal(*w->data, *w_ref));
  EXPECT_EQ(w->shape.to_string(), "[4, 3]");
}

TEST(OnnxImport, BindDimsMakesShapesStatic) {
  kiln::frontend::ImportOptions o;
  o.bind_dims = {{"batch", 5}, {"unused_symbol", 9}};
  auto g = import_ok("good_mlp.onnx", o);
  ASSERT_TRUE(g);
  EXPECT_EQ(g->inputs[0]->shape.to_string(), "[5, 4]");
  EXPECT_TRUE(g->inputs[0]->shape.is_static());
  EXPECT_EQ(g->outputs[0]->shape.to_string(), "[5, 3]");
  for (auto& n : g->nodes()) EXPECT_TRUE(n->outputs[0]->shape.is_static()) << n->name;
}

TEST(OnnxImport, Opset18SkipsLibonnxAndUsesOwnInference) {
  auto g = import_ok("good_mlp_opset18.onnx");
  ASSERT_TRUE(g);
  EXPECT_EQ(g->opset, 18);
  EXPECT_EQ(g->outputs[0]->shape.to_string(), "[batch, 3]");
}

TEST(OnnxImport, AllDtypesTypedAndRaw) {
  auto g = import_ok("good_dtypes.onnx");
  ASSERT_TRUE(g);
  EXPECT_TRUE(g->nodes().empty());
  // Formulas of tools/make_bad_models.py: float (i-3)*0.5, int i-3 (u8: i), bool i%2.
  struct Case {
    const char* name;
    DType dt;
  };
  const Case cases[] = {{"f32", DType::f32},      {"f64", DType::f64}, {"i64", DType::i64},
                        {"i32", DType::i32},      {"i8", DType::i8},   {"u8", DType::u8},
                        {"bool", DType::boolean}, {"f16", DType::f16}, {"bf16", DType::bf16}};
  int checked = 0;
  for (const auto& c : cases) {
    for (const char* form : {"_typed", "_raw"}) {
      std::string name = std::string(c.name) + form;
      const auto* v = find_init(*g, name);
      ASSERT_TRUE(v) << name;
      const Tensor& t = *v->data;
      ASSERT_EQ(t.dtype(), c.dt) << name;
      ASSERT_EQ(t.dims(), (std::vector<int64_t>{2, 3})) << name;
      for (int64_t i = 0; i < 6; ++i) {
        double expect = kiln::ir::is_float(c.dt) ? (i - 3) * 0.5
                        : c.dt == DType::u8      ? static_cast<double>(i)
                        : c.dt == DType::boolean ? static_cast<double>(i % 2)
                                                 : static_cast<double>(i - 3);
        double got;
        if (c.dt == DType::f16)
          got = kiln::ir::f16_to_f32(t.data<uint16_t>()[i]);
        else if (c.dt == DType::bf16)
          got = kiln::ir::bf16_to_f32(t.data<uint16_t>()[i]);
        else if (c.dt == DType::i8)
          got = t.data<int8_t>()[i];
        else if (c.dt == DType::u8 || c.dt == DType::boolean)
          got = t.data<uint8_t>()[i];
        else
          got = t.get_f64(i);
        EXPECT_EQ(got, expect) << name << "[" << i << "]";
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 18);
  const auto* s = find_init(*g, "scalar_f32");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->data->rank(), 0);
  EXPECT_EQ(s->data->data<float>()[0], 2.5f);
  const auto* e = find_init(*g, "empty_i64");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->data->dims(), std::vector<int64_t>{0});
  // Initializers that are graph outputs stay outputs.
  EXPECT_EQ(g->outputs.size(), 20u);
}

TEST(OnnxImport, ConstantNodesBecomeInitializers) {
  auto g = import_ok("good_constants.onnx");
  ASSERT_TRUE(g);
  for (auto& n : g->nodes()) EXPECT_NE(n->op, "Constant");
  EXPECT_EQ(g->nodes().size(), 4u);
  const auto* ct = find_init(*g, "c_tensor");
  ASSERT_TRUE(ct);
  EXPECT_TRUE(kiln::test::tensors_equal(*ct->data, Tensor::from_f32({1, 2, 3}, {3})));
  const auto* cf = find_init(*g, "c_float");
  ASSERT_TRUE(cf);
  EXPECT_TRUE(kiln::test::tensors_equal(*cf->data, Tensor::scalar_f32(0.25f)));
  const auto* cfs = find_init(*g, "c_floats");
  ASSERT_TRUE(cfs);
  EXPECT_TRUE(kiln::test::tensors_equal(*cfs->data, Tensor::from_f32({1.5f, -2.5f}, {2})));
  const auto* ci = find_init(*g, "c_int");
  ASSERT_TRUE(ci);
  EXPECT_TRUE(kiln::test::tensors_equal(*ci->data, Tensor::scalar_i64(7)));
  const auto* cis = find_init(*g, "c_ints");
  ASSERT_TRUE(cis);
  EXPECT_TRUE(kiln::test::tensors_equal(*cis->data, Tensor::from_i64({1, 2, 3})));
  EXPECT_EQ(g->outputs[0]->shape.to_string(), "[2, 3]");
  EXPECT_EQ(g->outputs[1]->dtype, DType::i64);
  EXPECT_EQ(g->outputs[1]->shape.to_string(), "[3]");
}

TEST(OnnxImport, ExternalDataInsideModelFolder) {
  auto g = import_ok("good_external.onnx");
  ASSERT_TRUE(g);
  const auto* w = find_init(*g, "W");
  ASSERT_TRUE(w);
  // The script stored arange(6) as f32[2, 3] at offset 8 of good_external.bin.
  EXPECT_TRUE(kiln::test::tensors_equal(*w->data, Tensor::from_f32({0, 1, 2, 3, 4, 5}, {2, 3})));
}

TEST(OnnxImport, InlineExternalDataAndEmbeddedModels) {
  // inline_external_data reads the external tensor in (the values the importer reads);
  // a registered (embedded) model that still refers to external data is refused, never
  // resolved against the current folder.
  std::ifstream f(fixture("good_external.onnx"), std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  onnx::ModelProto m;
  ASSERT_TRUE(m.ParseFromString(bytes));
  ASSERT_EQ(kiln::frontend::first_external_tensor(m), "initializer 'W'");
  static const std::string external = bytes;  // registered bytes must outlive every read
  kiln::frontend::register_model_bytes("embedded:external_test.onnx", external);
  auto refused = kiln::frontend::import_onnx("embedded:external_test.onnx");
  ASSERT_FALSE(refused);
  EXPECT_HAS(refused.message(), "initializer 'W' is stored as external data");

  const std::string dir = fixture("good_external.onnx").substr(0, fixture("good_external.onnx").rfind('/'));
  auto n = kiln::frontend::inline_external_data(m, dir);
  ASSERT_TRUE(n) << n.message();
  EXPECT_EQ(*n, 6 * 4);
  EXPECT_EQ(kiln::frontend::first_external_tensor(m), "");
  static const std::string inlined = m.SerializeAsString();
  kiln::frontend::register_model_bytes("embedded:inlined_test.onnx", inlined);
  auto g = kiln::frontend::import_onnx("embedded:inlined_test.onnx");
  ASSERT_TRUE(g) << g.message();
  const auto* w = find_init(**g, "W");
  ASSERT_TRUE(w);
  EXPECT_TRUE(kiln::test::tensors_equal(*w->data, Tensor::from_f32({0, 1, 2, 3, 4, 5}, {2, 3})));
}

// ---------------------------------------------------------------- bad inputs

TEST(OnnxImportErrors, NotAnOnnxFile) {
  for (const char* f : {"bad_truncated.onnx", "bad_random.onnx", "bad_text.onnx", "bad_empty.onnx"}) {
    std::string m = import_error(f);
    EXPECT_HAS(m, f);
    EXPECT_TRUE(m.find("not a valid ONNX model") != std::string::npos || m.find("empty file") != std::string::npos ||
                m.find("truncated") != std::string::npos)
        << m;
  }
  EXPECT_HAS(import_error("bad_truncated.onnx"), "truncated");
  std::string m = import_error("does_not_exist.onnx");
  EXPECT_HAS(m, "file not found");
}

TEST(OnnxImportErrors, UnsupportedOpNamesOpNodeAndOpset) {
  std::string m = import_error("bad_unsupported_op.onnx");
  EXPECT_EQ(m, fixture("bad_unsupported_op.onnx") + ": unsupported op 'Foo' (node '/layer/Foo_3', opset 17)");
}

TEST(OnnxImportErrors, NonDefaultDomain) {
  std::string m = import_error("bad_custom_domain.onnx");
  EXPECT_HAS(m, "unsupported op 'FusedMatMul'");
  EXPECT_HAS(m, "com.microsoft");
  EXPECT_HAS(m, "node '/fused'");
}

TEST(OnnxImportErrors, MissingInitializer) {
  std::string m = import_error("bad_missing_initializer.onnx");
  EXPECT_HAS(m, "missing initializer or value 'w_missing' used by node '/Add'");
}

TEST(OnnxImportErrors, OpsetOutOfRange) {
  // Opsets below 13 are upgraded to 13 by ONNX's version converter (Relu-6 -> Relu-13).
  auto g12 = import_ok("bad_opset12.onnx");
  ASSERT_TRUE(g12);
  EXPECT_EQ(g12->opset, 13);
  ASSERT_EQ(g12->nodes().size(), 1u);
  EXPECT_EQ(g12->nodes()[0]->op, "Relu");
  std::string m29 = import_error("bad_opset29.onnx");
  EXPECT_HAS(m29, "opset 29");
  EXPECT_HAS(m29, "newest is opset 28");
  EXPECT_HAS(m29, "13..28");
}

TEST(OnnxImportErrors, ExternalDataOutsideModelFolder) {
  std::string a = import_error("bad_external_absolute.onnx");
  EXPECT_HAS(a, "initializer 'W'");
  EXPECT_HAS(a, "'/tmp/kiln_weights.bin'");
  EXPECT_HAS(a, "absolute");
  std::string d = import_error("bad_external_dotdot.onnx");
  EXPECT_HAS(d, "initializer 'W'");
  EXPECT_HAS(d, "'../secret/weights.bin'");
  EXPECT_HAS(d, "'..'");
  std::string mi = import_error("bad_external_missing.onnx");
  EXPECT_HAS(mi, "initializer 'W'");
  EXPECT_HAS(mi, "'missing_weights.bin'");
  EXPECT_HAS(mi, "not found");
}

TEST(OnnxImportErrors, SubgraphAttribute) {
  std::string m = import_error("bad_subgraph.onnx");
  EXPECT_HAS(m, "'/If'");
  EXPECT_HAS(m, "If");
  // Either If is not in the op table, or its branch attribute is rejected.
  EXPECT_TRUE(m.find("unsupported op 'If'") != std::string::npos || m.find("subgraph") != std::string::npos) << m;
}

// ---------------------------------------------------------------- tensor protos

TEST(TensorProto, TypedFieldsAndErrors) {
  onnx::TensorProto tp;
  tp.set_name("t");
  tp.set_data_type(onnx::TensorProto::INT64);
  tp.add_dims(2);
  tp.add_int64_data(-4);
  tp.add_int64_data(9);
  auto t = kiln::frontend::tensor_from_proto(tp, "");
  ASSERT_TRUE(t) << t.message();
  EXPECT_TRUE(kiln::test::tensors_equal(*t, Tensor::from_i64({-4, 9})));

  tp.add_int64_data(1);  // 3 values for 2 elements
  auto bad = kiln::frontend::tensor_from_proto(tp, "");
  ASSERT_FALSE(bad);
  EXPECT_HAS(bad.message(), "tensor 't'");
  EXPECT_HAS(bad.message(), "int64_data has 3 values");

  onnx::TensorProto raw;
  raw.set_name("r");
  raw.set_data_type(onnx::TensorProto::FLOAT);
  raw.add_dims(3);
  raw.set_raw_data(std::string(8, '\0'));  // 8 bytes for 12
  auto br = kiln::frontend::tensor_from_proto(raw, "");
  ASSERT_FALSE(br);
  EXPECT_HAS(br.message(), "raw_data has 8 bytes");

  onnx::TensorProto str;
  str.set_name("s");
  str.set_data_type(onnx::TensorProto::STRING);
  auto bs = kiln::frontend::tensor_from_proto(str, "");
  ASSERT_FALSE(bs);
  EXPECT_HAS(bs.message(), "tensor 's'");

  onnx::TensorProto nodata;
  nodata.set_name("n");
  nodata.set_data_type(onnx::TensorProto::FLOAT);
  nodata.add_dims(2);
  auto bn = kiln::frontend::tensor_from_proto(nodata, "");
  ASSERT_FALSE(bn);
  EXPECT_HAS(bn.message(), "float_data has 0 values");
}

TEST(TensorProto, SaveLoadRoundTripAndBadFile) {
  Tensor t = Tensor::from_f32({1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -1.0f}, {3, 2});
  std::string p = kiln::test::scratch("frontend_roundtrip_tensor.pb");
  ASSERT_TRUE(kiln::frontend::save_tensor_pb(t, "t", p).is_ok());
  auto back = kiln::frontend::load_tensor_pb(p);
  ASSERT_TRUE(back) << back.message();
  EXPECT_TRUE(kiln::test::tensors_equal(*back, t));
  auto bad = kiln::frontend::load_tensor_pb(fixture("bad_text.onnx"));
  ASSERT_FALSE(bad);
  EXPECT_HAS(bad.message(), "bad_text.onnx");
  auto missing = kiln::frontend::load_tensor_pb(fixture("nope.pb"));
  ASSERT_FALSE(missing);
  EXPECT_HAS(missing.message(), "cannot open");
}

// ---------------------------------------------------------------- --shape bindings

TEST(ShapeBindings, ParseAndErrors) {
  auto ok = kiln::frontend::parse_shape_bindings("batch=8, seq = 64");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->size(), 2u);
  EXPECT_EQ(ok->at("batch"), 8);
  EXPECT_EQ(ok->at("seq"), 64);
  auto empty = kiln::frontend::parse_shape_bindings("");
  ASSERT_TRUE(empty);
  EXPECT_TRUE(empty->empty());
  for (const char* bad : {"batch", "=8", "batch=-1", "batch=x", "batch=8,batch=9", "batch=8,,seq=2", "b=1.5"}) {
    auto r = kiln::frontend::parse_shape_bindings(bad);
    EXPECT_FALSE(r) << bad;
    if (!r) {
      EXPECT_HAS(r.message(), "shape binding");
    }
  }
}

// ---------------------------------------------------------------- robustness

namespace {
std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& path, const std::string& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}
}  // namespace

TEST(OnnxImportErrors, EveryStrictPrefixOfAModelFails) {
  // Top-level fields are serialized by number (ir_version, producer, graph, opset_import), so any
  // strict prefix cuts a length-delimited field or loses opset_import: never a valid model.
  std::string bytes = read_bytes(fixture("good_mlp.onnx"));
  ASSERT_GT(bytes.size(), 100u);
  std::string p = kiln::test::scratch("frontend_prefix.onnx");
  for (size_t len = 0; len < bytes.size(); ++len) {
    write_bytes(p, bytes.substr(0, len));
    auto g = kiln::frontend::import_onnx(p);
    ASSERT_FALSE(g.has_value()) << "prefix of " << len << " bytes imported";
    EXPECT_EQ(g.message().rfind(p + ": ", 0), 0u) << g.message();
    EXPECT_EQ(g.message().find('\n'), std::string::npos) << g.message();
  }
}

TEST(OnnxImportErrors, CorruptedBytesGiveOkOrOneLineError) {
  const unsigned seed = 20240601;
  std::mt19937 rng(seed);
  std::string bytes = read_bytes(fixture("good_torch_tiny.onnx"));
  ASSERT_GT(bytes.size(), 1000u);
  std::string p = kiln::test::scratch("frontend_corrupt.onnx");
  int failed = 0;
  for (int it = 0; it < 200; ++it) {
    std::string b = bytes;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) b[rng() % b.size()] = static_cast<char>(rng() & 0xff);
    write_bytes(p, b);
    auto g = kiln::frontend::import_onnx(p);
    if (!g) {
      ++failed;
      EXPECT_EQ(g.message().find('\n'), std::string::npos) << "seed " << seed << " it " << it << ": " << g.message();
    }
  }
  EXPECT_GT(failed, 0);  // some corruptions must be detected
}

TEST(TensorProto, HugeDimsAreAnErrorNotAnAllocation) {
  onnx::TensorProto tp;
  tp.set_name("huge");
  tp.set_data_type(onnx::TensorProto::FLOAT);
  tp.add_dims(int64_t{1} << 40);
  tp.add_dims(int64_t{1} << 10);
  tp.set_raw_data(std::string(4, '\0'));
  auto r = kiln::frontend::tensor_from_proto(tp, "");
  ASSERT_FALSE(r);
  EXPECT_HAS(r.message(), "raw_data has 4 bytes");
  tp.add_dims(int64_t{1} << 40);
  auto r2 = kiln::frontend::tensor_from_proto(tp, "");
  ASSERT_FALSE(r2);
  EXPECT_HAS(r2.message(), "too many elements");
}

TEST(OnnxImportErrors, LibonnxCheckerErrorBecomesStatus) {
  std::string m = import_error("bad_checker.onnx");
  EXPECT_HAS(m, "ONNX checker");
  EXPECT_HAS(m, "foo");
}

TEST(OnnxImportErrors, KilnInferenceErrorNamesNode) {
  std::string m = import_error("bad_shape_mismatch.onnx");
  EXPECT_HAS(m, "type inference");
  EXPECT_HAS(m, "node '/MatMul' (MatMul)");
}

TEST(OnnxImportErrors, ZeroStrideIsRefusedBeforeLibonnxInference) {
  // libonnx's convPoolShapeInference divides by the stride: these crashed with SIGFPE.
  std::string p = import_error("bad_pool_stride0.onnx");
  EXPECT_HAS(p, "node '/MaxPool' (MaxPool)");
  EXPECT_HAS(p, "strides has 0");
  std::string c = import_error("bad_conv_stride0.onnx");
  EXPECT_HAS(c, "node '/Conv' (Conv)");
  EXPECT_HAS(c, "strides has 0");
}

TEST(OnnxImportErrors, GraphAttributeIsUnsupported) {
  std::string m = import_error("bad_graph_attribute.onnx");
  EXPECT_HAS(m, "node '/Relu' (Relu)");
  EXPECT_HAS(m, "attribute 'body'");
  EXPECT_HAS(m, "subgraph");
}

namespace {

// Writes a one-node model (float inputs/outputs unless `types` says otherwise) to the scratch folder.
std::string write_one_node_model(const std::string& file, int opset, const std::string& op,
                                 const std::vector<std::pair<std::string, std::vector<int64_t>>>& inputs,
                                 const std::vector<int>& input_types, const std::string& output,
                                 const std::vector<int64_t>& output_dims, bool shaped = true) {
  onnx::ModelProto m;
  m.set_ir_version(7);
  auto* imp = m.add_opset_import();
  imp->set_domain("");
  imp->set_version(opset);
  auto* g = m.mutable_graph();
  g->set_name("g");
  auto* n = g->add_node();
  n->set_op_type(op);
  n->set_name("/" + op);
  for (size_t i = 0; i < inputs.size(); ++i) {
    n->add_input(inputs[i].first);
    auto* vi = g->add_input();
    vi->set_name(inputs[i].first);
    auto* tt = vi->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(input_types[i]);
    if (shaped)
      for (int64_t d : inputs[i].second) tt->mutable_shape()->add_dim()->set_dim_value(d);
  }
  n->add_output(output);
  auto* o = g->add_output();
  o->set_name(output);
  o->mutable_type()->mutable_tensor_type()->set_elem_type(onnx::TensorProto::FLOAT);
  auto* os = o->mutable_type()->mutable_tensor_type()->mutable_shape();
  for (int64_t d : output_dims) os->add_dim()->set_dim_value(d);
  std::string path = kiln::test::scratch(file);
  std::ofstream f(path, std::ios::binary);
  m.SerializeToOstream(&f);
  return path;
}

}  // namespace

TEST(OnnxImportErrors, FailedVersionConversionNamesFileAndOpset) {
  // Softmax-12 -> 13 needs the input's rank (the axis semantics changed); without a shape the
  // converter gives up.
  std::string path = write_one_node_model("softmax12_unshaped.onnx", 12, "Softmax", {{"x", {}}},
                                          {onnx::TensorProto::FLOAT}, "y", {}, /*shaped=*/false);
  auto g = kiln::frontend::import_onnx(path);
  ASSERT_FALSE(g);
  const std::string& m = g.message();
  EXPECT_EQ(m.rfind(path + ": ", 0), 0u) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_HAS(m, "cannot upgrade opset 12 model to opset 13");
}

TEST(OnnxImport, ConstantInputsBecomeInitializers) {
  std::string path = write_one_node_model("reducesum_axes_input.onnx", 13, "ReduceSum", {{"x", {2, 3}}, {"axes", {1}}},
                                          {onnx::TensorProto::FLOAT, onnx::TensorProto::INT64}, "y", {2, 1});
  // Without the constant, kiln's static inference cannot shape the output.
  auto plain = kiln::frontend::import_onnx(path);
  ASSERT_FALSE(plain);
  EXPECT_HAS(plain.message(), "axes input must be a constant");
  kiln::frontend::ImportOptions opts;
  opts.constant_inputs["axes"] = Tensor::from_i64({1});
  auto imported = kiln::frontend::import_onnx(path, opts);
  ASSERT_TRUE(imported) << imported.message();
  auto& g = *imported;
  ASSERT_EQ(g->inputs.size(), 1u);
  EXPECT_EQ(g->inputs[0]->name, "x");
  ASSERT_EQ(g->outputs.size(), 1u);
  EXPECT_EQ(g->outputs[0]->shape.to_string(), "[2, 1]");
  // A constant whose dtype differs from the declared input is an error naming the input.
  opts.constant_inputs["axes"] = Tensor::from_f32({1.f}, {1});
  auto bad = kiln::frontend::import_onnx(path, opts);
  ASSERT_FALSE(bad);
  EXPECT_HAS(bad.message(), "constant input 'axes'");
}

// A naive export (eval mode, constant folding) writes a parameter as an Identity alias of
// another: one warning names the aliases and says they train tied; --untie_initializers
// trains them as parameters of their own.
TEST(OnnxImport, IdentityAliasOfAParameterWarnsAndUnties) {
  onnx::ModelProto m;
  m.set_ir_version(8);
  m.add_opset_import()->set_version(17);
  onnx::GraphProto* g = m.mutable_graph();
  g->set_name("g");
  auto* w = g->add_initializer();
  w->set_name("fc1.weight");
  w->set_data_type(onnx::TensorProto::FLOAT);
  w->add_dims(3);
  w->add_dims(3);
  for (int i = 0; i < 9; ++i) w->add_float_data(0.1f * static_cast<float>(i) - 0.3f);
  auto node = [&](const char* op, std::vector<std::string> in, const char* out, const char* name) {
    auto* n = g->add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (auto& s : in) n->add_input(s);
    n->add_output(out);
  };
  node("Identity", {"fc1.weight"}, "fc2.weight", "/Identity");
  node("MatMul", {"x", "fc1.weight"}, "h", "/fc1/MatMul");
  node("MatMul", {"h", "fc2.weight"}, "y", "/fc2/MatMul");
  for (auto [name, list] : {std::pair{"x", g->add_input()}, std::pair{"y", g->add_output()}}) {
    list->set_name(name);
    auto* t = list->mutable_type()->mutable_tensor_type();
    t->set_elem_type(onnx::TensorProto::FLOAT);
    t->mutable_shape()->add_dim()->set_dim_value(2);
    t->mutable_shape()->add_dim()->set_dim_value(3);
  }
  static const std::string bytes = m.SerializeAsString();
  kiln::frontend::register_model_bytes("embedded:identity_alias.onnx", bytes);
  auto count_warnings = [](const Graph& gr) {
    int n = 0;
    for (const std::string& s : gr.import_notes)
      if (s.rfind("warning: ", 0) == 0 && s.find("Identity aliases") != std::string::npos) {
        ++n;
        EXPECT_NE(s.find("'fc2.weight' of 'fc1.weight'"), std::string::npos) << s;
        EXPECT_NE(s.find("trained tied"), std::string::npos) << s;
        EXPECT_NE(s.find("--untie_initializers"), std::string::npos) << s;
      }
    return n;
  };
  auto tied = kiln::frontend::import_onnx("embedded:identity_alias.onnx");
  ASSERT_TRUE(tied) << tied.message();
  EXPECT_EQ(count_warnings(**tied), 1);
  EXPECT_EQ(kiln::ir::trainable_initializers(**tied).size(), 1u);
  kiln::frontend::ImportOptions apart;
  apart.untie_initializers = true;
  auto untied = kiln::frontend::import_onnx("embedded:identity_alias.onnx", apart);
  ASSERT_TRUE(untied) << untied.message();
  EXPECT_EQ(count_warnings(**untied), 0);
  EXPECT_EQ(kiln::ir::trainable_initializers(**untied).size(), 2u);
}
