// The pipeline table of a training run (tools/driver/pipeline.h).
#include "tools/driver/pipeline.h"

#include <iomanip>
#include <sstream>

#include "passes/pass.h"
#include "tools/driver/driver.h"

namespace kiln::driver {

PipelineOptions pipeline_options(const runtime::TrainConfig& cfg, int64_t total_steps, bool to_f64) {
  PipelineOptions po;
  po.bf16 = cfg.bf16;
  po.fp16 = cfg.fp16;
  po.compiled = cfg.backend == "compiled";
  po.to_f64 = to_f64;
  passes::PassOptions& o = po.passes;
  o.loss.loss = cfg.loss;
  o.loss.label_input = cfg.label_input.empty() ? "labels" : cfg.label_input;
  o.loss.ignore_index = cfg.ignore_index;
  o.loss.label_smoothing = cfg.label_smoothing;
  o.loss.freeze = cfg.freeze;
  o.loss.trainable = cfg.trainable;
  o.loss.disable_dropout = cfg.disable_dropout;
  o.optimizer.optim = cfg.optim;
  o.optimizer.learning_rate = cfg.learning_rate;
  o.optimizer.weight_decay = cfg.weight_decay;
  o.optimizer.adam_beta1 = cfg.adam_beta1;
  o.optimizer.adam_beta2 = cfg.adam_beta2;
  o.optimizer.adam_epsilon = cfg.adam_epsilon;
  o.optimizer.momentum = cfg.momentum;
  o.optimizer.nesterov = cfg.nesterov;
  o.optimizer.max_grad_norm = cfg.max_grad_norm;
  o.optimizer.lr_scheduler_type = cfg.lr_scheduler_type;
  o.optimizer.total_steps = total_steps;
  o.optimizer.warmup_steps = cfg.warmup(total_steps);
  o.remat.policy = cfg.effective_remat_policy();  // passes/remat.cpp
  if (auto b = runtime::parse_byte_size(cfg.memory_budget); !cfg.memory_budget.empty() && b) o.remat.memory_budget = *b;
  o.accumulation.gradient_accumulation_steps = cfg.gradient_accumulation_steps;
  o.accumulation.normalization = cfg.accumulation_normalization;
  o.data_parallel.world_size = cfg.world_size;  // passes/data_parallel.cpp
  o.data_parallel.bucket_cap_mb = cfg.ddp_bucket_cap_mb;
  o.optimizer.zero_shards = cfg.zero_stage == 1 && cfg.world_size > 1 ? cfg.world_size : 1;  // passes/optimizer.cpp
  o.autocast.min_flops = autocast_min_flops(cfg);
  o.autocast.min_conv_flops = autocast_min_flops(cfg, true);
  if (cfg.fp16) {  // passes/autocast.cpp + passes/grad_scaler.cpp
    o.autocast.dtype = ir::DType::f16;
    o.grad_scaler.init_scale = cfg.fp16_init_scale;
    o.grad_scaler.growth_interval = cfg.fp16_growth_interval;
  }
  // On CPUs without native bf16 dot products, bf16 GEMMs run as f32 GEMMs of the widened
  // operands (passes/gemm_widening.cpp): same function, several times faster there.
  // oneDNN 2.6 has no CPU f16 matmul (the eager f16 product is a plain f64 loop): f16
  // GEMMs always run as f32 GEMMs of the widened operands.
  o.lowering.widen_bf16_gemm = po.compiled && cfg.bf16 && !host_has_native_bf16();
  o.lowering.widen_f16_gemm = po.compiled && cfg.fp16;
  o.lowering.symbolic_versions = cfg.symbolic_versions != "off";
  return po;
}

std::vector<std::string> specialize_pipeline(bool to_f64) {
  std::vector<std::string> p = {"fold_constants", "canonicalize"};
  if (to_f64) p.push_back("to_float64");
  return p;
}

namespace {

/// When a table entry runs.
enum class When { always, low_precision, fp16, remat, compiled, data_parallel };

bool holds(When w, const PipelineOptions& o) {
  switch (w) {
    case When::always:
      return true;
    case When::low_precision:
      return o.bf16 || o.fp16;
    case When::fp16:
      return o.fp16;
    case When::remat:
      return o.passes.remat.policy != "none";
    case When::compiled:
      return o.compiled;
    case When::data_parallel:
      return o.passes.data_parallel.world_size > 1;
  }
  return false;
}

/// One pass of the table: when it runs and the stage it runs in for each program (null:
/// not in that program).
struct Entry {
  const char* pass;
  When when;
  const char* train;
  const char* grads;
  const char* eval;
};

// The whole table, in run order within each program. Stages are runs of the pass manager:
// the training step runs "step" (loss, mixed precision, backward, remat), "update"
// (optimizer, then the accumulation loop: the loop wraps forward and backward once the
// optimizer reads the gradients, so the update runs once per step) and "lowering" (the
// compiled backend's passes before kernel generation); the gradient program copies the
// step after "step" and runs "accumulation" (the same microbatches as the step); eval
// runs one stage "forward".
// --bf16: autocast runs before autodiff so saved activations are bf16 and the backward
// pass follows the forward dtypes (passes/autocast.cpp). --fp16: the same with f16, plus
// GradScaler loss scaling around autodiff and the optimizer (passes/grad_scaler.cpp).
// Lowering: bf16/f16 GEMMs widened to f32 where the CPU lacks fast ones (gemm_widening);
// Transposes feeding MatMul/Gemm operands read as strided operands, no copy
// (absorb_transpose); backward ops with row and column results split into a row op and
// column sums (decompose), which fusion then generates with the pointwise groups;
// duplicate small results (batch statistics a gradient's decomposition recomputes) are
// computed once (cse);
// pointwise kernels then write into an input that dies at them (fused_inplace); the
// optimizer's per-parameter update kernels become one multi-tensor launch (multi_tensor);
// data-parallel jobs sum the gradients over the ranks after the accumulation loop, once
// per optimizer step (data_parallel); memory planning runs last and writes each value's step-arena offset into the IR
// (arena_plan).
constexpr Entry kTable[] = {
    // pass                 runs when            train       grads           eval
    {"attach_loss", When::always, "step", nullptr, "forward"},
    {"autocast", When::low_precision, "step", nullptr, "forward"},
    {"cast_simplify", When::low_precision, "step", nullptr, "forward"},
    {"loss_scale", When::fp16, "step", nullptr, nullptr},
    {"autodiff", When::always, "step", nullptr, nullptr},
    {"grad_unscale", When::fp16, "step", nullptr, nullptr},
    {"autocast_grad", When::low_precision, "step", nullptr, nullptr},
    {"cast_simplify", When::low_precision, "step", nullptr, nullptr},
    {"remat", When::remat, "step", nullptr, nullptr},
    {"canonicalize", When::always, "step", nullptr, "forward"},
    {"accumulation", When::always, nullptr, "accumulation", nullptr},
    {"data_parallel", When::data_parallel, nullptr, "accumulation", nullptr},
    {"canonicalize", When::always, nullptr, "accumulation", nullptr},
    {"optimizer", When::always, "update", nullptr, nullptr},
    {"grad_scaler_update", When::fp16, "update", nullptr, nullptr},
    {"accumulation", When::always, "update", nullptr, nullptr},
    {"data_parallel", When::data_parallel, "update", nullptr, nullptr},
    {"canonicalize", When::always, "update", nullptr, nullptr},
    {"gemm_widening", When::compiled, "lowering", nullptr, "forward"},
    {"absorb_transpose", When::compiled, "lowering", nullptr, "forward"},
    {"decompose", When::compiled, "lowering", nullptr, "forward"},
    {"cse", When::compiled, "lowering", nullptr, "forward"},
    {"fusion", When::compiled, "lowering", nullptr, "forward"},
    {"fused_inplace", When::compiled, "lowering", nullptr, "forward"},
    {"multi_tensor", When::compiled, "lowering", nullptr, "forward"},
    {"arena_plan", When::compiled, "lowering", nullptr, "forward"},
};

void add(ProgramPipeline& p, const std::string& stage, const std::string& pass) {
  if (p.stages.empty() || p.stages.back().name != stage) p.stages.push_back({stage, {}, true});
  p.stages.back().passes.push_back(pass);
}

}  // namespace

const std::vector<std::string>& ProgramPipeline::stage(const std::string& name) const {
  static const std::vector<std::string> none;
  for (const PipelineStage& s : stages)
    if (s.name == name) return s.passes;
  return none;
}

Pipeline training_pipeline(const PipelineOptions& o) {
  Pipeline p;
  p.train.program = "train";
  p.grads.program = "grads";
  p.eval.program = "eval";
  p.train.options = o.passes;
  p.train.options.mode = passes::Mode::train;
  if (o.fp16) p.train.options.autodiff.loss_output = "loss.scaled";  // passes/grad_scaler.cpp
  p.grads.options = p.train.options;
  p.eval.options = o.passes;
  p.eval.options.mode = passes::Mode::eval;
  // Train and eval start from the specialised model; the gradient program from a copy of
  // the training step after its stage "step".
  for (ProgramPipeline* q : {&p.train, &p.eval})
    for (const std::string& pass : specialize_pipeline(o.to_f64)) add(*q, "specialize", pass);
  p.grads.from_program = "train";
  p.grads.after_stage = "step";
  for (const Entry& e : kTable) {
    if (!holds(e.when, o)) continue;
    if (e.train) add(p.train, e.train, e.pass);
    if (e.grads) add(p.grads, e.grads, e.pass);
    if (e.eval) add(p.eval, e.eval, e.pass);
  }
  // The eval and gradient programs are built quietly: --print-ir-after, --dump-ir-dir,
  // --stop-after and --time-passes act on the training step.
  for (ProgramPipeline* q : {&p.grads, &p.eval})
    for (PipelineStage& s : q->stages) s.debug = false;
  return p;
}

std::string format_pipeline(const Pipeline& p, bool with_grads) {
  std::ostringstream os;
  std::vector<const ProgramPipeline*> progs = {&p.train};
  if (with_grads) progs.push_back(&p.grads);
  progs.push_back(&p.eval);
  for (const ProgramPipeline* q : progs) {
    if (!q->from_program.empty())
      os << q->program << "  (starts from a copy of " << q->from_program << " after stage " << q->after_stage << ")\n";
    for (const PipelineStage& s : q->stages)
      for (const std::string& name : s.passes) {
        auto pass = passes::make_pass(name);
        const std::string opts = pass ? pass->describe_options(q->options) : std::string("(unknown pass)");
        os << std::left << std::setw(6) << q->program << " " << std::setw(11) << s.name << " " << std::setw(19) << name;
        os << (opts.empty() ? "" : " " + opts);
        os << "\n";
      }
  }
  std::string out = os.str();
  // No trailing spaces from the padding of a pass that reads no option.
  std::string clean;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    while (!line.empty() && line.back() == ' ') line.pop_back();
    clean += line + "\n";
  }
  return clean;
}

}  // namespace kiln::driver
