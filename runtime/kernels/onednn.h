// oneDNN 2.6 helpers of the eager kernels: matmul (batched, broadcast, strided
// operands) and convolution forward / backward-data / backward-weights over plain
// row-major buffers, for f32 and bf16 (bf16 with f32 accumulation). Primitives are
// cached by a shape/dtype key. When the CPU has no bf16 implementation (oneDNN 2.x
// needs AVX-512 for bf16), bf16 calls run the f32 primitive on converted copies and
// round the result to bf16 (nearest even), which computes the same function.
#pragma once
#include <cstdint>
#include <vector>

#include "ir/dtype.h"
#include "ir/status.h"

namespace kiln::runtime::kernels::onednn {

/// A dense operand: dims and strides in elements (row-major when strides is empty).
struct Operand {
  const void* data = nullptr;
  std::vector<int64_t> dims;
  std::vector<int64_t> strides;
};

/// C (..., M, N) = A (..., M, K) x B (..., K, N). A, B and C have equal rank >= 2; each
/// batch dim of A and B is 1 or equal to C's. `in_dt` is the dtype of A and B (f32 or
/// bf16), `out_dt` the dtype of the contiguous output C (f32 or bf16). Errors name
/// the oneDNN failure.
Status matmul(const Operand& a, const Operand& b, void* c, const std::vector<int64_t>& c_dims, ir::DType in_dt,
              ir::DType out_dt);

/// Geometry of an N-D convolution in ONNX terms (dilations >= 1, explicit pads).
struct ConvGeometry {
  std::vector<int64_t> x_dims;  ///< (N, C, i...)
  std::vector<int64_t> w_dims;  ///< (M, C/group, k...)
  std::vector<int64_t> y_dims;  ///< (N, M, o...)
  int64_t group = 1;
  std::vector<int64_t> strides, dilations, pads_begin, pads_end;
};

/// y = conv(x, w) + b (b may be null; same dtype as x). dt: f32 or bf16 for x, w, b, y.
Status conv_forward(const ConvGeometry& g, const void* x, const void* w, const void* b, void* y, ir::DType dt);
/// dx = conv_backward_data(dy, w). dt: f32 or bf16.
Status conv_backward_data(const ConvGeometry& g, const void* dy, const void* w, void* dx, ir::DType dt);
/// dw = conv_backward_weights(dy, x). dt: f32 or bf16.
Status conv_backward_weights(const ConvGeometry& g, const void* dy, const void* x, void* dw, ir::DType dt);

/// Converts n bf16 values to f32.
std::vector<float> bf16_to_f32(const void* src, int64_t n);
/// Rounds n f32 values to bf16 (nearest even).
void f32_to_bf16(const float* src, void* dst, int64_t n);

}  // namespace kiln::runtime::kernels::onednn
