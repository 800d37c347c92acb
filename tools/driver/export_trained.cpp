// export_trained_model: the original ONNX ModelProto with trained initializers.
#include "tools/driver/export_trained.h"

#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "frontend/initializers.h"
#include "frontend/model_bytes.h"
#include "frontend/tensor_proto.h"
#include "runtime/io.h"

namespace kiln::driver {

namespace {

/// The tensor an initializer of dims `dims` holds when it is `view` of trained weight w.
Expected<ir::Tensor> view_of(const ir::Tensor& w, const std::string& view, const std::vector<int64_t>& dims) {
  ir::Tensor out(w.dtype(), dims);
  if (view.empty()) {
    if (w.dims() != dims)
      return Status::error("shape " + ir::dims_to_string(dims) + ", the trained weight " +
                           ir::dims_to_string(w.dims()));
    return w;
  }
  if (view == "transpose") {
    if (w.rank() != 2 || dims.size() != 2 || dims[0] != w.dims()[1] || dims[1] != w.dims()[0])
      return Status::error("shape " + ir::dims_to_string(dims) + " is not the transpose of " +
                           ir::dims_to_string(w.dims()));
    return frontend::transpose_2d(w);
  }
  if (view == "slice") {  // the leading elements (a leading slice along the first non-unit dim)
    if (out.numel() > w.numel()) return Status::error("a slice larger than the weight");
    std::memcpy(out.raw(), w.raw(), out.nbytes());
    return out;
  }
  if (view == "broadcast") {  // copies of the weight along new leading dims
    if (w.numel() == 0 || out.numel() % w.numel()) return Status::error("not a broadcast of the weight");
    for (int64_t b = 0; b < out.numel() / w.numel(); ++b)
      std::memcpy(static_cast<char*>(out.raw()) + b * w.nbytes(), w.raw(), w.nbytes());
    return out;
  }
  return Status::error("unknown view '" + view + "'");
}

void set_raw(onnx::TensorProto& tp, const ir::Tensor& t) {
  tp.clear_float_data();
  tp.clear_double_data();
  tp.clear_int32_data();
  tp.clear_int64_data();
  tp.clear_uint64_data();
  tp.clear_string_data();
  tp.clear_external_data();
  tp.set_data_location(onnx::TensorProto::DEFAULT);
  tp.set_raw_data(std::string(static_cast<const char*>(t.raw()), t.nbytes()));  // little-endian host
}

}  // namespace

Status export_trained_model(const std::string& original_onnx, const std::map<std::string, ir::Tensor>& weights,
                            const std::map<std::string, std::vector<ir::InitializerOrigin>>& origins,
                            const std::string& out_path) {
  auto bytes = frontend::read_model_bytes(original_onnx);  // a file, or the model embedded in an AOT binary
  if (!bytes) return bytes.status();
  onnx::ModelProto model;
  if (!model.ParseFromString(*bytes)) return Status::error(original_onnx + ": not a valid ONNX model");
  auto* graph = model.mutable_graph();
  const int file_nodes = graph->node_size();
  std::map<std::string, int> inits;
  for (int i = 0; i < graph->initializer_size(); ++i) inits[graph->initializer(i).name()] = i;
  std::vector<std::pair<int, std::string>> adds;  // (node, bias initializer): an Add after the node
  std::set<int> dropped;                          // Identity aliases replaced by their own parameter
  for (auto& [name, w] : weights) {
    std::vector<ir::InitializerOrigin> places = {{name, "", -1, -1}};
    if (auto o = origins.find(name); o != origins.end()) places = o->second;
    for (const ir::InitializerOrigin& p : places) {
      if (p.onnx_name.empty()) {  // a parameter the file lacks: a new initializer, read by p.node
        if (p.node < 0 || p.node >= file_nodes)
          return Status::error(original_onnx + ": no place in the file for the trained weight '" + name + "'");
        onnx::TensorProto* tp = graph->add_initializer();
        tp->set_name(name);
        tp->set_data_type(ir::dtype_to_onnx(w.dtype()));
        for (int64_t d : w.dims()) tp->add_dims(d);
        set_raw(*tp, w);
        frontend::declare_parameter(model, name);
        onnx::NodeProto* n = graph->mutable_node(p.node);
        if (p.input == ir::InitializerOrigin::kReplacesNode)
          dropped.insert(p.node);  // the alias it was
        else if (p.input < 0)
          adds.push_back({p.node, name});
        else if (p.input < n->input_size())
          n->set_input(p.input, name);
        else {
          while (n->input_size() < p.input) n->add_input("");
          n->add_input(name);
        }
        continue;
      }
      auto it = inits.find(p.onnx_name);
      if (it == inits.end())
        return Status::error(original_onnx + ": no initializer named '" + p.onnx_name + "' for the trained weight '" +
                             name + "'");
      onnx::TensorProto& tp = *graph->mutable_initializer(it->second);
      std::vector<int64_t> dims(tp.dims().begin(), tp.dims().end());
      auto v = view_of(w, p.view, dims);
      if (!v)
        return Status::error(original_onnx + ": initializer '" + p.onnx_name + "' for '" + name + "': " + v.message());
      auto orig = ir::dtype_from_onnx(tp.data_type());
      if (!orig) return Status::error(original_onnx + ": initializer '" + p.onnx_name + "': " + orig.message());
      set_raw(tp, v->dtype() == *orig ? *v : v->cast(*orig));
      // A trained copy the roles of the file call constant (--untie_initializers) is
      // declared a parameter, so the trained model re-imports with what was trained.
      if (p.onnx_name == name && p.view.empty()) frontend::declare_parameter(model, name);
    }
  }
  // Dropped Linear biases: y = MatMul(...) becomes y' = Add(y, bias), read where y was.
  for (auto& [node, bias] : adds) {
    const std::string y = graph->node(node).output(0), yb = y + "/" + bias;
    for (auto& n : *graph->mutable_node())
      for (auto& in : *n.mutable_input())
        if (in == y) in = yb;
    for (auto& o : *graph->mutable_output())
      if (o.name() == y) o.set_name(yb);
    onnx::NodeProto* add = graph->add_node();
    add->set_op_type("Add");
    add->set_name(yb);
    add->add_input(y);
    add->add_input(bias);
    add->add_output(yb);
  }
  // New nodes were appended: keep the node list topologically sorted (each Add right
  // after its MatMul); replaced aliases leave.
  if (!adds.empty() || !dropped.empty()) {
    std::vector<onnx::NodeProto> nodes(graph->node().begin(), graph->node().end());
    graph->clear_node();
    std::map<int, int> add_of;
    for (size_t a = 0; a < adds.size(); ++a) add_of[adds[a].first] = file_nodes + static_cast<int>(a);
    for (int i = 0; i < file_nodes; ++i) {
      if (!dropped.count(i)) *graph->add_node() = nodes[static_cast<size_t>(i)];
      if (auto a = add_of.find(i); a != add_of.end()) *graph->add_node() = nodes[static_cast<size_t>(a->second)];
    }
  }
  // Initializers the run did not train (buffers, constants) may still point into the
  // original's external-data file: read them in, so the output stands on its own.
  const std::string model_dir = std::filesystem::path(original_onnx).parent_path().string();
  if (auto in = frontend::inline_external_data(model, model_dir); !in)
    return Status::error(original_onnx + ": " + in.message());
  int64_t total = 0;
  for (auto& tp : *graph->mutable_initializer()) total += static_cast<int64_t>(tp.raw_data().size());
  // The result must stay a valid model: libonnx's checker (opsets it knows).
  int64_t opset = 0;
  for (auto& imp : model.opset_import())
    if (imp.domain().empty() || imp.domain() == "ai.onnx") opset = imp.version();
  if (opset <= 17) {
    try {
      onnx::checker::check_model(model);
    } catch (const std::exception& e) {
      return Status::error(out_path + ": the trained model fails the ONNX checker: " + std::string(e.what()));
    }
  }
  // A protobuf message cannot exceed 2 GiB: past 1 GiB of weights, tensors of 1 KiB or
  // more go to OUT.data beside the model (ONNX external data, as torch.onnx writes it).
  std::string data_path, data_tmp;
  if (total > (int64_t{1} << 30)) {
    data_path = out_path + ".data";
    data_tmp = data_path + ".tmp";
    std::ofstream data(data_tmp, std::ios::binary | std::ios::trunc);
    if (!data) return Status::error(data_path + ": cannot write");
    int64_t offset = 0;
    const std::string location = std::filesystem::path(data_path).filename().string();
    for (auto& tp : *graph->mutable_initializer()) {
      const std::string& raw = tp.raw_data();
      if (raw.size() < 1024) continue;
      data.write(raw.data(), static_cast<std::streamsize>(raw.size()));
      auto add = [&](const std::string& k, const std::string& v) {
        auto* e = tp.add_external_data();
        e->set_key(k);
        e->set_value(v);
      };
      add("location", location);
      add("offset", std::to_string(offset));
      add("length", std::to_string(raw.size()));
      offset += static_cast<int64_t>(raw.size());
      tp.clear_raw_data();
      tp.set_data_location(onnx::TensorProto::EXTERNAL);
    }
    data.flush();
    if (!data) {
      std::filesystem::remove(data_tmp);
      return Status::error(data_path + ": write failed");
    }
  }
  std::string tmp = out_path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out || !model.SerializeToOstream(&out)) return Status::error(out_path + ": cannot write");
    out.flush();
    if (!out) return Status::error(out_path + ": write failed");
  }
  if (!data_path.empty())
    if (Status st = runtime::io::publish_file(data_tmp, data_path); !st.ok()) return st;
  return runtime::io::publish_file(tmp, out_path);  // no model.onnx.tmp left behind on failure
}

}  // namespace kiln::driver
