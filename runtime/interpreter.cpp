#include "runtime/interpreter.h"

#include <unordered_map>

#include "ir/op_table.h"

namespace kiln::runtime {

using namespace kiln::ir;

Status check_feed(const Value& input, const Tensor& t) {
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

Expected<std::vector<Tensor>> run_node(const Node& n, const std::vector<const Tensor*>& inputs, const RunOptions& opts,
                                       uint64_t op_id) {
  const OpDef* def = OpTable::get().find(n.op);
  if (!def) return Status::error("node '" + n.name + "': unknown op '" + n.op + "'");
  if (!def->kernel) return Status::error("node '" + n.name + "': op '" + n.op + "' has no eager kernel");
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
  KILN_RETURN_IF_ERROR(def->infer(ictx));
  KernelContext kctx{n, inputs, {}, opts.training, opts.seed, opts.step, op_id};
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    const TypeInfo& ti = ictx.out[i];
    if (!ti.present()) {
      kctx.outputs.emplace_back();
      continue;
    }
    if (!ti.shape.is_static())
      return Status::error("node '" + n.name + "' (" + n.op + "): output shape " + ti.shape.to_string() +
                           " is not static in eager mode");
    kctx.outputs.emplace_back(ti.dtype, ti.shape.to_vector());
  }
  KILN_RETURN_IF_ERROR(def->kernel(kctx));
  return std::move(kctx.outputs);
}

Expected<std::map<std::string, Tensor>> run_graph(const Graph& g, const std::map<std::string, Tensor>& feeds,
                                                 const RunOptions& opts) {
  register_eager_kernels();
  std::unordered_map<const Value*, Tensor> env;
  for (Value* in : g.inputs) {
    auto it = feeds.find(in->name);
    if (it == feeds.end()) return Status::error("missing input '" + in->name + "'");
    KILN_RETURN_IF_ERROR(check_feed(*in, it->second));
    env[in] = it->second;
  }
  for (Value* v : g.initializers) env[v] = *v->data;
  // Last use of each value, so its buffer is released right after.
  std::unordered_map<const Value*, size_t> last_use;
  const auto& nodes = g.nodes();
  for (size_t i = 0; i < nodes.size(); ++i)
    for (Value* in : nodes[i]->inputs)
      if (in) last_use[in] = i;
  std::unordered_map<const Value*, bool> pinned;
  for (Value* o : g.outputs) pinned[o] = true;
  for (auto& k : opts.keep)
    if (Value* v = g.find_value(k)) pinned[v] = true;
  for (Value* v : g.initializers) pinned[v] = true;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = *nodes[i];
    std::vector<const Tensor*> ins;
    for (Value* v : n.inputs) {
      if (!v) {
        ins.push_back(nullptr);
        continue;
      }
      auto it = env.find(v);
      if (it == env.end()) return Status::error("node '" + n.name + "': input '" + v->name + "' has no value");
      ins.push_back(&it->second);
    }
    auto outs = run_node(n, ins, opts, i);
    if (!outs) return outs.status();
    for (size_t k = 0; k < n.outputs.size(); ++k) env[n.outputs[k]] = std::move((*outs)[k]);
    for (Value* v : n.inputs)
      if (v && last_use[v] == i && !pinned.count(v)) env.erase(v);
  }
  std::map<std::string, Tensor> result;
  for (Value* o : g.outputs) {
    auto it = env.find(o);
    if (it == env.end()) return Status::error("graph output '" + o->name + "' was not computed");
    result[o->name] = it->second;
  }
  for (auto& k : opts.keep) {
    Value* v = g.find_value(k);
    if (v && env.count(v)) result[k] = env[v];
  }
  return result;
}

}  // namespace kiln::runtime
