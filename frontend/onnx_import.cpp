#include "frontend/onnx_import.h"

namespace kiln::frontend {

Expected<std::unique_ptr<ir::Graph>> import_onnx(const std::string& path, const ImportOptions&) {
  return Status::error(path + ": ONNX import not implemented yet");
}

Status export_onnx(const ir::Graph&, const std::string& path) {
  return Status::error(path + ": ONNX export not implemented yet");
}

}  // namespace kiln::frontend
