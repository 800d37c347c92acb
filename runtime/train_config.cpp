// TrainConfig: validation, step arithmetic (Hugging Face Trainer semantics), and
// the table of fields shared by the command-line flags and the JSON config files.
#include "runtime/train_config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "runtime/io.h"

namespace kiln::runtime {

using Kind = ConfigField::Kind;

int64_t TrainConfig::total_steps(int64_t steps_per_epoch) const {
  if (max_steps > 0) return max_steps;
  // HF: max_steps = ceil(num_train_epochs * num_update_steps_per_epoch)
  double t = std::ceil(num_train_epochs * static_cast<double>(steps_per_epoch) - 1e-9);
  if (!(t < 9.2e18)) return INT64_MAX;  // saturates (run_training refuses counts this large)
  return t < 0 ? 0 : static_cast<int64_t>(t);
}

int64_t TrainConfig::warmup(int64_t total) const {
  if (warmup_steps > 0) return warmup_steps;
  return static_cast<int64_t>(std::ceil(warmup_ratio * static_cast<double>(total) - 1e-9));
}

namespace {

/// Largest dim a flag may give (--shape, batch sizes): element counts and byte sizes are
/// int64, and beyond 2^31 per dim they overflow ("shapes [4611686018427387904, 64, 64] and
/// [0, 64, 64] do not broadcast").
constexpr int64_t kMaxDim = int64_t{1} << 31;

Status bad(const std::string& name, const std::string& why) { return Status::error("--" + name + ": " + why); }

template <typename T>
std::string num_str(T v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

Status one_of(const std::string& name, const std::string& v, const std::vector<std::string>& allowed) {
  for (auto& a : allowed)
    if (a == v) return Status::ok();
  std::string list;
  for (auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
  return bad(name, "unknown value '" + v + "' (expected one of: " + list + ")");
}

}  // namespace

Status TrainConfig::validate() const {
  KILN_RETURN_IF_ERROR(one_of("loss", loss, {"cross_entropy", "mse", "bce_with_logits", "l1", "model"}));
  // adamw_bnb_8bit is Hugging Face's name for the same bitsandbytes optimizer.
  KILN_RETURN_IF_ERROR(
      one_of("lr_scheduler_type", lr_scheduler_type, {"linear", "cosine", "constant", "constant_with_warmup"}));
  // A comma list ("eager,compiled") is for `kiln bench`, which runs each side by side;
  // the driver builds one program per single backend. An empty item is an error.
  auto check_list = [&](const char* flag, const std::string& text,
                        const std::vector<std::string>& allowed) -> Expected<std::vector<std::string>> {
    std::vector<std::string> items = comma_list(text);
    for (const std::string& item : items) {
      if (item.empty() && items.size() > 1) return bad(flag, "empty item in the list '" + text + "'");
      KILN_RETURN_IF_ERROR(one_of(flag, item, allowed));
    }
    return items;
  };
  if (auto items = check_list("backend", backend, {"eager", "compiled"}); !items) return items.status();
  // A comma list of optimizers is for `kiln bench` too (their updates side by side).
  if (auto items = check_list("optim", optim, {"adamw_torch", "adamw_8bit", "adamw_bnb_8bit", "sgd"}); !items)
    return items.status();
  if (!accumulation_normalization.empty())
    KILN_RETURN_IF_ERROR(one_of("accumulation_normalization", accumulation_normalization, {"tokens", "microbatch"}));
  if (accumulation_normalization == "tokens" && loss != "cross_entropy")
    return bad("accumulation_normalization", "'tokens' needs --loss cross_entropy (use microbatch)");
  auto positive = [](const char* n, int64_t v) -> Status {
    if (v <= 0) return bad(n, "must be > 0, got " + num_str(v));
    return Status::ok();
  };
  auto non_negative = [](const char* n, double v) -> Status {
    if (!(v >= 0) || std::isinf(v)) return bad(n, "must be a finite number >= 0, got " + num_str(v));
    return Status::ok();
  };
  KILN_RETURN_IF_ERROR(positive("per_device_train_batch_size", per_device_train_batch_size));
  KILN_RETURN_IF_ERROR(positive("per_device_eval_batch_size", per_device_eval_batch_size));
  KILN_RETURN_IF_ERROR(positive("gradient_accumulation_steps", gradient_accumulation_steps));
  KILN_RETURN_IF_ERROR(positive("logging_steps", logging_steps));
  // Rows per step are a dim of the step's tensors (kMaxDim).
  constexpr int64_t kMaxRows = kMaxDim;
  for (auto [n, v] : {std::pair<const char*, int64_t>{"per_device_train_batch_size", per_device_train_batch_size},
                      {"per_device_eval_batch_size", per_device_eval_batch_size},
                      {"gradient_accumulation_steps", gradient_accumulation_steps}})
    if (v > kMaxRows) return bad(n, "must be at most 2^31 (2147483648), got " + num_str(v));
  if (per_device_train_batch_size * gradient_accumulation_steps > kMaxRows)
    return bad("gradient_accumulation_steps",
               "times --per_device_train_batch_size must be at most 2^31 rows per step, got " +
                   num_str(gradient_accumulation_steps) + " x " + num_str(per_device_train_batch_size));
  if (zero_stage != 0 && zero_stage != 1)
    return bad("zero_stage", "must be 0 or 1 (ZeRO stages 2 and 3 are not built), got " + num_str(zero_stage));
  if (!(ddp_timeout > 0) || std::isinf(ddp_timeout))
    return bad("ddp_timeout", "must be a finite number of seconds > 0, got " + num_str(ddp_timeout));
  if (!(ddp_bucket_cap_mb > 0) || std::isinf(ddp_bucket_cap_mb))
    return bad("ddp_bucket_cap_mb", "must be a finite number of MiB > 0, got " + num_str(ddp_bucket_cap_mb));
  if (eval_steps < 0) return bad("eval_steps", "must be >= 0, got " + num_str(eval_steps));
  if (save_steps < 0) return bad("save_steps", "must be >= 0, got " + num_str(save_steps));
  if (save_total_limit < 0) return bad("save_total_limit", "must be >= 0, got " + num_str(save_total_limit));
  if (warmup_steps < 0) return bad("warmup_steps", "must be >= 0, got " + num_str(warmup_steps));
  if (block_size < 0) return bad("block_size", "must be >= 0, got " + num_str(block_size));
  if (max_length < 0 || max_length > kMaxDim)
    return bad("max_length", "must be in [0, 2^31], got " + num_str(max_length));
  if (pad_token_id < 0) return bad("pad_token_id", "must be >= 0 (a token id), got " + num_str(pad_token_id));
  if (recompile_limit < 1) return bad("recompile_limit", "must be > 0, got " + num_str(recompile_limit));
  KILN_RETURN_IF_ERROR(one_of("symbolic_versions", symbolic_versions, {"on", "off"}));
  if (auto items = check_list("shape_mode", shape_mode, {"pad", "specialize", "buckets", "symbolic"}); !items)
    return items.status();
  if (auto b = parse_shape_buckets(shape_buckets); !b) return b.status();
  if (max_steps == 0 || max_steps < -1)
    return bad("max_steps", "must be -1 (use epochs) or > 0, got " + num_str(max_steps));
  // Checked even when --max_steps overrides it (HF: max_steps wins): a NaN or negative
  // epoch count is a mistake either way.
  if (!(num_train_epochs > 0 && std::isfinite(num_train_epochs)))
    return bad("num_train_epochs", "must be > 0, got " + num_str(num_train_epochs));
  KILN_RETURN_IF_ERROR(non_negative("learning_rate", learning_rate));
  KILN_RETURN_IF_ERROR(non_negative("weight_decay", weight_decay));
  KILN_RETURN_IF_ERROR(non_negative("adam_epsilon", adam_epsilon));
  KILN_RETURN_IF_ERROR(non_negative("momentum", momentum));
  KILN_RETURN_IF_ERROR(non_negative("max_grad_norm", max_grad_norm));
  if (!(adam_beta1 >= 0 && adam_beta1 < 1)) return bad("adam_beta1", "must be in [0, 1), got " + num_str(adam_beta1));
  if (!(adam_beta2 >= 0 && adam_beta2 < 1)) return bad("adam_beta2", "must be in [0, 1), got " + num_str(adam_beta2));
  if (!(warmup_ratio >= 0 && warmup_ratio <= 1))
    return bad("warmup_ratio", "must be in [0, 1], got " + num_str(warmup_ratio));
  if (!(label_smoothing >= 0 && label_smoothing < 1))
    return bad("label_smoothing", "must be in [0, 1), got " + num_str(label_smoothing));
  if (bf16 && fp16) return bad("fp16", "--bf16 and --fp16 are mutually exclusive");
  if (!(fp16_init_scale > 0) || std::isinf(fp16_init_scale))
    return bad("fp16_init_scale", "must be a finite number > 0, got " + num_str(fp16_init_scale));
  if (!(autocast_min_flops == -1 || (autocast_min_flops >= 0 && autocast_min_flops <= 1e18)))
    return bad("autocast_min_flops", "must be a number of FLOPs in [0, 1e18], or -1 for this CPU's break-even, got " +
                                         num_str(autocast_min_flops));
  if (fp16_growth_interval <= 0)
    return bad("fp16_growth_interval", "must be > 0, got " + num_str(fp16_growth_interval));
  if (nesterov && momentum <= 0) return bad("nesterov", "requires --momentum > 0 (PyTorch SGD rule)");
  // Options of a mode that is off were silently ignored; like --memory_budget without
  // the budget policy, they are errors (values other than the defaults only).
  if (!fp16 && fp16_init_scale != TrainConfig{}.fp16_init_scale)
    return bad("fp16_init_scale", "only applies with --fp16");
  if (!fp16 && fp16_growth_interval != TrainConfig{}.fp16_growth_interval)
    return bad("fp16_growth_interval", "only applies with --fp16");
  if (!fp16 && !bf16 && autocast_min_flops != TrainConfig{}.autocast_min_flops)
    return bad("autocast_min_flops", "only applies with --bf16 or --fp16");
  if (momentum > 0 && optim.find("sgd") == std::string::npos)
    return bad("momentum", "only applies to --optim sgd (got '" + optim + "')");
  if (output_dir.empty()) return bad("output_dir", "must not be empty");
  for (auto* re : {&freeze, &trainable}) {
    if (re->empty()) continue;
    try {
      std::regex r(*re);
    } catch (const std::regex_error& e) {
      return bad(re == &freeze ? "freeze" : "trainable", "invalid regular expression '" + *re + "'");
    }
  }
  for (auto& [k, v] : shape)
    if (v <= 0) return bad("shape", "dimension '" + k + "' must be > 0, got " + num_str(v));
  // As --backend, a comma list ("none,blocks") is for `kiln bench`; each item is checked.
  std::vector<std::string> policies = {effective_remat_policy()};
  if (!remat_policy.empty()) {
    auto items = check_list("remat_policy", remat_policy, {"none", "blocks", "sqrt", "min-cut", "budget"});
    if (!items) return items.status();
    policies = *items;
  }
  const bool any_budget = std::find(policies.begin(), policies.end(), "budget") != policies.end();
  if (!memory_budget.empty() && memory_budget == "auto") {
    if (!fitting() || any_budget)
      return bad("memory_budget",
                 "'auto' (the memory available less a margin) is for --auto_fit, --auto_find_batch_size and kiln fit; "
                 "--remat_policy budget takes a size such as 800MB or 24GiB");
  } else if (!memory_budget.empty()) {
    auto b = parse_byte_size(memory_budget);
    if (!b) return b.status();
  }
  if (!memory_budget.empty() && !any_budget && !fitting())
    return bad("memory_budget",
               "only applies to --remat_policy budget, --auto_fit or --auto_find_batch_size (got policy '" +
                   effective_remat_policy() + "')");
  if (auto_fit && memory_budget.empty())
    return bad("memory_budget", "--auto_fit needs --memory_budget (e.g. 800MB, 24GiB, or auto: the memory available)");
  if (effective_batch_size < 0)
    return bad("effective_batch_size",
               "must be > 0 (0: per_device_train_batch_size x gradient_accumulation_steps), got " +
                   num_str(effective_batch_size));
  if (effective_batch_size > 0 && !fitting())
    return bad("effective_batch_size", "only applies to --auto_fit, --auto_find_batch_size and kiln fit");
  if (gradient_checkpointing && std::find(policies.begin(), policies.end(), "none") != policies.end())
    return bad("remat_policy", "'none' contradicts --gradient_checkpointing (drop one of them)");
  if (any_budget && memory_budget.empty())
    return bad("memory_budget", "--remat_policy budget needs --memory_budget (e.g. 800MB, 24GiB)");
  {
    const std::vector<std::string> items = comma_list(report_to);
    for (const std::string& item : items) {
      if (item.empty())
        return bad("report_to", "empty item in '" + report_to + "' (expected none, tensorboard or all)");
      if (item != "none" && item != "tensorboard" && item != "all")
        return bad("report_to", "unknown value '" + item +
                                    "' (expected one of: none, tensorboard, all; kiln writes TensorBoard event files "
                                    "and metrics.jsonl, no other integration)");
      if (item == "none" && items.size() > 1)
        return bad("report_to", "'none' in a list with others: '" + report_to + "'");
    }
  }
  if (!logging_dir.empty() && !reports_tensorboard())
    return bad("logging_dir", "only applies with --report_to tensorboard (or all)");
  return Status::ok();
}

bool TrainConfig::reports_tensorboard() const {
  for (const std::string& item : comma_list(report_to))
    if (item == "tensorboard" || item == "all") return true;
  return false;
}

std::vector<std::string> comma_list(const std::string& text) {
  std::vector<std::string> items(1);
  for (char ch : text) {
    if (ch == ',')
      items.emplace_back();
    else
      items.back() += ch;
  }
  return items;
}

Expected<ShapeBuckets> parse_shape_buckets(const std::string& text) {
  ShapeBuckets b;
  const std::vector<std::string> items = comma_list(text);
  auto fail = [&](const std::string& why) { return bad("shape_buckets", "'" + text + "': " + why); };
  std::vector<int64_t> v;
  for (const std::string& item : items) {
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || errno != 0 || *end != '\0' || x <= 0 || x > kMaxDim)
      return fail("expected a number of buckets K or ascending lengths such as 32,64,128");
    if (!v.empty() && x <= v.back()) return fail("lengths must be ascending");
    v.push_back(x);
  }
  if (v.empty()) return fail("expected a number of buckets K or ascending lengths such as 32,64,128");
  if (v.size() == 1 && items.size() == 1)
    b.count = v[0];
  else
    b.lengths = std::move(v);
  return b;
}

Expected<int64_t> parse_byte_size(const std::string& text) {
  auto fail = [&]() -> Status {
    return bad("memory_budget", "expected a size such as 800MB, 24GiB or a byte count, got '" + text + "'");
  };
  if (text.empty()) return fail();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || end == text.c_str() || !(v > 0) || !std::isfinite(v)) return fail();
  std::string unit(end);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  std::string u;
  for (char ch : unit) u += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  static const std::map<std::string, double> units = {
      {"", 1},      {"b", 1},        {"kb", 1e3},        {"mb", 1e6},           {"gb", 1e9},
      {"tb", 1e12}, {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  auto it = units.find(u);
  if (it == units.end()) return fail();
  double bytes = v * it->second;
  if (bytes < 1 || bytes >= 9.2e18) return fail();  // e.g. 0.4 (rounds to no bytes)
  return static_cast<int64_t>(std::llround(bytes));
}

std::vector<ConfigField> config_fields(TrainConfig& c) {
  return {
      {"model", Kind::str, &c.model, "path of the .onnx model"},
      {"shape", Kind::shape_map, &c.shape, "dim_param bindings, e.g. batch=8,seq=64 (repeatable)"},
      {"train_data", Kind::str_list, &c.train_data,
       "NAME=FILE.npy (repeatable), one nanoGPT uint16 FILE.bin, or variable-length rows: FILE.jsonl (input_ids "
       "lists) or a Megatron indexed dataset PREFIX.idx"},
      {"eval_data", Kind::str_list, &c.eval_data, "as --train_data"},
      {"block_size", Kind::i64, &c.block_size,
       "token window length for .bin data (0, the default: the model's input length)"},
      {"pad_token_id", Kind::i64, &c.pad_token_id,
       "variable-length data: token id of padding (default 0; labels are padded with --ignore_index)"},
      {"max_length", Kind::i64, &c.max_length,
       "variable-length data: tokens per row the model reads (a causal LM row of n tokens reads n-1); longer rows "
       "are truncated; --shape_mode pad pads every batch to it (0: the longest row)"},
      {"shape_mode", Kind::str, &c.shape_mode,
       "variable-length data: pad (default: one program at --max_length) | specialize (one per batch length) | "
       "buckets (--shape_buckets lengths) | symbolic (one program, its sequence dim a symbol, "
       "planned at --max_length); bench takes a list: pad,specialize,buckets,symbolic"},
      {"shape_buckets", Kind::str, &c.shape_buckets,
       "--shape_mode buckets: K (default 4), the number of padded lengths planned from the data's length "
       "histogram, or the lengths themselves: 32,64,128"},
      {"symbolic_versions", Kind::str, &c.symbolic_versions,
       "--shape_mode symbolic, compiled backend: on (default) | off. on: a generated row kernel with a run-time "
       "row length also holds specialized versions chosen at launch by a guard (a row length that is a multiple "
       "of the vector width: no scalar remainder loop; one shorter than a vector: one masked vector iteration); "
       "off: the generic kernel only"},
      {"recompile_limit", Kind::i64, &c.recompile_limit,
       "--shape_mode specialize: programs built before batches pad up to a built length (Dynamo's default 8)"},
      {"group_by_length", Kind::boolean, &c.group_by_length,
       "variable-length data: batches of similar lengths (length-grouped megabatches, Hugging Face's sampler)"},
      {"dataloader_drop_last", Kind::boolean, &c.dataloader_drop_last,
       "drop the epoch's last partial batch (kiln's default true; false trains it with a program of its size)"},
      {"loss", Kind::str, &c.loss, "cross_entropy | mse | bce_with_logits | l1 | model"},
      {"label_input", Kind::str, &c.label_input, "graph input fed with the labels (default: labels)"},
      {"ignore_index", Kind::i64, &c.ignore_index, "label ignored by cross_entropy"},
      {"label_smoothing", Kind::f64, &c.label_smoothing, "cross_entropy label smoothing in [0, 1)"},
      {"freeze", Kind::str, &c.freeze, "regex of initializers NOT trained"},
      {"trainable", Kind::str, &c.trainable, "regex: only matching initializers are trained"},
      {"optim", Kind::str, &c.optim,
       "adamw_torch | adamw_8bit (alias adamw_bnb_8bit: 8-bit block-wise Adam state) | sgd; bench takes a list: "
       "adamw_torch,adamw_8bit"},
      {"learning_rate", Kind::f64, &c.learning_rate, "peak learning rate"},
      {"weight_decay", Kind::f64, &c.weight_decay, "decoupled weight decay (AdamW) / L2 (SGD)"},
      {"adam_beta1", Kind::f64, &c.adam_beta1, "AdamW beta1"},
      {"adam_beta2", Kind::f64, &c.adam_beta2, "AdamW beta2"},
      {"adam_epsilon", Kind::f64, &c.adam_epsilon, "AdamW epsilon"},
      {"momentum", Kind::f64, &c.momentum, "SGD momentum"},
      {"nesterov", Kind::boolean, &c.nesterov, "SGD Nesterov momentum"},
      {"max_grad_norm", Kind::f64, &c.max_grad_norm,
       "global gradient-norm clipping (0 disables it and the grad_norm metric, as Hugging Face)"},
      {"lr_scheduler_type", Kind::str, &c.lr_scheduler_type, "linear | cosine | constant | constant_with_warmup"},
      {"warmup_ratio", Kind::f64, &c.warmup_ratio, "warmup as a fraction of the total steps"},
      {"warmup_steps", Kind::i64, &c.warmup_steps, "warmup steps (overrides warmup_ratio when > 0)"},
      {"output_dir", Kind::str, &c.output_dir, "where metrics, checkpoints and model.onnx go"},
      {"per_device_train_batch_size", Kind::i64, &c.per_device_train_batch_size, "rows per micro-batch"},
      {"per_device_eval_batch_size", Kind::i64, &c.per_device_eval_batch_size, "rows per eval batch"},
      {"num_train_epochs", Kind::f64, &c.num_train_epochs, "epochs (fractional allowed; --max_steps > 0 overrides it)"},
      {"max_steps", Kind::i64, &c.max_steps, "total optimizer steps (> 0 overrides num_train_epochs)"},
      {"seed", Kind::u64, &c.seed, "seed of data shuffling and dropout"},
      {"logging_steps", Kind::i64, &c.logging_steps, "log every N steps"},
      {"eval_steps", Kind::i64, &c.eval_steps, "evaluate every N steps (0: only at the end)"},
      {"save_steps", Kind::i64, &c.save_steps, "checkpoint every N steps (0: none)"},
      {"save_total_limit", Kind::i64, &c.save_total_limit, "keep at most N checkpoints (0: all)"},
      {"resume_from_checkpoint", Kind::str, &c.resume_from_checkpoint,
       "checkpoint directory to resume from (\"latest\": newest in output_dir)"},
      {"overwrite_output_dir", Kind::boolean, &c.overwrite_output_dir,
       "delete output_dir's checkpoints of another run (steps past this run's start) instead of refusing to start"},
      {"bf16", Kind::boolean, &c.bf16, "bf16 mixed precision with fp32 master weights"},
      {"fp16", Kind::boolean, &c.fp16, "fp16 mixed precision with fp32 master weights and dynamic loss scaling"},
      {"autocast_min_flops", Kind::f64, &c.autocast_min_flops,
       "--bf16/--fp16: GEMMs and convolutions below this many FLOPs stay f32 (-1, the default: this CPU's "
       "break-even, one for products and one for convolutions; 0: all in low precision, as torch.autocast)"},
      {"fp16_init_scale", Kind::f64, &c.fp16_init_scale, "--fp16 initial loss scale (torch GradScaler init_scale)"},
      {"fp16_growth_interval", Kind::i64, &c.fp16_growth_interval,
       "--fp16: double the loss scale after N finite steps"},
      {"gradient_accumulation_steps", Kind::i64, &c.gradient_accumulation_steps,
       "micro-batches per optimizer step (an accumulation loop in the IR)"},
      {"accumulation_normalization", Kind::str, &c.accumulation_normalization,
       "tokens | microbatch: how accumulated losses are normalized (default: tokens for cross_entropy, else "
       "microbatch)"},
      {"ddp_timeout", Kind::f64, &c.ddp_timeout,
       "data-parallel jobs (mpirun): seconds a collective waits for the other ranks before the job fails"},
      {"ddp_bucket_cap_mb", Kind::f64, &c.ddp_bucket_cap_mb,
       "data-parallel jobs: gradient bucket size in MiB (one all-reduce per bucket; the first holds 1 MiB)"},
      {"zero_stage", Kind::i64, &c.zero_stage,
       "data-parallel jobs: 1 shards the optimizer state over the ranks (DeepSpeed's ZeRO stage 1), 0 keeps it whole"},
      {"backend", Kind::str, &c.backend,
       "compiled (default: fused kernels generated with LLVM) | eager (op by op, the reference); bench takes a list: "
       "eager,compiled"},
      {"cache_dir", Kind::str, &c.cache_dir, "compile cache folder (default $KILN_CACHE_DIR, else ~/.cache/kiln)"},
      {"no_cache", Kind::boolean, &c.no_cache, "compile generated kernels without the compile cache"},
      {"disable_dropout", Kind::boolean, &c.disable_dropout,
       "remove Dropout from the training program (deterministic runs, reference checks)"},
      {"untie_initializers", Kind::boolean, &c.untie_initializers,
       "train initializers apart that the exporter stored as copies, transposes, slices, broadcasts or Identity "
       "aliases of a parameter (by default they are one tied parameter, as in PyTorch)"},
      {"gradient_checkpointing", Kind::boolean, &c.gradient_checkpointing,
       "recompute each repeated layer in backward (= --remat_policy blocks)"},
      {"remat_policy", Kind::str, &c.remat_policy,
       "none | blocks | sqrt | min-cut | budget: what the backward pass recomputes (default: min-cut for --backend "
       "compiled, as torch.compile's partitioner; none for eager); bench takes a list: none,blocks"},
      {"memory_budget", Kind::str, &c.memory_budget,
       "planned peak budget for --remat_policy budget, --auto_fit and kiln fit: bytes, 800MB, 24GiB (auto: the "
       "memory available less 10%, with --auto_fit, --auto_find_batch_size and kiln fit)"},
      {"auto_fit", Kind::boolean, &c.auto_fit,
       "choose the recipe (batch x accumulation, bf16, remat policy, 8-bit AdamW) that fits --memory_budget, as "
       "kiln fit does; --bf16/--fp16, --remat_policy and --optim given stay fixed; the batch flags set the "
       "effective batch (fixed only with --effective_batch_size)"},
      {"auto_find_batch_size", Kind::boolean, &c.auto_find_batch_size,
       "as --auto_fit with --memory_budget auto unless a budget is given (Hugging Face's flag)"},
      {"effective_batch_size", Kind::i64, &c.effective_batch_size,
       "samples per optimizer step that --auto_fit and kiln fit keep (default: per_device_train_batch_size x "
       "gradient_accumulation_steps)"},
      {"disable_tqdm", Kind::boolean, &c.disable_tqdm,
       "no live progress bar on a terminal: plain log lines every --logging_steps steps"},
      {"report_to", Kind::str, &c.report_to,
       "none | tensorboard | all: also write TensorBoard event files under --logging_dir"},
      {"logging_dir", Kind::str, &c.logging_dir, "TensorBoard log folder (default OUTPUT_DIR/runs/<date>_<host>)"},
  };
}

namespace {

bool parse_i64(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

bool parse_f64(const std::string& s, double& out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (errno == ERANGE || *end != '\0') return false;
  out = v;
  return true;
}

}  // namespace

Status apply_flag_values(TrainConfig& cfg, const std::map<std::string, std::vector<std::string>>& given) {
  auto fields = config_fields(cfg);
  for (auto& [name, vals] : given) {
    const ConfigField* f = nullptr;
    for (auto& c : fields)
      if (c.name == name) f = &c;
    if (!f) return Status::error("--" + name + ": not a training option");
    if (f->kind == Kind::str_list) static_cast<std::vector<std::string>*>(f->ptr)->clear();
    if (f->kind == Kind::boolean && vals.empty()) KILN_RETURN_IF_ERROR(set_config_field(*f, "true"));
    for (auto& v : vals) KILN_RETURN_IF_ERROR(set_config_field(*f, v));
  }
  return Status::ok();
}

Status check_eval_schedule(const TrainConfig& cfg) {
  if (cfg.eval_steps > 0 && cfg.eval_data.empty())
    return Status::error("--eval_steps " + std::to_string(cfg.eval_steps) +
                         ": no --eval_data to evaluate on (give --eval_data, or --eval_steps 0)");
  return Status::ok();
}

void eval_off_without_eval_data(TrainConfig& cfg, const std::map<std::string, std::vector<std::string>>& given) {
  if (given.count("eval_data") && cfg.eval_data.empty() && !given.count("eval_steps")) cfg.eval_steps = 0;
}

Status set_config_field(const ConfigField& f, const std::string& text) {
  switch (f.kind) {
    case Kind::str:
      *static_cast<std::string*>(f.ptr) = text;
      return Status::ok();
    case Kind::str_list:  // an empty item empties the list: `--eval_data ""` means none
      if (text.empty())
        static_cast<std::vector<std::string>*>(f.ptr)->clear();
      else
        static_cast<std::vector<std::string>*>(f.ptr)->push_back(text);
      return Status::ok();
    case Kind::i64: {
      int64_t v;
      if (!parse_i64(text, v)) return bad(f.name, "expected an integer, got '" + text + "'");
      *static_cast<int64_t*>(f.ptr) = v;
      return Status::ok();
    }
    case Kind::u64: {
      int64_t v;
      if (!parse_i64(text, v) || v < 0) return bad(f.name, "expected a non-negative integer, got '" + text + "'");
      *static_cast<uint64_t*>(f.ptr) = static_cast<uint64_t>(v);
      return Status::ok();
    }
    case Kind::f64: {
      double v;
      if (!parse_f64(text, v)) return bad(f.name, "expected a number, got '" + text + "'");
      *static_cast<double*>(f.ptr) = v;
      return Status::ok();
    }
    case Kind::boolean: {
      std::string t;
      for (char ch : text) t += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      bool* b = static_cast<bool*>(f.ptr);
      // Hugging Face's string_to_bool: yes/true/t/y/1 and no/false/f/n/0, any case.
      if (t == "" || t == "true" || t == "1" || t == "yes" || t == "t" || t == "y")
        *b = true;
      else if (t == "false" || t == "0" || t == "no" || t == "f" || t == "n")
        *b = false;
      else
        return bad(f.name, "expected true or false, got '" + text + "'");
      return Status::ok();
    }
    case Kind::shape_map: {
      auto* m = static_cast<std::map<std::string, int64_t>*>(f.ptr);
      std::stringstream ss(text);
      std::string item;
      bool any = false;
      while (std::getline(ss, item, ',')) {
        if (item.empty()) continue;
        auto eq = item.find('=');
        int64_t v;
        if (eq == std::string::npos || eq == 0 || !parse_i64(item.substr(eq + 1), v))
          return bad(f.name, "expected NAME=INT[,NAME=INT...], got '" + text + "'");
        if (v <= 0) return bad(f.name, "dim '" + item.substr(0, eq) + "' must be > 0, got " + std::to_string(v));
        if (v > kMaxDim)
          return bad(f.name,
                     "dim '" + item.substr(0, eq) + "' must be at most 2^31 (2147483648), got " + std::to_string(v));
        (*m)[item.substr(0, eq)] = v;
        any = true;
      }
      if (!any) return bad(f.name, "expected NAME=INT[,NAME=INT...], got '" + text + "'");
      return Status::ok();
    }
  }
  return Status::error("internal: unknown config field kind");
}

Status config_from_json_text(const std::string& text, const std::string& origin, TrainConfig& cfg) {
  if (std::string deep = io::json_nesting_error(text); !deep.empty())
    return Status::error(origin + ": invalid JSON (" + deep + ")");
  nlohmann::json j;
  try {
    j = io::parse_json_untrusted(text);
  } catch (const std::exception& e) {
    std::string what = e.what();
    return Status::error(origin + ": invalid JSON (" + what.substr(0, what.find('\n')) + ")");
  }
  if (!j.is_object()) return Status::error(origin + ": expected a JSON object of option names to values");
  auto fields = config_fields(cfg);
  for (auto it = j.begin(); it != j.end(); ++it) {
    const ConfigField* f = nullptr;
    for (auto& x : fields)
      if (x.name == it.key()) f = &x;
    if (!f) {
      std::set<std::string> names;
      for (auto& x : fields) names.insert(x.name);
      const std::string hint = unknown_flag_hint(it.key(), names, /*as_key=*/true);
      return Status::error(origin + ": unknown key '" + it.key() + "'" + (hint.empty() ? "" : " (" + hint + ")"));
    }
    const auto& v = it.value();
    auto type_err = [&](const char* want) {
      return Status::error(origin + ": key '" + it.key() + "': expected " + want + ", got " + io::json_excerpt(v));
    };
    switch (f->kind) {
      case Kind::str:
        // A byte count may be written as a JSON number ({"memory_budget": 800000000}).
        if (f->name == "memory_budget" && v.is_number_integer()) {
          *static_cast<std::string*>(f->ptr) = std::to_string(v.get<int64_t>());
          break;
        }
        if (!v.is_string()) return type_err("a string");
        *static_cast<std::string*>(f->ptr) = v.get<std::string>();
        break;
      case Kind::str_list: {
        auto* l = static_cast<std::vector<std::string>*>(f->ptr);
        l->clear();
        if (v.is_string()) {  // "" means none, as on the command line
          if (!v.get<std::string>().empty()) l->push_back(v.get<std::string>());
        } else if (v.is_array()) {
          for (auto& e : v) {
            if (!e.is_string()) return type_err("a string or a list of strings");
            if (!e.get<std::string>().empty()) l->push_back(e.get<std::string>());
          }
        } else {
          return type_err("a string or a list of strings");
        }
        break;
      }
      case Kind::i64:  // (2^63 and above wrapped to negative values)
        if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)))
          return type_err("an integer below 2^63");
        *static_cast<int64_t*>(f->ptr) = v.get<int64_t>();
        break;
      case Kind::u64:
        if (!v.is_number_unsigned()) return type_err("a non-negative integer");
        *static_cast<uint64_t*>(f->ptr) = v.get<uint64_t>();
        break;
      case Kind::f64:
        if (!v.is_number()) return type_err("a number");
        *static_cast<double*>(f->ptr) = v.get<double>();
        break;
      case Kind::boolean:
        if (!v.is_boolean()) return type_err("true or false");
        *static_cast<bool*>(f->ptr) = v.get<bool>();
        break;
      case Kind::shape_map: {
        if (!v.is_object()) return type_err("an object of dim names to integers");
        auto* m = static_cast<std::map<std::string, int64_t>*>(f->ptr);
        m->clear();
        for (auto e = v.begin(); e != v.end(); ++e) {
          if (!e.value().is_number_integer()) return type_err("an object of dim names to integers");
          (*m)[e.key()] = e.value().get<int64_t>();
        }
        break;
      }
    }
  }
  return Status::ok();
}

Status load_config_json(const std::string& path, TrainConfig& cfg) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::error(path + ": config file not found");
  KILN_ASSIGN_OR_RETURN(std::string text, io::read_file(path));
  return config_from_json_text(text, path, cfg);
}

namespace {

/// Levenshtein distance (insertions, deletions, substitutions: cost 1 each).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string unknown_flag_hint(const std::string& name_in, const std::set<std::string>& suggest, bool as_key) {
  const std::string pre = as_key ? "'" : "--", post = as_key ? "'" : "";
  // HfArgumentParser also takes dashes for underscores (--per-device-train-batch-size).
  std::string name = name_in;
  std::replace(name.begin(), name.end(), '-', '_');
  if (name != name_in && suggest.count(name)) return "did you mean " + pre + name + post + "?";
  // Hugging Face TrainingArguments that kiln does not take, and what it does instead.
  static const std::map<std::string, std::string> hf = {
      {"eval_strategy", "kiln evaluates at the end and every --eval_steps N steps when --eval_data is given"},
      {"evaluation_strategy", "kiln evaluates at the end and every --eval_steps N steps when --eval_data is given"},
      {"save_strategy", "kiln saves a checkpoint every --save_steps N steps"},
      {"logging_strategy", "kiln logs every --logging_steps N steps"},
      {"load_best_model_at_end", "kiln keeps no best checkpoint; each checkpoint's metrics.jsonl holds its eval lines"},
      {"metric_for_best_model", "kiln keeps no best checkpoint; each checkpoint's metrics.jsonl holds its eval lines"},
      {"greater_is_better", "kiln keeps no best checkpoint; each checkpoint's metrics.jsonl holds its eval lines"},
      {"dataloader_num_workers", "kiln reads its data files in-process"},
      {"dataloader_pin_memory", "kiln reads its data files in-process"},
      {"push_to_hub", "kiln saves to --output_dir only"},
      {"fp32", "kiln trains in fp32 unless --bf16 or --fp16 is given"},
      {"tf32", "kiln trains in fp32 unless --bf16 or --fp16 is given"},
      {"do_train", "kiln train trains; it evaluates when --eval_data is given"},
      {"do_eval", "kiln train evaluates when --eval_data is given"},
      {"do_predict", "kiln run computes a model's outputs"},
      {"eval_accumulation_steps", "kiln evaluates one batch of --per_device_eval_batch_size rows at a time"},
      {"data_seed", "--seed decides the data order as well"},
      {"logging_first_step", "kiln logs every --logging_steps N steps"},
      {"save_safetensors", "kiln always saves safetensors"},
      {"save_only_model", "kiln's checkpoints always hold the optimizer state"},
      {"use_cpu", "kiln runs on the CPU"},
      {"no_cuda", "kiln runs on the CPU"},
      {"fp16_full_eval", "evaluation runs in the training precision"},
      {"bf16_full_eval", "evaluation runs in the training precision"},
      {"fp16_opt_level", "--fp16 is mixed precision with loss scaling"},
      {"half_precision_backend", "--bf16 and --fp16 are kiln's own"},
      {"torch_compile", "kiln compiles by default (--backend compiled)"},
      {"run_name", "kiln names a run by its --output_dir"},
      {"log_level", "kiln prints one log line every --logging_steps steps"},
      {"remove_unused_columns", "kiln feeds the graph inputs named by --train_data NAME=FILE"},
      {"label_names", "--label_input names the label input"},
      {"dataloader_drop_last", "kiln drops the last partial batch of an epoch"},
      {"ignore_data_skip", "a resume continues the data order where the checkpoint left it"},
      {"local_rank", "kiln trains on one device"},
      {"deepspeed", "kiln trains on one device"},
      {"fsdp", "kiln trains on one device"},
      {"hub_model_id", "kiln saves to --output_dir only"},
      {"optim_args", "the optimizer's settings are flags (--adam_beta1, --momentum, ...)"},
      {"lr_scheduler_kwargs", "the schedule's settings are flags (--warmup_steps, --warmup_ratio)"},
      {"gradient_checkpointing_kwargs", "--remat_policy and --memory_budget choose what is recomputed"},
      {"eval_delay", "kiln evaluates every --eval_steps N steps"},
      {"eval_on_start", "kiln evaluates every --eval_steps N steps and at the end"},
      {"neftune_noise_alpha", "not supported"},
  };
  // Other spellings of flags kiln has (Hugging Face's own, and common short forms).
  static const std::map<std::string, std::string> alias = {
      {"lr", "learning_rate"},
      {"batch_size", "per_device_train_batch_size"},
      {"bs", "per_device_train_batch_size"},
      {"train_batch_size", "per_device_train_batch_size"},
      {"eval_batch_size", "per_device_eval_batch_size"},
      {"epochs", "num_train_epochs"},
      {"num_epochs", "num_train_epochs"},
      {"wd", "weight_decay"},
      {"steps", "max_steps"},
      {"grad_accum", "gradient_accumulation_steps"},
      {"label_smoothing_factor", "label_smoothing"},
      {"warmup", "warmup_steps"},
      {"optimizer", "optim"},
      {"scheduler", "lr_scheduler_type"},
      {"per_gpu_train_batch_size", "per_device_train_batch_size"},
      {"per_gpu_eval_batch_size", "per_device_eval_batch_size"},
  };
  const std::string kind = as_key ? "key" : "flag";
  if (auto h = hf.find(name); h != hf.end()) return "a Hugging Face " + kind + " kiln does not take: " + h->second;
  if (auto al = alias.find(name); al != alias.end() && suggest.count(al->second))
    return "did you mean " + pre + al->second + post + "?";
  const std::vector<std::string> best = near_names(name, suggest);
  if (best.empty()) return "";
  std::string r = "did you mean ";
  for (size_t i = 0; i < best.size(); ++i) r += (i ? " or " : "") + pre + best[i] + post;
  return r + "?";
}

std::vector<std::string> near_names(const std::string& name, const std::set<std::string>& candidates) {
  // One edit for short names, two for longer ones (fp32 -> fp16 or half -> help would
  // mislead); names of two or fewer characters are never suggested; when several are
  // equally near, all of them (f16: bf16 or fp16), up to three.
  std::vector<std::string> best;
  const size_t max_d = name.size() <= 6 ? 1 : 2;
  size_t best_d = max_d;
  for (const std::string& k : candidates) {
    if (k.size() <= 2) continue;
    const size_t d = edit_distance(name, k);
    if (d > max_d) continue;
    if (best.empty() || d < best_d) best_d = d, best.clear();
    if (d == best_d) best.push_back(k);
  }
  if (best.size() > 3) best.clear();
  return best;
}

std::string unknown_flag_message(const std::vector<std::string>& args, const std::set<std::string>& known,
                                 const std::set<std::string>* suggest, const std::set<std::string>* value_flags) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    // "--name", "--name=value", or "-name" (argparse-style single dash, not a number).
    size_t dashes = a.compare(0, 2, "--") == 0
                        ? 2
                        : (a.size() >= 2 && a[0] == '-' && std::isalpha(static_cast<unsigned char>(a[1])) ? 1 : 0);
    if (dashes == 0 || a.size() <= dashes) continue;
    const size_t eq = a.find('=');
    const std::string name = a.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
    if (name.empty()) continue;
    if (known.count(name)) {
      if (value_flags && eq == std::string::npos && value_flags->count(name)) ++i;  // its value, whatever it looks like
      continue;
    }
    const std::string hint = unknown_flag_hint(name, suggest ? *suggest : known);
    return "unknown flag " + a.substr(0, dashes) + name + " (" + (hint.empty() ? "--help lists the flags" : hint) + ")";
  }
  return "";
}

Status normalize_flag_values(std::vector<std::string>& args, const std::set<std::string>& value_flags,
                             const std::set<std::string>& switches, const std::set<std::string>& short_names) {
  auto lower = [](std::string t) {
    for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return t;
  };
  // Hugging Face's string_to_bool words.
  static const std::set<std::string> bool_words = {"yes", "true", "t", "y", "1", "no", "false", "f", "n", "0"};
  // The flag a token names without a value ("--name", or "-x" for a short option); "".
  auto flag_name = [&](const std::string& a) -> std::string {
    if (a.find('=') != std::string::npos) return "";
    if (a.size() > 2 && a.compare(0, 2, "--") == 0) return a.substr(2);
    if (a.size() >= 2 && a[0] == '-' && a[1] != '-' && short_names.count(a.substr(1))) return a.substr(1);
    return "";
  };
  // Whether the next token is a flag rather than a value: any "--name", or a single-dash
  // option this command has ("-h", "-o"); "-foo" or "-1e-3" stay values.
  auto is_flag = [&](const std::string& a) {
    return (a.size() > 2 && a.compare(0, 2, "--") == 0) ||
           (a.size() >= 2 && a[0] == '-' && a[1] != '-' && short_names.count(a.substr(1, a.find('=') - 1)));
  };
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const std::string name = flag_name(a);
    if (!name.empty() && switches.count(name) && i + 1 < args.size() && bool_words.count(lower(args[i + 1]))) {
      out.push_back(a + "=" + args[++i]);  // Hugging Face's "--bf16 True"
      continue;
    }
    if (!name.empty() && value_flags.count(name) && (i + 1 == args.size() || is_flag(args[i + 1])))
      return Status::error(a + " needs a value" +
                           (i + 1 == args.size() ? std::string(" (it is the last argument)")
                                                 : " (the next argument is the flag " + args[i + 1] + ")"));
    out.push_back(a);
  }
  args = std::move(out);
  return Status::ok();
}

std::string config_to_json(const TrainConfig& cfg_in) {
  TrainConfig cfg = cfg_in;
  nlohmann::json j = nlohmann::json::object();
  for (auto& f : config_fields(cfg)) {
    switch (f.kind) {
      case Kind::str:
        j[f.name] = *static_cast<std::string*>(f.ptr);
        break;
      case Kind::str_list:
        j[f.name] = *static_cast<std::vector<std::string>*>(f.ptr);
        break;
      case Kind::i64:
        j[f.name] = *static_cast<int64_t*>(f.ptr);
        break;
      case Kind::u64:
        j[f.name] = *static_cast<uint64_t*>(f.ptr);
        break;
      case Kind::f64:
        j[f.name] = *static_cast<double*>(f.ptr);
        break;
      case Kind::boolean:
        j[f.name] = *static_cast<bool*>(f.ptr);
        break;
      case Kind::shape_map: {
        nlohmann::json m = nlohmann::json::object();
        for (auto& [k, v] : *static_cast<std::map<std::string, int64_t>*>(f.ptr)) m[k] = v;
        j[f.name] = m;
        break;
      }
    }
  }
  return j.dump(2);
}

}  // namespace kiln::runtime
