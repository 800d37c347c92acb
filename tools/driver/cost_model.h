// The step-time cost model of `kiln fit` (issue 33): a roofline per node of a built
// training step (FLOPs and bytes from the op table, ir::node_cost), with the machine's
// rates measured once by short microbenchmarks of the same eager kernels the programs
// call (oneDNN matmul and convolution, a streaming pointwise op) and kept in the cache
// folder. It ranks recipes; it does not replace measuring them.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::driver {

/// Achieved FLOP/s of one library kernel kind at several problem sizes: (FLOPs of one
/// call, FLOP/s) pairs, ascending in FLOPs. rate() interpolates linearly in log(FLOPs)
/// and holds the end values outside the measured range (small calls run below the
/// machine's peak: their rate is what makes a small microbatch slower per sample).
struct RateCurve {
  std::vector<std::pair<double, double>> points;
  /// FLOP/s for a call of `flops` FLOPs (0 when the curve is empty).
  double rate(double flops) const;
};

/// The machine's measured rates (seconds and bytes are SI units).
struct MachineRates {
  std::string machine;           ///< CPU model name and OpenMP thread count the rates belong to
  RateCurve matmul_f32, matmul_bf16;  ///< MatMul (OpTrait::matmul ops) by operand dtype
  RateCurve conv_f32, conv_bf16;      ///< other library ops (Conv and its gradients)
  double bandwidth = 0;  ///< bytes/s (read + written) of a large streaming pointwise op
  double launch_s = 0;   ///< seconds of a one-element kernel: the fixed cost of every node
  double calibrate_s = 0;  ///< seconds the microbenchmarks took (0: read from the cache)
};

/// The CPU model (/proc/cpuinfo "model name") and OpenMP thread count: the key of the
/// cached rates.
std::string machine_key();

/// The rates of this machine: read from `<cache_dir>/fit_rates.json` when it holds this
/// machine_key(), else measured (about a second: MatMul and Conv in f32 and bf16 at
/// three sizes each, an Add of 8 Mi elements, a one-element Add) and written there
/// (cache_dir empty: codegen::default_cache_dir(); an unwritable folder only skips the
/// write). Errors: a microbenchmark's kernel fails (names the op).
Expected<MachineRates> machine_rates(const std::string& cache_dir, bool no_cache = false);

/// Estimated seconds of one execution of `g` (a training step after every pass): per
/// node, launch_s plus FLOPs over the library curve (library ops) or bytes over the
/// bandwidth (everything else; views cost nothing); an AccumulationLoop's body counts
/// trip_count times.
double estimate_step_seconds(const ir::Graph& g, const MachineRates& r);

}  // namespace kiln::driver
