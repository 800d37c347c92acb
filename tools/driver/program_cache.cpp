// The whole-program cache; see program_cache.h.
#include "tools/driver/program_cache.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/cpu/program.h"
#include "frontend/model_bytes.h"
#include "runtime/data.h"
#include "runtime/io.h"
#include "tools/driver/logs.h"

#ifndef KILN_VERSION
#define KILN_VERSION "0.1.0"
#endif

namespace kiln::driver {

namespace fs = std::filesystem;

const char* kiln_version() { return KILN_VERSION; }

namespace {

/// A program whose kernels were JIT-linked from its file: owns the module.
Expected<std::shared_ptr<codegen::CpuProgram>> jit_bind(const std::string& which, codegen::CpuObject obj) {
  (void)which;
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<codegen::CpuModule> mod, codegen::load_cpu_object(obj));
  auto prog = std::make_shared<codegen::CpuProgram>();
  prog->module = std::shared_ptr<codegen::CpuModule>(std::move(mod));
  const auto& ks = prog->module->kernels();
  if (ks.size() != obj.kernels.size()) return Status::error("the object has a different kernel count (internal)");
  for (size_t i = 0; i < ks.size(); ++i) prog->by_node[obj.kernels[i].name] = &ks[i];
  prog->object = std::make_shared<const codegen::CpuObject>(std::move(obj));
  prog->cache_status = "program file";
  return prog;
}

/// TrainConfig fields that never change the program: read by the trainer per run.
const std::vector<std::string>& per_run_fields() {
  static const std::vector<std::string> f = {"train_data", "eval_data", "output_dir", "num_train_epochs", "max_steps",
                                             "seed", "logging_steps", "eval_steps", "save_steps", "save_total_limit",
                                             "resume_from_checkpoint", "overwrite_output_dir", "cache_dir", "no_cache",
                                             "disable_tqdm", "report_to", "logging_dir",
                                             // variable-length data: each padded length is
                                             // its own program, keyed by its --shape binding
                                             "pad_token_id", "max_length", "shape_mode", "shape_buckets",
                                             "recompile_limit", "group_by_length", "dataloader_drop_last"};
  return f;
}

std::string cache_root(const runtime::TrainConfig& cfg) {
  return cfg.cache_dir.empty() ? codegen::default_cache_dir() : cfg.cache_dir;
}

void warn(const std::string& line) { std::cerr << "kiln: warning: " << line << "\n"; }

}  // namespace

runtime::KernelBinder jit_kernel_binder() { return jit_bind; }

Expected<std::string> program_cache_key(const runtime::TrainConfig& cfg) {
  KILN_ASSIGN_OR_RETURN(std::string model, frontend::read_model_bytes(cfg.model));
  nlohmann::json key;
  key["format"] = runtime::kProgramFormatVersion;
  key["kiln"] = KILN_VERSION;
  key["build"] = codegen::kiln_build_id();
  key["cpu"] = codegen::host_cpu_description();
  key["model"] = runtime::sha256_hex(model);
  // External data next to the model (torch.onnx writes MODEL.onnx.data): a changed data
  // file changes the key through its size and modification time.
  std::error_code ec;
  const fs::path model_path(cfg.model);
  nlohmann::json ext = nlohmann::json::array();
  if (fs::exists(model_path, ec)) {
    const fs::path dir = model_path.parent_path().empty() ? fs::path(".") : model_path.parent_path();
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name == model_path.filename().string() || !it->is_regular_file(ec)) continue;
      if (model.find(name) == std::string::npos) continue;  // not named by the model
      ext.push_back({name, static_cast<int64_t>(it->file_size(ec)),
                     static_cast<int64_t>(it->last_write_time(ec).time_since_epoch().count())});
    }
  }
  std::sort(ext.begin(), ext.end());
  key["external_data"] = ext;
  nlohmann::json c = nlohmann::json::parse(runtime::config_to_json(cfg));
  for (const std::string& f : per_run_fields()) c.erase(f);
  c.erase("model");
  key["config"] = c;
  key["world_size"] = cfg.world_size;  // not a config field: the launcher's (passes/data_parallel.cpp)
  key["token_data"] = runtime::is_token_file(cfg.train_data);
  key["eval_data"] = !cfg.eval_data.empty();
  // --shape_mode symbolic on variable-length data builds another program (its sequence
  // dim, and its batch dim without accumulation, left symbols), checked and planned at
  // --max_length (issue 32).
  if (cfg.shape_mode == "symbolic" && runtime::is_sequence_data(cfg.train_data)) key["symbolic_bound"] = cfg.max_length;
  // Symbolic dims are bound from the .npy files' shapes (driver.cpp's batch_bindings):
  // each file's dims past its rows are part of the key, the row count is not.
  nlohmann::json shapes = nlohmann::json::array();
  for (const auto* list : {&cfg.train_data, &cfg.eval_data})
    for (const std::string& spec : *list) {
      const size_t eq = spec.find('=');
      if (eq == std::string::npos) continue;
      auto dims = runtime::io::npy_shape(spec.substr(eq + 1));
      if (!dims) continue;  // the data loader refuses it with its own line
      if (!dims->empty()) dims->erase(dims->begin());
      shapes.push_back({list == &cfg.train_data ? "train" : "eval", spec.substr(0, eq), *dims});
    }
  key["data_shapes"] = shapes;
  return runtime::sha256_hex(key.dump());
}

std::string program_cache_path(const runtime::TrainConfig& cfg, const std::string& key) {
  return (fs::path(cache_root(cfg)) / "programs" / (key + ".kiln")).string();
}

std::optional<runtime::Program> load_cached_program(const runtime::TrainConfig& cfg, const passes::PassContext* dbg) {
  if (cfg.no_cache) return std::nullopt;
  if (dbg && (!dbg->print_ir_after.empty() || !dbg->dump_ir_dir.empty() || dbg->verify_each || dbg->time_passes ||
              dbg->stop_after > 0))
    return std::nullopt;  // the user asked to see the passes run, or to cut them short
  if (log_enabled("graph") || log_enabled("fusion") || log_enabled("output_code") || log_enabled("memory"))
    return std::nullopt;  // and these topics print what the passes build
  auto key = program_cache_key(cfg);
  if (!key) return std::nullopt;
  const std::string path = program_cache_path(cfg, *key);
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    log_text("cache", "program cache miss: " + path);
    return std::nullopt;
  }
  auto bytes = runtime::read_file_bytes(path);
  if (!bytes) {
    warn("program cache: " + bytes.message() + "; rebuilding it");
    return std::nullopt;
  }
  auto p = runtime::deserialize_program(*bytes, path, jit_bind);
  if (!p) {
    warn("program cache: " + p.message() + "; rebuilding it");
    return std::nullopt;
  }
  fs::last_write_time(path, fs::file_time_type::clock::now(), ec);  // recently used
  log_text("cache", "program cache hit: " + path + " (no import, no pass, no code generation)");
  return std::move(*p);
}

void store_cached_program(const runtime::TrainConfig& cfg, const runtime::Program& p, const passes::PassContext* dbg) {
  if (cfg.no_cache) return;
  if (dbg && dbg->stop_after > 0) return;  // not the whole pipeline's program: never under its key
  auto key = program_cache_key(cfg);
  if (!key) return;
  runtime::ProgramFileInfo info;
  info.kiln_version = KILN_VERSION;
  info.cpu = codegen::host_cpu_description();
  info.config_json = runtime::config_to_json(cfg);
  auto bytes = runtime::serialize_program(p, info);
  if (!bytes) {
    warn("program cache: not stored: " + bytes.message());
    return;
  }
  if (static_cast<int64_t>(bytes->size()) > kProgramCacheBytes / 4) {
    log_text("cache",
             "program cache: not stored (" + std::to_string(bytes->size()) + " bytes, over a quarter of the cache)");
    return;
  }
  const fs::path path = program_cache_path(cfg, *key);
  if (std::string err = codegen::write_cache_file(path.string(), *bytes); !err.empty()) {
    warn("program cache: " + err);
    return;
  }
  log_text("cache", "program cache store: " + path.string());
  codegen::prune_cache_files(path.parent_path().string(), ".kiln", kProgramCacheBytes, path.string());
}

}  // namespace kiln::driver
