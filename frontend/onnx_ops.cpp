#include "frontend/onnx_ops.h"

#include <map>

namespace kiln::frontend {

namespace {

std::map<std::string, OnnxOpInfo> build_table() {
  std::map<std::string, OnnxOpInfo> t;
  t["Constant"].constant = true;
  for (const char* op : {"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool",
                         "MaxUnpool", "MaxRoiPool", "Col2Im", "DeformConv"})
    t[op].windowed = true;
  t["Gather"].module_params = {{0, "weight"}};
  for (const char* op : {"Gemm", "Conv", "LayerNormalization", "BatchNormalization"})
    t[op].module_params = {{1, "weight"}, {2, "bias"}};
  t["MatMul"].module_params = {{1, "weight"}};
  t["Mul"].module_params = {{0, "weight"}, {1, "weight"}};
  t["Add"].module_params = {{0, "bias"}, {1, "bias"}};
  t["Gemm"].dropped_bias = DroppedBias::gemm_out_columns;
  t["Conv"].dropped_bias = DroppedBias::weight_rows;
  t["LayerNormalization"].dropped_bias = DroppedBias::like_weight;
  t["MatMul"].linear_weight_input = 1;
  return t;
}

}  // namespace

const OnnxOpInfo* onnx_op_info(const std::string& op_type) {
  static const std::map<std::string, OnnxOpInfo> table = build_table();
  auto it = table.find(op_type);
  return it == table.end() ? nullptr : &it->second;
}

}  // namespace kiln::frontend
