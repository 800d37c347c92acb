// The pipeline driver: import -> passes -> graphs for the runtime.
#include "tools/driver/driver.h"

#include <set>
#include <sstream>

#include "frontend/onnx_import.h"
#include "ir/op_table.h"
#include "ir/verifier.h"
#include "passes/passes.h"
#include "runtime/interpreter.h"

namespace kiln::driver {

using namespace kiln::ir;

Status bind_dims(Graph& g, const std::map<std::string, int64_t>& dims) {
  if (dims.empty()) return Status::ok();
  auto bind = [&](Value* v) {
    for (Dim& d : v->shape.dims)
      if (!d.is_static() && !d.symbol.empty()) {
        auto it = dims.find(d.symbol);
        if (it != dims.end()) d = Dim(it->second);
      }
  };
  for (Value* v : g.inputs) bind(v);
  for (auto& n : g.nodes())
    for (Value* v : n->outputs) bind(v);
  for (Value* v : g.outputs) bind(v);
  return infer_graph(g);
}

static Status run_passes(Graph& g, const std::vector<std::string>& names, passes::PassContext* dbg,
                         const std::map<std::string, std::string>& options) {
  passes::PassContext local;
  passes::PassContext& ctx = dbg ? *dbg : local;
  ctx.options = options;
  std::vector<std::string> pipeline;
  for (auto& n : names)
    if (passes::make_pass(n)) pipeline.push_back(n);
  return passes::run_pipeline(g, pipeline, ctx);
}

/// Symbolic dim names used anywhere in the graph's inputs.
static std::set<std::string> input_symbols(const Graph& g) {
  std::set<std::string> s;
  for (Value* v : g.inputs)
    for (const Dim& d : v->shape.dims)
      if (!d.is_static() && !d.symbol.empty()) s.insert(d.symbol);
  return s;
}

Expected<std::unique_ptr<Graph>> load_model(const std::string& path, const std::map<std::string, int64_t>& shape,
                                            bool to_f64, passes::PassContext* dbg) {
  runtime::register_eager_kernels();  // constant folding evaluates through the op table's kernels
  {
    // A --shape name that no input uses is a typo, not something to ignore silently.
    auto probe = frontend::import_onnx(path, {});
    if (!probe) return probe.status();
    auto syms = input_symbols(**probe);
    for (auto& [name, v] : shape)
      if (!syms.count(name)) {
        std::string known;
        for (auto& s : syms) known += (known.empty() ? "" : ", ") + s;
        return Status::error("--shape " + name + "=" + std::to_string(v) + ": the model has no input dim named '" +
                             name + "' (symbolic dims: " + (known.empty() ? "none" : known) + ")");
      }
  }
  frontend::ImportOptions opts;
  opts.bind_dims = shape;
  auto g = frontend::import_onnx(path, opts);
  if (!g) return g.status();
  KILN_RETURN_IF_ERROR(bind_dims(**g, shape).with_context(path));
  std::vector<std::string> pipeline = {"fold_constants", "canonicalize"};
  if (to_f64) pipeline.push_back("to_float64");
  KILN_RETURN_IF_ERROR(run_passes(**g, pipeline, dbg, {}).with_context(path));
  return g;
}

Expected<std::unique_ptr<Graph>> load_inference_model(const std::string& path,
                                                      const std::map<std::string, int64_t>& shape,
                                                      passes::PassContext* dbg) {
  KILN_ASSIGN_OR_RETURN(auto g, load_model(path, shape, false, dbg));
  KILN_RETURN_IF_ERROR(run_passes(*g, {"eval_mode", "canonicalize"}, dbg, {}).with_context(path));
  return g;
}

std::map<std::string, std::string> pass_options(const runtime::TrainConfig& cfg, int64_t total_steps) {
  auto num = [](double v) {
    std::ostringstream os;
    os.precision(17);
    os << v;
    return os.str();
  };
  std::map<std::string, std::string> o;
  o["loss"] = cfg.loss;
  o["label_input"] = cfg.label_input.empty() ? "labels" : cfg.label_input;
  o["ignore_index"] = std::to_string(cfg.ignore_index);
  o["label_smoothing"] = num(cfg.label_smoothing);
  o["freeze"] = cfg.freeze;
  o["trainable"] = cfg.trainable;
  o["optim"] = cfg.optim;
  o["learning_rate"] = num(cfg.learning_rate);
  o["weight_decay"] = num(cfg.weight_decay);
  o["adam_beta1"] = num(cfg.adam_beta1);
  o["adam_beta2"] = num(cfg.adam_beta2);
  o["adam_epsilon"] = num(cfg.adam_epsilon);
  o["momentum"] = num(cfg.momentum);
  o["nesterov"] = cfg.nesterov ? "1" : "0";
  o["max_grad_norm"] = num(cfg.max_grad_norm);
  o["lr_scheduler_type"] = cfg.lr_scheduler_type;
  o["total_steps"] = std::to_string(total_steps);
  o["disable_dropout"] = cfg.disable_dropout ? "1" : "0";
  o["warmup_steps"] = std::to_string(cfg.warmup(total_steps));
  return o;
}

/// Batch-size bindings: user --shape first, then the first symbolic dim of each model input.
static Expected<std::map<std::string, int64_t>> batch_bindings(const runtime::TrainConfig& cfg, int64_t batch) {
  frontend::ImportOptions opts;
  opts.bind_dims = cfg.shape;
  auto g = frontend::import_onnx(cfg.model, opts);
  if (!g) return g.status();
  std::map<std::string, int64_t> b = cfg.shape;
  for (Value* in : (*g)->inputs)
    if (in->shape.rank() > 0 && !in->shape.dims[0].is_static() && !in->shape.dims[0].symbol.empty() &&
        !b.count(in->shape.dims[0].symbol))
      b[in->shape.dims[0].symbol] = batch;
  return b;
}

Expected<TrainingProgram> build_training_program(const runtime::TrainConfig& cfg, passes::PassContext* dbg,
                                                 bool want_grads, bool to_f64, int64_t total_steps) {
  if (total_steps <= 0) total_steps = cfg.max_steps > 0 ? cfg.max_steps : 1;
  TrainingProgram prog;
  auto opts = pass_options(cfg, total_steps);
  KILN_ASSIGN_OR_RETURN(auto train_dims, batch_bindings(cfg, cfg.per_device_train_batch_size));
  KILN_ASSIGN_OR_RETURN(auto eval_dims, batch_bindings(cfg, cfg.per_device_eval_batch_size));

  // Training step: forward + loss + backward + optimizer.
  KILN_ASSIGN_OR_RETURN(auto train, load_model(cfg.model, train_dims, to_f64, dbg));
  for (Value* in : train->inputs) prog.data_inputs.push_back(in->name);
  prog.logits_output = train->outputs.empty() ? "" : train->outputs[0]->name;
  auto train_opts = opts;
  train_opts["mode"] = "train";
  // --bf16: autocast runs before autodiff so saved activations are bf16 and the
  // backward pass follows the forward dtypes (passes/autocast.cpp).
  std::vector<std::string> fwd = {"attach_loss"};
  if (cfg.bf16) fwd.insert(fwd.end(), {"autocast", "cast_simplify"});
  std::vector<std::string> train_pipe = fwd;
  train_pipe.insert(train_pipe.end(), {"autodiff", "canonicalize"});
  KILN_RETURN_IF_ERROR(run_passes(*train, train_pipe, dbg, train_opts));
  if (cfg.loss != "model") {
    prog.label_input = opts["label_input"];
    prog.data_inputs.push_back(prog.label_input);
  }
  for (auto& sb : train->state)
    if (sb.kind == "parameter") prog.parameters.push_back(sb.input->name);
  if (want_grads) prog.grads = train->clone();
  KILN_RETURN_IF_ERROR(run_passes(*train, {"optimizer", "canonicalize"}, dbg, train_opts));
  KILN_RETURN_IF_ERROR(verify_graph(*train).with_context("training program"));
  prog.train_step = std::move(train);

  // Evaluation: forward + loss in inference mode, parameters as inputs.
  KILN_ASSIGN_OR_RETURN(auto eval, load_model(cfg.model, eval_dims, to_f64, nullptr));
  auto eval_opts = opts;
  eval_opts["mode"] = "eval";
  std::vector<std::string> eval_pipe = fwd;
  eval_pipe.push_back("canonicalize");
  KILN_RETURN_IF_ERROR(run_passes(*eval, eval_pipe, nullptr, eval_opts));
  prog.eval = std::move(eval);
  return prog;
}

}  // namespace kiln::driver
