// oneDNN 2.6 helpers of the eager kernels: matmul (batched, broadcast, strided
// operands) and convolution forward / backward-data / backward-weights over plain
// row-major buffers, for f32 and bf16 (bf16 with f32 accumulation). Primitives are
// cached by a shape/dtype key. Convolutions run on the layouts oneDNN chooses
// (format_tag::any: channel-blocked on AVX-512), their operands reordered from and to
// the plain layout around each call through per-thread staging buffers; small ones run
// on one thread. When the CPU has no bf16 implementation (oneDNN 2.x
// needs AVX-512 for bf16), bf16 calls run the f32 primitive on converted copies and
// round the result to bf16 (nearest even), which computes the same function.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
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

/// C (..., M, N) = A (..., M, K) x B (..., K, N) [+ bias]. A, B and C have equal rank >= 2;
/// each batch dim of A and B is 1 or equal to C's. `in_dt` is the dtype of A and B (f32 or
/// bf16), `out_dt` the dtype of the contiguous output C (f32 or bf16). `bias` (optional,
/// dtype out_dt, dense, C's rank, each dim 1 or C's): added to the f32 product before C is
/// rounded to out_dt (oneDNN's matmul bias). Errors name the oneDNN failure; with a bias,
/// also "no implementation" when oneDNN has none for it (the caller adds it itself).
Status matmul(const Operand& a, const Operand& b, void* c, const std::vector<int64_t>& c_dims, ir::DType in_dt,
              ir::DType out_dt, const Operand* bias = nullptr);

/// A matrix product prepared for one set of operand dims, strides, dtypes and bias dims:
/// what a MatMul or Gemm node keeps in its cache slot (KernelContext::cache), so that a
/// call is one oneDNN execute.
struct PreparedMatmul;

/// The direct oneDNN product for these operands (their data pointers are not read), or
/// null where `matmul` takes another way (a transposed A it copies row-major first, a
/// strided operand or a bias only oneDNN's reference code takes, bf16 without bf16
/// kernels): the caller then calls `matmul`.
std::shared_ptr<PreparedMatmul> prepare_matmul(const Operand& a, const Operand& b, const std::vector<int64_t>& c_dims,
                                               ir::DType in_dt, ir::DType out_dt, const Operand* bias = nullptr);

/// Runs `p` on these buffers (laid out as the operands `p` was prepared for; bias null
/// without one). Errors: oneDNN's execution failed.
Status run_matmul(PreparedMatmul& p, const void* a, const void* b, void* c, const void* bias = nullptr);

/// C (M, N) = A (M, K) x B (K, N) through one shape-generic primitive per dtype pair and
/// operand layout: oneDNN's run-time dims (DNNL_RUNTIME_DIM_VAL for M, K and N), built
/// once and run at any shape, so a shape seen for the first time costs no primitive of
/// its own (creating one took 0.2-0.7 ms on AVX-512 / AMX; the shape's own primitive
/// runs up to 2.5x faster in bf16, where oneDNN 2.6 has no AMX kernel with run-time
/// dims, and alike in f32). Rank 2 to 4, batch dims equal (no broadcast); A and B each a
/// dense tensor in some order of its dims (a transposed or permuted view: one of the
/// oneDNN format tags ab, ba, abc, acb, bac, abcd, abdc, acbd, acdb, adbc, adcb, bacd);
/// C dense. Errors: another layout, oneDNN has no implementation with run-time dims
/// ("no matmul implementation"; the caller takes another way), or the execution failed.
Status matmul_any_shape(const Operand& a, const Operand& b, void* c, const std::vector<int64_t>& c_dims,
                        ir::DType in_dt, ir::DType out_dt);

/// Geometry of an N-D convolution in ONNX terms (dilations >= 1, explicit pads).
struct ConvGeometry {
  std::vector<int64_t> x_dims;  ///< (N, C, i...)
  std::vector<int64_t> w_dims;  ///< (M, C/group, k...)
  std::vector<int64_t> y_dims;  ///< (N, M, o...)
  int64_t group = 1;
  std::vector<int64_t> strides, dilations, pads_begin, pads_end;
};

/// Which of a convolution's three primitives.
enum class ConvDirection { forward, backward_data, backward_weights };

/// A convolution primitive prepared for one geometry, dtype, direction and bias choice,
/// with its memory descriptors: what a Conv node's kernel keeps between calls
/// (KernelContext::cache), so that a call is one oneDNN execute without building the
/// descriptors and the cache key again (about 7 us per call at ResNet-18's small shapes).
struct PreparedConv;

/// The primitive for (dir, g, dt, bias), from the process-wide primitive cache or built
/// now; never null. A geometry oneDNN cannot run is reported by run_conv. `compute` (f32
/// or bf16; undefined: dt) is the dtype the primitive computes in: a bf16 convolution
/// with compute f32 converts its bf16 operands to f32 in the reorders that stage them into
/// oneDNN's blocked layouts (and rounds the result to bf16, nearest even, in the one that
/// stages it out), so it runs the f32 kernel at almost no extra cost; the same function as
/// a bf16 primitive (bf16 products are exact in f32; both accumulate in f32).
/// `mixed` (compute f32 only): the dtypes (f32 or bf16) of the operands (a, b, out,
/// bias; as run_conv orders them) where they differ from dt: a mixed-precision
/// convolution reading f32 master weights or an f32 graph input beside bf16 activations
/// (autocast rule (e), passes/autocast.cpp).
std::shared_ptr<PreparedConv> prepare_conv(ConvDirection dir, const ConvGeometry& g, ir::DType dt, bool bias,
                                           ir::DType compute = ir::DType::undefined,
                                           const std::array<ir::DType, 4>* mixed = nullptr);

/// Runs `p`: forward: a = x, b = w, bias (null without), out = y; backward_data: a = dy,
/// b = w, out = dx; backward_weights: a = dy, b = x, out = dw. Buffers are dense row-major
/// in the dtypes p was prepared for. Errors: oneDNN has no implementation of the primitive
/// (f32), or its execution failed.
Status run_conv(PreparedConv& p, const void* a, const void* b, const void* bias, void* out);

}  // namespace kiln::runtime::kernels::onednn
