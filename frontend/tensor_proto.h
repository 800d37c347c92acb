// Conversion between ONNX TensorProto and kiln host tensors (ir::Tensor).
//
// Reads every storage form of the ONNX spec (onnx/onnx.proto, TensorProto):
// raw_data, the typed fields (float_data, double_data, int64_data, and int32_data,
// which also carries i32/i8/u8/bool values and the uint16 bit patterns of f16/bf16),
// and external data (data_location = EXTERNAL with location/offset/length entries),
// resolved only inside the model's directory.
#pragma once
#include <onnx/onnx_pb.h>

#include <string>

#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::frontend {

/// Converts an ONNX TensorProto into a host tensor (fresh storage, row-major).
/// `model_dir` is the folder external data is read from ("" = current folder).
/// Errors (one line, naming the tensor): unsupported element type (string, complex,
/// uint16/32/64, ...), negative dims, data size not matching the dims, sparse or
/// segmented tensors, and for external data: an absolute location, a location with a
/// `..` component, a missing/unreadable file, or offset+length outside the file.
Expected<ir::Tensor> tensor_from_proto(const onnx::TensorProto& tp, const std::string& model_dir);

/// Reads a file holding one serialized TensorProto (as the input_0.pb / output_0.pb
/// files of ONNX's backend test data). External data is resolved next to the file.
/// Errors name the file: unreadable, not a TensorProto, or any tensor_from_proto error.
Expected<ir::Tensor> load_tensor_pb(const std::string& path);

/// Converts a host tensor into a TensorProto named `name` with the data in raw_data
/// (little-endian, as the ONNX spec requires). Error for DType::undefined.
Expected<onnx::TensorProto> tensor_to_proto(const ir::Tensor& t, const std::string& name);

/// Writes `t` as one serialized TensorProto file (the inverse of load_tensor_pb).
Status save_tensor_pb(const ir::Tensor& t, const std::string& name, const std::string& path);

/// Replaces every external-data tensor of `model` (initializers, and tensor attributes of
/// nodes, subgraphs included) by the same tensor stored inline (raw_data), read from
/// `model_dir` as tensor_from_proto reads it, so the model stands on its own (a trained
/// model, the model a `kiln compile` binary embeds). Returns the bytes now inline. Errors:
/// any tensor_from_proto error, naming the tensor.
Expected<int64_t> inline_external_data(onnx::ModelProto& model, const std::string& model_dir);

/// Name of the first tensor of `model` (as inline_external_data visits them) stored as
/// external data, or "" when it has none.
std::string first_external_tensor(const onnx::ModelProto& model);

}  // namespace kiln::frontend
