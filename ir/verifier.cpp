#include "ir/verifier.h"

#include <set>
#include <unordered_set>

#include "ir/op_table.h"

namespace kiln::ir {

static bool attr_kind_matches(const AttrValue& v, AttrKind k) {
  switch (k) {
    case AttrKind::i:
      return std::holds_alternative<int64_t>(v);
    case AttrKind::f:
      return std::holds_alternative<double>(v) || std::holds_alternative<int64_t>(v);
    case AttrKind::s:
      return std::holds_alternative<std::string>(v);
    case AttrKind::ints:
      return std::holds_alternative<std::vector<int64_t>>(v);
    case AttrKind::floats:
      return std::holds_alternative<std::vector<double>>(v);
    case AttrKind::strings:
      return std::holds_alternative<std::vector<std::string>>(v);
    case AttrKind::tensor:
      return std::holds_alternative<Tensor>(v);
  }
  return false;
}

static Status verify_region(const Graph& g, std::unordered_set<const Value*> defined, std::set<std::string>& names) {
  for (Value* v : g.inputs) defined.insert(v);
  for (Value* v : g.initializers) {
    if (!v->data) return Status::error("initializer '" + v->name + "' has no data");
    defined.insert(v);
  }
  for (auto& np : g.nodes()) {
    const Node& n = *np;
    std::string where = "node '" + n.name + "' (" + n.op + ")";
    const OpDef* def = OpTable::get().find(n.op);
    if (!def) return Status::error(where + ": op not in the op table");
    if (n.num_inputs() < def->min_inputs || n.num_inputs() > def->max_inputs)
      return Status::error(where + ": " + std::to_string(n.num_inputs()) + " inputs, expected " +
                           std::to_string(def->min_inputs) + ".." + std::to_string(def->max_inputs));
    if (n.num_outputs() < def->min_outputs || n.num_outputs() > def->max_outputs)
      return Status::error(where + ": " + std::to_string(n.num_outputs()) + " outputs, expected " +
                           std::to_string(def->min_outputs) + ".." + std::to_string(def->max_outputs));
    for (auto& [k, v] : n.attrs.all()) {
      if (k.rfind("kiln_", 0) == 0) continue;  // kiln annotations (side effects, policy notes)
      const AttrSpec* spec = nullptr;
      for (auto& s : def->attrs)
        if (s.name == k) spec = &s;
      if (!spec) return Status::error(where + ": unknown attribute '" + k + "'");
      if (!attr_kind_matches(v, spec->kind)) return Status::error(where + ": attribute '" + k + "' has the wrong kind");
    }
    for (auto& s : def->attrs)
      if (s.required && !n.attrs.has(s.name)) return Status::error(where + ": missing attribute '" + s.name + "'");
    for (Value* in : n.inputs)
      if (in && !defined.count(in))
        return Status::error(where + ": input '" + in->name + "' is used before it is defined");
    for (auto& r : n.regions) KILN_RETURN_IF_ERROR(verify_region(*r, defined, names));
    for (Value* o : n.outputs) {
      if (!names.insert(o->name).second) return Status::error(where + ": value name '" + o->name + "' defined twice");
      if (o->producer != &n) return Status::error(where + ": output '" + o->name + "' has a wrong producer link");
      defined.insert(o);
    }
  }
  for (Value* o : g.outputs)
    if (!o || !defined.count(o)) return Status::error("graph '" + g.name + "': output is not defined");
  return Status::ok();
}

Status verify_graph(const Graph& g) {
  std::set<std::string> names;
  for (Value* v : g.inputs) names.insert(v->name);
  for (Value* v : g.initializers)
    if (!names.insert(v->name).second) return Status::error("value name '" + v->name + "' defined twice");
  return verify_region(g, {}, names);
}

}  // namespace kiln::ir
