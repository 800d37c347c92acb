// ONNX -> IR import and IR -> ONNX export (libonnx + protobuf).
#pragma once
#include <map>
#include <memory>
#include <string>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::frontend {

/// Options of an import.
struct ImportOptions {
  /// Values of ONNX dim_param symbols (e.g. {"batch": 8, "seq": 64}); unbound symbols stay symbolic.
  std::map<std::string, int64_t> bind_dims;
  /// Fold shape-computation subgraphs (Shape, Gather, Concat, ...) once shapes are static.
  bool fold_constants = true;
};

/// Imports an ONNX model file. Errors (one line, naming the file and the node/op/initializer at fault):
/// unreadable or non-ONNX file, failed checker, unsupported op (with node name and opset),
/// missing initializer, external data outside the model's folder.
Expected<std::unique_ptr<ir::Graph>> import_onnx(const std::string& path, const ImportOptions& opts = {});

/// Writes `g` as an ONNX model (opset g.opset, initializers as raw_data) that passes the ONNX checker.
Status export_onnx(const ir::Graph& g, const std::string& path);

}  // namespace kiln::frontend
