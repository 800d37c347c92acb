// Helpers shared by op entries, their eager kernels and code generation: the window
// geometry of Conv / MaxPool / AveragePool (ir/ops/nn.cpp, runtime/kernels/nn.cpp;
// kernel_shape, strides, dilations, pads, auto_pad and ceil_mode resolved into explicit
// begin/end pads and output extents, ONNX opsets 11-18), Reduce* axes, and Slice views.
#pragma once
#include <utility>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::ir {

/// Resolved sliding-window geometry over the spatial dims of an N-D op.
struct WindowGeometry {
  std::vector<int64_t> kernel, strides, dilations, pads_begin, pads_end;
  std::vector<Dim> out;  ///< output spatial extents (unknown Dim when an input extent is not static)
  /// Output extents as int64 (valid only when every input extent is static).
  std::vector<int64_t> out_static() const;
};

/// Resolves the window of node attributes `a` (auto_pad NOTSET|SAME_UPPER|SAME_LOWER|VALID,
/// strides, dilations, pads [b1..bn, e1..en], ceil_mode) for spatial input extents `in`
/// and kernel extents `kernel`. ceil_mode follows PyTorch (and ONNX >= 1.16): a last
/// window starting inside the right padding is dropped. Errors: wrong attribute
/// lengths, non-positive strides/dilations, a window larger than the padded input.
Expected<WindowGeometry> window_geometry(const Attributes& a, const std::vector<Dim>& in,
                                         const std::vector<int64_t>& kernel);

/// Resolved axes of a Reduce* node (ONNX ReduceSum-13, ReduceMean/ReduceMax-13 and -18).
struct ReduceSpec {
  std::vector<int> axes;  ///< sorted, unique, non-negative; every axis when the node reduces all
  bool keepdims = true;
  bool noop = false;  ///< empty axes with noop_with_empty_axes=1: the op is the identity
};

/// Reads axes from the attribute `axes` (opsets <= 17) or from the constant input
/// `axes_input` (ReduceSum-13, all Reduce*-18; null when omitted); `axes_given` is
/// true when the node has an axes input even if its value is unknown (then an error).
/// Errors: out-of-range or duplicate axes, non-constant axes.
Expected<ReduceSpec> reduce_spec(const Attributes& a, bool axes_given, const Tensor* axes_input, int rank);

/// Partitions of a float sum over leading axes (kiln's summation order, shared by the
/// eager ReduceSum/ReduceMean, the kernel IR's reference evaluator and the CPU code
/// generator): a sum of `rows` (flat, row-major) rows into each of `cols` trailing
/// columns, with 2 <= K <= 16 partitions of at least 256 rows each and cols <= 2048,
/// is summed in double per partition of contiguous rows [p*rows/K, (p+1)*rows/K) in
/// index order, and the K partial sums are then added in partition order. Returns K,
/// or 0 for the plain index-order sum. Depends on the shape only, never on threads.
int64_t column_sum_partitions(int64_t rows, int64_t cols);
/// The most partitions column_sum_partitions returns.
inline constexpr int64_t kMaxColumnSumPartitions = 16;

/// One dim of an ONNX Slice-13 with its indices clamped (negative start/end count from
/// the end; positive steps clamp to [0, dim], negative ones to [-1, dim - 1]): the first
/// index, the step and the number of elements taken.
struct SliceDim {
  int64_t start = 0, step = 1, len = 0;
};
SliceDim normalize_slice(int64_t dim, int64_t start, int64_t end, int64_t step);

/// The dims [start, end) an ONNX Shape-15 node `attrs` takes of a rank-`rank` input:
/// negative values count from the end, both are clamped to [0, rank] (end may be < start:
/// nothing is taken).
std::pair<int64_t, int64_t> shape_op_range(const Attributes& attrs, int64_t rank);

/// A Slice of a dense row-major tensor of `dims` as a strided view of it: element
/// offset of the first taken element, per-dim element strides (step times the dense
/// stride, negative for negative steps) and the sliced dims (ONNX Slice-13; empty axes =
/// 0..n-1, empty steps = 1). Errors: lengths that differ, an axis out of range, a zero
/// step. Used by Slice's eager kernel and by code generation (a Slice read in place).
struct SliceView {
  int64_t offset = 0;
  std::vector<int64_t> strides, dims;
};
Expected<SliceView> slice_view(const std::vector<int64_t>& dims, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& ends, std::vector<int64_t> axes, std::vector<int64_t> steps);

/// How a guarded view op (ir::is_guarded_view_op) reads its data input `k` at the points
/// of its output: inside the box [lo[d], hi[d]) the output element at index i is input
/// element offset + sum i_d * strides[d] (dense strides of the input; `offset` negative
/// when the box does not start at 0), outside it the op's fill (`fill`: Pad's constant,
/// else 0; a Concat's other inputs). Static shapes and constant operands only.
struct GuardedRead {
  std::vector<int64_t> lo, hi, strides;
  int64_t offset = 0;
  double fill = 0;
  bool fill_operand = false;  ///< `fill` is an operand of the op (Pad's constant), loaded as a constant
};
/// The data inputs of a guarded view op: every input of Concat, input 0 of Pad and
/// SliceGrad, both inputs of AsStridedScatter (data read outside src's box).
std::vector<int> guarded_view_inputs(const Node& n);
/// GuardedRead of data input `k` of `n`. Errors: not a guarded view op, shapes not
/// static, operands not constant, Pad not in constant mode, SliceGrad with a step other
/// than 1, an empty box, an AsStridedScatter whose written elements are not a box.
Expected<GuardedRead> guarded_read(const Node& n, int k);

}  // namespace kiln::ir
