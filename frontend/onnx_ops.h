// The frontend's table of ONNX op types: what import needs to know about an op as the
// exporters write it, before or beside kiln's own op table (ir/op_table.h). One entry
// per ONNX op type; the import code asks this table instead of comparing op names.
#pragma once
#include <string>
#include <vector>

namespace kiln::frontend {

/// An input of an ONNX op that holds a PyTorch module's parameter (`weight` or `bias`).
struct ModuleParam {
  int input;
  const char* suffix;  ///< "weight" or "bias"
};

/// How to rebuild a zero bias that an exporter dropped (a fresh model's zeros), from the
/// op's weight (input 1) of dims `wd`.
enum class DroppedBias {
  none,             ///< not rebuilt
  like_weight,      ///< zeros of the weight's dims (LayerNormalization)
  weight_rows,      ///< (wd[0]) (Conv: output channels)
  gemm_out_columns  ///< (wd[0]) when attribute transB is 1, else (wd[1]) (Gemm)
};

/// What import knows about one ONNX op type.
struct OnnxOpInfo {
  /// Becomes an initializer at import (Constant), never a node.
  bool constant = false;
  /// Has convolution / pooling window attributes (kernel_shape, strides, dilations) that
  /// must be positive before libonnx's shape inference divides by them.
  bool windowed = false;
  /// Inputs holding a PyTorch module's parameters, as the exporters lower nn.Embedding,
  /// nn.Linear, HF Conv1D, norms and convolutions.
  std::vector<ModuleParam> module_params;
  DroppedBias dropped_bias = DroppedBias::none;
  /// The op a Linear on 3-D input exports as (MatMul, then an Add of the bias): the input
  /// holding its weight as W^T (in, out); -1: not such an op.
  int linear_weight_input = -1;
};

/// The entry of ONNX op type `op_type` (default domain), or nullptr when import knows
/// nothing particular about it.
const OnnxOpInfo* onnx_op_info(const std::string& op_type);

}  // namespace kiln::frontend
