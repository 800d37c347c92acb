// accumulation: wraps forward and backward of a training graph in an explicit
// gradient-accumulation loop (DESIGN.md convention 11; Hugging Face's
// gradient_accumulation_steps).
//
// Input: a graph built for one microbatch of b rows (attach_loss, autocast,
// autodiff and usually optimizer already ran). Option gradient_accumulation_steps
// = N (N <= 1: no change). Algorithm:
//  1. Scan inputs: the data inputs (graph inputs that are neither training state
//     nor "num_items_in_batch"). Their leading dim becomes N*b; iteration t of the
//     loop reads rows [t*b, (t+1)*b).
//  2. Per-microbatch nodes: every node that depends on a scan input. The loop body
//     holds those needed for the carried results: "loss", every "<param>.grad",
//     and the BatchNormalization running statistics (state kind "buffer").
//     Nodes that do not depend on the data (parameters' bf16 Casts, weight
//     transposes, constants) stay before the loop: they are loop-invariant and
//     run once per optimizer step (loop-invariant code motion); the body reads
//     them from the enclosing graph. A large invariant other than a Cast that only
//     the body reads (a weight transpose) moves into the body instead, so hoisting
//     never holds a weight-sized temporary across the loop.
//  3. Carried values: one fp32 accumulator per gradient and one for the loss,
//     each zeroed once per step by a ConstantOfShape node before the loop and
//     updated by Add inside the body (the Add sits right after the gradient's
//     producer in the body's order, so a microbatch gradient dies at once and
//     peak memory stays that of one microbatch step; the Add carries
//     kiln_inplace=0, so the runtime updates the accumulator in place); BatchNorm running stats are
//     threaded through the iterations (PyTorch updates them once per forward).
//  4. Everything after (clipping, schedule, optimizer update) reads the loop's
//     outputs, so it runs once per optimizer step.
//  5. Loss normalization: attach_loss built the loss for option
//     accumulation_normalization (see there). With "tokens" the graph keeps its
//     input "num_items_in_batch": the count of labels != ignore_index over all N
//     microbatches (clamped to >= 1; runtime::count_num_items), fed with the step,
//     so the summed loss is the mean over every real label of the step, as one large
//     batch gives (Hugging Face's num_items_in_batch fix). Counting outside the graph
//     lets the trainer stream the microbatches into the loop (RunOptions::microbatch).
//     With "microbatch" each microbatch's mean loss was scaled by 1/N.
// Errors: a value computed per microbatch that is used after the loop (other than
// the carried results), or a scan input whose leading dim is not static.
#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "passes/passes.h"
#include "passes/training_util.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// Largest data-independent result (bytes) kept before the loop besides Casts.
constexpr int64_t kHoistMaxBytes = 4096;

class Accumulation : public Pass {
 public:
  std::string name() const override { return "accumulation"; }
  std::string describe_options(const PassOptions& o) const override {
    return OptionText().add("gradient_accumulation_steps", o.accumulation.gradient_accumulation_steps).str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const int64_t N = ctx.options.accumulation.gradient_accumulation_steps;
    if (N <= 1) return false;

    // ---- 1. scan inputs ----
    std::unordered_set<const Value*> state_inputs;
    for (auto& sb : g.state) state_inputs.insert(sb.input);
    std::vector<Value*> scan;
    for (Value* in : g.inputs) {
      if (state_inputs.count(in)) continue;
      if (in->name == kNumItemsInput) continue;        // fed with the step (see 5.)
      if (g.input_defaults.count(in->name)) continue;  // a run-time setting (LR schedule), read once per step
      if (in->shape.rank() < 1 || !in->shape.dims[0].is_static())
        return Status::error("gradient accumulation: data input '" + in->name +
                             "' has no static leading (batch) dim (" + in->shape.to_string() + ")");
      scan.push_back(in);
    }
    if (scan.empty()) return Status::error("gradient accumulation: the training graph has no data inputs");

    // ---- 2. per-microbatch nodes ----
    // Everything downstream of the data, stopping at the carried results (the
    // loop's outputs): what reads a carried result runs after the loop. A symbolic
    // program's shapes are data too: a node whose output's dims or contents
    // (Value::sym_data) name a symbol of the scan inputs' dims (SymInts of `seq`, the
    // Range and causal mask built from it) depends on the microbatch's shape, so it
    // runs in the body, where the microbatch binds its symbols.
    std::set<std::string> scan_symbols;
    for (const Value* s : scan)
      for (const Dim& d : s->shape.dims)
        if (d.is_symbolic())
          for (const std::string& x : d.expr.symbols()) scan_symbols.insert(x);
    auto names_scan_symbol = [&](const Value* v) {
      auto named = [&](const SymExpr& e) {
        for (const std::string& x : e.symbols())
          if (scan_symbols.count(x)) return true;
        return false;
      };
      for (const Dim& d : v->shape.dims)
        if (d.is_symbolic() && named(d.expr)) return true;
      if (v->sym_data)
        for (const SymExpr& e : *v->sym_data)
          if (named(e)) return true;
      return false;
    };
    auto data_dependent = [&](const std::unordered_set<const Value*>& stop, std::unordered_set<const Value*>& dep,
                              std::unordered_set<const Node*>& nodes) -> Status {
      dep = std::unordered_set<const Value*>(scan.begin(), scan.end());
      nodes.clear();
      for (auto& n : g.nodes()) {
        if (!n->regions.empty())
          return Status::error("gradient accumulation: node '" + n->name + "' already has a region");
        bool d = false;
        for (Value* in : n->inputs)
          if (in && dep.count(in) && !stop.count(in)) d = true;
        if (!scan_symbols.empty())
          for (const Value* o : n->outputs) d = d || names_scan_symbol(o);
        if (!d) continue;
        nodes.insert(n.get());
        for (Value* o : n->outputs) dep.insert(o);
      }
      return Status::ok();
    };
    std::unordered_set<const Value*> dep;
    std::unordered_set<const Node*> per_mb;

    // Carried results: loss and gradients (accumulated), BN buffers (threaded).
    struct Carried {
      Value* result;     // value in g computed by the body (per microbatch)
      Value* init;       // outer initial value (nullptr: zero accumulator)
      bool accumulate;   // Add into an accumulator vs thread through
      std::string name;  // name of the loop output
    };
    std::vector<Carried> carried;
    Value* loss = g.find_value("loss");
    if (!loss) return Status::error("gradient accumulation: no 'loss' value");
    carried.push_back({loss, nullptr, true, "loss"});
    for (auto& sb : g.state)
      if (sb.kind == "parameter") {
        Value* gr = g.find_value(sb.input->name + ".grad");
        if (!gr)
          return Status::error("gradient accumulation: no gradient '" + sb.input->name + ".grad' (run autodiff first)");
        carried.push_back({gr, nullptr, true, gr->name});
      }
    std::unordered_set<const Value*> carried_results;
    for (auto& c : carried) carried_results.insert(c.result);
    KILN_RETURN_IF_ERROR(data_dependent(carried_results, dep, per_mb));
    for (auto& sb : g.state)
      if (sb.kind == "buffer" && sb.output && dep.count(sb.output))
        carried.push_back({sb.output, sb.input, false, sb.output->name});
    for (auto& c : carried) carried_results.insert(c.result);
    KILN_RETURN_IF_ERROR(data_dependent(carried_results, dep, per_mb));
    // Loop-invariant code motion, with a memory guard: a data-independent node
    // stays before the loop (computed once per step) when it is a Cast (the bf16
    // copies of the master weights) or its outputs are small; a large invariant
    // read only inside the loop (a weight transpose for the backward MatMul) is
    // recomputed per microbatch instead, so it is not held across the whole loop.
    {
      std::unordered_map<const Value*, std::vector<const Node*>> users;
      for (auto& n : g.nodes())
        for (Value* in : n->inputs)
          if (in) users[in].push_back(n.get());
      const auto& nodes = g.nodes();
      for (int i = static_cast<int>(nodes.size()) - 1; i >= 0; --i) {
        Node* n = nodes[i].get();
        if (per_mb.count(n) || has_trait(*n, OpTrait::cast)) continue;
        int64_t bytes = 0;
        bool ok = true;
        for (Value* o : n->outputs) {
          if (!o->shape.is_static())
            ok = false;
          else
            bytes += o->shape.numel() * static_cast<int64_t>(dtype_size(o->dtype));
          if (g.is_graph_output(o)) ok = false;
          auto it = users.find(o);
          if (it == users.end())
            ok = false;
          else
            for (const Node* u : it->second)
              if (!per_mb.count(u)) ok = false;
        }
        if (ok && bytes > kHoistMaxBytes) per_mb.insert(n);
      }
      for (auto& n : g.nodes())
        if (per_mb.count(n.get()))
          for (Value* o : n->outputs) dep.insert(o);
    }

    // Body nodes: per-microbatch ancestors of the carried results.
    std::unordered_set<const Node*> body_nodes;
    {
      std::vector<const Value*> work;
      for (auto& c : carried) work.push_back(c.result);
      while (!work.empty()) {
        const Value* v = work.back();
        work.pop_back();
        const Node* p = v->producer;
        if (!p || !per_mb.count(p) || body_nodes.count(p)) continue;
        body_nodes.insert(p);
        for (Value* in : p->inputs)
          if (in) work.push_back(in);
      }
    }
    // Nothing computed per microbatch may be read after the loop except the carried results.
    for (auto& n : g.nodes()) {
      if (per_mb.count(n.get())) continue;
      for (Value* in : n->inputs)
        if (in && dep.count(in) && !carried_results.count(in))
          return Status::error("gradient accumulation: node '" + n->name + "' reads '" + in->name +
                               "', which is computed per microbatch; only the loss, gradients and "
                               "BatchNorm statistics leave the loop");
    }
    for (Value* o : g.outputs)
      if (dep.count(o) && !carried_results.count(o))
        return Status::error("gradient accumulation: graph output '" + o->name + "' is computed per microbatch");

    // ---- build the body region ----
    auto body = std::make_unique<Graph>();
    body->name = "accumulation_body";
    std::unordered_map<const Value*, Value*> map;
    std::vector<Value*> carried_in;
    for (auto& c : carried) {
      const std::string in_name = c.accumulate ? c.name + ".acc" : c.init->name + ".carried";
      Value* v = body->add_input(in_name, c.accumulate ? c.result->dtype : c.init->dtype,
                                 c.accumulate ? c.result->shape : c.init->shape);
      carried_in.push_back(v);
      if (!c.accumulate) map[c.init] = v;
    }
    for (Value* s : scan) {
      int64_t rows = s->shape.dims[0].value;
      Shape sh = s->shape;
      sh.dims[0] = Dim(rows);
      map[s] = body->add_input(s->name, s->dtype, sh);
    }
    auto mapped = [&](Value* v) -> Value* {
      if (!v) return nullptr;
      auto it = map.find(v);
      return it == map.end() ? v : it->second;  // not in the body: read from the enclosing graph
    };
    // Accumulator Adds are emitted right after the producer of their result.
    std::unordered_map<const Value*, size_t> carried_index;
    for (size_t i = 0; i < carried.size(); ++i) carried_index[carried[i].result] = i;
    std::vector<Value*> body_out(carried.size(), nullptr);
    auto emit_carried = [&](size_t i) -> Status {
      const Carried& c = carried[i];
      Value* r = mapped(c.result);
      if (!c.accumulate) {
        body_out[i] = r;
        return Status::ok();
      }
      Attributes aa;
      aa.set("kiln_inplace", int64_t(0));  // the accumulator is updated in place
      Node* add =
          body->add_node("Add", "accumulation/" + c.name + "/add", {carried_in[i], r}, {c.name + ".acc.next"}, aa);
      KILN_RETURN_IF_ERROR(infer_node(*add));
      body_out[i] = add->outputs[0];
      return Status::ok();
    };
    for (auto& np : g.nodes()) {
      const Node* n = np.get();
      if (!body_nodes.count(n)) continue;
      std::vector<Value*> ins;
      for (Value* in : n->inputs) ins.push_back(mapped(in));
      std::vector<std::string> outs;
      for (Value* o : n->outputs)  // carried results keep their name for the loop's output
        outs.push_back(carried_index.count(o) ? o->name + ".microbatch" : o->name);
      Node* nn = body->add_node(n->op, n->name, ins, outs, n->attrs);
      for (size_t k = 0; k < n->outputs.size(); ++k) {
        nn->outputs[k]->dtype = n->outputs[k]->dtype;
        nn->outputs[k]->shape = n->outputs[k]->shape;
        map[n->outputs[k]] = nn->outputs[k];
      }
      for (Value* o : n->outputs) {
        auto it = carried_index.find(o);
        if (it != carried_index.end()) KILN_RETURN_IF_ERROR(emit_carried(it->second));
      }
    }
    // Carried results not produced in the body (a gradient independent of the data).
    for (size_t i = 0; i < carried.size(); ++i)
      if (!body_out[i]) KILN_RETURN_IF_ERROR(emit_carried(i));
    body->outputs = body_out;

    // ---- rewrite the outer graph ----
    // Remove every per-microbatch node; their results are replaced by the loop's outputs.
    // The loop takes the place of the first per-microbatch node, so that the optimizer's
    // nodes that do not read a gradient (the LR schedule, AdamW's decay of a parameter)
    // stay after it rather than moving before it and holding their results across it.
    std::vector<Node*> to_remove;
    size_t loop_pos = 0;
    for (auto& n : g.nodes()) {
      if (per_mb.count(n.get()))
        to_remove.push_back(n.get());
      else if (to_remove.empty())
        ++loop_pos;
    }
    for (Node* n : to_remove) g.remove_node(n);

    Builder b(g, "accumulation");
    // Scan inputs now hold all N microbatches.
    for (Value* s : scan) s->shape.dims[0] = Dim(s->shape.dims[0].value * N);
    // accumulation_normalization=tokens: "num_items_in_batch" stays a graph input, the
    // count of labels != ignore_index over all N microbatches of the step, supplied by
    // whoever feeds the step (the trainer counts them before the loop, as Hugging
    // Face's Trainer does), so the microbatches need not all be resident at once.
    b.set_prefix("accumulation");
    std::vector<Value*> loop_in;
    for (size_t i = 0; i < carried.size(); ++i) {
      const Carried& c = carried[i];
      if (c.accumulate) {
        auto zero = std::make_shared<Tensor>(c.result->dtype, std::vector<int64_t>{1});
        std::memset(zero->raw(), 0, zero->nbytes());
        Attributes za;
        za.set("value", *zero);
        Value* z = b.op("ConstantOfShape", {b.dims(c.result->shape.dims)}, za, c.name + ".acc.init");
        loop_in.push_back(z);
      } else {
        loop_in.push_back(c.init);
      }
    }
    for (Value* s : scan) loop_in.push_back(s);
    std::vector<std::string> out_names;
    for (auto& c : carried) out_names.push_back(c.name);
    Attributes la;
    la.set("trip_count", N);
    la.set("num_carried", static_cast<int64_t>(carried.size()));
    Node* loop = g.insert_node(loop_pos, "AccumulationLoop", "accumulation/loop", loop_in, out_names, la);
    loop->regions.push_back(std::move(body));
    KILN_RETURN_IF_ERROR(infer_node(*loop));
    for (size_t i = 0; i < carried.size(); ++i) {
      Value* old = carried[i].result;
      Value* now = loop->outputs[i];
      for (auto& n : g.nodes())
        if (n.get() != loop)
          for (auto& in : n->inputs)
            if (in == old) in = now;
      for (auto& o : g.outputs)
        if (o == old) o = now;
      for (auto& sb : g.state)
        if (sb.output == old) sb.output = now;
    }

    if (!b.status()) return b.status();
    KILN_RETURN_IF_ERROR(g.topo_sort());
    g.dead_code_elimination();
    g.remove_unused_initializers();
    return true;
  }
};

}  // namespace

std::unique_ptr<Pass> make_accumulation_pass() { return std::make_unique<Accumulation>(); }

}  // namespace kiln::passes
