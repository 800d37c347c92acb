// Window geometry shared by the Conv / MaxPool / AveragePool entries (ir/ops/nn.cpp)
// and their eager kernels (runtime/kernels/nn.cpp): resolves kernel_shape,
// strides, dilations, pads, auto_pad and ceil_mode into explicit begin/end pads
// and output extents, following the ONNX spec (opsets 11-18).
#pragma once
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
  bool noop = false;      ///< empty axes with noop_with_empty_axes=1: the op is the identity
};

/// Reads axes from the attribute `axes` (opsets <= 17) or from the constant input
/// `axes_input` (ReduceSum-13, all Reduce*-18; null when omitted); `axes_given` is
/// true when the node has an axes input even if its value is unknown (then an error).
/// Errors: out-of-range or duplicate axes, non-constant axes.
Expected<ReduceSpec> reduce_spec(const Attributes& a, bool axes_given, const Tensor* axes_input, int rank);

}  // namespace kiln::ir
