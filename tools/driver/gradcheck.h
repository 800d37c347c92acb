// Numerical gradient checks in float64 by central differences (ONNX Runtime's
// GradientChecker, Glow's gradient check; DESIGN.md convention 9).
#pragma once
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::driver {

/// Outcome of a gradient check.
struct GradcheckResult {
  double max_rel_error = 0;  ///< max over checked tensors of ||analytic - numeric|| / max(||numeric||, 1e-12)
  std::string worst;         ///< name of the tensor with the largest error
  int64_t elements_checked = 0;
  uint64_t seed = 0;  ///< seed used for inputs/weights (print it on failure)
};

/// Checks the gradient rule of one op. `inputs` are the op's inputs (nullptr-free;
/// float inputs listed in `wrt` are differentiated, all float inputs when `wrt` is
/// empty); they are converted to f64. The scalar loss is sum_k sum(output_k * W_k)
/// with W_k random in [-1, 1] from `seed`. Central differences with step `eps`.
/// `training` selects Dropout/BatchNorm training behaviour (same Philox mask in
/// every evaluation). Errors: inference/kernel/gradient-rule failures.
Expected<GradcheckResult> gradcheck_op(const std::string& op, const std::vector<ir::Tensor>& inputs,
                                       const ir::Attributes& attrs, int num_outputs, uint64_t seed,
                                       std::vector<int> wrt = {}, double eps = 1e-6, bool training = false);

/// Checks a differentiated graph whose outputs are "loss" followed by "<param>.grad"
/// (the driver's grads program, in f64): at most `per_param` randomly chosen elements
/// of each parameter are perturbed. `feeds` hold the data inputs and every state input.
/// Error per parameter: ||analytic - numeric|| / max(||numeric||, 1e-3 * ||all numeric||).
Expected<GradcheckResult> gradcheck_graph(const ir::Graph& grads_program, std::map<std::string, ir::Tensor> feeds,
                                          int per_param, uint64_t seed, double eps = 1e-6);

}  // namespace kiln::driver
