// Writes a trained model: the original ONNX file with its initializers replaced by
// trained weights (everything else - graph, opset, metadata - kept byte for byte).
#pragma once
#include <map>
#include <string>

#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::driver {

/// Reads `original_onnx`, replaces every initializer named in `weights` (cast to the
/// initializer's original dtype, stored as raw_data, external data inlined) and writes
/// `out_path` (via out_path.tmp + rename). Errors: unreadable/unparsable model, a
/// weight with no initializer of that name, a shape that differs, write failure.
Status export_trained_model(const std::string& original_onnx, const std::map<std::string, ir::Tensor>& weights,
                            const std::string& out_path);

}  // namespace kiln::driver
