// Runtime of the ahead-of-time training binary; see aot_kernels.h.
#include "tools/aot/aot_kernels.h"

#include <cstdint>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "codegen/lower.h"
#include "tools/aot/aot_manifest.h"

// Defined by the data object that `kiln compile` links into the binary
// (codegen::emit_aot_data_object): the manifest JSON, the model, the kernel table.
extern "C" {
extern const char kiln_aot_manifest[];
extern const int64_t kiln_aot_manifest_size;
extern const char kiln_aot_model[];
extern const int64_t kiln_aot_model_size;
extern void* const kiln_aot_fns[];
extern const int64_t kiln_aot_fns_count;

/// Integer power the generated kernels call (as the JIT provides it in kiln itself).
int64_t kiln_cpu_ipow(int64_t base, int64_t e) { return kiln::codegen::ipow_wrapping(base, e); }
}

namespace kiln::aot {

namespace {

/// A program whose kernels live in the binary: it owns their CpuKernel records.
struct AotProgram : codegen::CpuProgram {
  std::vector<codegen::CpuKernel> table;
};

nlohmann::json& manifest() {
  static nlohmann::json m;
  return m;
}
}  // namespace

Status load_embedded() {
  if (kiln_aot_manifest_size <= 0) return Status::error("this binary holds no kiln manifest (a broken link?)");
  try {
    manifest() = nlohmann::json::parse(std::string(kiln_aot_manifest, static_cast<size_t>(kiln_aot_manifest_size)));
  } catch (const std::exception& e) {
    return Status::error(std::string("the binary's manifest is not valid JSON: ") + e.what());
  }
  const auto& m = manifest();
  if (!m.is_object() || m.value("format", 0) != kManifestFormat)
    return Status::error("the binary's manifest has format " + (m.is_object() ? m.value("format", nlohmann::json()).dump() : std::string("?")) +
                         ", this runtime reads format " + std::to_string(kManifestFormat));
  if (!m.contains("config") || !m.contains("programs"))
    return Status::error("the binary's manifest has no config or programs");
  return Status::ok();
}

Expected<runtime::TrainConfig> embedded_config() {
  runtime::TrainConfig cfg;
  KILN_RETURN_IF_ERROR(runtime::config_from_json_text(manifest()["config"].dump(), "the binary's manifest", cfg));
  return cfg;
}

std::string_view embedded_model() { return {kiln_aot_model, static_cast<size_t>(kiln_aot_model_size)}; }

Status check_cpu() {
  const std::string feats = manifest().value("cpu", std::string());
  std::string missing;
  auto need = [&](const char* llvm_name, bool have) {
    if (feats.find(std::string("+") + llvm_name + ",") == std::string::npos &&
        !(feats.size() >= std::string(llvm_name).size() + 1 && feats.ends_with(std::string("+") + llvm_name)))
      return;
    if (!have) missing += (missing.empty() ? "" : ", ") + std::string(llvm_name);
  };
#if defined(__x86_64__)
  __builtin_cpu_init();
  need("sse4.2", __builtin_cpu_supports("sse4.2"));
  need("avx", __builtin_cpu_supports("avx"));
  need("avx2", __builtin_cpu_supports("avx2"));
  need("fma", __builtin_cpu_supports("fma"));
  need("avx512f", __builtin_cpu_supports("avx512f"));
  need("avx512bw", __builtin_cpu_supports("avx512bw"));
  need("avx512dq", __builtin_cpu_supports("avx512dq"));
  need("avx512vl", __builtin_cpu_supports("avx512vl"));
  need("avx512bf16", __builtin_cpu_supports("avx512bf16"));
#endif
  if (!missing.empty())
    return Status::error("this binary's kernels were compiled for a CPU with " + missing +
                         ", which this CPU lacks; run kiln compile on this machine");
  return Status::ok();
}

Expected<std::shared_ptr<codegen::CpuProgram>> aot_program(const ir::Graph& g, const std::string& which) {
  auto prog = std::make_shared<AotProgram>();
  prog->cache_status = "linked ahead of time";
  const auto& programs = manifest()["programs"];
  std::map<std::string, const nlohmann::json*> by_node;
  if (programs.contains(which))
    for (const auto& k : programs[which]) by_node[k.value("node", std::string())] = &k;
  std::vector<const ir::Node*> nodes = codegen::fused_nodes(g);
  prog->table.reserve(nodes.size());
  int mismatched = 0;
  for (const ir::Node* n : nodes) {
    KILN_ASSIGN_OR_RETURN(codegen::Kernel k, codegen::lower_fused(*n));
    auto it = by_node.find(n->name);
    const std::string fp = kernel_fingerprint(k);
    prog->kernels.push_back(std::move(k));
    if (it == by_node.end() || it->second->value("fingerprint", std::string()) != fp) {
      ++mismatched;
      continue;
    }
    const nlohmann::json& e = *it->second;
    const int64_t fn = e.value("fn", int64_t(-1));
    if (fn < 0 || fn >= kiln_aot_fns_count)
      return Status::error("the binary's manifest names function " + std::to_string(fn) + " for kernel '" + n->name +
                           "'; the table has " + std::to_string(kiln_aot_fns_count));
    codegen::CpuKernel ck;
    ck.name = n->name;
    ck.fn = reinterpret_cast<codegen::CpuKernelFn>(kiln_aot_fns[fn]);
    ck.parallel_dim = e.value("parallel_dim", -1);
    ck.parallel_extent = e.value("parallel_extent", int64_t(1));
    ck.work_per_index = e.value("work_per_index", int64_t(1));
    ck.split_parts = e.value("split_parts", int64_t(0));
    ck.scratch_bytes = e.value("scratch_bytes", int64_t(0));
    prog->table.push_back(ck);
  }
  // by_node points into table: fill it once the table no longer grows.
  for (const codegen::CpuKernel& ck : prog->table) prog->by_node[ck.name] = &ck;
  if (mismatched > 0)
    std::cerr << "train: note: " << mismatched << " of " << nodes.size() << " " << which
              << " kernels differ from the ones compiled into this binary (a run-time flag such as --max_steps changed "
                 "a constant); they run op by op\n";
  return std::shared_ptr<codegen::CpuProgram>(std::move(prog));
}

}  // namespace kiln::aot
