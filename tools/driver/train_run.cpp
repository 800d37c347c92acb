// One training run as `kiln train` does it; see train_run.h.
#include "tools/driver/train_run.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

#include "ir/op_table.h"
#include "ir/tensor.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "runtime/io.h"
#include "runtime/metrics.h"
#include "runtime/sequences.h"
#include "tools/driver/export_trained.h"
#include "tools/driver/logs.h"
#ifndef KILN_AOT
#include "codegen/cpu/program.h"
#include "tools/driver/program_cache.h"
#endif

namespace kiln::driver {

namespace fs = std::filesystem;
using runtime::TrainConfig;

std::vector<runtime::DataInputSpec> forward_specs(const ir::Graph& g, const TrainConfig& cfg) {
  std::vector<runtime::DataInputSpec> specs;
  for (ir::Value* in : g.inputs) specs.push_back({in->name, in->dtype, in->shape});
  if (cfg.loss != "model" && !g.outputs.empty()) {
    const ir::Value* out = g.outputs[0];
    std::string label = cfg.label_input.empty() ? "labels" : cfg.label_input;
    if (cfg.loss == "cross_entropy") {
      ir::Shape s = out->shape;
      if (s.rank() > 0) s.dims.pop_back();
      for (auto& d : s.dims) d = ir::Dim();  // shape checked against the compiled graph later
      specs.push_back({label, ir::DType::i64, s});
    } else {
      specs.push_back({label, out->dtype, out->shape});
    }
  }
  return specs;
}

runtime::DataOptions data_options(const TrainConfig& cfg) {
  runtime::DataOptions o;
  o.label_input = cfg.loss == "model" ? "" : (cfg.label_input.empty() ? "labels" : cfg.label_input);
  o.loss = cfg.loss;
  o.block_size = cfg.block_size;
  o.pad_token_id = cfg.pad_token_id;
  o.ignore_index = cfg.ignore_index;
  o.max_length = cfg.max_length;
  // buckets pad each batch to its bucket: length-grouped batches keep the padding low.
  o.group_by_length = cfg.group_by_length || cfg.shape_mode == "buckets";
  // Each megabatch holds about K - 1 batches that straddle a bucket boundary (padded to the
  // longer bucket): past 4 buckets (HF's 50-batch megabatches then pad up to 1.2x the
  // planner's bound on the Jargon sentences with K = 8) megabatches grow to 12 K batches
  // (1.1x). Derived from --shape_buckets whatever the mode, so that every mode of a
  // comparison trains the same batches.
  if (auto b = runtime::parse_shape_buckets(cfg.shape_buckets)) {
    const int64_t k = b->count > 0 ? b->count : static_cast<int64_t>(b->lengths.size());
    if (k > 4) o.mega_batch_mult = 12 * k;
  }
  o.drop_last = cfg.dataloader_drop_last;
  return o;
}

std::vector<std::string> sequence_symbols(const ir::Graph& module) {
  std::vector<std::string> r;
  for (const ir::Value* in : module.inputs)
    if (in->shape.rank() == 2 && ir::is_integer(in->dtype) && !in->shape.dims[1].is_static() &&
        !in->shape.dims[1].symbol().empty() && std::find(r.begin(), r.end(), in->shape.dims[1].symbol()) == r.end())
      r.push_back(in->shape.dims[1].symbol());
  return r;
}

ShapePrograms::ShapePrograms(TrainConfig cfg, passes::PassContext* dbg, int64_t total_steps,
                             std::unique_ptr<ir::Graph> module)
    : cfg_(std::move(cfg)), dbg_(dbg), total_steps_(total_steps), module_(std::move(module)) {}

Expected<runtime::TrainGraphs> ShapePrograms::get(const runtime::StepShape& given, const std::string& reason) {
  // --shape_mode symbolic: one program of every length, its sequence dim left a symbol;
  // one of every row count too when its batch dim is symbolic (kept under rows 0).
  const bool symbolic = cfg_.shape_mode == "symbolic";
  runtime::StepShape shape = given;
  if (symbolic) {
    shape.length = 0;
    if (auto it = programs_.find({0, shape.trips, 0}); it != programs_.end()) return graphs_of(it->second);
  }
  if (auto it = programs_.find(shape); it != programs_.end()) return graphs_of(it->second);
  const auto t0 = std::chrono::steady_clock::now();
  TrainConfig c = cfg_;
  // Rows 0 (a key of programs()): the symbolic-rows program, bounded by the configured batch.
  if (shape.micro_rows > 0) c.per_device_train_batch_size = shape.micro_rows;
  c.gradient_accumulation_steps = shape.trips;
  std::optional<TrainingProgram> prog;
  if (shape.length > 0) {
    if (!module_) {
      KILN_ASSIGN_OR_RETURN(module_, import_model(cfg_.model, cfg_.untie_initializers));
    }
    for (const std::string& sym : sequence_symbols(*module_)) {
      if (cfg_.shape.count(sym))
        return Status::error("--shape " + sym + "=" + std::to_string(cfg_.shape.at(sym)) + ": '" + sym +
                             "' is the sequence dim, which variable-length data binds per batch (--max_length bounds "
                             "it); leave it out of --shape");
      c.shape[sym] = shape.length;
    }
  }
#ifndef KILN_AOT
  if (!c.no_cache) prog = load_cached_program(c, dbg_);
#endif
  const bool hit = prog.has_value();
  log_text("recompiles", "program for " + reason + (hit ? " (from the program cache)" : ""));
  if (!prog) {
    if (!module_) {
      KILN_ASSIGN_OR_RETURN(module_, import_model(cfg_.model, cfg_.untie_initializers));
    }
    KILN_ASSIGN_OR_RETURN(TrainingProgram built,
                          build_training_program(c, dbg_, false, false, total_steps_, module_.get()));
#ifndef KILN_AOT
    store_cached_program(c, built, dbg_);  // removed again by the run's guard if it fails
#endif
    prog = std::move(built);
  }
  hit ? ++hits_ : ++built_;
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (symbolic && prog->train_step && runtime::symbolic_rows(*prog->train_step, prog->data_inputs))
    shape.micro_rows = 0;
  return graphs_of(programs_[shape] = std::move(*prog));
}

Expected<const ir::Graph*> ShapePrograms::module() {
  if (!module_) {
    KILN_ASSIGN_OR_RETURN(module_, import_model(cfg_.model, cfg_.untie_initializers));
  }
  return module_.get();
}

runtime::ProgramProvider ShapePrograms::provider() {
  return [this](const runtime::StepShape& shape, const std::string& reason) { return get(shape, reason); };
}

int64_t ShapePrograms::max_planned_peak() const {
  int64_t m = -1;
  for (auto& [k, p] : programs_) m = std::max(m, p.signature.planned_peak_bytes);
  return m;
}

int64_t ShapePrograms::arena_bytes() const {
  int64_t b = 0;
  for (auto& [k, p] : programs_) b += step_arena_bytes(p);
  return b;
}

runtime::TrainGraphs graphs_of(const TrainingProgram& p) {
  runtime::TrainGraphs g{p.train_step.get(),   p.eval.get(),        p.data_inputs,
                         p.label_input,        p.logits_output,     p.train_kernels.get(),
                         p.eval_kernels.get(), p.train_arena.get(), p.eval_arena.get()};
  // The batch shapes the trainer reads come from the program, not the flags.
  g.microbatch_rows = p.signature.microbatch_rows;
  g.accumulation_steps = p.signature.gradient_accumulation_steps;
  g.eval_rows = p.signature.eval_rows;
  return g;
}

Expected<std::vector<runtime::DataInputSpec>> program_specs(const ir::Graph& g, const std::vector<std::string>& names) {
  std::vector<std::string> present;
  for (auto& n : names)
    for (ir::Value* in : g.inputs)
      if (in->name == n) present.push_back(n);
  return runtime::data_input_specs(g, present);
}

int64_t initializer_bytes(const ir::Graph& g) {
  int64_t b = 0;
  for (ir::Value* v : g.initializers)
    if (v->data) b += static_cast<int64_t>(v->data->nbytes());
  return b;
}

std::optional<passes::MemoryPlan> executor_plan(const TrainingProgram& p) {
  if (!p.train_arena) return eager_plan(*p.train_step);
  // A symbolic program's arena is planned at its bound (arena_plan; signature's
  // planned_peak_bytes): nothing to plan here at unbound dims.
  for (const ir::Value* in : p.train_step->inputs)
    if (!in->shape.is_static()) return std::nullopt;
  auto plan = plan_step_arena_layout(*p.train_step);
  if (!plan) {
    std::cerr << "kiln: note: no memory plan: " << plan.message() << "\n";
    return std::nullopt;
  }
  return std::move(*plan);
}

int64_t step_arena_bytes(const TrainingProgram& p) { return p.train_arena ? p.train_arena->block_bytes() : 0; }

std::optional<passes::MemoryPlan> eager_plan(const ir::Graph& g) {
  auto p = passes::plan_memory(g, passes::PlanOptions::eager());
  if (!p) {
    std::string m = p.message();
    std::replace(m.begin(), m.end(), '\n', ' ');
    std::cerr << "kiln: note: no memory plan: " << m << "\n";
    return std::nullopt;
  }
  return std::move(*p);
}

std::string planned_vs_measured(int64_t planned, int64_t measured) {
  std::string s = "planned " + passes::human_bytes(planned) + " (" + std::to_string(planned) + " B), measured " +
                  passes::human_bytes(measured) + " (" + std::to_string(measured) + " B)";
  if (measured > 0) {
    char b[64];
    std::snprintf(b, sizeof b, "%+.2f", planned > 0 ? 100.0 * double(measured - planned) / double(planned) : 0.0);
    s += std::string(" (measured - planned: ") + b + "% of planned)";
  }
  return s;
}

namespace {

/// Most optimizer steps a run may count (a huge --num_train_epochs would overflow).
constexpr int64_t kMaxTrainSteps = 1000000000000000;  // 1e15

std::string epochs_text(double e) {
  std::ostringstream o;
  o << e;
  return o.str();
}
/// steps_per_epoch with the model's data specs (ProgramSignature::forward_specs), of
/// `rows_per_step` rows (<= 0: the flags' per_device_train_batch_size x
/// gradient_accumulation_steps, for a program not built yet).
Expected<int64_t> steps_per_epoch_of(const TrainConfig& cfg, const runtime::RawData& train_raw,
                                     const std::vector<runtime::DataInputSpec>& specs, int64_t rows_per_step = 0) {
  auto pre = runtime::Dataset::bind(train_raw, specs, data_options(cfg));
  if (!pre) return Status::error("--train_data: " + pre.status().message());
  if (rows_per_step <= 0) rows_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps;
  rows_per_step *= std::max<int64_t>(1, cfg.world_size);  // a data-parallel job's global batch
  const int64_t spe = pre->steps_per_epoch(rows_per_step);
  if (spe <= 0)
    return Status::error("--train_data " + pre->files() + ": " + std::to_string(pre->num_rows()) +
                         " rows, fewer than one step of " + std::to_string(rows_per_step) +
                         " (--per_device_train_batch_size x --gradient_accumulation_steps)");
  return spe;
}
}  // namespace

Expected<int64_t> steps_per_epoch(const TrainConfig& cfg, const runtime::RawData& train_raw) {
  KILN_ASSIGN_OR_RETURN(auto forward, load_model(cfg.model, cfg.shape, false, nullptr, cfg.untie_initializers));
  return steps_per_epoch_of(cfg, train_raw, forward_specs(*forward, cfg));
}

runtime::ProgramSignature model_signature(const ir::Graph& forward, const TrainConfig& cfg) {
  runtime::ProgramSignature sig;
  sig.forward_specs = forward_specs(forward, cfg);
  // Gather tables indexed straight by a data input: input name -> the table's extent.
  std::map<std::string, int64_t>& extent = sig.index_extents;
  for (const auto& n : forward.nodes()) {
    if (!ir::has_trait(*n, ir::OpTrait::gather) || n->num_inputs() < 2 || !n->inputs[0] || !n->inputs[1]) continue;
    const ir::Value* idx = n->inputs[1];
    if (std::find(forward.inputs.begin(), forward.inputs.end(), idx) == forward.inputs.end()) continue;
    const ir::Shape& ts = n->inputs[0]->shape;
    int64_t axis = n->attrs.get_int("axis", 0);
    if (axis < 0) axis += ts.rank();
    if (axis < 0 || axis >= ts.rank() || !ts.dims[static_cast<size_t>(axis)].is_static()) continue;
    const int64_t e = ts.dims[static_cast<size_t>(axis)].value;
    auto [it, fresh] = extent.try_emplace(idx->name, e);
    if (!fresh) it->second = std::min(it->second, e);
  }
  // Classes of cross_entropy labels: the logits' last dim.
  const std::string label_input = data_options(cfg).label_input;
  if (cfg.loss == "cross_entropy" && !label_input.empty() && !forward.outputs.empty()) {
    const ir::Shape& ls = forward.outputs[0]->shape;  // the logits the loss reads
    if (ls.rank() > 0 && ls.dims.back().is_static()) sig.classes = ls.dims.back().value;
  }
  return sig;
}

Status check_data_values(const runtime::RawData& raw, const std::string& flag, const ir::Graph& forward,
                         const TrainConfig& cfg) {
  return check_data_values(raw, flag, model_signature(forward, cfg), cfg);
}

Status check_data_values(const runtime::RawData& raw, const std::string& flag, const runtime::ProgramSignature& sig,
                         const TrainConfig& cfg) {
  const std::string label_input = data_options(cfg).label_input;
  const std::map<std::string, int64_t>& extent = sig.index_extents;
  const int64_t classes = sig.classes;
  auto fail = [&](const std::string& what) { return Status::error(flag + ": " + what); };
  for (const runtime::NamedArray& a : raw.arrays) {
    if (!ir::is_integer(a.data.dtype())) continue;
    const int64_t n = a.data.numel();
    const int64_t per_row = a.data.rank() > 0 && a.data.dim(0) > 0 ? n / a.data.dim(0) : 1;
    if (auto it = extent.find(a.input); it != extent.end()) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = a.data.get_i64(i);
        if (v < -it->second || v >= it->second)
          return fail(a.input + "=" + a.file + ": index " + std::to_string(v) + " at row " +
                      std::to_string(i / per_row) + " is outside [-" + std::to_string(it->second) + ", " +
                      std::to_string(it->second) +
                      ") (the table the model looks it up in; ONNX Gather counts negative indices from the end)");
      }
    }
    if (a.input == label_input && classes > 0) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = a.data.get_i64(i);
        if (v != cfg.ignore_index && (v < 0 || v >= classes))
          return fail(a.input + "=" + a.file + ": label " + std::to_string(v) + " at row " +
                      std::to_string(i / per_row) + " is outside [0, " + std::to_string(classes) +
                      ") (the model's classes; " + std::to_string(cfg.ignore_index) + " is ignored)");
      }
    }
  }
  if (raw.sequences) {
    // Token ids are Gather indices into the embedding (and, shifted, labels); explicit
    // labels are classes or ignore_index. Named by file and row.
    const runtime::SequenceSet& q = *raw.sequences;
    int64_t limit = classes > 0 ? classes : std::numeric_limits<int64_t>::max();
    for (auto& [name, e] : extent) limit = std::min(limit, e);
    auto row_of = [&](size_t k) {
      return std::upper_bound(q.offsets.begin(), q.offsets.end(), static_cast<int64_t>(k)) - q.offsets.begin() - 1;
    };
    for (size_t k = 0; k < q.tokens.size(); ++k)
      if (q.tokens[k] < 0 || q.tokens[k] >= limit)
        return fail(q.file + ": " + q.row_name(row_of(k)) + ": token " + std::to_string(q.tokens[k]) +
                    " is outside the model's vocabulary [0, " + std::to_string(limit) + ")");
    if (cfg.pad_token_id >= limit)
      return Status::error("--pad_token_id " + std::to_string(cfg.pad_token_id) +
                           " is outside the model's vocabulary [0, " + std::to_string(limit) + ")");
    if (classes > 0)
      for (size_t k = 0; k < q.labels.size(); ++k)
        if (q.labels[k] != cfg.ignore_index && (q.labels[k] < 0 || q.labels[k] >= classes))
          return fail(q.file + ": " + q.row_name(row_of(k)) + ": label " + std::to_string(q.labels[k]) +
                      " is outside [0, " + std::to_string(classes) + ") (the model's classes; " +
                      std::to_string(cfg.ignore_index) + " is ignored)");
  }
  if (raw.tokens && !raw.tokens->empty()) {
    // Every token is an input id (a Gather index) and, shifted, a label.
    int64_t limit = classes > 0 ? classes : std::numeric_limits<int64_t>::max();
    for (auto& [name, e] : extent) limit = std::min(limit, e);
    const auto& t = *raw.tokens;
    for (size_t i = 0; i < t.size(); ++i)
      if (static_cast<int64_t>(t[i]) >= limit)
        return fail(raw.token_file + ": token " + std::to_string(t[i]) + " at position " + std::to_string(i) +
                    " is outside the model's vocabulary [0, " + std::to_string(limit) + ")");
  }
  return Status::ok();
}

Status check_finite_parameters(const ir::Graph& g) {
  for (const ir::Value* v : ir::trainable_initializers(g)) {
    if (!v->data || !ir::is_float(v->dtype)) continue;
    const ir::Tensor& t = *v->data;
    const int64_t n = t.numel();
    for (int64_t i = 0; i < n; ++i) {
      const double x = t.dtype() == ir::DType::f32 ? static_cast<double>(t.data<float>()[i]) : t.get_f64(i);
      if (!std::isfinite(x))
        return Status::error("parameter '" + v->name + "' holds " +
                             (std::isnan(x) ? "NaN"
                              : x > 0       ? "inf"
                                            : "-inf") +
                             " (element " + std::to_string(i) + " of " + ir::dtype_name(v->dtype) +
                             v->shape.to_string() + "); training from it gives a NaN loss at every step");
    }
  }
  return Status::ok();
}

OutputGuard::OutputGuard(std::string output_dir, std::string progress_dir)
    : dir_(std::move(output_dir)), progress_dir_(std::move(progress_dir)) {
#ifndef KILN_AOT
  cache_mark_ = codegen::cache_paths_created().size();
#endif
  if (dir_.empty()) return;
  // The folders create_directories would make: dir_ and its missing parents.
  std::error_code ec;
  fs::path p = fs::absolute(dir_, ec).lexically_normal();
  if (!ec && p.filename().empty()) p = p.parent_path();  // "a/b/" -> "a/b"
  for (; !ec && !p.empty() && p != p.parent_path(); p = p.parent_path()) {
    std::error_code st;
    if (fs::exists(fs::symlink_status(p, st))) break;
    created_.push_back(p.string());
  }
  if (created_.empty())
    for (auto it = fs::directory_iterator(dir_, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
      before_.push_back(it->path().filename().string());
  std::sort(before_.begin(), before_.end());
}

OutputGuard::~OutputGuard() {
  if (!keep_) {
    std::error_code ec;
    if (!dir_.empty()) {
      std::vector<fs::path> fresh;
      bool progress = false;
      for (auto it = fs::directory_iterator(dir_, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (std::binary_search(before_.begin(), before_.end(), name)) continue;
        fresh.push_back(it->path());
        if (runtime::checkpoint_step(name) >= 0) progress = true;
      }
      if (!progress && !progress_dir_.empty())
        for (auto it = fs::directory_iterator(progress_dir_, ec); !ec && it != fs::directory_iterator();
             it.increment(ec))
          if (runtime::checkpoint_step(it->path().filename().string()) >= 0) progress = true;
      ec.clear();
      for (const fs::path& p : fresh)
        if (!progress || p.filename() == ".kiln.lock") fs::remove_all(p, ec);
      for (const std::string& d : created_) fs::remove(d, ec);  // only while empty
    }
#ifndef KILN_AOT
    const std::vector<std::string> cache = codegen::cache_paths_created();
    for (size_t i = cache.size(); i > cache_mark_; --i) fs::remove(cache[i - 1], ec);  // folders only while empty
#endif
  }
  lock_.reset();
}

/// Writes output_dir/model.safetensors, then model.onnx (the weights first: they need
/// nothing but themselves), and prints "saved ..." and the final eval metrics.
static Status save_trained(const TrainConfig& cfg, const runtime::TrainResult& res,
                           const decltype(ir::Graph::initializer_origins)& origins, std::ostream& out) {
  KILN_RETURN_IF_ERROR(
      runtime::io::save_safetensors((fs::path(cfg.output_dir) / "model.safetensors").string(), res.weights));
  std::string onnx_out = (fs::path(cfg.output_dir) / "model.onnx").string();
  Status s = export_trained_model(cfg.model, res.weights, origins, onnx_out);
  if (!s) return Status::error("export: " + s.message());
  out << "saved " << onnx_out << "\n";
  if (!res.eval_metrics.empty()) {
    out << "final";
    for (auto& [k, v] : res.eval_metrics) out << " | " << k << " " << runtime::format_metric(v);
    out << "\n";
  }
  return Status::ok();
}

Status run_training(TrainConfig cfg, passes::PassContext* dbg, std::ostream& out_given, runtime::Program* loaded) {
  if (cfg.train_data.empty()) return Status::error("--train_data is required (NAME=FILE.npy ... or FILE.bin)");
  KILN_RETURN_IF_ERROR(runtime::check_eval_schedule(cfg));
  // A data-parallel job (mpirun, srun: runtime/comm.h): the programs are built for its
  // ranks; rank 0 alone writes output_dir and prints.
  KILN_ASSIGN_OR_RETURN(const runtime::comm::Communicator* world, join_job(cfg));
  const bool rank0 = !world || world->rank() == 0;
  std::ostream quiet(nullptr);
  std::ostream& out = rank0 ? out_given : quiet;
  if (!rank0 && dbg) {  // --print-ir-after, --dump-ir-dir, --time-passes: rank 0's
    dbg->print_ir_after.clear();
    dbg->dump_ir_dir.clear();
    dbg->time_passes = false;
  }
  if (!world && cfg.zero_stage == 1)
    std::cerr << runtime::message_prefix()
              << ": warning: --zero_stage 1 shards the optimizer state over the ranks of a data-parallel job "
                 "(mpirun, srun); this process runs alone and keeps it whole\n";
  if (loaded && loaded->signature.world_size != cfg.world_size)
    return Status::error("this program was compiled for " + std::to_string(loaded->signature.world_size) +
                         " rank(s) and runs on " + std::to_string(cfg.world_size) +
                         "; compile it under the same launcher (mpirun -np " + std::to_string(cfg.world_size) +
                         " kiln compile ...)");
  // Before anything is created in output_dir (its lock file, its folders).
  KILN_RETURN_IF_ERROR(runtime::guard_output_outside_checkpoint(cfg));
  // Whatever this run creates in output_dir goes again if it fails.
  OutputGuard guard(rank0 ? cfg.output_dir : "");
  // The same for an explicit --logging_dir (TensorBoard's event files) outside output_dir.
  OutputGuard log_guard(rank0 && cfg.reports_tensorboard() ? cfg.logging_dir : "", cfg.output_dir);
  if (rank0) {
    KILN_RETURN_IF_ERROR(runtime::prepare_output_dir(cfg.output_dir));
    // One training run per output_dir at a time (checkpoints, metrics.jsonl, model files).
    KILN_ASSIGN_OR_RETURN(auto dir_lock, runtime::OutputDirLock::acquire(cfg.output_dir));
    guard.hold(std::move(dir_lock));
  }
  auto ctx = [](const Status& s, const std::string& what) { return Status::error(what + ": " + s.message()); };
  auto train_raw = runtime::load_raw_data(cfg.train_data);
  if (!train_raw) return ctx(train_raw.status(), "--train_data");
  if (!train_raw->sequences) {
    // The flags of variable-length data, given for arrays or a token file: say they do nothing.
    std::vector<std::string> unused;
    if (cfg.shape_mode != "pad") unused.push_back("--shape_mode");
    if (cfg.max_length > 0) unused.push_back("--max_length");
    if (cfg.pad_token_id != 0) unused.push_back("--pad_token_id");
    if (cfg.shape_buckets != "4") unused.push_back("--shape_buckets");
    if (cfg.recompile_limit != 8) unused.push_back("--recompile_limit");
    if (cfg.group_by_length) unused.push_back("--group_by_length");
    std::string list;
    for (const std::string& f : unused) list += (list.empty() ? "" : ", ") + f;
    if (!unused.empty())
      std::cerr << runtime::message_prefix() << ": warning: " << list
                << " shape variable-length data (FILE.jsonl, PREFIX.idx) only: ignored for "
                << (train_raw->tokens ? "a token file" : "NAME=FILE.npy arrays") << "\n";
  }
  runtime::RawData eval_raw;
  if (!cfg.eval_data.empty()) {
    auto e = runtime::load_raw_data(cfg.eval_data);
    if (!e) return ctx(e.status(), "--eval_data");
    eval_raw = std::move(*e);
  }
  if (cfg.resume_from_checkpoint == "true" || cfg.resume_from_checkpoint == "latest") {
    // HF: resume_from_checkpoint=True resumes from the newest checkpoint in output_dir.
    auto all = runtime::list_checkpoints(cfg.output_dir);
    if (all.empty()) return Status::error("--resume_from_checkpoint: no checkpoint-N in " + cfg.output_dir);
    cfg.resume_from_checkpoint = all.back().second;
  }
  if (!cfg.resume_from_checkpoint.empty() && !fs::is_directory(cfg.resume_from_checkpoint))
    return Status::error(
        "--resume_from_checkpoint: " + cfg.resume_from_checkpoint +
        (fs::exists(cfg.resume_from_checkpoint) ? ": a file, not a checkpoint-N directory" : ": no such directory"));

  // The program: given (DIR/train loads its own), from the program cache (no import, no
  // pass), or built from the model, imported once.
  // Variable-length data (issue 31) is trained by one program per batch shape, which the
  // trainer asks for (ShapePrograms); DIR/train runs its own program only.
  const bool per_shape = train_raw->sequences != nullptr && !loaded;
  std::optional<TrainingProgram> have;
  if (loaded) have = std::move(*loaded);
#ifndef KILN_AOT
  else if (!cfg.no_cache && !per_shape)
    have = load_cached_program(cfg, dbg);
#endif
  std::unique_ptr<ir::Graph> module;
  runtime::ProgramSignature sig;
  if (have) {
    sig = have->signature;
    if (have->train_step) print_import_notes(*have->train_step);
  } else {
    KILN_ASSIGN_OR_RETURN(module, import_model(cfg.model, cfg.untie_initializers));
    KILN_ASSIGN_OR_RETURN(auto forward, specialize_model(*module, cfg.model, cfg.shape, false, nullptr));
    KILN_RETURN_IF_ERROR(check_finite_parameters(*forward).with_context(cfg.model));
    sig = model_signature(*forward, cfg);
  }
  // Check the data against the model before compiling (shapes and dtypes; labels and
  // token ids, which a bad eval file would otherwise show only at the first evaluation,
  // after training), and count steps.
  // A loaded program says how many rows a step reads; one about to be built reads the flags'.
  KILN_ASSIGN_OR_RETURN(const int64_t spe, steps_per_epoch_of(cfg, *train_raw, sig.forward_specs, sig.rows_per_step));
  KILN_RETURN_IF_ERROR(check_data_values(*train_raw, "--train_data", sig, cfg));
  if (!cfg.eval_data.empty()) KILN_RETURN_IF_ERROR(check_data_values(eval_raw, "--eval_data", sig, cfg));
  const int64_t total = cfg.total_steps(spe);
  if (total > kMaxTrainSteps)
    return Status::error(cfg.max_steps > 0 ? "--max_steps " + std::to_string(cfg.max_steps) + " is more than " +
                                                 std::to_string(kMaxTrainSteps) + " optimizer steps"
                                           : "--num_train_epochs " + epochs_text(cfg.num_train_epochs) + " at " +
                                                 std::to_string(spe) + " steps per epoch gives more than " +
                                                 std::to_string(kMaxTrainSteps) +
                                                 " optimizer steps; give fewer epochs or --max_steps");

  // The programs of other batch shapes: each padded length of variable-length data, the
  // epoch's last partial batch. DIR/train has its own program only.
  std::optional<ShapePrograms> shapes;
#ifndef KILN_AOT
  if (per_shape || !cfg.dataloader_drop_last) {
    shapes.emplace(cfg, dbg, total, per_shape ? std::move(module) : nullptr);
  }
#endif
  if (per_shape) {
    // The datasets are bound to the model's own inputs (symbolic sequence dim); the
    // trainer pads each batch and asks for its program.
    runtime::DataOptions dopts = data_options(cfg);
    {
      KILN_ASSIGN_OR_RETURN(const ir::Graph* m, shapes->module());
      for (const std::string& sym : sequence_symbols(*m))
        if (cfg.shape.count(sym))
          return Status::error("--shape " + sym + "=" + std::to_string(cfg.shape.at(sym)) + ": '" + sym +
                               "' is the sequence dim, which variable-length data binds per batch (--max_length "
                               "bounds it); leave it out of --shape");
    }
    auto train_ds = runtime::Dataset::bind(*train_raw, sig.forward_specs, dopts);
    if (!train_ds) return ctx(train_ds.status(), "--train_data");
    std::optional<runtime::Dataset> eval_ds;
    if (!cfg.eval_data.empty()) {
      auto e = runtime::Dataset::bind(eval_raw, sig.forward_specs, dopts);
      if (!e) return ctx(e.status(), "--eval_data");
      if (!e->is_sequences())
        return Status::error(
            "--eval_data: variable-length training data needs variable-length eval data "
            "(FILE.jsonl or PREFIX.idx), got " +
            e->files());
      eval_ds = std::move(*e);
    }
    shapes->set_longest_row(std::max(train_ds->max_length(), eval_ds ? eval_ds->max_length() : 0));
    const int64_t mem_base = ir::MemoryStats::current_bytes();
    ir::MemoryStats::reset_peak();
    runtime::TrainerOptions topts;
    topts.programs = shapes->provider();
    topts.memory_base_bytes = mem_base;
    KILN_ASSIGN_OR_RETURN(auto res,
                          runtime::train(cfg, runtime::TrainGraphs{}, *train_ds, eval_ds ? &*eval_ds : nullptr, topts));
    const int64_t mem_measured = ir::MemoryStats::peak_bytes() - mem_base;
    if (res.stopped_by_signal) {
      if (!res.step_losses.empty()) guard.keep(), log_guard.keep();
      return Status::ok();
    }
    if (shapes->programs().empty()) return Status::error("no program was built (internal)");
    if (rank0)
      KILN_RETURN_IF_ERROR(
          save_trained(cfg, res, shapes->programs().begin()->second.train_step->initializer_origins, out));
    out << "programs: " << shapes->programs().size() << " (" << shapes->built() << " built, " << shapes->cache_hits()
        << " from the program cache, " << runtime::format_time(shapes->seconds()) << ")\n";
    if (const int64_t planned = shapes->max_planned_peak(); planned >= 0 && !res.step_losses.empty())
      out << "peak memory: " << planned_vs_measured(planned, mem_measured)
          << " (planned: the largest program's step; measured: every step, with the programs' constants and their "
          << shapes->programs().size() << " step arenas, " << passes::human_bytes(shapes->arena_bytes()) << ")\n";
    guard.keep();
    log_guard.keep();
    return Status::ok();
  }

  if (!have) {
    // On a terminal, a compile that takes over a second shows its elapsed time (erased after).
    runtime::ElapsedIndicator compiling(std::cout, !cfg.disable_tqdm && isatty(fileno(stdout)) != 0 && !world,
                                        "compiling the training program");
    compiling.start();
    auto built_or = build_training_program(cfg, dbg, false, false, total, module.get());
    compiling.stop();
    KILN_ASSIGN_OR_RETURN(auto built, std::move(built_or));
    module.reset();  // ShapePrograms imports again if the last partial batch needs a program
#ifndef KILN_AOT
    store_cached_program(cfg, built, dbg);  // removed again by the guard if the run fails
#endif
    have = std::move(built);
  }
  TrainingProgram& prog = *have;
  KILN_ASSIGN_OR_RETURN(auto train_specs, program_specs(*prog.train_step, prog.data_inputs));
  auto train_ds = runtime::Dataset::bind(*train_raw, train_specs, data_options(cfg));
  if (!train_ds) return ctx(train_ds.status(), "--train_data");
  std::optional<runtime::Dataset> eval_ds;
  if (!cfg.eval_data.empty()) {
    if (!prog.eval) return Status::error("the training program has no eval graph");
    KILN_ASSIGN_OR_RETURN(auto eval_specs, program_specs(*prog.eval, prog.data_inputs));
    auto e = runtime::Dataset::bind(eval_raw, eval_specs, data_options(cfg));
    if (!e) return ctx(e.status(), "--eval_data");
    eval_ds = std::move(*e);
  }
  // Measured peak of the steps: MemoryStats peak over the run minus what was resident
  // before it (datasets, graphs), plus the train_step's own constants. The trainer's
  // state copies, batches and step values are allocated inside the run.
  const int64_t planned_peak = prog.signature.planned_peak_bytes;
  // The step arena's block was allocated with the program and is step memory.
  const int64_t mem_base =
      ir::MemoryStats::current_bytes() - initializer_bytes(*prog.train_step) - step_arena_bytes(prog);
  ir::MemoryStats::reset_peak();
  runtime::TrainerOptions topts;
  topts.planned_peak_bytes = planned_peak;
  topts.memory_base_bytes = mem_base;
  if (shapes) topts.programs = shapes->provider();
  topts.suggest_program_flags = loaded == nullptr;  // a loaded program's shapes are fixed
  KILN_ASSIGN_OR_RETURN(auto res,
                        runtime::train(cfg, graphs_of(prog), *train_ds, eval_ds ? &*eval_ds : nullptr, topts));
  const int64_t mem_measured = ir::MemoryStats::peak_bytes() - mem_base;
  if (res.stopped_by_signal) {  // not done: no trained model (the caller exits 128 + signal)
    // What the steps wrote (metrics.jsonl, event files) is the record of the stopped run.
    if (!res.step_losses.empty()) guard.keep(), log_guard.keep();
    return Status::ok();
  }

  if (rank0) KILN_RETURN_IF_ERROR(save_trained(cfg, res, prog.train_step->initializer_origins, out));
  if (planned_peak >= 0 && res.step_losses.empty())
    out << "peak memory: planned " << passes::human_bytes(planned_peak) << " (" << planned_peak
        << " B); no training step ran, nothing measured\n";
  else if (planned_peak >= 0)
    out << "peak memory: " << planned_vs_measured(planned_peak, mem_measured)
        << (eval_ds ? " (planned: the training step; measured: training and evaluation steps)" : "") << "\n";
  guard.keep();
  log_guard.keep();
  return Status::ok();
}

}  // namespace kiln::driver
