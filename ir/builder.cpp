#include "ir/builder.h"

namespace kiln::ir {

Expected<std::vector<Value*>> Builder::emit(const std::string& op, std::vector<Value*> inputs, int num_outputs,
                                            Attributes attrs, const std::string& out_name) {
  int k = counter_++;
  std::string node_name = prefix_ + "/" + op + "_" + std::to_string(k);
  std::vector<std::string> outs;
  for (int i = 0; i < num_outputs; ++i) {
    if (!out_name.empty())
      outs.push_back(num_outputs == 1 ? out_name : out_name + "." + std::to_string(i));
    else
      outs.push_back(node_name + (num_outputs == 1 ? "" : ":" + std::to_string(i)));
  }
  Node* n = g_.add_node(op, node_name, std::move(inputs), outs, std::move(attrs));
  Status st = infer_node(*n);
  if (!st) return st;
  return n->outputs;
}

Value* Builder::op(const std::string& op, std::vector<Value*> inputs, Attributes attrs, const std::string& out_name) {
  for (Value* v : inputs)
    if (v == nullptr && !has_trait(op, OpTrait::omittable_inputs)) {
      if (status_.is_ok()) status_ = Status::error("builder: null input to " + op);
      return nullptr;
    }
  auto r = emit(op, std::move(inputs), 1, std::move(attrs), out_name);
  if (!r) {
    if (status_.is_ok()) status_ = r.status();
    return nullptr;
  }
  return (*r)[0];
}

Value* Builder::scalar(double v, DType dtype) {
  Tensor t(dtype, {});
  t.set_f64(0, v);
  return (consts_ ? *consts_ : g_).add_initializer(prefix_ + "/const", std::move(t));
}

Value* Builder::ints(const std::vector<int64_t>& v) {
  return (consts_ ? *consts_ : g_).add_initializer(prefix_ + "/ints", Tensor::from_i64(v));
}

Value* Builder::dims(const std::vector<Dim>& d) {
  std::vector<std::string> values;
  bool all_static = true;
  for (const Dim& x : d) {
    if (x.is_unknown()) {
      if (status_.is_ok()) status_ = Status::error("builder: a shape " + Shape(d).to_string() + " with unknown dims");
      return nullptr;
    }
    all_static &= x.is_static();
    values.push_back(x.to_string());
  }
  if (all_static) return ints(Shape(d).to_vector());
  return op("SymInts", {}, make_attrs({{"values", values}, {"dims", std::vector<int64_t>{int64_t(d.size())}}}));
}

Attributes make_attrs(std::initializer_list<std::pair<std::string, AttrValue>> kv) {
  Attributes a;
  for (auto& [k, v] : kv) a.set(k, v);
  return a;
}

}  // namespace kiln::ir
