#include "ir/op_table.h"

#include <cstdlib>
#include <iostream>

namespace kiln::ir {

const char* fusion_class_name(FusionClass f) {
  switch (f) {
    case FusionClass::pointwise:
      return "pointwise";
    case FusionClass::reduction:
      return "reduction";
    case FusionClass::library:
      return "library";
    case FusionClass::view:
      return "view";
    case FusionClass::collective:
      return "collective";
    default:
      return "opaque";
  }
}

const char* precision_policy_name(PrecisionPolicy p) {
  switch (p) {
    case PrecisionPolicy::low_precision:
      return "low_precision";
    case PrecisionPolicy::follow_inputs:
      return "follow_inputs";
    case PrecisionPolicy::fp32:
      return "fp32";
    default:
      return "not_float";
  }
}

const char* scalar_op_name(ScalarOp op) {
  static const char* names[] = {"add",  "sub", "mul",  "div", "pow",    "max",   "min", "neg",  "abs",   "exp", "log",
                                "sqrt", "erf", "tanh", "sin", "cos",    "floor", "lt",  "le",   "gt",    "ge",  "eq",
                                "and",  "or",  "xor",  "not", "select", "cast",  "fma", "ceil", "round", "fmod"};
  return names[static_cast<int>(op)];
}

Status InferContext::fail(const std::string& msg) const {
  return Status::error("node '" + node.name + "' (" + node.op + "): " + msg);
}

Status KernelContext::fail(const std::string& msg) const {
  return Status::error("node '" + node.name + "' (" + node.op + "): " + msg);
}

OpTable& OpTable::get() {
  static OpTable* table = [] {
    auto* t = new OpTable();
    register_elementwise_ops(*t);
    register_shape_ops(*t);
    register_nn_ops(*t);
    register_reduction_ops(*t);
    register_loss_ops(*t);
    register_training_ops(*t);
    register_optim8bit_ops(*t);
    register_control_ops(*t);
    register_collective_ops(*t);
    register_indexing_ops(*t);
    register_scalar_rules(*t);
    register_op_traits(*t);
    register_decompositions(*t);
    register_sym_values(*t);
    return t;
  }();
  return *table;
}

const OpDef* OpTable::find(const std::string& name) const {
  auto it = ops_.find(name);
  return it == ops_.end() ? nullptr : &it->second;
}

OpDef* OpTable::find_mutable(const std::string& name) {
  auto it = ops_.find(name);
  return it == ops_.end() ? nullptr : &it->second;
}

OpDef& OpTable::add(OpDef def) {
  if (ops_.count(def.name)) {
    std::cerr << "kiln: op '" << def.name << "' registered twice\n";
    std::abort();
  }
  std::string n = def.name;
  return ops_[n] = std::move(def);
}

OpDef make_op(const std::string& name, const std::string& doc, int min_in, int max_in, InferFn infer,
              PrecisionPolicy prec, FusionClass fusion) {
  OpDef d;
  d.name = name;
  d.doc = doc;
  d.min_inputs = min_in;
  d.max_inputs = max_in;
  d.infer = std::move(infer);
  d.precision = prec;
  d.fusion = fusion;
  return d;
}

void set_onnx_since(OpTable& t, const char* name, std::vector<int> versions) {
  OpDef* d = t.find_mutable(name);
  if (!d) {
    std::cerr << "kiln: set_onnx_since: no op '" << name << "'\n";
    std::abort();
  }
  d->onnx_since = std::move(versions);
}

void add_differentiable(OpTable& t, OpDef d, GradFn g) {
  d.diff = Differentiability::differentiable;
  d.grad = std::move(g);
  t.add(std::move(d));
}

Value* shape_of(GradContext& g, Value* v) {
  for (const Dim& d : v->shape.dims)
    if (d.is_unknown()) return g.emit1("Shape", {v});
  return g.dims(v->shape.dims);
}

Value* zeros_like(GradContext& g, Value* v) {
  Attributes a;
  a.set("value", Tensor(v->dtype, {1}));
  return g.emit1("ConstantOfShape", {shape_of(g, v)}, a);
}

Status infer_node(Node& n) {
  const OpDef* def = OpTable::get().find(n.op);
  if (!def) return Status::error("node '" + n.name + "': unknown op '" + n.op + "'");
  if (!def->infer) return Status::error("op '" + n.op + "' has no type inference");
  // The arity first: inference functions index the inputs the op requires.
  if (n.num_inputs() < def->min_inputs || n.num_inputs() > def->max_inputs)
    return Status::error("node '" + n.name + "' (" + n.op + "): has " + std::to_string(n.num_inputs()) +
                         " inputs, the op takes " +
                         (def->max_inputs >= (1 << 20) ? "at least " + std::to_string(def->min_inputs)
                          : def->max_inputs == def->min_inputs
                              ? std::to_string(def->min_inputs)
                              : std::to_string(def->min_inputs) + " to " + std::to_string(def->max_inputs)));
  if (n.num_outputs() > def->max_outputs || n.num_outputs() < def->min_outputs)
    return Status::error("node '" + n.name + "' (" + n.op + "): has " + std::to_string(n.num_outputs()) +
                         " outputs, the op has " + std::to_string(def->min_outputs) +
                         (def->max_outputs == def->min_outputs ? "" : " to " + std::to_string(def->max_outputs)));
  for (int i = 0; i < def->min_inputs; ++i)
    if (!n.input(i))
      return Status::error("node '" + n.name + "' (" + n.op + "): required input " + std::to_string(i) + " is missing");
  InferContext ctx{n, {}, {}, {}, {}};
  bool symbolic = false;  // some input has a symbolic shape or symbolic contents
  for (Value* v : n.inputs) {
    TypeInfo ti;
    if (v) {
      ti.dtype = v->dtype;
      ti.shape = v->shape;
      for (const Dim& d : v->shape.dims) symbolic |= d.is_symbolic();
      symbolic |= v->sym_data != nullptr;
    }
    ctx.in.push_back(ti);
    ctx.values.push_back(v && v->data ? v->data.get() : nullptr);
    ctx.syms.push_back(v && v->sym_data ? v->sym_data.get() : nullptr);
  }
  ctx.out.resize(n.outputs.size());
  KILN_RETURN_IF_ERROR(def->infer(ctx));
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    if (i < ctx.out.size() && ctx.out[i].present()) {
      n.outputs[i]->dtype = ctx.out[i].dtype;
      n.outputs[i]->shape = ctx.out[i].shape;
    }
    n.outputs[i]->sym_data = nullptr;
  }
  if ((symbolic || n.num_inputs() == 0) && def->sym_values) {
    std::vector<std::optional<SymValues>> sv = def->sym_values(ctx);
    for (size_t i = 0; i < sv.size() && i < n.outputs.size(); ++i) {
      if (!sv[i] || !is_integer(n.outputs[i]->dtype)) continue;
      // Constant contents are kept too: a SymInts node whose symbols were bound
      // (ir::bind_symbols) gives its readers static dims, as an initializer would.
      bool valid = true;
      for (const SymExpr& e : *sv[i]) valid &= e.valid();
      if (valid) n.outputs[i]->sym_data = std::make_shared<const SymValues>(std::move(*sv[i]));
    }
  }
  return Status::ok();
}

std::optional<SymValues> InferContext::int_values(int i) const {
  if (!has_input(i) || !is_integer(in[i].dtype)) return std::nullopt;
  if (i < static_cast<int>(syms.size()) && syms[i]) return *syms[i];
  const Tensor* t = value(i);
  if (!t || t->numel() > kMaxSymValues) return std::nullopt;
  SymValues v;
  for (int64_t x : t->to_i64_vector()) v.push_back(SymExpr::constant(x));
  return v;
}

std::optional<Shape> InferContext::shape_input(int i) const {
  auto v = int_values(i);
  if (!v) return std::nullopt;
  Shape s;
  for (const SymExpr& e : *v) s.dims.push_back(Dim(e));
  return s;
}

Status infer_graph(Graph& g) {
  for (auto& n : g.nodes()) KILN_RETURN_IF_ERROR(infer_node(*n));
  return Status::ok();
}

Cost node_cost_at(const Node& n, const std::map<std::string, int64_t>& values) {
  if (values.empty() || n.shapes_static()) return node_cost(n);
  Graph g;
  std::vector<Value*> ins;
  for (size_t i = 0; i < n.inputs.size(); ++i) {
    const Value* v = n.inputs[i];
    ins.push_back(v ? g.add_input("in" + std::to_string(i), v->dtype, v->shape.bound(values)) : nullptr);
    if (v && v->data) ins.back()->data = v->data;  // costs may read constant operands
  }
  std::vector<std::string> outs;
  for (size_t i = 0; i < n.outputs.size(); ++i) outs.push_back("out" + std::to_string(i));
  Node* m = g.add_node(n.op, n.name, ins, outs, n.attrs);
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    m->outputs[i]->dtype = n.outputs[i]->dtype;
    m->outputs[i]->shape = n.outputs[i]->shape.bound(values);
  }
  return node_cost(*m);
}

Cost node_cost(const Node& n) {
  const OpDef* def = OpTable::get().find(n.op);
  if (def && def->cost) return def->cost(n);
  Cost c;
  for (Value* v : n.inputs)
    if (v && v->shape.numel() > 0) c.bytes += static_cast<double>(v->shape.numel() * dtype_size(v->dtype));
  for (Value* v : n.outputs)
    if (v->shape.numel() > 0) {
      c.bytes += static_cast<double>(v->shape.numel() * dtype_size(v->dtype));
      c.flops += static_cast<double>(v->shape.numel());
    }
  return c;
}

Expected<Shape> broadcast_shapes(const Shape& a, const Shape& b) {
  int r = std::max(a.rank(), b.rank());
  Shape out;
  out.dims.resize(r);
  for (int i = 0; i < r; ++i) {
    int ia = i - (r - a.rank()), ib = i - (r - b.rank());
    Dim da = ia >= 0 ? a.dims[ia] : Dim(1);
    Dim db = ib >= 0 ? b.dims[ib] : Dim(1);
    if (da == db)
      out.dims[i] = da;
    else if (da.is_static() && da.value == 1)
      out.dims[i] = db;
    else if (db.is_static() && db.value == 1)
      out.dims[i] = da;
    else if (!da.is_static() && db.is_static())
      out.dims[i] = db;
    else if (!db.is_static() && da.is_static())
      out.dims[i] = da;
    else if (da.is_unknown())
      out.dims[i] = db;
    else if (db.is_unknown())
      out.dims[i] = da;
    else if (da.is_symbolic() && db.is_symbolic())
      // Two different expressions are not assumed equal (nor is either assumed to be 1).
      return Status::error("shapes " + a.to_string() + " and " + b.to_string() + " do not broadcast: dim " +
                           da.to_string() + " against " + db.to_string() +
                           " (symbolic dims broadcast only when they are the same expression or one is 1)");
    else
      return Status::error("shapes " + a.to_string() + " and " + b.to_string() + " do not broadcast");
  }
  return out;
}

Expected<int> normalize_axis(int64_t axis, int rank) {
  // A scalar (rank 0) has no axis: accepting axis 0 there let inference index the dims of
  // an empty shape (a fuzzed Split of a scalar).
  if (axis < -rank || axis >= rank)
    return Status::error("axis " + std::to_string(axis) + " out of range for rank " + std::to_string(rank));
  return static_cast<int>(axis < 0 ? axis + rank : axis);
}

bool has_trait(const std::string& op, OpTrait t) {
  const OpDef* def = OpTable::get().find(op);
  return def && (def->traits & static_cast<OpTraits>(t)) != 0;
}

bool has_trait(const Node& n, OpTrait t) { return has_trait(n.op, t); }

void add_traits(OpTable& t, const char* name, OpTraits traits) {
  OpDef* d = t.find_mutable(name);
  if (!d) {
    std::cerr << "kiln: add_traits: no op '" << name << "'\n";
    std::abort();
  }
  d->traits |= traits;
}

bool is_view_op(const std::string& op) { return has_trait(op, OpTrait::view); }

bool is_strided_view_op(const std::string& op) { return has_trait(op, OpTrait::strided_view) || is_view_op(op); }

bool is_guarded_view_op(const std::string& op) { return has_trait(op, OpTrait::guarded_view); }

}  // namespace kiln::ir
