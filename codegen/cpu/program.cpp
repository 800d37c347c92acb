// Compiles every FusedKernel node of a graph; see program.h.
#include "codegen/cpu/program.h"

#include <chrono>

#include "codegen/lower.h"

namespace kiln::codegen {

Expected<std::shared_ptr<CpuProgram>> compile_graph_cpu(const ir::Graph& g) {
  auto prog = std::make_shared<CpuProgram>();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<const ir::Node*> nodes = fused_nodes(g);
  for (const ir::Node* n : nodes) {
    KILN_ASSIGN_OR_RETURN(Kernel k, lower_fused(*n));
    prog->kernels.push_back(std::move(k));
  }
  prog->lower_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (nodes.empty()) return prog;
  KILN_ASSIGN_OR_RETURN(prog->module, compile_cpu(prog->kernels));
  const auto& ks = prog->module->kernels();
  if (ks.size() != nodes.size()) return Status::error("compile_cpu returned a wrong number of kernels");
  for (size_t i = 0; i < nodes.size(); ++i) prog->by_node[nodes[i]->name] = &ks[i];
  return prog;
}

}  // namespace kiln::codegen
