// The trainer loop: data -> train_step -> state, logging, eval, checkpoints (see trainer.h).
#include "runtime/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "runtime/backend.h"
#include "runtime/buckets.h"
#include "runtime/comm.h"
#include "runtime/interpreter.h"
#include "runtime/interrupt.h"
#include "runtime/metrics.h"
#include "runtime/tensorboard.h"

namespace kiln::runtime {

using ir::DType;
using ir::Tensor;

Expected<std::vector<DataInputSpec>> data_input_specs(const ir::Graph& g, const std::vector<std::string>& names) {
  std::vector<DataInputSpec> r;
  for (auto& n : names) {
    const ir::Value* v = nullptr;
    for (ir::Value* in : g.inputs)
      if (in->name == n) v = in;
    if (!v) return Status::error("graph '" + g.name + "' has no data input '" + n + "'");
    r.push_back({v->name, v->dtype, v->shape});
  }
  return r;
}

namespace {

/// A finite loss above this (in magnitude) gets one warning: no real loss comes near it
/// (garbage weights or unscaled inputs give 1e30 where a cross entropy starts near ln V).
constexpr double kImplausibleLoss = 1e20;

/// A config field's value as a flag would spell it: strings and lists as written (an empty
/// one as "none"), numbers and booleans as JSON prints them.
std::string flag_value(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>().empty() ? "none" : v.get<std::string>();
  if (v.is_array()) {
    std::string r;
    for (auto& e : v) r += (r.empty() ? "" : ",") + (e.is_string() ? e.get<std::string>() : e.dump());
    return r.empty() ? "none" : r;
  }
  return v.dump();
}

/// The flags among `names` whose values differ between the run that wrote a checkpoint
/// (`saved_json`, config_to_json of that run; empty or unparsable: none known) and
/// `cfg`, as "--name saved (this run: current)" pieces.
std::vector<std::string> changed_flags(const std::string& saved_json, const TrainConfig& cfg,
                                       std::initializer_list<const char*> names) {
  std::vector<std::string> out;
  nlohmann::json saved, now;
  try {
    saved = nlohmann::json::parse(saved_json);
    now = nlohmann::json::parse(config_to_json(cfg));
  } catch (const std::exception&) {
    return out;
  }
  // The same data file spelled once relative, once absolute.
  auto same_file = [](const std::string& a, const std::string& b) {
    auto split = [](const std::string& v) {
      const size_t eq = v.find('=');
      return eq == std::string::npos ? std::make_pair(std::string(), v)
                                     : std::make_pair(v.substr(0, eq), v.substr(eq + 1));
    };
    auto [na, pa] = split(a);
    auto [nb, pb] = split(b);
    if (na != nb) return false;
    if (pa == pb) return true;
    // A relative path is taken from the current directory (the checkpoint does not say
    // which directory its run started in): the same file is then the same absolute path.
    std::error_code e1, e2;
    const auto ca = std::filesystem::weakly_canonical(std::filesystem::absolute(pa, e1), e1);
    const auto cb = std::filesystem::weakly_canonical(std::filesystem::absolute(pb, e2), e2);
    return !e1 && !e2 && ca == cb;
  };
  auto same = [&](const nlohmann::json& a, const nlohmann::json& b, const std::string& n) {
    if (a == b) return true;
    if ((n != "train_data" && n != "eval_data") || !a.is_array() || !b.is_array() || a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!a[i].is_string() || !b[i].is_string() || !same_file(a[i].get<std::string>(), b[i].get<std::string>()))
        return false;
    return true;
  };
  for (const char* n : names)
    if (saved.contains(n) && now.contains(n) && !same(saved[n], now[n], n))
      out.push_back(std::string("--") + n + " " + flag_value(saved[n]) + " (this run: " + flag_value(now[n]) + ")");
  return out;
}

/// The flags that decide which tensors a training program holds as state: a checkpoint
/// whose state does not match this program names those that changed (the model is
/// compared by its tensors, not by its path: a moved or copied file is the same model).
constexpr std::initializer_list<const char*> kStateFlags = {"freeze", "trainable", "optim", "momentum", "fp16", "bf16"};
/// The flags that decide the data order (rows per step, the rows themselves).
constexpr std::initializer_list<const char*> kDataFlags = {
    "per_device_train_batch_size", "gradient_accumulation_steps", "train_data", "block_size", "group_by_length",
    "dataloader_drop_last"};
/// Flags whose change a resume accepts, with a warning (the new values apply from the
/// next step; Hugging Face's Trainer would keep the saved optimizer's and scheduler's).
constexpr std::initializer_list<const char*> kResumeWarnFlags = {"seed",
                                                                 "max_length",
                                                                 "pad_token_id",
                                                                 "shape_mode",
                                                                 "shape_buckets",
                                                                 "recompile_limit",
                                                                 "group_by_length",
                                                                 "learning_rate",
                                                                 "weight_decay",
                                                                 "adam_beta1",
                                                                 "adam_beta2",
                                                                 "adam_epsilon",
                                                                 "nesterov",
                                                                 "max_grad_norm",
                                                                 "lr_scheduler_type",
                                                                 "warmup_ratio",
                                                                 "warmup_steps",
                                                                 "max_steps",
                                                                 "num_train_epochs",
                                                                 "loss",
                                                                 "label_smoothing",
                                                                 "ignore_index",
                                                                 "accumulation_normalization",
                                                                 "per_device_train_batch_size",
                                                                 "gradient_accumulation_steps",
                                                                 "fp16_init_scale",
                                                                 "fp16_growth_interval",
                                                                 "autocast_min_flops",
                                                                 "disable_dropout"};

std::string join_flags(const std::vector<std::string>& f) {
  std::string r;
  for (auto& s : f) r += (r.empty() ? "" : ", ") + s;
  return r;
}

bool same_layout(const Tensor& a, const Tensor& b) { return a.dtype() == b.dtype() && a.dims() == b.dims(); }

/// One memcpy of the state copy-back.
struct CopyTask {
  void* dst;
  const void* src;
  size_t bytes;
};

/// Runs `tasks` split into 1 MiB pieces across the OpenMP threads (a copy of the whole
/// optimizer state is bound by memory bandwidth, which one core does not saturate).
void copy_chunks(const std::vector<CopyTask>& tasks) {
  constexpr size_t kPiece = 1 << 20;
  std::vector<CopyTask> pieces;
  for (const CopyTask& t : tasks)
    for (size_t b = 0; b < t.bytes; b += kPiece)
      pieces.push_back(
          {static_cast<char*>(t.dst) + b, static_cast<const char*>(t.src) + b, std::min(kPiece, t.bytes - b)});
  const int64_t n = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(static) if (n > 1)
  for (int64_t i = 0; i < n; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
}

std::string describe(const Tensor& t) {
  return std::string(ir::dtype_name(t.dtype())) + " " + ir::dims_to_string(t.dims());
}

/// Argmax accuracy of logits (..., C) against integer labels (...), skipping `ignore`.
/// Returns {correct, counted}; counted = -1 when the shapes do not pair up.
std::pair<int64_t, int64_t> accuracy_counts(const Tensor& logits, const Tensor& labels, int64_t ignore) {
  if (logits.rank() < 1 || !ir::is_integer(labels.dtype())) return {0, -1};
  const int64_t C = logits.dim(-1);
  if (C <= 0 || labels.numel() * C != logits.numel()) return {0, -1};
  int64_t correct = 0, counted = 0;
  const bool f32 = logits.dtype() == DType::f32;
  const float* lf = f32 ? logits.data<float>() : nullptr;
  for (int64_t r = 0; r < labels.numel(); ++r) {
    int64_t y = labels.get_i64(r);
    if (y == ignore) continue;
    int64_t best = 0;
    double bv = f32 ? lf[r * C] : logits.get_f64(r * C);
    for (int64_t c = 1; c < C; ++c) {
      double v = f32 ? lf[r * C + c] : logits.get_f64(r * C + c);
      if (v > bv) bv = v, best = c;
    }
    correct += best == y;
    ++counted;
  }
  return {correct, counted};
}

}  // namespace

/// "8 rows x 2 microbatches padded to 128 tokens" (the length only for variable-length
/// data; a symbolic program's is its bound).
static std::string describe_shape(const StepShape& s, const std::optional<ShapeChooser>& chooser) {
  std::string r = std::to_string(s.micro_rows) + (s.micro_rows == 1 ? " row" : " rows");
  if (s.trips > 1) r += " x " + std::to_string(s.trips) + " microbatches";
  if (chooser && chooser->mode() == ShapeMode::symbolic)
    r += " of up to " + std::to_string(chooser->max_length()) + " tokens (--shape_mode symbolic, --max_length)";
  else if (s.length > 0)
    r += " padded to " + std::to_string(s.length) + " tokens (--max_length bounds it)";
  return r;
}

Expected<Trainer> Trainer::create(const TrainConfig& cfg, const TrainGraphs& given, const Dataset* train_data,
                                  const Dataset* eval_data, TrainerOptions opts) {
  KILN_RETURN_IF_ERROR(cfg.validate());
  if (!train_data) return Status::error("trainer: no training data");
  if (!given.train_step && !opts.programs) return Status::error("trainer: no train_step graph");
  Trainer t;
  t.cfg_ = cfg;
  t.train_ = train_data;
  t.eval_ = eval_data;
  t.opts_ = opts;
  // Variable-length data: the padded length of each batch (runtime/shapes.h).
  if (train_data->is_sequences()) {
    if (cfg.shape_mode.find(',') != std::string::npos)
      return Status::error("--shape_mode: one mode per run (a list such as '" + cfg.shape_mode +
                           "' is for kiln bench)");
    KILN_ASSIGN_OR_RETURN(ShapeMode mode, parse_shape_mode(cfg.shape_mode));
    if (mode != ShapeMode::pad && train_data->fixed_length() > 0)
      return Status::error("--shape_mode " + cfg.shape_mode + ": the model's input '" + train_data->token_input() +
                           "' has a fixed sequence length of " + std::to_string(train_data->fixed_length()) +
                           "; variable lengths need a model exported with a dynamic sequence axis "
                           "(dynamic_axes={'" +
                           train_data->token_input() + "': {0: 'batch', 1: 'seq'}})");
    std::vector<int64_t> bounds;
    if (mode == ShapeMode::buckets) {
      KILN_ASSIGN_OR_RETURN(ShapeBuckets sb, parse_shape_buckets(cfg.shape_buckets));
      auto hist = train_data->length_histogram();
      if (eval_data && eval_data->is_sequences())
        for (auto& [len, n] : eval_data->length_histogram()) hist[len] += n;
      auto plan = sb.count > 0 ? plan_buckets(hist, sb.count) : evaluate_buckets(hist, sb.lengths);
      if (!plan) return Status::error("--shape_buckets " + cfg.shape_buckets + ": " + plan.message());
      bounds = plan->boundaries;
    }
    const int64_t max_len =
        std::max(train_data->max_length(), eval_data && eval_data->is_sequences() ? eval_data->max_length() : 0);
    t.chooser_.emplace(mode, max_len, bounds, cfg.recompile_limit);
  }
  t.micro_rows_ = cfg.per_device_train_batch_size;
  t.trips_ = cfg.gradient_accumulation_steps;
  TrainGraphs graphs = given;
  if (graphs.train_step) {
    // The batch shapes come from the program (its signature); the config only for graphs
    // built without one.
    if (graphs.microbatch_rows > 0) t.micro_rows_ = graphs.microbatch_rows;
    if (graphs.accumulation_steps > 0) t.trips_ = graphs.accumulation_steps;
  }
  t.rows_per_step_ = t.micro_rows_ * t.trips_;
  // A data-parallel job (runtime/comm.h): each step takes one global batch of world_size
  // x rows_per_step rows from the one seeded order; rank r trains on its contiguous slice
  // [r * rows_per_step, (r + 1) * rows_per_step). Rank 0 alone logs, evaluates and saves.
  if (comm::Communicator* w = comm::world()) {
    t.world_ = w->world_size();
    t.rank_ = w->rank();
    if (!cfg.dataloader_drop_last)
      return Status::error(
          "--dataloader_drop_last false is not supported in a data-parallel job: the epoch's last "
          "partial batch would split unevenly over the " +
          std::to_string(t.world_) + " ranks (whole global batches of " + std::to_string(t.world_) + " x " +
          std::to_string(t.rows_per_step_) + " rows only; leave it at true)");
    if (t.rank_ != 0) {
      static std::ostream quiet(nullptr);
      t.opts_.out = &quiet;
      t.opts_.progress = 0;
      t.opts_.write_files = false;
    }
  }
  t.job_rows_ = t.rows_per_step_ * t.world_;
  t.job_writes_ = opts.write_files;
  t.steps_per_epoch_ = train_data->steps_per_epoch(t.job_rows_);
  if (t.steps_per_epoch_ <= 0)
    return Status::error("--train_data " + train_data->files() + ": " + std::to_string(train_data->num_rows()) +
                         " rows, fewer than one step of " + std::to_string(t.job_rows_) +
                         (t.world_ > 1 ? " (ranks x " : " (") +
                         "--per_device_train_batch_size x --gradient_accumulation_steps)");
  const StepShape first_shape = t.step_shape(0);
  if (!graphs.train_step) {
    auto g = opts.programs(first_shape, t.rebuild_reason(first_shape, "the first step"));
    if (!g) return g.status().with_context("the program of " + describe_shape(first_shape, t.chooser_));
    graphs = *g;
    if (!graphs.train_step) return Status::error("trainer: the program provider gave no train_step graph");
  }
  if (eval_data && !graphs.eval) return Status::error("trainer: eval data given but the program has no eval graph");
  t.g_ = graphs;
  const ir::Graph& g = *graphs.train_step;
  // The backend that runs the program (runtime/backend.h): the one the graphs name, else
  // the host's compiled backend when they come with kernels or an arena, else the
  // reference (eager). Both host backends run a graph without kernels the same way.
  const std::string backend_name =
      !graphs.backend.empty() ? graphs.backend : (graphs.train_program || graphs.train_arena ? "compiled" : "eager");
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(backend_name));
  t.backend_ = std::move(backend);

  // State, from the graph's bindings.
  for (const ir::StateBinding& sb : g.state) {
    if (!sb.input || !sb.output)
      return Status::error("train_step: a state binding of kind '" + sb.kind + "' lacks its input or output");
    if (!sb.initial) return Status::error("train_step: state '" + sb.input->name + "' has no initial value");
    if (!g.is_graph_output(sb.output))
      return Status::error("train_step: state output '" + sb.output->name + "' is not a graph output");
    t.state_[sb.input->name] = sb.initial->clone();
    t.state_kind_[sb.input->name] = sb.kind;
    if (!sb.full_dims.empty()) t.state_full_[sb.input->name] = sb.full_dims;
    t.state_output_[sb.input->name] = sb.output->name;
  }
  // Given graphs are the program of whole steps at their own length; a provider's are
  // the first step's.
  StepShape shape = first_shape;
  if (given.train_step) {
    shape = StepShape{t.micro_rows_, t.trips_, 0};
    if (train_data->is_sequences())
      for (ir::Value* in : g.inputs)
        if (in->name == train_data->token_input() && in->shape.rank() == 2 && in->shape.dims[1].is_static())
          shape.length = in->shape.dims[1].value;
  }
  // A program whose batch dim is symbolic runs every row count (runtime/shapes.h).
  t.symbolic_rows_ =
      t.chooser_ && t.chooser_->mode() == ShapeMode::symbolic && symbolic_rows(*graphs.train_step, graphs.data_inputs);
  t.eval_partial_ = t.symbolic_rows_ && eval_data && !eval_data->is_tokens() && graphs.eval &&
                    symbolic_rows(*graphs.eval, graphs.data_inputs);
  KILN_ASSIGN_OR_RETURN(t.first_, t.add_variant(t.program_key(shape), graphs));
  t.first_shape_ = shape;
  t.last_shape_ = shape;
  if (t.chooser_ && shape.length > 0) t.chooser_->add_built(shape.length);
  t.total_steps_ = cfg.total_steps(t.steps_per_epoch_);
  {
    // The LR schedule of this run (the program's inputs default to the build's counts).
    const int64_t warmup = cfg.warmup(t.total_steps_);
    const std::map<std::string, double> counts = {
        {ir::kScheduleTotalInput, double(t.total_steps_)},
        {ir::kScheduleWarmupInput, double(warmup)},
        {ir::kScheduleDecayInput, double(std::max<int64_t>(1, t.total_steps_ - warmup))}};
    for (ir::Value* in : g.inputs)
      if (auto c = counts.find(in->name); c != counts.end()) {
        Tensor v(in->dtype, {});
        v.set_f64(0, c->second);
        t.schedule_feeds_[in->name] = v;
      }
  }
  t.eval_rows_ = graphs.eval_rows > 0 ? graphs.eval_rows : cfg.per_device_eval_batch_size;
  if (eval_data && eval_data->num_eval_batches(t.eval_rows_, t.eval_partial_) <= 0)
    return Status::error("--eval_data " + eval_data->files() + ": " + std::to_string(eval_data->num_rows()) +
                         " rows, fewer than one eval batch of " + std::to_string(t.eval_rows_) +
                         " (--per_device_eval_batch_size)");
  t.acc_.seed = cfg.seed;
  return t;
}

Expected<Trainer::Variant*> Trainer::add_variant(const StepShape& shape, const TrainGraphs& graphs) {
  const ir::Graph& g = *graphs.train_step;
  Variant v;
  v.g = graphs;
  bool has_loss = false;
  for (ir::Value* o : g.outputs) has_loss |= o->name == "loss";
  if (!has_loss) return Status::error("train_step: the graph has no output 'loss'");
  // Every program of the run holds the same state (the parameters do not depend on the
  // batch shape).
  for (const ir::StateBinding& sb : g.state) {
    auto it = state_.find(sb.input ? sb.input->name : std::string());
    if (it == state_.end() || !sb.initial || !same_layout(*sb.initial, it->second))
      return Status::error("train_step: the program of another batch shape has other state ('" +
                           (sb.input ? sb.input->name : std::string("?")) + "') (internal)");
  }
  for (ir::Value* in : g.inputs) {
    bool is_data = false;
    for (auto& d : graphs.data_inputs) is_data |= d == in->name;
    if (!is_data && !state_.count(in->name) && in->name != kNumItemsInput && !g.input_defaults.count(in->name))
      return Status::error("train_step: input '" + in->name + "' is neither a data input nor a state input");
  }
  {
    std::vector<std::string> names;
    for (auto& d : graphs.data_inputs)
      for (ir::Value* in : g.inputs)
        if (in->name == d) names.push_back(d);
    KILN_ASSIGN_OR_RETURN(v.train_specs, data_input_specs(g, names));
  }
  if (graphs.eval) {
    std::vector<std::string> names;
    for (auto& d : graphs.data_inputs)
      for (ir::Value* in : graphs.eval->inputs)
        if (in->name == d) names.push_back(d);
    KILN_ASSIGN_OR_RETURN(v.eval_specs, data_input_specs(*graphs.eval, names));
    // Parameters kept as initializers in the eval graph are refreshed from the state.
    bool shadowed = false;
    for (ir::Value* x : graphs.eval->initializers) shadowed |= state_.count(x->name) > 0;
    if (shadowed) v.eval_clone = std::shared_ptr<ir::Graph>(graphs.eval->clone().release());
  }
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Executable> train_exec,
                        backend_->load(g, ProgramParts{graphs.train_program, graphs.train_arena}));
  v.train_exec = std::move(train_exec);
  return &(variants_[shape] = std::move(v));
}

std::string Trainer::rebuild_reason(const StepShape& shape, const std::string& what) const {
  std::string r = what + ": ";
  std::vector<std::string> parts;
  const std::string seq_dim =
      train_->sequence_dim_name().empty() ? std::string() : " (" + train_->sequence_dim_name() + ")";
  if (variants_.empty()) {
    parts.push_back(std::to_string(shape.micro_rows) + " rows x " + std::to_string(shape.trips) + " microbatches");
    if (shape.length > 0)
      parts.push_back("input '" + train_->token_input() + "' dim 1" + seq_dim + ": " + std::to_string(shape.length));
  } else {
    if (shape.micro_rows != last_shape_.micro_rows || shape.trips != last_shape_.trips)
      parts.push_back("rows " + std::to_string(last_shape_.micro_rows) + " x " + std::to_string(last_shape_.trips) +
                      " -> " + std::to_string(shape.micro_rows) + " x " + std::to_string(shape.trips) +
                      " (microbatch rows x microbatches)");
    if (shape.length != last_shape_.length)
      parts.push_back("input '" + train_->token_input() + "' dim 1" + seq_dim + ": " +
                      std::to_string(last_shape_.length) + " -> " + std::to_string(shape.length));
  }
  for (size_t i = 0; i < parts.size(); ++i) r += (i ? ", " : "") + parts[i];
  if (chooser_) r += std::string(" (--shape_mode ") + shape_mode_name(chooser_->mode()) + ")";
  return r + ", " + std::to_string(variants_.size() + 1) + (variants_.empty() ? " program" : " programs") + " so far";
}

StepShape Trainer::program_key(StepShape shape) const {
  if (chooser_ && chooser_->mode() == ShapeMode::symbolic) shape.length = 0;
  if (symbolic_rows_) shape.micro_rows = 0;
  return shape;
}

Expected<Trainer::Variant*> Trainer::variant_for(const StepShape& shape, const std::string& what) {
  if (auto it = variants_.find(program_key(shape)); it != variants_.end()) return &it->second;
  if (!opts_.programs)
    return Status::error("the batch of " + what + " needs a program for " + std::to_string(shape.micro_rows) +
                         " rows x " + std::to_string(shape.trips) + " microbatches" +
                         (shape.length > 0 ? " of length " + std::to_string(shape.length) : std::string()) +
                         ", and this run has one program (give --dataloader_drop_last true, or train with kiln train)");
  auto built = opts_.programs(shape, rebuild_reason(shape, what));
  if (!built) return built.status().with_context("the program of " + describe_shape(shape, chooser_));
  TrainGraphs g = std::move(*built);
  if (!g.train_step) return Status::error("trainer: the program provider gave no train_step graph");
  if (eval_ && !g.eval) return Status::error("trainer: the program of another batch shape has no eval graph");
  return add_variant(program_key(shape), g);
}

int64_t Trainer::padded_length(int64_t need) {
  const ShapeChoice c = chooser_->choose(need);
  if (c.limited && !limit_warned_) {
    limit_warned_ = true;
    std::string lens;
    for (int64_t l : chooser_->built()) lens += (lens.empty() ? "" : ", ") + std::to_string(l);
    std::cerr << message_prefix() << ": warning: --recompile_limit " << chooser_->recompile_limit()
              << " reached (programs for lengths " << lens << "): from now on batches pad up to the nearest of them"
              << (chooser_->built().count(chooser_->max_length())
                      ? std::string()
                      : ", or to " + std::to_string(chooser_->max_length()) + " (one more program)")
              << "\n";
  }
  return c.length;
}

StepShape Trainer::step_shape(int64_t step) const {
  StepShape s = step_rows(step);
  if (chooser_) {
    const int64_t epoch = step / steps_per_epoch_, index = step % steps_per_epoch_;
    const int64_t need =
        train_->train_batch_length(cfg_.seed, epoch, index, job_rows_, rank_ * rows_per_step_, s.micro_rows * s.trips);
    s.length = chooser_->choose(need).length;
  }
  return s;
}

StepShape Trainer::step_rows(int64_t step) const {
  StepShape s{micro_rows_, trips_, 0};
  const int64_t rows = train_->rows_in_batch(step % steps_per_epoch_, job_rows_);
  if (rows > 0 && rows < job_rows_) {
    // The epoch's last partial batch: microbatches of at most micro_rows_ equal rows.
    int64_t m = std::min(micro_rows_, rows);
    while (rows % m != 0) --m;
    s.micro_rows = m;
    s.trips = rows / m;
  }
  return s;
}

std::vector<StepShape> Trainer::loaded_shapes() const {
  std::vector<StepShape> r;
  for (auto& [k, v] : variants_) r.push_back(k);
  return r;
}

Status Trainer::prepare_programs() {
  if (!chooser_ || chooser_->mode() != ShapeMode::buckets) return Status::ok();
  // Every step's and every eval batch's program before step 1: nothing compiles during
  // training (the lengths come from the fixed buckets, the rows from the data order).
  for (int64_t k = global_step_; k < total_steps_; ++k) {
    const StepShape s = step_shape(k);
    if (!variants_.count(program_key(s))) {
      auto v = variant_for(s, "step " + std::to_string(k + 1) + " (built before step 1)");
      if (!v) return v.status();
      last_shape_ = s;
    }
  }
  if (eval_ && chooser_)
    for (int64_t i = 0; i < eval_->num_eval_batches(eval_rows_, eval_partial_); ++i) {
      const int64_t len = chooser_->choose(eval_->eval_batch_length(i, eval_rows_)).length;
      bool have = false;
      for (auto& [k, v] : variants_) have |= k.length == program_key({0, 0, len}).length;
      if (!have) {
        const StepShape s{micro_rows_, trips_, len};
        auto v = variant_for(s, "eval batch " + std::to_string(i + 1) + " (built before step 1)");
        if (!v) return v.status();
        last_shape_ = s;
      }
    }
  return Status::ok();
}

double Trainer::epoch_now() const {
  return steps_per_epoch_ > 0 ? static_cast<double>(global_step_) / static_cast<double>(steps_per_epoch_) : 0.0;
}

std::map<std::string, Tensor> Trainer::weights() const {
  std::map<std::string, Tensor> w;
  for (auto& [name, t] : state_) {
    const std::string& k = state_kind_.at(name);
    if (k == "parameter" || k == "buffer") w[name] = t;
  }
  return w;
}

Expected<std::vector<Tensor>> Trainer::feeds_for(const ir::Graph& g, const Batch& batch,
                                                 const std::vector<DataInputSpec>& specs, bool data_optional) const {
  std::vector<Tensor> feeds(g.inputs.size());
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    const ir::Value* in = g.inputs[i];
    if (in->name == kNumItemsInput) continue;  // fed by step()
    if (data_optional && !batch.count(in->name)) {
      bool is_data = false;
      for (auto& s : specs) is_data |= s.name == in->name;
      if (is_data) continue;  // streamed into the accumulation loop
    }
    auto b = batch.find(in->name);
    if (b != batch.end()) {
      const DataInputSpec* spec = nullptr;
      for (auto& s : specs)
        if (s.name == in->name) spec = &s;
      if (!spec) return Status::error("graph '" + g.name + "': input '" + in->name + "' is not a data input");
      KILN_ASSIGN_OR_RETURN(feeds[i], fit_to_input(b->second, *spec));
      continue;
    }
    auto s = state_.find(in->name);
    if (s != state_.end()) {
      feeds[i] = s->second;
      continue;
    }
    if (auto f = schedule_feeds_.find(in->name); f != schedule_feeds_.end()) {
      feeds[i] = f->second;
      continue;
    }
    if (g.input_defaults.count(in->name)) continue;  // run_graph takes the default
    return Status::error("graph '" + g.name + "': no data or state for input '" + in->name + "'");
  }
  return feeds;
}

Status Trainer::restore(const std::string& dir) {
  KILN_ASSIGN_OR_RETURN(Checkpoint c, load_checkpoint(dir));
  // Which state-shaping flags differ from the checkpoint's run: named in the errors below
  // instead of a guess.
  const std::vector<std::string> state_changes = changed_flags(c.state.config_json, cfg_, kStateFlags);
  resume_warning_.clear();
  const std::string cause =
      state_changes.empty() ? "" : "; the checkpoint was written with " + join_flags(state_changes);
  std::map<std::string, Tensor> next = state_;
  for (auto& [name, cur] : state_) {
    const std::string& kind = state_kind_[name];
    const auto& src = (kind == "parameter" || kind == "buffer") ? c.model : c.optimizer;
    auto it = src.find(name);
    if (it == src.end())
      return Status::error("checkpoint '" + dir + "': missing tensor '" + name + "' (" + kind + ") in " +
                           ((kind == "parameter" || kind == "buffer") ? "model" : "optimizer") + ".safetensors" +
                           (!cause.empty()              ? cause
                            : kind == "optimizer_state" ? " (was the checkpoint written with another --optim?)"
                                                        : ""));
    if (auto full = state_full_.find(name); full != state_full_.end()) {
      // ZeRO-1: this rank's shard of the whole tensor the checkpoint holds.
      const Tensor& whole = it->second;
      if (whole.dtype() != cur.dtype() || whole.dims() != full->second)
        return Status::error("checkpoint '" + dir + "': tensor '" + name + "' is " + describe(whole) +
                             ", the program expects " + describe(Tensor(cur.dtype(), full->second)) + " to shard");
      Tensor shard(cur.dtype(), cur.dims());
      const size_t es = ir::dtype_size(cur.dtype());
      const int64_t s = cur.numel(), n = whole.numel(), begin = std::min(n, rank_ * s),
                    end = std::min(n, rank_ * s + s);
      std::memset(shard.raw(), 0, shard.nbytes());
      std::memcpy(shard.raw(), static_cast<const char*>(whole.raw()) + begin * es,
                  static_cast<size_t>(end - begin) * es);
      next[name] = std::move(shard);
      continue;
    }
    if (!same_layout(it->second, cur))
      return Status::error("checkpoint '" + dir + "': tensor '" + name + "' is " + describe(it->second) +
                           ", the program expects " + describe(cur));
    next[name] = it->second.clone();
  }
  // State the checkpoint holds but this program does not read (another --optim):
  // resuming would silently drop it.
  for (const auto* src : {&c.model, &c.optimizer})
    for (auto& [name, t] : *src)
      if (!state_.count(name))
        return Status::error("checkpoint '" + dir + "': tensor '" + name + "' is not state of this training program" +
                             (!cause.empty() ? cause : " (was the checkpoint written with another --optim or model?)") +
                             "; resuming would drop it");
  // Rows of the job's global batch: a checkpoint resumes on another number of ranks when
  // the global batch (ranks x per-device batch x accumulation) is the same.
  if (c.state.steps_per_epoch != steps_per_epoch_ || c.state.rows_per_step != job_rows_) {
    const std::vector<std::string> data_changes = changed_flags(c.state.config_json, cfg_, kDataFlags);
    return Status::error(
        "checkpoint '" + dir + "': made with " + std::to_string(c.state.steps_per_epoch) + " steps per epoch of " +
        std::to_string(c.state.rows_per_step) + " rows, the current data gives " + std::to_string(steps_per_epoch_) +
        " of " + std::to_string(job_rows_) + " (resuming would change the data order" +
        (data_changes.empty() ? "" : "; the checkpoint was written with " + join_flags(data_changes)) + ")");
  }
  // Changes a resume accepts (state-shaping flags whose state still matches, such as
  // --bf16 or SGD's --momentum value; hyperparameters; the seed), never silently: one
  // warning line, printed by take_resume_warning() once the run is sure to start.
  std::vector<std::string> changes = state_changes;
  for (std::string& f : changed_flags(c.state.config_json, cfg_, kResumeWarnFlags)) changes.push_back(std::move(f));
  if (c.state.config_json.empty() && c.state.seed != cfg_.seed)  // no saved config: the data seed alone
    changes.push_back("--seed " + std::to_string(c.state.seed) + " (this run: " + std::to_string(cfg_.seed) + ")");
  if (!changes.empty())
    resume_warning_ = message_prefix() + ": warning: resuming from a run with " + join_flags(changes) +
                      "; this run's values apply from the next step";
  state_ = std::move(next);
  global_step_ = c.state.global_step;
  // specialize: the lengths the interrupted run had programs for, in its order, so the
  // resumed run pads (and stops at --recompile_limit) exactly as it would have.
  if (chooser_ && chooser_->mode() == ShapeMode::specialize)
    for (int64_t k = 0; k < global_step_; ++k) {
      StepShape sk = step_shape(k);
      chooser_->add_built(sk.length);
    }
  acc_.log_loss_sum = c.state.log_loss_sum;
  acc_.log_loss_count = c.state.log_loss_count;
  acc_.log_time_sum = c.state.log_time_sum;
  acc_.total_loss_sum = c.state.total_loss_sum;
  resumed_ = true;
  resumed_from_ = dir;
  return Status::ok();
}

Expected<StepResult> Trainer::step(const Batch* given) {
  auto t0 = std::chrono::steady_clock::now();
  const int64_t epoch = global_step_ / steps_per_epoch_, index = global_step_ % steps_per_epoch_;
  const int64_t first_row = rank_ * rows_per_step_;  // this rank's slice of the global batch
  // The program of this step's batch shape (a given batch runs on the first program).
  Variant* v = first_;
  StepShape shape = first_shape_;
  if (!given) {
    // Rows, then the padded length (computed once: padded_length also warns at the limit).
    shape = step_rows(global_step_);
    if (chooser_)
      shape.length = padded_length(
          train_->train_batch_length(cfg_.seed, epoch, index, job_rows_, first_row, shape.micro_rows * shape.trips));
    KILN_ASSIGN_OR_RETURN(v, variant_for(shape, "step " + std::to_string(global_step_ + 1)));
    last_shape_ = shape;
    if (chooser_) chooser_->add_built(shape.length);  // the specialize limit counts training lengths
  }
  const TrainGraphs& vg = v->g;
  const ir::Graph& g = *vg.train_step;
  const int64_t trips = shape.trips;
  const int64_t micro = shape.micro_rows;
  const int64_t rows = micro * trips;  // the last partial batch has fewer than rows_per_step_
  // Gradient accumulation streams its microbatches into the loop (RunOptions::microbatch):
  // only one microbatch of data is resident at a time, as when Hugging Face's Trainer
  // runs one forward per microbatch. A given batch (benchmarks, tests) is fed whole.
  const bool stream = !given && trips > 1;
  Batch batch;
  if (given) {
    batch = *given;
  } else if (!stream) {
    KILN_ASSIGN_OR_RETURN(batch,
                          train_->train_batch_rows(cfg_.seed, epoch, index, job_rows_, first_row, rows, shape.length));
  }
  KILN_ASSIGN_OR_RETURN(auto feeds, feeds_for(g, batch, v->train_specs, /*data_optional=*/stream));
  for (size_t i = 0; i < g.inputs.size(); ++i)
    if (const ir::Value* in = g.inputs[i]; in->name == kNumItemsInput) {
      // The real labels of all N microbatches, counted before the loop (as Hugging
      // Face's Trainer counts num_items_in_batch over its accumulation batches).
      int64_t count = 0;
      if (stream) {
        for (int64_t t = 0; t < trips; ++t) {
          KILN_ASSIGN_OR_RETURN(Batch part, train_->train_batch_rows(cfg_.seed, epoch, index, job_rows_,
                                                                     first_row + t * micro, micro, shape.length));
          auto l = part.find(vg.label_input);
          if (l == part.end()) return Status::error("train_step: the data has no label input '" + vg.label_input + "'");
          count += count_num_items(l->second, cfg_.ignore_index);
        }
      } else {
        auto l = batch.find(vg.label_input);
        if (l == batch.end()) return Status::error("train_step: the batch has no label input '" + vg.label_input + "'");
        count = count_num_items(l->second, cfg_.ignore_index);
      }
      if (comm::Communicator* w = comm::world()) {
        // The job's count: each rank's loss is its label sum over the labels of every
        // rank, so the summed losses are the mean over the global batch
        // (HF's average_tokens_across_devices).
        KILN_RETURN_IF_ERROR(
            w->all_reduce_sum(&count, 1, ir::DType::i64, "num_items_in_batch", comm::Traffic::control)->wait());
      }
      feeds[i] = num_items_tensor(count, in->dtype);
    }
  RunOptions ro;
  ro.training = true;
  ro.seed = cfg_.seed;
  // Dropout's Philox offset: rank r's microbatches are the job's microbatches r*A .. r*A +
  // A - 1 of N*A (the loop adds its iteration: (step * N + r) * A + t), so N ranks draw
  // the masks of one process accumulating N*A microbatches.
  ro.step = static_cast<uint64_t>(global_step_) * static_cast<uint64_t>(world_) + static_cast<uint64_t>(rank_);
  ro.results_in_arena = true;  // the new state is copied out below
  ro.donate_state = true;      // state_ was cloned for this trainer: kiln_donate updates it in place
  ro.profile = opts_.profile;
  if (stream)
    // One gather per microbatch: its tensors are handed out one input at a time and
    // leave this cache as they go, so nothing of microbatch t outlives its iteration.
    ro.microbatch = [&, pending = Batch{}, pending_t = int64_t(-1)](const ir::Value& in, int64_t t,
                                                                    int64_t n) mutable -> Expected<Tensor> {
      if (pending_t != t || !pending.count(in.name)) {
        pending.clear();
        KILN_ASSIGN_OR_RETURN(pending, train_->train_batch_rows(cfg_.seed, epoch, index, job_rows_,
                                                                first_row + t * micro, micro, shape.length));
        pending_t = t;
      }
      auto it = pending.find(in.name);
      const DataInputSpec* spec = nullptr;
      for (auto& sp : v->train_specs)
        if (sp.name == in.name) spec = &sp;
      if (it == pending.end() || !spec)
        return Status::error("train_step: no data for streamed input '" + in.name + "'");
      Tensor part = std::move(it->second);
      pending.erase(it);
      DataInputSpec one = *spec;  // the spec of the whole step, N·b rows -> one microbatch
      if (one.shape.rank() > 0 && one.shape.dims[0].is_static())
        one.shape.dims[0] = ir::Dim(one.shape.dims[0].value / n);
      return fit_to_input(part, one);
    };
  // The loss scale this step used: read before the step, whose update kernel may write
  // the next scale into the same buffer (RunOptions::donate_state).
  const double loss_scale_used = state_.count("loss_scale") ? state_.at("loss_scale").get_f64(0) : 0.0;
  auto outs = backend_->run_positional(*v->train_exec, feeds, ro);
  feeds.clear();  // the old state is held by state_ alone again
  if (!outs)
    return outs.status().with_context("step " + std::to_string(global_step_ + 1) +
                                      (chooser_ ? " (" + describe_shape(shape, std::nullopt) + ")" : std::string()));
  // The graph's outputs by name, once per program (the step reads them by position).
  if (v->output_index.empty())
    for (size_t i = 0; i < g.outputs.size(); ++i) v->output_index[g.outputs[i]->name] = i;
  auto output = [&](const std::string& name) -> const Tensor* {
    auto it = v->output_index.find(name);
    return it == v->output_index.end() ? nullptr : &(*outs)[it->second];
  };
  auto scalar = [&](const std::string& name) {
    const Tensor* t = output(name);
    return t && t->numel() >= 1 ? t->get_f64(0) : std::nan("");
  };
  StepResult r;
  if (output("found_inf") && state_.count("loss_scale")) {  // --fp16 loss scaling
    r.skipped = output("found_inf")->get_f64(0) != 0;
    r.loss_scale = loss_scale_used;
    r.loss_scale_next = scalar("loss_scale.next");
  }
  // Every state entry and its new value, checked before any is replaced.
  std::vector<std::pair<Tensor*, const Tensor*>> updates;
  updates.reserve(state_output_.size());
  for (auto& [name, out_name] : state_output_) {
    const Tensor* out = output(out_name);
    if (!out) return Status::error("train_step: state output '" + out_name + "' missing");
    auto st = state_.find(name);
    if (st == state_.end()) return Status::error("train_step: no state '" + name + "'");
    if (!same_layout(*out, st->second))
      return Status::error("train_step: state '" + name + "' changed from " + describe(st->second) + " to " +
                           describe(*out));
    updates.push_back({&st->second, out});
  }
  std::vector<CopyTask> copies;  // state outputs in the step arena -> the old state's buffers
  for (auto& [old, out] : updates) {
    // A state output in the step arena (RunOptions::results_in_arena) is overwritten by
    // the next step: it is copied into the old state's buffer, which nothing else holds
    // now (no allocation), or else into a fresh one.
    if (vg.train_arena && vg.train_arena->contains(out->raw())) {
      if (old->storage_unique() && !vg.train_arena->contains(old->raw()))
        copies.push_back({old->raw(), out->raw(), old->nbytes()});
      else
        *old = out->clone();
    } else {
      *old = *out;
    }
  }
  copy_chunks(copies);
  r.loss = scalar("loss");
  r.grad_norm = scalar("grad_norm");
  r.learning_rate = scalar("learning_rate");
  ++global_step_;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

Expected<std::map<std::string, double>> Trainer::evaluate(ProgressBar* bar) {
  if (!eval_ || !g_.eval) return Status::error("evaluate: no eval data or eval graph");
  const int64_t nb = eval_->num_eval_batches(eval_rows_, eval_partial_);
  double loss_sum = 0, row_loss_sum = 0;  // per batch; weighted by the batch's rows
  int64_t rows_seen = 0;
  bool partial = false;
  int64_t correct = 0, counted = 0;
  bool acc_ok = cfg_.loss == "cross_entropy" && !g_.label_input.empty();
  if (bar) bar->start(nb);
  for (int64_t i = 0; i < nb; ++i) {
    if (bar && i > 0) bar->update(i);
    // The program of this batch's length (variable-length data), else the first.
    Variant* v = first_;
    int64_t length = 0;
    if (chooser_) {
      // Evaluation pads to a length training has a program for (specialize: the nearest
      // built one, else --max_length), so it never spends --recompile_limit.
      const int64_t need = eval_->eval_batch_length(i, eval_rows_);
      length = chooser_->choose(need).length;
      if (chooser_->mode() == ShapeMode::specialize) {
        auto it = chooser_->built().lower_bound(need);
        length = it == chooser_->built().end() ? chooser_->max_length() : *it;
      }
      v = nullptr;
      for (auto& [k, x] : variants_)
        if (k.length == program_key({0, 0, length}).length &&
            (!v || (k.micro_rows == micro_rows_ && k.trips == trips_)))
          v = &x;
      if (!v) {
        const StepShape s{micro_rows_, trips_, length};
        KILN_ASSIGN_OR_RETURN(v, variant_for(s, "eval batch " + std::to_string(i + 1)));
        last_shape_ = s;
      }
    }
    const ir::Graph* eg = v->g.eval;
    if (v->eval_clone) {
      for (ir::Value* x : v->eval_clone->initializers) {
        auto it = state_.find(x->name);
        if (it != state_.end()) x->data = std::make_shared<Tensor>(it->second);
      }
      eg = v->eval_clone.get();
    }
    KILN_ASSIGN_OR_RETURN(Batch batch, eval_->eval_batch(i, eval_rows_, length));
    KILN_ASSIGN_OR_RETURN(auto feeds, feeds_for(*eg, batch, v->eval_specs));
    RunOptions ro;
    ro.training = false;
    ro.seed = cfg_.seed;
    ro.step = static_cast<uint64_t>(global_step_);
    ro.results_in_arena = true;  // read below, before the next batch runs
    if (!v->eval_exec) {
      // The eval step's arena is planned for the eval graph's own values, not its clone's.
      KILN_ASSIGN_OR_RETURN(
          std::unique_ptr<Executable> ex,
          backend_->load(*eg, ProgramParts{v->g.eval_program, eg == v->g.eval ? v->g.eval_arena : nullptr}));
      v->eval_exec = std::move(ex);
    }
    auto outs = backend_->run_positional(*v->eval_exec, feeds, ro);
    if (!outs) return outs.status().with_context("eval batch " + std::to_string(i));
    auto output = [&](const std::string& name) -> const Tensor* {
      for (size_t k = 0; k < eg->outputs.size(); ++k)
        if (eg->outputs[k]->name == name) return &(*outs)[k];
      return nullptr;
    };
    const Tensor* loss = output("loss");
    const double l = loss && loss->numel() >= 1 ? loss->get_f64(0) : std::nan("");
    const int64_t rows = eval_->eval_rows_in_batch(i, eval_rows_);
    loss_sum += l;
    row_loss_sum += l * static_cast<double>(rows);
    rows_seen += rows;
    partial = partial || rows < eval_rows_;
    if (acc_ok) {
      const Tensor* lg = output(v->g.logits_output);
      if (!lg) lg = output("logits");
      auto lb = batch.find(g_.label_input);
      if (!lg || lb == batch.end()) {
        acc_ok = false;
        continue;
      }
      auto [c, n] = accuracy_counts(*lg, lb->second, cfg_.ignore_index);
      if (n < 0) acc_ok = false;
      correct += c;
      counted += n;
    }
  }
  std::map<std::string, double> m;
  // A partial last batch weighs by its rows (Hugging Face's Trainer repeats each batch's
  // mean loss once per row); whole batches alone keep the plain mean of batch losses.
  m["eval_loss"] = partial ? row_loss_sum / static_cast<double>(rows_seen) : loss_sum / static_cast<double>(nb);
  if (acc_ok && counted > 0) m["eval_accuracy"] = static_cast<double>(correct) / static_cast<double>(counted);
  return m;
}

Expected<std::map<std::string, Tensor>> Trainer::whole_state() const {
  std::map<std::string, Tensor> whole = state_;
  comm::Communicator* w = comm::world();
  for (auto& [name, full] : state_full_) {
    if (!w) break;
    const Tensor& shard = state_.at(name);
    std::vector<char> all(shard.nbytes() * static_cast<size_t>(world_));
    KILN_RETURN_IF_ERROR(
        w->all_gather(shard.raw(), all.data(), shard.numel(), shard.dtype(), name, comm::Traffic::control)->wait());
    Tensor t(shard.dtype(), full);
    std::memcpy(t.raw(), all.data(), t.nbytes());
    whole[name] = std::move(t);
  }
  return whole;
}

Status Trainer::save() {
  KILN_ASSIGN_OR_RETURN(auto whole, whole_state());
  if (!opts_.write_files) return Status::ok();  // another rank of the job writes
  Checkpoint c;
  for (auto& [name, t] : whole) {
    const std::string& k = state_kind_[name];
    (k == "parameter" || k == "buffer" ? c.model : c.optimizer)[name] = t;
  }
  c.state = acc_;
  c.state.global_step = global_step_;
  c.state.epoch = epoch_now();
  c.state.total_steps = total_steps_;
  c.state.steps_per_epoch = steps_per_epoch_;
  c.state.rows_per_step = job_rows_;
  c.state.seed = cfg_.seed;
  c.state.config_json = config_to_json(cfg_);
  // The log history so far (MetricsWriter flushes every line).
  c.log_history = (std::filesystem::path(cfg_.output_dir) / "metrics.jsonl").string();
  std::string dir = (std::filesystem::path(cfg_.output_dir) / ("checkpoint-" + std::to_string(global_step_))).string();
  KILN_RETURN_IF_ERROR(save_checkpoint(dir, c));
  return rotate_checkpoints(cfg_.output_dir, cfg_.save_total_limit);
}

Expected<TrainResult> Trainer::run() {
  std::ostream& out = opts_.out ? *opts_.out : std::cout;
  // tqdm's bar on a terminal (Hugging Face's --disable_tqdm turns it off); plain log
  // lines only otherwise (CI logs, files).
  // Not in a data-parallel job: mpirun gives its ranks a pseudo-terminal even when its own
  // output goes to a file.
  const bool progress = opts_.progress == 1 || (opts_.progress == -1 && !cfg_.disable_tqdm && opts_.out == &std::cout &&
                                                isatty(fileno(stdout)) && comm::launch_info().world_size <= 1);
  ProgressBar bar(out, progress);
  ProgressBar eval_bar(out, progress, "eval", /*leave=*/false);
  MetricsWriter metrics_file;
  TensorBoardWriter tensorboard;
  if (opts_.write_files) {
    KILN_RETURN_IF_ERROR(prepare_output_dir(cfg_.output_dir));
    KILN_RETURN_IF_ERROR(metrics_file.open(
        (std::filesystem::path(cfg_.output_dir) / "metrics.jsonl").string(), resumed_, global_step_,
        resumed_from_.empty() ? std::string() : (std::filesystem::path(resumed_from_) / "metrics.jsonl").string()));
    if (cfg_.reports_tensorboard())
      KILN_RETURN_IF_ERROR(
          tensorboard.open(cfg_.logging_dir.empty() ? default_logging_dir(cfg_.output_dir) : cfg_.logging_dir));
  }
  // Each metrics line goes to metrics.jsonl and, with --report_to tensorboard, to the event file.
  struct {
    MetricsWriter& file;
    TensorBoardWriter& tb;
    Status write(const nlohmann::json& j) {
      KILN_RETURN_IF_ERROR(file.write(j));
      return tb.write_metrics(j);
    }
  } metrics{metrics_file, tensorboard};
  if (eval_ && !eval_partial_) {
    int64_t used = eval_->num_eval_batches(eval_rows_) * eval_rows_;
    const int64_t whole = eval_->num_rows() / eval_rows_ * eval_rows_;
    if (used < whole)
      out << "note: evaluation uses " << used << " of " << eval_->num_rows() << " eval rows (at most "
          << eval_->num_eval_batches(eval_rows_) << " batches of " << eval_rows_
          << " windows of a token file, to keep evaluation short)\n";
    else if (used < eval_->num_rows())
      out << "note: evaluation uses " << used << " of " << eval_->num_rows() << " eval rows (whole batches of "
          << eval_rows_ << ": the program is compiled for one static batch shape)\n";
  }
  out << "training: " << train_->num_rows() << " rows, " << steps_per_epoch_ << " steps/epoch of " << job_rows_
      << " rows"
      << (world_ > 1 ? " (" + std::to_string(world_) + " ranks x " + std::to_string(rows_per_step_) + ")" : "") << ", "
      << total_steps_ << " steps" << (resumed_ ? ", resuming at step " + std::to_string(global_step_) : "") << "\n";
  // HF's Trainer ends an epoch with a smaller batch (dataloader_drop_last=False); kiln
  // drops it unless asked (a partial batch needs a program of its own).
  if (const int64_t left = train_->num_rows() - steps_per_epoch_ * job_rows_;
      left > 0 && steps_per_epoch_ > 0 && !train_->is_tokens())
    out << "note: each epoch trains on " << steps_per_epoch_ * job_rows_ << " of the " << train_->num_rows()
        << " rows (whole steps of " << job_rows_ << " rows"
        << (world_ > 1 || !opts_.suggest_program_flags ? ""
            : symbolic_rows_ ? "; --dataloader_drop_last false trains the rest on the same program (its batch dim is "
                               "symbolic)"
                             : "; --dataloader_drop_last false trains the rest with a program of its size")
        << "); the " << left << (left == 1 ? " row left over differs" : " rows left over differ")
        << " from epoch to epoch (the order is reshuffled)\n";
  for (const Dataset* d : {train_, eval_})
    if (d)
      for (const std::string& n : d->notes()) out << "note: " << n << "\n";
  if (chooser_) {
    out << "shapes: --shape_mode " << shape_mode_name(chooser_->mode()) << ", rows up to " << chooser_->max_length()
        << " tokens";
    if (chooser_->mode() == ShapeMode::buckets) {
      out << ", padded to the buckets";
      for (size_t i = 0; i < chooser_->buckets().size(); ++i) out << (i ? "," : " ") << chooser_->buckets()[i];
    }
    out << "\n";
    // buckets: every program before step 1, so nothing compiles during training.
    KILN_RETURN_IF_ERROR(prepare_programs());
  }
  if (resumed_ && global_step_ >= total_steps_)
    out << "note: the checkpoint is at step " << global_step_ << ", at or past the " << total_steps_
        << " steps of this run (--max_steps, or --num_train_epochs): nothing to train; raise --max_steps to continue\n";
  TrainResult res;
  res.total_steps = total_steps_;
  auto run_t0 = std::chrono::steady_clock::now();
  const int64_t first_step = global_step_;
  // A data-parallel job: the ranks start together (they finish compiling at different
  // times), and wait for rank 0 while it evaluates or saves, without the collectives'
  // timeout (a day), which is for ranks that died or hang.
  auto wait_for_rank0 = [&](const std::string& what) -> Status {
    if (comm::Communicator* w = comm::world()) return w->barrier(what, 86400);
    return Status::ok();
  };
  KILN_RETURN_IF_ERROR(wait_for_rank0("before the first step (every rank's program ready)"));
  if (comm::Communicator* w = comm::world()) w->reset_stats();  // this run's steps only
  int64_t last_eval = -1;
  auto do_eval = [&]() -> Status {
    if (rank_ != 0) return Status::ok();  // a data-parallel job evaluates on rank 0 alone
    bar.clear();
    auto mr = evaluate(&eval_bar);
    eval_bar.close();
    if (!mr) return mr.status();
    auto& m = *mr;
    nlohmann::json j;
    j["step"] = global_step_;
    j["epoch"] = epoch_now();
    for (auto& [k, v] : m) j[k] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
    out << format_eval_line(j) << std::endl;
    bar.refresh();
    KILN_RETURN_IF_ERROR(metrics.write(j));
    res.eval_metrics = m;
    last_eval = global_step_;
    return Status::ok();
  };
  double last_grad_norm = std::nan(""), last_lr = std::nan("");
  bool warned_nonfinite = false, warned_huge = false;
  int64_t last_save = -1;
  bar.start(total_steps_, global_step_);
  while (global_step_ < total_steps_) {
    // SIGINT/SIGTERM (StopOnSignal): stop between steps, after the last one's log, eval and save.
    int stop = stop_signal();
    if (comm::Communicator* w = comm::world()) {
      // Every rank stops after the same step: the signal reaches the ranks at different
      // times, and a rank that stopped alone would leave the others waiting in a collective.
      int64_t any = stop != 0 ? 1 : 0;
      KILN_RETURN_IF_ERROR(w->all_reduce_sum(&any, 1, ir::DType::i64, "the stop flag", comm::Traffic::control)->wait());
      if (any > 0 && stop == 0) stop = SIGTERM;
    }
    if (stop != 0) {
      res.stopped_by_signal = stop;
      break;
    }
    KILN_ASSIGN_OR_RETURN(StepResult r, step());
    fault_point("step");  // between steps, before the log and save (tests)
    res.step_losses.push_back(r.loss);
    acc_.log_loss_sum += r.loss;
    acc_.log_loss_count += 1;
    acc_.log_time_sum += r.seconds;
    acc_.total_loss_sum += r.loss;
    last_grad_norm = r.grad_norm;
    last_lr = r.learning_rate;
    if (rank_ != 0) {
      // the job's loss is every rank's: rank 0 alone warns
    } else if (!std::isfinite(r.loss) && !warned_nonfinite) {
      // PyTorch and the HF Trainer keep going on a non-finite loss; say so once, loudly.
      bar.clear();
      std::cerr << message_prefix() << ": warning: loss is "
                << (std::isnan(r.loss) ? std::string("nan") : std::to_string(r.loss)) << " at step " << global_step_
                << " (check the data for NaN/inf, batches whose labels are all ignore_index, and the learning rate); "
                   "training continues\n";
      warned_nonfinite = true;
    } else if (std::isfinite(r.loss) && std::fabs(r.loss) > kImplausibleLoss && !warned_huge) {
      // Finite but far beyond any real loss (a cross entropy of V classes starts near ln V):
      // garbage weights or inputs, which a NaN often follows only much later.
      bar.clear();
      char v[32];
      std::snprintf(v, sizeof v, "%.3g", r.loss);
      std::cerr << message_prefix() << ": warning: loss is " << v << " at step " << global_step_
                << ", implausibly large (check the model's initial weights, the inputs' scale and the learning rate); "
                   "training continues\n";
      warned_huge = true;
    }
    if (r.skipped) {  // as torch's GradScaler: no optimizer step, scale backed off
      char msg[160];
      std::snprintf(msg, sizeof msg, "step %lld skipped: non-finite gradients, loss scale %g -> %g",
                    static_cast<long long>(global_step_), r.loss_scale, r.loss_scale_next);
      bar.clear();
      out << msg << std::endl;
    }
    bar.update(global_step_, r.loss);
    if (global_step_ % cfg_.logging_steps == 0) {
      LogEntry e;
      e.step = global_step_;
      e.total_steps = total_steps_;
      e.epoch = epoch_now();
      e.loss = acc_.log_loss_sum / static_cast<double>(acc_.log_loss_count);
      e.grad_norm = last_grad_norm;
      e.learning_rate = last_lr;
      e.step_time_s = acc_.log_time_sum / static_cast<double>(acc_.log_loss_count);
      e.samples_per_second = e.step_time_s > 0 ? static_cast<double>(job_rows_) / e.step_time_s : 0;
      bar.clear();
      out << format_log_line(e) << std::endl;  // flushed: progress shows through pipes too
      bar.refresh();
      KILN_RETURN_IF_ERROR(metrics.write(log_entry_json(e)));
      acc_.log_loss_sum = 0;
      acc_.log_loss_count = 0;
      acc_.log_time_sum = 0;
    }
    if (eval_ && cfg_.eval_steps > 0 && global_step_ % cfg_.eval_steps == 0) {
      KILN_RETURN_IF_ERROR(do_eval());
      KILN_RETURN_IF_ERROR(wait_for_rank0("rank 0's evaluation"));
    }
    if (job_writes_ && cfg_.save_steps > 0 && global_step_ % cfg_.save_steps == 0) {
      KILN_RETURN_IF_ERROR(save());
      KILN_RETURN_IF_ERROR(wait_for_rank0("rank 0's checkpoint"));
      last_save = global_step_;
    }
  }
  bar.close();  // the last state stays (tqdm's leave=True)
  if (res.stopped_by_signal != 0) {
    // Stopped by a signal: the state of the last whole step is saved (when the run saves
    // at all); no final evaluation or summary, the run is not done.
    std::string saved;
    const std::string ck =
        (std::filesystem::path(cfg_.output_dir) / ("checkpoint-" + std::to_string(global_step_))).string();
    // Only a run that reaches a multiple of --save_steps had output_dir checked for other
    // runs' checkpoints (guard_later_checkpoints), which a save could replace or rotate away.
    const bool saves = cfg_.save_steps > 0 && total_steps_ / cfg_.save_steps > first_step / cfg_.save_steps;
    if (job_writes_ && cfg_.save_steps > 0 && global_step_ > first_step && !saves) {
      saved = "; not saved (this run's steps reach no multiple of --save_steps)";
    } else if (job_writes_ && cfg_.save_steps > 0 && global_step_ > first_step) {
      if (last_save != global_step_) KILN_RETURN_IF_ERROR(save());
      saved = "; saved " + ck + " (continue with --resume_from_checkpoint latest)";
    } else if (job_writes_ && cfg_.save_steps > 0) {
      saved = "; no step ran since the start, nothing saved";
    } else {
      saved = "; no checkpoint saved (--save_steps is 0)";
    }
    if (rank_ == 0)
      std::cerr << message_prefix() << ": " << signal_name(res.stopped_by_signal) << ": stopped after step "
                << global_step_ << " of " << total_steps_ << saved << std::endl;
    res.global_step = global_step_;
    res.epoch = epoch_now();
    res.train_loss = global_step_ > 0 ? acc_.total_loss_sum / static_cast<double>(global_step_) : 0.0;
    return res;
  }
  if (eval_ && last_eval != global_step_) KILN_RETURN_IF_ERROR(do_eval());
  double runtime = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_t0).count();
  res.global_step = global_step_;
  res.epoch = epoch_now();
  res.train_loss = global_step_ > 0 ? acc_.total_loss_sum / static_cast<double>(global_step_) : 0.0;
  nlohmann::json summary;
  summary["step"] = global_step_;
  summary["epoch"] = res.epoch;
  summary["train_loss"] = std::isfinite(res.train_loss) ? nlohmann::json(res.train_loss) : nlohmann::json(nullptr);
  summary["train_runtime"] = runtime;
  int64_t ran = global_step_ - first_step;
  summary["train_samples_per_second"] = runtime > 0 ? static_cast<double>(ran * job_rows_) / runtime : 0.0;
  summary["train_steps_per_second"] = runtime > 0 ? static_cast<double>(ran) / runtime : 0.0;
  if (opts_.planned_peak_bytes >= 0) summary["planned_peak_bytes"] = opts_.planned_peak_bytes;
  if (opts_.memory_base_bytes >= 0 && ran > 0)
    summary["measured_peak_bytes"] = ir::MemoryStats::peak_bytes() - opts_.memory_base_bytes;
  std::string ddp_line;
  if (comm::Communicator* w = comm::world(); w && ran > 0) {
    // What the communication layer counted over this run's steps (per rank; every rank
    // sends as much): the program's collectives (gradient buckets) and their time.
    const comm::CommStats cs = w->stats();
    const double per = 1.0 / static_cast<double>(ran);
    summary["ddp_world_size"] = world_;
    summary["ddp_collectives_per_step"] = static_cast<double>(cs.collectives) * per;
    summary["ddp_bytes_sent_per_step"] = static_cast<double>(cs.bytes_sent) * per;
    summary["ddp_comm_seconds_per_step"] = cs.busy_seconds * per;
    summary["ddp_exposed_comm_seconds_per_step"] = cs.wait_seconds * per;
    const double overlap = cs.busy_seconds > 0 ? std::clamp(1.0 - cs.wait_seconds / cs.busy_seconds, 0.0, 1.0) : 0.0;
    summary["ddp_overlap"] = overlap;
    int64_t state_bytes = 0;  // this rank's optimizer state (a shard of it under ZeRO-1)
    for (auto& [name, t] : state_)
      if (state_kind_.at(name) == "optimizer_state") state_bytes += static_cast<int64_t>(t.nbytes());
    summary["ddp_optimizer_state_bytes"] = state_bytes;
    char line[256];
    std::snprintf(line, sizeof line,
                  "data parallel: %d ranks | %.3g collectives/step | %.0f B (%.3f MiB) sent/step per rank | "
                  "communication %s/step, exposed %s (overlap %.0f%%)",
                  world_, static_cast<double>(cs.collectives) * per, static_cast<double>(cs.bytes_sent) * per,
                  static_cast<double>(cs.bytes_sent) * per / 1048576.0, format_time(cs.busy_seconds * per).c_str(),
                  format_time(cs.wait_seconds * per).c_str(), overlap * 100);
    ddp_line = line;
  }
  KILN_RETURN_IF_ERROR(metrics.write(summary));
  if (!ddp_line.empty()) out << ddp_line << "\n";
  char buf[200];
  std::snprintf(buf, sizeof buf, "done: step %lld | epoch %.2f | train_loss %s | train_runtime %s",
                static_cast<long long>(global_step_), res.epoch, format_metric(res.train_loss).c_str(),
                format_time(runtime).c_str());
  out << buf << "\n";  // one spelling of NaN everywhere (glibc prints "-nan" for most)
  res.weights = weights();
  return res;
}

namespace {
std::string& prefix_storage() {
  static std::string p = "kiln";
  return p;
}
}  // namespace
void set_message_prefix(const std::string& name) { prefix_storage() = name; }
const std::string& message_prefix() { return prefix_storage(); }

Status guard_later_checkpoints(const TrainConfig& cfg, int64_t start_step, int64_t total_steps) {
  // Only a run that will write a checkpoint can overwrite or rotate one away.
  if (cfg.save_steps <= 0 || total_steps / cfg.save_steps <= start_step / cfg.save_steps) return Status::ok();
  for (const std::string& note : remove_interrupted_saves(cfg.output_dir))
    std::cerr << message_prefix() << ": " << note << std::endl;
  {  // a file named like a checkpoint would be in the way of (or replaced by) a save
    std::error_code ec;
    for (auto it = std::filesystem::directory_iterator(cfg.output_dir, ec);
         !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (checkpoint_step(name) >= 0 && !it->is_directory(ec))
        return Status::error(
            "--output_dir " + cfg.output_dir + " holds a file named " + name +
            ", in the way of the checkpoints this run saves (not a checkpoint directory); move it away");
    }
  }
  // Resumed from a checkpoint in another folder: every checkpoint in output_dir is
  // another run's (rotation would delete the lowest steps first).
  bool elsewhere = false;
  if (!cfg.resume_from_checkpoint.empty()) {
    // The folder holding the checkpoint, as the path names it (a symlinked checkpoint
    // stays in its folder) or as it resolves ("." inside the checkpoint, a symlink to a
    // checkpoint of this folder), compared by identity (device and inode: bind mounts).
    std::filesystem::path ck = std::filesystem::path(cfg.resume_from_checkpoint).lexically_normal();
    if (ck.filename().empty()) ck = ck.parent_path();
    std::filesystem::path from = ck.parent_path();
    if (from.empty()) from = ".";
    std::error_code ec, ec2;
    const std::filesystem::path resolved = std::filesystem::weakly_canonical(cfg.resume_from_checkpoint, ec2);
    const bool by_name = std::filesystem::equivalent(from, cfg.output_dir, ec) && !ec;
    const bool by_target = !ec2 && std::filesystem::equivalent(resolved.parent_path(), cfg.output_dir, ec2) && !ec2;
    elsewhere = !by_name && !by_target;
  }
  std::vector<std::pair<int64_t, std::string>> later;
  for (auto& c : list_checkpoints(cfg.output_dir)) {
    std::error_code ec;  // the checkpoint being resumed is never another run's, nor deleted
    if (!cfg.resume_from_checkpoint.empty() && std::filesystem::equivalent(c.second, cfg.resume_from_checkpoint, ec))
      continue;
    if (elsewhere || c.first > start_step) later.push_back(c);
  }
  if (later.empty()) return Status::ok();
  std::string names;
  for (size_t i = 0; i < later.size() && i < 3; ++i)
    names += (i ? ", " : "") + std::filesystem::path(later[i].second).filename().string();
  if (later.size() > 3) names += ", ... (" + std::to_string(later.size()) + " in all)";
  if (!cfg.overwrite_output_dir)
    return Status::error(
        "--output_dir " + cfg.output_dir + " already holds " + names +
        (elsewhere ? " of another run (this one resumes from " + cfg.resume_from_checkpoint + ")"
                   : ", past this run's start (step " + std::to_string(start_step) + ")") +
        ": saving there would overwrite them or --save_total_limit would delete them or this run's own checkpoints; " +
        (elsewhere ? "" : "continue that run with --resume_from_checkpoint latest, ") +
        "delete them with --overwrite_output_dir, or choose another --output_dir");
  for (auto& [step, dir] : later) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    if (ec) return Status::error("--overwrite_output_dir: cannot delete '" + dir + "' (" + ec.message() + ")");
  }
  std::cerr << message_prefix() << ": --overwrite_output_dir: deleted " << names << " from " << cfg.output_dir
            << std::endl;
  return Status::ok();
}

Status guard_output_outside_checkpoint(const TrainConfig& cfg) {
  if (cfg.resume_from_checkpoint.empty()) return Status::ok();
  std::error_code ec;
  const std::filesystem::path ck = std::filesystem::weakly_canonical(cfg.resume_from_checkpoint, ec);
  if (ec) return Status::ok();  // restore() reports an unreadable checkpoint
  const std::filesystem::path out = std::filesystem::weakly_canonical(cfg.output_dir, ec);
  if (ec) return Status::ok();
  // out equals ck or lies below it: ck's components are a prefix of out's.
  auto o = out.begin();
  for (auto c = ck.begin(); c != ck.end(); ++c, ++o)
    if (o == out.end() || *o != *c) return Status::ok();
  return Status::error("--output_dir " + cfg.output_dir + " is " + (o == out.end() ? "" : "inside ") +
                       "the checkpoint this run resumes from (" + cfg.resume_from_checkpoint +
                       "): saving there would overwrite it; give the run's folder (the checkpoint's parent) or "
                       "another --output_dir");
}

Expected<TrainResult> train(const TrainConfig& cfg, const TrainGraphs& graphs, const Dataset& train_data,
                            const Dataset* eval_data, TrainerOptions opts) {
  std::optional<StopOnSignal> stop_on_signal;  // SIGINT/SIGTERM: stop after the current step
  stop_on_signal.emplace();
  KILN_ASSIGN_OR_RETURN(Trainer t, Trainer::create(cfg, graphs, &train_data, eval_data, opts));
  if (!cfg.resume_from_checkpoint.empty()) {
    KILN_RETURN_IF_ERROR(t.restore(cfg.resume_from_checkpoint));
    ir::MemoryStats::reset_peak();  // the load held old and new state at once: not a step's memory
  }
  if (opts.write_files) KILN_RETURN_IF_ERROR(guard_later_checkpoints(cfg, t.global_step(), t.total_steps()));
  // (Not when nothing is left to train: no value applies then.)
  if (const std::string w = t.take_resume_warning(); !w.empty() && opts.out && t.global_step() < t.total_steps())
    std::cerr << w << "\n";
  Expected<TrainResult> res = t.run();
  stop_on_signal.reset();
  // A signal during the last step or the final evaluation: the run finished all the same
  // (stop_signal() is what the commands' exit codes read).
  if (res && res->stopped_by_signal == 0) clear_stop_signal();
  return res;
}

}  // namespace kiln::runtime
