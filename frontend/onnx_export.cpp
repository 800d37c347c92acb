// kiln IR -> ONNX export (see onnx_import.h, export_onnx).
//
// Builds a ModelProto (ir_version 8, opset_import {"": g.opset}, producer "kiln"):
// initializers as raw_data TensorProtos, graph inputs/outputs as ValueInfoProtos with
// elem_type and shape (static dims as dim_value, symbolic dims as dim_param, unknown dims
// left empty), nodes with their attributes (kiln_* attributes dropped; trailing omitted
// inputs trimmed, omitted inputs in the middle written as ""). kiln-internal ops
// (OpDef::onnx == false) and nested regions cannot be expressed and are errors. For
// opsets libonnx 1.12 knows (<= 17) the model must pass onnx::checker::check_model before
// it is written; the file is written to "<path>.tmp" and renamed.
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include <filesystem>
#include <fstream>

#include "frontend/onnx_import.h"
#include "frontend/tensor_proto.h"
#include "ir/op_table.h"

namespace kiln::frontend {

namespace {

Status fill_value_info(const ir::Value* v, onnx::ValueInfoProto* vi, const std::string& what) {
  if (v->dtype == ir::DType::undefined) return Status::error(what + " '" + v->name + "' has no dtype");
  vi->set_name(v->name);
  auto* tt = vi->mutable_type()->mutable_tensor_type();
  tt->set_elem_type(ir::dtype_to_onnx(v->dtype));
  auto* sh = tt->mutable_shape();
  for (const ir::Dim& d : v->shape.dims) {
    auto* dp = sh->add_dim();
    if (d.is_static())
      dp->set_dim_value(d.value);
    else if (d.is_symbolic())
      dp->set_dim_param(d.to_string());
  }
  return Status::ok();
}

Status fill_attribute(const std::string& key, const ir::AttrValue& v, onnx::AttributeProto* a, const std::string& who) {
  using A = onnx::AttributeProto;
  a->set_name(key);
  if (auto p = std::get_if<int64_t>(&v)) {
    a->set_type(A::INT);
    a->set_i(*p);
  } else if (auto p = std::get_if<double>(&v)) {
    a->set_type(A::FLOAT);
    a->set_f(static_cast<float>(*p));
  } else if (auto p = std::get_if<std::string>(&v)) {
    a->set_type(A::STRING);
    a->set_s(*p);
  } else if (auto p = std::get_if<std::vector<int64_t>>(&v)) {
    a->set_type(A::INTS);
    for (int64_t x : *p) a->add_ints(x);
  } else if (auto p = std::get_if<std::vector<double>>(&v)) {
    a->set_type(A::FLOATS);
    for (double x : *p) a->add_floats(static_cast<float>(x));
  } else if (auto p = std::get_if<std::vector<std::string>>(&v)) {
    a->set_type(A::STRINGS);
    for (const auto& x : *p) a->add_strings(x);
  } else if (auto p = std::get_if<ir::Tensor>(&v)) {
    a->set_type(A::TENSOR);
    auto tp = tensor_to_proto(*p, "");
    if (!tp) return Status::error(who + ": attribute '" + key + "': " + tp.message());
    *a->mutable_t() = std::move(*tp);
  }
  return Status::ok();
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

}  // namespace

Status export_onnx(const ir::Graph& g, const std::string& path) {
  auto fail = [&](const std::string& m) { return Status::error(path + ": export: " + m); };
  onnx::ModelProto m;
  m.set_ir_version(8);
  m.set_producer_name("kiln");
  m.set_producer_version("0.1.0");
  auto* op = m.add_opset_import();
  op->set_domain("");
  op->set_version(g.opset);
  auto* gp = m.mutable_graph();
  gp->set_name(g.name.empty() ? "main" : g.name);

  for (const ir::Value* v : g.initializers) {
    if (!v->data) return fail("initializer '" + v->name + "' has no data");
    auto tp = tensor_to_proto(*v->data, v->name);
    if (!tp) return fail(tp.message());
    *gp->add_initializer() = std::move(*tp);
  }
  for (const ir::Value* v : g.inputs) {
    Status s = fill_value_info(v, gp->add_input(), "graph input");
    if (!s) return fail(s.message());
  }
  const auto& table = ir::OpTable::get();
  for (const auto& n : g.nodes()) {
    std::string who = "node '" + n->name + "' (" + n->op + ")";
    const ir::OpDef* def = table.find(n->op);
    if (!def) return fail(who + ": op '" + n->op + "' is not in the op table");
    if (!def->onnx) return fail(who + ": op '" + n->op + "' is kiln-internal and has no ONNX equivalent");
    if (!n->regions.empty()) return fail(who + ": nodes with nested regions cannot be exported to ONNX");
    auto* np = gp->add_node();
    np->set_op_type(n->op);
    np->set_name(n->name);
    size_t nin = n->inputs.size();
    while (nin > 0 && n->inputs[nin - 1] == nullptr) --nin;
    for (size_t i = 0; i < nin; ++i) np->add_input(n->inputs[i] ? n->inputs[i]->name : std::string());
    for (const ir::Value* o : n->outputs) np->add_output(o->name);
    for (const auto& [k, v] : n->attrs.all()) {
      if (k.rfind("kiln_", 0) == 0) continue;
      Status s = fill_attribute(k, v, np->add_attribute(), who);
      if (!s) return fail(s.message());
    }
  }
  for (const ir::Value* v : g.outputs) {
    if (!v) return fail("graph has a null output");
    Status s = fill_value_info(v, gp->add_output(), "graph output");
    if (!s) return fail(s.message());
  }

  if (g.opset <= 17) {
    try {
      onnx::checker::check_model(m);
    } catch (const std::exception& e) {
      return fail("the exported model fails the ONNX checker: " + one_line(e.what()));
    }
  }
  if (m.ByteSizeLong() > static_cast<size_t>(INT32_MAX))
    return fail("model is larger than 2 GiB (protobuf limit); external-data export is not supported");
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return fail("cannot open '" + tmp + "' for writing");
    if (!m.SerializeToOstream(&out)) return fail("cannot write '" + tmp + "'");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);  // no .tmp left behind
    return fail("cannot rename '" + tmp + "': " + why);
  }
  return Status::ok();
}

}  // namespace kiln::frontend
