// cse: common-subexpression elimination by value numbering, for the nodes code
// generation computes (pointwise ops with a scalar rule, Cast, reductions and views):
// two such nodes with the same op, attributes and input values compute the same
// result. Inputs are the same value when they are the same IR value, or initializers
// of at most kMaxConstantElements elements with equal dtype, dims and bytes (each
// decomposition writes its own copies of constants such as a count or 1.0), or
// results of nodes numbered equal.
//
// Which duplicates are removed: a node's outputs are replaced by an equal earlier
// node's only when each of those outputs holds at most kMaxKeptBytes bytes. Keeping a
// small value alive longer costs nothing; a large one (an activation) kept from the
// forward pass to the backward pass would raise the peak that remat and the memory plan
// chose, so large duplicates stay and are computed twice (fused into their readers).
// Their numbers still match, so a small result computed from them is shared: the batch
// statistics that BatchNormalizationGrad's decomposition recomputes from X (two
// reductions of the activation) become the forward pass's.
//
// Never merged: nodes with regions, ops drawing random numbers (OpTrait::random), ops
// that update state (OpTrait::running_stats) and ops code generation does not compute
// (their kernels may read more than their inputs and attributes say). Top-level graph
// only. Runs in the compiled pipeline after decompose, before fusion.
#include <cstring>
#include <map>
#include <unordered_map>

#include "ir/op_table.h"
#include "ir/printer.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// Largest initializer (elements) compared by content.
constexpr int64_t kMaxConstantElements = 64;
/// Largest output (bytes) of a duplicate that is replaced by the earlier node's.
constexpr int64_t kMaxKeptBytes = 4096;

/// Whether code generation computes `n` from its inputs and attributes alone.
bool numberable(const Node& n) {
  if (!n.regions.empty() || n.outputs.empty()) return false;
  const OpDef* def = OpTable::get().find(n.op);
  if (!def || has_trait(n, OpTrait::random) || has_trait(n, OpTrait::running_stats) || has_trait(n, OpTrait::dropout))
    return false;
  return def->scalar || def->reduce_combine || has_trait(n, OpTrait::cast) || has_trait(n, OpTrait::view);
}

/// Bytes of v when its shape is static, else -1.
int64_t bytes_of(const Value* v) {
  if (!v->shape.is_static()) return -1;
  return v->shape.numel() * static_cast<int64_t>(dtype_size(v->dtype));
}

/// An attribute value as key text (tensors by dtype, dims and bytes).
std::string attr_key(const AttrValue& v) {
  if (const Tensor* t = std::get_if<Tensor>(&v)) {
    std::string k = "T" + std::string(dtype_name(t->dtype())) + dims_to_string(t->dims()) + ":";
    k.append(static_cast<const char*>(t->raw()), static_cast<size_t>(t->nbytes()));
    return k;
  }
  return attr_to_string(v);
}

class Cse : public Pass {
 public:
  std::string name() const override { return "cse"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    std::unordered_map<const Value*, int64_t> number;
    std::map<std::string, int64_t> constants;  // content key -> number
    std::map<std::string, const Node*> first;  // node key -> first node with that key
    int64_t next = 0;
    auto number_of = [&](const Value* v) -> int64_t {
      if (!v) return -1;
      auto it = number.find(v);
      if (it != number.end()) return it->second;
      int64_t id = next++;
      if (v->is_initializer() && v->data->numel() <= kMaxConstantElements) {
        const Tensor& t = *v->data;
        std::string k = std::string(dtype_name(t.dtype())) + dims_to_string(t.dims()) + ":";
        k.append(static_cast<const char*>(t.raw()), static_cast<size_t>(t.nbytes()));
        auto [c, fresh] = constants.emplace(k, id);
        if (!fresh) id = c->second;
      }
      number[v] = id;
      return id;
    };
    std::vector<std::pair<Node*, const Node*>> replace;  // duplicate, earlier equal node
    for (auto& np : g.nodes()) {
      Node& n = *np;
      if (!numberable(n)) {
        for (const Value* o : n.outputs) number_of(o);
        continue;
      }
      std::string key = n.op + "(";
      for (const Value* in : n.inputs) key += std::to_string(number_of(in)) + ",";
      key += ")";
      for (const auto& [name, v] : n.attrs.all()) {
        if (name.rfind("kiln_", 0) == 0) continue;  // kiln's scheduling marks, not semantics
        key += name + "=" + attr_key(v) + ";";
      }
      key += std::to_string(n.outputs.size());
      auto [it, fresh] = first.emplace(key, &n);
      if (fresh) {
        for (const Value* o : n.outputs) number_of(o);
        continue;
      }
      const Node& earlier = *it->second;
      bool small = true;
      for (size_t i = 0; i < n.outputs.size(); ++i) {
        number[n.outputs[i]] = number_of(earlier.outputs[i]);
        const int64_t b = bytes_of(earlier.outputs[i]);
        small = small && b >= 0 && b <= kMaxKeptBytes && earlier.outputs[i]->dtype == n.outputs[i]->dtype &&
                earlier.outputs[i]->shape == n.outputs[i]->shape;
      }
      if (small) replace.emplace_back(&n, &earlier);
    }
    int replaced = 0;
    for (auto& [dup, earlier] : replace) {
      bool named_output = false;  // a graph output keeps its producer (its name is the output's)
      for (const Value* o : dup->outputs) named_output = named_output || g.is_graph_output(o);
      if (named_output) continue;
      for (size_t i = 0; i < dup->outputs.size(); ++i) g.replace_all_uses(dup->outputs[i], earlier->outputs[i]);
      ++replaced;
    }
    if (replaced == 0) return false;
    g.dead_code_elimination();
    g.remove_unused_initializers();
    return true;
  }
};

}  // namespace

std::unique_ptr<Pass> make_cse_pass() { return std::make_unique<Cse>(); }

}  // namespace kiln::passes
