#include "runtime/interpreter.h"

#include <omp.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "ir/op_table.h"
#include "runtime/data.h"

namespace kiln::runtime {

using namespace kiln::ir;

Status check_feed(const Value& input, const Tensor& t) {
  if (!t.device().is_cpu())
    return Status::error("input '" + input.name + "': the tensor is on " + t.device().str() +
                         ", this executor runs on cpu (copy it with its backend's to_host)");
  if (t.dtype() != input.dtype)
    return Status::error("input '" + input.name + "': expected dtype " + dtype_name(input.dtype) + ", got " +
                         dtype_name(t.dtype()));
  if (t.rank() != input.shape.rank())
    return Status::error("input '" + input.name + "': expected shape " + input.shape.to_string() + ", got " +
                         dims_to_string(t.dims()));
  for (int i = 0; i < t.rank(); ++i) {
    const Dim& d = input.shape.dims[i];
    if (d.is_static() && d.value != t.dims()[i])
      return Status::error("input '" + input.name + "': expected shape " + input.shape.to_string() + ", got " +
                           dims_to_string(t.dims()));
  }
  return Status::ok();
}

namespace {
/// A fresh output tensor for value `v`: its planned place in the step arena when it has
/// one, else a new allocation (zero-filled when `zero`).
Tensor new_output(const StepArena* arena, const Value* v, DType dtype, const std::vector<int64_t>& dims, bool zero) {
  if (arena)
    if (Tensor t = arena->output(v, dtype, dims, zero); t.defined()) return t;
  return zero ? Tensor(dtype, dims) : Tensor::uninitialized(dtype, dims);
}

/// Output types of a node known before it runs: every output present with a static shape
/// in the graph, and the node's inputs of static type (so the op's inference on the actual
/// inputs, which run_graph checked against the graph, gives the same).
struct StaticOutputs {
  std::vector<DType> dtype;
  std::vector<std::vector<int64_t>> dims;
  std::vector<DType> in_dtype;  ///< the inputs' graph types (absent: undefined)
  std::vector<std::vector<int64_t>> in_dims;
  /// Whether the actual inputs have the graph's types (else the op infers from them).
  bool matches(const std::vector<const Tensor*>& ins) const {
    if (ins.size() != in_dtype.size()) return false;
    for (size_t k = 0; k < ins.size(); ++k) {
      if (!ins[k]) {
        if (in_dtype[k] != DType::undefined) return false;
        continue;
      }
      if (ins[k]->dtype() != in_dtype[k] || ins[k]->dims() != in_dims[k]) return false;
    }
    return true;
  }
};

/// run_node, optionally writing output 0 into `inplace` (a dying input's buffer of
/// the same dtype and dims; see the kiln_inplace attribute). `def`: the node's op-table
/// entry when the caller has it; `known`: its output types when known (inference skipped).
Expected<std::vector<Tensor>> run_node_impl(const Node& n, const std::vector<const Tensor*>& inputs,
                                            const RunOptions& opts, uint64_t op_id, const Tensor* inplace,
                                            const OpDef* def = nullptr, const StaticOutputs* known = nullptr,
                                            std::shared_ptr<void>* cache = nullptr);
}  // namespace

Expected<std::vector<Tensor>> run_node(const Node& n, const std::vector<const Tensor*>& inputs, const RunOptions& opts,
                                       uint64_t op_id) {
  return run_node_impl(n, inputs, opts, op_id, nullptr);
}

namespace {
/// The outputs of node `n`'s kernel call into `kctx.outputs` (planned arena places or
/// allocated; output 0 into `inplace` when it fits): types from `known` when the inputs
/// match it, else by type inference on the actual inputs.
Status allocate_kernel_outputs(const Node& n, const std::vector<const Tensor*>& inputs, const RunOptions& opts,
                               const Tensor* inplace, const OpDef& def, const StaticOutputs* known,
                               KernelContext& kctx) {
  // kiln_donate on an eager op (OpDef::in_place_outputs): output i is written into its
  // state input's buffer when the caller owns the state (RunOptions::donate_state).
  const std::vector<int64_t> d =
      opts.donate_state && !def.in_place_outputs.empty() ? n.attrs.get_ints("kiln_donate") : std::vector<int64_t>{};
  auto donated = [&](size_t i, DType dt, const std::vector<int64_t>& dims) -> const Tensor* {
    if (i >= d.size() || d[i] < 0 || d[i] >= static_cast<int64_t>(inputs.size())) return nullptr;
    const Tensor* in = inputs[static_cast<size_t>(d[i])];
    return in && in->dtype() == dt && in->dims() == dims ? in : nullptr;
  };
  if (known && known->matches(inputs)) {
    for (size_t i = 0; i < n.outputs.size(); ++i) {
      if (i == 0 && inplace && inplace->dtype() == known->dtype[i] && inplace->dims() == known->dims[i]) {
        kctx.outputs.push_back(*inplace);
        continue;
      }
      if (const Tensor* in = donated(i, known->dtype[i], known->dims[i])) {
        kctx.outputs.push_back(*in);
        continue;
      }
      kctx.outputs.push_back(
          new_output(opts.arena, n.outputs[i], known->dtype[i], known->dims[i], !def.kernel_writes_all_outputs));
    }
    return Status::ok();
  }
  InferContext ictx{n, {}, {}, {}};
  for (const Tensor* t : inputs) {
    TypeInfo ti;
    if (t) {
      ti.dtype = t->dtype();
      ti.shape = Shape::of(t->dims());
    }
    ictx.in.push_back(ti);
    ictx.values.push_back(t);
  }
  ictx.out.resize(n.outputs.size());
  KILN_RETURN_IF_ERROR(def.infer(ictx));
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    const TypeInfo& ti = ictx.out[i];
    if (!ti.present()) {
      kctx.outputs.emplace_back();
      continue;
    }
    if (!ti.shape.is_static())
      return Status::error("node '" + n.name + "' (" + n.op + "): output shape " + ti.shape.to_string() +
                           " is not static in eager mode");
    if (i == 0 && inplace && inplace->dtype() == ti.dtype && inplace->dims() == ti.shape.to_vector()) {
      kctx.outputs.push_back(*inplace);  // shares the dying input's storage: no allocation
      continue;
    }
    if (const Tensor* in = donated(i, ti.dtype, ti.shape.to_vector())) {
      kctx.outputs.push_back(*in);
      continue;
    }
    kctx.outputs.push_back(
        new_output(opts.arena, n.outputs[i], ti.dtype, ti.shape.to_vector(), !def.kernel_writes_all_outputs));
  }
  return Status::ok();
}

Expected<std::vector<Tensor>> run_node_impl(const Node& n, const std::vector<const Tensor*>& inputs,
                                            const RunOptions& opts, uint64_t op_id, const Tensor* inplace,
                                            const OpDef* def, const StaticOutputs* known,
                                            std::shared_ptr<void>* cache) {
  if (!def) def = OpTable::get().find(n.op);
  if (!def) return Status::error("node '" + n.name + "': unknown op '" + n.op + "'");
  if (!def->kernel) return Status::error("node '" + n.name + "': op '" + n.op + "' has no eager kernel");
  KernelContext kctx{n, inputs, {}, opts.training, opts.seed, opts.step, op_id, cache, opts.symbols};
  KILN_RETURN_IF_ERROR(allocate_kernel_outputs(n, inputs, opts, inplace, *def, known, kctx));
  KILN_RETURN_IF_ERROR(def->kernel(kctx));
  return std::move(kctx.outputs);
}
}  // namespace

Status evaluate_node(KernelContext& kc) {
  const Node& n = kc.node;
  const OpDef* def = OpTable::get().find(n.op);
  if (!def) return Status::error("node '" + n.name + "': unknown op '" + n.op + "'");
  if (!def->kernel) return Status::error("node '" + n.name + "': op '" + n.op + "' has no eager kernel");
  return def->kernel(kc);
}

namespace {

using ValueSet = std::unordered_set<const Value*>;
using SlotMap = std::unordered_map<const Value*, int32_t>;

/// The tensors of one run of a graph, by value. A value the graph's facts number
/// (GraphFacts::slot_of: its inputs, initializers and outputs, every node's inputs and
/// outputs, the values its nodes' regions read from outside) has a slot in a vector, which
/// the node facts index directly: a node's launch hashes nothing and allocates no map
/// node (they were a large part of a small kernel's launch). Other values (a run without
/// facts: a single loop node) live in a side map. A present value may hold an undefined
/// tensor (an absent optional output).
class Env {
 public:
  explicit Env(const SlotMap* slots = nullptr)
      : slots_(slots), t_(slots ? slots->size() : 0), has_(slots ? slots->size() : 0, 0) {}
  /// The tensor of `v`, or null when it has none.
  Tensor* find(const Value* v) {
    if (const int32_t s = slot(v); s >= 0) return at(s);
    auto it = other_.find(v);
    return it == other_.end() ? nullptr : &it->second;
  }
  bool count(const Value* v) { return find(v) != nullptr; }
  /// The tensor of `v`, made present (undefined) when it had none.
  Tensor& operator[](const Value* v) {
    if (const int32_t s = slot(v); s >= 0) return put(s);
    return other_[v];
  }
  void erase(const Value* v) {
    if (const int32_t s = slot(v); s >= 0) return drop(s);
    other_.erase(v);
  }
  /// By slot (GraphFacts::slot_of).
  Tensor* at(int32_t s) { return has_[static_cast<size_t>(s)] ? &t_[static_cast<size_t>(s)] : nullptr; }
  Tensor& put(int32_t s) {
    has_[static_cast<size_t>(s)] = 1;
    return t_[static_cast<size_t>(s)];
  }
  void drop(int32_t s) {
    if (!has_[static_cast<size_t>(s)]) return;
    t_[static_cast<size_t>(s)] = Tensor();
    has_[static_cast<size_t>(s)] = 0;
  }

 private:
  int32_t slot(const Value* v) const {
    if (!slots_) return -1;
    auto it = slots_->find(v);
    return it == slots_->end() ? -1 : it->second;
  }
  const SlotMap* slots_;
  std::vector<Tensor> t_;
  std::vector<char> has_;
  std::unordered_map<const Value*, Tensor> other_;
};

}  // namespace

/// What run_nodes needs of one graph besides the values: see ScheduleCache.
struct GraphFacts {
  struct NodeFacts {
    const OpDef* def = nullptr;                  ///< op-table entry (null: unknown op)
    const codegen::CpuKernel* kernel = nullptr;  ///< generated kernel (RunOptions::program)
    bool loop = false;                           ///< an AccumulationLoop
    int64_t group = -1;                          ///< kiln_multi_tensor_group (passes/multi_tensor.cpp), -1: none
    bool has_static = false;                     ///< `outs` holds the output types
    StaticOutputs outs;
    /// Every type of the node is defined and every dim static or an expression of
    /// symbols (a symbolic program's node): outputs_at binds them per run.
    bool bindable = false;
    /// The output types at the run's symbol values: `outs` for a static node; for a
    /// bindable one the graph's types evaluated at `symbols`, kept until the next run
    /// with other values (shape inference on every call cost a symbolic program's
    /// library ops 1-6 us each); null otherwise (the op infers from its inputs).
    const StaticOutputs* outputs_at(const Node& n, const std::map<std::string, int64_t>* symbols) const;
    mutable std::map<std::string, int64_t> bound_symbols;  ///< the values bound_outs holds
    mutable StaticOutputs bound_outs;
    mutable bool bound = false;
    std::vector<const Value*> captures;  ///< values its regions read from outside
    // Read once here instead of per run (string-keyed attribute lookups, op-name
    // comparisons and hash lookups were a large part of a small kernel's launch).
    int64_t inplace = -1;         ///< kiln_inplace, -1: none
    std::vector<int64_t> donate;  ///< kiln_donate
    bool view = false;            ///< ir::is_view_op
    std::vector<char> last_read;  ///< per input: this node is the value's last reader
    /// Env slots (GraphFacts::slot_of) of its inputs (-1: an absent optional one), its
    /// outputs and `captures`.
    std::vector<int32_t> in_slot, out_slot, capture_slot;
    /// The node's kernel cache slot (KernelContext::cache): what its eager kernel
    /// prepared on an earlier run of this graph.
    mutable std::shared_ptr<void> kernel_cache;
  };
  std::unordered_map<const Value*, size_t> last_use;  ///< ir::last_reads
  SlotMap slot_of;                                    ///< Env slot of every value a run of the graph holds
  std::vector<char> kept;                             ///< per slot: a graph output or initializer (never released)
  std::vector<NodeFacts> nodes;
  const codegen::CpuProgram* program = nullptr;
  uint64_t structure = 0;  ///< Graph::structure_id() when computed
  bool symbolic = false;   ///< some graph input has a symbolic dim (run_graph binds the symbols)

  GraphFacts(const Graph& g, const codegen::CpuProgram* prog) : program(prog) {
    const auto& ns = g.nodes();
    structure = g.structure_id();
    last_use = last_reads(g);
    nodes.resize(ns.size());
    auto number = [&](const Value* v) -> int32_t {
      if (!v) return -1;
      return slot_of.emplace(v, static_cast<int32_t>(slot_of.size())).first->second;
    };
    for (const Value* v : g.inputs) {
      number(v);
      for (const Dim& d : v->shape.dims) symbolic |= d.is_symbolic();
    }
    for (const Value* v : g.initializers) number(v);
    for (size_t i = 0; i < ns.size(); ++i) {
      const Node& n = *ns[i];
      NodeFacts& f = nodes[i];
      f.def = OpTable::get().find(n.op);
      f.loop = has_trait(n, OpTrait::loop);
      f.kernel = prog && has_trait(n, OpTrait::fused_kernel) ? prog->find(&n) : nullptr;
      // Group members run as generated kernels or as their eager kernel's pieces.
      const bool pieced = !f.kernel && f.def && f.def->multi_tensor && f.def->pieces;
      f.group = f.kernel || pieced ? n.attrs.get_int("kiln_multi_tensor_group", -1) : -1;
      ValueSet caps;
      for (auto& r : n.regions) collect_captures(*r, caps);
      f.captures.assign(caps.begin(), caps.end());
      for (const Value* in : n.inputs) f.in_slot.push_back(number(in));
      for (const Value* o : n.outputs) f.out_slot.push_back(number(o));
      for (const Value* c : f.captures) f.capture_slot.push_back(number(c));
      f.inplace = n.attrs.get_int("kiln_inplace", -1);
      f.donate = n.attrs.get_ints("kiln_donate");
      f.view = ir::is_view_op(n.op);
      for (const Value* in : n.inputs) {
        auto it = in ? last_use.find(in) : last_use.end();
        f.last_read.push_back(it != last_use.end() && it->second == i);
      }
      // Only types type inference has filled in (a graph built without infer_graph
      // has undefined dtypes): such nodes infer per run, as before.
      bool ok = !n.outputs.empty(), known = ok;
      for (const Value* in : n.inputs) ok = ok && (!in || (in->dtype != DType::undefined && in->shape.is_static()));
      for (const Value* o : n.outputs) ok = ok && o && o->dtype != DType::undefined && o->shape.is_static();
      for (const Value* in : n.inputs)
        known = known && (!in || (in->dtype != DType::undefined && in->shape.is_known()));
      for (const Value* o : n.outputs) known = known && o && o->dtype != DType::undefined && o->shape.is_known();
      f.bindable = known && !ok;
      if (ok) {
        f.has_static = true;
        for (const Value* o : n.outputs) {
          f.outs.dtype.push_back(o->dtype);
          f.outs.dims.push_back(o->shape.to_vector());
        }
        for (const Value* in : n.inputs) {
          f.outs.in_dtype.push_back(in ? in->dtype : DType::undefined);
          f.outs.in_dims.push_back(in ? in->shape.to_vector() : std::vector<int64_t>{});
        }
      }
    }
    for (const Value* v : g.outputs) number(v);
    // Never released during a run: the graph's outputs and initializers.
    kept.assign(slot_of.size(), 0);
    for (const Value* v : g.outputs) kept[static_cast<size_t>(slot_of.at(v))] = 1;
    for (const Value* v : g.initializers) kept[static_cast<size_t>(slot_of.at(v))] = 1;
  }
  /// Whether these facts were computed for `g` as it is now: same program and node list
  /// (Graph::structure_id: a node added, removed, replaced or moved, or another graph at
  /// the same address, is seen; attributes or types edited in place are not).
  bool matches(const Graph& g, const codegen::CpuProgram* prog) const {
    return prog == program && g.structure_id() == structure;
  }
};

struct ScheduleCache::Impl {
  std::unordered_map<const Graph*, std::unique_ptr<GraphFacts>> graphs;
  const GraphFacts& get(const Graph& g, const codegen::CpuProgram* prog) {
    auto& slot = graphs[&g];
    if (!slot || !slot->matches(g, prog)) slot = std::make_unique<GraphFacts>(g, prog);
    return *slot;
  }
};

ScheduleCache::ScheduleCache() : impl_(std::make_unique<Impl>()) {}
ScheduleCache::~ScheduleCache() = default;
ScheduleCache::ScheduleCache(ScheduleCache&&) noexcept = default;
ScheduleCache& ScheduleCache::operator=(ScheduleCache&&) noexcept = default;

namespace {

Status run_nodes(const Graph& g, const GraphFacts& facts, Env& env, const RunOptions& opts);

/// The facts of `g` for this run: the schedule cache's, else computed into `own`.
const GraphFacts& facts_of(const Graph& g, const RunOptions& opts, std::unique_ptr<GraphFacts>& own) {
  if (opts.schedule) return opts.schedule->impl().get(g, opts.program);
  own = std::make_unique<GraphFacts>(g, opts.program);
  return *own;
}

/// Binds every symbol that is a whole dim of a graph input to that dim of the tensor in
/// `env`, then checks every other symbolic input dim (an expression) against its tensor.
/// Errors: an input whose dims give one symbol two values, or an expression that does
/// not evaluate to the tensor's dim.
Status bind_symbols(const Graph& g, Env& env, std::map<std::string, int64_t>& symbols) {
  std::map<std::string, std::string> bound_by;
  for (Value* in : g.inputs) {
    const Tensor* t = env.find(in);
    if (!t) continue;
    for (int k = 0; k < in->shape.rank() && k < t->rank(); ++k) {
      const std::string s = in->shape.dims[k].symbol();
      if (s.empty()) continue;
      const int64_t v = t->dims()[k];
      auto [it, fresh] = symbols.emplace(s, v);
      if (!fresh && it->second != v)
        return Status::error("input '" + in->name + "' dim " + std::to_string(k) + ": symbol " + s + " is " +
                             std::to_string(v) + " here but " + std::to_string(it->second) + " in input '" +
                             bound_by[s] + "'");
      bound_by.emplace(s, in->name);
    }
  }
  for (Value* in : g.inputs) {
    const Tensor* t = env.find(in);
    if (!t) continue;
    for (int k = 0; k < in->shape.rank() && k < t->rank(); ++k) {
      const Dim& d = in->shape.dims[k];
      if (!d.is_symbolic() || !d.symbol().empty()) continue;
      auto v = d.expr.evaluate(symbols);
      if (!v || *v != t->dims()[k])
        return Status::error("input '" + in->name + "': expected shape " + in->shape.to_string() + ", got " +
                             dims_to_string(t->dims()) + " (dim " + std::to_string(k) + " is " + d.to_string() +
                             (v ? " = " + std::to_string(*v) : std::string(", which its symbols do not bind")) + ")");
    }
  }
  return Status::ok();
}

/// Runs an AccumulationLoop node (ir/ops/control.cpp): `trip_count` runs of the body
/// on scan slices, carried values threaded through. Carried inputs whose last use is
/// this node are moved into the loop, so an accumulator is never held twice.
/// `known_captures`: the body's captured values when the caller has them (ScheduleCache's
/// node facts); null: collected here.
Status run_accumulation_loop(const Node& n, Env& env, bool steal_carried, const RunOptions& opts,
                             const std::vector<const Value*>* known_captures = nullptr) {
  if (n.regions.size() != 1) return Status::error("node '" + n.name + "': AccumulationLoop has no body");
  const Graph& body = *n.regions[0];
  const int64_t trips = n.attrs.get_int("trip_count", 1);
  const size_t k = static_cast<size_t>(n.attrs.get_int("num_carried", 0));
  if (body.inputs.size() != n.inputs.size() || body.outputs.size() != k || n.outputs.size() != k)
    return Status::error("node '" + n.name + "': AccumulationLoop body does not match the node");
  std::vector<Tensor> carried(k);
  for (size_t i = 0; i < k; ++i) {
    Tensor* t = env.find(n.inputs[i]);
    if (!t) return Status::error("node '" + n.name + "': input '" + n.inputs[i]->name + "' has no value");
    if (steal_carried) {
      carried[i] = std::move(*t);
      env.erase(n.inputs[i]);
    } else {
      carried[i] = *t;
    }
  }
  std::vector<const Value*> collected;
  if (!known_captures) {
    ValueSet caps;
    collect_captures(body, caps);
    collected.assign(caps.begin(), caps.end());
  }
  const std::vector<const Value*>& captures = known_captures ? *known_captures : collected;
  std::unique_ptr<GraphFacts> own;
  const GraphFacts& bf = facts_of(body, opts, own);
  for (int64_t t = 0; t < trips; ++t) {
    Env benv(&bf.slot_of);
    for (size_t i = 0; i < k; ++i) benv[body.inputs[i]] = std::move(carried[i]);
    for (size_t i = k; i < n.inputs.size(); ++i) {
      Tensor* in = env.find(n.inputs[i]);
      if (!in && opts.microbatch) {  // streamed: one microbatch at a time
        auto mb = opts.microbatch(*n.inputs[i], t, trips);
        if (!mb) return mb.status().with_context(n.name + " microbatch " + std::to_string(t));
        KILN_RETURN_IF_ERROR(
            check_feed(*body.inputs[i], *mb).with_context(n.name + " microbatch " + std::to_string(t)));
        benv[body.inputs[i]] = std::move(*mb);
        continue;
      }
      if (!in) return Status::error("node '" + n.name + "': input '" + n.inputs[i]->name + "' has no value");
      auto slice = microbatch_rows(*in, t, trips);
      if (!slice) return slice.status().with_context("node '" + n.name + "': scan input '" + n.inputs[i]->name + "'");
      benv[body.inputs[i]] = std::move(*slice);
    }
    for (const Value* v : captures) {
      Tensor* c = env.find(v);
      if (!c) return Status::error("node '" + n.name + "': captured value '" + v->name + "' has no value");
      benv[v] = *c;  // shares storage: no copy, no extra bytes
    }
    // Each microbatch draws fresh dropout masks: Philox offset step*N + t.
    RunOptions bo = opts;
    bo.step = opts.step * static_cast<uint64_t>(trips) + static_cast<uint64_t>(t);
    bo.keep.clear();
    // A symbolic body binds its symbols from this microbatch's slices (streamed scan
    // inputs are not among the enclosing graph's fed inputs).
    std::map<std::string, int64_t> body_symbols;
    if (bf.symbolic) {
      if (opts.symbols) body_symbols = *opts.symbols;
      KILN_RETURN_IF_ERROR(
          bind_symbols(body, benv, body_symbols).with_context(n.name + " microbatch " + std::to_string(t)));
      bo.symbols = &body_symbols;
    }
    KILN_RETURN_IF_ERROR(run_nodes(body, bf, benv, bo).with_context(n.name + " iteration " + std::to_string(t)));
    for (size_t i = 0; i < k; ++i) {
      Tensor* out = benv.find(body.outputs[i]);
      if (!out)
        return Status::error("node '" + n.name + "': body output '" + body.outputs[i]->name + "' was not computed");
      carried[i] = std::move(*out);
    }
  }
  for (size_t i = 0; i < k; ++i) env[n.outputs[i]] = std::move(carried[i]);
  return Status::ok();
}

/// The tensors of node `n`'s inputs from `env` (null for an absent optional input), by
/// the slots of its facts `nf`. Error: an input without a value.
Status input_tensors(const Node& n, const GraphFacts::NodeFacts& nf, Env& env, std::vector<const Tensor*>& ins) {
  ins.reserve(n.inputs.size());
  for (size_t k = 0; k < n.inputs.size(); ++k) {
    if (!n.inputs[k]) {
      ins.push_back(nullptr);
      continue;
    }
    const Tensor* t = env.at(nf.in_slot[k]);
    if (!t) return Status::error("node '" + n.name + "': input '" + n.inputs[k]->name + "' has no value");
    ins.push_back(t);
  }
  return Status::ok();
}

/// The dims of `s` at the run's symbol values (static dims as they are); false when a
/// dim is unknown or names a symbol `symbols` does not bind.
bool dims_at(const ir::Shape& s, const std::map<std::string, int64_t>* symbols, std::vector<int64_t>& out) {
  out.clear();
  for (const Dim& d : s.dims) {
    if (d.is_static()) {
      out.push_back(d.value);
      continue;
    }
    std::optional<int64_t> v = d.is_symbolic() && symbols ? d.expr.evaluate(*symbols) : std::nullopt;
    if (!v) return false;
    out.push_back(*v);
  }
  return true;
}

}  // namespace

const StaticOutputs* GraphFacts::NodeFacts::outputs_at(const Node& n,
                                                       const std::map<std::string, int64_t>* symbols) const {
  if (has_static) return &outs;
  if (!bindable || !symbols) return nullptr;
  if (bound && bound_symbols == *symbols) return &bound_outs;
  bound = false;
  StaticOutputs o;
  std::vector<int64_t> dims;
  for (const Value* v : n.outputs) {
    if (!dims_at(v->shape, symbols, dims)) return nullptr;
    o.dtype.push_back(v->dtype);
    o.dims.push_back(dims);
  }
  for (const Value* v : n.inputs) {
    if (v && !dims_at(v->shape, symbols, dims)) return nullptr;
    o.in_dtype.push_back(v ? v->dtype : DType::undefined);
    o.in_dims.push_back(v ? dims : std::vector<int64_t>{});
  }
  bound_outs = std::move(o);
  bound_symbols = *symbols;
  bound = true;
  return &bound_outs;
}

namespace {

/// One generated kernel call being set up: argument pointers (inputs, then outputs) and
/// the output tensors, written into the environment once the kernel has run.
struct FusedLaunch {
  std::vector<void*> bufs;
  std::vector<Tensor> outs;
  const codegen::CpuKernel* ck = nullptr;
  std::vector<int64_t> symbol_values;  ///< a symbolic kernel's symbols (CpuKernel::symbols), passed after the buffers
  int64_t extent = 1;                  ///< parallel-dim extent
  int64_t chunks = 1;                  ///< pieces of it worth a thread each (about 32K domain points at least)
  int64_t split_parts = 0;             ///< a split reduction's row partitions (codegen::launch_split_parts)
  /// A multi-tensor member run by its eager kernel's pieces (OpDef::pieces; ck null):
  /// the call's context (inputs, outputs) and its pieces (chunks of them).
  std::vector<const Tensor*> ins;
  std::unique_ptr<KernelContext> ctx;
  ir::KernelPieces eager;
};

/// Sets up node `n`'s kernel call: inputs from `env`, outputs in the arena or allocated.
/// `scratch`: where a kernel with scratch_bytes gets its scratch (null: such a kernel is refused).
/// `donate`: outputs marked kiln_donate take their state input's buffer (the caller owns
/// it: RunOptions::donate_state); else each gets a copy of that input to update.
/// `symbols`: the run's symbol values (a symbolic kernel's extents and its outputs' dims).
Status prepare_fused(const Node& n, const GraphFacts::NodeFacts& nf, const codegen::CpuKernel& ck, Env& env,
                     const StepArena* arena, Tensor* dying_inplace, bool donate, FusedLaunch& l,
                     const std::map<std::string, int64_t>* symbols, std::vector<double>* scratch = nullptr) {
  l.ck = &ck;
  l.bufs.reserve(n.inputs.size() + n.outputs.size() + 2);
  l.outs.reserve(n.outputs.size());
  static const std::map<std::string, int64_t> none;
  const std::map<std::string, int64_t>& syms = symbols ? *symbols : none;
  // An extent of the kernel or a dim of the graph at this run's symbol values.
  auto value_of = [&](const ir::SymExpr& e, const std::string& what) -> Expected<int64_t> {
    if (e.is_constant()) return e.constant_value();
    auto v = e.evaluate(syms);
    if (!v) return Status::error("node '" + n.name + "': " + what + " " + e.to_string() + " has no value in this run");
    return *v;
  };
  // Output j's dims: the facts' static dims, else the graph's at the run's symbol values.
  std::vector<int64_t> dims_buf;
  Status dims_status = Status::ok();
  auto dims_of = [&](size_t j) -> const std::vector<int64_t>& {
    if (const StaticOutputs* known = nf.outputs_at(n, symbols)) return known->dims[j];
    if (!dims_at(n.outputs[j]->shape, symbols, dims_buf))
      dims_status = Status::error("node '" + n.name + "': output " + std::to_string(j) + " shape " +
                                  n.outputs[j]->shape.to_string() + " has no value in this run");
    return dims_buf;
  };
  for (size_t k = 0; k < n.inputs.size(); ++k) {
    const Tensor* t = n.inputs[k] ? env.at(nf.in_slot[k]) : nullptr;
    if (!t) return Status::error("node '" + n.name + "': input " + std::to_string(k) + " has no value");
    l.bufs.push_back(const_cast<void*>(t->raw()));
  }
  // kiln_inplace = k (passes/fused_inplace.cpp): the kernel was generated to write output
  // 0 through input k's pointer, so input k's slot must hold output 0's buffer: the
  // input's own when it dies here (`dying_inplace`), else a copy of it.
  const int64_t ip = nf.inplace;
  // kiln_donate (passes/fused_inplace.cpp): output j is generated to write through input
  // d[j]'s pointer; that slot holds the state input's own buffer when it is donated, else
  // a copy of it.
  const std::vector<int64_t>& d = nf.donate;
  for (size_t j = 0; j < n.outputs.size(); ++j) {
    Value* o = n.outputs[j];
    if (j < d.size() && d[j] >= 0) {
      if (d[j] >= n.num_inputs() || !n.inputs[d[j]])
        return Status::error("node '" + n.name + "': kiln_donate names no input");
      const Tensor& in = *env.at(nf.in_slot[static_cast<size_t>(d[j])]);
      if (in.dtype() != o->dtype || in.dims() != dims_of(j))
        return Status::error("node '" + n.name + "': kiln_donate input does not match output " + std::to_string(j));
      if (donate) {
        l.outs.push_back(in);
      } else {
        l.outs.push_back(new_output(arena, o, o->dtype, dims_of(j), false));
        if (in.nbytes()) std::memcpy(l.outs.back().raw(), in.raw(), in.nbytes());
      }
      l.bufs[static_cast<size_t>(d[j])] = l.outs.back().raw();
      l.bufs.push_back(l.outs.back().raw());
      continue;
    }
    if (j == 0 && ip >= 0 && ip < n.num_inputs()) {
      if (!n.inputs[ip]) return Status::error("node '" + n.name + "': kiln_inplace names no input");
      const Tensor& in = *env.at(nf.in_slot[static_cast<size_t>(ip)]);
      if (in.dtype() != o->dtype || in.dims() != dims_of(j))
        return Status::error("node '" + n.name + "': kiln_inplace input does not match output 0");
      if (dying_inplace) {
        l.outs.push_back(*dying_inplace);
      } else {
        l.outs.push_back(new_output(arena, o, o->dtype, dims_of(j), false));
        if (in.nbytes()) std::memcpy(l.outs.back().raw(), in.raw(), in.nbytes());
      }
      l.bufs[static_cast<size_t>(ip)] = l.outs.back().raw();
      l.bufs.push_back(l.outs.back().raw());
      continue;
    }
    // A generated kernel writes every element of each output: no zero fill.
    const std::vector<int64_t>& od = dims_of(j);
    if (!dims_status) return dims_status;
    l.outs.push_back(new_output(arena, o, o->dtype, od, false));
    l.bufs.push_back(l.outs.back().raw());
  }
  KILN_ASSIGN_OR_RETURN(int64_t extent, value_of(ck.parallel_extent, "parallel extent"));
  KILN_ASSIGN_OR_RETURN(int64_t per_index, value_of(ck.work_per_index, "work per index"));
  if (ck.split_parts != 0) {
    // A split reduction: its row partitions are the parallel indices (a symbolic one's
    // from this run's row count, passed after the symbols' values).
    int64_t rows = 0;
    if (ck.split_parts < 0) {
      KILN_ASSIGN_OR_RETURN(rows, value_of(ck.split_rows, "row count"));
    }
    l.split_parts = codegen::launch_split_parts(ck, rows);
    if (ck.split_parts < 0) {
      extent = l.split_parts;
      per_index = std::max<int64_t>(1, per_index / l.split_parts);
    }
  }
  if (!ck.symbols.empty()) {
    // A symbolic kernel (codegen/cpu/llvm_cpu.h): its symbols' values after the buffers,
    // then its launch value.
    l.symbol_values.clear();
    for (const std::string& s : ck.symbols) {
      auto it = syms.find(s);
      if (it == syms.end()) return Status::error("node '" + n.name + "': symbol '" + s + "' has no value in this run");
      l.symbol_values.push_back(it->second);
    }
    l.symbol_values.push_back(l.split_parts);
    l.bufs.push_back(l.symbol_values.data());
  }
  if (ck.scratch_bytes > 0) {
    // A split column reduction's partial rows (codegen::CpuKernel::scratch_bytes): one
    // buffer per calling thread, grown once and reused by every later call.
    if (!scratch) return Status::error("node '" + n.name + "': a split reduction kernel cannot run in a group");
    if (scratch->size() * sizeof(double) < static_cast<size_t>(ck.scratch_bytes))
      scratch->resize(static_cast<size_t>((ck.scratch_bytes + 7) / 8));
    l.bufs.push_back(scratch->data());
  }
  l.extent = ck.parallel_dim < 0 ? 1 : extent;
  const int64_t work = l.extent * std::max<int64_t>(1, per_index);
  const int threads = omp_get_max_threads();
  // About 32K domain points per chunk at least: smaller kernels run on one thread.
  l.chunks = std::min<int64_t>({l.extent, static_cast<int64_t>(threads), std::max<int64_t>(1, work / 32768)});
  return Status::ok();
}

/// Piece c of l.chunks of a prepared call.
inline void run_piece(const FusedLaunch& l, int64_t c) {
  if (!l.ck) {
    l.eager.run(c);
    return;
  }
  l.ck->fn(l.bufs.data(), c * l.extent / l.chunks, (c + 1) * l.extent / l.chunks);
}

/// Sets up an eager multi-tensor member (OpDef::pieces): its inputs from `env`, outputs
/// placed as run_node would, the kernel's checks, and its pieces.
Status prepare_pieced(const Node& n, const GraphFacts::NodeFacts& nf, const OpDef& def, const StaticOutputs* known,
                      Env& env, const RunOptions& opts, uint64_t op_id, FusedLaunch& l) {
  KILN_RETURN_IF_ERROR(input_tensors(n, nf, env, l.ins));
  l.ctx = std::make_unique<KernelContext>(
      KernelContext{n, l.ins, {}, opts.training, opts.seed, opts.step, op_id, nullptr, opts.symbols});
  KILN_RETURN_IF_ERROR(allocate_kernel_outputs(n, l.ins, opts, nullptr, def, known, *l.ctx));
  auto pieces = def.pieces(*l.ctx);
  if (!pieces) return pieces.status();
  l.eager = std::move(*pieces);
  l.chunks = l.eager.count;
  return Status::ok();
}

/// Runs a FusedKernel node through its generated kernel: outputs allocated, then the
/// kernel's parallel dimension split across the OpenMP threads (and a split column
/// reduction's partitions combined).
Status run_fused_compiled(const Node& n, const GraphFacts::NodeFacts& nf, const codegen::CpuKernel& ck, Env& env,
                          const StepArena* arena, Tensor* dying_inplace, bool donate,
                          const std::map<std::string, int64_t>* symbols) {
  FusedLaunch l;
  thread_local std::vector<double> scratch;
  KILN_RETURN_IF_ERROR(prepare_fused(n, nf, ck, env, arena, dying_inplace, donate, l, symbols, &scratch));
  if (l.chunks <= 1) {
    run_piece(l, 0);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < l.chunks; ++c) run_piece(l, c);
  }
  codegen::combine_cpu_partitions(ck, l.bufs.data(), l.split_parts);
  for (size_t k = 0; k < n.outputs.size(); ++k) env.put(nf.out_slot[k]) = std::move(l.outs[k]);
  return Status::ok();
}

/// A multi-tensor group's prepared calls (passes/multi_tensor.cpp) in one parallel
/// region: every call's pieces in one list, handed to the threads as they free up.
void run_fused_group(const std::vector<FusedLaunch>& ls) {
  std::vector<std::pair<int, int64_t>> pieces;  // (call, piece)
  for (size_t m = 0; m < ls.size(); ++m)
    for (int64_t c = 0; c < ls[m].chunks; ++c) pieces.push_back({static_cast<int>(m), c});
  const int64_t np = static_cast<int64_t>(pieces.size());
  if (omp_get_max_threads() <= 1 || np <= 1) {
    for (auto [m, c] : pieces) run_piece(ls[static_cast<size_t>(m)], c);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t p = 0; p < np; ++p) run_piece(ls[static_cast<size_t>(pieces[p].first)], pieces[p].second);
}

/// Step arena rule (runtime/arena.h): an output of `n` that lies in the arena block but
/// not at its own planned place (a kernel that returned one of its inputs, a view of an
/// input that does not die here) would outlive that place's planned owner: it moves to
/// its home when it has one, else to the heap.
void relocate_misplaced(const Node& n, const GraphFacts::NodeFacts& nf, Env& env, const StepArena& arena) {
  for (size_t k = 0; k < n.outputs.size(); ++k) {
    const Value* o = n.outputs[k];
    Tensor* t = o ? env.at(nf.out_slot[k]) : nullptr;
    if (!t || !t->defined()) continue;
    const void* p = t->raw();
    if (!arena.contains(p) || arena.at_planned_place(o, p)) continue;
    // Its home (never `p`: that is its planned place) or the heap.
    Tensor moved = new_output(&arena, o, t->dtype(), t->dims(), false);
    if (t->nbytes()) std::memcpy(moved.raw(), p, t->nbytes());
    arena.count_relocation();
    *t = std::move(moved);
  }
}

Status run_nodes(const Graph& g, const GraphFacts& facts, Env& env, const RunOptions& opts) {
  // Last use of each value (reads by nested regions count at their node), so its
  // buffer is released right after; kernels, output types and Env slots of the nodes.
  const std::unordered_map<const Value*, size_t>& last_use = facts.last_use;
  auto last_at = [&](const Value* v, size_t i) {
    auto it = last_use.find(v);
    return it != last_use.end() && it->second == i;
  };
  const auto& nodes = g.nodes();
  // Values never released, by slot: the graph's outputs and initializers, and the
  // values RunOptions::keep names.
  std::vector<char> pinned_slot = facts.kept;
  for (auto& k : opts.keep)
    if (const Value* v = g.find_value(k))
      if (auto it = facts.slot_of.find(v); it != facts.slot_of.end()) pinned_slot[static_cast<size_t>(it->second)] = 1;
  // Node i's inputs after it ran: those it read last leave the environment, and so do
  // the values its regions read for the last time.
  auto release_inputs = [&](size_t i) {
    const GraphFacts::NodeFacts& f = facts.nodes[i];
    for (size_t k = 0; k < f.in_slot.size(); ++k)
      if (f.last_read[k] && f.in_slot[k] >= 0 && !pinned_slot[static_cast<size_t>(f.in_slot[k])])
        env.drop(f.in_slot[k]);
    for (size_t c = 0; c < f.captures.size(); ++c)
      if (last_at(f.captures[c], i) && !pinned_slot[static_cast<size_t>(f.capture_slot[c])])
        env.drop(f.capture_slot[c]);
  };
  // Input k's tensor of node `at` when that node may take its storage: its last use, not
  // pinned, nothing else shares the storage, and the node reads it only once.
  auto dying_input_of = [&](size_t at, int64_t k) -> Tensor* {
    const Node& n = *nodes[at];
    const GraphFacts::NodeFacts& f = facts.nodes[at];
    if (k < 0 || k >= n.num_inputs() || !n.inputs[k]) return nullptr;
    const int32_t s = f.in_slot[static_cast<size_t>(k)];
    if (!f.last_read[static_cast<size_t>(k)] || pinned_slot[static_cast<size_t>(s)]) return nullptr;
    Tensor* t = env.at(s);
    if (!t || !t->storage_unique()) return nullptr;
    for (int j = 0; j < n.num_inputs(); ++j)
      if (j != k && n.inputs[j] == n.inputs[k]) return nullptr;
    return t;
  };
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = *nodes[i];
    const GraphFacts::NodeFacts& nf = facts.nodes[i];
    if (nf.group >= 0 && i + 1 < nodes.size() && facts.nodes[i + 1].group == nf.group) {
      // A multi-tensor group (passes/multi_tensor.cpp): its consecutive members' kernels
      // run in one parallel region; then each member's results land and its inputs are
      // released (the planner kept them all live over the group).
      size_t j = i;
      while (j + 1 < nodes.size() && facts.nodes[j + 1].group == nf.group) ++j;
      const auto t0 = opts.profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
      std::vector<FusedLaunch> ls(j - i + 1);
      for (size_t k = i; k <= j; ++k) {
        const GraphFacts::NodeFacts& mf = facts.nodes[k];
        if (mf.kernel)
          KILN_RETURN_IF_ERROR(prepare_fused(*nodes[k], mf, *mf.kernel, env, opts.arena, dying_input_of(k, mf.inplace),
                                             opts.donate_state, ls[k - i], opts.symbols));
        else
          KILN_RETURN_IF_ERROR(
              prepare_pieced(*nodes[k], mf, *mf.def, mf.outputs_at(*nodes[k], opts.symbols), env, opts, k, ls[k - i]));
      }
      run_fused_group(ls);
      if (opts.profile) {
        // Each member is charged a share of the group's wall time proportional to its
        // largest output's elements (the parameter it updates).
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::vector<double> weight(ls.size(), 1.0);
        double total_weight = 0;
        for (size_t k = i; k <= j; ++k) {
          for (const Value* o : nodes[k]->outputs)
            if (o && o->shape.is_static())
              weight[k - i] = std::max(weight[k - i], static_cast<double>(o->shape.numel()));
          total_weight += weight[k - i];
        }
        for (size_t k = i; k <= j; ++k)
          opts.profile->add(profile_key(*nodes[k], ls[k - i].ck != nullptr, opts.profile->group()),
                            wall * weight[k - i] / total_weight);
      }
      for (size_t k = i; k <= j; ++k) {
        const Node& m = *nodes[k];
        FusedLaunch& l = ls[k - i];
        std::vector<Tensor>& outs = l.ck ? l.outs : l.ctx->outputs;
        for (size_t o = 0; o < m.outputs.size(); ++o) env.put(facts.nodes[k].out_slot[o]) = std::move(outs[o]);
        if (opts.arena) relocate_misplaced(m, facts.nodes[k], env, *opts.arena);
      }
      for (size_t k = i; k <= j; ++k) release_inputs(k);
      i = j;
      continue;
    }
    // RunOptions::profile: this node's wall time (not an AccumulationLoop's: its body is timed).
    const bool timed = opts.profile && !has_trait(n, OpTrait::loop);
    const auto t0 = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    bool generated = false;
    auto dying_input = [&](int64_t k) { return dying_input_of(i, k); };
    if (nf.loop) {
      // Carried inputs used only here move into the loop.
      bool steal = true;
      for (size_t c = 0; c < static_cast<size_t>(n.attrs.get_int("num_carried", 0)) && c < n.inputs.size(); ++c) {
        const Value* v = n.inputs[c];
        if (!v || !last_at(v, i) || pinned_slot[static_cast<size_t>(nf.in_slot[c])]) steal = false;
        for (size_t c2 = 0; c2 < c; ++c2)
          if (n.inputs[c2] == v) steal = false;
      }
      KILN_RETURN_IF_ERROR(run_accumulation_loop(n, env, steal, opts, &nf.captures));
    } else if (const codegen::CpuKernel* ck = nf.kernel) {
      KILN_RETURN_IF_ERROR(
          run_fused_compiled(n, nf, *ck, env, opts.arena, dying_input(nf.inplace), opts.donate_state, opts.symbols));
      generated = true;
    } else {
      std::vector<const Tensor*> ins;
      KILN_RETURN_IF_ERROR(input_tensors(n, nf, env, ins));
      // kiln_inplace = k: output 0 may reuse input k's buffer when this is its last
      // use and nothing else shares it (set by passes for pointwise updates such as
      // the gradient accumulators; DESIGN.md invariant 2: visible in the IR).
      const Tensor* inplace = dying_input(nf.inplace);
      // Reshape-family ops (ir::is_view_op) whose input dies here: the output is the
      // same storage with new dims, no copy (the planner models the same rule).
      bool viewed = false;
      std::vector<int64_t> od;
      const StaticOutputs* known = nf.outputs_at(n, opts.symbols);
      if (nf.view && n.num_outputs() == 1 &&
          (known ? (od = known->dims[0], true) : dims_at(n.outputs[0]->shape, opts.symbols, od))) {
        Tensor* in = dying_input(0);
        if (in && ir::numel_of(od) == in->numel() && in->dtype() == n.outputs[0]->dtype) {
          env.put(nf.out_slot[0]) = in->reshaped(od);
          viewed = true;
        }
      }
      if (!viewed) {
        auto outs = run_node_impl(n, ins, opts, i, inplace, nf.def, known, &nf.kernel_cache);
        if (!outs) return outs.status();
        for (size_t k = 0; k < n.outputs.size(); ++k) env.put(nf.out_slot[k]) = std::move((*outs)[k]);
      }
    }
    if (opts.arena) relocate_misplaced(n, nf, env, *opts.arena);
    if (timed)
      opts.profile->add(profile_key(n, generated, opts.profile->group()),
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    release_inputs(i);
  }
  return Status::ok();
}

}  // namespace

namespace {

/// run_graph's work on `env` (slots of `facts`): the inputs from feed(i) (null: the
/// default, or streamed), the initializers, then the nodes (run_nodes pins the graph
/// outputs, initializers and RunOptions::keep).
Status run_graph_env(const Graph& g, const GraphFacts& facts, Env& env,
                     const std::function<const Tensor*(size_t)>& feed, const RunOptions& opts) {
  // Scan inputs of top-level accumulation loops that nothing else reads may be streamed
  // (RunOptions::microbatch) instead of fed.
  const ValueSet streamable = opts.microbatch ? ir::streamable_scan_inputs(g) : ValueSet{};
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    Value* in = g.inputs[i];
    const Tensor* t = feed(i);
    if (!t && streamable.count(in)) continue;
    if (!t) {
      auto d = g.input_defaults.find(in->name);  // a run-time setting left at its default
      if (d == g.input_defaults.end() || !d->second) return Status::error("missing input '" + in->name + "'");
      env[in] = *d->second;
      continue;
    }
    KILN_RETURN_IF_ERROR(check_feed(*in, *t));
    env[in] = *t;
  }
  for (Value* v : g.initializers) env[v] = *v->data;
  if (!facts.symbolic || opts.symbols) return run_nodes(g, facts, env, opts);
  // A symbolic program: the symbols take their values from the inputs' dims.
  std::map<std::string, int64_t> symbols;
  KILN_RETURN_IF_ERROR(bind_symbols(g, env, symbols));
  RunOptions bound = opts;
  bound.symbols = &symbols;
  return run_nodes(g, facts, env, bound);
}

/// Results outlive the step: unless the caller takes them as arena views
/// (RunOptions::results_in_arena), none may point into the arena, which the next step
/// overwrites.
Tensor out_of_arena(const Tensor& t, const RunOptions& opts) {
  return opts.arena && !opts.results_in_arena && t.defined() && opts.arena->contains(t.raw()) ? t.clone() : t;
}

}  // namespace

Expected<std::vector<Tensor>> run_graph_positional(const Graph& g, const std::vector<Tensor>& feeds,
                                                   const RunOptions& opts) {
  if (!opts.keep.empty()) return Status::error("run_graph_positional: RunOptions::keep names values; use run_graph");
  register_eager_kernels();
  std::unique_ptr<GraphFacts> own;
  const GraphFacts& facts = facts_of(g, opts, own);
  Env env(&facts.slot_of);
  KILN_RETURN_IF_ERROR(run_graph_env(
      g, facts, env, [&](size_t i) { return i < feeds.size() && feeds[i].defined() ? &feeds[i] : nullptr; }, opts));
  std::vector<Tensor> result;
  result.reserve(g.outputs.size());
  for (Value* o : g.outputs) {
    const Tensor* t = env.find(o);
    if (!t) return Status::error("graph output '" + o->name + "' was not computed");
    result.push_back(out_of_arena(*t, opts));
  }
  return result;
}

Expected<std::map<std::string, Tensor>> run_graph(const Graph& g, const std::map<std::string, Tensor>& feeds,
                                                  const RunOptions& opts) {
  register_eager_kernels();
  std::unique_ptr<GraphFacts> own;
  const GraphFacts& facts = facts_of(g, opts, own);
  Env env(&facts.slot_of);
  KILN_RETURN_IF_ERROR(run_graph_env(
      g, facts, env,
      [&](size_t i) -> const Tensor* {
        auto it = feeds.find(g.inputs[i]->name);
        return it == feeds.end() ? nullptr : &it->second;
      },
      opts));
  std::map<std::string, Tensor> result;
  for (Value* o : g.outputs) {
    const Tensor* t = env.find(o);
    if (!t) return Status::error("graph output '" + o->name + "' was not computed");
    result[o->name] = out_of_arena(*t, opts);
  }
  for (auto& k : opts.keep) {
    Value* v = g.find_value(k);
    if (const Tensor* t = v ? env.find(v) : nullptr) result[k] = out_of_arena(*t, opts);
  }
  return result;
}

Status fused_kernel_eager(KernelContext& ctx) {
  if (ctx.node.regions.size() != 1) return ctx.fail("FusedKernel has no body");
  const Graph& body = *ctx.node.regions[0];
  std::map<std::string, Tensor> feeds;
  for (size_t i = 0; i < body.inputs.size() && i < ctx.inputs.size(); ++i)
    if (ctx.inputs[i]) feeds[body.inputs[i]->name] = *ctx.inputs[i];
  RunOptions ro;
  ro.training = ctx.training;
  ro.seed = ctx.seed;
  ro.step = ctx.step;
  auto outs = run_graph(body, feeds, ro);
  if (!outs) return outs.status().with_context(ctx.node.name);
  for (size_t i = 0; i < ctx.outputs.size(); ++i) ctx.outputs[i] = (*outs)[body.outputs[i]->name];
  return Status::ok();
}

Status accumulation_loop_kernel(KernelContext& ctx) {
  // Outside run_graph the body's captured outer values are not available.
  if (!ctx.node.regions.empty()) {
    ValueSet caps;
    collect_captures(*ctx.node.regions[0], caps);
    if (!caps.empty())
      return ctx.fail("the loop body reads values of the enclosing graph; run it with run_graph, not run_node");
  }
  Env env;
  for (size_t i = 0; i < ctx.inputs.size(); ++i)
    if (ctx.inputs[i]) env[ctx.node.inputs[i]] = *ctx.inputs[i];
  RunOptions ro;
  ro.training = ctx.training;
  ro.seed = ctx.seed;
  ro.step = ctx.step;
  KILN_RETURN_IF_ERROR(run_accumulation_loop(ctx.node, env, false, ro));
  for (size_t i = 0; i < ctx.outputs.size(); ++i) ctx.outputs[i] = env[ctx.node.outputs[i]];
  return Status::ok();
}

}  // namespace kiln::runtime
