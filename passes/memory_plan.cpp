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
//
// Categories come from the graph only: StateBinding kinds; node-name scopes
// ("<node>/grad/..." = backward, written by autodiff; "optimizer/..." = the optimizer
// pass); the op table (fusion class). A narrowed single-input copy of a parameter made
// in the forward pass is a bf16 weight copy (autocast's Casts). Parameter gradients are
// the backward values an optimizer node (or the graph output list) reads, followed back
// through the "<param>/grad" summation scope and single-input copies of equal size.
#include "passes/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "ir/op_table.h"

namespace kiln::passes {

using namespace kiln::ir;

const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameters: return "parameters";
    case MemoryCategory::bf16_weights: return "bf16 weight copies";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::optimizer_state: return "optimizer state";
    case MemoryCategory::saved_activations: return "saved activations";
    case MemoryCategory::temporaries: return "temporaries";
    case MemoryCategory::data_and_buffers: return "data, buffers, constants";
  }
  return "?";
}

namespace {

enum class Phase { forward, backward, optimizer };

/// Position of the "/grad" scope segment in a node name (followed by '/' or the end), or npos.
size_t grad_scope_pos(const std::string& name) {
  size_t p = 0;
  while ((p = name.find("/grad", p)) != std::string::npos) {
    size_t e = p + 5;
    if (e == name.size() || name[e] == '/') return p;
    p = e;
  }
  return std::string::npos;
}

Phase phase_of(const Node& n) {
  if (n.name.rfind("optimizer/", 0) == 0 || n.name == "optimizer") return Phase::optimizer;
  if (grad_scope_pos(n.name) != std::string::npos) return Phase::backward;
  return Phase::forward;
}

int64_t align_up(int64_t v, int64_t a) { return a <= 1 ? v : (v + a - 1) / a * a; }

}  // namespace

Expected<MemoryPlan> plan_memory(const Graph& g, const PlanOptions& opts) {
  MemoryPlan plan;
  plan.options = opts;
  const auto& nodes = g.nodes();
  const int N = static_cast<int>(nodes.size());
  plan.num_nodes = N;
  const bool in_place = opts.in_place && !opts.eager_semantics;

  std::unordered_map<const Value*, int> idx;  // value -> index into plan.values
  auto bytes_of = [](const Value* v) -> Expected<int64_t> {
    if (v->dtype == DType::undefined) return int64_t(0);
    int64_t n = v->shape.numel();
    if (n < 0)
      return Status::error("memory plan: value '" + v->name + "' has non-static shape " + v->shape.to_string() +
                           " (bind symbolic dims with --shape)");
    return n * static_cast<int64_t>(dtype_size(v->dtype));
  };
  auto add_value = [&](const Value* v, bool persistent, int def) -> Status {
    if (!v || idx.count(v)) return Status::ok();
    KILN_ASSIGN_OR_RETURN(int64_t b, bytes_of(v));
    ValuePlan vp;
    vp.value = v;
    vp.bytes = b;
    vp.persistent = persistent;
    vp.def = def;
    idx[v] = static_cast<int>(plan.values.size());
    plan.values.push_back(vp);
    return Status::ok();
  };
  for (Value* v : g.inputs) KILN_RETURN_IF_ERROR(add_value(v, true, -1));
  for (Value* v : g.initializers) KILN_RETURN_IF_ERROR(add_value(v, true, -1));
  std::vector<Phase> phase(N);
  std::unordered_map<const Value*, int> last_use;
  for (int i = 0; i < N; ++i) {
    const Node& n = *nodes[i];
    if (!n.regions.empty())
      return Status::error("memory plan: node '" + n.name + "' (" + n.op +
                           ") has a nested region; planning inside regions is not supported yet");
    phase[i] = phase_of(n);
    for (Value* in : n.inputs) {
      if (!in) continue;
      if (!idx.count(in) && !in->producer)
        return Status::error("memory plan: node '" + n.name + "' reads '" + in->name +
                             "', which is neither a graph input, an initializer nor a node output");
      last_use[in] = i;
    }
    for (Value* o : n.outputs) KILN_RETURN_IF_ERROR(add_value(o, false, i));
  }
  std::unordered_set<const Value*> graph_outputs(g.outputs.begin(), g.outputs.end());

  // ---- liveness
  for (auto& vp : plan.values) {
    if (vp.persistent) {
      vp.def = 0;
      vp.end = N - 1;
      continue;
    }
    auto lu = last_use.find(vp.value);
    if (graph_outputs.count(vp.value)) vp.end = N - 1;
    else if (lu != last_use.end()) vp.end = std::max(lu->second, vp.def);
    else vp.end = opts.eager_semantics ? N - 1 : vp.def;
  }

  // ---- categories
  std::unordered_map<const Value*, std::string> state_kind;
  std::unordered_set<const Value*> params;
  for (const auto& sb : g.state) {
    if (sb.input) state_kind[sb.input] = sb.kind;
    if (sb.output) state_kind[sb.output] = sb.kind;
    if (sb.kind == "parameter" && sb.input) params.insert(sb.input);
  }
  auto node_of = [&](const Value* v) -> const Node* { return v ? v->producer : nullptr; };
  std::unordered_map<const Node*, int> node_index;
  for (int i = 0; i < N; ++i) node_index[nodes[i].get()] = i;
  auto phase_of_value = [&](const Value* v) -> int {
    const Node* p = node_of(v);
    if (!p) return -1;
    auto k = node_index.find(p);
    return k == node_index.end() ? -1 : static_cast<int>(phase[k->second]);
  };
  // bf16 weight copies: a forward node whose only non-constant input is a parameter,
  // producing an equally sized tensor of a narrower dtype.
  std::unordered_set<const Value*> weight_copies;
  std::unordered_set<std::string> grad_scopes;  // parameters and their copies: "<name>/grad..."
  for (const Value* p : params) grad_scopes.insert(p->name);
  for (int i = 0; i < N; ++i) {
    const Node& n = *nodes[i];
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
  // followed back through the parameter's "/grad" scope and single-input copies.
  std::unordered_set<const Value*> grads;
  std::vector<const Value*> work;
  auto is_bwd_value = [&](const Value* v) { return v && phase_of_value(v) == static_cast<int>(Phase::backward); };
  for (int i = 0; i < N; ++i) {
    if (phase[i] != Phase::optimizer) continue;
    for (Value* in : nodes[i]->inputs)
      if (is_bwd_value(in) && grads.insert(in).second) work.push_back(in);
  }
  for (Value* o : g.outputs)
    if (is_bwd_value(o) && grads.insert(o).second) work.push_back(o);
  while (!work.empty()) {
    const Value* v = work.back();
    work.pop_back();
    const Node* p = node_of(v);
    if (!p) continue;
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
      for (const Value* c : cands)
        if (grads.insert(c).second) work.push_back(c);
  }
  std::unordered_set<const Value*> read_by_backward;
  for (int i = 0; i < N; ++i)
    if (phase[i] == Phase::backward)
      for (Value* in : nodes[i]->inputs)
        if (in) read_by_backward.insert(in);

  for (auto& vp : plan.values) {
    const Value* v = vp.value;
    auto sk = state_kind.find(v);
    if (sk != state_kind.end()) {
      vp.category = sk->second == "parameter"         ? MemoryCategory::parameters
                    : sk->second == "optimizer_state" ? MemoryCategory::optimizer_state
                                                      : MemoryCategory::data_and_buffers;
    } else if (vp.persistent) {
      vp.category = MemoryCategory::data_and_buffers;
    } else if (weight_copies.count(v)) {
      vp.category = MemoryCategory::bf16_weights;
    } else if (grads.count(v)) {
      vp.category = MemoryCategory::gradients;
    } else if (phase_of_value(v) == static_cast<int>(Phase::forward) && read_by_backward.count(v)) {
      vp.category = MemoryCategory::saved_activations;
    } else {
      vp.category = MemoryCategory::temporaries;
    }
    if (vp.category == MemoryCategory::saved_activations) plan.saved_activation_bytes += vp.bytes;
  }
  for (const auto& sb : g.state) {
    if (!sb.input) continue;
    auto it = idx.find(sb.input);
    if (it == idx.end()) continue;
    if (sb.kind == "parameter") plan.parameter_elements += std::max<int64_t>(0, sb.input->shape.numel());
    if (sb.kind == "optimizer_state") plan.optimizer_state_bytes += plan.values[it->second].bytes;
  }

  // ---- buffers and in-place reuse (node order)
  std::vector<int> acct_end(plan.values.size());
  for (size_t k = 0; k < plan.values.size(); ++k) acct_end[k] = plan.values[k].end;
  for (int i = 0; i < N; ++i) {
    const Node& n = *nodes[i];
    const OpDef* def = OpTable::get().find(n.op);
    const bool pointwise = in_place && def && def->fusion == FusionClass::pointwise;
    std::unordered_set<int> taken;
    for (Value* o : n.outputs) {
      if (!o) continue;
      int oi = idx.at(o);
      ValuePlan& ov = plan.values[oi];
      if (ov.bytes == 0) continue;
      int reuse = -1;
      if (pointwise)
        for (Value* in : n.inputs) {
          if (!in) continue;
          int ii = idx.at(in);
          const ValuePlan& iv = plan.values[ii];
          if (iv.persistent || iv.buffer < 0 || iv.end != i || iv.bytes != ov.bytes || taken.count(iv.buffer)) continue;
          if (plan.buffers[iv.buffer].values.back() != ii) continue;  // not the buffer's current holder
          reuse = ii;
          break;
        }
      if (reuse >= 0) {
        ValuePlan& iv = plan.values[reuse];
        ov.buffer = iv.buffer;
        ov.reuses = iv.value;
        taken.insert(iv.buffer);
        acct_end[reuse] = i - 1;  // from node i on, the buffer holds the output
        BufferPlan& b = plan.buffers[iv.buffer];
        b.values.push_back(oi);
        b.last = std::max(b.last, ov.end);
        ++plan.in_place_reuses;
      } else {
        BufferPlan b;
        b.size = align_up(ov.bytes, opts.alignment);
        b.first = i;
        b.last = ov.end;
        b.values.push_back(oi);
        ov.buffer = static_cast<int>(plan.buffers.size());
        plan.buffers.push_back(std::move(b));
      }
    }
  }

  // ---- offsets: greedy by size, best fit
  std::vector<int> order(plan.buffers.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int>(k);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const BufferPlan &x = plan.buffers[a], &y = plan.buffers[b];
    if (x.size != y.size) return x.size > y.size;
    return x.first < y.first;
  });
  std::vector<int> placed;
  for (int bi : order) {
    BufferPlan& b = plan.buffers[bi];
    std::vector<const BufferPlan*> overlap;
    for (int pi : placed) {
      const BufferPlan& p = plan.buffers[pi];
      if (p.first <= b.last && b.first <= p.last) overlap.push_back(&p);
    }
    std::sort(overlap.begin(), overlap.end(), [](const BufferPlan* x, const BufferPlan* y) { return x->offset < y->offset; });
    int64_t cursor = 0, best = -1, best_gap = -1;
    for (const BufferPlan* p : overlap) {
      int64_t gap = p->offset - cursor;
      if (gap >= b.size && (best < 0 || gap < best_gap)) best = cursor, best_gap = gap;
      cursor = std::max(cursor, p->offset + p->size);
    }
    b.offset = best >= 0 ? best : cursor;
    plan.arena_bytes = std::max(plan.arena_bytes, b.offset + b.size);
    placed.push_back(bi);
  }
  for (auto& vp : plan.values)
    if (vp.buffer >= 0) vp.offset = plan.buffers[vp.buffer].offset;

  // ---- accounting
  for (auto& vp : plan.values)
    if (vp.persistent) plan.persistent_bytes += vp.bytes;
  const int T = std::max(N, 1);
  std::vector<CategoryBytes> diff(T + 1, CategoryBytes{});
  for (size_t k = 0; k < plan.values.size(); ++k) {
    const ValuePlan& vp = plan.values[k];
    if (vp.bytes == 0) continue;
    int a = vp.persistent ? 0 : vp.def, e = vp.persistent ? T - 1 : acct_end[k];
    if (e < a) continue;
    diff[a][static_cast<int>(vp.category)] += vp.bytes;
    diff[e + 1][static_cast<int>(vp.category)] -= vp.bytes;
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
  if (plan.peak_node >= 0)
    plan.peak_node_name = nodes[plan.peak_node]->name + " (" + nodes[plan.peak_node]->op + ")";
  return plan;
}

std::string human_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (std::abs(v) >= 1024.0 && u < 4) v /= 1024.0, ++u;
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

std::string format_memory_plan(const MemoryPlan& p) {
  std::ostringstream os;
  auto cell = [](int64_t b) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%12s %14lld B", human_bytes(b).c_str(), static_cast<long long>(b));
    return std::string(buf);
  };
  char head[160];
  std::snprintf(head, sizeof head, "  %-26s %29s   %29s\n", "category", "at peak", "max over step");
  os << "memory plan (" << p.num_nodes << " nodes in schedule order; "
     << (p.options.eager_semantics ? "eager interpreter semantics" : p.options.in_place ? "in-place reuse on" : "no in-place reuse")
     << ")\n"
     << head;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    char row[64];
    std::snprintf(row, sizeof row, "  %-26s ", memory_category_name(static_cast<MemoryCategory>(c)));
    os << row << cell(p.at_peak[c]) << "   " << cell(p.max_by_category[c]) << "\n";
  }
  char row[64];
  std::snprintf(row, sizeof row, "  %-26s ", "total (peak)");
  os << row << cell(p.peak_bytes) << "\n";
  if (p.peak_node >= 0) os << "peak at node " << p.peak_node << ": " << p.peak_node_name << "\n";
  os << "saved activations (all): " << human_bytes(p.saved_activation_bytes) << " (" << p.saved_activation_bytes << " B)\n";
  char opt[64];
  std::snprintf(opt, sizeof opt, "%.2f", p.optimizer_state_bytes_per_param_element());
  os << "optimizer state: " << opt << " bytes per parameter element (" << p.optimizer_state_bytes << " B over "
     << p.parameter_elements << " elements)\n";
  os << "arena: " << human_bytes(p.arena_bytes) << " (" << p.arena_bytes << " B, " << p.buffers.size() << " buffers, "
     << p.in_place_reuses << " in-place reuses); resident inputs and constants: " << human_bytes(p.persistent_bytes)
     << " (" << p.persistent_bytes << " B)\n";
  return os.str();
}

}  // namespace kiln::passes
