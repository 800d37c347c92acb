// Writes a trained model: the original ONNX file with its initializers replaced by
// trained weights (everything else - graph, opset, metadata - kept byte for byte, but
// for the parameters the importer restored that the file lacks: added initializers).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::driver {

/// Reads `original_onnx` and writes each trained weight of `weights` into the file's
/// initializer of its name, or where `origins` (ir::Graph::initializer_origins of the
/// imported model) places it: also into the initializers holding a copy, transpose,
/// leading slice or broadcast of it (ties the importer restored), or into a new
/// initializer read by the node that reads it in kiln (parameters the exporter merged or
/// dropped: an input set or appended, or an Add after a Linear's MatMul). Values are
/// cast to the initializer's original dtype, stored as raw_data; external data of the
/// original is read in, and past 1 GiB of weights tensors go to `out_path`.data.
/// Writes `out_path` (and its .data) via .tmp + rename. Errors: unreadable/unparsable model, a
/// weight with no place in the file, a shape that differs, write failure.
Status export_trained_model(const std::string& original_onnx, const std::map<std::string, ir::Tensor>& weights,
                            const std::map<std::string, std::vector<ir::InitializerOrigin>>& origins,
                            const std::string& out_path);

}  // namespace kiln::driver
