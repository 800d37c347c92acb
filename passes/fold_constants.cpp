// fold_constants: evaluates nodes whose inputs are all constant at compile time and
// replaces their outputs by initializers, so the shape subgraphs that PyTorch exports
// (Shape -> Gather -> Unsqueeze -> Concat -> Reshape, ConstantOfShape, Range, Equal,
// Where, Cast, Slice, Mul, ...) disappear once symbolic dims are bound, and downstream
// shapes become static (DESIGN.md invariant 3).
//
// Algorithm (the classic constant-propagation sweep of ONNX Runtime's ConstantFolding
// and onnx-simplifier, restricted to nodes we can evaluate exactly):
//   repeat until a sweep folds nothing:
//     for each node n in topological order:
//       1. re-infer n (ir::infer_node), so it sees inputs folded earlier in this sweep;
//       2. n is foldable when
//          - it has no regions, no kiln_side_effect / kiln_rng_id attribute, is not a
//            random op (OpTrait::random: Dropout), and none of its outputs
//            is bound as training state;
//          - every present input is an initializer, and none of them may be a trainable
//            parameter (ir::is_parameter_candidate: a declared parameter, or by kiln's
//            name rule when the model declares no roles), since folding e.g. Transpose(W)
//            would turn a parameter into a constant; buffers and constants fold (a rotary
//            inv_freq buffer into its cos/sin tables); or n computes its outputs from
//            its inputs' shapes (OpDef::eval_from_shapes: Shape) and they are static
//            (the data is not needed);
//          - every output has a known dtype and a static shape of at most
//            kMaxFoldElements elements (large constants stay computed at run time);
//       3. evaluate: Shape directly from the static dims (OpDef::eval_from_shapes: ONNX
//          Shape-15 start/end); every other op with the evaluator the driver passes in
//          PassContext::evaluator (the eager interpreter's kernels), given an
//          ir::KernelContext whose outputs are preallocated from the inferred types. An op
//          the evaluator cannot run, or that fails, is left unfolded (the run time will
//          evaluate it); a node that needs the evaluator when none was given is an error;
//       4. the node is removed and each output becomes an initializer of the same name,
//          with role constant (Value::role);
//       (a node whose i64 output inference knows as symbolic shape expressions,
//       Value::sym_data, is replaced by a SymInts node holding them instead: the shape
//       subgraphs of a program with unbound symbols, issue 32.)
//   then dead nodes are removed, initializers left unused by folding are dropped
//   (other unused initializers are kept), and ir::infer_graph re-infers every node.
#include <algorithm>
#include <unordered_set>

#include "ir/op_table.h"
#include "passes/passes.h"

namespace kiln::passes {

namespace {

constexpr int64_t kMaxFoldElements = 1 << 20;

// attach_loss's notion of a trainable parameter (see passes/attach_loss.cpp).
bool may_be_parameter(const ir::Value* v) { return ir::is_parameter_candidate(*v); }

class FoldConstants : public Pass {
 public:
  std::string name() const override { return "fold_constants"; }

  Expected<bool> run(ir::Graph& g, PassContext& ctx) override {
    created_.clear();
    evaluator_ = ctx.evaluator;
    error_ = Status::ok();
    std::unordered_set<const ir::Value*> used_before = used_values(g);
    int folded = 0;
    bool progress = true;
    while (progress) {
      progress = false;
      std::vector<ir::Node*> order;
      for (auto& n : g.nodes()) order.push_back(n.get());
      for (ir::Node* n : order) {
        if (!ir::infer_node(*n).is_ok()) continue;  // reported by the final infer_graph if it persists
        if (try_fold(g, n)) {
          progress = true;
          ++folded;
        }
        if (!error_.is_ok()) return error_;
      }
    }
    if (folded == 0) return false;
    g.dead_code_elimination();
    drop_initializers_unused_after_folding(g, used_before);
    KILN_RETURN_IF_ERROR(ir::infer_graph(g));
    return true;
  }

 private:
  static std::unordered_set<const ir::Value*> used_values(const ir::Graph& g) {
    std::unordered_set<const ir::Value*> u(g.outputs.begin(), g.outputs.end());
    for (auto& n : g.nodes())
      for (ir::Value* v : n->inputs)
        if (v) u.insert(v);
    return u;
  }

  // Removes initializers that were used before the pass and are unused now (the constants
  // that only fed folded nodes, and the folded values no one reads). Keeps the order.
  void drop_initializers_unused_after_folding(ir::Graph& g, const std::unordered_set<const ir::Value*>& used_before) {
    std::unordered_set<const ir::Value*> used_now = used_values(g);
    std::vector<ir::Value*> all = g.initializers, candidates;
    for (ir::Value* v : all)
      if (!used_now.count(v) && (used_before.count(v) || created_.count(v))) candidates.push_back(v);
    if (candidates.empty()) return;
    // Graph::remove_unused_initializers drops (and unnames) the unused entries of g.initializers;
    // run it on the candidates only, so that other unused initializers survive.
    g.initializers = candidates;
    g.remove_unused_initializers();
    std::unordered_set<const ir::Value*> removed(candidates.begin(), candidates.end());
    for (ir::Value* v : g.initializers) removed.erase(v);
    g.initializers.clear();
    for (ir::Value* v : all)
      if (!removed.count(v)) g.initializers.push_back(v);
  }

  static bool foldable_node(const ir::Graph& g, const ir::Node* n) {
    if (!n->regions.empty() || ir::has_trait(*n, ir::OpTrait::random)) return false;
    if (n->attrs.has("kiln_side_effect") || n->attrs.has("kiln_rng_id")) return false;
    for (const auto& sb : g.state)
      for (const ir::Value* o : n->outputs)
        if (sb.input == o || sb.output == o) return false;
    for (const ir::Value* o : n->outputs) {
      if (o->dtype == ir::DType::undefined || !o->shape.is_static()) return false;
      if (o->shape.numel() > kMaxFoldElements) return false;
    }
    return true;
  }

  // Outputs from the static input shapes (OpDef::eval_from_shapes: Shape-15).
  static bool eval_from_shapes(const ir::OpDef& def, const ir::Node* n, std::vector<ir::Tensor>& out) {
    auto r = def.eval_from_shapes(*n);
    if (!r) return false;
    out = std::move(*r);
    return true;
  }

  bool eval_kernel(const ir::Node* n, std::vector<ir::Tensor>& out) {
    const ir::OpDef* def = ir::OpTable::get().find(n->op);
    if (!def) return false;
    std::vector<const ir::Tensor*> ins;
    for (const ir::Value* v : n->inputs) {
      if (v && !v->is_initializer()) return false;
      if (v && may_be_parameter(v) && !created_.count(v)) return false;
      ins.push_back(v ? v->data.get() : nullptr);
    }
    if (!evaluator_) {
      error_ = Status::error("fold_constants: node '" + n->name + "' (" + n->op +
                             ") has constant inputs but the pass was given no evaluator (PassContext::evaluator)");
      return false;
    }
    std::vector<ir::Tensor> outs;
    for (const ir::Value* o : n->outputs) outs.emplace_back(o->dtype, o->shape.to_vector());
    ir::KernelContext kc{*n, std::move(ins), std::move(outs)};
    try {
      if (!evaluator_(kc).is_ok()) return false;
    } catch (...) {
      return false;
    }
    out = std::move(kc.outputs);
    return true;
  }

  /// A node whose output is a symbolic shape value (Value::sym_data: Shape of a
  /// symbolic tensor, the Gather / Concat / arithmetic of it) becomes one SymInts node
  /// holding the expressions: the subgraph leaves the program, and nothing reads the
  /// tensor whose shape it took (which would keep that tensor alive). A node with no
  /// inputs (SymInts itself, a constant) is already a leaf and is left alone.
  static bool try_fold_symbolic(ir::Graph& g, ir::Node* n) {
    if (n->inputs.empty() || n->num_outputs() != 1 || !n->outputs[0]->sym_data) return false;
    if (!foldable_node(g, n) || n->outputs[0]->dtype != ir::DType::i64) return false;
    ir::Value* old = n->outputs[0];
    std::vector<std::string> values;
    for (const ir::SymExpr& e : *old->sym_data) values.push_back(e.to_string());
    ir::Attributes a;
    a.set("values", values);
    a.set("dims", old->shape.to_vector());
    size_t pos = 0;
    while (g.nodes()[pos].get() != n) ++pos;
    const std::string name = n->name, out = old->name;
    g.remove_node(n);
    ir::Node* s = g.insert_node(pos, "SymInts", name, {}, {out}, a);
    if (!ir::infer_node(*s).is_ok()) return false;  // cannot happen: the expressions print and parse
    g.replace_all_uses(old, s->outputs[0]);
    return true;
  }

  bool try_fold(ir::Graph& g, ir::Node* n) {
    if (try_fold_symbolic(g, n)) return true;
    if (!foldable_node(g, n)) return false;
    std::vector<ir::Tensor> results;
    const ir::OpDef* def = ir::OpTable::get().find(n->op);
    const bool from_shapes = def && def->eval_from_shapes;
    bool ok = from_shapes ? eval_from_shapes(*def, n, results) : eval_kernel(n, results);
    if (!ok) {
      if (from_shapes) ok = eval_kernel(n, results);
      if (!ok) return false;
    }
    if (results.size() != n->outputs.size()) return false;
    for (size_t i = 0; i < results.size(); ++i)
      if (results[i].dtype() != n->outputs[i]->dtype || results[i].dims() != n->outputs[i]->shape.to_vector())
        return false;  // kernel and inference disagree: leave it to the run time
    std::vector<ir::Value*> old_outs = n->outputs;
    std::vector<std::string> names;
    for (ir::Value* o : old_outs) names.push_back(o->name);
    g.remove_node(n);  // frees the output names for the initializers
    for (size_t i = 0; i < old_outs.size(); ++i) {
      ir::Value* c = g.add_initializer(names[i], std::move(results[i]));
      c->role = ir::InitRole::constant;  // computed from constants: never trained
      c->role_source = "folded at import (fold_constants)";
      created_.insert(c);
      g.replace_all_uses(old_outs[i], c);
    }
    return true;
  }

  std::unordered_set<const ir::Value*> created_;  ///< initializers made by this run
  NodeEvaluator evaluator_;                       ///< PassContext::evaluator of this run
  Status error_;                                  ///< a node needed the missing evaluator
};

}  // namespace

std::unique_ptr<Pass> make_fold_constants_pass() { return std::make_unique<FoldConstants>(); }

}  // namespace kiln::passes
