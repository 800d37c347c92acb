// Eager CPU kernels, by group. Each register_* function sets OpDef::kernel for
// the ops of its group (the same groups as ir/ops/).
#pragma once
#include "ir/op_table.h"

namespace kiln::runtime::kernels {

void register_elementwise_kernels(ir::OpTable& t);
void register_shape_kernels(ir::OpTable& t);
void register_nn_kernels(ir::OpTable& t);
void register_reduction_kernels(ir::OpTable& t);
void register_loss_kernels(ir::OpTable& t);
void register_training_kernels(ir::OpTable& t);
void register_optim8bit_kernels(ir::OpTable& t);   ///< runtime/kernels/optim8bit.cpp
void register_indexing_kernels(ir::OpTable& t);    ///< runtime/kernels/indexing.cpp
void register_collective_kernels(ir::OpTable& t);  ///< runtime/kernels/collective.cpp

/// Test hooks of the 8-bit optimizer kernels (runtime/kernels/optim8bit.cpp).
namespace optim8bit_testing {
/// Caps the instruction set the kernels use: 0 portable C++, 1 AVX2 + FMA, 2 AVX-512
/// (each also needs the CPU's support). Returns the previous cap. Process-wide.
int set_max_isa(int level);
/// The level the kernels use now (the CPU's best, capped).
int active_isa();
/// out[i] = a[i] / b as the active vector path divides (a multiply by RN(1/b) and one FMA
/// correction), n a multiple of 16. False (nothing written) on the portable path.
bool divide_by_reciprocal(const float* a, float b, float* out, int64_t n);
/// Block-wise quantization of x (every element >= +0, not NaN) by the AVX-512 path the
/// 8-bit update takes for the second moment (CodeFinder::codes16_nonneg): codes[0..n),
/// absmax[one per 256-element block]. False (nothing written) below the AVX-512 path.
bool quantize_nonneg(const float* x, int64_t n, const float* qmap, uint8_t* codes, float* absmax);
}  // namespace optim8bit_testing

/// Test hooks of the Dropout kernel (runtime/kernels/elementwise.cpp).
namespace dropout_testing {
/// Caps the path f32/bf16 Dropout takes: 0 portable C++, 1 AVX2, 2 AVX-512 (each also
/// needs the CPU's support); all give the same bits. Returns the previous cap. Process-wide.
int set_max_isa(int level);
/// The path Dropout takes now (the CPU's best, capped).
int active_isa();
}  // namespace dropout_testing

/// Sets the kernel of op `name`; aborts if the op is not in the table (a programming error).
void set_kernel(ir::OpTable& t, const char* name, ir::KernelFn fn);
/// set_kernel for a kernel that writes every element of every output (library steps
/// such as MatMul): its outputs are allocated without a zero fill
/// (OpDef::kernel_writes_all_outputs; checked by tests/runtime/kernel_writes_test.cpp).
void set_kernel_writing_all_outputs(ir::OpTable& t, const char* name, ir::KernelFn fn);

}  // namespace kiln::runtime::kernels
