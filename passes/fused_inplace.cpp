// fused_inplace: a pointwise FusedKernel writes its output into an input that dies at it
// (kiln_inplace = k on the node), so a chain of generated kernels runs in one buffer and
// the step arena needs one buffer less per link (docs/architecture.md, decision 26). The
// memory planner already honours kiln_inplace (PlanOptions::honor_inplace_attr); the
// lowering marks the kernel's output parameter in_place_of k, so the generated code
// addresses both through one pointer (no alias checks, the loop still vectorizes), and
// the executor hands the kernel input k's buffer when it dies there, else a copy of it.
//
// Input k qualifies when (1) it has the output's dtype and static shape, (2) it is made
// by a node of the same graph (not a graph or loop-body input, not a constant, not a
// graph output), (3) this node is its last reader (region captures count) and reads it
// once, and (4) inside the body every reader of it is a pointwise op whose outputs have
// its shape and no view (Transpose, Expand, Slice, Reshape family) reads it: then the
// kernel reads element i of it exactly where it writes element i of the output. The
// first qualifying input is taken. Runs after fusion in the compiled pipeline, into
// AccumulationLoop bodies.
//
// State donation (kiln_donate): a pointwise FusedKernel (or an eager op whose kernel
// declares it, OpDef::in_place_outputs: the 8-bit AdamW update) of the top-level graph that
// makes a state's next value (StateBinding output: the optimizer's updated parameter and
// moments, a BatchNorm running statistic) writes it into the state's input buffer, as
// PyTorch's optimizers update parameters in place and as XLA's input/output aliasing
// ("buffer donation") does. kiln_donate is one int per output: the input index whose
// buffer output j takes, or -1. Input k qualifies for output j when it is the StateBinding
// input of output j, has its dtype and static shape, is read once by this node, by no
// node after it (region captures count), is not itself a graph output, and the body
// reads it pointwise only (as above); output 0 of a kiln_inplace node is not donated. The
// step then holds one copy of the state instead of two (old inputs and new outputs), and
// nothing is copied back after it. The executor donates only when its caller owns the
// state buffers (RunOptions::donate_state, set by the Trainer); otherwise it writes a copy.
#include <unordered_map>
#include <unordered_set>

#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// Every reader of body input `in` is an elementwise pointwise op over its shape.
bool read_pointwise_only(const Graph& body, const Value* in) {
  for (auto& m : body.nodes()) {
    bool reads = false;
    for (const Value* v : m->inputs) reads = reads || v == in;
    if (!reads) continue;
    if (is_view_op(m->op) || is_strided_view_op(m->op) || is_guarded_view_op(m->op)) return false;
    const OpDef* d = OpTable::get().find(m->op);
    if (!d || d->fusion != FusionClass::pointwise || !m->regions.empty()) return false;
    for (const Value* o : m->outputs)
      if (o && !(o->shape == in->shape)) return false;
  }
  return true;
}

int mark_graph(Graph& g) {
  int count = 0;
  for (auto& n : g.nodes())
    if (!has_trait(*n, OpTrait::fused_kernel))
      for (auto& r : n->regions) count += mark_graph(*r);
  const auto& nodes = g.nodes();
  std::unordered_map<const Value*, size_t> last_use = last_reads(g);
  std::unordered_set<const Value*> outside(g.outputs.begin(), g.outputs.end());
  outside.insert(g.inputs.begin(), g.inputs.end());
  outside.insert(g.initializers.begin(), g.initializers.end());
  for (size_t i = 0; i < nodes.size(); ++i) {
    Node& n = *nodes[i];
    if (!has_trait(n, OpTrait::fused_kernel) || n.attrs.get_string("kind", "") != "pointwise" ||
        n.regions.size() != 1 || n.num_outputs() != 1 || !n.outputs[0] || n.attrs.has("kiln_inplace"))
      continue;
    const Value* o = n.outputs[0];
    const Graph& body = *n.regions[0];
    // Static or symbolic: the same dims (one expression) are the same elements.
    if (!o->shape.is_known() || body.inputs.size() != n.inputs.size()) continue;
    for (int k = 0; k < n.num_inputs(); ++k) {
      const Value* v = n.inputs[k];
      if (!v || v->dtype != o->dtype || !v->shape.is_known() || !(v->shape == o->shape)) continue;
      if (outside.count(v) || v->is_initializer() || last_use[v] != i) continue;
      bool twice = false;
      for (int j = 0; j < n.num_inputs(); ++j) twice = twice || (j != k && n.inputs[j] == v);
      if (twice || !read_pointwise_only(body, body.inputs[k])) continue;
      n.attrs.set("kiln_inplace", static_cast<int64_t>(k));
      ++count;
      break;
    }
  }
  return count;
}

/// Marks kiln_donate on the top-level graph's state-updating pointwise kernels (see the
/// file comment); returns how many outputs were donated.
int mark_donations(Graph& g) {
  std::unordered_map<const Value*, const Value*> input_of_next;  // state output -> its input
  for (const StateBinding& sb : g.state)
    if (sb.input && sb.output) input_of_next[sb.output] = sb.input;
  if (input_of_next.empty()) return 0;
  std::unordered_map<const Value*, size_t> last_use = last_reads(g);
  std::unordered_set<const Value*> graph_outputs(g.outputs.begin(), g.outputs.end());
  int count = 0;
  const auto& nodes = g.nodes();
  for (size_t i = 0; i < nodes.size(); ++i) {
    Node& n = *nodes[i];
    if (n.attrs.has("kiln_donate")) continue;
    // A generated pointwise kernel (its body says which inputs it reads elementwise), or
    // an eager op whose kernel declares which outputs may share an input's buffer.
    const bool fused = has_trait(n, OpTrait::fused_kernel) && n.attrs.get_string("kind", "") == "pointwise" &&
                       n.regions.size() == 1 && n.regions[0]->inputs.size() == n.inputs.size();
    const OpDef* def = fused ? nullptr : OpTable::get().find(n.op);
    if (!fused && (!def || def->in_place_outputs.empty())) continue;
    std::vector<int64_t> donate(n.outputs.size(), -1);
    std::unordered_set<int> taken;
    bool any = false;
    for (size_t j = 0; j < n.outputs.size(); ++j) {
      const Value* o = n.outputs[j];
      if (!o || (j == 0 && n.attrs.has("kiln_inplace"))) continue;
      auto it = input_of_next.find(o);
      if (it == input_of_next.end()) continue;
      const Value* v = it->second;
      int k = -1, reads = 0;
      for (int q = 0; q < n.num_inputs(); ++q)
        if (n.inputs[q] == v) k = q, ++reads;
      if (reads != 1 || taken.count(k) || v->dtype != o->dtype || !v->shape.is_static() || !o->shape.is_static() ||
          !(v->shape == o->shape) || graph_outputs.count(v) || last_use[v] != i)
        continue;
      if (fused ? !read_pointwise_only(*n.regions[0], n.regions[0]->inputs[k])
                : j >= def->in_place_outputs.size() || def->in_place_outputs[j] != k)
        continue;
      donate[j] = k;
      taken.insert(k);
      any = true;
      ++count;
    }
    if (any) n.attrs.set("kiln_donate", donate);
  }
  return count;
}

class FusedInplace : public Pass {
 public:
  std::string name() const override { return "fused_inplace"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    const int inplace = mark_graph(g);
    return inplace + mark_donations(g) > 0;
  }
};

}  // namespace

std::unique_ptr<Pass> make_fused_inplace_pass() { return std::make_unique<FusedInplace>(); }

}  // namespace kiln::passes
