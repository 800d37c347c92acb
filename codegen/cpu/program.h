// A graph's generated CPU kernels: every FusedKernel node lowered to kernel IR
// (codegen/lower.h) and compiled into one LLVM ORC module (codegen/cpu/llvm_cpu.h).
// The executor (runtime/interpreter.cpp, RunOptions::program) runs each FusedKernel
// node through its kernel; the rest of the program runs as library steps.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/kernel_ir.h"
#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::codegen {

/// The compiled kernels of one graph, keyed by FusedKernel node name (names are unique
/// in a program, so a clone of the graph, as the trainer's eval copy, finds them too).
struct CpuProgram {
  std::unique_ptr<CpuModule> module;
  std::vector<Kernel> kernels;  ///< kernel IR, in schedule order (before collapse_dims)
  std::unordered_map<std::string, const CpuKernel*> by_node;
  double lower_s = 0;           ///< seconds spent lowering to kernel IR
  /// Kernel for a FusedKernel node, or nullptr.
  const CpuKernel* find(const ir::Node* n) const {
    auto it = by_node.find(n->name);
    return it == by_node.end() ? nullptr : it->second;
  }
};

/// Lowers and compiles every FusedKernel node of `g` (loop bodies included). A graph
/// with no fused node gives an empty program. Errors name the node or kernel.
Expected<std::shared_ptr<CpuProgram>> compile_graph_cpu(const ir::Graph& g);

}  // namespace kiln::codegen
