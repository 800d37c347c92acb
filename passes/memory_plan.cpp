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
// through the "<param>/grad" summation scope and single-input copies of equal size.
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

}  // namespace

Expected<MemoryPlan> plan_memory(const Graph& g, const PlanOptions& opts) {
  MemoryPlan plan;
  plan.options = opts;
  std::vector<Entry> tl;
  std::vector<LoopInfo> loops;
  KILN_RETURN_IF_ERROR(flatten(g, nullptr, tl, loops));
  const int N = static_cast<int>(tl.size());
  plan.num_nodes = N;
  plan.accumulation_loops = static_cast<int>(loops.size());
  for (auto& li : loops) plan.trip_count = std::max(plan.trip_count, li.node->attrs.get_int("trip_count", 1));
  const bool in_place = opts.in_place && !opts.eager_semantics;

  std::unordered_map<const Node*, int> node_pos;  // node -> schedule position
  for (int p = 0; p < N; ++p) node_pos[tl[p].node] = p;
  std::unordered_map<const Node*, const LoopInfo*> loop_of;
  for (auto& li : loops) loop_of[li.node] = &li;
  std::unordered_map<const Value*, std::pair<const LoopInfo*, size_t>> body_input_slot;
  for (auto& li : loops)
    for (size_t j = 0; j < li.body->inputs.size(); ++j) body_input_slot[li.body->inputs[j]] = {&li, j};

  std::unordered_map<const Value*, int> idx;  // value -> index into plan.values
  std::unordered_map<const Value*, const Graph*> owner;
  auto bytes_of = [](const Value* v) -> Expected<int64_t> {
    if (v->dtype == DType::undefined) return int64_t(0);
    int64_t n = v->shape.numel();
    if (n < 0)
      return Status::error("memory plan: value '" + v->name + "' has non-static shape " + v->shape.to_string() +
                           " (bind symbolic dims with --shape)");
    return n * static_cast<int64_t>(dtype_size(v->dtype));
  };
  auto add_value = [&](const Value* v, const Graph* gr, bool persistent, int def) -> Status {
    if (!v || idx.count(v)) return Status::ok();
    KILN_ASSIGN_OR_RETURN(int64_t b, bytes_of(v));
    ValuePlan vp;
    vp.value = v;
    vp.bytes = b;
    vp.persistent = persistent;
    vp.def = def;
    idx[v] = static_cast<int>(plan.values.size());
    owner[v] = gr;
    plan.values.push_back(vp);
    return Status::ok();
  };
  // Where each graph's run ends (a body: its last node, i.e. the end of one iteration)
  // and what it pins (graph outputs and constants; a body: its outputs).
  std::unordered_map<const Graph*, int> graph_end;
  std::unordered_map<const Graph*, std::unordered_set<const Value*>> pinned;
  graph_end[&g] = N - 1;
  pinned[&g].insert(g.outputs.begin(), g.outputs.end());
  pinned[&g].insert(g.initializers.begin(), g.initializers.end());
  for (auto& li : loops) {
    graph_end[li.body] = li.end - 1;
    pinned[li.body].insert(li.body->outputs.begin(), li.body->outputs.end());
  }
  for (Value* v : g.inputs) KILN_RETURN_IF_ERROR(add_value(v, &g, true, -1));
  if (opts.streamed_microbatches)  // streamed scan inputs are never resident whole (see PlanOptions)
    for (const Value* v : ir::streamable_scan_inputs(g)) plan.values[idx.at(v)].bytes = 0;
  for (Value* v : g.initializers) KILN_RETURN_IF_ERROR(add_value(v, &g, true, -1));
  std::vector<Phase> phase(N);
  std::unordered_map<const Value*, int> last_use;
  for (int i = 0; i < N; ++i) {
    for (auto& li : loops)
      if (li.body_start == i) {
        // Carried values and scan slices exist before the body's first node runs;
        // body constants live in the graph (resident).
        for (Value* v : li.body->inputs) KILN_RETURN_IF_ERROR(add_value(v, li.body, false, i));
        for (Value* v : li.body->initializers) KILN_RETURN_IF_ERROR(add_value(v, li.body, true, -1));
      }
    const Node& n = *tl[i].node;
    phase[i] = phase_of(n);
    for (Value* in : n.inputs) {
      if (!in) continue;
      if (!idx.count(in) && !in->producer)
        return Status::error("memory plan: node '" + n.name + "' reads '" + in->name +
                             "', which is neither a graph input, an initializer nor a node output");
      last_use[in] = std::max(last_use.count(in) ? last_use[in] : -1, i);
    }
    if (loop_of.count(&n)) {  // the interpreter releases captured values after the loop
      std::unordered_set<const Value*> caps;
      collect_captures(*n.regions[0], caps);
      for (const Value* v : caps) last_use[v] = std::max(last_use.count(v) ? last_use[v] : -1, i);
    }
    for (Value* o : n.outputs) KILN_RETURN_IF_ERROR(add_value(o, tl[i].graph, false, i));
  }

  // ---- liveness
  for (auto& vp : plan.values) {
    if (vp.persistent) {
      vp.def = 0;
      vp.end = N - 1;
      continue;
    }
    const Graph* gr = owner.at(vp.value);
    const int ge = graph_end.at(gr);
    auto lu = last_use.find(vp.value);
    if (pinned[gr].count(vp.value))
      vp.end = ge;
    else if (lu != last_use.end())
      vp.end = std::max(lu->second, vp.def);
    else
      vp.end = opts.eager_semantics ? ge : vp.def;
  }
  // The interpreter moves a loop's carried inputs into the loop when every one of them
  // is last used by the loop, none is pinned and none repeats.
  for (auto& li : loops) {
    const Node& n = *li.node;
    const auto& pin = pinned[node_pos.count(&n) ? tl[li.end].graph : &g];
    li.steal = true;
    for (size_t c = 0; c < li.carried; ++c) {
      const Value* v = n.inputs[c];
      auto lu = v ? last_use.find(v) : last_use.end();
      if (!v || lu == last_use.end() || lu->second != li.end || pin.count(v)) li.steal = false;
      for (size_t c2 = 0; c2 < c; ++c2)
        if (n.inputs[c2] == v) li.steal = false;
    }
  }

  // ---- categories
  std::unordered_map<const Value*, std::string> state_kind;
  std::unordered_set<const Value*> params;
  for (const auto& sb : g.state) {
    if (sb.input) state_kind[sb.input] = sb.kind;
    if (sb.output) state_kind[sb.output] = sb.kind;
    if (sb.kind == "parameter" && sb.input) params.insert(sb.input);
  }
  auto phase_of_value = [&](const Value* v) -> int {
    const Node* p = v ? v->producer : nullptr;
    if (!p) return -1;
    auto k = node_pos.find(p);
    if (k == node_pos.end()) return -1;
    // An output of a fused group is in the phase of the body node that makes it: the
    // kernel's own phase is its latest node's (a gradient cast fused with the clipping
    // norm's square sum is a backward value, not an optimizer temporary).
    if (has_trait(*p, OpTrait::fused_kernel) && p->regions.size() == 1 && v->producer_output >= 0 &&
        static_cast<size_t>(v->producer_output) < p->regions[0]->outputs.size()) {
      const Value* bo = p->regions[0]->outputs[static_cast<size_t>(v->producer_output)];
      if (bo && bo->producer) return static_cast<int>(phase_of(*bo->producer));
    }
    return static_cast<int>(phase[k->second]);
  };
  // Low-precision weight copies: a forward node whose only non-constant input is a parameter,
  // producing an equally sized tensor of a narrower dtype.
  std::unordered_set<const Value*> weight_copies;
  std::unordered_set<std::string> grad_scopes;  // parameters and their copies: "<name>/grad..."
  for (const Value* p : params) grad_scopes.insert(p->name);
  for (int i = 0; i < N; ++i) {
    const Node& n = *tl[i].node;
    if (phase[i] != Phase::forward) continue;
    const Value* only = nullptr;
    int nonconst = 0;
    for (Value* in : n.inputs)
      if (in && !in->is_initializer()) ++nonconst, only = in;
    if (nonconst != 1 || !params.count(only)) continue;
    for (Value* o : n.outputs)
      if (o && is_float(o->dtype) && o->shape.numel() == only->shape.numel() &&
          dtype_size(o->dtype) < dtype_size(only->dtype)) {
        weight_copies.insert(o);
        grad_scopes.insert(o->name);
      }
  }
  // Gradients: backward values read by the optimizer or listed as graph outputs, then
  // followed back through the parameter's "/grad" scope and single-input copies; an
  // AccumulationLoop output accumulating a backward value is a gradient too, with its
  // whole accumulator chain (zero init, body input, in-place Add, body output).
  std::unordered_set<const Value*> grads;
  std::vector<const Value*> work;
  auto is_bwd_value = [&](const Value* v) { return v && phase_of_value(v) == static_cast<int>(Phase::backward); };
  auto accumulates_bwd = [&](const Value* v) {
    if (!v || !v->producer || !loop_of.count(v->producer)) return false;
    const LoopInfo& li = *loop_of.at(v->producer);
    const Value* bo = li.body->outputs[v->producer_output];
    if (!bo || !bo->producer) return false;
    for (Value* in : bo->producer->inputs)
      if (is_bwd_value(in)) return true;
    return false;
  };
  auto bwd_like = [&](const Value* v) { return is_bwd_value(v) || accumulates_bwd(v); };
  auto mark = [&](const Value* v) {
    if (v && grads.insert(v).second) work.push_back(v);
  };
  for (int i = 0; i < N; ++i) {
    if (phase[i] != Phase::optimizer) continue;
    for (Value* in : tl[i].node->inputs)
      if (bwd_like(in)) mark(in);
  }
  for (Value* o : g.outputs)
    if (bwd_like(o)) mark(o);
  while (!work.empty()) {
    const Value* v = work.back();
    work.pop_back();
    const Node* p = v->producer;
    if (!p) {
      auto bi = body_input_slot.find(v);
      if (bi != body_input_slot.end() && bi->second.second < bi->second.first->carried)
        mark(bi->second.first->node->inputs[bi->second.second]);
      continue;
    }
    if (loop_of.count(p)) {
      mark(loop_of.at(p)->body->outputs[v->producer_output]);
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
  std::unordered_set<const Value*> read_by_backward;
  for (int i = 0; i < N; ++i)
    if (phase[i] == Phase::backward)
      for (Value* in : tl[i].node->inputs)
        if (in) read_by_backward.insert(in);

  auto category_of_state = [](const std::string& kind) {
    return kind == "parameter"         ? MemoryCategory::parameters
           : kind == "optimizer_state" ? MemoryCategory::optimizer_state
                                       : MemoryCategory::data_and_buffers;
  };
  for (auto& vp : plan.values) {
    const Value* v = vp.value;
    auto sk = state_kind.find(v);
    if (sk != state_kind.end()) {
      vp.category = category_of_state(sk->second);
    } else if (vp.persistent) {
      vp.category = MemoryCategory::data_and_buffers;
    } else if (weight_copies.count(v)) {
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
  for (auto& li : loops)
    for (size_t j = 0; j < li.body->inputs.size(); ++j) {
      auto it = idx.find(li.body->inputs[j]);
      if (it == idx.end()) continue;
      if (j >= li.carried) {
        plan.values[it->second].category = MemoryCategory::data_and_buffers;
      } else {
        auto sk = state_kind.find(li.node->outputs[j]);
        if (sk != state_kind.end()) plan.values[it->second].category = category_of_state(sk->second);
      }
    }
  for (const auto& vp : plan.values)
    if (vp.category == MemoryCategory::saved_activations) plan.saved_activation_bytes += vp.bytes;

  // ---- optimizer state per parameter (state "<param>.<slot>" belongs to <param>)
  {
    std::map<std::string, std::pair<int64_t, bool>> per_param;  // name -> (state bytes, has 8-bit codes)
    for (const auto& sb : g.state) {
      if (!sb.input) continue;
      auto it = idx.find(sb.input);
      if (it == idx.end()) continue;
      if (sb.kind == "parameter") plan.parameter_elements += std::max<int64_t>(0, sb.input->shape.numel());
      if (sb.kind != "optimizer_state") continue;
      plan.optimizer_state_bytes += plan.values[it->second].bytes;
      const Value* best = nullptr;
      for (const Value* p : params)
        if (sb.input->name.rfind(p->name + ".", 0) == 0 && (!best || p->name.size() > best->name.size())) best = p;
      if (!best) continue;
      auto& e = per_param[best->name];
      e.first += plan.values[it->second].bytes;
      if (sb.input->dtype == DType::u8 || sb.input->dtype == DType::i8) e.second = true;
    }
    for (const Value* p : params) {
      auto it = per_param.find(p->name);
      if (it == per_param.end()) continue;
      OptimizerGroup& grp = it->second.second ? plan.optim_8bit : plan.optim_other;
      ++grp.tensors;
      grp.param_elements += std::max<int64_t>(0, p->shape.numel());
      grp.state_bytes += it->second.first;
    }
  }

  // ---- buffers and in-place reuse (schedule order)
  std::vector<int> acct_start(plan.values.size()), acct_end(plan.values.size());
  for (size_t k = 0; k < plan.values.size(); ++k) acct_start[k] = plan.values[k].def, acct_end[k] = plan.values[k].end;
  auto holds_buffer = [&](int vi) {
    const ValuePlan& v = plan.values[vi];
    return !v.persistent && v.buffer >= 0 && plan.buffers[v.buffer].values.back() == vi;
  };
  auto new_buffer = [&](int vi, int first) {
    ValuePlan& ov = plan.values[vi];
    BufferPlan b;
    b.size = align_up(ov.bytes, opts.alignment);
    b.first = first;
    b.last = ov.end;
    b.values.push_back(vi);
    ov.buffer = static_cast<int>(plan.buffers.size());
    plan.buffers.push_back(std::move(b));
  };
  // `vi` takes over the buffer of `from` from position `at` on (in place, or a move).
  auto take_over = [&](int vi, int from, int at, bool count_reuse) {
    ValuePlan& ov = plan.values[vi];
    ValuePlan& iv = plan.values[from];
    ov.buffer = iv.buffer;
    ov.reuses = iv.value;
    acct_end[from] = std::min(acct_end[from], at - 1);
    BufferPlan& b = plan.buffers[iv.buffer];
    b.values.push_back(vi);
    b.last = std::max(b.last, ov.end);
    if (count_reuse) ++plan.in_place_reuses;
  };
  for (int i = 0; i < N; ++i) {
    for (auto& li : loops) {
      if (li.body_start != i) continue;
      for (size_t j = 0; j < li.body->inputs.size(); ++j) {
        int vi = idx.at(li.body->inputs[j]);
        if (plan.values[vi].bytes == 0) continue;
        int from = -1;
        if (j < li.carried && li.steal) {  // a stolen carried input moves into the body
          auto it = idx.find(li.node->inputs[j]);
          if (it != idx.end() && holds_buffer(it->second) && plan.values[it->second].bytes == plan.values[vi].bytes)
            from = it->second;
        }
        if (from >= 0)
          take_over(vi, from, i, false);
        else
          new_buffer(vi, i);
      }
    }
    const Node& n = *tl[i].node;
    const Graph* ng = tl[i].graph;
    std::unordered_set<int> taken;
    if (loop_of.count(&n)) {  // loop outputs are the last iteration's carried values
      const LoopInfo& li = *loop_of.at(&n);
      for (int k = 0; k < n.num_outputs(); ++k) {
        int oi = idx.at(n.outputs[k]);
        if (plan.values[oi].bytes == 0) continue;
        auto it = idx.find(li.body->outputs[k]);
        if (it != idx.end() && owner.at(li.body->outputs[k]) == li.body && holds_buffer(it->second) &&
            plan.values[it->second].bytes == plan.values[oi].bytes && !taken.count(plan.values[it->second].buffer)) {
          taken.insert(plan.values[it->second].buffer);
          take_over(oi, it->second, i, false);
        } else {
          new_buffer(oi, i);
        }
      }
      continue;
    }
    const OpDef* def = OpTable::get().find(n.op);
    const bool pointwise = in_place && def && def->fusion == FusionClass::pointwise;
    // Input k's value index when output 0 may take its buffer, as the interpreter allows
    // it: last use here, not pinned, storage unique (a node output or body input of this
    // graph, not a resident or captured value), the same dtype, read once by this node.
    auto dying_input = [&](int64_t k) -> int {
      if (k < 0 || k >= n.num_inputs() || !n.inputs[k] || n.num_outputs() == 0 || !n.outputs[0]) return -1;
      const Value* v = n.inputs[k];
      auto it = idx.find(v);
      if (it == idx.end() || owner.at(v) != ng || plan.values[it->second].persistent || last_use[v] != i ||
          pinned[ng].count(v) || !holds_buffer(it->second) || v->dtype != n.outputs[0]->dtype)
        return -1;
      for (int j = 0; j < n.num_inputs(); ++j)
        if (j != k && n.inputs[j] == v) return -1;
      return it->second;
    };
    // kiln_inplace = k: output 0 writes into input k (same dims).
    int inplace_from = -1;
    if (opts.honor_inplace_attr) {
      const int64_t ip = n.attrs.get_int("kiln_inplace", -1);
      const int from = dying_input(ip);
      if (from >= 0 && n.inputs[ip]->shape.to_vector() == n.outputs[0]->shape.to_vector()) inplace_from = from;
    }
    // kiln_donate: output j is written into the resident buffer of the state input d[j]
    // (its last reader is this node): no buffer, no bytes of its own.
    std::vector<bool> donated(static_cast<size_t>(n.num_outputs()), false);
    if (opts.donate_state) {
      const std::vector<int64_t> d = n.attrs.get_ints("kiln_donate");
      for (size_t j = 0; j < d.size() && j < donated.size(); ++j) {
        if (d[j] < 0 || d[j] >= n.num_inputs() || !n.inputs[d[j]] || !n.outputs[j]) continue;
        const Value* v = n.inputs[d[j]];
        auto it = idx.find(v);
        if (it == idx.end() || !plan.values[it->second].persistent || owner.at(v) != &g || last_use[v] != i ||
            pinned[&g].count(v))
          continue;
        ValuePlan& ov = plan.values[idx.at(n.outputs[j])];
        plan.donated_bytes += ov.bytes;
        ++plan.donated_outputs;
        ov.bytes = 0;
        ov.reuses = v;
        donated[j] = true;
      }
    }
    // Reshape-family views (ir::is_view_op): the output shares its input's buffer when
    // the input dies here, as runtime/interpreter.cpp does (no copy, no new buffer).
    if (inplace_from < 0 && is_view_op(n.op) && n.num_outputs() == 1) {
      const int from = dying_input(0);
      auto ot = n.outputs[0] ? idx.find(n.outputs[0]) : idx.end();
      if (from >= 0 && ot != idx.end() && plan.values[from].bytes == plan.values[ot->second].bytes) inplace_from = from;
    }
    for (int k = 0; k < n.num_outputs(); ++k) {
      Value* o = n.outputs[k];
      if (!o) continue;
      int oi = idx.at(o);
      ValuePlan& ov = plan.values[oi];
      if (ov.bytes == 0 || donated[static_cast<size_t>(k)]) continue;
      int reuse = -1;
      if (k == 0 && inplace_from >= 0)
        reuse = inplace_from;
      else if (pointwise)
        for (Value* in : n.inputs) {
          if (!in) continue;
          int ii = idx.at(in);
          const ValuePlan& iv = plan.values[ii];
          if (iv.persistent || owner.at(in) != ng || iv.end != i || iv.bytes != ov.bytes || !holds_buffer(ii) ||
              taken.count(iv.buffer) || pinned[ng].count(in))
            continue;
          reuse = ii;
          break;
        }
      if (reuse >= 0 && !taken.count(plan.values[reuse].buffer)) {
        taken.insert(plan.values[reuse].buffer);
        take_over(oi, reuse, i, true);
      } else {
        new_buffer(oi, i);
      }
    }
  }

  // ---- multi-tensor groups (passes/multi_tensor.cpp): members run concurrently, so a
  // buffer born or dying at a member is live over the whole group (positions lo..hi of
  // the group's members), and so are the values it holds for the accounting.
  {
    std::map<std::pair<const Graph*, int64_t>, std::pair<int, int>> span;
    for (int i = 0; i < N; ++i) {
      const int64_t gid = tl[i].node->attrs.get_int("kiln_multi_tensor_group", -1);
      if (gid < 0) continue;
      auto [it, fresh] = span.try_emplace({tl[i].graph, gid}, i, i);
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
    for (auto& b : plan.buffers) widen(b.first, b.last);
    for (size_t k = 0; k < plan.values.size(); ++k) {
      const ValuePlan& vp = plan.values[k];
      if (vp.persistent || vp.bytes == 0 || vp.def < 0 || acct_end[k] < vp.def) continue;
      widen(acct_start[k], acct_end[k]);
    }
    // A buffer's values follow one another (in-place chains, moves): after widening, a
    // value is counted only until its successor in the buffer is, or the group would
    // count the one buffer twice (SGD's kiln_inplace updates: each new parameter takes
    // its dying gradient's buffer; resnet18 planned 2.13 MiB against 1.77 measured).
    for (const auto& b : plan.buffers)
      for (size_t q = 0; q + 1 < b.values.size(); ++q) {
        const int a = b.values[q], c = b.values[q + 1];
        if (acct_start[c] <= acct_end[a]) acct_end[a] = std::max(acct_start[a] - 1, acct_start[c] - 1);
      }
  }

  // ---- offsets: best fit in a given order; greedy by size (largest first) unless
  // placing buffers by their start (then size) gives a smaller arena (the two orders
  // TFLite's arena planner and XLA's heap simulator offer; neither wins always: chains
  // of in-place buffers live long and fragment size order).
  for (auto& b : plan.buffers)
    if (opts.heap_values && !b.values.empty() && opts.heap_values->count(plan.values[b.values.front()].value)) {
      b.in_arena = false;
      b.offset = -1;
    }
  auto place = [&](const std::vector<int>& order, std::vector<int64_t>& offset) {
    offset.assign(plan.buffers.size(), -1);
    int64_t top = 0;
    std::vector<int> placed;
    for (int bi : order) {
      const BufferPlan& b = plan.buffers[bi];
      if (!b.in_arena) continue;
      std::vector<std::pair<int64_t, int64_t>> overlap;  // (offset, size) of placed buffers live with b
      for (int pi : placed) {
        const BufferPlan& q = plan.buffers[pi];
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
  };
  std::vector<int> by_size(plan.buffers.size());
  for (size_t k = 0; k < by_size.size(); ++k) by_size[k] = static_cast<int>(k);
  std::vector<int> by_start = by_size;
  std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) {
    const BufferPlan &x = plan.buffers[a], &y = plan.buffers[b];
    if (x.size != y.size) return x.size > y.size;
    return x.first < y.first;
  });
  std::stable_sort(by_start.begin(), by_start.end(), [&](int a, int b) {
    const BufferPlan &x = plan.buffers[a], &y = plan.buffers[b];
    if (x.first != y.first) return x.first < y.first;
    return x.size > y.size;
  });
  std::vector<int64_t> off_size, off_start;
  const int64_t top_size = place(by_size, off_size), top_start = place(by_start, off_start);
  const std::vector<int64_t>& chosen = top_start < top_size ? off_start : off_size;
  plan.arena_bytes = std::min(top_size, top_start);
  for (size_t k = 0; k < plan.buffers.size(); ++k)
    if (plan.buffers[k].in_arena) plan.buffers[k].offset = chosen[k];
  for (auto& vp : plan.values)
    if (vp.buffer >= 0) vp.offset = plan.buffers[vp.buffer].offset;  // -1 for heap buffers

  // ---- accounting
  for (auto& vp : plan.values)
    if (vp.persistent) plan.persistent_bytes += vp.bytes;
  const int T = std::max(N, 1);
  std::vector<CategoryBytes> diff(T + 1, CategoryBytes{});
  for (size_t k = 0; k < plan.values.size(); ++k) {
    const ValuePlan& vp = plan.values[k];
    if (vp.bytes == 0) continue;
    int a = vp.persistent ? 0 : acct_start[k], e = vp.persistent ? T - 1 : acct_end[k];
    if (e < a) continue;
    diff[a][static_cast<int>(vp.category)] += vp.bytes;
    diff[e + 1][static_cast<int>(vp.category)] -= vp.bytes;
  }
  if (opts.eager_semantics || opts.count_kernel_scratch)
    for (int t = 0; t < N; ++t) {
      const int64_t s = eager_kernel_scratch_bytes(*tl[t].node);
      if (s <= 0) continue;
      diff[t][static_cast<int>(MemoryCategory::temporaries)] += s;
      diff[t + 1][static_cast<int>(MemoryCategory::temporaries)] -= s;
      plan.kernel_scratch_bytes = std::max(plan.kernel_scratch_bytes, s);
    }
  CategoryBytes cur{};
  plan.peak_bytes = -1;
  for (int t = 0; t < T; ++t) {
    int64_t total = 0;
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      cur[c] += diff[t][c];
      total += cur[c];
      plan.max_by_category[c] = std::max(plan.max_by_category[c], cur[c]);
    }
    if (total > plan.peak_bytes) {
      plan.peak_bytes = total;
      plan.at_peak = cur;
      plan.peak_node = N > 0 ? t : -1;
    }
  }
  if (plan.peak_node >= 0) {
    const Entry& e = tl[plan.peak_node];
    plan.peak_node_name = e.node->name + " (" + e.node->op + ")";
    if (e.loop)
      plan.peak_node_name += ", inside the body of " + e.loop->name + " (each of " +
                             std::to_string(e.loop->attrs.get_int("trip_count", 1)) + " iterations)";
    plan.peak_in_loop_body = e.loop != nullptr;
  }
  return plan;
}

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
