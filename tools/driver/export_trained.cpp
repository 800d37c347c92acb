// export_trained_model: the original ONNX ModelProto with trained initializers.
#include "tools/driver/export_trained.h"

#include "frontend/model_bytes.h"
#include "runtime/io.h"

#include <onnx/onnx_pb.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <onnx/checker.h>
#include <sstream>

namespace kiln::driver {

Status export_trained_model(const std::string& original_onnx, const std::map<std::string, ir::Tensor>& weights,
                            const std::string& out_path) {
  auto bytes = frontend::read_model_bytes(original_onnx);  // a file, or the model embedded in an AOT binary
  if (!bytes) return bytes.status();
  onnx::ModelProto model;
  if (!model.ParseFromString(*bytes)) return Status::error(original_onnx + ": not a valid ONNX model");
  std::map<std::string, onnx::TensorProto*> inits;
  for (auto& t : *model.mutable_graph()->mutable_initializer()) inits[t.name()] = &t;
  for (auto& [name, w] : weights) {
    auto it = inits.find(name);
    if (it == inits.end()) return Status::error(original_onnx + ": no initializer named '" + name + "' for a trained weight");
    onnx::TensorProto& tp = *it->second;
    std::vector<int64_t> dims(tp.dims().begin(), tp.dims().end());
    if (dims != w.dims())
      return Status::error(original_onnx + ": initializer '" + name + "' has shape " + ir::dims_to_string(dims) +
                           ", the trained weight " + ir::dims_to_string(w.dims()));
    auto orig = ir::dtype_from_onnx(tp.data_type());
    if (!orig) return Status::error(original_onnx + ": initializer '" + name + "': " + orig.message());
    ir::Tensor t = w.dtype() == *orig ? w : w.cast(*orig);
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
  std::string tmp = out_path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out || !model.SerializeToOstream(&out)) return Status::error(out_path + ": cannot write");
    out.flush();
    if (!out) return Status::error(out_path + ": write failed");
  }
  return runtime::io::publish_file(tmp, out_path);  // no model.onnx.tmp left behind on failure
}

}  // namespace kiln::driver
