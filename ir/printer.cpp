#include "ir/printer.h"

#include <iomanip>
#include <sstream>

namespace kiln::ir {

static std::string fmt_double(double d) {
  std::ostringstream os;
  os << std::setprecision(9) << d;
  std::string s = os.str();
  if (s.find_first_of(".eninf") == std::string::npos) s += ".0";
  return s;
}

std::string attr_to_string(const AttrValue& v) {
  std::ostringstream os;
  if (auto p = std::get_if<int64_t>(&v))
    os << *p;
  else if (auto p = std::get_if<double>(&v))
    os << fmt_double(*p);
  else if (auto p = std::get_if<std::string>(&v))
    os << '"' << *p << '"';
  else if (auto p = std::get_if<std::vector<int64_t>>(&v)) {
    os << "[";
    for (size_t i = 0; i < p->size(); ++i) os << (i ? ", " : "") << (*p)[i];
    os << "]";
  } else if (auto p = std::get_if<std::vector<double>>(&v)) {
    os << "[";
    for (size_t i = 0; i < p->size(); ++i) os << (i ? ", " : "") << fmt_double((*p)[i]);
    os << "]";
  } else if (auto p = std::get_if<std::vector<std::string>>(&v)) {
    os << "[";
    for (size_t i = 0; i < p->size(); ++i) os << (i ? ", " : "") << '"' << (*p)[i] << '"';
    os << "]";
  } else if (auto p = std::get_if<Tensor>(&v)) {
    os << "tensor<" << dtype_name(p->dtype()) << dims_to_string(p->dims()) << ">";
    if (p->numel() <= 8) {
      os << "{";
      for (int64_t i = 0; i < p->numel(); ++i) os << (i ? ", " : "") << p->get_f64(i);
      os << "}";
    }
  }
  return os.str();
}

static std::string type_str(const Value* v) {
  std::string t = std::string(dtype_name(v->dtype)) + v->shape.to_string();
  if (v->arena.placed())
    t += " @arena(" + std::to_string(v->arena.offset) + ", " + std::to_string(v->arena.bytes) +
         (v->arena.home ? ", home)" : ")");
  return t;
}

void print_graph(const Graph& g, std::ostream& os, int indent) {
  std::string pad(indent, ' ');
  os << pad << "graph " << g.name << "(";
  for (size_t i = 0; i < g.inputs.size(); ++i)
    os << (i ? ", " : "") << "%" << g.inputs[i]->name << ": " << type_str(g.inputs[i]);
  os << ") {\n";
  if (g.arena_bytes >= 0)
    os << pad << "  memory arena_bytes=" << g.arena_bytes << " planned_peak_bytes=" << g.planned_peak_bytes << "\n";
  for (const Value* v : g.initializers) {
    os << pad << "  init %" << v->name << ": " << type_str(v);
    if (v->data && v->data->numel() <= 4 && v->data->numel() > 0) {
      os << " = {";
      for (int64_t i = 0; i < v->data->numel(); ++i) os << (i ? ", " : "") << v->data->get_f64(i);
      os << "}";
    }
    os << "\n";
  }
  for (auto& n : g.nodes()) {
    os << pad << "  ";
    for (size_t i = 0; i < n->outputs.size(); ++i) os << (i ? ", " : "") << "%" << n->outputs[i]->name;
    os << " = " << n->op << "(";
    for (size_t i = 0; i < n->inputs.size(); ++i)
      os << (i ? ", " : "") << (n->inputs[i] ? "%" + n->inputs[i]->name : std::string("_"));
    os << ")";
    if (!n->attrs.all().empty()) {
      os << " {";
      bool first = true;
      for (auto& [k, v] : n->attrs.all()) {
        os << (first ? "" : ", ") << k << "=" << attr_to_string(v);
        first = false;
      }
      os << "}";
    }
    os << " : ";
    for (size_t i = 0; i < n->outputs.size(); ++i) os << (i ? ", " : "") << type_str(n->outputs[i]);
    if (!n->name.empty()) os << "  # " << n->name;
    os << "\n";
    for (auto& r : n->regions) print_graph(*r, os, indent + 4);
  }
  for (const StateBinding& sb : g.state)
    os << pad << "  state " << sb.kind << " %" << sb.input->name << " <- %" << (sb.output ? sb.output->name : "?")
       << (sb.full_dims.empty() ? std::string() : " shard_of " + Shape::of(sb.full_dims).to_string()) << "\n";
  os << pad << "  return ";
  for (size_t i = 0; i < g.outputs.size(); ++i) os << (i ? ", " : "") << "%" << g.outputs[i]->name;
  os << "\n" << pad << "}\n";
}

std::string graph_to_string(const Graph& g) {
  std::ostringstream os;
  print_graph(g, os);
  return os.str();
}

}  // namespace kiln::ir
