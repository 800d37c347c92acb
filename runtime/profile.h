// Op-level profiler of the eager interpreter and the compiled executor, in the manner
// of torch.profiler's key_averages().table(): per key (an op name, or
// "FusedKernel[<kind>] (generated|eager)"), the number of calls and the total wall
// time (std::chrono::steady_clock), rendered as a table sorted by total time.
// Turned on by RunOptions::profile (runtime/interpreter.h); off, it costs one pointer check per node.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kiln::ir {
class Node;
}

namespace kiln::runtime {

/// Calls and wall time of one profile key.
struct OpProfileEntry {
  std::string key;
  int64_t calls = 0;
  double seconds = 0;  ///< total wall seconds over all calls
};

/// What a profile key names: the op (all nodes of one op type summed; FusedKernel by
/// kind), or each node by itself (generated kernels by name, with the IR nodes they fuse),
/// as torch.profiler's key_averages() against its per-event view.
enum class ProfileGroup { op, node };

/// Per-key call counts and wall seconds, accumulated over any number of runs. Not
/// thread-safe: one profile per concurrently running graph.
class OpProfile {
 public:
  /// Keys of later add() calls by op (default) or by node; see profile_key.
  void set_group(ProfileGroup g) { group_ = g; }
  ProfileGroup group() const { return group_; }
  /// Adds one call of `key` lasting `seconds` (wall, >= 0).
  void add(const std::string& key, double seconds);
  /// Entries sorted by total time, largest first (ties by key).
  std::vector<OpProfileEntry> entries() const;
  /// Sum of every key's seconds.
  double total_seconds() const;
  /// Calls of `key` (0 when never seen).
  int64_t calls(const std::string& key) const;
  /// Total seconds of `key` (0 when never seen).
  double seconds(const std::string& key) const;
  bool empty() const { return stats_.empty(); }
  void clear() { stats_.clear(); }

  /// The table: header `key  calls  total ms  mean us  % total`, then one row per key
  /// sorted by total time; with `max_rows` > 0 only that many rows, then one
  /// "(N other keys)" row summing the rest; a last "total" row. Keys longer than 120
  /// characters are cut to 117 and "...".
  std::string table(int max_rows = 0) const;

 private:
  struct Stat {
    int64_t calls = 0;
    double seconds = 0;
  };
  std::map<std::string, Stat> stats_;
  ProfileGroup group_ = ProfileGroup::op;
};

/// The profile key of node `n`: its op name; for FusedKernel "FusedKernel[<kind attr>]"
/// followed by " (generated)" when `generated` (run through the compiled program) or
/// " (eager)" (its body run op by op). ProfileGroup::node puts the node's name first,
/// and for a FusedKernel the names of its first three fused nodes (and how many more),
/// e.g. "fused_7 FusedKernel[row] (generated): /h.0/attn/Mul, /h.0/attn/Where, /h.0/attn/Softmax".
std::string profile_key(const ir::Node& n, bool generated, ProfileGroup group = ProfileGroup::op);

}  // namespace kiln::runtime
