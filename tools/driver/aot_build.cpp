// `kiln compile`: ahead-of-time training binaries; see aot_build.h.
#include "tools/driver/aot_build.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/cpu/program.h"
#include "frontend/model_bytes.h"
#include "frontend/tensor_proto.h"
#include "ir/op_table.h"
#include "passes/memory_plan.h"
#include "runtime/data.h"
#include "runtime/metrics.h"
#include "runtime/program.h"
#include "tools/aot/aot_manifest.h"
#include "tools/driver/driver.h"
#include "tools/driver/train_run.h"

#ifndef KILN_VERSION
#define KILN_VERSION "0.1.0"
#endif

namespace kiln::driver {

namespace fs = std::filesystem;
using runtime::TrainConfig;

namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) return Status::error(p.string() + ": cannot write");
  return Status::ok();
}

/// Kernel name as a file-name part: [A-Za-z0-9_.-] kept, anything else '_'.
std::string file_part(const std::string& s) {
  std::string r;
  for (char c : s) r += (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.') ? c : '_';
  return r.size() > 80 ? r.substr(0, 80) : r;
}

/// Link inputs written by CMake next to kiln: <kiln's folder>/../lib/kiln_aot_link.txt.
Expected<std::vector<std::string>> link_inputs() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return Status::error("cannot locate the kiln executable (/proc/self/exe): " + ec.message());
  fs::path file = exe.parent_path().parent_path() / "lib" / "kiln_aot_link.txt";
  std::ifstream in(file);
  if (!in)
    return Status::error(file.string() + ": missing (kiln compile needs the build tree's lib/ folder next to bin/)");
  std::vector<std::string> items;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line[0] != '-' && !fs::exists(line))
      return Status::error(file.string() + ": link input " + line + " does not exist (rebuild kiln)");
    items.push_back(line);
  }
  return items;
}

std::string shell_quote(const std::string& s) {
  std::string r = "'";
  for (char c : s) r += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return r + "'";
}

struct ProgramReport {
  int kernels = 0, unique = 0, fused_ops = 0, top_level_nodes = 0;
  std::string cache;
};

int count_fused_ops(const ir::Graph& g) {
  int n = 0;
  for (auto& node : g.nodes()) {
    if (ir::has_trait(*node, ir::OpTrait::fused_kernel) && !node->regions.empty())
      n += static_cast<int>(node->regions[0]->nodes().size());
    else
      for (auto& r : node->regions) n += count_fused_ops(*r);
  }
  return n;
}

}  // namespace

Status check_compile_flags(const TrainConfig& cfg) {
  if (cfg.backend != "compiled")
    return Status::error("--backend " + cfg.backend +
                         " cannot be compiled ahead of time (kiln compile builds the compiled backend; " + cfg.backend +
                         " is for kiln train and bench)");
  if (cfg.overwrite_output_dir)
    return Status::error(
        "--overwrite_output_dir deletes checkpoints: it is a per-run flag of DIR/train, not "
        "compiled into the binary (give it when running DIR/train)");
  if (cfg.shape_mode == "symbolic")
    return Status::error(
        "--shape_mode symbolic: DIR/train runs one static program (variable-length data pads to the compiled "
        "--max_length); compile with --shape_mode pad, or train the symbolic program with kiln train");
  if (!cfg.resume_from_checkpoint.empty())  // was accepted and then ignored: the binary trained from step 0
    return Status::error(
        "--resume_from_checkpoint is a per-run flag of DIR/train, not compiled into the binary "
        "(give it when running DIR/train)");
  return Status::ok();
}

Status compile_training_binary(const TrainConfig& cfg_in, passes::PassContext& dbg, const std::string& out_dir,
                               std::ostream& out) {
  using clock = std::chrono::steady_clock;
  const auto t_all = clock::now();
  TrainConfig cfg = cfg_in;
  KILN_RETURN_IF_ERROR(check_compile_flags(cfg));
  if (out_dir.empty()) return Status::error("-o DIR is required");

  // Optimizer steps of the run, for the LR schedule (as kiln train computes them).
  // Data given at compile time is checked against the model now (the binary keeps its
  // paths as defaults), as kiln train would.
  int64_t total = cfg.max_steps;
  if (total <= 0 && cfg.train_data.empty())
    return Status::error("give --max_steps or --train_data: the LR schedule needs the number of optimizer steps");
  if (!cfg.train_data.empty()) {
    auto raw = runtime::load_raw_data(cfg.train_data);
    if (!raw) return Status::error("--train_data: " + raw.status().message());
    KILN_ASSIGN_OR_RETURN(const int64_t spe, steps_per_epoch(cfg, *raw));
    if (total <= 0) total = cfg.total_steps(spe);
  }
  if (!cfg.eval_data.empty()) {
    auto raw = runtime::load_raw_data(cfg.eval_data);
    if (!raw) return Status::error("--eval_data: " + raw.status().message());
  }
  // The binary keeps the data paths as defaults: absolute, so it runs from any folder.
  // Resuming is a per-run choice, never baked in.
  std::error_code path_ec;
  for (auto* list : {&cfg.train_data, &cfg.eval_data})
    for (std::string& spec : *list) {
      const size_t eq = spec.find('=');
      const std::string name = eq == std::string::npos ? "" : spec.substr(0, eq + 1);
      const std::string file = eq == std::string::npos ? spec : spec.substr(eq + 1);
      spec = name + fs::absolute(file, path_ec).lexically_normal().string();
    }
  cfg.resume_from_checkpoint.clear();
  KILN_ASSIGN_OR_RETURN(std::string model_bytes, frontend::read_model_bytes(cfg.model));
  // The binary embeds the model alone: tensors the file keeps as external data (torch.onnx
  // writes MODEL.onnx.data) are read in now, so the binary runs without them.
  {
    onnx::ModelProto model;
    if (!model.ParseFromString(model_bytes)) return Status::error(cfg.model + ": not a valid ONNX model");
    if (!frontend::first_external_tensor(model).empty()) {
      auto inlined = frontend::inline_external_data(model, fs::path(cfg.model).parent_path().string());
      if (!inlined) return Status::error(cfg.model + ": " + inlined.message());
      if (model.ByteSizeLong() > size_t{INT32_MAX})
        return Status::error(cfg.model + ": with its external data the model has " +
                             std::to_string(model.ByteSizeLong()) +
                             " bytes, more than the 2 GiB one embedded ONNX model can hold");
      model_bytes = model.SerializeAsString();
    }
  }

  // DIR must be new, empty, or an earlier kiln compile output (it holds the marker
  // file): its ir/, kernels/ and obj/ are replaced, nothing else is ever deleted.
  const fs::path dir(out_dir);
  std::error_code ec;
  const fs::path marker = dir / ".kiln_compile";
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) return Status::error(out_dir + ": exists and is not a folder");
    if (!fs::is_empty(dir, ec) && !fs::exists(marker, ec))
      return Status::error(out_dir + ": folder exists, is not empty and is not a kiln compile output (no " +
                           marker.filename().string() + "); give a new or empty folder");
  }
  fs::create_directories(dir, ec);
  if (ec) return Status::error(out_dir + ": cannot create: " + ec.message());
  KILN_RETURN_IF_ERROR(
      write_file(marker, "kiln compile output; kiln compile may replace ir/ kernels/ obj/ train here\n"));
  for (const char* sub : {"ir", "kernels", "obj"}) {
    fs::remove_all(dir / sub, ec);
    fs::create_directories(dir / sub, ec);
    if (ec) return Status::error(out_dir + ": cannot create " + sub + "/: " + ec.message());
  }
  dbg.dump_ir_dir = (dir / "ir").string();
  dbg.dump_index = 0;

  const auto t_build = clock::now();
  KILN_ASSIGN_OR_RETURN(auto prog, build_training_program(cfg, &dbg, false, false, total));
  const double build_s = since(t_build);
  if (!prog.train_kernels || !prog.train_kernels->object)
    return Status::error("the training program has no compiled kernels (internal)");

  // Kernel dumps, objects, manifest.
  std::vector<std::string> fn_symbols;
  std::map<std::string, int> fn_index;
  std::map<std::string, ProgramReport> reports;
  double lower_s = 0, emit_s = 0, opt_s = 0, mc_s = 0;
  std::vector<fs::path> objects;
  struct Item {
    const char* which;
    const ir::Graph* g;
    const codegen::CpuProgram* p;
  };
  for (const Item& it : {Item{"train", prog.train_step.get(), prog.train_kernels.get()},
                         Item{"eval", prog.eval.get(), prog.eval_kernels.get()}}) {
    if (!it.p || !it.g) continue;
    ProgramReport& r = reports[it.which];
    r.kernels = static_cast<int>(it.p->kernels.size());
    r.fused_ops = count_fused_ops(*it.g);
    r.top_level_nodes = static_cast<int>(it.g->nodes().size());
    r.cache = it.p->cache_status;
    lower_s += it.p->lower_s;
    const codegen::CpuObject* obj = it.p->object.get();
    if (obj) {
      r.unique = obj->stats.num_unique;
      emit_s += obj->stats.emit_s;
      opt_s += obj->stats.optimize_s;
      mc_s += obj->stats.codegen_s;
      if (obj->kernels.size() != it.p->kernels.size() || obj->symbols.size() != it.p->kernels.size())
        return Status::error(std::string(it.which) + " program: object and kernel lists differ (internal)");
      KILN_RETURN_IF_ERROR(write_file(dir / "kernels" / (std::string(it.which) + ".ll"), obj->llvm_ir));
      fs::path o = dir / "obj" / (std::string(it.which) + ".o");
      KILN_RETURN_IF_ERROR(write_file(o, obj->object));
      objects.push_back(o);
    }
    for (size_t i = 0; i < it.p->kernels.size(); ++i) {
      const codegen::Kernel& k = it.p->kernels[i];
      char num[16];
      std::snprintf(num, sizeof num, "_%03zu_", i);
      KILN_RETURN_IF_ERROR(
          write_file(dir / "kernels" / (std::string(it.which) + num + file_part(k.name) + ".kir"), k.to_string()));
      if (!obj) continue;
      const std::string& sym = obj->symbols[i];
      auto [fi, fresh] = fn_index.emplace(sym, static_cast<int>(fn_symbols.size()));
      if (fresh) fn_symbols.push_back(sym);
    }
  }
  // The program file: what DIR/train loads (embedded in the binary, and beside it for
  // kiln inspect); its kernels name their functions by symbol (the binary's table).
  runtime::ProgramFileInfo info;
  info.kiln_version = KILN_VERSION;
  info.cpu = codegen::host_cpu_description();
  info.config_json = runtime::config_to_json(cfg);
  info.model_bytes = model_bytes;
  KILN_ASSIGN_OR_RETURN(std::string program_file, runtime::serialize_program(prog, info));
  KILN_RETURN_IF_ERROR(write_file(dir / "program.kiln", program_file));
  nlohmann::json manifest = {{"format", aot::kManifestFormat}, {"kiln_version", KILN_VERSION}, {"symbols", fn_symbols}};
  KILN_ASSIGN_OR_RETURN(std::string data_obj, codegen::emit_aot_data_object({{aot::kManifestSymbol, manifest.dump()},
                                                                             {aot::kProgramSymbol, program_file}},
                                                                            aot::kFunctionTableSymbol, fn_symbols));
  objects.push_back(dir / "obj" / "data.o");
  KILN_RETURN_IF_ERROR(write_file(objects.back(), data_obj));

  // Memory plan.
  auto plan = passes::plan_memory(*prog.train_step, passes::PlanOptions::eager());
  if (!plan) return Status::error("memory plan: " + plan.status().message());
  std::string plan_text = passes::format_memory_plan(*plan);
  if (prog.train_arena) {  // the compiled executor's step arena: where each buffer lies
    auto layout = plan_step_arena_layout(*prog.train_step);
    if (!layout) return Status::error("step arena plan: " + layout.status().message());
    plan_text += "\nstep arena of the compiled executor (" + std::to_string(layout->arena_bytes) + " B)\n" +
                 passes::format_buffer_offsets(*layout);
  }
  KILN_RETURN_IF_ERROR(write_file(dir / "memory_plan.txt", plan_text));

  // Link with the system linker (through the C++ compiler driver, for libstdc++ and crt).
  KILN_ASSIGN_OR_RETURN(auto inputs, link_inputs());
  const char* cxx = std::getenv("CXX");
  std::string cmd = shell_quote(cxx && *cxx ? cxx : "c++") + " -o " + shell_quote((dir / "train").string());
  for (auto& o : objects) cmd += " " + shell_quote(o.string());
  for (auto& i : inputs) cmd += " " + shell_quote(i);
  const fs::path log = dir / "link.log";
  KILN_RETURN_IF_ERROR(write_file(log, cmd + "\n"));
  const auto t_link = clock::now();
  const int rc = std::system((cmd + " >> " + shell_quote(log.string()) + " 2>&1").c_str());
  const double link_s = since(t_link);
  if (rc != 0) return Status::error("linking " + (dir / "train").string() + " failed (see " + log.string() + ")");

  // Report.
  double passes_s = 0;
  for (auto& [name, s] : dbg.pass_seconds)
    if (name != "fusion") passes_s += s;
  nlohmann::json cats = nlohmann::json::object();
  for (int c = 0; c < passes::kNumMemoryCategories; ++c)
    cats[passes::memory_category_name(static_cast<passes::MemoryCategory>(c))] = plan->at_peak[c];
  nlohmann::json progs = nlohmann::json::object();
  for (auto& [which, r] : reports)
    progs[which] = {{"kernels", r.kernels},
                    {"unique_functions", r.unique},
                    {"fused_ops", r.fused_ops},
                    {"top_level_nodes", r.top_level_nodes},
                    {"compile_cache", r.cache}};
  const double total_s = since(t_all);
  nlohmann::json report = {{"model", cfg.model},
                           {"kiln_version", KILN_VERSION},
                           {"cpu", codegen::host_cpu_description()},
                           {"binary", (dir / "train").string()},
                           {"binary_bytes", static_cast<int64_t>(fs::file_size(dir / "train", ec))},
                           {"optimizer_steps", total},
                           {"seconds",
                            {{"passes", passes_s},
                             {"fusion", dbg.pass_seconds.count("fusion") ? dbg.pass_seconds.at("fusion") : 0.0},
                             {"lower_to_kernel_ir", lower_s},
                             {"llvm_ir", emit_s},
                             {"llvm_o3", opt_s},
                             {"machine_code", mc_s},
                             {"build_program_total", build_s},
                             {"link", link_s},
                             {"total", total_s}}},
                           {"programs", progs},
                           {"planned_peak_bytes", plan->peak_bytes},
                           {"planned_peak_bytes_by_category", cats}};
  KILN_RETURN_IF_ERROR(write_file(dir / "compile_report.json", report.dump(2) + "\n"));

  char line[512];
  std::snprintf(line, sizeof line, "compiled %s: %d train + %d eval kernels in %s (program %s, link %s)\n",
                (dir / "train").string().c_str(), reports["train"].kernels,
                reports.count("eval") ? reports["eval"].kernels : 0, runtime::format_time(total_s).c_str(),
                runtime::format_time(build_s).c_str(), runtime::format_time(link_s).c_str());
  out << line << "wrote " << (dir / "ir").string() << "/, " << (dir / "kernels").string() << "/, "
      << (dir / "memory_plan.txt").string() << ", " << (dir / "compile_report.json").string() << "\n";
  return Status::ok();
}

}  // namespace kiln::driver
