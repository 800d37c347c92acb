// Static memory planner (DESIGN.md invariant 5, convention 12).
//
// Algorithm, over the graph's node order (the eager schedule):
//  1. Liveness. Graph inputs and initializers are resident for the whole step (the
//     caller holds the feeds, the graph holds its initializers) and sit outside the
//     arena. A node output is live from its node to its last use, inclusive: while a
//     node runs, its inputs and its freshly allocated outputs coexist, as in
//     runtime/interpreter.cpp, which frees a buffer right after its last use. Graph
//     outputs live to the end of the step. An output nothing reads dies at its node,
//     except with PlanOptions::eager_semantics, where (as in the interpreter) it stays
//     allocated until the step ends.
//  2. In-place reuse. When a pointwise op (op table fusion class pointwise) has an
//     input that is a node output dying at that op, with the same byte size as an
//     output, the output takes over that input's buffer (one output per input).
//     Chains of pointwise ops thus run in one buffer.
//  3. Offsets. Buffers (a value or an in-place chain) are placed in one arena by
//     greedy-by-size best fit: largest first, each into the smallest gap between
//     already placed buffers whose lifetimes overlap its own, else at the top
//     (TFLite's ArenaPlanner "greedy by size"; XLA's GlobalDecreasingSizeBestFitHeap).
//  4. Accounting. Live bytes per node and per category give the peak, the category
//     split at the peak and each category's own maximum. Bytes are numel * dtype size,
//     as MemoryStats counts them; the arena size also includes alignment padding.
//     With eager_semantics (or count_kernel_scratch), the tensor scratch an eager kernel allocates while its node
//     runs (eager_kernel_scratch_bytes) adds to that node's temporaries.
//
// AccumulationLoop (gradient accumulation): the schedule is flattened, a loop's body
// nodes (one iteration; all iterations have the same live set) followed by the loop
// node. The liveness follows runtime/interpreter.cpp exactly: captured outer values
// are live to the loop node; carried inputs whose last use is the loop move into the
// body (their buffer becomes the body input's); scan slices are new tensors live from
// the body's start to their last use; body outputs stay to the iteration's end and
// become the loop outputs (same buffer). kiln_inplace = k (the accumulator Adds) is
// honoured with the interpreter's condition; the planned iteration is a steady one
// (t >= 1), where every carried value is uniquely owned.
//
// Categories come from the graph only: StateBinding kinds; node-name scopes
// ("<node>/grad/..." = backward, written by autodiff; "optimizer/..." = the optimizer
// pass); the op table (fusion class). A narrowed single-input copy of a parameter made
// in the forward pass is a low-precision weight copy (autocast's bf16/fp16 Casts). Parameter gradients are
// the backward values an optimizer node (or the graph output list) reads, followed back
// through the "<param>/grad" summation scope and single-input copies of equal size (and
// through a data-parallel job's collectives to the rank's own gradients).
#include "passes/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "ir/op_table.h"

namespace kiln::passes {

using namespace kiln::ir;

const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameters:
      return "parameters";
    case MemoryCategory::low_precision_weights:
      return "low-precision weight copies";
    case MemoryCategory::gradients:
      return "gradients";
    case MemoryCategory::optimizer_state:
      return "optimizer state";
    case MemoryCategory::saved_activations:
      return "saved activations";
    case MemoryCategory::temporaries:
      return "temporaries";
    case MemoryCategory::data_and_buffers:
      return "data, buffers, constants";
  }
  return "?";
}

int64_t eager_kernel_scratch_bytes(const Node& n) {
  // Declared with the op (OpDef::kernel_scratch_bytes: Gemm's f64 temporary).
  const OpDef* def = OpTable::get().find(n.op);
  return def && def->kernel_scratch_bytes ? def->kernel_scratch_bytes(n) : 0;
}

namespace {

enum class Phase { forward, backward, optimizer };

Phase phase_of(const Node& n) {
  if (has_trait(n, OpTrait::fused_kernel) && n.regions.size() == 1) {
    // A fused group (passes/fusion.cpp) is in the latest phase of the nodes it holds.
    Phase p = Phase::forward;
    for (auto& b : n.regions[0]->nodes()) {
      const Phase q = phase_of(*b);
      if (q == Phase::optimizer) return q;
      if (q == Phase::backward) p = q;
    }
    return p;
  }
  if (n.name.rfind("optimizer/", 0) == 0 || n.name == "optimizer") return Phase::optimizer;
  if (grad_scope_pos(n.name) != std::string::npos) return Phase::backward;
  return Phase::forward;
}

int64_t align_up(int64_t v, int64_t a) { return a <= 1 ? v : (v + a - 1) / a * a; }

/// One schedule position: a node of the top-level graph or of a loop body (one
/// representative iteration), or the end of an AccumulationLoop (where its outputs
/// appear and its inputs and captures are released, as in the interpreter).
struct Entry {
  const Node* node = nullptr;
  const Graph* graph = nullptr;  ///< the graph whose node list holds `node`
  const Node* loop = nullptr;    ///< enclosing AccumulationLoop of a body node (nullptr at top level)
};

/// Per AccumulationLoop: where its body runs in the schedule.
struct LoopInfo {
  const Node* node = nullptr;
  const Graph* body = nullptr;
  int body_start = 0;  ///< position of the body's first node
  int end = 0;         ///< position of the loop node itself (after the body)
  size_t carried = 0;
  bool steal = false;  ///< carried inputs move into the loop (interpreter's condition)
};

/// Appends the schedule of `g` to `tl`: a loop's body nodes, then the loop node.
Status flatten(const Graph& g, const Node* loop, std::vector<Entry>& tl, std::vector<LoopInfo>& loops) {
  for (auto& np : g.nodes()) {
    const Node& n = *np;
    // A FusedKernel's body lives in registers: the node is planned as one step.
    if (!n.regions.empty() && !has_trait(n, OpTrait::fused_kernel)) {
      if (!has_trait(n, OpTrait::loop) || n.regions.size() != 1)
        return Status::error("memory plan: node '" + n.name + "' (" + n.op +
                             ") has a nested region; only AccumulationLoop regions are planned");
      const Graph& body = *n.regions[0];
      const int64_t k = n.attrs.get_int("num_carried", -1);
      if (k < 0 || body.inputs.size() != n.inputs.size() || static_cast<int64_t>(body.outputs.size()) != k ||
          n.num_outputs() != k || k > n.num_inputs())
        return Status::error("memory plan: AccumulationLoop '" + n.name + "': body does not match the node");
      if (body.nodes().empty())
        return Status::error("memory plan: AccumulationLoop '" + n.name + "' has an empty body");
      LoopInfo li;
      li.node = &n;
      li.body = &body;
      li.carried = static_cast<size_t>(k);
      li.body_start = static_cast<int>(tl.size());
      const size_t slot = loops.size();
      loops.push_back(li);
      KILN_RETURN_IF_ERROR(flatten(body, &n, tl, loops));
      loops[slot].end = static_cast<int>(tl.size());
    }
    tl.push_back({&n, &g, loop});
  }
  return Status::ok();
}

/// The planner's state over one schedule: plan_memory runs its phases in order (each a
/// member below), each reading what the earlier ones wrote.
class Planner {
 public:
  Planner(const Graph& g, const PlanOptions& opts) : g_(g), opts_(opts) { plan_.options = opts; }

  Expected<MemoryPlan> run() {
    KILN_RETURN_IF_ERROR(schedule());
    KILN_RETURN_IF_ERROR(collect_values());
    liveness();
    categorize();
    optimizer_groups();
    assign_buffers();
    widen_multi_tensor_groups();
    place_offsets();
    account();
    return std::move(plan_);
  }

 private:
  // ---- schedule: the flattened node order, loops and the lookups over them
  Status schedule() {
    KILN_RETURN_IF_ERROR(flatten(g_, nullptr, tl_, loops_));
    N_ = static_cast<int>(tl_.size());
    plan_.num_nodes = N_;
    plan_.accumulation_loops = static_cast<int>(loops_.size());
    for (auto& li : loops_) plan_.trip_count = std::max(plan_.trip_count, li.node->attrs.get_int("trip_count", 1));
    in_place_ = opts_.in_place && !opts_.eager_semantics;
    for (int p = 0; p < N_; ++p) node_pos_[tl_[p].node] = p;
    for (auto& li : loops_) loop_of_[li.node] = &li;
    for (auto& li : loops_)
      for (size_t j = 0; j < li.body->inputs.size(); ++j) body_input_slot_[li.body->inputs[j]] = {&li, j};
    return Status::ok();
  }

  static Expected<int64_t> bytes_of(const Value* v) {
    if (v->dtype == DType::undefined) return int64_t(0);
    int64_t n = v->shape.numel();
    if (n < 0)
      return Status::error("memory plan: value '" + v->name + "' has non-static shape " + v->shape.to_string() +
                           " (bind symbolic dims with --shape)");
    return n * static_cast<int64_t>(dtype_size(v->dtype));
  }

  Status add_value(const Value* v, const Graph* gr, bool persistent, int def) {
    if (!v || idx_.count(v)) return Status::ok();
    KILN_ASSIGN_OR_RETURN(int64_t b, bytes_of(v));
    ValuePlan vp;
    vp.value = v;
    vp.bytes = b;
    vp.persistent = persistent;
    vp.def = def;
    idx_[v] = static_cast<int>(plan_.values.size());
    owner_[v] = gr;
    plan_.values.push_back(vp);
    return Status::ok();
  }

  // ---- values: every input, initializer and node output, with its definition and last use
  Status collect_values() {
    // Where each graph's run ends (a body: its last node, i.e. the end of one iteration)
    // and what it pins (graph outputs and constants; a body: its outputs).
    graph_end_[&g_] = N_ - 1;
    pinned_[&g_].insert(g_.outputs.begin(), g_.outputs.end());
    pinned_[&g_].insert(g_.initializers.begin(), g_.initializers.end());
    for (auto& li : loops_) {
      graph_end_[li.body] = li.end - 1;
      pinned_[li.body].insert(li.body->outputs.begin(), li.body->outputs.end());
    }
    for (Value* v : g_.inputs) KILN_RETURN_IF_ERROR(add_value(v, &g_, true, -1));
    if (opts_.streamed_microbatches)  // streamed scan inputs are never resident whole (see PlanOptions)
      for (const Value* v : ir::streamable_scan_inputs(g_)) plan_.values[idx_.at(v)].bytes = 0;
    for (Value* v : g_.initializers) KILN_RETURN_IF_ERROR(add_value(v, &g_, true, -1));
    phase_.assign(N_, Phase::forward);
    for (int i = 0; i < N_; ++i) {
      for (auto& li : loops_)
        if (li.body_start == i) {
          // Carried values and scan slices exist before the body's first node runs;
          // body constants live in the graph (resident).
          for (Value* v : li.body->inputs) KILN_RETURN_IF_ERROR(add_value(v, li.body, false, i));
          for (Value* v : li.body->initializers) KILN_RETURN_IF_ERROR(add_value(v, li.body, true, -1));
        }
      const Node& n = *tl_[i].node;
      phase_[i] = phase_of(n);
      for (Value* in : n.inputs) {
        if (!in) continue;
        if (!idx_.count(in) && !in->producer)
          return Status::error("memory plan: node '" + n.name + "' reads '" + in->name +
                               "', which is neither a graph input, an initializer nor a node output");
        bump_last_use(in, i);
      }
      if (loop_of_.count(&n)) {  // the interpreter releases captured values after the loop
        std::unordered_set<const Value*> caps;
        collect_captures(*n.regions[0], caps);
        for (const Value* v : caps) bump_last_use(v, i);
      }
      for (Value* o : n.outputs) KILN_RETURN_IF_ERROR(add_value(o, tl_[i].graph, false, i));
    }
    return Status::ok();
  }

  void bump_last_use(const Value* v, int i) { last_use_[v] = std::max(last_use_.count(v) ? last_use_[v] : -1, i); }

  // ---- liveness: each value's last position; which loops take their carried inputs over
  void liveness() {
    for (auto& vp : plan_.values) {
      if (vp.persistent) {
        vp.def = 0;
        vp.end = N_ - 1;
        continue;
      }
      const Graph* gr = owner_.at(vp.value);
      const int ge = graph_end_.at(gr);
      auto lu = last_use_.find(vp.value);
      if (pinned_[gr].count(vp.value))
        vp.end = ge;
      else if (lu != last_use_.end())
        vp.end = std::max(lu->second, vp.def);
      else
        vp.end = opts_.eager_semantics ? ge : vp.def;
    }
    // The interpreter moves a loop's carried inputs into the loop when every one of them
    // is last used by the loop, none is pinned and none repeats.
    for (auto& li : loops_) {
      const Node& n = *li.node;
      const auto& pin = pinned_[node_pos_.count(&n) ? tl_[li.end].graph : &g_];
      li.steal = true;
      for (size_t c = 0; c < li.carried; ++c) {
        const Value* v = n.inputs[c];
        auto lu = v ? last_use_.find(v) : last_use_.end();
        if (!v || lu == last_use_.end() || lu->second != li.end || pin.count(v)) li.steal = false;
        for (size_t c2 = 0; c2 < c; ++c2)
          if (n.inputs[c2] == v) li.steal = false;
      }
    }
  }

  // ---- categories
  int phase_of_value(const Value* v) const {
    const Node* p = v ? v->producer : nullptr;
    if (!p) return -1;
    auto k = node_pos_.find(p);
    if (k == node_pos_.end()) return -1;
    // An output of a fused group is in the phase of the body node that makes it: the
    // kernel's own phase is its latest node's (a gradient cast fused with the clipping
    // norm's square sum is a backward value, not an optimizer temporary).
    if (has_trait(*p, OpTrait::fused_kernel) && p->regions.size() == 1 && v->producer_output >= 0 &&
        static_cast<size_t>(v->producer_output) < p->regions[0]->outputs.size()) {
      const Value* bo = p->regions[0]->outputs[static_cast<size_t>(v->producer_output)];
      if (bo && bo->producer) return static_cast<int>(phase_of(*bo->producer));
    }
    return static_cast<int>(phase_[k->second]);
  }

  /// Low-precision weight copies: a forward node whose only non-constant input is a
  /// parameter, producing an equally sized tensor of a narrower dtype. Adds the copies'
  /// names to `grad_scopes` (their gradients sum under "<copy>/grad...").
  std::unordered_set<const Value*> weight_copies(std::unordered_set<std::string>& grad_scopes) const {
    std::unordered_set<const Value*> copies;
    for (int i = 0; i < N_; ++i) {
      const Node& n = *tl_[i].node;
      if (phase_[i] != Phase::forward) continue;
      const Value* only = nullptr;
      int nonconst = 0;
      for (Value* in : n.inputs)
        if (in && !in->is_initializer()) ++nonconst, only = in;
      if (nonconst != 1 || !params_.count(only)) continue;
      for (Value* o : n.outputs)
        if (o && is_float(o->dtype) && o->shape.numel() == only->shape.numel() &&
            dtype_size(o->dtype) < dtype_size(only->dtype)) {
          copies.insert(o);
          grad_scopes.insert(o->name);
        }
    }
    return copies;
  }

  bool is_bwd_value(const Value* v) const { return v && phase_of_value(v) == static_cast<int>(Phase::backward); }

  /// An AccumulationLoop output whose body output accumulates a backward value.
  bool accumulates_bwd(const Value* v) const {
    if (!v || !v->producer || !loop_of_.count(v->producer)) return false;
    const LoopInfo& li = *loop_of_.at(v->producer);
    const Value* bo = li.body->outputs[v->producer_output];
    if (!bo || !bo->producer) return false;
    for (Value* in : bo->producer->inputs)
      if (is_bwd_value(in)) return true;
    return false;
  }

  /// Gradients: backward values read by the optimizer or listed as graph outputs, then
  /// followed back through the parameter's "/grad" scope and single-input copies; an
  /// AccumulationLoop output accumulating a backward value is a gradient too, with its
  /// whole accumulator chain (zero init, body input, in-place Add, body output).
  std::unordered_set<const Value*> gradients(const std::unordered_set<std::string>& grad_scopes) const {
    std::unordered_set<const Value*> grads;
    std::vector<const Value*> work;
    // A data-parallel job's sums (passes/data_parallel.cpp) are gradients, and so is what
    // each rank contributes to them.
    auto summed = [](const Value* v) {
      if (!v || !v->producer) return false;
      const OpDef* d = OpTable::get().find(v->producer->op);
      return d && d->fusion == FusionClass::collective;
    };
    auto bwd_like = [&](const Value* v) { return is_bwd_value(v) || accumulates_bwd(v) || summed(v); };
    auto mark = [&](const Value* v) {
      if (v && grads.insert(v).second) work.push_back(v);
    };
    for (int i = 0; i < N_; ++i) {
      if (phase_[i] != Phase::optimizer) continue;
      for (Value* in : tl_[i].node->inputs)
        if (bwd_like(in)) mark(in);
    }
    for (Value* o : g_.outputs)
      if (bwd_like(o)) mark(o);
    while (!work.empty()) {
      const Value* v = work.back();
      work.pop_back();
      const Node* p = v->producer;
      if (!p) {
        auto bi = body_input_slot_.find(v);
        if (bi != body_input_slot_.end() && bi->second.second < bi->second.first->carried)
          mark(bi->second.first->node->inputs[bi->second.second]);
        continue;
      }
      if (loop_of_.count(p)) {
        mark(loop_of_.at(p)->body->outputs[v->producer_output]);
        continue;
      }
      if (summed(v)) {  // the rank's own gradients (an AllReduceWait's token input is no float)
        for (Value* in : p->inputs)
          if (in && !in->is_initializer() && is_float(in->dtype) && bwd_like(in)) mark(in);
        continue;
      }
      if (p->attrs.has("kiln_inplace")) {  // accumulator update: acc + microbatch value
        for (Value* in : p->inputs)
          if (in && !in->is_initializer() && is_float(in->dtype) && in->shape.numel() == v->shape.numel()) mark(in);
        continue;
      }
      std::vector<const Value*> cands;
      int nonconst = 0;
      for (Value* in : p->inputs) {
        if (!in || in->is_initializer()) continue;
        ++nonconst;
        if (is_bwd_value(in) && is_float(in->dtype) && in->shape.numel() == v->shape.numel()) cands.push_back(in);
      }
      size_t pos = grad_scope_pos(p->name);
      bool param_scope = pos != std::string::npos && grad_scopes.count(p->name.substr(0, pos));
      if (param_scope || (nonconst == 1 && cands.size() == 1))
        for (const Value* c : cands) mark(c);
    }
    return grads;
  }

  static MemoryCategory category_of_state(const std::string& kind) {
    return kind == "parameter"         ? MemoryCategory::parameters
           : kind == "optimizer_state" ? MemoryCategory::optimizer_state
                                       : MemoryCategory::data_and_buffers;
  }

  void categorize() {
    for (const auto& sb : g_.state) {
      if (sb.input) state_kind_[sb.input] = sb.kind;
      if (sb.output) state_kind_[sb.output] = sb.kind;
      if (sb.kind == "parameter" && sb.input) params_.insert(sb.input);
    }
    std::unordered_set<std::string> grad_scopes;  // parameters and their copies: "<name>/grad..."
    for (const Value* p : params_) grad_scopes.insert(p->name);
    const std::unordered_set<const Value*> copies = weight_copies(grad_scopes);
    const std::unordered_set<const Value*> grads = gradients(grad_scopes);
    std::unordered_set<const Value*> read_by_backward;
    for (int i = 0; i < N_; ++i)
      if (phase_[i] == Phase::backward)
        for (Value* in : tl_[i].node->inputs)
          if (in) read_by_backward.insert(in);

    for (auto& vp : plan_.values) {
      const Value* v = vp.value;
      auto sk = state_kind_.find(v);
      if (sk != state_kind_.end()) {
        vp.category = category_of_state(sk->second);
      } else if (vp.persistent) {
        vp.category = MemoryCategory::data_and_buffers;
      } else if (copies.count(v)) {
        vp.category = MemoryCategory::low_precision_weights;
      } else if (grads.count(v)) {
        vp.category = MemoryCategory::gradients;
      } else if (phase_of_value(v) == static_cast<int>(Phase::forward) && read_by_backward.count(v)) {
        vp.category = MemoryCategory::saved_activations;
      } else {
        vp.category = MemoryCategory::temporaries;
      }
    }
    // Loop bodies: scan slices are data; a carried state (BatchNorm statistics) keeps the
    // category of the loop output it becomes.
    for (auto& li : loops_)
      for (size_t j = 0; j < li.body->inputs.size(); ++j) {
        auto it = idx_.find(li.body->inputs[j]);
        if (it == idx_.end()) continue;
        if (j >= li.carried) {
          plan_.values[it->second].category = MemoryCategory::data_and_buffers;
        } else {
          auto sk = state_kind_.find(li.node->outputs[j]);
          if (sk != state_kind_.end()) plan_.values[it->second].category = category_of_state(sk->second);
        }
      }
    for (const auto& vp : plan_.values)
      if (vp.category == MemoryCategory::saved_activations) plan_.saved_activation_bytes += vp.bytes;
  }

  // ---- optimizer state per parameter (state "<param>.<slot>" belongs to <param>)
  void optimizer_groups() {
    std::map<std::string, std::pair<int64_t, bool>> per_param;  // name -> (state bytes, has 8-bit codes)
    for (const auto& sb : g_.state) {
      if (!sb.input) continue;
      auto it = idx_.find(sb.input);
      if (it == idx_.end()) continue;
      if (sb.kind == "parameter") plan_.parameter_elements += std::max<int64_t>(0, sb.input->shape.numel());
      if (sb.kind != "optimizer_state") continue;
      plan_.optimizer_state_bytes += plan_.values[it->second].bytes;
      const Value* best = nullptr;
      for (const Value* p : params_)
        if (sb.input->name.rfind(p->name + ".", 0) == 0 && (!best || p->name.size() > best->name.size())) best = p;
      if (!best) continue;
      auto& e = per_param[best->name];
      e.first += plan_.values[it->second].bytes;
      if (sb.input->dtype == DType::u8 || sb.input->dtype == DType::i8) e.second = true;
    }
    for (const Value* p : params_) {
      auto it = per_param.find(p->name);
      if (it == per_param.end()) continue;
      OptimizerGroup& grp = it->second.second ? plan_.optim_8bit : plan_.optim_other;
      ++grp.tensors;
      grp.param_elements += std::max<int64_t>(0, p->shape.numel());
      grp.state_bytes += it->second.first;
    }
  }

  // ---- buffers and in-place reuse (schedule order)
  bool holds_buffer(int vi) const {
    const ValuePlan& v = plan_.values[vi];
    return !v.persistent && v.buffer >= 0 && plan_.buffers[v.buffer].values.back() == vi;
  }

  void new_buffer(int vi, int first) {
    ValuePlan& ov = plan_.values[vi];
    BufferPlan b;
    b.size = align_up(ov.bytes, opts_.alignment);
    b.first = first;
    b.last = ov.end;
    b.values.push_back(vi);
    ov.buffer = static_cast<int>(plan_.buffers.size());
    plan_.buffers.push_back(std::move(b));
  }

  /// `vi` takes over the buffer of `from` from position `at` on (in place, or a move).
  void take_over(int vi, int from, int at, bool count_reuse) {
    ValuePlan& ov = plan_.values[vi];
    ValuePlan& iv = plan_.values[from];
    ov.buffer = iv.buffer;
    ov.reuses = iv.value;
    acct_end_[from] = std::min(acct_end_[from], at - 1);
    BufferPlan& b = plan_.buffers[iv.buffer];
    b.values.push_back(vi);
    b.last = std::max(b.last, ov.end);
    if (count_reuse) ++plan_.in_place_reuses;
  }

  /// A loop body's inputs at its first position: stolen carried inputs move in, the rest
  /// get buffers of their own.
  void place_body_inputs(const LoopInfo& li, int i) {
    for (size_t j = 0; j < li.body->inputs.size(); ++j) {
      int vi = idx_.at(li.body->inputs[j]);
      if (plan_.values[vi].bytes == 0) continue;
      int from = -1;
      if (j < li.carried && li.steal) {  // a stolen carried input moves into the body
        auto it = idx_.find(li.node->inputs[j]);
        if (it != idx_.end() && holds_buffer(it->second) && plan_.values[it->second].bytes == plan_.values[vi].bytes)
          from = it->second;
      }
      if (from >= 0)
        take_over(vi, from, i, false);
      else
        new_buffer(vi, i);
    }
  }

  /// Loop outputs are the last iteration's carried values (the body outputs' buffers).
  void place_loop_outputs(const Node& n, int i) {
    const LoopInfo& li = *loop_of_.at(&n);
    std::unordered_set<int> taken;
    for (int k = 0; k < n.num_outputs(); ++k) {
      int oi = idx_.at(n.outputs[k]);
      if (plan_.values[oi].bytes == 0) continue;
      auto it = idx_.find(li.body->outputs[k]);
      if (it != idx_.end() && owner_.at(li.body->outputs[k]) == li.body && holds_buffer(it->second) &&
          plan_.values[it->second].bytes == plan_.values[oi].bytes && !taken.count(plan_.values[it->second].buffer)) {
        taken.insert(plan_.values[it->second].buffer);
        take_over(oi, it->second, i, false);
      } else {
        new_buffer(oi, i);
      }
    }
  }

  /// Input k's value index when output 0 of the node at `i` may take its buffer, as the
  /// interpreter allows it: last use here, not pinned, storage unique (a node output or body
  /// input of this graph, not a resident or captured value), the same dtype, read once by
  /// this node; -1 otherwise.
  int dying_input(const Node& n, int i, int64_t k) {
    const Graph* ng = tl_[i].graph;
    if (k < 0 || k >= n.num_inputs() || !n.inputs[k] || n.num_outputs() == 0 || !n.outputs[0]) return -1;
    const Value* v = n.inputs[k];
    auto it = idx_.find(v);
    if (it == idx_.end() || owner_.at(v) != ng || plan_.values[it->second].persistent || last_use_[v] != i ||
        pinned_[ng].count(v) || !holds_buffer(it->second) || v->dtype != n.outputs[0]->dtype)
      return -1;
    for (int j = 0; j < n.num_inputs(); ++j)
      if (j != k && n.inputs[j] == v) return -1;
    return it->second;
  }

  /// kiln_donate: output j is written into the resident buffer of the state input d[j]
  /// (its last reader is this node): no buffer, no bytes of its own. Returns, per output,
  /// whether it was donated.
  std::vector<bool> donate_outputs(const Node& n, int i) {
    std::vector<bool> donated(static_cast<size_t>(n.num_outputs()), false);
    if (!opts_.donate_state) return donated;
    const std::vector<int64_t> d = n.attrs.get_ints("kiln_donate");
    for (size_t j = 0; j < d.size() && j < donated.size(); ++j) {
      if (d[j] < 0 || d[j] >= n.num_inputs() || !n.inputs[d[j]] || !n.outputs[j]) continue;
      const Value* v = n.inputs[d[j]];
      auto it = idx_.find(v);
      if (it == idx_.end() || !plan_.values[it->second].persistent || owner_.at(v) != &g_ || last_use_[v] != i ||
          pinned_[&g_].count(v))
        continue;
      ValuePlan& ov = plan_.values[idx_.at(n.outputs[j])];
      plan_.donated_bytes += ov.bytes;
      ++plan_.donated_outputs;
      ov.bytes = 0;
      ov.reuses = v;
      donated[j] = true;
    }
    return donated;
  }

  /// The outputs of an ordinary node: in place (kiln_inplace, views, pointwise reuse of a
  /// dying input), donated, or new buffers.
  void place_node_outputs(const Node& n, int i) {
    const Graph* ng = tl_[i].graph;
    std::unordered_set<int> taken;
    const OpDef* def = OpTable::get().find(n.op);
    const bool pointwise = in_place_ && def && def->fusion == FusionClass::pointwise;
    // kiln_inplace = k: output 0 writes into input k (same dims).
    int inplace_from = -1;
    if (opts_.honor_inplace_attr) {
      const int64_t ip = n.attrs.get_int("kiln_inplace", -1);
      const int from = dying_input(n, i, ip);
      if (from >= 0 && n.inputs[ip]->shape == n.outputs[0]->shape) inplace_from = from;
    }
    const std::vector<bool> donated = donate_outputs(n, i);
    // Reshape-family views (ir::is_view_op): the output shares its input's buffer when
    // the input dies here, as runtime/interpreter.cpp does (no copy, no new buffer).
    if (inplace_from < 0 && is_view_op(n.op) && n.num_outputs() == 1) {
      const int from = dying_input(n, i, 0);
      auto ot = n.outputs[0] ? idx_.find(n.outputs[0]) : idx_.end();
      if (from >= 0 && ot != idx_.end() && plan_.values[from].bytes == plan_.values[ot->second].bytes)
        inplace_from = from;
    }
    for (int k = 0; k < n.num_outputs(); ++k) {
      Value* o = n.outputs[k];
      if (!o) continue;
      int oi = idx_.at(o);
      ValuePlan& ov = plan_.values[oi];
      if (ov.bytes == 0 || donated[static_cast<size_t>(k)]) continue;
      int reuse = -1;
      if (k == 0 && inplace_from >= 0)
        reuse = inplace_from;
      else if (pointwise)
        for (Value* in : n.inputs) {
          if (!in) continue;
          int ii = idx_.at(in);
          const ValuePlan& iv = plan_.values[ii];
          if (iv.persistent || owner_.at(in) != ng || iv.end != i || iv.bytes != ov.bytes || !holds_buffer(ii) ||
              taken.count(iv.buffer) || pinned_[ng].count(in))
            continue;
          reuse = ii;
          break;
        }
      if (reuse >= 0 && !taken.count(plan_.values[reuse].buffer)) {
        taken.insert(plan_.values[reuse].buffer);
        take_over(oi, reuse, i, true);
      } else {
        new_buffer(oi, i);
      }
    }
  }

  void assign_buffers() {
    acct_start_.resize(plan_.values.size());
    acct_end_.resize(plan_.values.size());
    for (size_t k = 0; k < plan_.values.size(); ++k)
      acct_start_[k] = plan_.values[k].def, acct_end_[k] = plan_.values[k].end;
    for (int i = 0; i < N_; ++i) {
      for (auto& li : loops_)
        if (li.body_start == i) place_body_inputs(li, i);
      const Node& n = *tl_[i].node;
      if (loop_of_.count(&n))
        place_loop_outputs(n, i);
      else
        place_node_outputs(n, i);
    }
  }

  // ---- multi-tensor groups (passes/multi_tensor.cpp): members run concurrently, so a
  // buffer born or dying at a member is live over the whole group (positions lo..hi of
  // the group's members), and so are the values it holds for the accounting.
  void widen_multi_tensor_groups() {
    std::map<std::pair<const Graph*, int64_t>, std::pair<int, int>> span;
    for (int i = 0; i < N_; ++i) {
      const int64_t gid = tl_[i].node->attrs.get_int("kiln_multi_tensor_group", -1);
      if (gid < 0) continue;
      auto [it, fresh] = span.try_emplace({tl_[i].graph, gid}, i, i);
      if (!fresh) it->second.first = std::min(it->second.first, i), it->second.second = std::max(it->second.second, i);
    }
    std::vector<std::pair<int, int>> groups;  // (lo, hi) of groups of two or more positions
    for (auto& [key, lh] : span)
      if (lh.second > lh.first) groups.push_back(lh);
    auto widen = [&](int& first, int& last) {
      for (auto [lo, hi] : groups) {
        if (first >= lo && first <= hi) first = lo;
        if (last >= lo && last <= hi) last = hi;
      }
    };
    for (auto& b : plan_.buffers) widen(b.first, b.last);
    for (size_t k = 0; k < plan_.values.size(); ++k) {
      const ValuePlan& vp = plan_.values[k];
      if (vp.persistent || vp.bytes == 0 || vp.def < 0 || acct_end_[k] < vp.def) continue;
      widen(acct_start_[k], acct_end_[k]);
    }
    // A buffer's values follow one another (in-place chains, moves): after widening, a
    // value is counted only until its successor in the buffer is, or the group would
    // count the one buffer twice (SGD's kiln_inplace updates: each new parameter takes
    // its dying gradient's buffer; resnet18 planned 2.13 MiB against 1.77 measured).
    for (const auto& b : plan_.buffers)
      for (size_t q = 0; q + 1 < b.values.size(); ++q) {
        const int a = b.values[q], c = b.values[q + 1];
        if (acct_start_[c] <= acct_end_[a]) acct_end_[a] = std::max(acct_start_[a] - 1, acct_start_[c] - 1);
      }
  }

  /// Best-fit placement of the arena buffers in `order`; writes `offset` and returns the
  /// arena's top (bytes).
  int64_t place(const std::vector<int>& order, std::vector<int64_t>& offset) const {
    offset.assign(plan_.buffers.size(), -1);
    int64_t top = 0;
    std::vector<int> placed;
    for (int bi : order) {
      const BufferPlan& b = plan_.buffers[bi];
      if (!b.in_arena) continue;
      std::vector<std::pair<int64_t, int64_t>> overlap;  // (offset, size) of placed buffers live with b
      for (int pi : placed) {
        const BufferPlan& q = plan_.buffers[pi];
        if (q.first <= b.last && b.first <= q.last) overlap.push_back({offset[pi], q.size});
      }
      std::sort(overlap.begin(), overlap.end());
      int64_t cursor = 0, best = -1, best_gap = -1;
      for (auto [off, size] : overlap) {
        const int64_t gap = off - cursor;
        if (gap >= b.size && (best < 0 || gap < best_gap)) best = cursor, best_gap = gap;
        cursor = std::max(cursor, off + size);
      }
      offset[bi] = best >= 0 ? best : cursor;
      top = std::max(top, offset[bi] + b.size);
      placed.push_back(bi);
    }
    return top;
  }

  // ---- offsets: best fit in a given order; greedy by size (largest first) unless
  // placing buffers by their start (then size) gives a smaller arena (the two orders
  // TFLite's arena planner and XLA's heap simulator offer; neither wins always: chains
  // of in-place buffers live long and fragment size order).
  void place_offsets() {
    for (auto& b : plan_.buffers)
      if (opts_.heap_values && !b.values.empty() && opts_.heap_values->count(plan_.values[b.values.front()].value)) {
        b.in_arena = false;
        b.offset = -1;
      }
    std::vector<int> by_size(plan_.buffers.size());
    for (size_t k = 0; k < by_size.size(); ++k) by_size[k] = static_cast<int>(k);
    std::vector<int> by_start = by_size;
    std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) {
      const BufferPlan &x = plan_.buffers[a], &y = plan_.buffers[b];
      if (x.size != y.size) return x.size > y.size;
      return x.first < y.first;
    });
    std::stable_sort(by_start.begin(), by_start.end(), [&](int a, int b) {
      const BufferPlan &x = plan_.buffers[a], &y = plan_.buffers[b];
      if (x.first != y.first) return x.first < y.first;
      return x.size > y.size;
    });
    // Also: longest-lived first (then size), and by area (bytes x positions live), the
    // orders of the "greedy by breadth" and conflict-area heuristics (Pisarchyk & Lee,
    // "Efficient Memory Management for Deep Neural Net Inference", 2020).
    std::vector<int> by_life = by_size, by_area = by_size;
    auto life = [&](int k) { return int64_t{plan_.buffers[k].last} - plan_.buffers[k].first + 1; };
    std::stable_sort(by_life.begin(), by_life.end(), [&](int a, int b) {
      if (life(a) != life(b)) return life(a) > life(b);
      return plan_.buffers[a].size > plan_.buffers[b].size;
    });
    std::stable_sort(by_area.begin(), by_area.end(), [&](int a, int b) {
      const double x = double(plan_.buffers[a].size) * double(life(a)),
                   y = double(plan_.buffers[b].size) * double(life(b));
      return x > y;
    });
    std::vector<int64_t> chosen;
    plan_.arena_bytes = -1;
    for (const std::vector<int>* order : {&by_size, &by_start, &by_life, &by_area}) {
      std::vector<int64_t> off;
      const int64_t top = place(*order, off);
      if (plan_.arena_bytes < 0 || top < plan_.arena_bytes) plan_.arena_bytes = top, chosen = std::move(off);
    }
    for (size_t k = 0; k < plan_.buffers.size(); ++k)
      if (plan_.buffers[k].in_arena) plan_.buffers[k].offset = chosen[k];
    for (auto& vp : plan_.values)
      if (vp.buffer >= 0) vp.offset = plan_.buffers[vp.buffer].offset;  // -1 for heap buffers
  }

  // ---- accounting: live bytes per position and category, the peak and where it is
  void account() {
    for (auto& vp : plan_.values)
      if (vp.persistent) plan_.persistent_bytes += vp.bytes;
    const int T = std::max(N_, 1);
    std::vector<CategoryBytes> diff(T + 1, CategoryBytes{});
    for (size_t k = 0; k < plan_.values.size(); ++k) {
      const ValuePlan& vp = plan_.values[k];
      if (vp.bytes == 0) continue;
      int a = vp.persistent ? 0 : acct_start_[k], e = vp.persistent ? T - 1 : acct_end_[k];
      if (e < a) continue;
      diff[a][static_cast<int>(vp.category)] += vp.bytes;
      diff[e + 1][static_cast<int>(vp.category)] -= vp.bytes;
    }
    if (opts_.eager_semantics || opts_.count_kernel_scratch)
      for (int t = 0; t < N_; ++t) {
        const int64_t s = eager_kernel_scratch_bytes(*tl_[t].node);
        if (s <= 0) continue;
        diff[t][static_cast<int>(MemoryCategory::temporaries)] += s;
        diff[t + 1][static_cast<int>(MemoryCategory::temporaries)] -= s;
        plan_.kernel_scratch_bytes = std::max(plan_.kernel_scratch_bytes, s);
      }
    CategoryBytes cur{};
    plan_.peak_bytes = -1;
    plan_.live.reserve(static_cast<size_t>(N_));
    for (int t = 0; t < T; ++t) {
      int64_t total = 0;
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        cur[c] += diff[t][c];
        total += cur[c];
        plan_.max_by_category[c] = std::max(plan_.max_by_category[c], cur[c]);
      }
      if (t < N_) plan_.live.push_back(cur);
      if (t < N_ && phase_[t] == Phase::backward && plan_.backward_start < 0) plan_.backward_start = t;
      if (t < N_ && phase_[t] == Phase::optimizer && plan_.optimizer_start < 0) plan_.optimizer_start = t;
      if (total > plan_.peak_bytes) {
        plan_.peak_bytes = total;
        plan_.at_peak = cur;
        plan_.peak_node = N_ > 0 ? t : -1;
      }
    }
    if (plan_.peak_node >= 0) {
      const Entry& e = tl_[plan_.peak_node];
      plan_.peak_node_name = e.node->name + " (" + e.node->op + ")";
      if (e.loop)
        plan_.peak_node_name += ", inside the body of " + e.loop->name + " (each of " +
                                std::to_string(e.loop->attrs.get_int("trip_count", 1)) + " iterations)";
      plan_.peak_in_loop_body = e.loop != nullptr;
    }
  }

  const Graph& g_;
  const PlanOptions& opts_;
  MemoryPlan plan_;
  std::vector<Entry> tl_;  ///< the schedule
  std::vector<LoopInfo> loops_;
  int N_ = 0;                                      ///< schedule length
  bool in_place_ = false;                          ///< pointwise in-place reuse (off with eager semantics)
  std::unordered_map<const Node*, int> node_pos_;  ///< node -> schedule position
  std::unordered_map<const Node*, const LoopInfo*> loop_of_;
  std::unordered_map<const Value*, std::pair<const LoopInfo*, size_t>> body_input_slot_;
  std::unordered_map<const Value*, int> idx_;  ///< value -> index into plan_.values
  std::unordered_map<const Value*, const Graph*> owner_;
  std::unordered_map<const Graph*, int> graph_end_;
  std::unordered_map<const Graph*, std::unordered_set<const Value*>> pinned_;
  std::vector<Phase> phase_;
  std::unordered_map<const Value*, int> last_use_;
  std::unordered_map<const Value*, std::string> state_kind_;
  std::unordered_set<const Value*> params_;
  std::vector<int> acct_start_, acct_end_;  ///< positions each value is counted over
};

}  // namespace

Expected<MemoryPlan> plan_memory(const Graph& g, const PlanOptions& opts) { return Planner(g, opts).run(); }

std::string human_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (std::abs(v) >= 1024.0 && u < 4) v /= 1024.0, ++u;
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

std::string format_memory_plan(const MemoryPlan& p) {
  std::ostringstream os;
  auto cell = [](int64_t b) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%12s %14lld B", human_bytes(b).c_str(), static_cast<long long>(b));
    return std::string(buf);
  };
  auto per_param = [&](int64_t b) {
    char buf[32];
    if (p.parameter_elements > 0)
      std::snprintf(buf, sizeof buf, "%10.2f", double(b) / double(p.parameter_elements));
    else
      std::snprintf(buf, sizeof buf, "%10s", "-");
    return std::string(buf);
  };
  char head[200];
  std::snprintf(head, sizeof head, "  %-28s %29s   %29s   %10s\n", "category", "at peak", "max over step",
                "peak B/param");
  os << "memory plan (" << p.num_nodes << " nodes in schedule order";
  if (p.accumulation_loops > 0)
    os << ", " << p.accumulation_loops << " accumulation loop" << (p.accumulation_loops > 1 ? "s" : "")
       << " (trip_count " << p.trip_count << "; one iteration's body planned, every iteration reuses it)";
  os << "; "
     << (p.options.eager_semantics ? "eager interpreter semantics"
         : p.options.in_place      ? "in-place reuse on"
                                   : "no in-place reuse")
     << ")\n"
     << head;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    char row[64];
    std::snprintf(row, sizeof row, "  %-28s ", memory_category_name(static_cast<MemoryCategory>(c)));
    os << row << cell(p.at_peak[c]) << "   " << cell(p.max_by_category[c]) << "   " << per_param(p.at_peak[c]) << "\n";
  }
  char row[64];
  std::snprintf(row, sizeof row, "  %-28s ", "total (peak)");
  os << row << cell(p.peak_bytes) << "   " << std::string(29, ' ') << "   " << per_param(p.peak_bytes) << "\n";
  os << "  (peak B/param: bytes at the peak / " << p.parameter_elements
     << " parameter elements; the max over the step counts a state's input and its updated output)\n";
  if (p.peak_node >= 0) os << "peak at schedule position " << p.peak_node << ": " << p.peak_node_name << "\n";
  if (p.kernel_scratch_bytes > 0)
    os << "eager kernel scratch (largest, counted as temporaries at its node): " << human_bytes(p.kernel_scratch_bytes)
       << " (" << p.kernel_scratch_bytes << " B)\n";
  os << "saved activations (all): " << human_bytes(p.saved_activation_bytes) << " (" << p.saved_activation_bytes
     << " B)\n";
  auto bpp = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", v);
    return std::string(buf);
  };
  os << "optimizer state per parameter: " << bpp(p.optimizer_state_bytes_per_param_element()) << " B/param overall ("
     << p.optimizer_state_bytes << " B over " << p.parameter_elements << " parameter elements)";
  if (p.optim_8bit.tensors > 0)
    os << "; 8-bit blockwise: " << bpp(p.optim_8bit.bytes_per_param()) << " B/param (" << p.optim_8bit.tensors
       << " tensors, " << p.optim_8bit.param_elements << " elements, " << p.optim_8bit.state_bytes << " B)";
  if (p.optim_other.tensors > 0)
    os << "; " << (p.optim_8bit.tensors > 0 ? "32-bit (below the 8-bit size threshold): " : "32-bit: ")
       << bpp(p.optim_other.bytes_per_param()) << " B/param (" << p.optim_other.tensors << " tensors, "
       << p.optim_other.param_elements << " elements, " << p.optim_other.state_bytes << " B)";
  os << "\n";
  os << "arena: " << human_bytes(p.arena_bytes) << " (" << p.arena_bytes << " B, " << p.buffers.size() << " buffers, "
     << p.in_place_reuses << " in-place reuses); resident inputs and constants: " << human_bytes(p.persistent_bytes)
     << " (" << p.persistent_bytes << " B)\n";
  if (p.donated_outputs > 0)
    os << "donated state: " << p.donated_outputs << " updated state tensors written into their inputs' buffers ("
       << human_bytes(p.donated_bytes) << " not allocated; kiln_donate)\n";
  return os.str();
}

std::string format_buffer_offsets(const MemoryPlan& p) {
  std::ostringstream os;
  std::vector<size_t> order(p.buffers.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const BufferPlan &x = p.buffers[a], &y = p.buffers[b];
    if ((x.offset < 0) != (y.offset < 0)) return y.offset < 0;
    return x.offset < y.offset;
  });
  os << "arena buffers (" << p.buffers.size() << "; offset B, size B, live at schedule positions, values in turn):\n";
  for (size_t k : order) {
    const BufferPlan& b = p.buffers[k];
    char head[96];
    if (b.offset >= 0)
      std::snprintf(head, sizeof head, "  %12lld %12lld  [%d, %d]  ", static_cast<long long>(b.offset),
                    static_cast<long long>(b.size), b.first, b.last);
    else
      std::snprintf(head, sizeof head, "  %12s %12lld  [%d, %d]  ", "heap", static_cast<long long>(b.size), b.first,
                    b.last);
    os << head;
    for (size_t q = 0; q < b.values.size(); ++q)
      os << (q ? " -> " : "")
         << (p.values[static_cast<size_t>(b.values[q])].value ? p.values[static_cast<size_t>(b.values[q])].value->name
                                                              : "?");
    os << "\n";
  }
  for (const ValuePlan& vp : p.values)
    if (vp.value && vp.reuses && vp.bytes == 0 && vp.buffer < 0 && vp.def >= 0)
      os << "  " << std::string(12, ' ') << " donated  " << vp.value->name << " -> the buffer of " << vp.reuses->name
         << "\n";
  return os.str();
}

}  // namespace kiln::passes
