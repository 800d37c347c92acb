// main() of the standalone training binary that `kiln compile MODEL -o DIR` links as
// DIR/train (issues 8, 30). It holds its program file (runtime/program.h: the post-pass
// graphs, step arenas, signature, compile-time configuration and the model) and the
// generated kernels (object code); it needs no kiln build tree, no Python and no
// compiler. At start it loads the program (no ONNX import, no pass), binds every kernel
// to its linked function by symbol, checks the CPU, then trains exactly as `kiln train`
// does. The LR schedule reads the run's step counts, so --max_steps may change.
//
// Flags that may change: data paths, max_steps, num_train_epochs, output_dir,
// logging/eval/save steps, save_total_limit, seed, resume_from_checkpoint,
// overwrite_output_dir, and the reporting flags (disable_tqdm, report_to, logging_dir). Any other
// training flag (shapes, precision, optimizer, passes) is fixed at compile time and is
// refused with one line. Exit codes: 0 ok, 2 bad usage, 1 failure at run time.
#include <CLI/CLI.hpp>
#include <iostream>
#include <new>
#include <set>

#include "frontend/model_bytes.h"
#include "ir/tensor.h"
#include "runtime/comm.h"
#include "runtime/interrupt.h"
#include "runtime/train_config.h"
#include "tools/aot/aot_kernels.h"
#include "tools/driver/train_run.h"

namespace {

using namespace kiln;

/// TrainConfig fields a compiled binary lets the user change.
const std::set<std::string>& changeable() {
  static const std::set<std::string> s = {"train_data",
                                          "eval_data",
                                          "max_steps",
                                          "num_train_epochs",
                                          "output_dir",
                                          "logging_steps",
                                          "eval_steps",
                                          "save_steps",
                                          "save_total_limit",
                                          "seed",
                                          "resume_from_checkpoint",
                                          "overwrite_output_dir",
                                          "disable_tqdm",
                                          "report_to",
                                          "logging_dir"};
  return s;
}

int fail(int code, const std::string& msg) {
  std::string m = msg;
  for (char& c : m)
    if (c == '\n') c = ' ';
  const std::string line = "train" + runtime::comm::rank_tag() + ": error: " + m + "\n";
  std::cerr.write(line.data(), static_cast<std::streamsize>(line.size()));
  std::cerr.flush();
  runtime::comm::abort_world(code);  // the other ranks of a data-parallel job would wait for this one
  return code;
}

int real_main(int argc, char** argv) {
  Status s = aot::load_embedded();
  if (!s) return fail(1, s.message());
  const std::string program_bytes(aot::embedded_program());
  const std::string origin = "the binary's program";
  auto info = runtime::read_program_info(program_bytes, origin);
  if (!info) return fail(1, info.message());
  runtime::TrainConfig cfg;
  s = runtime::config_from_json_text(info->config_json, origin, cfg);
  if (!s) return fail(1, s.message());

  CLI::App app{
      "a kiln training binary (built by kiln compile): trains the model it holds with the configuration "
      "it was compiled with; the flags below may change per run"};
  std::map<std::string, std::vector<std::string>> values;
  std::map<std::string, CLI::Option*> options;
  for (auto& f : runtime::config_fields(cfg)) {
    auto& v = values[f.name];
    const bool ok = changeable().count(f.name) > 0;
    const std::string help = ok ? f.help : "(fixed at compile time: refused)";
    CLI::Option* o = f.kind == runtime::ConfigField::Kind::boolean
                         ? app.add_flag("--" + f.name, v, help)
                         : app.add_option("--" + f.name, v, help)->allow_extra_args(false);
    if (!ok) o->group("");  // hidden from --help
    options[f.name] = o;
  }
  std::set<std::string> known, changeable_names, value_flags, switches;
  for (auto& f : runtime::config_fields(cfg)) {
    known.insert(f.name);
    if (changeable().count(f.name)) changeable_names.insert(f.name);
    (f.kind == runtime::ConfigField::Kind::boolean ? switches : value_flags).insert(f.name);
  }
  std::vector<std::string> args(argv + 1, argv + argc);
  if (Status st = runtime::normalize_flag_values(args, value_flags, switches); !st) return fail(2, st.message());
  std::vector<char*> cargv{argv[0]};
  for (std::string& a : args) cargv.push_back(a.data());
  try {
    app.parse(static_cast<int>(cargv.size()), cargv.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    // Suggest only flags this binary takes per run (the others are fixed at compile time).
    const std::string m = runtime::unknown_flag_message(args, known, &changeable_names, &value_flags);
    return fail(2, m.empty() ? std::string(e.what()) : m);
  } catch (const CLI::ParseError& e) {
    return fail(2, e.what());
  }
  std::map<std::string, std::vector<std::string>> given;
  for (auto& f : runtime::config_fields(cfg)) {
    if (options.at(f.name)->count() == 0) continue;
    if (!changeable().count(f.name)) {
      // The compiled value itself is accepted (a command line copied from `kiln train`).
      runtime::TrainConfig probe = cfg;
      const Status same = runtime::apply_flag_values(probe, {{f.name, values.at(f.name)}});
      if (same && runtime::config_to_json(probe) == runtime::config_to_json(cfg)) continue;
      return fail(2, "--" + f.name +
                         " is fixed when the binary is compiled (shapes, passes or the generated kernels' constants "
                         "depend on it); run kiln compile again with the new value");
    }
    given[f.name] = values.at(f.name);
  }
  Status applied = runtime::apply_flag_values(cfg, given);
  if (!applied) return fail(2, applied.message());
  runtime::eval_off_without_eval_data(cfg, given);
  Status v = cfg.validate();
  if (!v) return fail(2, v.message());
  if (cfg.train_data.empty()) return fail(2, "--train_data is required (NAME=FILE.npy ... or FILE.bin)");
  if (Status e = runtime::check_eval_schedule(cfg); !e) return fail(2, e.message());
  s = runtime::check_host_cpu(info->cpu);
  if (!s) return fail(1, s.message());
  auto prog = runtime::deserialize_program(program_bytes, origin, aot::kernel_binder());
  if (!prog) return fail(1, prog.message());

  // The model file the trained weights are written into comes from the program.
  cfg.model = "embedded:model.onnx";
  cfg.backend = "compiled";
  frontend::register_model_bytes(cfg.model, info->model_bytes);
  s = driver::run_training(cfg, nullptr, std::cout, &*prog);
  if (!s) return fail(1, s.message());
  if (const int sig = runtime::stop_signal()) return 128 + sig;  // stopped after a step (runtime/interrupt.h)
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  kiln::runtime::set_message_prefix("train");  // the Trainer's warnings, as this binary's errors
  kiln::runtime::ignore_file_size_signal();    // a write past RLIMIT_FSIZE is an error naming the file
  try {
    return real_main(argc, argv);
  } catch (const kiln::ir::OutOfMemory& e) {
    return fail(1, e.what());
  } catch (const std::bad_alloc&) {
    return fail(1, "out of memory (an allocation failed: lower the batch size, or raise the process's memory limit)");
  } catch (const std::exception& e) {
    return fail(1, std::string("internal error: ") + e.what());
  } catch (...) {
    return fail(1, "internal error (unknown exception)");
  }
}
