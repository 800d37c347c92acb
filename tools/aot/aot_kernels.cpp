// Runtime of the ahead-of-time training binary; see aot_kernels.h.
#include "tools/aot/aot_kernels.h"

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>

#include "codegen/kernel_ir.h"
#include "tools/aot/aot_manifest.h"

// Defined by the data object that `kiln compile` links into the binary
// (codegen::emit_aot_data_object): the manifest JSON, the program file, the kernel table.
extern "C" {
extern const char kiln_aot_manifest[];
extern const int64_t kiln_aot_manifest_size;
extern const char kiln_aot_program[];
extern const int64_t kiln_aot_program_size;
extern void* const kiln_aot_fns[];
extern const int64_t kiln_aot_fns_count;

/// Integer power the generated kernels call (as the JIT provides it in kiln itself).
int64_t kiln_cpu_ipow(int64_t base, int64_t e) { return kiln::codegen::ipow_wrapping(base, e); }
}

namespace kiln::aot {

namespace {

/// Kernels whose code is linked into the binary: owns their CpuKernel records.
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
    return Status::error("the binary's manifest has format " +
                         (m.is_object() ? m.value("format", nlohmann::json()).dump() : std::string("?")) +
                         ", this runtime reads format " + std::to_string(kManifestFormat));
  if (!m.contains("symbols") || !m["symbols"].is_array()) return Status::error("the binary's manifest has no symbols");
  if (static_cast<int64_t>(m["symbols"].size()) != kiln_aot_fns_count)
    return Status::error("the binary's manifest names " + std::to_string(m["symbols"].size()) +
                         " kernel functions; its table has " + std::to_string(kiln_aot_fns_count));
  return Status::ok();
}

std::string_view embedded_program() { return {kiln_aot_program, static_cast<size_t>(kiln_aot_program_size)}; }

runtime::KernelBinder kernel_binder() {
  return [](const std::string& which, codegen::CpuObject obj) -> Expected<std::shared_ptr<codegen::CpuProgram>> {
    std::map<std::string, int64_t> index;
    const auto& syms = manifest()["symbols"];
    for (size_t i = 0; i < syms.size(); ++i) index[syms[i].get<std::string>()] = static_cast<int64_t>(i);
    auto prog = std::make_shared<AotProgram>();
    prog->cache_status = "linked ahead of time";
    prog->table.reserve(obj.kernels.size());
    for (size_t i = 0; i < obj.kernels.size(); ++i) {
      auto it = index.find(i < obj.symbols.size() ? obj.symbols[i] : std::string());
      if (it == index.end())
        return Status::error(which + " kernel '" + obj.kernels[i].name + "': this binary does not hold its function " +
                             (i < obj.symbols.size() ? obj.symbols[i] : std::string("?")));
      codegen::CpuKernel ck = obj.kernels[i];
      ck.fn = reinterpret_cast<codegen::CpuKernelFn>(kiln_aot_fns[it->second]);
      prog->table.push_back(ck);
    }
    // by_node points into table: filled once the table no longer grows.
    for (const codegen::CpuKernel& ck : prog->table) prog->by_node[ck.name] = &ck;
    return std::shared_ptr<codegen::CpuProgram>(std::move(prog));
  };
}

}  // namespace kiln::aot
