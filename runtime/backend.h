// Backends: the executor runs a program's graphs on a device through one interface, as
// tinygrad's Runner and ONNX Runtime's execution providers do. A backend owns its
// device's buffers (ir::Tensor storage carries its ir::Device), prepares a graph once
// (load: the executor's per-node facts, kernels, arena, device modules) and runs it many
// times (run). Backends of this file:
//   "eager"     the reference (DESIGN.md convention 8): every node's op-table eager kernel,
//               one allocation per result; kernels and arenas of the program are ignored.
//   "compiled"  host CPU: the program's generated LLVM kernels (codegen::CpuProgram),
//               library calls (oneDNN) and its planned step arena (runtime/arena.h).
// Other devices register a factory (register_backend): runtime/cuda/cuda_backend.h adds
// "cuda" where kiln is built with the CUDA toolkit and a caller registers it.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cpu/program.h"
#include "ir/graph.h"
#include "ir/status.h"
#include "ir/tensor.h"
#include "runtime/arena.h"
#include "runtime/interpreter.h"

namespace kiln::runtime {

/// The parts of a compiled program a backend runs one graph with (null: none; a backend
/// that has no use for a part ignores it). They must outlive the executables loaded with them.
struct ProgramParts {
  const codegen::CpuProgram* cpu_kernels = nullptr;  ///< generated CPU kernels of the graph's FusedKernel nodes
  const StepArena* arena = nullptr;                  ///< the graph's step arena (offsets written by arena_plan)
};

/// A graph prepared by one backend for repeated runs. The graph (and the ProgramParts it
/// was loaded with) must outlive it and must not change while it lives.
class Executable {
 public:
  virtual ~Executable() = default;
  virtual const ir::Graph& graph() const = 0;
};

/// One device's executor.
class Backend {
 public:
  virtual ~Backend() = default;
  /// The name make_backend takes: "eager", "compiled", "cuda".
  virtual std::string name() const = 0;
  /// The device whose buffers this backend allocates, reads and writes.
  virtual ir::Device device() const = 0;
  /// A zero-filled buffer of `dtype` and `dims` on this device. Errors: out of memory
  /// (naming the bytes).
  virtual Expected<ir::Tensor> zeros(ir::DType dtype, const std::vector<int64_t>& dims) = 0;
  /// Copies a host tensor to this device (host backends return it, sharing its storage).
  /// Errors: a tensor of another non-host device.
  virtual Expected<ir::Tensor> to_device(const ir::Tensor& host) = 0;
  /// Copies a tensor of this device to host memory (host backends return it).
  virtual Expected<ir::Tensor> to_host(const ir::Tensor& t) = 0;
  /// Prepares `g` with `parts` for runs. Errors: a node this backend cannot run, named
  /// with its op ("node 'n' (MatMul): ...").
  virtual Expected<std::unique_ptr<Executable>> load(const ir::Graph& g, const ProgramParts& parts) = 0;
  /// Runs an executable this backend loaded. `feeds`: graph input name -> tensor on this
  /// device or on the host (a tensor on another device is refused, naming the input and
  /// both devices). Results are on this device. `opts` as run_graph's; its program, arena
  /// and schedule fields are the executable's (values set by the caller are ignored).
  /// Errors: as run_graph's (the node and op at fault, a missing or mismatched input).
  virtual Expected<std::map<std::string, ir::Tensor>> run(Executable& e, const std::map<std::string, ir::Tensor>& feeds,
                                                          const RunOptions& opts = {}) = 0;
  /// run by position (run_graph_positional): feeds[i] is the graph's input i (undefined:
  /// its default, or streamed), the result its outputs in order; no name is looked up on
  /// the way (the trainer's step). This default goes through `run` by name.
  virtual Expected<std::vector<ir::Tensor>> run_positional(Executable& e, const std::vector<ir::Tensor>& feeds,
                                                           const RunOptions& opts = {}) {
    const ir::Graph& g = e.graph();
    std::map<std::string, ir::Tensor> named;
    for (size_t i = 0; i < feeds.size() && i < g.inputs.size(); ++i)
      if (feeds[i].defined()) named[g.inputs[i]->name] = feeds[i];
    auto outs = run(e, named, opts);
    if (!outs) return outs.status();
    std::vector<ir::Tensor> r;
    for (const ir::Value* o : g.outputs) {
      auto it = outs->find(o->name);
      if (it == outs->end()) return Status::error("graph output '" + o->name + "' was not computed");
      r.push_back(it->second);
    }
    return r;
  }
};

/// Makes a backend of each call. Errors: its device cannot be opened (the backend's own line).
using BackendFactory = std::function<Expected<std::unique_ptr<Backend>>()>;

/// Adds (or replaces) the backend `name` for make_backend. Thread-safe.
void register_backend(const std::string& name, BackendFactory factory);

/// Names make_backend accepts now, sorted ("compiled", "eager", and the registered ones).
std::vector<std::string> backend_names();

/// The backend named `name`. Errors: "unknown backend 'x' (known: compiled, eager)";
/// a device that cannot be opened ("no CUDA device: ...").
Expected<std::unique_ptr<Backend>> make_backend(const std::string& name);

}  // namespace kiln::runtime
