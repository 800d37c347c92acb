// Typed pass options (issue 30): what each pass reads, one struct per pass family,
// held by PassContext::options. The driver fills them from a TrainConfig
// (tools/driver/pipeline.h pipeline_options); a default-constructed PassOptions is what
// a pass sees when nobody set anything, the defaults below being the passes' own.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "ir/dtype.h"

namespace kiln::passes {

/// Which program a pipeline builds: the training step or the evaluation forward.
enum class Mode { train, eval };

/// "train" or "eval".
const char* mode_name(Mode m);

/// attach_loss: the loss, the label input, which initializers are trained.
struct LossOptions {
  std::string loss = "cross_entropy";  ///< cross_entropy, mse, l1, bce_with_logits or model
  std::string label_input = "labels";  ///< name of the label input the pass adds
  std::string logits_output;           ///< model output the loss reads; empty: the first output
  int64_t ignore_index = -100;         ///< cross_entropy: label that counts for nothing
  double label_smoothing = 0.0;        ///< cross_entropy: label smoothing epsilon
  std::string freeze;                  ///< regex: matching parameters stay constants
  std::string trainable;               ///< regex: only matching parameters train (empty: all)
  bool disable_dropout = false;        ///< training: Dropout becomes Identity
};

/// autodiff: the scalar it differentiates.
struct AutodiffOptions {
  std::string loss_output = "loss";  ///< "loss.scaled" under --fp16 loss scaling
};

/// optimizer (and remat's estimate of the optimizer state): the update and its schedule.
struct OptimizerOptions {
  std::string optim = "adamw_torch";  ///< adamw_torch, adamw_8bit (adamw_bnb_8bit) or sgd
  double learning_rate = 5e-5;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;                     ///< sgd
  bool nesterov = false;                     ///< sgd
  double max_grad_norm = 1.0;                ///< global-norm clipping; <= 0: none
  std::string lr_scheduler_type = "linear";  ///< linear, cosine, constant, constant_with_warmup
  int64_t total_steps = 1;                   ///< optimizer steps of the run (the schedule input's default)
  int64_t warmup_steps = 0;                  ///< the warmup input's default
  /// ZeRO-1 (--zero_stage 1 in a data-parallel job): the optimizer state is cut into this
  /// many shards (the world size), one per rank; 1: whole.
  int64_t zero_shards = 1;
};

/// autocast: the low-precision dtype (bf16 for --bf16, f16 for --fp16).
struct AutocastOptions {
  ir::DType dtype = ir::DType::bf16;
  /// A low_precision node (GEMM, MatMul, convolution) of fewer FLOPs than this
  /// (ir::node_cost) keeps f32 inputs and output, marked kiln_autocast_kept = its FLOPs;
  /// 0 casts every one, as torch.autocast does. Products (OpTrait::matmul) compare with
  /// min_flops, convolutions with min_conv_flops (their f32 and bf16 kernels break even
  /// at other sizes).
  double min_flops = 0;
  double min_conv_flops = 0;
};

/// remat: the gradient-checkpointing policy.
struct RematOptions {
  std::string policy = "none";  ///< none, blocks, sqrt, min-cut or budget
  /// policy budget: the peak to fit, in bytes (unset: the policy is an error).
  std::optional<int64_t> memory_budget;
  int solver_ms = 2000;  ///< policy budget: time limit of the MIP solver
};

/// accumulation (and attach_loss, which normalizes the microbatch losses).
struct AccumulationOptions {
  int64_t gradient_accumulation_steps = 1;  ///< the AccumulationLoop's trip count; 1: no loop
  /// tokens or microbatch; empty: tokens for cross_entropy, microbatch otherwise.
  std::string normalization;
};

/// loss_scale and grad_scaler_update: torch.amp.GradScaler's settings.
struct GradScalerOptions {
  double init_scale = 65536.0;
  int64_t growth_interval = 2000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
};

/// data_parallel (and attach_loss, which scales a mean loss by 1/world_size): the ranks
/// of a data-parallel job and DDP's gradient buckets.
struct DataParallelOptions {
  int64_t world_size = 1;            ///< ranks of the job; 1: the pass changes nothing
  double bucket_cap_mb = 25.0;       ///< bucket size in MiB (DDP's bucket_cap_mb)
  double first_bucket_cap_mb = 1.0;  ///< the first bucket's size in MiB (DDP's first bucket)
};

/// The compiled pipeline's passes (gemm_widening, fusion, multi_tensor).
struct LoweringOptions {
  bool widen_bf16_gemm = false;  ///< bf16 MatMul/Gemm as f32 products of widened operands
  bool widen_f16_gemm = false;   ///< the same for f16
  int fusion_min_nodes = 1;      ///< smallest pointwise group fusion makes a kernel of
  bool multi_tensor = true;      ///< false: multi_tensor leaves the graph as it is
  /// --symbolic_versions: symbolic row kernels also hold whole-vectors and short-row
  /// versions chosen at launch (false: fusion marks them kiln_symbolic_versions = 0, the
  /// generic form only).
  bool symbolic_versions = true;
};

/// Every option a pass reads. Each pass reads only its own family's fields (and
/// `mode` and `symbol_bounds`); Pass::describe_options names them for `kiln inspect
/// --pipeline`.
struct PassOptions {
  Mode mode = Mode::train;
  /// A symbolic program's bounds (--shape_mode symbolic: each symbol's largest value,
  /// --max_length and the batch size). Autocast decides a node with symbolic dims by its
  /// FLOPs at them (ir::node_cost_at; empty: such a node takes the low dtype); arena_plan
  /// lays out the step arena at them (offsets valid for every smaller value); fusion
  /// chooses schedules for them. Empty for static programs.
  std::map<std::string, int64_t> symbol_bounds;
  LossOptions loss;
  AutodiffOptions autodiff;
  OptimizerOptions optimizer;
  AutocastOptions autocast;
  RematOptions remat;
  AccumulationOptions accumulation;
  GradScalerOptions grad_scaler;
  DataParallelOptions data_parallel;
  LoweringOptions lowering;
};

/// `v` printed so that reading it back gives the same double (17 significant digits
/// where needed, shortest otherwise), for option listings and messages.
std::string format_option(double v);

/// Builds the "name=value name=value" text of Pass::describe_options (an empty string
/// value prints as '').
class OptionText {
 public:
  OptionText& add(const char* name, const std::string& v);
  OptionText& add(const char* name, const char* v) { return add(name, std::string(v)); }
  OptionText& add(const char* name, double v) { return add(name, format_option(v)); }
  OptionText& add(const char* name, int64_t v) { return add(name, std::to_string(v)); }
  OptionText& add(const char* name, int v) { return add(name, std::to_string(v)); }
  OptionText& add(const char* name, bool v) { return add(name, std::string(v ? "true" : "false")); }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

}  // namespace kiln::passes
