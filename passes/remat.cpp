// remat: rematerialization (gradient checkpointing) as a policy pass (DESIGN.md convention 11).
//
// Runs after autodiff, before the optimizer. A *saved activation* is a value made by a
// forward node and read by a backward node (a node in a "<node>/grad" name scope, as
// passes/memory_plan.cpp classifies them). A policy chooses a set K of forward values to
// keep; every other saved activation is recomputed in the backward section from K, the
// graph inputs and the initializers:
//
//   materialize(v): v in K, persistent, or made by a node that may not be recomputed -> v;
//                   else clone v's producer with its inputs materialized, inserted just
//                   before the first backward node that needs it (lazily, in backward order),
//                   outputs named "<value>.remat" (DESIGN.md convention 3), node named
//                   "<node>/grad/remat" so the memory planner counts it as backward.
//
// Each forward node is cloned at most once; later backward users share the clone. Clones
// compute exactly what the original computed (same op, attributes and input values), so the
// gradients are bitwise equal in eager fp32. Dropout is recomputed only when it carries a
// kiln_rng_id (attach_loss sets one): its Philox stream is keyed by (seed, rng id, step), so
// the clone regenerates the same output (DESIGN.md invariant 6), while the mask its gradient
// reads stays saved (a secondary boolean output, 1 byte per element: recomputing it would
// re-run the producer's whole input chain). A clone drops trailing outputs that are such
// masks or graph outputs (BatchNormalization running statistics are state outputs), so a
// recomputed BatchNormalization recomputes its normalized output from the batch and never
// updates the running statistics a second time.
//
// Policies (RematOptions::policy):
//   none     nothing changes.
//   blocks   repeated layers; values flowing into a block from outside are kept, everything
//            inside a block is recomputed (Hugging Face gradient_checkpointing /
//            torch.utils.checkpoint per layer). Blocks come from, in this order:
//            1. PyTorch export name scopes: a scope segment "h.0", "layer1.0" or "0" whose
//               family has >= 2 members;
//            2. structural repetition, when no name scope repeats: each forward node (in
//               schedule order) gets a signature from the op table's view of it (op,
//               attributes but kiln_rng_id, input and output dtypes and shapes; never
//               node or value names); the tandem repeat s[i..i+p) x k (k >= 2, p >= 2) covering
//               the most nodes is taken (the smallest p on equal coverage: per layer, not
//               per pair of layers), each repetition one block. Its phase within the
//               periodic run is the one whose block boundaries cut the fewest live bytes.
//               Nodes before the first and after the last repetition are in no block.
//               O(n^2) integer comparisons over n forward nodes;
//            3. sqrt, when nothing repeats.
//            Under --time-passes or --print-ir-after remat|all, one "[remat] blocks ..."
//            line on the pass log says which detection was used, the blocks and its time.
//   sqrt     forward nodes in segments of round(sqrt(n)); values crossing a segment boundary
//            are kept, the rest recomputed (Chen et al. 2016, "Training Deep Nets with
//            Sublinear Memory Cost").
//   min-cut  the kept set of least bytes such that only cheap ops (op-table fusion class
//            pointwise / reduction / view) are recomputed, never library ops (MatMul, Gemm,
//            Conv): a minimum s-t cut (Dinic's max flow) over the forward value graph, each
//            value split into in/out nodes joined by an edge of its byte size, as in
//            PyTorch AOTAutograd's min_cut_rematerialization_partition; among cuts of
//            equal bytes the one nearer the backward wins (fewer hops to a saved value),
//            so nothing is recomputed where recomputing saves no bytes.
//   budget   RematOptions::memory_budget (bytes): the planned peak (passes/memory_plan.h, eager
//            options) plus the optimizer state the optimizer pass will add must fit. Choices
//            are per block (as blocks finds them; sqrt segments as its fallback): keep it or
//            recompute it; the pass picks the set of least recompute FLOPs whose saved bytes
//            cover the excess, as a 0/1 knapsack integer program solved by GLPK (in the
//            manner of Checkmate, Jain et al. 2020, at block granularity), verified with the
//            memory planner and tightened until it fits; a greedy (bytes per FLOP) order is
//            the fallback when GLPK hits its time limit or is not built in. When even
//            recomputing every block does not fit, it is an error naming the smallest
//            reachable peak and the category that dominates it. When recomputing every block
//            does not fit, sqrt's and min-cut's plans are tried as well (finer grained) and
//            the fitting one of least recompute FLOPs is taken; the error names the
//            smallest peak any of them reaches.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <queue>
#include <regex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "ir/op_table.h"
#include "ir/printer.h"
#include "passes/memory_plan.h"
#include "passes/passes.h"

#ifdef KILN_HAVE_GLPK
#include <glpk.h>
#endif

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// Elements of `v` at `bounds` (a symbolic program's: PassOptions::symbol_bounds, what
/// its memory is planned at); -1 when a dim is unknown or unbound.
int64_t numel_at(const Value* v, const std::map<std::string, int64_t>& bounds) {
  return bounds.empty() ? v->shape.numel() : v->shape.bound(bounds).numel();
}

/// The forward/backward split of a graph right after autodiff.
struct Sections {
  /// A symbolic program's bounds (PassOptions::symbol_bounds): sizes and FLOPs of
  /// symbolic values are taken there.
  std::map<std::string, int64_t> bounds;
  int bwd_start = 0;                               ///< index of the first backward node
  std::vector<Node*> forward;                      ///< nodes [0, bwd_start)
  std::unordered_map<const Node*, int> fwd_index;  ///< forward node -> index
  std::unordered_set<const Value*> graph_outputs;
  /// Forward values read by a backward node (the saved activations), in forward order.
  std::vector<Value*> saved;
  std::unordered_set<const Value*> saved_set;

  bool is_forward_value(const Value* v) const { return v && v->producer && fwd_index.count(v->producer); }
  /// Bytes of `v` (at the bounds); 0 when unknown.
  int64_t bytes(const Value* v) const {
    if (!v || v->dtype == DType::undefined) return 0;
    const int64_t n = numel_at(v, bounds);
    return n < 0 ? 0 : n * static_cast<int64_t>(dtype_size(v->dtype));
  }
  /// FLOPs of `n` (at the bounds).
  double flops(const Node& n) const { return node_cost_at(n, bounds).flops; }
};

Sections split_sections(const Graph& g, const std::map<std::string, int64_t>& bounds) {
  Sections s;
  s.bounds = bounds;
  const auto& nodes = g.nodes();
  s.bwd_start = static_cast<int>(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i)
    if (in_grad_scope(nodes[i]->name)) {
      s.bwd_start = static_cast<int>(i);
      break;
    }
  for (int i = 0; i < s.bwd_start; ++i) {
    s.forward.push_back(nodes[i].get());
    s.fwd_index[nodes[i].get()] = i;
  }
  for (Value* o : g.outputs) s.graph_outputs.insert(o);
  std::unordered_set<const Value*> read;
  for (size_t i = s.bwd_start; i < nodes.size(); ++i)
    for (Value* in : nodes[i]->inputs)
      if (s.is_forward_value(in)) read.insert(in);
  for (Node* n : s.forward)
    for (Value* o : n->outputs)
      if (read.count(o)) {
        s.saved.push_back(o);
        s.saved_set.insert(o);
      }
  return s;
}

/// Whether a node may be cloned at all (any policy): it has an eager kernel, no nested
/// regions, and, if it draws random numbers, a stable stream id.
bool recomputable_at_all(const Node& n, const Sections& s) {
  const OpDef* def = OpTable::get().find(n.op);
  if (!def || !n.regions.empty()) return false;
  // A random op's Philox stream (Dropout's) falls back to the node's position without
  // kiln_rng_id, which a clone would not share (runtime/kernels/util.h rng_id).
  if (has_trait(n, OpTrait::random) && !n.attrs.has("kiln_rng_id")) return false;
  for (Value* o : n.outputs)
    if (o->dtype == DType::undefined || numel_at(o, s.bounds) < 0) return false;
  return true;
}

/// What a policy decided, and what applying it did.
struct RematStats {
  int cloned_nodes = 0;
  double recompute_flops = 0;
  double forward_flops = 0;
};

/// Applies a kept set: rewires every backward read of a saved activation outside `keep`
/// to a clone, made lazily just before its first backward user.
class Rematerializer {
 public:
  Rematerializer(Graph& g, const Sections& s, const std::unordered_set<const Value*>& keep,
                 std::function<bool(const Node&)> may_recompute)
      : g_(g), s_(s), keep_(keep), may_(std::move(may_recompute)) {}

  Status run(RematStats& st) {
    for (Node* n : s_.forward) st.forward_flops += s_.flops(*n);
    std::vector<Node*> bwd;
    for (size_t i = s_.bwd_start; i < g_.nodes().size(); ++i) bwd.push_back(g_.nodes()[i].get());
    for (Node* b : bwd)
      for (size_t i = 0; i < b->inputs.size(); ++i) {
        Value* v = b->inputs[i];
        if (!needs_work(v)) continue;
        KILN_ASSIGN_OR_RETURN(Value * nv, materialize(v, b, st));
        b->inputs[i] = nv;
      }
    return Status::ok();
  }

 private:
  bool needs_work(const Value* v) const {
    return s_.is_forward_value(v) && !keep_.count(v) && !s_.graph_outputs.count(v) && !kept_mask(v);
  }

  /// A secondary boolean output (a Dropout mask: 1 byte per element) stays saved:
  /// recomputing it would re-run its producer and everything that feeds it.
  static bool kept_mask(const Value* v) { return v->producer_output > 0 && v->dtype == DType::boolean; }

  Expected<Value*> materialize(Value* v, Node* before, RematStats& st) {
    if (!needs_work(v)) return v;
    Node* p = v->producer;
    auto it = clones_.find(p);
    if (it == clones_.end()) {
      if (!may_(*p) || !recomputable_at_all(*p, s_)) return v;
      std::vector<Value*> ins;
      for (Value* in : p->inputs) {
        if (!in) {
          ins.push_back(nullptr);
          continue;
        }
        KILN_ASSIGN_OR_RETURN(Value * m, materialize(in, before, st));
        ins.push_back(m);
      }
      int k = p->num_outputs();
      while (k > 1 && (s_.graph_outputs.count(p->outputs[k - 1]) || kept_mask(p->outputs[k - 1]))) --k;
      std::vector<std::string> names;
      for (int i = 0; i < k; ++i) names.push_back(p->outputs[i]->name + ".remat");
      int pos = g_.index_of(before);
      Node* c = g_.insert_node(static_cast<size_t>(pos), p->op, p->name + "/grad/remat", ins, names, p->attrs);
      for (int i = 0; i < k; ++i) {
        c->outputs[i]->dtype = p->outputs[i]->dtype;
        c->outputs[i]->shape = p->outputs[i]->shape;
      }
      KILN_RETURN_IF_ERROR(infer_node(*c).with_context("remat of node '" + p->name + "'"));
      st.cloned_nodes++;
      st.recompute_flops += s_.flops(*c);
      it = clones_.emplace(p, c).first;
    }
    Node* c = it->second;
    if (v->producer_output >= c->num_outputs()) return v;
    return c->outputs[v->producer_output];
  }

  Graph& g_;
  const Sections& s_;
  const std::unordered_set<const Value*>& keep_;
  std::function<bool(const Node&)> may_;
  std::unordered_map<const Node*, Node*> clones_;
};

// ---------------------------------------------------------------- segmentations

/// Block key of a node from its export name scope ("/h.0/attn/MatMul" -> "/h.0"), or "".
/// The casts the autocast pass adds are named "autocast/<value>" after the value they
/// convert: they belong to that value's scope ("autocast//h.0/attn/MatMul_output_0.f32"
/// -> "/h.0"), so mixed precision does not split every block in two.
std::string scope_block(std::string name) {
  static const std::regex seg_re("^([^/]*\\.)?[0-9]+$");
  static const std::string kAutocast = "autocast/";
  if (name.compare(0, kAutocast.size(), kAutocast) == 0) name = name.substr(kAutocast.size());
  std::vector<std::string> segs;
  std::stringstream ss(name);
  std::string seg;
  while (std::getline(ss, seg, '/')) segs.push_back(seg);
  std::string prefix;
  for (size_t i = 0; i + 1 < segs.size(); ++i) {  // the last segment is the op's own name
    prefix += segs[i] + (i + 1 < segs.size() ? "/" : "");
    if (i > 0 && !segs[i].empty() && std::regex_match(segs[i], seg_re)) return prefix;
  }
  return "";
}

/// Family of a block key: the key without its trailing index ("/h.0/" -> "/h.").
std::string block_family(const std::string& key) {
  std::string k = key.substr(0, key.size() - 1);  // drop '/'
  size_t e = k.size();
  while (e > 0 && std::isdigit(static_cast<unsigned char>(k[e - 1]))) --e;
  return k.substr(0, e);
}

/// Segment id per forward node (-1: not in any segment, never recomputed).
/// `blocks` from name scopes; empty result when the model has no repeated scopes.
/// `nblocks` gets the number of blocks.
std::vector<int> scope_segments(const Sections& s, int* nblocks) {
  std::vector<std::string> key(s.forward.size());
  std::map<std::string, std::set<std::string>> families;
  for (size_t i = 0; i < s.forward.size(); ++i) {
    key[i] = scope_block(s.forward[i]->name);
    if (!key[i].empty()) families[block_family(key[i])].insert(key[i]);
  }
  std::map<std::string, int> ids;
  std::vector<int> seg(s.forward.size(), -1);
  bool any = false;
  for (size_t i = 0; i < s.forward.size(); ++i) {
    if (key[i].empty() || families[block_family(key[i])].size() < 2) continue;
    auto it = ids.find(key[i]);
    if (it == ids.end()) {
      it = ids.emplace(key[i], static_cast<int>(ids.size())).first;
    }
    seg[i] = it->second;
    any = true;
  }
  *nblocks = static_cast<int>(ids.size());
  if (!any) return {};
  return seg;
}

/// Structural signature of a forward node: what the op table sees of it, no names.
std::string node_signature(const Node& n) {
  std::ostringstream os;
  os << n.op;
  for (const auto& [k, v] : n.attrs.all()) {
    if (k == "kiln_rng_id") continue;  // a per-node stream id, not what the node computes
    os << ' ' << k << '=' << attr_to_string(v);
  }
  os << " (";
  for (const Value* in : n.inputs) {
    if (!in) {
      os << "-,";
      continue;
    }
    os << dtype_name(in->dtype) << in->shape.to_string() << ',';
  }
  os << ")->(";
  for (const Value* o : n.outputs) os << dtype_name(o->dtype) << o->shape.to_string() << ',';
  os << ") r" << n.regions.size();
  return os.str();
}

/// A tandem repeat found in the forward signature sequence: `count` consecutive copies
/// of the `period` nodes starting at forward index `start`.
struct TandemRepeat {
  int start = -1, period = 0, count = 0;
};

/// The tandem repeat (period >= 2, count >= 2) over `sig` covering the most elements,
/// the smallest period on equal coverage (then the earliest run). `cut_bytes[c]`: bytes
/// live across the cut before element c (c in [0, n]); the phase within the periodic run
/// is the one whose block boundaries cut the fewest bytes (then the earliest).
TandemRepeat longest_tandem_repeat(const std::vector<int>& sig, const std::vector<int64_t>& cut_bytes) {
  const int n = static_cast<int>(sig.size());
  TandemRepeat best;
  int best_cover = 0, best_run = 0;  // run: length of the p-periodic stretch is run + p
  for (int p = 2; 2 * p <= n; ++p) {
    if (n / p * p <= best_cover) continue;  // this period cannot cover more
    int run = 0;
    auto consider = [&](int j0, int len) {
      int k = (len + p) / p;
      if (k >= 2 && k * p > best_cover) {
        best_cover = k * p;
        best = {j0, p, k};
        best_run = len;
      }
    };
    for (int j = 0; j + p < n; ++j) {
      if (sig[j] == sig[j + p]) {
        ++run;
      } else {
        consider(j - run, run);
        run = 0;
      }
    }
    consider(n - p - run, run);
  }
  if (best.count < 2) return {};
  // Phase: any shift d in [0, run + p - count * p] gives `count` equal repetitions.
  const int slack = best_run + best.period - best.count * best.period;
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  int best_d = 0;
  for (int d = 0; d <= slack; ++d) {
    int64_t cost = 0;
    for (int m = 0; m <= best.count; ++m) cost += cut_bytes[best.start + d + m * best.period];
    if (cost < best_cost) best_cost = cost, best_d = d;
  }
  best.start += best_d;
  return best;
}

/// `blocks` from structural repetition (see the file comment); empty when nothing repeats.
std::vector<int> structural_segments(const Sections& s, TandemRepeat* found) {
  const int n = static_cast<int>(s.forward.size());
  std::unordered_map<std::string, int> ids;
  std::vector<int> sig(n);
  for (int i = 0; i < n; ++i)
    sig[i] = ids.emplace(node_signature(*s.forward[i]), static_cast<int>(ids.size())).first->second;
  // Bytes live across each cut: a value made at i and last read (in the forward) at j > i
  // crosses the cuts i+1..j.
  std::vector<int64_t> diff(n + 2, 0);
  std::unordered_map<const Value*, int> last_use;
  for (int i = 0; i < n; ++i)
    for (const Value* in : s.forward[i]->inputs)
      if (s.is_forward_value(in)) last_use[in] = i;
  for (const auto& [v, j] : last_use) {
    int i = s.fwd_index.at(v->producer);
    if (j <= i) continue;
    diff[i + 1] += s.bytes(v);
    diff[j + 1] -= s.bytes(v);
  }
  std::vector<int64_t> cut(n + 1, 0);
  int64_t acc = 0;
  for (int c = 0; c <= n; ++c) cut[c] = (acc += diff[c]);
  TandemRepeat r = longest_tandem_repeat(sig, cut);
  *found = r;
  if (r.count < 2) return {};
  std::vector<int> seg(n, -1);
  for (int i = r.start; i < r.start + r.count * r.period; ++i) seg[i] = (i - r.start) / r.period;
  return seg;
}

/// The segmentation of `blocks` and how it was found.
struct BlockDetection {
  std::vector<int> seg;  ///< segment id per forward node; sqrt segments when nothing repeats
  std::string note;      ///< one line: the detection used, the blocks, the time taken
};

std::vector<int> sqrt_segments(const Sections& s);

BlockDetection detect_blocks(const Sections& s) {
  auto t0 = std::chrono::steady_clock::now();
  BlockDetection d;
  std::ostringstream os;
  const size_t n = s.forward.size();
  int nblocks = 0;
  d.seg = scope_segments(s, &nblocks);
  if (!d.seg.empty()) {
    size_t covered = std::count_if(d.seg.begin(), d.seg.end(), [](int x) { return x >= 0; });
    os << "blocks from name scopes: " << nblocks << " blocks, " << covered << " of " << n << " forward nodes";
  } else {
    TandemRepeat r;
    d.seg = structural_segments(s, &r);
    if (!d.seg.empty()) {
      os << "blocks from structural repetition: " << r.count << " blocks of " << r.period << " nodes (forward nodes "
         << r.start << ".." << r.start + r.count * r.period - 1 << " of " << n << ")";
    } else {
      d.seg = sqrt_segments(s);
      int segs = 0;
      for (int x : d.seg) segs = std::max(segs, x + 1);
      os << "blocks: no repeated name scopes or structure in " << n << " forward nodes; sqrt fallback, " << segs
         << " segments";
    }
  }
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  char buf[64];
  std::snprintf(buf, sizeof buf, "; detection %.3f ms", ms);
  os << buf;
  d.note = os.str();
  return d;
}

/// Writes "[remat] <line>" to the pass log under --time-passes / --print-ir-after remat|all.
void log_decision(const PassContext& ctx, const std::string& line) {
  if (!ctx.time_passes && ctx.print_ir_after != "all" && ctx.print_ir_after != "remat") return;
  (ctx.log ? *ctx.log : std::cerr) << "[remat] " << line << "\n";
}

std::vector<int> sqrt_segments(const Sections& s) {
  const size_t n = s.forward.size();
  size_t len = std::max<size_t>(1, static_cast<size_t>(std::llround(std::sqrt(static_cast<double>(n)))));
  std::vector<int> seg(n);
  for (size_t i = 0; i < n; ++i) seg[i] = static_cast<int>(i / len);
  return seg;
}

/// Kept set of a segmentation (segment id per forward node, -1 = never recomputed): every
/// value read by a node of another segment (or by a node outside any segment) is kept.
std::unordered_set<const Value*> segment_keep(const Sections& s, const std::vector<int>& seg) {
  std::unordered_set<const Value*> keep;
  for (size_t i = 0; i < s.forward.size(); ++i)
    for (Value* in : s.forward[i]->inputs)
      if (s.is_forward_value(in)) {
        int j = s.fwd_index.at(in->producer);
        if (seg[j] != seg[i] || seg[j] < 0) keep.insert(in);
      }
  return keep;
}

// ---------------------------------------------------------------- min-cut

/// Dinic's maximum flow (int64 capacities); min_cut_source_side() after max_flow().
class MaxFlow {
 public:
  static constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
  explicit MaxFlow(int n) : adj_(n), level_(n), it_(n) {}
  void add_edge(int u, int v, int64_t cap) {
    adj_[u].push_back({v, static_cast<int>(adj_[v].size()), cap});
    adj_[v].push_back({u, static_cast<int>(adj_[u].size()) - 1, 0});
  }
  int64_t max_flow(int s, int t) {
    int64_t flow = 0;
    while (bfs(s, t)) {
      std::fill(it_.begin(), it_.end(), 0);
      while (int64_t f = dfs(s, t, kInf)) flow += f;
    }
    return flow;
  }
  /// Nodes reachable from s in the residual graph.
  std::vector<bool> source_side(int s) {
    std::vector<bool> seen(adj_.size(), false);
    std::vector<int> st = {s};
    seen[s] = true;
    while (!st.empty()) {
      int u = st.back();
      st.pop_back();
      for (auto& e : adj_[u])
        if (e.cap > 0 && !seen[e.to]) seen[e.to] = true, st.push_back(e.to);
    }
    return seen;
  }

 private:
  struct Edge {
    int to, rev;
    int64_t cap;
  };
  bool bfs(int s, int t) {
    std::fill(level_.begin(), level_.end(), -1);
    std::queue<int> q;
    level_[s] = 0;
    q.push(s);
    while (!q.empty()) {
      int u = q.front();
      q.pop();
      for (auto& e : adj_[u])
        if (e.cap > 0 && level_[e.to] < 0) level_[e.to] = level_[u] + 1, q.push(e.to);
    }
    return level_[t] >= 0;
  }
  int64_t dfs(int u, int t, int64_t f) {
    if (u == t) return f;
    for (int& i = it_[u]; i < static_cast<int>(adj_[u].size()); ++i) {
      Edge& e = adj_[u][i];
      if (e.cap <= 0 || level_[e.to] != level_[u] + 1) continue;
      int64_t d = dfs(e.to, t, std::min(f, e.cap));
      if (d > 0) {
        e.cap -= d;
        adj_[e.to][e.rev].cap += d;
        return d;
      }
    }
    return 0;
  }
  std::vector<std::vector<Edge>> adj_;
  std::vector<int> level_, it_;
};

/// Cheap to recompute: op-table fusion class pointwise, reduction or view.
bool cheap_op(const Node& n) {
  const OpDef* def = OpTable::get().find(n.op);
  if (!def) return false;
  return def->fusion == FusionClass::pointwise || def->fusion == FusionClass::reduction ||
         def->fusion == FusionClass::view;
}

/// The kept set of least bytes when only cheap ops are recomputed (see the file comment).
std::unordered_set<const Value*> min_cut_keep(const Sections& s) {
  std::unordered_map<const Value*, int> id;
  std::vector<const Value*> vals;
  for (Node* n : s.forward)
    for (Value* o : n->outputs) {
      id[o] = static_cast<int>(vals.size());
      vals.push_back(o);
    }
  const int V = static_cast<int>(vals.size());
  // Hops from each value to the nearest saved value along forward uses (0: saved; a
  // large value when no use leads to one), as AOTAutograd's dist_from_bw.
  constexpr int64_t kFar = 1000;
  std::vector<int64_t> dist(V, kFar);
  std::unordered_map<const Value*, std::vector<const Node*>> users;
  for (Node* n : s.forward)
    for (Value* in : n->inputs)
      if (in && id.count(in)) users[in].push_back(n);
  for (int i = V - 1; i >= 0; --i) {  // forward order is topological: users come later
    if (s.saved_set.count(vals[i])) {
      dist[i] = 0;
      continue;
    }
    for (const Node* u : users[vals[i]])
      for (Value* o : u->outputs)
        if (o && id.count(o)) dist[i] = std::min(dist[i], dist[id[o]] + 1);
  }
  const int S = 2 * V, T = 2 * V + 1;
  MaxFlow mf(2 * V + 2);
  auto in_node = [](int i) { return 2 * i; };
  auto out_node = [](int i) { return 2 * i + 1; };
  for (int i = 0; i < V; ++i) {
    const Value* v = vals[i];
    const Node* p = v->producer;
    // Capacity: bytes first; among cuts of equal bytes the one whose values are nearer
    // the backward (fewer hops to a saved value, so less to recompute: keep a Softmax's
    // output rather than its input) and with fewer values wins. AOTAutograd scales its
    // weights by 1.1^dist_from_bw; here distance is a tie-break worth about one byte per
    // cut value, so the saved bytes stay minimal.
    mf.add_edge(in_node(i), out_node(i), s.bytes(v) * 4096 + 4 * std::min(dist[i], kFar) + 1);
    if (s.graph_outputs.count(v)) mf.add_edge(S, out_node(i), MaxFlow::kInf);  // resident anyway
    if (!cheap_op(*p) || !recomputable_at_all(*p, s)) {
      mf.add_edge(S, in_node(i), MaxFlow::kInf);  // must be computed in forward
    } else {
      for (Value* in : p->inputs)
        if (in && id.count(in)) mf.add_edge(out_node(id[in]), in_node(i), MaxFlow::kInf);
    }
    if (s.saved_set.count(v)) mf.add_edge(out_node(i), T, MaxFlow::kInf);
  }
  mf.max_flow(S, T);
  auto side = mf.source_side(S);
  std::unordered_set<const Value*> keep;
  for (int i = 0; i < V; ++i)
    if (side[in_node(i)] && !side[out_node(i)]) keep.insert(vals[i]);
  return keep;
}

// ---------------------------------------------------------------- pass

/// Bytes per parameter element of the state the optimizer pass adds (inputs of the
/// step), from OptimizerOptions::optim: AdamW fp32 m and v = 8, 8-bit AdamW ~2, SGD momentum 4.
double optimizer_bytes_per_element(const PassContext& ctx) {
  const std::string& optim = ctx.options.optimizer.optim;
  if (optim == "sgd") return ctx.options.optimizer.momentum > 0 ? 4.0 : 0.0;
  if (optim == "adamw_8bit" || optim == "adamw_bnb_8bit") return 2.0 + 16.0 / 2048.0;
  return 8.0;
}

/// Recomputes in the backward pass the forward nodes of the segments `seg` marks (one
/// entry per forward node, -1: kept as is): blocks, sqrt and the budget's choices.
Status recompute_segments(Graph& g, const Sections& s, const std::vector<int>& seg, RematStats& st) {
  auto keep = segment_keep(s, seg);
  std::unordered_map<const Node*, int> segof;
  for (size_t i = 0; i < s.forward.size(); ++i) segof[s.forward[i]] = seg[i];
  Rematerializer r(g, s, keep, [&](const Node& n) { return segof.count(&n) && segof.at(&n) >= 0; });
  return r.run(st);
}

/// min-cut's plan: saves min_cut_keep's values, recomputes the cheap ops between them.
Status recompute_min_cut(Graph& g, const Sections& s, RematStats& st) {
  auto keep = min_cut_keep(s);
  Rematerializer r(g, s, keep, [](const Node& n) { return cheap_op(n); });
  return r.run(st);
}

class Remat : public Pass {
 public:
  std::string name() const override { return "remat"; }
  std::string describe_options(const PassOptions& o) const override {
    OptionText t;
    t.add("remat_policy", o.remat.policy);
    if (o.remat.policy == "budget") {
      t.add("memory_budget", o.remat.memory_budget ? std::to_string(*o.remat.memory_budget) : std::string());
      t.add("remat_solver_ms", o.remat.solver_ms).add("optim", o.optimizer.optim);
    }
    return t.str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const std::string& policy = ctx.options.remat.policy;
    if (policy == "none" || policy.empty()) return false;
    Sections s = split_sections(g, ctx.options.symbol_bounds);
    if (s.bwd_start >= static_cast<int>(g.nodes().size()))
      return Status::error("remat: no backward nodes (run autodiff first)");
    RematStats st;
    if (policy == "blocks") {
      BlockDetection d = detect_blocks(s);
      log_decision(ctx, d.note);
      KILN_RETURN_IF_ERROR(recompute_segments(g, s, d.seg, st));
    } else if (policy == "sqrt") {
      KILN_RETURN_IF_ERROR(recompute_segments(g, s, sqrt_segments(s), st));
    } else if (policy == "min-cut") {
      KILN_RETURN_IF_ERROR(recompute_min_cut(g, s, st));
    } else if (policy == "budget") {
      KILN_RETURN_IF_ERROR(run_budget(g, ctx, s, st));
    } else {
      return Status::error("--remat_policy: unknown policy '" + policy + "' (none, blocks, sqrt, min-cut, budget)");
    }
    return st.cloned_nodes > 0;
  }

 private:
  Status run_budget(Graph& g, PassContext& ctx, const Sections& s, RematStats& st);
};

/// Planned peak of the whole training step: `g` with the optimizer pass applied to a copy
/// (the same options), planned with eager semantics. `opt_bytes` is an estimate of the
/// optimizer state, added only when the optimizer pass cannot run on the copy.
struct Fit {
  int64_t peak = 0;
  std::string dominant;
  int64_t dominant_bytes = 0;
};

Expected<Fit> planned_fit(const Graph& g, PassContext& ctx, double opt_bytes) {
  auto copy = g.clone();
  PassContext quiet;
  quiet.options = ctx.options;
  // The driver's order after remat: canonicalize, optimizer, canonicalize.
  auto pre = make_canonicalize_pass()->run(*copy, quiet);
  if (!pre) return pre.status();
  auto opt = make_optimizer_pass()->run(*copy, quiet);
  if (opt) {
    auto post = make_canonicalize_pass()->run(*copy, quiet);
    if (!post) return post.status();
    opt_bytes = 0;
  } else {
    copy = g.clone();
  }
  // A symbolic program is planned at its bounds (PassOptions::symbol_bounds), as its memory is.
  if (!ctx.options.symbol_bounds.empty())
    KILN_RETURN_IF_ERROR(bind_symbols(*copy, ctx.options.symbol_bounds).with_context("remat: the plan at the bound"));
  KILN_ASSIGN_OR_RETURN(MemoryPlan p, plan_memory(*copy, PlanOptions::eager()));
  Fit f;
  f.peak = p.peak_bytes + static_cast<int64_t>(opt_bytes);
  CategoryBytes cat = p.at_peak;
  cat[static_cast<int>(MemoryCategory::optimizer_state)] += static_cast<int64_t>(opt_bytes);
  for (int c = 0; c < kNumMemoryCategories; ++c)
    if (cat[c] > f.dominant_bytes) {
      f.dominant_bytes = cat[c];
      f.dominant = memory_category_name(static_cast<MemoryCategory>(c));
    }
  return f;
}

Status Remat::run_budget(Graph& g, PassContext& ctx, const Sections& s, RematStats& st) {
  if (!ctx.options.remat.memory_budget) return Status::error("--remat_policy budget needs --memory_budget");
  const double budget = static_cast<double>(*ctx.options.remat.memory_budget);
  if (!(budget > 0))
    return Status::error("--memory_budget: expected a byte count > 0, got '" +
                         std::to_string(*ctx.options.remat.memory_budget) + "'");
  int64_t param_elems = 0;
  for (auto& sb : g.state)
    if (sb.kind == "parameter" && sb.input) param_elems += std::max<int64_t>(0, sb.input->shape.numel());
  const double opt_bytes = optimizer_bytes_per_element(ctx) * static_cast<double>(param_elems);

  KILN_ASSIGN_OR_RETURN(Fit base, planned_fit(g, ctx, opt_bytes));
  if (base.peak <= budget) return Status::ok();  // fits without recomputation

  BlockDetection det = detect_blocks(s);
  log_decision(ctx, "budget: " + det.note);
  std::vector<int> seg = std::move(det.seg);
  int nseg = 0;
  for (int x : seg) nseg = std::max(nseg, x + 1);

  // Applies "recompute the segments in `on`" to a copy and returns its fit.
  auto trial = [&](const std::vector<bool>& on, Graph& target, RematStats& ts) -> Expected<Fit> {
    Sections ss = split_sections(target, ctx.options.symbol_bounds);
    std::vector<int> sg(ss.forward.size(), -1);
    for (size_t i = 0; i < ss.forward.size(); ++i) sg[i] = seg[i] >= 0 && on[seg[i]] ? seg[i] : -1;
    KILN_RETURN_IF_ERROR(recompute_segments(target, ss, sg, ts));
    return planned_fit(target, ctx, opt_bytes);
  };

  // Per-segment effect, measured one segment at a time: saved bytes and recompute FLOPs.
  std::vector<double> gain(nseg, 0), flops(nseg, 0);
  for (int k = 0; k < nseg; ++k) {
    std::vector<bool> on(nseg, false);
    on[k] = true;
    auto copy = g.clone();
    RematStats ts;
    KILN_ASSIGN_OR_RETURN(Fit f, trial(on, *copy, ts));
    gain[k] = static_cast<double>(base.peak - f.peak);
    flops[k] = ts.recompute_flops;
  }
  // Every block recomputed: the smallest peak block choices reach. When even that does
  // not fit, the finer policies' plans are tried (sqrt's segments, min-cut's saved set:
  // on the tiny GPT sqrt reaches 7.03 MiB where every block gives 7.34), the fitting one
  // of least recompute FLOPs taken; if none fits, the error names the smallest of them.
  {
    auto copy = g.clone();
    RematStats ts;
    KILN_ASSIGN_OR_RETURN(Fit all, trial(std::vector<bool>(nseg, true), *copy, ts));
    if (all.peak > budget) {
      auto apply = [&](const std::string& policy, Graph& target, RematStats& rs) -> Status {
        Sections ss = split_sections(target, ctx.options.symbol_bounds);
        return policy == "sqrt" ? recompute_segments(target, ss, sqrt_segments(ss), rs)
                                : recompute_min_cut(target, ss, rs);
      };
      std::string best_policy = "every block", fit_policy;
      Fit smallest_fit = all;
      double fit_flops = 0;
      for (const char* policy : {"sqrt", "min-cut"}) {
        auto c2 = g.clone();
        RematStats rs;
        KILN_RETURN_IF_ERROR(apply(policy, *c2, rs));
        KILN_ASSIGN_OR_RETURN(Fit f, planned_fit(*c2, ctx, opt_bytes));
        if (f.peak < smallest_fit.peak) smallest_fit = f, best_policy = std::string("--remat_policy ") + policy;
        if (f.peak <= budget && (fit_policy.empty() || rs.recompute_flops < fit_flops))
          fit_policy = policy, fit_flops = rs.recompute_flops;
      }
      if (!fit_policy.empty()) {
        log_decision(ctx, "budget: recomputing every block leaves " + human_bytes(all.peak) + "; " + fit_policy +
                              "'s plan fits the budget");
        return apply(fit_policy, g, st);
      }
      return Status::error("--memory_budget " + human_bytes(static_cast<int64_t>(budget)) +
                           ": does not fit; the smallest planned peak reachable by recomputation is " +
                           human_bytes(smallest_fit.peak) + " (" + std::to_string(smallest_fit.peak) + " bytes, " +
                           best_policy + "), dominated by " + smallest_fit.dominant + " (" +
                           human_bytes(smallest_fit.dominant_bytes) + ")");
    }
  }

  // 0/1 knapsack: minimise sum flops_k x_k subject to sum gain_k x_k >= need.
  double need = static_cast<double>(base.peak) - budget;
  std::vector<bool> best;
  for (int attempt = 0; attempt < 2 * nseg + 2; ++attempt) {
    std::vector<bool> pick(nseg, false);
    bool solved = false;
#ifdef KILN_HAVE_GLPK
    {
      glp_prob* lp = glp_create_prob();
      glp_set_obj_dir(lp, GLP_MIN);
      glp_add_rows(lp, 1);
      glp_set_row_bnds(lp, 1, GLP_LO, need, 0.0);
      glp_add_cols(lp, nseg);
      std::vector<int> ia(1), ja(1);
      std::vector<double> ar(1);
      for (int k = 0; k < nseg; ++k) {
        glp_set_col_kind(lp, k + 1, GLP_BV);
        glp_set_obj_coef(lp, k + 1, flops[k] + 1.0);
        ia.push_back(1), ja.push_back(k + 1), ar.push_back(std::max(0.0, gain[k]));
      }
      glp_load_matrix(lp, nseg, ia.data(), ja.data(), ar.data());
      glp_iocp parm;
      glp_init_iocp(&parm);
      parm.presolve = GLP_ON;
      parm.msg_lev = GLP_MSG_OFF;
      parm.tm_lim = ctx.options.remat.solver_ms;
      int rc = glp_intopt(lp, &parm);
      int stat = glp_mip_status(lp);
      if (rc == 0 && stat == GLP_OPT) {
        for (int k = 0; k < nseg; ++k) pick[k] = glp_mip_col_val(lp, k + 1) > 0.5;
        solved = true;
      }
      glp_delete_prob(lp);
    }
#endif
    if (!solved) {  // greedy: most bytes per FLOP first
      std::vector<int> order(nseg);
      for (int k = 0; k < nseg; ++k) order[k] = k;
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return gain[a] * (flops[b] + 1) > gain[b] * (flops[a] + 1); });
      double got = 0;
      for (int k : order) {
        if (got >= need) break;
        pick[k] = true;
        got += gain[k];
      }
    }
    auto copy = g.clone();
    RematStats ts;
    KILN_ASSIGN_OR_RETURN(Fit f, trial(pick, *copy, ts));
    if (f.peak <= budget) {
      best = pick;
      break;
    }
    // Savings of segments overlap or interact; ask for more and try again.
    need += static_cast<double>(f.peak) - budget + 1.0;
  }
  if (best.empty()) best = std::vector<bool>(nseg, true);  // fits (checked above)
  KILN_ASSIGN_OR_RETURN(Fit done, trial(best, g, st));
  (void)done;
  return Status::ok();
}

}  // namespace

std::unique_ptr<Pass> make_remat_pass() { return std::make_unique<Remat>(); }

}  // namespace kiln::passes
