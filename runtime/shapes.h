// Batch shapes of variable-length training data (issues 31 and 32, `--shape_mode`): which
// padded length each batch gets, and which programs a run therefore needs. A static
// program serves one length, so the static strategies trade padding against programs:
//   pad         every batch padded to --max_length: one program (the baseline);
//   specialize  every batch padded to its own longest row: one program per distinct
//               length, built when a batch first needs it, as torch.compile recompiles on
//               a guard failure; after --recompile_limit programs (Dynamo's
//               recompile_limit, default 8) a batch pads up to the nearest length that has
//               a program, and --max_length's program is the last one built;
//   buckets     every batch padded to the smallest of K boundaries that holds its longest
//               row (runtime/buckets.h plans them from the length histogram); every
//               program is built before step 1;
//   symbolic    every batch padded to its own longest row, as specialize, and run by one
//               program whose sequence dim stays a symbol (issue 32): one build, before
//               step 1, for every length up to --max_length (eager backend for now).
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::runtime {

/// True when a data input of `g` named in `data_inputs` has a symbolic batch dim (dim 0):
/// the program then runs batches of any row count (--shape_mode symbolic, issue 32).
bool symbolic_rows(const ir::Graph& g, const std::vector<std::string>& data_inputs);

/// --shape_mode.
enum class ShapeMode { pad, specialize, buckets, symbolic };

/// Parses "pad", "specialize", "buckets" or "symbolic". Error: one line naming the modes.
Expected<ShapeMode> parse_shape_mode(const std::string& text);
/// The flag's word for `m`.
const char* shape_mode_name(ShapeMode m);

/// The padded length of one batch and whether its program is new.
struct ShapeChoice {
  int64_t length = 0;        ///< tokens per row the batch is padded to
  bool new_program = false;  ///< no program of this length was built yet
  /// specialize: --recompile_limit was reached, and the batch pads up to a length that
  /// has a program instead of its own (the trainer warns the first time).
  bool limited = false;
};

/// Chooses padded lengths per --shape_mode and records the lengths that have programs.
/// Lengths are in tokens per row (the sequence dim of the model's inputs).
class ShapeChooser {
 public:
  /// `max_length` > 0: the longest row (rows are truncated to it by the loader);
  /// `buckets`: ascending boundaries, the last >= max_length (buckets mode);
  /// `recompile_limit` >= 1 (specialize mode).
  ShapeChooser(ShapeMode mode, int64_t max_length, std::vector<int64_t> buckets, int64_t recompile_limit);

  /// The length a batch whose longest row has `need` tokens (1 <= need <= max_length)
  /// pads to; does not record it (add_built does, once its program exists).
  ShapeChoice choose(int64_t need) const;
  /// Records that the program of `length` exists.
  void add_built(int64_t length) { built_.insert(length); }
  /// Lengths with programs, ascending.
  const std::set<int64_t>& built() const { return built_; }
  ShapeMode mode() const { return mode_; }
  int64_t max_length() const { return max_length_; }
  int64_t recompile_limit() const { return limit_; }
  const std::vector<int64_t>& buckets() const { return buckets_; }

 private:
  ShapeMode mode_;
  int64_t max_length_;
  std::vector<int64_t> buckets_;
  int64_t limit_;
  std::set<int64_t> built_;
};

}  // namespace kiln::runtime
