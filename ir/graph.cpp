#include "ir/graph.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "ir/op_table.h"

namespace kiln::ir {

const char* init_role_name(InitRole r) {
  switch (r) {
    case InitRole::parameter:
      return "parameter";
    case InitRole::buffer:
      return "buffer";
    case InitRole::constant:
      return "constant";
    default:
      return "unknown";
  }
}

bool is_parameter_candidate(const Value& v) {
  if (!v.is_initializer() || !is_float(v.dtype) || v.name.empty()) return false;
  if (v.role != InitRole::unknown) return v.role == InitRole::parameter;
  if (v.name[0] == '/') return false;
  if (v.shape.numel() > 1) return true;
  // One element: a module's parameter by its state_dict key (the bias of Linear(h, 1)),
  // not a scalar constant of the graph.
  auto ends_with = [&](const std::string& suffix) {
    return v.name.size() > suffix.size() && v.name.compare(v.name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return v.shape.numel() == 1 && (ends_with(".weight") || ends_with(".bias"));
}

std::unordered_set<const Value*> batchnorm_statistics(const Graph& g) {
  std::unordered_set<const Value*> s;
  for (auto& n : g.nodes())
    if (has_trait(*n, OpTrait::running_stats))
      for (int i = 3; i <= 4; ++i)
        if (n->input(i) && n->input(i)->is_initializer()) s.insert(n->input(i));
  return s;
}

std::vector<const Value*> trainable_initializers(const Graph& g) {
  const auto stats = batchnorm_statistics(g);
  std::vector<const Value*> out;
  for (const Value* v : g.initializers)
    if (is_parameter_candidate(*v) && !stats.count(v)) out.push_back(v);
  return out;
}

Shape Shape::of(const std::vector<int64_t>& v) {
  Shape s;
  for (auto d : v) s.dims.emplace_back(d);
  return s;
}

Dim::Dim(const SymExpr& e) {
  if (!e.valid()) return;
  if (e.is_constant()) {
    if (e.constant_value() >= 0) value = e.constant_value();
    return;
  }
  expr = e;
}

std::optional<SymExpr> Dim::as_expr() const {
  if (is_static()) return SymExpr::constant(value);
  if (is_symbolic()) return expr;
  return std::nullopt;
}

std::string Dim::to_string() const {
  if (is_static()) return std::to_string(value);
  if (is_symbolic()) return expr.to_string();
  return "?";
}

Dim Dim::from_text(const std::string& text) {
  if (text == "?") return Dim();
  if (auto e = SymExpr::parse(text)) return Dim(*e);  // constants: static (unknown when negative)
  return Dim(text);
}

namespace {
template <typename F>
Dim combine(const Dim& a, const Dim& b, F f) {
  auto ea = a.as_expr(), eb = b.as_expr();
  if (!ea || !eb) return Dim();
  return f(*ea, *eb);
}
}  // namespace

Dim operator*(const Dim& a, const Dim& b) {
  if (a.is_static() && b.is_static()) {
    int64_t p;
    return __builtin_mul_overflow(a.value, b.value, &p) ? Dim() : Dim(p);
  }
  return combine(a, b, [](const SymExpr& x, const SymExpr& y) { return Dim(x * y); });
}
Dim operator+(const Dim& a, const Dim& b) {
  return combine(a, b, [](const SymExpr& x, const SymExpr& y) { return Dim(x + y); });
}
Dim operator-(const Dim& a, const Dim& b) {
  return combine(a, b, [](const SymExpr& x, const SymExpr& y) { return Dim(x - y); });
}
Dim dim_exact_div(const Dim& a, const Dim& b) {
  return combine(a, b, [](const SymExpr& x, const SymExpr& y) {
    if (y.is_constant() && y.constant_value() == 0) return Dim();
    auto q = x.exact_div(y);
    return q ? Dim(*q) : Dim();
  });
}

bool Shape::is_static() const {
  for (auto& d : dims)
    if (!d.is_static()) return false;
  return true;
}

bool Shape::is_known() const {
  for (auto& d : dims)
    if (d.is_unknown()) return false;
  return true;
}

Shape Shape::bound(const std::map<std::string, int64_t>& values) const {
  Shape s = *this;
  for (Dim& d : s.dims)
    if (d.is_symbolic()) d = Dim(d.expr.substitute(values));
  return s;
}

std::vector<int64_t> Shape::to_vector() const {
  std::vector<int64_t> v;
  for (auto& d : dims) v.push_back(d.is_static() ? d.value : -1);
  return v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  bool overflow = false;
  for (auto& d : dims) {
    if (!d.is_static()) return -1;
    if (d.value == 0) return 0;
    if (!overflow && __builtin_mul_overflow(n, d.value, &n)) overflow = true;
  }
  return overflow ? std::numeric_limits<int64_t>::max() : n;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += dims[i].to_string();
  }
  return s + "]";
}

int64_t Attributes::get_int(const std::string& k, int64_t def) const {
  auto it = map_.find(k);
  if (it == map_.end()) return def;
  if (auto p = std::get_if<int64_t>(&it->second)) return *p;
  if (auto p = std::get_if<double>(&it->second)) return static_cast<int64_t>(*p);
  return def;
}
double Attributes::get_float(const std::string& k, double def) const {
  auto it = map_.find(k);
  if (it == map_.end()) return def;
  if (auto p = std::get_if<double>(&it->second)) return *p;
  if (auto p = std::get_if<int64_t>(&it->second)) return static_cast<double>(*p);
  return def;
}
std::string Attributes::get_string(const std::string& k, const std::string& def) const {
  auto it = map_.find(k);
  if (it == map_.end()) return def;
  if (auto p = std::get_if<std::string>(&it->second)) return *p;
  return def;
}
std::vector<int64_t> Attributes::get_ints(const std::string& k, const std::vector<int64_t>& def) const {
  auto it = map_.find(k);
  if (it == map_.end()) return def;
  if (auto p = std::get_if<std::vector<int64_t>>(&it->second)) return *p;
  if (auto p = std::get_if<int64_t>(&it->second)) return {*p};
  return def;
}
std::vector<double> Attributes::get_floats(const std::string& k, const std::vector<double>& def) const {
  auto it = map_.find(k);
  if (it == map_.end()) return def;
  if (auto p = std::get_if<std::vector<double>>(&it->second)) return *p;
  return def;
}
std::vector<std::string> Attributes::get_strings(const std::string& k) const {
  auto it = map_.find(k);
  if (it == map_.end()) return {};
  if (auto p = std::get_if<std::vector<std::string>>(&it->second)) return *p;
  return {};
}
const Tensor* Attributes::get_tensor(const std::string& k) const {
  auto it = map_.find(k);
  if (it == map_.end()) return nullptr;
  return std::get_if<Tensor>(&it->second);
}
const AttrValue* Attributes::find(const std::string& k) const {
  auto it = map_.find(k);
  return it == map_.end() ? nullptr : &it->second;
}

std::string Graph::unique_name(const std::string& base) {
  std::string b = base.empty() ? "v" : base;
  if (!by_name_.count(b)) return b;
  for (int i = 1;; ++i) {
    std::string c = b + "." + std::to_string(i);
    if (!by_name_.count(c)) return c;
  }
}

Value* Graph::new_value(const std::string& name, DType dtype, Shape shape) {
  auto v = std::make_unique<Value>();
  v->name = unique_name(name);
  v->dtype = dtype;
  v->shape = std::move(shape);
  Value* p = v.get();
  by_name_[p->name] = p;
  values_.push_back(std::move(v));
  return p;
}

const std::string& Graph::rename_value(Value* v, const std::string& base) {
  auto it = by_name_.find(v->name);
  if (it != by_name_.end() && it->second == v) by_name_.erase(it);
  v->name = unique_name(base);
  by_name_[v->name] = v;
  return v->name;
}

Value* Graph::add_input(const std::string& name, DType dtype, Shape shape) {
  Value* v = new_value(name, dtype, std::move(shape));
  inputs.push_back(v);
  return v;
}

Value* Graph::add_initializer(const std::string& name, Tensor t) {
  Value* v = new_value(name, t.dtype(), Shape::of(t.dims()));
  v->data = std::make_shared<Tensor>(std::move(t));
  initializers.push_back(v);
  return v;
}

Node* Graph::insert_node(size_t pos, const std::string& op, const std::string& name, std::vector<Value*> ins,
                         const std::vector<std::string>& output_names, Attributes attrs) {
  auto n = std::make_unique<Node>();
  n->op = op;
  n->name = name;
  n->inputs = std::move(ins);
  n->attrs = std::move(attrs);
  n->owner = this;
  for (size_t i = 0; i < output_names.size(); ++i) {
    Value* v = new_value(output_names[i]);
    v->producer = n.get();
    v->producer_output = static_cast<int>(i);
    n->outputs.push_back(v);
  }
  Node* p = n.get();
  pos = std::min(pos, nodes_.size());
  nodes_.insert(nodes_.begin() + static_cast<long>(pos), std::move(n));
  touch();
  return p;
}

uint64_t Graph::next_structure_id() {
  static std::atomic<uint64_t> counter{0};
  return ++counter;
}

Node* Graph::add_node(const std::string& op, const std::string& name, std::vector<Value*> ins,
                      const std::vector<std::string>& output_names, Attributes attrs) {
  return insert_node(nodes_.size(), op, name, std::move(ins), output_names, std::move(attrs));
}

int Graph::index_of(const Node* n) const {
  for (size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i].get() == n) return static_cast<int>(i);
  return -1;
}

void Graph::remove_node(Node* n) {
  int i = index_of(n);
  if (i < 0) return;
  for (Value* o : n->outputs) {
    o->producer = nullptr;
    by_name_.erase(o->name);
  }
  nodes_.erase(nodes_.begin() + i);
  touch();
}

void Graph::replace_all_uses(Value* from, Value* to) {
  for (auto& n : nodes_) {
    for (auto& in : n->inputs)
      if (in == from) in = to;
    for (auto& r : n->regions) r->replace_all_uses(from, to);
  }
  for (auto& o : outputs)
    if (o == from) o = to;
  // A state binding's output is a graph output (runtime/trainer.cpp checks it): it follows.
  for (auto& sb : state)
    if (sb.output == from) sb.output = to;
}

std::vector<Use> Graph::uses(const Value* v) const {
  std::vector<Use> u;
  for (auto& n : nodes_)
    for (int i = 0; i < n->num_inputs(); ++i)
      if (n->inputs[i] == v) u.push_back({n.get(), i});
  return u;
}

bool Graph::is_graph_output(const Value* v) const {
  return std::find(outputs.begin(), outputs.end(), v) != outputs.end();
}

Value* Graph::find_value(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

static void collect_region_inputs(const Graph& g, std::unordered_set<const Value*>& used) {
  for (auto& n : g.nodes()) {
    for (auto* in : n->inputs)
      if (in) used.insert(in);
    for (auto& r : n->regions) collect_region_inputs(*r, used);
  }
  for (auto* o : g.outputs) used.insert(o);
}

void Graph::remove_unused_initializers() {
  std::unordered_set<const Value*> used;
  collect_region_inputs(*this, used);
  for (const StateBinding& sb : state) used.insert(sb.input);  // state is read by the next step
  std::vector<Value*> keep;
  for (Value* v : initializers) {
    if (used.count(v))
      keep.push_back(v);
    else
      by_name_.erase(v->name);
  }
  initializers = keep;
}

int Graph::dead_code_elimination() {
  std::unordered_set<const Value*> live(outputs.begin(), outputs.end());
  std::vector<bool> keep(nodes_.size(), false);
  for (int i = static_cast<int>(nodes_.size()) - 1; i >= 0; --i) {
    Node* n = nodes_[i].get();
    bool needed = false;
    for (Value* o : n->outputs)
      if (live.count(o)) needed = true;
    // Nodes with side effects on state (marked by attribute) are kept.
    if (n->attrs.get_int("kiln_side_effect", 0)) needed = true;
    if (!needed) continue;
    keep[i] = true;
    for (Value* in : n->inputs)
      if (in) live.insert(in);
    std::unordered_set<const Value*> sub;
    for (auto& r : n->regions) collect_region_inputs(*r, sub);
    live.insert(sub.begin(), sub.end());
  }
  int removed = 0;
  std::vector<std::unique_ptr<Node>> kept;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (keep[i]) {
      kept.push_back(std::move(nodes_[i]));
    } else {
      for (Value* o : nodes_[i]->outputs) by_name_.erase(o->name), o->producer = nullptr;
      ++removed;
    }
  }
  nodes_ = std::move(kept);
  touch();
  return removed;
}

std::unique_ptr<Graph> Graph::clone() const {
  auto g = std::make_unique<Graph>();
  g->name = name;
  g->opset = opset;
  g->import_notes = import_notes;
  g->initializer_origins = initializer_origins;
  g->input_defaults = input_defaults;
  g->arena_bytes = arena_bytes;
  g->planned_peak_bytes = planned_peak_bytes;
  std::unordered_map<const Value*, Value*> map;
  auto mapv = [&](Value* v) -> Value* { return v ? map.at(v) : nullptr; };
  for (Value* v : inputs) {
    map[v] = g->add_input(v->name, v->dtype, v->shape);
    map[v]->arena = v->arena;
    map[v]->role = v->role;
    map[v]->role_source = v->role_source;
  }
  // An initializer of `src` (this graph's, or a fused body's constant) copied into `dst`.
  auto copy_initializer = [&](Value* v, Graph& dst) {
    Value* nv = dst.new_value(v->name, v->dtype, v->shape);
    nv->data = v->data;
    nv->role = v->role;
    nv->role_source = v->role_source;
    dst.initializers.push_back(nv);
    map[v] = nv;
  };
  for (Value* v : initializers) copy_initializer(v, *g);
  std::function<void(const Graph&, Graph&)> copy_nodes = [&](const Graph& src, Graph& dst) {
    for (auto& n : src.nodes()) {
      std::vector<Value*> ins;
      for (Value* in : n->inputs) ins.push_back(in ? map.count(in) ? map.at(in) : in : nullptr);
      std::vector<std::string> outs;
      for (Value* o : n->outputs) outs.push_back(o->name);
      Node* nn = dst.add_node(n->op, n->name, ins, outs, n->attrs);
      for (size_t i = 0; i < n->outputs.size(); ++i) {
        nn->outputs[i]->dtype = n->outputs[i]->dtype;
        nn->outputs[i]->shape = n->outputs[i]->shape;
        nn->outputs[i]->arena = n->outputs[i]->arena;
        nn->outputs[i]->sym_data = n->outputs[i]->sym_data;
        map[n->outputs[i]] = nn->outputs[i];
      }
      for (auto& r : n->regions) {
        auto nr = std::make_unique<Graph>();
        nr->name = r->name;
        for (Value* v : r->inputs) {
          map[v] = nr->add_input(v->name, v->dtype, v->shape);
          map[v]->arena = v->arena;
        }
        for (Value* v : r->initializers) copy_initializer(v, *nr);  // a fused body's constants
        copy_nodes(*r, *nr);
        for (Value* o : r->outputs) nr->outputs.push_back(mapv(o));
        nn->regions.push_back(std::move(nr));
      }
    }
  };
  copy_nodes(*this, *g);
  for (Value* o : outputs) g->outputs.push_back(mapv(o));
  for (const StateBinding& sb : state)
    g->state.push_back({sb.kind, mapv(sb.input), mapv(sb.output), sb.initial, sb.full_dims});
  return g;
}

Status Graph::topo_sort() {
  touch();
  std::unordered_map<const Value*, Node*> prod;
  for (auto& n : nodes_)
    for (Value* o : n->outputs) prod[o] = n.get();
  std::unordered_map<const Node*, int> state;  // 0 new, 1 visiting, 2 done
  std::vector<std::unique_ptr<Node>> order;
  std::unordered_map<const Node*, size_t> pos;
  for (size_t i = 0; i < nodes_.size(); ++i) pos[nodes_[i].get()] = i;
  std::vector<std::unique_ptr<Node>> old = std::move(nodes_);
  nodes_.clear();
  std::function<bool(Node*)> visit = [&](Node* n) -> bool {
    int& s = state[n];
    if (s == 2) return true;
    if (s == 1) return false;
    s = 1;
    for (Value* in : n->inputs) {
      if (!in) continue;
      auto it = prod.find(in);
      if (it != prod.end() && !visit(it->second)) return false;
    }
    // Values a nested region reads from this graph are inputs of its node too.
    std::unordered_set<const Value*> captured;
    for (auto& r : n->regions) collect_region_inputs(*r, captured);
    for (const Value* in : captured) {
      auto it = prod.find(in);
      if (it != prod.end() && it->second != n && !visit(it->second)) return false;
    }
    s = 2;
    nodes_.push_back(std::move(old[pos[n]]));
    return true;
  };
  for (size_t i = 0; i < old.size(); ++i) {
    if (!old[i]) continue;
    Node* n = old[i].get();
    if (!visit(n)) {
      for (auto& o : old)
        if (o) nodes_.push_back(std::move(o));
      return Status::error("graph has a cycle through node '" + n->name + "' (" + n->op + ")");
    }
  }
  return Status::ok();
}

std::unordered_set<const Value*> streamable_scan_inputs(const Graph& g) {
  std::unordered_set<const Value*> scan;
  for (auto& n : g.nodes())
    if (has_trait(*n, OpTrait::loop))
      for (size_t i = static_cast<size_t>(n->attrs.get_int("num_carried", 0)); i < n->inputs.size(); ++i)
        scan.insert(n->inputs[i]);
  for (auto& n : g.nodes())
    if (!has_trait(*n, OpTrait::loop))
      for (Value* in : n->inputs) scan.erase(in);
  for (Value* o : g.outputs) scan.erase(o);
  std::unordered_set<const Value*> out;
  for (Value* in : g.inputs)
    if (scan.count(in)) out.insert(in);
  return out;
}

void collect_captures(const Graph& r, std::unordered_set<const Value*>& out) {
  std::unordered_set<const Value*> defined(r.inputs.begin(), r.inputs.end());
  defined.insert(r.initializers.begin(), r.initializers.end());
  for (auto& n : r.nodes()) {
    for (Value* v : n->inputs)
      if (v && !defined.count(v)) out.insert(v);
    for (auto& sub : n->regions) {
      std::unordered_set<const Value*> inner;
      collect_captures(*sub, inner);
      for (const Value* v : inner)
        if (!defined.count(v)) out.insert(v);
    }
    for (Value* o : n->outputs) defined.insert(o);
  }
  for (Value* o : r.outputs)
    if (o && !defined.count(o)) out.insert(o);
}

std::unordered_map<const Value*, size_t> last_reads(const Graph& g) {
  std::unordered_map<const Value*, size_t> last;
  const auto& nodes = g.nodes();
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const Value* v : nodes[i]->inputs)
      if (v) last[v] = i;
    for (auto& r : nodes[i]->regions) {
      std::unordered_set<const Value*> caps;
      collect_captures(*r, caps);
      for (const Value* v : caps) last[v] = i;
    }
  }
  return last;
}

size_t grad_scope_pos(const std::string& name) {
  size_t p = 0;
  while ((p = name.find("/grad", p)) != std::string::npos) {
    size_t e = p + 5;
    if (e == name.size() || name[e] == '/') return p;
    p = e;
  }
  return std::string::npos;
}

}  // namespace kiln::ir
