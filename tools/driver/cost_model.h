// The step-time cost model of `kiln fit` (issue 33): a roofline per node of a built
// training step (FLOPs and bytes from the op table, ir::node_cost), with the machine's
// rates measured once by short microbenchmarks of the same eager kernels the programs
// call (oneDNN matmul and convolution, a streaming pointwise op) and kept in the cache
// folder. It ranks recipes; it does not replace measuring them.
#pragma once
#include <map>
#include <memory>
#include <mutex>
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
  std::string machine;                ///< CPU model name and OpenMP thread count the rates belong to
  RateCurve matmul_f32, matmul_bf16;  ///< MatMul (OpTrait::matmul ops) by operand dtype
  RateCurve conv_f32, conv_bf16;      ///< other library ops (Conv and its gradients)
  double bandwidth = 0;               ///< bytes/s (read + written) of a large streaming pointwise op
  /// Seconds every modelled node pays besides its bytes: a small OpenMP parallel loop's
  /// time (a generated kernel's region), at least a one-element eager kernel's dispatch.
  double launch_s = 0;
  double calibrate_s = 0;  ///< seconds the microbenchmarks took (0: read from the cache)
};

/// The CPU model (/proc/cpuinfo "model name"), OpenMP thread count and OMP_WAIT_POLICY
/// (when set): the key of the cached rates and kernel timings.
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

/// Eager kernels (library ops such as MatMul and Conv and their gradients, and the other
/// ops the compiled backend runs as eager kernels: normalizations, pooling, losses,
/// optimizer updates, unfused adds and copies) timed at their exact shapes and attributes, as op-level profiles
/// feed the cost models of auto-parallelizers (FlexFlow, Alpa): each distinct signature
/// once, on inputs of the same dtypes and shapes (floats uniform in [-1, 1), booleans
/// false, small constants as in the graph). Timings are kept per machine in
/// `<cache_dir>/fit_ops.json`. Thread-safe registration; timing runs on one thread.
class OpTimes {
 public:
  /// Reads this machine's cached timings (none when the file is absent, unreadable or
  /// another machine's). cache_dir "" = codegen::default_cache_dir().
  OpTimes(const std::string& cache_dir, bool no_cache);
  ~OpTimes();
  /// Whether estimates time this node's kernel instead of modelling it: every eager
  /// kernel (not a loop, a fused kernel or a reshaping view such as Reshape) whose
  /// inputs are not integer data (indices and class ids, which synthetic values would
  /// misrepresent). Identity is timed: the executor copies it.
  static bool timed(const ir::Node& n);
  /// The node's signature: op, attributes, and each input's dtype and shape (and the
  /// values of constant inputs of at most 64 elements).
  static std::string signature(const ir::Node& n);
  /// Registers `n` (a timed() node) and returns its signature; `fallback_s` is used when
  /// its kernel cannot run on its own.
  std::string add(const ir::Node& n, double fallback_s);
  /// Times every registered signature the cache lacks, one after another, and writes
  /// the cache (an unwritable folder only skips the write). Never fails: a kernel that
  /// errors keeps its fallback.
  void measure();
  /// Seconds of a registered signature (measured, cached or fallback; 0 when unknown).
  double seconds(const std::string& sig) const;
  int measured_count() const { return measured_; }  ///< signatures timed by measure()
  double measure_seconds() const { return measure_s_; }
  size_t size() const;

 private:
  struct Entry;
  std::string file_, machine_;
  bool no_cache_ = false;
  mutable std::mutex mu_;
  std::map<std::string, double> cached_;  ///< signature hash -> seconds
  std::map<std::string, std::unique_ptr<Entry>> entries_;
  int measured_ = 0;
  double measure_s_ = 0;
};

/// One step's estimate as terms: modelled seconds (generated kernels, views, launches)
/// plus timed kernels by signature with their executions per step.
struct StepEstimate {
  double modelled_s = 0;
  double modelled_launches = 0;           ///< executions per step of the modelled nodes (views excluded)
  std::map<std::string, double> kernels;  ///< signature -> executions per step
  /// modelled_s plus each kernel's OpTimes seconds times its count.
  double seconds(const OpTimes& t) const;
};

/// The terms of `g`'s step: timed() nodes registered with `times` (their fallback the
/// roofline of estimate_step_seconds), the rest modelled as estimate_step_seconds does;
/// loop bodies count trip_count times.
StepEstimate estimate_step(const ir::Graph& g, const MachineRates& r, OpTimes& times);

}  // namespace kiln::driver
