// Running a fused graph with its generated CPU kernels, for the codegen tests.
#pragma once
#include <map>
#include <memory>
#include <string>

#include "codegen/cpu/program.h"
#include "runtime/interpreter.h"

namespace kiln::testing {

/// The outputs of `fused` (a graph after the fusion pass) run by the executor with its
/// FusedKernels compiled by codegen::compile_graph_cpu; the program goes to `prog` when
/// given (for checks on its kernels). Errors: compile_graph_cpu's or run_graph's.
inline Expected<std::map<std::string, ir::Tensor>> run_compiled(const ir::Graph& fused,
                                                                const std::map<std::string, ir::Tensor>& feeds,
                                                                std::shared_ptr<codegen::CpuProgram>* prog = nullptr) {
  auto p = codegen::compile_graph_cpu(fused);
  if (!p) return p.status();
  runtime::RunOptions ro;
  ro.program = p->get();
  auto out = runtime::run_graph(fused, feeds, ro);
  if (prog) *prog = *p;
  return out;
}

}  // namespace kiln::testing
