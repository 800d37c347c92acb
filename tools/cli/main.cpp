// The kiln command line (flags parsed with CLI11): train, compile, grad, gradcheck, bench, inspect, run.
//
// Every TrainConfig field is a flag `--<name>` with its Hugging Face name; a JSON file
// given with --config sets the same keys, and flags on the command line override it.
// Errors are one line `kiln: error: ...` on stderr; exit code 2 for bad usage (unknown
// flag, bad option value, missing required argument), 1 for failures at run time
// (missing or malformed files, data that does not fit the model, I/O errors). No
// exception escapes main.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>

#include "frontend/onnx_import.h"
#include "frontend/onnx_lower.h"
#include "ir/op_table.h"
#include "ir/tensor.h"
#include "passes/memory_plan.h"
#include "passes/pass.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/interpreter.h"
#include "runtime/interrupt.h"
#include "runtime/io.h"
#include "runtime/train_config.h"
#include "runtime/trainer.h"
#include "tools/driver/aot_build.h"
#include "tools/driver/bench.h"
#include "tools/driver/driver.h"
#include "tools/driver/export_trained.h"
#include "tools/driver/fit.h"
#include "tools/driver/gradcheck.h"
#include "tools/driver/pipeline.h"
#include "tools/driver/plot.h"
#include "tools/driver/train_run.h"

namespace {

using namespace kiln;
using driver::data_options;
using driver::eager_plan;
using driver::forward_specs;
using runtime::TrainConfig;
namespace fs = std::filesystem;

/// A failure with its exit code (2: usage, 1: run time).
struct Failure {
  int code;
  std::string msg;
};

/// Length of the valid UTF-8 sequence at s[i] (0: not one).
size_t utf8_length(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 && c < 0xE0 ? 2 : 0;
  if (n == 0 || c > 0xF4 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  return n;
}

/// One line of valid UTF-8: newlines become spaces; other control bytes and bytes that
/// are not UTF-8 (names read from a corrupt file) are written as \xNN.
std::string one_line(const std::string& in) {
  std::string s;
  for (size_t i = 0; i < in.size(); ++i) {
    const auto c = static_cast<unsigned char>(in[i]);
    if (c == '\n' || c == '\r' || c == '\t') {
      s += ' ';
    } else if (c < 0x20 || c == 0x7F) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02X", c);
      s += b;
    } else if (c < 0x80) {
      s += static_cast<char>(c);
    } else if (const size_t n = utf8_length(in, i)) {
      s.append(in, i, n);
      i += n - 1;
    } else {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02X", c);
      s += b;
    }
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

int report(const Failure& f) {
  // One write per line: the ranks of a data-parallel job share the terminal.
  const std::string line = "kiln" + runtime::comm::rank_tag() + ": error: " + one_line(f.msg) + "\n";
  std::cerr.write(line.data(), static_cast<std::streamsize>(line.size()));
  std::cerr.flush();
  runtime::comm::abort_world(f.code);  // the other ranks would wait for this one
  return f.code;
}

/// Raw text of every config flag, bound to CLI11 options; applied after parsing.
struct ConfigFlags {
  bool backend_list = false;  ///< --backend and --remat_policy may be lists (kiln bench only)
  bool remat_list = false;    ///< --remat_policy may be a list (kiln inspect --memory: one plan per policy)
  bool fit_ok = false;        ///< --auto_fit, --auto_find_batch_size, --effective_batch_size apply (train)
  bool fit_command = false;   ///< kiln fit: the recipe search is the command itself
  std::map<std::string, std::vector<std::string>> values;
  std::map<std::string, CLI::Option*> options;
  std::string config_file;
  std::string model_pos;
  // pass-manager debugging switches
  std::string print_ir_after, dump_ir_dir;
  bool verify_each = false, time_passes = false;
  int stop_after = -1;

  void add_to(CLI::App* app, bool with_model = true) {
    if (with_model) app->add_option("model", model_pos, "the .onnx model");
    app->add_option("--config", config_file, "JSON file with option values (flags override it)");
    TrainConfig dummy;
    for (auto& f : runtime::config_fields(dummy)) {
      auto& v = values[f.name];
      CLI::Option* o;
      std::string flag = "--" + f.name;
      if (f.kind == runtime::ConfigField::Kind::boolean) {
        o = app->add_flag(flag, v, f.help);
      } else {
        o = app->add_option(flag, v, f.help)->allow_extra_args(false);
      }
      options[f.name] = o;
    }
    app->add_option("--print-ir-after", print_ir_after, "print the IR after PASS (or all)");
    app->add_option("--dump-ir-dir", dump_ir_dir, "write NN-pass.txt after each pass");
    app->add_flag("--verify-each", verify_each, "run the verifier after each pass");
    app->add_flag("--time-passes", time_passes, "report the time of each pass");
    app->add_option("--stop-after", stop_after, "stop after the N-th pass");
  }

  /// Defaults <- --config file <- flags; then validate.
  TrainConfig build() const {
    TrainConfig cfg;
    cfg.backend = "compiled";  // the command line's default (TrainConfig's own is eager, the reference)
    if (!config_file.empty()) {
      if (std::error_code ec; !fs::exists(config_file, ec))
        throw Failure{2, "--config: " + config_file + ": no such file"};
      Status s = runtime::load_config_json(config_file, cfg);
      if (!s) throw Failure{2, s.message()};
    }
    std::map<std::string, std::vector<std::string>> given;
    for (auto& [name, o] : options)
      if (o->count() > 0) given[name] = values.at(name);
    Status applied = runtime::apply_flag_values(cfg, given);
    if (!applied) throw Failure{2, applied.message()};
    runtime::eval_off_without_eval_data(cfg, given);
    if (!model_pos.empty()) cfg.model = model_pos;
    if (cfg.model.empty()) throw Failure{2, "a MODEL.onnx argument is required"};
    if (fit_command) {
      if (cfg.memory_budget.empty())
        throw Failure{2, "--memory_budget is required: the budget a training step must fit (e.g. 800MB, 24GiB, auto)"};
      cfg.auto_fit = true;
    } else if (!fit_ok) {
      for (const char* f : {"auto_fit", "auto_find_batch_size", "effective_batch_size"})
        if (this->given(f))
          throw Failure{2, std::string("--") + f + ": the recipe search runs in kiln train and kiln fit only"};
    }
    Status v = cfg.validate();
    if (!v) throw Failure{2, v.message()};
    if (!backend_list && cfg.backend.find(',') != std::string::npos)
      throw Failure{2, "--backend: one backend per program (a list such as '" + cfg.backend + "' is for kiln bench)"};
    if (!backend_list && cfg.optim.find(',') != std::string::npos)
      throw Failure{2, "--optim: one optimizer per program (a list such as '" + cfg.optim + "' is for kiln bench)"};
    if (!backend_list && !remat_list && cfg.remat_policy.find(',') != std::string::npos)
      throw Failure{
          2, "--remat_policy: one policy per program (a list such as '" + cfg.remat_policy + "' is for kiln bench)"};
    if (std::error_code ec; !fs::exists(cfg.model, ec))
      throw Failure{1, cfg.model + (ec ? ": " + ec.message() : std::string(": no such file"))};
    return cfg;
  }

  /// Whether flag `name` was set: on the command line or as a key of the --config file.
  bool given(const std::string& name) const {
    if (auto it = options.find(name); it != options.end() && it->second->count() > 0) return true;
    if (config_file.empty()) return false;
    std::ifstream in(config_file);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    return !j.is_discarded() && j.is_object() && j.contains(name);
  }

  passes::PassContext pass_context() const {
    passes::PassContext ctx;
    if (!print_ir_after.empty() && print_ir_after != "all") {
      const std::vector<std::string> names = passes::pass_names();
      if (std::find(names.begin(), names.end(), print_ir_after) == names.end()) {
        std::string near, all;
        for (const std::string& n : runtime::near_names(print_ir_after, {names.begin(), names.end()}))
          near += (near.empty() ? "" : " or ") + n;
        for (const std::string& n : names) all += (all.empty() ? "" : ", ") + n;
        throw Failure{2, "--print-ir-after " + print_ir_after + ": no such pass" +
                             (near.empty() ? std::string() : " (did you mean " + near + "?)") + "; passes: all, " +
                             all};
      }
    }
    // Passes of the compiled pipeline only: asking for them with --backend eager prints nothing.
    const auto& cp = driver::compiled_pipeline();
    const bool compiled_pass = std::find(cp.begin(), cp.end(), print_ir_after) != cp.end();
    if (compiled_pass && values.count("backend") && options.at("backend")->count() > 0) {
      bool compiled = false;
      for (auto& v : values.at("backend")) compiled = compiled || v.find("compiled") != std::string::npos;
      if (!compiled)
        std::cerr << "kiln: note: --print-ir-after " << print_ir_after
                  << ": that pass runs only with --backend compiled\n";
    }
    ctx.print_ir_after = print_ir_after;
    ctx.dump_ir_dir = dump_ir_dir;
    ctx.verify_each = verify_each;
    ctx.time_passes = time_passes;
    ctx.stop_after = stop_after;
    return ctx;
  }
};

/// --print-ir-after PASS printed nothing because PASS is not in this program's pipeline
/// (autocast without --bf16/--fp16, remat without a policy, ...): say so on stderr.
void note_unrun_pass(const passes::PassContext& dbg) {
  if (dbg.print_ir_after.empty() || dbg.print_ir_after == "all" || dbg.pass_seconds.count(dbg.print_ir_after)) return;
  std::cerr << "kiln: note: --print-ir-after " << dbg.print_ir_after
            << ": that pass did not run for these flags, so nothing was printed (--print-ir-after all lists the "
               "passes that ran)\n";
}

template <typename T>
T unwrap(Expected<T> e, const std::string& ctx = "") {
  if (!e) throw Failure{1, ctx.empty() ? e.message() : ctx + ": " + e.message()};
  return std::move(*e);
}

void check(const Status& s, const std::string& ctx = "") {
  if (!s) throw Failure{1, ctx.empty() ? s.message() : ctx + ": " + s.message()};
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// ------------------------------------------------------------------ memory
// ------------------------------------------------------------------ train
/// The recipe search of kiln fit and kiln train --auto_fit: prints the table and returns
/// the result (the caller reads the chosen recipe). Errors: exit 1 for a search that
/// fails or finds nothing that fits (one line: the smallest reachable peak).
std::pair<driver::FitOptions, driver::FitResult> search_recipe(const ConfigFlags& flags, const TrainConfig& cfg,
                                                               const std::string& who, int measure_top = 3,
                                                               int measure_steps = 2) {
  if (runtime::is_sequence_data(cfg.train_data))
    throw Failure{2, who +
                         ": variable-length data (--train_data ROWS.jsonl or PREFIX.idx) is not searched yet; "
                         "fit a recipe at --max_length with kiln fit on fixed-length data"};
  std::string note;
  auto o = driver::fit_options(
      cfg, [&flags](const std::string& n) { return flags.given(n); }, &note);
  if (!o) throw Failure{2, o.message()};  // the flags contradict each other
  if (!note.empty()) std::cerr << "kiln: note: " << note << "\n";
  // The data, checked against the model before the search (not after it).
  check(driver::check_fit_data(*o));
  o->measure_top = measure_top;
  o->measure_steps = measure_steps;
  auto r = unwrap(driver::run_fit(*o, std::cerr));
  std::cout << driver::format_fit(r, *o);
  if (r.chosen < 0) throw Failure{1, driver::fit_nothing_fits(r, *o)};
  return {*o, r};
}

int cmd_train(const ConfigFlags& flags) {
  TrainConfig cfg = flags.build();
  if (cfg.train_data.empty()) throw Failure{2, "--train_data is required (NAME=FILE.npy ... or FILE.bin)"};
  if (Status s = runtime::check_eval_schedule(cfg); !s) throw Failure{2, s.message()};
  if (cfg.fitting() && !cfg.resume_from_checkpoint.empty()) {
    // A resume continues the checkpoint's recipe (a new search could measure another);
    // a recipe flag given now that says otherwise is refused, as a plain resume refuses
    // another --optim.
    const TrainConfig asked = cfg;
    if (const std::string from = driver::apply_checkpoint_recipe(cfg); !from.empty()) {
      const std::string why = ": this --auto_fit run resumes " + from +
                              ", whose recipe it continues; resume without --auto_fit to change it";
      auto differs = [&](const char* flag, bool d) {
        if (flags.given(flag) && d) throw Failure{2, std::string("--") + flag + why};
      };
      differs("per_device_train_batch_size", asked.per_device_train_batch_size != cfg.per_device_train_batch_size);
      differs("gradient_accumulation_steps", asked.gradient_accumulation_steps != cfg.gradient_accumulation_steps);
      differs("bf16", asked.bf16 != cfg.bf16);
      differs("fp16", asked.fp16 != cfg.fp16);
      differs("remat_policy", asked.effective_remat_policy() != cfg.effective_remat_policy());
      differs("gradient_checkpointing", asked.effective_remat_policy() != cfg.effective_remat_policy());
      differs("optim", asked.optim != cfg.optim);
      differs("effective_batch_size",
              asked.effective_batch_size > 0 &&
                  asked.effective_batch_size != cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps);
      const driver::FitCandidate c = driver::FitCandidate::of(cfg);
      auto budget = runtime::parse_byte_size(cfg.memory_budget);
      std::cout << "auto_fit: resuming with the recipe of " << from << ": "
                << driver::fit_flags(c, budget && !cfg.memory_budget.empty() ? *budget : 0)
                << " (not searched again: --memory_budget is not checked against it)\n";
    } else
      cfg.auto_fit = cfg.auto_find_batch_size = false, cfg.effective_batch_size = 0;  // the resume reports it
  } else if (cfg.fitting()) {
    auto [o, r] = search_recipe(flags, cfg, cfg.auto_fit ? "--auto_fit" : "--auto_find_batch_size");
    const driver::FitCandidate& c = r.candidates[static_cast<size_t>(r.chosen)];
    cfg = c.config(o.config, o.memory_budget);
    std::cout << "auto_fit: training with " << driver::fit_flags(c, o.memory_budget) << "\n";
  }
  passes::PassContext dbg = flags.pass_context();
  check(driver::run_training(cfg, &dbg, std::cout));
  // Stopped by SIGINT/SIGTERM after a step (runtime/interrupt.h): 128 + the signal, as a
  // shell reports a process the signal ended, so that scripts see the run did not finish.
  if (const int sig = runtime::stop_signal()) return 128 + sig;
  note_unrun_pass(dbg);
  return 0;
}

// ------------------------------------------------------------------ fit
/// Whether an output flag was given: an empty path is a usage error (not a silent no-op).
bool flags_given_value(const std::string& flag, const std::string& path) {
  if (path.empty()) return false;
  if (path.find_first_not_of(" \t") == std::string::npos) throw Failure{2, flag + ": expected a file path"};
  return true;
}

/// `kiln fit MODEL --memory_budget X [--effective_batch_size N] [train flags]`: the recipe
/// that fits the budget (tools/driver/fit.h), as a table, flags and --config JSON;
/// --plot draws peak against time, --save_config writes the recipe's JSON.
int cmd_fit(const ConfigFlags& flags, int measure_top, int measure_steps, const std::string& plot,
            const std::string& save_config, const std::string& report_json) {
  TrainConfig cfg = flags.build();
  if (measure_top < 0) throw Failure{2, "--measure_top must be >= 0 (0: rank by the cost model only)"};
  if (measure_steps < 1) throw Failure{2, "--measure_steps must be >= 1"};
  // kiln fit trains nothing and writes only its own outputs: run flags are refused, as
  // kiln bench refuses them.
  for (const char* f : {"output_dir", "save_steps", "save_total_limit", "resume_from_checkpoint",
                        "overwrite_output_dir", "eval_data", "eval_steps", "report_to", "logging_dir"})
    if (flags.given(f))
      throw Failure{2, std::string("--") + f +
                           ": kiln fit searches recipes and trains nothing (give it to kiln train, with the "
                           "recipe's flags or --auto_fit)"};
  // The output files: each its own path, in a folder that exists and is writable, checked
  // before the search; written together at the end (all or none).
  std::vector<std::pair<std::string, std::string>> outputs;  // flag, path
  for (auto [f, p] : {std::pair<const char*, const std::string*>{"--plot", &plot},
                      {"--save_config", &save_config},
                      {"--report_json", &report_json}})
    if (flags_given_value(f, *p)) outputs.push_back({f, *p});
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = 0; j < i; ++j)
      if (fs::weakly_canonical(outputs[i].second) == fs::weakly_canonical(outputs[j].second))
        throw Failure{2, outputs[i].first + " " + outputs[i].second + ": the same file as " + outputs[j].first};
    const fs::path parent = fs::absolute(outputs[i].second).parent_path();
    if (std::error_code ec; !fs::is_directory(parent, ec) || ::access(parent.c_str(), W_OK) != 0)
      throw Failure{2, outputs[i].first + " " + outputs[i].second + ": cannot write into " + parent.string() +
                           (fs::is_directory(parent, ec) ? " (not writable)" : " (no such folder)")};
    if (std::error_code ec; fs::is_directory(outputs[i].second, ec))
      throw Failure{2, outputs[i].first + " " + outputs[i].second + ": a folder, not a file"};
  }
  auto [o, r] = search_recipe(flags, cfg, "kiln fit", measure_top, measure_steps);
  const driver::FitCandidate& c = r.candidates[static_cast<size_t>(r.chosen)];
  std::vector<std::pair<std::string, std::string>> files;  // path, text
  for (const auto& [f, p] : outputs)
    files.push_back({p, f == "--plot"          ? driver::fit_svg(r, o)
                        : f == "--save_config" ? driver::fit_config_json(c, o.memory_budget) + "\n"
                                               : driver::fit_report_json(r, o) + "\n"});
  check(driver::write_text_files(files));
  for (const auto& [f, p] : outputs) std::cout << "wrote " << p << "\n";
  return 0;
}

// ------------------------------------------------------------------ compile
/// `kiln compile MODEL [train flags] -o DIR`: the training program built ahead of time
/// into a standalone binary DIR/train plus readable compiler output (tools/driver/aot_build.h).
int cmd_compile(const ConfigFlags& flags, const std::string& out_dir) {
  TrainConfig cfg = flags.build();
  if (out_dir.empty()) throw Failure{2, "compile: -o DIR is required"};
  // Under mpirun or srun: a binary for that many ranks (its collectives; DIR/train refuses
  // another count). Rank 0 compiles; nothing is communicated.
  const runtime::comm::LaunchInfo job = runtime::comm::launch_info();
  if (job.rank != 0) return 0;
  cfg.world_size = job.world_size;
  // Usage errors (exit 2): another backend, DIR/train's per-run flags.
  if (Status s = driver::check_compile_flags(cfg); !s) throw Failure{2, s.message()};
  // The binary would refuse every run without --eval_data.
  if (Status s = runtime::check_eval_schedule(cfg); !s) throw Failure{2, s.message()};
  passes::PassContext dbg = flags.pass_context();
  driver::OutputGuard guard(out_dir);  // a refused compile leaves no folder or file it created
  check(driver::compile_training_binary(cfg, dbg, out_dir, std::cout), "compile");
  guard.keep();
  note_unrun_pass(dbg);
  return 0;
}

// ------------------------------------------------------------------ grad
/// The driver's gradient program and its feeds for one batch: the first
/// per_device_train_batch_size rows of --train_data in file order, and every state
/// input at its initial value.
struct GradSetup {
  driver::TrainingProgram prog;
  std::map<std::string, ir::Tensor> feeds;
};

GradSetup grad_setup(const ConfigFlags& flags, TrainConfig& cfg, bool f64) {
  if (cfg.train_data.empty()) throw Failure{2, "--train_data is required"};
  // Under mpirun or srun (kiln grad): the job's gradients, summed over the ranks, of the
  // first world_size x rows_per_step rows, rank r computing on the r-th slice.
  const runtime::comm::Communicator* world = unwrap(driver::join_job(cfg), "data parallel");
  const int64_t rank = world ? world->rank() : 0;
  // The gradients come from the eager interpreter running the gradient graph (the
  // reference); building the compiled program as well would only cost its LLVM time.
  if (flags.options.count("backend") && flags.options.at("backend")->count() > 0 && cfg.backend != "eager")
    throw Failure{2, "--backend " + cfg.backend +
                         ": kiln grad and gradcheck compute gradients with the eager "
                         "reference interpreter; omit --backend (or give --backend eager)"};
  cfg.backend = "eager";
  runtime::RawData raw = unwrap(runtime::load_raw_data(cfg.train_data), "--train_data");
  passes::PassContext dbg = flags.pass_context();
  GradSetup s{unwrap(driver::build_training_program(cfg, &dbg, true, f64, cfg.max_steps > 0 ? cfg.max_steps : 1)), {}};
  note_unrun_pass(dbg);
  if (!s.prog.grads) throw Failure{1, "the driver built no gradient graph"};
  const ir::Graph& g = *s.prog.grads;
  auto specs = unwrap(driver::program_specs(g, s.prog.data_inputs));
  auto ds = unwrap(runtime::Dataset::bind(raw, specs, data_options(cfg)), "--train_data");
  const int64_t rows = s.prog.signature.rows_per_step;
  auto job_batch = unwrap(ds.first_batch(rows * cfg.world_size), "--train_data");
  runtime::Batch batch;  // this rank's slice: rows [rank * rows, (rank + 1) * rows)
  for (auto& [name, t] : job_batch) {
    std::vector<int64_t> dims = t.dims();
    const size_t row_bytes = t.nbytes() / static_cast<size_t>(dims[0]);
    dims[0] = rows;
    ir::Tensor part(t.dtype(), dims);
    std::memcpy(part.raw(), static_cast<const char*>(t.raw()) + static_cast<size_t>(rank * rows) * row_bytes,
                part.nbytes());
    batch[name] = std::move(part);
  }
  for (ir::Value* in : g.inputs) {
    auto b = batch.find(in->name);
    if (b != batch.end()) {
      for (auto& sp : specs)
        if (sp.name == in->name) s.feeds[in->name] = unwrap(runtime::fit_to_input(b->second, sp));
      continue;
    }
    if (in->name == runtime::kNumItemsInput && batch.count(s.prog.label_input)) {  // accumulation, tokens
      s.feeds[in->name] = runtime::num_items_tensor(  // the job's labels: every rank's slice
          runtime::count_num_items(job_batch.at(s.prog.label_input), cfg.ignore_index), in->dtype);
      continue;
    }
    bool found = false;
    for (auto& sb : g.state)
      if (sb.input == in && sb.initial) s.feeds[in->name] = *sb.initial, found = true;
    if (!found) throw Failure{1, "grads graph input '" + in->name + "' has no data or initial value"};
  }
  return s;
}

int cmd_grad(const ConfigFlags& flags, const std::string& out, bool f64) {
  TrainConfig cfg = flags.build();
  if (out.empty()) throw Failure{2, "--out is required"};
  if (fs::is_directory(out)) throw Failure{2, "--out " + out + ": is a directory; give a .safetensors file path"};
  GradSetup setup = grad_setup(flags, cfg, f64);
  const ir::Graph& g = *setup.prog.grads;
  auto& feeds = setup.feeds;
  runtime::RunOptions ro;
  ro.training = true;
  ro.seed = cfg.seed;
  auto outs = unwrap(runtime::run_graph(g, feeds, ro));
  std::map<std::string, ir::Tensor> result;
  for (auto& [name, t] : outs) {
    const std::string suffix = ".grad";
    if (name == "loss")
      result["loss"] = t;
    else if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      result[name.substr(0, name.size() - suffix.size())] = t;
  }
  if (!result.count("loss")) throw Failure{1, "grads graph has no 'loss' output"};
  if (const auto* w = runtime::comm::world(); w && w->rank() != 0) return 0;  // rank 0 writes the job's sums
  fs::path op(out);
  if (op.has_parent_path()) check(runtime::prepare_output_dir(op.parent_path().string()), "--out");
  check(runtime::io::save_safetensors(out, result), "--out");
  std::cout << "loss " << fmt("%.6f", result["loss"].get_f64(0)) << " | " << result.size() - 1 << " gradients -> "
            << out << "\n";
  return 0;
}

// ------------------------------------------------------------------ gradcheck
/// Whole-model float64 gradient check: autodiff's gradients of one batch against
/// central differences, on `per_param` random elements of every parameter.
int cmd_gradcheck(const ConfigFlags& flags, int per_param, double tol, double eps) {
  if (per_param <= 0) throw Failure{2, "--elements_per_parameter must be > 0, got " + std::to_string(per_param)};
  if (!(eps > 0) || !std::isfinite(eps)) throw Failure{2, "--eps must be a finite number > 0, got " + fmt("%g", eps)};
  if (!(tol > 0)) throw Failure{2, "--tolerance must be > 0, got " + fmt("%g", tol)};
  if (runtime::comm::launch_info().world_size > 1)
    throw Failure{2,
                  "kiln gradcheck runs on one process (its central differences perturb one batch); run it "
                  "without mpirun"};
  TrainConfig cfg = flags.build();
  // The check runs the whole model in float64: a mixed-precision program has no float64
  // form (bf16 gradients against f64 differences read as a gradient bug; --fp16's loss
  // scaling expects an f32 loss).
  if (cfg.bf16 || cfg.fp16)
    throw Failure{2, std::string(cfg.bf16 ? "--bf16" : "--fp16") +
                         ": kiln gradcheck checks the float64 gradients of the fp32 program; omit it (kiln grad "
                         "gives the " +
                         (cfg.bf16 ? "bf16" : "fp16") + " program's gradients)"};
  GradSetup setup = grad_setup(flags, cfg, /*f64=*/true);
  auto r = unwrap(driver::gradcheck_graph(*setup.prog.grads, setup.feeds, per_param, cfg.seed, eps));
  std::cout << "gradcheck: " << r.elements_checked << " elements of " << setup.prog.parameters.size()
            << " parameters, max relative error " << fmt("%.3e", r.max_rel_error) << " (worst: " << r.worst << ", seed "
            << r.seed << ", tolerance " << fmt("%.1e", tol) << ")\n";
  if (r.elements_checked == 0) throw Failure{1, "gradcheck checked no element (no trainable parameter?)"};
  if (!(r.max_rel_error < tol))
    throw Failure{1, "gradcheck failed: relative error " + fmt("%.3e", r.max_rel_error) + " on " + r.worst};
  std::cout << "gradcheck: ok\n";
  return 0;
}

// ------------------------------------------------------------------ bench
int cmd_bench(const ConfigFlags& flags, int warmup, int steps, bool profile, const std::string& profile_by,
              int row_limit, bool compare_static) {
  TrainConfig cfg = flags.build();
  if (warmup < 0 || steps < 1) throw Failure{2, "--warmup_steps_bench must be >= 0 and --bench_steps >= 1"};
  // kiln bench times steps from the model's initial weights and writes nothing: a flag
  // on the command line that would resume, save or evaluate is refused rather than
  // silently ignored (the same keys of a --config file, shared with kiln train, are
  // ignored; values that turn them off, such as --save_steps 0, are accepted).
  const std::pair<const char*, bool> active[] = {{"resume_from_checkpoint", !cfg.resume_from_checkpoint.empty()},
                                                 {"output_dir", true},
                                                 {"save_steps", cfg.save_steps > 0},
                                                 {"save_total_limit", cfg.save_total_limit > 0},
                                                 {"overwrite_output_dir", cfg.overwrite_output_dir},
                                                 {"eval_data", !cfg.eval_data.empty()},
                                                 {"eval_steps", cfg.eval_steps > 0},
                                                 {"report_to", cfg.reports_tensorboard()},
                                                 {"logging_dir", !cfg.logging_dir.empty()}};
  for (const auto& [f, on] : active) {
    auto it = flags.values.find(f);
    if (on && it != flags.values.end() && !it->second.empty())
      throw Failure{2, std::string("--") + f +
                           ": kiln bench times training steps from the model's initial weights "
                           "and writes and evaluates nothing (use kiln train)"};
  }
  if (row_limit < 0)
    throw Failure{2, "--profile_row_limit must be >= 0 (0: every row), got " + std::to_string(row_limit)};
  driver::BenchOptions opts;
  opts.config = cfg;
  opts.warmup = warmup;
  opts.steps = steps;
  opts.profile = profile;
  opts.profile_by = profile_by;
  opts.profile_row_limit = row_limit;
  opts.compare_static = compare_static;
  opts.pass_context = [&flags] { return flags.pass_context(); };
  opts.after_build = note_unrun_pass;
  check(driver::run_bench(opts, std::cout, std::cerr));
  return 0;
}

// ------------------------------------------------------------------ inspect
std::map<std::string, int64_t> parse_shapes(const std::vector<std::string>& items) {
  TrainConfig tmp;
  for (auto& f : runtime::config_fields(tmp))
    if (f.name == "shape")
      for (auto& s : items) {
        Status st = runtime::set_config_field(f, s);
        if (!st) throw Failure{2, st.message()};
      }
  return tmp.shape;
}

int cmd_inspect(ConfigFlags flags, const std::string& model) {
  if (std::error_code ec; !fs::exists(model, ec))
    throw Failure{1, model + (ec ? ": " + ec.message() : std::string(": no such file"))};
  flags.model_pos = model;
  const TrainConfig cfg = flags.build();  // --shape, --untie_initializers (and --config) apply
  auto g = unwrap(driver::load_model(model, cfg.shape, false, nullptr, cfg.untie_initializers));
  std::cout << "model " << model << " (opset " << g->opset << ")\n";
  std::cout << "inputs:\n";
  for (ir::Value* v : g->inputs)
    std::cout << "  " << v->name << "  " << ir::dtype_name(v->dtype) << " " << v->shape.to_string() << "\n";
  std::cout << "outputs:\n";
  for (ir::Value* v : g->outputs)
    std::cout << "  " << v->name << "  " << ir::dtype_name(v->dtype) << " " << v->shape.to_string() << "\n";
  // Trainable parameters (the names --freeze and --trainable match), then the other
  // float tensors of more than one element: buffers and constants, each with its role
  // and where the role came from (frontend/initializers.h).
  const auto params = ir::trainable_initializers(*g);
  const auto bn_stats = ir::batchnorm_statistics(*g);
  auto source = [&](const ir::Value* v) -> std::string {
    if (!v->role_source.empty()) return v->role_source;
    if (bn_stats.count(v)) return "BatchNormalization running statistics";
    return "name rule (the model states no roles)";
  };
  int64_t count = 0, bytes = 0;
  for (const ir::Value* v : params) {
    count += v->data->numel();
    bytes += static_cast<int64_t>(v->data->nbytes());
  }
  std::cout << "trainable parameters: " << count << " in " << params.size() << " tensors (" << bytes << " bytes)\n";
  for (const ir::Value* v : params)
    std::cout << "  " << v->name << "  " << ir::dtype_name(v->dtype) << " " << v->shape.to_string() << "  ("
              << source(v) << ")\n";
  std::vector<const ir::Value*> others;
  for (const ir::Value* v : g->initializers)
    if (ir::is_float(v->dtype) && v->data->numel() > 1 && std::find(params.begin(), params.end(), v) == params.end())
      others.push_back(v);
  if (!others.empty()) {
    std::cout << "buffers and constants (float, more than one element): " << others.size() << "\n";
    for (const ir::Value* v : others) {
      const char* role = bn_stats.count(v)                  ? "buffer"
                         : v->role == ir::InitRole::unknown ? "constant"
                                                            : ir::init_role_name(v->role);
      std::cout << "  " << v->name << "  " << ir::dtype_name(v->dtype) << " " << v->shape.to_string() << "  " << role
                << " (" << source(v) << ")\n";
    }
  }
  std::map<std::string, int> hist;
  double flops = 0;
  bool flops_known = true;
  for (auto& n : g->nodes()) {
    hist[n->op]++;
    bool static_shapes = true;
    for (ir::Value* o : n->outputs)
      if (o && !o->shape.is_static()) static_shapes = false;
    if (!static_shapes)
      flops_known = false;
    else
      flops += ir::node_cost(*n).flops;
  }
  std::cout << "ops (" << g->nodes().size() << " nodes):\n";
  std::vector<std::pair<int, std::string>> sorted;
  for (auto& [op, c] : hist) sorted.push_back({-c, op});
  std::sort(sorted.begin(), sorted.end());
  for (auto& [c, op] : sorted) std::cout << "  " << op << " " << -c << "\n";
  std::cout << "forward FLOPs: " << fmt("%.4g", flops)
            << (flops_known ? "" : " (partial: bind symbolic dims with --shape)") << "\n";
  return 0;
}

/// `kiln ops [--names]`: every ONNX op of the default domain kiln imports (opsets
/// frontend::kMinOpset..kMaxOpset), with the since-versions of its ONNX schema kiln
/// implements and how: an op of kiln's table (gradient rule or not, fusion class) or one
/// lowered at import into ops of the table (frontend/onnx_lower.h).
int cmd_ops(bool names_only) {
  auto pad = [](std::string s, size_t w) {
    if (s.size() < w) s.resize(w, ' ');
    return s + " ";
  };
  auto versions = [](const std::vector<int>& v) {
    std::string s;
    for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
    return s;
  };
  std::map<std::string, std::string> rows;
  for (const auto& [name, def] : ir::OpTable::get().all())
    if (def.onnx)
      rows[name] = pad(versions(def.onnx_since), 22) +
                   (def.diff == ir::Differentiability::differentiable ? "gradient rule, " : "no gradient, ") +
                   ir::fusion_class_name(def.fusion) + (def.scalar || def.row ? " (generated code)" : "");
  for (const auto& [name, lw] : frontend::onnx_lowerings())
    rows[name] = pad(versions(lw.onnx_since), 22) + "lowered at import into ops of the table";
  if (names_only) {
    for (const auto& [name, row] : rows) std::cout << name << "\n";
    return 0;
  }
  std::cout << rows.size() << " ONNX ops (default domain, opsets " << frontend::kMinOpset << ".." << frontend::kMaxOpset
            << "; older models are upgraded to opset " << frontend::kMinOpset << ")\n";
  std::cout << pad("op", 24) << pad("ONNX versions", 22) << "how\n";
  for (const auto& [name, row] : rows) std::cout << pad(name, 24) << row << "\n";
  return 0;
}

/// `kiln inspect MODEL --pipeline [train flags]`: the passes `kiln train` with those flags
/// would run, per program (train, eval) and stage, in order, each with the options it reads
/// (tools/driver/pipeline.h); nothing is imported or run. The LR schedule's total_steps is
/// --max_steps (1 without it: kiln train counts it from the data).
int cmd_inspect_pipeline(ConfigFlags flags, const std::string& model) {
  flags.model_pos = model;
  const TrainConfig cfg = flags.build();
  const driver::Pipeline p =
      driver::training_pipeline(driver::pipeline_options(cfg, cfg.max_steps > 0 ? cfg.max_steps : 1));
  std::cout << "pipeline of " << model << " (--backend " << cfg.backend
            << "): program, stage, pass, the options it reads\n";
  std::cout << driver::format_pipeline(p);
  return 0;
}

/// `kiln inspect MODEL --precision [train flags]`: the precision plan of the whole
/// training step that `kiln train` would run with those flags (`--bf16` unless `--fp16`
/// is given), before anything runs: per node (loop bodies indented) its compute,
/// accumulation and storage (first output) dtype and the rule that chose them (the op
/// table's PrecisionPolicy, or "cast" for the casts autocast inserted).
int cmd_inspect_precision(ConfigFlags flags, const std::string& model) {
  flags.model_pos = model;
  TrainConfig cfg = flags.build();
  const bool assumed = !cfg.fp16 && !cfg.bf16;
  if (!cfg.fp16) cfg.bf16 = true;
  passes::PassContext dbg = flags.pass_context();
  auto prog = unwrap(driver::build_training_program(cfg, &dbg, false, false, cfg.max_steps > 0 ? cfg.max_steps : 1));
  note_unrun_pass(dbg);
  std::cout << "precision plan (--" << (cfg.fp16 ? "fp16" : "bf16")
            << (assumed ? " assumed: neither --bf16 nor --fp16 given" : "") << ", batch "
            << cfg.per_device_train_batch_size << ") of " << model << ": node, compute / accumulate / store, rule\n";
  std::function<void(const ir::Graph&, int)> print = [&](const ir::Graph& g, int indent) {
    for (auto& n : g.nodes()) {
      const ir::OpDef* d = ir::OpTable::get().find(n->op);
      ir::PrecisionPolicy p = d ? d->precision : ir::PrecisionPolicy::follow_inputs;
      ir::DType compute = ir::DType::undefined;
      for (ir::Value* in : n->inputs)
        if (in && ir::is_float(in->dtype) &&
            (compute == ir::DType::undefined || ir::dtype_size(in->dtype) > ir::dtype_size(compute)))
          compute = in->dtype;
      ir::DType store = n->outputs.empty() ? ir::DType::undefined : n->outputs[0]->dtype;
      const bool cast = ir::has_trait(*n, ir::OpTrait::cast);
      if (cast || compute == ir::DType::undefined) compute = store;
      // Low-precision compute accumulates in f32 (oneDNN's bf16/f16 primitives, the eager
      // kernels' f32 compute type).
      ir::DType acc = (compute == ir::DType::bf16 || compute == ir::DType::f16) ? ir::DType::f32 : compute;
      std::string rule = cast ? "cast" : ir::precision_policy_name(p);
      const bool f32_compute = n->attrs.has("kiln_compute_f32");  // autocast rule (d): bf16 storage
      if (f32_compute) compute = acc = ir::DType::f32;
      if (n->attrs.has("kiln_autocast_kept") || f32_compute) {
        std::ostringstream os;
        // 4 digits: a node just below an explicit --autocast_min_flops still reads as below it.
        os << std::setprecision(4)
           << n->attrs.get_float(f32_compute ? "kiln_compute_f32" : "kiln_autocast_kept", 0) / 1e6 << " MFLOP";
        const bool by_default = cfg.autocast_min_flops < 0;
        const double min = driver::autocast_min_flops(cfg, !ir::has_trait(*n, ir::OpTrait::matmul));
        os << (std::isinf(min) ? ", below this CPU's break-even (f16 products never pay here)"
               : by_default    ? " < this CPU's break-even of "
                               : " < --autocast_min_flops ");
        if (!std::isinf(min)) os << min / 1e6 << " MFLOP";
        rule += (f32_compute ? ", computes f32: " : ", kept f32: ") + os.str();
      }
      std::cout << std::string(indent, ' ') << n->op << " " << n->name << "  " << ir::dtype_name(compute) << " / "
                << ir::dtype_name(acc) << " / " << ir::dtype_name(store) << "  " << rule << "\n";
      for (auto& r : n->regions) print(*r, indent + 4);
    }
  };
  print(*prog.train_step, 2);
  return 0;
}

/// One policy's part of `kiln inspect --memory`: builds the program of `cfg`, prints its
/// plan, and returns its memory profile for --plot.
driver::MemoryProfile inspect_memory_of(const TrainConfig& cfg_in, const ConfigFlags& flags, const std::string& model) {
  TrainConfig cfg = cfg_in;
  if (cfg.shape_mode.find(',') != std::string::npos)
    throw Failure{2, "--shape_mode " + cfg.shape_mode + ": one mode for kiln inspect (kiln bench compares lists)"};
  // A symbolic program's bound: --max_length, else (as kiln train) the data's longest row.
  const bool symbolic_data = cfg.shape_mode == "symbolic" && runtime::is_sequence_data(cfg.train_data);
  std::vector<std::pair<int64_t, int64_t>> shapes;  // the data's batch shapes (symbolic, with --train_data)
  // --train_data is read and checked against the model before any plan is printed, as
  // kiln train reads it (an unreadable or malformed file is one error line).
  if (!cfg.train_data.empty()) {
    const runtime::Dataset ds = unwrap(driver::bind_train_data(cfg));
    if (symbolic_data && cfg.max_length <= 0) cfg.max_length = ds.max_length();
    if (symbolic_data) shapes = driver::epoch_batch_shapes(ds, cfg);
  }
  if (!symbolic_data && cfg.shape_mode == "symbolic" && cfg.max_length <= 0) {
    throw Failure{2,
                  "inspect --memory --shape_mode symbolic: the program is planned at its bound: give --max_length "
                  "(or variable-length --train_data, whose longest row bounds it)"};
  }
  passes::PassContext dbg = flags.pass_context();
  auto prog = unwrap(driver::build_training_program(cfg, &dbg, false, false, cfg.max_steps > 0 ? cfg.max_steps : 1));
  note_unrun_pass(dbg);
  // A symbolic program (--shape_mode symbolic) is planned at its bound, as kiln train plans it.
  const auto bounds = driver::symbolic_bounds(*prog.train_step, cfg, cfg.per_device_train_batch_size);
  std::unique_ptr<ir::Graph> at_bound;
  if (!bounds.empty()) {
    if (cfg.max_length <= 0)
      throw Failure{2,
                    "inspect --memory: a symbolic program is planned at its bound: give --max_length (or "
                    "--train_data, whose longest row bounds it)"};
    at_bound = prog.train_step->clone();
    check(ir::bind_symbols(*at_bound, bounds), "memory plan at the bound");
  }
  const ir::Graph& g = at_bound ? *at_bound : *prog.train_step;
  auto eager = unwrap(passes::plan_memory(g, passes::PlanOptions::eager()), "memory plan");
  auto compiled = unwrap(passes::plan_memory(g), "memory plan");
  if (!bounds.empty()) {
    std::cout << "symbolic program, planned at its bound:";
    for (const auto& [sym, v] : bounds) std::cout << " " << sym << "=" << v;
    std::cout << "\n";
  }
  std::cout << "training step of " << model << ": batch " << cfg.per_device_train_batch_size;
  if (cfg.gradient_accumulation_steps > 1)
    std::cout << " x " << cfg.gradient_accumulation_steps << " accumulated microbatches";
  std::cout << ", "
            << (cfg.bf16   ? "bf16 mixed precision"
                : cfg.fp16 ? "fp16 mixed precision"
                           : "fp32")
            << ", optim " << cfg.optim << ", backend " << cfg.backend << ", remat policy "
            << cfg.effective_remat_policy() << "\n";
  std::cout << passes::format_memory_plan(eager);
  std::cout << "with in-place reuse (a compiled program's arena): peak " << passes::human_bytes(compiled.peak_bytes)
            << " (" << compiled.peak_bytes << " B), arena " << passes::human_bytes(compiled.arena_bytes) << " ("
            << compiled.arena_bytes << " B), " << compiled.in_place_reuses << " in-place reuses\n";
  std::cout << "planned peak for this run: " << passes::human_bytes(eager.peak_bytes) << " (" << eager.peak_bytes
            << " B)\n";
  if (!bounds.empty() && !shapes.empty()) {
    // Per batch shape of the data's first epoch: the bytes live at that shape's peak
    // (the program's values at the shape's sizes, planned as at the bound) against the
    // bound's plan, whose offsets every smaller shape uses.
    std::map<std::pair<int64_t, int64_t>, int64_t> seen;  // (rows, length) -> batches
    for (const auto& s : shapes) ++seen[s];
    const int64_t micro = cfg.per_device_train_batch_size;
    std::cout << "per batch shape of one epoch of --train_data (" << shapes.size() << " batches, " << seen.size()
              << " shapes): the step's live peak at that shape, against " << passes::human_bytes(eager.peak_bytes)
              << " at the bound\n";
    std::cout << "  rows  length  batches  live peak\n";
    double weighted = 0;  // live peak bytes summed over the epoch's batches
    for (const auto& [shape, count] : seen) {
      // Under gradient accumulation the batch dim is the micro-batch's (static).
      const int64_t rows = cfg.gradient_accumulation_steps > 1 ? micro : shape.first;
      auto at = prog.train_step->clone();
      check(ir::bind_symbols(*at, driver::symbol_values(*prog.train_step, rows, shape.second)),
            "memory plan at a batch shape");
      auto p = unwrap(passes::plan_memory(*at, passes::PlanOptions::eager()), "memory plan");
      char line[96];
      std::snprintf(line, sizeof line, "  %-5lld %-7lld %-8lld ", static_cast<long long>(shape.first),
                    static_cast<long long>(shape.second), static_cast<long long>(count));
      std::cout << line << passes::human_bytes(p.peak_bytes) << " (" << p.peak_bytes << " B, "
                << fmt("%.1f%% of the bound's", eager.peak_bytes > 0 ? 100.0 * static_cast<double>(p.peak_bytes) /
                                                                           static_cast<double>(eager.peak_bytes)
                                                                     : 0)
                << ")\n";
      weighted += static_cast<double>(p.peak_bytes) * static_cast<double>(count);
    }
    const double mean = shapes.empty() ? 0 : weighted / static_cast<double>(shapes.size());
    std::cout << "  mean live peak over the epoch's batches: " << passes::human_bytes(static_cast<int64_t>(mean))
              << " (" << fmt("%.1f%% of the bound's", eager.peak_bytes > 0 ? 100.0 * mean / eager.peak_bytes : 0)
              << ")\n";
  }
  if (cfg.world_size > 1) {
    const driver::DataParallelPlan dp = driver::data_parallel_plan(g, cfg.world_size);
    std::cout << "data parallel, per rank of " << cfg.world_size << (cfg.zero_stage == 1 ? " (ZeRO stage 1)" : "")
              << ": optimizer state " << passes::human_bytes(dp.optimizer_state_bytes) << " ("
              << dp.optimizer_state_bytes << " B), " << dp.collectives << " collectives and " << dp.bytes_sent
              << " B sent per optimizer step\n";
  }
  if (g.arena_bytes >= 0) {
    // The offsets the program's last pass (arena_plan) wrote into its values.
    std::vector<const ir::Value*> placed;
    std::function<void(const ir::Graph&)> walk = [&](const ir::Graph& gr) {
      for (const auto& n : gr.nodes()) {
        for (const ir::Value* o : n->outputs)
          if (o->arena.placed()) placed.push_back(o);
        for (const auto& r : n->regions) walk(*r);
      }
    };
    walk(g);
    std::stable_sort(placed.begin(), placed.end(),
                     [](const ir::Value* a, const ir::Value* b) { return a->arena.offset < b->arena.offset; });
    std::cout << "step arena of the compiled program (arena_plan): " << passes::human_bytes(g.arena_bytes) << " ("
              << g.arena_bytes << " B), " << placed.size() << " values placed; planned step peak "
              << passes::human_bytes(g.planned_peak_bytes) << " (" << g.planned_peak_bytes << " B)\n";
    std::cout << "  offset        bytes  home  value\n";
    for (const ir::Value* v : placed) {
      char line[64];
      std::snprintf(line, sizeof line, "  %-12lld %-6lld %-5s ", static_cast<long long>(v->arena.offset),
                    static_cast<long long>(v->arena.bytes), v->arena.home ? "yes" : "");
      std::cout << line << v->name << "\n";
    }
  }
  return driver::memory_profile(eager, "remat " + cfg.effective_remat_policy());
}

/// `kiln inspect MODEL --memory [train flags] [--plot FILE.svg]`: builds the training
/// program for those flags and prints its static memory plan without running it: one
/// row per category (bytes at the peak and max over the step), for the backend that
/// would run it. A --remat_policy list plans each policy in turn; --plot draws the live
/// bytes of each plan over its schedule, side by side, into an SVG file.
int cmd_inspect_memory(ConfigFlags flags, const std::string& model, const std::string& plot) {
  flags.model_pos = model;
  TrainConfig base = flags.build();
  // Under mpirun or srun: the plan of one rank of that job (nothing is communicated; rank
  // 0 prints it).
  const runtime::comm::LaunchInfo job = runtime::comm::launch_info();
  if (job.rank != 0) return 0;
  base.world_size = job.world_size;
  std::vector<std::string> policies = runtime::comma_list(base.remat_policy);
  if (policies.size() > 1 && plot.empty())
    throw Failure{2, "--remat_policy: a list ('" + base.remat_policy +
                         "') plans each policy for --plot; give --plot FILE.svg, or one policy"};
  std::vector<driver::MemoryProfile> profiles;
  for (size_t i = 0; i < policies.size(); ++i) {
    TrainConfig cfg = base;
    cfg.remat_policy = policies[i];
    if (i > 0) std::cout << "\n";
    profiles.push_back(inspect_memory_of(cfg, flags, model));
  }
  if (!plot.empty()) {
    check(driver::write_text_file(plot, driver::memory_svg(profiles)), "--plot");
    std::cout << "wrote " << plot << "\n";
  }
  return 0;
}

// ------------------------------------------------------------------ plot
/// `kiln plot OUTPUT_DIR... -o curves.svg`: training loss, eval loss, learning rate and
/// grad norm of each run's metrics.jsonl, the runs overlaid.
int cmd_plot(const std::vector<std::string>& dirs, const std::string& out) {
  std::vector<driver::RunCurves> runs;
  for (const std::string& d : dirs) runs.push_back(unwrap(driver::read_run_curves(d)));
  check(driver::write_text_file(out, driver::curves_svg(runs)), "-o");
  std::cout << "wrote " << out << "\n";
  return 0;
}

// ------------------------------------------------------------------ run
int cmd_run(const std::string& model, const std::vector<std::string>& inputs, const std::string& out_dir,
            const std::vector<std::string>& shape_items) {
  auto shape = parse_shapes(shape_items);
  if (out_dir.empty()) throw Failure{2, "--output_dir is required"};
  std::map<std::string, std::string> files;
  for (auto& s : inputs) {
    auto eq = s.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == s.size())
      throw Failure{2, "--input '" + s + "': expected NAME=FILE.npy"};
    if (files.count(s.substr(0, eq))) throw Failure{2, "--input " + s.substr(0, eq) + " given twice"};
    files[s.substr(0, eq)] = s.substr(eq + 1);
  }
  if (std::error_code ec; !fs::exists(model, ec))
    throw Failure{1, model + (ec ? ": " + ec.message() : std::string(": no such file"))};
  driver::OutputGuard guard(out_dir);  // a refused run leaves no folder or file it created
  check(runtime::prepare_output_dir(out_dir));
  // Bind still-symbolic leading dims from the given arrays (e.g. batch from input.npy).
  if (shape.empty()) {
    auto probe = unwrap(driver::load_model(model, {}));
    for (ir::Value* v : probe->inputs) {
      auto f = files.find(v->name);
      if (f == files.end()) continue;
      auto t = runtime::io::load_npy(f->second);
      if (!t) continue;
      for (int i = 0; i < v->shape.rank() && i < t->rank(); ++i)
        if (!v->shape.dims[i].is_static() && !v->shape.dims[i].symbol().empty())
          shape[v->shape.dims[i].symbol()] = t->dim(i);
    }
  }
  auto g = unwrap(driver::load_inference_model(model, shape));
  std::map<std::string, ir::Tensor> feeds;
  for (auto& [name, file] : files) {
    ir::Value* in = nullptr;
    for (ir::Value* v : g->inputs)
      if (v->name == name) in = v;
    if (!in) throw Failure{1, "--input " + name + ": the model has no input '" + name + "'"};
    auto t = unwrap(runtime::io::load_npy(file));
    if (t.dtype() != in->dtype && ir::is_float(t.dtype()) == ir::is_float(in->dtype) &&
        ir::is_integer(t.dtype()) == ir::is_integer(in->dtype))
      t = t.cast(in->dtype);  // f64 -> f32, i32 -> i64 like numpy callers expect
    check(runtime::check_feed(*in, t), file);
    feeds[name] = t;
  }
  for (ir::Value* v : g->inputs)
    if (!feeds.count(v->name)) throw Failure{2, "missing --input " + v->name + "=FILE.npy"};
  auto outs = unwrap(runtime::run_graph(*g, feeds, {}));
  for (auto& [name, t] : outs) {
    std::string safe = name;
    std::replace(safe.begin(), safe.end(), '/', '_');
    std::string path = (fs::path(out_dir) / (safe + ".npy")).string();
    check(runtime::io::save_npy(path, t.dtype() == ir::DType::bf16 ? t.cast(ir::DType::f32) : t));
    std::cout << name << " " << ir::dtype_name(t.dtype()) << " " << ir::dims_to_string(t.dims()) << " -> " << path
              << "\n";
  }
  guard.keep();
  return 0;
}

int real_main(int argc, char** argv) {
  CLI::App app{"kiln: compile exported ONNX models into training programs"};
  app.require_subcommand(1);

  ConfigFlags train_flags, grad_flags, bench_flags;
  auto* train = app.add_subcommand("train", "train a model (Hugging Face Trainer options)");
  train_flags.fit_ok = true;
  train_flags.add_to(train);
  ConfigFlags fit_flags;
  fit_flags.fit_command = true;
  auto* fit = app.add_subcommand(
      "fit", "choose the training recipe that fits --memory_budget: batch x accumulation, bf16, remat, 8-bit AdamW");
  fit_flags.add_to(fit);
  int fit_measure_top = 3, fit_measure_steps = 2;
  std::string fit_plot, fit_save, fit_report;
  fit->add_option("--measure_top", fit_measure_top,
                  "fitting recipes measured with real steps, best estimates first (default 3; 0: cost model only)");
  fit->add_option("--measure_steps", fit_measure_steps, "timed steps of each measured recipe (default 2)");
  fit->add_option("--plot", fit_plot, "draw planned peak against time per optimizer step into an SVG file");
  fit->add_option("--save_config", fit_save, "write the chosen recipe as a --config JSON file");
  fit->add_option("--report_json", fit_report,
                  "write every recipe searched (planned peak, estimate, measurement) as JSON (tools/fit_grid.py)");
  ConfigFlags compile_flags;
  auto* compile =
      app.add_subcommand("compile", "compile a training program ahead of time into DIR/train (a standalone binary)");
  compile_flags.add_to(compile);
  std::string compile_out;
  compile->add_option("-o,--output", compile_out,
                      "output folder: train binary, ir/, kernels/, memory_plan.txt, compile_report.json");
  auto* grad = app.add_subcommand("grad", "loss and parameter gradients of one batch -> safetensors");
  grad_flags.add_to(grad);
  std::string grad_out;
  bool grad_f64 = false;
  grad->add_option("--out", grad_out, "output .safetensors file");
  grad->add_flag("--float64", grad_f64, "compute in float64");
  ConfigFlags gc_flags;
  auto* gradcheck = app.add_subcommand("gradcheck", "float64 central-difference check of a whole model's gradients");
  gc_flags.add_to(gradcheck);
  int gc_per_param = 4;
  double gc_tol = 1e-6, gc_eps = 1e-5;
  gradcheck->add_option("--eps", gc_eps, "central-difference step (default 1e-5)");
  gradcheck->add_option("--elements_per_parameter", gc_per_param, "elements perturbed per parameter (default 4)");
  gradcheck->add_option("--tolerance", gc_tol, "max relative error (default 1e-6)");
  auto* bench = app.add_subcommand("bench", "time training steps");
  bench_flags.backend_list = true;
  bench_flags.add_to(bench);
  int bench_warmup = 3, bench_steps = 10;
  bench->add_option("--warmup_steps_bench", bench_warmup, "untimed warm-up steps");
  bench->add_option("--bench_steps", bench_steps, "timed steps");
  bool bench_profile = false;
  bench->add_flag(
      "--profile", bench_profile,
      "per-op table of the timed steps (calls, total ms, mean us, % of op time), after each backend's timing");
  std::string bench_profile_by = "op";
  bench
      ->add_option("--profile_by", bench_profile_by,
                   "op (default: one row per op type) | node (one row per node or generated kernel, with the IR "
                   "nodes it fuses); implies --profile")
      ->check(CLI::IsMember({"op", "node"}));
  bool bench_compare_static = false;
  bench->add_flag("--compare_static", bench_compare_static,
                  "with --shape_mode symbolic: also time the static program of exactly each shape the symbolic "
                  "program runs (variable-length data: a program per batch length, compared per length seen; a "
                  "synthetic batch: the --shape length, as --shape_mode pad,symbolic)");
  int bench_row_limit = 25;
  bench->add_option("--profile_row_limit", bench_row_limit,
                    "rows of the profile table before one \"(N other keys)\" row; 0: every key (as the row_limit "
                    "of torch.profiler's table)");
  auto* inspect = app.add_subcommand("inspect", "inputs, outputs, parameters, ops and FLOPs of a model");
  std::string inspect_model;
  inspect->add_option("model", inspect_model, "the .onnx model")->required();
  // Training flags (--shape, --loss, --bf16, --per_device_train_batch_size, ...) shape
  // the program that --memory plans; --shape and --loss also serve the other views.
  ConfigFlags inspect_flags;
  inspect_flags.remat_list = true;
  inspect_flags.add_to(inspect, /*with_model=*/false);
  std::string inspect_plot;
  inspect->add_option("--plot", inspect_plot,
                      "with --memory: draw the live bytes over the step's schedule, stacked by category, into an SVG "
                      "file (a --remat_policy list such as none,blocks,sqrt: one panel per policy)");
  bool inspect_precision = false, inspect_memory = false, inspect_pipeline = false;
  inspect->add_flag(
      "--precision", inspect_precision,
      "print the precision plan (--bf16, or --fp16) of every node of the training step for the given training flags");
  inspect->add_flag("--memory", inspect_memory,
                    "print the static memory plan of one training step for the given training flags (not run)");
  inspect->add_flag("--pipeline", inspect_pipeline,
                    "print the passes of the train and eval programs for the given training flags, in order, with "
                    "the options each pass reads (nothing runs)");
  auto* plot = app.add_subcommand("plot", "training curves of runs (metrics.jsonl) as an SVG file");
  std::vector<std::string> plot_dirs;
  std::string plot_out;
  plot->add_option("output_dir", plot_dirs, "kiln train --output_dir folders (several: their runs overlaid)")
      ->required();
  plot->add_option("-o,--output", plot_out, "the SVG file to write")->required();
  auto* ops = app.add_subcommand("ops", "the ONNX ops kiln imports, with the ONNX versions it implements");
  bool ops_names = false;
  ops->add_flag("--names", ops_names, "print only the op names, one per line");
  auto* run = app.add_subcommand("run", "forward pass (eager); writes OUTPUT_DIR/<output>.npy");
  std::string run_model, run_out;
  std::vector<std::string> run_inputs, run_shape;
  run->add_option("model", run_model, "the .onnx model")->required();
  run->add_option("--input", run_inputs, "NAME=FILE.npy (repeatable)")->allow_extra_args(false);
  run->add_option("--output_dir", run_out, "where the outputs go");
  run->add_option("--shape", run_shape, "dim bindings NAME=INT[,NAME=INT]")->allow_extra_args(false);

  std::string names;
  for (auto* sc : app.get_subcommands({})) names += (names.empty() ? "" : "|") + sc->get_name();
  CLI::App* sub = nullptr;
  if (argc >= 2 && argv[1][0] != '-') {
    for (auto* sc : app.get_subcommands({}))
      if (sc->get_name() == argv[1]) sub = sc;
    if (!sub) return report({2, std::string("unknown subcommand '") + argv[1] + "' (expected one of: " + names + ")"});
  } else if (argc >= 2 && std::string(argv[1]) != "-h" && std::string(argv[1]) != "--help") {
    return report({2, std::string("the subcommand comes first: kiln {") + names + "} ... (got " + argv[1] + ")"});
  }
  // The subcommand's flag names: long and short, value-taking and switches.
  std::set<std::string> known, long_names, short_names = {"h"}, value_flags, switches;
  if (sub)
    for (const CLI::Option* o : sub->get_options()) {
      const bool takes_value = o->get_expected_max() != 0;
      for (const std::string& n : o->get_lnames()) {
        known.insert(n), long_names.insert(n);
        (takes_value ? value_flags : switches).insert(n);
      }
      for (const std::string& n : o->get_snames()) {
        known.insert(n), short_names.insert(n);
        if (takes_value) value_flags.insert(n);
      }
    }
  // "--bf16 True" as Hugging Face reads it; a value-taking flag without its value.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (sub) {
    std::vector<std::string> rest(args.begin() + 1, args.end());
    if (Status st = runtime::normalize_flag_values(rest, value_flags, switches, short_names); !st)
      return report({2, st.message()});
    args.resize(1);
    args.insert(args.end(), rest.begin(), rest.end());
  }
  std::vector<char*> cargv{argv[0]};
  for (std::string& a : args) cargv.push_back(a.data());
  // A single-value option given twice takes the last value, as the training flags do
  // (HF's argument parser); CLI11's default refused it ("At Most 1 required but received 2").
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    for (CLI::Option* opt : sub->get_options())
      if (opt->get_items_expected_max() == 1) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  try {
    app.parse(static_cast<int>(cargv.size()), cargv.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    // Name the unknown flag (CLI11 lists the leftover tokens, values first).
    const std::string m = runtime::unknown_flag_message(args, known, &long_names, &value_flags);
    return report({2, m.empty() ? std::string(e.what()) : m});
  } catch (const CLI::ParseError& e) {
    return report({2, e.what()});
  }
  try {
    if (*train) return cmd_train(train_flags);
    if (*fit) return cmd_fit(fit_flags, fit_measure_top, fit_measure_steps, fit_plot, fit_save, fit_report);
    if (*compile) return cmd_compile(compile_flags, compile_out);
    if (*grad) return cmd_grad(grad_flags, grad_out, grad_f64);
    if (*gradcheck) return cmd_gradcheck(gc_flags, gc_per_param, gc_tol, gc_eps);
    if (*bench)
      return cmd_bench(bench_flags, bench_warmup, bench_steps,
                       bench_profile || bench->count("--profile_by") > 0 || bench->count("--profile_row_limit") > 0,
                       bench_profile_by, bench_row_limit, bench_compare_static);
    if (*inspect && inspect_memory && inspect_precision)
      throw Failure{2, "inspect: give one of --memory and --precision"};
    if (*inspect && inspect_pipeline && (inspect_memory || inspect_precision))
      throw Failure{2,
                    "inspect: --pipeline lists the passes without running them: give it without --memory and "
                    "--precision"};
    if (*inspect && !inspect_plot.empty() && !inspect_memory)
      throw Failure{2, "inspect: --plot draws the memory plan: give it with --memory"};
    if (*inspect && inspect_memory) return cmd_inspect_memory(inspect_flags, inspect_model, inspect_plot);
    if (*inspect && inspect_flags.remat_list && inspect_flags.values.count("remat_policy") &&
        inspect_flags.options.at("remat_policy")->count() > 0) {
      for (const std::string& v : inspect_flags.values.at("remat_policy"))
        if (v.find(',') != std::string::npos)
          throw Failure{2, "--remat_policy: a list ('" + v + "') is for kiln inspect --memory --plot"};
    }
    if (*plot) return cmd_plot(plot_dirs, plot_out);
    if (*inspect && inspect_precision) return cmd_inspect_precision(inspect_flags, inspect_model);
    if (*inspect) {
      // Plain inspect reads the ONNX graph only: no pass runs, so nothing would be printed.
      const ConfigFlags& f = inspect_flags;
      const char* pass_flag = !f.print_ir_after.empty() ? "--print-ir-after"
                              : !f.dump_ir_dir.empty()  ? "--dump-ir-dir"
                              : f.time_passes           ? "--time-passes"
                              : f.verify_each           ? "--verify-each"
                              : f.stop_after >= 0       ? "--stop-after"
                                                        : nullptr;
      if (pass_flag)
        return report({2, std::string(pass_flag) +
                              ": kiln inspect runs the passes only with --memory or --precision "
                              "(the training program); add one of them" +
                              (inspect_pipeline ? " (--pipeline lists the passes without running them)" : "")});
      if (inspect_pipeline) return cmd_inspect_pipeline(inspect_flags, inspect_model);
      return cmd_inspect(inspect_flags, inspect_model);
    }
    if (*run) return cmd_run(run_model, run_inputs, run_out, run_shape);
    if (*ops) return cmd_ops(ops_names);
  } catch (const Failure& f) {
    return report(f);
  }
  return report({2, "no subcommand"});
}

}  // namespace

int main(int argc, char** argv) {
  runtime::ignore_file_size_signal();  // a write past RLIMIT_FSIZE is an error naming the file
  try {
    return real_main(argc, argv);
  } catch (const ir::OutOfMemory& e) {
    return report({1, e.what()});
  } catch (const std::bad_alloc&) {
    return report(
        {1, "out of memory (an allocation failed: lower the batch size, or raise the process's memory limit)"});
  } catch (const std::exception& e) {
    return report({1, std::string("internal error: ") + e.what()});
  } catch (...) {
    return report({1, "internal error (unknown exception)"});
  }
}
