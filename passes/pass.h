// One pass interface and one pass manager (DESIGN.md convention 4, 5).
//
// A pass has a name and `run(Graph&, PassContext&) -> Expected<bool changed>`; it reads
// its typed options (passes/options.h) from PassContext::options. Pipelines are
// declarative lists of pass names (the driver's are built by tools/driver/pipeline.h). The manager implements the
// debugging flags: --print-ir-after=PASS|all, --dump-ir-dir (NN-pass.txt),
// --verify-each, --stop-after=N and --time-passes.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/op_table.h"
#include "ir/status.h"
#include "passes/options.h"

namespace kiln::passes {

/// Evaluates one node on constant inputs into `kc.outputs` (preallocated with the
/// inferred dtypes and shapes): the eager interpreter's kernels, which constant folding
/// receives through PassContext::evaluator (passes never call the runtime themselves).
using NodeEvaluator = std::function<Status(ir::KernelContext& kc)>;

/// Options that passes read (training configuration) and debugging switches.
struct PassContext {
  /// The typed options every pass reads its own fields of (defaults: passes/options.h).
  PassOptions options;
  std::string print_ir_after;  ///< a pass name, or "all"
  std::string dump_ir_dir;     ///< writes NN-pass.txt after each pass when set
  bool verify_each = false;
  int stop_after = -1;  ///< stop after the N-th pass (1-based) when > 0
  bool time_passes = false;
  std::ostream* log = nullptr;  ///< where printed IR and timings go (stderr when null)
  int dump_index = 0;           ///< running NN of --dump-ir-dir files across pipelines
  /// Seconds spent in each pass by name, summed over every pipeline run with this
  /// context (always collected; `kiln compile` reports them per phase).
  std::map<std::string, double> pass_seconds;
  /// Evaluator of constant nodes for fold_constants (the driver passes the eager
  /// interpreter's, runtime::evaluate_node); empty: folding a node that needs it fails.
  NodeEvaluator evaluator;
};

/// A Graph -> Graph transformation.
class Pass {
 public:
  virtual ~Pass() = default;
  virtual std::string name() const = 0;
  /// Transforms `g` in place; returns whether anything changed, or an error.
  virtual Expected<bool> run(ir::Graph& g, PassContext& ctx) = 0;
  /// The options this pass reads and their values in `o`, as "name=value" separated by
  /// spaces ("" when it reads none): what `kiln inspect --pipeline` prints per pass.
  virtual std::string describe_options(const PassOptions& o) const {
    (void)o;
    return "";
  }
};

/// Registry of passes by name (each pass file registers itself in passes/registry.cpp).
std::unique_ptr<Pass> make_pass(const std::string& name);
/// Names of all registered passes.
std::vector<std::string> pass_names();
/// The error for a pass name that is not registered: "unknown pass 'NAME' (known passes:
/// ...)", every registered name listed.
Status unknown_pass(const std::string& name);

/// Runs a declarative list of passes with the debugging switches of `ctx`.
/// Errors name the pass that failed (and the verifier's message under --verify-each).
Status run_pipeline(ir::Graph& g, const std::vector<std::string>& pipeline, PassContext& ctx);

}  // namespace kiln::passes
