// Frontend-internal helpers shared by the importer and tensor_proto.cpp.
#pragma once
#include <onnx/onnx_pb.h>

#include <string>

#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::frontend {

/// tensor_from_proto with the tensor named `who` in error messages
/// (e.g. "initializer 'fc.weight'" or "Constant node '/Constant_3'").
Expected<ir::Tensor> tensor_from_proto_named(const onnx::TensorProto& tp, const std::string& model_dir,
                                             const std::string& who);

}  // namespace kiln::frontend
